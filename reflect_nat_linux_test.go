//go:build linux

package knet

import (
	"context"
	"encoding/binary"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/nattest"
)

// listenIn is Listen("udp4", addr, cfg) inside node's namespace (its
// socket is the namespace's for good), closed when t ends.
func listenIn(t *testing.T, node *nattest.Node, addr string, cfg *Config) *Listener {
	t.Helper()
	var l *Listener
	require.NoError(t, node.Run(func() (err error) {
		l, err = Listen("udp4", addr, cfg)
		return err
	}))
	t.Cleanup(func() { l.Close() })
	return l
}

// Behind each type of NAT, a host learns the public address of its
// Listener's socket from knet servers in the public network: the router's
// address, and for the cone types the one port every destination sees
// (Linux keeps the private one), so two servers agree; behind a
// symmetric NAT they report different ports. Reflect's own socket is
// mapped to the router's address too. Behind a full cone, a client at an
// address the host never sent to then connects to the host at the address reflected.
func TestNATReflect(t *testing.T) {
	for _, ty := range nattest.Types {
		t.Run(ty.String(), func(t *testing.T) {
			t.Parallel()
			n := nattest.New(t, ty, nattest.PortRestrictedCone, nil)
			s1 := listenIn(t, n.Public, "203.0.113.1:7000", testConfig())
			s2 := listenIn(t, n.Public, "203.0.113.2:7000", testConfig())
			host := listenIn(t, n.A.Host, "0.0.0.0:0", testConfig())
			local := host.Addr().(*net.UDPAddr).AddrPort()

			ctx := within(t, 10*time.Second)
			m1, err := host.Reflect(ctx, "203.0.113.1:7000")
			require.NoError(t, err)
			m2, err := host.Reflect(ctx, "203.0.113.2:7000")
			require.NoError(t, err)
			wan := n.A.Router.Addr()
			assert.Equal(t, wan, m1.Addr(), "the router's public address")
			assert.Equal(t, wan, m2.Addr())
			if ty == nattest.Symmetric {
				assert.NotEqual(t, m1.Port(), m2.Port(), "a port per destination")
			} else {
				assert.Equal(t, m1, m2, "one mapping for every destination")
				assert.Equal(t, local.Port(), m1.Port())
			}

			var own netip.AddrPort
			require.NoError(t, n.A.Host.Run(func() (err error) {
				own, err = Reflect(ctx, "udp4", "203.0.113.1:7000")
				return err
			}))
			assert.Equal(t, wan, own.Addr())
			assert.NotEqual(t, m1.Port(), own.Port(), "a socket of its own, mapped apart")

			for _, s := range []*Listener{s1, s2} {
				st := s.Stats()
				assert.NotZero(t, st.ReflectionsAnswered)
				assert.Zero(t, st.ReflectionsDropped)
			}

			if ty == nattest.FullCone {
				accepted := make(chan *Conn, 1)
				go func() {
					c, err := host.AcceptConn(ctx)
					if err == nil {
						accepted <- c
					}
					close(accepted)
				}()
				// From an address the host never sent to: the
				// public network's third.
				pc := n.Public.ListenUDP(t, "203.0.113.3:0")
				c, err := DialPacket(ctx, pc, m1.String(), testConfig())
				require.NoError(t, err, "a full cone lets anyone in at the address reflected")
				defer c.Close()
				sc, ok := <-accepted
				require.True(t, ok)
				defer sc.Close()
				require.NoError(t, c.Send(Message{ID: 100, Payload: []byte("hello host"), Reliable: true}))
				m, err := sc.Receive(ctx)
				require.NoError(t, err)
				assert.Equal(t, "hello host", string(m.Payload))
			}
		})
	}
}

// A server that does not reflect (Stealth) behind the same NATs: the host
// learns nothing, and the error names the server and what failed.
func TestNATReflectNoAnswer(t *testing.T) {
	t.Parallel()
	n := nattest.New(t, nattest.PortRestrictedCone, nattest.PortRestrictedCone, nil)
	cfg := testConfig()
	cfg.Stealth = true
	listenIn(t, n.Public, "203.0.113.1:7000", cfg)
	host := listenIn(t, n.A.Host, "0.0.0.0:0", testConfig())
	ctx, cancel := context.WithTimeout(context.Background(), 600*time.Millisecond)
	defer cancel()
	_, err := host.Reflect(ctx, "203.0.113.1:7000")
	require.ErrorIs(t, err, context.DeadlineExceeded, "no answer, before the caller's deadline")
}

