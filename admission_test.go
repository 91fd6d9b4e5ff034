package knet

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"net"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// tokenServer is a secure listener taking connect tokens under key, with
// the Config a client needs (but the token).
func tokenServer(t *testing.T, mod func(*Config)) (l *Listener, key []byte, ccfg *Config, admitted *atomic.Int32) {
	scfg, ccfg := secureConfigs(t)
	key = newTokenKey(t)
	scfg.TokenKey = key
	admitted = new(atomic.Int32)
	scfg.AdmitConn = func(c *Conn, payload []byte) ([]byte, error) {
		admitted.Add(1)
		return nil, nil
	}
	if mod != nil {
		mod(scfg)
	}
	l = listen(t, scfg)
	serveEcho(t, l)
	return l, key, ccfg, admitted
}

func addrPort(t testing.TB, a net.Addr) netip.AddrPort {
	ap, err := netip.ParseAddrPort(a.String())
	require.NoError(t, err)
	return ap
}

func issue(t *testing.T, key []byte, tok Token) []byte {
	b, err := IssueToken(key, tok)
	require.NoError(t, err)
	return b
}

func TestTokenUserDataReachesAdmit(t *testing.T) {
	type seen struct {
		tok     *Token
		payload string
	}
	got := make(chan seen, 1)
	l, key, ccfg, _ := tokenServer(t, func(c *Config) {
		c.AdmitConn = func(c *Conn, payload []byte) ([]byte, error) {
			got <- seen{c.Token(), string(payload)}
			return []byte("welcome"), nil
		}
	})
	want := sampleToken(addrPort(t, l.Addr()))
	ccfg.Token = issue(t, key, want)
	ccfg.ConnectPayload = []byte("hello")
	c := dial(t, l.Addr().String(), ccfg)
	require.True(t, c.Secure())
	assert.Nil(t, c.Token(), "a client has no checked token")
	_, reply := c.Handshake()
	assert.Equal(t, "welcome", string(reply))
	s := <-got
	require.NotNil(t, s.tok)
	assert.Equal(t, uint64(0x0102030405060708), s.tok.ClientID)
	assert.Equal(t, "team=red;rank=gold", string(s.tok.UserData))
	assert.Equal(t, "hello", s.payload, "the ConnectPayload came apart from the token")
	assert.Equal(t, want.Expires.Unix(), s.tok.Expires.Unix())
	assert.Equal(t, uint64(0), l.Stats().RejectedTokens)
}

func TestTokenRejectedBeforeAnyState(t *testing.T) {
	l, key, ccfg, admitted := tokenServer(t, nil)
	us := addrPort(t, l.Addr())
	expired := sampleToken(us)
	expired.Expires = time.Now().Add(-time.Second)
	elsewhere := sampleToken(netip.MustParseAddrPort("192.0.2.1:7000"), netip.AddrPortFrom(us.Addr(), us.Port()+1))
	for _, tt := range []struct {
		name, reason string
		token        []byte
	}{
		{"missing", "missing", nil},
		{"expired", "expired", issue(t, key, expired)},
		{"foreign key", "invalid", issue(t, newTokenKey(t), sampleToken(us))},
		{"forged", "invalid", append(issue(t, key, sampleToken(us)), 0)},
		{"another server", "not for this server", issue(t, key, elsewhere)},
	} {
		before := l.Stats()
		cfg := *ccfg
		cfg.Token = tt.token
		_, err := sysNet().Dial(within(t, 5*time.Second), l.Addr().String(), &cfg)
		require.Error(t, err, tt.name)
		assert.ErrorIs(t, err, ErrTokenRejected, tt.name)
		assert.ErrorIs(t, err, ErrRefused, tt.name)
		assert.Contains(t, err.Error(), "connect token rejected: "+tt.reason, tt.name)
		// The refusal went out after the counts: they are final.
		st := l.Stats()
		assert.Equal(t, before.RejectedTokens+1, st.RejectedTokens, tt.name)
		assert.Equal(t, before.RefusedAttempts+1, st.RefusedAttempts, tt.name)
		assert.Zero(t, st.Connections, tt.name)
		assert.Zero(t, st.Pending, tt.name)
	}
	assert.Zero(t, admitted.Load(), "Admit saw a rejected token")
}

