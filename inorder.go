package knet

import (
	"container/heap"
	"slices"
	"time"
)

// Ordering (spec "InOrder Datagrams and Messages", DECISIONS §5).
//
// The wire carries dependencies between messages, each named by the
// datagram it arrived in and its index there. The receiver applies a message
// once every message it depends on is applied; the sender turns channels and
// explicit dependencies into such references.

// msgRef names a message on the wire: the PacketID of its datagram (of the
// FragmentStart, for a fragmented message) and its index among the message
// blocks there.
type msgRef struct {
	pid uint32
	idx uint16
}

// refFromEntry converts dependency entry x of a datagram header into the
// message it names.
func refFromEntry(h *header, x int) msgRef {
	return msgRef{pid: (h.packetID - uint32(h.deltas[x]) - 1) & packetIDMask, idx: h.indices[x]}
}

// appendDeps appends the messages m depends on, per its InOrder code, each
// once: two entries, or one entry listed twice, may name the same message.
func appendDeps(dst []msgRef, h *header, m *message) []msgRef {
	switch m.order {
	case orderNone:
	case orderSingle:
		dst = append(dst, refFromEntry(h, int(m.orderIndex)))
	case orderMulti:
		start := len(dst)
		for _, x := range m.orderMulti {
			if r := refFromEntry(h, int(x)); !slices.Contains(dst[start:], r) {
				dst = append(dst, r)
			}
		}
	default:
		dst = append(dst, refFromEntry(h, int(m.order)-1))
	}
	return dst
}

// Latest-state marker. A message that supersedes the ones it names (a
// ContentID update naming earlier versions of its state) lists its entries
// with InOrder code 7 and repeats the first entry at the end. A receiver
// that reads the spec alone sees the same dependencies; ours applies such
// a message at once and drops the named ones if they arrive later
// (latest state wins), instead of waiting for them. Our encoder never
// repeats an entry otherwise.

// supersedes reports whether m carries the latest-state marker.
func supersedes(m *message) bool {
	k := len(m.orderMulti)
	return m.order == orderMulti && k >= 2 && m.orderMulti[0] == m.orderMulti[k-1]
}

// Receiver.

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
	bytes   int      // payload bytes held
	free    freeList[*held]
	gaveUp  []msgRef
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

// isHeld reports whether anything waits on ref, and whether that message
// could be applied now: the test for a datagram that makes progress.
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

