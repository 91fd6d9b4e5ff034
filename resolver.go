package knet

import (
	"container/heap"
	"math/bits"
	"time"
)

// The receiver's side of ordering (spec "InOrder Datagrams and Messages",
// DECISIONS §5): received messages held until what they depend on is
// applied, and the unreliable ones given up on after their reorder window.
// session_apply.go applies what it releases; deptable.go holds the
// dependency entries of a datagram and the groups its held messages form.

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
	deadline time.Time // unreliable: when it gives up waiting
	done     bool
	cost     int // what it is charged in resolver.bytes (heldCost)
	// Its dependencies: the entries of its group (the datagram's) not yet
	// resolved for it, and how many.
	group   *depGroup
	member  int32 // its index among the group's members
	unres   depBits
	pending int
	// waiters is the first wait node of the groups waiting for it (+1).
	waiters int32
}

// resolver holds received messages until their dependencies are applied.
//
// A message counts as applied when its datagram has arrived and it is not
// held (DECISIONS §5: the receiver applies what it can on arrival). An
// unreliable message waits at most the reorder window for a dependency; what
// it gives up on is declared missing, and an unreliable message declared
// missing is dropped if it arrives later. A reliable message never gives up.
//
// What waits for a datagram not arrived waits on its PacketID, one wait per
// group (the held messages of one datagram) and PacketID, resolved when the
// datagram has been handled (arrived); what waits for a held message waits
// on it, resolved when it is applied or dropped (wake).
type resolver struct {
	held  map[uint64]*held // by refKey
	timed groupHeap        // groups with unreliable members, by deadline
	bytes int              // what the held messages and their groups are charged
	free  freeList[*held]
	// The datagram being handled: its dependency table, kept up to date
	// as the resolver changes (hold, release, declareMissing), and what
	// is known of its PacketID.
	tab *depTable
	cur *pidRec
	// floor is the newest message that an unreliable dependent gave up
	// on. An unreliable in-order message sent before it (an earlier
	// datagram, or earlier in the same one) comes too late: a newer message
	// already went without its successors, so it is dropped.
	floor    msgRef
	hasFloor bool
	// The rest, made with the first message held or declared missing:
	// most connections never hold one.
	*depState
}

// depState is the resolver's bookkeeping of what waits for what.
type depState struct {
	pids map[uint32]*pidRec
	// recGen changes whenever a pidRec is made or forgotten (depTable's
	// runs cache them).
	recGen uint32
	// missQ holds the records with messages declared missing, oldest
	// first from missHead; nmiss and missWords count what they hold.
	missQ     []*pidRec
	missHead  int
	nmiss     int
	missWords int
	nodes     []waitNode
	freeNode  int32 // first free node (+1)
	usedNodes int
	groups    freeList[*depGroup]
	dead      []*depGroup // groups left without members, to free (reap)
	// stack is expire's: held messages given up on together.
	stack []*held
	// waitIdx, for the datagram being handled, are the indices of its
	// messages held ones wait for (waitedOn), once asked.
	waitIdx   []uint64
	waitKnown bool
}

const (
	// maxMissing bounds the messages declared missing that are
	// remembered, and maxMissWords the words their sets take.
	maxMissing   = 4096
	maxMissWords = 8192
	// maxFreeGroups bounds the groups kept for reuse.
	maxFreeGroups = 64
)

// init readies the maps on first use: most connections never hold a
// message.
func (r *resolver) init() {
	if r.held == nil {
		r.held = make(map[uint64]*held)
	}
	if r.depState == nil {
		r.depState = &depState{pids: make(map[uint32]*pidRec)}
	}
}

// heldAt returns the message held at ref, or nil.
func (r *resolver) heldAt(ref msgRef) *held {
	if len(r.held) == 0 {
		return nil
	}
	return r.held[refKey(ref)]
}

// begin starts the handling of the datagram with PacketID pid, whose
// dependency table is t (filled when first needed).
func (r *resolver) begin(pid uint32, t *depTable) {
	t.reset(pid)
	r.tab, r.cur = t, nil
	if r.depState != nil {
		r.waitKnown = false
		if len(r.pids) > 0 {
			r.cur = r.pids[pid]
		}
	}
}

