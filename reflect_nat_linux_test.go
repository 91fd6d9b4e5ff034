//go:build linux

package knet

import (
	"context"
	"net"
	"net/netip"
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
