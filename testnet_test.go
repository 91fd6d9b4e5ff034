package knet

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"reflect"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/netsim"
)

// testNet makes the tests' listeners, dialed connections and raw peers:
// over the system's UDP sockets on loopback (sysNet), or over a network in
// memory (memNet), for tests in a testing/synctest bubble. In a bubble no
// socket is touched, every wait is a channel or a timer, and time is the
// bubble's: a test of a minute's timeouts takes none, and synctest.Wait
// tells when every goroutine of the connections is idle.
type testNet struct {
	mem *netsim.Network // nil: the system's sockets
	// When connections park (Conn.park), and who hears of it; zero: the
	// -knet.park flag's, or the endpoint's second.
	parkAfter time.Duration
	parkHook  func(*Conn)
	// roundHook, if set, runs after each pass of a connection's round.
	roundHook func(*Conn)
	// wrapDial, if set, wraps each dialed socket of the network in memory.
	wrapDial func(socket) socket
}

// sysNet is the system's UDP sockets on loopback.
func sysNet() *testNet { return &testNet{} }

// memNet is a network in memory, for the test t running in a synctest
// bubble. A dialed socket sending where nothing listens reads
// errConnRefused next, as a connected UDP socket reads the system's
// report of an ICMP port unreachable.
//
// At the test's end, once the cleanups registered later have run (they
// close listeners and connections), it waits until every socket of the
// network is closed: a dialed connection's socket outlives its Close for
// a moment (endpoint.connDone), and the bubble's clock, which stops with
// the test's goroutine, must run until then. A socket still open a
// minute later, on that clock, fails the test: something leaked.
func memNet(t testing.TB) *testNet {
	n := &testNet{mem: netsim.NewNetwork()}
	n.mem.Refusal = errConnRefused
	t.Cleanup(func() { n.allClosed(t) })
	return n
}

// allClosed waits until every socket of the network in memory is closed,
// failing the test if one is still open a minute later on the bubble's
// clock.
func (n *testNet) allClosed(t testing.TB) {
	t.Helper()
	select {
	case <-n.mem.Empty():
	case <-time.After(time.Minute):
		t.Errorf("sockets left open: %v", n.mem.Open())
	}
}

// bubbleGoroutines returns the stacks of the package's goroutines in the
// caller's synctest bubble, bar the caller and the test's own. After
// synctest.Wait, what it finds is blocked for good, or waits on a timer.
func bubbleGoroutines() string {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	gs := strings.Split(string(buf), "\n\n")
	head, _, _ := strings.Cut(gs[0], "\n") // the caller's
	_, bubble, ok := strings.Cut(head, "synctest bubble ")
	if !ok {
		panic("bubbleGoroutines outside a bubble")
	}
	bubble = "synctest bubble " + bubble
	var out []string
	for _, g := range gs[1:] {
		head, _, _ := strings.Cut(g, "\n")
		if strings.Contains(head, bubble) && strings.Contains(g, "knet-go/knet") && !strings.Contains(g, "testing.tRunner") {
			out = append(out, g)
		}
	}
	return strings.Join(out, "\n\n")
}

var _ socket = (*netsim.Socket)(nil)

func (n *testNet) options() *endpointOptions {
	o := &endpointOptions{parkAfter: n.parkAfter, parkHook: n.parkHook, roundHook: n.roundHook}
	if o.parkAfter == 0 {
		o.parkAfter = *parkFlag
	}
	if n.mem == nil {
		return o
	}
	o.listen = func(_ string, laddr *net.UDPAddr, reuse bool) (socket, error) {
		if reuse {
			return nil, errors.New("knet: Config.Sockets above 1 on a network in memory")
		}
		s, err := n.mem.Listen(unmap(laddr.AddrPort()))
		if err != nil {
			return nil, err
		}
		return s, nil
	}
	o.dial = func(_ string, raddr *net.UDPAddr) (socket, error) {
		s, err := n.mem.Dial(netip.AddrPort{}, unmap(raddr.AddrPort()))
		if err != nil {
			return nil, err
		}
		if n.wrapDial != nil {
			return n.wrapDial(s), nil
		}
		return s, nil
	}
	return o
}

