package knet

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestRecvWindowDuplicates(t *testing.T) {
	var w recvWindow
	assert.False(t, w.contains(10))
	w.add(10)
	assert.True(t, w.contains(10))
	assert.False(t, w.contains(11))
	assert.True(t, w.contains(9), "before the first datagram seen")
	for _, id := range []uint32{12, 15, 11} {
		w.add(id)
	}
	for _, id := range []uint32{10, 11, 12, 15} {
		assert.True(t, w.contains(id), "id %d", id)
	}
	for _, id := range []uint32{13, 14, 16, 1000} {
		assert.False(t, w.contains(id), "id %d", id)
	}
}

func TestRecvWindowWrap(t *testing.T) {
	var w recvWindow
	start := uint32(packetIDMask - 100)
	for i := range uint32(300) {
		id := (start + i) & packetIDMask
		if i%7 == 3 {
			continue // lost
		}
		require.False(t, w.contains(id), "i=%d", i)
		w.add(id)
	}
	for i := range uint32(300) {
		id := (start + i) & packetIDMask
		assert.Equal(t, i%7 != 3, w.contains(id), "i=%d", i)
	}
}

func TestRecvWindowHolesKeepItBounded(t *testing.T) {
	// Every other datagram lost, far past the span: the window keeps the
	// last recvSpan PacketIDs and no more.
	var w recvWindow
	for i := uint32(0); i < 4*recvSpan; i += 2 {
		w.add(i)
	}
	assert.LessOrEqual(t, int(w.n), recvWindowMaxWords+1)
	last := uint32(4*recvSpan - 2)
	assert.False(t, w.contains(last-1), "a recent hole is still a hole")
	assert.True(t, w.contains(last-recvSpan-1), "older than the span counts as seen")
}

func TestRecvWindowPlausible(t *testing.T) {
	var w recvWindow
	w.add(40000)
	assert.True(t, w.plausible(40000+recvSpan-1))
	assert.False(t, w.plausible(40000+recvSpan))
	assert.False(t, w.plausible(40000+1<<21))
	assert.True(t, w.plausible(40000-recvSpan+1))
	assert.False(t, w.plausible(40000-recvSpan))
}

func TestRecvWindowMatchesModel(t *testing.T) {
	t.Parallel()
	// Random arrival of a sliding range of PacketIDs against a set; with
	// a few PacketIDs never sent (skipped, skip.go), and late arrivals
	// far back.
	for _, skips := range []bool{false, true} {
		rng := rand.New(rand.NewPCG(1, 2))
		var w recvWindow
		seen := map[uint32]bool{}
		base := uint32(packetIDMask - 5000)
		w.add(base)
		seen[base] = true
		newest := base
		for range 200000 {
			id := (newest + uint32(rng.IntN(200)) - 150) & packetIDMask
			if skips && rng.IntN(50) == 0 {
				id = (newest - uint32(rng.IntN(recvSpan-64))) & packetIDMask
			}
			if seqDiff(newest, id) <= -recvSpan+64 || !w.plausible(id) {
				continue
			}
			require.Equal(t, seen[id] || seqLess(id, base), w.contains(id), "id %d", id)
			if skips && id%97 == 0 {
				continue // never sent
			}
			w.add(id)
			seen[id] = true
			if seqLess(newest, id) {
				newest = id
			}
		}
	}
}

// A hole now and then (a sender's skipped PacketIDs, skip.go; an
// unreliable datagram lost) goes to the list of old holes once the ring
// moves on: the ring stays a few words, the holes are still holes, one
// filled late is filled, and past recvSpan they count as arrived.
func TestRecvWindowOldHoles(t *testing.T) {
	var w recvWindow
	start := uint32(packetIDMask - 3000) // across the wrap
	hole := func(i uint32) bool { return i%500 == 77 }
	const n = 20000
	for i := range uint32(n) {
		if !hole(i) {
			w.add((start + i) & packetIDMask)
		}
	}
	assert.LessOrEqual(t, len(w.ring), 8, "the ring stays small")
	require.NotNil(t, w.old)
	assert.Len(t, w.old.ids, n/500)
	for i := range uint32(n) {
		assert.Equal(t, !hole(i), w.contains((start+i)&packetIDMask), "i=%d", i)
	}
	late := (start + 77 + 500*10) & packetIDMask
	w.add(late)
	assert.True(t, w.contains(late), "an old hole filled")
	assert.Len(t, w.old.ids, n/500-1)
	// recvSpan on, the old holes are too old to tell.
	for i := uint32(n); i < n+recvSpan; i++ {
		w.add((start + i) & packetIDMask)
	}
	assert.Empty(t, w.old.ids)
	assert.True(t, w.contains((start+77)&packetIDMask))
}

// More holes than the list takes stay in the ring, as before it.
func TestRecvWindowOldHolesFull(t *testing.T) {
	var w recvWindow
	for i := uint32(0); i < 4096; i++ {
		if i%16 != 5 {
			w.add(i)
		}
	}
	assert.Len(t, w.old.ids, maxOldHoles)
	assert.Greater(t, len(w.ring), 8, "the rest in the ring")
	for i := uint32(0); i < 4096; i++ {
		assert.Equal(t, i%16 != 5, w.contains(i), "i=%d", i)
	}
}
