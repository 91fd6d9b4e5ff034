package knet

import "time"

// The specification's wire (DialectSpec; the codec is datagram.go,
// message.go, vle.go): the session's wire (session_wire.go) unless it
// speaks to a C++ peer. Receiving is here, sending in session_specsend.go;
// applying what arrives, with the dependencies the wire carries, is
// session_apply.go.

// specWire is the specification's wire. Its buffers are the session's
// (scratch.rd, scratch.wh): session_apply.go reads the datagram being
// handled. (The session's size is tight: path MTU discovery's state,
// which only this wire has, hangs from here.)
type specWire struct {
	s    *session
	pmtu *pmtuState // path MTU discovery (pmtu.go); nil when off
}

// The specification's wire has every word the session uses.
func (w *specWire) hasConnectAck() bool    { return true }
func (w *specWire) hasRefusal() bool       { return true }
func (w *specWire) sendsFlowControl() bool { return true }

// The specification's wire has no timer of its own.
func (w *specWire) deadline() time.Time { return time.Time{} }
func (w *specWire) advance(time.Time)   {}

// read takes one datagram from the peer. Everything is parsed first: a
// malformed datagram is dropped whole.
func (w *specWire) read(now time.Time, b []byte) {
	s := w.s
	if parseInto(b, &s.sc().rd) != nil {
		s.stats.InvalidDatagrams++
		return
	}
	d := &s.sc().rd
	s.countIn(len(b))
	switch s.state {
	case stateSyn:
		w.recvConnecting(now, d)
	case stateAdmit:
		w.recvAdmit(now, d)
	case stateLinger:
		s.recvLinger(now, d.has(idDisconnect))
	case stateClosing:
		w.recvClosing(now, d)
	default: // stateSynAck, stateOK
		w.recvOpen(now, d)
	}
}

// recvConnecting takes a datagram while the client waits for its
// ConnectSynAck: one completes the handshake, and what came with it is
// taken as on an open connection; a DisconnectAck is a refusal.
func (w *specWire) recvConnecting(now time.Time, d *datagram) {
	s := w.s
	for i := range d.msgs {
		m := &d.msgs[i]
		if m.fragment {
			continue
		}
		switch m.id {
		case idConnectSynAck:
			s.clientEstablished(now, m.payload)
			w.recvOpen(now, d)
			return
		case idDisconnectAck:
			s.fail(refusedErr(m.payload))
			return
		}
	}
}

// recvAdmit takes a datagram before the server's application decided on
// the connection: the first ConnectSyn is handed to it (evAdmit), anything
// else waits for the decision.
func (w *specWire) recvAdmit(now time.Time, d *datagram) {
	s := w.s
	if s.handshake.admitWaiting {
		return
	}
	for i := range d.msgs {
		if m := &d.msgs[i]; m.id == idConnectSyn && !m.fragment {
			s.handshake.admitWaiting = true
			s.events |= evAdmit
			s.handshake.syn = append([]byte(nil), m.payload...)
			s.live.lastRecv = now
			s.recv.win.add(d.packetID)
			return
		}
	}
}

// recvClosing takes a datagram while our Disconnect waits for its answer.
// The answer may come from a peer that has already forgotten us (the
// listener answers statelessly, PacketID 0, when our first DisconnectAck
// was lost): it ends the close whatever its PacketID. Before it comes, the
// peer's datagrams are taken as on an open connection.
func (w *specWire) recvClosing(now time.Time, d *datagram) {
	if d.has(idDisconnectAck) {
		w.s.closeDone()
		return
	}
	w.recvOpen(now, d)
}

