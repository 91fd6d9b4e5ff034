package knet

import (
	"slices"
	"sync"
)

// Payload buffers of queued messages come from pools by size class (64
// bytes to 16 MiB, powers of two), so that Send allocates nothing in steady
// state; the session returns them once a message is packed or dropped.
// Large messages use them too: a fresh megabyte buffer per message costs
// its zeroing, the garbage collector's work and the scavenger's madvise
// calls, more than the copy into it. Reassembly takes its arenas from the
// same pools, and the receive queue keeps them until the application has
// read the message.
const (
	minPayloadClass = 6  // 64 bytes
	maxPayloadClass = 24 // 16 MiB, the default MaxMessageSize
)

var payloadPools [maxPayloadClass - minPayloadClass + 1]sync.Pool

func payloadClass(n int) int {
	k := minPayloadClass
	for 1<<k < n {
		k++
	}
	return k
}

// getPayload returns a buffer of capacity at least n.
func getPayload(n int) *[]byte {
	k := payloadClass(n)
	if k > maxPayloadClass {
		b := make([]byte, 0, n)
		return &b
	}
	if p, ok := payloadPools[k-minPayloadClass].Get().(*[]byte); ok {
		return p
	}
	b := make([]byte, 0, 1<<k)
	return &b
}

// putPayload returns a buffer got from getPayload.
func putPayload(p *[]byte) {
	if p == nil {
		return
	}
	k := payloadClass(cap(*p))
	if k > maxPayloadClass || cap(*p) != 1<<k {
		return
	}
	*p = (*p)[:0]
	payloadPools[k-minPayloadClass].Put(p)
}

// outMsg is an application message queued for sending.
type outMsg struct {
	ref       Ref
	id        uint32
	payload   []byte
	pbuf      *[]byte // the pooled buffer behind payload
	reliable  bool
	inOrder   bool
	tracked   bool
	channel   uint8
	priority  int8
	contentID uint32
	after     []Ref
	deps      []depOn
	latest    bool // replaces what it depends on (ContentID)
	track     *track
	done      bool // fully packed
	receipted bool // its receipt is in the session's record (receipts.go)
	// keep: the session keeps it until it is known delivered, for
	// Conn.Unacknowledged (unacked.go); left: its queue let go of it.
	keep, left bool
	// A reliable latest-state version (latest.go), and its number; an
	// unreliable one has its number too (0: untagged).
	relLatest bool
	version   uint32
	// share orders messages of one priority by channel weight
	// (Config.ChannelWeights, weights.go); 0 without weights.
	share     uint64
	lostSends int // datagrams given up that carried it (see sent.lostSends)
	off       int // payload bytes packed so far

	// Fragmented transfer progress.
	frag      bool
	fragSize  int
	fragCount uint32
	fragNext  uint32 // next FragmentNumber to pack
	tid       uint8
}

// sendQueue holds queued messages by priority, then in send order.
type sendQueue struct {
	items []*outMsg
	head  int
}

func (q *sendQueue) len() int { return len(q.items) - q.head }

func (q *sendQueue) push(m *outMsg) {
	n := len(q.items)
	if n == q.head || before(q.items[n-1], m) {
		q.items = append(q.items, m)
		return
	}
	i := n
	for i > q.head && !before(q.items[i-1], m) {
		i--
	}
	q.items = slices.Insert(q.items, i, m)
}

// before reports whether queued message a stays ahead of m, pushed after
// it: a higher priority, or the same and an earlier share (weights.go;
// both 0 without weights, which keeps send order).
func before(a, m *outMsg) bool {
	return a.priority > m.priority || a.priority == m.priority && a.share <= m.share
}

// remove takes m out of the queue wherever it is.
func (q *sendQueue) remove(m *outMsg) {
	for i := q.head; i < len(q.items); i++ {
		if q.items[i] == m {
			q.items = slices.Delete(q.items, i, i+1)
			return
		}
	}
}

