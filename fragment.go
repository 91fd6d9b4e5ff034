package knet

import (
	"bytes"
	"errors"
	"slices"
	"sync"
)

// Fragmented transfers (spec "Fragmented Transfers", DECISIONS §6).
//
// Sender: a message whose content does not fit one message block is cut into
// fragments, each in a reliable datagram, under a TransferID that stays taken
// until every datagram carrying one of its fragments is acked.
//
// Receiver: fragments are kept per TransferID in arrival order, those before
// their FragmentStart included, and put in order once all have come. Memory
// grows with the bytes received, never with a FragmentCount announced; a
// large transfer's arena grows by doubling in pooled buffers (grow), and
// when its fragments came in order it is the message itself.

var (
	errFragCount     = errors.New("knet: FragmentCount below 2")
	errFragTooLarge  = errors.New("knet: fragmented transfer larger than MaxMessageSize")
	errFragTooMany   = errors.New("knet: fragmented transfer in more, smaller fragments than any sender uses")
	errFragNumber    = errors.New("knet: FragmentNumber not below FragmentCount")
	errFragRestart   = errors.New("knet: second FragmentStart for a TransferID in use")
	errFragDuplicate = errors.New("knet: fragment number repeated within a transfer")
	errFragControl   = errors.New("knet: connection control message sent fragmented")
)

// transferIDs allocates TransferIDs on the sending side.
type transferIDs struct {
	// open counts, per TransferID, the unacked datagrams carrying its
	// fragments, plus one while fragments remain to be packed.
	open  *[256]int32 // allocated with the first transfer
	inUse int
	next  uint8
	// noZero keeps TransferID 0 unused: the reference dialect's start at
	// 1, and a reference peer is not known to take 0.
	noZero bool
}

// alloc returns a free TransferID, marked in use with fragments to pack.
func (t *transferIDs) alloc() (uint8, bool) {
	if t.inUse == 256 {
		return 0, false
	}
	if t.open == nil {
		t.open = new([256]int32)
	}
	for range 256 {
		id := t.next
		t.next++
		if id == 0 && t.noZero {
			continue
		}
		if t.open[id] == 0 {
			t.open[id] = 1
			t.inUse++
			return id, true
		}
	}
	return 0, false
}

// carried records one more unacked datagram carrying fragments of id.
func (t *transferIDs) carried(id uint8) { t.open[id]++ }

// release drops one reference to id: an acked datagram, or the end of
// packing. The TransferID is free again when none remain.
func (t *transferIDs) release(id uint8) {
	if t.open == nil || t.open[id] <= 0 {
		return
	}
	t.open[id]--
	if t.open[id] == 0 {
		t.inUse--
	}
}

// fragLoc is where a fragment's bytes sit in its transfer's arena.
type fragLoc struct {
	number   uint32
	pid      uint32 // the PacketID of the datagram it came in
	off, len int
}

// transfer is a fragmented message being reassembled.
type transfer struct {
	active  bool
	reused  bool // a transfer under this TransferID finished before
	started bool // FragmentStart seen
	count   uint32
	id      uint32 // MessageID, from the FragmentStart
	start   msgRef // where the FragmentStart was
	order   startOrder
	arena   []byte
	abuf    *[]byte // the pooled buffer behind a large arena
	// announced is the size the FragmentStart announced, an upper bound
	// for the arena's growth, never a reservation.
	announced int
	// repeatWork is what the passes dropping repeated fragments
	// (dropRepeats) cost, in fragments scanned: bounded (repeatLimit).
	repeatWork int
	frags      []fragLoc
	seq        uint64 // arrival order of the first fragment, for the budget
	sorted     bool
	whole      bool // add returned the arena itself as the message
}

// startOrder is what the session needs to apply a reassembled message as if
// it had arrived whole in the FragmentStart's place.
type startOrder struct {
	reliable bool
	inOrder  bool
	// pidOrder, in the specification's dialect (where a datagram keeps
	// its PacketID when sent again), lets PacketIDs tell a stale
	// fragment (reassembly.stale). Given with every fragment.
	pidOrder bool
	deps     []msgRef
	rel      uint32 // the FragmentStart's reliable number (the reference dialect)
	// A latest-state version's tag (latest.go).
	tag    latestTag
	tagged bool
}

