package knet

import (
	"time"
)

// recvState is what a session keeps of the datagrams it received: which
// PacketIDs came (the window), fragments being put together, messages
// held for what they depend on, how late reordered datagrams come, and
// the counters of Stats.LossRate.
type recvState struct {
	win        recvWindow
	reasm      reassembly
	res        resolver
	lent       *[]byte       // see takeLent
	newestAt   time.Time     // when the newest PacketID arrived
	reorderExt time.Duration // how late reordered datagrams came
	reorderAt  time.Time
	// For Stats.LossRate: how far the peer's PacketIDs advanced, and how
	// many datagrams arrived (new ones only).
	pidAdvance, uniqueIn uint64
}

// reorderSeen is how late out-of-order datagrams have been arriving
// lately, with a margin: the extent halves every five seconds.
func (s *session) reorderSeen() time.Duration {
	e := s.recv.reorderExt
	for t := s.recv.reorderAt; e > 0 && s.live.lastRecv.Sub(t) > 5*time.Second; t = t.Add(5 * time.Second) {
		e /= 2
	}
	return e * 5 / 4
}

// noteArrival measures reordering: a datagram older than the newest one
// seen arrives this long after it.
func (s *session) noteArrival(now time.Time, pid uint32) {
	if !s.recv.win.started || seqLess(s.recv.win.newest, pid) {
		s.recv.newestAt = now
		return
	}
	if late := now.Sub(s.recv.newestAt); late > 0 {
		s.recv.reorderExt = max(s.reorderSeen()*4/5, late)
		s.recv.reorderAt = now
	}
}

// handleDatagram processes one datagram from the peer: the wire reads it
// (session_spec.go, session_cpp.go). b is not kept.
func (s *session) handleDatagram(now time.Time, b []byte) {
	if s.state == stateDone {
		return
	}
	s.wire.read(now, b)
	s.flushDeliveries()
}

// recvLinger takes a datagram after we answered the peer's Disconnect: a
// Disconnect again (disconnect) means our DisconnectAck was lost.
func (s *session) recvLinger(now time.Time, disconnect bool) {
	s.live.lastRecv = now
	if disconnect {
		s.owed.owe(oweDiscAck)
	}
}

// countIn counts a well-formed datagram of n bytes in, the ack credit it
// earns (ack.go), and, on a server whose peer has not proven its address,
// the credit it earns there (anti-amplification).
func (s *session) countIn(n int) {
	s.stats.DatagramsReceived++
	s.stats.BytesReceived += uint64(n)
	s.acks.earn(n, s.cfg.maxDatagram)
	if !s.addressProven() {
		s.handshake.preIn += n
	}
}

// seenBefore handles a datagram whose PacketID tells it is not new: one
// implausibly far from those seen is invalid, one seen before a duplicate
// (acked again, as its ack may have been lost).
func (s *session) seenBefore(now time.Time, pid uint32, reliable bool) bool {
	if !s.recv.win.plausible(pid) {
		s.stats.InvalidDatagrams++
		return true
	}
	if s.recv.win.contains(pid) {
		// Acked again, as our ack may have been lost; but a copy proves
		// nothing of the peer's life (anyone may replay one).
		s.stats.DuplicateDatagrams++
		if reliable {
			s.acks.add(now, pid)
		}
		return true
	}
	return false
}

// arrived records a new datagram, taken in, and owes its ack if reliable.
func (s *session) arrived(now time.Time, pid uint32, reliable bool) {
	s.alive(now)
	s.recv.uniqueIn++
	switch {
	case !s.recv.win.started:
		s.recv.pidAdvance++
	case seqLess(s.recv.win.newest, pid):
		s.recv.pidAdvance += uint64(seqDiff(s.recv.win.newest, pid))
	}
	s.noteArrival(now, pid)
	// PacketIDs count up by one, so a gap means something went missing
	// (or the sender skipped one, skip.go), and an older one arriving
	// fills a gap:
	// either way the sender wants to hear at once (an immediate ack speeds
	// up its loss detection, as TCP does on out-of-order data).
	gap := s.recv.win.started && (pid != (s.recv.win.newest+1)&packetIDMask)
	s.recv.win.add(pid)
	if reliable {
		s.acks.add(now, pid)
		if gap {
			s.owed.owe(oweAckNow)
		}
	}
}

// datagramDone ends the handling of a datagram taken in, or refused for
// want of room: the acks it carried (acked) take effect, and flow control
// counts it.
func (s *session) datagramDone(now time.Time, acked bool) {
	s.flushDeliveries()
	if acked {
		s.afterAcks(now)
	}
	s.flow.arrivals++
	s.flowControl(now)
}

func (s *session) protocolError(err error) {
	s.stats.ProtocolErrors++
	s.fail(&ProtocolError{Err: err})
}

// Fragments, in either wire: the wire reads each and says what the
// message is once whole (order); reassembly (fragment.go) puts it
// together.

// reassemble feeds a fragment, found at at, to reassembly. Once the
// message is whole it returns its transfer and the message; a fragment
// the protocol forbids ends the session (ok false).
func (s *session) reassemble(m *message, at msgRef, order *startOrder) (t *transfer, whole []byte, ok bool) {
	t, whole, err := s.recv.reasm.add(m, at, order)
	if err != nil {
		s.protocolError(err)
		return nil, nil, false
	}
	return t, whole, true
}

// endTransfer forgets transfer t, whose message whole is about to be
// applied, and lends the pooled buffer behind whole, if any, to the
// receive queue meanwhile (see takeLent); reclaimLent takes it back if
// the queue did not keep it.
func (s *session) endTransfer(t *transfer, whole []byte) {
	s.recv.lent = s.recv.reasm.lend(t, whole)
	s.recv.reasm.finish(t)
}

// reclaimLent puts back the buffer endTransfer lent, if the message was
// held (a held message has its copy) or dropped, not delivered.
func (s *session) reclaimLent() {
	if s.recv.lent != nil {
		putPayload(s.recv.lent)
		s.recv.lent = nil
	}
}
