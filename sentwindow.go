package knet

import "time"

// The sender's side of reliability (spec "Reliable Datagrams", DECISIONS
// §4): the reliable datagrams in flight, by PacketID for acks and by send
// time for timeouts. A plain struct; loss.go's recovery drives it with the
// current time.

// sent is a reliable datagram in flight.
type sent struct {
	packetID uint32
	pn       uint64 // its packet number, whose low 22 bits are packetID
	b        []byte // the datagram as sent, re-sent as is
	sentAt   time.Time
	sendSeq  uint64 // the number of its last send, counting every send, new or again
	sends    int
	// lostSends counts, for a datagram of versions (latest.go), the
	// datagrams given up before it that carried one of its versions
	// (or one they replaced while queued): toward MaxMessageSendCount,
	// as sends do, since it is never sent again itself.
	lostSends int
	lost      bool // queued for retransmission
	acked     bool
	appBytes  int  // application payload bytes carried, for send buffer accounting
	hold      int  // of which the receiver may have to hold (see session.holdLimit)
	whole0    bool // its first block is a whole message: an anchor once acked
	bulk      bool // it holds only fragments past their start (pmtu.go)
	retireAt  int  // after a black hole, the send count past which it may be retired (pmtu.go)
	// Delivery rate estimation (draft-cheng-iccrg-delivery-rate-estimation),
	// as of the last send.
	delivered   int64
	deliveredAt time.Time
	firstSentAt time.Time
	appLimited  bool
	transfers   []byte // TransferIDs whose fragments it carries
	// The versions it carries, in order, if it is a datagram of reliable
	// latest-state versions (latest.go).
	latest []latestSent
	// The reliable numbers it carries, relFirst on (the reference
	// dialect).
	relFirst uint32
	relCount int
	// prev and next link the sent datagrams in order of last send.
	prev, next *sent
	// gen tells this datagram from a later one in the same recycled
	// struct. A stand-in left where a datagram resent under a new
	// PacketID was (see rekey) is acked, and passes an ack of its
	// PacketID on to alias if alias is still generation aliasGen.
	gen      uint64
	alias    *sent
	aliasGen uint64
}

// sentWindow holds the reliable datagrams in flight, in PacketID order for
// acks and in order of last send for timeouts.
type sentWindow struct {
	byID   []*sent // ring, PacketID order; acked entries linger until they reach the front
	head   int
	n      int
	oldest *sent // least recently sent unacked
	newest *sent
	count  int // unacked
	free   freeList[*sent]
	// Sends are numbered in order, new ones and resends alike: a resent
	// datagram keeps its PacketID, so only this tells which datagrams
	// went out before one that arrived. lastAckedSeq is the number of the
	// latest send acked, for loss detection.
	sends        uint64
	lastAckedSeq uint64
	anyAcked     bool
}

// sentBefore reports how many sends, after d's last one, were acked
// already: d's place behind the latest send acked, 0 if not behind it.
func (w *sentWindow) sentBefore(d *sent) uint64 {
	if d.sendSeq >= w.lastAckedSeq {
		return 0
	}
	return w.lastAckedSeq - d.sendSeq
}

func (w *sentWindow) at(k int) *sent { return w.byID[(w.head+k)&(len(w.byID)-1)] }

// push records a newly sent reliable datagram; b is kept until it is acked.
func (w *sentWindow) push(now time.Time, id uint32, b []byte) *sent {
	s, ok := w.free.get()
	if !ok {
		s = new(sent)
	}
	w.sends++
	clear(s.latest)
	*s = sent{packetID: id, b: b, sentAt: now, sendSeq: w.sends, sends: 1, transfers: s.transfers[:0], latest: s.latest[:0], gen: w.sends}
	w.append(s)
	w.count++
	w.link(s)
	return s
}

// append puts s at the newest end of the PacketID ring.
func (w *sentWindow) append(s *sent) {
	if w.n == len(w.byID) {
		r := make([]*sent, max(16, 2*len(w.byID)))
		for k := range w.n {
			r[k] = w.at(k)
		}
		w.byID = r
		w.head = 0
	}
	w.byID[(w.head+w.n)&(len(w.byID)-1)] = s
	w.n++
}

// rekey gives d, about to be resent, the new PacketID id, newer than any
// sent: the reference dialect resends in a new datagram. An acked
// stand-in keeps d's old place, so that the ring stays in PacketID order
// and a late ack of the old PacketID still reaches d (see find).
func (w *sentWindow) rekey(d *sent, id uint32) {
	k := w.index(d.packetID)
	if k < 0 || w.at(k) != d {
		return
	}
	g, ok := w.free.get()
	if !ok {
		g = new(sent)
	}
	*g = sent{packetID: d.packetID, acked: true, alias: d, aliasGen: d.gen, transfers: g.transfers[:0]}
	w.byID[(w.head+k)&(len(w.byID)-1)] = g
	d.packetID = id
	w.append(d)
}

