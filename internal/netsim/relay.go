package netsim

import (
	"errors"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
)

// socketBuffer is the kernel buffer the relay's sockets ask for, so that a
// burst is not dropped before its link decides its fate (the kernel may
// grant less).
const socketBuffer = 4 << 20

// Relay is a UDP proxy between clients and one server, with a Pipe for each
// direction of each client. Clients send to Addr; each gets its own socket
// towards the server.
type Relay struct {
	pc       *net.UDPConn
	server   netip.AddrPort
	up, down Params

	holeUp, holeDown atomic.Bool

	mu      sync.Mutex
	clients map[netip.AddrPort]*relayClient
	seed    uint64
	closed  bool
	wg      sync.WaitGroup
}

type relayClient struct {
	sock     *net.UDPConn
	toServer *Pipe
	toClient *Pipe
	upLink   *Link
	downLink *Link
}

// NewRelay listens on a loopback port and relays to server. up applies to
// datagrams from clients to the server, down to those back. Each client's
// links are seeded from the params' seeds plus its arrival order.
func NewRelay(server string, up, down Params) (*Relay, error) {
	sa, err := netip.ParseAddrPort(server)
	if err != nil {
		ua, err2 := net.ResolveUDPAddr("udp", server)
		if err2 != nil {
			return nil, err
		}
		sa = ua.AddrPort()
	}
	pc, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		return nil, err
	}
	pc.SetReadBuffer(socketBuffer)
	r := &Relay{pc: pc, server: sa, up: up, down: down, clients: make(map[netip.AddrPort]*relayClient)}
	r.wg.Add(1)
	go r.readClients()
	return r, nil
}

// Addr is where clients send.
func (r *Relay) Addr() net.Addr { return r.pc.LocalAddr() }

// Stats sums what the links of every client did, each way.
func (r *Relay) Stats() (up, down Stats) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, c := range r.clients {
		u, d := c.upLink.Stats(), c.downLink.Stats()
		up = addStats(up, u)
		down = addStats(down, d)
	}
	return up, down
}

func addStats(a, b Stats) Stats {
	a.Sent += b.Sent
	a.Delivered += b.Delivered
	a.Lost += b.Lost
	a.TooBig += b.TooBig
	a.QueueDrops += b.QueueDrops
	a.Duplicated += b.Duplicated
	a.Reordered += b.Reordered
	a.Corrupted += b.Corrupted
	a.Bytes += b.Bytes
	return a
}

func (r *Relay) readClients() {
	defer r.wg.Done()
	buf := make([]byte, 65536)
	for {
		n, from, err := r.pc.ReadFromUDPAddrPort(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		c := r.client(from)
		if c == nil {
			return
		}
		if !r.holeUp.Load() {
			c.toServer.Send(buf[:n], r.server)
		}
	}
}

func (r *Relay) client(from netip.AddrPort) *relayClient {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil
	}
	if c := r.clients[from]; c != nil {
		return c
	}
	sock, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(r.server))
	if err != nil {
		return nil
	}
	sock.SetReadBuffer(socketBuffer)
	r.seed++
	up, down := r.up, r.down
	up.Seed += r.seed
	down.Seed += r.seed * 7919
	c := &relayClient{sock: sock, upLink: NewLink(up), downLink: NewLink(down)}
	c.toServer = NewPipe(c.upLink, func(b []byte, _ netip.AddrPort) { sock.Write(b) })
	c.toClient = NewPipe(c.downLink, func(b []byte, to netip.AddrPort) { r.pc.WriteToUDPAddrPort(b, to) })
	r.clients[from] = c
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		buf := make([]byte, 65536)
		for {
			n, err := sock.Read(buf)
			if err != nil {
				if errors.Is(err, net.ErrClosed) {
					return
				}
				continue
			}
			if !r.holeDown.Load() {
				c.toClient.Send(buf[:n], from)
			}
		}
	}()
	return c
}

// Close stops the relay and everything in flight.
func (r *Relay) Close() error {
	r.mu.Lock()
	r.closed = true
	cs := r.clients
	r.clients = nil
	r.mu.Unlock()
	r.pc.Close()
	for _, c := range cs {
		c.sock.Close()
		c.toServer.Close()
		c.toClient.Close()
	}
	r.wg.Wait()
	return nil
}

// Blackhole drops everything in both directions while on, as if the path
// went dead; off, it carries datagrams again.
func (r *Relay) Blackhole(on bool) { r.Cut(on, on) }

// Cut drops what clients send to the server while up is set, and what
// comes back to them while down is: a path dead one way.
func (r *Relay) Cut(up, down bool) {
	r.holeUp.Store(up)
	r.holeDown.Store(down)
}
