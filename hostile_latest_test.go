package knet

import (
	"encoding/binary"
	"testing"
	"time"

	"github.com/knet-go/knet/internal/netsim"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// isLatestDatagram reports whether b is a reliable datagram of versions
// (its first block a tag).
func isLatestDatagram(b []byte) bool {
	d, _, err := parseDatagram(b)
	if err != nil || !d.header.reliable || len(d.msgs) < 2 {
		return false
	}
	_, ok := parseLatestTag(d.msgs[0].payload)
	return d.msgs[0].id == idExt && !d.msgs[0].fragment && ok
}

// latestTagsIn returns the tags of the versions in b, with their
// MessageIDs.
func latestTagsIn(b []byte) (ids []uint32, tags []latestTag) {
	d, _, err := parseDatagram(b)
	if err != nil || !d.header.reliable {
		return nil, nil
	}
	for i := 0; i+1 < len(d.msgs); i++ {
		if m := &d.msgs[i]; m.id == idExt && !m.fragment {
			if tag, ok := parseLatestTag(m.payload); ok {
				ids = append(ids, d.msgs[i+1].id)
				tags = append(tags, tag)
			}
		}
	}
	return ids, tags
}

// A path that loses every datagram of versions (a black hole for datagrams
// of their size, say) while the peer stays alive: a datagram of versions
// found lost is abandoned and its versions go again in a new datagram,
// each sent once, so the retransmission limit, which ends a connection
// whose plain reliable datagram went MaxMessageSendCount times, never
// came. The connection must end as it would with plain reliable messages,
// not retry forever with the version's receipt never told.
func TestHostileLatestBlackHoleHitsRetransmitLimit(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name             string
		latest, changing bool
	}{{"plain", false, false}, {"latest", true, false}, {"latest changing", true, true}} {
		latest := c.latest
		t.Run(c.name, func(t *testing.T) {
			cfg := &Config{Receipts: true, MaxMessageSendCount: 6, DatagramTimeout: 100 * time.Millisecond}
			p := newSimPair(t, cfg, nil, perfect, perfect)
			p.connect()
			p.run(100*time.Millisecond, nil)
			p.drop = func(from int, b []byte) bool {
				if from != 0 {
					return false
				}
				d, _, err := parseDatagram(b)
				if err != nil || !d.header.reliable {
					return false
				}
				for _, m := range d.msgs {
					if m.id == 120 {
						return true
					}
				}
				return false
			}
			m := Message{ID: 120, Payload: versionPayload(1, 100), Reliable: true}
			if latest {
				m.ContentID = 7
			}
			ref := p.send(0, m)
			for v := 2; c.changing && v < 10_000 && !p.client().done(); v++ {
				// A new version every 10ms, each replacing the last.
				m.Payload = versionPayload(v, 100)
				ref = p.send(0, m)
				p.run(10*time.Millisecond, nil)
			}
			p.run(5*time.Minute, func() bool { return p.client().done() })
			require.True(t, p.client().done(), "a connection whose data never gets through ends")
			assert.ErrorIs(t, p.client().err, ErrRetransmitLimit)
			assert.Equal(t, []bool{false}, receiptsOf(p.h[0].receipts)[ref], "told lost, once")
		})
	}
}

// A version that does not fit the room left in a datagram of versions is
// passed over and later ones placed: those are done but stay in the
// queue behind it. The next datagram of versions must not send them
// again: a second copy counts their bytes as sent twice, so the send
// buffer is released twice over (SendBuffer no longer bounds what is
// queued).
func TestHostileLatestPassedOverVersionsGoOnce(t *testing.T) {
	p := newSimPair(t, nil, nil, perfect, perfect)
	p.connect()
	p.run(100*time.Millisecond, nil)
	sends := map[uint32]int{}
	p.tap = func(from int, b []byte) {
		if from != 0 {
			return
		}
		ids, _ := latestTagsIn(b)
		for _, id := range ids {
			sends[id]++
		}
	}
	released := p.h[0].released
	total := 0
	for i, size := range []int{1000, 1000, 10} {
		m := Message{ID: uint32(120 + i), Payload: versionPayload(1, size), Reliable: true, ContentID: 1}
		total += len(m.Payload)
		p.send(0, m)
	}
	require.True(t, p.run(5*time.Second, func() bool {
		return len(p.h[1].msgs) == 3 && p.client().loss.sent.count == 0 && p.client().latestQueued() == 0
	}))
	p.run(time.Second, nil)
	assert.Equal(t, map[uint32]int{120: 1, 121: 1, 122: 1}, sends, "each version sent once")
	assert.Equal(t, total, p.h[0].released-released, "each version's bytes released once")
	assert.Zero(t, p.server().snapshot().ObsoleteMessages)
}