// Listen is Listen("udp", "127.0.0.1:0", cfg) on the network.
func (n *testNet) Listen(cfg *Config) (*Listener, error) {
	return listenWith("udp", "127.0.0.1:0", cfg, n.options())
}

// Dial is Dial(ctx, "udp", addr, cfg) on the network.
func (n *testNet) Dial(ctx context.Context, addr string, cfg *Config) (*Conn, error) {
	return dialWith(ctx, "udp", addr, cfg, n.options())
}

// listen opens a listener that the test's end closes.
func (n *testNet) listen(t testing.TB, cfg *Config) *Listener {
	t.Helper()
	l, err := n.Listen(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { l.Close() })
	return l
}

// dial connects to addr; the test's end closes the connection.
func (n *testNet) dial(t testing.TB, addr string, cfg *Config) *Conn {
	t.Helper()
	c, err := n.dialErr(t, addr, cfg)
	require.NoError(t, err)
	return c
}

// dialErr is dial for goroutines other than the test's, which may not
// call t.FailNow: it returns the error instead.
func (n *testNet) dialErr(t testing.TB, addr string, cfg *Config) (*Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := n.Dial(ctx, addr, cfg)
	if err != nil {
		return nil, err
	}
	t.Cleanup(func() { c.Close() })
	return c, nil
}

// parkWatch has the network's connections park after this much
// idleness, and reports each parking on the channel returned (what does
// not fit is not reported). Set it before the connections are made.
func (n *testNet) parkWatch(after time.Duration) <-chan *Conn {
	parked := make(chan *Conn, 64)
	n.parkAfter = after
	n.parkHook = func(c *Conn) {
		select {
		case parked <- c:
		default:
		}
	}
	return parked
}

// paths puts the datagrams from everyone else to the server at addr
// through a link with parameters up, and those from it through one with
// down, and returns the links, for their Stats. The network is in memory.
func (n *testNet) paths(server net.Addr, up, down netsim.Params) (upLink, downLink *netsim.Link) {
	a := unmap(server.(*net.UDPAddr).AddrPort())
	return n.mem.SetLink(netip.AddrPort{}, a, &up), n.mem.SetLink(a, netip.AddrPort{}, &down)
}

// rawConn is a socket connected to a server, for test peers that speak
// the wire themselves: a *net.UDPConn, or a *netsim.Socket in memory.
type rawConn interface {
	Write(b []byte) (int, error)
	Read(b []byte) (int, error)
	SetReadDeadline(t time.Time) error
	LocalAddr() net.Addr
	Close() error
}

// rawSocket opens a socket connected to addr, closed at the test's end.
func (n *testNet) rawSocket(t testing.TB, addr net.Addr) rawConn {
	t.Helper()
	var c rawConn
	if n.mem == nil {
		uc, err := net.DialUDP("udp", nil, addr.(*net.UDPAddr))
		require.NoError(t, err)
		c = uc
	} else {
		s, err := n.mem.Dial(netip.AddrPort{}, unmap(addr.(*net.UDPAddr).AddrPort()))
		require.NoError(t, err)
		c = s
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// forListen is cfg without the fields only Dial reads, and forDial cfg
// without those only a Listener reads (Config.checkSide): for a test whose
// two sides share their settings.
func forListen(cfg *Config) *Config { return withoutFields(cfg, dialFields) }

func forDial(cfg *Config) *Config { return withoutFields(cfg, listenFields) }

func withoutFields(cfg *Config, fields []string) *Config {
	if cfg == nil {
		return nil
	}
	c := *cfg
	v := reflect.ValueOf(&c).Elem()
	for _, f := range fields {
		v.FieldByName(f).SetZero()
	}
	return &c
}
