package knet

import (
	"encoding/binary"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/netsim"
)

// Ordering defects found by trying the library from outside, each pinned
// by a deterministic test on the fake-clock harness.

// holdFirst makes the harness keep back side from's first datagram that
// carries a message with id. It returns a function reporting whether it
// has, and one that stops holding and delivers it.
func holdFirst(p *simPair, from int, id uint32) (deliver func(), held func() bool) {
	var b []byte
	p.tap = func(side int, d []byte) {
		p.cut[from] = false
		if side != from || b != nil {
			return
		}
		dg, _, err := parseDatagram(d)
		if err != nil {
			return
		}
		for _, m := range dg.msgs {
			if !m.fragment && m.id == id {
				b = append([]byte(nil), d...)
				p.cut[from] = true
			}
		}
	}
	deliver = func() {
		p.tap = nil
		p.cut[from] = false
		p.inject(1-from, b)
	}
	return deliver, func() bool { return b != nil }
}

func TestInOrderAfterLostConnectAck(t *testing.T) {
	// The first in-order message of a connection names the ConnectAck's
	// datagram (nothing else is known applied yet). When that datagram
	// came late, its ConnectAck never released what waited on it.
	p := newSimPair(t, nil, nil, perfect, perfect)
	deliver, held := holdFirst(p, 0, idConnectAck)
	require.True(t, p.run(time.Second, func() bool { return p.h[0].est }))
	require.True(t, held())
	for i := range 20 {
		p.send(0, chanMsg(0, i, true, 100))
	}
	p.run(50*time.Millisecond, nil)
	deliver() // the ConnectAck's datagram, late
	require.True(t, p.run(5*time.Second, func() bool { return len(p.h[1].msgs) == 20 }),
		"delivered %d of 20, %d held", len(p.h[1].msgs), len(p.server().recv.res.held))
	for i, m := range p.h[1].msgs {
		_, seq := chanOf(m)
		require.Equal(t, i, seq)
	}
}

func TestInOrderRightAfterHandshakeLossyReordering(t *testing.T) {
	// Defect 1's recipe: 200 reliable in-order messages sent as soon as the
	// client is up, over a path that loses 8% and reorders 30% by 8ms.
	path := func(seed uint64) netsim.Params {
		return netsim.Params{Loss: 0.08, Reorder: 0.3, ReorderDelay: 8 * time.Millisecond, Delay: 2 * time.Millisecond, Seed: seed}
	}
	for seed := range uint64(40) {
		p := newSimPair(t, nil, nil, path(seed+1000), path(seed))
		require.True(t, p.run(30*time.Second, func() bool { return p.h[0].est }))
		for i := range 200 {
			p.send(0, chanMsg(0, i, true, 100))
		}
		ok := p.run(30*time.Second, func() bool { return len(p.h[1].msgs) == 200 })
		require.True(t, ok, "seed %d: delivered %d of 200, %d held, client %+v", seed, len(p.h[1].msgs), len(p.server().recv.res.held), p.client().stats)
		for i, m := range p.h[1].msgs {
			_, seq := chanOf(m)
			require.Equal(t, i, seq, "seed %d", seed)
		}
	}
}

func TestInOrderBehindFragmentedMessage(t *testing.T) {
	// A 100 KiB in-order message, then small ones on its channel. The
	// small ones' datagrams are acked long before the big message is
	// whole; acked is not applied, so they must still name their
	// predecessor and wait for it.
	delay := netsim.Params{Delay: time.Millisecond}
	p := newSimPair(t, nil, nil, delay, delay)
	p.connect()
	p.send(0, chanMsg(1, 0, true, 100<<10))
	for i := 1; i <= 30; i++ {
		p.send(0, chanMsg(1, i, true, 20))
		p.run(time.Millisecond, nil)
	}
	require.True(t, p.run(10*time.Second, func() bool { return len(p.h[1].msgs) == 31 }))
	for i, m := range p.h[1].msgs {
		_, seq := chanOf(m)
		require.Equal(t, i, seq)
	}
}

