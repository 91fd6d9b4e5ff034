package knet

import (
	"math/bits"
	"math/rand/v2"
	"slices"
	"time"
)

// The dependencies a received datagram's messages name (spec "InOrder
// Datagrams and Messages", DECISIONS §5), in time linear in the entries its
// header carries and the indices its messages list: each distinct message
// named is one entry of the datagram's depTable (duplicates found by a hash,
// not a search), a message's dependencies are a bit set over those entries,
// and a held message counts what it still lacks, so that neither holding it
// nor releasing it nor giving up on it rescans a list. Messages waiting for
// a datagram not yet arrived wait on its PacketID as a group, the messages
// of one datagram together (depGroup). (Issue 38: a message naming 255
// entries of a datagram never sent cost, held and then given up on, 110-350
// times an honest datagram's CPU per byte.)

// depBits is a set of a depTable's entries.
type depBits [4]uint64

func (b *depBits) set(e int)   { b[e>>6] |= 1 << (e & 63) }
func (b *depBits) unset(e int) { b[e>>6] &^= 1 << (e & 63) }
func (b *depBits) has(e int) bool {
	return b[e>>6]>>(e&63)&1 != 0
}
func (b *depBits) empty() bool { return b[0]|b[1]|b[2]|b[3] == 0 }

func (b *depBits) count() int {
	return bits.OnesCount64(b[0]) + bits.OnesCount64(b[1]) + bits.OnesCount64(b[2]) + bits.OnesCount64(b[3])
}

// within reports whether every entry of b is in c.
func (b *depBits) within(c *depBits) bool {
	return b[0]&^c[0]|b[1]&^c[1]|b[2]&^c[2]|b[3]&^c[3] == 0
}

// entryState is where a message named as a dependency stands.
type entryState uint8

const (
	stUnknown entryState = iota // to be looked up (see depTable.state)
	stApplied                   // arrived and not held: applied, or dropped
	stHeld                      // arrived and held
	stAbsent                    // not arrived
	stMissing                   // not arrived, declared missing: resolved for an unreliable dependent
)

// lacks reports whether a dependency in state st is unresolved for a
// dependent, reliable or not (a reliable one waits for a message declared
// missing, DECISIONS §5).
func (st entryState) lacks(reliable bool) bool {
	return st == stHeld || st == stAbsent || st == stMissing && reliable
}

// noEntry ends a run's list of entries.
const noEntry = 0xff

// depTable is the distinct messages a datagram's header names (or a
// reassembled message's FragmentStart named), in runs of one PacketID, and
// where each stands, looked up once while the datagram is handled and again
// only when the resolver changes it (invalidate).
type depTable struct {
	pid   uint32 // the datagram's: a group made from the table is its
	n     int
	canon [maxDeps]uint8 // header entry x is entry canon[x]
	ent   [maxDeps]tabEntry
	nruns int
	runs  [maxDeps]tabRun
	// absent counts the runs found naming a datagram not arrived (see
	// maxAbsentPIDs).
	absent int
	// Open addressing, index+1 (0 is empty): entries by message named,
	// runs by PacketID.
	refSlots [tabSlots]uint8
	pidSlots [tabSlots]uint8
	// The group of the datagram's held messages, once one is held.
	group *depGroup
	built bool // filled for the datagram being handled
}

type tabEntry struct {
	ref   msgRef
	run   uint8
	next  uint8 // the next entry of the run, or noEntry
	state entryState
	on    *held // stHeld
}

type tabRun struct {
	pid       uint32
	first     uint8
	known     bool   // contained and rec were read, at recGen gen
	gen       uint32 // the resolver's recGen then
	contained bool
	rec       *pidRec
	absent    bool // counted in depTable.absent
}

// tabSlots is the size of a depTable's hashes: at most maxDeps keys each,
// under half full.
const tabSlots = 512

// tabHashMul is the multiplier of the depTable's hashes, odd and drawn at
// start: a peer choosing the entries cannot make them collide.
var tabHashMul = rand.Uint64() | 1

func tabSlot(key uint64) int { return int((key * tabHashMul) >> (64 - 9)) }

