package knet

import (
	"slices"
	"time"
)

// Sending in the reference dialect (see session_ref.go). The queues, the
// rate control, loss detection and the probe timer are the spec dialect's;
// what differs is the packing, the control messages and retransmission,
// which goes under a new PacketID.

// refControl builds the datagram of a connection control message: the
// opening (idConnectSyn), the server's answer to it (idConnectSynAck: a
// PingRequest), Disconnect (reliable and in order, under one reliable
// number however often it goes) and DisconnectAck.
func (s *session) refControl(buf []byte, id uint32) []byte {
	if id == idConnectSyn {
		b := append(buf[:0], refOpening[:]...)
		s.stats.DatagramsSent++
		s.stats.BytesSent += uint64(len(b))
		return b
	}
	h := cppHeader{packetID: s.send.nextPID, inOrder: true}
	m := cppMessage{inOrder: true, id: id}
	var one [1]byte
	switch id {
	case idConnectSynAck:
		one[0] = s.live.nextPingID
		s.live.nextPingID++
		m.id, m.payload = idPingRequest, one[:]
	case idDisconnect:
		if !s.ref.hasDiscRel {
			s.ref.discRel, s.ref.hasDiscRel = s.ref.relOut, true
			s.ref.relOut = relNextNum(s.ref.relOut)
		}
		h.reliable, h.relBase = true, s.ref.discRel
		m.reliable, m.relNum = true, s.ref.discRel
	}
	b := appendCppHeader(buf[:0], &h)
	b = appendCppMessage(b, &m, h.relBase)
	if !s.amplifies(b) { // 7 bytes answer the 8 of the opening
		return nil
	}
	s.sentUnreliable(b)
	return b
}

// refResend sends d, found lost, again under the next PacketID: the
// reference keeps PacketIDs unique, and its receiver drops a PacketID seen
// before. The reliable numbers inside tell the messages for what they are.
func (s *session) refResend(now time.Time, d *sent) {
	pid := s.send.nextPID
	d.b[0] = d.b[0]&^0x3f | byte(pid&0x3f)
	hi := pid >> 6
	d.b[1], d.b[2] = byte(hi), byte(hi>>8)
	s.loss.resendAs(now, d, pid)
	s.loss.sent.trim(s.trimmed) // the stand-in, if it is at the front
	d.pn = s.send.nextPN
	s.numberNew()
}

// refPacking is a reference datagram being filled.
type refPacking struct {
	body     []byte
	limit    int
	reliable bool   // a reliable datagram: messages get reliable numbers from base on
	base     uint32 // ReliableMsgNumBase
	rels     int    // reliable numbers taken
	inOrder  bool   // a message has the InOrder bit
	count    int
	appBytes int
	holds    bool
	tids     []byte
	skipped  int
}

func (p *refPacking) room() int {
	n := p.limit - cppHeaderSize - len(p.body)
	if p.reliable {
		n -= sizeVLE1516(p.base)
	}
	return n
}

// nextRel is the reliable number of the next message placed.
func (p *refPacking) nextRel() uint32 { return (p.base + uint32(p.rels)) & maxRelNum }

// buildRefReliable packs reliable messages into a new datagram, followed
// by whatever acks fit.
func (s *session) buildRefReliable(now time.Time) []byte {
	p := refPacking{body: s.scratch.body[:0], limit: s.cfg.maxDatagram, reliable: true, base: s.ref.relOut, tids: s.scratch.tidBuf[:0]}
	s.packRef(now, &p, &s.send.relQ)
	s.scratch.body, s.scratch.tidBuf = p.body, p.tids
	if p.count == 0 {
		return nil
	}
	n := len(p.body)
	p.body = s.appendAcks(now, p.room(), p.body, false)
	p.inOrder = p.inOrder || len(p.body) > n // PacketAcks have the InOrder bit
	s.scratch.body = p.body
	h := cppHeader{packetID: s.send.nextPID, reliable: true, inOrder: p.inOrder, relBase: p.base}
	b := appendCppHeader(s.getBuf(), &h)
	b = append(b, p.body...)
	d := s.loss.sendNew(now, h.packetID, b)
	s.rc.sent(len(b))
	d.appBytes = p.appBytes
	if p.holds {
		d.hold = p.appBytes
		s.send.spanHold += d.hold
	}
	d.relFirst, d.relCount = p.base, p.rels
	d.transfers = append(d.transfers, p.tids...)
	if len(p.tids) > 0 {
		s.ref.fragFlight++
	}
	s.ref.relOut = p.nextRel()
	d.pn = s.send.nextPN
	s.numberNew()
	s.stats.DatagramsSent++
	s.stats.BytesSent += uint64(len(b))
	return b
}

