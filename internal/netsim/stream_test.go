package netsim

import (
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// piece is a write to a simulated stream and when its last byte was
// delivered.
type piece struct {
	wrote, got time.Time
	end        int64 // the stream's offset after it
}

// writeEvery writes n pieces of size bytes, one every gap from t0, then
// runs the stream, a millisecond at a time, until everything is delivered
// or until end; it returns the pieces with their delivery times.
func writeEvery(t *testing.T, s *Stream, n, size int, gap time.Duration, end time.Time) []piece {
	t.Helper()
	ps := make([]piece, n)
	var written int64
	done := 0
	for now := t0; now.Before(end) && done < n; now = now.Add(time.Millisecond) {
		if i := int(now.Sub(t0) / gap); now.Sub(t0)%gap == 0 && i < n {
			require.Equal(t, size, s.Write(now, size), "room for piece %d", i)
			written += int64(size)
			ps[i] = piece{wrote: now, end: written}
		}
		s.Advance(now)
		for done < n && !ps[done].wrote.IsZero() && s.Delivered() >= ps[done].end {
			ps[done].got = now
			done++
		}
	}
	return ps
}

func latencies(ps []piece) []time.Duration {
	var ls []time.Duration
	for _, p := range ps {
		if !p.got.IsZero() {
			ls = append(ls, p.got.Sub(p.wrote))
		}
	}
	slices.Sort(ls)
	return ls
}

// A write is cut into segments of MSS bytes at most, which arrive Delay
// later, together.
func TestStreamDelayAndSegments(t *testing.T) {
	s := NewStream(NewLink(Params{Delay: 20 * time.Millisecond}))
	require.Equal(t, 4000, s.Write(t0, 4000))
	assert.Equal(t, uint64(3), s.Stats().Segments, "1448+1448+1104")
	assert.Equal(t, t0.Add(20*time.Millisecond), s.Next())
	s.Advance(t0.Add(20*time.Millisecond - 1))
	assert.Zero(t, s.Delivered(), "in flight")
	s.Advance(t0.Add(20 * time.Millisecond))
	assert.Equal(t, int64(4000), s.Delivered())
	assert.Equal(t, t0.Add(40*time.Millisecond), s.Next(), "the acknowledgement frees the buffer a delay later")
	s.Advance(t0.Add(40 * time.Millisecond))
	assert.True(t, s.Next().IsZero(), "nothing pending")
}

// A lost segment arrives once the acknowledgement of the next one tells
// the sender (RACK): here the next write 50ms later, its trip there and
// back, a quarter of the RTT to wait for reordering, and the resend's trip.
// Every byte behind it waits for it: the latencies are the path's delay, or
// a stall up to that recovery's length, or more for a segment lost again.
func TestStreamLossHoldsWhatFollows(t *testing.T) {
	const delay, gap = 20 * time.Millisecond, 50 * time.Millisecond
	recovered := delay + gap + 2*delay + 2*delay/4 // lost once, resent on the next one's ack
	s := NewStream(NewLink(Params{Loss: 0.05, Delay: delay, Seed: 7}))
	ps := writeEvery(t, s, 2000, 100, gap, t0.Add(200*time.Second)) // at 20Hz
	st, ls := s.Stats(), s.Link().Stats()
	assert.Equal(t, int64(200000), s.Delivered(), "every byte, in order")
	assert.InDelta(t, 100, st.Retransmitted, 40, "5%% of 2000 segments")
	assert.Equal(t, ls.Lost, st.Retransmitted)
	assert.Zero(t, st.GivenUp)

	l := latencies(ps)
	require.Len(t, l, 2000)
	assert.Equal(t, delay, l[0], "no faster than the path")
	assert.GreaterOrEqual(t, l[len(l)*99/100], recovered, "the lost ones, over 1%, recovered late")
	assert.Less(t, l[len(l)*99/100], delay+2*delay+MinRTO, "not a timeout late: the stream kept writing")
	var clean, once int
	for _, d := range l {
		switch d {
		case delay:
			clean++
		case recovered:
			once++ // lost once, not held by an earlier one
		}
	}
	assert.Greater(t, clean, 1000, "most go untouched, at 20Hz")
	assert.Greater(t, once, 50)
	t.Logf("latencies: p50 %v, p90 %v, p99 %v, max %v", l[len(l)/2], l[len(l)*9/10], l[len(l)*99/100], l[len(l)-1])
}

// A lost tail, with nothing written after it to tell the sender, waits out
// the retransmission timeout (2·20ms + 200ms).
func TestStreamLostTailWaitsTimeout(t *testing.T) {
	const delay = 20 * time.Millisecond
	for seed := uint64(1); ; seed++ {
		s := NewStream(NewLink(Params{Loss: 0.5, Delay: delay, Seed: seed}))
		require.Equal(t, 100, s.Write(t0, 100))
		if s.Stats().Retransmitted == 0 {
			continue // the first try went through: another seed
		}
		assert.Equal(t, t0.Add(2*delay+MinRTO), s.Next(), "seed %d", seed)
		return
	}
}

// The retransmission timeout doubles with each loss of the same segment
// (TCP's backoff); after MaxRetries the segment is given up and the
// stream stalls: nothing behind it arrives, and the buffer stays full.
func TestStreamBackoffAndGiveUp(t *testing.T) {
	s := NewStream(NewLink(Params{Loss: 1, Delay: 10 * time.Millisecond, Seed: 1}))
	require.Equal(t, 100, s.Write(t0, 100))
	rto := 20*time.Millisecond + MinRTO
	at := t0
	for i := range MaxRetries {
		next := at.Add(min(rto<<i, MaxRTO))
		assert.Equal(t, next, s.Next(), "retransmission %d", i+1)
		s.Advance(next)
		at = next
	}
	assert.True(t, s.Next().IsZero(), "given up")
	assert.Equal(t, uint64(MaxRetries+1), s.Link().Stats().Sent)
	assert.Equal(t, uint64(1), s.Stats().GivenUp)
	assert.Zero(t, s.Delivered())
}

// Corruption is a loss to TCP: the segment comes late, resent.
func TestStreamCorruptIsLoss(t *testing.T) {
	s := NewStream(NewLink(Params{Corrupt: 0.1, Delay: time.Millisecond, Seed: 3}))
	ps := writeEvery(t, s, 500, 10, time.Millisecond, t0.Add(5*time.Second))
	assert.Equal(t, int64(5000), s.Delivered())
	assert.Positive(t, s.Link().Stats().Corrupted)
	assert.Equal(t, s.Link().Stats().Corrupted, s.Stats().Retransmitted)
	l := latencies(ps)
	assert.GreaterOrEqual(t, l[len(l)-1], 3*time.Millisecond, "resent after a later segment's acknowledgement: a round trip late at least")
}

// Jitter and Reorder hold segments back, never reorder them: each arrives
// after the one before it, within Delay..Delay+Jitter+ReorderDelay of its
// write.
func TestStreamJitterKeepsOrder(t *testing.T) {
	const delay, jitter, reorder = 20 * time.Millisecond, 10 * time.Millisecond, 5 * time.Millisecond
	s := NewStream(NewLink(Params{Delay: delay, Jitter: jitter, Reorder: 0.1, ReorderDelay: reorder, Duplicate: 0.5, MaxSize: 100, Seed: 4}))
	ps := writeEvery(t, s, 1000, 1000, time.Millisecond, t0.Add(5*time.Second))
	assert.Equal(t, int64(1000000), s.Delivered(), "no loss: Duplicate and MaxSize do nothing to a stream")
	for i, p := range ps {
		d := p.got.Sub(p.wrote)
		assert.GreaterOrEqual(t, d, delay, "piece %d", i)
		assert.LessOrEqual(t, d, delay+jitter+reorder, "piece %d", i)
		if i > 0 {
			assert.False(t, p.got.Before(ps[i-1].got), "piece %d in order", i)
		}
	}
	assert.Positive(t, s.Link().Stats().Reordered)
}

// Bandwidth serialises the segments at the cap, and the sender's buffer
// makes a writer that writes as fast as it can wait: over a second it
// gets the cap, no more.
func TestStreamBandwidth(t *testing.T) {
	const bw = 100_000
	s := NewStream(NewLink(Params{Bandwidth: bw, Delay: 10 * time.Millisecond}))
	// 50ms at the cap and the bandwidth-delay product of 20ms.
	assert.Equal(t, bw/20+bw/50, s.Capacity())
	require.Equal(t, s.Capacity(), s.Write(t0, 1<<20), "takes what the buffer holds")
	assert.Zero(t, s.Write(t0, 1), "then none")
	tx := time.Duration(MSS) * time.Second / bw
	assert.Equal(t, t0.Add(tx+10*time.Millisecond), s.Next(), "the first segment leaves the bottleneck, and arrives a delay later")
	s.Advance(s.Next())
	assert.Equal(t, int64(MSS), s.Delivered())
	s.Advance(t0.Add(2*tx + 10*time.Millisecond))
	assert.Equal(t, int64(2*MSS), s.Delivered(), "the second one serialisation later")

	end := t0.Add(time.Second)
	for now := t0; now.Before(end); {
		s.Write(now, 1<<20)
		next := s.Next()
		require.False(t, next.IsZero())
		now = next
	}
	s.Advance(end)
	assert.InDelta(t, bw*99/100, s.Delivered(), MSS, "the cap over a second, less the delay")
}

// BurstDuration blackouts hold everything until they end and a
// retransmission gets through: the stalls last about as long as the
// bursts, and more, never less.
func TestStreamBlackouts(t *testing.T) {
	const burst = 300 * time.Millisecond
	s := NewStream(NewLink(Params{Loss: 0.05, BurstDuration: burst, Delay: 5 * time.Millisecond, Seed: 5}))
	ps := writeEvery(t, s, 20000, 50, time.Millisecond, t0.Add(60*time.Second))
	assert.Equal(t, int64(20000*50), s.Delivered())
	l := latencies(ps)
	require.Len(t, l, 20000)
	assert.Equal(t, 5*time.Millisecond, l[len(l)/2])
	assert.Greater(t, l[len(l)-1], burst+MinRTO, "the longest stall")
}

// The same seed gives the same schedule.
func TestStreamSeedReplays(t *testing.T) {
	p := Params{Loss: 0.1, Delay: 5 * time.Millisecond, Jitter: 5 * time.Millisecond, Seed: 9}
	a := writeEvery(t, NewStream(NewLink(p)), 500, 700, 2*time.Millisecond, t0.Add(10*time.Second))
	b := writeEvery(t, NewStream(NewLink(p)), 500, 700, 2*time.Millisecond, t0.Add(10*time.Second))
	assert.Equal(t, a, b)
	p.Seed++
	c := writeEvery(t, NewStream(NewLink(p)), 500, 700, 2*time.Millisecond, t0.Add(10*time.Second))
	assert.NotEqual(t, a, c)
}
