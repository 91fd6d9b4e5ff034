package knet

import (
	"bytes"
	"slices"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/netsim"
)

// sizeLimited is a path of 5ms each way that drops datagrams above max
// bytes.
func sizeLimited(max int) netsim.Params {
	return netsim.Params{Delay: 5 * time.Millisecond, MaxSize: max}
}

// sizeTap records the largest datagram each side sent, reliable ones apart.
type sizeTap struct{ maxRel, maxAny [2]int }

func (st *sizeTap) tap(from int, b []byte) {
	st.maxAny[from] = max(st.maxAny[from], len(b))
	if len(b) >= 3 && b[2]&0x40 != 0 { // the Reliable flag (DECISIONS §3)
		st.maxRel[from] = max(st.maxRel[from], len(b))
	}
}

func TestPMTUSettlesBelowPathLimit(t *testing.T) {
	// The path carries 4000 bytes, the connection may go to 9000: the
	// search settles within its granularity below 4000, the transfer
	// uses it, and the lost probes cost no retransmission, no loss for
	// the controller, and not the connection.
	cfg := &Config{MaxPathDatagramSize: 9000}
	p := newSimPair(t, cfg, cfg, sizeLimited(4000), sizeLimited(4000))
	var sizes sizeTap
	p.tap = sizes.tap
	p.connect()
	// The first transfer starts the search, the second goes at the
	// size found.
	for i := range 2 {
		payload := randomPayload(uint64(i), 1<<20)
		p.send(0, Message{ID: 400, Payload: payload, Reliable: true})
		require.True(t, p.run(time.Minute, func() bool { return len(p.h[1].msgs) == i+1 && !p.client().mtu().searching }))
		assert.True(t, bytes.Equal(payload, p.h[1].msgs[i].Payload))
	}

	st := p.client().snapshot()
	assert.LessOrEqual(t, st.PathDatagramSize, 4000)
	assert.Greater(t, st.PathDatagramSize, 4000-pmtuGranularity)
	// Whole fragments fill the datagrams.
	assert.Greater(t, sizes.maxRel[0], st.PathDatagramSize-p.client().send.fragSize-8, "fragments went in datagrams of the size found")
	assert.LessOrEqual(t, sizes.maxRel[0], 4000)
	assert.Positive(t, p.client().mtu().probesLost, "probes above 4000 were lost")
	assert.Zero(t, st.Retransmits, "a lost probe is not sent again")
	assert.Zero(t, st.FastRetransmits)
	assert.Zero(t, p.client().mtu().blackHoles)
	assert.Equal(t, stateOK, p.client().state)
	assert.False(t, p.client().mtu().searching, "the search ended")
}

