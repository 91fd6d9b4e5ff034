package knet

import "time"

// onProbeTimeout runs when nothing was acked for a probe timeout (see
// lossState.onProbeTimeout).
func (s *session) onProbeTimeout(now time.Time) {
	probed, ok := s.loss.onProbeTimeout(now)
	if !ok {
		s.fail(ErrRetransmitLimit)
		return
	}
	if probed {
		s.rc.cc.OnTimeout(now)
	}
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
		if x, ok := s.loss.nextTimeout(s.closeAsked); ok {
			at(x)
		}
		at(s.loss.lossTime)
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
			s.synBackoff = min(2*s.synBackoff, maxSynBackoff)
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
			s.discBackoff = min(2*max(s.discBackoff, s.loss.minRTO()), maxDiscBackoff)
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
		if !s.loss.lossTime.IsZero() && !now.Before(s.loss.lossTime) {
			s.detectLoss(now)
			if s.state == stateDone {
				return
			}
		}
		if x, ok := s.loss.nextTimeout(s.closeAsked); ok && !now.Before(x) {
			s.onProbeTimeout(now)
			if s.state == stateDone {
				return
			}
		}
		s.expireHeld(now)
	}
}
