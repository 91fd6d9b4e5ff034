package knet

import "time"

// Delivery receipts (Config.Receipts): the fate of each message sent with
// SendRef, told once, as delivered or lost.
//
// A reliable message is delivered once every datagram up to the one that
// carried its last fragment is acked (specWire.acked, cppWire.acked): the
// same test that lets later messages stop naming it. It is lost only if
// the connection ends first.
//
// An unreliable message is delivered when the datagram it went in is
// acked. The protocol acks reliable datagrams only, so a datagram carrying
// unreliable messages that want a receipt also carries an ack request: a
// message block of reserved ID 5 (idExt) whose content is extAckRequest.
// A spec receiver ignores ID 5, as it ignores every reserved ID; knet's
// acks the datagram as it would a reliable one, in its PacketAcks, once
// it has taken every message in it (one dropped for want of room leaves
// the datagram unacked). The sender never resends such a datagram: an ack
// is news, its absence within receiptWait makes the messages lost. The
// reference dialect has no such request, so there an unreliable message
// is always reported lost after receiptWait.

// idExt is reserved message ID 5, which receivers ignore. knet's padding
// (zeros) and in-order anchors (empty) use it too; inside a connection, a
// first content byte other than 0 says which extension it is.
const idExt = idPadding

// Kinds of idExt content.
const (
	// extAckRequest asks the receiver to ack the (unreliable) datagram it
	// is in. It has no further content.
	extAckRequest = 1
)

var ackRequest = [1]byte{extAckRequest}

// ackRequestSize is the ack request's message block: the block header,
// the MessageID, the kind.
const ackRequestSize = 2 + 1 + 1

// maxReceipts is how many receipts a connection keeps for its application
// before it drops the oldest (Stats.ReceiptsDropped): an application that
// asks for receipts and never takes them does not make the connection
// grow without bound.
const maxReceipts = 4096

// A Receipt tells what became of a message sent with SendRef on a
// connection with Config.Receipts.
type Receipt struct {
	Ref Ref
	// Delivered is true when the peer acknowledged the message: the
	// datagram (every datagram, for a fragmented one) that carried it
	// was acked. An unreliable message is acked only once the peer's
	// knet took it in: with room for it in its receive queue, or held
	// there for a message it depends on (which it may still give up
	// on). False means lost: an unreliable message not acked within
	// about a retransmission timeout of its sending (a late ack is not
	// reported), one replaced or dropped before it left, or a reliable
	// one still unacked when the connection ended. A peer speaking the
	// reference dialect, or a spec peer other than knet, never acks an
	// unreliable message: all of them are reported lost.
	Delivered bool
}

// receipts is a session's record of the messages whose receipt is owed,
// made when the first one is sent.
type receipts struct {
	// Reliable messages (and unreliable ones sent as fragmented
	// transfers), in send order, from relHead.
	rel     []relReceipt
	relHead int
	// Unreliable messages sent, in send order, from unrelHead; a
	// resolved entry has ref 0.
	unrel     []unrelReceipt
	unrelHead int
	// Those placed in the datagram being built.
	cur []Ref
}

type relReceipt struct {
	t   *track
	ref Ref
}

type unrelReceipt struct {
	ref Ref
	pid uint32
	due time.Time // lost if not acked by then
}

// asksAck reports whether a datagram carries an ack request.
func asksAck(msgs []message) bool {
	for i := range msgs {
		if isAckRequest(&msgs[i]) {
			return true
		}
	}
	return false
}

// isAckRequest reports whether m is an ack request.
func isAckRequest(m *message) bool {
	return m.id == idExt && !m.fragment && len(m.payload) > 0 && m.payload[0] == extAckRequest
}

// wantsReceipt reports whether m is owed a receipt.
func (s *session) wantsReceipt(m *outMsg) bool { return s.cfg.receipts && m.tracked }

// receipt hands one to the application.
func (s *session) receipt(ref Ref, delivered bool) {
	if delivered {
		s.stats.ReceiptsDelivered++
	} else {
		s.stats.ReceiptsLost++
	}
	s.host.receipt(Receipt{Ref: ref, Delivered: delivered})
}

func (s *session) rcpts() *receipts {
	x := s.ext()
	if x.rcpt == nil {
		x.rcpt = new(receipts)
	}
	return x.rcpt
}

// queuedForReceipt records a reliable message, just queued and tracked,
// whose receipt is owed.
func (s *session) queuedForReceipt(m *outMsg) {
	r := s.rcpts()
	r.rel = append(r.rel, relReceipt{t: m.track, ref: m.ref})
	m.receipted = true
}

// placedForReceipt records an unreliable message placed in the datagram
// being built.
func (s *session) placedForReceipt(m *outMsg) {
	r := s.rcpts()
	r.cur = append(r.cur, m.ref)
	m.receipted = true
}

// receiptWait is how long an unreliable message's ack may take: a
// retransmission timeout, which holds a round trip, its variation and
// MaxAckDelay (the floor), plus MaxAckDelay again, as the peer holds acks
// that long.
func (s *session) receiptWait() time.Duration { return s.loss.rto() + s.cfg.maxAckDelay }

// sentForReceipt records the unreliable datagram pid, just built, as
// carrying the messages placed in it.
func (s *session) sentForReceipt(now time.Time, pid uint32) {
	r := s.rcptOf()
	if r == nil || len(r.cur) == 0 {
		return
	}
	due := now.Add(s.receiptWait())
	for _, ref := range r.cur {
		r.unrel = append(r.unrel, unrelReceipt{ref: ref, pid: pid, due: due})
	}
	r.cur = r.cur[:0]
}

