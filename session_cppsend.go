package knet

import "time"

// Sending on the C++ wire (see session_cpp.go). The queues, the rate
// control, loss detection and the probe timer are the session's, shared
// with the spec's wire; what differs is the packing, the control messages
// and retransmission, which goes under a new PacketID.

// control builds the datagram of a connection control message: the
// opening (idConnectSyn), the server's answer to it (idConnectSynAck: a
// PingRequest), Disconnect (reliable and in order, under one reliable
// number however often it goes) and DisconnectAck. The wire carries no
// payload in them.
func (w *cppWire) control(buf []byte, id uint32, _ []byte) []byte {
	s := w.s
	if id == idConnectSyn {
		b := append(buf[:0], cppOpening[:]...)
		s.stats.DatagramsSent++
		s.stats.BytesSent += uint64(len(b))
		return b
	}
	h := cppHeader{packetID: s.send.nextPID, inOrder: true}
	m := cppMessage{inOrder: true, id: id}
	var one [1]byte
	switch id {
	case idConnectSynAck:
		// The same random ID every time it goes: the PingReply echoing
		// it proves the client is at its address (takeProof).
		if s.handshake.synAckSends == 0 {
			s.handshake.challenge = randomBits(0xff)
		}
		one[0] = byte(s.handshake.challenge)
		m.id, m.payload = idPingRequest, one[:]
	case idDisconnect:
		if !w.hasDiscRel {
			w.discRel, w.hasDiscRel = w.relOut, true
			w.relOut = relNextNum(w.relOut)
		}
		h.reliable, h.relBase = true, w.discRel
		m.reliable, m.relNum = true, w.discRel
	}
	b := appendCppHeader(buf[:0], &h)
	b = appendCppMessage(b, &m, h.relBase)
	if !s.amplifies(b) { // 7 bytes answer the 8 of the opening
		return nil
	}
	s.sentUnreliable(b)
	return b
}

// resend sends d, found lost, again under the next PacketID: the
// reference keeps PacketIDs unique, and its receiver drops a PacketID seen
// before. The reliable numbers inside tell the messages for what they are.
func (w *cppWire) resend(now time.Time, d *sent) {
	s := w.s
	pid := s.send.nextPID
	d.b[0] = d.b[0]&^0x3f | byte(pid&0x3f)
	hi := pid >> 6
	d.b[1], d.b[2] = byte(hi), byte(hi>>8)
	s.loss.resendAs(now, d, pid)
	s.loss.sent.trim(s.trimmed) // the stand-in, if it is at the front
	d.pn = s.send.nextPN
	s.numberNew(true)
}

// appendAck appends a PacketAck message for a.
func (w *cppWire) appendAck(b []byte, a packetAck) []byte {
	var p [packetAckSize]byte
	return appendCppMessage(b, &cppMessage{inOrder: true, id: idPacketAck, payload: appendCppPacketAck(p[:0], a)}, 0)
}

// freed takes what the acks of a datagram freed: the reliable numbers
// acked, and the datagrams carrying fragments, one of which may now go.
func (w *cppWire) freed(a *ackResult) {
	for _, r := range a.rels {
		w.relAcked.addRange(r.first, r.count)
	}
	w.fragFlight -= a.fragDgrams
}

// dropSending forgets the datagrams carrying fragments in flight.
func (w *cppWire) dropSending() { w.fragFlight = 0 }

// latestTags: the reference's wire has no tag, so reliable messages with a
// ContentID are plain reliable ones.
func (w *cppWire) latestTags() bool { return false }

// acked reports whether reliable message t, packed whole, is known to
// have arrived: every reliable number up to its last is acked (datagrams
// are resent under new PacketIDs, so those tell nothing), and none of an
// in-order transfer still open comes before it. That is all a receiver
// waits for on this wire (alone): what t depends on has lower numbers, or
// is unreliable and does not hold it.
func (w *cppWire) acked(t *track) (acked, alone bool) {
	if relDiff(t.relLast, w.relAcked.next) <= 0 {
		return false, false
	}
	if w.bulkInOrder && (w.s.send.bulk != nil || w.fragFlight > 0) && relDiff(w.bulkRel, t.relLast) > 0 {
		return false, false
	}
	return true, true
}

