package knet

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/netsim"
)

var perfect = netsim.Params{}

func lossy(seed uint64, loss float64) netsim.Params {
	return netsim.Params{Loss: loss, Duplicate: 0.05, Reorder: 0.1, ReorderDelay: 3 * time.Millisecond,
		Delay: 5 * time.Millisecond, Jitter: 2 * time.Millisecond, Seed: seed}
}

func numbered(id uint32, i int, size int) Message {
	p := make([]byte, max(size, 4))
	binary.LittleEndian.PutUint32(p, uint32(i))
	return Message{ID: id, Payload: p, Reliable: true}
}

func TestSessionHandshake(t *testing.T) {
	p := newSimPair(t, &Config{ConnectPayload: []byte("let me in")}, nil, perfect, perfect)
	var gotSyn []byte
	p.admit = func(syn []byte) ([]byte, bool) { gotSyn = syn; return []byte("welcome"), true }
	p.connect()
	assert.Equal(t, "let me in", string(gotSyn))
	assert.Equal(t, "welcome", string(p.client().handshake.synAck))
	assert.Equal(t, "let me in", string(p.server().handshake.syn))
	assert.Equal(t, stateOK, p.client().state)
	assert.Equal(t, stateOK, p.server().state)
	// The client's RTT starts from the handshake.
	assert.Positive(t, p.client().loss.rtt.samples)
}

func TestSessionHandshakeSurvivesLoss(t *testing.T) {
	for seed := range uint64(20) {
		p := newSimPair(t, nil, nil, lossy(seed, 0.4), lossy(seed+100, 0.4))
		p.connect()
	}
}

func TestSessionReliableExactlyOnceLossy(t *testing.T) {
	for _, seed := range []uint64{1, 2, 3} {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			p := newSimPair(t, nil, nil, lossy(seed, 0.1), lossy(seed+50, 0.1))
			p.connect()
			const n = 2000
			for i := range n {
				p.send(0, numbered(100, i, 20+i%300))
				p.send(1, numbered(200, i, 10))
			}
			ok := p.run(120*time.Second, func() bool { return len(p.h[0].msgs) == n && len(p.h[1].msgs) == n })
			require.True(t, ok, "delivered %d and %d of %d", len(p.h[1].msgs), len(p.h[0].msgs), n)
			for side, id := range []uint32{200, 100} {
				seen := make([]bool, n)
				for _, m := range p.h[side].msgs {
					require.Equal(t, id, m.ID)
					i := binary.LittleEndian.Uint32(m.Payload)
					require.False(t, seen[i], "message %d delivered twice", i)
					seen[i] = true
				}
			}
			st := p.client().snapshot()
			assert.Positive(t, st.Retransmits, "10%% loss must cost retransmissions")
			assert.Positive(t, p.server().snapshot().DuplicateDatagrams)
			// Nothing left in flight once all is delivered and acked.
			p.run(5*time.Second, func() bool { return p.client().loss.sent.count == 0 && p.server().loss.sent.count == 0 })
			assert.Zero(t, p.client().loss.sent.count)
		})
	}
}

func TestSessionPacketIDWrap(t *testing.T) {
	p := newSimPair(t, nil, nil, lossy(7, 0.1), lossy(8, 0.1))
	p.client().startPIDAt(packetIDMask - 50)
	p.server().startPIDAt(packetIDMask - 5)
	p.connect()
	const n = 1500
	for i := range n {
		p.send(0, numbered(100, i, 100))
	}
	require.True(t, p.run(60*time.Second, func() bool { return len(p.h[1].msgs) == n }))
	assert.Less(t, p.client().send.nextPID, uint32(100000), "PacketIDs wrapped")
	seen := map[uint32]bool{}
	for _, m := range p.h[1].msgs {
		i := binary.LittleEndian.Uint32(m.Payload)
		require.False(t, seen[i])
		seen[i] = true
	}
}

func TestSessionUnreliableNeverResent(t *testing.T) {
	p := newSimPair(t, nil, nil, lossy(3, 0.2), lossy(4, 0.2))
	p.connect()
	wire := map[string]int{}
	p.tap = func(from int, b []byte) {
		d, _, err := parseDatagram(b)
		require.NoError(t, err)
		for _, m := range d.msgs {
			if m.id == 300 {
				require.False(t, d.reliable, "unreliable message in a reliable datagram")
				wire[string(m.payload)]++
			}
		}
	}
	const n = 500
	for i := range n {
		p.send(0, Message{ID: 300, Payload: []byte(fmt.Sprint(i))})
	}
	p.run(10*time.Second, nil)
	for k, c := range wire {
		require.Equal(t, 1, c, "unreliable %s sent %d times", k, c)
	}
	assert.Len(t, wire, n)
	got := map[string]bool{}
	for _, m := range p.h[1].msgs {
		require.False(t, got[string(m.Payload)], "delivered twice")
		got[string(m.Payload)] = true
	}
	assert.Less(t, len(got), n, "20%% loss loses some")
	assert.Greater(t, len(got), n/2)
}

