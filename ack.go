package knet

import (
	"slices"
	"time"
)

// The acks a receiver owes (spec "Reliable Datagrams", DECISIONS §4): the
// PacketIDs of reliable datagrams received and not yet acked, packed into
// the fewest PacketAcks, and those sent lately, sent again a few times
// while the peer may not have them. A plain struct; the session calls it
// with the current time. The window of PacketIDs seen is recvwindow.go's;
// the PacketAck codec is message.go's (cppwire.go's in the reference
// dialect).
//
// What acks may cost (issue 38): a peer that sends us little must not get
// much more back. Fresh acks always go: each owes its PacketID to a
// datagram of the peer's, and one PacketAck in a datagram of its own is
// 41 bytes on the wire against the 31 at least the peer spent. Repeats go
// only while the peer may not have them (sent in the last half round trip,
// not confirmed), and only out of the ack credit (below), earned by what
// the peer sends: twice its bytes on the wire, whatever the round trip.
//
// Why the credit and not a count of repeats: a count that bounds a
// gap-opening peer (four repeats of each PacketAck, 32 in a datagram) let
// bursts of loss take every copy of an honest receiver's acks. Ack
// datagrams go every millisecond or two in a download, so four repeats
// were over within one 3-8ms burst, and the sender resent what had
// arrived: 28-369 needless resends in a 20,000-datagram download where
// repeats over the whole half round trip had 0-20
// (TestAckRepeatsOutlastBursts). A download earns far more credit than
// its acks spend, so the credit never limits an honest one.

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
	// credit is what we may still spend on acks, in bytes on the wire
	// (the ack credit, below), at most ackCreditCap, at least minus that.
	credit int32
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

// sentAck is a PacketAck sent lately: when, and the reliable datagram of ours that carried it, if one did (by, of
// generation gen: a sent is recycled).
type sentAck struct {
	a   packetAck
	at  time.Time
	by  *sent
	gen uint64
}

// confirmed reports whether the peer has the PacketAck: a reliable
// datagram of ours that carried it was acked. That is sound because a
// datagram is acked only once it arrived, and its PacketAcks with it (the
// spec's receiver takes the acks of every datagram it parses; a resend
// carries the same bytes, in the reference dialect too, which changes
// only its PacketID). carried names only ordinary reliable datagrams,
// which leave the sent window only acked (trim): datagrams of
// latest-state versions, which may be given up (abandon), and bulk ones,
// which may be retired (pmtu.go), carry acks that are never confirmed, so
// a recycled sent (its generation changed) was acked too. (An unreliable
// datagram's acks have nothing to confirm them: nothing acks it.)
//
// The confirmation comes a round trip after the PacketAck went at the
// soonest, when the half round trip of repeats is over if the smoothed
// RTT is the path's; it ends the repeats when the estimate is above the
// path's (a queue that drained, a peer that held its acks).
func (a *sentAck) confirmed() bool {
	return a.by != nil && (a.by.gen != a.gen || a.by.acked)
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
			q.recent[i] = sentAck{a: a, at: now}
			q.next++
			continue
		}
		// Grow: put the ring in order, oldest first, and add at the end.
		slices.Reverse(q.recent[:i])
		slices.Reverse(q.recent[i:])
		slices.Reverse(q.recent)
		q.recent = append(q.recent, sentAck{a: a, at: now})
		q.next = len(q.recent)
	}
}

// carried records that d, an ordinary reliable datagram just built, carries
// the last k PacketAcks remembered: once d is acked they are confirmed,
// and go again no more.
func (q *ackQueue) carried(d *sent, k int) {
	n := len(q.recent)
	for i := 1; i <= k && i <= n; i++ {
		r := &q.recent[(q.next-i)%n]
		r.by, r.gen = d, d.gen
	}
}

// repeats appends, newest first, up to room PacketAcks sent since
// notBefore that the peer has not confirmed.
func (q *ackQueue) repeats(dst []packetAck, notBefore time.Time, room int) []packetAck {
	n := len(q.recent)
	for k := 1; k <= n && room > 0; k++ {
		r := &q.recent[(q.next-k)%n]
		if r.at.Before(notBefore) {
			break
		}
		if r.confirmed() {
			continue
		}
		dst = append(dst, r.a)
		room--
	}
	return dst
}

// The ack credit: what a peer sends us pays for the acks we send it back,
// in bytes on the wire (IPv4 and UDP headers counted,
// ackWireOverhead, which makes small datagrams count for what they cost;
// IPv6's larger headers only lower the ratio). Each datagram the peer
// sends earns ackCreditRatio times its size, up to ackCreditCap banked;
// each datagram of ours carrying acks and no application data spends its
// size, one carrying data what its PacketAcks add. Repeats go only out of
// credit left once the datagram is paid for; fresh acks always go (they
// cost less than the datagrams that owed them), so the peer always learns
// what arrived.
const (
	ackWireOverhead = 28
	ackCreditRatio  = 2
)

// ackCreditCap is what credit may be banked: what one datagram of the
// largest size earns, two of ours, so that what came long ago does not
// pay for a burst now. It bounds the debt too.
func ackCreditCap(maxDatagram int) int {
	return ackCreditRatio * (maxDatagram + ackWireOverhead)
}

// earn credits a datagram of n bytes from the peer.
func (q *ackQueue) earn(n, maxDatagram int) {
	q.credit = int32(min(int(q.credit)+ackCreditRatio*(n+ackWireOverhead), ackCreditCap(maxDatagram)))
}

// spend debits n bytes (a datagram's wire overhead included if it is
// counted whole).
func (q *ackQueue) spend(n, maxDatagram int) {
	q.credit = int32(max(int(q.credit)-n, -ackCreditCap(maxDatagram)))
}

// affords reports how many repeated PacketAcks of block bytes each the
// credit pays for, on top of a datagram of used bytes so far (its wire
// overhead not counted).
func (q *ackQueue) affords(used, block int) int {
	left := int(q.credit) - used - ackWireOverhead
	if left < block {
		return 0
	}
	return left / block
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