// Version numbers are compared as serial numbers (RFC 1982): one 2^31 or
// more ahead of the newest taken reads as older. Counted per connection,
// a state left alone while 2^31 versions of others went (hours, for a
// server sending a few thousand states at 60 Hz) would have its next
// version dropped by the receiver, though acked and told delivered. So
// each state counts its own versions: two versions of a state in a row
// carry consecutive numbers, whatever went between.
func TestHostileLatestNumbersCountedPerState(t *testing.T) {
	p := newSimPair(t, nil, nil, perfect, perfect)
	p.connect()
	p.run(100*time.Millisecond, nil)
	got := map[uint32][]uint32{}
	p.tap = func(from int, b []byte) {
		if from != 0 {
			return
		}
		ids, tags := latestTagsIn(b)
		for i, id := range ids {
			got[id] = append(got[id], tags[i].ver)
		}
	}
	p.send(0, Message{ID: 120, Payload: versionPayload(1, 8), Reliable: true, ContentID: 1})
	p.run(100*time.Millisecond, nil)
	for v := range 50 {
		p.send(0, Message{ID: 121, Payload: versionPayload(v, 8), Reliable: true, ContentID: 1})
		p.run(time.Millisecond, nil)
	}
	p.send(0, Message{ID: 120, Payload: versionPayload(2, 8), Reliable: true, ContentID: 1})
	p.run(100*time.Millisecond, nil)
	require.Len(t, got[120], 2)
	assert.Equal(t, got[120][0]+1, got[120][1], "state 120's numbers: %v", got[120])
}

// The receiver's side of the serial numbers, as documented: a version
// less than 2^31 ahead of the newest taken is newer, one 2^31 or more
// ahead (or behind) is older; the u32 wraps.
func TestHostileLatestSerialNumberBound(t *testing.T) {
	p := newSimPair(t, nil, nil, perfect, perfect)
	s := p.server()
	k := contentKey{120, 1}
	require.True(t, s.takeVersion(k, 0xffff_fff0))
	assert.True(t, s.takeVersion(k, 5), "wraps")
	assert.False(t, s.takeVersion(k, 5), "a copy")
	assert.False(t, s.takeVersion(k, 5+1<<31), "2^31 ahead reads as older")
	assert.True(t, s.takeVersion(k, 4+1<<31))
}

// A peer cycling more states than a receiver keeps (maxLatestStates)
// evicts the record of earlier ones: an old version of an evicted state
// is then taken, as documented. The record stays bounded.
func TestHostileLatestEvictionBound(t *testing.T) {
	p := newSimPair(t, nil, nil, perfect, perfect)
	s := p.server()
	old := contentKey{120, 1}
	require.True(t, s.takeVersion(old, 100))
	for c := range uint32(4 * maxLatestStates) {
		s.takeVersion(contentKey{121, c}, 1)
		require.LessOrEqual(t, len(s.x.seen.newest), maxLatestStates)
	}
	_, kept := s.x.seen.newest[old]
	if !kept {
		assert.True(t, s.takeVersion(old, 50), "forgotten: an older version is taken")
	}
}

// A datagram of versions given up while it is the oldest in flight, with
// the span of PacketIDs full behind it (DECISIONS §4: 2^15 sent since
// the oldest unacked): abandoned as if acked, it must leave the window's
// front at once. Left there until the next ack trims it, it still counted
// as the oldest unacked, so no new datagram could go (spanFull), not even
// the one carrying its versions again, and with nothing in flight no ack
// ever came to trim it: the connection was wedged.
func TestHostileLatestAbandonedAtSpanEdge(t *testing.T) {
	p := newSimPair(t, nil, nil, perfect, perfect)
	p.connect()
	p.run(100*time.Millisecond, nil)
	drop := true
	p.drop = func(from int, b []byte) bool { return drop && from == 0 && isLatestDatagram(b) }
	p.send(0, Message{ID: 120, Payload: versionPayload(1, 8), Reliable: true, ContentID: 1})
	p.run(time.Millisecond, nil)
	c := p.client()
	first := c.loss.sent.firstUnacked()
	require.NotNil(t, first)
	// As if 2^15 datagrams had gone since (a busy unreliable stream,
	// which the server saw).
	for pid := first.packetID + 1; pid < first.packetID+recvSpan-1; pid += 512 {
		h := header{packetID: pid}
		p.inject(1, appendMessage(appendHeader(nil, &h), &message{id: idPadding}))
	}
	c.startPIDAt(first.packetID + recvSpan - 1)
	require.True(t, c.spanFull())
	drop = false
	require.True(t, p.run(30*time.Second, func() bool { return len(p.h[1].msgs) == 1 }),
		"the version goes again once its datagram is given up")
	assert.Equal(t, stateOK, c.state)
}

