package knet

import (
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var timeZero = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

func TestAckQueueTakeSplits(t *testing.T) {
	var q ackQueue
	ids := []uint32{40, 1, 2, 36, 35, 3, 3, 70}
	for _, id := range ids {
		q.add(timeZero, id)
	}
	acks := q.take(nil, 10)
	var got []uint32
	for _, a := range acks {
		a.each(func(id uint32) { got = append(got, id) })
	}
	assert.Equal(t, []uint32{1, 2, 3, 35, 36, 40, 70}, got)
	// 1..35 fits one PacketAck; 36..70 the next.
	require.Len(t, acks, 2)
	assert.Equal(t, uint32(1), acks[0].base)
	assert.Equal(t, uint32(36), acks[1].base)
	assert.Zero(t, q.pending())

	for _, id := range ids {
		q.add(timeZero, id)
	}
	acks = q.take(nil, 1)
	require.Len(t, acks, 1)
	assert.Equal(t, 3, q.pending(), "what did not fit stays queued")
}

// Repeated acks merge with the fresh ones into the fewest PacketAcks that
// cover the same PacketIDs, across the PacketID wrap too.
func TestAckQueueMerge(t *testing.T) {
	ids := func(acks []packetAck) []uint32 {
		var got []uint32
		for _, a := range acks {
			a.each(func(id uint32) { got = append(got, id) })
		}
		return got
	}
	var q ackQueue
	// The echo pattern: a fresh ack, then the repeats, newest first.
	in := []packetAck{{base: 1010}, {base: 1008}, {base: 1006, more: 1}, {base: 1004}, {base: 1002}, {base: 1000}}
	got := q.merge(slices.Clone(in))
	require.Len(t, got, 1)
	assert.Equal(t, []uint32{1000, 1002, 1004, 1006, 1007, 1008, 1010}, ids(got))

	// More than one PacketAck spans, and duplicates.
	in = []packetAck{{base: 100, more: 1 << 33}, {base: 10}, {base: 100}, {base: 60, more: 3}}
	got = q.merge(slices.Clone(in))
	assert.Equal(t, []uint32{10, 60, 61, 62, 100, 134}, ids(got))
	assert.Len(t, got, 3, "10, 60-62 and 100-134 need a window of 35 each")

	// Around the wrap.
	in = []packetAck{{base: 1}, {base: packetIDMask}, {base: packetIDMask - 1}}
	got = q.merge(slices.Clone(in))
	require.Len(t, got, 1)
	assert.Equal(t, []uint32{packetIDMask - 1, packetIDMask, 1}, ids(got))

	assert.Zero(t, testing.AllocsPerRun(100, func() { q.merge(in) }))
}

// Acks sent again are those of the last keep, newest first, whatever the
// ring did meanwhile; and the ring holds about what keep needs, not
// maxRecentAcks on every connection.
func TestAckQueueRepeatsMatchModel(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 7))
	for _, keep := range []time.Duration{time.Millisecond, 5 * time.Millisecond, time.Second} {
		var q ackQueue
		type sent struct {
			a  packetAck
			at time.Time
		}
		var model []sent
		now := timeZero
		base := uint32(0)
		for step := range 5000 {
			now = now.Add(time.Duration(rng.IntN(3000)) * time.Microsecond)
			var acks []packetAck
			for range rng.IntN(4) {
				base++
				acks = append(acks, packetAck{base: base})
				model = append(model, sent{packetAck{base: base}, now})
			}
			q.remember(now, acks, keep)
			back := time.Duration(rng.Int64N(int64(keep) + 1))
			room := 1 + rng.IntN(20)
			var want []packetAck
			for k := len(model) - 1; k >= 0 && len(want) < room && len(model)-k <= maxRecentAcks; k-- {
				if model[k].at.Before(now.Add(-back)) {
					break
				}
				want = append(want, model[k].a)
			}
			got := q.repeats(nil, now.Add(-back), room)
			require.Equal(t, want, got, "keep %v, step %d", keep, step)
		}
		t.Logf("keep %v: ring of %d", keep, len(q.recent))
		if keep < time.Second {
			// Up to 3 acks every 0-3 ms: a short keep needs few.
			assert.Less(t, len(q.recent), maxRecentAcks/4)
		} else {
			assert.Equal(t, maxRecentAcks, len(q.recent))
		}
	}
}