func TestPMTUBlackHoleMidTransfer(t *testing.T) {
	// The path carries 4000 bytes, then only 1300 while transfers and
	// small ordered messages flow: the connection finds the black hole,
	// sends the fragments in flight again in datagrams of its base size,
	// searches again, and delivers everything, in order.
	cfg := &Config{MaxDatagramSize: 1200, MaxPathDatagramSize: 9000}
	// A bottleneck, so that the transfers last, and lose datagrams of
	// their own to its queue.
	path := sizeLimited(4000)
	path.Bandwidth = 4 << 20
	p := newSimPair(t, cfg, cfg, path, path)
	p.connect()
	var want []Message
	for i := range 16 {
		m := Message{ID: 400, Payload: randomPayload(uint64(i), 256<<10), Reliable: true, InOrder: true}
		p.send(0, m)
		want = append(want, m)
		small := Message{ID: 401, Payload: []byte{byte(i)}, Reliable: true, InOrder: true}
		p.send(0, small)
		want = append(want, small)
	}
	require.True(t, p.run(time.Minute, func() bool { return !p.client().mtu().searching && len(p.h[1].msgs) >= 2 }))
	require.Greater(t, p.client().mtu().size, 4000-pmtuGranularity)
	require.Less(t, len(p.h[1].msgs), len(want), "the drop comes mid-transfer")
	require.Positive(t, p.client().loss.sent.count)
	p.links[0].SetMaxSize(1300)
	p.links[1].SetMaxSize(1300)
	ok := p.run(5*time.Minute, func() bool { return len(p.h[1].msgs) == len(want) })
	t.Logf("client %v %v server %v %v bh %d retired %d", p.client().state, p.client().err, p.server().state, p.server().err, p.client().mtu().blackHoles, p.client().mtu().retiredCount)
	require.True(t, ok,
		"delivered %d of %d", len(p.h[1].msgs), len(want))
	for i, m := range p.h[1].msgs {
		assert.Equal(t, want[i].ID, m.ID, "message %d", i)
		assert.True(t, bytes.Equal(want[i].Payload, m.Payload), "message %d", i)
	}
	require.True(t, p.run(time.Minute, func() bool { return !p.client().mtu().searching }))
	st := p.client().snapshot()
	assert.Equal(t, uint64(1), p.client().mtu().blackHoles)
	assert.Positive(t, p.client().mtu().retiredCount, "datagrams in flight were too large")
	assert.LessOrEqual(t, st.PathDatagramSize, 1300)
	assert.Greater(t, st.PathDatagramSize, 1300-pmtuGranularity, "searched again")
	assert.Equal(t, stateOK, p.client().state)
	assert.Equal(t, stateOK, p.server().state)
	require.True(t, p.run(time.Minute, func() bool { return p.client().loss.sent.count == 0 }))
	assert.Empty(t, p.client().mtu().retired, "the datagrams retired are settled")
	assert.Zero(t, p.client().send.tids.inUse, "and their TransferIDs free")
}

func TestPMTUPathAtBase(t *testing.T) {
	// A path that carries MaxDatagramSize and no more: every probe is
	// lost, the search gives up after a bounded number of them, and the
	// transfer goes at the base size without a single retransmission.
	cfg := &Config{MaxDatagramSize: 1400, MaxPathDatagramSize: 9000}
	p := newSimPair(t, cfg, cfg, sizeLimited(1400), sizeLimited(1400))
	p.connect()
	payload := randomPayload(2, 1<<20)
	p.send(0, Message{ID: 400, Payload: payload, Reliable: true})
	require.True(t, p.run(time.Minute, func() bool { return len(p.h[1].msgs) == 1 && !p.client().mtu().searching }))
	assert.True(t, bytes.Equal(payload, p.h[1].msgs[0].Payload))
	st := p.client().snapshot()
	assert.Equal(t, 1400, st.PathDatagramSize)
	assert.Positive(t, p.client().mtu().probesLost)
	assert.Equal(t, p.client().mtu().probes, p.client().mtu().probesLost)
	assert.LessOrEqual(t, p.client().mtu().probes, uint64(pmtuMaxProbes*10), "a binary search")
	assert.Zero(t, st.Retransmits)
	assert.False(t, p.client().mtu().searching)
}

func TestPMTUReferenceDialectNeverProbes(t *testing.T) {
	// The reference dialect keeps the reference's datagram size.
	cfg := &Config{MaxPathDatagramSize: 9000}
	p := newSimPairIn(t, DialectReference, cfg, cfg, netsim.Params{}, netsim.Params{})
	var sizes sizeTap
	p.tap = sizes.tap
	p.connect()
	payload := randomPayload(3, 256<<10)
	p.send(0, Message{ID: 400, Payload: payload, Reliable: true})
	require.True(t, p.run(time.Minute, func() bool { return len(p.h[1].msgs) == 1 }))
	assert.Nil(t, p.client().mtu())
	assert.LessOrEqual(t, sizes.maxAny[0], 1400)
	assert.Equal(t, 1400, p.client().snapshot().PathDatagramSize)
}

