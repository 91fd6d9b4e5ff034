package knet

import (
	"net"
	"net/netip"

	"github.com/knet-go/knet/internal/udp"
)

// socket is what an endpoint needs of its datagram socket: batched reads
// that say where each datagram came from and whether it was cut short,
// batched writes, single writes, its address and Close. udpSocket is the
// system's UDP socket through internal/udp (recvmmsg/sendmmsg, GSO and
// GRO on Linux); the tests' in-memory network (internal/netsim.Network)
// is another, and so could be a net.PacketConn the application hands in.
//
// A socket is connected when it was made for one peer (Dial): it writes
// there whatever address a write names, and its reads may report the
// system's word that nothing listens at the peer's port (errConnRefused).
type socket interface {
	// ReadBatch reads at least one datagram into ps, and as many more as
	// are waiting, up to len(ps), and returns how many. Each packet's
	// Buf[:N] is then a datagram, Addr its sender, Trunc set if it did
	// not fit Buf. Only the endpoint's reader calls it. After Close it
	// returns an error wrapping net.ErrClosed; after other errors the
	// socket may be read again.
	ReadBatch(ps []udp.Packet) (int, error)
	// ReadWant is how many of max packets the next ReadBatch may fill:
	// the reader gives it buffers for only that many, so that a quiet
	// socket holds one.
	ReadWant(max int) int
	// WriteBatch writes every packet of ps to its Addr and sets each one's
	// Err; it returns the first error. w is the calling goroutine's state
	// for batches (udp.NewWriterSize), nil when ps holds one packet; a
	// socket without system batches ignores it. Several goroutines may
	// write at once, each with its own w.
	WriteBatch(w *udp.Writer, ps []udp.Packet) error
	// WriteTo writes one datagram.
	WriteTo(b []byte, to netip.AddrPort) error
	// LocalAddr returns the socket's address, a *net.UDPAddr.
	LocalAddr() net.Addr
	// Close closes the socket; a ReadBatch waiting returns.
	Close() error
}

var _ socket = (*udpSocket)(nil)

// udpSocket is a socket of the system, read and written in batches by
// internal/udp. It holds the one reader's state.
type udpSocket struct {
	pc        *net.UDPConn
	uc        *udp.Conn
	r         *udp.Reader
	connected bool // Write, not WriteTo
}

// newUDPSocket wraps pc, asking for socketBuffer each way. A connected
// socket (net.DialUDP) writes without addresses.
func newUDPSocket(pc *net.UDPConn, connected bool) *udpSocket {
	pc.SetReadBuffer(socketBuffer)
	pc.SetWriteBuffer(socketBuffer)
	uc := udp.New(pc, connected)
	return &udpSocket{pc: pc, uc: uc, r: uc.NewReader(), connected: connected}
}

// socketBuffer is the kernel buffer size asked for, each way; the kernel
// may grant less (net.core.rmem_max, wmem_max on Linux).
const socketBuffer = 4 << 20

func (s *udpSocket) ReadBatch(ps []udp.Packet) (int, error) { return s.uc.ReadBatch(s.r, ps) }

func (s *udpSocket) ReadWant(max int) int { return s.r.Want(max) }

func (s *udpSocket) WriteBatch(w *udp.Writer, ps []udp.Packet) error {
	if len(ps) == 1 {
		return s.uc.WriteOne(&ps[0]) // the plain call: no batch state
	}
	_, err := s.uc.WriteBatch(w, ps)
	return err
}

func (s *udpSocket) WriteTo(b []byte, to netip.AddrPort) error {
	var err error
	if s.connected {
		_, err = s.pc.Write(b)
	} else {
		_, err = s.pc.WriteToUDPAddrPort(b, to)
	}
	return err
}

func (s *udpSocket) LocalAddr() net.Addr { return s.pc.LocalAddr() }

func (s *udpSocket) Close() error { return s.pc.Close() }