// cppPacking is a C++ datagram being filled.
type cppPacking struct {
	packing
	reliable bool   // a reliable datagram: messages get reliable numbers from base on
	base     uint32 // ReliableMsgNumBase
	rels     int    // reliable numbers taken
	inOrder  bool   // a message has the InOrder bit
}

// room is how many bytes the datagram can still take.
func (p *cppPacking) room() int {
	n := p.limit - cppHeaderSize - len(p.body)
	if p.reliable {
		n -= sizeVLE1516(p.base)
	}
	return n
}

// nextRel is the reliable number of the next message placed.
func (p *cppPacking) nextRel() uint32 { return (p.base + uint32(p.rels)) & maxRelNum }

// buildReliable packs reliable messages into a new datagram, followed by
// whatever acks fit.
func (w *cppWire) buildReliable(now time.Time) []byte {
	s := w.s
	p := cppPacking{packing: packing{body: s.sc().body[:0], limit: s.cfg.maxDatagram, tids: s.sc().tidBuf[:0]},
		reliable: true, base: w.relOut}
	w.pack(now, &p, &s.send.relQ)
	s.sc().body, s.sc().tidBuf = p.body, p.tids
	if p.count == 0 {
		return nil
	}
	n := len(p.body)
	p.body = s.appendAcks(now, p.room(), p.body, false)
	p.inOrder = p.inOrder || len(p.body) > n // PacketAcks have the InOrder bit
	s.sc().body = p.body
	h := cppHeader{packetID: s.send.nextPID, reliable: true, inOrder: p.inOrder, relBase: p.base}
	b := appendCppHeader(s.getBuf(cppHeaderSize+sizeVLE1516(w.relOut)+len(p.body)), &h)
	b = append(b, p.body...)
	d := s.sentReliable(now, h.packetID, b, &p.packing)
	s.acks.carried(d, len(s.sc().ackBuf)) // the acks appendAcks put in it
	d.relFirst, d.relCount = p.base, p.rels
	if len(p.tids) > 0 {
		w.fragFlight++
	}
	w.relOut = p.nextRel()
	return b
}

// pollUnreliable builds an unreliable datagram when acks, pings or
// unreliable messages are due.
func (w *cppWire) pollUnreliable(now time.Time, buf []byte) []byte {
	s := w.s
	acksDue, pingDue, data := s.unreliableDue(now)
	if !acksDue && !pingDue && len(s.live.pingReplies) == 0 && !data {
		return nil
	}
	p := cppPacking{packing: packing{body: s.sc().body[:0], limit: s.cfg.maxDatagram}}
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
	acks := 0
	if s.acks.pending() > 0 {
		n := len(p.body)
		p.body = s.appendAcks(now, p.room(), p.body, true)
		if acks = len(p.body) - n; acks > 0 {
			p.count += len(s.sc().ackBuf)
		}
	}
	if s.acks.pending() == 0 {
		s.owed.take(oweAckNow)
	}
	p.inOrder = p.count > 0 // library messages have the InOrder bit
	packed := false
	if data {
		before := p.count
		w.pack(now, &p, &s.send.unrelQ)
		if p.count > before {
			packed = true
			s.rc.sentUnpaced()
		}
	}
	s.sc().body = p.body
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
	s.spendAckCredit(b, acks, packed)
	s.sentForReceipt(now, h.packetID)
	return b
}

