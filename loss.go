package knet

import "time"

// Loss recovery (spec "Reliable Datagrams", DECISIONS §4): the reliable
// datagrams in flight, those found lost and waiting to go again, the
// round-trip estimate, the probe timer and the delivery-rate state the
// congestion controller is fed from. A plain struct in the manner of the
// parts it holds (sentwindow.go, rtt.go): its methods take the time and
// report what happened; the session acts on it (failing the connection,
// telling the controller).
type lossState struct {
	cfg *config

	sent     sentWindow
	rekeys   bool      // resends take new PacketIDs (the reference dialect)
	lostQ    []lostRef // found lost, to go again, in the order found
	lostHead int
	rtt      rttEstimator
	inflight int // bytes of reliable datagrams sent and neither acked nor lost
	// ackedTop is 1 + the highest packet number acked, or whose
	// PingRequest was answered (0: none), the proof a key update waits
	// for (keyupdate.go).
	ackedTop uint64

	// The probe timer: from the last reliable send, backed off per probe
	// since the last ack.
	lastSend time.Time
	ptoCount int
	// The loss timer (RFC 9002): when a datagram that later ones overtook
	// is taken for lost if its ack has not come; zero if none.
	lossTime time.Time
	// Reordering tolerated by loss detection (RACK, RFC 8985), widened by
	// each loss found spurious, halving every four seconds without.
	reorder   time.Duration
	reorderAt time.Time

	// Delivery rate estimation (draft-cheng-iccrg-delivery-rate-
	// estimation): bytes delivered so far, when, the send time of the
	// first datagram of the current flight, and until which delivered
	// count samples are app-limited.
	delivered       int64
	deliveredAt     time.Time
	firstSentAt     time.Time
	appLimitedUntil int64
	sample          rateSample // the newest datagram acked by the datagram being handled
	newlyAcked      int        // bytes it acked

	fastRetransmits, spuriousLosses uint64
}

// lostRef is a datagram waiting to go again; pid tells it from a recycled
// sent that since holds another datagram.
type lostRef struct {
	s   *sent
	pid uint32
}

// rateSample is the newest datagram acked by one incoming datagram, for the
// RTT and delivery rate samples.
type rateSample struct {
	ok                               bool
	delivered                        int64
	deliveredAt, firstSentAt, sentAt time.Time
	appLimited, once                 bool
}

// rto is the retransmission timeout (RFC 6298), within minRTO and
// DatagramTimeout; a second before the first sample.
func (l *lossState) rto() time.Duration {
	return l.rtt.rto(initialRTO, l.minRTO(), l.cfg.datagramTimeout)
}

// minRTO is the floor of the retransmission timeout: MaxAckDelay, as a
// peer may hold an ack that long (spec "Reliable Datagrams"; RFC 9002 adds
// it to the probe timeout too), and never under 5ms. A quarter of it, the
// floor before, was below the scheduling stalls of a loaded host: 200
// game clients on loopback had their probe timeouts fire at 8-12ms while
// the acks were on their way, 84 spurious resends in 6s against none.
func (l *lossState) minRTO() time.Duration {
	return max(5*time.Millisecond, l.cfg.maxAckDelay)
}

// Sending.

// sendNew records a new reliable datagram b going out, kept until acked.
func (l *lossState) sendNew(now time.Time, id uint32, b []byte) *sent {
	d := l.sent.push(now, id, b)
	l.onSend(now, d)
	return d
}

// nextResend returns the datagram found lost that goes again first, or nil.
func (l *lossState) nextResend() *sent {
	for l.lostHead < len(l.lostQ) {
		r := l.lostQ[l.lostHead]
		if d := r.s; d.packetID == r.pid && !d.acked && d.lost && d.b != nil {
			return d
		}
		l.popLost() // acked meanwhile, or long gone
	}
	return nil
}

// abandon takes d, from nextResend, out of the datagrams in flight without
// sending it again, as if acked (a datagram of latest-state versions: see
// latest.go). Its loss was counted when it was found.
func (l *lossState) abandon(d *sent) {
	l.popLost()
	d.acked, d.lost = true, false
	l.sent.count--
}

// resend records d, from nextResend, going again.
func (l *lossState) resend(now time.Time, d *sent) {
	l.popLost()
	l.sent.resent(now, d)
	l.onSend(now, d)
}

