package knet

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/netsim"
)

// TestKeyUpdateOldPeer: a side with key updates off (KeyUpdateInterval
// negative) is, on the wire, a peer of before them: it never announces
// them, ignores the announcement, and has one key each way. Against it,
// a side that wants a key update after every datagram still talks (over
// a lossy path, every message arrives), never changes its keys (the
// ledger sees one key each way), and stops announcing after announceMax.
// Both ways round: an old client and an old server.
func TestKeyUpdateOldPeer(t *testing.T) {
	for _, oldSide := range []int{0, 1} {
		t.Run([]string{"OldClient", "OldServer"}[oldSide], func(t *testing.T) {
			cfgs := [2]*Config{{KeyUpdateInterval: 1}, {KeyUpdateInterval: 1}}
			cfgs[oldSide].KeyUpdateInterval = -1
			p := newSecureSimPair(t, cfgs[0], cfgs[1], lossy(3, 0.1), lossy(4, 0.1))
			p.connect()
			const n = 2000
			for i := range n {
				p.send(0, numbered(100, i, 30))
				p.send(1, numbered(100, i, 30))
				if i%20 == 0 {
					p.run(20*time.Millisecond, nil)
				}
			}
			require.True(t, p.run(time.Minute, func() bool { return len(p.h[0].msgs) == n && len(p.h[1].msgs) == n }),
				"delivered %d and %d of %d", len(p.h[1].msgs), len(p.h[0].msgs), n)
			newSide := 1 - oldSide
			assert.Nil(t, p.sec[oldSide].ku, "the old side has no key update state")
			ku := p.sec[newSide].ku
			assert.False(t, ku.peer, "the old peer never announced")
			assert.Zero(t, ku.sendPhase, "never an update to an old peer")
			assert.Zero(t, ku.recvPhase)
			assert.Positive(t, ku.announced)
			assert.LessOrEqual(t, ku.announced, announceMax, "announcements to a silent peer stop")
			keys, sealed := p.ledger.keys()
			assert.Equal(t, 2, keys, "one key each way, %d datagrams sealed", sealed)
		})
	}
}

// TestKeyUpdatePreviousKeyErased: after the client's key update, the
// server keeps the previous key for reordered datagrams, and only for
// keyDropPTOs retransmission timeouts. A datagram of the previous phase
// delayed less than that opens; one delayed longer, once the key is gone,
// is dropped and counted invalid (its message arrives in the client's
// resend under the current key). The client erases its own old key at
// the update: it seals nothing more under it.
func TestKeyUpdatePreviousKeyErased(t *testing.T) {
	path := netsim.Params{Delay: 20 * time.Millisecond}
	cfg := &Config{KeyUpdateInterval: 1}
	p := newSecureSimPair(t, cfg, cfg, path, path)
	p.connect()
	p.exchange(t, 5)
	cli, srv := p.sec[0], p.sec[1]
	// Two datagrams of the client's current phase held back: the path
	// delays them.
	early, phase := p.holdNext(t, 0, numbered(300, 0, 30))
	late, _ := p.holdNext(t, 0, numbered(301, 0, 30))
	oldPrint := cli.tapKey
	// The client's next message: acked, then the client updates, and
	// its next datagram takes the server to the next phase.
	p.send(0, numbered(302, 0, 30))
	require.True(t, p.run(5*time.Second, func() bool { return srv.ku.recvPhase == phase+1 }), "client %v server %v", cli.ku, srv.ku)
	require.NotNil(t, srv.ku.prev, "the previous key is kept")
	assert.NotEqual(t, oldPrint, cli.tapKey, "the client seals under a new key")
	underOld := p.ledger.sealedUnder(oldPrint)
	// Within the bound: the early datagram opens under the previous key.
	invalid := srv.invalid
	p.inject(1, early)
	assert.Equal(t, invalid, srv.invalid, "opened under the previous key")
	assert.True(t, hasID(p.h[1].msgs, 300))
	// Past the bound, with no update in between (the client sends nothing
	// reliable), the next datagram in erases it.
	bound := srv.ku.prevUntil
	require.True(t, bound.Sub(p.now) <= keyDropPTOs*p.server().rto(), "kept at most %d timeouts", keyDropPTOs)
	require.True(t, p.run(time.Minute, func() bool { return p.now.After(bound) && srv.ku.prev == nil }))
	require.Equal(t, phase+1, srv.ku.recvPhase, "no update in between")
	p.inject(1, late)
	assert.Equal(t, invalid+1, srv.invalid, "nothing opens a datagram of an erased phase")
	// The message still arrives: the client sends it again, under its
	// current key.
	require.True(t, p.run(time.Minute, func() bool { return hasID(p.h[1].msgs, 301) }))
	assert.Equal(t, underOld, p.ledger.sealedUnder(oldPrint), "nothing sealed under the old key after the update, not even the resend")
}

// sealedUnder is how many packet numbers the ledger saw sealed under the
// key of fingerprint key.
func (l *nonceLedger) sealedUnder(key [8]byte) (n int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for k := range l.seen {
		if k.key == key {
			n++
		}
	}
	return n
}

