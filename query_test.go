package knet

import (
	"bytes"
	"context"
	"errors"
	"net"
	"net/netip"
	"os"
	"runtime"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/netsim"
)

// Query is Query(ctx, "udp", addr) on the network.
func (n *testNet) Query(ctx context.Context, addr string) ([]byte, time.Duration, error) {
	return queryWith(ctx, "udp", addr, n.options())
}

// discovered is a server Discover found.
type discovered struct {
	from netip.AddrPort
	info string
	rtt  time.Duration
}

// Discover is Discover(ctx, "udp", addr, ...) on the network, collecting
// what it finds.
func (n *testNet) Discover(ctx context.Context, addr string) ([]discovered, error) {
	var found []discovered
	err := discoverWith(ctx, "udp", addr, func(from netip.AddrPort, info []byte, rtt time.Duration) {
		found = append(found, discovered{from, string(info), rtt})
	}, n.options())
	return found, err
}

func testNonce(b byte) *[queryNonceSize]byte {
	var n [queryNonceSize]byte
	for i := range n {
		n[i] = b + byte(i)
	}
	return &n
}

func TestQueryDatagram(t *testing.T) {
	q := appendQueryDatagram(nil, queryKindQuery, testNonce(1), nil, queryPadTo)
	require.Len(t, q, queryPadTo)
	assert.Equal(t, "000000"+"ab04"+"05"+"6b4e6574"+"01"+"01"+"0102030405060708", hexString(q[:queryOverhead]))
	a := appendQueryDatagram(nil, queryKindAnswer, testNonce(1), []byte("de_dust2"), 0)
	assert.Equal(t, "000000"+"1700"+"05"+"6b4e6574"+"01"+"02"+"0102030405060708"+"64655f6475737432", hexString(a))
	full := appendQueryDatagram(nil, queryKindAnswer, testNonce(1), make([]byte, MaxQueryInfo), 0)
	assert.Len(t, full, queryPadTo, "the largest answer is as large as a query")

	// A spec receiver sees one unreliable datagram holding a message of
	// the reserved ID 5, and no ConnectSyn.
	d, _, err := parseDatagram(q)
	require.NoError(t, err)
	require.Len(t, d.msgs, 1)
	assert.Equal(t, uint32(idPadding), d.msgs[0].id)
	syn, valid := isConnectSyn(q)
	assert.True(t, valid)
	assert.False(t, syn)

	modify := func(b []byte, f func([]byte) []byte) []byte { return f(bytes.Clone(b)) }
	for _, tt := range []struct {
		name string
		b    []byte
		kind byte
		body string
	}{
		{"query", q, queryKindQuery, string(make([]byte, queryPadTo-queryOverhead))},
		{"answer", a, queryKindAnswer, "de_dust2"},
		{"empty answer", appendQueryDatagram(nil, queryKindAnswer, testNonce(1), nil, 0), queryKindAnswer, ""},
		{"MessageID in two bytes", append(append([]byte{0, 0, 0, 16, 0, 0x85, 0}, "kNet\x01\x02"...), testNonce(1)[:]...), queryKindAnswer, ""},
		{"PacketID", modify(a, func(b []byte) []byte { b[0] = 1; return b }), 0, ""},
		{"reliable", modify(a, func(b []byte) []byte { b[2] = 0x40; return b }), 0, ""},
		{"in order", modify(a, func(b []byte) []byte { b[2] = 0x80; return b }), 0, ""},
		{"another ID", modify(a, func(b []byte) []byte { b[5] = 6; return b }), 0, ""},
		{"magic", modify(a, func(b []byte) []byte { b[6] = 'K'; return b }), 0, ""},
		{"version 2", modify(a, func(b []byte) []byte { b[10] = 2; return b }), 0, ""},
		{"kind 3 (a reflection's ask)", modify(a, func(b []byte) []byte { b[11] = 3; return b }), reflectKindAsk, "de_dust2"},
		{"kind 5 (a punch probe)", modify(a, func(b []byte) []byte { b[11] = 5; return b }), punchKindProbe, "de_dust2"},
		{"kind 8 (an introduction)", modify(a, func(b []byte) []byte { b[11] = 8; return b }), introKindAnswer, "de_dust2"},
		{"kind 9 (a relay bind)", modify(a, func(b []byte) []byte { b[11] = 9; return b }), relayKindBind, "de_dust2"},
		{"kind 10 (a relay's answer)", modify(a, func(b []byte) []byte { b[11] = 10; return b }), relayKindBound, "de_dust2"},
		{"kind 11", modify(a, func(b []byte) []byte { b[11] = 11; return b }), 0, ""},
		{"kind 0", modify(a, func(b []byte) []byte { b[11] = 0; return b }), 0, ""},
		{"InOrder code", modify(a, func(b []byte) []byte { b[4] |= 1 << 3; return b }), 0, ""},
		{"fragment", modify(a, func(b []byte) []byte { b[4] |= 0x40; return b }), 0, ""},
		{"cut short", a[:len(a)-1], 0, ""},
		{"no nonce", a[:queryOverhead-1], 0, ""},
		{"a second message", append(bytes.Clone(a), 2, 0, 6, 0), 0, ""},
		{"nothing", nil, 0, ""},
	} {
		kind, nonce, body, ok := parseQueryDatagram(tt.b)
		if tt.kind == 0 {
			assert.False(t, ok, tt.name)
			continue
		}
		if assert.True(t, ok, tt.name) {
			assert.Equal(t, tt.kind, kind, tt.name)
			assert.Equal(t, *testNonce(1), nonce, tt.name)
			assert.Equal(t, tt.body, string(body), tt.name)
		}
	}
}

