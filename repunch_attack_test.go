package knet

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A punched game on loopback (no NAT): an introducer, a host hosting
// (hostLoop, as a game keeps it), a joiner connected by DialCandidates.
type loopGame struct {
	intro, host *Listener
	introAddr   string
	c, sc       *Conn
	told        chan Introduction
}

func newLoopGame(t *testing.T, hostCfg, joinCfg *Config) *loopGame {
	t.Helper()
	g := &loopGame{told: make(chan Introduction, 8)}
	var err error
	g.intro, err = Listen("udp4", "127.0.0.1:0", testConfig())
	require.NoError(t, err)
	t.Cleanup(func() { g.intro.Close() })
	g.intro.ServeIntroductions()
	g.introAddr = g.intro.Addr().String()
	g.host, err = Listen("udp4", "127.0.0.1:0", hostCfg)
	require.NoError(t, err)
	t.Cleanup(func() { g.host.Close() })
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go func() {
		for {
			in, err := g.host.Host(ctx, g.introAddr, "loop")
			if err != nil {
				return
			}
			g.told <- in
			go g.host.Punch(ctx, in)
		}
	}()
	wctx := within(t, 10*time.Second)
	pc, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	in, err := Join(wctx, pc, g.introAddr, "loop")
	require.NoError(t, err)
	g.c, err = DialCandidates(wctx, pc, in, joinCfg)
	require.NoError(t, err)
	t.Cleanup(func() { g.c.Close() })
	g.sc, err = g.host.AcceptConn(wctx)
	require.NoError(t, err)
	t.Cleanup(func() { g.sc.Close() })
	first := <-g.told
	require.Nil(t, first.Repunch)
	require.Same(t, g.sc, g.host.punch.re.tied(in.Token), "the host tied the connection to its punch's token")
	return g
}

// stranger is a UDP socket on loopback of no one in the game.
func stranger(t *testing.T) *net.UDPConn {
	t.Helper()
	pc, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	t.Cleanup(func() { pc.Close() })
	return pc
}

// handled waits until the host's socket reader handled what a stranger
// sent it before: a query sent after it is answered.
func handled(t *testing.T, l *Listener) {
	t.Helper()
	require.NoError(t, l.SetQueryInfo([]byte("marker")))
	_, _, err := Query(within(t, 5*time.Second), "udp4", l.Addr().String())
	require.NoError(t, err)
}