// reassembly holds the transfers in progress for one connection. What it
// holds stays under budget, plus the oldest transfer, which may always grow
// to MaxMessageSize (and fragRecordCost per fragment) so that an honest
// sender's transfers complete one after another.
type reassembly struct {
	transfers  *[256]*transfer // allocated with the first fragment
	active     int
	bytes      int // payload bytes held, plus fragRecordCost per fragment
	budget     int // bytes all but the oldest transfer may hold together
	maxMessage int
	seq        uint64
	reserved   int // capacity of the pooled arenas
}

func (r *reassembly) get(tid uint8) *transfer {
	if r.transfers == nil {
		r.transfers = new([256]*transfer)
	}
	t := r.transfers[tid]
	if t == nil {
		t = new(transfer)
		r.transfers[tid] = t
	}
	if !t.active {
		*t = transfer{active: true, reused: t.reused, arena: t.arena[:0], frags: t.frags[:0], seq: r.seq, order: startOrder{deps: t.order.deps[:0]}}
		r.seq++
		r.active++
	}
	return t
}

// oldest reports whether t is the longest-running transfer, which may
// always grow so that an honest sender never deadlocks on the budget.
func (r *reassembly) oldest(t *transfer) bool {
	if r.transfers == nil {
		return true
	}
	for _, o := range r.transfers {
		if o != nil && o.active && o.seq < t.seq {
			return false
		}
	}
	return true
}

// admits reports whether a fragment of n bytes for TransferID tid fits the
// budget now. The session drops (and does not ack) a datagram it refuses, so
// the sender tries again later.
func (r *reassembly) admits(tid uint8, n int) bool {
	n += fragRecordCost
	if r.bytes+n <= r.budget {
		return true
	}
	if r.transfers == nil {
		return true
	}
	t := r.transfers[tid]
	if t == nil || !t.active {
		return r.active == 0
	}
	return r.oldest(t) && len(t.arena)+n <= r.maxMessage+maxContentLength
}

const (
	// fragRecordCost is what one fragment's bookkeeping costs, charged
	// against the budget with its payload.
	fragRecordCost = 24
	// minFragAverage bounds the fragments of one transfer to
	// MaxMessageSize/minFragAverage; real senders use hundreds of bytes.
	minFragAverage = 16
	// smallArena is the arena a transfer keeps for the next one; a
	// larger one goes back to the pool when the transfer ends.
	smallArena = 64 << 10
)

// fragPool keeps the fragment records of large transfers: a megabyte
// message has a few thousand, which a transfer would otherwise grow anew
// each time.
var fragPool sync.Pool

func getFrags() []fragLoc {
	if p, ok := fragPool.Get().(*[]fragLoc); ok {
		return (*p)[:0]
	}
	return nil
}

// grow makes room in a large transfer's arena for need bytes: a buffer
// from the payload pools at least twice the old one (so that each byte is
// copied about once more in all; a power-of-two buffer, so at most four
// times the bytes held), but never beyond what the FragmentStart
// announced unless the bytes go past it: memory follows the bytes
// received, never an announced size. In the end a transfer whose
// fragments came in order has its message whole in a pooled buffer,
// handed on without another copy (lend).
func (r *reassembly) grow(t *transfer, need int) {
	size := max(need, 2*len(t.arena), smallArena)
	if t.announced >= need {
		size = min(size, t.announced)
	}
	if t.frags == nil || cap(t.frags) <= smallArena/fragRecordCost {
		if f := getFrags(); cap(f) > cap(t.frags) {
			t.frags = append(f, t.frags...)
		}
	}
	b := getPayload(size)
	*b = append((*b)[:0], t.arena...)
	r.dropArena(t)
	t.abuf = b
	t.arena = *b
	r.reserved += cap(*b)
}

// dropArena returns a transfer's large arena to the pool.
func (r *reassembly) dropArena(t *transfer) {
	if t.abuf != nil {
		r.reserved -= cap(*t.abuf)
		putPayload(t.abuf)
	}
	t.abuf = nil
	t.arena = nil
}