func TestPMTUSecure(t *testing.T) {
	// Probes and bulk datagrams are sealed like the rest, and sizes
	// count the sealing: the datagrams on the wire stay within the path.
	cfg := &Config{MaxPathDatagramSize: 9000}
	p := newSecureSimPair(t, cfg, cfg, sizeLimited(4000), sizeLimited(4000))
	var sizes sizeTap
	p.tap = func(from int, b []byte) { sizes.maxAny[from] = max(sizes.maxAny[from], len(b)) }
	p.connect()
	payload := randomPayload(4, 1<<20)
	p.send(0, Message{ID: 400, Payload: payload, Reliable: true})
	require.True(t, p.run(time.Minute, func() bool { return len(p.h[1].msgs) == 1 && !p.client().mtu().searching }))
	assert.True(t, bytes.Equal(payload, p.h[1].msgs[0].Payload))
	st := p.client().snapshot()
	assert.LessOrEqual(t, st.PathDatagramSize, 4000)
	assert.Greater(t, st.PathDatagramSize, 4000-pmtuGranularity)
	assert.Greater(t, sizes.maxAny[0], 4000-pmtuGranularity)
	assert.Zero(t, st.Retransmits)
}

func TestPadTo(t *testing.T) {
	// Probes are padded to the byte, with several padding messages past
	// what one carries, and parse.
	for _, size := range []int{20, 1200, 2051, 2052, 2053, 4100, 9000} {
		b := appendHeader(nil, &header{packetID: 7})
		b = appendMessage(b, &message{id: idPingRequest, payload: []byte{1}})
		b = padTo(b, size)
		require.Len(t, b, size)
		d, _, err := parseDatagram(b)
		require.NoError(t, err, "size %d", size)
		assert.Equal(t, uint32(idPingRequest), d.msgs[0].id)
	}
}

// pmtuTransfer sends n messages of size bytes from a client with cfg to
// a listener with lcfg on nw, and returns the client's Stats once the
// listener's side has received them all, and the client.
func pmtuTransfer(t *testing.T, nw *testNet, cfg, lcfg *Config, n, size int) (Stats, *Conn) {
	t.Helper()
	l := nw.listen(t, lcfg)
	ctx := within(t, time.Minute)
	accepted := make(chan *Conn, 1)
	go func() {
		c, err := l.AcceptConn(ctx)
		if err == nil {
			accepted <- c
		}
		close(accepted)
	}()
	c := nw.dial(t, l.Addr().String(), cfg)
	sc := <-accepted
	require.NotNil(t, sc)
	payload := randomPayload(9, size)
	go func() {
		for range n {
			if c.SendContext(ctx, Message{ID: 400, Payload: payload, Reliable: true}) != nil {
				return
			}
		}
	}()
	for i := range n {
		m, err := sc.Receive(ctx)
		require.NoError(t, err, "message %d", i)
		require.True(t, bytes.Equal(payload, m.Payload), "message %d", i)
	}
	return c.Stats(), c
}

func TestPMTUConnReadsLargeDatagrams(t *testing.T) {
	// Both ends read what the other may send: the client finds 9000
	// bytes carried end to end, through the endpoints' buffers.
	synctest.Test(t, func(t *testing.T) {
		cfg := testConfig()
		cfg.MaxPathDatagramSize = 9000
		st, _ := pmtuTransfer(t, memNet(t), cfg, cfg, 4, 1<<20)
		assert.Equal(t, 9000, st.PathDatagramSize)
		assert.Zero(t, st.Retransmits)
	})
}

func TestPMTUConnDefaultReceiver(t *testing.T) {
	// A receiver without MaxPathDatagramSize reads 2048 bytes at most:
	// larger probes are lost to it, and the client settles below.
	synctest.Test(t, func(t *testing.T) {
		cfg := testConfig()
		cfg.MaxPathDatagramSize = 9000
		st, c := pmtuTransfer(t, memNet(t), cfg, testConfig(), 4, 1<<20)
		// The search goes on after the transfer: wait for it (the
		// bubble's clock) to end.
		for range 100 {
			if st = c.Stats(); st.PathDatagramSize > 2048-pmtuGranularity {
				break
			}
			<-time.After(100 * time.Millisecond)
		}
		assert.LessOrEqual(t, st.PathDatagramSize, 2048)
		assert.Greater(t, st.PathDatagramSize, 2048-pmtuGranularity)
		assert.Zero(t, st.Retransmits)
	})
}

