// Package udp moves datagrams in batches: on Linux one sendmmsg or
// recvmmsg system call carries many, runs of equal-sized datagrams to one
// peer go down the stack as one UDP_SEGMENT (GSO) message, and a socket
// receiving a bulk stream takes UDP_GRO so that such runs arrive whole;
// elsewhere a loop of single calls does the same job. Nothing is allocated
// per datagram or per call.
package udp

import (
	"net"
	"net/netip"
)

// Packet is one datagram in a batch.
type Packet struct {
	// Buf holds the datagram to write, or the buffer to read into; after
	// a read, Buf[:N] is the datagram.
	Buf []byte
	N   int
	// Addr is the peer: where to write (ignored on a connected socket),
	// or where a read datagram came from.
	Addr netip.AddrPort
	// Trunc is set when a read datagram did not fit Buf.
	Trunc bool
	// Err is set by WriteBatch: why this datagram did not go out, or nil
	// if it did.
	Err error
}

// MaxBatch is the most datagrams one call moves.
const MaxBatch = 64

// Conn batches the I/O of a UDP socket. ReadBatch may be called by one
// goroutine at a time; WriteBatch by several at once, each with its own
// Writer.
type Conn struct {
	pc        *net.UDPConn
	connected bool
	v6        bool // an AF_INET6 socket
	sys       sysConn
}

// New wraps pc. A connected socket (net.DialUDP) writes without
// addresses.
func New(pc *net.UDPConn, connected bool) *Conn {
	c := &Conn{pc: pc, connected: connected}
	if a, ok := pc.LocalAddr().(*net.UDPAddr); ok && a.IP.To4() == nil {
		c.v6 = true
	}
	c.sys.init(c)
	return c
}

// Reader is the state of one reading goroutine.
type Reader struct {
	sys sysReader
}

// NewReader returns the state for reading batches of up to MaxBatch.
func (c *Conn) NewReader() *Reader {
	r := &Reader{}
	r.sys.init(c)
	return r
}

// Writer is the state of one writing goroutine.
type Writer struct {
	sys  sysWriter
	size int
}

// NewWriter returns the state for writing batches of up to MaxBatch.
func (c *Conn) NewWriter() *Writer { return NewWriterSize(MaxBatch) }

// NewWriterSize returns the state for writing batches of up to n
// datagrams a call (1 to MaxBatch); a longer batch takes more calls. The
// state is about 140 bytes a datagram. It belongs to no Conn: a writing
// goroutine may use it with any.
func NewWriterSize(n int) *Writer {
	w := &Writer{size: min(max(n, 1), MaxBatch)}
	w.sys.init(w.size)
	return w
}

// Size is how many datagrams w writes a call.
func (w *Writer) Size() int { return w.size }

// Want is how many of max packets the next ReadBatch may fill: 1 while
// the reader takes datagrams one at a time, so that a quiet socket need
// not hold a batch of buffers.
func (r *Reader) Want(max int) int { return r.sys.want(max) }

// ReadBatch reads at least one datagram into ps, as many as are ready, and
// returns how many.
func (c *Conn) ReadBatch(r *Reader, ps []Packet) (int, error) {
	return c.sys.readBatch(&r.sys, ps)
}

// WriteBatch writes every packet in ps. A datagram the system refuses (an
// ICMP error reported on a connected socket, no route, a full buffer) does
// not keep the others from going out: it returns how many went out and the
// first error met, and each packet's Err says what became of it.
func (c *Conn) WriteBatch(w *Writer, ps []Packet) (int, error) {
	for i := range ps {
		ps[i].Err = nil
	}
	return c.sys.writeBatch(&w.sys, ps)
}

// WriteOne writes one packet, as WriteBatch would, with no Writer: a
// single datagram needs no batch state.
func (c *Conn) WriteOne(p *Packet) error {
	p.Err = c.writeOne(p)
	return p.Err
}

// portable is the loop of single calls, for systems without batches and
// as the fallback.
func (c *Conn) readOne(p *Packet) error {
	n, addr, err := c.pc.ReadFromUDPAddrPort(p.Buf)
	if err != nil {
		return err
	}
	p.N = n
	p.Addr = addr
	p.Trunc = n == len(p.Buf)
	return nil
}

func (c *Conn) writeOne(p *Packet) error {
	if c.connected {
		_, err := c.pc.Write(p.Buf)
		return err
	}
	_, err := c.pc.WriteToUDPAddrPort(p.Buf, p.Addr)
	return err
}

// netInterfaceIndex resolves an IPv6 zone (rare: link-local peers).
func netInterfaceIndex(zone string) (int, error) {
	ifi, err := net.InterfaceByName(zone)
	if err != nil {
		return 0, err
	}
	return ifi.Index, nil
}