// end ends the handling of the datagram begun, and returns, released, the
// held messages ready now that it arrived (see arrived); with arrived
// false (the datagram was not taken in) nothing changes.
func (r *resolver) end(arrived bool, ready []*held) []*held {
	rec := r.cur
	r.tab, r.cur = nil, nil
	if arrived && rec != nil {
		ready = r.arrived(rec, ready)
	}
	return ready
}

// state returns where entry e of t stands, looking it up if it is not
// known: applied, held, not arrived, or declared missing.
func (r *resolver) state(t *depTable, e int, w *recvWindow) entryState {
	en := &t.ent[e]
	if en.state != stUnknown {
		return en.state
	}
	ru := &t.runs[en.run]
	var gen uint32
	if r.depState != nil {
		gen = r.recGen
	}
	if !ru.known || ru.gen != gen {
		ru.contained = w.contains(ru.pid)
		ru.rec = nil
		if !ru.contained && r.depState != nil && len(r.pids) > 0 {
			ru.rec = r.pids[ru.pid]
		}
		ru.known, ru.gen = true, gen
		if !ru.contained && !ru.absent {
			ru.absent = true
			t.absent++
		}
	}
	switch {
	case ru.contained:
		en.state = stApplied
		if h := r.heldAt(en.ref); h != nil {
			en.state, en.on = stHeld, h
		}
	case ru.rec != nil && ru.rec.missing(en.ref.idx):
		en.state = stMissing
	default:
		en.state = stAbsent
	}
	return en.state
}

// unresolved returns the entries of all not yet resolved for a dependent,
// reliable or not.
func (r *resolver) unresolved(t *depTable, all depBits, w *recvWindow, reliable bool) (out depBits) {
	for k, x := range all {
		for ; x != 0; x &= x - 1 {
			e := k<<6 | bits.TrailingZeros64(x)
			st := t.ent[e].state
			if st == stUnknown {
				st = r.state(t, e, w)
			}
			if st.lacks(reliable) {
				out.set(e)
			}
		}
	}
	return out
}

// maxAbsentPIDs is how many datagrams not arrived the messages of one
// datagram may have an unreliable message wait for. Past it, an unreliable
// message gives up at once on what it names of datagrams not arrived, as it
// would after its reorder window: whatever was sent before them comes too
// late (the floor), with no record made, declared missing, and forgotten for
// each. A sender names the previous message of each channel, so that
// reaching the cap takes more than 16 datagrams lost, each carrying one of
// the channels of the datagram that names them; a peer's datagram naming
// 255 datagrams never sent cost a record each, held, given up on and
// forgotten, 24 times an honest datagram's CPU per byte (issue 38).
const maxAbsentPIDs = 16

// giveUpNow reports whether an unreliable message of the datagram being
// handled, whose table is t, gives up at once on the datagrams not arrived
// that it names, rather than wait: past maxAbsentPIDs of them.
func (r *resolver) giveUpNow(t *depTable) bool { return t.absent > maxAbsentPIDs }

// giveUpAbsent gives up, for an unreliable message, on the entries of
// lacks, unresolved entries of t, that name a datagram not arrived, and
// returns the others.
func (r *resolver) giveUpAbsent(t *depTable, lacks depBits) depBits {
	for k, x := range lacks {
		for ; x != 0; x &= x - 1 {
			e := k<<6 | bits.TrailingZeros64(x)
			if en := &t.ent[e]; en.state == stAbsent {
				r.raiseFloor(en.ref)
				lacks.unset(e)
			}
		}
	}
	return lacks
}

// lateDrop reports whether an arriving message of the datagram being
// handled was declared missing and, unreliable, must be dropped; it
// forgets the declaration either way.
func (r *resolver) lateDrop(ref msgRef, reliable bool) bool {
	p := r.cur
	if p == nil || p.pid != ref.pid || !p.missing(ref.idx) {
		return false
	}
	p.miss[ref.idx>>6] &^= 1 << (ref.idx & 63)
	p.nmiss--
	r.nmiss--
	return !reliable
}

