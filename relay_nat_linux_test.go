//go:build linux

package knet

import (
	"encoding/binary"
	"fmt"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/nattest"
)

// relayIn makes l, in node's namespace, a relay: its allocations' sockets
// are opened there too (a goroutine's new thread starts in the test's own
// namespace).
func relayIn(t *testing.T, node *nattest.Node, l *Listener, cfg RelayConfig) {
	t.Helper()
	l.relay.listen = func(network string, laddr *net.UDPAddr) (pc *net.UDPConn, err error) {
		err2 := node.Run(func() error {
			pc, err = net.ListenUDP(network, laddr)
			return nil
		})
		if err2 != nil {
			return nil, err2
		}
		return pc, err
	}
	l.ServeRelay(cfg)
}

// relayNATPair is a host and a joiner connected through an introducer that
// relays, behind the NATs of n.
type relayNATPair struct {
	intro, host *Listener
	c, sc       *Conn
	in          Introduction  // the joiner's
	connected   time.Duration // from the joiner's ask
}

// connectNAT runs an introduction between site A's host (hostCfg) and
// site B's joiner (joinCfg) through an introducer at 203.0.113.1:7000
// that relays, and returns the pair once the host accepted. relayFirst
// sets the Introductions' test hook on both sides: no direct probing
// before the relay, and the retries while relayed that much later.
func connectNAT(t *testing.T, n *nattest.Net, hostCfg, joinCfg *Config, relayFirst time.Duration) *relayNATPair {
	t.Helper()
	p := &relayNATPair{}
	p.intro = listenIn(t, n.Public, "203.0.113.1:7000", testConfig())
	p.intro.ServeIntroductions()
	relayIn(t, n.Public, p.intro, RelayConfig{})
	p.host = listenIn(t, n.A.Host, "0.0.0.0:0", hostCfg)
	ctx := within(t, 20*time.Second)
	punched := make(chan error, 1)
	go func() {
		in, err := p.host.Host(ctx, "203.0.113.1:7000", "relay-35")
		if err == nil {
			in.relayFirst = relayFirst
			err = p.host.Punch(ctx, in)
		}
		punched <- err
	}()
	accepted := make(chan *Conn, 1)
	go func() {
		c, err := p.host.AcceptConn(ctx)
		if err == nil {
			accepted <- c
		}
		close(accepted)
	}()
	pc := n.B.Host.ListenUDP(t, "0.0.0.0:0")
	start := time.Now()
	require.NoError(t, n.B.Host.Run(func() (err error) {
		p.in, err = Join(ctx, pc, "203.0.113.1:7000", "relay-35")
		return err
	}))
	require.True(t, p.in.Relay.IsValid(), "the introduction offers the relay")
	assert.Equal(t, netipFrom(n.Public.Addr(), 0).Addr(), p.in.Relay.Addr(), "at the introducer's address")
	p.in.relayFirst = relayFirst
	c, err := DialCandidates(ctx, pc, p.in, joinCfg)
	require.NoError(t, err)
	p.connected = time.Since(start)
	t.Cleanup(func() { c.Close() })
	p.c = c
	require.NoError(t, <-punched)
	sc, ok := <-accepted
	require.True(t, ok, "the host's Listener accepted the joiner")
	t.Cleanup(func() { sc.Close() })
	p.sc = sc
	return p
}

// Two symmetric NATs, which no probe gets through (TestNATPunch), connect
// through the introducer's relay, and so does a port-restricted cone
// hosting for a symmetric NAT: the joiner's connection is to the
// relay's allocation, the host's Listener accepts it from there as any
// other, both say the route is relayed, and reliable messages go both
// ways, in a plaintext and a secure session. The secure one's datagrams
// cross the relay sealed: the relay forwards them and holds no key.
func TestNATRelaySymmetricPair(t *testing.T) {
	for _, tc := range []struct {
		host   nattest.Type
		secure bool
	}{{nattest.Symmetric, false}, {nattest.Symmetric, true}, {nattest.PortRestrictedCone, true}} {
		secure := tc.secure
		name := fmt.Sprintf("%v-hosts-plaintext", tc.host)
		if secure {
			name = fmt.Sprintf("%v-hosts-secure", tc.host)
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			n := nattest.New(t, tc.host, nattest.Symmetric, nil)
			hostCfg, joinCfg := testConfig(), testConfig()
			if secure {
				hostCfg, joinCfg = secureConfigs(t)
			}
			p := connectNAT(t, n, hostCfg, joinCfg, 0)
			t.Logf("%s, symmetric joins: relayed through %v in %v from the ask", name, p.c.RemoteAddr(), p.connected.Round(time.Millisecond))
			assert.Equal(t, p.in.Relay, p.c.RemoteAddr().(*net.UDPAddr).AddrPort(), "the joiner's peer is the relay's allocation")
			assert.Equal(t, p.in.Relay, p.sc.RemoteAddr().(*net.UDPAddr).AddrPort(), "the host sees the joiner at the allocation")
			assert.Equal(t, RouteRelayed, p.c.Route())
			assert.Equal(t, RouteRelayed, p.sc.Route())
			assert.Equal(t, secure, p.c.Secure() && p.sc.Secure())

			ctx := within(t, 10*time.Second)
			for i := range 20 {
				require.NoError(t, p.c.Send(Message{ID: 100, Payload: []byte(fmt.Sprint("to host ", i)), Reliable: true, InOrder: true}))
				require.NoError(t, p.sc.Send(Message{ID: 100, Payload: []byte(fmt.Sprint("to joiner ", i)), Reliable: true, InOrder: true}))
			}
			for i := range 20 {
				m, err := p.sc.Receive(ctx)
				require.NoError(t, err)
				assert.Equal(t, fmt.Sprint("to host ", i), string(m.Payload))
				m, err = p.c.Receive(ctx)
				require.NoError(t, err)
				assert.Equal(t, fmt.Sprint("to joiner ", i), string(m.Payload))
			}
			st := p.intro.Stats()
			assert.Equal(t, 1, st.RelayAllocations)
			assert.GreaterOrEqual(t, st.RelayForwardedBytes, uint64(2*20*len("to joiner 00")), "the messages went through the relay")
			assert.Zero(t, st.RelayLimited)
			if secure {
				assert.Zero(t, p.intro.Stats().Connections, "the relay is no party to the session")
			}
		})
	}
}

