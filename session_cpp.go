package knet

import (
	"container/heap"
	"slices"
	"time"
)

// The reference dialect (dialect.go, cppwire.go): the connection opening
// and receiving. Sending is in session_refsend.go.
//
// A reference client opens with 8 zero bytes, no datagram, and takes the
// connection as open on the first datagram back; the server answers the
// opening with a PingRequest (the reference sends two, but a server owes
// an unproven address no more bytes than it sent) and takes the client's
// first datagram for the end of the handshake. Both count PacketIDs from 1.
//
// Reliable messages carry reliable numbers, counted per connection,
// fragments each their own: a receiver drops a message whose number came
// before, delivers the reliable in-order ones in the order of their
// numbers (the first of a fragmented message standing for the whole), and
// the unreliable in-order ones unless a later datagram's came first.

// refState is what a session in the reference dialect keeps beside the
// spec dialect's state: reliable numbers sent, acked and received, the
// in-order messages held for earlier numbers, and the datagram being
// handled. A session in the spec's dialect has none (session.ref is nil).
type refState struct {
	rrd      cppDatagram // the one being handled
	relOut   uint32      // the next reliable number to send
	relAcked relWindow   // reliable numbers the peer acked
	// The fragmented transfer under way (send.bulk, or its last datagram
	// unacked: one at a time) is in order and starts at this number; a
	// receiver holds the in-order messages numbered after it until it is
	// whole.
	bulkRel      uint32
	bulkInOrder  bool
	fragFlight   int    // unacked reliable datagrams carrying fragments
	discRel      uint32 // our Disconnect's reliable number
	hasDiscRel   bool
	relIn        relWindow // reliable numbers received
	relHeld      relHeap   // in-order messages waiting for earlier numbers
	relHeldBytes int
	relOpen      []uint32 // FragmentStart numbers of in-order transfers incomplete
	relFlushAt   time.Time
	seqPID       uint32 // the datagram of the newest unreliable in-order message delivered
	seqStarted   bool
}

// refHeld is an in-order message waiting for the messages numbered before
// it.
type refHeld struct {
	rel     uint32
	kind    heldKind
	id      uint32
	payload []byte
}

// handleRefDatagram processes one datagram from a reference peer. b is
// not kept.
func (s *session) handleRefDatagram(now time.Time, b []byte) {
	if isCppOpening(b) {
		s.stats.DatagramsReceived++
		s.stats.BytesReceived += uint64(len(b))
		s.refOpening(now, len(b))
		return
	}
	if parseCppInto(b, &s.ref.rrd) != nil {
		s.stats.InvalidDatagrams++
		return
	}
	d := &s.ref.rrd
	s.countIn(len(b))
	switch s.state {
	case stateSyn:
		// Any datagram opens the connection.
		s.clientEstablished(now, nil)
		s.recvRefOpen(now, d)
	case stateAdmit:
		// Nothing comes before our answer to the opening; a stray
		// datagram waits for the application's decision like any.
	case stateSynAck:
		s.establishServer(now)
		s.recvRefOpen(now, d)
	case stateLinger:
		s.live.lastRecv = now
		if d.has(idDisconnect) {
			s.owed.owe(oweDiscAck)
		}
	case stateClosing:
		if d.has(idDisconnectAck) {
			s.state = stateDone
			return
		}
		s.recvRefOpen(now, d)
	default:
		s.recvRefOpen(now, d)
	}
}

// refOpening takes a client's opening: the first goes to the application
// (evAdmit, with no payload: the reference has none); one repeated while
// we answer means our answer was lost, and earns the credit for another.
func (s *session) refOpening(now time.Time, n int) {
	if s.client {
		s.stats.InvalidDatagrams++
		return
	}
	if !s.handshake.wasOpen {
		s.handshake.preIn += n
	}
	switch s.state {
	case stateAdmit:
		if !s.handshake.admitWaiting {
			s.handshake.admitWaiting = true
			s.events |= evAdmit
			s.handshake.syn = nil
			s.live.lastRecv = now
		}
	case stateSynAck:
		s.owed.owe(oweSynAck)
	default:
		// The client opens again after the connection was up: it lost
		// everything we sent it, or restarted. Nothing to act on; the
		// connection times out if it is gone.
		s.stats.DuplicateDatagrams++
	}
}

// has reports whether the datagram holds a whole message with ID id.
func (d *cppDatagram) has(id uint32) bool {
	for i := range d.msgs {
		if m := &d.msgs[i]; !m.fragment && m.id == id {
			return true
		}
	}
	return false
}