func hexString(b []byte) string {
	const digits = "0123456789abcdef"
	s := make([]byte, 0, 2*len(b))
	for _, c := range b {
		s = append(s, digits[c>>4], digits[c&15])
	}
	return string(s)
}

// FuzzQueryDatagram: whatever arrives, parsing never panics, what parses
// encodes back to itself, and the answer a listener would send is never
// larger than what came.
func FuzzQueryDatagram(f *testing.F) {
	f.Add(appendQueryDatagram(nil, queryKindQuery, testNonce(1), nil, queryPadTo))
	f.Add(appendQueryDatagram(nil, queryKindQuery, testNonce(1), nil, 0))
	f.Add(appendQueryDatagram(nil, queryKindAnswer, testNonce(7), []byte("name=knet;map=e1m1;players=3/16"), 0))
	f.Fuzz(func(t *testing.T, b []byte) {
		kind, nonce, body, ok := parseQueryDatagram(b)
		if !ok {
			return
		}
		if b[5] == idPadding { // not a longer encoding of the MessageID
			require.Equal(t, b, appendQueryDatagram(nil, kind, &nonce, body, 0))
		}
		if kind == queryKindQuery && len(b) >= queryPadTo {
			buf := make([]byte, 0, 4096)
			require.LessOrEqual(t, len(appendQueryDatagram(buf, queryKindAnswer, &nonce, make([]byte, MaxQueryInfo), 0)), len(b))
		}
	})
}

// TestQuery: a plaintext, a secure, a reference-dialect, a stealthy and a
// closed listener answer a query with their info, in one round trip, and
// no connection or handshake comes of it.
func TestQuery(t *testing.T) {
	priv, _, err := GenerateKey()
	require.NoError(t, err)
	for _, tt := range []struct {
		name   string
		cfg    *Config
		closed bool
	}{
		{"plain", &Config{}, false},
		{"secure", &Config{PrivateKey: priv, CookieThreshold: -1}, false},
		{"reference dialect", &Config{Dialect: DialectReference}, false},
		{"stealth, closed", &Config{Stealth: true}, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				nw := memNet(t)
				g := NewGroup()
				tt.cfg.Group = g
				l := nw.listen(t, tt.cfg)
				l.SetListenOpen(!tt.closed)
				nw.paths(l.Addr(), netsim.Params{Delay: 10 * time.Millisecond}, netsim.Params{Delay: 15 * time.Millisecond})
				require.NoError(t, l.SetQueryInfo([]byte("name=knet;map=e1m1;players=3/16")))
				info, rtt, err := nw.Query(context.Background(), l.Addr().String())
				require.NoError(t, err)
				assert.Equal(t, "name=knet;map=e1m1;players=3/16", string(info))
				assert.Equal(t, 25*time.Millisecond, rtt)
				synctest.Wait()
				st := l.Stats()
				assert.Equal(t, uint64(1), st.QueriesAnswered)
				assert.Zero(t, st.QueriesDropped)
				assert.Zero(t, st.Connections+st.Pending)
				assert.Zero(t, st.InvalidDatagrams+st.StrayDatagrams+st.IgnoredAttempts+st.RefusedAttempts)
				assert.Zero(t, st.KeyExchanges+st.CookiesSent)
				assert.Zero(t, g.Len(), "no connection")
			})
		})
	}
}

