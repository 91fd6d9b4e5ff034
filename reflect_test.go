package knet

import (
	"bytes"
	"context"
	"net"
	"net/netip"
	"os"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/netsim"
)

type netsimSocket = netsim.Socket

// Reflect is Reflect(ctx, "udp", addr) on the network.
func (n *testNet) Reflect(ctx context.Context, addr string) (netip.AddrPort, error) {
	return reflectWith(ctx, "udp", addr, n.options())
}

func TestReflectDatagram(t *testing.T) {
	ask := appendQueryDatagram(nil, reflectKindAsk, testNonce(1), nil, queryPadTo)
	require.Len(t, ask, queryPadTo)
	assert.Equal(t, "000000"+"ab04"+"05"+"6b4e6574"+"01"+"03"+"0102030405060708", hexString(ask[:queryOverhead]))

	v4 := netip.MustParseAddrPort("203.0.113.11:40000") // cb 00 71 0b, 9c 40
	a := appendQueryDatagram(nil, reflectKindAnswer, testNonce(1), appendReflectBody(nil, testNonce(1), v4), 0)
	assert.Equal(t, "000000"+"1600"+"05"+"6b4e6574"+"01"+"04"+"0102030405060708"+
		"04"+"ca0272"+"0f"+"9946", hexString(a), "the address and port XORed with the nonce")
	assert.Len(t, a, 27)
	assert.NotContains(t, string(a), string([]byte{203, 0, 113, 11}), "no address in clear for a gateway to rewrite")
	kind, nonce, body, ok := parseQueryDatagram(a)
	require.True(t, ok)
	assert.Equal(t, byte(reflectKindAnswer), kind)
	got, ok := parseReflectBody(body, &nonce)
	require.True(t, ok)
	assert.Equal(t, v4, got)

	v6 := netip.MustParseAddrPort("[2001:db8::7]:443")
	a6 := appendQueryDatagram(nil, reflectKindAnswer, testNonce(1), appendReflectBody(nil, testNonce(1), v6), 0)
	assert.Len(t, a6, 39)
	_, nonce, body, _ = parseQueryDatagram(a6)
	got, ok = parseReflectBody(body, &nonce)
	require.True(t, ok)
	assert.Equal(t, v6, got)
	mapped := netip.AddrPortFrom(netip.MustParseAddr("::ffff:192.0.2.1"), 9)
	got, ok = parseReflectBody(appendReflectBody(nil, testNonce(1), mapped), testNonce(1))
	require.True(t, ok)
	assert.Equal(t, netip.MustParseAddrPort("192.0.2.1:9"), got, "an IPv4 address in IPv6 goes as IPv4")

	b4 := appendReflectBody(nil, testNonce(1), v4)
	b6 := appendReflectBody(nil, testNonce(1), v6)
	for name, b := range map[string][]byte{
		"empty":          nil,
		"cut short":      b4[:len(b4)-1],
		"a byte more":    append(bytes.Clone(b4), 0),
		"IPv6 cut short": b6[:len(b6)-1],
		"family 5":       append([]byte{5}, b4[1:]...),
		"family 6, 4":    append([]byte{6}, b4[1:]...),
		"too long":       make([]byte, 64),
	} {
		_, ok := parseReflectBody(b, testNonce(1))
		assert.False(t, ok, name)
	}
}

