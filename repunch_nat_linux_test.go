//go:build linux

package knet

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/nattest"
)

// The NAT pairs that punch (TestNATPunch): host's type, joiner's.
var punchingPairs = func() [][2]nattest.Type {
	F, R, P, S := nattest.FullCone, nattest.RestrictedCone, nattest.PortRestrictedCone, nattest.Symmetric
	return [][2]nattest.Type{{F, F}, {F, R}, {F, P}, {R, R}, {R, P}, {P, P}, {F, S}, {S, F}, {R, S}, {S, R}}
}()

const introAddr = "203.0.113.1:7000"

// hostGame is a host's loop while it hosts, as a game runs it: Host, then
// Punch what it was told in the background, and Host again, until ctx
// ends. It keeps the host polling its introducer, which tells it of new
// joiners and of joiners to re-punch.
func hostGame(ctx context.Context, host *Listener, id string, told chan<- Introduction) {
	for {
		in, err := host.Host(ctx, introAddr, id)
		if err != nil {
			return
		}
		select {
		case told <- in:
		default:
		}
		go host.Punch(ctx, in)
	}
}

// natGame is a host in site A and a joiner in site B connected through
// their NATs by punching, the host still hosting.
type natGame struct {
	intro, host *Listener
	c, sc       *Conn // the joiner's connection, and the host's
	told        chan Introduction
}

func punchGame(t *testing.T, n *nattest.Net, hostCfg, joinCfg *Config) *natGame {
	t.Helper()
	g := &natGame{told: make(chan Introduction, 8)}
	g.intro = listenIn(t, n.Public, introAddr, testConfig())
	g.intro.ServeIntroductions()
	g.host = listenIn(t, n.A.Host, "0.0.0.0:0", hostCfg)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go hostGame(ctx, g.host, "game-35", g.told)
	require.Eventually(t, func() bool {
		g.intro.punch.mu.Lock()
		defer g.intro.punch.mu.Unlock()
		return g.intro.punch.hosts["game-35"] != nil
	}, 5*time.Second, 10*time.Millisecond)

	wctx := within(t, 10*time.Second)
	pc := n.B.Host.ListenUDP(t, "0.0.0.0:0")
	var in Introduction
	require.NoError(t, n.B.Host.Run(func() (err error) {
		in, err = Join(wctx, pc, introAddr, "game-35")
		return err
	}))
	c, err := DialCandidates(wctx, pc, in, joinCfg)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	sc, err := g.host.AcceptConn(wctx)
	require.NoError(t, err)
	t.Cleanup(func() { sc.Close() })
	g.c, g.sc = c, sc
	select {
	case first := <-g.told:
		require.Nil(t, first.Repunch, "a new joiner")
	case <-wctx.Done():
		t.Fatal("the host was told of no joiner")
	}
	return g
}

// natConfig is a Config for a punched connection whose pings come every
// ping and whose silence is lost after lost.
func natConfig(base *Config, ping, lost time.Duration) *Config {
	c := *base
	c.PingInterval, c.ConnectionLostTimeout = ping, lost
	return &c
}

// exchange sends a reliable message each way at once and waits for both.
func (g *natGame) exchange(t *testing.T, what string, within time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	require.NoError(t, g.c.Send(Message{ID: 100, Payload: []byte("to host " + what), Reliable: true}))
	require.NoError(t, g.sc.Send(Message{ID: 100, Payload: []byte("to joiner " + what), Reliable: true}))
	m, err := g.sc.Receive(ctx)
	require.NoError(t, err, "the host heard nothing from the joiner (%s)", what)
	assert.Equal(t, "to host "+what, string(m.Payload))
	m, err = g.c.Receive(ctx)
	require.NoError(t, err, "the joiner heard nothing from the host (%s)", what)
	assert.Equal(t, "to joiner "+what, string(m.Payload))
}