// recvOpen takes a datagram of a connection past its handshake (or, on
// the server, completing it): duplicates are acked again, a reliable one
// without room goes unacked, the others are acked and their messages
// handled in order.
func (w *specWire) recvOpen(now time.Time, d *datagram) {
	s := w.s
	h, msgs := &d.header, d.msgs
	if s.seenBefore(now, h.packetID, h.reliable) {
		return
	}
	res := &s.recv.res
	res.begin(h.packetID, s.sc().depTable())
	if h.reliable && !w.admits(msgs) {
		// No room: leave it unacked so it comes again, but take the
		// acks it carries.
		res.end(false, nil)
		s.stats.DroppedDatagrams++
		s.alive(now)
		for i := range msgs {
			if !msgs[i].fragment && msgs[i].id == idPacketAck {
				w.handlePacketAck(now, msgs[i].payload)
			}
		}
		s.datagramDone(now, true)
		return
	}
	s.arrived(now, h.packetID, h.reliable)
	acked := false
	dropped := s.stats.DroppedMessages
	tagFor := -1 // the message a latest-state tag precedes (latest.go)
	var tag latestTag
	askAck := false // an ack request (receipts.go)
	for i := range msgs {
		if s.state == stateDone {
			break
		}
		m := &msgs[i]
		ref := msgRef{h.packetID, uint16(i)}
		if !m.fragment {
			switch {
			case m.id >= MinMessageID && m.id <= MaxMessageID && i != tagFor:
				// The application's, the most of what comes.
				if s.state == stateSynAck {
					s.establishServer(now)
				}
				if m.order == orderNone {
					s.applyWire(ref, m, h.reliable)
				} else {
					s.handleOrdered(now, h, ref, m, heldApp)
				}
				continue
			case m.id == idPacketAck:
				acked = true
			case m.id == idExt:
				var ok bool
				if tag, ok = parseLatestTag(m.payload); ok {
					tagFor = i + 1
				}
				askAck = askAck || isAckRequest(m)
				if isDrainNotice(m) {
					s.closing.peerReadsOn = true // session_close.go
				}
				if code, ok := parseCloseCode(m); ok && s.closing.peerCode == 0 {
					s.closing.peerCode = code // session_close.go
				}
			}
		}
		if i == tagFor && (!m.fragment || h.reliable && m.fragStart) && m.id >= MinMessageID && m.id <= MaxMessageID && m.order == orderNone {
			if m.fragStart {
				s.sc().ltag, s.sc().ltagOK = tag, true
			} else if !s.takeVersion(contentKey{m.id, tag.content}, tag.ver) {
				// A version no newer than one taken: a copy, or
				// replaced (not held: what waits for it goes on).
				s.stats.ObsoleteMessages++
				continue
			}
		}
		w.handleMessage(now, h, ref, m)
		s.sc().ltagOK = false
	}
	// What waited for this datagram goes on (resolver.arrived).
	s.sc().woken = res.end(true, s.sc().woken[:0])
	s.readyAll(s.sc().woken)
	s.runReady(now)
	s.flushDeliveries() // the receive queue says which had no room
	if askAck && !h.reliable && s.stats.DroppedMessages == dropped && s.state != stateDone {
		// The sender wants to hear that this unreliable datagram's
		// messages are in (receipts.go): acked as a reliable one is,
		// once, unless one was dropped for want of room. A copy of it
		// (seenBefore) is not acked again: the sender takes a missing
		// ack for a loss, which at worst it was not.
		s.acks.add(now, h.packetID)
	}
	s.datagramDone(now, acked)
}

