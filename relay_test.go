//go:build !js

package knet

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The relay on loopback, without NATs: its allocations, what it forwards
// and what it refuses, and the joiner's and host's parts, forced relayed
// where loopback would connect directly.

// relayOnLoopback is a Listener serving introductions and a relay on
// 127.0.0.1.
func relayOnLoopback(t *testing.T, cfg RelayConfig) *Listener {
	t.Helper()
	l, err := Listen("udp4", "127.0.0.1:0", testConfig())
	require.NoError(t, err)
	t.Cleanup(func() { l.Close() })
	l.ServeIntroductions()
	l.ServeRelay(cfg)
	return l
}

// udpSide is a raw UDP socket on loopback, standing for a side or an
// attacker.
func udpSide(t *testing.T) *net.UDPConn {
	t.Helper()
	pc, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	t.Cleanup(func() { pc.Close() })
	return pc
}

// readFrom reads pc's next datagram within 5 s.
func readFrom(t *testing.T, pc *net.UDPConn) ([]byte, netip.AddrPort) {
	t.Helper()
	buf := make([]byte, 65536)
	require.NoError(t, pc.SetReadDeadline(time.Now().Add(5*time.Second)))
	n, from, err := pc.ReadFromUDPAddrPort(buf)
	require.NoError(t, err)
	return buf[:n], from
}

// bindAs runs a side's bind from pc with token to the relay at to, and
// returns the last status and what the relay sent pc in all. The cookie
// is echoed as the relay asks.
func bindAs(t *testing.T, pc *net.UDPConn, to netip.AddrPort, token []byte) (status byte, got int) {
	t.Helper()
	var nonce [queryNonceSize]byte
	nonce[0] = 9
	var cookie []byte
	for range 3 {
		ask := appendQueryDatagram(nil, relayKindBind, &nonce, appendRelayBind(nil, cookie, token), queryPadTo)
		_, err := pc.WriteToUDPAddrPort(ask, to)
		require.NoError(t, err)
		b, from := readFrom(t, pc)
		require.Equal(t, to, from)
		require.LessOrEqual(t, len(b), len(ask), "no answer larger than the bind")
		got += len(b)
		kind, n, body, ok := parseQueryDatagram(b)
		require.True(t, ok)
		require.Equal(t, byte(relayKindBound), kind)
		require.Equal(t, nonce, n)
		require.NotEmpty(t, body)
		if body[0] != relayProve {
			return body[0], got
		}
		cookie = body[1:]
	}
	t.Fatal("the relay kept asking for a cookie")
	return 0, 0
}

// marker sends a datagram from one bound side to the other through the
// relay and reads the other's datagrams until it comes: it returns what
// came before it, which must be nothing the test did not mean to send.
func marker(t *testing.T, from, to *net.UDPConn, relay netip.AddrPort) [][]byte {
	t.Helper()
	mark := []byte("marker, end of the test's traffic")
	_, err := from.WriteToUDPAddrPort(mark, relay)
	require.NoError(t, err)
	var before [][]byte
	for {
		b, src := readFrom(t, to)
		require.Equal(t, relay, src, "everything comes from the relay's allocation")
		if bytes.Equal(b, mark) {
			return before
		}
		before = append(before, bytes.Clone(b))
	}
}

// boundPair is an allocation with both sides bound from raw sockets.
func boundPair(t *testing.T, l *Listener) (host, join *net.UDPConn, relay netip.AddrPort, ht, jt RelayTicket) {
	t.Helper()
	ht, jt, err := l.AllocateRelay(netip.MustParseAddr("127.0.0.1"))
	require.NoError(t, err)
	require.Equal(t, ht.Relay, jt.Relay)
	require.NotEqual(t, ht.Token, jt.Token, "a token for each side")
	host, join = udpSide(t), udpSide(t)
	s, _ := bindAs(t, host, ht.Relay, ht.Token[:])
	require.Equal(t, byte(relayBound), s)
	s, _ = bindAs(t, join, jt.Relay, jt.Token[:])
	require.Equal(t, byte(relayBound), s)
	return host, join, ht.Relay, ht, jt
}