// Over the system's loopback: a Listener learns its own socket's address
// from another Listener, plaintext or secure; Reflect learns its new
// socket's.
func TestReflectLoopback(t *testing.T) {
	priv, _, err := GenerateKey()
	require.NoError(t, err)
	for _, cfg := range []*Config{testConfig(), {PrivateKey: priv}} {
		server := listen(t, cfg)
		host := listen(t, testConfig())
		got, err := host.Reflect(within(t, 5*time.Second), server.Addr().String())
		require.NoError(t, err)
		assert.Equal(t, host.Addr().(*net.UDPAddr).AddrPort(), got, "the host's own socket, as the server sees it")

		got, err = Reflect(within(t, 5*time.Second), "udp", server.Addr().String())
		require.NoError(t, err)
		assert.Equal(t, netip.MustParseAddr("127.0.0.1"), got.Addr())
		assert.NotZero(t, got.Port())
		assert.NotEqual(t, host.Addr().(*net.UDPAddr).AddrPort(), got, "a socket of its own")

		st := server.Stats()
		assert.Equal(t, uint64(2), st.ReflectionsAnswered)
		assert.Zero(t, st.ReflectionsDropped+st.QueriesAnswered+st.QueriesDropped)
		assert.Zero(t, st.Connections+st.Pending)
		assert.Zero(t, st.KeyExchanges)
		assert.Zero(t, host.Stats().StrayDatagrams, "the host took its answer")
	}
}

// Reflect (a socket of its own) learns exactly the address of its
// socket, with a round trip of the network in memory.
func TestReflectOwnSocket(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		server := nw.listen(t, testConfig())
		var local netip.AddrPort
		nw.wrapDial = func(s socket) socket {
			local = s.LocalAddr().(*net.UDPAddr).AddrPort()
			return s
		}
		got, err := nw.Reflect(context.Background(), server.Addr().String())
		require.NoError(t, err)
		assert.True(t, local.IsValid())
		assert.Equal(t, local, got)
	})
}

// An answer is never larger than its ask: an ask not padded to 1200
// bytes gets none; a padded one, 27 bytes (an IPv4 address).
func TestReflectAnswerNoLargerThanAsk(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		raw := nw.rawSocket(t, l.Addr())
		for _, size := range []int{0, 100, queryPadTo - 1} {
			_, err := raw.Write(appendQueryDatagram(nil, reflectKindAsk, testNonce(1), nil, size))
			require.NoError(t, err)
		}
		synctest.Wait()
		assert.Empty(t, readAll(t, raw), "short asks get no answer")
		assert.Equal(t, uint64(3), l.Stats().ReflectionsDropped)

		for _, size := range []int{queryPadTo, queryPadTo + 500} {
			_, err := raw.Write(appendQueryDatagram(nil, reflectKindAsk, testNonce(2), nil, size))
			require.NoError(t, err)
		}
		synctest.Wait()
		got := readAll(t, raw)
		require.Len(t, got, 2)
		for _, a := range got {
			assert.Len(t, a, 27)
			kind, nonce, body, ok := parseQueryDatagram(a)
			require.True(t, ok)
			assert.Equal(t, byte(reflectKindAnswer), kind)
			assert.Equal(t, *testNonce(2), nonce)
			seen, ok := parseReflectBody(body, &nonce)
			require.True(t, ok)
			assert.Equal(t, raw.LocalAddr().(*net.UDPAddr).AddrPort(), seen)
		}
		st := l.Stats()
		assert.Equal(t, uint64(2), st.ReflectionsAnswered)
		assert.Zero(t, st.Connections+st.Pending)
		assert.Zero(t, st.InvalidDatagrams+st.StrayDatagrams)
	})
}

