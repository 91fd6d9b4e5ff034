package knet

import (
	"container/heap"
	"slices"
	"time"
)

// The receiver's side of ordering (spec "InOrder Datagrams and Messages",
// DECISIONS §5): received messages held until what they depend on is
// applied, and the unreliable ones given up on after their reorder window.
// session_apply.go applies what it releases.

// heldKind says what a held message is, so that the session knows how to
// apply it.
type heldKind uint8

const (
	heldApp heldKind = iota
	heldDisconnect
	heldDisconnectAck
	heldFragments // a FragmentStart whose transfer is not complete yet
)

// held is a received message waiting for its dependencies.
type held struct {
	ref      msgRef
	kind     heldKind
	id       uint32
	payload  []byte // owned
	reliable bool
	inOrder  bool
	deps     []msgRef // not yet resolved
	deadline time.Time
	heapIdx  int
	done     bool
	cost     int // what it is charged in resolver.bytes (heldCost)
}

// resolver holds received messages until their dependencies are applied.
//
// A message counts as applied when its datagram has arrived and it is not
// held (DECISIONS §5: the receiver applies what it can on arrival). An
// unreliable message waits at most the reorder window for a dependency; what
// it gives up on is declared missing, and an unreliable message declared
// missing is dropped if it arrives later. A reliable message never gives up.
type resolver struct {
	held    map[msgRef]*held
	waiters map[msgRef][]*held
	missing map[msgRef]struct{}
	missQ   []msgRef // insertion order of missing, for eviction
	timed   heldHeap // unreliable held messages, by deadline
	bytes   int      // what the held messages are charged (heldCost)
	free    freeList[*held]
	gaveUp  []msgRef
	// givingUp is expire's stack of held messages given up on together.
	givingUp []*held
	// floor is the newest message that an unreliable dependent gave up
	// on. An unreliable in-order message sent before it (an earlier
	// datagram, or earlier in the same one) comes too late: a newer message
	// already went without its successors, so it is dropped.
	floor    msgRef
	hasFloor bool
}

const maxMissing = 4096

// init readies the maps on first use: most connections never hold a
// message.
func (r *resolver) init() {
	if r.held == nil {
		r.held = make(map[msgRef]*held)
		r.waiters = make(map[msgRef][]*held)
		r.missing = make(map[msgRef]struct{})
	}
}

// resolved reports whether dependency d is satisfied for a dependent of
// the given kind. A message declared missing satisfies unreliable
// dependents only: a reliable one waits for it (DECISIONS §5).
func (r *resolver) resolved(w *recvWindow, d msgRef, reliable bool) bool {
	if _, ok := r.held[d]; ok {
		return false
	}
	if w.contains(d.pid) {
		return true
	}
	if reliable {
		return false
	}
	_, ok := r.missing[d]
	return ok
}

// waitedOn reports whether a held message waits on ref: the test for a
// datagram that makes progress.
func (r *resolver) waitedOn(ref msgRef) bool {
	return len(r.waiters[ref]) > 0
}

// lateDrop reports whether an arriving unreliable message was declared
// missing and must be dropped; it forgets the declaration either way.
func (r *resolver) lateDrop(ref msgRef, reliable bool) bool {
	if len(r.missing) == 0 {
		return false
	}
	if _, ok := r.missing[ref]; !ok {
		return false
	}
	delete(r.missing, ref)
	return !reliable
}

// pendingDeps filters deps down to those not yet resolved, in place.
func (r *resolver) pendingDeps(w *recvWindow, deps []msgRef, reliable bool) []msgRef {
	k := 0
	for _, d := range deps {
		if !r.resolved(w, d, reliable) {
			deps[k] = d
			k++
		}
	}
	return deps[:k]
}

// heldRecordCost is what holding one message costs beyond its payload (the
// held record, its map and heap entries, its waiters), charged with the
// payload against ReceiveBuffer: a peer's empty messages, each naming one
// that never comes, were held without limit for the reorder window (59,700
// from 200 datagrams, TestPeerHoldingEmptyMessages).
const heldRecordCost = 192

// heldDepCost is what each dependency of a held message costs (its entry
// in the message's list and in the waiters map): a peer's messages naming
// 255 datagrams each, charged only heldRecordCost, held 60 times the
// buffer (TestPeerHoldingManyDependencies).
const heldDepCost = 64

// heldCost is what holding a message of n payload bytes and deps
// dependencies is charged against ReceiveBuffer.
func heldCost(n, deps int) int { return n + heldRecordCost + deps*heldDepCost }

// hold keeps h until its dependencies (h.deps, all unresolved) are applied.
// An unreliable message gives up at deadline.
func (r *resolver) hold(h *held, deadline time.Time) {
	r.init()
	r.held[h.ref] = h
	h.cost = heldCost(len(h.payload), len(h.deps))
	r.bytes += h.cost
	for _, d := range h.deps {
		r.waiters[d] = append(r.waiters[d], h)
	}
	h.heapIdx = -1
	if !h.reliable && len(h.deps) > 0 {
		h.deadline = deadline
		heap.Push(&r.timed, h)
	}
}

