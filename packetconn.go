package knet

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync/atomic"
	"time"

	"github.com/knet-go/knet/internal/udp"
)

// Bring your own socket: a Listener, or a dialed Conn, over a socket the
// application made (a host port bound in advance, one a fleet manager
// hands over, a relay's).

// ListenPacket accepts kNet connections on pc, as Listen does on the
// socket it opens. A *net.UDPConn is read and written in batches, as
// Listen's sockets are (recvmmsg and sendmmsg on Linux), and its kernel
// buffers are raised as theirs; any other net.PacketConn a datagram at a
// time, through ReadFrom and WriteTo, with the peer's address a
// *net.UDPAddr: ReadFrom must report senders as *net.UDPAddr (or as
// addresses whose String is an IP and port; a datagram from any other is
// dropped and counted in InvalidDatagrams), and Close must unblock a
// ReadFrom waiting, as the net.PacketConn contract has it.
//
// The Listener owns pc from the call on: its Close closes pc, and so does
// ListenPacket if it fails. Its deadlines are cleared. pc must not be
// connected (net.DialUDP). Config.Sockets above 1 is an error: the
// Listener serves the one socket it is given.
func ListenPacket(pc net.PacketConn, cfg *Config) (*Listener, error) {
	return listenPacketWith(pc, cfg, &endpointOptions{})
}

// listenPacketWith is ListenPacket with the endpoint's options (tests).
func listenPacketWith(pc net.PacketConn, cfg *Config, o *endpointOptions) (*Listener, error) {
	if pc == nil {
		return nil, errors.New("knet: ListenPacket on a nil net.PacketConn")
	}
	fail := func(err error) (*Listener, error) {
		pc.Close()
		return nil, err
	}
	rc, err := cfg.resolveListener()
	if err != nil {
		return fail(err)
	}
	if rc.http != nil {
		return fail(errors.New("knet: Config.HTTP is served on a Listener's TCP port, and ListenPacket has none"))
	}
	if rc.sockets > 1 {
		return fail(fmt.Errorf("knet: Config.Sockets is %d, but ListenPacket serves the one socket it is given", rc.sockets))
	}
	if uc, ok := pc.(*net.UDPConn); ok && uc.RemoteAddr() != nil {
		return fail(errors.New("knet: ListenPacket on a connected UDP socket"))
	}
	sock := packetSocketFor(pc, false)
	laddr, ok := sock.LocalAddr().(*net.UDPAddr)
	if !ok {
		// No IP and port to name the server by: a listener taking
		// connect tokens then needs Config.PublicAddrs.
		laddr = &net.UDPAddr{IP: net.IPv4zero}
		if a, ok := addrPortOf(sock.LocalAddr()); ok {
			laddr = net.UDPAddrFromAddrPort(a)
		}
	}
	return startListener(rc, laddr, []socket{sock}, o) // which closes sock if it fails
}

// DialPacket connects to a kNet server at address (a UDP host and port)
// over pc, as Dial does over the socket it opens, and returns once the
// handshake is complete. pc is used as ListenPacket uses it: a
// *net.UDPConn in batches, any other net.PacketConn a datagram at a time,
// with *net.UDPAddr addresses. Datagrams pc receives from other
// addresses than the server's are not the connection's: a Disconnect
// among them is answered, the rest dropped.
//
// The Conn owns pc from the call on: pc is closed when the connection
// ends (a moment after Close, as Dial's socket), and by DialPacket if it
// fails. A *net.UDPConn connected to the server (net.DialUDP) may be
// given; it writes only there.
func DialPacket(ctx context.Context, pc net.PacketConn, address string, cfg *Config) (*Conn, error) {
	return dialPacketWith(ctx, pc, address, cfg, &endpointOptions{})
}

