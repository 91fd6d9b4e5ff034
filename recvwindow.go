package knet

import (
	"math/bits"
	"slices"
)

// The receiver's side of reliability (spec "Reliable Datagrams", DECISIONS
// §4): which PacketIDs have arrived, so that duplicates are known. A plain
// struct; the acks owed for them are in ack.go.

// recvSpan is how far back the receiver remembers PacketIDs. The sender keeps
// newest-sent minus oldest-unacked below it (DECISIONS §4), so any PacketID
// older than the newest seen by recvSpan or more is a duplicate.
const recvSpan = 1 << 15

const recvWindowMaxWords = recvSpan / 64

// recvWindow remembers which PacketIDs have arrived. Bit i of ring word
// (head+k) covers PacketID (baseWord+k)*64 + i. It starts small and grows to
// recvSpan bits only while there are holes that far back, but for a few
// holes, which it keeps in a list instead (old): a sender that skips a
// PacketID now and then (skip.go) leaves a hole that is never filled,
// and so does an unreliable datagram lost.
type recvWindow struct {
	started  bool
	newest   uint32 // newest PacketID seen
	baseWord uint32 // PacketID>>6 of the word at head, mod 2^16
	head     int32
	n        int32 // words in use
	ring     []uint64
	old      *oldHoles // made with the first hole the ring lets go of
}

// oldHoles are the PacketIDs before the ring's first word that have not
// arrived, oldest first: at most maxOldHoles, within recvSpan of the
// newest.
type oldHoles struct{ ids []uint32 }

const (
	maxOldHoles = 64
	// keepWords is how many words the ring keeps before it lets go of
	// one with holes: the holes of recent losses and reordering stay in
	// the ring, where they are cheap.
	keepWords = 3
)

// wordDelta is the signed distance in words from the base word to id's word.
func (w *recvWindow) wordDelta(id uint32) int32 {
	d := int32((id>>6 - w.baseWord) & 0xffff)
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
		_, hole := w.oldHole(id)
		return !hole
	}
	if d >= w.n {
		return false
	}
	return w.ring[w.slot(d)]&(1<<(id&63)) != 0
}

func (w *recvWindow) slot(d int32) int { return int(w.head+d) & (len(w.ring) - 1) }

// oldHole reports whether id is one of the old holes, and its place in the
// list (where it would go if not).
func (w *recvWindow) oldHole(id uint32) (i int, ok bool) {
	if w.old == nil {
		return 0, false
	}
	ids := w.old.ids
	lo, hi := 0, len(ids)
	for lo < hi {
		m := (lo + hi) / 2
		if seqLess(ids[m], id) {
			lo = m + 1
		} else {
			hi = m
		}
	}
	return lo, lo < len(ids) && ids[lo] == id
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
		w.forgetOld()
	}
	d := w.wordDelta(id)
	if d < 0 {
		// Before the ring: an old hole filled, if it is one.
		if i, ok := w.oldHole(id); ok {
			w.old.ids = slices.Delete(w.old.ids, i, i+1)
		}
		return
	}
	for d >= w.n {
		if w.n == recvWindowMaxWords+1 {
			// Forget the oldest word: the sender promised nothing
			// that old is still unacked.
			w.popFront()
			d--
			continue
		}
		if int(w.n) == len(w.ring) {
			w.grow()
		}
		w.ring[w.slot(w.n)] = 0
		w.n++
	}
	w.ring[w.slot(d)] |= 1 << (id & 63)
	for w.n > 1 && (w.ring[w.head] == ^uint64(0) || w.n > keepWords && w.keepHoles()) {
		w.popFront()
	}
}

// popFront lets go of the ring's first word.
func (w *recvWindow) popFront() {
	w.ring[w.head] = 0
	w.head = int32(w.slot(1))
	w.baseWord++
	w.n--
}

// keepHoles adds the holes of the ring's first word to the old holes, if
// they fit, and reports whether they did.
func (w *recvWindow) keepHoles() bool {
	missing := ^w.ring[w.head]
	k := bits.OnesCount64(missing)
	if w.old == nil {
		w.old = new(oldHoles)
	}
	if len(w.old.ids)+k > maxOldHoles {
		return false
	}
	first := w.baseWord << 6 // the PacketID of its bit 0
	for m := missing; m != 0; m &= m - 1 {
		w.old.ids = append(w.old.ids, (first+uint32(bits.TrailingZeros64(m)))&packetIDMask)
	}
	return true
}

// forgetOld drops the old holes recvSpan or more before the newest
// PacketID: too old to tell, they count as arrived (contains).
func (w *recvWindow) forgetOld() {
	if w.old == nil {
		return
	}
	k := 0
	for k < len(w.old.ids) && seqDiff(w.old.ids[k], w.newest) >= recvSpan {
		k++
	}
	if k > 0 {
		w.old.ids = slices.Delete(w.old.ids, 0, k)
	}
}

func (w *recvWindow) grow() {
	r := make([]uint64, 2*len(w.ring))
	for k := range w.n {
		r[k] = w.ring[w.slot(k)]
	}
	w.ring = r
	w.head = 0
}
