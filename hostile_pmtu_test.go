package knet

import (
	"bytes"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/netsim"
	"github.com/knet-go/knet/internal/udp"
)

// Hostile and unlucky paths against path MTU discovery (pmtu.go).

func TestHostilePMTULateRetiredDatagram(t *testing.T) {
	// A bulk datagram larger than the base is held back on the path (an
	// attacker delaying it, or a path that black-holes the size and then
	// lets one copy through late) until after the sender retired it and
	// the transfer was completed by the repacked fragments. Its
	// fragments then reach the receiver after the transfer finished:
	// they must not linger as a phantom transfer under the TransferID,
	// which the sender reuses later (after 256 transfers) for another
	// message whose fragments of the same numbers differ. Before the
	// fix, that later transfer ended the connection with a protocol
	// error.
	cfg := &Config{MaxDatagramSize: 1200, MaxPathDatagramSize: 4000}
	path := netsim.Params{Delay: 5 * time.Millisecond}
	p := newSimPair(t, cfg, cfg, path, path)
	p.connect()
	first := Message{ID: 400, Payload: randomPayload(1, 256<<10), Reliable: true}
	p.send(0, first)
	require.True(t, p.run(time.Minute, func() bool { return len(p.h[1].msgs) == 1 && !p.client().mtu().searching }))
	require.Greater(t, p.client().mtu().size, 1300)

	// The next transfer's datagrams above 1300 bytes are held: the
	// first copy of each bulk one kept to be delivered late.
	var held [][]byte
	heldPID := map[uint32]bool{}
	p.drop = func(from int, b []byte) bool {
		if from != 0 || len(b) <= 1300 {
			return false
		}
		var h header
		if _, err := parseHeader(b, &h); err == nil && h.reliable && !heldPID[h.packetID] {
			heldPID[h.packetID] = true
			held = append(held, append([]byte(nil), b...))
		}
		return true
	}
	second := Message{ID: 400, Payload: randomPayload(2, 256<<10), Reliable: true}
	p.send(0, second)
	require.True(t, p.run(5*time.Minute, func() bool { return len(p.h[1].msgs) == 2 }))
	require.Positive(t, p.client().mtu().retiredCount, "bulk datagrams were retired and repacked")
	require.NotEmpty(t, held)
	assert.True(t, bytes.Equal(second.Payload, p.h[1].msgs[1].Payload))

	// Now the held copies arrive, after the transfer was delivered.
	p.drop = nil
	for _, b := range held {
		p.inject(1, b)
	}
	require.True(t, p.run(time.Minute, func() bool { return p.client().loss.sent.count == 0 }))
	require.Equal(t, stateOK, p.server().state, "%v", p.server().err)

	// 256 more transfers: each TransferID is used again.
	want := 2
	for i := range 260 {
		m := Message{ID: 400, Payload: randomPayload(uint64(100+i), 8<<10), Reliable: true}
		p.send(0, m)
		want++
		require.True(t, p.run(time.Minute, func() bool {
			return len(p.h[1].msgs) == want || p.server().done()
		}), "transfer %d", i)
		require.Equal(t, stateOK, p.server().state, "transfer %d: %v", i, p.server().err)
		require.True(t, bytes.Equal(m.Payload, p.h[1].msgs[want-1].Payload), "transfer %d delivered intact", i)
	}
	assert.Zero(t, p.server().stats.ProtocolErrors)
	require.True(t, p.run(time.Minute, func() bool { return p.client().loss.sent.count == 0 }))
	assert.Empty(t, p.client().mtu().retired)
	assert.Zero(t, p.client().send.tids.inUse, "every TransferID freed, once")
	assert.Zero(t, p.server().recv.reasm.active, "no transfer left behind")
}

