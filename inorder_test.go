package knet

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/netsim"
)

// chanMsg is an in-order message whose payload says its channel and
// sequence number.
func chanMsg(ch uint8, seq int, reliable bool, size int) Message {
	p := make([]byte, max(size, 5))
	p[0] = ch
	binary.LittleEndian.PutUint32(p[1:], uint32(seq))
	return Message{ID: 50 + uint32(ch), Payload: p, Reliable: reliable, InOrder: true, Channel: ch}
}

func chanOf(m Message) (uint8, int) {
	return m.Payload[0], int(binary.LittleEndian.Uint32(m.Payload[1:]))
}

func TestInOrderReliableChannelsLossy(t *testing.T) {
	for _, seed := range []uint64{1, 2} {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			p := newSimPair(t, nil, nil, lossy(seed, 0.08), lossy(seed+9, 0.08))
			p.connect()
			const n = 1000
			for i := range n {
				for ch := range uint8(3) {
					p.send(0, chanMsg(ch, i, true, 10+i%200))
				}
			}
			require.True(t, p.run(60*time.Second, func() bool { return len(p.h[1].msgs) == 3*n }))
			next := [3]int{}
			for _, m := range p.h[1].msgs {
				ch, seq := chanOf(m)
				require.Equal(t, next[ch], seq, "channel %d out of order", ch)
				next[ch]++
			}
			assert.Positive(t, p.client().stats.Retransmits)
		})
	}
}

func TestInOrderUnreliableSequenced(t *testing.T) {
	p := newSimPair(t, nil, nil, lossy(4, 0.10), lossy(5, 0.10))
	p.connect()
	const n = 2000
	for i := range n {
		p.send(0, chanMsg(7, i, false, 30))
		if i%20 == 0 {
			p.run(time.Millisecond, nil) // a stream, not one burst
		}
	}
	p.run(5*time.Second, nil)
	last := -1
	for _, m := range p.h[1].msgs {
		_, seq := chanOf(m)
		require.Greater(t, seq, last, "older after newer")
		last = seq
	}
	got := len(p.h[1].msgs)
	t.Logf("%d of %d delivered", got, n)
	assert.GreaterOrEqual(t, got, n/2)
	assert.Less(t, got, n)
}

func TestInOrderMixedChannel(t *testing.T) {
	// Reliable and unreliable messages on one channel: the reliable ones
	// arrive exactly once in order; the unreliable ones are in sequence
	// among themselves. (A late unreliable message may still follow a newer
	// reliable one: a reliable message cannot depend on it.)
	p := newSimPair(t, nil, nil, lossy(6, 0.1), lossy(7, 0.1))
	p.connect()
	const n = 1500
	for i := range n {
		p.send(0, chanMsg(1, i, i%3 == 0, 20))
		if i%10 == 0 {
			p.run(time.Millisecond, nil)
		}
	}
	require.True(t, p.run(30*time.Second, func() bool {
		r := 0
		for _, m := range p.h[1].msgs {
			if m.Reliable {
				r++
			}
		}
		return r == n/3
	}))
	p.run(time.Second, nil)
	lastRel, lastUnrel := -3, -1
	for _, m := range p.h[1].msgs {
		_, seq := chanOf(m)
		if m.Reliable {
			require.Equal(t, lastRel+3, seq, "reliable out of order")
			lastRel = seq
		} else {
			require.Greater(t, seq, lastUnrel, "unreliable %d after %d", seq, lastUnrel)
			lastUnrel = seq
		}
	}
}

func TestChannelIndependence(t *testing.T) {
	// Channel 0's first message is lost; channel 1's messages, sent after
	// it, are delivered without waiting for its retransmission.
	delay := netsim.Params{Delay: 20 * time.Millisecond}
	p := newSimPair(t, nil, nil, delay, delay)
	p.connect()
	p.run(6*time.Second, nil) // settle the RTT: the timeout is well above a round trip
	var lostAt time.Time
	p.tap = func(from int, b []byte) {
		p.cut[0] = false
		if from != 0 {
			return
		}
		d, _, _ := parseDatagram(b)
		for _, m := range d.msgs {
			if m.id == 50 && lostAt.IsZero() {
				lostAt = p.now
				p.cut[0] = true
			}
		}
	}
	p.send(0, chanMsg(0, 0, true, 10))
	p.run(time.Millisecond, nil)
	p.send(0, chanMsg(0, 1, true, 10))
	for i := range 5 {
		p.send(0, chanMsg(1, i, true, 10))
	}
	delivered := map[uint8]time.Time{}
	require.True(t, p.run(5*time.Second, func() bool {
		for _, m := range p.h[1].msgs {
			ch, _ := chanOf(m)
			if _, ok := delivered[ch]; !ok {
				delivered[ch] = p.now
			}
		}
		return len(p.h[1].msgs) == 7
	}))
	// Channel 1 arrives after one trip; channel 0 waits for a retransmission.
	assert.Less(t, delivered[1].Sub(lostAt), 25*time.Millisecond)
	assert.Greater(t, delivered[0].Sub(lostAt), 40*time.Millisecond)
	// And channel 0 is still in order.
	var seqs []int
	for _, m := range p.h[1].msgs {
		if ch, seq := chanOf(m); ch == 0 {
			seqs = append(seqs, seq)
		}
	}
	assert.Equal(t, []int{0, 1}, seqs)
}

