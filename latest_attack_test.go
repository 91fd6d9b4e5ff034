package knet

import (
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Attacks on unreliable latest-state tags (latest.go takeVersion,
// session_spec.go): a hostile peer's tags order only its own states, in
// bounded memory, and no shape of them breaks the connection.

// tagMsg is a latest-state tag naming version ver of content.
func tagMsg(content, ver uint32) message {
	var c [9]byte
	c[0] = extLatest
	binary.LittleEndian.PutUint32(c[1:], content)
	binary.LittleEndian.PutUint32(c[5:], ver)
	return message{id: idExt, payload: c[:]}
}

// payloadsOf returns the payloads of ID id that h took, in order.
func payloadsOf(h *simHost, id uint32) []string {
	var got []string
	for _, m := range h.msgs {
		if m.ID == id {
			got = append(got, string(m.Payload))
		}
	}
	return got
}

// Each odd shape of a tag in an unreliable datagram: the connection goes
// on, only a tag right before an application message (not a fragment)
// orders it, and a tag that ordered nothing records nothing.
func TestLatestAttackUnreliableTagShapes(t *testing.T) {
	p := newSimPair(t, nil, nil, perfect, perfect)
	p.connect()
	s := p.server()
	pid := p.client().send.nextPID
	send := func(msgs ...message) {
		d := datagram{header: header{packetID: pid}, msgs: msgs}
		pid++
		p.inject(1, appendDatagram(nil, &d))
		require.Equal(t, stateOK, s.state, "%v", s.err)
	}
	app := func(v string) message { return message{id: 300, payload: []byte(v)} }

	send(tagMsg(1, 5), app("v5"))
	send(tagMsg(1, 4), app("v4")) // older: obsolete
	send(tagMsg(1, 0xffff_ffff))  // a tag and nothing after it
	send(app("untagged"), tagMsg(1, 1<<30))
	send(tagMsg(1, 1<<30), tagMsg(2, 1), app("c2v1")) // the second tag is the one before the message
	send(tagMsg(1, 1<<30), message{id: idPacketAck, payload: appendPacketAck(nil, packetAck{base: s.send.nextPID - 1})})
	send(tagMsg(1, 1<<30), message{id: idPingRequest, payload: []byte{1}})
	send(tagMsg(1, 1<<30), message{fragStart: true, fragment: true, id: 300, fragCount: 2, transferID: 3, payload: []byte("frag")})
	send(tagMsg(1, 1<<30), message{fragment: true, transferID: 3, fragNumber: 1, payload: []byte("ment")})
	send(tagMsg(1, 1<<30), message{id: 300, order: 1, payload: []byte("ordered")})
	// None of the 1<<30 tags was taken: version 6 still is newer.
	send(tagMsg(1, 6), app("v6"))
	got := payloadsOf(p.h[1], 300)
	assert.Subset(t, got, []string{"v5", "untagged", "c2v1", "v6"})
	assert.NotContains(t, got, "v4")
	assert.Less(t, indexOf(got, "v5"), indexOf(got, "v6"))
	assert.Equal(t, uint32(6), s.x.seen.newest[contentKey{300, 1}])
	assert.LessOrEqual(t, len(s.x.seen.newest), 2)
	assert.Equal(t, stateOK, s.state)
	assert.Zero(t, s.stats.ProtocolErrors)
}

func indexOf(ss []string, s string) int {
	for i, x := range ss {
		if x == s {
			return i
		}
	}
	return -1
}

// A peer tagging 3*maxLatestStates distinct states, with versions near
// the top of the u32, over the wire: every message is delivered, the
// record stays within maxLatestStates, and the connection goes on.
func TestLatestAttackManyStatesOverWire(t *testing.T) {
	p := newSimPair(t, nil, nil, perfect, perfect)
	p.connect()
	s := p.server()
	pid := p.client().send.nextPID
	const states = 3 * maxLatestStates
	for c := range uint32(states) {
		d := datagram{header: header{packetID: pid}, msgs: []message{tagMsg(c, 0xffff_fff0+c%16), {id: 301, payload: []byte{1}}}}
		pid++
		p.inject(1, appendDatagram(nil, &d))
		if c%512 == 0 {
			require.Equal(t, stateOK, s.state, "%v", s.err)
			require.LessOrEqual(t, len(s.x.seen.newest), maxLatestStates)
		}
	}
	assert.Equal(t, stateOK, s.state)
	assert.LessOrEqual(t, len(s.x.seen.newest), maxLatestStates)
	assert.Len(t, payloadsOf(p.h[1], 301), states)
	assert.Zero(t, s.stats.ProtocolErrors)
}
