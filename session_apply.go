package knet

import (
	"container/heap"
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

// handleOrdered applies a message now, or holds it until its dependencies
// are applied.
func (s *session) handleOrdered(now time.Time, h *header, ref msgRef, id uint32, payload []byte, kind heldKind) {
	m := &s.sc().rd.msgs[ref.idx]
	s.sc().deps = appendDeps(s.sc().deps[:0], h, m)
	s.handleOrderedDeps(now, ref, id, payload, kind, h.reliable, m.order != orderNone, supersedes(m), s.sc().deps)
}

// handleOrderedDeps applies a message whose dependencies are deps, or holds
// it. An unreliable message marked latest (see supersedes), or whose ID has
// no reorder window, does not wait: it replaces what it names.
func (s *session) handleOrderedDeps(now time.Time, ref msgRef, id uint32, payload []byte, kind heldKind, reliable, inOrder, latest bool, deps []msgRef) {
	if s.recv.res.lateDrop(ref, reliable) || !reliable && len(deps) > 0 && s.recv.res.overtaken(ref, s.recv.win.newest) {
		s.stats.DroppedMessages++
		// What it waited for is older still: drop that too if it comes.
		s.supersede(now, s.recv.res.pendingDeps(&s.recv.win, deps, false))
		s.cascade(now, ref)
		return
	}
	deps = s.recv.res.pendingDeps(&s.recv.win, deps, reliable)
	var wait time.Duration
	if len(deps) > 0 && !reliable {
		wait = s.reorderWindowFor(id)
		if kind == heldApp && (latest || wait == 0) {
			s.supersede(now, deps)
			deps = deps[:0]
		}
	}
	if len(deps) == 0 {
		s.apply(now, kind, id, payload, reliable, inOrder)
		s.cascade(now, ref)
		return
	}
	if !reliable && (s.host.recvUsed()+s.recv.res.bytes+heldCost(len(payload), len(deps)) > s.cfg.recvBuffer || s.dropOverBudget()) {
		// No room to hold it: an unreliable message may be dropped, and
		// what names it later finds it arrived (not held) and goes on.
		s.stats.DroppedMessages++
		return
	}
	hm := s.recv.res.newHeld()
	hm.ref = ref
	hm.kind = kind
	hm.id = id
	hm.payload = append(hm.payload[:0], payload...)
	hm.reliable = reliable
	hm.inOrder = inOrder
	hm.deps = append(hm.deps[:0], deps...)
	s.recv.res.hold(hm, now.Add(wait))
}

// supersede gives up on deps (see resolver.supersede), dropping the held
// messages among them.
func (s *session) supersede(now time.Time, deps []msgRef) {
	if len(deps) == 0 {
		return
	}
	s.sc().dropped = s.recv.res.supersede(&s.recv.win, deps, s.sc().dropped[:0])
	for i, hm := range s.sc().dropped {
		s.stats.DroppedMessages++
		s.wake(hm.ref)
		s.recv.res.recycle(hm)
		s.sc().dropped[i] = nil
	}
	s.sc().dropped = s.sc().dropped[:0]
}

// cascade applies the held messages that ref's application released, and
// those theirs released, oldest first.
func (s *session) cascade(now time.Time, ref msgRef) {
	s.wake(ref)
	s.runReady(now)
}

// wake moves the messages waiting only on ref to the ready queue.
func (s *session) wake(ref msgRef) {
	s.sc().woken = s.recv.res.applied(ref, s.sc().woken[:0])
	for i, hm := range s.sc().woken {
		heap.Push(&s.sc().ready, hm)
		s.sc().woken[i] = nil
	}
}

// runReady applies the ready messages, oldest first, waking their
// dependents into the same queue.
func (s *session) runReady(now time.Time) {
	for s.sc().ready.Len() > 0 {
		hm := heap.Pop(&s.sc().ready).(*held)
		s.applyHeld(now, hm)
		s.wake(hm.ref)
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
	s.apply(now, hm.kind, hm.id, hm.payload, hm.reliable, hm.inOrder)
}

// apply hands a message whose dependencies are satisfied to where it goes.
func (s *session) apply(now time.Time, kind heldKind, id uint32, payload []byte, reliable, inOrder bool) {
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
		if s.host.deliver(id, payload, s.takeLent(payload), reliable, inOrder) {
			s.stats.MessagesReceived++
		} else {
			s.stats.DroppedMessages++
		}
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

// handleFragment feeds a fragment to reassembly and, once a message is
// whole, applies or holds it in its FragmentStart's place.
func (s *session) handleFragment(now time.Time, h *header, ref msgRef, m *message) {
	order := startOrder{pidOrder: true} // the specification's dialect
	if m.fragStart {
		order.reliable = h.reliable
		order.inOrder = m.order != orderNone
		s.sc().deps = appendDeps(s.sc().deps[:0], h, m)
		order.deps = s.sc().deps
		order.tag, order.tagged = s.sc().ltag, s.sc().ltagOK
	}
	t, whole, ok := s.reassemble(m, ref, order)
	if !ok {
		return
	}
	if whole == nil {
		if m.fragStart {
			// Hold a place so that dependents wait for the whole.
			hm := s.recv.res.newHeld()
			hm.ref = ref
			hm.kind = heldFragments
			s.recv.res.hold(hm, time.Time{})
		}
		return
	}
	start := t.start
	if !m.fragStart {
		if hm, ok := s.recv.res.held[start]; ok && hm.kind == heldFragments {
			s.recv.res.release(hm)
			s.recv.res.recycle(hm)
		}
	}
	s.establishServer(now)
	deps := append(s.sc().wdeps[:0], t.order.deps...)
	s.sc().wdeps = deps
	reliable, inOrder, id := t.order.reliable, t.order.inOrder, t.id
	if t.order.tagged && !s.takeVersion(contentKey{id, t.order.tag.content}, t.order.tag.ver) {
		// A latest-state version no newer than one taken (latest.go).
		s.endTransfer(t, whole)
		s.stats.ObsoleteMessages++
		s.cascade(now, start)
		s.reclaimLent()
		return
	}
	s.endTransfer(t, whole)
	s.handleOrderedDeps(now, start, id, whole, heldApp, reliable, inOrder, false, deps)
	s.reclaimLent()
}

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
	ready := s.recv.res.expire(now, &s.recv.win, s.sc().expired[:0])
	for i, hm := range ready {
		heap.Push(&s.sc().ready, hm)
		ready[i] = nil
	}
	s.sc().expired = ready[:0]
	s.runReady(now)
}