func TestTokenReplayRejected(t *testing.T) {
	l, key, ccfg, admitted := tokenServer(t, nil)
	var first atomic.Pointer[[]byte]
	r := newTapRelay(t, l.Addr(), func(b []byte) [][]byte {
		first.CompareAndSwap(nil, &b)
		return [][]byte{b}
	}, nil)
	want := sampleToken(addrPort(t, l.Addr()))
	ccfg.Token = issue(t, key, want)
	c := dial(t, r.Addr(), ccfg)
	require.True(t, c.Secure())
	require.Equal(t, int32(1), admitted.Load())
	// A round trip: the server's side is established (no longer pending)
	// before the counts below.
	require.NoError(t, c.Send(Message{ID: 6, Payload: []byte("hi"), Reliable: true}))
	_, err := c.Receive(within(t, 5*time.Second))
	require.NoError(t, err)

	// An on-path attacker replays the client's ConnectSyn from its own
	// address: its handshake message cost a key exchange already, and
	// costs none again; the replay is dropped.
	syn := *first.Load()
	attacker := newFlooder(t, l.Addr())
	_, err = attacker.pc.Write(syn)
	require.NoError(t, err)
	probe(t, l)
	attacker.quiet(t)
	st := l.Stats()
	assert.Equal(t, uint64(1), st.ReplayedHandshakes)
	assert.Equal(t, uint64(1), st.KeyExchanges)

	// The client dialing again with the token is refused: it was used.
	_, err = sysNet().Dial(within(t, 5*time.Second), l.Addr().String(), ccfg)
	assert.ErrorIs(t, err, ErrTokenRejected)
	assert.Contains(t, err.Error(), "already used")
	st = l.Stats()
	assert.Equal(t, uint64(1), st.RejectedTokens)
	assert.Equal(t, uint64(2), st.KeyExchanges)
	assert.Equal(t, 1, st.Connections, "only the first connection")
	assert.Zero(t, st.Pending)
	assert.Equal(t, int32(1), admitted.Load())
}

// readRefusal reads a DisconnectAck from pc and returns its reason.
func readRefusal(t *testing.T, pc *net.UDPConn) string {
	t.Helper()
	pc.SetReadDeadline(time.Now().Add(5 * time.Second)) // a bound, not a wait
	buf := make([]byte, 2048)
	n, err := pc.Read(buf)
	require.NoError(t, err)
	var reason []byte
	found := false
	var h header
	require.NoError(t, scanDatagram(buf[:n], &h, func(m message) {
		if m.id == idDisconnectAck {
			found, reason = true, append([]byte(nil), m.payload...)
		}
	}))
	require.True(t, found, "no DisconnectAck")
	if n := len(reason) - 1 - refusalProofSize; n >= 0 && reason[n] == 0 {
		reason = reason[:n] // a refusal of a secure ConnectSyn: its proof
	}
	return string(reason)
}

func TestTokenPublicAddrs(t *testing.T) {
	public := netip.MustParseAddrPort("203.0.113.7:7777")
	l, key, ccfg, _ := tokenServer(t, func(c *Config) { c.PublicAddrs = []netip.AddrPort{public} })
	ccfg.Token = issue(t, key, sampleToken(public))
	dial(t, l.Addr().String(), ccfg)
	// The socket's own address is not one of PublicAddrs.
	want := sampleToken(addrPort(t, l.Addr()))
	ccfg.Token = issue(t, key, want)
	_, err := sysNet().Dial(within(t, 5*time.Second), l.Addr().String(), ccfg)
	assert.ErrorIs(t, err, ErrTokenRejected)
	assert.Contains(t, err.Error(), "not for this server")
}

func TestTokenStealth(t *testing.T) {
	l, _, ccfg, _ := tokenServer(t, func(c *Config) { c.Stealth = true })
	ccfg.Token = issue(t, newTokenKey(t), sampleToken(addrPort(t, l.Addr())))
	ccfg.ConnectTimeout = 300 * time.Millisecond
	_, err := sysNet().Dial(within(t, 5*time.Second), l.Addr().String(), ccfg)
	var te *TimeoutError
	require.ErrorAs(t, err, &te)
	st := l.Stats()
	assert.Positive(t, st.RejectedTokens)
	assert.Zero(t, st.Connections)
}

