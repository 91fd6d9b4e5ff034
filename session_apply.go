package knet

import (
	"container/heap"
	"slices"
	"time"
)

// reorderWindowFor is how long an unreliable message with the given ID
// waits for a missing dependency: Config.ReorderWindows, else
// ReorderWindow. Zero means it does not wait.
func (s *session) reorderWindowFor(id uint32) time.Duration {
	if w, ok := s.cfg.reorderWindows[id]; ok {
		return max(w, 0)
	}
	return s.reorderWindow()
}

// reorderWindow is how long an unreliable in-order message waits for a
// missing predecessor, unless its ID has a window of its own.
func (s *session) reorderWindow() time.Duration {
	if s.cfg.reorderWindow != 0 {
		return max(s.cfg.reorderWindow, 0)
	}
	w := 20 * time.Millisecond
	if s.loss.rtt.samples > 0 {
		w = s.loss.rtt.srtt/4 + 2*s.loss.rtt.rttvar
	}
	return min(max(w, s.reorderSeen(), 2*time.Millisecond), maxDerivedReorderWindow)
}

// maxDerivedReorderWindow caps the reorder window derived from the path.
const maxDerivedReorderWindow = 250 * time.Millisecond

// depsOf returns the dependency table of the datagram being handled,
// filled from its header h when first needed, and the entries of it that m
// names.
func (s *session) depsOf(h *header, m *message) (*depTable, depBits) {
	t := s.sc().depTable()
	if m.order == orderNone {
		return t, depBits{}
	}
	if !t.built {
		t.fromHeader(h)
	}
	return t, t.bitsOf(m)
}

// handleOrdered applies a message of the datagram being handled now, or
// holds it until its dependencies are applied.
func (s *session) handleOrdered(now time.Time, h *header, ref msgRef, m *message, kind heldKind) {
	if m.order == orderNone && kind == heldApp {
		s.applyWire(ref, m, h.reliable)
		return
	}
	if kind == heldApp && m.order != orderMulti && s.applyOne(now, h, ref, m) {
		return
	}
	t, all := s.depsOf(h, m)
	s.handleOrderedDeps(now, ref, m.id, m.payload, kind, h.reliable, m.order != orderNone, supersedes(m), t, all, true, nil)
}

// applyOne is handleOrderedDeps for most of what names a dependency: an
// application message of the datagram being handled that names one entry
// (InOrder codes 1-6), when it need not wait: the entry is resolved, or,
// for an unreliable message, not arrived while waiting would be given up
// at once (giveUpNow). It makes no dependency set, and reports whether it
// handled m; if not, it changed nothing but what it looked up.
// Small in-order messages cost a third less this way (issue 38's
// singles230arrived: 41 to 28us a datagram of 230).
func (s *session) applyOne(now time.Time, h *header, ref msgRef, m *message) bool {
	t := s.sc().depTable()
	if !t.built {
		t.fromHeader(h)
	}
	e := t.entryOf(m)
	res, w := &s.recv.res, &s.recv.win
	st := res.state(t, e, w)
	giveUp := st.lacks(h.reliable)
	if giveUp && (h.reliable || st != stAbsent || !res.giveUpNow(t)) {
		return false
	}
	if res.lateDrop(ref, h.reliable) || !h.reliable && res.overtaken(ref, w.newest) {
		var all depBits
		all.set(e)
		s.dropLate(now, t, all, nil)
		return true
	}
	if giveUp {
		res.raiseFloor(t.ent[e].ref) // as giveUpAbsent
	}
	s.apply(now, heldApp, m.id, m.payload, h.reliable, true, true)
	s.placeDone(now, nil)
	return true
}

// applyWire applies an application message of the datagram being handled
// that names no dependency, the most of what comes: as handleOrderedDeps
// and apply would, with nothing to wait for or give up.
func (s *session) applyWire(ref msgRef, m *message, reliable bool) {
	if s.recv.res.cur != nil && s.recv.res.lateDrop(ref, reliable) {
		s.stats.DroppedMessages++
		return
	}
	if s.state != stateOK && s.state != stateClosing && (s.client || s.state != stateSynAck) {
		return // see apply
	}
	if !reliable && s.dropOverBudget() {
		s.stats.DroppedMessages++
		return
	}
	sc := s.sc()
	sc.dq = append(sc.dq, delivery{id: m.id, payload: m.payload, reliable: reliable})
	sc.dqCharge += len(m.payload) + recvEntryCost
}