// add takes one fragment, copying its payload. When the transfer is
// complete it returns the whole message in msg, never nil (a transfer of
// empty fragments is an empty message), which stays valid until the next
// call for the same TransferID. A protocol error means the peer is
// hostile or broken.
func (r *reassembly) add(m *message, at msgRef, order *startOrder) (t *transfer, msg []byte, err error) {
	t = r.get(m.transferID)
	number := m.fragNumber
	if m.fragStart {
		if t.started {
			return nil, nil, errFragRestart
		}
		if m.fragCount < 2 {
			return nil, nil, errFragCount
		}
		// The announced size, counting every fragment as large as the
		// first, must fit MaxMessageSize (DECISIONS §6). The last may
		// be shorter, hence count-1.
		if uint64(m.fragCount-1)*uint64(len(m.payload)) > uint64(r.maxMessage) {
			return nil, nil, errFragTooLarge
		}
		if m.id < MinMessageID || m.id > MaxMessageID {
			return nil, nil, errFragControl
		}
		t.started = true
		t.count = m.fragCount
		t.id = m.id
		t.start = at
		t.order.reliable = order.reliable
		t.order.inOrder = order.inOrder
		t.order.rel = order.rel
		t.order.tag, t.order.tagged = order.tag, order.tagged
		t.order.deps = append(t.order.deps[:0], order.deps...)
		number = 0
		// An upper bound for grow, not an allocation: the last
		// fragment may be shorter.
		t.announced = int(m.fragCount) * len(m.payload)
		kept := t.frags[:0]
		for _, f := range t.frags {
			if r.stale(t, f.pid, order.pidOrder) {
				r.bytes -= fragRecordCost // its bytes stay in the arena
				continue
			}
			if f.number >= t.count {
				return nil, nil, errFragNumber
			}
			kept = append(kept, f)
		}
		if len(kept) == 0 && len(t.arena) > 0 {
			r.bytes -= len(t.arena)
			t.arena = t.arena[:0]
		}
		if len(kept) < len(t.frags) {
			t.sorted = false
		}
		t.frags = kept
	} else if r.stale(t, at.pid, order.pidOrder) {
		return t, nil, nil // dropped (see stale)
	} else if t.started && number >= t.count {
		return nil, nil, errFragNumber
	}
	if len(t.arena)+len(m.payload) > r.maxMessage {
		return nil, nil, errFragTooLarge
	}
	// Fragments may be empty, so bytes alone do not bound what a transfer
	// holds: cap the count too, at an average of minFragAverage bytes.
	if len(t.frags) >= r.maxMessage/minFragAverage+2 {
		return nil, nil, errFragTooMany
	}
	if len(t.frags) > 0 && t.frags[len(t.frags)-1].number > number {
		t.sorted = false
	} else if len(t.frags) == 0 {
		t.sorted = true
	}
	t.frags = append(t.frags, fragLoc{number: number, pid: at.pid, off: len(t.arena), len: len(m.payload)})
	if need := len(t.arena) + len(m.payload); need > cap(t.arena) && (t.abuf != nil || need > smallArena) {
		r.grow(t, need)
	}
	t.arena = append(t.arena, m.payload...)
	r.bytes += len(m.payload) + fragRecordCost
	if !t.started || uint32(len(t.frags)) < t.count {
		return t, nil, nil
	}
	// Every fragment is here, unless one was repeated.
	if !t.sorted {
		slices.SortFunc(t.frags, func(a, b fragLoc) int { return int(a.number) - int(b.number) })
	}
	for i, f := range t.frags {
		if f.number != uint32(i) {
			// Each pass sorts and scans every fragment: a peer repeating
			// one of the fragments of a transfer that lacks one would
			// have it done at each repeat (9ms for a million).
			if t.repeatWork += len(t.frags); t.repeatWork > repeatLimit(t.count) || !r.dropRepeats(t) {
				return nil, nil, errFragDuplicate
			}
			if uint32(len(t.frags)) < t.count {
				return t, nil, nil // the rest is on its way
			}
			break
		}
	}
	if t.sorted {
		// Arrived in order, as they mostly do: the arena is the
		// message.
		t.whole = true
		if t.arena == nil {
			// Every fragment was empty: an empty message, not nil,
			// which would read as incomplete and leave the
			// TransferID taken for good.
			return t, []byte{}, nil
		}
		return t, t.arena, nil
	}
	msg = make([]byte, 0, len(t.arena))
	for _, f := range t.frags {
		msg = append(msg, t.arena[f.off:f.off+f.len]...)
	}
	return t, msg, nil
}

