package knet

import "time"

type lostRef struct {
	s   *sent
	pid uint32
}

func (s *session) rto() time.Duration {
	return s.rtt.rto(time.Second, s.minRTO(), s.cfg.datagramTimeout)
}

// minRTO is the floor of the retransmission timeout: MaxAckDelay, as a
// peer may hold an ack that long (spec "Reliable Datagrams"; RFC 9002 adds
// it to the probe timeout too), and never under 5ms. A quarter of it, the
// floor before, was below the scheduling stalls of a loaded host: 200
// game clients on loopback had their probe timeouts fire at 8-12ms while
// the acks were on their way, 84 spurious resends in 6s against none.
func (s *session) minRTO() time.Duration {
	return max(5*time.Millisecond, s.cfg.maxAckDelay)
}

func (s *session) ackOne(now time.Time, id uint32) {
	d := s.sent.find(id)
	if d == nil {
		return
	}
	s.sent.ack(d, d.sends > 1 && now.Sub(d.sentAt) < s.rtt.min)
	if !d.lost {
		s.inflight -= len(d.b)
	} else {
		// Acked while it waited to go again: it was late, not lost.
		// Tolerate that much reordering from now on (RACK).
		s.spuriousLoss(now)
	}
	s.newlyAcked += len(d.b)
	// Delivery rate (draft-cheng-iccrg-delivery-rate-estimation): the
	// sample comes from the most recently sent datagram acked.
	s.delivered += int64(len(d.b))
	s.deliveredAt = now
	if !s.sample.ok || d.delivered >= s.sample.delivered {
		s.sample = rateSample{ok: true, delivered: d.delivered, deliveredAt: d.deliveredAt,
			firstSentAt: d.firstSentAt, sentAt: d.sentAt, appLimited: d.appLimited, once: d.sends == 1}
	}
	if d.appBytes > 0 {
		s.host.sendDone(d.appBytes)
	}
	for _, tid := range d.transfers {
		s.tids.release(tid)
	}
}

// rateSample is the newest datagram acked by one incoming datagram, for the
// RTT and delivery rate samples.
type rateSample struct {
	ok                               bool
	delivered                        int64
	deliveredAt, firstSentAt, sentAt time.Time
	appLimited, once                 bool
}

// afterAcks takes one RTT and delivery-rate sample from what an incoming
// datagram acked, drops acked datagrams, finds those the acks show lost,
// and forgets dependencies now resolved.
func (s *session) afterAcks(now time.Time) {
	if sm := s.sample; sm.ok {
		s.sample = rateSample{}
		// One RTT sample per ack, from the newest datagram it names, if
		// sent once (Karn): samples from a batch acked at once would
		// shrink RTTVAR to nothing.
		rtt := now.Sub(sm.sentAt)
		if sm.once {
			s.rtt.sample(rtt)
		}
		s.firstSentAt = sm.sentAt
		var rate float64
		if interval := max(sm.sentAt.Sub(sm.firstSentAt), now.Sub(sm.deliveredAt)); interval > 0 {
			rate = float64(s.delivered-sm.delivered) / interval.Seconds()
		}
		if s.appLimitedUntil > 0 && s.delivered > s.appLimitedUntil {
			s.appLimitedUntil = 0
		}
		s.ptoCount = 0
		s.rc.cc.OnAck(now, AckEvent{AckedBytes: s.newlyAcked, InFlight: s.inflight, DeliveryRate: rate,
			AppLimited: sm.appLimited, RTT: rtt, SRTT: s.rtt.srtt, MinRTT: s.rtt.min})
		s.newlyAcked = 0
	}
	s.sent.trim(s.trimmed)
	s.detectLoss(now)
	s.order.forget(func(t *track) bool { return s.forgettable(now, t) })
}

// trimmed takes a datagram acked along with every one before it: its
// first message, if it named nothing, is applied at the receiver, an anchor
// for in-order messages with nothing else to depend on.
func (s *session) trimmed(d *sent) {
	s.spanHold -= d.hold
	if d.whole0 {
		s.newAnchor(msgRef{d.packetID, 0})
	}
	s.putBuf(d.b)
}

