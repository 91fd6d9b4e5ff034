package knet

import (
	"crypto/rand"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Attacks on key updates (issue 36) from someone without the keys.

// TestKeyUpdateAttackForgedFloodCost: a flood of datagrams forged to look
// like the next phase's (a genuine header with a packet number ahead, a
// body of noise) costs the receiver a bounded work each: no allocation
// and no key derivation per datagram (the next phase's key is derived
// once and kept), and nothing of the key state moves: phase, the keys
// held, the previous key's deadline, the replay window's top.
func TestKeyUpdateAttackForgedFloodCost(t *testing.T) {
	p := keyUpdatePair(t)
	srv := p.sec[1]
	genuine, _ := p.holdNext(t, 0, numbered(200, 0, 30))
	k := srv.ku
	forged := make([]byte, len(genuine))
	copy(forged, genuine)
	rand.Read(forged[minHeaderSize+cidSize:])
	buf := make([]byte, len(forged))
	srv.open(append(buf[:0], forged...)) // the first derives the next key
	next, recv, prev, prevUntil := k.next, srv.recv, k.prev, k.prevUntil
	phase, top, invalid := k.recvPhase, srv.replay.top, srv.invalid
	require.NotNil(t, next)
	const n = 1000
	allocs := testing.AllocsPerRun(n, func() {
		copy(buf, forged)
		if pt, _ := srv.open(buf); pt != nil {
			t.Fatal("a forgery opened")
		}
	})
	assert.Zero(t, allocs, "allocations per forged datagram")
	assert.Same(t, next, k.next, "the next key derived again")
	assert.Same(t, recv, srv.recv)
	assert.Equal(t, prev, k.prev)
	assert.Equal(t, prevUntil, k.prevUntil)
	assert.Equal(t, phase, k.recvPhase)
	assert.Equal(t, top, srv.replay.top)
	assert.Equal(t, invalid+n+1, srv.invalid, "every forgery counted") // AllocsPerRun runs once more
	// The genuine datagram still opens, and moves the phase.
	p.inject(1, genuine)
	p.exchange(t, 5)
	assert.Greater(t, k.recvPhase, phase)
	assert.Equal(t, stateOK, p.server().state)
}
