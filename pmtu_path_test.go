package knet

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/netsim"
)

// Issue 32 part 2: paths that carry less than 1400 bytes, and paths whose
// MTU falls, with the default Config.

// pathOf is a path of delay each way that drops datagrams above size
// bytes, at a bandwidth of bw bytes per second (0: no cap).
func pathOf(size int, delay time.Duration, bw int) netsim.Params {
	return netsim.Params{Delay: delay, MaxSize: size, Bandwidth: bw}
}

// sizeLog records each side's reliable datagrams by size and time.
type sizeLog struct {
	p    *simPair
	sent [2][]sentSize
}

type sentSize struct {
	at       time.Time
	size     int
	reliable bool
}

func (l *sizeLog) tap(from int, b []byte) {
	rel := len(b) >= 3 && b[2]&0x40 != 0 // the Reliable flag (DECISIONS §3)
	l.sent[from] = append(l.sent[from], sentSize{at: l.p.now, size: len(b), reliable: rel})
}

// reliableBytes returns the bytes of the side's reliable datagrams sent
// at or after from, in all and in datagrams above size.
func (l *sizeLog) reliableBytes(side int, from time.Time, size int) (all, above int) {
	for _, s := range l.sent[side] {
		if !s.reliable || s.at.Before(from) {
			continue
		}
		all += s.size
		if s.size > size {
			above += s.size
		}
	}
	return all, above
}

// delivered reports whether the server received want, in order.
func delivered(t *testing.T, p *simPair, want []Message) {
	t.Helper()
	require.Len(t, p.h[1].msgs, len(want))
	for i, m := range p.h[1].msgs {
		require.Equal(t, want[i].ID, m.ID, "message %d", i)
		require.True(t, bytes.Equal(want[i].Payload, m.Payload), "message %d", i)
	}
}

// burst queues a message of size bytes and n small reliable ones on the
// client, all in order, and returns them.
func burst(p *simPair, seed uint64, size, n int) []Message {
	var want []Message
	big := Message{ID: 400, Payload: randomPayload(seed, size), Reliable: true, InOrder: true}
	p.send(0, big)
	want = append(want, big)
	for i := range n {
		m := Message{ID: 401, Payload: []byte(fmt.Sprintf("small %d.%d", seed, i)), Reliable: true, InOrder: true}
		p.send(0, m)
		want = append(want, m)
	}
	return want
}

func TestPMTUDefaultConfigPath1280(t *testing.T) {
	// A path that drops UDP payloads above 1280 bytes (an IPv6 tunnel,
	// PPPoE, a VPN) with the default Config: a 1 MiB message and 200
	// small reliable ones arrive within 10 s, with no black hole to
	// find: nothing but the transfer's datagrams is larger than 1200.
	for _, size := range []int{1280, 1232} {
		t.Run(fmt.Sprint(size), func(t *testing.T) {
			p := newSimPair(t, &Config{}, &Config{}, pathOf(size, 20*time.Millisecond, 0), pathOf(size, 20*time.Millisecond, 0))
			log := &sizeLog{p: p}
			p.tap = log.tap
			p.connect()
			want := burst(p, 1, 1<<20, 200)
			start := p.now
			ok := p.run(10*time.Second, func() bool { return len(p.h[1].msgs) == len(want) })
			require.True(t, ok, "delivered %d of %d in 10s; client %v %v", len(p.h[1].msgs), len(want), p.client().state, p.client().err)
			t.Logf("path %d: delivered in %v, path size %d, retransmits %d", size, p.now.Sub(start), p.client().snapshot().PathDatagramSize, p.client().stats.Retransmits)
			delivered(t, p, want)
			assert.Nil(t, p.client().err)
			assert.Equal(t, stateOK, p.client().state)
			assert.LessOrEqual(t, p.client().snapshot().PathDatagramSize, size)
		})
	}
}

func TestPMTUFallMidConnection(t *testing.T) {
	t.Parallel()
	// MaxPathDatagramSize 9000 over a path that carries 8000, which falls
	// to 1300 while a transfer runs: what was in flight and everything
	// sent after the fall arrives, intact and in order, within 15 s, and
	// from 3 s after the fall no reliable datagram above 1300 goes.
	cfg := &Config{MaxPathDatagramSize: 9000}
	p := newSimPair(t, cfg, cfg, pathOf(8000, 10*time.Millisecond, 8<<20), pathOf(8000, 10*time.Millisecond, 8<<20))
	log := &sizeLog{p: p}
	p.tap = log.tap
	p.connect()
	want := burst(p, 1, 1<<20, 10)
	require.True(t, p.run(time.Minute, func() bool {
		return len(p.h[1].msgs) == len(want) && p.client().snapshot().PathDatagramSize > 8000-pmtuGranularity
	}), "the search found 8000")
	// Mid-transfer: datagrams of 8000 bytes are in flight.
	want = append(want, burst(p, 2, 4<<20, 0)...)
	require.True(t, p.run(time.Minute, func() bool { return p.client().loss.inflight > 100<<10 }))
	fall := p.now
	p.links[0].SetMaxSize(1300)
	p.links[1].SetMaxSize(1300)
	want = append(want, burst(p, 3, 1<<20, 200)...)
	ok := p.run(15*time.Second, func() bool { return len(p.h[1].msgs) == len(want) })
	require.True(t, ok, "delivered %d of %d in 15s after the fall; client %v %v", len(p.h[1].msgs), len(want), p.client().state, p.client().err)
	t.Logf("delivered %v after the fall, path size %d", p.now.Sub(fall), p.client().snapshot().PathDatagramSize)
	delivered(t, p, want)
	all, above := log.reliableBytes(0, fall.Add(3*time.Second), 1300)
	assert.Zero(t, above, "reliable bytes above 1300 from 3s after the fall (of %d)", all)
	assert.Equal(t, stateOK, p.client().state)
}