// newHeld returns a cleared held, reusing one if it can.
func (r *resolver) newHeld() *held {
	if h, ok := r.free.get(); ok {
		return h
	}
	return &held{heapIdx: -1}
}

func (r *resolver) recycle(h *held) {
	*h = held{deps: h.deps[:0], heapIdx: -1}
	r.free.put(h, maxFreeHeld)
}

// release stops holding h, leaving it to the caller to apply or drop.
func (r *resolver) release(h *held) {
	for _, d := range h.deps {
		r.unwait(d, h)
	}
	h.deps = h.deps[:0]
	delete(r.held, h.ref)
	r.bytes -= h.cost
	h.cost = 0
	h.done = true
	if h.heapIdx >= 0 {
		heap.Remove(&r.timed, h.heapIdx)
	}
}

// applied records that ref has been applied (or dropped) and returns, in
// order, the held messages that are now ready, already released. Apply
// each, then call applied for it in turn.
func (r *resolver) applied(ref msgRef, ready []*held) []*held {
	return r.satisfy(ref, ready, false)
}

// satisfy removes ref from its waiters' dependencies, all of them or only
// the unreliable ones, and returns those now ready.
func (r *resolver) satisfy(ref msgRef, ready []*held, unreliableOnly bool) []*held {
	ws, ok := r.waiters[ref]
	if !ok {
		return ready
	}
	kept := ws[:0]
	for _, h := range ws {
		if h.done {
			continue
		}
		if unreliableOnly && h.reliable {
			kept = append(kept, h)
			continue
		}
		h.deps = removeRef(h.deps, ref)
		if len(h.deps) == 0 {
			ready = append(ready, h)
		}
	}
	if len(kept) == 0 {
		delete(r.waiters, ref)
	} else {
		clear(ws[len(kept):])
		r.waiters[ref] = kept
	}
	for _, h := range ready {
		if !h.done {
			r.release(h)
		}
	}
	return ready
}

// siblingBudget bounds the lookups one expire makes for given-up messages'
// predecessors in their datagrams.
const siblingBudget = 4096

// containsAll reports whether every ref of sub is in refs.
func containsAll(refs, sub []msgRef) bool {
	for _, d := range sub {
		if !slices.Contains(refs, d) {
			return false
		}
	}
	return true
}

func removeRef(deps []msgRef, ref msgRef) []msgRef {
	for i, d := range deps {
		if d == ref {
			deps[i] = deps[len(deps)-1]
			return deps[:len(deps)-1]
		}
	}
	return deps
}

// expire gives up, for unreliable messages whose reorder window has passed,
// on the dependencies still missing (DECISIONS §5). It returns the messages
// now ready, already released; the caller applies them oldest first.
//
// A held unreliable message that one of them waits for arrived but waits
// for something older still: it is given up on along with it, and applied
// before it, not dropped. On a sequenced channel with a message lost and
// the next ones arriving out of order (jitter), the message after the loss
// is held for it, and the one after that, arriving first, for that one:
// when the latter's window ran out first, dropping the former lost a
// message that had arrived in time (issue 22, part 6: 2444 of the 2,700 or
// so that arrived were delivered, TestSequencedDeliversWhatArrives).
// Whoever else waited on what was given up on is released too.
func (r *resolver) expire(now time.Time, w *recvWindow, ready []*held) []*held {
	budget := siblingBudget
	for r.timed.Len() > 0 && !r.timed[0].deadline.After(now) {
		h := heap.Pop(&r.timed).(*held)
		stack := append(r.givingUp[:0], h)
		for len(stack) > 0 {
			h := stack[len(stack)-1]
			stack[len(stack)-1] = nil
			stack = stack[:len(stack)-1]
			if h.done {
				continue // released meanwhile: what it lacked was given up on
			}
			deps := append(r.gaveUp[:0], h.deps...)
			// The messages before it in its datagram that wait for what
			// it waits for are its predecessors: the wire names a
			// message's predecessor in the same datagram by naming what
			// that one names (DECISIONS §5). The look is bounded per
			// call: a peer's datagrams of a thousand tiny held messages
			// cost it at most the order among its own messages, not a
			// million lookups.
			for i := int(h.ref.idx) - 1; i >= 0 && budget > 0; i-- {
				budget--
				if sh, ok := r.held[msgRef{h.ref.pid, uint16(i)}]; ok && !sh.reliable && !sh.done && containsAll(deps, sh.deps) {
					stack = append(stack, sh)
				}
			}
			r.release(h)
			ready = append(ready, h)
			for _, d := range deps {
				if dh, ok := r.held[d]; ok {
					if !dh.reliable { // a reliable message is applied exactly once, later
						stack = append(stack, dh)
					}
					continue
				}
				if !w.contains(d.pid) {
					r.declareMissing(d)
					r.raiseFloor(d)
					ready = r.satisfy(d, ready, true)
				}
				// Otherwise it arrived and is not held: applied, or ready
				// in this same pass.
			}
			r.gaveUp = deps
		}
		r.givingUp = stack
	}
	return ready
}