func TestSessionAckWithinMaxAckDelay(t *testing.T) {
	cfg := &Config{MaxAckDelay: 33 * time.Millisecond}
	p := newSimPair(t, cfg, cfg, perfect, perfect)
	p.connect()
	p.run(time.Second, nil)
	sentAt := map[uint32]time.Time{}
	var worst time.Duration
	acked := 0
	p.tap = func(from int, b []byte) {
		d, _, err := parseDatagram(b)
		require.NoError(t, err)
		if from == 0 && d.reliable {
			sentAt[d.packetID] = p.now
		}
		if from == 1 {
			for _, m := range d.msgs {
				if m.id != idPacketAck {
					continue
				}
				a, ok := parsePacketAck(m.payload)
				require.True(t, ok)
				a.each(func(id uint32) {
					if at, ok := sentAt[id]; ok {
						worst = max(worst, p.now.Sub(at))
						delete(sentAt, id)
						acked++
					}
				})
			}
		}
	}
	// Lone reliable messages, spaced out: each waits for its ack alone.
	for i := range 20 {
		p.send(0, numbered(100, i, 10))
		p.run(100*time.Millisecond, nil)
	}
	assert.Equal(t, 20, acked)
	assert.Empty(t, sentAt)
	assert.LessOrEqual(t, worst, 33*time.Millisecond)
}

func TestSessionAcksBatch(t *testing.T) {
	p := newSimPair(t, nil, nil, perfect, perfect)
	p.connect()
	var acks, maxPerAck int
	p.tap = func(from int, b []byte) {
		d, _, _ := parseDatagram(b)
		for _, m := range d.msgs {
			if m.id == idPacketAck && from == 1 {
				acks++
				a, _ := parsePacketAck(m.payload)
				n := 0
				a.each(func(uint32) { n++ })
				maxPerAck = max(maxPerAck, n)
			}
		}
	}
	// Deliver 70 reliable datagrams at the same instant: the receiver acks
	// them with two full PacketAcks, not seventy. (With no PacketID
	// skipped: a skipped one, skip.go, is a hole no ack names.)
	noSkips(p.client())
	p.client().rc.forceRate = 1e6
	p.client().rc.bytes = pacer{} // a full bucket at the new rate
	for i := range 70 {
		p.send(0, numbered(100, i, 1300))
	}
	p.run(time.Second, func() bool { return len(p.h[1].msgs) == 70 })
	p.run(100*time.Millisecond, nil)
	assert.Equal(t, 35, maxPerAck)
	assert.LessOrEqual(t, acks, 8)
}

func TestSessionRetransmitsSameDatagram(t *testing.T) {
	p := newSimPair(t, nil, nil, perfect, perfect)
	p.connect()
	var first []byte
	copies := 0
	p.tap = func(from int, b []byte) {
		if from != 0 {
			return
		}
		d, _, _ := parseDatagram(b)
		for _, m := range d.msgs {
			if m.id == 100 {
				if first == nil {
					first = append([]byte(nil), b...)
					p.cut[0] = true // lose it
				} else {
					assert.Equal(t, first, b, "a retransmission repeats the datagram byte for byte")
					p.cut[0] = false
				}
				copies++
			}
		}
	}
	p.send(0, numbered(100, 1, 10))
	require.True(t, p.run(5*time.Second, func() bool { return len(p.h[1].msgs) == 1 }))
	assert.Equal(t, 2, copies)
	assert.Equal(t, uint64(1), p.client().stats.Retransmits)
}