func TestInOrderWireUsesDependencies(t *testing.T) {
	// The wire carries the order as dependency entries that a plain spec
	// receiver can apply: check the entries name the predecessor.
	p := newSimPair(t, nil, nil, perfect, perfect)
	p.connect()
	type placed struct {
		pid uint32
		idx int
	}
	where := map[int]placed{}
	var deps [][]msgRef
	p.tap = func(from int, b []byte) {
		if from != 0 {
			return
		}
		d, _, err := parseDatagram(b)
		require.NoError(t, err)
		for i, m := range d.msgs {
			if m.id != 51 {
				continue
			}
			_, seq := chanOf(Message{Payload: m.payload})
			where[seq] = placed{d.packetID, i}
			for len(deps) <= seq {
				deps = append(deps, nil)
			}
			deps[seq] = appendDeps(nil, &d.header, &m)
		}
	}
	// Spread out, so that each message has its own datagram and the
	// predecessor is not yet acked.
	p.links[1] = netsim.NewLink(netsim.Params{Delay: 50 * time.Millisecond})
	for i := range 5 {
		p.send(0, chanMsg(1, i, true, 10))
		p.run(time.Millisecond, nil)
	}
	p.run(time.Second, nil)
	require.Len(t, deps, 5)
	// The first has no predecessor: it is anchored on an earlier message
	// the receiver has, so that it still shows as in order.
	require.Len(t, deps[0], 1)
	assert.True(t, seqLess(deps[0][0].pid, where[0].pid))
	for i := 1; i < 5; i++ {
		require.Len(t, deps[i], 1, "message %d", i)
		assert.Equal(t, msgRef{where[i-1].pid, uint16(where[i-1].idx)}, deps[i][0], "message %d depends on %d", i, i-1)
	}
}

func TestExplicitDependencies(t *testing.T) {
	// A diamond: d depends on b and c, which depend on a; b's datagram is
	// lost once, so c and d must wait as the graph says.
	p := newSimPair(t, nil, nil, netsim.Params{Delay: 5 * time.Millisecond}, netsim.Params{Delay: 5 * time.Millisecond})
	p.connect()
	lost := false
	p.tap = func(from int, b []byte) {
		p.cut[0] = false
		d, _, _ := parseDatagram(b)
		for _, m := range d.msgs {
			if from == 0 && m.id == 61 && !lost {
				lost = true
				p.cut[0] = true
			}
		}
	}
	send := func(id uint32, after ...Ref) Ref {
		r := p.send(0, Message{ID: id, Payload: []byte{byte(id)}, Reliable: true, DependsOn: after})
		p.run(time.Millisecond, nil) // each in its own datagram
		return r
	}
	a := send(60)
	b := send(61, a)
	c := send(62, a)
	send(63, b, c)
	send(64) // independent
	require.True(t, p.run(5*time.Second, func() bool { return len(p.h[1].msgs) == 5 }))
	order := map[uint32]int{}
	for i, m := range p.h[1].msgs {
		order[m.ID] = i
	}
	assert.Less(t, order[60], order[61])
	assert.Less(t, order[60], order[62])
	assert.Less(t, order[61], order[63])
	assert.Less(t, order[62], order[63])
	assert.Less(t, order[64], order[61], "the independent message does not wait for the lost one")
}

func TestPriorityLeavesFirst(t *testing.T) {
	p := newSimPair(t, nil, nil, perfect, perfect)
	p.connect()
	// A slow sender: many datagrams queued behind the pacer.
	p.client().rc.forceRate = 100
	for i := range 200 {
		p.send(0, numbered(100, i, 1300))
	}
	p.send(0, Message{ID: 200, Payload: []byte("urgent"), Reliable: true, Priority: 10})
	require.True(t, p.run(10*time.Second, func() bool {
		for _, m := range p.h[1].msgs {
			if m.ID == 200 {
				return true
			}
		}
		return false
	}))
	assert.Less(t, len(p.h[1].msgs), 40, "the urgent message overtook the queue")
}

