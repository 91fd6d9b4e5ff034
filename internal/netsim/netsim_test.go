package netsim

import (
	"math"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// run sends n datagrams of size bytes every gap through a fresh link and
// returns the fates.
func run(p Params, n, size int, gap time.Duration) ([]Fate, Stats) {
	l := NewLink(p)
	fates := make([]Fate, n)
	for i := range n {
		fates[i] = l.Decide(t0.Add(time.Duration(i)*gap), size)
	}
	return fates, l.Stats()
}

func TestPerfectPath(t *testing.T) {
	fates, st := run(Params{}, 1000, 100, time.Millisecond)
	for _, f := range fates {
		require.Equal(t, []time.Duration{0}, f.After)
		require.Equal(t, -1, f.Flip)
	}
	assert.Equal(t, uint64(1000), st.Delivered)
}

func TestMaxSizeDropsLarger(t *testing.T) {
	l := NewLink(Params{MaxSize: 1500})
	assert.NotEmpty(t, l.Decide(t0, 1500).After, "at the limit")
	assert.Empty(t, l.Decide(t0, 1501).After, "above it")
	l.SetMaxSize(1000)
	assert.Empty(t, l.Decide(t0, 1500).After, "above the lowered limit")
	assert.NotEmpty(t, l.Decide(t0, 1000).After)
	st := l.Stats()
	assert.Equal(t, uint64(2), st.TooBig)
	assert.Equal(t, uint64(2), st.Delivered)
}

func TestUniformLoss(t *testing.T) {
	_, st := run(Params{Loss: 0.1, Seed: 1}, 100000, 100, 0)
	assert.InDelta(t, 0.1, float64(st.Lost)/1e5, 0.005)
}

func TestBurstLoss(t *testing.T) {
	fates, st := run(Params{Loss: 0.1, BurstLen: 5, Seed: 2}, 200000, 100, 0)
	assert.InDelta(t, 0.1, float64(st.Lost)/2e5, 0.01, "long-run average")
	bursts, lost := 0, 0
	for i, f := range fates {
		if len(f.After) == 0 {
			lost++
			if i == 0 || len(fates[i-1].After) > 0 {
				bursts++
			}
		}
	}
	assert.InDelta(t, 5, float64(lost)/float64(bursts), 0.5, "mean burst length")
}

func TestSeedReplays(t *testing.T) {
	for _, p := range []Params{
		{Loss: 0.2, Duplicate: 0.1, Reorder: 0.1, Jitter: time.Millisecond, Corrupt: 0.05, Seed: 9},
		{Loss: 0.2, BurstDuration: 5 * time.Millisecond, Jitter: time.Millisecond, Seed: 9},
	} {
		a, _ := run(p, 5000, 100, time.Millisecond)
		b, _ := run(p, 5000, 100, time.Millisecond)
		assert.Equal(t, a, b)
		p.Seed = 10
		c, _ := run(p, 5000, 100, time.Millisecond)
		assert.NotEqual(t, a, c)
	}
}

func TestJitterReorders(t *testing.T) {
	// Each datagram draws its own delay, so one sent gap after another
	// arrives first with probability (1-gap/Jitter)²/2.
	const gap, jitter = time.Millisecond, 5 * time.Millisecond
	fates, _ := run(Params{Delay: 10 * time.Millisecond, Jitter: jitter, Seed: 3}, 100000, 100, gap)
	overtook := 0
	var lo, hi time.Duration = time.Hour, 0
	for i, f := range fates {
		require.Len(t, f.After, 1)
		lo, hi = min(lo, f.After[0]), max(hi, f.After[0])
		if i > 0 && time.Duration(i)*gap+f.After[0] < time.Duration(i-1)*gap+fates[i-1].After[0] {
			overtook++
		}
	}
	want := (1 - float64(gap)/float64(jitter)) * (1 - float64(gap)/float64(jitter)) / 2
	assert.InDelta(t, want, float64(overtook)/float64(len(fates)-1), 0.01, "share overtaking the one before")
	assert.GreaterOrEqual(t, lo, 10*time.Millisecond)
	assert.LessOrEqual(t, hi, 15*time.Millisecond)
	assert.Greater(t, hi-lo, 4*time.Millisecond, "jitter is there")
}

func TestJitterKeepsOrder(t *testing.T) {
	fates, _ := run(Params{Delay: 10 * time.Millisecond, Jitter: 5 * time.Millisecond, JitterKeepsOrder: true, Seed: 3}, 10000, 100, 100*time.Microsecond)
	last := t0
	spread := time.Duration(0)
	for i, f := range fates {
		at := t0.Add(time.Duration(i)*100*time.Microsecond + f.After[0])
		require.False(t, at.Before(last), "datagram %d overtook", i)
		last = at
		spread = max(spread, f.After[0]-10*time.Millisecond)
	}
	assert.Greater(t, spread, 4*time.Millisecond, "jitter is there")
}

func TestBurstDurationDense(t *testing.T) {
	// A datagram every 200µs: the chain is seen almost continuously, so
	// the bad state's share of time and its mean length show directly.
	const gap, burst = 200 * time.Microsecond, 20 * time.Millisecond
	const n = 1000000
	fates, st := run(Params{Loss: 0.1, BurstDuration: burst, Seed: 11}, n, 100, gap)
	assert.InDelta(t, 0.1, float64(st.Lost)/n, 0.015, "long-run fraction of time lost")
	// A burst lasts from its first lost datagram to the next delivered
	// one: both ends are late by the same U(0, gap) on average.
	var bursts int
	var total time.Duration
	start := -1
	for i, f := range fates {
		switch {
		case len(f.After) == 0 && start < 0:
			start = i
		case len(f.After) > 0 && start >= 0:
			bursts++
			total += time.Duration(i-start) * gap
			start = -1
		}
	}
	require.Greater(t, bursts, 300)
	assert.InDelta(t, float64(burst), float64(total)/float64(bursts), float64(2*time.Millisecond), "mean burst duration")
}

func TestBurstDurationSparse(t *testing.T) {
	// Datagrams further apart than a burst: the chance that one is lost
	// after a lost one follows the chain's time, not a datagram count,
	// P(bad after t | bad) = p + (1-p)·exp(-t/(B(1-p))). With BurstLen
	// instead, a burst would swallow BurstLen datagrams however spaced.
	const p, burst = 0.2, 20 * time.Millisecond
	for _, gap := range []time.Duration{10 * time.Millisecond, 500 * time.Millisecond} {
		const n = 40000
		fates, st := run(Params{Loss: p, BurstDuration: burst, Seed: 12}, n, 100, gap)
		assert.InDelta(t, p, float64(st.Lost)/n, 0.02, "gap %v: long-run loss", gap)
		after, again := 0, 0
		for i := 1; i < n; i++ {
			if len(fates[i-1].After) == 0 {
				after++
				if len(fates[i].After) == 0 {
					again++
				}
			}
		}
		want := p + (1-p)*math.Exp(-gap.Seconds()/(burst.Seconds()*(1-p)))
		assert.InDelta(t, want, float64(again)/float64(after), 0.03, "gap %v: loss after a loss", gap)
	}
	// The per-datagram chain, for contrast, keeps its bursts.
	fates, _ := run(Params{Loss: p, BurstLen: 5, Seed: 12}, 40000, 100, 500*time.Millisecond)
	after, again := 0, 0
	for i := 1; i < len(fates); i++ {
		if len(fates[i-1].After) == 0 {
			after++
			if len(fates[i].After) == 0 {
				again++
			}
		}
	}
	assert.InDelta(t, 0.8, float64(again)/float64(after), 0.03)
}

func TestBurstDurationSameInstant(t *testing.T) {
	// Datagrams sent at the same instant share the chain's state.
	l := NewLink(Params{Loss: 0.3, BurstDuration: 10 * time.Millisecond, Seed: 13})
	lost := 0
	for i := range 2000 {
		now := t0.Add(time.Duration(i) * 7 * time.Millisecond)
		first := len(l.Decide(now, 100).After) == 0
		for range 5 {
			require.Equal(t, first, len(l.Decide(now, 100).After) == 0, "instant %d", i)
		}
		if first {
			lost++
		}
	}
	assert.InDelta(t, 0.3, float64(lost)/2000, 0.05)
}

func TestReorderAndDuplicate(t *testing.T) {
	_, st := run(Params{Reorder: 0.1, Duplicate: 0.05, Seed: 4}, 100000, 100, 0)
	assert.InDelta(t, 0.1, float64(st.Reordered)/1e5, 0.01)
	assert.InDelta(t, 0.05, float64(st.Duplicated)/1e5, 0.005)
	assert.Equal(t, st.Sent+st.Duplicated, st.Delivered)
}

func TestCorrupt(t *testing.T) {
	fates, st := run(Params{Corrupt: 0.2, Seed: 5}, 10000, 50, 0)
	assert.InDelta(t, 0.2, float64(st.Corrupted)/1e4, 0.02)
	for _, f := range fates {
		assert.Less(t, f.Flip, 50)
	}
}

func TestBandwidthCap(t *testing.T) {
	// Offer twice the cap for a second: about half gets through, and
	// nothing waits longer than the queue allows.
	const bw = 1 << 20
	p := Params{Bandwidth: bw, Seed: 6}
	l := NewLink(p)
	size := 1000
	gap := time.Duration(float64(size) / (2 * bw) * float64(time.Second))
	var delivered int
	var worst time.Duration
	for i := range int(2 * bw / size) {
		f := l.Decide(t0.Add(time.Duration(i)*gap), size)
		if len(f.After) > 0 {
			delivered += size
			worst = max(worst, f.After[0])
		}
	}
	assert.InDelta(t, bw, float64(delivered), bw*0.05)
	assert.LessOrEqual(t, worst, 51*time.Millisecond)
	assert.Positive(t, l.Stats().QueueDrops)
}

func TestPipeDeliversInOrderWithDelay(t *testing.T) {
	var mu sync.Mutex
	var got []byte
	to := netip.MustParseAddrPort("127.0.0.1:9")
	p := NewPipe(NewLink(Params{Delay: 5 * time.Millisecond, Jitter: 2 * time.Millisecond, JitterKeepsOrder: true, Seed: 1}), func(b []byte, dst netip.AddrPort) {
		mu.Lock()
		defer mu.Unlock()
		if dst == to {
			got = append(got, b[0])
		}
	})
	defer p.Close()
	start := time.Now()
	for i := range 100 {
		p.Send([]byte{byte(i)}, to)
	}
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(got) == 100
	}, 2*time.Second, time.Millisecond)
	assert.GreaterOrEqual(t, time.Since(start), 5*time.Millisecond)
	for i, b := range got {
		require.Equal(t, byte(i), b)
	}
}

