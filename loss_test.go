package knet

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// lossState on its own: a fixed clock, datagrams sent and acked by hand.

func newLoss(cfg *Config) *lossState {
	return &lossState{cfg: cfg.resolve()}
}

// sendN sends n datagrams of size bytes, PacketIDs from first, at now.
func sendN(l *lossState, now time.Time, first uint32, n, size int) []*sent {
	var ds []*sent
	for i := range n {
		ds = append(ds, l.sendNew(now, first+uint32(i), make([]byte, size)))
	}
	return ds
}

func ackIDs(l *lossState, now time.Time, ids ...uint32) ackResult {
	var r ackResult
	for _, id := range ids {
		l.onPacketAck(now, packetAck{base: id}, &r)
	}
	return r
}

func TestLossInFlightAndSample(t *testing.T) {
	l := newLoss(nil)
	ds := sendN(l, timeZero, 0, 3, 100)
	ds[1].appBytes = 40
	ds[1].transfers = append(ds[1].transfers, 7)
	assert.Equal(t, 300, l.inflight)
	now := timeZero.Add(20 * time.Millisecond)
	r := ackIDs(l, now, 0, 1)
	assert.Equal(t, 40, r.appBytes, "payload bytes freed")
	assert.Equal(t, []byte{7}, r.tids, "transfers freed")
	assert.Equal(t, 100, l.inflight)
	ev, ok := l.takeSample(now)
	require.True(t, ok)
	assert.Equal(t, 200, ev.AckedBytes)
	assert.Equal(t, 100, ev.InFlight)
	assert.Equal(t, 20*time.Millisecond, ev.RTT)
	assert.Equal(t, 20*time.Millisecond, l.rtt.srtt)
	_, ok = l.takeSample(now)
	assert.False(t, ok, "one sample per incoming datagram")
}

func TestLossPacketThreshold(t *testing.T) {
	// Three newer PacketIDs acked: lost at once, without waiting.
	l := newLoss(nil)
	sendN(l, timeZero, 0, 5, 100)
	now := timeZero.Add(20 * time.Millisecond)
	ackIDs(l, now, 3)
	l.takeSample(now) // an RTT of 20ms
	lost, ok := l.detectLoss(now)
	require.True(t, ok)
	assert.Equal(t, 100, lost, "only 0 is three behind 3")
	assert.Equal(t, uint64(1), l.fastRetransmits)
	d := l.nextResend()
	require.NotNil(t, d)
	assert.Equal(t, uint32(0), d.packetID)
	// 1 and 2 go once the time threshold passes without their acks.
	require.False(t, l.lossTime.IsZero())
	later := l.lossTime
	lost, _ = l.detectLoss(later)
	assert.Equal(t, 200, lost)
}

func TestLossBySendTimeAfterResend(t *testing.T) {
	// A resent datagram keeps its PacketID: that it was lost again shows
	// only by send time, when a datagram sent after the resend is acked.
	l := newLoss(nil)
	sendN(l, timeZero, 0, 2, 100)
	now := timeZero.Add(20 * time.Millisecond)
	ackIDs(l, now, 1)
	l.takeSample(now)
	l.detectLoss(now.Add(30 * time.Millisecond))
	d := l.nextResend()
	require.NotNil(t, d, "0 found lost by time")
	resentAt := now.Add(30 * time.Millisecond)
	l.resend(resentAt, d)
	assert.Nil(t, l.nextResend())
	after := sendN(l, resentAt.Add(time.Millisecond), 2, 1, 100)
	at := resentAt.Add(22 * time.Millisecond)
	ackIDs(l, at, after[0].packetID)
	l.takeSample(at)
	lost, _ := l.detectLoss(at.Add(5 * time.Millisecond))
	assert.Equal(t, 100, lost, "the resend of 0 is lost too")
	assert.Equal(t, uint32(0), l.nextResend().packetID)
}

func TestLossAmbiguousAckAfterResend(t *testing.T) {
	// The first send's ack arriving just after the resend must not pass
	// for the resend's: every datagram sent before would seem lost.
	l := newLoss(nil)
	sendN(l, timeZero, 0, 1, 100)
	ackIDs(l, timeZero.Add(20*time.Millisecond), 0)
	l.takeSample(timeZero.Add(20 * time.Millisecond))
	ds := sendN(l, timeZero.Add(30*time.Millisecond), 1, 10, 100)
	resentAt := timeZero.Add(60 * time.Millisecond)
	require.True(t, l.markLost(ds[0], false))
	l.resend(resentAt, l.nextResend())
	ackIDs(l, resentAt.Add(time.Millisecond), 1) // the first send's ack
	lost, _ := l.detectLoss(resentAt.Add(time.Millisecond))
	assert.Zero(t, lost, "datagrams sent before the resend taken for lost")
	assert.Equal(t, uint64(1), l.spuriousLosses, "the resend was needless")
}