// A reliable datagram is kept until acked, in a buffer of its own size
// class: a small one must not hold a full datagram's buffer (at a game
// server's load that was most of its memory per connection), a full one
// may.
func TestSessionReliableBuffersSizedToUse(t *testing.T) {
	for _, dialect := range []Dialect{DialectSpec, DialectReference} {
		p := newSimPairIn(t, dialect, nil, nil, perfect, perfect)
		p.connect()
		p.cut[0] = true // nothing acked: the datagrams stay in the window
		p.send(0, Message{ID: 100, Payload: make([]byte, 40), Reliable: true})
		p.run(time.Millisecond, func() bool { return false })
		p.send(0, Message{ID: 101, Payload: make([]byte, 1100), Reliable: true})
		p.run(time.Millisecond, func() bool { return false })
		w := &p.client().loss.sent
		var caps []int
		for k := range w.n {
			if d := w.at(k); d != nil && d.b != nil {
				require.LessOrEqual(t, len(d.b), cap(d.b))
				caps = append(caps, cap(d.b))
			}
		}
		require.Len(t, caps, 2, "%v", dialect)
		require.Less(t, caps[0], 128, "%v: a 40-byte message's datagram", dialect)
		require.GreaterOrEqual(t, caps[1], 1100, "%v", dialect)
	}
}

// Latest-state versions replaced while still queued are counted: they
// never left, and only the newest arrives.
func TestSessionReplacedMessagesCounted(t *testing.T) {
	p := newSimPair(t, nil, nil, perfect, perfect)
	p.connect()
	for v := range 3 {
		p.send(0, Message{ID: 100, Payload: []byte{byte(v)}, ContentID: 1})
	}
	require.True(t, p.run(time.Second, func() bool { return len(p.h[1].msgs) == 1 }))
	p.run(100*time.Millisecond, nil)
	require.Len(t, p.h[1].msgs, 1)
	assert.Equal(t, []byte{2}, p.h[1].msgs[0].Payload)
	assert.Equal(t, uint64(2), p.client().snapshot().ReplacedMessages)
	assert.Zero(t, p.client().snapshot().DroppedMessages, "a replaced version is not a dropped one")
}

func TestSessionFastRetransmit(t *testing.T) {
	// One datagram of a burst lost: the acks of the later ones trigger
	// its retransmission well before the timeout.
	p := newSimPair(t, nil, nil, netsim.Params{Delay: 10 * time.Millisecond}, netsim.Params{Delay: 10 * time.Millisecond})
	p.connect()
	p.run(6*time.Second, nil) // a ping or two for the RTT
	dropped := false
	p.tap = func(from int, b []byte) {
		d, _, _ := parseDatagram(b)
		p.cut[0] = false
		if from == 0 && d.reliable && !dropped && len(d.msgs) > 0 && d.msgs[0].id == 100 && binary.LittleEndian.Uint32(d.msgs[0].payload) == 3 {
			dropped = true
			p.cut[0] = true
		}
	}
	start := p.now
	for i := range 10 {
		p.send(0, numbered(100, i, 1300))
	}
	require.True(t, p.run(5*time.Second, func() bool { return len(p.h[1].msgs) == 10 }))
	assert.True(t, dropped)
	assert.Equal(t, uint64(1), p.client().snapshot().FastRetransmits)
	// Two one-way trips for the acks to come back, one for the resend.
	assert.Less(t, p.now.Sub(start), 60*time.Millisecond)
}

func TestSessionCoalesces(t *testing.T) {
	p := newSimPair(t, nil, nil, perfect, perfect)
	p.connect()
	datagrams := 0
	p.tap = func(from int, b []byte) {
		if from == 0 {
			datagrams++
			assert.LessOrEqual(t, len(b), defaultMaxDatagramSize)
		}
	}
	for i := range 200 {
		p.send(0, numbered(100, i, 40))
	}
	require.True(t, p.run(time.Second, func() bool { return len(p.h[1].msgs) == 200 }))
	// 200 x (2 + 1 + 40) bytes = 8600: seven datagrams of 1400.
	assert.LessOrEqual(t, datagrams, 9)
}

func TestSessionLoneMessageGoesAtOnce(t *testing.T) {
	p := newSimPair(t, nil, nil, perfect, perfect)
	p.connect()
	p.run(time.Second, nil)
	p.send(0, Message{ID: 100, Payload: []byte("now"), Reliable: true})
	b := p.client().poll(p.now, p.buf)
	require.NotNil(t, b, "a lone message must not wait for company")
	d, _, err := parseDatagram(b)
	require.NoError(t, err)
	require.Len(t, d.msgs, 1)
	p.send(0, Message{ID: 101, Payload: []byte("and now")})
	assert.NotNil(t, p.client().poll(p.now, p.buf))
}

