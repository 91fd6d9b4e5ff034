//go:build linux

package knet

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/nattest"
)

// A host behind one NAT type (site A) registers its Listener with an
// introducer in the public network; a joiner behind another (site B)
// joins by the same ID, and both punch. The pairs that a probe can get
// through connect directly, to the host's Listener, admitted as any
// connection, and a reliable message goes each way; the pairs that no
// probe gets through (a port-restricted cone facing a symmetric NAT, two
// symmetric NATs) fail with ErrNoDirectPath within the probing budget.
// Each pair logs its route and time from the joiner's ask to connected.
func TestNATPunch(t *testing.T) {
	F, R, P, S := nattest.FullCone, nattest.RestrictedCone, nattest.PortRestrictedCone, nattest.Symmetric
	cases := []struct {
		host, joiner nattest.Type
		direct       bool
	}{
		{F, F, true}, {F, R, true}, {F, P, true},
		{R, R, true}, {R, P, true}, {P, P, true},
		{F, S, true}, {S, F, true}, {R, S, true}, {S, R, true},
		{P, S, false}, {S, S, false},
	}
	for _, tc := range cases {
		t.Run(fmt.Sprintf("%v-hosts-%v-joins", tc.host, tc.joiner), func(t *testing.T) {
			t.Parallel()
			n := nattest.New(t, tc.host, tc.joiner, nil)
			intro := listenIn(t, n.Public, "203.0.113.1:7000", testConfig())
			intro.ServeIntroductions()
			host := listenIn(t, n.A.Host, "0.0.0.0:0", testConfig())
			ctx := within(t, 10*time.Second)

			// The host registers and punches once told of the joiner.
			punched := make(chan error, 1)
			go func() {
				var in Introduction
				err := n.A.Host.Run(func() (err error) {
					in, err = host.Host(ctx, "203.0.113.1:7000", "game-35")
					return err
				})
				if err == nil {
					err = host.Punch(ctx, in)
				}
				punched <- err
			}()
			accepted := make(chan *Conn, 1)
			go func() {
				c, err := host.AcceptConn(ctx)
				if err == nil {
					accepted <- c
				}
				close(accepted)
			}()
			// The host is registered once the introducer has it.
			require.Eventually(t, func() bool {
				intro.punch.mu.Lock()
				defer intro.punch.mu.Unlock()
				return intro.punch.hosts["game-35"] != nil
			}, 5*time.Second, 10*time.Millisecond)

			pc := n.B.Host.ListenUDP(t, "0.0.0.0:0")
			start := time.Now()
			var in Introduction
			require.NoError(t, n.B.Host.Run(func() (err error) {
				in, err = Join(ctx, pc, "203.0.113.1:7000", "game-35")
				return err
			}))
			assert.Equal(t, n.A.Router.Addr(), in.Peer[0].Addr(), "the host's address as the introducer saw it first")
			c, err := DialCandidates(ctx, pc, in, testConfig())
			elapsed, fromStart := time.Since(start), time.Since(in.Start)
			require.NoError(t, <-punched)
			if !tc.direct {
				require.ErrorIs(t, err, ErrNoDirectPath)
				t.Logf("NAT pair %v hosts, %v joins: no direct path (%v)", tc.host, tc.joiner, elapsed.Round(time.Millisecond))
				return
			}
			require.NoError(t, err)
			defer c.Close()
			sc, ok := <-accepted
			require.True(t, ok, "the host's Listener accepted the joiner")
			defer sc.Close()
			t.Logf("NAT pair %v hosts, %v joins: direct to %v in %v from the ask, %v from the agreed start", tc.host, tc.joiner, c.RemoteAddr(), elapsed.Round(time.Millisecond), fromStart.Round(time.Millisecond))
			assert.Equal(t, n.A.Router.Addr(), c.RemoteAddr().(*net.UDPAddr).AddrPort().Addr(), "through the host's NAT")
			assert.Equal(t, n.B.Router.Addr(), sc.RemoteAddr().(*net.UDPAddr).AddrPort().Addr(), "from the joiner's NAT")

			require.NoError(t, c.Send(Message{ID: 100, Payload: []byte("hello host"), Reliable: true}))
			m, err := sc.Receive(ctx)
			require.NoError(t, err)
			assert.Equal(t, "hello host", string(m.Payload))
			require.NoError(t, sc.Send(Message{ID: 100, Payload: []byte("hello joiner"), Reliable: true}))
			m, err = c.Receive(ctx)
			require.NoError(t, err)
			assert.Equal(t, "hello joiner", string(m.Payload))
		})
	}
}

