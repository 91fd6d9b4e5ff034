package knet

import (
	"context"
	"net"
	"net/netip"
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

func addrPort(t *testing.T, a net.Addr) netip.AddrPort {
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
		_, err := Dial(within(t, 5*time.Second), "udp", l.Addr().String(), &cfg)
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
	// address: the token was used.
	syn := *first.Load()
	pc, err := net.DialUDP("udp", nil, l.Addr().(*net.UDPAddr))
	require.NoError(t, err)
	defer pc.Close()
	_, err = pc.Write(syn)
	require.NoError(t, err)
	why := readRefusal(t, pc)
	assert.Equal(t, "knet: connect token rejected: already used", why)

	// So does the client itself, dialing again with it.
	_, err = Dial(within(t, 5*time.Second), "udp", l.Addr().String(), ccfg)
	assert.ErrorIs(t, err, ErrTokenRejected)
	assert.Contains(t, err.Error(), "already used")
	st := l.Stats()
	assert.Equal(t, uint64(2), st.RejectedTokens)
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
	_, err := Dial(within(t, 5*time.Second), "udp", l.Addr().String(), ccfg)
	assert.ErrorIs(t, err, ErrTokenRejected)
	assert.Contains(t, err.Error(), "not for this server")
}

func TestTokenStealth(t *testing.T) {
	l, _, ccfg, _ := tokenServer(t, func(c *Config) { c.Stealth = true })
	ccfg.Token = issue(t, newTokenKey(t), sampleToken(addrPort(t, l.Addr())))
	ccfg.ConnectTimeout = 300 * time.Millisecond
	_, err := Dial(within(t, 5*time.Second), "udp", l.Addr().String(), ccfg)
	var te *TimeoutError
	require.ErrorAs(t, err, &te)
	st := l.Stats()
	assert.Positive(t, st.RejectedTokens)
	assert.Zero(t, st.Connections)
}

func TestTokenConfigChecks(t *testing.T) {
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

	// A Config shared by server and client: each takes its own fields.
	l := listen(t, &Config{PrivateKey: priv, TokenKey: key, ServerKey: pub})
	serveEcho(t, l)
	shared := &Config{PrivateKey: priv, TokenKey: key, ServerKey: pub, Token: issue(t, key, sampleToken(addrPort(t, l.Addr())))}
	dial(t, l.Addr().String(), shared)
	// A token sent to a listener that takes none is ignored.
	l2 := listen(t, &Config{PrivateKey: priv})
	serveEcho(t, l2)
	dial(t, l2.Addr().String(), shared)
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
	c, err := Dial(within(t, 5*time.Second), "udp", l.Addr().String(), ccfg)
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
	st := l.Stats()
	assert.Equal(t, uint64(1), st.RejectedTokens)
	assert.Equal(t, 1, st.Connections)
	assert.Zero(t, st.Pending)
}

// probe waits until the listener's reader has handled every datagram
// sent to it before: it sends a Disconnect from a new address, which the
// reader answers at once, statelessly (a DisconnectAck without a reason).
// On loopback a datagram is queued at the listener's socket when its send
// returns, and the reader takes them in order (one socket).
func probe(t *testing.T, server net.Addr) {
	t.Helper()
	f := newFlooder(t, server)
	d := appendHeader(nil, &header{})
	d = appendMessage(d, &message{id: idDisconnect})
	r := f.send(t, d)
	ack, _ := holds(r, idDisconnectAck)
	require.True(t, ack, "the probe's answer is no DisconnectAck")
}

// quiet asserts that f has nothing to read now.
func (f *flooder) quiet(t *testing.T) {
	t.Helper()
	f.pc.SetReadDeadline(time.Now())
	buf := make([]byte, 2048)
	n, err := f.pc.Read(buf)
	assert.Error(t, err, "got %d bytes", n)
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
	probe(t, l.Addr())
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
	_, err = Dial(within(t, 5*time.Second), "udp", l.Addr().String(), &Config{MaxDatagramSize: 300, ConnectPayload: []byte("hello")})
	assert.ErrorIs(t, err, ErrRefused)
	assert.Contains(t, err.Error(), ErrHandshakeFailed.Error())
}
