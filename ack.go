package knet

import (
	"slices"
	"time"
)

// This file holds the parts of reliability (spec "Reliable Datagrams",
// DECISIONS §4): the receiver's window of PacketIDs seen, the acks it owes,
// and the sender's table of reliable datagrams in flight. Plain structs; the
// session calls them with the current time.

// recvSpan is how far back the receiver remembers PacketIDs. The sender keeps
// newest-sent minus oldest-unacked below it (DECISIONS §4), so any PacketID
// older than the newest seen by recvSpan or more is a duplicate.
const recvSpan = 1 << 15

const recvWindowMaxWords = recvSpan / 64

// recvWindow remembers which PacketIDs have arrived. Bit i of ring word
// (head+k) covers PacketID (baseWord+k)*64 + i. It starts small and grows to
// recvSpan bits only while there are holes that far back.
type recvWindow struct {
	started  bool
	newest   uint32 // newest PacketID seen
	baseWord uint32 // PacketID>>6 of the word at head, mod 2^16
	head     int
	n        int // words in use
	ring     []uint64
}

// wordDelta is the signed distance in words from the base word to id's word.
func (w *recvWindow) wordDelta(id uint32) int {
	d := int((id>>6 - w.baseWord) & 0xffff)
	if d >= 1<<15 {
		d -= 1 << 16
	}
	return d
}

// plausible reports whether id is within recvSpan of the newest PacketID
// seen, on either side. A datagram farther ahead would slide the window over
// PacketIDs still in flight, so it is refused instead.
func (w *recvWindow) plausible(id uint32) bool {
	if !w.started {
		return true
	}
	d := seqDiff(w.newest, id)
	return d < recvSpan && d > -recvSpan
}

// contains reports whether id has arrived before (or is too old to tell, which
// the sender's span limit makes the same thing).
func (w *recvWindow) contains(id uint32) bool {
	if !w.started {
		return false
	}
	if seqDiff(w.newest, id) <= -recvSpan {
		return true
	}
	d := w.wordDelta(id)
	if d < 0 {
		return true
	}
	if d >= w.n {
		return false
	}
	return w.ring[(w.head+d)&(len(w.ring)-1)]&(1<<(id&63)) != 0
}

// startAt starts the window before id, nothing received: the peer's
// PacketIDs start at id, and any of the next ones may arrive first. A
// secure session's windows start at 0 this way: the handshake's clear
// datagrams, whose PacketIDs nothing authenticates, are no part of them,
// and the first sealed datagram to arrive must not make those before it
// count as seen (add's rule for a first datagram).
func (w *recvWindow) startAt(id uint32) {
	*w = recvWindow{started: true, ring: make([]uint64, 4), baseWord: id >> 6, n: 1, newest: (id - 1) & packetIDMask}
}

// add records id as arrived. Call it only for plausible ids.
func (w *recvWindow) add(id uint32) {
	if !w.started {
		w.started = true
		w.ring = make([]uint64, 4)
		w.baseWord = id >> 6
		w.n = 1
		w.newest = id
		// PacketIDs below the first one seen in its word count as seen:
		// nothing the peer sent before its first datagram to us can
		// still need delivering.
		w.ring[0] = 1<<(id&63) - 1
	}
	if seqLess(w.newest, id) {
		w.newest = id
	}
	d := w.wordDelta(id)
	if d < 0 {
		return
	}
	mask := len(w.ring) - 1
	for d >= w.n {
		if w.n == recvWindowMaxWords+1 {
			// Forget the oldest word: the sender promised nothing
			// that old is still unacked.
			w.ring[w.head] = 0
			w.head = (w.head + 1) & mask
			w.baseWord++
			w.n--
			d--
			continue
		}
		if w.n == len(w.ring) {
			w.grow()
			mask = len(w.ring) - 1
		}
		w.ring[(w.head+w.n)&mask] = 0
		w.n++
	}
	w.ring[(w.head+d)&mask] |= 1 << (id & 63)
	for w.n > 1 && w.ring[w.head] == ^uint64(0) {
		w.ring[w.head] = 0
		w.head = (w.head + 1) & mask
		w.baseWord++
		w.n--
	}
}