func TestPipeCloseDropsInFlight(t *testing.T) {
	delivered := 0
	p := NewPipe(NewLink(Params{Delay: time.Hour}), func([]byte, netip.AddrPort) { delivered++ })
	p.Send([]byte{1}, netip.AddrPort{})
	p.Close()
	assert.Zero(t, delivered)
}

func TestPipeDrainDeliversInFlight(t *testing.T) {
	var delivered atomic.Int64
	p := NewPipe(NewLink(Params{Delay: 20 * time.Millisecond, Jitter: 5 * time.Millisecond, Seed: 7}), func([]byte, netip.AddrPort) { delivered.Add(1) })
	for range 10 {
		p.Send([]byte{1}, netip.AddrPort{})
	}
	p.Drain(time.Minute)
	assert.Equal(t, int64(10), delivered.Load(), "everything in flight landed")
	p.Close()

	// The bound holds however long the path.
	slow := NewPipe(NewLink(Params{Delay: time.Hour}), func([]byte, netip.AddrPort) { delivered.Add(1) })
	slow.Send([]byte{1}, netip.AddrPort{})
	slow.Drain(time.Millisecond)
	slow.Close()
	assert.Equal(t, int64(10), delivered.Load())

	// Nothing in flight: nothing to wait for.
	idle := NewPipe(NewLink(Params{}), func([]byte, netip.AddrPort) {})
	idle.Drain(time.Hour)
	idle.Close()
}