// readyHeap holds messages ready to apply, oldest first. Applying in send
// order keeps every dependency before its dependent and every channel in
// sequence, whatever made each one ready.
type readyHeap []*held

func (q readyHeap) Len() int           { return len(q) }
func (q readyHeap) Less(i, j int) bool { return refLess(q[i].ref, q[j].ref) }
func (q readyHeap) Swap(i, j int)      { q[i], q[j] = q[j], q[i] }
func (q *readyHeap) Push(x any)        { *q = append(*q, x.(*held)) }
func (q *readyHeap) Pop() any {
	old := *q
	h := old[len(old)-1]
	old[len(old)-1] = nil
	*q = old[:len(old)-1]
	return h
}

func (r *resolver) unwait(d msgRef, h *held) {
	ws := r.waiters[d]
	switch {
	case len(ws) > 0 && ws[0] == h:
		// The oldest: held messages give up in the order they came, and
		// a shift of all the others each time made a reorder window's
		// worth of them, all waiting on one message, cost their square
		// (4 s of CPU at the default ReceiveBuffer,
		// TestPeerHeldBehindReliable).
		ws[0] = nil
		ws = ws[1:]
	case len(ws) > 0 && ws[len(ws)-1] == h:
		ws[len(ws)-1] = nil
		ws = ws[:len(ws)-1]
	default:
		for i, x := range ws {
			if x == h {
				ws = append(ws[:i], ws[i+1:]...)
				break
			}
		}
	}
	if len(ws) == 0 {
		delete(r.waiters, d)
	} else {
		r.waiters[d] = ws
	}
}

// raiseFloor records that messages sent before ref are overtaken.
func (r *resolver) raiseFloor(ref msgRef) {
	if !r.hasFloor || refLess(r.floor, ref) {
		r.floor = ref
		r.hasFloor = true
	}
}

// overtaken reports whether an unreliable in-order message at ref comes
// after a newer one went without an older message; newest is the newest
// PacketID received, to let the floor age out before PacketIDs wrap.
func (r *resolver) overtaken(ref msgRef, newest uint32) bool {
	if !r.hasFloor {
		return false
	}
	if seqDiff(r.floor.pid, newest) >= recvSpan {
		r.hasFloor = false
		return false
	}
	return refLess(ref, r.floor)
}

func (r *resolver) declareMissing(d msgRef) {
	r.init()
	if _, ok := r.missing[d]; ok {
		return
	}
	if len(r.missQ) >= maxMissing {
		delete(r.missing, r.missQ[0])
		r.missQ = r.missQ[1:]
	}
	r.missing[d] = struct{}{}
	r.missQ = append(r.missQ, d)
}

// supersede gives up on deps, the unresolved dependencies of an unreliable
// message applied without them, because it replaces them (latest state) or
// because it was itself dropped as overtaken: an older message must not
// come after a newer one. Those not arrived are declared missing, so that
// they are dropped if they come; unreliable application messages still
// held are released and returned, for the caller to drop.
func (r *resolver) supersede(w *recvWindow, deps []msgRef, dropped []*held) []*held {
	for _, d := range deps {
		if h, ok := r.held[d]; ok {
			if !h.reliable && h.kind == heldApp {
				r.release(h)
				dropped = append(dropped, h)
			}
			continue
		}
		if !w.contains(d.pid) {
			r.declareMissing(d)
		}
	}
	return dropped
}

// nextDeadline is when the first unreliable message gives up waiting.
func (r *resolver) nextDeadline() (time.Time, bool) {
	if r.timed.Len() == 0 {
		return time.Time{}, false
	}
	return r.timed[0].deadline, true
}

// heldHeap orders unreliable held messages by deadline, then arrival.
type heldHeap []*held

func (q heldHeap) Len() int { return len(q) }
func (q heldHeap) Less(i, j int) bool {
	if !q[i].deadline.Equal(q[j].deadline) {
		return q[i].deadline.Before(q[j].deadline)
	}
	if q[i].ref.pid != q[j].ref.pid {
		return seqLess(q[i].ref.pid, q[j].ref.pid)
	}
	return q[i].ref.idx < q[j].ref.idx
}
func (q heldHeap) Swap(i, j int) {
	q[i], q[j] = q[j], q[i]
	q[i].heapIdx = i
	q[j].heapIdx = j
}
func (q *heldHeap) Push(x any) {
	h := x.(*held)
	h.heapIdx = len(*q)
	*q = append(*q, h)
}
func (q *heldHeap) Pop() any {
	old := *q
	h := old[len(old)-1]
	old[len(old)-1] = nil
	*q = old[:len(old)-1]
	h.heapIdx = -1
	return h
}
