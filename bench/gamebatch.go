package main

// The game scenario's batched raw UDP server: the machine's limit for
// this load. The same traffic as the raw UDP server (inputs in, a
// snapshot per client per tick, an event per client per second), but
// its system calls carry many datagrams: recvmmsg for the inputs and
// sendmmsg for a tick's snapshots and events, through golang.org/x/net's
// ipv4.PacketConn (ReadBatch, WriteBatch). No protocol work: nothing is
// acknowledged, ordered or resent. Its clients are the raw UDP clients.

import (
	"errors"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"

	"golang.org/x/net/ipv4"
)

// gameBatch is the number of datagrams per recvmmsg, and at most per
// sendmmsg (the kernel's UIO_MAXIOV is 1024).
const (
	gameBatchRead  = 64
	gameBatchWrite = 1024
)

type udpBatchGameServer struct {
	pc *net.UDPConn
	bc *ipv4.PacketConn
	mu sync.Mutex
	by map[netip.AddrPort]struct{}
	to []*net.UDPAddr

	snapsSent, snapsMissed, eventsSent, eventsMissed, inputs atomic.Uint64
	view                                                     []*net.UDPAddr
	out                                                      []ipv4.Message
	kinds                                                    []byte // kindSnapshot or kindEvent, per out entry
}

func newUDPBatchGameServer() (*udpBatchGameServer, error) {
	pc, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		return nil, err
	}
	pc.SetReadBuffer(4 << 20)
	pc.SetWriteBuffer(4 << 20)
	s := &udpBatchGameServer{pc: pc, bc: ipv4.NewPacketConn(pc), by: map[netip.AddrPort]struct{}{}}
	go s.read()
	return s, nil
}

// read takes the inputs, up to gameBatchRead per recvmmsg; a new source
// address is a new client.
func (s *udpBatchGameServer) read() {
	ms := make([]ipv4.Message, gameBatchRead)
	for i := range ms {
		ms[i].Buffers = [][]byte{make([]byte, 1500)}
	}
	for {
		n, err := s.bc.ReadBatch(ms, 0)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		var in uint64
		for _, m := range ms[:n] {
			if m.N == 0 || m.Buffers[0][0] != kindInput {
				continue
			}
			in++
			ua, ok := m.Addr.(*net.UDPAddr)
			if !ok {
				continue
			}
			from := ua.AddrPort()
			s.mu.Lock()
			if _, ok := s.by[from]; !ok {
				s.by[from] = struct{}{}
				s.to = append(s.to, ua)
			}
			s.mu.Unlock()
		}
		s.inputs.Add(in)
	}
}

func (s *udpBatchGameServer) addr() string { return s.pc.LocalAddr().String() }
func (s *udpBatchGameServer) close()       { s.pc.Close() }
func (s *udpBatchGameServer) clients() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.to)
}
func (s *udpBatchGameServer) counters() (uint64, uint64, uint64, uint64, uint64) {
	return s.snapsSent.Load(), s.snapsMissed.Load(), s.eventsSent.Load(), s.eventsMissed.Load(), s.inputs.Load()
}

// tick queues every client's snapshot (and event when due) and sends
// them with as few sendmmsg calls as the kernel takes.
func (s *udpBatchGameServer) tick(t int, snap, event []byte) {
	s.mu.Lock()
	s.view = append(s.view[:0], s.to...)
	s.mu.Unlock()
	s.out, s.kinds = s.out[:0], s.kinds[:0]
	for i, to := range s.view {
		s.out = append(s.out, ipv4.Message{Buffers: [][]byte{snap}, Addr: to})
		s.kinds = append(s.kinds, kindSnapshot)
		if eventTurn(i, t) {
			s.out = append(s.out, ipv4.Message{Buffers: [][]byte{event}, Addr: to})
			s.kinds = append(s.kinds, kindEvent)
		}
	}
	var sent, missed, evSent, evMissed uint64
	count := func(k byte, ok bool) {
		switch {
		case k == kindSnapshot && ok:
			sent++
		case k == kindSnapshot:
			missed++
		case ok:
			evSent++
		default:
			evMissed++
		}
	}
	for i := 0; i < len(s.out); {
		n, err := s.bc.WriteBatch(s.out[i:min(i+gameBatchWrite, len(s.out))], 0)
		for _, k := range s.kinds[i : i+n] {
			count(k, true)
		}
		i += n
		if (err != nil || n == 0) && i < len(s.out) {
			count(s.kinds[i], false) // the datagram the kernel refused
			i++
		}
	}
	s.snapsSent.Add(sent)
	s.snapsMissed.Add(missed)
	s.eventsSent.Add(evSent)
	s.eventsMissed.Add(evMissed)
}
