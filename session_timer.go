package knet

import "time"

// probeTimeout is how long after the last reliable send, with nothing
// acked, a probe goes out: the RTO, doubled for each probe since the last
// ack, at most DatagramTimeout. While closing, at most an eighth of
// DisconnectTimeout: what is left has to be acked within it, and a lost
// ack or two must not take all of it (before the first RTT sample the RTO
// is a full second, and doubles).
func (s *session) probeTimeout() time.Duration {
	t := s.rto()
	limit := min(s.cfg.datagramTimeout, max(4*t, 500*time.Millisecond))
	for i := 0; i < s.ptoCount && t < limit; i++ {
		t *= 2
	}
	t = min(t, limit)
	if s.closeAsked {
		t = min(t, max(s.cfg.disconnect/8, s.minRTO()))
	}
	return t
}

// nextTimeout is when the probe timer fires, if anything is in flight.
func (s *session) nextTimeout() (time.Time, bool) {
	if s.sent.oldest == nil {
		return time.Time{}, false
	}
	return s.lastReliableSend.Add(s.probeTimeout()), true
}

// onProbeTimeout runs when nothing was acked for a timeout: the two oldest
// datagrams in flight go again (RFC 9002's probes, resending data rather
// than declaring everything lost; two, so that one lost probe does not cost
// another timeout), and the timer backs off.
func (s *session) onProbeTimeout(now time.Time) {
	d := s.sent.oldestUnlost()
	if d == nil {
		return
	}
	s.ptoCount++
	s.lastReliableSend = now // re-arms the timer, even while the probe waits for the pacer
	s.markLost(now, d, false)
	if s.state != stateDone {
		if d := s.sent.oldestUnlost(); d != nil {
			s.markLost(now, d, false)
		}
	}
	s.rc.cc.OnTimeout(now)
}

// nextDeadline is when advance must next run.
func (s *session) nextDeadline(now time.Time) time.Time {
	t := now.Add(time.Hour)
	at := func(x time.Time) {
		if !x.IsZero() && x.Before(t) {
			t = x
		}
	}
	switch s.state {
	case stateSyn:
		at(s.synResend)
		at(s.started.Add(s.cfg.connectTimeout))
	case stateAdmit, stateSynAck:
		at(s.started.Add(s.cfg.connectTimeout))
	case stateLinger:
		at(s.lingerUntil)
	case stateClosing:
		at(s.discResend)
		at(s.closeBy)
	case stateDone:
		return now
	case stateOK:
		if s.acks.pending() > 0 {
			at(s.acks.oldest.Add(s.ackDelay()))
		}
		if x, ok := s.nextTimeout(); ok {
			at(x)
		}
		at(s.lossTime)
		at(s.nextPing)
		at(s.lastRecv.Add(s.cfg.lostTimeout))
		if s.closeAsked {
			at(s.closeBy)
		}
		if x, ok := s.res.nextDeadline(); ok {
			at(x)
		}
		if s.pacedOut {
			at(s.rc.nextSend(now, s.cfg.maxDatagram))
		}
	}
	return t
}

// advance runs the timers due at now.
func (s *session) advance(now time.Time) {
	switch s.state {
	case stateSyn:
		if !now.Before(s.started.Add(s.cfg.connectTimeout)) {
			s.fail(&TimeoutError{Op: "connect", Silent: s.cfg.connectTimeout})
		} else if !now.Before(s.synResend) {
			s.needSyn = true
			s.synBackoff = min(2*s.synBackoff, time.Second)
			s.synResend = now.Add(s.synBackoff)
		}
	case stateAdmit, stateSynAck:
		if !now.Before(s.started.Add(s.cfg.connectTimeout)) {
			s.fail(&TimeoutError{Op: "connect", Silent: s.cfg.connectTimeout})
		}
	case stateLinger:
		if !now.Before(s.lingerUntil) {
			s.state = stateDone
		}
	case stateClosing:
		if s.needDisc {
			return // goes out before the end
		}
		if !now.Before(s.closeBy) {
			// No DisconnectAck: the peer is declared lost (spec
			// "DisconnectTimeOut").
			s.fail(&TimeoutError{Op: "disconnect", Silent: s.cfg.disconnect})
		} else if !now.Before(s.discResend) {
			// Resent with backoff: a peer that does not answer is gone
			// or far, and DisconnectTimeout bounds the wait anyway.
			s.needDisc = true
			s.discBackoff = min(2*max(s.discBackoff, s.minRTO()), maxDiscBackoff)
			s.discResend = now.Add(s.discBackoff)
		}
	case stateOK:
		if silent := now.Sub(s.lastRecv); silent >= s.cfg.lostTimeout {
			s.fail(&TimeoutError{Silent: silent})
			return
		}
		if s.closeAsked && !now.Before(s.closeBy) {
			// Gave up delivering what was queued; still tell the
			// peer, so that it does not wait for a lost timeout.
			s.dropSending()
			s.state = stateClosing
			s.needDisc = true
			return
		}
		if !s.lossTime.IsZero() && !now.Before(s.lossTime) {
			s.detectLoss(now)
			if s.state == stateDone {
				return
			}
		}
		if x, ok := s.nextTimeout(); ok && !now.Before(x) {
			s.onProbeTimeout(now)
			if s.state == stateDone {
				return
			}
		}
		s.expireHeld(now)
	}
}