// index returns the place in the ring of the entry with PacketID id, or
// -1.
func (w *sentWindow) index(id uint32) int {
	if k := w.search(id); k < w.n && w.at(k).packetID == id {
		return k
	}
	return -1
}

// search returns the place in the ring of the first entry whose PacketID
// is id or after it, w.n if there is none. PacketIDs are increasing but
// not contiguous (unreliable datagrams and skipped PacketIDs take some),
// so it searches: between the first entry and id, at most as many
// entries as PacketIDs.
func (w *sentWindow) search(id uint32) int {
	if w.n == 0 {
		return 0
	}
	d := int(seqDiff(w.at(0).packetID, id))
	if d <= 0 {
		return 0
	}
	lo, hi := 1, min(w.n, d+1)
	for lo < hi {
		m := (lo + hi) / 2
		if seqLess(w.at(m).packetID, id) {
			lo = m + 1
		} else {
			hi = m
		}
	}
	return lo
}

func (w *sentWindow) link(s *sent) {
	s.prev = w.newest
	s.next = nil
	if w.newest != nil {
		w.newest.next = s
	} else {
		w.oldest = s
	}
	w.newest = s
}

func (w *sentWindow) unlink(s *sent) {
	if s.prev == nil && w.oldest != s {
		return // not linked
	}
	if s.prev != nil {
		s.prev.next = s.next
	} else {
		w.oldest = s.next
	}
	if s.next != nil {
		s.next.prev = s.prev
	} else {
		w.newest = s.prev
	}
	s.prev, s.next = nil, nil
}

// resent moves s to the newest end after a retransmission.
func (w *sentWindow) resent(now time.Time, s *sent) {
	w.unlink(s)
	w.sends++
	s.sentAt = now
	s.sendSeq = w.sends
	s.sends++
	s.lost = false
	w.link(s)
}

// find returns the unacked datagram with PacketID id, or nil. through
// reports that id was its PacketID before a resend under a new one (see
// rekey): the ack is for an earlier send.
func (w *sentWindow) find(id uint32) (s *sent, through bool) {
	k := w.index(id)
	if k < 0 {
		return nil, false
	}
	return w.unacked(w.at(k))
}

// unacked returns the unacked datagram an entry of the ring stands for:
// the entry itself, or the datagram resent under a new PacketID that it
// stands in for (through; see rekey); nil if that was acked.
func (w *sentWindow) unacked(s *sent) (d *sent, through bool) {
	if !s.acked {
		return s, false
	}
	if a := s.alias; a != nil && a.gen == s.aliasGen && !a.acked {
		return a, true
	}
	return nil, false
}

// ack marks s acked and unlinks it from the send-time order. The caller
// reads what it needs from s, then calls trim.
//
// A resent datagram acked sooner after its last send than any round trip
// took was acked for an earlier send: its last send says nothing about
// what arrived (RFC 8985 skips it too), so ambiguous leaves lastAckedSeq
// alone.
func (w *sentWindow) ack(s *sent, ambiguous bool) {
	s.acked = true
	w.unlink(s)
	w.count--
	w.anyAcked = true
	if !ambiguous && s.sendSeq > w.lastAckedSeq {
		w.lastAckedSeq = s.sendSeq
	}
}

// trim drops acked datagrams from the front, every one before them acked
// too, handing each to release first.
func (w *sentWindow) trim(release func(s *sent)) {
	for w.n > 0 {
		s := w.at(0)
		if !s.acked {
			return
		}
		w.byID[w.head] = nil
		w.head = (w.head + 1) & (len(w.byID) - 1)
		w.n--
		if release != nil {
			release(s)
		}
		s.b = nil
		s.alias = nil
		w.free.put(s, 0)
	}
}

// oldestUnlost returns the unacked datagram with the oldest PacketID that
// is not already waiting to be resent, or nil.
func (w *sentWindow) oldestUnlost() *sent {
	for k := range w.n {
		if s := w.at(k); !s.acked && !s.lost {
			return s
		}
	}
	return nil
}

// firstUnacked returns the oldest-PacketID unacked datagram, or nil.
func (w *sentWindow) firstUnacked() *sent {
	if w.n == 0 {
		return nil
	}
	return w.at(0) // trim keeps an unacked datagram at the front
}

// shrink lets go of the ring once it is empty, and of the entries kept
// for reuse that were not reused (see tidy).
func (w *sentWindow) shrink() {
	if w.n == 0 {
		w.byID, w.head = nil, 0
	}
	w.free.trim()
}

// clear drops everything, releasing the buffers.
func (w *sentWindow) clear(release func(b []byte)) {
	for k := range w.n {
		s := w.at(k)
		if release != nil && s.b != nil {
			release(s.b)
		}
		s.b = nil
	}
	*w = sentWindow{}
}