func TestTokenConfigChecks(t *testing.T) {
	t.Parallel()
	priv, pub, err := GenerateKey()
	require.NoError(t, err)
	key := newTokenKey(t)
	_, err = Listen("udp", "127.0.0.1:0", &Config{TokenKey: key})
	assert.ErrorIs(t, err, errTokenKeyAlone)
	_, err = Listen("udp", "127.0.0.1:0", &Config{PrivateKey: priv, TokenKey: key[:5]})
	assert.Error(t, err)
	_, err = Listen("udp", ":0", &Config{PrivateKey: priv, TokenKey: key})
	assert.ErrorIs(t, err, errTokenAddrs)
	_, err = Dial(context.Background(), "udp", "127.0.0.1:9", &Config{Token: []byte("x")})
	assert.ErrorIs(t, err, errTokenInClear)
	_, err = Dial(context.Background(), "udp", "127.0.0.1:9", &Config{ServerKey: pub, Token: make([]byte, maxTokenSize+1)})
	assert.Error(t, err)
	// The token's length comes off the ConnectPayload's.
	tok := make([]byte, maxTokenSize)
	cfg := &Config{ServerKey: pub, Token: tok, ConnectPayload: make([]byte, cfgLimit(pub, nil)-maxTokenSize+1)}
	_, err = Dial(context.Background(), "udp", "127.0.0.1:9", cfg)
	assert.ErrorIs(t, err, ErrHandshakeTooLarge)

	// A Config shared by server and client is refused, naming the field
	// of the other side (TestAPIConfigSides); each side takes its own.
	_, err = Listen("udp", "127.0.0.1:0", &Config{PrivateKey: priv, TokenKey: key, ServerKey: pub})
	assert.ErrorContains(t, err, "Config.ServerKey")
	l := listen(t, &Config{PrivateKey: priv, TokenKey: key})
	serveEcho(t, l)
	client := &Config{ServerKey: pub, Token: issue(t, key, sampleToken(addrPort(t, l.Addr())))}
	dial(t, l.Addr().String(), client)
	// A token sent to a listener that takes none is ignored.
	l2 := listen(t, &Config{PrivateKey: priv})
	serveEcho(t, l2)
	dial(t, l2.Addr().String(), client)
}

// cfgLimit is a secure client's ConnectPayload limit without a token.
func cfgLimit(pub, token []byte) int {
	rc := (&Config{ServerKey: pub, Token: token}).resolve()
	rc.secureDialer()
	return rc.synPayloadLimit() + len(token)
}

func TestTokenNotBurntByReplayThatNeverCompletes(t *testing.T) {
	// An on-path attacker drops a client's ConnectSyn and replays it from
	// its own address: the server takes the attempt (the token is valid)
	// and answers the attacker, who cannot read the answer. The token is
	// not used by that: the client, dialing again, connects with it.
	l, key, ccfg, admitted := tokenServer(t, nil)
	tok := issue(t, key, sampleToken(addrPort(t, l.Addr())))
	victims, _ := synDatagram(t, ccfg.ServerKey, tok, nil)
	attacker := newFlooder(t, l.Addr())
	r := attacker.send(t, victims)
	synAck, _ := holds(r, idConnectSynAck)
	require.True(t, synAck, "the replay was not taken")
	require.Equal(t, 1, l.Stats().Pending)

	ccfg.Token = tok
	c, err := sysNet().Dial(within(t, 5*time.Second), l.Addr().String(), ccfg)
	require.NoError(t, err, "the replay burnt the token")
	t.Cleanup(func() { c.Close() })
	echoOnce(t, c, Message{ID: 6, Payload: []byte("x"), Reliable: true})
	st := l.Stats()
	assert.Zero(t, st.RejectedTokens)
	assert.Equal(t, 2, st.Connections, "the client's and the attacker's pending one")
	assert.Equal(t, 1, st.Pending)
	assert.Equal(t, int32(2), admitted.Load())
}