func TestPMTUSecureConn(t *testing.T) {
	// A secure connection: probes and bulk datagrams sealed, never two
	// plaintexts under one nonce, the size counted on the wire.
	synctest.Test(t, func(t *testing.T) {
		priv, pub, err := GenerateKey()
		require.NoError(t, err)
		ccfg, lcfg := testConfig(), testConfig()
		ccfg.ServerKey, lcfg.PrivateKey = pub, priv
		ccfg.MaxPathDatagramSize, lcfg.MaxPathDatagramSize = 9000, 9000
		withLedger(t, ccfg, lcfg)
		st, _ := pmtuTransfer(t, memNet(t), ccfg, lcfg, 4, 1<<20)
		assert.Equal(t, 9000, st.PathDatagramSize)
	})
}

func TestPMTUThroughputFigure(t *testing.T) {
	// The figure in docs/configuration.md, "Path MTU": 1 MiB messages over real
	// loopback, with discovery up to 9000 bytes and at the fixed 1400,
	// in turns; the medians.
	//
	//	go test -run TestPMTUThroughputFigure -v
	if testing.Short() {
		t.Skip("a figure, on real sockets")
	}
	const n, size, rounds = 128, 1 << 20, 5
	rates := map[int][]float64{}
	for r := range 2 * rounds {
		path := 0
		if r%2 == 1 {
			path = 9000
		}
		cfg := testConfig()
		cfg.MaxPathDatagramSize = path
		if path == 0 {
			cfg.MaxDatagramSize = 1400 // the fixed size, no discovery
		}
		start := time.Now()
		st, _ := pmtuTransfer(t, sysNet(), cfg, cfg, n, size)
		took := time.Since(start)
		rate := float64(n*size) / took.Seconds() / 1e6
		rates[path] = append(rates[path], rate)
		t.Logf("MaxPathDatagramSize %4d: datagrams of %4d B, %d x 1 MiB in %v: %.0f MB/s, %d datagrams sent",
			path, st.PathDatagramSize, n, took.Round(time.Millisecond), rate, st.DatagramsSent)
	}
	fixed, found := median(rates[0]), median(rates[9000])
	t.Logf("median: fixed 1400 %.0f MB/s, discovery to 9000 %.0f MB/s: %.2fx", fixed, found, found/fixed)
}

func median(v []float64) float64 {
	v = slices.Clone(v)
	slices.Sort(v)
	return v[len(v)/2]
}

func TestPMTULossyPath(t *testing.T) {
	t.Parallel()
	// Heavy random loss, and bursts: bulk datagrams and probes are lost
	// often. The size the path carries is seldom taken for a black hole
	// (each lost probe of it counts only once a smaller one got through
	// after it, and not while bulk datagrams are acked), and when it is,
	// nothing breaks: datagrams retired after all that the peer had are
	// dropped there as copies. Everything arrives, intact.
	var falseHoles uint64
	for i, tt := range []struct {
		loss, burst float64
	}{{0.3, 0}, {0.1, 4}} {
		seed := uint64(10 * i)
		cfg := &Config{MaxPathDatagramSize: 9000}
		up, down := sizeLimited(4000), sizeLimited(4000)
		up.Loss, up.BurstLen, up.Seed = tt.loss, tt.burst, seed
		down.Loss, down.BurstLen, down.Seed = tt.loss, tt.burst, seed+100
		p := newSimPair(t, cfg, cfg, up, down)
		p.connect()
		for i := range 4 {
			p.send(0, Message{ID: 400, Payload: randomPayload(uint64(i), 1<<20), Reliable: true})
		}
		ok := p.run(10*time.Minute, func() bool { return len(p.h[1].msgs) == 4 })
		st := p.client().snapshot()
		require.True(t, ok, "case %d loss %v burst %v: client %v, server %v; black holes %d retired %d", i, tt.loss, tt.burst, p.client().err, p.server().err, p.client().mtu().blackHoles, p.client().mtu().retiredCount)
		// Unordered messages: each arrives once, intact, in any order.
		got := map[int]bool{}
		for _, m := range p.h[1].msgs {
			j := slices.IndexFunc([]int{0, 1, 2, 3}, func(j int) bool { return bytes.Equal(randomPayload(uint64(j), 1<<20), m.Payload) })
			require.GreaterOrEqual(t, j, 0, "a message arrived corrupted")
			require.False(t, got[j], "message %d arrived twice", j)
			got[j] = true
		}
		t.Logf("loss %v burst %v: %d black holes, %d datagrams retired, size %d",
			tt.loss, tt.burst, p.client().mtu().blackHoles, p.client().mtu().retiredCount, st.PathDatagramSize)
		falseHoles += p.client().mtu().blackHoles
	}
	assert.LessOrEqual(t, falseHoles, uint64(2), "black holes taken from random loss")
}

