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

// handleDatagram processes one datagram from the peer. b is not kept.
func (s *session) handleDatagram(now time.Time, b []byte) {
	if s.state == stateDone {
		return
	}
	if s.ref != nil {
		s.handleRefDatagram(now, b)
		return
	}
	// Parse everything first: a malformed datagram is dropped whole.
	if parseInto(b, &s.scratch.rd) != nil {
		s.stats.InvalidDatagrams++
		return
	}
	d := &s.scratch.rd
	s.countIn(len(b))
	switch s.state {
	case stateSyn:
		s.recvConnecting(now, d)
	case stateAdmit:
		s.recvAdmit(now, d)
	case stateLinger:
		s.recvLinger(now, d)
	case stateClosing:
		s.recvClosing(now, d)
	default: // stateSynAck, stateOK
		s.recvOpen(now, d)
	}
}

// recvConnecting takes a datagram while the client waits for its
// ConnectSynAck: one completes the handshake, and what came with it is
// taken as on an open connection; a DisconnectAck is a refusal.
func (s *session) recvConnecting(now time.Time, d *datagram) {
	for i := range d.msgs {
		m := &d.msgs[i]
		if m.fragment {
			continue
		}
		switch m.id {
		case idConnectSynAck:
			s.clientEstablished(now, m.payload)
			s.recvOpen(now, d)
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
func (s *session) recvAdmit(now time.Time, d *datagram) {
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

// recvLinger takes a datagram after we answered the peer's Disconnect: a
// Disconnect again means our DisconnectAck was lost.
func (s *session) recvLinger(now time.Time, d *datagram) {
	s.live.lastRecv = now
	if d.has(idDisconnect) {
		s.owed.owe(oweDiscAck)
	}
}

// recvClosing takes a datagram while our Disconnect waits for its answer.
// The answer may come from a peer that has already forgotten us (the
// listener answers statelessly, PacketID 0, when our first DisconnectAck
// was lost): it ends the close whatever its PacketID. Before it comes, the
// peer's datagrams are taken as on an open connection.
func (s *session) recvClosing(now time.Time, d *datagram) {
	if d.has(idDisconnectAck) {
		s.state = stateDone
		return
	}
	s.recvOpen(now, d)
}

// countIn counts a well-formed datagram of n bytes in, and, on a server
// not yet open, the credit it earns (anti-amplification).
func (s *session) countIn(n int) {
	s.stats.DatagramsReceived++
	s.stats.BytesReceived += uint64(n)
	if !s.client && !s.handshake.wasOpen {
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
	// Every datagram takes the next PacketID, so a skipped one means
	// something went missing, and an older one arriving fills a gap:
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

// recvOpen takes a datagram of a connection past its handshake (or, on
// the server, completing it): duplicates are acked again, a reliable one
// without room goes unacked, the others are acked and their messages
// handled in order.
func (s *session) recvOpen(now time.Time, d *datagram) {
	h, msgs := &d.header, d.msgs
	if s.seenBefore(now, h.packetID, h.reliable) {
		return
	}
	if h.reliable && !s.admits(msgs) {
		// No room: leave it unacked so it comes again, but take the
		// acks it carries.
		s.stats.DroppedDatagrams++
		s.alive(now)
		for i := range msgs {
			if !msgs[i].fragment && msgs[i].id == idPacketAck {
				s.handlePacketAck(now, msgs[i].payload)
			}
		}
		s.afterAcks(now)
		s.flow.arrivals++
		s.flowControl(now)
		return
	}
	s.arrived(now, h.packetID, h.reliable)
	acked := false
	for i := range msgs {
		if s.state == stateDone {
			break
		}
		m := &msgs[i]
		if !m.fragment && m.id == idPacketAck {
			acked = true
		}
		s.handleMessage(now, h, msgRef{h.packetID, uint16(i)}, m)
	}
	if acked {
		s.afterAcks(now)
	}
	s.flow.arrivals++
	s.flowControl(now)
}

// admits reports whether a reliable datagram fits our buffers, or makes
// progress: it carries a message that can be applied now and either held
// messages wait for it or the application has room for it, or a fragment
// the reassembly takes.
//
// Held messages alone may fill the buffer while the application has read
// everything; what fills the hole they wait behind must still get in, even
// when it is several datagrams back from the first held one.
func (s *session) admits(msgs []message) bool {
	used := s.host.recvUsed()
	over := used+s.recv.res.bytes >= s.cfg.recvBuffer
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
	h := &s.scratch.rd.header
	appRoom := used < s.cfg.recvBuffer
	for i := range msgs {
		ref := msgRef{h.packetID, uint16(i)}
		if !appRoom && !s.recv.res.waitedOn(ref) {
			continue
		}
		deps := appendDeps(s.scratch.deps[:0], h, &msgs[i])
		if len(s.recv.res.pendingDeps(&s.recv.win, deps, h.reliable)) == 0 {
			return true
		}
	}
	return false
}

// handleMessage processes one message block of an accepted datagram.
func (s *session) handleMessage(now time.Time, h *header, ref msgRef, m *message) {
	if m.fragment {
		s.handleFragment(now, h, ref, m)
		return
	}
	if s.handlePing(now, m.id, m.payload) {
		return
	}
	switch m.id {
	case idPacketAck:
		s.handlePacketAck(now, m.payload)
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
		s.handleOrdered(now, h, ref, m.id, m.payload, heldKindOf(m.id))
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
			s.handleOrdered(now, h, ref, m.id, m.payload, heldApp)
			return
		}
		// Reserved and unknown: ignored, which applies it.
	}
	// A connection control message is applied as it arrives, and may be
	// named by later messages (the first in-order message of a connection
	// names the ConnectAck): release what waits for it.
	s.cascade(now, ref)
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

func (s *session) protocolError(err error) {
	s.stats.ProtocolErrors++
	s.fail(&ProtocolError{Err: err})
}

func (s *session) handlePacketAck(now time.Time, p []byte) {
	a, ok := parsePacketAck(p)
	if !ok {
		return
	}
	s.loss.onPacketAck(now, a, &s.scratch.acked)
}