func TestSessionPingRTT(t *testing.T) {
	cfg := &Config{PingInterval: time.Second}
	d := netsim.Params{Delay: 20 * time.Millisecond}
	p := newSimPair(t, cfg, cfg, d, d)
	p.connect()
	p.run(10*time.Second, nil)
	for _, s := range p.s {
		assert.InDelta(t, float64(40*time.Millisecond), float64(s.loss.rtt.srtt), float64(2*time.Millisecond))
		assert.GreaterOrEqual(t, s.loss.rtt.samples, 9)
	}
}

func TestSessionKeepaliveThenLoss(t *testing.T) {
	cfg := &Config{PingInterval: time.Second, ConnectionLostTimeout: 3 * time.Second}
	p := newSimPair(t, cfg, cfg, perfect, perfect)
	p.connect()
	// Idle for a minute: pings keep it up.
	p.run(time.Minute, nil)
	require.Equal(t, stateOK, p.client().state)
	require.Equal(t, stateOK, p.server().state)
	// The client goes silent.
	p.cut[0] = true
	cutAt := p.now
	require.True(t, p.run(10*time.Second, func() bool { return p.server().state == stateDone }))
	var te *TimeoutError
	require.ErrorAs(t, p.server().err, &te)
	assert.True(t, errors.Is(p.server().err, net.ErrClosed))
	assert.LessOrEqual(t, p.now.Sub(cutAt), 3*time.Second+time.Millisecond)
	assert.GreaterOrEqual(t, p.now.Sub(cutAt), 2*time.Second, "not before the silence is long enough")
}

func TestSessionConnectTimeout(t *testing.T) {
	p := newSimPair(t, &Config{ConnectTimeout: 2 * time.Second}, nil, perfect, perfect)
	p.cut[1] = true
	require.True(t, p.run(5*time.Second, func() bool { return p.client().state == stateDone }))
	var te *TimeoutError
	require.ErrorAs(t, p.client().err, &te)
	assert.Equal(t, "connect", te.Op)
	assert.Equal(t, timeZero.Add(2*time.Second), p.now)
}

func TestSessionConnectSynResent(t *testing.T) {
	p := newSimPair(t, nil, nil, perfect, perfect)
	syns := 0
	p.tap = func(from int, b []byte) {
		if from == 0 {
			syns++
			p.cut[0] = syns < 3 // the first two are lost
		}
	}
	p.connect()
	assert.GreaterOrEqual(t, syns, 3)
}

func TestSessionRefused(t *testing.T) {
	for _, stealth := range []bool{false, true} {
		t.Run(fmt.Sprint("stealth=", stealth), func(t *testing.T) {
			p := newSimPair(t, &Config{ConnectTimeout: time.Second}, &Config{Stealth: stealth}, perfect, perfect)
			var answer []byte
			p.tap = func(from int, b []byte) {
				if from == 1 {
					answer = append([]byte(nil), b...)
				}
			}
			p.admit = func([]byte) ([]byte, bool) { return nil, false }
			require.True(t, p.run(5*time.Second, func() bool { return p.client().state == stateDone }))
			if stealth {
				assert.Nil(t, answer)
				var te *TimeoutError
				assert.ErrorAs(t, p.client().err, &te)
			} else {
				assert.ErrorIs(t, p.client().err, ErrRefused)
				d, _, err := parseDatagram(answer)
				require.NoError(t, err)
				require.Len(t, d.msgs, 1)
				assert.Equal(t, uint32(idDisconnectAck), d.msgs[0].id)
			}
		})
	}
}

func TestSessionGracefulClose(t *testing.T) {
	p := newSimPair(t, nil, nil, lossy(11, 0.1), lossy(12, 0.1))
	p.connect()
	const n = 300
	for i := range n {
		p.send(0, numbered(100, i, 200))
	}
	p.client().requestClose(p.now)
	var disconnectSeen bool
	p.tap = func(from int, b []byte) {
		d, _, _ := parseDatagram(b)
		for _, m := range d.msgs {
			if m.id == idDisconnect {
				disconnectSeen = true
				assert.True(t, d.inOrder, "Disconnect travels in an InOrder datagram")
				assert.Len(t, p.h[1].msgs, n, "Disconnect only after everything is acked")
			}
		}
	}
	require.True(t, p.run(10*time.Second, func() bool { return p.client().done() && p.h[1].eof }))
	assert.True(t, disconnectSeen)
	assert.Len(t, p.h[1].msgs, n)
	assert.NoError(t, p.client().err)
	require.True(t, p.run(10*time.Second, func() bool { return p.server().done() }))
}