func TestLossSpuriousWidensReordering(t *testing.T) {
	l := newLoss(nil)
	sendN(l, timeZero, 0, 5, 100)
	now := timeZero.Add(20 * time.Millisecond)
	ackIDs(l, now, 4)
	l.takeSample(now)
	l.detectLoss(now)
	require.NotNil(t, l.nextResend())
	ackIDs(l, now.Add(time.Millisecond), 0, 1) // late, not lost
	assert.Equal(t, uint64(2), l.spuriousLosses)
	reo := l.reorderTolerance(now)
	assert.Positive(t, reo)
	assert.Less(t, l.reorderTolerance(now.Add(9*time.Second)), reo, "halves without more")
	assert.Nil(t, l.nextResend(), "acked ones do not go again")
}

func TestLossProbeTimeout(t *testing.T) {
	cfg := &Config{MaxMessageSendCount: 3}
	l := newLoss(cfg)
	_, ok := l.nextTimeout(false)
	assert.False(t, ok, "nothing in flight")
	sendN(l, timeZero, 0, 3, 100)
	at, ok := l.nextTimeout(false)
	require.True(t, ok)
	assert.Equal(t, timeZero.Add(time.Second), at, "the initial RTO before any sample")
	probed, ok := l.onProbeTimeout(at, nil)
	assert.True(t, probed)
	assert.True(t, ok)
	for _, want := range []uint32{0, 1} {
		d := l.nextResend()
		require.NotNil(t, d, "two probes")
		assert.Equal(t, want, d.packetID)
		l.resend(at, d)
	}
	next, _ := l.nextTimeout(false)
	assert.Equal(t, 2*time.Second, next.Sub(at), "backed off")
	closing, _ := l.nextTimeout(true)
	assert.Equal(t, l.cfg.disconnect/8, closing.Sub(at), "at most an eighth of DisconnectTimeout while closing")
	// The third send of 0 is its last: the next probe finds it spent.
	l.onProbeTimeout(next, nil)
	l.resend(next, l.nextResend())
	l.resend(next, l.nextResend())
	_, ok = l.onProbeTimeout(next.Add(time.Hour), nil)
	assert.False(t, ok, "MaxMessageSendCount reached")
}

// A probe passes over the datagrams that would send nothing again (versions
// of latest state all replaced since): they are queued, to be given up,
// and the two oldest that still carry something are the probe. With none
// such, nothing is probed and the timer does not back off.
func TestLossProbePassesOverObsolete(t *testing.T) {
	l := newLoss(&Config{MaxMessageSendCount: 3})
	ds := sendN(l, timeZero, 0, 6, 100)
	obsolete := map[*sent]bool{ds[0]: true, ds[1]: true, ds[3]: true, ds[5]: true}
	ds[0].lostSends = 5 // past the limit, but it goes no more: not the connection's end
	at, _ := l.nextTimeout(false)
	probed, ok := l.onProbeTimeout(at, func(d *sent) bool { return obsolete[d] })
	require.True(t, ok)
	assert.True(t, probed)
	assert.Equal(t, 1, l.ptoCount)
	var order []uint32
	for d := l.nextResend(); d != nil; d = l.nextResend() {
		order = append(order, d.packetID)
		l.abandon(d)
	}
	assert.Equal(t, []uint32{0, 1, 2, 3, 4}, order, "obsolete ones queued in turn, up to the second probe")
	assert.Equal(t, 100, l.inflight, "the one after the probes is still in flight")
	// Only an obsolete one left: no probe.
	at, _ = l.nextTimeout(false)
	probed, ok = l.onProbeTimeout(at, func(d *sent) bool { return obsolete[d] })
	require.True(t, ok)
	assert.False(t, probed)
	assert.Equal(t, 1, l.ptoCount, "no back-off for a probe that sends nothing")
	_, armed := l.nextTimeout(false)
	assert.False(t, armed, "nothing left in flight to time")
}

func TestLossProbeBackoffCap(t *testing.T) {
	l := newLoss(nil)
	sendN(l, timeZero, 0, 1, 100)
	ackIDs(l, timeZero.Add(10*time.Millisecond), 0)
	l.takeSample(timeZero.Add(10 * time.Millisecond))
	sendN(l, timeZero.Add(20*time.Millisecond), 1, 1, 100)
	l.ptoCount = 20
	assert.Equal(t, maxProbeBackoff, l.probeTimeout(false), "four RTOs or 500ms, not DatagramTimeout")
}