func (w *recvWindow) grow() {
	r := make([]uint64, 2*len(w.ring))
	for k := range w.n {
		r[k] = w.ring[(w.head+k)&(len(w.ring)-1)]
	}
	w.ring = r
	w.head = 0
}

// ackQueue holds the PacketIDs of reliable datagrams received and not yet
// acked, and when the oldest of them arrived. It also remembers the
// PacketAcks sent lately, to send them again while there is room: a lost
// ack would otherwise make the peer resend what arrived.
type ackQueue struct {
	ids    []uint32
	oldest time.Time
	recent []sentAck // ring, up to maxRecentAcks
	next   int
	// scratch holds the PacketIDs merge works on.
	scratch []uint32
	// bits is how many PacketIDs after its base one PacketAck names:
	// packetAckBits, or refAckBits in the reference dialect.
	bits uint32
}

// span is how many PacketIDs after its base one PacketAck names.
func (q *ackQueue) span() uint32 {
	if q.bits == 0 {
		return packetAckBits
	}
	return q.bits
}

// maxRecentAcks bounds the PacketAcks remembered for sending again.
const maxRecentAcks = 256

type sentAck struct {
	a  packetAck
	at time.Time
}

// remember records PacketAcks just sent. Only those sent in the last keep
// are wanted again, so the ring grows only while its oldest entry is
// younger than that: its size follows the acks sent in keep, up to
// maxRecentAcks, instead of filling up on any long-lived connection.
func (q *ackQueue) remember(now time.Time, acks []packetAck, keep time.Duration) {
	for _, a := range acks {
		n := len(q.recent)
		i := 0
		if n > 0 {
			i = q.next % n // the oldest
		}
		if n == maxRecentAcks || n > 0 && now.Sub(q.recent[i].at) > keep {
			q.recent[i] = sentAck{a, now}
			q.next++
			continue
		}
		// Grow: put the ring in order, oldest first, and add at the end.
		slices.Reverse(q.recent[:i])
		slices.Reverse(q.recent[i:])
		slices.Reverse(q.recent)
		q.recent = append(q.recent, sentAck{a, now})
		q.next = len(q.recent)
	}
}

// repeats appends, newest first, up to room PacketAcks sent since
// notBefore.
func (q *ackQueue) repeats(dst []packetAck, notBefore time.Time, room int) []packetAck {
	n := len(q.recent)
	for k := 1; k <= n && room > 0; k++ {
		r := q.recent[(q.next-k)%n]
		if r.at.Before(notBefore) {
			break
		}
		dst = append(dst, r.a)
		room--
	}
	return dst
}

func (q *ackQueue) add(now time.Time, id uint32) {
	if len(q.ids) == 0 {
		q.oldest = now
	}
	q.ids = append(q.ids, id)
}

func (q *ackQueue) pending() int { return len(q.ids) }

// take removes and returns PacketAcks covering every queued PacketID, at
// most max of them, the oldest PacketIDs first. What does not fit stays
// queued.
func (q *ackQueue) take(dst []packetAck, max int) []packetAck {
	if len(q.ids) == 0 || max <= 0 {
		return dst
	}
	sortSerial(q.ids)
	dst, i := packAcks(dst, q.ids, max, q.span())
	n := copy(q.ids, q.ids[i:])
	q.ids = q.ids[:n]
	return dst
}

// merge rewrites acks (fresh ones, then repeats of those sent lately) as
// the fewest PacketAcks covering the same PacketIDs, oldest first. Repeats
// mostly name PacketIDs close to the fresh ones, which one PacketAck
// covers 35 of: sent one block each, they made a ping-pong's datagrams
// twice the size of their payload.
func (q *ackQueue) merge(acks []packetAck) []packetAck {
	if len(acks) < 2 {
		return acks
	}
	ids := q.scratch[:0]
	for _, a := range acks {
		ids = append(ids, a.base)
		for m, d := a.more, uint32(1); m != 0; m, d = m>>1, d+1 {
			if m&1 != 0 {
				ids = append(ids, (a.base+d)&packetIDMask)
			}
		}
	}
	sortSerial(ids)
	// Never more blocks than given: covering sorted PacketIDs greedily
	// takes the fewest windows of 35.
	acks, _ = packAcks(acks[:0], ids, len(acks), q.span())
	q.scratch = ids[:0]
	return acks
}