func TestSessionCloseGivesUpAfterDisconnectTimeout(t *testing.T) {
	cfg := &Config{DisconnectTimeout: 2 * time.Second, ConnectionLostTimeout: time.Minute}
	p := newSimPair(t, cfg, nil, perfect, perfect)
	p.connect()
	p.cut[1] = true // the server stops answering
	p.send(0, numbered(100, 1, 10))
	p.client().requestClose(p.now)
	start := p.now
	require.True(t, p.run(10*time.Second, func() bool { return p.client().done() }))
	assert.Equal(t, 2*time.Second, p.now.Sub(start))
	var te *TimeoutError
	require.ErrorAs(t, p.client().err, &te, "the close ended unanswered")
	assert.Equal(t, "disconnect", te.Op)
	assert.ErrorIs(t, p.client().err, net.ErrClosed)
}

// countSent counts, from side from, the datagrams holding message id.
func countSent(p *simPair, from int, id uint32) *int {
	n := new(int)
	p.tap = func(i int, b []byte) {
		d, _, err := parseDatagram(b)
		if err != nil || i != from {
			return
		}
		for _, m := range d.msgs {
			if !m.fragment && m.id == id {
				*n++
			}
		}
	}
	return n
}

func TestSessionDisconnectResentWithBackoff(t *testing.T) {
	// A peer that never answers gets a few Disconnects a second over the
	// DisconnectTimeout, not one every minimum RTO (was 243 in 2s).
	cfg := &Config{DisconnectTimeout: 2 * time.Second, ConnectionLostTimeout: time.Minute}
	p := newSimPair(t, cfg, nil, perfect, perfect)
	p.connect()
	require.True(t, p.run(time.Second, func() bool { return p.client().loss.sent.count == 0 && p.client().acks.pending() == 0 }))
	discs := countSent(p, 0, idDisconnect)
	var at []time.Duration
	tap := p.tap
	p.tap = func(i int, b []byte) {
		before := *discs
		tap(i, b)
		if *discs > before {
			at = append(at, p.now.Sub(timeZero))
		}
	}
	p.cut[1] = true
	p.client().requestClose(p.now)
	start := p.now
	require.True(t, p.run(10*time.Second, func() bool { return p.client().done() }))
	assert.Equal(t, 2*time.Second, p.now.Sub(start), "still bounded by DisconnectTimeout")
	assert.GreaterOrEqual(t, *discs, 4, "resent")
	// Doubling from the RTO (8ms here) to maxDiscBackoff: six, then four
	// a second.
	assert.LessOrEqual(t, *discs, 6+int(2*time.Second/maxDiscBackoff), "backed off: sent at %v", at)
	doubling := true
	for i := 2; i < len(at); i++ {
		gap, prev := at[i]-at[i-1], at[i-1]-at[i-2]
		doubling = doubling && (gap >= 2*prev-time.Millisecond || gap >= maxDiscBackoff-time.Millisecond)
	}
	assert.True(t, doubling, "gaps double up to %v: sent at %v", maxDiscBackoff, at)
}

func TestSessionCloseWithoutRTTSampleProbesWithinTimeout(t *testing.T) {
	// The first ConnectSynAck is lost, so the client has no RTT sample
	// (Karn) and an RTO of a full second; then the acks of its ConnectAck
	// are lost twice. Close waits for that ack before its Disconnect, and
	// probes backing off from 1s (1s, then 2s) took the whole 3s
	// DisconnectTimeout: the close ended unanswered, though the path
	// works. Probes during a close back off no further than an eighth of
	// the timeout.
	cfg := &Config{DisconnectTimeout: 3 * time.Second}
	link := netsim.Params{Delay: time.Millisecond}
	p := newSimPair(t, cfg, cfg, link, link)
	var synAcks, acks int
	p.drop = func(from int, b []byte) bool {
		d, _, err := parseDatagram(b)
		if err != nil || from != 1 {
			return false
		}
		for _, m := range d.msgs {
			switch {
			case m.id == idConnectSynAck && synAcks == 0:
				synAcks++
				return true
			case m.id == idPacketAck && acks < 2 && p.client().state == stateOK:
				acks++
				return true
			}
		}
		return false
	}
	p.connect()
	require.Zero(t, p.client().loss.rtt.samples, "no RTT sample: the RTO is the initial one")
	p.client().requestClose(p.now)
	start := p.now
	require.True(t, p.run(10*time.Second, func() bool { return p.client().done() }))
	assert.Equal(t, 2, acks)
	assert.NoError(t, p.client().err, "ended by a DisconnectAck, not by the timeout")
	assert.Less(t, p.now.Sub(start), 1500*time.Millisecond)
}

