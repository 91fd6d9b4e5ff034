package knet

import (
	"slices"
	"time"
)

// anchors are what in-order messages that would carry no dependency
// name instead, so that the receiver still sees them in order (see
// wireDeps): the newest reliable message known applied (the first of a
// datagram acked with all before it, if it named nothing; or a tracked
// one resolved), and the first message, naming nothing, of the newest
// reliable datagram sent. oweAnchor asks for a datagram that starts with
// one.
type anchors struct {
	applied, lastWhole       msgRef
	hasApplied, hasLastWhole bool
}

// forgettable reports whether a tracked message can be forgotten: later
// messages need not name it. A reliable one that is becomes an anchor.
func (s *session) forgettable(now time.Time, t *track) bool {
	if !s.resolvedAtSender(now, t) {
		return false
	}
	if t.reliable && t.packed {
		s.newAnchor(t.at)
	}
	return true
}

func (s *session) newAnchor(r msgRef) {
	if !s.anchors.hasApplied || refLess(s.anchors.applied, r) {
		s.anchors.applied = r
		s.anchors.hasApplied = true
	}
}

// resolvedAtSender reports whether a tracked message is known to be applied
// at the receiver, so that dependencies on it can be left out (DECISIONS
// §5): a reliable one once every datagram up to its last fragment is acked
// and the same holds for everything it waits for (arrived is not applied: a
// message may wait at the receiver for a fragmented one still coming); an
// unreliable one once it is older than any reorder window could be.
func (s *session) resolvedAtSender(now time.Time, t *track) bool {
	return s.resolvedWithin(now, t, 0)
}

// unreliableHorizon is how long after it was sent an unreliable message
// may still wait at the receiver for what it depends on: a one-way trip,
// within a retransmission timeout, then the receiver's reorder window, at
// most 250ms unless configured longer (ours is taken for the peer's).
func (s *session) unreliableHorizon() time.Duration {
	return max(maxDerivedReorderWindow, s.cfg.longestReorderWindow()) + s.loss.rto()
}

// maxResolveDepth bounds the walk through unresolved dependencies; past it
// a message counts as unresolved for now, which only costs a dependency
// named without need.
const maxResolveDepth = 32

func (s *session) resolvedWithin(now time.Time, t *track, depth int) bool {
	if t.dropped || t.resolved {
		return true
	}
	if !t.packed || !t.complete {
		return false
	}
	if !t.reliable {
		return now.Sub(t.sentAt) > s.unreliableHorizon()
	}
	acked, alone := s.wire.acked(t)
	if !acked {
		return false
	}
	if !alone {
		if depth == maxResolveDepth {
			return false
		}
		for _, d := range t.deps {
			if dt := d.live(); dt != nil && !s.resolvedWithin(now, dt, depth+1) {
				return false
			}
		}
	}
	t.resolved = true
	clear(t.deps)
	t.deps = t.deps[:0]
	return true
}

// wireDeps turns m's dependencies into wire references from datagram pid,
// leaving out those known resolved. It reports false when m cannot go in
// this datagram yet: a dependency is unsent, too far back to name, or a
// fragmented message in this same datagram.
func (s *session) wireDeps(now time.Time, m *outMsg, pid uint32) ([]msgRef, bool) {
	refs := s.sc().wdeps[:0]
	for _, d := range m.deps {
		t := d.live()
		if t == nil || t.dropped {
			continue
		}
		if !t.packed {
			return nil, false
		}
		if s.resolvedAtSender(now, t) {
			// For a latest-state update (m.latest), an earlier version
			// sent too long ago to arrive any more. The others are all
			// named, up to contentBackRefs: a receiver knows an older
			// version for older only by a newer one naming it, and no
			// estimate from the round trip bounds how late a datagram
			// comes (held back 8ms on a 2ms path, one arrives after
			// versions sent 6ms after it, while the ones between that
			// name it may all be lost).
			continue
		}
		if d.hard {
			return nil, false // goes once t is applied: see depOn
		}
		if t.at.pid == pid {
			// A message in this datagram: processed before m, so m
			// waits for what it waits for (DECISIONS §5).
			if t.fragmented {
				return nil, false
			}
			refs = append(refs, t.wire...)
			continue
		}
		if seqDiff(t.at.pid, pid)-1 > maxDepDelta {
			if !t.reliable {
				continue // long since applied or given up on
			}
			return nil, false // wait for its ack
		}
		refs = append(refs, t.at)
	}
	if m.inOrder && len(refs) == 0 {
		// Nothing left to name, yet the receiver should see that the
		// message was sent in order (an application that forwards what it
		// receives keeps the order), and a sequenced one must be
		// droppable when it comes late: depend on a message known
		// applied, or the first, naming nothing, of the newest reliable
		// datagram sent. With neither (at the start, or after long
		// silence), wait for a datagram that starts with one.
		found := false
		for _, a := range [...]struct {
			ref msgRef
			ok  bool
		}{{s.anchors.applied, s.anchors.hasApplied}, {s.anchors.lastWhole, s.anchors.hasLastWhole}} {
			if a.ok && a.ref.pid != pid && seqDiff(a.ref.pid, pid)-1 <= maxDepDelta && seqLess(a.ref.pid, pid) {
				refs = append(refs, a.ref)
				found = true
				break
			}
		}
		if !found {
			s.owed.owe(oweAnchor)
			return nil, false
		}
	}
	// Few entries: drop repeats in place.
	k := 0
	for _, r := range refs {
		if !slices.Contains(refs[:k], r) {
			refs[k] = r
			k++
		}
	}
	s.sc().wdeps = refs[:k]
	return s.sc().wdeps, true
}

// encodeDeps adds the entries refs need to the datagram header and sets
// msg's InOrder code, with the latest-state marker if latest (see
// supersedes). It reports false if the header would need more than maxDeps
// entries.
func (s *session) encodeDeps(h *header, msg *message, refs []msgRef, latest bool) bool {
	if len(refs) == 0 {
		return true
	}
	idx := s.sc().entries[:0]
	for _, r := range refs {
		delta := uint16(seqDiff(r.pid, h.packetID) - 1)
		e := -1
		for x := range h.deltas {
			if h.deltas[x] == delta && h.indices[x] == r.idx {
				e = x
				break
			}
		}
		if e < 0 {
			if len(h.deltas) == maxDeps {
				return false
			}
			e = len(h.deltas)
			h.deltas = append(h.deltas, delta)
			h.indices = append(h.indices, r.idx)
		}
		idx = append(idx, byte(e))
	}
	if latest {
		idx = append(idx, idx[0])
	}
	s.sc().entries = idx
	h.inOrder = true
	switch {
	case len(idx) > 1:
		msg.order = orderMulti
		msg.orderMulti = idx
	case idx[0] < 5:
		msg.order = idx[0] + 1
	default:
		msg.order = orderSingle
		msg.orderIndex = idx[0]
	}
	return true
}
