package knet

import "slices"

// What a connection that ended did not get acknowledged
// (Conn.Unacknowledged): the reliable messages its Send accepted that
// are not known to have reached the peer, for a client that moves to
// another server (the token's next one) to send there.
//
// A dialed connection keeps each reliable message it queues, payload and
// all, in send order, until it is known delivered by the test delivery
// receipts use (receipts.go): every datagram up to the one that carried
// its last fragment is acked. The payload is the buffer Send copied it
// into, which packing would otherwise have handed back: a message is
// held from Send to that ack instead of from Send to its packing, so
// what is kept is what the send buffer counts (SendBuffer bounds it),
// and what the datagrams in flight past an unacked one carry. A
// message replaced before it went (a reliable latest-state version) is
// let go of as it is replaced. When the session drops what it was
// sending (its end: dropSending), those not known delivered become the
// list the connection hands its application.

// unackedState is a dialed connection's record of the reliable messages
// it keeps (extras.kept), made when the first one is queued.
type unackedState struct {
	msgs  []keptMsg // in send order from head, each until known delivered
	head  int
	sweep int       // when more than this many are kept, sweepKept runs
	ended bool      // the end made left: later refusals join it
	left  []Message // what the end left unacknowledged, in send order
	state bool      // left has a latest-state version
}

// keptMsg is a kept message and its Ref: the message's storage is
// recycled (putMsg) when a newer version replaces it, and the Ref then
// no longer matches.
type keptMsg struct {
	m   *outMsg
	ref Ref
}

// keep records m, just queued, if the connection keeps what it sends
// and m is reliable: m then has a track (sendOrder.add), whose packing
// and acks tell when it is delivered, and its storage is the record's
// until then (see freeQueued). Called before m is added to the send
// order.
func (s *session) keep(m *outMsg) {
	if !s.client || !m.reliable {
		return
	}
	k := s.keptState()
	if k.ended {
		return
	}
	m.keep = true
	k.msgs = append(k.msgs, keptMsg{m: m, ref: m.ref})
	if len(k.msgs)-k.head > max(k.sweep, minKeptSweep) {
		s.sweepKept(k)
	}
}

// delivered reports whether kept message e is known delivered, or no
// longer to be delivered (replaced by a newer version of its state).
func (s *session) delivered(e keptMsg) bool {
	m := e.m
	if m.ref != e.ref || m.track == nil {
		return true // replaced: its storage went back (putMsg), or its payload (a dead version)
	}
	t := m.track
	if t.ref != e.ref || t.dropped {
		// Its track was let go of: resolved (every datagram of it
		// acked, sendOrder.forget), or dropped, replaced.
		return true
	}
	if !t.packed || !t.complete {
		return false
	}
	acked, _ := s.wire.acked(t)
	return acked
}

// settleKept lets go of the kept messages now known delivered, in send
// order: after acks (afterAcks), and at the end.
func (s *session) settleKept() {
	k := s.keptOf()
	if k == nil || k.head == len(k.msgs) {
		return
	}
	for k.head < len(k.msgs) && s.delivered(k.msgs[k.head]) {
		s.letGo(k.msgs[k.head])
		k.msgs[k.head] = keptMsg{}
		k.head++
	}
	if k.head == len(k.msgs) {
		k.msgs, k.head = k.msgs[:0], 0
	} else if k.head > 64 && k.head*2 > len(k.msgs) {
		n := copy(k.msgs, k.msgs[k.head:])
		clear(k.msgs[n:])
		k.msgs, k.head = k.msgs[:n], 0
	}
}

// minKeptSweep is how many kept messages there may be before sweepKept
// looks past the first one not delivered.
const minKeptSweep = 256

// sweepKept lets go of the kept messages replaced (or delivered) behind
// one not yet delivered: a state that changes fast while the peer acks
// nothing would otherwise hold the storage of every version (the send
// buffer no longer counts them). keep runs it when the list has doubled
// since the last sweep, which makes its cost a constant per message kept.
func (s *session) sweepKept(k *unackedState) {
	live := k.msgs[:0]
	for _, e := range k.msgs[k.head:] {
		if s.delivered(e) {
			s.letGo(e)
			continue
		}
		live = append(live, e)
	}
	clear(k.msgs[len(live):])
	k.msgs, k.head = live, 0
	k.sweep = 2 * len(live)
}

// letGo ends the record's hold on e's storage: it is recycled here if
// the send queue let go of it already (left), by the queue otherwise.
func (s *session) letGo(e keptMsg) {
	m := e.m
	if m.ref != e.ref {
		return // recycled when it was replaced
	}
	m.keep = false
	if m.left {
		s.putMsg(m)
	}
}