// resendAs records d, from nextResend, going again under the new
// PacketID id (the reference dialect), and returns what its old PacketID
// was.
func (l *lossState) resendAs(now time.Time, d *sent, id uint32) uint32 {
	old := d.packetID
	l.sent.rekey(d, id)
	l.resend(now, d)
	return old
}

func (l *lossState) popLost() {
	l.lostQ[l.lostHead] = lostRef{}
	l.lostHead++
	if l.lostHead == len(l.lostQ) {
		l.lostQ = l.lostQ[:0]
		l.lostHead = 0
	}
}

// onSend does the bookkeeping of a reliable datagram going out, new or
// again: bytes in flight, the probe timer and delivery rate state.
func (l *lossState) onSend(now time.Time, d *sent) {
	if l.inflight == 0 {
		l.firstSentAt = now
		l.deliveredAt = now
	}
	d.delivered = l.delivered
	d.deliveredAt = l.deliveredAt
	d.firstSentAt = l.firstSentAt
	d.appLimited = l.appLimitedUntil > 0
	l.inflight += len(d.b)
	l.lastSend = now
}

// appLimited records that the sender has less to send than it may: rate
// samples until what is in flight is delivered say more about it than
// about the path.
func (l *lossState) appLimited() {
	l.appLimitedUntil = max(l.delivered+int64(l.inflight), 1)
}

// Acks.

// ackResult is what the acks of one incoming datagram freed.
type ackResult struct {
	appBytes int    // application payload bytes acked
	tids     []byte // TransferIDs of the fragments acked
	// The reference dialect: the reliable numbers acked, and how many
	// datagrams carrying fragments.
	rels       []relRange
	fragDgrams int
	largest    int // the largest datagram acked (pmtu.go)
}

// relRange is count reliable numbers from first on.
type relRange struct {
	first uint32
	count int
}

// onPacketAck takes one PacketAck, adding to r what it frees: one search
// of the sent window for its base, then a walk over the datagrams in
// flight within its span. Whether it names a PacketID never sent is the
// session's to check first (session.ackedUnsent); here a PacketID that
// names nothing in flight (an unreliable datagram's, one acked already
// or older than every one in flight) is passed over.
func (l *lossState) onPacketAck(now time.Time, a packetAck, r *ackResult) {
	w := &l.sent
	for k := w.search(a.base); k < w.n; k++ {
		s := w.at(k)
		off := uint32(seqDiff(a.base, s.packetID))
		if off > packetAckBits {
			return
		}
		if off > 0 && a.more>>(off-1)&1 == 0 {
			continue
		}
		if d, through := w.unacked(s); d != nil {
			l.ackOne(now, d, through, r)
		}
	}
}

// ackOne takes the ack of d, in flight; through says the ack named the
// PacketID it had before a resend under a new one (see sentWindow.rekey).
func (l *lossState) ackOne(now time.Time, d *sent, through bool, r *ackResult) {
	// Acked sooner after its resend than any round trip took: the ack is
	// the first send's, and the resend was needless. Resent under a new
	// PacketID, the ack tells which send it is for.
	ambiguous := through || d.sends > 1 && now.Sub(d.sentAt) < l.rtt.min && !l.rekeys
	l.sent.ack(d, ambiguous)
	if !through {
		l.ackedTop = max(l.ackedTop, d.pn+1)
	}
	if ambiguous {
		l.spuriousLosses++
	}
	if !d.lost {
		l.inflight -= len(d.b)
	} else {
		// Acked while it waited to go again: it was late, not lost.
		// Tolerate that much reordering from now on (RACK).
		l.spuriousLoss(now)
	}
	l.newlyAcked += len(d.b)
	r.largest = max(r.largest, len(d.b)) // the path carries it (pmtu.go)
	// The delivery rate sample comes from the most recently sent datagram
	// acked.
	l.delivered += int64(len(d.b))
	l.deliveredAt = now
	if !l.sample.ok || d.delivered >= l.sample.delivered {
		l.sample = rateSample{ok: true, delivered: d.delivered, deliveredAt: d.deliveredAt,
			firstSentAt: d.firstSentAt, sentAt: d.sentAt, appLimited: d.appLimited, once: d.sends == 1}
	}
	r.appBytes += d.appBytes
	r.tids = append(r.tids, d.transfers...)
	if d.relCount > 0 {
		r.rels = append(r.rels, relRange{d.relFirst, d.relCount})
	}
	if len(d.transfers) > 0 {
		r.fragDgrams++
	}
}