// pollRefUnreliable builds an unreliable datagram when acks, pings or
// unreliable messages are due (see pollUnreliable).
func (s *session) pollRefUnreliable(now time.Time, buf []byte) []byte {
	acksDue, pingDue, data := s.unreliableDue(now)
	if !acksDue && !pingDue && len(s.live.pingReplies) == 0 && !data {
		return nil
	}
	p := refPacking{body: s.scratch.body[:0], limit: s.cfg.maxDatagram}
	var one [1]byte
	for _, id := range s.live.pingReplies {
		one[0] = id
		p.body = appendCppMessage(p.body, &cppMessage{inOrder: true, id: idPingReply, payload: one[:]}, 0)
		p.count++
	}
	s.live.pingReplies = s.live.pingReplies[:0]
	if pingDue {
		one[0] = s.pingNow(now)
		p.body = appendCppMessage(p.body, &cppMessage{inOrder: true, id: idPingRequest, payload: one[:]}, 0)
		p.count++
	}
	if s.acks.pending() > 0 {
		n := len(p.body)
		p.body = s.appendAcks(now, p.room(), p.body, true)
		if len(p.body) > n {
			p.count += len(s.scratch.ackBuf)
		}
	}
	if s.acks.pending() == 0 {
		s.owed.take(oweAckNow)
	}
	p.inOrder = p.count > 0 // library messages have the InOrder bit
	if data {
		before := p.count
		s.packRef(now, &p, &s.send.unrelQ)
		if p.count > before {
			s.rc.sentUnpaced()
		}
	}
	s.scratch.body = p.body
	if p.count == 0 {
		return nil
	}
	h := cppHeader{packetID: s.send.nextPID, inOrder: p.inOrder}
	b := appendCppHeader(buf[:0], &h)
	b = append(b, p.body...)
	if p.appBytes > 0 {
		s.host.sendDone(p.appBytes)
	}
	s.sentUnreliable(b)
	return b
}

// packRef fills the datagram from q, as pack does: whole messages and the
// first fragments of transfers in queue order, then further fragments of
// the transfer under way.
func (s *session) packRef(now time.Time, p *refPacking, q *sendQueue) {
	for i := q.head; i < len(q.items) && p.room() >= 8 && p.count < maxPerDatagram; i++ {
		m := q.items[i]
		if m.done || (m.frag && m.off > 0) {
			continue
		}
		if !s.placeRef(now, p, m) {
			p.skipped++
			if p.skipped > maxSkipped {
				break
			}
		}
	}
	if q == &s.send.relQ {
		for s.send.bulk != nil && s.ref.fragFlight == 0 && p.room() >= 16 && p.count < maxPerDatagram {
			if !s.placeRefFragment(now, p, s.send.bulk) {
				break
			}
		}
	}
	q.compact(s.freeQueued)
}

// refDepsReady reports whether m may go: what it depends on went before
// it, and, for an unreliable message naming a reliable one, is acked. The
// receiver orders reliable messages by number but cannot hold an
// unreliable one for a reliable one (see Dialect).
func (s *session) refDepsReady(now time.Time, m *outMsg) bool {
	for _, d := range m.deps {
		t := d.live()
		if t == nil || t.dropped {
			continue
		}
		if !t.packed {
			return false
		}
		if !m.reliable && t.reliable && !s.resolvedAtSender(now, t) {
			return false
		}
		// A fragmented message sent without the InOrder bit is delivered
		// whenever it is whole, after what follows it: wait for it.
		if t.reliable && t.fragmented && !t.inOrder && len(t.deps) == 0 && !s.resolvedAtSender(now, t) {
			return false
		}
	}
	return true
}