// heldRecordCost is what holding one message costs beyond its payload (the
// held record, its map and heap entries, its waiters), charged with the
// payload against ReceiveBuffer: a peer's empty messages, each naming one
// that never comes, were held without limit for the reorder window (59,700
// from 200 datagrams, TestPeerHoldingEmptyMessages).
const heldRecordCost = 192

// heldDepCost is what each dependency of a held message costs (its bit and
// its entry in the group's lists): a peer's messages naming 255 datagrams
// each, charged only heldRecordCost, held 60 times the buffer
// (TestPeerHoldingManyDependencies).
const heldDepCost = 64

// heldCost is what holding a message of n payload bytes and deps
// dependencies is charged against ReceiveBuffer.
func heldCost(n, deps int) int { return n + heldRecordCost + deps*heldDepCost }

// holdCost is what holding a message of n payload bytes lacking deps,
// entries of t, would be charged: heldCost, and t's group if it is the
// first of its datagram held.
func (r *resolver) holdCost(t *depTable, n int, deps depBits) int {
	c := heldCost(n, deps.count())
	if t.group == nil && !deps.empty() {
		c += t.n * groupEntryCost
	}
	return c
}

// hold keeps h until the entries of t in lacks, all unresolved, are
// applied; an unreliable message gives up at deadline. A message with
// nothing lacking holds a place (heldFragments).
func (r *resolver) hold(h *held, deadline time.Time, t *depTable, lacks depBits) {
	r.init()
	r.held[refKey(h.ref)] = h
	h.cost = heldCost(len(h.payload), lacks.count())
	r.bytes += h.cost
	if r.tab != nil && h.ref.pid != r.tab.pid {
		r.tab.invalidate(h.ref)
	}
	if lacks.empty() {
		return
	}
	g := t.group
	if g == nil {
		g, _ = r.groups.get()
		if g == nil {
			g = new(depGroup)
		}
		g.fill(t)
		r.bytes += g.cost
		t.group = g
	}
	r.join(g, h, t, lacks)
	if !h.reliable {
		h.deadline = deadline
		r.schedule(g, deadline)
	}
}

// schedule has g expire its unreliable members at deadline at the latest.
// The deadline heap holds a group, not each message: the messages of a
// datagram arrive together, and most wait the same reorder window (a peer's
// 230 held unreliable messages a datagram cost a heap entry each, pushed,
// popped, and applied through a heap of their own, 45x an honest datagram's
// CPU per byte, issue 38).
func (r *resolver) schedule(g *depGroup, deadline time.Time) {
	switch {
	case g.timedAt == 0:
		g.deadline = deadline
		heap.Push(&r.timed, g)
	case deadline.Before(g.deadline):
		g.deadline = deadline
		heap.Fix(&r.timed, g.timedAt-1)
	}
}

// join makes h, lacking the entries lacks of t, a member of g, the group of
// t's datagram, and has g wait for each entry no member waited for before.
func (r *resolver) join(g *depGroup, h *held, t *depTable, lacks depBits) {
	g.dying = false
	h.group = g
	h.member = int32(len(g.members))
	g.members = append(g.members, h)
	g.live++
	h.unres = lacks
	h.pending = lacks.count()
	var bit uint64
	if h.member < 64 {
		bit = 1 << h.member
	}
	for k, x := range lacks {
		for ; x != 0; x &= x - 1 {
			e := k<<6 | bits.TrailingZeros64(x)
			if ge := &g.ent[e]; ge.wait == gNone || ge.wait == gDone {
				if t.ent[e].state == stHeld {
					ge.wait = gHeld
					ge.node = r.waitOnHeld(t.ent[e].on, g, e)
					g.held++
				} else { // stAbsent, stMissing
					ge.wait = gRun
					if ru := &g.runs[ge.run]; ru.node == 0 {
						ru.node = r.waitOnPID(ru.pid, g, int(ge.run))
					}
				}
			}
			if bit != 0 {
				g.masks[e] |= bit
			} else {
				g.pairs = append(g.pairs, groupPair{member: h.member, next: g.ent[e].head})
				g.ent[e].head = int32(len(g.pairs))
			}
		}
	}
	r.waitKnown = false
}