// Two sides that proved their tokens get each other's datagrams, byte
// for byte, from the allocation's port: the relay reads nothing of them.
func TestRelayForwardsBetweenProvenSides(t *testing.T) {
	l := relayOnLoopback(t, RelayConfig{})
	host, join, relay, _, _ := boundPair(t, l)
	sealed := bytes.Repeat([]byte{0xa5}, 1200) // any bytes: a sealed datagram, say
	_, err := join.WriteToUDPAddrPort(sealed, relay)
	require.NoError(t, err)
	b, from := readFrom(t, host)
	assert.Equal(t, relay, from)
	assert.Equal(t, sealed, b)
	_, err = host.WriteToUDPAddrPort([]byte("back"), relay)
	require.NoError(t, err)
	b, _ = readFrom(t, join)
	assert.Equal(t, "back", string(b))
	st := l.Stats()
	assert.Equal(t, uint64(2), st.RelayForwarded)
	assert.Equal(t, uint64(1204), st.RelayForwardedBytes)
	assert.Equal(t, 1, st.RelayAllocations)
}

// A stranger without a token: its datagrams go nowhere, a bind without a
// cookie gets a cookie (never more bytes than it sent), one with a
// cookie and a token of no side is refused, and a bind shorter than 1200
// bytes gets nothing. The sides hear nothing of it.
func TestRelayAttackStranger(t *testing.T) {
	l := relayOnLoopback(t, RelayConfig{})
	host, join, relay, _, _ := boundPair(t, l)
	stranger := udpSide(t)
	for range 10 {
		_, err := stranger.WriteToUDPAddrPort(bytes.Repeat([]byte{1}, 1000), relay)
		require.NoError(t, err)
	}
	var nonce [queryNonceSize]byte
	short := appendQueryDatagram(nil, relayKindBind, &nonce, appendRelayBind(nil, nil, make([]byte, relayTokenSize)), queryPadTo-1)
	_, err := stranger.WriteToUDPAddrPort(short, relay)
	require.NoError(t, err)
	var guess [relayTokenSize]byte
	guess[0] = 1
	status, got := bindAs(t, stranger, relay, guess[:])
	assert.Equal(t, byte(relayRefused), status)
	assert.Less(t, got, 2*queryPadTo, "answers no larger than the binds")
	assert.Empty(t, marker(t, join, host, relay), "nothing of the stranger's reached the host")
	assert.Empty(t, marker(t, host, join, relay), "nor the joiner")
	st := l.Stats()
	assert.Equal(t, uint64(11), st.RelayDropped, "the stranger's 10 datagrams and its short bind")
	assert.Equal(t, uint64(1), st.RelayRefused)
}

// A side's token replayed from another address, with that address's own
// cookie (it proved it receives there): refused, and the side stays where
// it proved itself first. Nothing of the other side's goes to the
// replayer.
func TestRelayAttackTokenReplayedFromAnotherAddress(t *testing.T) {
	l := relayOnLoopback(t, RelayConfig{})
	host, join, relay, ht, _ := boundPair(t, l)
	thief := udpSide(t)
	status, _ := bindAs(t, thief, relay, ht.Token[:])
	assert.Equal(t, byte(relayRefused), status)
	_, err := join.WriteToUDPAddrPort([]byte("for the host only"), relay)
	require.NoError(t, err)
	b, _ := readFrom(t, host)
	assert.Equal(t, "for the host only", string(b))
	_, err = thief.WriteToUDPAddrPort([]byte("as the host"), relay)
	require.NoError(t, err)
	assert.Empty(t, marker(t, host, join, relay), "the thief's datagram went nowhere")
	// The thief got its cookie and the refusal, nothing else.
	require.NoError(t, thief.SetReadDeadline(time.Now().Add(50*time.Millisecond)))
	_, _, err = thief.ReadFromUDPAddrPort(make([]byte, 2048))
	var ne net.Error
	assert.True(t, errors.As(err, &ne) && ne.Timeout(), "nothing more came to the thief: %v", err)
}