// A stranger who knows the game's ID asks the introducer for a re-punch
// (it proves its own address with the cookie, as anyone can) naming a
// tie no connection of the host was punched with: the introducer tells
// the host, whose Host call does not return it (counted), so no Punch
// probes the stranger; the host goes on hosting.
func TestRepunchAttackUnknownTie(t *testing.T) {
	g := newLoopGame(t, testConfig(), testConfig())
	s := stranger(t)
	var nonce [queryNonceSize]byte
	nonce[0] = 7
	tie := [8]byte{1, 2, 3, 4, 5, 6, 7, 8}
	intro := netip.MustParseAddrPort(g.introAddr)
	ask := func(cookie []byte) {
		body := append(tie[:], appendIntroAsk(nil, introRoleJoin, cookie, "loop", nil, 0)...)
		_, err := s.WriteToUDPAddrPort(appendQueryDatagram(nil, repunchKindAsk, &nonce, body, queryPadTo), intro)
		require.NoError(t, err)
	}
	read := func() (byte, []byte) {
		buf := make([]byte, 2048)
		require.NoError(t, s.SetReadDeadline(time.Now().Add(5*time.Second)))
		n, _, err := s.ReadFromUDPAddrPort(buf)
		require.NoError(t, err)
		kind, got, body, ok := parseQueryDatagram(buf[:n])
		require.True(t, ok)
		require.Equal(t, nonce, got)
		return kind, body
	}
	ask(nil)
	kind, body := read()
	require.Equal(t, byte(repunchKindAnswer), kind, "a re-punch ask is answered in kind 16")
	require.Equal(t, byte(introProve), body[0], "an address not proven gets a cookie, nothing else")
	ask(body[1:])
	kind, body = read()
	require.Equal(t, byte(repunchKindAnswer), kind)
	require.Equal(t, byte(introIntroduced), body[0], "the host is there")
	assert.Equal(t, tie[:], body[1:1+tieSize], "the tie echoed")

	require.Eventually(t, func() bool { return g.host.punch.re.unknown.Load() > 0 }, 5*time.Second, 5*time.Millisecond,
		"the host was told and found no connection for the tie")
	select {
	case in := <-g.told:
		t.Fatalf("the host's Host returned a re-punch toward %v", in.Peer)
	default:
	}
	g.host.punch.mu.Lock()
	running := len(g.host.punch.tokens)
	g.host.punch.mu.Unlock()
	assert.Zero(t, running, "no Punch runs")
	// Nothing came from the host: its probes would start 200 ms after
	// the introduction (introLead).
	require.NoError(t, s.SetReadDeadline(time.Now().Add(introLead+3*punchInterval)))
	buf := make([]byte, 2048)
	for {
		_, from, err := s.ReadFromUDPAddrPort(buf)
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			break
		}
		require.NoError(t, err)
		require.NotEqual(t, g.host.Addr().(*net.UDPAddr).AddrPort(), from, "a datagram from the host")
	}
	// And the game goes on.
	echo := Message{ID: 100, Payload: []byte("still here"), Reliable: true}
	require.NoError(t, g.c.Send(echo))
	m, err := g.sc.Receive(within(t, 5*time.Second))
	require.NoError(t, err)
	assert.Equal(t, "still here", string(m.Payload))
}

// A forged introduction sent to the host from an address other than its
// introducer's, carrying the nonce of its Host call (which an off-path
// stranger would also have to guess) and the tie of a live connection,
// is not taken: the host answers to its introducer's address alone.
func TestRepunchAttackForgedIntroduction(t *testing.T) {
	g := newLoopGame(t, testConfig(), testConfig())
	s := stranger(t)
	var nonce [queryNonceSize]byte
	require.Eventually(t, func() bool {
		g.host.punch.mu.Lock()
		defer g.host.punch.mu.Unlock()
		for n := range g.host.punch.waits {
			nonce = n
			return true
		}
		return false
	}, 5*time.Second, time.Millisecond, "the host's Host call is waiting")
	var tie [8]byte
	g.host.punch.re.mu.Lock()
	for t := range g.host.punch.re.ties {
		tie = t
	}
	g.host.punch.re.mu.Unlock()
	target := s.LocalAddr().(*net.UDPAddr).AddrPort()
	body := append([]byte{introIntroduced}, tie[:]...)
	body = append(body, 9, 9, 9, 9, 9, 9, 9, 9, 0, 0, 1)
	body = appendReflectBody(body, &nonce, target)
	stray := g.host.Stats().StrayDatagrams
	_, err := s.WriteToUDPAddrPort(appendQueryDatagram(nil, repunchKindAnswer, &nonce, body, 0), g.host.Addr().(*net.UDPAddr).AddrPort())
	require.NoError(t, err)
	handled(t, g.host)
	assert.Greater(t, g.host.Stats().StrayDatagrams, stray, "dropped as stray")
	select {
	case in := <-g.told:
		t.Fatalf("the host took a forged introduction toward %v", in.Peer)
	default:
	}
}