// refInOrder reports whether m goes with the InOrder bit: in-order
// messages, those that depend on others, and the states of a ContentID
// (so that an older one arriving after a newer one is dropped, or, when
// reliable, delivered before it).
func refInOrder(m *outMsg) bool { return m.inOrder || len(m.deps) > 0 || m.contentID != 0 }

// placeRef tries to put m (whole, or its first fragment) into the
// datagram. A fragmented transfer starts only when no datagram carrying
// fragments is unacked: see placeRefFragment.
func (s *session) placeRef(now time.Time, p *refPacking, m *outMsg) bool {
	if m.frag && (s.send.bulk != nil || s.ref.fragFlight > 0) {
		return false
	}
	// A reliable in-order message waits while an in-order transfer is
	// still being sent: a reference receiver delivers in arrival order,
	// so one sent now, beside the transfer's stop-and-wait datagrams,
	// would reach its application before the message it follows.
	if p.reliable && s.send.bulk != nil && refInOrder(m) && refInOrder(s.send.bulk) {
		return false
	}
	if !s.refDepsReady(now, m) {
		return false
	}
	msg := cppMessage{inOrder: refInOrder(m), reliable: p.reliable, id: m.id, payload: m.payload}
	if p.reliable {
		msg.relNum = p.nextRel()
	}
	if m.frag {
		msg.fragStart, msg.fragment = true, true
		msg.fragCount = m.fragCount
		msg.payload = m.payload[:m.fragSize]
	}
	if sizeCppMessage(&msg, p.base) > p.room() {
		return false
	}
	if m.frag {
		tid, ok := s.send.tids.alloc()
		if !ok {
			return false
		}
		m.tid = tid
		msg.transferID = tid
		s.send.tids.carried(tid)
		p.tids = append(p.tids, tid)
		m.fragNext = 1
		s.send.bulk = m
		s.ref.bulkRel, s.ref.bulkInOrder = msg.relNum, msg.inOrder
	}
	p.body = appendCppMessage(p.body, &msg, p.base)
	if p.reliable {
		p.rels++
	}
	p.inOrder = p.inOrder || msg.inOrder
	p.holds = p.holds || msg.inOrder || m.frag
	p.count++
	p.appBytes += len(msg.payload)
	m.off = len(msg.payload)
	if t := m.track; t != nil {
		t.placed(now, msgRef{s.send.nextPID, uint16(p.count - 1)}, m, true)
		t.relLast = msg.relNum
	}
	if !m.frag {
		m.done = true
	}
	return true
}

// placeRefFragment puts the next fragment of the transfer under way into
// the datagram. Fragments go in order, in datagrams sent one at a time,
// each once the one before is acked (packRef): a reference receiver puts
// fragments together in the order they arrive, so one overtaking another,
// or a resend after later ones, would corrupt its message.
func (s *session) placeRefFragment(now time.Time, p *refPacking, m *outMsg) bool {
	end := min(m.off+m.fragSize, len(m.payload))
	msg := cppMessage{fragment: true, reliable: true, inOrder: refInOrder(m), relNum: p.nextRel(),
		transferID: m.tid, fragNumber: m.fragNext, payload: m.payload[m.off:end]}
	if sizeCppMessage(&msg, p.base) > p.room() {
		return false
	}
	p.body = appendCppMessage(p.body, &msg, p.base)
	p.rels++
	p.count++
	p.appBytes += len(msg.payload)
	p.holds = true
	p.inOrder = p.inOrder || msg.inOrder
	if !slices.Contains(p.tids, m.tid) {
		s.send.tids.carried(m.tid)
		p.tids = append(p.tids, m.tid)
	}
	m.off = end
	m.fragNext++
	if t := m.track; t != nil {
		t.lastPID = s.send.nextPID
		t.relLast = msg.relNum
	}
	if m.fragNext == m.fragCount {
		if t := m.track; t != nil {
			t.complete = true
		}
		s.send.tids.release(m.tid)
		m.done = true
		s.send.bulk = nil
	}
	return true
}
