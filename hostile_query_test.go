package knet

import (
	"context"
	"fmt"
	"net/netip"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/netsim"
)

// Hostile server queries (query.go).

func TestHostileQueryOnEstablishedConnection(t *testing.T) {
	// A query from an established connection's own address goes to the
	// connection, not to the query code: it is answered by nothing, and
	// the connection, whatever its dialect and in clear or sealed, goes
	// on as before.
	q := appendQueryDatagram(nil, queryKindQuery, testNonce(9), nil, queryPadTo)
	for _, tc := range []struct {
		name string
		pair func() *simPair
	}{
		{"spec", func() *simPair { return newSimPair(t, nil, nil, netsim.Params{}, netsim.Params{}) }},
		{"reference", func() *simPair { return newSimPairIn(t, DialectReference, nil, nil, netsim.Params{}, netsim.Params{}) }},
		{"secure", func() *simPair { return newSecureSimPair(t, nil, nil, netsim.Params{}, netsim.Params{}) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := tc.pair()
			p.connect()
			for i := range 3 {
				p.send(0, Message{ID: 100, Payload: []byte{byte(i)}, Reliable: true, InOrder: true})
				require.True(t, p.run(time.Second, func() bool { return len(p.h[1].msgs) == i+1 }))
				for range 3 {
					p.inject(1, q)
					p.inject(0, q)
				}
			}
			require.True(t, p.run(time.Second, func() bool { return p.client().loss.sent.count == 0 }))
			assert.Equal(t, stateOK, p.server().state, "%v", p.server().err)
			assert.Equal(t, stateOK, p.client().state, "%v", p.client().err)
			assert.Zero(t, p.server().stats.ProtocolErrors)
			assert.Len(t, p.h[1].msgs, 3, "nothing delivered for the queries")
		})
	}
}

func TestHostileQuerySecureListenerSizes(t *testing.T) {
	// A secure listener, reading datagrams up to MaxPathDatagramSize plus
	// sealing's overhead: at every size around the padding and up to
	// the largest it reads, an answer is never larger than its query,
	// and the queries it cannot read get none.
	synctest.Test(t, func(t *testing.T) {
		priv, _, err := GenerateKey()
		require.NoError(t, err)
		nw := memNet(t)
		cfg := testConfig()
		cfg.PrivateKey = priv
		cfg.MaxPathDatagramSize = 9000
		cfg.Stealth = true
		l := nw.listen(t, cfg)
		require.NoError(t, l.SetQueryInfo(make([]byte, MaxQueryInfo)))
		raw := nw.rawSocket(t, l.Addr())
		read := cfg.resolve().readSize()
		sizes := []int{queryOverhead, queryPadTo - 1, queryPadTo, queryPadTo + 1, 2048, 2049, 2052, 2053, read - 1, read, read + 1, 65507}
		answered := 0
		for i, size := range sizes {
			q := appendQueryDatagram(nil, queryKindQuery, testNonce(byte(i)), nil, size)
			_, err := raw.Write(q)
			require.NoError(t, err)
			synctest.Wait()
			got := readAll(t, raw)
			// One message block carries at most 2047 bytes: a larger
			// query is no query.
			_, _, _, isQuery := parseQueryDatagram(q)
			if size < queryPadTo || size > read || !isQuery {
				assert.Empty(t, got, "size %d", size)
				continue
			}
			require.Len(t, got, 1, "size %d", size)
			assert.LessOrEqual(t, len(got[0]), size)
			_, nonce, info, ok := parseQueryDatagram(got[0])
			require.True(t, ok)
			assert.Equal(t, *testNonce(byte(i)), nonce)
			assert.Len(t, info, MaxQueryInfo)
			answered++
		}
		assert.Equal(t, uint64(answered), l.Stats().QueriesAnswered)
		assert.Zero(t, l.Stats().Connections)
	})
}

func TestHostileDiscoverFloodBounded(t *testing.T) {
	// Someone who sees Discover's broadcast answers it, echoing its
	// nonce, from more addresses than Discover reports: it reports
	// maxDiscovered servers, each once, and returns when its ctx is done.
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		const fakes = maxDiscovered + 100
		var socks []*netsim.Socket
		for i := range fakes {
			s, err := nw.mem.Listen(netip.MustParseAddrPort(fmt.Sprintf("10.1.%d.%d:7000", i/250, i%250+1)))
			require.NoError(t, err)
			t.Cleanup(func() { s.Close() })
			socks = append(socks, s)
		}
		var wg sync.WaitGroup
		t.Cleanup(func() { socks[0].Close(); wg.Wait() })
		wg.Go(func() {
			buf := make([]byte, 4096)
			for {
				n, from, err := socks[0].ReadFrom(buf)
				if err != nil {
					return
				}
				kind, nonce, _, ok := parseQueryDatagram(buf[:n])
				if !ok || kind != queryKindQuery {
					continue
				}
				a := appendQueryDatagram(nil, queryKindAnswer, &nonce, []byte("fake"), 0)
				for _, s := range socks {
					s.WriteTo(a, from)
				}
			}
		})
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		seen := map[netip.AddrPort]int{}
		calls := 0
		err := discoverWith(ctx, "udp", "255.255.255.255:7000", func(from netip.AddrPort, info []byte, _ time.Duration) {
			calls++
			seen[from]++
			assert.Equal(t, "fake", string(info))
		}, nw.options())
		require.NoError(t, err)
		assert.Equal(t, maxDiscovered, calls)
		assert.Len(t, seen, maxDiscovered, "each once")
	})
}

func TestHostileQueryDuringCookies(t *testing.T) {
	// A secure listener asking every attempt for a cookie (a Retry)
	// answers queries as before, and a query costs it no Retry, no key
	// exchange and no connection.
	synctest.Test(t, func(t *testing.T) {
		priv, _, err := GenerateKey()
		require.NoError(t, err)
		nw := memNet(t)
		cfg := testConfig()
		cfg.PrivateKey = priv
		cfg.CookieThreshold = -1
		l := nw.listen(t, cfg)
		require.NoError(t, l.SetQueryInfo([]byte("busy")))
		info, _, err := nw.Query(context.Background(), l.Addr().String())
		require.NoError(t, err)
		assert.Equal(t, "busy", string(info))
		synctest.Wait() // the answer may reach us before the listener counts it
		st := l.Stats()
		assert.Equal(t, uint64(1), st.QueriesAnswered)
		assert.Zero(t, st.CookiesSent)
		assert.Zero(t, st.KeyExchanges)
		assert.Zero(t, st.Connections+st.Pending)
	})
}
