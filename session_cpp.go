package knet

import (
	"container/heap"
	"slices"
	"time"
)

// The C++ reference implementation's wire (DialectReference; the codec is
// cppwire.go): the session's wire (session_wire.go) when it speaks to a
// C++ kNet peer. Opening and receiving are here, sending in
// session_cppsend.go.
//
// A reference client opens with 8 zero bytes, no datagram, and takes the
// connection as open on the first datagram back; the server answers the
// opening with a PingRequest (the reference sends two, but a server owes
// an unproven address no more bytes than it sent) whose ID is random, and
// takes the PingReply echoing it for the end of the handshake: the proof
// that the client is at its address (takeProof). Both count PacketIDs
// from 1.
//
// Reliable messages carry reliable numbers, counted per connection,
// fragments each their own: a receiver drops a message whose number came
// before, delivers the reliable in-order ones in the order of their
// numbers (the first of a fragmented message standing for the whole), and
// the unreliable in-order ones unless a later datagram's came first.

// cppWire is the C++ wire, with what a session keeps for it beside the
// state both wires share: reliable numbers sent, acked and received, the
// in-order messages held for earlier numbers, and the datagram being
// handled.
type cppWire struct {
	s        *session
	rd       cppDatagram // the one being handled
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

// newCppWire makes s speak the C++ wire, and sets what its shared parts
// do differently for it.
func newCppWire(s *session) *cppWire {
	s.loss.rekeys = true
	s.acks.bits = cppAckBits
	s.send.tids.noZero = true
	// The reference's own fragment size: its receiver took 400 bytes
	// once, but 318 is what it is known to take.
	s.send.fragSize = min(s.send.fragSize, cppFragSize)
	s.send.nextPID, s.send.nextPN = 1, 1 // both sides start at 1; the opening is no datagram
	// So the peer's PacketIDs start at 1 too: whichever of its first
	// datagrams arrives first, those before it are still to come.
	s.recv.win.add(0)
	return &cppWire{s: s}
}

// The C++ wire has no ConnectAck and no refusal, and knet sends it no
// FlowControlRequest (see Dialect).
func (w *cppWire) hasConnectAck() bool    { return false }
func (w *cppWire) hasRefusal() bool       { return false }
func (w *cppWire) sendsFlowControl() bool { return false }

// cppHeld is an in-order message waiting for the messages numbered before
// it.
type cppHeld struct {
	rel     uint32
	kind    heldKind
	id      uint32
	payload []byte
}

// read takes one datagram from a C++ peer.
func (w *cppWire) read(now time.Time, b []byte) {
	s := w.s
	if isCppOpening(b) {
		s.stats.DatagramsReceived++
		s.stats.BytesReceived += uint64(len(b))
		w.opening(now, len(b))
		return
	}
	if parseCppInto(b, &w.rd) != nil {
		s.stats.InvalidDatagrams++
		return
	}
	d := &w.rd
	s.countIn(len(b))
	switch s.state {
	case stateSyn:
		// Any datagram opens the connection; our pings tell whether the
		// server took our answer to its challenge (openPings).
		s.clientEstablished(now, nil)
		s.openPings(now)
		w.recvOpen(now, d)
	case stateAdmit:
		// Nothing comes before our answer to the opening; a stray
		// datagram waits for the application's decision like any.
	case stateSynAck:
		// Any datagram says the client is open, but only with the
		// PingReply to our answer is the connection established
		// (handleMessage). Until then each one earns the credit for our
		// challenge again, which goes at once: the client sends one
		// (its ping, see openPings) when its PingReply may have been
		// lost. Proven by this one, the challenge stays home.
		if s.awaitsProof() {
			s.owed.owe(oweSynAck)
		}
		s.establishServer(now)
		w.recvOpen(now, d)
	case stateLinger:
		s.recvLinger(now, d.has(idDisconnect))
	case stateClosing:
		if d.has(idDisconnectAck) {
			s.closeDone()
			return
		}
		w.recvOpen(now, d)
	default:
		w.recvOpen(now, d)
	}
}

// opening takes a client's opening: the first goes to the application
// (evAdmit, with no payload: the reference has none); one repeated while
// we answer means our answer was lost, and earns the credit for another.
func (w *cppWire) opening(now time.Time, n int) {
	s := w.s
	if s.client {
		s.stats.InvalidDatagrams++
		return
	}
	if !s.addressProven() {
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

// recvOpen takes a datagram of an open connection (or, on the server,
// the one completing it), as the spec wire's recvOpen does.
func (w *cppWire) recvOpen(now time.Time, d *cppDatagram) {
	s := w.s
	h, msgs := &d.cppHeader, d.msgs
	if s.seenBefore(now, h.packetID, h.reliable) {
		return
	}
	if h.reliable && !w.admits(msgs) {
		// No room: leave it unacked so it comes again, but take the
		// acks it carries.
		s.stats.DroppedDatagrams++
		s.alive(now)
		for i := range msgs {
			if m := &msgs[i]; !m.fragment && m.id == idPacketAck {
				w.handlePacketAck(now, m.payload)
			}
		}
		s.datagramDone(now, true)
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
		w.handleMessage(now, h.packetID, m)
	}
	w.releaseRelHeld(now)
	s.datagramDone(now, acked)
}

// admits reports whether a reliable datagram fits our buffers, as the
// spec wire's admits does: with the buffer full of messages waiting
// behind a missing one, only the datagram bringing that one (the oldest
// reliable number missing) gets in.
func (w *cppWire) admits(msgs []cppMessage) bool {
	s := w.s
	// Over the Listener's budget (budget.go), as over the buffer, only
	// the datagram filling the hole gets in.
	used := s.recvUsed()
	over := s.overBudget(used) || used+w.relHeldBytes >= s.cfg.recvBuffer
	appContent, fills := false, false
	for i := range msgs {
		m := &msgs[i]
		if m.reliable {
			if !w.relIn.fits(m.relNum) {
				return false // far ahead of a hole: it comes again
			}
			fills = fills || m.relNum == w.relIn.next
		}
		if m.fragment {
			if !s.recv.reasm.admits(m.transferID, len(m.payload)) {
				return false
			}
			appContent = true
			continue
		}
		appContent = appContent || cppAppID(m.id)
	}
	if used+w.relHeldBytes >= heldCap*s.cfg.recvBuffer && appContent {
		return false // the hard limit: see heldCap
	}
	// The next reliable number lets a datagram in past the buffer only
	// when messages are held behind it: otherwise a peer sending in order
	// without waiting for acks filled the queue of an application that
	// does not read without bound (TestCppPeerFillingReceiveQueue).
	return !over || !appContent || fills && len(w.relHeld) > 0
}

// cppAppID reports whether a C++ peer's message with this ID is the
// application's: all but the IDs its library uses.
func cppAppID(id uint32) bool {
	switch id {
	case idPingRequest, idPingReply, idFlowControlRequest, idPacketAck, idDisconnect, idDisconnectAck:
		return false
	}
	return true
}

// handleMessage processes one message block of an accepted datagram
// with PacketID pid.
func (w *cppWire) handleMessage(now time.Time, pid uint32, m *cppMessage) {
	s := w.s
	if m.reliable {
		if w.relIn.has(m.relNum) {
			s.stats.DuplicateMessages++
			return
		}
		w.relIn.add(m.relNum)
	}
	if m.fragment {
		w.handleFragment(now, pid, m)
		return
	}
	if m.id == idPingReply && s.awaitsProof() {
		right := len(m.payload) == 1 && uint32(m.payload[0]) == s.handshake.challenge
		if !s.takeProof(now, right) {
			return
		}
	}
	if s.handlePing(now, m.id, m.payload) {
		return
	}
	switch m.id {
	case idPacketAck:
		w.handlePacketAck(now, m.payload)
	case idDisconnect:
		w.handleDisconnect(now, m)
	case idDisconnectAck:
		s.apply(now, heldDisconnectAck, 0, nil, m.reliable, m.inOrder, false)
	default:
		w.deliver(now, pid, m.relNum, heldApp, m.id, m.payload, m.reliable, m.inOrder, true)
	}
}

// handlePacketAck takes a PacketAck (session.takeAck).
func (w *cppWire) handlePacketAck(now time.Time, p []byte) {
	if a, ok := parseCppPacketAck(p); ok && w.s.state != stateDone {
		w.s.takeAck(now, a)
	}
}

// deliver applies a message now, or holds it until the messages numbered
// before it have arrived (reliable in-order ones); an unreliable in-order
// one from a datagram older than the last one's is dropped. wire says that
// payload is the datagram's being handled (see session.deliver).
func (w *cppWire) deliver(now time.Time, pid, rel uint32, kind heldKind, id uint32, payload []byte, reliable, inOrder, wire bool) {
	s := w.s
	switch {
	case reliable && inOrder:
		if len(w.relHeld) == 0 && w.relReady(rel) {
			s.apply(now, kind, id, payload, true, true, wire)
			return
		}
		heap.Push(&w.relHeld, cppHeld{rel: rel, kind: kind, id: id, payload: append([]byte(nil), payload...)})
		w.relHeldBytes += len(payload) + cppHeldCost
	case !reliable && kind == heldApp:
		// An unreliable message from a datagram older than the last
		// one's that had an in-order message goes: that one may name it
		// (a dependency, or a newer state of its ContentID), and the wire
		// does not say.
		if w.seqStarted && seqLess(pid, w.seqPID) {
			s.stats.DroppedMessages++
			return
		}
		if inOrder {
			w.seqPID, w.seqStarted = pid, true
		}
		s.apply(now, kind, id, payload, false, inOrder, wire)
	default:
		s.apply(now, kind, id, payload, reliable, inOrder, wire)
	}
}

// relReady reports whether an in-order message numbered rel can go: every
// number before it has arrived, and no in-order fragmented message begun
// before it is still incomplete.
func (w *cppWire) relReady(rel uint32) bool {
	if relDiff(rel, w.relIn.next) <= 0 {
		return false
	}
	for _, o := range w.relOpen {
		if relDiff(o, rel) > 0 {
			return false
		}
	}
	return true
}

// releaseRelHeld applies the held in-order messages now ready, in order.
func (w *cppWire) releaseRelHeld(now time.Time) {
	for len(w.relHeld) > 0 && w.s.state != stateDone && w.relReady(w.relHeld[0].rel) {
		w.applyFirstHeld(now)
	}
}

// applyRelHeld applies every held message, in order.
func (w *cppWire) applyRelHeld(now time.Time) {
	for len(w.relHeld) > 0 && w.s.state != stateDone {
		w.applyFirstHeld(now)
	}
}

// applyFirstHeld applies the held message with the lowest number.
func (w *cppWire) applyFirstHeld(now time.Time) {
	e := heap.Pop(&w.relHeld).(cppHeld)
	w.relHeldBytes -= len(e.payload) + cppHeldCost
	if len(w.relHeld) == 0 {
		w.relFlushAt = time.Time{}
	}
	w.s.apply(now, e.kind, e.id, e.payload, true, true, false)
}

// cppHeldCost is what a held message counts for beyond its payload, so
// that empty ones cannot pile up unbounded.
const cppHeldCost = 64

// relHeap is the held in-order messages, lowest reliable number first.
// Their numbers all lie within maxRelWindow, so serial order is total.
type relHeap []cppHeld

func (h relHeap) Len() int           { return len(h) }
func (h relHeap) Less(i, j int) bool { return relDiff(h[i].rel, h[j].rel) > 0 }
func (h relHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *relHeap) Push(x any)        { *h = append(*h, x.(cppHeld)) }
func (h *relHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	old[len(old)-1] = cppHeld{}
	*h = old[:len(old)-1]
	return e
}

// handleDisconnect takes the peer's Disconnect. It is in order after
// everything the peer sent: it waits for what is missing before it, but
// not for long, since a C++ peer sends nothing after it (no resend of
// what we miss); past relFlushWait what arrived goes to the application
// and the Disconnect is answered.
func (w *cppWire) handleDisconnect(now time.Time, m *cppMessage) {
	if !m.reliable || w.relReady(m.relNum) && len(w.relHeld) == 0 {
		w.applyRelHeld(now)
		w.s.apply(now, heldDisconnect, 0, nil, true, true, false)
		return
	}
	w.deliver(now, 0, m.relNum, heldDisconnect, 0, nil, true, true, false)
	if w.relFlushAt.IsZero() {
		w.relFlushAt = now.Add(w.relFlushWait())
	}
}

// relFlushWait is how long a held Disconnect waits for the messages
// before it: two retransmission timeouts, at least 100ms.
func (w *cppWire) relFlushWait() time.Duration {
	return max(2*w.s.loss.rto(), 100*time.Millisecond)
}

// deadline is the C++ wire's timer on an open connection: the end of a
// held Disconnect's wait (advance).
func (w *cppWire) deadline() time.Time { return w.relFlushAt }

// advance applies every held message, in order, gaps or not, once the
// peer's Disconnect waited long enough (see handleDisconnect).
func (w *cppWire) advance(now time.Time) {
	if w.relFlushAt.IsZero() || now.Before(w.relFlushAt) {
		return
	}
	w.relFlushAt = time.Time{}
	w.relOpen = w.relOpen[:0]
	w.applyRelHeld(now)
}

// handleFragment feeds a fragment to reassembly and, once the message is
// whole, delivers it in its FragmentStart's place.
func (w *cppWire) handleFragment(now time.Time, pid uint32, m *cppMessage) {
	s := w.s
	msg := message{fragStart: m.fragStart, fragment: true, fragCount: m.fragCount, transferID: m.transferID,
		fragNumber: m.fragNumber, id: m.id, payload: m.payload}
	var order startOrder
	if m.fragStart {
		order = startOrder{reliable: m.reliable, inOrder: m.inOrder, rel: m.relNum}
		if m.reliable && m.inOrder {
			w.relOpen = append(w.relOpen, m.relNum)
		}
	}
	t, whole, ok := s.reassemble(&msg, msgRef{pid: pid}, &order)
	if !ok || whole == nil {
		return
	}
	reliable, inOrder, id, rel := t.order.reliable, t.order.inOrder, t.id, t.order.rel
	s.endTransfer(t, whole)
	if i := slices.Index(w.relOpen, rel); i >= 0 && reliable && inOrder {
		w.relOpen = slices.Delete(w.relOpen, i, i+1)
	}
	w.deliver(now, pid, rel, heldApp, id, whole, reliable, inOrder, false)
	s.reclaimLent()
}
