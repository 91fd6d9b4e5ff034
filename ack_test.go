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
	assert.LessOrEqual(t, w.n, recvWindowMaxWords+1)
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
	// Random arrival of a sliding range of PacketIDs against a set.
	rng := rand.New(rand.NewPCG(1, 2))
	var w recvWindow
	seen := map[uint32]bool{}
	base := uint32(packetIDMask - 5000)
	w.add(base)
	seen[base] = true
	newest := base
	for range 200000 {
		id := (newest + uint32(rng.IntN(200)) - 150) & packetIDMask
		if seqDiff(newest, id) <= -recvSpan+64 || !w.plausible(id) {
			continue
		}
		require.Equal(t, seen[id] || seqLess(id, base), w.contains(id), "id %d", id)
		w.add(id)
		seen[id] = true
		if seqLess(newest, id) {
			newest = id
		}
	}
}

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

func TestRTTEstimator(t *testing.T) {
	var r rttEstimator
	assert.Equal(t, time.Second, r.rto(time.Second, 5*time.Millisecond, 2*time.Second))
	r.sample(100 * time.Millisecond)
	assert.Equal(t, 100*time.Millisecond, r.srtt)
	assert.Equal(t, 50*time.Millisecond, r.rttvar)
	assert.Equal(t, 300*time.Millisecond, r.rto(time.Second, 5*time.Millisecond, 2*time.Second))
	r.sample(200 * time.Millisecond)
	// RFC 6298: RTTVAR = 3/4*50 + 1/4*100 = 62.5ms; SRTT = 7/8*100 + 1/8*200 = 112.5ms.
	assert.Equal(t, 62500*time.Microsecond, r.rttvar)
	assert.Equal(t, 112500*time.Microsecond, r.srtt)
	assert.Equal(t, 100*time.Millisecond, r.min)
	assert.Equal(t, 362500*time.Microsecond, r.rto(time.Second, 5*time.Millisecond, 2*time.Second))
	assert.Equal(t, 200*time.Millisecond, r.rto(time.Second, 5*time.Millisecond, 200*time.Millisecond), "ceiling")
	var fast rttEstimator
	fast.sample(50 * time.Microsecond)
	assert.Equal(t, 5*time.Millisecond, fast.rto(time.Second, 5*time.Millisecond, 2*time.Second), "floor")
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
