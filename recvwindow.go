package knet

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
