package knet

import "time"

// nextDeadline is when advance must next run.
func (s *session) nextDeadline(now time.Time) time.Time {
	if s.state == stateDone {
		return now
	}
	t := deadlines{t: now.Add(time.Hour)}
	switch s.state {
	case stateSyn, stateAdmit, stateSynAck:
		s.handshakeDeadline(&t)
	case stateClosing, stateLinger:
		s.closeDeadline(&t)
	case stateOK:
		s.openDeadlines(now, &t)
	}
	return t.t
}

// deadlines finds the earliest of several times, zero ones left out.
type deadlines struct{ t time.Time }

func (d *deadlines) at(x time.Time) {
	if !x.IsZero() && x.Before(d.t) {
		d.t = x
	}
}

// openDeadlines are the timers of an open connection: acks owed, the
// probe and loss timers, pings and silence, the close, held messages'
// reorder windows and the pacer.
func (s *session) openDeadlines(now time.Time, t *deadlines) {
	held := s.spanFull() // no new datagram until an ack comes (see spanFull)
	s.sendDeadline(now, held, t)
	s.liveDeadline(held, t)
	s.closeDeadline(t)
	s.recvDeadline(t)
	t.at(s.wire.deadline())
}

// advance runs the timers due at now.
func (s *session) advance(now time.Time) {
	switch s.state {
	case stateSyn, stateAdmit, stateSynAck:
		s.advanceHandshake(now)
	case stateClosing, stateLinger:
		s.advanceClose(now)
	case stateOK:
		s.advanceOpen(now)
	}
}

// advanceOpen runs an open connection's timers: silence, a close that
// took too long, the loss and probe timers, held messages' windows.
func (s *session) advanceOpen(now time.Time) {
	s.advanceLive(now)
	if s.state != stateOK {
		return
	}
	s.advanceClose(now)
	if s.state != stateOK {
		return
	}
	s.advanceSend(now)
	if s.state != stateOK {
		return
	}
	s.expireHeld(now)
	s.wire.advance(now)
	if !now.Before(s.send.tidyAt) {
		s.send.tidyAt = now.Add(s.cfg.keepalive())
		s.tidy(now)
	}
}

// tidy returns what the connection holds but did not use since it last
// ran, one keepalive ago: it runs with the ping timer, which wakes every
// open connection, busy or idle, at that pace. Steady traffic keeps the
// buffers it uses and allocates nothing; a burst's go once it is over;
// an idle connection keeps little beyond its own state.
func (s *session) tidy(now time.Time) {
	// Tracks resolve with time as well as with acks, and an idle
	// connection hears no acks.
	s.send.order.forget(func(t *track) bool { return s.forgettable(now, t) })
	s.send.order.trim()
	s.tidyReceipts()
	s.send.freeMsgs.trim()
	s.send.freeBufs.trim()
	s.loss.sent.shrink()
	s.recv.res.trim()
	if len(s.send.latestQueued) == 0 {
		s.send.latestQueued = nil // an emptied map keeps its buckets
	}
	s.events |= evTidy
}
