package main

import (
	"errors"
	"net"
	"net/netip"
	"sync"
	"syscall"

	"github.com/knet-go/knet"
)

// relay forwards UDP datagrams between the clients that reach its front
// socket and a target, one socket of its own towards the target per
// client, and describes each datagram as it passes (-trace). knet owns
// its sockets; the relay sees their traffic without a hook in the
// library.
//
// In connect mode the front's one client is knetcat's own Conn and the
// target the peer; in listen mode the front is the -l address, its
// clients the peers, and the target knetcat's Listener on loopback.
type relay struct {
	front    *net.UDPConn
	target   *net.UDPAddr
	outbound bool // connect mode: what comes to the front goes out to the peer
	dialect  knet.Dialect
	logf     func(format string, args ...any)

	mu     sync.Mutex
	flows  map[netip.AddrPort]*flow
	byUp   map[netip.AddrPort]netip.AddrPort // a flow's socket towards the target, to its client
	closed bool
	wg     sync.WaitGroup
}

// flow is one client's traffic through the relay.
type flow struct {
	client  netip.AddrPort
	up      *net.UDPConn // towards the target
	dialect knet.Dialect // set before the flow's goroutine starts
}

// maxFlows bounds the clients one relay forwards for.
const maxFlows = 4096

func newRelay(listen string, target *net.UDPAddr, outbound bool, d knet.Dialect, logf func(string, ...any)) (*relay, error) {
	la, err := net.ResolveUDPAddr("udp", listen)
	if err != nil {
		return nil, err
	}
	front, err := net.ListenUDP("udp", la)
	if err != nil {
		return nil, err
	}
	r := &relay{front: front, target: target, outbound: outbound, dialect: d, logf: logf,
		flows: map[netip.AddrPort]*flow{}, byUp: map[netip.AddrPort]netip.AddrPort{}}
	r.wg.Go(r.frontLoop)
	return r, nil
}

// Addr is the front's address.
func (r *relay) Addr() net.Addr { return r.front.LocalAddr() }

// ClientOf returns the client whose traffic reaches the target from
// addr, one of the relay's own sockets.
func (r *relay) ClientOf(addr net.Addr) (netip.AddrPort, bool) {
	ua, ok := addr.(*net.UDPAddr)
	if !ok {
		return netip.AddrPort{}, false
	}
	ap := ua.AddrPort()
	r.mu.Lock()
	defer r.mu.Unlock()
	c, ok := r.byUp[netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())]
	return c, ok
}

// Close stops forwarding and waits for the relay's goroutines.
func (r *relay) Close() error {
	r.mu.Lock()
	r.closed = true
	for _, f := range r.flows {
		f.up.Close()
	}
	r.mu.Unlock()
	err := r.front.Close()
	r.wg.Wait()
	return err
}

func (r *relay) isClosed() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.closed
}

// frontLoop forwards what the clients send.
func (r *relay) frontLoop() {
	buf := make([]byte, 65536)
	for {
		n, from, err := r.front.ReadFromUDPAddrPort(buf)
		if err != nil {
			if r.isClosed() || !errors.Is(err, syscall.ECONNREFUSED) {
				return
			}
			continue
		}
		b := buf[:n]
		from = netip.AddrPortFrom(from.Addr().Unmap(), from.Port())
		f := r.flow(from, b)
		if f == nil {
			continue
		}
		r.describe(f, !r.outbound, b)
		f.up.Write(b) // a datagram the system refuses is lost, as on any path
	}
}

// flow returns the client's flow, opening it for its first datagram b.
func (r *relay) flow(client netip.AddrPort, b []byte) *flow {
	r.mu.Lock()
	defer r.mu.Unlock()
	if f := r.flows[client]; f != nil || r.closed {
		return f
	}
	if len(r.flows) >= maxFlows {
		return nil
	}
	up, err := net.DialUDP("udp", nil, r.target)
	if err != nil {
		r.logf("trace relay: %v", err)
		return nil
	}
	f := &flow{client: client, up: up, dialect: r.dialect}
	if f.dialect == knet.DialectAuto {
		// What a Listener does: a flow opened by the reference's 8
		// zero bytes speaks its dialect, any other the spec's.
		f.dialect = knet.DialectSpec
		if len(b) == 8 && string(b) == "\x00\x00\x00\x00\x00\x00\x00\x00" {
			f.dialect = knet.DialectReference
		}
	}
	r.flows[client] = f
	la := up.LocalAddr().(*net.UDPAddr).AddrPort()
	r.byUp[netip.AddrPortFrom(la.Addr().Unmap(), la.Port())] = client
	r.wg.Go(func() { r.upLoop(f) })
	return f
}

// upLoop forwards what the target sends to one client.
func (r *relay) upLoop(f *flow) {
	buf := make([]byte, 65536)
	for {
		n, err := f.up.Read(buf)
		if err != nil {
			if r.isClosed() {
				return
			}
			if errors.Is(err, syscall.ECONNREFUSED) {
				r.logf("trace %s: port unreachable", r.peerName(f))
				continue
			}
			return
		}
		b := buf[:n]
		r.describe(f, r.outbound, b)
		r.front.WriteToUDPAddrPort(b, f.client)
	}
}

// peerName is the remote peer of a flow: the target in connect mode, the
// client in listen mode.
func (r *relay) peerName(f *flow) string {
	if r.outbound {
		return r.target.String()
	}
	return f.client.String()
}

// describe prints one datagram; in tells whether it comes from the peer.
func (r *relay) describe(f *flow, in bool, b []byte) {
	dir := "out to"
	if in {
		dir = "in from"
	}
	r.logf("trace %s %s: %s", dir, r.peerName(f), knet.DescribeDatagram(b, f.dialect))
}