// While the host re-punches a connection, a probe or answer from a
// stranger moves nothing unless it carries the re-punch's token: a
// plaintext connection moves only to where the token came from, a
// secure one not even then (migration moves it, on a sealed datagram
// and a path check), and once the Punch ends the token moves nothing.
func TestRepunchAttackProbeMovesNothing(t *testing.T) {
	t.Parallel()
	for _, secure := range []bool{false, true} {
		name := "Plaintext"
		hostCfg, joinCfg := testConfig(), testConfig()
		if secure {
			name = "Secure"
			hostCfg, joinCfg = secureConfigs(t)
		}
		t.Run(name, func(t *testing.T) {
			g := newLoopGame(t, hostCfg, joinCfg)
			s := stranger(t)
			at := g.sc.RemoteAddr().String()
			hostAddr := g.host.Addr().(*net.UDPAddr).AddrPort()
			token := [8]byte{35, 35, 35, 35, 35, 35, 35, 35}
			ctx, cancel := context.WithCancel(context.Background())
			punched := make(chan error, 1)
			go func() {
				punched <- g.host.Punch(ctx, Introduction{Peer: []netip.AddrPort{netip.MustParseAddrPort("127.0.0.1:9")}, Token: token, Start: time.Now(), Repunch: g.sc})
			}()
			running := func() bool {
				g.host.punch.mu.Lock()
				defer g.host.punch.mu.Unlock()
				_, ok := g.host.punch.tokens[token]
				return ok
			}
			require.Eventually(t, running, 5*time.Second, time.Millisecond)
			send := func(kind byte, tok [8]byte) {
				_, err := s.WriteToUDPAddrPort(appendQueryDatagram(nil, kind, &tok, nil, queryPadTo), hostAddr)
				require.NoError(t, err)
				handled(t, g.host)
			}
			wrong := token
			wrong[7]++
			send(punchKindProbe, wrong)
			send(punchKindAnswer, wrong)
			assert.Equal(t, at, g.sc.RemoteAddr().String(), "a wrong token moves nothing")
			assert.Zero(t, g.host.punch.re.moves.Load())

			send(punchKindProbe, token)
			if secure {
				assert.Equal(t, at, g.sc.RemoteAddr().String(), "a probe never moves a secure connection")
				assert.Zero(t, g.host.punch.re.moves.Load())
			} else {
				require.Eventually(t, func() bool { return g.sc.RemoteAddr().String() == s.LocalAddr().String() }, 5*time.Second, time.Millisecond,
					"the re-punch's token is the proof: the plaintext connection moved where it came from")
				assert.EqualValues(t, 1, g.host.punch.re.moves.Load())
			}
			cancel()
			<-punched
			require.False(t, running(), "the Punch ended")
			require.Zero(t, g.host.punch.re.n.Load(), "nothing moves on its token")
			s2 := stranger(t)
			_, err := s2.WriteToUDPAddrPort(appendQueryDatagram(nil, punchKindProbe, &token, nil, queryPadTo), hostAddr)
			require.NoError(t, err)
			handled(t, g.host)
			assert.NotEqual(t, s2.LocalAddr().String(), g.sc.RemoteAddr().String())
		})
	}
}

// The joiner's re-punch takes only what names it: the introducer's
// answers from the introducer's address with its ask's nonce, and probes
// or answers carrying the token it was given. What else a stranger sends
// its socket while it re-punches is dropped as before (stray), and
// moves nothing.
func TestRepunchAttackJoinerIgnoresStrangers(t *testing.T) {
	g := newLoopGame(t, testConfig(), testConfig())
	rp := g.c.ep.repunch.Load()
	require.NotNil(t, rp, "DialCandidates armed the re-punch")
	nonce := [queryNonceSize]byte{4, 4, 4, 4, 4, 4, 4, 4}
	token := [8]byte{5, 5, 5, 5, 5, 5, 5, 5}
	rp.mu.Lock()
	rp.nonce, rp.token, rp.probing = nonce, token, true
	rp.mu.Unlock()
	rp.active.Store(true)
	defer rp.active.Store(false)

	s := stranger(t)
	joiner := g.c.LocalAddr().(*net.UDPAddr).AddrPort()
	wrong := token
	wrong[0]++
	for _, d := range [][]byte{
		appendQueryDatagram(nil, punchKindProbe, &wrong, nil, queryPadTo),
		appendQueryDatagram(nil, punchKindAnswer, &wrong, nil, 0),
		appendQueryDatagram(nil, repunchKindAnswer, &nonce, []byte{introIntroduced}, 0), // not from the introducer
		appendQueryDatagram(nil, repunchKindAnswer, &wrong, []byte{introProve}, 0),
	} {
		_, err := s.WriteToUDPAddrPort(d, joiner)
		require.NoError(t, err)
	}
	require.Eventually(t, func() bool { return g.c.ep.stray.Load() >= 4 }, 5*time.Second, time.Millisecond, "dropped as stray")
	assert.Empty(t, rp.found, "no address found")
	assert.Empty(t, rp.answers, "no answer taken")
	assert.Equal(t, g.host.Addr().String(), g.c.RemoteAddr().String())

	// The token, from wherever, is found (and the joiner would move there).
	_, err := s.WriteToUDPAddrPort(appendQueryDatagram(nil, punchKindProbe, &token, nil, 0), joiner)
	require.NoError(t, err)
	select {
	case from := <-rp.found:
		assert.Equal(t, s.LocalAddr().(*net.UDPAddr).AddrPort(), from)
	case <-time.After(5 * time.Second):
		t.Fatal("the probe carrying the token was not taken")
	}
}