// recvRefOpen takes a datagram of an open connection (or, on the server,
// the one completing it), as recvOpen does in the spec's dialect.
func (s *session) recvRefOpen(now time.Time, d *cppDatagram) {
	h, msgs := &d.cppHeader, d.msgs
	if s.seenBefore(now, h.packetID, h.reliable) {
		return
	}
	if h.reliable && !s.refAdmits(msgs) {
		// No room: leave it unacked so it comes again, but take the
		// acks it carries.
		s.stats.DroppedDatagrams++
		s.live.lastRecv = now
		for i := range msgs {
			if m := &msgs[i]; !m.fragment && m.id == idPacketAck {
				s.refPacketAck(now, m.payload)
			}
		}
		s.afterAcks(now)
		s.flow.arrivals++
		s.flowControl(now)
		return
	}
	s.arrived(now, h.packetID, h.reliable)
	if h.reliable {
		// A knet sender in this dialect sends the fragments of a transfer
		// one datagram at a time, each after the previous one's ack: an
		// ack held back for MaxAckDelay would cost that much per datagram.
		for i := range msgs {
			if msgs[i].fragment {
				s.owed.owe(oweAckNow)
				break
			}
		}
	}
	acked := false
	for i := range msgs {
		if s.state == stateDone || s.state == stateLinger {
			break
		}
		m := &msgs[i]
		if !m.fragment && m.id == idPacketAck {
			acked = true
		}
		s.handleRefMessage(now, h.packetID, m)
	}
	s.releaseRelHeld(now)
	if acked {
		s.afterAcks(now)
	}
	s.flow.arrivals++
	s.flowControl(now)
}

// refAdmits reports whether a reliable datagram fits our buffers, as
// admits does in the spec's dialect: with the buffer full of messages
// waiting behind a missing one, only the datagram bringing that one (the
// oldest reliable number missing) gets in.
func (s *session) refAdmits(msgs []cppMessage) bool {
	over := s.host.recvUsed()+s.ref.relHeldBytes >= s.cfg.recvBuffer
	appContent, fills := false, false
	for i := range msgs {
		m := &msgs[i]
		if m.reliable {
			if !s.ref.relIn.fits(m.relNum) {
				return false // far ahead of a hole: it comes again
			}
			fills = fills || m.relNum == s.ref.relIn.next
		}
		if m.fragment {
			if !s.recv.reasm.admits(m.transferID, len(m.payload)) {
				return false
			}
			appContent = true
			continue
		}
		appContent = appContent || refAppID(m.id)
	}
	return !over || !appContent || fills
}

// refAppID reports whether a reference peer's message with this ID is the
// application's: all but the IDs its library uses.
func refAppID(id uint32) bool {
	switch id {
	case idPingRequest, idPingReply, idFlowControlRequest, idPacketAck, idDisconnect, idDisconnectAck:
		return false
	}
	return true
}

// handleRefMessage processes one message block of an accepted datagram
// with PacketID pid.
func (s *session) handleRefMessage(now time.Time, pid uint32, m *cppMessage) {
	if m.reliable {
		if s.ref.relIn.has(m.relNum) {
			s.stats.DuplicateMessages++
			return
		}
		s.ref.relIn.add(m.relNum)
	}
	if m.fragment {
		s.handleRefFragment(now, pid, m)
		return
	}
	if s.handlePing(now, m.id, m.payload) {
		return
	}
	switch m.id {
	case idPacketAck:
		s.refPacketAck(now, m.payload)
	case idDisconnect:
		s.refDisconnect(now, m)
	case idDisconnectAck:
		s.apply(now, heldDisconnectAck, 0, nil, m.reliable, m.inOrder)
	default:
		s.refDeliver(now, pid, m.relNum, heldApp, m.id, m.payload, m.reliable, m.inOrder)
	}
}

func (s *session) refPacketAck(now time.Time, p []byte) {
	if a, ok := parseCppPacketAck(p); ok {
		s.loss.onPacketAck(now, a, &s.scratch.acked)
	}
}

// refDeliver applies a message now, or holds it until the messages
// numbered before it have arrived (reliable in-order ones); an unreliable
// in-order one from a datagram older than the last one's is dropped.
func (s *session) refDeliver(now time.Time, pid, rel uint32, kind heldKind, id uint32, payload []byte, reliable, inOrder bool) {
	switch {
	case reliable && inOrder:
		if len(s.ref.relHeld) == 0 && s.relReady(rel) {
			s.apply(now, kind, id, payload, true, true)
			return
		}
		heap.Push(&s.ref.relHeld, refHeld{rel: rel, kind: kind, id: id, payload: append([]byte(nil), payload...)})
		s.ref.relHeldBytes += len(payload) + refHeldCost
	case !reliable && kind == heldApp:
		// An unreliable message from a datagram older than the last
		// one's that had an in-order message goes: that one may name it
		// (a dependency, or a newer state of its ContentID), and the wire
		// does not say.
		if s.ref.seqStarted && seqLess(pid, s.ref.seqPID) {
			s.stats.DroppedMessages++
			return
		}
		if inOrder {
			s.ref.seqPID, s.ref.seqStarted = pid, true
		}
		s.apply(now, kind, id, payload, false, inOrder)
	default:
		s.apply(now, kind, id, payload, reliable, inOrder)
	}
}

// relReady reports whether an in-order message numbered rel can go: every
// number before it has arrived, and no in-order fragmented message begun
// before it is still incomplete.
func (s *session) relReady(rel uint32) bool {
	if relDiff(rel, s.ref.relIn.next) <= 0 {
		return false
	}
	for _, o := range s.ref.relOpen {
		if relDiff(o, rel) > 0 {
			return false
		}
	}
	return true
}

