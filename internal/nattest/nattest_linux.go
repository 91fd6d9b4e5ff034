//go:build linux

package nattest

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/knet-go/knet/internal/testtool"
)

// Type is a NAT's type: how it maps a private host's (address, port) to
// a public one, and whom it lets in to a mapped port.
type Type int

const (
	// FullCone maps a private (address, port) to one public port for
	// every destination, and lets anyone in to it.
	FullCone Type = iota + 1
	// RestrictedCone maps as FullCone does, and lets in any port of an
	// IP address the private host sent to.
	RestrictedCone
	// PortRestrictedCone maps as FullCone does, and lets in only the
	// (address, port) pairs the private host sent to.
	PortRestrictedCone
	// Symmetric maps each destination to a new public port, and lets in
	// only that destination, to that port.
	Symmetric
)

// Types are the four types, in order from the most open.
var Types = []Type{FullCone, RestrictedCone, PortRestrictedCone, Symmetric}

func (t Type) String() string {
	switch t {
	case FullCone:
		return "FullCone"
	case RestrictedCone:
		return "RestrictedCone"
	case PortRestrictedCone:
		return "PortRestrictedCone"
	case Symmetric:
		return "Symmetric"
	}
	return "Type(" + strconv.Itoa(int(t)) + ")"
}

// DefaultMapTimeout is how long a router keeps a mapping nothing went
// through, when Options leaves it zero: short, so that a connection's
// keepalives must hold it (knet pings every 5 s by default).
const DefaultMapTimeout = 10 * time.Second

// Options are a Net's settings; the zero value is the default.
type Options struct {
	// MapTimeout is how long a router keeps an idle mapping: the
	// conntrack UDP timeouts of its namespace, and the lifetime of the
	// cone types' learned ports and contacted addresses (refreshed by
	// each datagram going out). Zero: DefaultMapTimeout. Conntrack
	// counts in seconds: at least 1 s.
	MapTimeout time.Duration
	// Loss is the share of datagrams each router drops at random, in
	// both directions between its private network and the public one
	// (0 to 1, in whole percent): a lossy private link.
	Loss float64
}

// The fixed addresses (each Net's namespaces are its own).
var (
	// PublicAddrs are the public network's own addresses, for servers.
	PublicAddrs = []netip.Addr{
		netip.MustParseAddr("203.0.113.1"),
		netip.MustParseAddr("203.0.113.2"),
		netip.MustParseAddr("203.0.113.3"),
	}
	wanAddrs  = []netip.Addr{netip.MustParseAddr("203.0.113.11"), netip.MustParseAddr("203.0.113.12")}
	lanRouter = []netip.Addr{netip.MustParseAddr("10.0.1.1"), netip.MustParseAddr("10.0.2.1")}
	lanHost   = []netip.Addr{netip.MustParseAddr("10.0.1.2"), netip.MustParseAddr("10.0.2.2")}
)

// Node is one network namespace of a Net.
type Node struct {
	// Name is the namespace's name (ip netns): "ip netns exec Name ..."
	// runs a command in it while the test runs.
	Name string
	// Addrs are its addresses: the public network's three, a router's
	// WAN then LAN address, a private host's one.
	Addrs []netip.Addr
}

// Addr is the node's first address.
func (n *Node) Addr() netip.Addr { return n.Addrs[0] }

// Site is a private network behind a NAT router.
type Site struct {
	Type   Type
	Router *Node // WAN address (its public one) first
	Host   *Node // the private host
}

// Net is one test's networks: the public one and two private sites.
type Net struct {
	Public *Node
	A, B   *Site
	opts   Options
}

// seq numbers the Nets of this process; names carry the process ID too,
// so that test binaries running at once (go test ./... runs packages in
// parallel) never share a name.
var seq atomic.Uint64

// namePrefix starts every namespace this package makes.
const namePrefix = "knat"