// A side cannot use the relay to flood a third address: with the other
// side not proven, everything it sends is dropped, and a bind never
// names an address other than the one it came from. Binds shorter than
// 1200 bytes (which a spoofer would use to make the relay answer a
// victim with more) get nothing.
func TestRelayAttackFloodThirdAddress(t *testing.T) {
	l := relayOnLoopback(t, RelayConfig{})
	ht, _, err := l.AllocateRelay(netip.MustParseAddr("127.0.0.1"))
	require.NoError(t, err)
	attacker, victim := udpSide(t), udpSide(t)
	s, _ := bindAs(t, attacker, ht.Relay, ht.Token[:])
	require.Equal(t, byte(relayBound), s)
	for range 50 {
		_, err := attacker.WriteToUDPAddrPort(bytes.Repeat([]byte{7}, 1200), ht.Relay)
		require.NoError(t, err)
	}
	// The attacker's datagrams are all read (counted) before the check.
	require.Eventually(t, func() bool { return l.Stats().RelayDropped >= 50 }, 5*time.Second, time.Millisecond)
	st := l.Stats()
	assert.Zero(t, st.RelayForwarded)
	assert.Equal(t, uint64(50), st.RelayDropped)
	require.NoError(t, victim.SetReadDeadline(time.Now().Add(50*time.Millisecond)))
	_, _, err = victim.ReadFromUDPAddrPort(make([]byte, 2048))
	var ne net.Error
	assert.True(t, errors.As(err, &ne) && ne.Timeout(), "nothing reached the victim: %v", err)
}

// Truncated, forged and oversized datagrams: binds cut short, with a
// cookie of the wrong length, with a forged cookie, a datagram larger
// than any knet datagram. None is answered with more than a cookie, none
// is forwarded, nothing panics, and the sides' traffic goes on.
func TestRelayAttackTruncatedForged(t *testing.T) {
	l := relayOnLoopback(t, RelayConfig{})
	host, join, relay, _, jt := boundPair(t, l)
	attacker := udpSide(t)
	var nonce [queryNonceSize]byte
	good := appendQueryDatagram(nil, relayKindBind, &nonce, appendRelayBind(nil, nil, jt.Token[:]), queryPadTo)
	forged := appendQueryDatagram(nil, relayKindBind, &nonce, appendRelayBind(nil, bytes.Repeat([]byte{3}, cookieSize), jt.Token[:]), queryPadTo)
	badLen := appendQueryDatagram(nil, relayKindBind, &nonce, append([]byte{5}, bytes.Repeat([]byte{3}, 5+relayTokenSize)...), queryPadTo)
	noToken := appendQueryDatagram(nil, relayKindBind, &nonce, []byte{0, 1, 2}, queryPadTo)
	for _, b := range [][]byte{good[:len(good)/2], good[:queryOverhead], badLen, noToken, make([]byte, relayMaxDatagram+100), {}} {
		_, err := attacker.WriteToUDPAddrPort(b, relay)
		require.NoError(t, err)
	}
	_, err := attacker.WriteToUDPAddrPort(forged, relay)
	require.NoError(t, err)
	b, _ := readFrom(t, attacker)
	_, _, body, ok := parseQueryDatagram(b)
	require.True(t, ok)
	assert.Equal(t, byte(relayProve), body[0], "a forged cookie is no cookie: asked to prove again")
	assert.Empty(t, marker(t, join, host, relay))
	assert.Empty(t, marker(t, host, join, relay))
	st := l.Stats()
	assert.Equal(t, uint64(2), st.RelayForwarded, "the markers only")
	assert.GreaterOrEqual(t, st.RelayDropped, uint64(5), "the malformed ones, counted")
}