func TestPriorityRaisesDependencies(t *testing.T) {
	// An urgent message that depends on a queued one pulls it forward.
	p := newSimPair(t, nil, nil, perfect, perfect)
	p.connect()
	p.client().rc.forceRate = 100
	for i := range 100 {
		p.send(0, numbered(100, i, 1300))
	}
	dep := p.send(0, Message{ID: 201, Payload: []byte("first"), Reliable: true})
	for i := range 100 {
		p.send(0, numbered(100, 100+i, 1300))
	}
	p.send(0, Message{ID: 202, Payload: []byte("urgent"), Reliable: true, Priority: 5, DependsOn: []Ref{dep}})
	require.True(t, p.run(20*time.Second, func() bool {
		for _, m := range p.h[1].msgs {
			if m.ID == 202 {
				return true
			}
		}
		return false
	}))
	var ids []uint32
	for _, m := range p.h[1].msgs {
		if m.ID != 100 {
			ids = append(ids, m.ID)
		}
	}
	assert.Equal(t, []uint32{201, 202}, ids)
	assert.Less(t, len(p.h[1].msgs), 40)
}

func TestContentIDLatestStateWins(t *testing.T) {
	p := newSimPair(t, nil, nil, perfect, perfect)
	p.connect()
	// Nothing leaves until the simulation runs: the updates pile up.
	for i := range 50 {
		p.send(0, Message{ID: 300, ContentID: 1, Payload: []byte{byte(i)}})
		p.send(0, Message{ID: 300, ContentID: 2, Payload: []byte{100 + byte(i)}})
	}
	p.run(time.Second, nil)
	var got []byte
	for _, m := range p.h[1].msgs {
		got = append(got, m.Payload[0])
	}
	assert.Equal(t, []byte{49, 149}, got, "only the latest of each state went out")
}

func TestContentIDDropsOlderArrivingLate(t *testing.T) {
	// Update 1 is held back on the path and arrives after update 2: the
	// receiver drops it.
	p := newSimPair(t, nil, nil, netsim.Params{Delay: time.Millisecond}, perfect)
	p.connect()
	p.run(6*time.Second, nil)
	var held []byte
	p.tap = func(from int, b []byte) {
		p.cut[0] = false
		d, _, _ := parseDatagram(b)
		for _, m := range d.msgs {
			if from == 0 && m.id == 300 && m.payload[0] == 1 {
				held = append([]byte(nil), b...)
				p.cut[0] = true
			}
		}
	}
	p.send(0, Message{ID: 300, ContentID: 9, Payload: []byte{1}})
	p.run(time.Millisecond, nil)
	p.send(0, Message{ID: 300, ContentID: 9, Payload: []byte{2}})
	p.run(100*time.Millisecond, nil)
	require.NotNil(t, held)
	p.inject(1, held) // the old update, late
	p.run(100*time.Millisecond, nil)
	var got []byte
	for _, m := range p.h[1].msgs {
		got = append(got, m.Payload[0])
	}
	assert.Equal(t, []byte{2}, got)
	assert.Positive(t, p.server().stats.ObsoleteMessages, "dropped by its tag's number")
}

func TestDependencyEntriesSplitAt255(t *testing.T) {
	// More than 255 distinct dependencies cannot share a datagram: the
	// sender splits them, and each still names what it depends on.
	big := &Config{MaxDatagramSize: 9000} // so that the entry count, not the size, binds
	p := newSimPair(t, big, big, netsim.Params{Delay: 30 * time.Millisecond}, netsim.Params{Delay: 30 * time.Millisecond})
	p.connect()
	for ch := range 256 {
		p.send(0, chanMsg(uint8(ch), 0, true, 6))
	}
	p.run(time.Millisecond, nil) // first messages out, unacked
	maxEntries := 0
	p.tap = func(from int, b []byte) {
		d, _, _ := parseDatagram(b)
		maxEntries = max(maxEntries, len(d.deltas))
	}
	for ch := range 256 {
		p.send(0, chanMsg(uint8(ch), 1, true, 6))
	}
	require.True(t, p.run(5*time.Second, func() bool { return len(p.h[1].msgs) == 512 }))
	assert.Equal(t, maxDeps, maxEntries)
	next := map[uint8]int{}
	for _, m := range p.h[1].msgs {
		ch, seq := chanOf(m)
		require.Equal(t, next[ch], seq)
		next[ch]++
	}
}

// FuzzInOrder sends a random dependency graph (channels and explicit
// dependencies, reliable and unreliable) over a random lossy, duplicating,
// reordering path, and checks what arrives against the graph as DECISIONS
// §5 defines it: every reliable message exactly once; every message after
// each explicit dependency that arrives at all (a reliable one always
// does); channels in order.
func FuzzInOrder(f *testing.F) {
	f.Add(uint64(1), uint8(60), uint8(10), uint8(10))
	f.Add(uint64(2), uint8(120), uint8(25), uint8(30))
	f.Add(uint64(3), uint8(30), uint8(0), uint8(0))
	f.Add(uint64(4), uint8(200), uint8(15), uint8(50))
	f.Fuzz(runGraph)
}