func TestSessionLostDisconnectAckAnsweredStatelessly(t *testing.T) {
	// The server answers the client's Disconnect, but the DisconnectAck is
	// lost and the server's application closes at once (on io.EOF), so the
	// server forgets the connection. The client's next Disconnect reaches
	// the listener, whose stateless DisconnectAck ends the close: no wait
	// for the DisconnectTimeout.
	cfg := &Config{DisconnectTimeout: 3 * time.Second}
	link := netsim.Params{Delay: time.Millisecond}
	p := newSimPair(t, cfg, cfg, link, link)
	p.connect()
	p.send(0, numbered(100, 1, 10))
	p.endpoints = true
	lost := 0
	p.drop = func(from int, b []byte) bool {
		d, _, err := parseDatagram(b)
		if err == nil && from == 1 && len(d.msgs) == 1 && d.msgs[0].id == idDisconnectAck && lost == 0 {
			lost++
			return true
		}
		return false
	}
	discs := countSent(p, 0, idDisconnect)
	p.client().requestClose(p.now)
	start := p.now
	require.True(t, p.run(time.Second, func() bool { return p.h[1].eof }))
	p.server().requestClose(p.now) // the application closes on io.EOF
	require.True(t, p.server().done(), "the server forgot the connection")
	require.True(t, p.run(10*time.Second, func() bool { return p.client().done() }))
	assert.Equal(t, 1, lost)
	assert.NoError(t, p.client().err, "ended by a DisconnectAck, not by the timeout")
	assert.Less(t, p.now.Sub(start), 100*time.Millisecond)
	assert.LessOrEqual(t, *discs, 3)
	assert.Equal(t, []Message{numbered(100, 1, 10)}, p.h[1].msgs)
}

func TestSessionSimultaneousCloseLostDisconnectAck(t *testing.T) {
	// Both sides close within half a millisecond, over 1ms links, right
	// after the handshake. The side that ends by answering the other's
	// Disconnect loses that DisconnectAck (as when a dialed socket closed
	// at once and its simulated network dropped what was in flight); it
	// still answers the resent Disconnect, from its socket that lingers
	// (client) or statelessly (listener), so neither side waits for the
	// DisconnectTimeout.
	for _, first := range []int{0, 1} {
		t.Run(fmt.Sprint("closing first: ", first), func(t *testing.T) {
			cfg := &Config{DisconnectTimeout: 5 * time.Second}
			link := netsim.Params{Delay: time.Millisecond}
			p := newSimPair(t, cfg, cfg, link, link)
			p.connect()
			p.endpoints = true
			lost := [2]int{}
			p.drop = func(from int, b []byte) bool {
				d, _, err := parseDatagram(b)
				if err == nil && len(d.msgs) == 1 && d.msgs[0].id == idDisconnectAck && lost[from] == 0 {
					lost[from]++
					return true
				}
				return false
			}
			p.s[first].requestClose(p.now)
			p.run(500*time.Microsecond, nil)
			p.s[1-first].requestClose(p.now)
			start := p.now
			require.True(t, p.run(10*time.Second, func() bool { return p.client().done() && p.server().done() }))
			assert.Less(t, p.now.Sub(start), 100*time.Millisecond)
			assert.NoError(t, p.client().err)
			assert.NoError(t, p.server().err)
			assert.Positive(t, lost[0]+lost[1], "a DisconnectAck was lost")
		})
	}
}

func TestSessionSimultaneousClose(t *testing.T) {
	p := newSimPair(t, nil, nil, perfect, perfect)
	p.connect()
	p.client().requestClose(p.now)
	p.server().requestClose(p.now)
	require.True(t, p.run(time.Second, func() bool { return p.client().done() && p.server().done() }))
	assert.Less(t, p.now.Sub(timeZero), 100*time.Millisecond)
}