func TestTokenUsedAtEstablishment(t *testing.T) {
	// Two attempts with one token both pass admission; the first to
	// complete the handshake uses it, the other is refused as it
	// completes.
	l, key, ccfg, admitted := tokenServer(t, nil)
	ccfg.Token = issue(t, key, sampleToken(addrPort(t, l.Addr())))
	var release atomic.Bool
	// A's ConnectSyn goes through, its ConnectAck and what follows wait.
	r := newTapRelay(t, l.Addr(), func(b []byte) [][]byte {
		if syn, _ := holds(b, idConnectSyn); syn || release.Load() {
			return [][]byte{b}
		}
		return nil
	}, nil)
	a := dial(t, r.Addr(), ccfg) // the client's side completes on the ConnectSynAck
	require.Equal(t, int32(1), admitted.Load())
	require.Equal(t, 1, l.Stats().Pending)

	b := dial(t, l.Addr().String(), ccfg)
	echoOnce(t, b, Message{ID: 6, Payload: []byte("b"), Reliable: true})
	assert.Equal(t, int32(2), admitted.Load(), "the second attempt was refused at admission")

	l.eps[0].mu.Lock()
	serverA := l.eps[0].conns[addrPort(t, r.sc.LocalAddr())]
	l.eps[0].mu.Unlock()
	require.NotNil(t, serverA)

	release.Store(true)
	require.NoError(t, a.Send(Message{ID: 6, Payload: []byte("a"), Reliable: true}))
	select {
	case <-a.Done():
	case <-within(t, 10*time.Second).Done():
		t.Fatal("the second connection with the token was not refused")
	}
	// Refused after its own side completed: to the client, the server closed
	// it (as when the accept backlog fills up meanwhile).
	assert.ErrorIs(t, a.Err(), ErrPeerClosed)
	<-serverA.Done()
	st := l.Stats()
	assert.Equal(t, uint64(1), st.RejectedTokens)
	assert.Equal(t, 1, st.Connections)
	assert.Zero(t, st.Pending)
}

// probe waits until the listener's reader has handled every datagram
// sent to it before: it sends a datagram that is no connection attempt
// from a new address, which the reader counts as stray (a secure listener
// answers nothing to it), and waits for the count. On loopback a datagram
// is queued at the listener's socket when its send returns, and the
// reader takes them in order (one socket).
func probe(t *testing.T, l *Listener) {
	t.Helper()
	before := l.Stats().StrayDatagrams
	f := newFlooder(t, l.Addr())
	d := appendHeader(nil, &header{})
	d = appendMessage(d, &message{id: idDisconnect})
	_, err := f.pc.Write(d)
	require.NoError(t, err)
	for deadline := time.Now().Add(5 * time.Second); l.Stats().StrayDatagrams == before; {
		require.True(t, time.Now().Before(deadline), "the probe was never read")
		runtime.Gosched()
	}
}

// recv returns what f reads next, which must come.
func (f *flooder) recv(t *testing.T) []byte {
	t.Helper()
	f.pc.SetReadDeadline(time.Now().Add(5 * time.Second)) // a bound, not a wait
	buf := make([]byte, 2048)
	n, err := f.pc.Read(buf)
	require.NoError(t, err, "no answer")
	return buf[:n]
}

// quiet asserts that f has nothing to read now: nothing the listener
// sent it before the last probe (on loopback, a datagram is queued at its
// socket when its send returns).
func (f *flooder) quiet(t *testing.T) {
	t.Helper()
	b, ok := recvNow(t, f.pc)
	assert.False(t, ok, "got %d bytes: %x", len(b), b)
}

// paddedSyn is a secure ConnectSyn datagram for msg1 (no cookie) padded to
// size bytes.
func paddedSyn(msg1 []byte, size int) []byte {
	d := appendHeader(nil, &header{})
	d = appendMessage(d, &message{id: idConnectSyn, payload: appendSecureSyn(nil, nil, msg1)})
	return appendPadding(d, size)
}

