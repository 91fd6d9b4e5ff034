package netsim

import (
	"container/heap"
	"errors"
	"net"
	"net/netip"
	"os"
	"sync"
	"time"

	"github.com/knet-go/knet/internal/udp"
)

// Network is a network of datagram sockets in memory: no system calls,
// every wait a channel operation and every delay a timer. Under
// testing/synctest a reader waiting on an idle socket is durably blocked
// and the bubble's fake clock runs the paths' delays, so that a test of
// minutes takes none; a Network must then be made, used and closed in one
// bubble. Each direction between two sockets is a perfect path unless
// SetLink gives it a Link.
//
// A Network is safe for concurrent use.
type Network struct {
	// Refusal, if set, is what a connected socket's next read returns
	// after it sent to an address where no socket is, as the system
	// reports an ICMP port unreachable (syscall.ECONNREFUSED).
	Refusal error
	// QueueLen is how many datagrams a socket holds unread before it
	// drops what comes (default 1024), as a socket's buffer does.
	QueueLen int

	mu    sync.Mutex
	socks map[netip.AddrPort]*Socket
	links map[[2]netip.AddrPort]*Link
	port  uint16 // the last port handed out
	q     pending
	seq   uint64
	timer *time.Timer // for the head of q
	stats NetworkStats
	empty chan struct{} // closed while no socket is open
}

// NetworkStats count what the network did with datagrams, besides what
// links did.
type NetworkStats struct {
	Delivered uint64 // handed to a socket's queue
	Unbound   uint64 // to an address with no socket
	Overflow  uint64 // dropped at a full queue
	Filtered  uint64 // dropped by a connected socket: not from its peer
}

// NewNetwork returns an empty network.
func NewNetwork() *Network {
	n := &Network{socks: make(map[netip.AddrPort]*Socket), links: make(map[[2]netip.AddrPort]*Link), port: 40000}
	n.empty = make(chan struct{})
	close(n.empty)
	return n
}

// Empty returns a channel closed once no socket of the network is open:
// everything that used it has closed its sockets.
func (n *Network) Empty() <-chan struct{} {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.empty
}

// Open returns the addresses of the sockets open.
func (n *Network) Open() []netip.AddrPort {
	n.mu.Lock()
	defer n.mu.Unlock()
	var as []netip.AddrPort
	for a := range n.socks {
		as = append(as, a)
	}
	return as
}

var (
	errAddrInUse = errors.New("netsim: address already in use")
	loopback     = netip.AddrFrom4([4]byte{127, 0, 0, 1})
)

// Listen opens a socket at addr: an unspecified address is 127.0.0.1,
// port 0 a port of the network's choosing.
func (n *Network) Listen(addr netip.AddrPort) (*Socket, error) {
	return n.open(addr, netip.AddrPort{})
}

// Dial opens a socket connected to raddr, at laddr if it is valid and
// otherwise at 127.0.0.1 and a port of the network's choosing: it sends
// only to raddr and takes datagrams only from it.
func (n *Network) Dial(laddr, raddr netip.AddrPort) (*Socket, error) {
	return n.open(laddr, raddr)
}