// newHeld returns a cleared held, reusing one if it can.
func (r *resolver) newHeld() *held {
	if h, ok := r.free.get(); ok {
		return h
	}
	return &held{}
}

func (r *resolver) recycle(h *held) {
	*h = held{}
	r.free.put(h, maxFreeHeld)
}

// release stops holding h, leaving it to the caller to apply or drop it,
// then wake what waits for it.
func (r *resolver) release(h *held) {
	h.done = true
	if len(r.held) > 0 {
		delete(r.held, refKey(h.ref))
	}
	r.bytes -= h.cost
	h.cost = 0
	if r.tab != nil {
		r.tab.invalidate(h.ref)
	}
	g := h.group
	if g == nil {
		return
	}
	h.group = nil
	g.members[h.member] = nil
	g.live--
	for g.first < len(g.members) && g.members[g.first] == nil {
		g.first++
	}
	if g.live == 0 && !g.dying {
		g.dying = true
		r.dead = append(r.dead, g)
	}
	r.waitKnown = false
}

// reap frees the groups left without members.
func (r *resolver) reap() {
	if r.depState == nil {
		return
	}
	for i, g := range r.dead {
		r.dead[i] = nil
		if g.live == 0 && g.dying {
			r.freeGroup(g)
		}
	}
	r.dead = r.dead[:0]
}

func (r *resolver) freeGroup(g *depGroup) {
	if g.timedAt != 0 {
		heap.Remove(&r.timed, g.timedAt-1)
	}
	for i := range g.runs {
		if n := g.runs[i].node; n != 0 {
			r.unlink(n)
		}
	}
	for i := 0; g.held > 0 && i < len(g.ent); i++ {
		if n := g.ent[i].node; n != 0 {
			r.unlink(n)
			g.held--
		}
	}
	r.bytes -= g.cost
	clear(g.members)
	*g = depGroup{ent: g.ent[:0], masks: g.masks[:0], runs: g.runs[:0], members: g.members[:0], pairs: g.pairs[:0]}
	if r.tab != nil && r.tab.group == g {
		r.tab.group = nil
	}
	r.groups.put(g, maxFreeGroups)
}

// satisfy resolves entry e of g for its members, all of them or only the
// unreliable ones, and returns, released, those it leaves lacking nothing.
func (r *resolver) satisfy(g *depGroup, e int, unreliableOnly bool, ready []*held) []*held {
	for m := g.masks[e]; m != 0; m &= m - 1 {
		ready = r.satisfyMember(g.members[bits.TrailingZeros64(m)], e, unreliableOnly, ready)
	}
	for p := g.ent[e].head; p != 0; p = g.pairs[p-1].next {
		ready = r.satisfyMember(g.members[g.pairs[p-1].member], e, unreliableOnly, ready)
	}
	if !unreliableOnly {
		ge := &g.ent[e]
		if ge.wait == gHeld {
			g.held--
		}
		ge.wait, ge.head, ge.node = gDone, 0, 0
		g.masks[e] = 0
	}
	return ready
}

// satisfyMember resolves entry e for member m, if it lacked it.
func (r *resolver) satisfyMember(m *held, e int, unreliableOnly bool, ready []*held) []*held {
	if m == nil || !m.unres.has(e) || unreliableOnly && m.reliable {
		return ready
	}
	m.unres.unset(e)
	if m.pending--; m.pending == 0 {
		r.release(m)
		ready = append(ready, m)
	}
	return ready
}

// arrived resolves what waited for the datagram of record p, now handled:
// each message of it named is applied, or held, and then waited on in turn.
func (r *resolver) arrived(p *pidRec, ready []*held) []*held {
	for n := p.head; n != 0; {
		node := r.nodes[n-1]
		r.freeNodeAt(n)
		n = node.next
		g, ru := node.g, int(node.x)
		g.runs[ru].node = 0
		for e := int(g.runs[ru].first); e != noEntry; e = int(g.ent[e].next) {
			if g.ent[e].wait != gRun {
				continue
			}
			if h := r.heldAt(g.ref(e)); h != nil {
				g.ent[e].wait = gHeld
				g.ent[e].node = r.waitOnHeld(h, g, e)
				g.held++
				continue
			}
			ready = r.satisfy(g, e, false, ready)
		}
	}
	p.head = 0
	r.dropRec(p)
	r.reap()
	return ready
}