func TestDependentsOfHeldMessageWait(t *testing.T) {
	// Defect 2's variant: B waits behind a fragmented message on its
	// channel; ten messages naming B must come after it.
	delay := netsim.Params{Delay: time.Millisecond}
	p := newSimPair(t, nil, nil, delay, delay)
	p.connect()
	p.send(0, Message{ID: 51, Payload: make([]byte, 100<<10), Reliable: true, InOrder: true, Channel: 1})
	b := p.send(0, Message{ID: 52, Payload: []byte("B"), Reliable: true, InOrder: true, Channel: 1})
	for i := range 10 {
		p.send(0, Message{ID: 53, Payload: []byte{byte(i)}, Reliable: true, DependsOn: []Ref{b}})
		p.run(time.Millisecond, nil)
	}
	require.True(t, p.run(10*time.Second, func() bool { return len(p.h[1].msgs) == 12 }))
	var ids []uint32
	for _, m := range p.h[1].msgs {
		ids = append(ids, m.ID)
	}
	assert.Equal(t, []uint32{51, 52, 53, 53, 53, 53, 53, 53, 53, 53, 53, 53}, ids)
}

func TestUnreliableNamingReliableComesAfterIt(t *testing.T) {
	// Defect 3: R reliable, then U unreliable naming R, ten pairs 1ms
	// apart over a lossy path. U may be lost, but never arrives before R.
	for _, seed := range []uint64{1005, 1007, 1014, 1015, 1, 2, 3, 4, 5, 6, 7, 8} {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			p := newSimPair(t, nil, nil, netsim.Params{Loss: 0.05, Delay: 5 * time.Millisecond, Seed: seed}, perfect)
			p.connect()
			p.run(time.Second, nil) // an RTT measured
			for i := range 10 {
				r := p.send(0, Message{ID: 60, Payload: []byte{byte(i)}, Reliable: true})
				p.send(0, Message{ID: 61, Payload: []byte{byte(i)}, DependsOn: []Ref{r}})
				p.run(time.Millisecond, nil)
			}
			require.True(t, p.run(10*time.Second, func() bool {
				n := 0
				for _, m := range p.h[1].msgs {
					if m.ID == 60 {
						n++
					}
				}
				return n == 10
			}))
			p.run(time.Second, nil)
			seen := map[byte]bool{}
			unrel := 0
			for _, m := range p.h[1].msgs {
				if m.ID == 60 {
					seen[m.Payload[0]] = true
					continue
				}
				unrel++
				require.True(t, seen[m.Payload[0]], "U%d before R%d", m.Payload[0], m.Payload[0])
			}
			assert.Positive(t, unrel)
		})
	}
}

func TestContentIDNeverOlderAfterNewer(t *testing.T) {
	// Defect 4: three versions of one state 0.3ms apart over a lossy,
	// reordering path, then a reliable marker. The receiver must never
	// see an older version after a newer one.
	for seed := range uint64(60) {
		p := newSimPair(t, nil, nil, netsim.Params{Loss: 0.1, Reorder: 0.3, ReorderDelay: 8 * time.Millisecond,
			Delay: 2 * time.Millisecond, Seed: seed + 1000}, perfect)
		p.connect()
		p.run(time.Second, nil)
		for round := range 5 {
			for v := range 3 {
				p.send(0, Message{ID: 80, ContentID: 1, Payload: []byte{byte(round), byte(v)}})
				p.run(300*time.Microsecond, nil)
			}
			p.send(0, Message{ID: 81, Payload: []byte{byte(round)}, Reliable: true})
			p.run(20*time.Millisecond, nil)
		}
		require.True(t, p.run(10*time.Second, func() bool {
			n := 0
			for _, m := range p.h[1].msgs {
				if m.ID == 81 {
					n++
				}
			}
			return n == 5
		}))
		p.run(time.Second, nil)
		last := -1
		for _, m := range p.h[1].msgs {
			if m.ID != 80 {
				continue
			}
			v := int(m.Payload[0])*3 + int(m.Payload[1])
			require.Greater(t, v, last, "seed %d: version %d after %d", seed, v, last)
			last = v
		}
	}
}

