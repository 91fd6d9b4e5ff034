package knet

import (
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestRelWindowInOrder(t *testing.T) {
	var w relWindow
	for n := range uint32(1000) {
		require.False(t, w.has(n))
		w.add(n)
		require.True(t, w.has(n))
		require.Equal(t, n+1, w.next)
	}
	assert.Nil(t, w.ring, "no bitmap without a hole")
}

// Numbers arriving shuffled within a sliding window, as after losses and
// resends: next is always the first missing one, and has agrees with a
// plain set.
func TestRelWindowShuffled(t *testing.T) {
	t.Parallel()
	for seed := range uint64(20) {
		r := rand.New(rand.NewPCG(seed, 7))
		var w relWindow
		start := uint32(maxRelNum - 3000) // crosses the wrap
		w.next = start
		const total = 6000
		// Each number arrives up to 500 places late.
		order := make([]uint32, total)
		key := make([]int, total)
		for i := range order {
			order[i] = uint32(i)
			key[i] = i + r.IntN(500)
		}
		slices.SortStableFunc(order, func(a, b uint32) int { return key[a] - key[b] })
		seen := make(map[uint32]bool)
		for _, k := range order {
			n := (start + k) & maxRelNum
			w.add(n)
			w.add(n) // a duplicate changes nothing
			seen[k] = true
			first := uint32(0)
			for seen[first] {
				first++
			}
			require.Equal(t, (start+first)&maxRelNum, w.next, "seed %d", seed)
		}
		for k := range uint32(total + 100) {
			assert.Equal(t, k < total, w.has((start+k)&maxRelNum), "seed %d number %d", seed, k)
		}
		assert.LessOrEqual(t, len(w.ring), 32, "the bitmap follows the holes, not the count")
	}
}

func TestRelWindowBounds(t *testing.T) {
	var w relWindow
	w.add(5)
	assert.False(t, w.fits(maxRelWindow))
	assert.True(t, w.fits(maxRelWindow-1))
	w.add(maxRelWindow + 10) // refused
	assert.False(t, w.has(maxRelWindow+10))
	assert.True(t, w.has(5))
	assert.False(t, w.has(0))
	w.addRange(0, 5)
	assert.Equal(t, uint32(6), w.next)
	assert.True(t, w.has(maxRelNum), "before next, serially: old")
}

func TestRelDiff(t *testing.T) {
	assert.Equal(t, int32(1), relDiff(maxRelNum, 0))
	assert.Equal(t, int32(-1), relDiff(0, maxRelNum))
	assert.Equal(t, int32(10), relDiff(5, 15))
	assert.Equal(t, uint32(0), relNextNum(maxRelNum))
}