// The attacker's view: asks from one source (its own address, or a
// victim's it spoofs) get one source's burst of answers, each smaller
// than the ask, and then one a rate; they share the bucket with server
// queries. A Stealth listener answers none.
func TestReflectFloodRateLimited(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		require.NoError(t, l.SetQueryInfo([]byte("info")))
		raw := nw.rawSocket(t, l.Addr())
		ask := appendQueryDatagram(nil, reflectKindAsk, testNonce(3), nil, queryPadTo)
		const flood = 500
		for range flood {
			_, err := raw.Write(ask)
			require.NoError(t, err)
		}
		synctest.Wait()
		got := readAll(t, raw)
		assert.Len(t, got, querySourceBurst, "one source's burst")
		out := 0
		for _, a := range got {
			out += len(a)
		}
		assert.LessOrEqual(t, out*40, flood*len(ask), "at most a fortieth of the bytes sent")
		st := l.Stats()
		assert.Equal(t, uint64(querySourceBurst), st.ReflectionsAnswered)
		assert.Equal(t, uint64(flood-querySourceBurst), st.ReflectionsDropped)

		// The queries' bucket is the same, and empty.
		_, err := raw.Write(appendQueryDatagram(nil, queryKindQuery, testNonce(4), nil, queryPadTo))
		require.NoError(t, err)
		synctest.Wait()
		assert.Empty(t, readAll(t, raw), "a query from the same source, over the shared rate")
		assert.Equal(t, uint64(1), l.Stats().QueriesDropped)

		time.Sleep(time.Second) // the bubble's clock: the bucket fills again
		for range 2 * querySourceRate {
			_, err := raw.Write(ask)
			require.NoError(t, err)
		}
		synctest.Wait()
		assert.Len(t, readAll(t, raw), querySourceRate, "a second's worth")
	})
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		cfg := testConfig()
		cfg.Stealth = true
		l := nw.listen(t, cfg)
		raw := nw.rawSocket(t, l.Addr())
		_, err := raw.Write(appendQueryDatagram(nil, reflectKindAsk, testNonce(3), nil, queryPadTo))
		require.NoError(t, err)
		synctest.Wait()
		assert.Empty(t, readAll(t, raw), "Stealth: no reflection")
		assert.Equal(t, uint64(1), l.Stats().ReflectionsDropped)
	})
}

// fakeReflector answers the asks reaching its socket at addr with what
// answer makes of them; others, sockets on the same host, may send them
// too.
func fakeReflector(t *testing.T, nw *testNet, answer func(nonce *[queryNonceSize]byte, to netip.AddrPort, others []*netsimSocket)) netip.AddrPort {
	addr := netip.MustParseAddrPort("127.0.0.9:7000")
	s, err := nw.mem.Listen(addr)
	require.NoError(t, err)
	other, err := nw.mem.Listen(netip.MustParseAddrPort("127.0.0.9:7001"))
	require.NoError(t, err)
	var wg sync.WaitGroup
	t.Cleanup(func() { s.Close(); other.Close(); wg.Wait() })
	wg.Go(func() {
		buf := make([]byte, 4096)
		for {
			n, from, err := s.ReadFrom(buf)
			if err != nil {
				return
			}
			kind, nonce, _, ok := parseQueryDatagram(buf[:n])
			if ok && kind == reflectKindAsk {
				answer(&nonce, from, []*netsimSocket{s, other})
			}
		}
	})
	return addr
}

// An asker takes only an answer echoing its nonce, well formed, from the
// server it asked: forged and truncated answers are ignored, whether the
// asker is a Listener or Reflect's socket.
func TestReflectForgedAnswerIgnored(t *testing.T) {
	real := netip.MustParseAddrPort("192.0.2.7:4242")
	forged := netip.MustParseAddrPort("198.51.100.66:666")
	answer := func(nonce *[queryNonceSize]byte, to netip.AddrPort, s []*netsimSocket) {
		other := *nonce
		other[0] ^= 1
		good := appendQueryDatagram(nil, reflectKindAnswer, nonce, appendReflectBody(nil, nonce, real), 0)
		bad := appendQueryDatagram(nil, reflectKindAnswer, nonce, appendReflectBody(nil, nonce, forged), 0)
		for _, d := range [][]byte{
			appendQueryDatagram(nil, reflectKindAnswer, &other, appendReflectBody(nil, &other, forged), 0), // another nonce
			bad[:len(bad)-1], // truncated
			appendQueryDatagram(nil, reflectKindAnswer, nonce, append(appendReflectBody(nil, nonce, forged), 0), 0), // a byte more
			appendQueryDatagram(nil, queryKindAnswer, nonce, appendReflectBody(nil, nonce, forged), 0),              // a query's answer
			appendQueryDatagram(nil, reflectKindAsk, nonce, appendReflectBody(nil, nonce, forged), 0),               // an ask
		} {
			s[0].WriteTo(d, to)
		}
		s[1].WriteTo(bad, to) // the nonce, from another port of the server's host
		s[0].WriteTo(good, to)
	}
	for _, asker := range []string{"Listener", "Reflect"} {
		t.Run(asker, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				nw := memNet(t)
				server := fakeReflector(t, nw, answer)
				var got netip.AddrPort
				var err error
				if asker == "Listener" {
					host := nw.listen(t, testConfig())
					got, err = host.Reflect(context.Background(), server.String())
					synctest.Wait()
					st := host.Stats()
					assert.Equal(t, uint64(4), st.StrayDatagrams, "answers to no ask of the host's, or not from the server: stray")
					assert.Equal(t, uint64(1), st.InvalidDatagrams, "the truncated one")
					assert.Equal(t, uint64(1), st.ReflectionsDropped, "the ask (a Listener reflects), unpadded")
				} else {
					got, err = nw.Reflect(context.Background(), server.String())
				}
				require.NoError(t, err)
				assert.Equal(t, real, got)
			})
		})
	}
}