// endKept makes the list of what the end leaves unacknowledged: the kept
// messages not known delivered, in send order, of each state (a
// reliable latest-state version) only the newest. Their payloads become
// the application's: they never go back to the pools. Called as the
// session drops what it was sending, before the queues and the send
// order forget it.
func (s *session) endKept() {
	k := s.keptOf()
	if k == nil || k.ended {
		return
	}
	k.ended = true
	s.settleKept()
	for _, e := range k.msgs[k.head:] {
		if s.delivered(e) {
			s.letGo(e) // acked, or replaced, past one that was not
			continue
		}
		s.leave(e.m)
		e.m.keep = false
		if e.m.left {
			s.putMsg(e.m)
		}
	}
	clear(k.msgs)
	k.msgs, k.head = nil, 0
	if k.state {
		// A state's older version, still in flight when a newer one
		// queued, goes no more: the newer is all the peer needs.
		last := map[contentKey]int{}
		for i, m := range k.left {
			if m.ContentID != 0 {
				last[contentKey{m.ID, m.ContentID}] = i
			}
		}
		n := 0
		for i, m := range k.left {
			if m.ContentID == 0 || last[contentKey{m.ID, m.ContentID}] == i {
				k.left[n] = m
				n++
			}
		}
		clear(k.left[n:])
		k.left = k.left[:n]
	}
}

// leave adds m, reliable and not delivered, to what the end leaves
// unacknowledged, its payload with it.
func (s *session) leave(m *outMsg) {
	k := s.keptState()
	k.left = append(k.left, Message{ID: m.id, Payload: m.payload, Reliable: true, InOrder: m.inOrder,
		Channel: m.channel, Priority: m.priority, ContentID: m.contentID})
	k.state = k.state || m.contentID != 0
	m.pbuf = nil // the payload is the application's now
}

// refusedKept adds m, a reliable message Send accepted that the session
// refuses (it ended, or answered the peer's Disconnect, since), to what
// the end leaves unacknowledged, if the connection keeps what it sends.
func (s *session) refusedKept(m *outMsg) {
	if s.client && m.reliable {
		s.leave(m)
	}
}

// Unacknowledged returns, once the connection has ended, the reliable
// messages its Send accepted that the peer is not known to have
// received, in send order: those still queued, and those sent in a
// datagram that was not acked, or after one that was not (the peer may
// have held such a message for the one before it, and dropped it as the
// connection ended), the same test that makes a delivery receipt
// (Config.Receipts) say lost. Of the versions of one state (a reliable
// message with a ContentID) only the newest is returned. Each message
// has the ID, Payload, Channel, Priority, InOrder and ContentID it was
// sent with, and no DependsOn (a Ref names a message of this connection
// only); the caller owns the payloads.
//
// A client that moves to another server (the token's next one, after a
// drain that could not wait for everything, or a server that fell
// silent) sends them there, in order, before anything new:
//
//	for _, m := range old.Unacknowledged() {
//		next.Send(m)
//	}
//
// A message may have reached the old server's application all the same
// (its ack lost on the way back): a game that cannot take a message
// twice numbers them. A Listener's Drain makes a knet client deliver
// everything before its connection ends, so that this is empty after a
// drain (unless it ran out of DisconnectTimeout).
//
// Only a dialed connection over UDP keeps its messages for this, from
// Send until they are acked (at most about SendBuffer bytes): it returns
// nil for a Listener's connections, over TCP and WebSocket (whose
// stream has no acks to tell), and until the connection has ended.
func (c *Conn) Unacknowledged() []Message {
	select {
	case <-c.done:
	default:
		return nil
	}
	if k := c.sess.keptOf(); k != nil {
		return slices.Clone(k.left)
	}
	return nil
}

func (s *session) keptOf() *unackedState {
	if s.x == nil {
		return nil
	}
	return s.x.kept
}

func (s *session) keptState() *unackedState {
	x := s.ext()
	if x.kept == nil {
		x.kept = new(unackedState)
	}
	return x.kept
}

// endUnacked adds to what the session left unacknowledged the reliable
// messages Send queued that no round took before the end (Conn.finish).
// Once the connection's done channel is closed the list is read-only:
// Unacknowledged reads it without a lock.
func (c *Conn) endUnacked() {
	if !c.sess.client {
		return
	}
	c.sendq.mu.Lock()
	for i := range c.sendq.msgs {
		if m := &c.sendq.msgs[i]; m.reliable {
			k := c.sess.keptState()
			k.left = append(k.left, Message{ID: m.id, Payload: m.payload, Reliable: true, InOrder: m.inOrder,
				Channel: m.channel, Priority: m.priority, ContentID: m.contentID})
			m.pbuf = nil
		}
	}
	c.sendq.mu.Unlock()
}
