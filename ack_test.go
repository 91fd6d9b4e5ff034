package knet

import (
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/netsim"
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

// Acks sent again are those of the last keep, newest first, at most room
// of them, whatever the ring did meanwhile; and the ring holds about what
// keep needs, not maxRecentAcks on every connection.
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
				model = append(model, sent{a: packetAck{base: base}, at: now})
			}
			q.remember(now, acks, keep)
			back := time.Duration(rng.Int64N(int64(keep) + 1))
			room := 1 + rng.IntN(40)
			var want []packetAck
			for k := len(model) - 1; k >= 0 && len(model)-k <= maxRecentAcks && len(want) < room; k-- {
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

// A loaded round acks many datagrams at once: one ack datagram holds many
// fresh PacketAcks (the contiguous run, and one for each resend that
// filled a hole), and the next one carries them all again, as room and
// credit allow: an ack datagram lost in a burst costs the peer nothing if
// the one after it gets through.
func TestAckQueueRepeatsBurst(t *testing.T) {
	var q ackQueue
	var burst []packetAck
	for i := range 100 {
		burst = append(burst, packetAck{base: uint32(i) * 40})
	}
	q.remember(timeZero, burst, time.Second)
	got := q.repeats(nil, timeZero, 120)
	require.Len(t, got, 100, "a burst of 100 goes again whole")
	assert.Equal(t, burst[99], got[0], "newest first")
	assert.Len(t, q.repeats(nil, timeZero, 120), 100, "and again: only the window and the peer's confirmation end repeats")
	assert.Len(t, q.repeats(nil, timeZero, 30), 30, "at most room")
	assert.Empty(t, q.repeats(nil, timeZero.Add(time.Nanosecond), 120), "none sent since notBefore")
}

// A PacketAck that rode in a reliable datagram of ours goes again no more
// once that datagram is acked, or recycled (acked and trimmed: carried
// names only datagrams that leave the window acked); one that rode in an
// unreliable datagram, or in one not acked yet, still goes again.
func TestAckQueueConfirmed(t *testing.T) {
	var q ackQueue
	var w sentWindow
	now := timeZero
	d1 := w.push(now, 10, nil)
	q.remember(now, []packetAck{{base: 1}, {base: 50}}, time.Second)
	q.carried(d1, 2)
	d2 := w.push(now, 11, nil)
	q.remember(now, []packetAck{{base: 100}}, time.Second)
	q.carried(d2, 1)
	q.remember(now, []packetAck{{base: 150}}, time.Second) // unreliable: never confirmed
	q.remember(now, []packetAck{{base: 200}}, time.Second)
	q.carried(&sent{}, 0) // none: an unreliable datagram's

	bases := func(acks []packetAck) (b []uint32) {
		for _, a := range acks {
			b = append(b, a.base)
		}
		return b
	}
	assert.Equal(t, []uint32{200, 150, 100, 50, 1}, bases(q.repeats(nil, timeZero, 10)))
	w.ack(d1, false)
	assert.Equal(t, []uint32{200, 150, 100}, bases(q.repeats(nil, timeZero, 10)), "d1 acked")
	w.ack(d2, false)
	w.trim(nil)
	w.push(now, 12, nil) // d2's struct again, perhaps, under a new generation
	assert.Equal(t, []uint32{200, 150}, bases(q.repeats(nil, timeZero, 10)), "d2 acked and trimmed")
}

// The ack credit: earned by what the peer sends, up to its cap, spent by
// what we send back, and paying for repeats only past the datagram.
func TestAckCredit(t *testing.T) {
	var q ackQueue
	const maxDatagram = 1200
	q.earn(3, maxDatagram) // an empty reliable datagram: 31 bytes on the wire
	assert.EqualValues(t, 2*31, q.credit)
	// An ack-only datagram of one PacketAck (13 bytes, 41 on the wire)
	// leaves 21: two more PacketAcks of 10.
	assert.Equal(t, 2, q.affords(3+ackBlock, ackBlock))
	q.spend(3+ackBlock+ackWireOverhead, maxDatagram)
	assert.Equal(t, 0, q.affords(3+ackBlock, ackBlock), "the next datagram pays for itself first")
	q.earn(3, maxDatagram)
	assert.Equal(t, 4, q.affords(3+ackBlock, ackBlock), "what was left, and what the next earned")
	q.spend(3+ackBlock+ackWireOverhead, maxDatagram)
	q.spend(3+ackBlock+ackWireOverhead, maxDatagram)
	assert.Equal(t, 0, q.affords(3+ackBlock, ackBlock))
	for range 100 {
		q.earn(maxDatagram, maxDatagram)
	}
	assert.EqualValues(t, ackCreditCap(maxDatagram), q.credit, "banked up to the cap")
	for range 100 {
		q.spend(maxDatagram, maxDatagram)
	}
	assert.EqualValues(t, -ackCreditCap(maxDatagram), q.credit, "in debt down to the cap")
	assert.Equal(t, 0, q.affords(0, ackBlock), "in debt: no repeats")
}

// ackReplies is what a server session sent back for n gap-opening
// datagrams (empty, reliable, PacketIDs peerGapSpacing apart: each opens
// a gap, acked at once), one every cadence, with its smoothed RTT set to
// srtt: the bytes each way on the wire (ackWireOverhead each), the
// datagrams back, the PacketAcks in them (the most in one), the PacketIDs
// they named (counting each time), and whether every PacketID the peer
// sent was acked.
type ackReply struct {
	in, out, outN, blocks int
	maxBlocks, named      int
	allAcked              bool
}

func ackReplies(t *testing.T, secure bool, cadence, srtt time.Duration, n int, during func(i int, s *session)) ackReply {
	b := newPeerBench(t, peerShape{name: "gaps", next: func(g *peerGen) []byte {
		g.pid += peerGapSpacing
		return appendDatagram(nil, &datagram{header: header{packetID: g.pid - peerGapSpacing, reliable: true}})
	}}, secure)
	srv := b.srv
	srv.loss.rtt = rttEstimator{srtt: srtt, rttvar: srtt / 2, min: srtt, samples: 1}
	b.prepare(n)
	sent := map[uint32]bool{}
	var r ackReply
	var d datagram
	flush := func() {
		for {
			out := srv.poll(b.now, b.buf)
			if out == nil {
				return
			}
			require.NoError(t, parseInto(out, &d))
			blocks := 0
			for _, m := range d.msgs {
				if !m.fragment && m.id == idPacketAck {
					a, ok := parsePacketAck(m.payload)
					require.True(t, ok)
					a.each(func(id uint32) {
						delete(sent, id)
						r.named++
					})
					blocks++
				}
			}
			r.blocks += blocks
			r.maxBlocks = max(r.maxBlocks, blocks)
			if secure {
				var err error
				out, err = b.p.sec[1].sealOut(srv, out, b.spare)
				require.NoError(t, err)
			}
			r.out += len(out) + ackWireOverhead
			r.outN++
		}
	}
	for i, dg := range b.batch {
		if during != nil {
			during(i, srv)
		}
		var h header
		b.now = b.now.Add(cadence)
		if !srv.nextDeadline(b.now).After(b.now) {
			srv.advance(b.now)
		}
		srv.beginRound()
		if secure {
			pt, fresh := b.p.sec[1].in(srv, b.now, dg, true)
			require.NotNil(t, pt)
			_, err := parseHeader(pt, &h)
			require.NoError(t, err)
			sent[h.packetID] = true
			srv.handleSealed(b.now, pt, fresh)
		} else {
			_, err := parseHeader(dg, &h)
			require.NoError(t, err)
			sent[h.packetID] = true
			srv.handleDatagram(b.now, dg)
		}
		r.in += len(dg) + ackWireOverhead
		flush()
	}
	for range 100 {
		b.now = b.now.Add(10 * time.Millisecond)
		srv.advance(b.now)
		flush()
	}
	require.NoError(t, srv.err)
	r.allAcked = len(sent) == 0
	return r
}

// Gap-opening datagrams get back at most twice what they cost the peer
// (ackCreditRatio), on the wire, at any pace and whatever the smoothed RTT (a 9s one
// repeated every ack of the last 4.5s, up to ~139 PacketAcks a datagram:
// issue 38), and every PacketID the peer sent is acked.
func TestSessionAckRepliesBounded(t *testing.T) {
	for _, secure := range []bool{false, true} {
		for _, srtt := range []time.Duration{40 * time.Millisecond, 9 * time.Second} {
			for _, cadence := range []time.Duration{0, 150 * time.Microsecond, 5 * time.Millisecond} {
				r := ackReplies(t, secure, cadence, srtt, 2000, nil)
				ratio := float64(r.out) / float64(r.in)
				t.Logf("secure %v, srtt %v, one every %v: %.2fx, %d datagrams back, %.1f PacketAcks each, at most %d",
					secure, srtt, cadence, ratio, r.outN, float64(r.blocks)/float64(r.outN), r.maxBlocks)
				assert.LessOrEqual(t, ratio, ackCreditRatio+0.1, "the credit's ratio, and the cap's slack")
				assert.LessOrEqual(t, r.outN, 2000+2, "at most one datagram back for each (and a ping)")
				assert.True(t, r.allAcked, "every PacketID the peer sent is acked")
			}
		}
	}
}

// Out of credit, fresh acks still go, every one of them, and nothing is
// repeated.
func TestSessionAckCreditPaysForRepeats(t *testing.T) {
	r := ackReplies(t, false, time.Millisecond, 40*time.Millisecond, 500, func(i int, s *session) {
		s.acks.credit = -1 << 30 // deep in debt before each datagram: nothing pays it off
	})
	t.Logf("out of credit: %d datagrams back, %d PacketAcks naming %d PacketIDs", r.outN, r.blocks, r.named)
	assert.Equal(t, 500, r.named, "each PacketID acked once")
	assert.True(t, r.allAcked)
	r = ackReplies(t, false, time.Millisecond, 40*time.Millisecond, 500, nil)
	t.Logf("with credit: %d datagrams back, %d PacketAcks naming %d PacketIDs", r.outN, r.blocks, r.named)
	assert.Greater(t, r.named, 2*500, "with credit, acks go again")
}

// An ack that rode in a reliable datagram goes again until that datagram
// is acked, and no more after: the peer has it. (The smoothed RTT is set
// to 10s so that the repeat window, half of it, does not end the repeats
// first.)
func TestSessionAckConfirmedNotRepeated(t *testing.T) {
	path := netsim.Params{Delay: 10 * time.Millisecond}
	p := newSimPair(t, nil, nil, path, path)
	p.connect()
	p.run(100*time.Millisecond, nil) // the handshake's acks
	srv := p.server()
	srv.loss.rtt = rttEstimator{srtt: 10 * time.Second, rttvar: time.Second, min: 20 * time.Millisecond, samples: 1}
	p.send(0, Message{ID: 100, Payload: []byte("ping"), Reliable: true})
	require.True(t, p.run(time.Second, func() bool { return len(p.h[1].msgs) == 1 }))
	first := p.client().send.nextPID - 1
	p.send(1, Message{ID: 100, Payload: []byte("pong"), Reliable: true}) // the ack rides in it
	var named []bool
	p.tap = func(from int, b []byte) {
		var d datagram
		if from != 1 || parseInto(b, &d) != nil || d.header.reliable {
			return
		}
		has := false
		for _, m := range d.msgs {
			if a, ok := parsePacketAck(m.payload); ok && !m.fragment && m.id == idPacketAck {
				a.each(func(id uint32) { has = has || id == first })
			}
		}
		named = append(named, has)
	}
	gap := func() {
		pid := (p.client().send.nextPID + 1000) & packetIDMask
		p.client().startPIDAt(pid + 1)
		p.inject(1, appendDatagram(nil, &datagram{header: header{packetID: pid, reliable: true}}))
	}
	p.run(time.Millisecond, nil) // the pong goes, with the ack
	require.Equal(t, 1, srv.loss.sent.count)
	gap()
	p.flush()
	require.Equal(t, []bool{true}, named, "the pong not acked yet: the ack goes again")
	require.True(t, p.run(time.Second, func() bool { return srv.loss.sent.count == 0 }))
	named = nil
	gap()
	p.flush()
	require.Equal(t, []bool{false}, named, "the pong acked: the ack it carried goes again no more")
}

// A download over a path that loses in bursts (5%, bursts of 3-8ms both
// ways), its receiver taking 1-2ms of datagrams a round, so that it sends
// an ack datagram every 1-2ms: each burst takes several of them. The acks
// of the last half round trip go again in every one, so the first to get
// through after a burst carries what the burst took, and the sender
// resends nothing that arrived. (Four repeats of each PacketAck, 32 a
// datagram, were over within one burst: 28-369 needless resends.)
func TestAckRepeatsOutlastBursts(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		batch, burst time.Duration
		seed         uint64
	}{
		{time.Millisecond, 3 * time.Millisecond, 3},
		{time.Millisecond, 3 * time.Millisecond, 4},
		{2 * time.Millisecond, 8 * time.Millisecond, 1},
		{2 * time.Millisecond, 8 * time.Millisecond, 4},
	} {
		up := netsim.Params{Loss: 0.05, BurstDuration: c.burst, Delay: 20 * time.Millisecond, Bandwidth: 20 << 20, Seed: c.seed}
		down := netsim.Params{Loss: 0.05, BurstDuration: c.burst, Delay: 20 * time.Millisecond, Seed: c.seed + 100}
		p := newSimPair(t, &Config{}, &Config{}, up, down)
		p.batch = c.batch
		p.connect()
		const n = 10000
		payload := make([]byte, 1100)
		sent := 0
		require.True(t, p.run(20*time.Second, func() bool {
			for sent < n && p.client().send.relQ.len() < 200 {
				p.send(0, Message{ID: 9, Payload: payload, Reliable: true, InOrder: true})
				sent++
			}
			return len(p.h[1].msgs) == n
		}))
		c2, s := p.client().snapshot(), p.server().snapshot()
		t.Logf("rounds of %v, bursts of %v, seed %d: delivered in %v, %d resends, %d received twice; %d ack datagrams, %d bytes",
			c.batch, c.burst, c.seed, p.now.Sub(timeZero), c2.Retransmits, s.DuplicateDatagrams, s.DatagramsSent, s.BytesSent)
		assert.LessOrEqual(t, s.DuplicateDatagrams, uint64(10), "needless resends")
	}
}