// dialPacketWith is DialPacket with the endpoint's options (tests).
func dialPacketWith(ctx context.Context, pc net.PacketConn, address string, cfg *Config, o *endpointOptions) (*Conn, error) {
	if pc == nil {
		return nil, errors.New("knet: DialPacket on a nil net.PacketConn")
	}
	if ctx == nil {
		pc.Close()
		return nil, errNilContext
	}
	rc, raddr, err := dialTarget("udp", address, cfg)
	if err != nil {
		pc.Close()
		return nil, err
	}
	connected := false
	if uc, ok := pc.(*net.UDPConn); ok {
		connected = uc.RemoteAddr() != nil
	}
	sock := packetSocketFor(pc, connected)
	c, err := dialOn(ctx, sock, raddr, rc, o)
	if err != nil {
		return nil, err // dialOn closed the socket
	}
	return c, nil
}

// packetSocketFor makes the socket an endpoint reads pc with: the batched
// udpSocket for a *net.UDPConn, packetSocket for any other. Deadlines
// left on pc are cleared, so that they do not fail the reader.
func packetSocketFor(pc net.PacketConn, connected bool) socket {
	pc.SetDeadline(time.Time{}) // a PacketConn may not have them: the error says so
	if uc, ok := pc.(*net.UDPConn); ok {
		return newUDPSocket(uc, connected)
	}
	return &packetSocket{pc: pc}
}

// packetSocket is a socket over any net.PacketConn, read and written a
// datagram at a time (ReadFrom, WriteTo), with *net.UDPAddr addresses.
type packetSocket struct {
	pc     net.PacketConn
	closed atomic.Bool
	// invalid counts the datagrams from addresses that are no IP and
	// port, which the reader drops (in ListenerStats.InvalidDatagrams).
	invalid atomic.Uint64
}

var _ socket = (*packetSocket)(nil)

// ReadBatch reads one datagram: a PacketConn has no batches.
func (s *packetSocket) ReadBatch(ps []udp.Packet) (int, error) {
	if len(ps) == 0 {
		return 0, nil
	}
	p := &ps[0]
	for {
		n, from, err := s.pc.ReadFrom(p.Buf)
		if n == 0 && err != nil {
			if s.closed.Load() && !errors.Is(err, net.ErrClosed) {
				err = fmt.Errorf("%w: %w", net.ErrClosed, err)
			}
			return 0, err
		}
		// A datagram read along with an error is taken; the error, if
		// it lasts, comes again with the next read.
		a, ok := addrPortOf(from)
		if !ok {
			s.invalid.Add(1)
			continue
		}
		p.N, p.Addr = n, a
		p.Trunc = n == len(p.Buf) // the reader's buffer is a byte longer than any datagram taken
		return 1, nil
	}
}

// ReadWant is 1: a PacketConn reads a datagram at a time.
func (s *packetSocket) ReadWant(max int) int { return min(max, 1) }

// WriteBatch writes each packet with WriteTo, setting its Err.
func (s *packetSocket) WriteBatch(_ *udp.Writer, ps []udp.Packet) error {
	var first error
	for i := range ps {
		ps[i].Err = s.WriteTo(ps[i].Buf, ps[i].Addr)
		if first == nil {
			first = ps[i].Err
		}
	}
	return first
}

func (s *packetSocket) WriteTo(b []byte, to netip.AddrPort) error {
	_, err := s.pc.WriteTo(b, net.UDPAddrFromAddrPort(to))
	return err
}

func (s *packetSocket) LocalAddr() net.Addr { return s.pc.LocalAddr() }

func (s *packetSocket) Close() error {
	s.closed.Store(true)
	return s.pc.Close()
}

// addrPortOf returns a's IP and port: a *net.UDPAddr's, or what a's
// String says, if that is an IP and port.
func addrPortOf(a net.Addr) (netip.AddrPort, bool) {
	switch a := a.(type) {
	case nil:
		return netip.AddrPort{}, false
	case *net.UDPAddr:
		if a == nil {
			return netip.AddrPort{}, false
		}
		ap := a.AddrPort()
		return ap, ap.Addr().IsValid()
	}
	ap, err := netip.ParseAddrPort(a.String())
	return ap, err == nil
}

// sockInvalid is what the endpoint's socket dropped as invalid before
// the endpoint saw it (packetSocket).
func (ep *endpoint) sockInvalid() uint64 {
	if s, ok := ep.sock.(*packetSocket); ok {
		return s.invalid.Load()
	}
	return 0
}