// A listener answers no query until it sets info, stops when it sets nil,
// and refuses info that no answer can carry. Query then times out.
func TestQueryInfoUnset(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		start := time.Now()
		_, _, err := nw.Query(context.Background(), l.Addr().String())
		var te *TimeoutError
		require.ErrorAs(t, err, &te)
		assert.ErrorIs(t, err, os.ErrDeadlineExceeded)
		assert.Equal(t, queryTimeout, time.Since(start))
		assert.Equal(t, uint64(queryMaxSends), l.Stats().QueriesDropped, "each resent query dropped")

		require.NoError(t, l.SetQueryInfo([]byte{}))
		info, _, err := nw.Query(context.Background(), l.Addr().String())
		require.NoError(t, err)
		assert.Empty(t, info)

		require.NoError(t, l.SetQueryInfo(nil))
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_, _, err = nw.Query(ctx, l.Addr().String())
		assert.ErrorIs(t, err, context.DeadlineExceeded, "the caller's deadline, first")
		assert.NotErrorAs(t, err, &te)

		assert.Error(t, l.SetQueryInfo(make([]byte, MaxQueryInfo+1)))
		require.NoError(t, l.SetQueryInfo(make([]byte, MaxQueryInfo)))
		info, _, err = nw.Query(context.Background(), l.Addr().String())
		require.NoError(t, err)
		assert.Len(t, info, MaxQueryInfo)
		assert.Equal(t, uint64(2), l.Stats().QueriesAnswered)
	})
}

// readAll reads what the socket has now, in a bubble where everything
// sent has arrived (synctest.Wait before): until a read waits a
// millisecond of the bubble's time in vain.
func readAll(t *testing.T, c rawConn) [][]byte {
	t.Helper()
	var got [][]byte
	for {
		c.SetReadDeadline(time.Now().Add(time.Millisecond))
		buf := make([]byte, 4096)
		n, err := c.Read(buf)
		if err != nil {
			require.ErrorIs(t, err, os.ErrDeadlineExceeded)
			c.SetReadDeadline(time.Time{})
			return got
		}
		got = append(got, buf[:n])
	}
}

// An answer is never larger than its query: a query not padded to 1200
// bytes gets none, even if the info would fit; a padded one gets an answer
// of at most its size.
func TestQueryAnswerNoLargerThanQuery(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		require.NoError(t, l.SetQueryInfo(make([]byte, MaxQueryInfo)))
		raw := nw.rawSocket(t, l.Addr())
		for _, size := range []int{0, 100, queryPadTo - 1} {
			_, err := raw.Write(appendQueryDatagram(nil, queryKindQuery, testNonce(1), nil, size))
			require.NoError(t, err)
		}
		synctest.Wait()
		assert.Empty(t, readAll(t, raw), "short queries get no answer")
		require.NoError(t, l.SetQueryInfo([]byte("x"))) // an answer of 21 bytes
		_, err := raw.Write(appendQueryDatagram(nil, queryKindQuery, testNonce(1), nil, 100))
		require.NoError(t, err)
		synctest.Wait()
		assert.Empty(t, readAll(t, raw), "short queries get no answer, even if the info would fit")
		assert.Equal(t, uint64(4), l.Stats().QueriesDropped)
		require.NoError(t, l.SetQueryInfo(make([]byte, MaxQueryInfo)))

		for _, size := range []int{queryPadTo, queryPadTo + 500} {
			_, err := raw.Write(appendQueryDatagram(nil, queryKindQuery, testNonce(2), nil, size))
			require.NoError(t, err)
		}
		synctest.Wait()
		got := readAll(t, raw)
		require.Len(t, got, 2)
		for _, a := range got {
			assert.Len(t, a, queryPadTo)
			kind, nonce, info, ok := parseQueryDatagram(a)
			require.True(t, ok)
			assert.Equal(t, byte(queryKindAnswer), kind)
			assert.Equal(t, *testNonce(2), nonce)
			assert.Len(t, info, MaxQueryInfo)
		}
		assert.Equal(t, uint64(2), l.Stats().QueriesAnswered)
	})
}