func TestLossRetryNowIsNoProbe(t *testing.T) {
	l := newLoss(nil)
	sendN(l, timeZero, 0, 2, 100)
	assert.True(t, l.retryNow(timeZero), "nothing backed off: nothing to do")
	assert.Nil(t, l.nextResend())
	l.onProbeTimeout(timeZero.Add(time.Second), nil)
	l.resend(timeZero.Add(time.Second), l.nextResend())
	l.resend(timeZero.Add(time.Second), l.nextResend())
	now := timeZero.Add(1500 * time.Millisecond)
	assert.True(t, l.retryNow(now))
	assert.Zero(t, l.ptoCount)
	assert.NotNil(t, l.nextResend(), "the oldest goes again at once")
	at, _ := l.nextTimeout(false)
	assert.Equal(t, now.Add(time.Second), at, "the timer starts afresh")
}

func TestLossDrop(t *testing.T) {
	l := newLoss(nil)
	ds := sendN(l, timeZero, 0, 3, 100)
	for _, d := range ds {
		d.appBytes = 10
	}
	ackIDs(l, timeZero.Add(time.Millisecond), 1)
	l.markLost(ds[2], true)
	assert.Equal(t, 20, l.drop(), "payload of what was not acked")
	assert.Zero(t, l.inflight)
	assert.Nil(t, l.nextResend())
	assert.Zero(t, l.sent.count)
}

// A PacketAck is taken by range: what it names in flight is acked, and
// nothing else, the same as acking each PacketID it names on its own,
// whatever the PacketIDs between those in flight (unreliable datagrams,
// skipped ones), the acks before, the resends under new PacketIDs (the
// reference dialect) and the wrap.
func TestLossAckByRange(t *testing.T) {
	for seed := range uint64(200) {
		rng := rand.New(rand.NewPCG(seed, 38))
		rekeys := seed%2 == 1
		build := func() (*lossState, []uint32) {
			l := newLoss(nil)
			l.rekeys = rekeys
			rng := rand.New(rand.NewPCG(seed, 1))
			id := uint32(packetIDMask - 200 + rng.IntN(400))
			var ids []uint32
			for i := range 150 {
				id = (id + 1 + uint32(rng.IntN(3))) & packetIDMask
				ids = append(ids, id)
				d := l.sendNew(timeZero, id, make([]byte, 10))
				d.appBytes, d.relFirst, d.relCount = 1+i, uint32(i), 1
			}
			if rekeys {
				// Some go again under new PacketIDs.
				for range 10 {
					d, _ := l.sent.find(ids[rng.IntN(len(ids))])
					if d != nil && !d.acked {
						id = (id + 1) & packetIDMask
						l.sent.rekey(d, id)
						ids = append(ids, id)
					}
				}
			}
			return l, ids
		}
		ranged, ids := build()
		byID, _ := build()
		now := timeZero.Add(30 * time.Millisecond)
		for range 40 {
			base := (ids[rng.IntN(len(ids))] - 20 + uint32(rng.IntN(40))) & packetIDMask
			a := packetAck{base: base, more: rng.Uint64() & (1<<packetAckBits - 1) & rng.Uint64()}
			var r1, r2 ackResult
			ranged.onPacketAck(now, a, &r1)
			a.each(func(id uint32) {
				if d, through := byID.sent.find(id); d != nil {
					byID.ackOne(now, d, through, &r2)
				}
			})
			require.Equal(t, r2, r1, "seed %d: PacketAck %+v", seed, a)
			require.Equal(t, byID.sent.count, ranged.sent.count, "seed %d", seed)
			require.Equal(t, byID.inflight, ranged.inflight, "seed %d", seed)
			if rng.IntN(4) == 0 {
				ranged.sent.trim(nil)
				byID.sent.trim(nil)
			}
		}
		for k := range ranged.sent.n {
			require.Equal(t, byID.sent.at(k).acked, ranged.sent.at(k).acked, "seed %d: entry %d", seed, k)
		}
	}
}

// BenchmarkPacketAcks takes 139 PacketAcks, a datagram's worth, naming
// every PacketID of 3,000 reliable datagrams in flight (the front one
// never acked, so that the acked ones stay in the window): ns/op is per
// PacketAck, each naming 35 PacketIDs.
func BenchmarkPacketAcks(b *testing.B) {
	const inFlight, acks = 3000, 139
	l := newLoss(nil)
	sendN(l, timeZero, 1000, inFlight, 1200)
	now := timeZero.Add(20 * time.Millisecond)
	var r ackResult
	b.ReportAllocs()
	for b.Loop() {
		for i := range acks {
			l.onPacketAck(now, packetAck{base: 1001 + uint32(i*packetAckSpan)%(inFlight-packetAckSpan), more: 1<<packetAckBits - 1}, &r)
		}
		r = ackResult{tids: r.tids[:0], rels: r.rels[:0]}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*acks), "ns/PacketAck")
}