// releaseRelHeld applies the held in-order messages now ready, in order.
func (s *session) releaseRelHeld(now time.Time) {
	for len(s.ref.relHeld) > 0 && s.state != stateDone && s.relReady(s.ref.relHeld[0].rel) {
		s.applyFirstHeld(now)
	}
}

// applyRelHeld applies every held message, in order.
func (s *session) applyRelHeld(now time.Time) {
	for len(s.ref.relHeld) > 0 && s.state != stateDone {
		s.applyFirstHeld(now)
	}
}

// applyFirstHeld applies the held message with the lowest number.
func (s *session) applyFirstHeld(now time.Time) {
	e := heap.Pop(&s.ref.relHeld).(refHeld)
	s.ref.relHeldBytes -= len(e.payload) + refHeldCost
	if len(s.ref.relHeld) == 0 {
		s.ref.relFlushAt = time.Time{}
	}
	s.apply(now, e.kind, e.id, e.payload, true, true)
}

// refHeldCost is what a held message counts for beyond its payload, so
// that empty ones cannot pile up unbounded.
const refHeldCost = 64

// relHeap is the held in-order messages, lowest reliable number first.
// Their numbers all lie within maxRelWindow, so serial order is total.
type relHeap []refHeld

func (h relHeap) Len() int           { return len(h) }
func (h relHeap) Less(i, j int) bool { return relDiff(h[i].rel, h[j].rel) > 0 }
func (h relHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *relHeap) Push(x any)        { *h = append(*h, x.(refHeld)) }
func (h *relHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	old[len(old)-1] = refHeld{}
	*h = old[:len(old)-1]
	return e
}

// refDisconnect takes the peer's Disconnect. It is in order after
// everything the peer sent: it waits for what is missing before it, but
// not for long, since a reference peer sends nothing after it (no resend
// of what we miss); past relFlushWait what arrived goes to the
// application and the Disconnect is answered.
func (s *session) refDisconnect(now time.Time, m *cppMessage) {
	if !m.reliable || s.relReady(m.relNum) && len(s.ref.relHeld) == 0 {
		s.applyRelHeld(now)
		s.apply(now, heldDisconnect, 0, nil, true, true)
		return
	}
	s.refDeliver(now, 0, m.relNum, heldDisconnect, 0, nil, true, true)
	if s.ref.relFlushAt.IsZero() {
		s.ref.relFlushAt = now.Add(s.relFlushWait())
	}
}

// relFlushWait is how long a held Disconnect waits for the messages
// before it: two retransmission timeouts, at least 100ms.
func (s *session) relFlushWait() time.Duration { return max(2*s.loss.rto(), 100*time.Millisecond) }

// refDeadline adds the reference dialect's timer: the end of a held
// Disconnect's wait (flushRelHeld).
func (s *session) refDeadline(t *deadlines) { t.at(s.ref.relFlushAt) }

// flushRelHeld applies every held message, in order, gaps or not: the
// peer's Disconnect waited long enough (see refDisconnect).
func (s *session) flushRelHeld(now time.Time) {
	if s.ref.relFlushAt.IsZero() || now.Before(s.ref.relFlushAt) {
		return
	}
	s.ref.relFlushAt = time.Time{}
	s.ref.relOpen = s.ref.relOpen[:0]
	s.applyRelHeld(now)
}

// handleRefFragment feeds a fragment to reassembly and, once the message
// is whole, delivers it in its FragmentStart's place.
func (s *session) handleRefFragment(now time.Time, pid uint32, m *cppMessage) {
	msg := message{fragStart: m.fragStart, fragment: true, fragCount: m.fragCount, transferID: m.transferID,
		fragNumber: m.fragNumber, id: m.id, payload: m.payload}
	var order startOrder
	if m.fragStart {
		order = startOrder{reliable: m.reliable, inOrder: m.inOrder, rel: m.relNum}
		if m.reliable && m.inOrder {
			s.ref.relOpen = append(s.ref.relOpen, m.relNum)
		}
	}
	t, whole, err := s.recv.reasm.add(&msg, msgRef{pid: pid}, order)
	if err != nil {
		s.protocolError(err)
		return
	}
	if whole == nil {
		return
	}
	reliable, inOrder, id, rel := t.order.reliable, t.order.inOrder, t.id, t.order.rel
	s.recv.lent = s.recv.reasm.lend(t, whole)
	s.recv.reasm.finish(t)
	if i := slices.Index(s.ref.relOpen, rel); i >= 0 && reliable && inOrder {
		s.ref.relOpen = slices.Delete(s.ref.relOpen, i, i+1)
	}
	s.refDeliver(now, pid, rel, heldApp, id, whole, reliable, inOrder)
	if s.recv.lent != nil {
		// Held (a copy) or dropped, not delivered.
		putPayload(s.recv.lent)
		s.recv.lent = nil
	}
}