func (n *Network) open(addr, peer netip.AddrPort) (*Socket, error) {
	a := addr.Addr()
	if !a.IsValid() || a.IsUnspecified() {
		a = loopback
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	port := addr.Port()
	if port == 0 {
		for {
			n.port++
			if n.port == 0 {
				n.port = 1024
			}
			if n.socks[netip.AddrPortFrom(a, n.port)] == nil {
				break
			}
		}
		port = n.port
	}
	addr = netip.AddrPortFrom(a, port)
	if n.socks[addr] != nil {
		return nil, errAddrInUse
	}
	qlen := n.QueueLen
	if qlen <= 0 {
		qlen = 1024
	}
	s := &Socket{
		n:      n,
		addr:   addr,
		peer:   peer,
		in:     make(chan inDatagram, qlen),
		refuse: make(chan struct{}, 1),
		closed: make(chan struct{}),
	}
	if len(n.socks) == 0 {
		n.empty = make(chan struct{})
	}
	n.socks[addr] = s
	return s, nil
}

// SetLink puts datagrams from from to to through a Link with parameters
// p, or, with p nil, back on a perfect path. A zero address matches any:
// a datagram takes the link of its exact pair, else its sender's, else
// its receiver's, else the wildcard's. It returns the link, for its
// Stats.
func (n *Network) SetLink(from, to netip.AddrPort, p *Params) *Link {
	n.mu.Lock()
	defer n.mu.Unlock()
	k := [2]netip.AddrPort{from, to}
	if p == nil {
		delete(n.links, k)
		return nil
	}
	l := NewLink(*p)
	n.links[k] = l
	return l
}

// Stats returns what the network did so far.
func (n *Network) Stats() NetworkStats {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.stats
}

// link returns the link from from to to, nil for a perfect path.
func (n *Network) link(from, to netip.AddrPort) *Link {
	if len(n.links) == 0 {
		return nil
	}
	var any netip.AddrPort
	for _, k := range [...][2]netip.AddrPort{{from, to}, {from, any}, {any, to}, {any, any}} {
		if l := n.links[k]; l != nil {
			return l
		}
	}
	return nil
}

// send puts a copy of b on the path from s to to.
func (n *Network) send(s *Socket, b []byte, to netip.AddrPort) {
	n.mu.Lock()
	defer n.mu.Unlock()
	l := n.link(s.addr, to)
	if l == nil {
		n.deliver(s, append([]byte(nil), b...), to)
		return
	}
	now := time.Now()
	f := l.Decide(now, len(b))
	for _, d := range f.After {
		c := append([]byte(nil), b...)
		if f.Flip >= 0 {
			c[f.Flip] ^= 0xff
		}
		if d <= 0 {
			n.deliver(s, c, to)
			continue
		}
		n.seq++
		heap.Push(&n.q, item{at: now.Add(d), seq: n.seq, b: c, to: to, from: s})
		if n.q[0].seq == n.seq {
			n.arm(now)
		}
	}
}

// arm sets the timer for the head of the queue; n.mu is held.
func (n *Network) arm(now time.Time) {
	d := n.q[0].at.Sub(now)
	if n.timer == nil {
		n.timer = time.AfterFunc(d, n.due)
		return
	}
	n.timer.Reset(d)
}

// due delivers what the paths held until now.
func (n *Network) due() {
	n.mu.Lock()
	defer n.mu.Unlock()
	now := time.Now()
	for n.q.Len() > 0 && !n.q[0].at.After(now) {
		it := heap.Pop(&n.q).(item)
		n.deliver(it.from, it.b, it.to)
	}
	if n.q.Len() > 0 {
		n.arm(now)
	}
}

// Broadcast is the address whose datagrams reach every socket bound to
// their port that is not connected, whatever its address: the network is
// one LAN, and this its limited broadcast address.
var Broadcast = netip.AddrFrom4([4]byte{255, 255, 255, 255})

// deliver hands b, from from, to the socket at to; n.mu is held. It never
// blocks: a full queue drops.
func (n *Network) deliver(from *Socket, b []byte, to netip.AddrPort) {
	if to.Addr() == Broadcast {
		for a, d := range n.socks {
			if a.Port() == to.Port() && !d.peer.IsValid() && d != from {
				n.deliver(from, b, a)
			}
		}
		return
	}
	d := n.socks[to]
	if d == nil {
		n.stats.Unbound++
		if from.peer.IsValid() && n.Refusal != nil && n.socks[from.addr] == from {
			select {
			case from.refuse <- struct{}{}:
			default:
			}
		}
		return
	}
	if d.peer.IsValid() && d.peer != from.addr {
		n.stats.Filtered++
		return
	}
	select {
	case d.in <- inDatagram{b: b, from: from.addr}:
		n.stats.Delivered++
	default:
		n.stats.Overflow++
	}
}

type inDatagram struct {
	b    []byte
	from netip.AddrPort
}

// Socket is a datagram socket of a Network. Its batch methods are what
// knet's endpoint needs of a socket; Read, Write, ReadFrom, WriteTo and
// SetReadDeadline serve test peers that speak the wire themselves.
//
// A Socket is safe for concurrent use, but only one goroutine may read.
type Socket struct {
	n      *Network
	addr   netip.AddrPort
	peer   netip.AddrPort // a connected socket's; invalid otherwise
	in     chan inDatagram
	refuse chan struct{} // capacity 1: a refusal to report
	closed chan struct{}
	once   sync.Once

	mu       sync.Mutex
	deadline chan struct{} // closed when the read deadline passes; nil if none
	dlTimer  *time.Timer
}

// Addr is the socket's address.
func (s *Socket) Addr() netip.AddrPort { return s.addr }

// LocalAddr is the socket's address as a *net.UDPAddr.
func (s *Socket) LocalAddr() net.Addr { return net.UDPAddrFromAddrPort(s.addr) }

// RemoteAddr is a connected socket's peer, or nil.
func (s *Socket) RemoteAddr() net.Addr {
	if !s.peer.IsValid() {
		return nil
	}
	return net.UDPAddrFromAddrPort(s.peer)
}

// Close closes the socket: what waits in it and what is on its way to it
// is dropped, and a read in progress returns net.ErrClosed. It is
// idempotent.
func (s *Socket) Close() error {
	s.once.Do(func() {
		s.n.mu.Lock()
		if s.n.socks[s.addr] == s {
			delete(s.n.socks, s.addr)
			if len(s.n.socks) == 0 {
				close(s.n.empty)
			}
		}
		s.n.mu.Unlock()
		close(s.closed)
		s.mu.Lock()
		if s.dlTimer != nil {
			s.dlTimer.Stop()
		}
		s.mu.Unlock()
	})
	return nil
}

func (s *Socket) isClosed() bool {
	select {
	case <-s.closed:
		return true
	default:
		return false
	}
}

// errClosed is what I/O on a closed socket returns.
var errClosed = &net.OpError{Op: "use", Net: "netsim", Err: net.ErrClosed}

// WriteTo sends b to to (to the peer, on a connected socket).
func (s *Socket) WriteTo(b []byte, to netip.AddrPort) error {
	if s.isClosed() {
		return errClosed
	}
	if s.peer.IsValid() {
		to = s.peer
	}
	s.n.send(s, b, to)
	return nil
}

// Write sends b to a connected socket's peer.
func (s *Socket) Write(b []byte) (int, error) {
	if !s.peer.IsValid() {
		return 0, errors.New("netsim: write on a socket not connected")
	}
	if err := s.WriteTo(b, s.peer); err != nil {
		return 0, err
	}
	return len(b), nil
}

// WriteBatch sends each packet to its Addr, as WriteTo, setting its Err.
// w is not used: there are no system calls to batch.
func (s *Socket) WriteBatch(w *udp.Writer, ps []udp.Packet) error {
	var first error
	for i := range ps {
		ps[i].Err = s.WriteTo(ps[i].Buf, ps[i].Addr)
		if first == nil {
			first = ps[i].Err
		}
	}
	return first
}

// ReadWant is max when datagrams wait beyond the next, and otherwise 1.
func (s *Socket) ReadWant(max int) int {
	if len(s.in) > 1 {
		return max
	}
	return min(max, 1)
}

// ReadBatch waits for a datagram and reads it and those waiting behind
// it into ps, up to len(ps).
func (s *Socket) ReadBatch(ps []udp.Packet) (int, error) {
	if len(ps) == 0 {
		return 0, nil
	}
	d, err := s.next()
	if err != nil {
		return 0, err
	}
	fill(&ps[0], d)
	k := 1
	for k < len(ps) {
		select {
		case d := <-s.in:
			fill(&ps[k], d)
			k++
		default:
			return k, nil
		}
	}
	return k, nil
}

func fill(p *udp.Packet, d inDatagram) {
	p.N = copy(p.Buf, d.b)
	p.Trunc = p.N < len(d.b)
	p.Addr = d.from
}

// ReadFrom reads one datagram into b, cut to fit, and says who sent it.
func (s *Socket) ReadFrom(b []byte) (int, netip.AddrPort, error) {
	d, err := s.next()
	if err != nil {
		return 0, netip.AddrPort{}, err
	}
	return copy(b, d.b), d.from, nil
}

// Read reads one datagram into b, cut to fit.
func (s *Socket) Read(b []byte) (int, error) {
	n, _, err := s.ReadFrom(b)
	return n, err
}

// next waits for a datagram, the socket's close, a refusal to report or
// the read deadline.
func (s *Socket) next() (inDatagram, error) {
	s.mu.Lock()
	dl := s.deadline
	s.mu.Unlock()
	select {
	case <-s.closed:
		return inDatagram{}, errClosed
	default:
	}
	select {
	case d := <-s.in:
		return d, nil
	case <-s.refuse:
		return inDatagram{}, s.n.Refusal
	case <-s.closed:
		return inDatagram{}, errClosed
	case <-dl:
		return inDatagram{}, os.ErrDeadlineExceeded
	}
}

// SetReadDeadline sets when reads stop waiting, with
// os.ErrDeadlineExceeded; the zero time waits for ever. It applies to a
// read waiting already only from its next call.
func (s *Socket) SetReadDeadline(t time.Time) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.dlTimer != nil {
		s.dlTimer.Stop()
		s.dlTimer = nil
	}
	s.deadline = nil
	if t.IsZero() {
		return nil
	}
	ch := make(chan struct{})
	s.deadline = ch
	d := time.Until(t)
	if d <= 0 {
		close(ch)
		return nil
	}
	s.dlTimer = time.AfterFunc(d, func() { close(ch) })
	return nil
}