// takeSample ends the acks of one incoming datagram: it takes one RTT
// sample, from the newest datagram acked if sent once (Karn; samples from
// a batch acked at once would shrink RTTVAR to nothing), restarts the probe
// timer's back-off, and returns what the congestion controller hears, ok
// false if nothing was newly acked.
func (l *lossState) takeSample(now time.Time) (ev AckEvent, ok bool) {
	sm := l.sample
	if !sm.ok {
		return AckEvent{}, false
	}
	l.sample = rateSample{}
	rtt := now.Sub(sm.sentAt)
	if sm.once {
		l.rtt.sample(rtt)
	}
	l.firstSentAt = sm.sentAt
	var rate float64
	if interval := max(sm.sentAt.Sub(sm.firstSentAt), now.Sub(sm.deliveredAt)); interval > 0 {
		rate = float64(l.delivered-sm.delivered) / interval.Seconds()
	}
	if l.appLimitedUntil > 0 && l.delivered > l.appLimitedUntil {
		l.appLimitedUntil = 0
	}
	l.ptoCount = 0
	ev = AckEvent{AckedBytes: l.newlyAcked, InFlight: l.inflight, DeliveryRate: rate,
		AppLimited: sm.appLimited, RTT: rtt, SRTT: l.rtt.srtt, MinRTT: l.rtt.min}
	l.newlyAcked = 0
	return ev, true
}

// Loss.

// detectLoss marks as lost the datagrams whose last send came before three
// sends acked since, or before one acked and more than 9/8 of a round trip
// ago (RFC 9002's thresholds, counted in sends rather than PacketIDs: a
// resent datagram keeps its PacketID, and RACK, RFC 8985, goes by send
// order too): fast retransmit, a lost resend included, without waiting for
// the timeout. For the others it sets the loss timer. It returns the bytes
// found lost, and ok false if a datagram had been sent MaxMessageSendCount
// times.
func (l *lossState) detectLoss(now time.Time) (lost int, ok bool) {
	if !l.sent.anyAcked {
		return 0, true
	}
	reo := l.reorderTolerance(now)
	thresh := max(l.rtt.srtt, l.rtt.latest)*9/8 + reo
	l.lossTime = time.Time{}
	for d := l.sent.oldest; d != nil; {
		behind := l.sent.sentBefore(d)
		if behind == 0 {
			break // in order of last send: the rest are later still
		}
		next := d.next
		if reo == 0 && behind >= 3 || now.Sub(d.sentAt) >= thresh {
			lost += len(d.b)
			if !l.markLost(d, true) {
				return lost, false
			}
		} else if at := d.sentAt.Add(thresh); l.lossTime.IsZero() || at.Before(l.lossTime) {
			// Later datagrams got through: this one is lost if its ack
			// does not come within the threshold (the loss timer of RFC
			// 9002).
			l.lossTime = at
		}
		d = next
	}
	return lost, true
}

// markLost queues d to go again; fast says later acks showed it lost. It
// reports false, leaving d, if d was sent MaxMessageSendCount times
// already: the connection is lost (spec "MaxMessageSendCount").
func (l *lossState) markLost(d *sent, fast bool) bool {
	if d.sends+d.lostSends >= l.cfg.maxSendCount {
		return false
	}
	l.queueLost(d)
	if fast {
		l.fastRetransmits++
	}
	return true
}

// queueLost takes d out of flight, to wait in the lost queue for its turn.
func (l *lossState) queueLost(d *sent) {
	d.lost = true
	l.inflight -= len(d.b)
	l.sent.unlink(d) // no timeout runs while it waits to go again
	l.lostQ = append(l.lostQ, lostRef{d, d.packetID})
}

// spuriousLoss widens the reordering the loss detection tolerates, after a
// datagram taken for lost turned out late: the packet threshold is dropped
// and the time threshold extended (RACK, RFC 8985), up to a round trip.
func (l *lossState) spuriousLoss(now time.Time) {
	l.spuriousLosses++
	reo := max(2*l.reorderTolerance(now), time.Millisecond, l.rtt.srtt/4)
	l.reorder = min(reo, max(l.rtt.srtt, 4*time.Millisecond))
	l.reorderAt = now
}

