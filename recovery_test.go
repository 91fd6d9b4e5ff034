package knet

import (
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/netsim"
)

// Loss recovery under heavy and bursty loss, on the fake clock.

// echoGaps has the client send n reliable messages, at most ten
// unanswered, and the server echo each; it returns the longest time
// without a new echo at the client.
func echoGaps(t *testing.T, path func(uint64) netsim.Params, seed uint64, n int) time.Duration {
	cfg := &Config{ConnectTimeout: time.Minute}
	p := newSimPair(t, cfg, cfg, path(seed), path(seed+1000))
	p.connect()
	start, last := p.now, p.now
	var gap time.Duration
	sent, echoed, got := 0, 0, 0
	for got < n {
		if sent < n && sent-got < 10 {
			p.send(0, numbered(100, sent, 50))
			sent++
		}
		for ; echoed < len(p.h[1].msgs); echoed++ {
			p.send(1, p.h[1].msgs[echoed])
		}
		p.run(time.Millisecond, nil)
		if len(p.h[0].msgs) > got {
			got = len(p.h[0].msgs)
			gap = max(gap, p.now.Sub(last))
			last = p.now
		}
		require.Less(t, p.now.Sub(start), 2*time.Minute, "seed %d: %d of %d echoed", seed, got, n)
		require.NotEqual(t, stateDone, p.client().state, "seed %d: %v", seed, p.client().err)
	}
	return gap
}

func TestEchoThroughBurstyLoss(t *testing.T) {
	t.Parallel()
	// Defect 5: 20% loss in bursts of three, 2% duplicates, both ways;
	// 300 echoed reliable messages. Bursts drawn per datagram last seconds
	// once a direction carries only spaced probes: one seed in eight went
	// 5-12s without an echo. Real links lose for a time (BurstDuration).
	// The probe timeout now backs off to at most max(4 RTO, 500ms) and
	// resends two datagrams. Per-datagram bursts still have a long tail
	// (18 losses in a row happen: (2/3)^17 per burst) that no back-off
	// short of flooding gets through quickly; one seed in a hundred
	// still waits 9s. The test holds the distribution to that.
	for _, tc := range []struct {
		name     string
		burst    func(*netsim.Params)
		seeds    int
		p90, max time.Duration // the longest wait: at the 90th percentile of seeds, and at most
		over     int           // seeds allowed past max
	}{
		{"per datagram", func(p *netsim.Params) { p.BurstLen = 3 }, 48, 1500 * time.Millisecond, 5 * time.Second, 1},
		// Over 400 seeds 2-3% wait 1.5s or more (9 before PacketIDs
		// were skipped, 10 after, issue 38): 48 seeds, one allowed.
		{"in time", func(p *netsim.Params) { p.BurstDuration = 20 * time.Millisecond }, 48, time.Second, 1500 * time.Millisecond, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := func(seed uint64) netsim.Params {
				p := netsim.Params{Loss: 0.2, Duplicate: 0.02, Delay: 5 * time.Millisecond, Jitter: 2 * time.Millisecond, Seed: seed}
				tc.burst(&p)
				return p
			}
			var gaps []time.Duration
			over := 0
			for seed := range uint64(tc.seeds) {
				g := echoGaps(t, path, seed, 300)
				gaps = append(gaps, g)
				if g >= tc.max {
					over++
				}
			}
			slices.Sort(gaps)
			p90 := gaps[len(gaps)*9/10]
			t.Logf("longest wait for an echo over %d seeds: median %v, p90 %v, worst %v", tc.seeds, gaps[len(gaps)/2], p90, gaps[len(gaps)-1])
			assert.Less(t, p90, tc.p90)
			assert.LessOrEqual(t, over, tc.over, "seeds waiting %v or more", tc.max)
		})
	}
}

func TestLargeMessageUnderHeavyRandomLoss(t *testing.T) {
	t.Parallel()
	// Defect 5: 1 MiB one way with 20% loss each way took 0.2-13s (half
	// the seeds over 6s) against 0.1-1.2s at 10%. Random loss made each
	// round deliver a fifth less than it sent, the estimate followed it
	// down, and a fifth lost crossed the heavy-loss threshold (a quarter)
	// often enough to keep the rate cut.
	path := func(seed uint64) netsim.Params {
		return netsim.Params{Loss: 0.2, Delay: 5 * time.Millisecond, Seed: seed}
	}
	var times []time.Duration
	for seed := range uint64(16) {
		p := newSimPair(t, nil, nil, path(seed+1), path(seed+100))
		p.connect()
		start := p.now
		p.send(0, Message{ID: 10, Payload: make([]byte, 1<<20), Reliable: true})
		require.True(t, p.run(time.Minute, func() bool { return len(p.h[1].msgs) == 1 }))
		times = append(times, p.now.Sub(start).Round(time.Millisecond))
	}
	t.Logf("1 MiB at 20%% loss: %v", times)
	for _, d := range times {
		assert.Less(t, d, 2*time.Second)
	}
}