func refKey(r msgRef) uint64 { return uint64(r.pid)<<16 | uint64(r.idx) }

// reset empties the table for the datagram with PacketID pid.
func (t *depTable) reset(pid uint32) {
	if t.n > 0 {
		clear(t.refSlots[:])
		clear(t.pidSlots[:])
		clear(t.ent[:t.n]) // the held messages named
		clear(t.runs[:t.nruns])
	}
	t.pid, t.n, t.nruns, t.absent = pid, 0, 0, 0
	t.group = nil
	t.built = false
}

// add takes the message ref into the table, once, and returns its entry.
func (t *depTable) add(ref msgRef) int {
	k := refKey(ref)
	i := tabSlot(k)
	for ; t.refSlots[i] != 0; i = (i + 1) & (tabSlots - 1) {
		if e := int(t.refSlots[i]) - 1; t.ent[e].ref == ref {
			return e
		}
	}
	e := t.n
	t.n++
	t.refSlots[i] = uint8(e + 1)
	// Its run: the entries naming the same datagram.
	j := tabSlot(uint64(ref.pid))
	for ; t.pidSlots[j] != 0; j = (j + 1) & (tabSlots - 1) {
		if ru := int(t.pidSlots[j]) - 1; t.runs[ru].pid == ref.pid {
			t.ent[e] = tabEntry{ref: ref, run: uint8(ru), next: t.runs[ru].first}
			t.runs[ru].first = uint8(e)
			return e
		}
	}
	ru := t.nruns
	t.nruns++
	t.pidSlots[j] = uint8(ru + 1)
	t.runs[ru] = tabRun{pid: ref.pid, first: uint8(e)}
	t.ent[e] = tabEntry{ref: ref, run: uint8(ru), next: noEntry}
	return e
}

// find returns the entry naming ref, or -1.
func (t *depTable) find(ref msgRef) int {
	if t.n == 0 {
		return -1
	}
	for i := tabSlot(refKey(ref)); t.refSlots[i] != 0; i = (i + 1) & (tabSlots - 1) {
		if e := int(t.refSlots[i]) - 1; t.ent[e].ref == ref {
			return e
		}
	}
	return -1
}

// fromHeader fills the table with the entries of h.
func (t *depTable) fromHeader(h *header) {
	t.reset(h.packetID)
	for x := range h.deltas {
		t.canon[x] = uint8(t.add(refFromEntry(h, x)))
	}
	t.built = true
}

// fromRefs fills the table with refs, the dependencies of a message whose
// FragmentStart was in datagram pid.
func (t *depTable) fromRefs(pid uint32, refs []msgRef) (all depBits) {
	t.reset(pid)
	for _, r := range refs {
		all.set(t.add(r))
	}
	return all
}

// entryOf returns the one entry m names, InOrder code 1-6 (not 0 or
// orderMulti).
func (t *depTable) entryOf(m *message) int {
	if m.order == orderSingle {
		return int(t.canon[m.orderIndex])
	}
	return int(t.canon[m.order-1])
}

// bitsOf returns the entries m names per its InOrder code (checkOrder made
// sure the header carries them), each once.
func (t *depTable) bitsOf(m *message) (b depBits) {
	switch m.order {
	case orderNone:
	case orderSingle:
		b.set(int(t.canon[m.orderIndex]))
	case orderMulti:
		for _, x := range m.orderMulti {
			b.set(int(t.canon[x]))
		}
	default:
		b.set(int(t.canon[m.order-1]))
	}
	return b
}

// refsOf appends the messages the entries of b name.
func (t *depTable) refsOf(dst []msgRef, b depBits) []msgRef {
	for k, x := range b {
		for ; x != 0; x &= x - 1 {
			e := k<<6 | bits.TrailingZeros64(x)
			dst = append(dst, t.ent[e].ref)
		}
	}
	return dst
}

// invalidate has the entry naming ref, if any, looked up again.
func (t *depTable) invalidate(ref msgRef) {
	if e := t.find(ref); e >= 0 {
		t.ent[e].state, t.ent[e].on = stUnknown, nil
	}
}