// A message of higher priority that names a version in DependsOn waits
// at the sender until the version is acked. The version must still go:
// datagrams of versions went only when the head of the other reliable
// messages was of no higher priority, and that head was the message
// waiting for it, so neither ever went. Whether the version was queued
// when the message came (raise does not look at versions), or given up
// with its datagram after and queued again at its own priority.
func TestHostileLatestDependsOnVersionWithPriority(t *testing.T) {
	for _, lost := range []bool{false, true} {
		t.Run(map[bool]string{false: "queued", true: "requeued"}[lost], func(t *testing.T) {
			p := newSimPair(t, nil, nil, perfect, perfect)
			p.connect()
			p.run(100*time.Millisecond, nil)
			dropped := false
			p.drop = func(from int, b []byte) bool {
				if lost && !dropped && from == 0 && isLatestDatagram(b) {
					dropped = true
					return true
				}
				return false
			}
			v := p.send(0, Message{ID: 120, Payload: versionPayload(1, 8), Reliable: true, ContentID: 1})
			if lost {
				p.run(time.Millisecond, nil)
				require.True(t, dropped)
			}
			p.send(0, Message{ID: 130, Payload: []byte("after"), Reliable: true, Priority: 5, DependsOn: []Ref{v}})
			require.True(t, p.run(5*time.Second, func() bool { return len(p.h[1].msgs) == 2 }), "both go")
			assert.Equal(t, uint32(120), p.h[1].msgs[0].ID)
			assert.Equal(t, uint32(130), p.h[1].msgs[1].ID)
		})
	}
}

// A version given up with its datagram, replaced meanwhile, is let go of
// (its track dropped). It must not become an anchor, the message known
// applied that an in-order message naming nothing else names: the
// receiver never got its datagram, which is never sent again, and would
// hold the in-order message for it forever.
func TestHostileLatestReplacedVersionIsNoAnchor(t *testing.T) {
	p := newSimPair(t, nil, nil, perfect, perfect)
	p.connect()
	p.run(100*time.Millisecond, nil)
	drop := true
	p.drop = func(from int, b []byte) bool { return drop && from == 0 && isLatestDatagram(b) }
	p.send(0, Message{ID: 120, Payload: versionPayload(1, 8), Reliable: true, ContentID: 1})
	p.run(time.Millisecond, nil)
	p.send(0, Message{ID: 120, Payload: versionPayload(2, 8), Reliable: true, ContentID: 1})
	// Both datagrams given up, the second's version going again and lost
	// again for a while.
	p.run(2*time.Second, nil)
	p.send(0, Message{ID: 130, Payload: []byte("in order"), Reliable: true, InOrder: true})
	p.run(100*time.Millisecond, nil)
	drop = false
	require.True(t, p.run(10*time.Second, func() bool { return len(p.h[1].msgs) == 2 }), "got %d", len(p.h[1].msgs))
}

// Versions of many states, some too large for one datagram, some with
// priorities, on a path losing a fifth of the datagrams each way and
// reordering them, with receipts: once everything is acked, each
// version's receipt was told exactly once, a delivered one only if the
// receiver got it (or a newer one of its state was taken first, which
// drops it, as documented); no version came after a newer one of its
// state; and the accounting is back to zero: bytes in flight, the span
// held, the send buffer released exactly what was queued.
func TestHostileLatestAccountingUnderLoss(t *testing.T) {
	for seed := uint64(11); seed <= 61; seed += 10 {
		t.Run("", func(t *testing.T) { latestAccountingUnderLoss(t, seed, false) })
	}
	// A secure session's ledger (newSecureSimPair) also checks that no
	// packet number is sealed with two plaintexts: a given-up datagram's
	// versions go under new ones.
	for seed := uint64(71); seed <= 91; seed += 10 {
		t.Run("secure", func(t *testing.T) { latestAccountingUnderLoss(t, seed, true) })
	}
}

