package knet

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// An unreliable message with a ContentID too large for one datagram
// travels as a reliable transfer, and its receipt is kept with the
// reliable ones. Replaced by a newer version before it went, it never
// left: its receipt must say lost. It said delivered: putMsg took it for
// told (receipted), and once its track was let go of the reliable
// receipts took that for resolved.
func TestReceiptsAttackReplacedFragmentedLatestIsLost(t *testing.T) {
	p := newSimPair(t, &Config{Receipts: true}, nil, perfect, perfect)
	p.connect()
	p.run(100*time.Millisecond, nil)
	big := make([]byte, 3*p.client().cfg.maxDatagram)
	old := p.send(0, Message{ID: 120, Payload: big, ContentID: 1})
	newer := p.send(0, Message{ID: 120, Payload: big, ContentID: 1})
	last := p.send(0, Message{ID: 121, Payload: []byte("r"), Reliable: true})
	require.True(t, p.run(5*time.Second, func() bool { return len(p.h[0].receipts) >= 3 }))
	p.run(time.Second, nil)
	require.Len(t, p.h[1].msgs, 2, "the replaced one never left")
	told := receiptsOf(p.h[0].receipts)
	assert.Equal(t, []bool{false}, told[old], "replaced before it went")
	assert.Equal(t, []bool{true}, told[newer])
	assert.Equal(t, []bool{true}, told[last])
}

// A peer acking PacketIDs it never got: those of unreliable datagrams
// that asked no ack, and ones older than any sent. No receipt is told
// for them and nothing breaks; the ack of a datagram that did ask (a
// plaintext peer may ack what it likes: its own acks are its word) tells
// its messages delivered, once. An ack of a PacketID never sent (not
// reached yet, far ahead) is a lie no honest peer can tell: it ends the
// connection (issue 38).
func TestReceiptsAttackForgedAcks(t *testing.T) {
	p := newSimPair(t, &Config{Receipts: true}, nil, perfect, perfect)
	p.connect()
	p.run(100*time.Millisecond, nil)
	var asked []uint32
	p.drop = func(from int, b []byte) bool {
		d, _, err := parseDatagram(b)
		if from == 0 && err == nil && !d.header.reliable && asksAck(d.msgs) {
			asked = append(asked, d.header.packetID)
			return true // the peer never gets them
		}
		return false
	}
	ref := p.send(0, Message{ID: 120, Payload: []byte("u")})
	p.run(time.Millisecond, nil)
	require.Len(t, asked, 1)
	c := p.client()
	ack := func(ids ...uint32) {
		pid := p.server().send.nextPID
		p.server().numberNew(false)
		h := header{packetID: pid}
		b := appendHeader(nil, &h)
		for _, id := range ids {
			b = c.wire.appendAck(b, packetAck{base: id})
		}
		p.inject(0, b)
	}
	// The datagram before the one that asked, and a PacketID in the half
	// behind the next one (serial arithmetic): older than any sent.
	ack(asked[0]-1, (c.send.nextPID+1<<21+1)&packetIDMask)
	assert.Empty(t, p.h[0].receipts, "no receipt for what asked no ack")
	ack(asked[0], asked[0])
	assert.Equal(t, []bool{true}, receiptsOf(p.h[0].receipts)[ref], "the peer's word, once")
	assert.Equal(t, stateOK, c.state)
	assert.False(t, c.rcptOf().awaitsAck())
	for _, ahead := range []uint32{0, 5, 1000} {
		q := newSimPair(t, &Config{Receipts: true}, nil, perfect, perfect)
		q.connect()
		q.run(100*time.Millisecond, nil)
		qc := q.client()
		h := header{packetID: q.server().send.nextPID}
		q.server().numberNew(false)
		q.inject(0, qc.wire.appendAck(appendHeader(nil, &h), packetAck{base: (qc.send.nextPID + ahead) & packetIDMask}))
		var pe *ProtocolError
		assert.ErrorAs(t, qc.err, &pe, "an ack %d PacketIDs past the next", ahead)
		assert.Equal(t, uint64(1), qc.stats.ProtocolErrors)
	}
}

// In a secure session, no one without the keys can make a receipt say
// delivered: a forged plaintext ack of the datagram that asked is
// dropped, and the receipt says lost.
func TestReceiptsAttackSecureForgedAck(t *testing.T) {
	p := newSecureSimPair(t, &Config{Receipts: true}, nil, perfect, perfect)
	p.connect()
	p.run(100*time.Millisecond, nil)
	var asked []uint32
	p.drop = func(from int, b []byte) bool {
		d, _, err := parseDatagram(b)
		if from == 0 && err == nil && !d.header.reliable && asksAck(d.msgs) {
			asked = append(asked, d.header.packetID)
			return true
		}
		return false
	}
	ref := p.send(0, Message{ID: 120, Payload: []byte("u")})
	p.run(time.Millisecond, nil)
	require.Len(t, asked, 1)
	h := header{packetID: 77}
	b := p.client().wire.appendAck(appendHeader(nil, &h), packetAck{base: asked[0]})
	p.inject(0, b)
	p.run(5*time.Second, nil)
	assert.Equal(t, []bool{false}, receiptsOf(p.h[0].receipts)[ref])
}