func TestPMTUOutageIsNoBlackHole(t *testing.T) {
	t.Parallel()
	// A path that carries nothing for a while loses the probes of every
	// size: no size is to blame, and the size found stays.
	cfg := &Config{MaxPathDatagramSize: 9000}
	p := newSimPair(t, cfg, cfg, sizeLimited(4000), sizeLimited(4000))
	p.connect()
	p.send(0, Message{ID: 400, Payload: randomPayload(0, 1<<20), Reliable: true})
	require.True(t, p.run(time.Minute, func() bool { return !p.client().mtu().searching && len(p.h[1].msgs) == 1 }))
	for i := range 8 {
		p.send(0, Message{ID: 400, Payload: randomPayload(uint64(i), 1<<20), Reliable: true})
	}
	require.True(t, p.run(time.Minute, func() bool { return p.client().loss.sent.count > 10 }))
	p.cut = [2]bool{true, true}
	p.run(3*time.Second, nil)
	p.cut = [2]bool{}
	require.True(t, p.run(5*time.Minute, func() bool { return len(p.h[1].msgs) == 9 }))
	st := p.client().snapshot()
	assert.Zero(t, p.client().mtu().blackHoles)
	assert.Greater(t, st.PathDatagramSize, 4000-pmtuGranularity)
}

func TestPMTUBulkAckedIsNoBlackHole(t *testing.T) {
	t.Parallel()
	// Probes of the size found are lost (a middlebox that drops large
	// pings, or bad luck), and a bulk datagram now and then, but bulk
	// datagrams of that size are acked: the path carries it.
	cfg := &Config{MaxPathDatagramSize: 9000}
	p := newSimPair(t, cfg, cfg, sizeLimited(4000), sizeLimited(4000))
	p.connect()
	p.send(0, Message{ID: 400, Payload: randomPayload(0, 1<<20), Reliable: true})
	require.True(t, p.run(time.Minute, func() bool { return !p.client().mtu().searching && len(p.h[1].msgs) == 1 }))
	size := p.client().mtu().size
	n := 0
	p.drop = func(from int, b []byte) bool {
		if from != 0 || len(b) <= 1400 {
			return false
		}
		if b[2]&0x40 == 0 {
			return true // a probe
		}
		n++
		return n%20 == 0
	}
	for i := range 8 {
		p.send(0, Message{ID: 400, Payload: randomPayload(uint64(i), 1<<20), Reliable: true})
	}
	require.True(t, p.run(time.Minute, func() bool { return len(p.h[1].msgs) == 9 }))
	assert.Zero(t, p.client().mtu().blackHoles)
	assert.Equal(t, size, p.client().mtu().size)
}

func TestPMTULatestStateNotHeldByBulk(t *testing.T) {
	// Versions of reliable latest state go beside a transfer's bulk
	// datagrams, not after the transfer.
	cfg := &Config{MaxPathDatagramSize: 9000}
	p := newSimPair(t, cfg, cfg, sizeLimited(0), sizeLimited(0))
	p.connect()
	p.send(0, Message{ID: 400, Payload: randomPayload(0, 8<<20), Reliable: true})
	require.True(t, p.run(time.Minute, func() bool { return p.client().mtu().size == p.client().mtu().max }))
	p.send(0, Message{ID: 120, Payload: []byte("state"), Reliable: true, ContentID: 1})
	require.True(t, p.run(time.Minute, func() bool {
		for _, m := range p.h[1].msgs {
			if m.ID == 120 {
				return true
			}
		}
		return false
	}))
	assert.Len(t, p.h[1].msgs, 1, "the version arrived before the transfer ended")
}
