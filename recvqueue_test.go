package knet

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"
)

// A payload handed over in its own buffer sits among arena payloads: the
// byte count, reads across messages, partial reads and take all see the
// messages in order, and take gives the buffer itself away.
func TestRecvQueueOwnedAmongArena(t *testing.T) {
	var q recvQueue
	big := func(c byte, n int) ([]byte, *[]byte) {
		b := getPayload(n)
		*b = append((*b)[:0], bytes.Repeat([]byte{c}, n)...)
		return *b, b
	}
	q.push(StreamMessageID, []byte("ab"), true, true)
	p, b := big('x', 100)
	q.pushOwned(StreamMessageID, p, b, true, true)
	q.push(StreamMessageID, []byte("cd"), true, true)
	p2, b2 := big('y', 50)
	q.pushOwned(9, p2, b2, true, false)
	require.Equal(t, 4, q.len())
	require.Equal(t, 154, q.used())

	// A stream read across the first arena message and into the owned one.
	buf := make([]byte, 30)
	require.Equal(t, 30, q.read(buf, StreamMessageID))
	require.Equal(t, "ab"+string(bytes.Repeat([]byte{'x'}, 28)), string(buf))
	require.Equal(t, 124, q.used())
	require.Equal(t, 3, q.len())

	// The rest of the owned one, then the arena one after it.
	buf = make([]byte, 74)
	require.Equal(t, 74, q.read(buf, StreamMessageID))
	require.Equal(t, string(bytes.Repeat([]byte{'x'}, 72))+"cd", string(buf))
	require.Equal(t, 50, q.used())

	// take hands the owned buffer over.
	e := q.peek()
	require.Equal(t, uint32(9), e.id)
	got := q.take(e)
	require.Equal(t, bytes.Repeat([]byte{'y'}, 50), got)
	require.Same(t, &(*b2)[0], &got[0])
	require.Equal(t, 0, q.len())
	require.Equal(t, 0, q.used())

	// The queue starts over cleanly.
	q.push(10, []byte("ef"), true, true)
	require.Equal(t, "ef", string(q.take(q.peek())))
	require.Equal(t, 0, q.used())
}

// Arena compaction moves arena payloads only, not those in their own
// buffers.
func TestRecvQueueCompactKeepsOwned(t *testing.T) {
	var q recvQueue
	filler := bytes.Repeat([]byte{'f'}, 80<<10)
	q.push(6, filler, true, true)
	b := getPayload(10)
	*b = append((*b)[:0], "0123456789"...)
	q.pushOwned(7, *b, b, true, true)
	q.push(8, []byte("tail"), true, true)
	require.Equal(t, filler, q.take(q.peek()))
	q.push(9, []byte("more"), true, true) // compacts: start > 64 KiB, over half
	require.Equal(t, "0123456789", string(q.take(q.peek())))
	require.Equal(t, "tail", string(q.take(q.peek())))
	require.Equal(t, "more", string(q.take(q.peek())))
	require.Equal(t, 0, q.used())
}

// Entries keep no pointer: the buffers of those that have their own wait
// beside them in order, and those read are let go even when the queue
// never empties.
func TestRecvQueueOwnedNeverEmpty(t *testing.T) {
	var q recvQueue
	q.push(5, []byte("first"), true, true)
	for i := range 1000 {
		b := getPayload(70000)
		*b = append((*b)[:0], bytes.Repeat([]byte{byte(i)}, 70000)...)
		q.pushOwned(uint32(6+i), *b, b, true, true)
		q.push(uint32(6+i), []byte{byte(i)}, true, true)
		// The message before: "first", then the last one pushed.
		q.pop()
		e := q.peek()
		require.Equal(t, uint32(6+i), e.id)
		require.Equal(t, bytes.Repeat([]byte{byte(i)}, 70000), q.bytes(e))
		q.pop()
		require.Equal(t, []byte{byte(i)}, q.bytes(q.peek()))
		require.Less(t, len(q.bufs.b), 200, "read buffers kept")
	}
	require.Equal(t, 1, q.len())
	require.Equal(t, 1, q.used())
}
