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
	askedAt     time.Time
	rate        uint16 // the FlowControlRequest owed (oweFlow) asks for this
}

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
	fill := float64(s.host.recvUsed()) / float64(s.cfg.recvBuffer)
	if dt := now.Sub(s.flow.arrivalsAt); dt >= 10*time.Millisecond {
		rate := float64(s.flow.arrivals) / dt.Seconds()
		s.flow.arrivalRate = max(rate, s.flow.arrivalRate*0.5) // quick to rise, slow to fall
		s.flow.arrivals = 0
		s.flow.arrivalsAt = now
	}
	switch {
	case fill >= 0.5:
		if s.flow.askedRate > 0 && now.Sub(s.flow.askedAt) < max(s.loss.rtt.srtt, 10*time.Millisecond) {
			return
		}
		// Half full: the arrival rate; full: the minimum.
		want := int(max(s.cfg.minRate, s.flow.arrivalRate*2*(1-min(fill, 1))))
		if s.flow.askedRate > 0 && want >= s.flow.askedRate {
			return
		}
		s.flow.askedRate = max(want, 1)
		s.flow.askedAt = now
		s.sendFlowControl(s.flow.askedRate)
	case fill < 0.25 && s.flow.askedRate > 0:
		s.flow.askedRate = 0
		s.flow.askedAt = now
		s.sendFlowControl(0xffff)
	}
}

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
