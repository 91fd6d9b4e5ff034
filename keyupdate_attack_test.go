package knet

import (
	"bytes"
	"crypto/rand"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/netsim"
)

// keyUpdatePair is a secure sim pair over a 5 ms path, both sides
// updating their keys after every acked datagram, connected, with a few
// updates made each way.
func keyUpdatePair(t *testing.T) *simPair {
	t.Helper()
	path := netsim.Params{Delay: 5 * time.Millisecond}
	cfg := &Config{KeyUpdateInterval: 1}
	p := newSecureSimPair(t, cfg, cfg, path, path)
	p.connect()
	p.exchange(t, 20)
	c, s := p.keyPhases()
	require.Greater(t, c, uint64(3))
	require.Greater(t, s, uint64(3))
	return p
}

// exchange has each side send n reliable messages, one every 10 ms, and
// waits until all arrived.
func (p *simPair) exchange(t *testing.T, n int) {
	t.Helper()
	want := [2]int{len(p.h[0].msgs) + n, len(p.h[1].msgs) + n}
	for i := range n {
		p.send(0, numbered(100, i, 20))
		p.send(1, numbered(100, i, 20))
		p.run(10*time.Millisecond, nil)
	}
	require.True(t, p.run(10*time.Second, func() bool { return len(p.h[0].msgs) == want[0] && len(p.h[1].msgs) == want[1] }))
}

// holdNext sends m from side and holds the sealed datagram that carries
// it instead of putting it on the path (as a path that delays it would):
// it returns that datagram, and what the sender's phase was.
func (p *simPair) holdNext(t *testing.T, side int, m Message) (sealed []byte, phase uint64) {
	t.Helper()
	var held []byte
	p.drop = func(from int, plain []byte) bool {
		var d datagram
		if from != side || held != nil || parseInto(plain, &d) != nil || !d.has(m.ID) {
			return false
		}
		// The same plaintext sealed again under its packet number and
		// the current key: the bytes that would have gone.
		out := p.s[side].lastOut()
		b, err := p.sec[side].seal(nil, plain, out.pn, false)
		require.NoError(t, err)
		held = b
		phase = p.sec[side].ku.sendPhase
		return true
	}
	p.send(side, m)
	p.flush()
	p.drop = nil
	require.NotNil(t, held)
	return held, phase
}

// TestKeyUpdateAttackForgedNextPhase: datagrams forged to look like the
// next phase's (a genuine header and packet number ahead, a body that is
// noise, or a genuine datagram with one bit flipped) open under no key:
// each is dropped and counted as invalid, the receiver stays in its
// phase, and the connection goes on.
func TestKeyUpdateAttackForgedNextPhase(t *testing.T) {
	p := keyUpdatePair(t)
	srv := p.sec[1]
	phase, invalid := srv.ku.recvPhase, srv.invalid
	genuine, _ := p.holdNext(t, 0, numbered(200, 0, 30))
	const forged = 50
	for i := range forged {
		b := append([]byte(nil), genuine...)
		if i%2 == 0 {
			rand.Read(b[minHeaderSize+cidSize:])
		} else {
			b[len(b)-1-i%17] ^= 0x40
		}
		p.inject(1, b)
	}
	assert.Equal(t, invalid+forged, srv.invalid, "every forgery counted")
	assert.Equal(t, phase, srv.ku.recvPhase, "no forgery moves the phase")
	assert.Zero(t, srv.ku.tooFast)
	// The genuine one still opens, and the connection goes on updating.
	p.inject(1, bytes.Clone(genuine))
	p.exchange(t, 10)
	assert.Equal(t, invalid+forged, srv.invalid)
	assert.Greater(t, srv.ku.recvPhase, phase)
	assert.Equal(t, stateOK, p.server().state)
}