func TestSessionGarbageIsCountedAndHarmless(t *testing.T) {
	p := newSimPair(t, nil, nil, perfect, perfect)
	p.connect()
	rng := rand.New(rand.NewPCG(5, 6))
	const n = 300
	invalid := 0
	for i := range n {
		p.send(0, numbered(100, i, 30))
		b := make([]byte, rng.IntN(60))
		for j := range b {
			b[j] = byte(rng.Uint32())
		}
		if _, _, err := parseDatagram(b); err != nil {
			invalid++
		}
		p.inject(1, b)
		p.run(time.Millisecond, nil)
	}
	require.True(t, p.run(5*time.Second, func() bool { return len(p.h[1].msgs) >= n }))
	assert.Equal(t, stateOK, p.server().state)
	// Besides what does not parse, the session refuses fragments in
	// unreliable datagrams and PacketIDs far ahead.
	assert.GreaterOrEqual(t, p.server().stats.InvalidDatagrams, uint64(invalid))
	assert.LessOrEqual(t, p.server().stats.InvalidDatagrams, uint64(n))
	seen := map[uint32]bool{}
	for _, m := range p.h[1].msgs {
		if m.ID == 100 {
			seen[binary.LittleEndian.Uint32(m.Payload)] = true
		}
	}
	assert.Len(t, seen, n)
}

func TestSessionTruncatedDatagramsDropWhole(t *testing.T) {
	p := newSimPair(t, nil, nil, perfect, perfect)
	p.connect()
	var captured [][]byte
	p.tap = func(from int, b []byte) {
		if from == 0 {
			captured = append(captured, append([]byte(nil), b...))
		}
	}
	p.cut[0] = true
	p.send(0, Message{ID: 100, Payload: []byte("abcdef"), Reliable: true})
	p.send(0, Message{ID: 101, Payload: []byte("ghijkl"), Reliable: true})
	p.run(time.Millisecond, nil)
	p.cut[0] = false
	require.NotEmpty(t, captured)
	whole := captured[0]
	before := p.server().stats.InvalidDatagrams
	for cut := minHeaderSize + 1; cut < len(whole); cut++ {
		if _, _, err := parseDatagram(whole[:cut]); err == nil {
			continue // a prefix that happens to be whole messages
		}
		p.inject(1, whole[:cut])
	}
	assert.Empty(t, p.h[1].msgs, "nothing of a truncated datagram is delivered")
	assert.Positive(t, p.server().stats.InvalidDatagrams-before)
	require.True(t, p.run(5*time.Second, func() bool { return len(p.h[1].msgs) == 2 }), "the real datagram still arrives")
}

func TestSessionRetransmitLimit(t *testing.T) {
	// The server's application never reads and its buffer is full, so it
	// leaves reliable datagrams unacked while still answering pings.
	client := &Config{MaxMessageSendCount: 5, PingInterval: 100 * time.Millisecond}
	p := newSimPair(t, client, &Config{ReceiveBuffer: 1000}, perfect, perfect)
	p.connect()
	p.h[1].hold = true
	for i := range 10 {
		p.send(0, numbered(100, i, 400))
	}
	require.True(t, p.run(30*time.Second, func() bool { return p.client().state == stateDone }))
	assert.ErrorIs(t, p.client().err, ErrRetransmitLimit)
	assert.Positive(t, p.server().stats.DroppedDatagrams)
}

func TestSessionReceiveBufferBackpressure(t *testing.T) {
	// The reader pauses; the sender neither loses data nor overfills the
	// receiver, and all arrives once the reader resumes.
	p := newSimPair(t, nil, &Config{ReceiveBuffer: 20000}, perfect, perfect)
	p.connect()
	p.h[1].hold = true
	const n = 200
	for i := range n {
		p.send(0, numbered(100, i, 1000))
	}
	p.run(2*time.Second, nil)
	assert.LessOrEqual(t, p.h[1].used, 20000+2*defaultMaxDatagramSize)
	assert.Less(t, len(p.h[1].msgs), n)
	p.h[1].hold = false
	p.h[1].used = 0
	require.True(t, p.run(30*time.Second, func() bool { return len(p.h[1].msgs) == n }))
}

// Held in-order messages can fill the receive buffer on their own while
// the application has read everything; the datagrams that fill the hole
// they wait behind, several in a row lost included, must still get in.
func TestSessionHeldMessagesDoNotBlockTheirHole(t *testing.T) {
	for _, seed := range []uint64{1, 2, 3} {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			p := newSimPair(t, nil, &Config{ReceiveBuffer: 5000}, lossy(seed, 0.15), perfect)
			p.connect()
			const n = 500
			for i := range n {
				m := numbered(100, i, 1000)
				m.InOrder = true
				p.send(0, m)
			}
			ok := p.run(30*time.Second, func() bool { return len(p.h[1].msgs) == n }) // 3-6 s over 40 seeds
			require.True(t, ok, "delivered %d of %d; client %v %v, server dropped %d", len(p.h[1].msgs), n, p.client().state, p.client().err, p.server().stats.DroppedDatagrams)
			for i, m := range p.h[1].msgs {
				require.Equal(t, uint32(i), binary.LittleEndian.Uint32(m.Payload), "in order")
			}
		})
	}
}