func TestHostileStaleFragmentsAfterTransferIDReuse(t *testing.T) {
	// Copies of fragments of a finished transfer (a repacked retired
	// datagram and the original, pmtu.go) come in datagrams older than
	// the FragmentStart of the next transfer under that TransferID,
	// before it or after it: they are dropped, and the new message is
	// whole and intact.
	spec := startOrder{pidOrder: true}
	frag := func(number uint32, payload string) *message {
		return &message{fragment: true, transferID: 3, fragNumber: number, payload: []byte(payload)}
	}
	start := &message{fragment: true, fragStart: true, transferID: 3, fragCount: 3, id: 400, payload: []byte("A0")}
	r := reassembly{maxMessage: 1 << 20, budget: 1 << 20}
	add := func(m *message, pid uint32) []byte {
		t.Helper()
		tr, msg, err := r.add(m, msgRef{pid: pid}, &spec)
		require.NoError(t, err)
		if msg != nil {
			msg = bytes.Clone(msg)
			r.finish(tr)
		}
		return msg
	}
	add(start, 10)
	add(frag(1, "A1"), 11)
	assert.Equal(t, "A0A1A2", string(add(frag(2, "A2"), 12)))
	add(frag(2, "A2"), 13) // a late copy: the transfer is over

	next := &message{fragment: true, fragStart: true, transferID: 3, fragCount: 3, id: 400, payload: []byte("B0")}
	add(next, 20)
	add(frag(1, "A1"), 11) // older than the FragmentStart, after it
	add(frag(1, "B1"), 21)
	assert.Equal(t, "B0B1B2", string(add(frag(2, "B2"), 22)))
	assert.Zero(t, r.active)
	assert.Zero(t, r.bytes, "nothing left counted")

	// A fragment number beyond the new count, stale, is no protocol
	// error either; one that is not stale still is.
	add(frag(5, "A5"), 15)
	add(&message{fragment: true, fragStart: true, transferID: 3, fragCount: 2, id: 400, payload: []byte("C0")}, 30)
	assert.Equal(t, "C0C1", string(add(frag(1, "C1"), 31)))
	_, _, err := r.add(frag(5, "D5"), msgRef{pid: 41}, &spec)
	require.NoError(t, err)
	_, _, err = r.add(&message{fragment: true, fragStart: true, transferID: 3, fragCount: 2, id: 400, payload: []byte("D0")}, msgRef{pid: 40}, &spec)
	assert.ErrorIs(t, err, errFragNumber)

	// The reference dialect resends under new PacketIDs: there an
	// older PacketID proves nothing, and nothing is dropped for it.
	r = reassembly{maxMessage: 1 << 20, budget: 1 << 20}
	ref := startOrder{}
	for _, pid := range []uint32{10, 11} {
		m := start
		if pid == 11 {
			m = frag(1, "A1")
			m.fragNumber = 1
		}
		_, _, err := r.add(m, msgRef{pid: pid}, &ref)
		require.NoError(t, err)
	}
	tr, msg, err := r.add(frag(2, "A2"), msgRef{pid: 12}, &ref)
	require.NoError(t, err)
	require.Equal(t, "A0A1A2", string(msg))
	r.finish(tr)
	_, _, err = r.add(frag(2, "X2"), msgRef{pid: 5}, &ref)
	require.NoError(t, err)
	_, _, err = r.add(frag(1, "X1"), msgRef{pid: 6}, &ref)
	require.NoError(t, err)
	_, msg, err = r.add(next, msgRef{pid: 20}, &ref)
	require.NoError(t, err)
	assert.Equal(t, "B0X1X2", string(msg), "fragments sent again under new PacketIDs before their start are kept")
}