// TestRelayAttackAllocationFlood: an allocation flood through the
// introducer. Joiners asking for one host from ever new ports each take
// the place of the one before, whose allocation (its sides never bound)
// is given back at once: the relay holds one. Joiners of one source
// asking for many hosts get MaxAllocationsPerSource allocations, then
// introductions that say the relay is full (port 0), while a joiner from
// another address still gets one; a refused joiner that finds no direct
// path fails with ErrRelayRefused. Allocations whose sides never bind
// end after the bind time and give their source's places back.
func TestRelayAttackAllocationFlood(t *testing.T) {
	t.Parallel()
	l := relayOnLoopback(t, RelayConfig{MaxAllocations: 8, MaxAllocationsPerSource: 3})
	l.relay.mu.Lock()
	// Long enough for every allocation below to be counted before the
	// first expires, on a loaded machine too.
	l.relay.bindTTL = 8 * time.Second
	l.relay.mu.Unlock()
	ctx := within(t, 30*time.Second)
	hostAs := func(id string) { registerHost(t, l, id) }
	hostAs("flooded")
	for i := range 6 {
		in, err := Join(ctx, udpSide(t), l.Addr().String(), "flooded")
		require.NoError(t, err)
		assert.NotZero(t, in.Relay.Port(), "joiner %d gets an allocation", i)
		assert.Equal(t, 1, l.Stats().RelayAllocations, "joiner %d: the one before gave its allocation back", i)
	}

	// One source, many hosts: three allocations (the flooded host's
	// joiner holds one of them), then none.
	var refused Introduction
	for i := range 4 {
		id := fmt.Sprintf("host%d", i)
		hostAs(id)
		in, err := Join(ctx, udpSide(t), l.Addr().String(), id)
		require.NoError(t, err)
		if i < 2 {
			assert.NotZero(t, in.Relay.Port(), "joiner of %s gets an allocation", id)
		} else {
			assert.Equal(t, l.Addr().(*net.UDPAddr).AddrPort().Addr(), in.Relay.Addr())
			assert.Zero(t, in.Relay.Port(), "joiner of %s: its source holds its allocations", id)
			refused = in
		}
	}
	st := l.Stats()
	assert.Equal(t, 3, st.RelayAllocations)
	assert.Equal(t, uint64(2), st.RelayRefused)

	// Another source gets one.
	other, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 2)})
	require.NoError(t, err)
	t.Cleanup(func() { other.Close() })
	in, err := Join(ctx, other, l.Addr().String(), "host3")
	require.NoError(t, err)
	assert.NotZero(t, in.Relay.Port(), "a joiner from another address")
	assert.Equal(t, 4, l.Stats().RelayAllocations)

	refused.relayFirst = time.Second // no probing: straight to the relay
	_, err = DialCandidates(ctx, udpSide(t), refused, testConfig())
	require.ErrorIs(t, err, ErrRelayRefused)
	// Unbound, they expire, and the source's places come back.
	require.Eventually(t, func() bool { return l.Stats().RelayAllocations == 0 }, 20*time.Second, 10*time.Millisecond)
	l.mu.Lock()
	defer l.mu.Unlock()
	assert.Empty(t, l.sources, "every source's places given back")
}

// registerHost registers a host under id at the introducer l, from a raw
// socket that asks once (with the cookie l gives it) and never again: it
// is told of no joiner.
func registerHost(t *testing.T, l *Listener, id string) {
	t.Helper()
	body := rawHost(t, l, id)()
	require.Equal(t, []byte{introWaiting}, body, "host %s registered", id)
}

// rawHost returns a host's ask under id at the introducer l from a raw
// socket: each call asks (with the cookie, once l gave one) and returns
// the answer's body.
func rawHost(t *testing.T, l *Listener, id string) func() []byte {
	pc := udpSide(t)
	var nonce [queryNonceSize]byte
	rand.Read(nonce[:])
	var cookie []byte
	return func() []byte {
		t.Helper()
		for range 2 {
			d := appendQueryDatagram(nil, introKindAsk, &nonce, appendIntroAsk(nil, introRoleHost, cookie, id, nil, 0), queryPadTo)
			_, err := pc.WriteToUDPAddrPort(d, l.Addr().(*net.UDPAddr).AddrPort())
			require.NoError(t, err)
			b, _ := readFrom(t, pc)
			kind, _, body, ok := parseQueryDatagram(b)
			require.True(t, ok && kind == introKindAnswer && len(body) > 0)
			if body[0] != introProve {
				return body
			}
			cookie = body[1:]
		}
		t.Fatalf("host %s: the introducer wants its cookie again", id)
		return nil
	}
}