// A probe that does not carry the token of a Punch running gets no
// answer, and an introducer keeps an ID for the address that registered
// it.
func TestNATPunchUnproven(t *testing.T) {
	t.Parallel()
	n := nattest.New(t, nattest.FullCone, nattest.PortRestrictedCone, nil)
	intro := listenIn(t, n.Public, "203.0.113.1:7000", testConfig())
	intro.ServeIntroductions()
	host := listenIn(t, n.A.Host, "0.0.0.0:0", testConfig())
	other := listenIn(t, n.Public, "203.0.113.2:0", testConfig())
	ctx := within(t, 10*time.Second)
	hctx, cancel := context.WithCancel(ctx)
	hosted := make(chan error, 1)
	go func() { _, err := host.Host(hctx, "203.0.113.1:7000", "mine"); hosted <- err }()
	require.Eventually(t, func() bool {
		intro.punch.mu.Lock()
		defer intro.punch.mu.Unlock()
		return intro.punch.hosts["mine"] != nil
	}, 5*time.Second, 10*time.Millisecond)
	_, err := other.Host(ctx, "203.0.113.1:7000", "mine")
	require.ErrorIs(t, err, ErrIntroIDTaken)
	cancel()
	require.ErrorIs(t, <-hosted, context.Canceled)

	// A padded probe with a token the host is not punching with.
	pc := n.Public.ListenUDP(t, "203.0.113.3:0")
	var tok [queryNonceSize]byte
	tok[0] = 1
	laddr := host.Addr().(*net.UDPAddr).AddrPort()
	_, err = pc.WriteToUDPAddrPort(appendQueryDatagram(nil, punchKindProbe, &tok, nil, queryPadTo), netipFrom(n.A.Router.Addr(), laddr.Port()))
	require.NoError(t, err)
	// Then a query, which the host answers: the probe was handled before it.
	require.NoError(t, host.SetQueryInfo([]byte("x")))
	require.NoError(t, n.Public.Run(func() error {
		_, _, err := Query(ctx, "udp4", netipFrom(n.A.Router.Addr(), laddr.Port()).String())
		return err
	}))
	assert.Zero(t, host.punch.answered.Load(), "no answer to a probe of no Punch")
	require.NoError(t, pc.SetReadDeadline(time.Now().Add(100*time.Millisecond)))
	buf := make([]byte, 2048)
	_, _, err = pc.ReadFromUDPAddrPort(buf)
	var ne net.Error
	require.True(t, errors.As(err, &ne) && ne.Timeout(), "nothing came back: %v", err)
}

func netipFrom(a netip.Addr, port uint16) netip.AddrPort { return netip.AddrPortFrom(a, port) }

// memSignal is a game's own backend in one process: it pairs a host and
// a joiner under an ID, as Signal says.
type memSignal struct {
	hosts chan memOffer
}

type memOffer struct {
	id   string
	self []netip.AddrPort
	back chan Introduction // the joiner's, for the host
	peer Introduction      // the host's, for the joiner
}

func (m *memSignal) Host(ctx context.Context, id string, self []netip.AddrPort) (Introduction, error) {
	back := make(chan Introduction, 1)
	select {
	case m.hosts <- memOffer{id: id, self: self, back: back}:
	case <-ctx.Done():
		return Introduction{}, ctx.Err()
	}
	select {
	case in := <-back:
		return in, nil
	case <-ctx.Done():
		return Introduction{}, ctx.Err()
	}
}

func (m *memSignal) Join(ctx context.Context, id string, self []netip.AddrPort) (Introduction, error) {
	select {
	case h := <-m.hosts:
		if h.id != id {
			return Introduction{}, ErrNoHost
		}
		var tok [8]byte
		tok[0], tok[7] = 35, 35
		start := time.Now().Add(50 * time.Millisecond)
		h.back <- Introduction{Peer: self, Token: tok, Start: start}
		return Introduction{Peer: h.self, Token: tok, Start: start}, nil
	case <-ctx.Done():
		return Introduction{}, ctx.Err()
	}
}

