//go:build !js

package knet

import (
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Attacks on the relay (issue 35) from outside: what a stranger, or a
// side that stays while the other left, can make it do.

// A relayed secure joiner takes a probe's answer as the sign of a direct
// path. The answer is clear and its token travels in clear in every probe
// both sides send, so anyone who saw one (or who shares the host's
// public address, as behind a carrier-grade NAT) can send it from the
// host's address at another port. The joiner may try that address, but
// it must not stay there when nothing authenticated comes from it: its
// messages still reach the host, it goes back to the relay, a second
// answer moves nothing, and the stranger gets a handful of sealed
// datagrams at most.
func TestRelayAttackDirectMoveByStranger(t *testing.T) {
	t.Parallel()
	l := relayOnLoopback(t, RelayConfig{})
	hostCfg, joinCfg := secureConfigs(t)
	c, sc, _ := hostAndJoin(t, l, hostCfg, joinCfg, time.Hour)
	require.Equal(t, RouteRelayed, c.Route())
	r := c.ep.relay.Load()
	stranger := udpSide(t) // at the host's address (127.0.0.1), another port
	answer := appendQueryDatagram(nil, punchKindAnswer, &r.token, nil, 0)
	ctx := within(t, 20*time.Second)
	next := 0
	for round := range 2 {
		_, err := stranger.WriteToUDPAddrPort(answer, addrPortFromNet(t, c.LocalAddr()))
		require.NoError(t, err)
		for range 20 {
			require.NoError(t, c.Send(Message{ID: 100, Payload: []byte{byte(next)}, Reliable: true, InOrder: true}))
			m, err := sc.Receive(ctx)
			require.NoError(t, err, "round %d: message %d after the stranger's answer", round, next)
			require.Equal(t, byte(next), m.Payload[0])
			next++
		}
		require.Eventually(t, func() bool { return c.Route() == RouteRelayed },
			5*time.Second, time.Millisecond, "round %d: the joiner sends through the relay again", round)
	}
	assert.Equal(t, r.via, addrPortFromNet(t, c.RemoteAddr()))
	assert.Zero(t, c.Stats().Migrations, "no move held")
	assert.Zero(t, sc.Stats().Migrations)
	got := 0
	buf := make([]byte, 2048)
	for {
		stranger.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
		if _, _, err := stranger.ReadFromUDPAddrPort(buf); err != nil {
			break
		}
		got++
	}
	assert.Less(t, got, 30, "datagrams the stranger got")
}

// One side's datagrams alone keep an allocation, and the relay's sending
// toward the other side, alive: a host that left (its NAT mapping perhaps
// now someone else's, or its public address a victim's) would get the
// joiner's datagrams from the relay's address for as long as the joiner
// likes, at ConnBytesPerSecond. The relay must forward toward a side
// only while that side is heard from (within IdleTimeout), and end an
// allocation that one side alone keeps busy.
func TestRelayAttackOneSidedKeepsAlive(t *testing.T) {
	t.Parallel()
	const idle = 400 * time.Millisecond
	l := relayOnLoopback(t, RelayConfig{IdleTimeout: idle})
	host, join, relay, _, _ := boundPair(t, l)
	// The host falls silent (it reads, to count, but never sends).
	got := make(chan int, 1)
	go func() {
		n := 0
		buf := make([]byte, 2048)
		for {
			host.SetReadDeadline(time.Now().Add(2 * time.Second))
			if _, _, err := host.ReadFromUDPAddrPort(buf); err != nil {
				got <- n
				return
			}
			n++
		}
	}()
	start := time.Now()
	ended := false
	for sent := 0; time.Since(start) < 5*time.Second; sent++ {
		if l.relayAllocations() == 0 {
			ended = true
			break
		}
		_, err := join.WriteToUDPAddrPort([]byte("still here"), relay)
		require.NoError(t, err)
		time.Sleep(10 * time.Millisecond) // the joiner's pace, not a synchronisation
	}
	lasted := time.Since(start)
	n := <-got
	assert.True(t, ended, "the allocation lived %v on the joiner's datagrams alone", lasted)
	// What went to the host after it fell silent: IdleTimeout's worth at
	// most (a datagram each 10 ms), with room for a loaded machine.
	assert.Less(t, n, int(3*idle/(10*time.Millisecond)), "datagrams forwarded to a silent side")
}

// A side's token is its allocation's alone: replayed on another
// allocation's port (by a side of that one, or anyone who saw it), it is
// refused and binds nothing, and that allocation forwards nothing from
// the replayer.
func TestRelayAttackTokenOnAnotherAllocation(t *testing.T) {
	l := relayOnLoopback(t, RelayConfig{})
	host, join, relay, ht, _ := boundPair(t, l)
	other, _, err := l.AllocateRelay(netip.MustParseAddr("127.0.0.1"))
	require.NoError(t, err)
	require.NotEqual(t, relay, other.Relay)
	// The other allocation's host token on this allocation's port, from
	// a new address and from the joiner's own.
	for _, pc := range []*net.UDPConn{udpSide(t), join} {
		s, _ := bindAs(t, pc, relay, other.Token[:])
		assert.Equal(t, byte(relayRefused), s)
		_, err := pc.WriteToUDPAddrPort([]byte("replayed token's traffic"), relay)
		require.NoError(t, err)
	}
	// Only the joiner's datagram went, as it is bound here.
	before := marker(t, join, host, relay)
	assert.Len(t, before, 1)
	// And the other way: this allocation's host token on the other's
	// port, from the host's own address.
	s, _ := bindAs(t, host, other.Relay, ht.Token[:])
	assert.Equal(t, byte(relayRefused), s)
	assert.GreaterOrEqual(t, l.Stats().RelayRefused, uint64(3))
}

// The same with binds: a bound side that binds again and again (each
// answered, as its answer may have been lost) must not keep alive an
// allocation whose other side fell silent, holding its socket and
// goroutine, and a place under MaxAllocations, for ever.
func TestRelayAttackOneSidedRebindKeepsAlive(t *testing.T) {
	const idle = 400 * time.Millisecond
	l := relayOnLoopback(t, RelayConfig{IdleTimeout: idle})
	_, join, relay, _, jt := boundPair(t, l)
	var nonce [queryNonceSize]byte
	var cookie []byte
	buf := make([]byte, 2048)
	start := time.Now()
	for l.relayAllocations() > 0 {
		require.Less(t, time.Since(start), 5*time.Second, "the allocation lived on the joiner's binds alone")
		ask := appendQueryDatagram(nil, relayKindBind, &nonce, appendRelayBind(nil, cookie, jt.Token[:]), queryPadTo)
		_, err := join.WriteToUDPAddrPort(ask, relay)
		require.NoError(t, err)
		// Answers come within the per-source rate: take a new cookie
		// when one is asked for, and go on without waiting otherwise.
		join.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
		if n, _, err := join.ReadFromUDPAddrPort(buf); err == nil {
			if kind, _, body, ok := parseQueryDatagram(buf[:n]); ok && kind == relayKindBound && len(body) > 0 && body[0] == relayProve {
				cookie = append(cookie[:0], body[1:]...)
			}
		}
	}
}
