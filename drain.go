package knet

import "context"

// Draining: a server leaving a fleet (an Agones Shutdown, a rolling
// update, a scale-down) stops admitting new connections, tells its
// players why, and waits for them to leave before the process ends.

// StopAdmitting closes the listener for new connections, as
// SetListenOpen(false) does, and has each refused attempt told reason: a
// knet client's Dial then fails with a *RefusedError holding it (not with
// Config.Stealth, nor in the reference dialect, which carries no
// reason), so that its matchmaker can send it elsewhere. Connections
// already made are served as before: the gentle first step of a drain,
// letting a match finish. SetListenOpen(true) reopens the listener and
// forgets the reason.
func (l *Listener) StopAdmitting(reason string) {
	why := reasonBytes(reason)
	l.refuseReason.Store(&why)
	l.open.Store(false)
}

// refusal is the reason refused attempts are told, if any.
func (l *Listener) refusal() []byte {
	if p := l.refuseReason.Load(); p != nil {
		return *p
	}
	return nil
}

// Drain empties the listener before it closes. It stops admitting new
// connections for good (StopAdmitting(reason); SetListenOpen cannot
// reopen the listener), closes every connection, established or still
// being made, as CloseWithReason(reason) does, and waits until each has
// ended (but for streams not yet established, which are refused and not
// waited for), or until ctx is done, when it returns ctx's error and leaves the
// connections still closing to Close.
//
// Each connection closes gracefully: what it sent before the drain is
// delivered and acked, then the Disconnect tells the peer reason, which a
// knet peer sees as a *DisconnectError, all within DisconnectTimeout. A
// player that does not answer ends after DisconnectTimeout, so a ctx that
// outlasts it lets Drain return nil whatever the players do. Messages
// the players were still sending when the Disconnect reached them are
// not delivered: a game that must keep them ends its match first.
//
// Stats().Connections counts the connections yet to end while it waits
// (and how many were left when ctx ended it); RefusedAttempts counts the
// attempts refused meanwhile. A connection a Group holds reports
// EventDisconnected there as it ends; one from Accept sees Receive and
// Send fail at once, as after Close. Drain returns nil at once on a
// listener without connections, and may be called again, after it
// returned ctx's error, to wait some more. Close still has to be called.
func (l *Listener) Drain(ctx context.Context, reason string) error {
	if ctx == nil {
		return errNilContext
	}
	why := reasonBytes(reason)
	l.refuseReason.Store(&why)
	l.draining.Store(true)
	l.open.Store(false)
	for {
		cs, streaming := l.live()
		for _, c := range streaming {
			c.closeFor(why)
		}
		if len(cs) == 0 {
			return nil
		}
		for _, c := range cs {
			c.readOn.Store(true) // it reads on until its player is done (session_close.go)
			c.closeFor(why)
		}
		for _, c := range cs {
			select {
			case <-c.done:
				continue // an end wins over a ctx done meanwhile
			default:
			}
			select {
			case <-c.done:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
	}
}

// live returns the connections that have not ended: those on the sockets
// and those just made, not yet there (handleNew adds one to l.pending
// before its endpoint's map), and, apart, the streams not yet
// established. Once draining is set, no more are made over UDP
// (handleNew, startSecure check it under l.mu); a stream is still taken,
// to be told why it is refused, and such attempts are closed but not
// waited for: silent streams opened one after another must not hold a
// drain open (Close ends what is left of them).
func (l *Listener) live() (cs, streaming []*Conn) {
	seen := make(map[*Conn]bool)
	add := func(c *Conn) {
		if !seen[c] && !c.ended() {
			seen[c] = true
			cs = append(cs, c)
		}
	}
	l.mu.Lock()
	for c, est := range l.streams {
		if !est && !c.ended() {
			seen[c] = true
			streaming = append(streaming, c)
		}
	}
	for c := range l.pending {
		add(c)
	}
	for c := range l.streams {
		add(c)
	}
	l.mu.Unlock()
	for _, ep := range l.eps {
		ep.mu.Lock()
		for _, c := range ep.conns {
			add(c)
		}
		ep.mu.Unlock()
	}
	return cs, streaming
}

// closeFor starts c's graceful close with why as its reason, unless the
// application gave one (CloseWithReason, StartClose): what a Listener's
// Drain does to each connection. Like the Listener's Close it does not
// count as the application's Close, whose first call still reports how
// the connection ended.
func (c *Conn) closeFor(why []byte) {
	c.sendq.mu.Lock()
	if c.sendq.closeReason == nil && len(why) > 0 {
		c.sendq.closeReason = why
	}
	c.sendq.mu.Unlock()
	c.shutdown()
}