// wake resolves what waited for h, applied or dropped (released), and
// returns, released, the held messages now ready.
func (r *resolver) wake(h *held, ready []*held) []*held {
	for n := h.waiters; n != 0; {
		node := r.nodes[n-1]
		r.freeNodeAt(n)
		n = node.next
		ready = r.satisfy(node.g, int(node.x), false, ready)
	}
	h.waiters = 0
	r.reap()
	return ready
}

// moveWaiters has what waited for from wait for to instead: a reassembled
// message held in its FragmentStart's place.
func (r *resolver) moveWaiters(from, to *held) {
	for n := from.waiters; n != 0; n = r.nodes[n-1].next {
		r.nodes[n-1].on = to
	}
	to.waiters, from.waiters = from.waiters, 0
}

// waitOnPID has g wait for run ru of its entries on datagram pid, and
// returns the wait node.
func (r *resolver) waitOnPID(pid uint32, g *depGroup, ru int) int32 {
	r.init()
	p := r.pids[pid]
	if p == nil {
		p = &pidRec{pid: pid}
		r.pids[pid] = p
		r.recGen++
	}
	n := r.newNode(waitNode{g: g, x: uint8(ru), rec: p, next: p.head})
	p.head = n
	return n
}

// waitOnHeld has g wait for its entry e on h, and returns the wait node.
func (r *resolver) waitOnHeld(h *held, g *depGroup, e int) int32 {
	n := r.newNode(waitNode{g: g, x: uint8(e), on: h, next: h.waiters})
	h.waiters = n
	return n
}

// newNode stores w, first in its list, and returns its index+1.
func (r *resolver) newNode(w waitNode) int32 {
	var n int32
	if r.freeNode != 0 {
		n = r.freeNode
		r.freeNode = r.nodes[n-1].next
		r.nodes[n-1] = w
	} else {
		r.nodes = append(r.nodes, w)
		n = int32(len(r.nodes))
	}
	if w.next != 0 {
		r.nodes[w.next-1].prev = n
	}
	r.usedNodes++
	return n
}

func (r *resolver) freeNodeAt(n int32) {
	r.nodes[n-1] = waitNode{next: r.freeNode}
	r.freeNode = n
	r.usedNodes--
}

// unlink takes node n out of its list and frees it; a record left with
// nothing to keep is forgotten.
func (r *resolver) unlink(n int32) {
	node := r.nodes[n-1]
	switch {
	case node.prev != 0:
		r.nodes[node.prev-1].next = node.next
	case node.rec != nil:
		node.rec.head = node.next
	default:
		node.on.waiters = node.next
	}
	if node.next != 0 {
		r.nodes[node.next-1].prev = node.prev
	}
	r.freeNodeAt(n)
	if p := node.rec; p != nil && p.head == 0 && p.nmiss == 0 && p != r.cur {
		r.dropRec(p)
	}
}

// dropRec forgets record p, and what it declared missing.
func (r *resolver) dropRec(p *pidRec) {
	if p.dropped {
		return
	}
	p.dropped = true
	delete(r.pids, p.pid)
	r.recGen++
	r.nmiss -= p.nmiss
	r.missWords -= len(p.miss)
	p.nmiss, p.miss = 0, nil
	if r.tab != nil {
		r.tab.invalidatePID(p.pid)
	}
}

// trim lets go of what the last burst of held messages left.
func (r *resolver) trim() {
	r.free.trim()
	if r.depState == nil {
		return
	}
	r.groups.trim()
	if r.usedNodes == 0 {
		r.nodes, r.freeNode = nil, 0
	}
}