// hasID reports whether msgs holds a message with id.
func hasID(msgs []Message, id uint32) bool {
	for _, m := range msgs {
		if m.ID == id {
			return true
		}
	}
	return false
}

// TestKeyUpdateTimeBound: with the default interval (2^20 datagrams, far
// off) and KeyUpdateTime 1 s, each direction replaces its key about once
// a second of simulated time, no more, while traffic flows; the Config's
// values resolve as documented.
func TestKeyUpdateTimeBound(t *testing.T) {
	cfg := &Config{KeyUpdateTime: time.Second}
	p := newSecureSimPair(t, cfg, cfg, lossy(5, 0.05), lossy(6, 0.05))
	p.connect()
	for i := range 1000 {
		p.send(0, numbered(100, i, 30))
		p.send(1, numbered(100, i, 30))
		p.run(10*time.Millisecond, nil)
	}
	c, s := p.keyPhases()
	assert.InDelta(t, 9.5, float64(c), 1.5, "client phases in 10 s")
	assert.InDelta(t, 9.5, float64(s), 1.5, "server phases in 10 s")
	assert.Equal(t, c, p.sec[1].ku.recvPhase)
	assert.Equal(t, s, p.sec[0].ku.recvPhase)

	for _, tc := range []struct {
		cfg     Config
		packets uint64
		every   time.Duration
	}{
		{Config{}, 1 << 20, 5 * time.Minute},
		{Config{KeyUpdateInterval: 1000, KeyUpdateTime: -1}, 1000, 0},
		{Config{KeyUpdateInterval: 1 << 30}, 1 << 20, 5 * time.Minute},
		{Config{KeyUpdateInterval: -1, KeyUpdateTime: time.Second}, 0, 0},
	} {
		packets, every := tc.cfg.keyUpdates()
		assert.Equal(t, tc.packets, packets, "%+v", tc.cfg)
		if packets != 0 {
			assert.Equal(t, tc.every, every, "%+v", tc.cfg)
		}
	}
}

// TestKeyUpdateUnreliableOnly: a game that sends only unreliable
// messages both ways (state at 100 Hz) gets no acks, the proof an update
// otherwise waits for: a side whose update is due sends a PingRequest at
// once (at most every 1.25 s, a quarter of the keepalive), whose answer
// proves the peer has the current key. With an update due after every 16
// datagrams, over 20 s of simulated time on a path losing 2%, each side
// makes a dozen updates or more (the keepalive's pings alone, every 5 s,
// would allow four), the receivers follow, the pings
// ride in datagrams that went anyway, and the nonce ledger finds no
// nonce reused. Before, neither side updated, and at 2^23 datagrams (a
// day at 100 Hz) the connection would have ended.
func TestKeyUpdateUnreliableOnly(t *testing.T) {
	cfg := &Config{KeyUpdateInterval: 16}
	p := newSecureSimPair(t, cfg, cfg, lossy(7, 0.02), lossy(8, 0.02))
	p.connect()
	for i := range 2000 {
		for side := range 2 {
			m := numbered(100, i, 30)
			m.Reliable = false
			p.send(side, m)
		}
		p.run(10*time.Millisecond, nil)
	}
	c, s := p.keyPhases()
	t.Logf("phases: client %d, server %d; client %+v; server %+v", c, s, p.s[0].stats, p.s[1].stats)
	assert.GreaterOrEqual(t, c, uint64(12), "client phases in 20 s")
	assert.GreaterOrEqual(t, s, uint64(12), "server phases in 20 s")
	for side := range 2 {
		assert.Less(t, p.s[side].stats.DatagramsSent, uint64(2100), "side %d: datagrams for 2,000 messages", side)
	}
	assert.Equal(t, c, p.sec[1].ku.recvPhase)
	assert.Equal(t, s, p.sec[0].ku.recvPhase)
	assert.Zero(t, p.sec[0].ku.tooFast+p.sec[1].ku.tooFast)
	assert.Equal(t, stateOK, p.s[0].state)
	assert.Equal(t, stateOK, p.s[1].state)
}

// A key due without proof asks for a ping (pingForProof), but not while
// the connection is suspended: its pings are then resume.go's, spaced
// out while the peer is silent, and a ping for proof every keepalive/4
// would undo that spacing.
func TestKeyUpdateProofPingNotWhileSuspended(t *testing.T) {
	t.Parallel()
	cfg := &Config{KeyUpdateInterval: 16}
	p := newSecureSimPair(t, cfg, cfg, netsim.Params{}, netsim.Params{})
	p.connect()
	s := p.client()
	now := p.now.Add(time.Minute) // past any ping the handshake made
	later := now.Add(time.Hour)
	s.live.nextPing = later
	s.live.suspended = true
	s.pingForProof(now, s.send.nextPN)
	assert.Equal(t, later, s.live.nextPing, "suspended: no ping for proof")
	s.live.suspended = false
	s.pingForProof(now, s.send.nextPN)
	assert.Equal(t, now, s.live.nextPing, "not suspended: a ping goes now")
}
