//go:build linux

package udp

import (
	"encoding/binary"
	"net/netip"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// sendmmsg and recvmmsg through the socket's RawConn, so that the runtime's
// poller still does the waiting, with headers, iovecs and addresses
// allocated once per Reader or Writer.

type sysConn struct {
	c  *Conn
	rc syscall.RawConn
	// gso is set while the kernel takes UDP_SEGMENT: a run of datagrams
	// of one size to one peer goes down the stack as one (the last may be
	// shorter), and the receiving side splits it, or hands it whole to a
	// socket with UDP_GRO. It is cleared for good at the first send the
	// kernel refuses with it (a device without checksum offload).
	gso atomic.Bool
}

func (s *sysConn) init(c *Conn) {
	s.c = c
	s.rc, _ = c.pc.SyscallConn()
	s.rc.Control(func(fd uintptr) {
		_, err := unix.GetsockoptInt(int(fd), unix.IPPROTO_UDP, unix.UDP_SEGMENT)
		s.gso.Store(err == nil)
	})
}

// A GSO run: at most maxSegments datagrams and maxRunBytes in all (the
// kernel's limits: UDP_MAX_SEGMENTS, and an IP packet's 64 KiB).
const (
	maxSegments = 64
	maxRunBytes = 65000
)

// sockaddr is room for an address of either family.
type sockaddr [unix.SizeofSockaddrInet6]byte

type sysReader struct {
	hdrs  [MaxBatch]unix.Mmsghdr
	iovs  [MaxBatch]unix.Iovec
	names [MaxBatch]sockaddr
	// The call in progress, for fn (a method value made once: a closure
	// per call would escape and allocate).
	n     int
	got   int
	tries int
	errno syscall.Errno
	fn    func(fd uintptr) bool

	// Reads take one datagram at a time until a backlog shows (several
	// reads in a row finding a datagram already waiting), then whole
	// batches for as long as they come back full. With 100 ping-pong
	// sessions on one socket, reading whatever batch was waiting cut the
	// round-trip rate by a third (BenchmarkSessions, 13 -> 20 us a round
	// trip); a single stream gained nothing measurable from it. A flood
	// fills batches and keeps them.
	batching bool
	streak   int

	// GRO: once a bulk stream arrives, the socket takes UDP_GRO and reads
	// go into big buffers, each of which may hold a run of datagrams the
	// kernel kept together (a GSO run from a peer on this machine, or one
	// the NIC coalesced); they are split into the caller's packets, what
	// does not fit kept for the next call. It stays on: with it off, runs
	// still queued would come out with no word of where their datagrams
	// end.
	big   *groBuffers // while GRO is on
	bulk  int         // full batches in a row mostly from one peer in one size
	noGRO bool        // the kernel refused UDP_GRO
	runs  int         // reads that returned a run (for tests)
	msgs  [groBufs]groMsg
	nmsg  int // messages read into big
	cur   int // message being handed out, and where in it
	off   int
}

// GRO costs groBufs big buffers a socket, and reads of at most groBufs
// messages; a batch of small datagrams from many peers then takes several
// reads. So it waits for a stream that can gain from it.
const (
	groBufs    = 4
	groBufSize = 1 << 16
	bulkToGRO  = 4 // bulk batches in a row that turn GRO on
)

type groBuffers struct {
	bufs  [groBufs][groBufSize]byte
	oobs  [groBufs][cmsgGROSpace]byte
	hdrs  [groBufs]unix.Mmsghdr
	iovs  [groBufs]unix.Iovec
	names [groBufs]sockaddr
}

// cmsgGROSpace is room for a UDP_GRO control message (an int).
const cmsgGROSpace = 24

type groMsg struct {
	n, seg int // bytes, and the size of each datagram in them (0: one)
	addr   netip.AddrPort
	trunc  bool
}

// backlogStreak is how many reads in a row must find a datagram waiting
// before reads go by batches.
const backlogStreak = 8

func (r *sysReader) init(c *Conn) {
	r.fn = r.recv
}

func (r *sysReader) want(max int) int {
	if r.batching || r.big != nil {
		return max
	}
	return min(max, 1)
}

func (r *sysReader) recv(fd uintptr) bool {
	r.tries++
	hdrs := &r.hdrs[0]
	if r.big != nil {
		hdrs = &r.big.hdrs[0]
	}
	n, _, e := unix.Syscall6(unix.SYS_RECVMMSG, fd, uintptr(unsafe.Pointer(hdrs)), uintptr(r.n), unix.MSG_DONTWAIT, 0, 0)
	if e == unix.EAGAIN {
		return false // the poller waits for readability and calls again
	}
	r.got, r.errno = int(n), e
	return true
}

func (s *sysConn) readBatch(r *sysReader, ps []Packet) (int, error) {
	if r.big != nil {
		return s.readBig(r, ps)
	}
	n := min(len(ps), MaxBatch)
	if !r.batching {
		n = min(n, 1)
	}
	for i := range n {
		p := &ps[i]
		r.iovs[i] = unix.Iovec{Base: unsafe.SliceData(p.Buf)}
		r.iovs[i].SetLen(len(p.Buf))
		r.hdrs[i] = unix.Mmsghdr{}
		h := &r.hdrs[i].Hdr
		h.Iov = &r.iovs[i]
		h.SetIovlen(1)
		h.Name = (*byte)(unsafe.Pointer(&r.names[i]))
		h.Namelen = uint32(len(r.names[i]))
	}
	r.n, r.tries = n, 0
	if err := s.rc.Read(r.fn); err != nil {
		return 0, err
	}
	if r.errno != 0 {
		return 0, r.errno
	}
	switch {
	case r.batching:
		r.batching = r.got == n
		r.streak = 0
	case r.tries == 1: // a datagram was waiting
		r.streak++
		r.batching = r.streak >= backlogStreak
	default:
		r.streak = 0
	}
	for i := range r.got {
		p := &ps[i]
		p.N = int(r.hdrs[i].Len)
		p.Trunc = r.hdrs[i].Hdr.Flags&unix.MSG_TRUNC != 0
		p.Addr = parseSockaddr(r.names[i][:r.hdrs[i].Hdr.Namelen])
	}
	if r.batching && r.got == n && n > 1 {
		// A bulk stream: most of a full batch from one peer, in one size.
		same := 0
		for i := range r.got {
			if ps[i].Addr == ps[0].Addr && ps[i].N == ps[0].N {
				same++
			}
		}
		if 2*same < n {
			r.bulk = 0
		} else if r.bulk++; r.bulk >= bulkToGRO && !r.noGRO {
			s.startGRO(r)
		}
	} else {
		r.bulk = 0
	}
	return r.got, nil
}

// startGRO turns UDP_GRO on.
func (s *sysConn) startGRO(r *sysReader) {
	var err error
	s.rc.Control(func(fd uintptr) {
		err = unix.SetsockoptInt(int(fd), unix.IPPROTO_UDP, unix.UDP_GRO, 1)
	})
	if err != nil {
		r.noGRO = true
		return
	}
	r.big = new(groBuffers)
}

// readBig hands out what the last read into the big buffers holds, or
// reads them again.
func (s *sysConn) readBig(r *sysReader, ps []Packet) (int, error) {
	if r.cur >= r.nmsg {
		b := r.big
		for i := range groBufs {
			b.iovs[i] = unix.Iovec{Base: &b.bufs[i][0]}
			b.iovs[i].SetLen(groBufSize)
			b.hdrs[i] = unix.Mmsghdr{}
			h := &b.hdrs[i].Hdr
			h.Iov = &b.iovs[i]
			h.SetIovlen(1)
			h.Name = (*byte)(unsafe.Pointer(&b.names[i]))
			h.Namelen = uint32(len(b.names[i]))
			h.Control = &b.oobs[i][0]
			h.SetControllen(cmsgGROSpace)
		}
		r.n, r.tries = groBufs, 0
		if err := s.rc.Read(r.fn); err != nil {
			return 0, err
		}
		if r.errno != 0 {
			return 0, r.errno
		}
		for i := range r.got {
			h := &b.hdrs[i]
			m := &r.msgs[i]
			*m = groMsg{n: int(h.Len), addr: parseSockaddr(b.names[i][:h.Hdr.Namelen]), trunc: h.Hdr.Flags&unix.MSG_TRUNC != 0}
			m.seg = groSegment(b.oobs[i][:h.Hdr.Controllen])
			if m.seg >= m.n {
				m.seg = 0
			}
			if m.seg > 0 {
				r.runs++
			}
		}
		r.nmsg, r.cur, r.off = r.got, 0, 0
	}
	k := 0
	for k < len(ps) && r.cur < r.nmsg {
		m := &r.msgs[r.cur]
		end := m.n
		if m.seg > 0 {
			end = min(r.off+m.seg, m.n)
		}
		d := r.big.bufs[r.cur][r.off:end]
		p := &ps[k]
		p.N = copy(p.Buf, d)
		p.Trunc = len(d) > len(p.Buf) || m.trunc && end == m.n
		p.Addr = m.addr
		k++
		if r.off = end; r.off >= m.n {
			r.cur, r.off = r.cur+1, 0
		}
	}
	return k, nil
}

// groSegment finds the UDP_GRO control message: the size of the datagrams
// a read returned together.
func groSegment(oob []byte) int {
	for len(oob) >= unix.SizeofCmsghdr {
		h := (*unix.Cmsghdr)(unsafe.Pointer(&oob[0]))
		l := int(h.Len)
		if l < unix.SizeofCmsghdr || l > len(oob) {
			return 0
		}
		if h.Level == unix.IPPROTO_UDP && h.Type == unix.UDP_GRO && l >= unix.CmsgLen(4) {
			return int(binary.NativeEndian.Uint32(oob[unix.CmsgLen(0):]))
		}
		oob = oob[min(unix.CmsgSpace(l-unix.CmsgLen(0)), len(oob)):]
	}
	return 0
}

type sysWriter struct {
	// Each as long as the batch a call writes.
	hdrs  []unix.Mmsghdr
	iovs  []unix.Iovec
	names []sockaddr
	oobs  [][cmsgSegmentSpace]byte
	runs  []int // datagrams in each message
	n     int
	sent  int
	errno syscall.Errno
	fn    func(fd uintptr) bool
}

// cmsgSegmentSpace is room for a UDP_SEGMENT control message (a uint16):
// unix.CmsgSpace(2) is 24 on 64-bit systems, 16 on 32-bit ones.
const cmsgSegmentSpace = 24

func (w *sysWriter) init(n int) {
	w.hdrs = make([]unix.Mmsghdr, n)
	w.iovs = make([]unix.Iovec, n)
	w.names = make([]sockaddr, n)
	w.oobs = make([][cmsgSegmentSpace]byte, n)
	w.runs = make([]int, n)
	w.fn = w.send
}

func (w *sysWriter) send(fd uintptr) bool {
	n, _, e := unix.Syscall6(unix.SYS_SENDMMSG, fd, uintptr(unsafe.Pointer(&w.hdrs[w.sent])), uintptr(w.n-w.sent), unix.MSG_DONTWAIT, 0, 0)
	if e == unix.EAGAIN {
		return false // the poller waits for room and calls again
	}
	if e != 0 {
		w.errno = e
		return true
	}
	w.sent += int(n)
	return w.sent == w.n
}

// run returns how many datagrams from the start of ps go out as one GSO
// message: datagrams of one size to one peer, the last possibly shorter.
func run(ps []Packet, gso bool) int {
	if !gso || len(ps) < 2 {
		return 1
	}
	size := len(ps[0].Buf)
	total, k := size, 1
	for k < len(ps) && k < maxSegments {
		p := &ps[k]
		if len(p.Buf) > size || len(p.Buf) == 0 || p.Addr != ps[0].Addr || total+len(p.Buf) > maxRunBytes {
			break
		}
		total += len(p.Buf)
		k++
		if len(p.Buf) < size {
			break // a shorter one ends the run
		}
	}
	return k
}

func (s *sysConn) writeBatch(w *sysWriter, ps []Packet) (int, error) {
	if len(ps) == 1 {
		// One datagram: the plain call is cheaper than setting up a batch.
		if err := s.c.writeOne(&ps[0]); err != nil {
			ps[0].Err = err
			return 0, err
		}
		return 1, nil
	}
	done, sent := 0, 0 // datagrams dealt with, and sent
	var first error
	for done < len(ps) {
		gso := s.gso.Load()
		n, used := 0, 0 // messages, datagrams
		for used < len(ps)-done && used < len(w.hdrs) {
			k := run(ps[done+used:done+min(len(ps)-done, len(w.hdrs))], gso)
			p0 := &ps[done+used]
			for i := range k {
				p := &ps[done+used+i]
				w.iovs[used+i] = unix.Iovec{Base: unsafe.SliceData(p.Buf)}
				w.iovs[used+i].SetLen(len(p.Buf))
			}
			w.hdrs[n] = unix.Mmsghdr{}
			h := &w.hdrs[n].Hdr
			h.Iov = &w.iovs[used]
			h.SetIovlen(k)
			if !s.c.connected {
				l := putSockaddr(&w.names[n], p0.Addr, s.c.v6)
				h.Name = (*byte)(unsafe.Pointer(&w.names[n]))
				h.Namelen = uint32(l)
			}
			if k > 1 {
				oob := w.oobs[n][:]
				c := (*unix.Cmsghdr)(unsafe.Pointer(&oob[0]))
				c.Level = unix.IPPROTO_UDP
				c.Type = unix.UDP_SEGMENT
				c.SetLen(unix.CmsgLen(2))
				binary.NativeEndian.PutUint16(oob[unix.CmsgLen(0):], uint16(len(p0.Buf)))
				h.Control = &oob[0]
				h.SetControllen(unix.CmsgSpace(2))
			}
			w.runs[n] = k
			n++
			used += k
		}
		w.n, w.sent, w.errno = n, 0, 0
		err := s.rc.Write(w.fn)
		for i := range w.sent {
			done += w.runs[i]
			sent += w.runs[i]
		}
		if err != nil {
			// The socket itself failed (closed): nothing more goes.
			for i := done; i < len(ps); i++ {
				ps[i].Err = err
			}
			if first == nil {
				first = err
			}
			return sent, first
		}
		if w.errno != 0 {
			if w.runs[w.sent] > 1 && (w.errno == unix.EIO || w.errno == unix.EINVAL || w.errno == unix.EOPNOTSUPP) {
				// The kernel or the device refuses segmentation: send
				// the rest one datagram a message, from now on.
				s.gso.Store(false)
				continue
			}
			// Skip what the kernel refused (say, an ICMP error reported
			// on a connected socket) and go on with the rest.
			for i := done; i < done+w.runs[w.sent]; i++ {
				ps[i].Err = w.errno
			}
			done += w.runs[w.sent]
			if first == nil {
				first = w.errno
			}
		}
	}
	return sent, first
}

// putSockaddr encodes a in the socket's family and returns its length.
func putSockaddr(b *sockaddr, a netip.AddrPort, v6 bool) int {
	*b = sockaddr{}
	if !v6 {
		binary.NativeEndian.PutUint16(b[0:], unix.AF_INET)
		binary.BigEndian.PutUint16(b[2:], a.Port())
		ip := a.Addr().Unmap().As4()
		copy(b[4:8], ip[:])
		return unix.SizeofSockaddrInet4
	}
	binary.NativeEndian.PutUint16(b[0:], unix.AF_INET6)
	binary.BigEndian.PutUint16(b[2:], a.Port())
	ip := a.Addr().As16() // an IPv4 address comes out v4-mapped
	copy(b[8:24], ip[:])
	if z := a.Addr().Zone(); z != "" {
		if ifi, err := netInterfaceIndex(z); err == nil {
			binary.NativeEndian.PutUint32(b[24:], uint32(ifi))
		}
	}
	return unix.SizeofSockaddrInet6
}

// parseSockaddr decodes an address the kernel wrote.
func parseSockaddr(b []byte) netip.AddrPort {
	if len(b) < 4 {
		return netip.AddrPort{}
	}
	port := binary.BigEndian.Uint16(b[2:])
	switch binary.NativeEndian.Uint16(b[0:]) {
	case unix.AF_INET:
		if len(b) >= 8 {
			return netip.AddrPortFrom(netip.AddrFrom4([4]byte(b[4:8])), port)
		}
	case unix.AF_INET6:
		if len(b) >= 24 {
			return netip.AddrPortFrom(netip.AddrFrom16([16]byte(b[8:24])), port)
		}
	}
	return netip.AddrPort{}
}