// A game's own backend carries the introductions (Signal), each side
// gathering its candidates from a knet server that reflects; the
// connection is a secure one, between two port-restricted cones.
func TestNATPunchSignal(t *testing.T) {
	t.Parallel()
	n := nattest.New(t, nattest.PortRestrictedCone, nattest.PortRestrictedCone, nil)
	listenIn(t, n.Public, "203.0.113.1:7000", testConfig()) // a reflector: any knet server
	serverCfg, clientCfg := secureConfigs(t)
	host := listenIn(t, n.A.Host, "0.0.0.0:0", serverCfg)
	sig := Signal(&memSignal{hosts: make(chan memOffer)})
	ctx := within(t, 10*time.Second)

	punched := make(chan error, 1)
	go func() {
		var self []netip.AddrPort
		err := n.A.Host.Run(func() (err error) {
			self, err = host.Candidates(ctx, "203.0.113.1:7000")
			return err
		})
		var in Introduction
		if err == nil {
			in, err = sig.Host(ctx, "lobby", self)
		}
		if err == nil {
			err = host.Punch(ctx, in)
		}
		punched <- err
	}()
	accepted := make(chan *Conn, 1)
	go func() {
		c, err := host.AcceptConn(ctx)
		if err == nil {
			accepted <- c
		}
		close(accepted)
	}()

	pc := n.B.Host.ListenUDP(t, "0.0.0.0:0")
	var self []netip.AddrPort
	require.NoError(t, n.B.Host.Run(func() (err error) {
		self, err = PacketCandidates(ctx, pc, "203.0.113.1:7000")
		return err
	}))
	require.NotEmpty(t, self)
	assert.Equal(t, n.B.Router.Addr(), self[0].Addr(), "the joiner's public address first")
	in, err := sig.Join(ctx, "lobby", self)
	require.NoError(t, err)
	c, err := DialCandidates(ctx, pc, in, clientCfg)
	require.NoError(t, err)
	defer c.Close()
	require.NoError(t, <-punched)
	sc, ok := <-accepted
	require.True(t, ok)
	defer sc.Close()
	require.NoError(t, c.Send(Message{ID: 100, Payload: []byte("sealed hello"), Reliable: true}))
	m, err := sc.Receive(ctx)
	require.NoError(t, err)
	assert.Equal(t, "sealed hello", string(m.Payload))
	assert.True(t, c.Secure() && sc.Secure(), "a secure session")
}

// Under 10 % loss on both private links (each router drops a tenth of
// what it forwards, both ways), the pairs that punch without loss still
// connect directly: the asks, the probes and the handshake are resent
// (within the default ConnectTimeout: natLossConfig).
func TestNATPunchLoss(t *testing.T) {
	for _, pair := range [][2]nattest.Type{
		{nattest.PortRestrictedCone, nattest.PortRestrictedCone},
		{nattest.RestrictedCone, nattest.Symmetric},
		{nattest.Symmetric, nattest.FullCone},
	} {
		t.Run(fmt.Sprintf("%v-hosts-%v-joins", pair[0], pair[1]), func(t *testing.T) {
			t.Parallel()
			n := nattest.New(t, pair[0], pair[1], &nattest.Options{Loss: 0.1})
			intro := listenIn(t, n.Public, "203.0.113.1:7000", testConfig())
			intro.ServeIntroductions()
			host := listenIn(t, n.A.Host, "0.0.0.0:0", natLossConfig()) // not testConfig: see natLossConfig
			ctx := within(t, 20*time.Second)
			punched := make(chan error, 1)
			go func() {
				in, err := host.Host(ctx, "203.0.113.1:7000", "lossy")
				if err == nil {
					err = host.Punch(ctx, in)
				}
				punched <- err
			}()
			accepted := make(chan *Conn, 1)
			go func() {
				c, err := host.AcceptConn(ctx)
				if err == nil {
					accepted <- c
				}
				close(accepted)
			}()
			pc := n.B.Host.ListenUDP(t, "0.0.0.0:0")
			start := time.Now()
			var in Introduction
			var err error
			// The host may not be registered yet: Join asks until it is.
			require.NoError(t, n.B.Host.Run(func() (err error) {
				in, err = Join(ctx, pc, "203.0.113.1:7000", "lossy")
				return err
			}))
			c, err := DialCandidates(ctx, pc, in, natLossConfig())
			require.NoError(t, err)
			defer c.Close()
			t.Logf("NAT pair %v hosts, %v joins, 10%% loss: direct to %v in %v", pair[0], pair[1], c.RemoteAddr(), time.Since(start).Round(time.Millisecond))
			require.NoError(t, c.Send(Message{ID: 100, Payload: []byte("through loss"), Reliable: true}))
			require.NoError(t, <-punched)
			sc, ok := <-accepted
			require.True(t, ok)
			defer sc.Close()
			m, err := sc.Receive(ctx)
			require.NoError(t, err)
			assert.Equal(t, "through loss", string(m.Payload))
		})
	}
}