func TestHostilePMTUInboxHoldsSmallBuffers(t *testing.T) {
	// With MaxPathDatagramSize, an endpoint reads into buffers of that
	// size. A peer sending small datagrams faster than its connection
	// takes them must not make each of the maxInbox it may queue hold
	// one: that multiplied what a connection may pin by up to 32
	// (2048 x 64 KiB, 128 MiB, where 4 MiB was the bound).
	cfg := (&Config{MaxPathDatagramSize: 65507}).resolve()
	ep := newEndpoint(nil, false, cfg, &endpointOptions{})
	defer ep.sched.stop()
	addr := netip.MustParseAddrPort("192.0.2.1:4000")
	c := &Conn{ep: ep}
	ep.conns[addr] = c
	const n = 8
	ps := make([]udp.Packet, n)
	pkts := make([]*packet, n)
	for i := range n {
		pkts[i] = ep.getPacket()
		require.Greater(t, len(pkts[i].buf), 65507, "read buffers hold the largest datagram")
		size := 20
		if i == n-1 {
			size = 9000 // a large one keeps its buffer
		}
		for j := range size {
			pkts[i].buf[j] = byte(i + j)
		}
		ps[i] = udp.Packet{Buf: pkts[i].buf, N: size, Addr: addr}
	}
	ep.dispatch(ps, pkts)
	ep.ready = ep.ready[:0]
	require.Len(t, c.inbox.pkts, n)
	for i, p := range c.inbox.pkts {
		if i < n-1 {
			require.Len(t, p.b, 20)
			assert.LessOrEqual(t, cap(p.buf), smallPacketSize, "datagram %d holds a small buffer", i)
		} else {
			require.Len(t, p.b, 9000)
		}
		assert.Equal(t, byte(i), p.b[0])
		assert.Equal(t, byte(i+19), p.b[19])
		ep.putPacket(p)
	}
}

func TestHostilePMTUReplayedPingReplies(t *testing.T) {
	// Someone on the path replays every datagram the server sent so far
	// (its PingReplies among them) to the client, again and again, while
	// the client searches a path that carries 4000 bytes: copies are
	// duplicates (by PacketID in clear, by the replay window sealed),
	// whose PingReplies confirm no probe. The size found stays within
	// what the path carries, and nothing goes black.
	for _, secure := range []bool{false, true} {
		t.Run(map[bool]string{false: "clear", true: "secure"}[secure], func(t *testing.T) {
			cfg := &Config{MaxPathDatagramSize: 9000}
			var p *simPair
			if secure {
				p = newSecureSimPair(t, cfg, cfg, sizeLimited(4000), sizeLimited(4000))
			} else {
				p = newSimPair(t, cfg, cfg, sizeLimited(4000), sizeLimited(4000))
			}
			p.connect()
			var seen [][]byte
			replaying := false
			p.tap = func(from int, b []byte) {
				if from != 1 || replaying {
					return
				}
				seen = append(seen, append([]byte(nil), b...))
				replaying = true
				for _, old := range seen[max(0, len(seen)-64):] {
					p.inject(0, append([]byte(nil), old...)) // opened in place
				}
				replaying = false
			}
			payload := randomPayload(7, 1<<20)
			p.send(0, Message{ID: 400, Payload: payload, Reliable: true})
			require.True(t, p.run(time.Minute, func() bool { return len(p.h[1].msgs) == 1 && !p.client().mtu().searching }))
			assert.True(t, bytes.Equal(payload, p.h[1].msgs[0].Payload))
			st := p.client().snapshot() // the size on the wire
			assert.LessOrEqual(t, st.PathDatagramSize, 4000)
			assert.Greater(t, st.PathDatagramSize, 4000-pmtuGranularity)
			assert.Zero(t, p.client().mtu().blackHoles)
			copies := p.client().stats.DuplicateDatagrams
			if secure {
				copies += p.sec[0].replays
			}
			assert.Greater(t, copies, uint64(len(seen)), "the copies arrived")
		})
	}
}