// With no answer, or only forged ones, a Reflect gives up after its
// timeout, naming the server, having asked five times; the caller's ctx
// ends it first if sooner; a Listener's, its Close.
func TestReflectTimeout(t *testing.T) {
	for _, asker := range []string{"Listener", "Reflect"} {
		t.Run(asker, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				nw := memNet(t)
				var mu sync.Mutex
				asks := 0
				server := fakeReflector(t, nw, func(nonce *[queryNonceSize]byte, to netip.AddrPort, s []*netsimSocket) {
					mu.Lock()
					asks++
					mu.Unlock()
					other := *nonce
					other[7] ^= 0x80
					s[0].WriteTo(appendQueryDatagram(nil, reflectKindAnswer, &other, appendReflectBody(nil, &other, to), 0), to)
				})
				reflect := nw.Reflect
				var host *Listener
				if asker == "Listener" {
					host = nw.listen(t, testConfig())
					reflect = host.Reflect
				}
				start := time.Now()
				_, err := reflect(context.Background(), server.String())
				var te *TimeoutError
				require.ErrorAs(t, err, &te)
				assert.Equal(t, "reflect", te.Op)
				assert.ErrorIs(t, err, os.ErrDeadlineExceeded)
				assert.Contains(t, err.Error(), server.String())
				assert.Contains(t, err.Error(), "no answer from the reflector")
				assert.Equal(t, queryTimeout, time.Since(start))
				synctest.Wait()
				mu.Lock()
				assert.Equal(t, queryMaxSends, asks)
				mu.Unlock()

				ctx, cancel := context.WithTimeout(context.Background(), time.Second)
				defer cancel()
				_, err = reflect(ctx, server.String())
				assert.ErrorIs(t, err, context.DeadlineExceeded, "the caller's deadline, first")
				assert.NotErrorAs(t, err, &te)

				if host != nil {
					assert.Zero(t, host.reflect.waiting.Load(), "no ask left waiting")
					done := make(chan error, 1)
					go func() {
						_, err := host.Reflect(context.Background(), server.String())
						done <- err
					}()
					synctest.Wait()
					host.Close()
					assert.ErrorIs(t, <-done, net.ErrClosed)
					_, err = host.Reflect(context.Background(), server.String())
					assert.ErrorIs(t, err, net.ErrClosed, "closed before")
				}
			})
		})
	}
}

// Answering an ask allocates nothing: the reader does it inline.
func TestReflectAnswerNoAllocs(t *testing.T) {
	ask := appendQueryDatagram(nil, reflectKindAsk, testNonce(5), nil, queryPadTo)
	buf := make([]byte, 0, 2048)
	from := netip.MustParseAddrPort("[2001:db8::2]:40000")
	require.Zero(t, testing.AllocsPerRun(100, func() {
		kind, nonce, _, ok := parseQueryDatagram(ask)
		if ok && kind == reflectKindAsk {
			var body [reflectMaxBody]byte
			buf = appendQueryDatagram(buf[:0], reflectKindAnswer, &nonce, appendReflectBody(body[:0], &nonce, from), 0)
		}
	}))
	assert.Len(t, buf, 39)
}
