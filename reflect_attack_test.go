package knet

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/netsim"
)

// Attacks on address reflection (reflect.go, query.go answerQuery,
// admission.go answerUnconnected).

// A reflection ask (and an answer) from the address of an established
// connection, plaintext or secure, goes to the connection, which ignores
// it: nothing is reflected (neither answered nor counted dropped), the
// connection goes on, and a message after it is delivered.
func TestReflectAttackAskFromConnectedAddress(t *testing.T) {
	for _, secure := range []bool{false, true} {
		t.Run(fmt.Sprintf("secure=%v", secure), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				nw := memNet(t)
				v := peerConnect(t, nw, peerSides[0], secure, *testConfig(), netsim.Params{}, netsim.Params{}, 0)
				synctest.Wait()
				ask := appendQueryDatagram(nil, reflectKindAsk, testNonce(7), nil, queryPadTo)
				answer := appendQueryDatagram(nil, reflectKindAnswer, testNonce(7), appendReflectBody(nil, testNonce(7), netip.MustParseAddrPort("198.51.100.1:1")), 0)
				for range 5 {
					v.e.writeRaw(ask)
					v.e.writeRaw(answer)
				}
				synctest.Wait()
				st := v.l.Stats()
				assert.Zero(t, st.ReflectionsAnswered, "an ask from a connection's address is the connection's")
				assert.Zero(t, st.ReflectionsDropped)
				assert.Equal(t, 1, st.Connections)
				require.NoError(t, v.c.Err())
				v.e.send(true, header{}, message{id: 100, payload: []byte("after")})
				m, err := v.c.Receive(within(t, 5*time.Second))
				require.NoError(t, err)
				assert.Equal(t, "after", string(m.Payload))
				assert.Zero(t, v.c.Stats().ProtocolErrors)
			})
		})
	}
}

// A Listener's Reflect takes no replay of an answer to an earlier ask
// (its nonce is forgotten once that Reflect returned), and an answer
// coming after its Reflect returned is stray: no wait is left behind.
func TestReflectAttackReplayedAnswer(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		real := netip.MustParseAddrPort("192.0.2.7:4242")
		forged := netip.MustParseAddrPort("198.51.100.66:666")
		var first []byte // the answer to the first ask, as it went
		var old [queryNonceSize]byte
		asks := 0
		var from *netsimSocket
		server := fakeReflector(t, nw, func(nonce *[queryNonceSize]byte, to netip.AddrPort, s []*netsimSocket) {
			asks++
			from = s[0]
			if first == nil {
				old = *nonce
				first = appendQueryDatagram(nil, reflectKindAnswer, nonce, appendReflectBody(nil, nonce, real), 0)
				s[0].WriteTo(first, to)
				return
			}
			// Replayed, and replayed with the old nonce and a forged
			// address: neither is an answer to this ask.
			s[0].WriteTo(first, to)
			s[0].WriteTo(appendQueryDatagram(nil, reflectKindAnswer, &old, appendReflectBody(nil, &old, forged), 0), to)
		})
		host := nw.listen(t, testConfig())
		got, err := host.Reflect(context.Background(), server.String())
		require.NoError(t, err)
		assert.Equal(t, real, got)
		host.reflect.mu.Lock()
		assert.Empty(t, host.reflect.waits, "no wait left after Reflect returned")
		host.reflect.mu.Unlock()
		from.WriteTo(first, addrOf(host.Addr())) // a copy, after Reflect returned
		synctest.Wait()
		assert.Equal(t, uint64(1), host.Stats().StrayDatagrams, "the copy came after Reflect returned")

		_, err = host.Reflect(context.Background(), server.String())
		var te *TimeoutError
		require.ErrorAs(t, err, &te, "replays of an earlier answer are not taken")
		assert.Equal(t, 1+queryMaxSends, asks)
		host.reflect.mu.Lock()
		assert.Empty(t, host.reflect.waits)
		host.reflect.mu.Unlock()
	})
}

// Over IPv6 the answer is 39 bytes, still far below the 1200-byte ask,
// and tells the asker's address; a dual-stack Listener answers an IPv4
// asker with the 27-byte IPv4 form, not an IPv4-mapped IPv6 address.
func TestReflectAttackIPv6(t *testing.T) {
	l6, err := Listen("udp6", "[::1]:0", testConfig())
	if err != nil {
		t.Skipf("no IPv6 loopback: %v", err)
	}
	t.Cleanup(func() { l6.Close() })
	check := func(l *Listener, network string, to *net.UDPAddr, size int) {
		t.Helper()
		uc, err := net.DialUDP(network, nil, to)
		require.NoError(t, err)
		defer uc.Close()
		_, err = uc.Write(appendQueryDatagram(nil, reflectKindAsk, testNonce(5), nil, queryPadTo))
		require.NoError(t, err)
		uc.SetReadDeadline(time.Now().Add(5 * time.Second))
		buf := make([]byte, 2048)
		n, err := uc.Read(buf)
		require.NoError(t, err)
		assert.Equal(t, size, n)
		kind, nonce, body, ok := parseQueryDatagram(buf[:n])
		require.True(t, ok)
		assert.Equal(t, byte(reflectKindAnswer), kind)
		seen, ok := parseReflectBody(body, &nonce)
		require.True(t, ok)
		assert.Equal(t, unmap(uc.LocalAddr().(*net.UDPAddr).AddrPort()), seen)
	}
	check(l6, "udp6", l6.Addr().(*net.UDPAddr), 39)
	got, err := Reflect(within(t, 5*time.Second), "udp6", l6.Addr().String())
	require.NoError(t, err)
	assert.True(t, got.Addr().Is6() && got.Addr().IsLoopback())

	dual, err := Listen("udp", "[::]:0", testConfig())
	require.NoError(t, err)
	t.Cleanup(func() { dual.Close() })
	port := dual.Addr().(*net.UDPAddr).Port
	check(dual, "udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: port}, 27)
	check(dual, "udp6", &net.UDPAddr{IP: net.IPv6loopback, Port: port}, 39)
	assert.Equal(t, uint64(2), dual.Stats().ReflectionsAnswered)
}
