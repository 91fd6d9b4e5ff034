package knet

import "time"

// Rate control (spec "Flow Control", DECISIONS §7).
//
// A congestion controller decides how fast reliable datagrams may go, from
// what the acks say about the path. The session paces sends to its rate,
// keeps no more than its window unacked, never goes below MinDatagramRate
// and never above what the peer asked for with FlowControlRequest.

// flowState is the rate we ask of the peer: how fast its datagrams
// arrive, and what we asked for last.
type flowState struct {
	arrivals    int // datagrams since arrivalsAt
	arrivalsAt  time.Time
	arrivalRate float64 // datagrams/s
	askedRate   int     // the limit we asked the peer for, 0 if none
	askedAt     int64   // when, in Unix nanoseconds (8 bytes, not a Time's 24)
	rate        uint16  // the FlowControlRequest owed (oweFlow) asks for this
	// unreadBefore is what the application had not read when the
	// connection's round began (beginRound), at most 2 GiB; behindSince,
	// since when that has been half ReceiveBuffer or more, in Unix
	// nanoseconds (0: it is not).
	unreadBefore int32
	behindSince  int64
}

// beginRound notes what the application has yet to read as the
// connection's round begins, before the datagrams it handles deliver
// more: only that shows the application falling behind (see
// flowControl).
func (s *session) beginRound() { s.flow.unreadBefore = int32(min(s.host.recvUsed(), 1<<31-1)) }

// flowControl asks the peer to slow down when our application falls behind
// (spec "Flow Control"): past half of ReceiveBuffer, for a rate that shrinks
// as the buffer fills, at most once a round trip; once below a quarter, it
// lifts the limit (65535). The buffer itself is the hard limit.
//
// Only what the application has yet to read counts: messages held for a
// lost predecessor wait on the network, and slowing the peer down would
// only delay the retransmission they need (admits bounds them).
func (s *session) flowControl(now time.Time) {
	if s.state != stateOK {
		return
	}
	// What this round delivered has not been offered to the application
	// yet: the hole a retransmission filled can release several large
	// messages at once (a download's 64 KiB chunks, held behind one lost
	// fragment), and counting them as unread capped the peer to half its
	// arrival rate, and again, while the application read everything
	// in time.
	fill := float64(min(s.recvUsed(), int(s.flow.unreadBefore))) / float64(s.cfg.recvBuffer)
	if dt := now.Sub(s.flow.arrivalsAt); dt >= 10*time.Millisecond {
		rate := float64(s.flow.arrivals) / dt.Seconds()
		s.flow.arrivalRate = max(rate, s.flow.arrivalRate*0.5) // quick to rise, slow to fall
		s.flow.arrivals = 0
		s.flow.arrivalsAt = now
	}
	if fill < 0.5 {
		s.flow.behindSince = 0
	} else if s.flow.behindSince == 0 {
		s.flow.behindSince = now.UnixNano()
	}
	switch {
	case fill >= 0.5:
		if time.Duration(now.UnixNano()-s.flow.behindSince) < behindFor(s.loss.rtt.srtt) {
			// Half the buffer unread for a moment is an application
			// reading large messages a little late, not one falling
			// behind: capping the peer then (to half its rate and
			// less, for a round trip at least, every datagram counted)
			// stalled a download's connection for seconds, and its
			// snapshots with it, on a loaded machine.
			return
		}
		if s.flow.askedRate > 0 && time.Duration(now.UnixNano()-s.flow.askedAt) < max(s.loss.rtt.srtt, 10*time.Millisecond) {
			return
		}
		// Half full: the arrival rate; full: the minimum.
		want := int(max(s.cfg.minRate, s.flow.arrivalRate*2*(1-min(fill, 1))))
		if s.flow.askedRate > 0 && want >= s.flow.askedRate {
			return
		}
		s.flow.askedRate = max(want, 1)
		s.flow.askedAt = now.UnixNano()
		s.sendFlowControl(s.flow.askedRate)
	case fill < 0.25 && s.flow.askedRate > 0:
		s.flow.askedRate = 0
		s.flow.askedAt = now.UnixNano()
		s.sendFlowControl(0xffff)
	}
}

// behindFor is how long the application must leave half the receive
// buffer unread before the peer is asked to slow down: a round trip, at
// least 20ms.
func behindFor(srtt time.Duration) time.Duration { return max(srtt, 20*time.Millisecond) }

// peerRateRequest applies the peer's FlowControlRequest: the most datagrams
// a second it wants to receive; 65535 lifts the limit. When the limit goes
// up, what waited for it goes at once instead of after backed-off timeouts:
// the oldest datagram unacked is resent and the probe timer starts afresh.
// That says nothing about congestion, so the controller hears nothing.
func (s *session) peerRateRequest(now time.Time, rate uint16) {
	old := s.rc.maxRate
	if rate == 0xffff {
		s.rc.maxRate = 0
	} else {
		s.rc.maxRate = max(float64(rate), s.cfg.minRate)
	}
	if old > 0 && (s.rc.maxRate == 0 || s.rc.maxRate > old) && !s.loss.retryNow(now) {
		s.fail(ErrRetransmitLimit)
	}
}

// sendFlowControl asks the peer to send at most rate datagrams a second.
// The C++ wire has no FlowControlRequest in use (see Dialect).
func (s *session) sendFlowControl(rate int) {
	if !s.wire.sendsFlowControl() {
		return
	}
	s.flow.rate = uint16(min(max(rate, 1), 0xffff))
	s.owed.owe(oweFlow)
}