// sortSerial sorts PacketIDs, all within recvSpan of each other, by serial
// distance from the oldest. They are usually in order already.
func sortSerial(ids []uint32) {
	if len(ids) == 0 {
		return
	}
	first := ids[0]
	for _, id := range ids {
		if seqLess(id, first) {
			first = id
		}
	}
	slices.SortFunc(ids, func(a, b uint32) int {
		return int(seqDiff(first, a)) - int(seqDiff(first, b))
	})
}

// packAcks appends up to max PacketAcks, each naming bits PacketIDs after
// its base, covering ids, sorted by sortSerial, from the oldest, and
// returns how many of ids they cover.
func packAcks(dst []packetAck, ids []uint32, max int, bits uint32) ([]packetAck, int) {
	i := 0
	for i < len(ids) && max > 0 {
		a := packetAck{base: ids[i]}
		i++
		for i < len(ids) {
			d := seqDiff(a.base, ids[i])
			if d == 0 { // the same PacketID twice: a duplicate re-acked
				i++
				continue
			}
			if uint32(d) > bits {
				break
			}
			a.more |= 1 << (d - 1)
			i++
		}
		dst = append(dst, a)
		max--
	}
	return dst, i
}

// sent is a reliable datagram in flight.
type sent struct {
	packetID uint32
	pn       uint64 // its packet number, whose low 22 bits are packetID
	b        []byte // the datagram as sent, re-sent as is
	sentAt   time.Time
	sendSeq  uint64 // the number of its last send, counting every send, new or again
	sends    int
	lost     bool // queued for retransmission
	acked    bool
	appBytes int  // application payload bytes carried, for send buffer accounting
	hold     int  // of which the receiver may have to hold (see session.holdLimit)
	whole0   bool // its first block is a whole message: an anchor once acked
	// Delivery rate estimation (draft-cheng-iccrg-delivery-rate-estimation),
	// as of the last send.
	delivered   int64
	deliveredAt time.Time
	firstSentAt time.Time
	appLimited  bool
	transfers   []byte // TransferIDs whose fragments it carries
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
	*s = sent{packetID: id, b: b, sentAt: now, sendSeq: w.sends, sends: 1, transfers: s.transfers[:0], gen: w.sends}
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
// and a late ack of the old PacketID still reaches d (see findAcked).
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
	if w.n == 0 {
		return -1
	}
	first := w.at(0).packetID
	d := int(seqDiff(first, id))
	if d < 0 {
		return -1
	}
	// PacketIDs are increasing but not contiguous (unreliable datagrams
	// take some), so search.
	lo, hi := 0, min(w.n, d+1)
	for lo < hi {
		m := (lo + hi) / 2
		if seqLess(w.at(m).packetID, id) {
			lo = m + 1
		} else {
			hi = m
		}
	}
	if lo < w.n && w.at(lo).packetID == id {
		return lo
	}
	return -1
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
	s = w.at(k)
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

// rttEstimator follows RFC 6298: SRTT, RTTVAR and the retransmission
// timeout derived from them.
type rttEstimator struct {
	srtt, rttvar, min, latest time.Duration
	samples                   int
}

func (r *rttEstimator) sample(d time.Duration) {
	if d <= 0 {
		d = time.Microsecond
	}
	r.latest = d
	if r.samples == 0 || d < r.min {
		r.min = d
	}
	if r.samples == 0 {
		r.srtt = d
		r.rttvar = d / 2
	} else {
		diff := r.srtt - d
		if diff < 0 {
			diff = -diff
		}
		r.rttvar = (3*r.rttvar + diff) / 4
		r.srtt = (7*r.srtt + d) / 8
	}
	r.samples++
}

// rto is SRTT + max(G, 4*RTTVAR) clamped to [floor, ceiling]; before any
// sample it is initial.
func (r *rttEstimator) rto(initial, floor, ceiling time.Duration) time.Duration {
	if r.samples == 0 {
		return initial
	}
	v := max(4*r.rttvar, time.Millisecond)
	return min(max(r.srtt+v, floor), ceiling)
}
