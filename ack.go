package knet

import (
	"slices"
	"time"
)

// The acks a receiver owes (spec "Reliable Datagrams", DECISIONS §4): the
// PacketIDs of reliable datagrams received and not yet acked, packed into
// the fewest PacketAcks, and those sent lately, sent again while there is
// room. A plain struct; the session calls it with the current time. The
// window of PacketIDs seen is recvwindow.go's; the PacketAck codec is
// message.go's (cppwire.go's in the reference dialect).

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
	// packetAckBits, or cppAckBits in the reference dialect.
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