func TestPMTUSearchSettlesForBurst(t *testing.T) {
	// A path that carries 4000 bytes, discovery allowed to 9000 on both
	// ends: the search settles within a few round trips, and the bulk of
	// one 4 MiB message goes at about 4000 bytes.
	cfg := &Config{MaxPathDatagramSize: 9000}
	const rtt = 40 * time.Millisecond
	p := newSimPair(t, cfg, cfg, pathOf(4000, rtt/2, 16<<20), pathOf(4000, rtt/2, 16<<20))
	log := &sizeLog{p: p}
	p.tap = log.tap
	p.connect()
	start := p.now
	want := burst(p, 1, 4<<20, 0)
	var settled time.Duration
	ok := p.run(time.Minute, func() bool {
		if settled == 0 && p.client().mtu() != nil && p.client().mtu().size > 4000-pmtuGranularity {
			settled = p.now.Sub(start)
		}
		return len(p.h[1].msgs) == len(want)
	})
	require.True(t, ok)
	delivered(t, p, want)
	all, above := log.reliableBytes(0, start, 3500)
	t.Logf("settled after %v (%.1f RTTs), transfer took %v; %.0f%% of %d reliable bytes in datagrams above 3500",
		settled, float64(settled)/float64(rtt), p.now.Sub(start), 100*float64(above)/float64(all), all)
	require.NotZero(t, settled, "the search found about 4000 during the transfer")
	assert.LessOrEqual(t, settled, 10*rtt, "the search settles within a few round trips")
	assert.Greater(t, float64(above), 0.75*float64(all), "the bulk of the transfer went at about 4000")
	assert.LessOrEqual(t, p.client().snapshot().PathDatagramSize, 4000)
}

func TestPMTUPathBelowBase(t *testing.T) {
	// A path that stops carrying even 1200 bytes, while small datagrams
	// (acks, pings) get through: the connection ends, and its error says
	// why, with the sizes.
	p := newSimPair(t, &Config{}, &Config{}, pathOf(0, 10*time.Millisecond, 0), pathOf(0, 10*time.Millisecond, 0))
	p.connect()
	p.links[0].SetMaxSize(1000)
	p.links[1].SetMaxSize(1000)
	burst(p, 1, 64<<10, 0)
	ok := p.run(time.Minute, func() bool { return p.client().err != nil })
	require.True(t, ok, "the connection still open, state %v", p.client().state)
	msg := p.client().err.Error()
	t.Logf("error: %v", msg)
	assert.Contains(t, msg, "1200")
	assert.True(t, strings.Contains(msg, "path"), "the error names the path: %q", msg)
	var pe *PathMTUError
	require.ErrorAs(t, p.client().err, &pe)
	assert.Equal(t, 1200, pe.Size)
	assert.Positive(t, pe.Largest)
	assert.Less(t, pe.Largest, 1000)
}

func TestPMTUWholeMessagesFollowPath(t *testing.T) {
	// With the default Config over a path that carries 1400 bytes,
	// 1250-byte messages go whole once the search found 1400 (none but
	// the first few as transfers). The path then falls to 1250 with
	// such datagrams in flight: they go again converted (their messages
	// made transfers under the same PacketID and index), and everything
	// arrives, intact and in order.
	p := newSimPair(t, &Config{}, &Config{}, pathOf(1400, 10*time.Millisecond, 4<<20), pathOf(1400, 10*time.Millisecond, 4<<20))
	log := &sizeLog{p: p}
	p.tap = log.tap
	p.connect()
	start := p.now
	var want []Message
	send := func(seed uint64, n int) {
		for i := range n {
			m := Message{ID: 402, Payload: randomPayload(seed*1000+uint64(i), 1250), Reliable: true, InOrder: true}
			p.send(0, m)
			want = append(want, m)
		}
	}
	send(1, 200)
	var settled time.Duration
	require.True(t, p.run(10*time.Second, func() bool {
		if settled == 0 && p.client().snapshot().PathDatagramSize == 1400 {
			settled = p.now.Sub(start)
		}
		return len(p.h[1].msgs) == len(want)
	}))
	t.Logf("1400 confirmed %v (%.1f round trips) after the first message", settled, settled.Seconds()/0.02)
	assert.Equal(t, 1400, p.client().snapshot().PathDatagramSize)
	assert.LessOrEqual(t, settled, 3*20*time.Millisecond, "within a few round trips")
	all, above := log.reliableBytes(0, start, 1250)
	assert.Greater(t, float64(above), 0.9*float64(all), "reliable bytes in datagrams above 1250: whole messages")
	send(2, 400)
	require.True(t, p.run(time.Minute, func() bool { return p.client().loss.inflight > 40<<10 }))
	p.links[0].SetMaxSize(1250)
	p.links[1].SetMaxSize(1250)
	send(3, 100)
	ok := p.run(20*time.Second, func() bool { return len(p.h[1].msgs) == len(want) })
	require.True(t, ok, "delivered %d of %d; client %v %v", len(p.h[1].msgs), len(want), p.client().state, p.client().err)
	delivered(t, p, want)
	mtu := p.client().mtu()
	t.Logf("black holes %d, converted %d, retired %d, size %d", mtu.blackHoles, mtu.converted, mtu.retiredCount, mtu.size)
	assert.Positive(t, mtu.blackHoles)
	assert.Positive(t, mtu.converted, "datagrams of whole messages went again converted")
	assert.Equal(t, stateOK, p.client().state)
}