func TestSecureSynPadding(t *testing.T) {
	scfg, ccfg := secureConfigs(t)
	l := listen(t, scfg)
	serveEcho(t, l)

	// A secure ConnectSyn under 1200 bytes: no key exchange, no answer.
	f := newFlooder(t, l.Addr())
	_, msg1 := synDatagram(t, ccfg.ServerKey, nil, nil)
	short := paddedSyn(msg1, synPadTo-1)
	require.Len(t, short, synPadTo-1)
	_, err := f.pc.Write(short)
	require.NoError(t, err)
	probe(t, l)
	f.quiet(t)
	st := l.Stats()
	assert.Zero(t, st.Connections, "a short secure ConnectSyn was taken")
	assert.Zero(t, st.RefusedAttempts)
	assert.Equal(t, uint64(1), st.InvalidDatagrams)
	// The same handshake padded to 1200 bytes is taken.
	r := f.send(t, paddedSyn(msg1, synPadTo))
	synAck, _ := holds(r, idConnectSynAck)
	assert.True(t, synAck)

	// A secure client pads to 1200 bytes whatever its MaxDatagramSize.
	small := *ccfg
	small.MaxDatagramSize = 600
	c := dial(t, l.Addr().String(), &small)
	echoOnce(t, c, Message{ID: 6, Payload: []byte("x"), Reliable: true})

	// A plaintext client is still refused, however short its ConnectSyn.
	_, err = sysNet().Dial(within(t, 5*time.Second), l.Addr().String(), &Config{MaxDatagramSize: 300, ConnectPayload: []byte("hello")})
	assert.ErrorIs(t, err, ErrRefused)
	assert.Contains(t, err.Error(), ErrHandshakeFailed.Error())
}

// garbageSyn is a ConnectSyn datagram whose Noise message is random
// bytes (no key exchange can read it), echoing cookie, padded to 1200
// bytes; also its Noise message.
func garbageSyn(cookie []byte) (d, msg1 []byte) {
	msg1 = make([]byte, noiseOverhead+200)
	rand.Read(msg1)
	return rebuildSyn(cookie, msg1), msg1
}

// cookieOf returns the cookie of the Retry r.
func cookieOf(t *testing.T, r []byte) []byte {
	t.Helper()
	var cookie []byte
	var h header
	require.NoError(t, scanDatagram(r, &h, func(m message) {
		if m.id == idRetry {
			cookie = bytes.Clone(m.payload)
		}
	}))
	require.Len(t, cookie, cookieSize, "not a Retry")
	return cookie
}

// holdKeyExchanges makes l's key exchanges wait until release: entered
// receives as each starts.
func holdKeyExchanges(t *testing.T, l *Listener) (entered <-chan struct{}, release func()) {
	in := make(chan struct{}, 64)
	gate := make(chan struct{})
	var once sync.Once
	hook := func() {
		in <- struct{}{}
		<-gate
	}
	l.keyExchangeHook.Store(&hook)
	release = func() { once.Do(func() { close(gate) }) }
	t.Cleanup(release) // before the listener's Close
	return in, release
}

// setHandshakeLimits sets l's handshake workers and queue, before any
// attempt.
func setHandshakeLimits(l *Listener, workers, queue int) {
	l.mu.Lock()
	l.hs.maxWorkers, l.hs.maxQueue = workers, queue
	l.mu.Unlock()
}

// setSourceLimits sets l's key exchanges per source address.
func setSourceLimits(l *Listener, rate, burst float64) {
	l.mu.Lock()
	l.hs.sources.rate, l.hs.sources.burst = rate, burst
	l.mu.Unlock()
}

func TestCookieFloodCostsOneKeyExchange(t *testing.T) {
	// The review's flood: one ConnectSyn with a valid cookie and a Noise
	// message that does not read, sent 2,000 times. It costs one key
	// exchange, off the reader; the copies get the refusal again,
	// statelessly. An established connection's echo goes on meanwhile.
	scfg, ccfg := secureConfigs(t)
	scfg.CookieThreshold = -1
	l := listen(t, scfg)
	serveEcho(t, l)
	c := dial(t, l.Addr().String(), ccfg)
	echoOnce(t, c, Message{ID: 6, Payload: []byte("before"), Reliable: true})
	before := l.Stats()

	f := newFlooder(t, l.Addr())
	d, msg1 := garbageSyn(nil)
	d = rebuildSyn(cookieOf(t, f.send(t, d)), msg1)
	require.Len(t, d, synPadTo)
	echoed := make(chan error, 1)
	go func() {
		if err := c.Send(Message{ID: 6, Payload: []byte("during"), Reliable: true}); err != nil {
			echoed <- err
			return
		}
		_, err := c.Receive(context.Background())
		echoed <- err
	}()
	const copies = 2000
	for range copies {
		_, err := f.pc.Write(d)
		require.NoError(t, err)
	}
	select {
	case err := <-echoed:
		require.NoError(t, err)
	case <-within(t, 10*time.Second).Done():
		t.Fatal("no echo during the flood")
	}
	probe(t, l)
	// A refusal comes once the key exchange failed (the copies after
	// it get it again): none can follow.
	r := f.recv(t)
	ack, _ := holds(r, idDisconnectAck)
	require.True(t, ack)
	st := l.Stats()
	assert.Equal(t, uint64(1), st.KeyExchanges-before.KeyExchanges, "the flood cost more than one key exchange")
	assert.Zero(t, st.Pending)
	assert.LessOrEqual(t, l.unprovenOut.Load(), l.unprovenIn.Load())
}