// compact drops packed messages from the front, and from anywhere once
// they are many.
func (q *sendQueue) compact(free func(*outMsg)) {
	for q.head < len(q.items) && q.items[q.head].done {
		free(q.items[q.head])
		q.items[q.head] = nil
		q.head++
	}
	if q.head == len(q.items) {
		q.items = q.items[:0]
		q.head = 0
		return
	}
	if q.head > 256 && q.head*2 > len(q.items) {
		n := copy(q.items, q.items[q.head:])
		clear(q.items[n:])
		q.items = q.items[:n]
		q.head = 0
	}
}

// unsentBytes is how many payload bytes of m are not yet in a datagram.
func (s *session) unsentBytes(m *outMsg) int { return len(m.payload) - m.off }

// enqueue takes an application message for sending. The payload is already
// a private copy.
func (s *session) enqueue(m *outMsg) {
	if s.state == stateDone || s.state == stateLinger || s.closing.stopAccepting {
		s.host.sendDone(len(m.payload))
		s.stats.DroppedMessages++
		s.refusedKept(m)
		s.putMsg(m)
		return
	}
	if m.contentID != 0 && !m.reliable {
		k := contentKey{m.id, m.contentID}
		if old := s.send.latestQueued[k]; old != nil && !old.packed() {
			// Latest state wins: the newer content replaces the older
			// one still queued.
			s.stats.ReplacedMessages++
			s.host.sendDone(len(old.payload))
			if !old.frag && !m.frag && !m.tracked && !s.wantsReceipt(old) {
				old.payload, m.payload = m.payload, old.payload
				old.pbuf, m.pbuf = m.pbuf, old.pbuf
				s.putMsg(m)
				return
			}
			// A fragmented transfer, sized for its payload and perhaps in
			// the other queue, or a message later ones may name by its
			// Ref: the older one goes, the newer one queues.
			s.queueFor(old).remove(old)
			if old.track != nil {
				old.track.dropped = true
			}
			if old.receipted {
				// A transfer's receipt is kept with the reliable
				// ones (queuedForReceipt): told lost there, or, its
				// track let go of, it would read as delivered.
				s.relReceiptLost(old.ref)
			}
			delete(s.send.latestQueued, k)
			s.putMsg(old)
		}
	}
	s.weighShare(m)
	latest := s.queueLatest(m)
	s.keep(m)
	s.send.order.add(m)
	if (m.reliable || m.frag) && s.wantsReceipt(m) {
		s.queuedForReceipt(m)
	}
	if latest {
		s.raise(m)
		s.queueForLatest(m).push(m)
		s.stats.MessagesSent++
		return
	}
	if m.contentID != 0 && !m.reliable {
		if s.send.latestQueued == nil {
			s.send.latestQueued = make(map[contentKey]*outMsg)
		}
		s.send.latestQueued[contentKey{m.id, m.contentID}] = m
	}
	s.raise(m)
	s.queueFor(m).push(m)
	s.stats.MessagesSent++
}

// raise lifts the messages m depends on to m's priority, so that none is
// left behind it in the queue.
func (s *session) raise(m *outMsg) {
	if m.priority == 0 {
		return
	}
	for _, d := range m.deps {
		t := d.live()
		if t == nil || t.packed {
			continue
		}
		for _, q := range [...]*sendQueue{&s.send.relQ, &s.send.unrelQ} {
			for i := q.head; i < len(q.items); i++ {
				o := q.items[i]
				if o.track == t && o.priority < m.priority {
					q.remove(o)
					o.priority = m.priority
					s.raise(o)
					q.push(o)
					break
				}
			}
		}
	}
}

// packed reports whether m's (first) block is in a datagram.
func (m *outMsg) packed() bool {
	if m.track != nil {
		return m.track.packed
	}
	return m.done || m.off > 0
}