func TestContentIDOlderBehindLostVersions(t *testing.T) {
	// Latest state went backwards in mixed traffic: version 1 of a state
	// is held back on the path, versions 2 and 3 (which name it) are
	// lost, and version 4, sent 60ms after version 1, arrives first. A
	// version named the last two before it and those sent within a
	// horizon taken from the round trip (5ms here), so version 4 did not
	// name version 1 and the receiver delivered it after version 4.
	two := netsim.Params{Delay: 2 * time.Millisecond}
	p := newSimPair(t, nil, nil, two, two)
	p.connect()
	p.run(time.Second, nil)
	var late []byte
	p.drop = func(from int, b []byte) bool {
		d, _, err := parseDatagram(b)
		if from != 0 || err != nil {
			return false
		}
		for _, m := range d.msgs {
			if m.fragment || m.id != 300 {
				continue
			}
			switch m.payload[0] {
			case 1:
				late = append([]byte(nil), b...)
				return true
			case 2, 3:
				return true
			}
		}
		return false
	}
	for v := range byte(4) {
		p.send(0, Message{ID: 300, ContentID: 5, Payload: []byte{1 + v}})
		p.run(20*time.Millisecond, nil)
	}
	require.NotNil(t, late)
	require.True(t, p.run(time.Second, func() bool { return len(p.h[1].msgs) == 1 }))
	p.inject(1, late) // version 1, late
	p.run(100*time.Millisecond, nil)
	var got []byte
	for _, m := range p.h[1].msgs {
		got = append(got, m.Payload[0])
	}
	assert.Equal(t, []byte{4}, got, "an older version after a newer one")
}

func TestContentIDDeliversAtOnce(t *testing.T) {
	// Defect 12: latest state wins. A newer version arriving while an
	// older one is missing is delivered at once, not after a reorder
	// window; the older one, arriving later, is dropped.
	p := newSimPair(t, nil, nil, netsim.Params{Delay: 40 * time.Millisecond}, netsim.Params{Delay: 40 * time.Millisecond})
	p.connect()
	p.run(6*time.Second, nil)
	deliver, held := holdFirst(p, 0, 80)
	p.send(0, Message{ID: 80, ContentID: 1, Payload: []byte{0}})
	p.run(10*time.Millisecond, nil)
	require.True(t, held())
	p.send(0, Message{ID: 80, ContentID: 1, Payload: []byte{1}})
	sent := p.now
	require.True(t, p.run(time.Second, func() bool { return len(p.h[1].msgs) == 1 }))
	assert.Equal(t, []byte{1}, p.h[1].msgs[0].Payload)
	assert.LessOrEqual(t, p.now.Sub(sent), 41*time.Millisecond, "the newer version waited")
	deliver()
	p.run(100*time.Millisecond, nil)
	assert.Len(t, p.h[1].msgs, 1, "the older version, late, was delivered")
}

func TestDependencyNamedTwiceAppliesOnce(t *testing.T) {
	// A message may list one entry twice, or two entries naming the same
	// message (a hostile peer, or our own latest-state marker). It must
	// still be applied once, after what it names.
	for _, reliable := range []bool{true, false} {
		p := newSimPair(t, nil, nil, perfect, perfect)
		p.connect()
		c := p.client()
		first := c.send.nextPID
		c.startPIDAt(c.send.nextPID + 2) // the client must not reuse these
		dependent := header{packetID: first + 1, reliable: reliable, inOrder: true, deltas: []uint16{0, 0}, indices: []uint16{0, 0}}
		b := appendHeader(nil, &dependent)
		b = appendMessage(b, &message{id: 70, payload: []byte("twice"), order: orderMulti, orderMulti: []byte{0, 0, 1}})
		p.inject(1, b)
		require.Empty(t, p.h[1].msgs, "applied before what it names")
		b = appendHeader(nil, &header{packetID: first, reliable: true})
		b = appendMessage(b, &message{id: 71, payload: []byte("first")})
		p.inject(1, b)
		p.run(100*time.Millisecond, nil)
		var ids []uint32
		for _, m := range p.h[1].msgs {
			ids = append(ids, m.ID)
		}
		assert.Equal(t, []uint32{71, 70}, ids, "reliable %v", reliable)
		assert.Equal(t, 0, len(p.server().recv.res.held))
	}
}