// New builds a Net whose site A is behind a NAT of type a and site B
// behind one of type b, and removes it when t ends (t.Cleanup), failed or
// not. It skips t, naming what to install or how to run, when the
// machine cannot build it (not Linux as root, no ip or nft), or fails t
// with KNET_REQUIRE_TOOLS=1.
func New(t testing.TB, a, b Type, o *Options) *Net {
	t.Helper()
	Require(t)
	var opts Options
	if o != nil {
		opts = *o
	}
	if opts.MapTimeout == 0 {
		opts.MapTimeout = DefaultMapTimeout
	}
	sweepOnce.Do(sweep)
	prefix := fmt.Sprintf("%s%d-%d-", namePrefix, os.Getpid(), seq.Add(1))
	n := &Net{opts: opts}
	mk := func(role string, addrs ...netip.Addr) *Node {
		nd := &Node{Name: prefix + role, Addrs: addrs}
		if out, err := exec.Command("ip", "netns", "add", nd.Name).CombinedOutput(); err != nil {
			msg := strings.TrimSpace(string(out))
			if strings.Contains(msg, "ermission") || strings.Contains(msg, "not permitted") {
				testtool.Missing(t, "cannot make a network namespace ("+msg+"): the NAT tests need root with CAP_SYS_ADMIN")
			}
			t.Fatalf("nattest: ip netns add %s: %v: %s", nd.Name, err, msg)
		}
		// Deleting a namespace deletes its interfaces, and so the
		// veth pairs with an end in it.
		t.Cleanup(func() {
			if out, err := exec.Command("ip", "netns", "del", nd.Name).CombinedOutput(); err != nil {
				t.Errorf("nattest: ip netns del %s: %v: %s", nd.Name, err, out)
			}
		})
		run(t, "ip", "-n", nd.Name, "link", "set", "lo", "up")
		return nd
	}
	n.Public = mk("pub", PublicAddrs...)
	run(t, "ip", "-n", n.Public.Name, "link", "add", "br0", "type", "bridge")
	for _, ad := range PublicAddrs {
		run(t, "ip", "-n", n.Public.Name, "addr", "add", ad.String()+"/24", "dev", "br0")
	}
	run(t, "ip", "-n", n.Public.Name, "link", "set", "br0", "up")
	for i, ty := range []Type{a, b} {
		side := string(rune('a' + i))
		s := &Site{
			Type:   ty,
			Router: mk("r"+side, wanAddrs[i], lanRouter[i]),
			Host:   mk("h"+side, lanHost[i]),
		}
		r, h, pub := s.Router.Name, s.Host.Name, n.Public.Name
		port := "p" + side // the router's WAN link, on the public bridge
		run(t, "ip", "-n", r, "link", "add", "wan", "type", "veth", "peer", "name", port, "netns", pub)
		run(t, "ip", "-n", pub, "link", "set", port, "master", "br0", "up")
		run(t, "ip", "-n", r, "addr", "add", wanAddrs[i].String()+"/24", "dev", "wan")
		run(t, "ip", "-n", r, "link", "set", "wan", "up")
		run(t, "ip", "-n", r, "link", "add", "lan", "type", "veth", "peer", "name", "eth0", "netns", h)
		run(t, "ip", "-n", r, "addr", "add", lanRouter[i].String()+"/24", "dev", "lan")
		run(t, "ip", "-n", r, "link", "set", "lan", "up")
		run(t, "ip", "-n", h, "addr", "add", lanHost[i].String()+"/24", "dev", "eth0")
		run(t, "ip", "-n", h, "link", "set", "eth0", "up")
		run(t, "ip", "-n", h, "route", "add", "default", "via", lanRouter[i].String())
		n.router(t, s)
		if i == 0 {
			n.A = s
		} else {
			n.B = s
		}
	}
	return n
}

// Require skips t (or fails it, with KNET_REQUIRE_TOOLS=1) unless this
// process can build a Net: root, ip and nft. New calls it.
func Require(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		testtool.Missing(t, "not root: the NAT tests make network namespaces (run as root, e.g. sudo go test -run NAT ./...)")
	}
	testtool.Need(t, "ip", "apt-get install iproute2")
	testtool.Need(t, "nft", "apt-get install nftables")
}

