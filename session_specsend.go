package knet

import "time"

// Sending on the specification's wire (see session_spec.go): the control
// messages, the packing of reliable and unreliable datagrams with the
// dependencies they carry (session_deps.go works them out), and
// retransmission under the same PacketID.

// control builds an unreliable datagram holding one connection control
// message. Disconnect and DisconnectAck are in-order messages: their
// datagram has the InOrder flag, with no dependency left to name.
//
// A plaintext server's ConnectSynAck is the exception: its datagram is
// flagged Reliable, so that the client acks it (spec "Reliable
// Datagrams": the other end is expected to), and its PacketID, the
// session's first, is random (newSession); the ack naming it proves the
// client is at its address (takeProof). It goes again as it was, the same
// PacketID, as a reliable datagram does (DECISIONS §4), but it is no part
// of loss recovery: the handshake's timer resends it (synAckWent).
func (w *specWire) control(buf []byte, id uint32, payload []byte) []byte {
	s := w.s
	if s.spanFull() {
		return nil
	}
	// Before the connection opened (a refusal) there is nothing to be in
	// order after, and the flag's count byte would make the answer larger
	// than the smallest ConnectSyn.
	h := header{packetID: s.send.nextPID, inOrder: s.handshake.wasOpen && (id == idDisconnect || id == idDisconnectAck)}
	again := false
	if id == idConnectSynAck && !s.secure {
		if s.handshake.synAckSends == 0 {
			s.handshake.challenge = h.packetID
		}
		h.packetID, h.reliable = s.handshake.challenge, true
		again = s.handshake.synAckSends > 0
	}
	b := appendHeader(buf[:0], &h)
	if id == idDisconnect && s.closing.readOn {
		b = appendMessage(b, &message{id: idExt, payload: drainNotice[:]}) // session_close.go
	}
	if id == idDisconnect && s.closing.code != 0 {
		b = appendCloseCode(b, s.closing.code) // session_close.go
	}
	b = appendMessage(b, &message{id: id, payload: payload})
	if id == idConnectSyn {
		b = appendPadding(b, s.synPadding())
	}
	if !s.amplifies(b) {
		return nil
	}
	if again {
		s.stats.DatagramsSent++
		s.stats.BytesSent += uint64(len(b))
		return b
	}
	s.sentUnreliable(b)
	return b
}

// resend records d, found lost, going again as it was: same bytes, same
// PacketID, same packet number.
func (w *specWire) resend(now time.Time, d *sent) {
	w.s.loss.resend(now, d)
	w.s.send.out = outInfo{pn: d.pn}
}

// appendAck appends a PacketAck message for a.
func (w *specWire) appendAck(b []byte, a packetAck) []byte {
	var p [packetAckSize]byte
	return appendMessage(b, &message{id: idPacketAck, payload: appendPacketAck(p[:0], a)})
}

// The specification's wire keeps nothing of what it sent beside the
// session's state.
func (w *specWire) freed(*ackResult) {}
func (w *specWire) dropSending()     {}
func (w *specWire) latestTags() bool { return true }

// acked reports whether reliable message t, packed whole, is known to
// have arrived: every datagram up to its last one sent (not the one being
// built) is acked. The receiver may still hold it for what it depends on
// (alone is false): see resolvedWithin.
func (w *specWire) acked(t *track) (acked, alone bool) {
	s := w.s
	if !seqLess(t.lastPID, s.send.nextPID) {
		return false, false
	}
	if first := s.loss.sent.firstUnacked(); first != nil && !seqLess(t.lastPID, first.packetID) {
		return false, false
	}
	return true, false
}

// specPacking is a datagram of the specification's wire being filled.
type specPacking struct {
	packing
	h      *header // its header, where place adds dependencies
	whole0 bool    // the first block is a whole message
	// path is the size path MTU discovery found, when larger than limit:
	// a whole message too large for limit may take the datagram to it
	// (grow, pmtu.go).
	path int
}

// room is how many bytes the datagram can still take.
func (p *specPacking) room() int { return p.limit - sizeHeader(p.h) - len(p.body) }

