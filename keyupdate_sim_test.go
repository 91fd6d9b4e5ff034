package knet

import (
	"encoding/binary"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// keyPhases returns each direction's sending phase, client's first.
func (p *simPair) keyPhases() (client, server uint64) {
	return p.sec[0].ku.sendPhase, p.sec[1].ku.sendPhase
}

// TestKeyUpdateEveryPacketLossyReorder: both sides update their keys
// after every datagram whose ack came (KeyUpdateInterval 1) for 60 s of
// simulated time, both ways over a path that loses 10%, duplicates 5% and
// reorders 10% of datagrams, while each sends reliable messages. At least
// 1,000 phases go each way, every reliable message arrives, in full, and
// the nonce ledger (newSecureSimPair's, checked at the end) finds no
// packet number sealed twice under one key with different plaintexts.
// The receivers' previous keys are dropped within their bound.
func TestKeyUpdateEveryPacketLossyReorder(t *testing.T) {
	t.Parallel()
	cfg := &Config{KeyUpdateInterval: 1}
	p := newSecureSimPair(t, cfg, cfg, lossy(1, 0.1), lossy(2, 0.1))
	p.connect()
	sent := [2]int{}
	end := p.now.Add(60 * time.Second)
	for p.now.Before(end) {
		for side := range 2 {
			if p.s[side].state != stateOK {
				t.Fatalf("side %d: %v %v", side, p.s[side].state, p.s[side].err)
			}
			for p.s[side].send.relQ.len() < 8 {
				p.send(side, numbered(100, sent[side], 40))
				sent[side]++
			}
		}
		p.run(10*time.Millisecond, nil)
	}
	require.True(t, p.run(30*time.Second, func() bool { return len(p.h[0].msgs) == sent[1] && len(p.h[1].msgs) == sent[0] }),
		"delivered %d of %d and %d of %d", len(p.h[1].msgs), sent[0], len(p.h[0].msgs), sent[1])
	for side := range 2 {
		seen := make(map[uint32]bool)
		for _, m := range p.h[side].msgs {
			seen[binary.LittleEndian.Uint32(m.Payload)] = true
		}
		assert.Len(t, seen, sent[1-side], "side %d got each message once", side)
	}
	c, s := p.keyPhases()
	t.Logf("phases: client %d, server %d; sent %v; ledger (keys, seals) %s; client %v; server %v", c, s, sent, fmt.Sprint(p.ledger.keys()), p.sec[0].ku, p.sec[1].ku)
	assert.GreaterOrEqual(t, c, uint64(1000))
	assert.GreaterOrEqual(t, s, uint64(1000))
	assert.Equal(t, c, p.sec[1].ku.recvPhase, "the server follows the client's phases")
	assert.Equal(t, s, p.sec[0].ku.recvPhase, "the client follows the server's phases")
	assert.Zero(t, p.sec[0].ku.tooFast+p.sec[1].ku.tooFast, "no update of a genuine peer is refused")
}

// keys is how many different keys the ledger saw seal, and how many
// datagrams.
func (l *nonceLedger) keys() (keys, sealed int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	k := make(map[[8]byte]bool)
	for lk := range l.seen {
		k[lk.key] = true
	}
	return len(k), l.sealed
}