// queueFor is the queue m waits in: fragmented transfers travel in
// reliable datagrams whatever the message's own kind (spec "Fragmented
// Transfers", 3).
func (s *session) queueFor(m *outMsg) *sendQueue {
	if m.reliable || m.frag {
		return &s.send.relQ
	}
	return &s.send.unrelQ
}

func (s *session) newMsg() *outMsg {
	if m, ok := s.send.freeMsgs.get(); ok {
		return m
	}
	return new(outMsg)
}

func (s *session) putMsg(m *outMsg) {
	if m.tracked && !m.receipted && s.cfg.receipts {
		// Replaced or dropped before it left.
		s.receipt(m.ref, false)
	}
	putPayload(m.pbuf)
	*m = outMsg{deps: m.deps[:0], after: m.after[:0]}
	s.send.freeMsgs.put(m, maxFreeMsgs)
}

func (s *session) freeQueued(m *outMsg) {
	if m.reliable && m.contentID != 0 {
		if rl := s.rlOf(); rl != nil {
			k := contentKey{m.id, m.contentID}
			if rl.queued[k] == m {
				delete(rl.queued, k) // packed: it can be replaced no more
			}
		}
	}
	if m.contentID != 0 {
		k := contentKey{m.id, m.contentID}
		if s.send.latestQueued[k] == m {
			delete(s.send.latestQueued, k)
		}
	}
	if m.keep {
		m.left = true // the record recycles it (unacked.go)
		return
	}
	s.putMsg(m)
}

// prepare sets up fragmentation for a queued message.
func (s *session) prepare(m *outMsg) {
	limit := s.cfg.wholeLimit()
	if m.reliable && m.contentID != 0 && !m.inOrder && len(m.after) == 0 && s.wire.latestTags() {
		limit -= maxLatestTag // a latest-state version goes after its tag
	}
	if len(m.payload) <= limit {
		return
	}
	m.frag = true
	if !m.reliable {
		s.stats.UnreliableAsReliable++
	}
	m.fragSize = s.send.fragSize
	m.fragCount = uint32((len(m.payload) + m.fragSize - 1) / m.fragSize)
	s.pathSize(m)
}

// freeList keeps released values for reuse, so that steady traffic
// allocates nothing. trim, run now and then, lets go of the values that
// were not needed since its last run: a burst's are returned once it is
// over, steady traffic keeps what it uses.
type freeList[T any] struct {
	items []T
	high  int  // the most items kept since the last trim
	need  int  // the most taken since then below a high point: what is kept
	asked bool // get ran since the last trim
}

// get returns a kept value, ok false if there is none.
func (f *freeList[T]) get() (v T, ok bool) {
	f.asked = true
	k := len(f.items)
	if k == 0 {
		// The value made instead will be put back: count it as kept.
		f.high++
		f.need = max(f.need, f.high)
		return v, false
	}
	v = f.items[k-1]
	var zero T
	f.items[k-1] = zero
	f.items = f.items[:k-1]
	f.need = max(f.need, f.high-(k-1))
	return v, true
}

// put keeps v, unless limit values are kept already (0: no limit).
func (f *freeList[T]) put(v T, limit int) {
	if limit == 0 || len(f.items) < limit {
		f.items = append(f.items, v)
		f.high = max(f.high, len(f.items))
	}
}

// trim keeps as many values as the gets since the last trim took at most
// in a row, dropping the others (from the bottom of the stack, those
// least recently used), and the list's own storage if no get ran.
func (f *freeList[T]) trim() {
	switch drop := len(f.items) - f.need; {
	case !f.asked:
		clear(f.items)
		f.items = nil
	case drop > 0:
		n := copy(f.items, f.items[drop:])
		clear(f.items[n:])
		f.items = f.items[:n]
	}
	f.high, f.need, f.asked = len(f.items), 0, false
}

// Free-list limits: a burst's worth is kept, not the burst.
const (
	maxFreeMsgs = 1024 // queued messages
	maxFreeBufs = 256  // reliable datagram buffers
	maxFreeHeld = 256  // held messages
)