// buildReliable packs reliable messages into a new datagram, followed by
// whatever acks fit.
func (w *specWire) buildReliable(now time.Time) []byte {
	if b := w.buildBulk(now); b != nil {
		return b
	}
	s := w.s
	if !s.owed.owes(oweAck|oweFlow|oweAnchor) && s.latestDue() {
		return w.buildLatest(now)
	}
	h := &s.sc().wh
	*h = header{packetID: s.send.nextPID, reliable: true, deltas: h.deltas[:0], indices: h.indices[:0]}
	p := specPacking{packing: packing{body: s.sc().body[:0], limit: s.cfg.maxDatagram, tids: s.sc().tidBuf[:0]}, h: h, path: s.datagramLimit()}
	if s.owed.take(oweAck) {
		p.body = appendMessage(p.body, &message{id: idConnectAck})
		p.count++
		p.whole0 = true
	} else if s.owed.owes(oweAnchor) {
		// An empty reserved message, applied as it arrives (a receiver
		// ignores it), for in-order messages to name: see wireDeps.
		p.body = appendMessage(p.body, &message{id: idPadding})
		p.count++
		p.whole0 = true
	}
	s.owed.take(oweAnchor)
	if s.owed.take(oweFlow) {
		p.body = appendMessage(p.body, &message{id: idFlowControlRequest, payload: []byte{byte(s.flow.rate), byte(s.flow.rate >> 8)}})
		if p.count == 0 {
			p.whole0 = true
		}
		p.count++
	}
	w.pack(now, &p, &s.send.relQ)
	s.sc().body, s.sc().tidBuf = p.body, p.tids
	if p.count == 0 {
		if s.latestQueued() > 0 {
			// None of the others can go yet (they may wait for a
			// version, DependsOn): versions of lower priority may.
			return w.buildLatest(now)
		}
		return nil
	}
	b, d := w.finishReliable(now, &p)
	s.acks.carried(d, len(s.sc().ackBuf)) // the acks finishReliable put in it
	d.whole0 = p.whole0
	if p.whole0 {
		s.anchors.lastWhole = msgRef{h.packetID, 0}
		s.anchors.hasLastWhole = true
	}
	return b
}

// finishReliable ends the reliable datagram p: the acks that fit after
// its messages, then its bytes, kept until acked (sentReliable).
func (w *specWire) finishReliable(now time.Time, p *specPacking) ([]byte, *sent) {
	s := w.s
	p.body = s.appendAcks(now, p.room(), p.body, false)
	s.sc().body = p.body
	b := s.getBuf(sizeHeader(p.h) + len(p.body))
	b = appendHeader(b, p.h)
	b = append(b, p.body...)
	return b, s.sentReliable(now, p.h.packetID, b, &p.packing)
}

// buildLatest packs reliable latest-state versions, each after its tag,
// into a new datagram of their own (see latest.go), followed by whatever
// acks fit.
func (w *specWire) buildLatest(now time.Time) []byte {
	s := w.s
	rl := s.rlOf()
	h := &s.sc().wh
	*h = header{packetID: s.send.nextPID, reliable: true, deltas: h.deltas[:0], indices: h.indices[:0]}
	p := specPacking{packing: packing{body: s.sc().body[:0], limit: s.cfg.maxDatagram, tids: s.sc().tidBuf[:0]}, h: h}
	placed := s.sc().lsent[:0]
	q := &rl.q
	for i := q.head; i < len(q.items) && p.count+2 <= maxPerDatagram; i++ {
		m := q.items[i]
		if m.done {
			// Placed in an earlier datagram past one that did not fit
			// there, and still queued behind it: not again.
			continue
		}
		msg := message{id: m.id, payload: m.payload}
		need := sizeMessage(&msg) + maxLatestTag
		if need > p.room() {
			if p.room() < 16 {
				break
			}
			continue
		}
		p.body = appendLatestTag(p.body, m.contentID, m.version)
		p.count++
		p.body = appendMessage(p.body, &msg)
		idx := p.took(m, len(m.payload), false)
		if t := m.track; t != nil {
			t.placed(now, msgRef{h.packetID, idx}, m, false)
		}
		placed = append(placed, latestSent{ref: m.ref, t: m.track, priority: m.priority, lostSends: m.lostSends})
		s.packedLatest(m)
		s.sentShare(m)
	}
	q.compact(s.freeQueued)
	s.sc().body, s.sc().tidBuf = p.body, p.tids
	defer func() {
		clear(placed)
		s.sc().lsent = placed[:0]
	}()
	if len(placed) == 0 {
		return nil
	}
	b, d := w.finishReliable(now, &p)
	d.latest = append(d.latest, placed...)
	for _, e := range placed {
		d.lostSends = max(d.lostSends, e.lostSends)
	}
	return b
}