// handleOrderedDeps applies a message whose dependencies are the entries
// all of t, or holds it. An unreliable message marked latest (see
// supersedes), or whose ID has no reorder window, does not wait: it
// replaces what it names. wire says that payload is the datagram's being
// handled (delivered with its others: see deliver); place is the
// reassembled message's FragmentStart's place, held until now.
func (s *session) handleOrderedDeps(now time.Time, ref msgRef, id uint32, payload []byte, kind heldKind, reliable, inOrder, latest bool, t *depTable, all depBits, wire bool, place *held) {
	res, w := &s.recv.res, &s.recv.win
	if res.lateDrop(ref, reliable) || !reliable && !all.empty() && res.overtaken(ref, w.newest) {
		s.dropLate(now, t, all, place)
		return
	}
	lacks := res.unresolved(t, all, w, reliable)
	if !reliable && !lacks.empty() && res.giveUpNow(t) {
		lacks = res.giveUpAbsent(t, lacks)
	}
	var wait time.Duration
	if !lacks.empty() && !reliable {
		wait = s.reorderWindowFor(id)
		if kind == heldApp && (latest || wait == 0) {
			s.supersede(t, lacks)
			lacks = depBits{}
		}
	}
	if lacks.empty() {
		s.apply(now, kind, id, payload, reliable, inOrder, wire)
		s.placeDone(now, place)
		return
	}
	if !reliable && (s.recvUsed()+res.bytes+res.holdCost(t, len(payload), lacks) > s.cfg.recvBuffer || s.dropOverBudget()) {
		// No room to hold it: an unreliable message may be dropped, and
		// what names it later finds it arrived (not held) and goes on.
		s.stats.DroppedMessages++
		s.placeDone(now, place)
		return
	}
	hm := res.newHeld()
	hm.ref = ref
	hm.kind = kind
	hm.id = id
	hm.payload = append(hm.payload[:0], payload...)
	hm.reliable = reliable
	hm.inOrder = inOrder
	res.hold(hm, now.Add(wait), t, lacks)
	if place != nil {
		res.moveWaiters(place, hm)
		res.recycle(place)
	}
}

// dropLate drops a message come too late (declared missing, or overtaken:
// see resolver.floor) whose dependencies are the entries all of t: what it
// waited for is older still, and is dropped too if it comes.
func (s *session) dropLate(now time.Time, t *depTable, all depBits, place *held) {
	s.stats.DroppedMessages++
	s.supersede(t, s.recv.res.unresolved(t, all, &s.recv.win, true))
	s.placeDone(now, place)
}

// placeDone ends a reassembled message's FragmentStart's place, the message
// applied or dropped: what waited for it goes on.
func (s *session) placeDone(now time.Time, place *held) {
	if place != nil {
		s.wake(place)
		s.recv.res.recycle(place)
	}
	s.runReady(now)
}

// supersede gives up on the entries lacks of t (see resolver.supersede),
// dropping the held messages among them.
func (s *session) supersede(t *depTable, lacks depBits) {
	if lacks.empty() {
		return
	}
	s.sc().dropped = s.recv.res.supersede(t, lacks, s.sc().dropped[:0])
	for i, hm := range s.sc().dropped {
		s.stats.DroppedMessages++
		s.wake(hm)
		s.recv.res.recycle(hm)
		s.sc().dropped[i] = nil
	}
	s.sc().dropped = s.sc().dropped[:0]
}

// wake moves the messages that waited only for hm, applied or dropped, to
// the ready queue.
func (s *session) wake(hm *held) {
	if hm.waiters == 0 {
		return
	}
	s.sc().woken = s.recv.res.wake(hm, s.sc().woken[:0])
	s.readyAll(s.sc().woken)
}