// pack fills the datagram from q, as the spec wire's pack does: whole
// messages and the first fragments of transfers in queue order, then
// further fragments of the transfer under way.
func (w *cppWire) pack(now time.Time, p *cppPacking, q *sendQueue) {
	s := w.s
	for i := q.head; i < len(q.items) && p.room() >= 8 && p.count < maxPerDatagram; i++ {
		m := q.items[i]
		if m.done || (m.frag && m.off > 0) {
			continue
		}
		if !w.place(now, p, m) {
			p.skipped++
			if p.skipped > maxSkipped {
				break
			}
		} else {
			s.sentShare(m)
			if !m.reliable && !m.frag && s.wantsReceipt(m) {
				s.placedForReceipt(m)
			}
		}
	}
	if q == &s.send.relQ {
		for s.send.bulk != nil && w.fragFlight == 0 && p.room() >= 16 && p.count < maxPerDatagram {
			if !w.placeFragment(p, s.send.bulk) {
				break
			}
		}
	}
	q.compact(s.freeQueued)
}

// depsReady reports whether m may go: what it depends on went before
// it, and, for an unreliable message naming a reliable one, is acked. The
// receiver orders reliable messages by number but cannot hold an
// unreliable one for a reliable one (see Dialect).
func (w *cppWire) depsReady(now time.Time, m *outMsg) bool {
	s := w.s
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

// cppInOrder reports whether m goes with the InOrder bit: in-order
// messages, those that depend on others, and the states of a ContentID
// (so that an older one arriving after a newer one is dropped, or, when
// reliable, delivered before it).
func cppInOrder(m *outMsg) bool { return m.inOrder || len(m.deps) > 0 || m.contentID != 0 }

// place tries to put m (whole, or its first fragment) into the datagram.
// A fragmented transfer starts only when no datagram carrying fragments is
// unacked: see placeFragment.
func (w *cppWire) place(now time.Time, p *cppPacking, m *outMsg) bool {
	s := w.s
	if m.frag && (s.send.bulk != nil || w.fragFlight > 0) {
		return false
	}
	// A reliable in-order message waits while an in-order transfer is
	// still being sent: a reference receiver delivers in arrival order,
	// so one sent now, beside the transfer's stop-and-wait datagrams,
	// would reach its application before the message it follows.
	if p.reliable && s.send.bulk != nil && cppInOrder(m) && cppInOrder(s.send.bulk) {
		return false
	}
	if !w.depsReady(now, m) {
		return false
	}
	msg := cppMessage{inOrder: cppInOrder(m), reliable: p.reliable, id: m.id, payload: m.payload}
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
		tid, ok := s.startTransfer(&p.packing, m)
		if !ok {
			return false
		}
		msg.transferID = tid
		w.bulkRel, w.bulkInOrder = msg.relNum, msg.inOrder
	}
	p.body = appendCppMessage(p.body, &msg, p.base)
	if p.reliable {
		p.rels++
	}
	p.inOrder = p.inOrder || msg.inOrder
	idx := p.took(m, len(msg.payload), msg.inOrder)
	if t := m.track; t != nil {
		t.placed(now, msgRef{s.send.nextPID, idx}, m, true)
		t.relLast = msg.relNum
	}
	return true
}

// placeFragment puts the next fragment of the transfer under way into the
// datagram. Fragments go in order, in datagrams sent one at a time, each
// once the one before is acked (pack): a reference receiver puts
// fragments together in the order they arrive, so one overtaking another,
// or a resend after later ones, would corrupt its message.
func (w *cppWire) placeFragment(p *cppPacking, m *outMsg) bool {
	end := min(m.off+m.fragSize, len(m.payload))
	msg := cppMessage{fragment: true, reliable: true, inOrder: cppInOrder(m), relNum: p.nextRel(),
		transferID: m.tid, fragNumber: m.fragNext, payload: m.payload[m.off:end]}
	if sizeCppMessage(&msg, p.base) > p.room() {
		return false
	}
	p.body = appendCppMessage(p.body, &msg, p.base)
	p.rels++
	p.inOrder = p.inOrder || msg.inOrder
	if t := m.track; t != nil {
		t.relLast = msg.relNum
	}
	w.s.tookFragment(&p.packing, m, end, w.s.send.nextPID)
	return true
}