// A host whose NAT maps it afresh asks its introducer from a new address
// with the nonce of the same Host call: it keeps its ID (the joiner's
// re-punch reaches it there). From a new address, an ask with another
// nonce is told the ID is taken, as before.
func TestRepunchHostMovesWithItsNonce(t *testing.T) {
	intro, err := Listen("udp4", "127.0.0.1:0", testConfig())
	require.NoError(t, err)
	defer intro.Close()
	intro.ServeIntroductions()
	host, err := Listen("udp4", "127.0.0.1:0", testConfig())
	require.NoError(t, err)
	defer host.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	hosting := make(chan error, 1)
	go func() { _, err := host.Host(ctx, intro.Addr().String(), "moving"); hosting <- err }()
	var nonce [queryNonceSize]byte
	require.Eventually(t, func() bool {
		intro.punch.mu.Lock()
		defer intro.punch.mu.Unlock()
		if h := intro.punch.hosts["moving"]; h != nil {
			nonce = h.nonce
			return true
		}
		return false
	}, 5*time.Second, time.Millisecond)

	// ask registers "moving" from s with the nonce n, proving s first,
	// and returns the status of the answer.
	to := intro.Addr().(*net.UDPAddr).AddrPort()
	ask := func(s *net.UDPConn, n [queryNonceSize]byte) byte {
		var cookie []byte
		buf := make([]byte, 2048)
		for range 2 {
			_, err := s.WriteToUDPAddrPort(appendQueryDatagram(nil, introKindAsk, &n, appendIntroAsk(nil, introRoleHost, cookie, "moving", nil, 0), queryPadTo), to)
			require.NoError(t, err)
			require.NoError(t, s.SetReadDeadline(time.Now().Add(5*time.Second)))
			k, _, err := s.ReadFromUDPAddrPort(buf)
			require.NoError(t, err)
			kind, got, body, ok := parseQueryDatagram(buf[:k])
			require.True(t, ok && kind == introKindAnswer && got == n)
			if body[0] != introProve {
				return body[0]
			}
			cookie = append([]byte(nil), body[1:]...)
		}
		t.Fatal("asked for a cookie twice")
		return 0
	}
	other := stranger(t)
	var guess [queryNonceSize]byte
	guess[0] = nonce[0] + 1
	assert.Equal(t, byte(introTaken), ask(other, guess), "another nonce from elsewhere: taken")
	// The host's own asks stop (what it sent before is delivered first:
	// loopback delivers as it sends), then it asks from elsewhere.
	cancel()
	require.ErrorIs(t, <-hosting, context.Canceled)
	moved := stranger(t)
	assert.Equal(t, byte(introWaiting), ask(moved, nonce), "the Host call's nonce from a new address: still the host")
	intro.punch.mu.Lock()
	at := intro.punch.hosts["moving"].observed
	intro.punch.mu.Unlock()
	assert.Equal(t, moved.LocalAddr().(*net.UDPAddr).AddrPort(), at, "the introducer follows the host")
}
