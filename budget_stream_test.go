//go:build !js

package knet

import (
	"context"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/coder/websocket"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Over TCP and WebSocket: streams that each leave a frame unfinished (its
// size field announcing 16 MiB, then 9 MiB of it, more than the whole
// budget) are bounded by the budget together (the framer holds up to
// MaxMessageSize each): once it is spent those over their share are not
// read, then closed with the reason, a few at a time (those left then take
// the room they left, until they spend it in turn); an honest client goes
// on meanwhile.
//
// Without the budget (ReceiveBudget 1<<40), the six held 54 MiB and none
// was closed.
func TestBudgetStreamPartialFrames(t *testing.T) {
	for _, tr := range []Transport{TransportTCP, TransportWebSocket} {
		t.Run(tr.String(), func(t *testing.T) { testBudgetStreamPartialFrames(t, tr) })
	}
}

// rawStream opens a stream to l over tr, for a peer that writes its
// bytes by hand: a TCP connection, or a WebSocket whose writes are each a
// binary message.
func rawStream(t *testing.T, l *Listener, tr Transport, url string) net.Conn {
	if tr == TransportTCP {
		return rawTCP(t, l)
	}
	ws, _, err := websocket.Dial(within(t, 5*time.Second), url, nil)
	require.NoError(t, err)
	nc := websocket.NetConn(context.Background(), ws, websocket.MessageBinary)
	t.Cleanup(func() { nc.Close() })
	return nc
}

func testBudgetStreamPartialFrames(t *testing.T, tr Transport) {
	const budget = 8 << 20
	cfg := attackConfig()
	cfg.ReceiveBudget = budget
	cfg.DatagramTimeout = 500 * time.Millisecond // a grace of 1s
	l := listen(t, cfg)
	url := wsServer(t, l)
	var honestGot atomic.Int32
	srv := serveAll(l, func(c *Conn, m Message) {
		if m.ID == 7 {
			honestGot.Add(1)
		}
	})

	const streams, sent = 6, 9 << 20
	frame := appendVLE32(nil, 16<<20) // the size field
	frame = append(frame, 6)          // the MessageID
	var writers sync.WaitGroup
	ncs := make([]net.Conn, streams)
	for i := range ncs {
		nc := rawStream(t, l, tr, url)
		_, err := nc.Write(knetHello(helloClient, nil))
		require.NoError(t, err)
		id, p := readFrame(t, nc, newTCPFramer(1<<20))
		kind, _, ok := parseStreamHello(p)
		require.True(t, ok && id == idPingReply && kind == helloAccept, "the server's accept")
		ncs[i] = nc
		writers.Go(func() {
			nc.SetWriteDeadline(time.Now().Add(30 * time.Second))
			nc.Write(frame)
			chunk := make([]byte, 32<<10)
			for range sent / len(chunk) { // until the server stops reading, then ends the stream
				if _, err := nc.Write(chunk); err != nil {
					return
				}
			}
		})
	}
	var honest *Conn
	var err error
	if tr == TransportTCP {
		honest, err = Dial(within(t, 5*time.Second), "tcp", l.Addr().String(), testConfig())
	} else {
		honest, err = DialWebSocket(within(t, 5*time.Second), url, testConfig())
	}
	require.NoError(t, err)
	defer honest.Close()
	const honestMessages = 200
	honestDone := make(chan error, 1)
	go func() {
		p := make([]byte, 1000)
		for range honestMessages {
			if err := honest.Send(Message{ID: 7, Payload: p, Reliable: true}); err != nil {
				honestDone <- err
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
		honestDone <- nil
	}()

	// Each raw stream hears the reason, then its end.
	peak := 0
	stopPeak := make(chan struct{})
	var sampler sync.WaitGroup
	sampler.Go(func() {
		for {
			peak = max(peak, l.Stats().ReceiveHeld)
			select {
			case <-stopPeak:
				return
			case <-time.After(5 * time.Millisecond):
			}
		}
	})
	for i, nc := range ncs {
		fr := newTCPFramer(1 << 20)
		var reason []byte
		nc.SetReadDeadline(time.Now().Add(30 * time.Second))
		buf := make([]byte, 4096)
	read:
		for {
			for {
				id, p, ok, err := fr.next()
				require.NoError(t, err)
				if !ok {
					break
				}
				if kind, content, ok := parseStreamHello(p); id == idPingReply && ok && kind == helloClose {
					reason = append([]byte(nil), content...)
				}
			}
			n, err := nc.Read(buf)
			fr.feed(buf[:n])
			if err != nil {
				break read
			}
		}
		assert.Equal(t, budgetReason, string(reason), "stream %d", i)
	}
	writers.Wait()
	require.NoError(t, <-honestDone)
	require.Eventually(t, func() bool { return honestGot.Load() == honestMessages }, 5*time.Second, 10*time.Millisecond, "every honest message arrives")
	close(stopPeak)
	sampler.Wait()
	st := l.Stats()
	t.Logf("budget %d KiB: peak held %d KiB; closed over budget %d", budget>>10, peak>>10, st.ClosedOverBudget)
	// The budget and its eighth, and for each stream what its reader
	// reads ahead and a step (budget.go).
	slack := budget/8 + streams*(streamInLimit+streamReadSize+maxBudgetStep)
	assert.LessOrEqual(t, peak, budget+slack, "held past the budget")
	assert.Greater(t, peak, budget*7/8, "the streams spent it")
	assert.Equal(t, uint64(streams), st.ClosedOverBudget)
	assert.NoError(t, honest.Err(), "the honest client goes on")
	require.NoError(t, honest.Close())
	l.Close()
	assert.Equal(t, streams, srv.overBudget(), "the server's streams end with ErrOverBudget")
}