// TestRelayAttackReplacedJoinerTold: a stranger who joins under a host's
// ID after the host was told of its joiner takes the joiner's place for
// the host's next ask, but the told pair's allocation stays: the
// stranger cannot end a pair that may be binding it.
func TestRelayAttackReplacedJoinerTold(t *testing.T) {
	l := relayOnLoopback(t, RelayConfig{})
	ctx := within(t, 20*time.Second)
	ask := rawHost(t, l, "told")
	require.Equal(t, []byte{introWaiting}, ask())
	in, err := Join(ctx, udpSide(t), l.Addr().String(), "told")
	require.NoError(t, err)
	require.NotZero(t, in.Relay.Port())
	require.Equal(t, byte(introIntroduced), ask()[0], "the host is told of its joiner")
	_, err = Join(ctx, udpSide(t), l.Addr().String(), "told")
	require.NoError(t, err)
	assert.Equal(t, 2, l.Stats().RelayAllocations, "the told pair's allocation stays beside the stranger's")
}

// The bandwidth limits: an allocation forwards ConnBytesPerSecond (in a
// second's burst) and drops the rest, counted; the relay forwards
// BytesPerSecond in all, across allocations.
func TestRelayLimits(t *testing.T) {
	t.Run("per connection", func(t *testing.T) {
		l := relayOnLoopback(t, RelayConfig{ConnBytesPerSecond: 10_000})
		host, join, relay, _, _ := boundPair(t, l)
		start := time.Now()
		for range 50 {
			_, err := join.WriteToUDPAddrPort(bytes.Repeat([]byte{1}, 1000), relay)
			require.NoError(t, err)
		}
		require.Eventually(t, func() bool {
			st := l.Stats()
			return st.RelayForwarded+st.RelayLimited == 50
		}, 5*time.Second, time.Millisecond)
		elapsed := time.Since(start)
		st := l.Stats()
		allowed := uint64(10_000 + 10_000*elapsed.Seconds())
		assert.LessOrEqual(t, st.RelayForwardedBytes, allowed, "within the allocation's bucket")
		assert.GreaterOrEqual(t, st.RelayForwarded, uint64(10), "a second's burst went")
		assert.Positive(t, st.RelayLimited)
		_ = host
	})
	t.Run("global", func(t *testing.T) {
		l := relayOnLoopback(t, RelayConfig{BytesPerSecond: 10_000})
		start := time.Now()
		for range 2 {
			_, join, relay, _, _ := boundPair(t, l)
			for range 25 {
				_, err := join.WriteToUDPAddrPort(bytes.Repeat([]byte{1}, 1000), relay)
				require.NoError(t, err)
			}
		}
		require.Eventually(t, func() bool {
			st := l.Stats()
			return st.RelayForwarded+st.RelayLimited == 50
		}, 5*time.Second, time.Millisecond)
		st := l.Stats()
		assert.LessOrEqual(t, st.RelayForwardedBytes, uint64(10_000+10_000*time.Since(start).Seconds()), "within the relay's bucket")
		assert.Positive(t, st.RelayLimited)
	})
}

// hostAndJoin runs an introduction on loopback through l (which relays)
// between a host Listener (hostCfg) and a joiner (joinCfg), relayed first
// (relayFirst), and returns both connections.
func hostAndJoin(t *testing.T, l *Listener, hostCfg, joinCfg *Config, relayFirst time.Duration) (c, sc *Conn, host *Listener) {
	t.Helper()
	host = listen(t, hostCfg)
	ctx := within(t, 10*time.Second)
	punched := make(chan error, 1)
	go func() {
		in, err := host.Host(ctx, l.Addr().String(), "loop")
		if err == nil {
			in.relayFirst = relayFirst
			err = host.Punch(ctx, in)
		}
		punched <- err
	}()
	pc := udpSide(t)
	in, err := Join(ctx, pc, l.Addr().String(), "loop")
	require.NoError(t, err)
	in.relayFirst = relayFirst
	c, err = DialCandidates(ctx, pc, in, joinCfg)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	require.NoError(t, <-punched)
	sc, err = host.AcceptConn(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { sc.Close() })
	return c, sc, host
}

