package knet

import (
	"bytes"
	"context"
	"encoding/binary"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestServerIDFromLiveDatagrams: every datagram a secure client sends to
// a server with a ServerID names that server, as a balancer reads it from
// the wire, before and after the client's NAT rebinds (the connection
// migrates, its ID stays); the ConnectSyn names none.
func TestServerIDFromLiveDatagrams(t *testing.T) {
	scfg, ccfg := secureConfigs(t)
	scfg.ServerID = []byte{0xab, 0xcd}
	_, r, c, sc := behindNAT(t, scfg, ccfg)
	for i := range 5 {
		echoBoth(t, c, byte(i))
	}
	r.rebind()
	second := r.outerAddr()
	before := len(r.recorded())
	for i := range 5 {
		echoBoth(t, c, byte(10+i))
	}
	require.Equal(t, second, sc.RemoteAddr().String(), "the server did not follow the client")
	require.Equal(t, uint64(1), sc.Stats().Migrations)

	var cid [cidSize]byte
	binary.LittleEndian.PutUint32(cid[:], sc.sec.cid)
	assert.Equal(t, []byte{0xab, 0xcd}, cid[:2], "the connection ID starts with the ServerID")
	syns, routed, after := 0, 0, 0
	for i, b := range r.recorded() {
		id, ok := ServerIDFromDatagram(b, 2)
		if syn, _ := isConnectSyn(b); syn {
			syns++
			assert.False(t, ok, "datagram %d: a ConnectSyn carries no connection ID", i)
			continue
		}
		routed++
		if i >= before {
			after++
		}
		if assert.True(t, ok, "datagram %d (%d bytes) not routable", i, len(b)) {
			assert.Equal(t, uint32(0xabcd), id, "datagram %d", i)
		}
		one, ok := ServerIDFromDatagram(b, 1)
		assert.True(t, ok)
		assert.Equal(t, uint32(0xab), one, "datagram %d, one byte", i)
	}
	assert.Positive(t, syns)
	assert.Positive(t, after, "no datagram after the rebinding")
	t.Logf("%d ConnectSyns, %d sealed datagrams (%d after the rebinding) all naming 0xabcd", syns, routed, after)
}

// TestConnectionIDsUnpredictable: the random part of the IDs a listener
// gives differs across 1000 connections (no two equal, no counter), and
// each of its bits is set about half the time.
func TestConnectionIDsUnpredictable(t *testing.T) {
	for _, sid := range [][]byte{nil, {7}, {7, 8}} {
		l := &Listener{cfg: &config{serverID: sid}}
		k := len(sid)
		randBits := 8 * (cidSize - k)
		const n = 1000
		seen := make(map[uint32]bool)
		var ones [32]int
		steps := 0
		var last uint32
		for i := range n {
			id, err := l.newCID(&Conn{})
			require.NoError(t, err)
			var b [cidSize]byte
			binary.LittleEndian.PutUint32(b[:], id)
			require.True(t, bytes.Equal(sid, b[:k]), "sid %x: the prefix of %08x", sid, id)
			assert.False(t, seen[id], "sid %x: id %08x given twice", sid, id)
			seen[id] = true
			rest := randomPart(b, k)
			if i > 0 && rest == last+1 {
				steps++
			}
			last = rest
			for j := range randBits {
				ones[j] += int(rest >> j & 1)
			}
		}
		assert.Less(t, steps, 5, "sid %x: %d IDs one above the one before", sid, steps)
		for j := range randBits {
			assert.InDelta(t, n/2, ones[j], n/10, "sid %x: random bit %d set %d times in %d", sid, j, ones[j], n)
		}
		assert.Len(t, l.cids, n)
	}
}

// randomPart is the bytes of a connection ID after the server ID's k,
// as a number.
func randomPart(b [cidSize]byte, k int) uint32 {
	var v uint32
	for _, c := range b[k:] {
		v = v<<8 | uint32(c)
	}
	return v
}

// TestConnectionIDsExhausted: with a 3-byte ServerID one byte is random:
// a listener gives 256 different IDs, then refuses, and gives one again
// when a connection goes.
func TestConnectionIDsExhausted(t *testing.T) {
	l := &Listener{cfg: &config{serverID: []byte{1, 2, 3}}}
	conns := make([]*Conn, 256)
	for i := range conns {
		conns[i] = &Conn{sec: &secureState{}}
		id, err := l.newCID(conns[i])
		require.NoError(t, err, "id %d", i)
		conns[i].sec.cid = id
	}
	_, err := l.newCID(&Conn{})
	require.ErrorIs(t, err, errNoCID)
	l.dropCID(conns[100])
	id, err := l.newCID(&Conn{})
	require.NoError(t, err)
	assert.Equal(t, conns[100].sec.cid, id)

	// A zero ID is never given, even when the ServerID is zeros.
	l = &Listener{cfg: &config{serverID: []byte{0, 0, 0}}}
	for range 255 {
		id, err := l.newCID(&Conn{})
		require.NoError(t, err)
		require.NotZero(t, id)
	}
	_, err = l.newCID(&Conn{})
	require.ErrorIs(t, err, errNoCID)
}

func TestServerIDConfigErrors(t *testing.T) {
	scfg, _ := secureConfigs(t)
	scfg.ServerID = []byte{1, 2, 3, 4}
	_, err := Listen("udp", "127.0.0.1:0", scfg)
	require.ErrorContains(t, err, "Config.ServerID of 4 bytes, at most 3")

	plain := testConfig()
	plain.ServerID = []byte{1}
	_, err = Listen("udp", "127.0.0.1:0", plain)
	require.ErrorContains(t, err, "needs Config.PrivateKey")

	scfg.ServerID = []byte{1, 2, 3}
	l, err := Listen("udp", "127.0.0.1:0", scfg)
	require.NoError(t, err)
	require.NoError(t, l.Close())
}

// routingSamples are datagrams for ServerIDFromDatagram: sealed ones of a
// client whose ID is 01 02 03 04 on the wire, and ones that carry none.
func routingSamples(t testing.TB) (sealed, none [][]byte) {
	c, _ := securePair(t)
	c.cid = binary.LittleEndian.Uint32([]byte{1, 2, 3, 4})
	for i, d := range [][]byte{
		plainDatagram(0, true, []byte("x")),
		appendHeader(nil, &header{packetID: 1, inOrder: true, deltas: []uint16{200}, indices: []uint16{1}}),
		appendHeader(nil, &header{packetID: 2}),
	} {
		b, err := c.seal(nil, d, uint64(i), true)
		require.NoError(t, err)
		sealed = append(sealed, b)
	}
	_, syn, err := newClientSecure(c.serverKey, nil, []byte("hello"))
	require.NoError(t, err)
	synDg := appendHeader(nil, &header{})
	synDg = appendMessage(synDg, &message{id: idConnectSyn, payload: syn})
	synDg = appendMessage(synDg, &message{id: idPadding, payload: make([]byte, 1200-len(synDg)-4)})
	var nonce [queryNonceSize]byte
	query := appendQueryDatagram(nil, queryKindQuery, &nonce, nil, 1200)
	zero := appendHeader(nil, &header{packetID: 9})
	zero = append(zero, make([]byte, cidSize+sealOverhead+3)...)
	none = [][]byte{nil, {0, 0}, sealed[2][:len(sealed[2])-1], synDg, query, zero}
	return sealed, none
}

func TestServerIDFromDatagram(t *testing.T) {
	sealed, none := routingSamples(t)
	for i, b := range sealed {
		for k, want := range []uint32{0, 0x01, 0x0102, 0x010203, 0} {
			id, ok := ServerIDFromDatagram(b, k)
			valid := k >= 1 && k <= MaxServerIDSize
			assert.Equal(t, valid, ok, "datagram %d, idLen %d", i, k)
			assert.Equal(t, want, id, "datagram %d, idLen %d", i, k)
		}
	}
	for i, b := range none {
		_, ok := ServerIDFromDatagram(b, 2)
		assert.False(t, ok, "datagram %d carries no connection ID", i)
	}
	syn := none[3]
	require.Zero(t, testing.AllocsPerRun(100, func() { ServerIDFromDatagram(sealed[1], 2) }))
	require.Zero(t, testing.AllocsPerRun(100, func() { ServerIDFromDatagram(syn, 2) }))
}

// FuzzServerIDFromDatagram: the balancer's reader never panics, and what
// it reads is the leading bytes of the connection ID the server would
// route on (sealedCID).
func FuzzServerIDFromDatagram(f *testing.F) {
	sealed, none := routingSamples(f)
	for _, b := range append(sealed, none...) {
		f.Add(b, 2)
	}
	f.Fuzz(func(t *testing.T, b []byte, idLen int) {
		id, ok := ServerIDFromDatagram(b, idLen)
		if !ok {
			if id != 0 {
				t.Fatal("an ID with ok false")
			}
			return
		}
		cid, found := sealedCID(b)
		if !found || idLen < 1 || idLen > MaxServerIDSize {
			t.Fatalf("ok for idLen %d, a datagram the server finds no ID in", idLen)
		}
		var w [cidSize]byte
		binary.LittleEndian.PutUint32(w[:], cid) // as on the wire
		if want := randomPart(w, 0) >> (8 * (cidSize - idLen)); id != want {
			t.Fatalf("id %x, the ID's first %d bytes are %x", id, idLen, want)
		}
	})
}

// Tokens that name several servers.

// downAddr is a loopback address where nothing listens (a socket bound
// there, then closed): a Dial there is refused at once (ICMP port
// unreachable).
func downAddr(t *testing.T) netip.AddrPort {
	pc, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	a := pc.LocalAddr().(*net.UDPAddr).AddrPort()
	require.NoError(t, pc.Close())
	return a
}

func TestTokenServersReadable(t *testing.T) {
	key := newTokenKey(t)
	servers := []netip.AddrPort{
		netip.MustParseAddrPort("192.0.2.7:7001"),
		netip.MustParseAddrPort("[2001:db8::1]:7000"),
		netip.MustParseAddrPort("192.0.2.1:7000"),
	}
	b := issue(t, key, sampleToken(servers...))
	got, err := TokenServers(b)
	require.NoError(t, err)
	assert.Equal(t, servers, got, "in the backend's order")

	// No token: nil, a cut head, another version, a count out of range.
	for n := range tokenHeadSize + 1 + len(servers)*tokenAddrSize + 10 + 16 {
		_, err := TokenServers(b[:n])
		assert.ErrorIs(t, err, errNotToken, "%d bytes", n)
	}
	for name, mod := range map[string]func([]byte){
		"version 1":          func(b []byte) { b[0] = 1 },
		"0 servers":          func(b []byte) { b[tokenHeadSize] = 0 },
		"9 servers":          func(b []byte) { b[tokenHeadSize] = MaxTokenServers + 1 },
		"more than there is": func(b []byte) { b[tokenHeadSize] = MaxTokenServers },
	} {
		c := bytes.Clone(b)
		mod(c)
		_, err := TokenServers(c)
		assert.ErrorIs(t, err, errNotToken, name)
	}
}

// TestDialTokenServersInOrder: Dial with no address tries the token's
// servers in order, past one where nothing listens, one that refuses the
// token and one that never answers, and tells which it reached.
func TestDialTokenServersInOrder(t *testing.T) {
	t.Parallel()
	// A fleet: the servers share a key pair. Another with the same keys
	// but another token key refuses the token ("invalid"); a socket that
	// reads nothing never answers.
	priv, pub, err := GenerateKey()
	require.NoError(t, err)
	fleet := func(c *Config) { c.PrivateKey = priv }
	l, key, ccfg, admitted := tokenServer(t, fleet)
	ccfg.ServerKey = pub
	good := addrPort(t, l.Addr())
	other, _, _, _ := tokenServer(t, fleet)
	silent := loopbackSocket(t)
	for _, tt := range []struct {
		name  string
		first netip.AddrPort
	}{
		{"nothing listening", downAddr(t)},
		{"refuses the token", addrPort(t, other.Addr())},
		{"silent", silent.LocalAddr().(*net.UDPAddr).AddrPort()},
	} {
		rejected := other.Stats().RejectedTokens
		cfg := *ccfg
		cfg.Token = issue(t, key, sampleToken(tt.first, good))
		start := time.Now()
		c, err := Dial(within(t, 10*time.Second), "udp", "", &cfg)
		require.NoError(t, err, tt.name)
		took := time.Since(start)
		assert.Equal(t, good.String(), c.RemoteAddr().String(), tt.name)
		m := echoOnce(t, c, Message{ID: 6, Payload: []byte(tt.name), Reliable: true})
		assert.Equal(t, tt.name, string(m.Payload))
		require.NoError(t, c.Close())
		switch tt.name {
		case "refuses the token":
			assert.Equal(t, rejected+1, other.Stats().RejectedTokens, "the first server was not tried first")
		case "silent":
			_, n := queued(t, silent)
			assert.Positive(t, n, "no ConnectSyn reached the silent server first")
			// Half of ConnectTimeout (3s) for each of two servers.
			assert.GreaterOrEqual(t, took, ccfg.ConnectTimeout/2, "the silent server's share")
		}
		t.Logf("%s: connected to the second server in %v", tt.name, took.Round(time.Millisecond))
	}
	assert.Equal(t, int32(3), admitted.Load())
}

// TestDialTokenServersShareContext: with a ctx deadline sooner than
// ConnectTimeout, the shares are of ctx's time: a silent first server
// leaves the second its turn.
func TestDialTokenServersShareContext(t *testing.T) {
	t.Parallel()
	l, key, ccfg, _ := tokenServer(t, nil)
	silent := loopbackSocket(t).LocalAddr().(*net.UDPAddr).AddrPort()
	ccfg.ConnectTimeout = time.Minute
	ccfg.Token = issue(t, key, sampleToken(silent, addrPort(t, l.Addr())))
	start := time.Now()
	c, err := Dial(within(t, 2*time.Second), "udp", "", ccfg)
	require.NoError(t, err)
	took := time.Since(start)
	assert.Equal(t, l.Addr().String(), c.RemoteAddr().String())
	assert.GreaterOrEqual(t, took, time.Second, "the silent server's share: half of ctx's 2s")
	require.NoError(t, c.Close())
}

// TestDialTokenServersAllDown: when no server of the token admits the
// client, Dial fails within ConnectTimeout, naming each attempt in order.
func TestDialTokenServersAllDown(t *testing.T) {
	_, key, ccfg, _ := tokenServer(t, nil)
	down1, down2 := downAddr(t), downAddr(t)
	silent := loopbackSocket(t).LocalAddr().(*net.UDPAddr).AddrPort()
	ccfg.ConnectTimeout = time.Second
	ccfg.Token = issue(t, key, sampleToken(down1, silent, down2))
	start := time.Now()
	c, err := Dial(within(t, 10*time.Second), "udp", "", ccfg)
	took := time.Since(start)
	require.Error(t, err)
	require.Nil(t, c)
	var te *TokenDialError
	require.ErrorAs(t, err, &te)
	require.Len(t, te.Attempts, 3)
	for i, s := range []netip.AddrPort{down1, silent, down2} {
		assert.Equal(t, s, te.Attempts[i].Server)
		assert.Contains(t, err.Error(), s.String())
	}
	var timeout *TimeoutError
	require.ErrorAs(t, te.Attempts[1].Err, &timeout, "the silent server")
	// Its share: half of what the first attempt left of ConnectTimeout.
	assert.GreaterOrEqual(t, timeout.Silent, time.Second/3)
	assert.LessOrEqual(t, timeout.Silent, time.Second/2)
	assert.NotErrorAs(t, te.Attempts[0].Err, &timeout, "nothing listening: refused at once")
	assert.Less(t, took, 2*time.Second, "bounded by ConnectTimeout")
	t.Logf("failed in %v: %v", took.Round(time.Millisecond), err)

	// A context cancelled during an attempt stops them with its error.
	ccfg.ConnectTimeout = 10 * time.Second
	waiting := loopbackSocket(t)
	ccfg.Token = issue(t, key, sampleToken(waiting.LocalAddr().(*net.UDPAddr).AddrPort(), down1))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		// The first ConnectSyn at the first server: cancel then.
		waiting.SetReadDeadline(time.Now().Add(5 * time.Second))
		waiting.ReadFromUDPAddrPort(make([]byte, 2048))
		cancel()
	}()
	_, err = Dial(ctx, "udp", "", ccfg)
	require.ErrorIs(t, err, context.Canceled)

	// A ConnectPayload too large fails at once, not once per server;
	// bytes that are no token say so.
	ccfg.ConnectPayload = make([]byte, 1200)
	_, err = Dial(within(t, time.Second), "udp", "", ccfg)
	require.ErrorIs(t, err, ErrHandshakeTooLarge)
	require.NotErrorAs(t, err, &te)
	ccfg.ConnectPayload = nil
	ccfg.Token = []byte("not a token")
	_, err = Dial(within(t, time.Second), "udp", "", ccfg)
	require.ErrorIs(t, err, errNotToken)

	// No token, no address: as before, nowhere to go.
	ccfg.Token = nil
	_, err = Dial(within(t, time.Second), "udp", "", ccfg)
	require.ErrorContains(t, err, "no port")
}