// A flood of queries gets a bounded number of answers, while an
// established connection goes on as before.
func TestQueryFloodRateLimited(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		serveEcho(t, l)
		require.NoError(t, l.SetQueryInfo([]byte("busy")))
		c := nw.dial(t, l.Addr().String(), testConfig())
		raw := nw.rawSocket(t, l.Addr())
		q := appendQueryDatagram(nil, queryKindQuery, testNonce(3), nil, queryPadTo)
		const flood = 900 // within the socket's queue: every one reaches the reader
		for i := range flood {
			_, err := raw.Write(q)
			require.NoError(t, err)
			if i == flood/2 { // the connection meanwhile
				require.NoError(t, c.Send(Message{ID: 100, Payload: []byte("still here"), Reliable: true}))
			}
		}
		m, err := c.Receive(within(t, time.Second))
		require.NoError(t, err)
		assert.Equal(t, "still here", string(m.Payload))
		synctest.Wait()
		assert.Len(t, readAll(t, raw), querySourceBurst, "one source's burst")
		st := l.Stats()
		assert.Equal(t, uint64(querySourceBurst), st.QueriesAnswered)
		assert.Equal(t, uint64(flood-querySourceBurst), st.QueriesDropped)
		assert.Equal(t, 1, st.Connections)

		time.Sleep(time.Second) // the bubble's clock: the bucket fills again
		for range 2 * querySourceRate {
			_, err := raw.Write(q)
			require.NoError(t, err)
		}
		synctest.Wait()
		assert.Len(t, readAll(t, raw), querySourceRate, "a second's worth")
		require.NoError(t, c.Send(Message{ID: 100, Payload: []byte("and now"), Reliable: true}))
		m, err = c.Receive(within(t, time.Second))
		require.NoError(t, err)
		assert.Equal(t, "and now", string(m.Payload))
	})
}

// The overall limit holds whatever the sources: answers to queries from
// many addresses at once stop at queryBurst, then go at queryRate.
func TestQueryLimiterOverall(t *testing.T) {
	var q queryState
	now := time.Now()
	allowed := 0
	for i := range 5000 {
		ip := netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)})
		if q.allow(ip, now) {
			allowed++
		}
	}
	assert.Equal(t, queryBurst, allowed)
	allowed = 0
	for i := range 5000 {
		ip := netip.AddrFrom4([4]byte{11, byte(i >> 16), byte(i >> 8), byte(i)})
		if q.allow(ip, now.Add(100*time.Millisecond)) {
			allowed++
		}
	}
	assert.Equal(t, queryRate/10, allowed)
	allowed = 0
	for range 100 {
		if q.allow(netip.MustParseAddr("2001:db8::1"), now.Add(10*time.Second)) {
			allowed++
		}
	}
	assert.Equal(t, querySourceBurst, allowed, "one source")
}

// fakeServer answers the queries that reach its socket with what answer
// makes of them, until the socket closes.
func fakeServer(t *testing.T, nw *testNet, answer func(nonce *[queryNonceSize]byte) [][]byte) net.Addr {
	s, err := nw.mem.Listen(netip.MustParseAddrPort("127.0.0.9:7000"))
	require.NoError(t, err)
	var wg sync.WaitGroup
	t.Cleanup(func() { s.Close(); wg.Wait() })
	wg.Go(func() {
		buf := make([]byte, 4096)
		for {
			n, from, err := s.ReadFrom(buf)
			if err != nil {
				return
			}
			kind, nonce, _, ok := parseQueryDatagram(buf[:n])
			if !ok || kind != queryKindQuery {
				continue
			}
			for _, a := range answer(&nonce) {
				s.WriteTo(a, from)
			}
		}
	})
	return s.LocalAddr()
}