// dropRepeats removes from t's fragments, sorted by number, the copies of
// a fragment that came twice with the same bytes: a sender that repacked
// the fragments of a datagram it took for lost after a path MTU black hole
// (pmtu.go) sends them again under new PacketIDs, and the first may have
// arrived after all. It reports false if two fragments of one number
// differ: a protocol error. The copies' bytes stay in the arena, which is
// then no longer the message (sorted is cleared).
func (r *reassembly) dropRepeats(t *transfer) bool {
	kept := t.frags[:1]
	for _, f := range t.frags[1:] {
		last := kept[len(kept)-1]
		if f.number != last.number {
			kept = append(kept, f)
			continue
		}
		if !bytes.Equal(t.arena[f.off:f.off+f.len], t.arena[last.off:last.off+last.len]) {
			return false
		}
		r.bytes -= fragRecordCost
	}
	t.frags = kept
	t.sorted = false
	return true
}

// stale reports whether a fragment of t that came in the datagram with
// PacketID pid is a copy of one of the transfer that had t's TransferID
// before: sent in a datagram older than t's FragmentStart. A sender that
// repacked the fragments of a datagram retired after a path MTU black
// hole (pmtu.go) sends them again under new PacketIDs; when the retired
// datagram arrives after all, whichever copies arrive once the transfer
// is complete are taken for the start of another under the same
// TransferID, which the sender reuses once both were acked, and so
// before it sends the new FragmentStart: mixed into the new transfer,
// they would corrupt its message or end the connection. A sender sends a
// transfer's FragmentStart in a datagram before those of its other
// fragments, and a datagram keeps its PacketID when sent again
// (DECISIONS §4); so only in the specification's dialect, and only for a
// TransferID used before.
func (r *reassembly) stale(t *transfer, pid uint32, pidOrder bool) bool {
	return pidOrder && t.started && t.reused && seqDiff(t.start.pid, pid) < 0
}

// repeatLimit bounds a transfer's repeatWork: a few passes over all its
// fragments, and a few dozen for a transfer of a few thousand, more than
// the late copies of the datagrams a black hole retires (pmtu.go) cause.
func repeatLimit(count uint32) int { return 4*int(count) + 1<<16 }

// finish forgets a completed transfer, freeing its TransferID.
func (r *reassembly) finish(t *transfer) {
	t.reused = true
	r.bytes -= len(t.arena) + fragRecordCost*len(t.frags)
	t.active = false
	t.started = false
	r.active--
	if t.whole && t.abuf != nil {
		// The message returned is the arena and was not lent: it
		// stays the caller's, left to the garbage collector.
		r.reserved -= cap(*t.abuf)
		t.abuf = nil
	}
	t.whole = false
	t.announced = 0
	// Keep a modest arena for the next transfer; give large ones back.
	if cap(t.arena) > smallArena || t.abuf != nil {
		r.dropArena(t)
		if cap(t.frags) > smallArena/fragRecordCost {
			f := t.frags[:0]
			fragPool.Put(&f)
		}
		t.frags = nil
	}
}

// lend hands a completed transfer's pooled arena, which the message add
// returned aliases when its fragments came in order, to the caller, who
// puts it back with putPayload once done with the message; finish then
// forgets it without pooling it. It returns nil if the arena is not pooled
// or not the message.
func (r *reassembly) lend(t *transfer, msg []byte) *[]byte {
	b := t.abuf
	if b == nil || len(msg) == 0 || len(t.arena) == 0 || &msg[0] != &t.arena[0] {
		return nil
	}
	r.reserved -= cap(*b)
	t.abuf = nil
	*b = msg
	return b
}