// router makes s's router a NAT of its type: forwarding on, the nftables
// rules, the conntrack timeouts.
func (n *Net) router(t testing.TB, s *Site) {
	t.Helper()
	secs := max(1, int(n.opts.MapTimeout.Round(time.Second)/time.Second))
	rules := ruleset(s.Type, secs) + lossRules(int(n.opts.Loss*100+0.5))
	cmd := exec.Command("ip", "netns", "exec", s.Router.Name, "nft", "-f", "-")
	cmd.Stdin = strings.NewReader(rules)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("nattest: nft rules of a %v router: %v: %s\n%s", s.Type, err, out, rules)
	}
	// After the rules: they load conntrack, whose settings then exist
	// in the namespace.
	err := s.Router.Run(func() error {
		for _, w := range []struct{ file, val string }{
			{"/proc/sys/net/ipv4/ip_forward", "1"},
			{"/proc/sys/net/netfilter/nf_conntrack_udp_timeout", strconv.Itoa(secs)},
			{"/proc/sys/net/netfilter/nf_conntrack_udp_timeout_stream", strconv.Itoa(secs)},
		} {
			if err := os.WriteFile(w.file, []byte(w.val), 0); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("nattest: router %s: %v", s.Router.Name, err)
	}
}

// ruleset is the nftables rules of a router of type ty, mappings kept
// secs seconds. All four masquerade what leaves by the WAN link: Linux's
// NAT keeps the private port when it is free, the same for every
// destination (endpoint-independent mapping), and lets in only replies
// of a flow (conntrack): a port-restricted cone. The others change that:
//
//   - Symmetric: masquerade fully-random, a random port per flow, that
//     is per destination (address and port).
//   - FullCone: each outgoing flow's public port is learned, with the
//     private (address, port) it stands for (the map "mapped", in
//     postrouting after the NAT, original direction only), and a new
//     datagram from anyone to that public port is sent there (dnat).
//   - RestrictedCone: the same, the dnat gated by the set "contacted" of
//     (public port, remote address) the outgoing flows went to.
//
// The learned entries last secs after the last datagram out, as the
// flows in conntrack do.
//
// Every router drops what comes in by the WAN link for itself (nothing
// the NAT let in), as a home router's firewall does: conntrack then
// keeps no entry for the dropped datagram (an entry is kept only once a
// datagram passes its last hook). Without the drop, a peer's probe
// arriving before the host's own went out would leave an entry (the
// peer's address and port toward the router's) that makes the NAT give
// the host's outgoing flow to that peer another port, and that keeps a
// cone's dnat from being looked at again for the flow: punching would
// fail for whoever probed first, which no real NAT with a firewall does.
//
// A cone's UDP flows keep their private port, always (conePort): when
// a cone's host sends its first datagram to a peer at the moment the
// peer's first datagram to it comes in through the dnat, both flows'
// conntrack entries are made at once, and the plain masquerade would
// give the host's another port, found taken; its datagram then leaves
// from a port that no entry keeps (the clashing entry is not kept), and
// the peer, answering there, gets nowhere. A cone NAT has one mapping
// per private socket: the datagram that would have left from another
// port is dropped instead (the entry is not kept either), as a loss.
func ruleset(ty Type, secs int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "table ip nat {\n")
	masq := "masquerade"
	if ty == Symmetric {
		masq = "masquerade fully-random"
	}
	if ty == FullCone || ty == RestrictedCone {
		fmt.Fprintf(&b, "\tmap mapped { type inet_service : ipv4_addr . inet_service; flags dynamic, timeout; timeout %ds; size 65536; }\n", secs)
		fmt.Fprintf(&b, "\tset contacted { type inet_service . ipv4_addr; flags dynamic, timeout; timeout %ds; size 65536; }\n", secs)
	}
	fmt.Fprintf(&b, "\tchain post { type nat hook postrouting priority srcnat; policy accept;\n")
	if ty != Symmetric {
		// The private port, and no other: see conePort.
		fmt.Fprintf(&b, "\t\toifname \"wan\" meta l4proto udp %s\n", conePort)
	}
	fmt.Fprintf(&b, "\t\toifname \"wan\" %s\n\t}\n", masq)
	if ty == FullCone || ty == RestrictedCone {
		// After the NAT (srcnat is 100): udp sport is the public port.
		fmt.Fprintf(&b, "\tchain learn { type filter hook postrouting priority 300; policy accept;\n")
		fmt.Fprintf(&b, "\t\toifname \"wan\" ct direction original update @mapped { udp sport : ct original ip saddr . ct original proto-src }\n")
		fmt.Fprintf(&b, "\t\toifname \"wan\" ct direction original update @contacted { udp sport . ip daddr }\n\t}\n")
		fmt.Fprintf(&b, "\tchain pre { type nat hook prerouting priority dstnat; policy accept;\n")
		gate := ""
		if ty == RestrictedCone {
			gate = "udp dport . ip saddr @contacted "
		}
		fmt.Fprintf(&b, "\t\tiifname \"wan\" %sdnat ip to udp dport map @mapped\n\t}\n", gate)
	}
	fmt.Fprintf(&b, "}\n")
	fmt.Fprintf(&b, "table ip filter {\n\tchain input { type filter hook input priority filter; policy accept;\n")
	fmt.Fprintf(&b, "\t\tiifname \"wan\" drop\n\t}\n")
	if ty == FullCone || ty == RestrictedCone {
		// After the NAT: see crossRule.
		fmt.Fprintf(&b, "\tchain tolan { type filter hook postrouting priority 300; policy accept;\n\t\t%s\n\t}\n", crossRule)
	}
	fmt.Fprintf(&b, "}\n")
	return b.String()
}