// detectLoss marks as lost the datagrams sent before one acked that are
// three PacketIDs older than the newest acked, or were sent more than 9/8
// of a round trip ago (RFC 9002's thresholds; the time one by send time, as
// RACK does, RFC 8985, since a resent datagram keeps its PacketID): fast
// retransmit without waiting for the timeout. For the others it sets the
// loss timer.
func (s *session) detectLoss(now time.Time) {
	if !s.sent.anyAcked {
		return
	}
	reo := s.reorderTolerance(now)
	thresh := max(s.rtt.srtt, s.rtt.latest)*9/8 + reo
	lost := 0
	s.lossTime = time.Time{}
	for d := s.sent.oldest; d != nil && s.sent.sentBefore(d); {
		next := d.next
		if reo == 0 && d.sends == 1 && seqLess(d.packetID, s.sent.largestAcked) && seqDiff(d.packetID, s.sent.largestAcked) >= 3 ||
			now.Sub(d.sentAt) >= thresh {
			lost += len(d.b)
			s.markLost(now, d, true)
			if s.state == stateDone {
				return
			}
		} else if at := d.sentAt.Add(thresh); s.lossTime.IsZero() || at.Before(s.lossTime) {
			// Later datagrams got through: this one is lost if its ack
			// does not come within the threshold (the loss timer of RFC
			// 9002).
			s.lossTime = at
		}
		d = next
	}
	if lost > 0 {
		s.rc.cc.OnLoss(now, lost)
	}
}

// spuriousLoss widens the reordering the loss detection tolerates, after a
// datagram taken for lost turned out late: the packet threshold is dropped
// and the time threshold extended (RACK, RFC 8985), up to a round trip.
func (s *session) spuriousLoss(now time.Time) {
	s.stats.SpuriousLosses++
	reo := max(2*s.reorderTolerance(now), time.Millisecond, s.rtt.srtt/4)
	s.lossReorder = min(reo, max(s.rtt.srtt, 4*time.Millisecond))
	s.lossReorderAt = now
}

// reorderTolerance is the extra time the loss detection waits for a late
// datagram: zero until reordering was seen, halving every four seconds
// without more.
func (s *session) reorderTolerance(now time.Time) time.Duration {
	r := s.lossReorder
	for t := s.lossReorderAt.Add(4 * time.Second); r > 0 && !now.Before(t); t = t.Add(4 * time.Second) {
		r /= 2
		if r < 100*time.Microsecond {
			r = 0
		}
	}
	return r
}

func (s *session) markLost(now time.Time, d *sent, fast bool) {
	if d.sends >= s.cfg.maxSendCount {
		s.fail(ErrRetransmitLimit)
		return
	}
	d.lost = true
	s.inflight -= len(d.b)
	s.sent.unlink(d) // no timeout runs while it waits to go again
	s.lostQ = append(s.lostQ, lostRef{d, d.packetID})
	if fast {
		s.stats.FastRetransmits++
	}
}

// onReliableSent does the bookkeeping of a reliable datagram going out,
// new or resent: pacing, bytes in flight, the probe timer and delivery rate
// state.
func (s *session) onReliableSent(now time.Time, d *sent) {
	if s.inflight == 0 {
		s.firstSentAt = now
		s.deliveredAt = now
	}
	d.delivered = s.delivered
	d.deliveredAt = s.deliveredAt
	d.firstSentAt = s.firstSentAt
	d.appLimited = s.appLimitedUntil > 0
	s.inflight += len(d.b)
	s.lastReliableSend = now
	s.rc.sent(len(d.b))
}

func (s *session) popLost() {
	s.lostQ[s.lostHead] = lostRef{}
	s.lostHead++
	if s.lostHead == len(s.lostQ) {
		s.lostQ = s.lostQ[:0]
		s.lostHead = 0
	}
}