// readyAll moves the messages hs, released, to the ready queue.
func (s *session) readyAll(hs []*held) {
	for i, hm := range hs {
		heap.Push(&s.sc().ready, hm)
		hs[i] = nil
	}
}

// runReady applies the ready messages, oldest first, waking their
// dependents into the same queue.
func (s *session) runReady(now time.Time) {
	for s.sc().ready.Len() > 0 {
		hm := heap.Pop(&s.sc().ready).(*held)
		s.applyHeld(now, hm)
		s.wake(hm)
		s.recv.res.recycle(hm)
	}
}

// runReadyFrom is runReady with the messages sorted, released, to apply
// too, oldest first, merged with the ready queue.
func (s *session) runReadyFrom(now time.Time, sorted []*held) {
	q := &s.sc().ready
	for i := 0; ; {
		var hm *held
		switch {
		case i < len(sorted) && (q.Len() == 0 || refLess(sorted[i].ref, (*q)[0].ref)):
			hm = sorted[i]
			i++
		case q.Len() > 0:
			hm = heap.Pop(q).(*held)
		default:
			return
		}
		s.applyHeld(now, hm)
		s.wake(hm)
		s.recv.res.recycle(hm)
	}
}

// applyHeld applies a held message now ready, unless it is unreliable and
// was overtaken while it waited.
func (s *session) applyHeld(now time.Time, hm *held) {
	if !hm.reliable && hm.kind == heldApp && s.recv.res.overtaken(hm.ref, s.recv.win.newest) {
		s.stats.DroppedMessages++
		return
	}
	s.apply(now, hm.kind, hm.id, hm.payload, hm.reliable, hm.inOrder, false)
}

// apply hands a message whose dependencies are satisfied to where it goes;
// wire as for handleOrderedDeps.
func (s *session) apply(now time.Time, kind heldKind, id uint32, payload []byte, reliable, inOrder, wire bool) {
	switch kind {
	case heldApp:
		// A server's messages that come before its peer proved its
		// address (stateSynAck: a plaintext server's, see takeProof)
		// wait in the receive queue like any: the client is open and
		// sent them once, and the application sees them, and the
		// connection, only once it is established.
		if s.state != stateOK && s.state != stateClosing && (s.client || s.state != stateSynAck) {
			return
		}
		if !reliable && s.dropOverBudget() {
			s.stats.DroppedMessages++
			return
		}
		s.deliver(id, payload, s.takeLent(payload), reliable, inOrder, wire)
	case heldDisconnect:
		s.peerDisconnect(now, payload) // session_close.go
	case heldDisconnectAck:
		switch s.state {
		case stateClosing:
			s.closeDone()
		case stateOK:
			// The peer says it is gone without our asking.
			s.events |= evPeerClosed
			s.fail(ErrPeerClosed)
		case stateSynAck:
			s.fail(ErrPeerClosed)
		}
	}
}

// specFragment is what a fragment other than the FragmentStart says of its
// message in the specification's dialect: nothing but that its PacketID
// tells a stale one (reassembly.stale). Read only.
var specFragment = startOrder{pidOrder: true}