// Query takes only an answer echoing its nonce: not one with another
// nonce, nor a query, nor one larger than a query, nor the reference's
// opening datagram.
func TestQuerySpoofedAnswerIgnored(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		addr := fakeServer(t, nw, func(nonce *[queryNonceSize]byte) [][]byte {
			other := *nonce
			other[0] ^= 1
			return [][]byte{
				appendQueryDatagram(nil, queryKindAnswer, &other, []byte("spoofed"), 0),
				appendQueryDatagram(nil, queryKindQuery, nonce, []byte("a query"), 0),
				appendQueryDatagram(nil, queryKindAnswer, nonce, make([]byte, MaxQueryInfo+1), 0),
				{0x81, 0, 0, 2, 0x20, 1, 1, 2, 0x20, 1, 2}, // a reference server's two PingRequests
				appendQueryDatagram(nil, queryKindAnswer, nonce, []byte("real"), 0),
			}
		})
		info, _, err := nw.Query(context.Background(), addr.String())
		require.NoError(t, err)
		assert.Equal(t, "real", string(info))
	})
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		addr := fakeServer(t, nw, func(nonce *[queryNonceSize]byte) [][]byte {
			other := *nonce
			other[7] ^= 0x80
			return [][]byte{appendQueryDatagram(nil, queryKindAnswer, &other, []byte("spoofed"), 0)}
		})
		_, _, err := nw.Query(context.Background(), addr.String())
		var te *TimeoutError
		assert.ErrorAs(t, err, &te, "only spoofed answers: no answer")
	})
}

// A lost query is sent again, with a nonce of its own: the round trip is
// that of the query answered.
func TestQueryResent(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		var mu sync.Mutex
		var nonces [][queryNonceSize]byte
		addr := fakeServer(t, nw, func(nonce *[queryNonceSize]byte) [][]byte {
			mu.Lock()
			defer mu.Unlock()
			nonces = append(nonces, *nonce)
			if len(nonces) < 3 {
				return nil // lost
			}
			return [][]byte{appendQueryDatagram(nil, queryKindAnswer, nonce, []byte("third"), 0)}
		})
		start := time.Now()
		info, rtt, err := nw.Query(context.Background(), addr.String())
		require.NoError(t, err)
		assert.Equal(t, "third", string(info))
		assert.Zero(t, rtt)
		assert.Equal(t, queryFirstResend*3, time.Since(start), "sent at 0, 250ms, 750ms")
		assert.Len(t, nonces, 3)
		assert.NotEqual(t, nonces[0], nonces[1])
	})
}

// Query to a port where nothing listens fails fast, as Dial does.
func TestQueryPortUnreachable(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		_, _, err := nw.Query(context.Background(), "127.0.0.1:9")
		assert.ErrorIs(t, err, ErrPortUnreachable)
	})
}

// Malformed and look-alike datagrams from unknown addresses are dropped
// and counted as before, never answered, never a connection.
func TestQueryMalformedDropped(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		require.NoError(t, l.SetQueryInfo([]byte("x")))
		raw := nw.rawSocket(t, l.Addr())
		q := appendQueryDatagram(nil, queryKindQuery, testNonce(4), nil, queryPadTo)
		bad := [][]byte{
			q[:queryPadTo-1],  // ContentLength past the end: malformed
			q[:queryOverhead], // likewise
			{0, 0, 0, 0xab},   // a message header cut short
		}
		stray := [][]byte{
			appendQueryDatagram(nil, queryKindAnswer, testNonce(4), nil, queryPadTo), // an answer
			append(bytes.Clone(q[:10]), append([]byte{2}, q[11:]...)...),             // version 2
			append(bytes.Clone(q[:11]), append([]byte{9}, q[12:]...)...),             // kind 9
		}
		for _, b := range append(bad, stray...) {
			_, err := raw.Write(b)
			require.NoError(t, err)
		}
		synctest.Wait()
		assert.Empty(t, readAll(t, raw))
		st := l.Stats()
		assert.Equal(t, uint64(len(bad)), st.InvalidDatagrams)
		assert.Equal(t, uint64(len(stray)), st.StrayDatagrams)
		assert.Zero(t, st.QueriesAnswered+st.QueriesDropped)
		assert.Zero(t, st.Connections)
	})
}