func TestSessionStaysWithinDatagramSize(t *testing.T) {
	for _, size := range []int{256, 600, 1400, 9000} {
		cfg := &Config{MaxDatagramSize: size}
		p := newSimPair(t, cfg, cfg, perfect, perfect)
		p.tap = func(from int, b []byte) { require.LessOrEqual(t, len(b), size) }
		p.connect()
		for i := range 300 {
			p.send(0, numbered(100, i, i*7%size))
			p.send(1, Message{ID: 7, Payload: bytes.Repeat([]byte{1}, i%50)})
		}
		require.True(t, p.run(10*time.Second, func() bool { return len(p.h[1].msgs) == 300 }))
	}
}

func TestPaddingMessage(t *testing.T) {
	b := appendHeader(nil, &header{})
	b = appendMessage(b, &message{id: idConnectSyn, payload: []byte("hi")})
	b = appendPadding(b, 1200)
	require.Len(t, b, 1200)
	d, _, err := parseDatagram(b)
	require.NoError(t, err)
	require.Len(t, d.msgs, 2)
	assert.Equal(t, uint32(idPadding), d.msgs[1].id)
	// Too little room: no padding.
	assert.Len(t, appendPadding(b[:20:20], 21), 20)
}

func TestServerNeverAmplifies(t *testing.T) {
	// However large the Admit reply, a server sends an unproven endpoint
	// no more bytes than it received from it; the client's resent
	// ConnectSyns buy the rest.
	for _, reply := range []int{0, 7, 1100, 1300} {
		t.Run(fmt.Sprint(reply), func(t *testing.T) {
			p := newSimPair(t, nil, nil, perfect, perfect)
			p.admit = func([]byte) ([]byte, bool) { return make([]byte, reply), true }
			in, out := 0, 0
			p.tap = func(from int, b []byte) {
				if from == 0 && !p.server().handshake.wasOpen {
					in += len(b)
				}
				if from == 1 && !p.server().handshake.wasOpen {
					out += len(b)
					assert.LessOrEqual(t, out, in, "server sent %d bytes for %d received", out, in)
				}
			}
			p.connect()
			assert.Equal(t, reply, len(p.client().handshake.synAck))
		})
	}
}

func TestServerRefusalNeverAmplifies(t *testing.T) {
	p := newSimPair(t, &Config{ConnectTimeout: time.Second}, nil, perfect, perfect)
	p.admit = func([]byte) ([]byte, bool) { return nil, false }
	in, out := 0, 0
	p.tap = func(from int, b []byte) {
		if from == 0 {
			in += len(b)
		} else {
			out += len(b)
		}
	}
	require.True(t, p.run(5*time.Second, func() bool { return p.client().state == stateDone }))
	assert.ErrorIs(t, p.client().err, ErrRefused)
	assert.LessOrEqual(t, out, in)
	assert.Positive(t, out)
}

func TestNoSpuriousResendsWhenThePeerStalls(t *testing.T) {
	// A loaded host deschedules a connection's goroutine for 10-20ms now
	// and then: its acks leave late, all at once, over a clean path. A
	// probe timeout under that resends what arrived. Every 200ms the
	// server stalls for 20ms (what it sends is held, then goes in order).
	p := newSimPair(t, nil, nil, netsim.Params{Delay: 50 * time.Microsecond}, netsim.Params{Delay: 50 * time.Microsecond})
	p.connect()
	var held [][]byte
	stalled := false
	p.tap = func(from int, b []byte) {
		p.cut[1] = from == 1 && stalled
		if p.cut[1] {
			held = append(held, append([]byte(nil), b...))
		}
	}
	for i := range 250 {
		if i%25 == 0 {
			stalled = true
		}
		if i%25 == 2 {
			stalled = false
			for _, b := range held {
				p.inject(0, b)
			}
			held = held[:0]
		}
		p.send(0, numbered(100, i, 40))
		p.run(10*time.Millisecond, nil)
	}
	require.True(t, p.run(time.Second, func() bool { return len(p.h[1].msgs) == 250 }))
	assert.Zero(t, p.client().stats.Retransmits, "resent what the stalled peer had")
	assert.Zero(t, p.client().snapshot().SpuriousLosses)
}