func TestFailedHandshakeRefusedAgainWithoutKeyExchange(t *testing.T) {
	// A ConnectSyn whose handshake failed, sent again (its refusal was
	// lost), from its address or another: refused again, statelessly.
	scfg, ccfg := secureConfigs(t)
	scfg.AdmitConn = func(c *Conn, payload []byte) ([]byte, error) {
		return nil, errors.New("go away")
	}
	l := listen(t, scfg)
	f, g := newFlooder(t, l.Addr()), newFlooder(t, l.Addr())
	d, _ := garbageSyn(nil)
	for _, from := range []*flooder{f, f, g} {
		_, err := from.pc.Write(d)
		require.NoError(t, err)
		assert.Equal(t, ErrHandshakeFailed.Error(), readRefusal(t, from.pc))
	}
	st := l.Stats()
	assert.Equal(t, uint64(1), st.KeyExchanges)
	assert.Equal(t, uint64(2), st.ReplayedHandshakes)
	assert.Equal(t, uint64(3), st.RefusedAttempts)

	// So is one whose connection AdmitConn refused, once that ended.
	d, _ = synDatagram(t, ccfg.ServerKey, nil, nil)
	h := newFlooder(t, l.Addr())
	_, err := h.pc.Write(d)
	require.NoError(t, err)
	assert.Equal(t, "go away", readRefusal(t, h.pc))
	l.eps[0].mu.Lock()
	conn := l.eps[0].conns[h.addr]
	l.eps[0].mu.Unlock()
	if conn != nil {
		<-conn.Done()
	}
	_, err = h.pc.Write(d)
	require.NoError(t, err)
	assert.Equal(t, "go away", readRefusal(t, h.pc))
	st = l.Stats()
	assert.Equal(t, uint64(2), st.KeyExchanges)
	assert.Equal(t, uint64(3), st.ReplayedHandshakes)
}

func TestHandshakesOffTheReader(t *testing.T) {
	// Key exchanges run on a bounded pool: while they wait, the reader
	// serves established connections; past the queue, attempts are
	// dropped (their clients send them again); an address sent again
	// while its attempt waits costs nothing more.
	scfg, ccfg := secureConfigs(t)
	l := listen(t, scfg)
	serveEcho(t, l)
	setHandshakeLimits(l, 1, 2)
	c := dial(t, l.Addr().String(), ccfg)
	entered, release := holdKeyExchanges(t, l)

	fs := make([]*flooder, 4)
	ds := make([][]byte, 4)
	for i := range fs {
		fs[i] = newFlooder(t, l.Addr())
		ds[i], _ = synDatagram(t, ccfg.ServerKey, nil, nil)
	}
	_, err := fs[0].pc.Write(ds[0])
	require.NoError(t, err)
	<-entered // the worker holds the first; two more fill the queue
	for i := 1; i < 4; i++ {
		_, err := fs[i].pc.Write(ds[i])
		require.NoError(t, err)
	}
	_, err = fs[1].pc.Write(ds[1]) // sent again while it waits
	require.NoError(t, err)

	// The reader is not waiting for the key exchange.
	m := echoOnce(t, c, Message{ID: 6, Payload: []byte("meanwhile"), Reliable: true})
	assert.Equal(t, "meanwhile", string(m.Payload))
	probe(t, l)
	st := l.Stats()
	assert.Equal(t, uint64(1), st.DroppedHandshakes, "the queue holds two")
	assert.Equal(t, uint64(1), st.KeyExchanges, "the client's only")

	release()
	for i := range 3 {
		r := fs[i].recv(t)
		synAck, _ := holds(r, idConnectSynAck)
		assert.True(t, synAck, "attempt %d", i)
	}
	fs[3].quiet(t)
	// The dropped one, sent again, is taken.
	r := fs[3].send(t, ds[3])
	synAck, _ := holds(r, idConnectSynAck)
	assert.True(t, synAck)
	st = l.Stats()
	assert.Equal(t, uint64(5), st.KeyExchanges, "the client's, three, and the one sent again")
	assert.Equal(t, 4, st.Pending)
	assert.Zero(t, st.ReplayedHandshakes)
}