// hold keeps h until its dependencies (h.deps, all unresolved) are applied.
// An unreliable message gives up at deadline.
func (r *resolver) hold(h *held, deadline time.Time) {
	r.init()
	r.held[h.ref] = h
	r.bytes += len(h.payload)
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
	r.bytes -= len(h.payload)
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
// now ready, already released, in the order to apply them, and the held
// unreliable messages given up on, which the caller drops: applied now they
// would come after a newer message. Whoever else waited on what was given up
// on is released too.
func (r *resolver) expire(now time.Time, w *recvWindow, ready, dropped []*held) ([]*held, []*held) {
	for r.timed.Len() > 0 && !r.timed[0].deadline.After(now) {
		h := heap.Pop(&r.timed).(*held)
		deps := append(r.gaveUp[:0], h.deps...)
		r.release(h)
		ready = append(ready, h)
		for _, d := range deps {
			if dh, ok := r.held[d]; ok {
				if dh.reliable {
					continue // a reliable message is applied exactly once, later
				}
				r.release(dh)
				dropped = append(dropped, dh)
				r.raiseFloor(d)
				ready = r.applied(d, ready)
			} else if !w.contains(d.pid) {
				r.declareMissing(d)
				r.raiseFloor(d)
				ready = r.satisfy(d, ready, true)
			}
			// Otherwise it arrived and is not held: applied, or ready
			// in this same pass.
		}
		r.gaveUp = deps
	}
	return ready, dropped
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
	for i, x := range ws {
		if x == h {
			ws = append(ws[:i], ws[i+1:]...)
			break
		}
	}
	if len(ws) == 0 {
		delete(r.waiters, d)
	} else {
		r.waiters[d] = ws
	}
}

// refLess reports whether a was sent before b.
func refLess(a, b msgRef) bool {
	return seqLess(a.pid, b.pid) || a.pid == b.pid && a.idx < b.idx
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

// Sender.

// track follows a message that later messages may depend on: every InOrder
// message, every message sent with SendRef and every unreliable message with
// a ContentID. Tracks are recycled once resolved; a depOn whose ref no longer
// matches its track's names a message already resolved.
type track struct {
	ref      Ref
	reliable bool
	inOrder  bool
	channel  uint8
	hasKey   bool
	key      contentKey
	explicit bool // in byRef

	packed     bool   // its (first) message block has been placed
	at         msgRef // where
	wire       []msgRef
	lastPID    uint32 // datagram of its last fragment
	relLast    uint32 // reliable number of its last fragment (the reference dialect)
	complete   bool   // every fragment placed
	fragmented bool
	dropped    bool // superseded or dropped before sending
	sentAt     time.Time
	// deps are the messages it waits for at the receiver, as of its
	// packing; resolved records that it and all of them are known applied.
	deps     []depOn
	resolved bool
	prev     depOn // the previous version of its state (ContentID)
}

// depOn is a dependency of a queued message on a tracked one.
type depOn struct {
	t   *track
	ref Ref
	// hard marks an unreliable message's dependency on a reliable one
	// that it must never arrive before (one it names in DependsOn, or an
	// earlier version of its state sent fragmented): it is sent only once
	// that one is known applied, since a receiver gives up on a missing
	// dependency of an unreliable message after its reorder window.
	hard bool
}

// live returns the track if it still follows the message depended on.
func (d depOn) live() *track {
	if d.t != nil && d.t.ref == d.ref {
		return d.t
	}
	return nil
}

// contentBackRefs is how many earlier versions of its state, sent in one
// datagram each, a latest-state message may name (the sender leaves out
// those sent too long ago to be overtaken); maxContentWalk bounds the
// versions looked at for them.
const (
	contentBackRefs = 8
	maxContentWalk  = 16
)

type contentKey struct {
	id, content uint32
}

// sendOrder turns channels and explicit dependencies into dependencies on
// tracked messages (DECISIONS §5, sender).
type sendOrder struct {
	byRef  map[Ref]*track // messages sent with SendRef
	fifo   []*track       // in Ref order, for forgetting resolved ones
	fifoAt int
	chans  []chanTails // the channels with a live tail, few as a rule
	latest map[contentKey]depOn
	free   freeList[*track]
}

// chanTails are the last messages of one channel.
type chanTails struct {
	channel uint8
	rel     depOn // reliable InOrder
	any     depOn // InOrder of either kind
	unrel   depOn // unreliable InOrder
}

// tails returns the channel's tails, nil if it has none.
//
// A connection uses few channels at a time, and a channel's entry goes
// once its tails are all forgotten: a short list searched in order costs
// less than an array of all 256 (18 KiB per connection), even when many
// channels are busy.
func (o *sendOrder) tails(channel uint8) *chanTails {
	for i := range o.chans {
		if o.chans[i].channel == channel {
			return &o.chans[i]
		}
	}
	return nil
}

// add registers a newly queued message, in send order, and fills m.deps with
// what it depends on: its channel predecessor, the messages it names, and the
// previous unreliable messages with its ID and ContentID.
//
// A message too large for one datagram travels reliably (spec "Fragmented
// Transfers", 3) and is ordered as a reliable one: on the wire a reliable
// message cannot depend on an unreliable one, which may never arrive, so
// it does not name unreliable messages, and those naming it wait at the
// sender until it is applied.
func (o *sendOrder) add(m *outMsg) {
	m.deps = m.deps[:0]
	reliable := m.reliable || m.frag
	var ch *chanTails
	if m.inOrder {
		if ch = o.tails(m.channel); ch == nil {
			o.chans = append(o.chans, chanTails{channel: m.channel})
			ch = &o.chans[len(o.chans)-1]
		}
		if reliable {
			m.deps = appendLive(m.deps, ch.rel)
		} else {
			// After the channel's last message of either kind, and its
			// last unreliable one, so that the unreliable messages form
			// a chain the receiver can keep in sequence.
			m.deps = appendLive(m.deps, ch.any)
			if ch.unrel != ch.any {
				m.deps = appendLive(m.deps, ch.unrel)
			}
		}
	}
	for _, r := range m.after {
		if t := o.byRef[r]; t != nil && (t.reliable || !reliable) {
			m.deps = append(m.deps, depOn{t: t, ref: r, hard: !reliable && t.reliable})
		}
	}
	hasKey := m.contentID != 0 && !m.reliable
	var key contentKey
	var prev depOn
	if hasKey {
		// Latest state: name the last few versions, so that the
		// receiver knows an older one for older even when the one just
		// before was lost, and marks it as replacing them. One that
		// travelled reliably (fragmented) must be applied first.
		key = contentKey{m.id, m.contentID}
		prev = o.latest[key]
		for t := prev.live(); t != nil && t.dropped; t = prev.live() {
			prev = t.prev // replaced before it went: not a version sent
		}
		// The newest version that travelled reliably, and unless this
		// one does too, the last few that did not.
		named, seenReliable := 0, false
		for d, k := prev, 0; k < maxContentWalk && named < contentBackRefs; k++ {
			t := d.live()
			if t == nil {
				break
			}
			switch {
			case t.reliable && !seenReliable:
				seenReliable = true
				d.hard = !reliable
				m.deps = append(m.deps, d)
			case !t.reliable && !reliable:
				m.deps = append(m.deps, d)
				named++
			}
			if reliable && seenReliable {
				break
			}
			d = t.prev
		}
		m.latest = !m.inOrder && len(m.after) == 0 && !reliable
	}
	if !m.tracked && !m.inOrder && !hasKey {
		m.track = nil
		return
	}
	t, ok := o.free.get()
	if !ok {
		t = new(track)
	}
	*t = track{ref: m.ref, reliable: reliable, inOrder: m.inOrder, channel: m.channel,
		hasKey: hasKey, key: key, explicit: m.tracked, wire: t.wire[:0], deps: t.deps[:0], prev: prev}
	m.track = t
	o.fifo = append(o.fifo, t)
	if m.tracked {
		if o.byRef == nil {
			o.byRef = make(map[Ref]*track)
		}
		o.byRef[m.ref] = t
	}
	d := depOn{t: t, ref: m.ref}
	if ch != nil {
		if reliable {
			ch.rel = d
		} else {
			ch.unrel = d
		}
		ch.any = d
	}
	if hasKey {
		if o.latest == nil {
			o.latest = make(map[contentKey]depOn)
		}
		o.latest[key] = d
	}
}

func appendLive(deps []depOn, d depOn) []depOn {
	if d.live() != nil {
		deps = append(deps, d)
	}
	return deps
}

// tracking reports whether any track is live.
func (o *sendOrder) tracking() bool { return o.fifoAt < len(o.fifo) }

// forget recycles tracks that no later message needs: resolved ones, in
// order.
func (o *sendOrder) forget(resolved func(t *track) bool) {
	for o.fifoAt < len(o.fifo) {
		t := o.fifo[o.fifoAt]
		if !t.dropped && !resolved(t) {
			break
		}
		o.fifo[o.fifoAt] = nil
		o.fifoAt++
		o.drop(t)
	}
	if o.fifoAt > 64 && o.fifoAt*2 > len(o.fifo) {
		n := copy(o.fifo, o.fifo[o.fifoAt:])
		clear(o.fifo[n:])
		o.fifo = o.fifo[:n]
		o.fifoAt = 0
	}
}

func (o *sendOrder) drop(t *track) {
	if t.explicit {
		delete(o.byRef, t.ref)
	}
	if t.inOrder {
		o.dropTail(t)
	}
	if t.hasKey && o.latest[t.key].t == t {
		delete(o.latest, t.key)
	}
	t.ref = 0 // any depOn still naming it now reads as resolved
	o.free.put(t, 0)
}

// dropTail clears t from its channel's tails.
func (o *sendOrder) dropTail(t *track) {
	ch := o.tails(t.channel)
	if ch == nil {
		return
	}
	for _, d := range [...]*depOn{&ch.rel, &ch.any, &ch.unrel} {
		if d.t == t {
			*d = depOn{}
		}
	}
	if ch.rel.t == nil && ch.any.t == nil && ch.unrel.t == nil {
		// Nothing left to order after: the entry goes, as good as
		// tails all resolved.
		last := len(o.chans) - 1
		*ch = o.chans[last]
		o.chans[last] = chanTails{}
		o.chans = o.chans[:last]
	}
}

// trim lets go of storage unused since it last ran (see session.tidy).
func (o *sendOrder) trim() {
	o.free.trim()
	if o.fifoAt == len(o.fifo) {
		o.fifo, o.fifoAt = nil, 0
	}
	if len(o.chans) == 0 {
		o.chans = nil
	}
	// Emptied maps keep their buckets.
	if len(o.byRef) == 0 {
		o.byRef = nil
	}
	if len(o.latest) == 0 {
		o.latest = nil
	}
}

// reset forgets everything.
func (o *sendOrder) reset() {
	for _, t := range o.fifo[o.fifoAt:] {
		if t != nil {
			t.ref = 0
		}
	}
	o.fifo, o.fifoAt, o.free = nil, 0, freeList[*track]{}
	o.chans = nil
	clear(o.byRef)
	clear(o.latest)
}