// awaitsAck reports whether unreliable datagrams wait for acks.
func (r *receipts) awaitsAck() bool { return r != nil && r.unrelHead < len(r.unrel) }

// ackedUnreliable takes the ack of datagram pid: the unreliable messages
// it carried are delivered.
func (s *session) ackedUnreliable(pid uint32) {
	r := s.rcptOf()
	if !r.awaitsAck() {
		return
	}
	// Entries are in PacketID order: find the first with pid.
	w := r.unrel[r.unrelHead:]
	lo, hi := 0, len(w)
	for lo < hi {
		m := (lo + hi) / 2
		if seqLess(w[m].pid, pid) {
			lo = m + 1
		} else {
			hi = m
		}
	}
	for i := lo; i < len(w) && w[i].pid == pid; i++ {
		if w[i].ref != 0 {
			s.receipt(w[i].ref, true)
			w[i].ref = 0
		}
	}
	r.trimUnrel()
}

// trimUnrel drops resolved entries from the front.
func (r *receipts) trimUnrel() {
	for r.unrelHead < len(r.unrel) && r.unrel[r.unrelHead].ref == 0 {
		r.unrelHead++
	}
	if r.unrelHead == len(r.unrel) {
		r.unrel, r.unrelHead = r.unrel[:0], 0
	} else if r.unrelHead > 64 && r.unrelHead*2 > len(r.unrel) {
		n := copy(r.unrel, r.unrel[r.unrelHead:])
		r.unrel, r.unrelHead = r.unrel[:n], 0
	}
}

// expireReceipts reports lost the unreliable messages whose ack did not
// come in time.
func (s *session) expireReceipts(now time.Time) {
	r := s.rcptOf()
	if !r.awaitsAck() {
		return
	}
	for i := r.unrelHead; i < len(r.unrel) && !now.Before(r.unrel[i].due); i++ {
		if e := &r.unrel[i]; e.ref != 0 {
			s.receipt(e.ref, false)
			e.ref = 0
		}
	}
	r.trimUnrel()
}

// receiptDeadline is when the oldest unreliable message still waiting for
// its ack is lost.
func (s *session) receiptDeadline(t *deadlines) {
	if r := s.rcptOf(); r.awaitsAck() {
		t.at(r.unrel[r.unrelHead].due)
	}
}

// checkReliableReceipts reports delivered the reliable messages now known
// to have arrived, in send order.
func (s *session) checkReliableReceipts() {
	r := s.rcptOf()
	if r == nil || r.relHead == len(r.rel) {
		return
	}
	for r.relHead < len(r.rel) {
		e := &r.rel[r.relHead]
		if e.ref == 0 {
			r.relHead++ // told already (relReceiptLost)
			continue
		}
		if e.t.ref == e.ref {
			if !e.t.packed || !e.t.complete {
				break
			}
			if acked, _ := s.wire.acked(e.t); !acked {
				break
			}
		}
		// Else the track was let go of, resolved: every datagram of it
		// acked (sendOrder.forget; dropSending reports what is left
		// before it lets go of the rest).
		s.receipt(e.ref, true)
		*e = relReceipt{}
		r.relHead++
	}
	if r.relHead == len(r.rel) {
		r.rel, r.relHead = r.rel[:0], 0
	} else if r.relHead > 64 && r.relHead*2 > len(r.rel) {
		n := copy(r.rel, r.rel[r.relHead:])
		clear(r.rel[n:])
		r.rel, r.relHead = r.rel[:n], 0
	}
}

// relReceiptLost tells lost the reliable message ref, replaced before it
// was acked.
func (s *session) relReceiptLost(ref Ref) {
	r := s.rcptOf()
	if r == nil {
		return
	}
	for i := r.relHead; i < len(r.rel); i++ {
		if r.rel[i].ref == ref {
			r.rel[i] = relReceipt{}
			s.receipt(ref, false)
			return
		}
	}
}

// endReceipts settles every receipt still owed as the connection drops
// what it was sending: what is known delivered is, the rest is lost.
func (s *session) endReceipts() {
	if !s.cfg.receipts {
		return
	}
	s.checkReliableReceipts()
	if r := s.rcptOf(); r != nil {
		for _, e := range r.rel[r.relHead:] {
			if e.ref != 0 {
				s.receipt(e.ref, false)
			}
		}
		for _, e := range r.unrel[r.unrelHead:] {
			if e.ref != 0 {
				s.receipt(e.ref, false)
			}
		}
		for _, ref := range r.cur {
			s.receipt(ref, false)
		}
		s.x.rcpt = nil
	}
	// Unreliable messages still queued.
	for i := s.send.unrelQ.head; i < len(s.send.unrelQ.items); i++ {
		if m := s.send.unrelQ.items[i]; !m.done && m.tracked && !m.receipted {
			m.receipted = true
			s.receipt(m.ref, false)
		}
	}
}

// tidyReceipts lets go of emptied storage (see session.tidy).
func (s *session) tidyReceipts() {
	if r := s.rcptOf(); r != nil && r.relHead == len(r.rel) && r.unrelHead == len(r.unrel) && len(r.cur) == 0 {
		s.x.rcpt = nil
	}
}