func latestAccountingUnderLoss(t *testing.T, seed uint64, secure bool) {
	pair := newSimPair
	if secure {
		pair = newSecureSimPair
	}
	p := pair(t, &Config{Receipts: true}, nil, netsimLossy(0.2, seed), netsimLossy(0.2, seed+1))
	p.connect()
	p.run(100*time.Millisecond, nil)
	released := p.h[0].released
	total := 0
	refs := map[Ref]int{} // the version each ref sent
	last := map[uint32]int{}
	for v := 1; v <= 800; v++ {
		id := uint32(120 + v%7)
		size := 16
		if v%50 == 0 {
			size = 3000 // fragmented
		}
		m := Message{ID: id, Payload: versionPayload(v, size), Reliable: true, ContentID: 1, Priority: int8(v % 3)}
		total += len(m.Payload)
		refs[p.send(0, m)] = v
		last[id] = v
		p.run(time.Millisecond, nil)
	}
	c := p.client()
	require.True(t, p.run(2*time.Minute, func() bool {
		return c.loss.sent.count == 0 && c.send.relQ.len() == 0 && c.latestQueued() == 0 && len(p.h[0].receipts) == len(refs)
	}), "settles: %d receipts of %d", len(p.h[0].receipts), len(refs))
	p.run(time.Second, nil)
	checkVersions(t, p.h[1], last)
	told := receiptsOf(p.h[0].receipts)
	got := map[int]bool{}
	newest := map[uint32]int{}
	for _, m := range p.h[1].msgs {
		v := int(binary.LittleEndian.Uint32(m.Payload))
		got[v] = true
		newest[m.ID] = max(newest[m.ID], v)
	}
	delivered := 0
	for ref, v := range refs {
		if !assert.Len(t, told[ref], 1, "version %d told once", v) {
			continue
		}
		if told[ref][0] {
			delivered++
			assert.True(t, got[v] || newest[uint32(120+v%7)] > v, "version %d told delivered: received, or replaced at the receiver", v)
		}
	}
	t.Logf("%d versions, %d received, %d told delivered, %d obsolete at the receiver", len(refs), len(p.h[1].msgs), delivered, p.server().snapshot().ObsoleteMessages)
	assert.Zero(t, c.loss.inflight)
	assert.Zero(t, c.send.spanHold)
	assert.Equal(t, total, p.h[0].released-released, "the send buffer released what was queued")
	assert.Equal(t, stateOK, c.state)
}

// netsimLossy is a path losing loss of the datagrams, with jitter that
// reorders them.
func netsimLossy(loss float64, seed uint64) netsim.Params {
	return netsim.Params{Loss: loss, Delay: 20 * time.Millisecond, Jitter: 10 * time.Millisecond, Seed: seed}
}

// Close with versions queued: they go and are acked first, then the
// Disconnect; with their datagrams all lost (the peer alive), the close
// still ends within DisconnectTimeout, each receipt told once.
func TestHostileLatestCloseWithVersionsQueued(t *testing.T) {
	for _, blackHole := range []bool{false, true} {
		t.Run(map[bool]string{false: "delivered", true: "black hole"}[blackHole], func(t *testing.T) {
			cfg := &Config{Receipts: true, DisconnectTimeout: 2 * time.Second}
			p := newSimPair(t, cfg, nil, perfect, perfect)
			p.connect()
			p.run(100*time.Millisecond, nil)
			p.drop = func(from int, b []byte) bool { return blackHole && from == 0 && isLatestDatagram(b) }
			var refs []Ref
			for v := 1; v <= 20; v++ {
				refs = append(refs, p.send(0, Message{ID: uint32(120 + v%4), Payload: versionPayload(v, 30), Reliable: true, ContentID: 1}))
			}
			start := p.now
			p.client().requestClose(p.now)
			require.True(t, p.run(time.Minute, func() bool { return p.client().done() }))
			assert.LessOrEqual(t, p.now.Sub(start), 2*time.Second+100*time.Millisecond)
			told := receiptsOf(p.h[0].receipts)
			for _, ref := range refs {
				assert.Len(t, told[ref], 1)
			}
			if !blackHole {
				assert.Len(t, p.h[1].msgs, 4, "the newest of each state")
				assert.NoError(t, p.client().err)
			}
		})
	}
}

// The ack of a given-up datagram comes late (the datagram was slow, not
// lost), after its version went again and was acked: it changes nothing,
// no receipt told twice, no byte released twice.
func TestHostileLatestLateAckOfAbandoned(t *testing.T) {
	p := newSimPair(t, &Config{Receipts: true}, nil, perfect, perfect)
	p.connect()
	p.run(100*time.Millisecond, nil)
	var held []byte
	p.drop = func(from int, b []byte) bool {
		if from == 0 && held == nil && isLatestDatagram(b) {
			held = append([]byte(nil), b...)
			return true
		}
		return false
	}
	released := p.h[0].released
	ref := p.send(0, Message{ID: 120, Payload: versionPayload(1, 40), Reliable: true, ContentID: 1})
	require.True(t, p.run(5*time.Second, func() bool { return len(p.h[0].receipts) == 1 }))
	p.run(time.Second, nil)
	p.inject(1, held) // the server acks it
	p.run(time.Second, nil)
	assert.Equal(t, []bool{true}, receiptsOf(p.h[0].receipts)[ref])
	assert.Equal(t, 40, p.h[0].released-released)
	assert.Len(t, p.h[1].msgs, 1)
	assert.Equal(t, uint64(1), p.server().snapshot().ObsoleteMessages)
	assert.Zero(t, p.client().loss.inflight)
}