// TestKeyUpdateAttackReplayAcrossUpdate: a datagram of the client's,
// recorded, is replayed to the server after the keys changed. Within the
// previous key's life it opens, but the replay window knows its packet
// number: the session drops it as a duplicate and delivers nothing. Once
// the receiver moved two phases on, no key it holds opens it: dropped and
// counted invalid. Nothing is delivered twice, and the phase does not
// move back.
func TestKeyUpdateAttackReplayAcrossUpdate(t *testing.T) {
	p := keyUpdatePair(t)
	srv := p.sec[1]
	var recorded []byte
	p.tap = func(from int, b []byte) {
		var d datagram
		if from == 0 && recorded == nil {
			recorded = append([]byte(nil), b...)
			_ = d
		}
	}
	p.exchange(t, 1)
	p.tap = nil
	require.NotNil(t, recorded)
	delivered := len(p.h[1].msgs)
	// One phase on: the previous key opens it, the replay window drops it.
	phase := srv.ku.recvPhase
	invalid, dups := srv.invalid, p.server().stats.DuplicateDatagrams+srv.replays
	p.inject(1, bytes.Clone(recorded))
	assert.Equal(t, delivered, len(p.h[1].msgs), "a replay delivers nothing")
	assert.Equal(t, invalid, srv.invalid)
	assert.Equal(t, dups+1, p.server().stats.DuplicateDatagrams+srv.replays, "counted as a duplicate")
	// Several phases on: no key opens it.
	p.exchange(t, 10)
	require.GreaterOrEqual(t, srv.ku.recvPhase, phase+2)
	delivered, invalid = len(p.h[1].msgs), srv.invalid
	p.inject(1, bytes.Clone(recorded))
	assert.Equal(t, delivered, len(p.h[1].msgs))
	assert.Equal(t, invalid+1, srv.invalid, "counted invalid")
	p.exchange(t, 3)
	assert.Equal(t, stateOK, p.server().state)
}

// TestKeyUpdateAttackTooFast: a client that updates its key twice
// without waiting for the ack the rule asks for. Its datagram two phases
// ahead opens under no key the server tries: dropped, counted. Once the
// server took the next phase, a datagram of the phase after that which
// comes before the server sealed anything (so before the client can have
// had an ack of the phase) is refused as too fast: dropped, counted, the
// phase unchanged. The connection goes on: after the server's next
// datagram, the client's resends under its key are taken and everything
// arrives.
func TestKeyUpdateAttackTooFast(t *testing.T) {
	p := keyUpdatePair(t)
	cli, srv := p.sec[0], p.sec[1]
	p.exchange(t, 2)
	// The client may have taken its next key on the last answer it got,
	// with nothing sent under it yet: its next datagram carries it, and
	// the server's answer lets the client's next update come.
	require.True(t, p.run(10*time.Second, func() bool { return cli.ku.sendPhase == srv.ku.recvPhase && srv.ku.sealedSince }),
		"the server holds the client's phase, and sealed a datagram since")
	require.NoError(t, cli.ku.rekeySend(cli, p.now))
	next, _ := p.holdNext(t, 0, numbered(201, 0, 30))
	require.NoError(t, cli.ku.rekeySend(cli, p.now))
	ahead, _ := p.holdNext(t, 0, numbered(202, 0, 30))
	phase, invalid, refused := srv.ku.recvPhase, srv.invalid, srv.ku.tooFast
	p.inject(1, bytes.Clone(ahead))
	assert.Equal(t, phase, srv.ku.recvPhase, "two phases ahead: not taken")
	assert.Equal(t, invalid+1, srv.invalid, "counted")
	p.inject(1, bytes.Clone(next))
	require.Equal(t, phase+1, srv.ku.recvPhase, "the next phase is taken")
	p.inject(1, bytes.Clone(ahead))
	assert.Equal(t, refused+1, srv.ku.tooFast, "an update before any ack could be had is refused")
	assert.Equal(t, invalid+2, srv.invalid, "and counted invalid")
	assert.Equal(t, phase+1, srv.ku.recvPhase, "the phase stays")
	require.True(t, p.run(20*time.Second, func() bool {
		n := 0
		for _, m := range p.h[1].msgs {
			if m.ID == 201 || m.ID == 202 {
				n++
			}
		}
		return n == 2
	}), "client %v, server %v", cli.ku, srv.ku)
	assert.Equal(t, phase+2, srv.ku.recvPhase)
	assert.Equal(t, stateOK, p.server().state)
}

// BenchmarkKeyUpdateOpen1200: what key updates add to opening a 1200-byte
// datagram of the current phase (the common case): the copy kept for the
// next trial. off: no key updates.
func BenchmarkKeyUpdateOpen1200(b *testing.B) {
	for _, on := range []bool{false, true} {
		b.Run(map[bool]string{false: "off", true: "on"}[on], func(b *testing.B) {
			cs, ss := securePair(b)
			if on {
				ss.ku = newKeyUpdates(&config{keyUpdatePackets: defaultKeyUpdatePackets})
			}
			d := appendHeader(nil, &header{packetID: 5})
			d = append(d, make([]byte, 1200-len(d)-wireOverhead)...)
			sealed, err := cs.seal(nil, d, 5, true)
			require.NoError(b, err)
			buf := make([]byte, len(sealed))
			n := headerSize(sealed) + cidSize
			b.SetBytes(int64(len(sealed)))
			for b.Loop() {
				copy(buf, sealed)
				if _, err := ss.openSealed(buf[n:], 5, buf[:n]); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