// Relayed first, then direct: two port-restricted cones, which punch
// (TestNATPunch), are made to skip the probing before the relay
// (relayFirst), so that the secure connection starts relayed; the
// retries while relayed find the direct path a second later, and the
// connection moves there in place (the joiner sends there, the host's
// Listener checks the path and follows). A stream of ordered reliable
// messages runs both ways all along: each arrives once, in order, none
// lost, across the switch.
func TestNATRelayThenDirect(t *testing.T) {
	t.Parallel()
	n := nattest.New(t, nattest.PortRestrictedCone, nattest.PortRestrictedCone, nil)
	hostCfg, joinCfg := secureConfigs(t)
	p := connectNAT(t, n, hostCfg, joinCfg, time.Second)
	require.Equal(t, RouteRelayed, p.c.Route(), "relayed first")
	relayedAt := time.Now()
	ctx := within(t, 20*time.Second)

	// A stream each way, sent until both sides are direct and 100
	// messages after.
	var counts [2]atomic.Int64
	stream := func(from *Conn, count *atomic.Int64, stop <-chan struct{}, sent chan<- int) {
		i := 0
		tick := time.NewTicker(2 * time.Millisecond) // a game's pace, not a wait for anything
		defer tick.Stop()
		for {
			var b [4]byte
			binary.BigEndian.PutUint32(b[:], uint32(i))
			if from.Send(Message{ID: 200, Payload: b[:], Reliable: true, InOrder: true}) != nil {
				break
			}
			i++
			count.Store(int64(i))
			select {
			case <-stop:
				sent <- i
				return
			case <-tick.C:
			}
		}
		sent <- i
	}
	stop := make(chan struct{})
	sentUp, sentDown := make(chan int, 1), make(chan int, 1)
	go stream(p.c, &counts[0], stop, sentUp)
	go stream(p.sc, &counts[1], stop, sentDown)
	check := func(to *Conn, n int) {
		t.Helper()
		for i := range n {
			m, err := to.Receive(ctx)
			require.NoError(t, err, "message %d of %d", i, n)
			require.Equal(t, uint32(i), binary.BigEndian.Uint32(m.Payload), "message %d: once and in order", i)
		}
	}
	// Both sides go direct (a bounded wait on the route).
	require.Eventually(t, func() bool {
		return p.c.Route() == RouteDirect && p.sc.Route() == RouteDirect
	}, 15*time.Second, 5*time.Millisecond, "the connection moves to the direct path")
	moved := time.Since(relayedAt)
	hostRoute := p.sc.RemoteAddr().(*net.UDPAddr).AddrPort()
	assert.Equal(t, n.B.Router.Addr(), hostRoute.Addr(), "the host sends to the joiner's NAT now")
	assert.Equal(t, n.A.Router.Addr(), p.c.RemoteAddr().(*net.UDPAddr).AddrPort().Addr(), "the joiner sends to the host's NAT now")
	forwarded := p.intro.Stats().RelayForwarded
	// 100 more messages each way after the switch, then the check.
	after := [2]int64{counts[0].Load(), counts[1].Load()}
	require.Eventually(t, func() bool {
		return counts[0].Load() >= after[0]+100 && counts[1].Load() >= after[1]+100
	}, 10*time.Second, 5*time.Millisecond)
	close(stop)
	up, down := <-sentUp, <-sentDown
	check(p.sc, up)
	check(p.c, down)
	t.Logf("relayed then direct: relayed in %v from the ask, direct %v after (relayFirst 1 s), %d and %d ordered reliable messages across the switch, none lost or reordered; the relay forwarded %d datagrams", p.connected.Round(time.Millisecond), moved.Round(time.Millisecond), up, down, forwarded)
	assert.Greater(t, forwarded, uint64(0))
	assert.Greater(t, p.sc.Stats().Migrations, uint64(0), "the host's connection migrated")
	// What the relay forwarded since is at most a few late datagrams,
	// against the 200 and more messages sent meanwhile.
	assert.Less(t, p.intro.Stats().RelayForwarded-forwarded, uint64(20), "the messages after the switch went direct")
}