func TestReorderWindowsByID(t *testing.T) {
	// The receiver gives each stream its own wait for a missing
	// predecessor: none for ID 90 (snapshots), the default for ID 91.
	delay := netsim.Params{Delay: 20 * time.Millisecond}
	server := &Config{ReorderWindows: map[uint32]time.Duration{90: 0}, ReorderWindow: 30 * time.Millisecond}
	for _, id := range []uint32{90, 91} {
		p := newSimPair(t, nil, server, delay, delay)
		p.connect()
		p.run(6*time.Second, nil)
		deliver, held := holdFirst(p, 0, id)
		p.send(0, Message{ID: id, Payload: []byte{0}, InOrder: true, Channel: 3})
		p.run(time.Millisecond, nil)
		require.True(t, held())
		p.send(0, Message{ID: id, Payload: []byte{1}, InOrder: true, Channel: 3})
		sent := p.now
		require.True(t, p.run(time.Second, func() bool { return len(p.h[1].msgs) == 1 }))
		waited := p.now.Sub(sent) - 20*time.Millisecond
		if id == 90 {
			assert.Zero(t, waited, "no window: delivered as it arrived")
		} else {
			assert.Equal(t, 30*time.Millisecond, waited, "waited the window for its predecessor")
		}
		deliver() // the predecessor, late: dropped
		p.run(100*time.Millisecond, nil)
		require.Len(t, p.h[1].msgs, 1, "ID %d", id)
		assert.Equal(t, []byte{1}, p.h[1].msgs[0].Payload)
	}
}

// streamTime sends n messages of size bytes as fast as the sender takes
// them and returns the simulated time until the last is delivered.
func streamTime(t *testing.T, cfg *Config, path func(uint64) netsim.Params, seed uint64, n, size int, ordered bool) (time.Duration, *simPair) {
	p := newSimPair(t, cfg, cfg, path(seed), path(seed+100))
	p.connect()
	start := p.now
	sent := 0
	for len(p.h[1].msgs) < n {
		for sent < n && p.client().send.relQ.len() < 256 {
			b := make([]byte, size)
			binary.LittleEndian.PutUint32(b, uint32(sent))
			p.send(0, Message{ID: 10, Payload: b, Reliable: true, InOrder: ordered})
			sent++
		}
		p.run(time.Millisecond, nil)
		require.Less(t, p.now.Sub(start), time.Minute, "ordered %v: %d of %d delivered", ordered, len(p.h[1].msgs), n)
	}
	return p.now.Sub(start), p
}

func TestOrderedStreamKeepsUpUnderLoss(t *testing.T) {
	t.Parallel()
	// Messages held behind a loss count against the receiver's buffer;
	// past it, datagrams were refused and came again, and the sender took
	// the refusals for congestion: ordered streams crawled at a tiny
	// fraction of unordered ones. The sender now keeps ordered data ahead
	// of its oldest unacked datagram within the buffer; and a datagram
	// sent before one acked is found lost by send time, resent or not, so
	// that a tail of losses is not recovered one timeout at a time.
	path := func(seed uint64) netsim.Params {
		return netsim.Params{Loss: 0.05, Delay: 20 * time.Millisecond, Bandwidth: 100 << 20, Seed: seed}
	}
	seeds := uint64(3)
	if testing.Short() {
		seeds = 1
	}
	for seed := range seeds {
		unordered, _ := streamTime(t, nil, path, seed, 20000, 1200, false)
		ordered, p := streamTime(t, nil, path, seed, 20000, 1200, true)
		t.Logf("seed %d: 24 MB unordered in %v, ordered in %v (%.2fx the rate)", seed, unordered, ordered, unordered.Seconds()/ordered.Seconds())
		assert.Less(t, ordered.Seconds(), unordered.Seconds()/0.8, "ordered below 0.8x unordered")
		assert.Less(t, unordered, 1500*time.Millisecond, "unordered: the tail of losses took long")
		assert.Zero(t, p.server().stats.DroppedDatagrams, "datagrams refused for lack of room")
		for i, m := range p.h[1].msgs {
			require.Equal(t, i, int(binary.LittleEndian.Uint32(m.Payload)), "order")
		}
	}
}