// TestTokenServersTampered: the servers are in clear, but authenticated:
// a token whose list was rewritten to name this server (it named another)
// is refused as invalid, not admitted.
func TestTokenServersTampered(t *testing.T) {
	l, key, ccfg, admitted := tokenServer(t, nil)
	us := addrPort(t, l.Addr())
	elsewhere := netip.MustParseAddrPort("192.0.2.1:7000")
	b := issue(t, key, sampleToken(elsewhere))
	// The one entry of the list, rewritten.
	ip := us.Addr().As16()
	entry := b[tokenHeadSize+1 : tokenHeadSize+1+tokenAddrSize]
	copy(entry, ip[:])
	binary.LittleEndian.PutUint16(entry[16:], us.Port())
	got, err := TokenServers(b)
	require.NoError(t, err)
	require.Equal(t, []netip.AddrPort{us}, got, "the client reads the rewritten list")

	ccfg.Token = b
	for _, addr := range []string{"", us.String()} {
		_, err := dialErr(t, addr, ccfg)
		require.ErrorIs(t, err, ErrTokenRejected, "address %q", addr)
		assert.ErrorContains(t, err, "invalid", "address %q", addr)
	}
	assert.Equal(t, uint64(2), l.Stats().RejectedTokens)
	assert.Zero(t, admitted.Load())
}