// invalidatePID has the entries naming messages of datagram pid looked up
// again.
func (t *depTable) invalidatePID(pid uint32) {
	if t.n == 0 {
		return
	}
	for i := tabSlot(uint64(pid)); t.pidSlots[i] != 0; i = (i + 1) & (tabSlots - 1) {
		if ru := int(t.pidSlots[i]) - 1; t.runs[ru].pid == pid {
			t.runs[ru].known = false
			for e := int(t.runs[ru].first); e != noEntry; e = int(t.ent[e].next) {
				t.ent[e].state, t.ent[e].on = stUnknown, nil
			}
			return
		}
	}
}

// depGroup is the held messages of one datagram that wait for others (its
// members), with its depTable's entries: which members wait for each, and
// what each waits on, a held message or, for the messages of a datagram not
// arrived, that datagram's PacketID, one wait for all the entries naming it.
type depGroup struct {
	pid     uint32
	ent     []groupEntry
	masks   []uint64 // by entry: its first 64 members that lack it
	runs    []groupRun
	members []*held // in the order they were held (their index order); nil once released
	first   int     // members before it are all released
	live    int
	pairs   []groupPair // by entry, in lists: its members from the 65th on that lack it
	held    int         // entries waiting on a held message (wait nodes on it)
	cost    int         // what it is charged in resolver.bytes
	dying   bool        // no member left: to be freed (resolver.reap)
	// deadline is the earliest of its unreliable members' when it was
	// scheduled (a member released since may leave it early); timedAt its
	// index in resolver.timed +1, 0 if not there.
	deadline time.Time
	timedAt  int
}

// groupWait is how a group waits for one of its entries.
type groupWait uint8

const (
	gNone groupWait = iota // no member waits for it (yet)
	gRun                   // on its PacketID (the run's node)
	gHeld                  // on the held message it names (the entry's node)
	gDone                  // resolved
)

// Lists link by index+1: 0 ends them.

type groupEntry struct {
	idx  uint16 // the message's index in its datagram, the run's
	run  uint8
	next uint8
	wait groupWait
	node int32 // gHeld: its wait node on the held message
	head int32 // its first pair
}

type groupRun struct {
	pid   uint32
	first uint8
	node  int32 // the wait node on pid
}

type groupPair struct {
	member int32
	next   int32
}

// groupEntryCost is what each entry of a group costs beyond its members:
// charged against ReceiveBuffer with them.
const groupEntryCost = 48

// ref returns the message entry e names.
func (g *depGroup) ref(e int) msgRef {
	return msgRef{g.runs[g.ent[e].run].pid, g.ent[e].idx}
}

// fill readies g for the messages of the datagram of table t.
func (g *depGroup) fill(t *depTable) {
	g.pid = t.pid
	n := t.n
	g.ent = slices.Grow(g.ent[:0], n)[:n]
	for i := range g.ent {
		e := &t.ent[i]
		g.ent[i] = groupEntry{idx: e.ref.idx, run: e.run, next: e.next}
	}
	g.masks = slices.Grow(g.masks[:0], n)[:n]
	clear(g.masks)
	g.runs = slices.Grow(g.runs[:0], t.nruns)[:t.nruns]
	for i := range g.runs {
		g.runs[i] = groupRun{pid: t.runs[i].pid, first: t.runs[i].first}
	}
	g.cost = n * groupEntryCost
}

// pidRec is what the resolver knows of a PacketID not arrived: the groups
// waiting for it, and the messages of its datagram declared missing.
type pidRec struct {
	pid     uint32
	head    int32    // first wait node
	miss    []uint64 // bit i: message i declared missing
	nmiss   int
	queued  bool // in resolver.missQ
	dropped bool // forgotten: no longer in resolver.pids
}

func (p *pidRec) missing(idx uint16) bool {
	w := int(idx >> 6)
	return w < len(p.miss) && p.miss[w]>>(idx&63)&1 != 0
}

// waitNode is one group waiting, for a run of its entries on a PacketID
// (rec) or for one entry on a held message (on).
type waitNode struct {
	g          *depGroup
	x          uint8 // the run, or the entry
	prev, next int32
	rec        *pidRec
	on         *held
}