// Each NAT forgets a mapping idle for 2 s; the connection's pings come
// every 500 ms, and so hold both NATs' mappings: after 6 s in which the
// game sent nothing, a message goes each way at once, nothing either
// side's connection sent was dropped (what one sent the other received),
// and no re-punch ran or was needed (same addresses both sides). With
// knet's default PingInterval (5 s) against these NATs, 7 of the 10
// pairs fail (datagrams dropped, or the message to the host lost to a
// symmetric NAT's new port); only those with a full cone host pass,
// which lets anyone in to its mapping.
func TestNATMappingHeldByKeepalive(t *testing.T) {
	for _, pair := range punchingPairs {
		t.Run(fmt.Sprintf("%v-hosts-%v-joins", pair[0], pair[1]), func(t *testing.T) {
			t.Parallel()
			const mapTimeout = 2 * time.Second
			n := nattest.New(t, pair[0], pair[1], &nattest.Options{MapTimeout: mapTimeout})
			cfg := natConfig(testConfig(), mapTimeout/4, 3*mapTimeout)
			g := punchGame(t, n, cfg, cfg)
			g.exchange(t, "first", 5*time.Second)
			// What each side's connection sent that the other's did
			// not receive, once nothing is in flight: the host's Punch
			// probes reach the joiner's connection too, so the counts
			// are compared with where they stood after the first
			// exchange.
			lost := func() (toHost, toJoiner int64) {
				a, b := g.c.Stats(), g.sc.Stats()
				return int64(a.DatagramsSent) - int64(b.DatagramsReceived), int64(b.DatagramsSent) - int64(a.DatagramsReceived)
			}
			h0, j0 := settledLost(t, lost)
			raddr, sraddr := g.c.RemoteAddr().String(), g.sc.RemoteAddr().String()

			select {
			case <-g.c.Done():
				t.Fatalf("the joiner's connection ended while idle: %v", g.c.Err())
			case <-g.sc.Done():
				t.Fatalf("the host's connection ended while idle: %v", g.sc.Err())
			case <-time.After(3 * mapTimeout):
			}
			g.exchange(t, "after idling", 2*time.Second)
			h1, j1 := settledLost(t, lost)
			assert.Equal(t, h0, h1, "datagrams from the joiner lost while idle")
			assert.Equal(t, j0, j1, "datagrams from the host lost while idle")
			assert.Zero(t, g.c.ep.repunch.Load().attempts.Load(), "no re-punch")
			assert.Equal(t, raddr, g.c.RemoteAddr().String())
			assert.Equal(t, sraddr, g.sc.RemoteAddr().String())
		})
	}
}

// settledLost reads lost until it gives the same twice, 100 ms apart
// (nothing in flight), within 5 s.
func settledLost(t *testing.T, lost func() (int64, int64)) (int64, int64) {
	t.Helper()
	a, b := lost()
	for range 50 {
		<-time.After(100 * time.Millisecond)
		a2, b2 := lost()
		if a2 == a && b2 == b {
			return a, b
		}
		a, b = a2, b2
	}
	t.Fatal("the datagram counts did not settle in 5 s")
	return 0, 0
}

// streamBoth sends reliable ordered messages both ways, numbered from
// 0, every 5 ms until stop is closed; the func it returns then checks
// that each side received every one the other sent, once, in order.
func streamBoth(t *testing.T, g *natGame, stop <-chan struct{}) func() {
	t.Helper()
	conns := [2]*Conn{g.c, g.sc}
	sent := make(chan int, 2)
	for i, c := range conns {
		go func() {
			n := 0
			defer func() { sent <- i<<24 | n }()
			tick := time.NewTicker(5 * time.Millisecond)
			defer tick.Stop()
			for {
				select {
				case <-stop:
					return
				case <-tick.C:
				}
				var b [8]byte
				binary.BigEndian.PutUint64(b[:], uint64(n))
				if err := c.Send(Message{ID: 101, Payload: b[:], Reliable: true, InOrder: true}); err != nil {
					return
				}
				n++
			}
		}()
	}
	return func() {
		t.Helper()
		var want [2]int
		for range 2 {
			v := <-sent
			want[v>>24] = v & (1<<24 - 1)
		}
		// The joiner's (0) go to the host's connection (1), and back.
		for i, c := range conns {
			from := want[1-i]
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			for k := 0; k < from; k++ {
				m, err := c.Receive(ctx)
				if !assert.NoError(t, err, "side %d received %d of %d", i, k, from) {
					break
				}
				if got := int(binary.BigEndian.Uint64(m.Payload)); got != k {
					assert.Equal(t, k, got, "side %d: message %d lost or out of order", i, k)
					break
				}
			}
			cancel()
			t.Logf("side %d received %d messages in order", i, from)
		}
	}
}