// A plaintext relayed connection stays relayed: its datagrams carry no
// connection ID for the host's Listener to find it by at a new address,
// so the joiner neither probes nor takes a probe's answer (here a valid
// one, with the token, from the host's address) for a path; messages go
// on through the relay. A secure one, given the same answer, moves.
func TestRelayPlaintextStaysRelayed(t *testing.T) {
	t.Parallel()
	for _, secure := range []bool{false, true} {
		l := relayOnLoopback(t, RelayConfig{})
		hostCfg, joinCfg := testConfig(), testConfig()
		if secure {
			hostCfg, joinCfg = secureConfigs(t)
		}
		c, sc, host := hostAndJoin(t, l, hostCfg, joinCfg, time.Hour)
		require.Equal(t, RouteRelayed, c.Route())
		require.Equal(t, RouteRelayed, sc.Route())
		// The host's answer to a probe, as its Listener would send it.
		r := c.ep.relay.Load()
		answer := appendQueryDatagram(nil, punchKindAnswer, &r.token, nil, 0)
		host.eps[0].write(answer, addrPortFromNet(t, c.LocalAddr()))
		ctx := within(t, 5*time.Second)
		require.NoError(t, c.Send(Message{ID: 100, Payload: []byte("after the answer"), Reliable: true}))
		m, err := sc.Receive(ctx)
		require.NoError(t, err)
		assert.Equal(t, "after the answer", string(m.Payload))
		if !secure {
			assert.Equal(t, RouteRelayed, c.Route(), "plaintext: still relayed")
			assert.Equal(t, RouteRelayed, sc.Route())
			assert.Equal(t, r.via, addrPortFromNet(t, sc.RemoteAddr()))
			continue
		}
		require.Eventually(t, func() bool {
			return c.Route() == RouteDirect && sc.Route() == RouteDirect
		}, 5*time.Second, time.Millisecond, "secure: moved to the host's address")
		assert.Equal(t, addrPortFromNet(t, host.Addr()), addrPortFromNet(t, c.RemoteAddr()))
	}
}

func addrPortFromNet(t *testing.T, a net.Addr) netip.AddrPort {
	t.Helper()
	ap, ok := addrPortOf(a)
	require.True(t, ok)
	return unmap(ap)
}

// Relayed first, then direct, on loopback: the retries find the host a
// moment after the relayed connection opens, and a secure connection
// moves with every reliable message kept, in order.
func TestRelayThenDirectLoopback(t *testing.T) {
	l := relayOnLoopback(t, RelayConfig{})
	hostCfg, joinCfg := secureConfigs(t)
	c, sc, _ := hostAndJoin(t, l, hostCfg, joinCfg, 200*time.Millisecond)
	require.Equal(t, RouteRelayed, c.Route())
	ctx := within(t, 10*time.Second)
	sent := 0
	for c.Route() == RouteRelayed || sc.Route() == RouteRelayed {
		require.NoError(t, c.Send(Message{ID: 100, Payload: []byte{byte(sent)}, Reliable: true, InOrder: true}))
		sent++
		m, err := sc.Receive(ctx) // one at a time: the stream runs through the switch
		require.NoError(t, err)
		require.Equal(t, byte(sent-1), m.Payload[0])
		require.Less(t, sent, 100_000)
	}
	for i := range 50 {
		require.NoError(t, c.Send(Message{ID: 100, Payload: []byte{byte(sent + i)}, Reliable: true, InOrder: true}))
	}
	for i := range 50 {
		m, err := sc.Receive(ctx)
		require.NoError(t, err)
		require.Equal(t, byte(sent+i), m.Payload[0])
	}
	assert.Positive(t, sc.Stats().Migrations)
	// Closed, the joiner's connection leaves its socket's table at both
	// addresses, the relay's and the host's.
	require.NoError(t, c.Close())
	require.Eventually(t, func() bool {
		c.ep.mu.Lock()
		defer c.ep.mu.Unlock()
		return len(c.ep.conns) == 0
	}, 5*time.Second, time.Millisecond)
}