// admits reports whether a reliable datagram fits our buffers, or makes
// progress: it carries a message that can be applied now and either held
// messages wait for it or the application has room for it, or a fragment
// the reassembly takes.
//
// Held messages alone may fill the buffer while the application has read
// everything; what fills the hole they wait behind must still get in, even
// when it is several datagrams back from the first held one.
func (w *specWire) admits(msgs []message) bool {
	s := w.s
	used := s.recvUsed()
	refused := s.overBudget(used) // budget.go: then only progress gets in
	over := refused || used+s.recv.res.bytes >= s.cfg.recvBuffer
	appContent := false
	for i := range msgs {
		m := &msgs[i]
		if m.fragment {
			if !s.recv.reasm.admits(m.transferID, len(m.payload)) {
				return false
			}
			appContent = true
			continue
		}
		if m.id >= MinMessageID && m.id <= MaxMessageID {
			appContent = true
		}
	}
	if !over || !appContent {
		return true
	}
	h := &s.sc().rd.header
	res, win := &s.recv.res, &s.recv.win
	if refused || used+res.bytes >= heldCap*s.cfg.recvBuffer {
		// Past the hard limit, or over the Listener's budget, nothing
		// more is held: only a datagram whose messages all apply at
		// once gets in. A peer filling one hole per datagram and
		// opening new ones gets no further.
		for i := range msgs {
			if m := &msgs[i]; !m.fragment || m.fragStart {
				t, all := s.depsOf(h, m)
				if lacks := res.unresolved(t, all, win, h.reliable); !lacks.empty() {
					return false
				}
			}
		}
	}
	appRoom := !refused && used < s.cfg.recvBuffer
	for i := range msgs {
		m := &msgs[i]
		ref := msgRef{h.packetID, uint16(i)}
		// Progress is a message held ones wait for (an anchor of ID 5
		// among them), or, while the application has room, application
		// content or a Disconnect: a message that applies at once but
		// that nothing waits for (a reserved ID, an ack) let a datagram
		// of held messages in with it (TestPeerHoldingReliableEmptyMessages).
		if !res.waitedOn(ref) {
			if !appRoom || !m.fragment && (m.id < MinMessageID || m.id > MaxMessageID) && m.id != idDisconnect {
				continue
			}
		}
		t, all := s.depsOf(h, m)
		if lacks := res.unresolved(t, all, win, h.reliable); lacks.empty() {
			return true
		}
	}
	return false
}

// heldCap is the hard limit, in ReceiveBuffers, on what the receive queue
// and the held messages may take together: past one ReceiveBuffer only
// datagrams that make progress get in, each adding at most its own, and a
// peer chaining such datagrams stops here.
const heldCap = 2

// handleMessage processes one message block of an accepted datagram.
func (w *specWire) handleMessage(now time.Time, h *header, ref msgRef, m *message) {
	s := w.s
	if m.fragment {
		s.handleFragment(now, h, ref, m)
		return
	}
	if s.handlePing(now, m.id, m.payload) {
		return
	}
	switch m.id {
	case idPacketAck:
		w.handlePacketAck(now, m.payload)
	case idConnectSyn:
		if s.state == stateSynAck {
			s.owed.owe(oweSynAck) // ours was lost
		}
	case idConnectSynAck:
		// A copy of one we already had; our ConnectAck is reliable
		// and takes care of itself.
	case idConnectAck:
		s.establishServer(now)
	case idDisconnect, idDisconnectAck:
		s.handleOrdered(now, h, ref, m, heldKindOf(m.id))
		return
	case idPath:
		// Ignored, as any reserved message, unless the connection is
		// secure.
		if s.secure {
			s.handlePath(m.payload)
		}
	default:
		if m.id >= MinMessageID && m.id <= MaxMessageID {
			s.establishServer(now)
			s.handleOrdered(now, h, ref, m, heldApp)
			return
		}
		// Reserved and unknown: ignored, which applies it.
	}
	// A connection control message is applied as it arrives, and may be
	// named by later messages (the first in-order message of a connection
	// names the ConnectAck): what waits for it goes on once the datagram
	// is handled (resolver.arrived).
}

func heldKindOf(id uint32) heldKind {
	switch id {
	case idDisconnect:
		return heldDisconnect
	case idDisconnectAck:
		return heldDisconnectAck
	}
	return heldApp
}

// handlePacketAck takes a PacketAck (session.takeAck); on a plaintext
// server waiting for its peer's proof, the first one is the proof
// (takeProof), or ends the attempt: one naming a PacketID never sent is
// no proof either.
func (w *specWire) handlePacketAck(now time.Time, p []byte) {
	s := w.s
	a, ok := parsePacketAck(p)
	if !ok || s.state == stateDone {
		return
	}
	if s.awaitsProof() && !s.takeProof(now, a.names(s.handshake.challenge) && s.ackedUnsent(a) == nil) {
		return
	}
	if !s.takeAck(now, a) {
		return
	}
	if s.rcptOf().awaitsAck() {
		a.each(s.ackedUnreliable)
	}
}