// A NAT's mappings expire mid-game (the router forgets every flow:
// nattest's Flush, on the host's NAT, the joiner's or both) while
// reliable ordered messages run both ways every 5 ms: the joiner's
// connection hears nothing new from the host for two keepalive
// intervals, re-punches through the introducer (the host, still
// hosting, is told and punches again), and both connections go on, the
// same *Conn on each side, every message delivered once in order. A
// symmetric NAT's new port is where the other side's connection moved
// to; through a cone, which keeps the port, the path comes back as it
// was.
func TestNATMappingExpiredRepunch(t *testing.T) {
	F, R, P, S := nattest.FullCone, nattest.RestrictedCone, nattest.PortRestrictedCone, nattest.Symmetric
	cases := []struct {
		host, joiner nattest.Type
		flush        string // "host", "joiner", "both"
	}{
		{S, F, "host"}, {S, R, "both"}, {F, S, "joiner"}, {R, S, "both"}, {P, P, "both"}, {F, R, "host"},
	}
	for _, secure := range []bool{false, true} {
		for _, tc := range cases {
			mode := "Plaintext"
			if secure {
				mode = "Secure"
			}
			t.Run(fmt.Sprintf("%s/%v-hosts-%v-joins-flush-%s", mode, tc.host, tc.joiner, tc.flush), func(t *testing.T) {
				t.Parallel()
				n := nattest.New(t, tc.host, tc.joiner, nil)
				hostCfg, joinCfg := testConfig(), testConfig()
				if secure {
					hostCfg, joinCfg = secureConfigs(t)
				}
				const ping = 250 * time.Millisecond
				hostCfg, joinCfg = natConfig(hostCfg, ping, 10*time.Second), natConfig(joinCfg, ping, 10*time.Second)
				g := punchGame(t, n, hostCfg, joinCfg)
				g.exchange(t, "before", 5*time.Second)
				raddr, sraddr := g.c.RemoteAddr().(*net.UDPAddr).AddrPort(), g.sc.RemoteAddr().(*net.UDPAddr).AddrPort()

				stop := make(chan struct{})
				check := streamBoth(t, g, stop)
				<-time.After(200 * time.Millisecond) // messages in flight when the mappings go
				start := time.Now()
				switch tc.flush {
				case "host":
					n.Flush(t, n.A)
				case "joiner":
					n.Flush(t, n.B)
				default:
					n.Flush(t, n.A)
					n.Flush(t, n.B)
				}
				// The stream goes on until the host hears the joiner again
				// after the re-punch, and a moment more.
				rp := g.c.ep.repunch.Load()
				// A cone keeps the port and both sides keep sending, so
				// the flows come back by themselves; a secure host
				// follows a symmetric joiner's new port by migration.
				// The rest need the re-punch.
				if tc.host == S && tc.flush != "joiner" || !secure && tc.joiner == S && tc.flush != "host" {
					require.Eventually(t, func() bool { return rp.attempts.Load() > 0 }, 5*time.Second, 10*time.Millisecond, "the joiner re-punched")
				}
				heard := g.sc.Stats().MessagesReceived
				require.Eventually(t, func() bool { return g.sc.Stats().MessagesReceived > heard+20 && g.c.Stats().MessagesReceived > 0 }, 15*time.Second, 10*time.Millisecond)
				<-time.After(200 * time.Millisecond)
				close(stop)
				check()
				t.Logf("%s: path back %v after the flush; joiner at %v (was %v), host at %v (was %v), %d re-punches",
					mode, time.Since(start).Round(time.Millisecond), g.sc.RemoteAddr(), sraddr, g.c.RemoteAddr(), raddr, rp.attempts.Load())
				require.NoError(t, g.c.Err())
				require.NoError(t, g.sc.Err())
				g.exchange(t, "after", 5*time.Second)
				if conns := g.host.Conns(); assert.Len(t, conns, 1, "one connection at the host") {
					assert.Same(t, g.sc, conns[0])
				}
				assert.Equal(t, n.A.Router.Addr(), g.c.RemoteAddr().(*net.UDPAddr).AddrPort().Addr())
				assert.Equal(t, n.B.Router.Addr(), g.sc.RemoteAddr().(*net.UDPAddr).AddrPort().Addr())
				if tc.host == S && tc.flush != "joiner" {
					assert.NotEqual(t, raddr, g.c.RemoteAddr().(*net.UDPAddr).AddrPort(), "the joiner moved to the host's new port")
				}
				if tc.joiner == S && tc.flush != "host" {
					assert.NotEqual(t, sraddr, g.sc.RemoteAddr().(*net.UDPAddr).AddrPort(), "the host moved to the joiner's new port")
				}
			})
		}
	}
}