// A relay that never answers the joiner's bind: DialCandidates fails with
// a TimeoutError naming the relay, after 3 s.
func TestRelaySilentRelay(t *testing.T) {
	t.Parallel()
	silent := udpSide(t) // reads nothing, answers nothing
	at := silent.LocalAddr().(*net.UDPAddr).AddrPort()
	in := Introduction{Peer: []netip.AddrPort{at}, Relay: at, relayFirst: time.Second}
	_, err := DialCandidates(within(t, 10*time.Second), udpSide(t), in, testConfig())
	var te *TimeoutError
	require.ErrorAs(t, err, &te)
	assert.Equal(t, "relay", te.Op)
	assert.Contains(t, err.Error(), at.String(), "the error names the relay")
	assert.NotErrorIs(t, err, ErrRelayRefused)
}

// A relay that refuses the joiner's token (a side taken by another
// address, an allocation for someone else): ErrRelayRefused.
func TestRelayRefusesToken(t *testing.T) {
	l := relayOnLoopback(t, RelayConfig{})
	ht, jt, err := l.AllocateRelay(netip.MustParseAddr("127.0.0.1"))
	require.NoError(t, err)
	s, _ := bindAs(t, udpSide(t), jt.Relay, jt.Token[:]) // the joiner's side, taken
	require.Equal(t, byte(relayBound), s)
	in := Introduction{Peer: []netip.AddrPort{ht.Relay}, Relay: jt.Relay, RelayToken: jt.Token, relayFirst: time.Second}
	_, err = DialCandidates(within(t, 10*time.Second), udpSide(t), in, testConfig())
	require.ErrorIs(t, err, ErrRelayRefused)
	assert.Contains(t, err.Error(), jt.Relay.String())
}

// Join and Host name the introducer when it never answers.
func TestRelayErrNoIntroducer(t *testing.T) {
	t.Parallel()
	silent := udpSide(t) // reads nothing, answers nothing
	ctx, cancel := context.WithTimeout(context.Background(), 600*time.Millisecond)
	defer cancel()
	_, err := Join(ctx, udpSide(t), silent.LocalAddr().String(), "x")
	require.ErrorIs(t, err, ErrNoIntroducer)
	host := listen(t, testConfig())
	_, err = host.Host(ctx, silent.LocalAddr().String(), "x")
	require.ErrorIs(t, err, ErrNoIntroducer)
	// An introducer that answers, without the host: ErrNoHost.
	l := relayOnLoopback(t, RelayConfig{})
	ctx2, cancel2 := context.WithTimeout(context.Background(), 600*time.Millisecond)
	defer cancel2()
	_, err = Join(ctx2, udpSide(t), l.Addr().String(), "nobody")
	require.ErrorIs(t, err, ErrNoHost)
	assert.NotErrorIs(t, err, ErrNoIntroducer)
}

// With a relay offered and a direct path open (loopback), the
// connection is direct: nothing goes through the relay, and the host
// stops binding to it once the joiner said it found the path.
func TestRelayUnusedWhenDirect(t *testing.T) {
	l := relayOnLoopback(t, RelayConfig{})
	hostCfg, joinCfg := secureConfigs(t)
	c, sc, host := hostAndJoin(t, l, hostCfg, joinCfg, 0)
	assert.Equal(t, RouteDirect, c.Route())
	assert.Equal(t, RouteDirect, sc.Route())
	assert.Equal(t, addrPortFromNet(t, host.Addr()), addrPortFromNet(t, c.RemoteAddr()))
	require.Eventually(t, func() bool {
		host.relayUse.mu.Lock()
		defer host.relayUse.mu.Unlock()
		return len(host.relayUse.peers) == 0
	}, 2*time.Second, time.Millisecond, "the host's binding to the relay ended")
	assert.Zero(t, l.Stats().RelayForwarded)
}