// pollUnreliable builds an unreliable datagram when acks, pings or
// unreliable messages are due.
func (w *specWire) pollUnreliable(now time.Time, buf []byte) []byte {
	s := w.s
	acksDue, pingDue, data := s.unreliableDue(now)
	if !acksDue && !pingDue && len(s.live.pingReplies) == 0 && !data && !s.owed.owes(owePathResponse) || s.spanFull() {
		return nil
	}
	h := &s.sc().wh
	*h = header{packetID: s.send.nextPID, deltas: h.deltas[:0], indices: h.indices[:0]}
	p := specPacking{packing: packing{body: s.sc().body[:0], limit: s.cfg.maxDatagram}, h: h}
	if s.owed.take(owePathResponse) {
		var resp [1 + pathDataSize]byte
		resp[0] = pathResponse
		copy(resp[1:], s.path.challenge[:])
		p.body = appendMessage(p.body, &message{id: idPath, payload: resp[:]})
		p.count++
	}
	var one [1]byte
	for _, id := range s.live.pingReplies {
		one[0] = id
		p.body = appendMessage(p.body, &message{id: idPingReply, payload: one[:]})
		p.count++
	}
	s.live.pingReplies = s.live.pingReplies[:0]
	if pingDue {
		one[0] = s.pingNow(now)
		p.body = appendMessage(p.body, &message{id: idPingRequest, payload: one[:]})
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
	packed := false
	if data {
		before := p.count
		// Room for an ack request, should a message want a receipt.
		if s.cfg.receipts {
			p.limit -= ackRequestSize
		}
		w.pack(now, &p, &s.send.unrelQ)
		if s.cfg.receipts {
			p.limit += ackRequestSize
		}
		if p.count > before {
			packed = true
			s.rc.sentUnpaced()
		}
		if r := s.rcptOf(); r != nil && len(r.cur) > 0 {
			p.body = appendMessage(p.body, &message{id: idExt, payload: ackRequest[:]})
			p.count++
		}
	}
	s.sc().body = p.body
	if p.count == 0 {
		return nil
	}
	b := appendHeader(buf[:0], h)
	b = append(b, p.body...)
	if p.appBytes > 0 {
		s.host.sendDone(p.appBytes)
	}
	s.sentUnreliable(b)
	s.spendAckCredit(b, acks, packed)
	s.sentForReceipt(now, h.packetID)
	return b
}

// pack fills the datagram from q: whole messages and the first fragments of
// transfers in queue order, then further fragments of the transfer under way
// in the space left.
func (w *specWire) pack(now time.Time, p *specPacking, q *sendQueue) {
	s := w.s
	for i := q.head; i < len(q.items) && p.room() >= 4 && p.count < maxPerDatagram; i++ {
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
		for s.send.bulk != nil && p.room() >= 16 && p.count < maxPerDatagram {
			if !w.placeFragment(p, s.send.bulk) {
				break
			}
		}
	}
	q.compact(s.freeQueued)
}

// place tries to put m (whole, or its first fragment) into the datagram,
// with the dependencies it names.
func (w *specWire) place(now time.Time, p *specPacking, m *outMsg) bool {
	s, h := w.s, p.h
	s.pathSize(m)
	if m.frag && s.send.bulk != nil {
		return false // one transfer at a time keeps the receiver's reassembly small
	}
	refs, ok := s.wireDeps(now, m, h.packetID)
	if !ok {
		return false
	}
	mark := len(h.deltas)
	wasInOrder := h.inOrder
	msg := message{id: m.id}
	if !s.encodeDeps(h, &msg, refs, m.latest) {
		return false
	}
	if m.frag {
		msg.fragStart = true
		msg.fragment = true
		msg.fragCount = m.fragCount
		msg.payload = m.payload[:m.fragSize]
	} else {
		msg.payload = m.payload
	}
	tag := 0
	if m.version != 0 {
		// A version goes after its tag: an unreliable one, or one too
		// large for one datagram before its first fragment.
		tag = maxLatestTag
	}
	if sizeMessage(&msg)+tag > p.room() && !p.grow(s, m, sizeMessage(&msg)+tag) {
		h.deltas, h.indices, h.inOrder = h.deltas[:mark], h.indices[:mark], wasInOrder
		return false
	}
	if m.frag {
		tid, ok := s.startTransfer(&p.packing, m)
		if !ok {
			h.deltas, h.indices, h.inOrder = h.deltas[:mark], h.indices[:mark], wasInOrder
			return false
		}
		msg.transferID = tid
	}
	if m.version != 0 {
		p.body = appendLatestTag(p.body, m.contentID, m.version)
		p.count++
		if m.relLatest {
			s.packedLatest(m)
		}
	}
	p.body = appendMessage(p.body, &msg)
	if p.count == 0 && !m.frag && len(refs) == 0 {
		p.whole0 = true // applied as it arrives: an anchor
	}
	idx := p.took(m, len(msg.payload), len(refs) > 0)
	if t := m.track; t != nil {
		t.wire = append(t.wire[:0], refs...)
		t.placed(now, msgRef{h.packetID, idx}, m, len(refs) > 0)
	}
	return true
}

// placeFragment puts the next fragment of the transfer under way into the
// datagram.
func (w *specWire) placeFragment(p *specPacking, m *outMsg) bool {
	end := min(m.off+m.fragSize, len(m.payload))
	msg := message{fragment: true, transferID: m.tid, fragNumber: m.fragNext, payload: m.payload[m.off:end]}
	if sizeMessage(&msg) > p.room() {
		return false
	}
	p.body = appendMessage(p.body, &msg)
	w.s.tookFragment(&p.packing, m, end, p.h.packetID)
	return true
}