func TestPendingBoundCountsQueuedHandshakes(t *testing.T) {
	// MaxPendingConnections counts the attempts waiting for their key
	// exchange: they become pending connections.
	scfg, ccfg := secureConfigs(t)
	scfg.MaxPendingConnections = 2
	l := listen(t, scfg)
	entered, release := holdKeyExchanges(t, l)
	setHandshakeLimits(l, 1, 8)
	fs := make([]*flooder, 3)
	for i := range fs {
		fs[i] = newFlooder(t, l.Addr())
		d, _ := synDatagram(t, ccfg.ServerKey, nil, nil)
		_, err := fs[i].pc.Write(d)
		require.NoError(t, err)
		if i == 0 {
			<-entered
		}
	}
	probe(t, l)
	assert.Equal(t, uint64(1), l.Stats().IgnoredAttempts)
	release()
	for i := range 2 {
		r := fs[i].recv(t)
		synAck, _ := holds(r, idConnectSynAck)
		assert.True(t, synAck)
	}
	st := l.Stats()
	assert.Equal(t, 2, st.Pending)
	assert.Equal(t, uint64(2), st.KeyExchanges)
}

func TestHandshakeRateLimitPerSourceIP(t *testing.T) {
	// Three key exchanges for 127.0.0.1, whatever its ports; then its
	// attempts are dropped before one. 127.0.0.2 has its own.
	scfg, _ := secureConfigs(t)
	scfg.CookieThreshold = 1000 // failed handshakes do not bring cookies here
	l := listen(t, scfg)
	setSourceLimits(l, 0, 3)
	for i := range 5 {
		f := newFlooder(t, l.Addr())
		d, _ := garbageSyn(nil)
		_, err := f.pc.Write(d)
		require.NoError(t, err)
		if i < 3 {
			assert.Equal(t, ErrHandshakeFailed.Error(), readRefusal(t, f.pc), "attempt %d", i)
			continue
		}
		probe(t, l)
		f.quiet(t)
	}
	st := l.Stats()
	assert.Equal(t, uint64(3), st.KeyExchanges)
	assert.Equal(t, uint64(2), st.RateLimitedHandshakes)

	pc, err := net.DialUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 2)}, l.Addr().(*net.UDPAddr))
	if err != nil {
		t.Skipf("no 127.0.0.2 here: %v", err)
	}
	defer pc.Close()
	d, _ := garbageSyn(nil)
	_, err = pc.Write(d)
	require.NoError(t, err)
	assert.Equal(t, ErrHandshakeFailed.Error(), readRefusal(t, pc))
	assert.Equal(t, uint64(4), l.Stats().KeyExchanges)
}

func TestListenerCloseWaitsForHandshakes(t *testing.T) {
	// Close while a key exchange runs and others wait: the queue is let
	// go, the worker ends, no connection or goroutine is left (TestMain
	// checks).
	scfg, ccfg := secureConfigs(t)
	l, err := sysNet().Listen(scfg)
	require.NoError(t, err)
	entered, release := holdKeyExchanges(t, l)
	for i := range 4 {
		f := newFlooder(t, l.Addr())
		d, _ := synDatagram(t, ccfg.ServerKey, nil, nil)
		_, err := f.pc.Write(d)
		require.NoError(t, err)
		if i == 0 {
			<-entered
		}
	}
	probe(t, l)
	closed := make(chan struct{})
	go func() {
		l.Close()
		close(closed)
	}()
	release()
	<-closed
	st := l.Stats()
	assert.Zero(t, st.Connections)
	assert.Zero(t, st.Pending)
}

