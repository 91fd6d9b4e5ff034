//go:build linux

package nattest

import (
	"errors"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// wait bounds every read: the networks are in this machine, a datagram
// that gets through does in microseconds.
const wait = 5 * time.Second

// exchange sends from c to the server s, reads it at s, and answers it:
// it returns the address s saw (c's public mapping for s), once c has the
// answer.
func exchange(t *testing.T, c, s *net.UDPConn) netip.AddrPort {
	t.Helper()
	to := s.LocalAddr().(*net.UDPAddr).AddrPort()
	_, err := c.WriteToUDPAddrPort([]byte("out"), to)
	require.NoError(t, err)
	buf := make([]byte, 64)
	require.NoError(t, s.SetReadDeadline(time.Now().Add(wait)))
	n, from, err := s.ReadFromUDPAddrPort(buf)
	require.NoError(t, err, "the server got nothing from the private host")
	require.Equal(t, "out", string(buf[:n]))
	_, err = s.WriteToUDPAddrPort([]byte("back"), from)
	require.NoError(t, err)
	require.NoError(t, c.SetReadDeadline(time.Now().Add(wait)))
	n, src, err := c.ReadFromUDPAddrPort(buf)
	require.NoError(t, err, "the private host got no answer from the server it sent to")
	require.Equal(t, "back", string(buf[:n]))
	require.Equal(t, to, src)
	return from
}

// reaches reports whether a datagram from `from` to the public address
// `at` gets through the NAT to c. To know that one did not without
// waiting on a clock, `marker` (a server c sent to: its answers get
// through) sends a second datagram right after it, by the same path: c
// reads until the marker comes, and the probe, if let in, is there first.
func reaches(t *testing.T, from *net.UDPConn, at netip.AddrPort, c, marker *net.UDPConn) bool {
	t.Helper()
	_, err := from.WriteToUDPAddrPort([]byte("probe"), at)
	require.NoError(t, err)
	_, err = marker.WriteToUDPAddrPort([]byte("marker"), at)
	require.NoError(t, err)
	buf := make([]byte, 64)
	got := false
	require.NoError(t, c.SetReadDeadline(time.Now().Add(wait)))
	for range 16 {
		n, src, err := c.ReadFromUDPAddrPort(buf)
		require.NoError(t, err, "the marker from a contacted server did not come")
		switch string(buf[:n]) {
		case "probe":
			assert.Equal(t, from.LocalAddr().(*net.UDPAddr).AddrPort(), src, "the probe came from elsewhere")
			got = true
		case "marker":
			return got
		}
	}
	t.Fatal("no marker among 16 datagrams")
	return false
}

// checkType builds a Net with site A behind a NAT of type ty and checks,
// with plain UDP sockets, the mapping and the filtering that define ty.
func checkType(t *testing.T, ty Type) {
	t.Parallel()
	n := New(t, ty, PortRestrictedCone, nil)
	pub := n.Public
	s1 := pub.ListenUDP(t, "203.0.113.1:7001")
	s1b := pub.ListenUDP(t, "203.0.113.1:7002") // same address, another port
	s2 := pub.ListenUDP(t, "203.0.113.2:7001")  // another address, contacted
	s3 := pub.ListenUDP(t, "203.0.113.3:7001")  // an address never contacted
	c := n.A.Host.ListenUDP(t, "0.0.0.0:0")
	local := c.LocalAddr().(*net.UDPAddr).AddrPort().Port()

	m1 := exchange(t, c, s1)
	assert.Equal(t, n.A.Router.Addr(), m1.Addr(), "the server sees the router's public address")
	m2 := exchange(t, c, s2)
	assert.Equal(t, m1.Addr(), m2.Addr())
	if ty == Symmetric {
		// A new port per destination (fully random: 1 in 64,512 that
		// two are equal).
		assert.NotEqual(t, m1.Port(), m2.Port(), "a symmetric NAT maps each destination to a new port")
		m3 := exchange(t, c, s1b)
		assert.NotEqual(t, m1.Port(), m3.Port(), "a new port for a new port of the same address too")
	} else {
		assert.Equal(t, m1, m2, "a cone NAT maps the socket to one public port for every destination")
		assert.Equal(t, local, m1.Port(), "Linux keeps the private port when it is free")
	}

	// Filtering, at the port mapped for s1.
	open := map[Type][2]bool{ // s1b (a contacted address, new port), s3 (an address never contacted)
		FullCone:           {true, true},
		RestrictedCone:     {true, false},
		PortRestrictedCone: {false, false},
		Symmetric:          {false, false},
	}[ty]
	if ty != Symmetric {
		assert.Equal(t, open[0], reaches(t, s1b, m1, c, s1), "a new port of the address contacted")
	}
	assert.Equal(t, open[1], reaches(t, s3, m1, c, s1), "an address never contacted")
	if ty == Symmetric {
		// s2's mapping lets in s2 only; s2 is no one at s1's mapping.
		assert.False(t, reaches(t, s2, m1, c, s1), "a contacted server, at another destination's port")
		assert.True(t, reaches(t, s2, m2, c, s2), "s2, at its own mapping")
	}
	// The flows still hold: a server contacted gets through at once.
	assert.True(t, reaches(t, s2, m2, c, s2))
}

func TestNATFullCone(t *testing.T)           { checkType(t, FullCone) }
func TestNATRestrictedCone(t *testing.T)     { checkType(t, RestrictedCone) }
func TestNATPortRestrictedCone(t *testing.T) { checkType(t, PortRestrictedCone) }
func TestNATSymmetric(t *testing.T)          { checkType(t, Symmetric) }

// Both sites are built, each behind its own router: host B reaches the
// public network through router B, and a full-cone host A is reachable
// from host B at its mapped port, once A sent anywhere.
func TestNATTwoSites(t *testing.T) {
	t.Parallel()
	n := New(t, FullCone, Symmetric, nil)
	s := n.Public.ListenUDP(t, "203.0.113.1:7001")
	a := n.A.Host.ListenUDP(t, "0.0.0.0:0")
	b := n.B.Host.ListenUDP(t, "0.0.0.0:0")
	ma := exchange(t, a, s)
	mb := exchange(t, b, s)
	assert.Equal(t, n.B.Router.Addr(), mb.Addr())
	_, err := b.WriteToUDPAddrPort([]byte("hello"), ma)
	require.NoError(t, err)
	buf := make([]byte, 64)
	require.NoError(t, a.SetReadDeadline(time.Now().Add(wait)))
	k, from, err := a.ReadFromUDPAddrPort(buf)
	require.NoError(t, err)
	assert.Equal(t, "hello", string(buf[:k]))
	assert.Equal(t, n.B.Router.Addr(), from.Addr(), "B's datagram comes from B's router")
}

// Run runs fn in the namespace, on a thread no other goroutine uses: a
// socket made there has the namespace's addresses, and the test's own
// goroutine stays in its namespace.
func TestNATRunStaysInNamespace(t *testing.T) {
	n := New(t, PortRestrictedCone, PortRestrictedCone, nil)
	var inside string
	require.NoError(t, n.A.Host.Run(func() error {
		b, err := os.ReadFile("/proc/thread-self/net/fib_trie")
		inside = string(b)
		return err
	}))
	assert.Contains(t, inside, "10.0.1.2")
	outside, err := os.ReadFile("/proc/thread-self/net/fib_trie")
	require.NoError(t, err)
	assert.NotContains(t, string(outside), "10.0.1.2")
	// A goroutine fn starts is not in the namespace.
	got := make(chan []byte, 1)
	require.NoError(t, n.A.Host.Run(func() error {
		go func() {
			b, _ := os.ReadFile("/proc/thread-self/net/fib_trie")
			got <- b
		}()
		return nil
	}))
	assert.NotContains(t, string(<-got), "10.0.1.2")
	// An error from fn is Run's.
	errFn := errors.New("from fn")
	assert.ErrorIs(t, n.A.Host.Run(func() error { return errFn }), errFn)
}

// The rules are what the package says each type is made of.
func TestNATRuleset(t *testing.T) {
	assert.Contains(t, ruleset(Symmetric, 10), "masquerade fully-random")
	assert.NotContains(t, ruleset(Symmetric, 10), conePort)
	for _, ty := range []Type{FullCone, RestrictedCone, PortRestrictedCone} {
		assert.Contains(t, ruleset(ty, 10), conePort, "a cone keeps the private port, or drops")
	}
	assert.Contains(t, ruleset(FullCone, 10), crossRule)
	assert.Contains(t, ruleset(RestrictedCone, 10), crossRule)
	assert.NotContains(t, ruleset(PortRestrictedCone, 10), "dnat")
	assert.Contains(t, ruleset(FullCone, 10), "dnat ip to udp dport map @mapped")
	assert.NotContains(t, ruleset(FullCone, 10), "@contacted dnat")
	assert.Contains(t, ruleset(RestrictedCone, 10), "udp dport . ip saddr @contacted dnat")
	assert.True(t, strings.Contains(ruleset(RestrictedCone, 3), "timeout 3s"))
	for _, ty := range Types {
		assert.Contains(t, ruleset(ty, 10), "iifname \"wan\" drop", "a firewall: nothing in for the router itself")
	}
}

// The routers forget an idle mapping after Options.MapTimeout: conntrack's
// UDP timeouts in their namespaces, and the cone sets' element timeouts.
func TestNATMapTimeout(t *testing.T) {
	t.Parallel()
	n := New(t, FullCone, Symmetric, &Options{MapTimeout: 3 * time.Second})
	for _, r := range []*Node{n.A.Router, n.B.Router} {
		for _, f := range []string{"nf_conntrack_udp_timeout", "nf_conntrack_udp_timeout_stream"} {
			var v []byte
			require.NoError(t, r.Run(func() (err error) {
				v, err = os.ReadFile("/proc/sys/net/netfilter/" + f)
				return err
			}))
			assert.Equal(t, "3", strings.TrimSpace(string(v)), "%s in %s", f, r.Name)
		}
	}
	out, err := exec.Command("ip", "netns", "exec", n.A.Router.Name, "nft", "list", "map", "ip", "nat", "mapped").CombinedOutput()
	require.NoError(t, err, "%s", out)
	assert.Contains(t, string(out), "timeout 3s")
	// And the host's own namespace keeps its settings.
	v, err := os.ReadFile("/proc/sys/net/netfilter/nf_conntrack_udp_timeout")
	if err == nil {
		assert.NotEqual(t, "3", strings.TrimSpace(string(v)))
	}
}

// With Options.Loss, a router drops about that share of what it
// forwards: of 400 datagrams at 50 %, far from all and far from none get
// through (the bounds are over 10 standard deviations out). The server
// reads until an end marker sent after them from the public network,
// which has no loss; one of the 400 overtaken by it only lowers the
// count by one.
func TestNATLoss(t *testing.T) {
	t.Parallel()
	n := New(t, PortRestrictedCone, PortRestrictedCone, &Options{Loss: 0.5})
	s := n.Public.ListenUDP(t, "203.0.113.1:7000")
	c := n.A.Host.ListenUDP(t, "0.0.0.0:0")
	to := s.LocalAddr().(*net.UDPAddr).AddrPort()
	const sent = 400
	for range sent {
		_, err := c.WriteToUDPAddrPort([]byte("x"), to)
		require.NoError(t, err)
	}
	// A server in the public network sends the end marker from the
	// router's side of the loss: the public network itself has none.
	end := n.Public.ListenUDP(t, "203.0.113.2:0")
	_, err := end.WriteToUDPAddrPort([]byte("end"), to)
	require.NoError(t, err)
	got := 0
	buf := make([]byte, 16)
	require.NoError(t, s.SetReadDeadline(time.Now().Add(wait)))
	for {
		k, _, err := s.ReadFromUDPAddrPort(buf)
		require.NoError(t, err)
		if string(buf[:k]) == "end" {
			break
		}
		got++
	}
	t.Logf("%d of %d got through at 50 %% loss", got, sent)
	assert.Greater(t, got, 100)
	assert.Less(t, got, 300)
	assert.Contains(t, lossRules(10), "numgen random mod 100 < 10 drop")
	assert.Empty(t, lossRules(0))
}

// A cone keeps a socket's private port for every datagram, even the one
// its host sends to a peer at the moment the peer's first datagram to it
// comes in (which the full cone's dnat lets in): two conntrack entries
// for one flow, made at once, where the plain masquerade gave the host's
// datagram another port, kept by no entry, and a peer answering there
// got nowhere (conePort). Each round, new sockets on both full-cone
// sites send to each other at once; every datagram that arrives comes
// from the other's one public port.
func TestNATConeKeepsPortWhenFlowsCross(t *testing.T) {
	t.Parallel()
	n := New(t, FullCone, FullCone, nil)
	s := n.Public.ListenUDP(t, "203.0.113.1:7001")
	rounds := 300
	if testing.Short() {
		rounds = 150
	}
	crossed := 0
	for i := range rounds {
		a := n.A.Host.ListenUDP(t, "0.0.0.0:0")
		b := n.B.Host.ListenUDP(t, "0.0.0.0:0")
		ma, mb := exchange(t, a, s), exchange(t, b, s) // each has its mapping
		var wg sync.WaitGroup
		start := make(chan struct{})
		for _, p := range [][2]any{{a, mb}, {b, ma}} {
			wg.Go(func() {
				<-start
				p[0].(*net.UDPConn).WriteToUDPAddrPort([]byte("x"), p[1].(netip.AddrPort))
			})
		}
		close(start)
		wg.Wait()
		// What came in by the end marker: the server's answer, which
		// follows the crossing datagrams by the same router.
		for _, r := range []struct {
			c    *net.UDPConn
			from netip.AddrPort
		}{{a, mb}, {b, ma}} {
			_, err := s.WriteToUDPAddrPort([]byte("end"), map[*net.UDPConn]netip.AddrPort{a: ma, b: mb}[r.c])
			require.NoError(t, err)
			buf := make([]byte, 16)
			require.NoError(t, r.c.SetReadDeadline(time.Now().Add(wait)))
			for {
				k, src, err := r.c.ReadFromUDPAddrPort(buf)
				require.NoError(t, err, "round %d: the end marker did not come", i)
				if string(buf[:k]) == "end" {
					break
				}
				crossed++
				require.Equal(t, r.from, src, "round %d: a datagram from another port than the peer's mapping", i)
			}
		}
		a.Close()
		b.Close()
	}
	t.Logf("%d datagrams of %d crossed and arrived from the peer's mapping", crossed, 2*rounds)
	assert.Greater(t, crossed, rounds, "most crossing datagrams arrive")
}