// handleFragment feeds a fragment to reassembly and, once a message is
// whole, applies or holds it in its FragmentStart's place.
func (s *session) handleFragment(now time.Time, h *header, ref msgRef, m *message) {
	order := &specFragment
	if m.fragStart {
		t, all := s.depsOf(h, m)
		s.sc().deps = t.refsOf(s.sc().deps[:0], s.recv.res.unresolved(t, all, &s.recv.win, true))
		order = &startOrder{pidOrder: true, reliable: h.reliable, inOrder: m.order != orderNone, deps: s.sc().deps}
		order.tag, order.tagged = s.sc().ltag, s.sc().ltagOK
	}
	t, whole, ok := s.reassemble(m, ref, order)
	if !ok {
		return
	}
	if whole == nil {
		if m.fragStart {
			// Hold a place so that dependents wait for the whole
			// (reliable: a fragmented message always is, and a
			// dependent that gives up on it goes without it, leaving
			// it to the others).
			hm := s.recv.res.newHeld()
			hm.ref = ref
			hm.kind = heldFragments
			hm.reliable = true
			s.recv.res.hold(hm, time.Time{}, nil, depBits{})
		}
		return
	}
	start := t.start
	var place *held
	if !m.fragStart {
		if hm := s.recv.res.heldAt(start); hm != nil && hm.kind == heldFragments {
			s.recv.res.release(hm)
			place = hm
		}
	}
	s.establishServer(now)
	ft := s.sc().fragTable()
	all := ft.fromRefs(start.pid, t.order.deps)
	reliable, inOrder, id := t.order.reliable, t.order.inOrder, t.id
	if t.order.tagged && !s.takeVersion(contentKey{id, t.order.tag.content}, t.order.tag.ver) {
		// A latest-state version no newer than one taken (latest.go).
		s.endTransfer(t, whole)
		s.stats.ObsoleteMessages++
		s.placeDone(now, place)
		s.reclaimLent()
		return
	}
	s.endTransfer(t, whole)
	s.handleOrderedDeps(now, start, id, whole, heldApp, reliable, inOrder, false, ft, all, false, place)
	s.reclaimLent()
}

// deliver hands an application message to the receive queue. One whose
// payload is the datagram's being handled (wire) waits for the others of
// the datagram, handed over together at its end (flushDeliveries): a lock
// and a call per datagram, not per message (465 empty messages in one
// datagram cost 10-60 times an honest datagram's CPU per byte, issue 38).
// Any other goes at once, after those waiting, to keep their order.
func (s *session) deliver(id uint32, payload []byte, buf *[]byte, reliable, inOrder, wire bool) {
	sc := s.sc()
	sc.dq = append(sc.dq, delivery{id: id, payload: payload, buf: buf, reliable: reliable, inOrder: inOrder})
	sc.dqCharge += len(payload) + recvEntryCost
	if !wire {
		s.flushDeliveries()
	}
}

// flushDeliveries hands the messages waiting (see deliver) to the receive
// queue.
func (s *session) flushDeliveries() {
	sc := s.sc()
	if len(sc.dq) == 0 {
		return
	}
	s.host.deliver(sc.dq)
	for i := range sc.dq {
		if sc.dq[i].taken {
			s.stats.MessagesReceived++
		} else {
			s.stats.DroppedMessages++
		}
		sc.dq[i] = delivery{}
	}
	sc.dq, sc.dqCharge = sc.dq[:0], 0
}

// recvUsed is what the receive queue counts against ReceiveBuffer, with the
// messages waiting to join it.
func (s *session) recvUsed() int { return s.host.recvUsed() + s.sc().dqCharge }

// takeLent returns the pooled buffer behind a reassembled message being
// applied, for the receive queue to keep instead of copying the message,
// if payload is that message (and not another one its application
// released).
func (s *session) takeLent(payload []byte) *[]byte {
	b := s.recv.lent
	if b == nil || len(payload) == 0 || cap(*b) == 0 || &payload[0] != &(*b)[:1][0] {
		return nil
	}
	s.recv.lent = nil
	return b
}

// recvDeadline adds the receiving side's timer: the first reorder window
// of a held message to run out (expireHeld).
func (s *session) recvDeadline(t *deadlines) {
	if x, ok := s.recv.res.nextDeadline(); ok {
		t.at(x)
	}
}

// expireHeld delivers the unreliable in-order messages that waited their
// reorder window out, and the held ones they waited for before them.
func (s *session) expireHeld(now time.Time) {
	ready := s.recv.res.expire(now, s.sc().expired[:0])
	if len(ready) == 0 {
		return
	}
	// Mostly in order already (a datagram's members come in theirs):
	// sorted, and applied merged with the ready queue, rather than each
	// pushed to it and popped.
	slices.SortFunc(ready, func(a, b *held) int {
		if refLess(a.ref, b.ref) {
			return -1
		}
		return 1 // no two are the same message
	})
	s.runReadyFrom(now, ready)
	clear(ready)
	s.sc().expired = ready[:0]
}