// spoofUDP sends b as a UDP datagram from `from` to `to` over a raw
// socket (IP_HDRINCL), whatever from is: an attacker forging its victim's
// address. It runs in node's namespace.
func spoofUDP(t *testing.T, node *nattest.Node, from, to netip.AddrPort, bs [][]byte) {
	t.Helper()
	require.NoError(t, node.Run(func() error {
		fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_RAW, syscall.IPPROTO_RAW)
		if err != nil {
			return err
		}
		defer syscall.Close(fd)
		dst := &syscall.SockaddrInet4{Addr: to.Addr().As4()}
		for _, b := range bs {
			// IPv4 header (the kernel fills in the checksum and total
			// length), then UDP (checksum 0: none).
			p := make([]byte, 28, 28+len(b))
			p[0], p[8], p[9] = 0x45, 64, syscall.IPPROTO_UDP
			s, d := from.Addr().As4(), to.Addr().As4()
			copy(p[12:16], s[:])
			copy(p[16:20], d[:])
			binary.BigEndian.PutUint16(p[20:], from.Port())
			binary.BigEndian.PutUint16(p[22:], to.Port())
			binary.BigEndian.PutUint16(p[24:], uint16(8+len(b)))
			p = append(p, b...)
			if err := syscall.Sendto(fd, p, 0, dst); err != nil {
				return err
			}
		}
		return nil
	}))
}

// The attacker's view, on a real network: asks spoofing a victim's
// address (every one 1200 bytes, or short) make a reflector send the
// victim one source's burst of answers, each 27 bytes: no amplification,
// and a bounded rate.
func TestNATReflectSpoofedVictim(t *testing.T) {
	t.Parallel()
	n := nattest.New(t, nattest.PortRestrictedCone, nattest.PortRestrictedCone, nil)
	l := listenIn(t, n.Public, "203.0.113.1:7000", testConfig())
	require.NoError(t, l.SetQueryInfo([]byte("sentinel")))
	victim := n.Public.ListenUDP(t, "203.0.113.3:9000")
	const flood = 200
	var asks [][]byte
	sent := 0
	for i := range flood {
		size := queryPadTo
		if i%4 == 3 {
			size = 100 // short: no answer at all
		}
		asks = append(asks, appendQueryDatagram(nil, reflectKindAsk, testNonce(byte(i)), nil, size))
		sent += size
	}
	start := time.Now()
	spoofUDP(t, n.Public, netip.MustParseAddrPort("203.0.113.3:9000"), netip.MustParseAddrPort("203.0.113.1:7000"), asks)
	// The listener's reader takes datagrams in order: once a query from
	// another source is answered, every ask before it was handled.
	var info []byte
	ctx := within(t, 5*time.Second)
	require.NoError(t, n.Public.Run(func() (err error) {
		info, _, err = Query(ctx, "udp4", "203.0.113.1:7000")
		return err
	}))
	assert.Equal(t, "sentinel", string(info))
	elapsed := time.Since(start)
	st := l.Stats()
	assert.Equal(t, uint64(flood), st.ReflectionsAnswered+st.ReflectionsDropped)
	// A burst, and what the rate adds over the flood's time.
	most := querySourceBurst + int(elapsed.Seconds()*querySourceRate) + 1
	assert.LessOrEqual(t, int(st.ReflectionsAnswered), most)
	assert.GreaterOrEqual(t, int(st.ReflectionsAnswered), querySourceBurst)
	// What the victim got: the answers, 27 bytes each, to its address.
	got := 0
	buf := make([]byte, 2048)
	require.NoError(t, victim.SetReadDeadline(time.Now().Add(5*time.Second)))
	for range st.ReflectionsAnswered {
		k, from, err := victim.ReadFromUDPAddrPort(buf)
		require.NoError(t, err)
		assert.Equal(t, netip.MustParseAddrPort("203.0.113.1:7000"), from)
		assert.Equal(t, 27, k)
		got += k
	}
	assert.LessOrEqual(t, got*40, sent, "the victim gets under a fortieth of what the attacker sent")
	t.Logf("attacker sent %d bytes in %d asks; the victim got %d bytes in %d answers", sent, flood, got, st.ReflectionsAnswered)
}