func TestHostileRepeatedFragmentsBounded(t *testing.T) {
	// Repeated fragments with the same bytes are dropped (a repacked
	// retired datagram's, pmtu.go), but each drop sorts and scans the
	// whole transfer: a peer repeating a fragment of a large transfer
	// that lacks one had that done at every repeat, 9ms a fragment for
	// a million, hundreds of fragments a datagram. The work is bounded:
	// past it, a repeat is the protocol error it was.
	spec := startOrder{pidOrder: true}
	const count = 4096
	r := reassembly{maxMessage: 16 << 20, budget: 16 << 20}
	_, _, err := r.add(&message{fragment: true, fragStart: true, transferID: 1, fragCount: count, id: 400, payload: []byte{1}}, msgRef{pid: 1}, &spec)
	require.NoError(t, err)
	for n := uint32(1); n < count-1; n++ {
		_, _, err := r.add(&message{fragment: true, transferID: 1, fragNumber: n, payload: []byte{1}}, msgRef{pid: 2}, &spec)
		require.NoError(t, err)
	}
	repeats := 0
	for ; repeats < 1000; repeats++ {
		_, _, err = r.add(&message{fragment: true, transferID: 1, fragNumber: 1, payload: []byte{1}}, msgRef{pid: 3}, &spec)
		if err != nil {
			break
		}
	}
	assert.ErrorIs(t, err, errFragDuplicate)
	assert.GreaterOrEqual(t, repeats, 8, "a few repeats are taken")
	assert.LessOrEqual(t, repeats*count, repeatLimit(count), "the work stays bounded")

	// Within the bound, the transfer completes intact.
	r = reassembly{maxMessage: 16 << 20, budget: 16 << 20}
	_, _, err = r.add(&message{fragment: true, fragStart: true, transferID: 1, fragCount: count, id: 400, payload: []byte{0}}, msgRef{pid: 1}, &spec)
	require.NoError(t, err)
	for n := uint32(1); n < count-1; n++ {
		_, _, err := r.add(&message{fragment: true, transferID: 1, fragNumber: n, payload: []byte{byte(n)}}, msgRef{pid: 2}, &spec)
		require.NoError(t, err)
	}
	for range 8 {
		_, _, err = r.add(&message{fragment: true, transferID: 1, fragNumber: 7, payload: []byte{7}}, msgRef{pid: 3}, &spec)
		require.NoError(t, err)
	}
	_, msg, err := r.add(&message{fragment: true, transferID: 1, fragNumber: count - 1, payload: []byte{byte((count - 1) % 256)}}, msgRef{pid: 4}, &spec)
	require.NoError(t, err)
	require.Len(t, msg, count)
	for i, b := range msg {
		require.Equal(t, byte(i), b, "byte %d", i)
	}
}

func TestHostilePMTUNoProbeBeforeProof(t *testing.T) {
	// A server with MaxPathDatagramSize and a large message queued
	// before the connection is open sends an address that has not
	// proven it receives (one ConnectSyn arrives, nothing after: a
	// forged one) no probe, nothing larger than MaxDatagramSize and no
	// more bytes than it received.
	cfg := &Config{MaxPathDatagramSize: 9000}
	p := newSimPair(t, cfg, cfg, netsim.Params{Delay: 5 * time.Millisecond}, netsim.Params{Delay: 5 * time.Millisecond})
	var in, out, largest int
	p.tap = func(from int, b []byte) {
		if from == 1 {
			out += len(b)
			largest = max(largest, len(b))
		}
	}
	p.drop = func(from int, b []byte) bool {
		if from != 0 {
			return false
		}
		if in > 0 {
			return true
		}
		in = len(b)
		return false
	}
	p.send(1, Message{ID: 400, Payload: randomPayload(3, 256<<10), Reliable: true})
	p.run(time.Minute, nil)
	assert.False(t, p.server().opened())
	assert.Positive(t, out, "the server answered")
	assert.LessOrEqual(t, out, in, "no more than the ConnectSyn's bytes")
	assert.LessOrEqual(t, largest, 1400)
	assert.Zero(t, p.server().mtu().probes)
}