// siblingBudget bounds the members one expire looks at for given-up
// messages' predecessors in their datagrams.
const siblingBudget = 4096

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
// The messages of its datagram that wait for what it gives up on are
// released too.
func (r *resolver) expire(now time.Time, ready []*held) []*held {
	budget := siblingBudget
	for r.timed.Len() > 0 && !r.timed[0].deadline.After(now) {
		tg := heap.Pop(&r.timed).(*depGroup)
		var next time.Time // the first deadline of its members not due
		for i := tg.first; i < len(tg.members); i++ {
			if h := tg.members[i]; h != nil && !h.reliable && !h.done {
				if h.deadline.After(now) {
					if next.IsZero() || h.deadline.Before(next) {
						next = h.deadline
					}
					continue
				}
				ready = r.giveUp(h, &budget, ready)
			}
		}
		if !next.IsZero() && tg.live > 0 {
			r.schedule(tg, next)
		}
	}
	r.reap()
	return ready
}

// giveUp is expire's for one message h whose reorder window has passed,
// with those given up on along with it; budget is what is left of the
// members expire may look at.
func (r *resolver) giveUp(h *held, budget *int, ready []*held) []*held {
	stack := append(r.stack[:0], h)
	for len(stack) > 0 {
		h := stack[len(stack)-1]
		stack[len(stack)-1] = nil
		stack = stack[:len(stack)-1]
		if h.done {
			continue // released meanwhile: what it lacked was given up on
		}
		g := h.group
		lacks := h.unres
		// The members before it in its datagram that lack no more
		// than it does are its predecessors: the wire names a
		// message's predecessor in the same datagram by naming what
		// that one names (DECISIONS §5). The look is bounded per
		// call: a peer's datagrams of a thousand tiny held messages
		// cost it at most the order among its own messages.
		for i := int(h.member) - 1; i >= g.first && *budget > 0; i-- {
			*budget--
			if sh := g.members[i]; sh != nil && !sh.reliable && !sh.done && sh.unres.within(&lacks) {
				stack = append(stack, sh)
			}
		}
		h.unres, h.pending = depBits{}, 0
		for k, x := range lacks {
			for ; x != 0; x &= x - 1 {
				e := k<<6 | bits.TrailingZeros64(x)
				switch ge := &g.ent[e]; ge.wait {
				case gHeld:
					// A reliable message is applied exactly once,
					// later.
					if dh := r.nodes[ge.node-1].on; !dh.reliable && !dh.done {
						stack = append(stack, dh)
					}
				case gRun:
					ref := g.ref(e)
					r.declareIn(r.nodes[g.runs[ge.run].node-1].rec, ref)
					r.raiseFloor(ref)
					ready = r.satisfy(g, e, true, ready)
				}
			}
		}
		r.release(h)
		ready = append(ready, h)
	}
	r.stack = stack
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

// declareMissing records that the message ref, not arrived, was given up
// on: it is dropped if it comes unreliable, and no longer waited for by
// unreliable dependents.
func (r *resolver) declareMissing(ref msgRef) {
	r.init()
	p := r.pids[ref.pid]
	if p == nil {
		p = &pidRec{pid: ref.pid}
		r.pids[ref.pid] = p
		r.recGen++
	}
	r.declareIn(p, ref)
}

// declareIn is declareMissing with ref's record p at hand.
func (r *resolver) declareIn(p *pidRec, ref msgRef) {
	if p.missing(ref.idx) {
		return
	}
	if w := int(ref.idx>>6) + 1; w > len(p.miss) {
		r.missWords += w - len(p.miss)
		p.miss = append(p.miss, make([]uint64, w-len(p.miss))...)
	}
	p.miss[ref.idx>>6] |= 1 << (ref.idx & 63)
	p.nmiss++
	r.nmiss++
	if !p.queued {
		p.queued = true
		r.missQ = append(r.missQ, p)
	}
	if r.tab != nil {
		r.tab.invalidate(ref)
	}
	for r.nmiss > maxMissing || r.missWords > maxMissWords {
		r.forgetOldest()
	}
}

// forgetOldest forgets the messages declared missing of the record that
// declared first.
func (r *resolver) forgetOldest() {
	p := r.missQ[r.missHead]
	r.missQ[r.missHead] = nil
	r.missHead++
	if r.missHead > len(r.missQ)/2 {
		n := copy(r.missQ, r.missQ[r.missHead:])
		clear(r.missQ[n:])
		r.missQ = r.missQ[:n]
		r.missHead = 0
	}
	p.queued = false
	if p.dropped {
		return
	}
	r.nmiss -= p.nmiss
	r.missWords -= len(p.miss)
	p.nmiss, p.miss = 0, nil
	if r.tab != nil {
		r.tab.invalidatePID(p.pid)
	}
	if p.head == 0 && p != r.cur {
		r.dropRec(p)
	}
}

// supersede gives up on the entries lacks of t, the unresolved
// dependencies of an unreliable message applied without them, because it
// replaces them (latest state) or because it was itself dropped as
// overtaken: an older message must not come after a newer one. Those not
// arrived are declared missing, so that they are dropped if they come;
// unreliable application messages still held are released and returned,
// for the caller to drop.
func (r *resolver) supersede(t *depTable, lacks depBits, dropped []*held) []*held {
	for k, x := range lacks {
		for ; x != 0; x &= x - 1 {
			e := k<<6 | bits.TrailingZeros64(x)
			en := &t.ent[e]
			switch en.state {
			case stHeld:
				if h := en.on; !h.reliable && h.kind == heldApp && !h.done {
					r.release(h)
					dropped = append(dropped, h)
				}
			case stAbsent:
				r.declareMissing(en.ref)
			}
		}
	}
	return dropped
}

// waitedOn reports whether a held message waits for the message ref of the
// datagram being handled.
func (r *resolver) waitedOn(ref msgRef) bool {
	p := r.cur
	if p == nil || p.pid != ref.pid {
		return false
	}
	if !r.waitKnown {
		// Once per datagram: the indices waited for.
		clear(r.waitIdx)
		for n := p.head; n != 0; n = r.nodes[n-1].next {
			node := &r.nodes[n-1]
			g := node.g
			for e := int(g.runs[node.x].first); e != noEntry; e = int(g.ent[e].next) {
				if g.ent[e].wait == gRun && r.waiting(g, e) {
					idx := int(g.ent[e].idx)
					if w := idx>>6 + 1; w > len(r.waitIdx) {
						r.waitIdx = append(r.waitIdx, make([]uint64, w-len(r.waitIdx))...)
					}
					r.waitIdx[idx>>6] |= 1 << (idx & 63)
				}
			}
		}
		r.waitKnown = true
	}
	w := int(ref.idx >> 6)
	return w < len(r.waitIdx) && r.waitIdx[w]>>(ref.idx&63)&1 != 0
}

// waiting reports whether a member of g lacks its entry e.
func (r *resolver) waiting(g *depGroup, e int) bool {
	for m := g.masks[e]; m != 0; m &= m - 1 {
		if h := g.members[bits.TrailingZeros64(m)]; h != nil && h.unres.has(e) {
			return true
		}
	}
	for p := g.ent[e].head; p != 0; p = g.pairs[p-1].next {
		if m := g.members[g.pairs[p-1].member]; m != nil && m.unres.has(e) {
			return true
		}
	}
	return false
}

// nextDeadline is when the first unreliable message gives up waiting.
func (r *resolver) nextDeadline() (time.Time, bool) {
	if r.timed.Len() == 0 {
		return time.Time{}, false
	}
	return r.timed[0].deadline, true
}

// groupHeap orders groups with unreliable members by deadline, then
// datagram.
type groupHeap []*depGroup

func (q groupHeap) Len() int { return len(q) }
func (q groupHeap) Less(i, j int) bool {
	if !q[i].deadline.Equal(q[j].deadline) {
		return q[i].deadline.Before(q[j].deadline)
	}
	return seqLess(q[i].pid, q[j].pid)
}
func (q groupHeap) Swap(i, j int) {
	q[i], q[j] = q[j], q[i]
	q[i].timedAt = i + 1
	q[j].timedAt = j + 1
}
func (q *groupHeap) Push(x any) {
	g := x.(*depGroup)
	g.timedAt = len(*q) + 1
	*q = append(*q, g)
}
func (q *groupHeap) Pop() any {
	old := *q
	g := old[len(old)-1]
	old[len(old)-1] = nil
	*q = old[:len(old)-1]
	g.timedAt = 0
	return g
}