// A flood of unreliable datagrams asking acks, copies among them: each is
// acked once, copies not again, and the connection stays up.
func TestReceiptsAttackAckRequestFlood(t *testing.T) {
	p := newSimPair(t, nil, nil, perfect, perfect)
	p.connect()
	p.run(200*time.Millisecond, nil)
	acked := map[uint32]int{}
	p.tap = func(from int, b []byte) {
		d, _, err := parseDatagram(b)
		if from != 1 || err != nil {
			return
		}
		for _, m := range d.msgs {
			if m.id == idPacketAck && !m.fragment {
				if a, ok := parsePacketAck(m.payload); ok {
					a.each(func(id uint32) { acked[id]++ })
				}
			}
		}
	}
	req := message{id: idExt, payload: []byte{extAckRequest}}
	var sent []uint32
	for i := range 5000 {
		pid := p.client().send.nextPID
		p.client().numberNew(false)
		h := header{packetID: pid}
		b := appendHeader(nil, &h)
		// The request first, last, twice.
		b = appendMessage(b, &req)
		b = appendMessage(b, &message{id: 120, payload: []byte{byte(i)}})
		b = appendMessage(b, &req)
		p.inject(1, b)
		p.inject(1, b) // a copy
		sent = append(sent, pid)
		if i%100 == 0 {
			p.run(time.Millisecond, nil)
		}
	}
	p.run(200*time.Millisecond, nil)
	for _, pid := range sent {
		if acked[pid] == 0 {
			t.Fatalf("PacketID %d never acked", pid)
		}
	}
	assert.Equal(t, stateOK, p.server().state)
	assert.Zero(t, p.server().acks.pending())
}

// Close right after sending unreliable messages that want receipts: the
// Disconnect goes as soon as nothing reliable is unacked, and the peer,
// answering it, sends no more acks. When our close ends with its
// DisconnectAck, every receipt still owed must be told (lost, unless its
// ack came): none may be left untold as the connection ends.
func TestReceiptsAttackGracefulCloseTellsEveryReceipt(t *testing.T) {
	p := newSimPair(t, &Config{Receipts: true}, nil, perfect, perfect)
	p.connect()
	p.run(100*time.Millisecond, nil)
	var refs []Ref
	for i := range 5 {
		refs = append(refs, p.send(0, Message{ID: 120, Payload: []byte{byte(i)}}))
	}
	p.client().requestClose(p.now)
	require.True(t, p.run(10*time.Second, func() bool { return p.client().done() }))
	require.NoError(t, p.client().err, "a graceful close")
	told := receiptsOf(p.h[0].receipts)
	for _, ref := range refs {
		assert.Len(t, told[ref], 1, "ref %d told once", ref)
	}
}

// From an address with no connection, an ack request or a latest-state
// tag is no connection attempt: with an application message, in either
// kind of datagram, at any PacketID, padded or not, nothing answers,
// nothing is accepted, and each is counted a stray.
func TestExtensionBlocksFromUnknownAddress(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		raw := nw.rawSocket(t, l.Addr())
		var sent int
		for _, reliable := range []bool{false, true} {
			for _, pid := range []uint32{0, 1, 77, packetIDMask} {
				for _, ext := range [][]byte{ackRequest[:], appendLatestTag(nil, 1, 1)} {
					h := header{packetID: pid, reliable: reliable}
					b := appendHeader(nil, &h)
					if len(ext) == 1 {
						b = appendMessage(b, &message{id: idExt, payload: ext})
					} else {
						b = append(b, ext...) // a whole message block already
					}
					b = appendMessage(b, &message{id: 100, payload: []byte("hello")})
					for _, pad := range []int{0, 1200} {
						d := b
						if pad > 0 {
							d = appendPadding(append([]byte(nil), b...), pad)
						}
						_, err := raw.Write(d)
						require.NoError(t, err)
						sent++
					}
				}
			}
		}
		synctest.Wait()
		assert.Empty(t, readAll(t, raw), "nothing answers")
		st := l.Stats()
		assert.Zero(t, st.Connections)
		assert.Zero(t, st.Pending)
		assert.Equal(t, uint64(sent), st.StrayDatagrams+st.InvalidDatagrams, "each dropped and counted")
		_, err := l.AcceptConn(within(t, 50*time.Millisecond))
		assert.ErrorIs(t, err, context.DeadlineExceeded)
	})
}
