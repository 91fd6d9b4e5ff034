package knet

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestSentWindow(t *testing.T) {
	var w sentWindow
	now := timeZero
	for i := range uint32(40) {
		id := (packetIDMask - 10 + 2*i) & packetIDMask // every other PacketID, across the wrap
		w.push(now.Add(time.Duration(i)*time.Millisecond), id, []byte{byte(i)})
	}
	require.Equal(t, 40, w.count)
	find := func(id uint32) *sent { d, _ := w.find(id); return d }
	assert.Nil(t, find(packetIDMask-9), "unreliable PacketID in between")
	d := find(packetIDMask - 10 + 2*5)
	require.NotNil(t, d)
	assert.Equal(t, []byte{5}, d.b)
	w.ack(d, false)
	assert.Nil(t, find(d.packetID), "acked")
	assert.Equal(t, 39, w.count)
	first := w.firstUnacked()
	w.ack(first, false)
	var released int
	w.trim(func(*sent) { released++ })
	assert.Equal(t, 1, released, "only the front is trimmed; the middle waits")
	assert.Equal(t, uint32(packetIDMask-8), w.firstUnacked().packetID)
	// Time order: resending moves a datagram to the newest end.
	old := w.oldest
	w.resent(now.Add(time.Second), old)
	assert.Same(t, old, w.newest)
	assert.Equal(t, 2, old.sends)
}

// A datagram resent under a new PacketID (the reference dialect) moves to
// the newest end; an ack of either PacketID reaches it, the old one
// marked as for an earlier send; the stand-in goes with the front.
func TestSentWindowRekey(t *testing.T) {
	var w sentWindow
	now := timeZero
	for i := range uint32(4) {
		w.push(now, 10+i, []byte{byte(i)})
	}
	d, _ := w.find(11)
	w.rekey(d, 20)
	w.resent(now, d)
	assert.Equal(t, uint32(20), d.packetID)
	assert.Equal(t, 4, w.count, "still four unacked")
	got, through := w.find(20)
	assert.Same(t, d, got)
	assert.False(t, through)
	got, through = w.find(11)
	assert.Same(t, d, got, "a late ack of the first send")
	assert.True(t, through)
	w.ack(d, through)
	got, _ = w.find(11)
	assert.Nil(t, got, "acked: nothing left to reach")
	for _, id := range []uint32{10, 12} {
		x, _ := w.find(id)
		w.ack(x, false)
	}
	w.trim(nil)
	assert.Equal(t, uint32(13), w.firstUnacked().packetID, "the stand-in trimmed with the acked front")
	x, _ := w.find(13)
	w.ack(x, false)
	w.trim(nil)
	assert.Nil(t, w.firstUnacked())
	assert.Equal(t, 0, w.count)
}

// search finds the first entry at or after a PacketID, across the wrap,
// with the PacketIDs in between taken by others (unreliable datagrams,
// skipped ones).
func TestSentWindowSearch(t *testing.T) {
	var w sentWindow
	assert.Equal(t, 0, w.search(5), "empty")
	start := uint32(packetIDMask - 20)
	for i := range uint32(30) {
		w.push(timeZero, (start+3*i)&packetIDMask, nil)
	}
	for k := range w.n {
		id := w.at(k).packetID
		assert.Equal(t, k, w.search(id), "PacketID %d", id)
		assert.Equal(t, k, w.index(id))
		assert.Equal(t, k+1, w.search((id+1)&packetIDMask), "after PacketID %d", id)
		assert.Equal(t, -1, w.index((id+1)&packetIDMask))
		assert.Equal(t, k, w.search((id-2)&packetIDMask), "before PacketID %d", id)
	}
	assert.Equal(t, 0, w.search((start-1000)&packetIDMask), "before the first")
	assert.Equal(t, w.n, w.search((start+1000)&packetIDMask), "after the last")
}