// reorderTolerance is the extra time the loss detection waits for a late
// datagram: zero until reordering was seen, halving every four seconds
// without more.
func (l *lossState) reorderTolerance(now time.Time) time.Duration {
	r := l.reorder
	for t := l.reorderAt.Add(4 * time.Second); r > 0 && !now.Before(t); t = t.Add(4 * time.Second) {
		r /= 2
		if r < 100*time.Microsecond {
			r = 0
		}
	}
	return r
}

// The probe timer.

// maxProbeBackoff is the least the probe timeout may back off to: four
// RTOs or this, whichever is longer, within DatagramTimeout.
const maxProbeBackoff = 500 * time.Millisecond

// probeTimeout is how long after the last reliable send, with nothing
// acked, a probe goes out: the RTO, doubled for each probe since the last
// ack, up to four RTOs or maxProbeBackoff, at most DatagramTimeout. While
// closing, at most an eighth of DisconnectTimeout: what is left has to be
// acked within it, and a lost ack or two must not take all of it (before
// the first RTT sample the RTO is a full second, and doubles).
func (l *lossState) probeTimeout(closing bool) time.Duration {
	t := l.rto()
	limit := min(l.cfg.datagramTimeout, max(4*t, maxProbeBackoff))
	for i := 0; i < l.ptoCount && t < limit; i++ {
		t *= 2
	}
	t = min(t, limit)
	if closing {
		t = min(t, max(l.cfg.disconnect/8, l.minRTO()))
	}
	return t
}

// nextTimeout is when the probe timer fires, if anything is in flight.
func (l *lossState) nextTimeout(closing bool) (time.Time, bool) {
	if l.sent.oldest == nil {
		return time.Time{}, false
	}
	return l.lastSend.Add(l.probeTimeout(closing)), true
}

// onProbeTimeout runs when nothing was acked for a timeout: the two oldest
// datagrams in flight go again (RFC 9002's probes, resending data rather
// than declaring everything lost; two, so that one lost probe does not cost
// another timeout), and the timer backs off. It reports whether there was
// anything to probe, and ok false if the connection is lost (see markLost).
//
// A datagram that obsolete says carries nothing that would go again (one of
// latest-state versions, every one replaced since: see latest.go) is no
// probe: it joins the lost queue, to be given up in its turn
// (abandonLatest), and the probe takes the next. A probe that sends nothing earns no ack: with one such
// datagram in flight for each version sent during a blackout, oldest first,
// two a timeout, backed off to maxProbeBackoff, the newest of 300 versions
// went again 150 probes, over a minute, after the path was back (issue 32).
func (l *lossState) onProbeTimeout(now time.Time, obsolete func(*sent) bool) (probed, ok bool) {
	n := 0
	for k := 0; k < l.sent.n && n < 2; k++ {
		d := l.sent.at(k)
		if d.acked || d.lost {
			continue
		}
		if obsolete != nil && obsolete(d) {
			l.queueLost(d) // not sent again: no send to count
			continue
		}
		if n == 0 {
			l.ptoCount++
			l.lastSend = now // re-arms the timer, even while the probe waits for the pacer
		}
		n++
		if !l.markLost(d, false) {
			return true, false
		}
	}
	return n > 0, true
}

// retryNow sends the oldest datagram in flight again at once and restarts
// the probe timer, when what held it back was not the path (the peer raised
// its rate limit): no congestion signal.
func (l *lossState) retryNow(now time.Time) bool {
	if l.ptoCount == 0 {
		return true
	}
	l.ptoCount = 0
	if d := l.sent.oldestUnlost(); d != nil {
		l.lastSend = now
		return l.markLost(d, false)
	}
	return true
}

// resendAll sends every datagram in flight again at once and restarts the
// probe timer, when the path they took is gone (the peer moved: see
// Conn.moveTo); no congestion signal. It reports false if one of them
// reached its send limit.
func (l *lossState) resendAll(now time.Time) bool {
	l.ptoCount = 0
	l.lastSend = now
	for d := l.sent.oldestUnlost(); d != nil; d = l.sent.oldestUnlost() {
		if !l.markLost(d, false) {
			return false
		}
	}
	return true
}

// drop forgets everything in flight and returns the application payload
// bytes it held.
func (l *lossState) drop() (released int) {
	for k := range l.sent.n {
		if d := l.sent.at(k); !d.acked {
			released += d.appBytes
		}
	}
	l.sent.clear(nil)
	l.lostQ, l.lostHead = nil, 0
	l.inflight = 0
	return released
}