// conePort is the cone types' NAT of UDP: masquerade, to the private
// port only (a range of one port, which the NAT never leaves).
const conePort = "masquerade to :udp sport"

// crossRule is the other half of a cone's flows crossing (see ruleset):
// a datagram that came in through the dnat while the host's own first
// datagram to its sender went out gets a new entry whose answer would be
// the host's flow, so the NAT gives it another source port (a source NAT
// of a flow that came in); that entry is not kept either, and a host
// answering the port it saw gets nowhere. It is dropped instead, as a
// loss: the sender's next datagram finds the host's flow.
const crossRule = `oifname "lan" ct direction original ct status snat drop`

// lossRules drops pct percent of what a router forwards, at random; none
// for 0.
func lossRules(pct int) string {
	if pct <= 0 {
		return ""
	}
	return fmt.Sprintf("table ip loss {\n\tchain forward { type filter hook forward priority filter; policy accept;\n\t\tnumgen random mod 100 < %d drop\n\t}\n}\n", pct)
}

// Run calls fn inside the node's network namespace, and returns its
// error, or why it could not run there.
//
// The rule: fn runs on a goroutine of its own, locked to its OS thread,
// which joins the namespace (setns) first and is never unlocked: when
// fn returns the goroutine ends locked, and the Go runtime ends the
// thread with it, so no other goroutine ever runs on a thread in the
// namespace. Only what fn does itself, on its goroutine, happens there:
// a socket it makes (net.ListenUDP, knet.Listen, knet.Dial) belongs to
// the namespace for good, and may then be used from any goroutine; a
// goroutine fn starts runs in the test's own namespace (the runtime
// makes new threads from a clean one), so work that makes sockets must
// not be left to one. fn must not call t.FailNow (t.Fatal, require):
// return an error instead.
func (n *Node) Run(fn func() error) error {
	f, err := os.Open("/run/netns/" + n.Name)
	if err != nil {
		return fmt.Errorf("nattest: namespace %s: %w", n.Name, err)
	}
	defer f.Close()
	done := make(chan error, 1)
	go func() {
		err := errors.New("nattest: fn did not return (runtime.Goexit: t.FailNow in Run?)")
		defer func() { done <- err }()
		runtime.LockOSThread() // never unlocked (see above)
		if e := unix.Setns(int(f.Fd()), unix.CLONE_NEWNET); e != nil {
			err = fmt.Errorf("nattest: setns %s: %w", n.Name, e)
			return
		}
		err = fn()
	}()
	return <-done
}

// ListenUDP opens a UDP socket at addr ("10.0.1.2:0", ":7000") in the
// node's namespace, closed when t ends.
func (n *Node) ListenUDP(t testing.TB, addr string) *net.UDPConn {
	t.Helper()
	var c *net.UDPConn
	err := n.Run(func() error {
		a, err := net.ResolveUDPAddr("udp4", addr)
		if err != nil {
			return err
		}
		c, err = net.ListenUDP("udp4", a)
		return err
	})
	if err != nil {
		t.Fatalf("nattest: listen %s in %s: %v", addr, n.Name, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// run runs a command, failing t with its output if it fails.
func run(t testing.TB, name string, args ...string) {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("nattest: %s %s: %v: %s", name, strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
}

var sweepOnce sync.Once

// sweep deletes the namespaces a test process that was killed left (its
// cleanups never ran): those named by this package for a process that no
// longer exists.
func sweep() {
	ents, err := os.ReadDir("/run/netns")
	if err != nil {
		return
	}
	for _, e := range ents {
		rest, ok := strings.CutPrefix(e.Name(), namePrefix)
		if !ok {
			continue
		}
		pidText, _, ok := strings.Cut(rest, "-")
		pid, err := strconv.Atoi(pidText)
		if !ok || err != nil || pid <= 0 {
			continue
		}
		if err := syscall.Kill(pid, 0); errors.Is(err, syscall.ESRCH) {
			exec.Command("ip", "netns", "del", e.Name()).Run()
		}
	}
}