func runGraph(t *testing.T, seed uint64, count, lossPct, reorderPct uint8) {
	n := int(count)%150 + 2
	path := func(s uint64) netsim.Params {
		return netsim.Params{Loss: float64(lossPct%30) / 100, Duplicate: 0.05, Reorder: float64(reorderPct%60) / 100,
			ReorderDelay: 4 * time.Millisecond, Delay: 3 * time.Millisecond, Jitter: time.Millisecond, Seed: s}
	}
	p := newSimPair(t, nil, nil, path(seed), path(seed+1))
	p.connect()
	rng := rand.New(rand.NewPCG(seed, 7))
	type spec struct {
		reliable, inOrder bool
		channel           uint8
		deps              []int
	}
	specs := make([]spec, n)
	refs := make([]Ref, n)
	reliable := 0
	for i := range n {
		s := spec{reliable: rng.IntN(3) != 0, inOrder: rng.IntN(2) == 0, channel: uint8(rng.IntN(3))}
		var after []Ref
		for range rng.IntN(3) {
			if i == 0 {
				break
			}
			d := rng.IntN(i)
			if s.reliable && !specs[d].reliable {
				continue
			}
			s.deps = append(s.deps, d)
			after = append(after, refs[d])
		}
		specs[i] = s
		if s.reliable {
			reliable++
		}
		payload := binary.LittleEndian.AppendUint32(nil, uint32(i))
		refs[i] = p.send(0, Message{ID: 500, Payload: payload, Reliable: s.reliable, InOrder: s.inOrder, Channel: s.channel, DependsOn: after})
		if rng.IntN(4) == 0 {
			p.run(time.Duration(rng.IntN(5000))*time.Microsecond, nil)
		}
	}
	countReliable := func() int {
		k := 0
		for _, m := range p.h[1].msgs {
			if m.Reliable {
				k++
			}
		}
		return k
	}
	require.True(t, p.run(2*time.Minute, func() bool { return countReliable() == reliable }), "reliable %d of %d", countReliable(), reliable)
	p.run(time.Second, nil)

	pos := map[int]int{}
	for k, m := range p.h[1].msgs {
		i := int(binary.LittleEndian.Uint32(m.Payload))
		_, dup := pos[i]
		require.False(t, dup, "message %d delivered twice", i)
		require.Equal(t, specs[i].reliable, m.Reliable)
		pos[i] = k
	}
	lastRel := map[uint8]int{}
	lastUnrel := map[uint8]int{}
	for i, s := range specs {
		at, ok := pos[i]
		if s.reliable {
			require.True(t, ok, "reliable %d lost", i)
		}
		if !ok {
			continue
		}
		for _, d := range s.deps {
			dat, dok := pos[d]
			if specs[d].reliable || s.reliable {
				require.True(t, dok, "%d delivered without its reliable dependency %d", i, d)
			}
			// An explicit dependency holds whatever the kinds: an
			// unreliable message naming a reliable one is sent once
			// that one is acked.
			if dok {
				require.Less(t, dat, at, "%d delivered before its dependency %d", i, d)
			}
		}
	}
	for _, m := range p.h[1].msgs {
		i := int(binary.LittleEndian.Uint32(m.Payload))
		s := specs[i]
		if !s.inOrder {
			continue
		}
		last := lastUnrel
		if s.reliable {
			last = lastRel
		}
		if prev, ok := last[s.channel]; ok {
			require.Greater(t, i, prev, "channel %d: %d after %d", s.channel, i, prev)
		}
		last[s.channel] = i
	}
}

func TestInOrderReportedOnReceipt(t *testing.T) {
	// Every message sent InOrder arrives marked InOrder, even the first of
	// a channel and those whose predecessor was long acked, so that an
	// application forwarding what it receives keeps the order.
	p := newSimPair(t, nil, nil, lossy(61, 0.05), lossy(62, 0.05))
	p.connect()
	for i := range 300 {
		p.send(0, chanMsg(uint8(i%5), i, i%2 == 0, 20))
		p.send(0, Message{ID: 99, Payload: []byte{1}, Reliable: i%3 == 0})
		if i%30 == 0 {
			p.run(time.Second, nil) // everything acked in between
		}
	}
	p.run(10*time.Second, nil)
	inOrder, plain := 0, 0
	for _, m := range p.h[1].msgs {
		if m.ID == 99 {
			assert.False(t, m.InOrder)
			plain++
			continue
		}
		assert.True(t, m.InOrder, "message %v", m.Payload)
		inOrder++
	}
	assert.Greater(t, inOrder, 250)
	assert.Greater(t, plain, 250)
}