func TestSeenHandshakes(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	s := newSeenHandshakes(3, 10*time.Second, now)
	_, ok := s.find(1, now)
	assert.False(t, ok)
	s.add(1, now)
	e, ok := s.find(1, now.Add(10*time.Second))
	require.True(t, ok)
	assert.False(t, e.failed)
	_, ok = s.find(1, now.Add(10*time.Second+1))
	assert.False(t, ok, "past the window")

	s.fail(1, "why")
	e, _ = s.find(1, now)
	assert.True(t, e.failed)
	assert.Equal(t, "why", e.reason)
	s.fail(9, "unknown") // nothing to mark

	// Full: the oldest goes, live or not.
	s.add(2, now.Add(time.Second))
	s.add(3, now.Add(2*time.Second))
	s.add(4, now.Add(3*time.Second))
	assert.False(t, s.has(1, now.Add(3*time.Second)), "the oldest stayed")
	for _, h := range []uint64{2, 3, 4} {
		assert.True(t, s.has(h, now.Add(3*time.Second)), "%d", h)
	}
	assert.Len(t, s.index, 3)
	// One added again after it went stale keeps its new place when its
	// old entry is overwritten.
	s.add(2, now.Add(20*time.Second)) // overwrites 2's old entry itself
	s.add(5, now.Add(20*time.Second)) // overwrites 3
	assert.True(t, s.has(2, now.Add(20*time.Second)))
	assert.False(t, s.has(3, now.Add(20*time.Second)))
	s.forget(2)
	assert.False(t, s.has(2, now.Add(20*time.Second)))
	assert.LessOrEqual(t, len(s.index), 3)
	assert.Len(t, s.ring, 3)
}

func TestSourceLimiter(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	s := newSourceLimiter(sourceBuckets, 10, 3, now)
	a := netip.MustParseAddr("192.0.2.1")
	for i := range 3 {
		assert.True(t, s.allow(a, now), "%d", i)
	}
	assert.False(t, s.allow(a, now), "past the burst")
	assert.False(t, s.allow(netip.MustParseAddr("::ffff:192.0.2.1"), now), "the same address, mapped")
	assert.False(t, s.allow(a, now.Add(99*time.Millisecond)))
	assert.True(t, s.allow(a, now.Add(150*time.Millisecond)), "paid back at 10 a second")
	assert.False(t, s.allow(a, now.Add(150*time.Millisecond)))
	assert.True(t, s.allow(a, now.Add(time.Hour)), "full again")

	// IPv6: one bucket per /64.
	v6 := netip.MustParseAddr("2001:db8:1:2::1")
	for range 3 {
		require.True(t, s.allow(v6, now))
	}
	assert.False(t, s.allow(netip.MustParseAddr("2001:db8:1:2:ffff::9"), now), "the same /64")
	// Another address or /64 has its own bucket, unless the hashes meet
	// (1 in sourceBuckets).
	others := 0
	for i := range 16 {
		if s.allow(netip.AddrFrom4([4]byte{198, 51, 100, byte(i)}), now) {
			others++
		}
	}
	assert.GreaterOrEqual(t, others, 15)
	// A clock read late by another reader takes nothing back.
	b := newSourceLimiter(sourceBuckets, 10, 1, now)
	assert.True(t, b.allow(a, now.Add(time.Second)))
	assert.False(t, b.allow(a, now))

	if !raceEnabled {
		allocs := testing.AllocsPerRun(100, func() { s.allow(v6, now) })
		assert.Zero(t, allocs)
	}
}

func TestTimedOutHandshakeMayComeAgain(t *testing.T) {
	// An attempt whose connection timed out unestablished is forgotten:
	// its ConnectSyn, sent again, is taken again (a new key exchange, as
	// a new attempt would cost), not dropped as a replay.
	scfg, ccfg := secureConfigs(t)
	scfg.ConnectTimeout = 50 * time.Millisecond
	l := listen(t, scfg)
	f := newFlooder(t, l.Addr())
	d, _ := synDatagram(t, ccfg.ServerKey, nil, nil)
	for i := range 2 {
		r := f.send(t, d)
		synAck, _ := holds(r, idConnectSynAck)
		require.True(t, synAck, "attempt %d", i)
		l.eps[0].mu.Lock()
		c := l.eps[0].conns[f.addr]
		l.eps[0].mu.Unlock()
		if c != nil {
			<-c.Done() // it times out: f never answers
		}
	}
	st := l.Stats()
	assert.Equal(t, uint64(2), st.KeyExchanges)
	assert.Zero(t, st.ReplayedHandshakes)
}