// Discover finds every server answering at the broadcast address's port,
// each once, though it sends its query three times: here on a network in
// memory whose 255.255.255.255 reaches every socket at the port.
func TestDiscover(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		listenAt := func(addr, info string) *Listener {
			l, err := listenWith("udp", addr, testConfig(), nw.options())
			require.NoError(t, err)
			t.Cleanup(func() { l.Close() })
			if info != "" {
				require.NoError(t, l.SetQueryInfo([]byte(info)))
			}
			return l
		}
		listenAt("10.0.0.1:7000", "one")
		listenAt("10.0.0.2:7000", "two")
		far := listenAt("10.0.0.3:7000", "three")
		silent := listenAt("10.0.0.4:7000", "")
		listenAt("10.0.0.5:7001", "another port")
		nw.paths(far.Addr(), netsim.Params{}, netsim.Params{Delay: 30 * time.Millisecond})
		start := time.Now()
		found, err := nw.Discover(within(t, 2*time.Second), "255.255.255.255:7000")
		require.NoError(t, err)
		assert.Equal(t, 2*time.Second, time.Since(start), "until ctx is done")
		assert.ElementsMatch(t, []discovered{
			{netip.MustParseAddrPort("10.0.0.1:7000"), "one", 0},
			{netip.MustParseAddrPort("10.0.0.2:7000"), "two", 0},
			{netip.MustParseAddrPort("10.0.0.3:7000"), "three", 30 * time.Millisecond},
		}, found)
		assert.Equal(t, uint64(discoverSends), far.Stats().QueriesAnswered)
		assert.Equal(t, uint64(discoverSends), silent.Stats().QueriesDropped)
	})
}

// Over real loopback: Query to a plaintext and a secure listener, and
// Discover by broadcast to 127.255.255.255, which Linux delivers to a
// socket bound to 0.0.0.0.
func TestQueryLoopback(t *testing.T) {
	priv, _, err := GenerateKey()
	require.NoError(t, err)
	for _, cfg := range []*Config{testConfig(), {PrivateKey: priv}} {
		l := listen(t, cfg)
		require.NoError(t, l.SetQueryInfo([]byte("loopback")))
		info, rtt, err := Query(within(t, 5*time.Second), "udp", l.Addr().String())
		require.NoError(t, err)
		assert.Equal(t, "loopback", string(info))
		assert.Positive(t, rtt)
		assert.Less(t, rtt, time.Second)
	}
}

func TestDiscoverLoopbackBroadcast(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("broadcast on loopback (127.255.255.255) is Linux's")
	}
	l, err := Listen("udp4", "0.0.0.0:0", testConfig())
	require.NoError(t, err)
	defer l.Close()
	require.NoError(t, l.SetQueryInfo([]byte("on the LAN")))
	port := l.Addr().(*net.UDPAddr).Port
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var found []discovered
	err = Discover(ctx, "udp4", netip.AddrPortFrom(netip.MustParseAddr("127.255.255.255"), uint16(port)).String(),
		func(from netip.AddrPort, info []byte, rtt time.Duration) {
			found = append(found, discovered{from, string(info), rtt})
			cancel() // one is all there is
		})
	if errors.Is(err, os.ErrPermission) {
		t.Skip("the system refuses to broadcast on loopback:", err)
	}
	require.NoError(t, err)
	require.Len(t, found, 1, "no answer by broadcast on loopback within 5s")
	assert.Equal(t, uint16(port), found[0].from.Port())
	assert.Equal(t, "on the LAN", found[0].info)
}

// What the reader does with each query allocates nothing: a flood of them
// costs no garbage.
func TestQueryAnswerAllocs(t *testing.T) {
	var q queryState
	q.allow(netip.MustParseAddr("10.0.0.1"), time.Now()) // the table, made once
	query := appendQueryDatagram(nil, queryKindQuery, testNonce(5), nil, queryPadTo)
	info := []byte("name=knet")
	buf := make([]byte, 0, 2048)
	ip := netip.MustParseAddr("10.0.0.2")
	now := time.Now()
	require.Zero(t, testing.AllocsPerRun(100, func() {
		kind, nonce, _, ok := parseQueryDatagram(query)
		if ok && kind == queryKindQuery && q.allow(ip, now) {
			buf = appendQueryDatagram(buf[:0], queryKindAnswer, &nonce, info, 0)
		}
	}))
}
