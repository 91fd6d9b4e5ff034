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
// connections still closing to Close. A connection over UDP that the
// server has answered, whose client may be playing already, is closed as
// an established one once its client proves its address (or ends at its
// ConnectTimeout); one still before its answer (Admit deciding) is
// dropped, and the client's next try is refused with reason.
//
// Each connection closes gracefully: what the server sent before the
// drain is delivered and acked, then the Disconnect tells the player
// reason, which a knet player sees as a *DisconnectError. The server
// reads on meanwhile: a knet player over UDP (the spec dialect, plaintext
// or secure) answers the Disconnect only once every reliable message its
// Send accepted before it learned of the drain (before its Send failed
// with ErrPeerClosed and its Receive returned io.EOF) is delivered and
// acked, and over TCP and WebSocket it writes what it has queued before
// its end of the stream: a drain loses none of the players' messages. A
// player that cannot deliver them within its DisconnectTimeout answers
// anyway, and its Conn.Unacknowledged then returns the rest. A player
// that does not answer ends after the server's DisconnectTimeout, so a
// ctx that outlasts it (and the players') lets Drain return nil whatever
// the players do. In the reference dialect, which cannot say that the
// server reads on, a player answers at once and drops what it had in
// flight (its Unacknowledged still returns it); so does a peer that
// speaks only the specification.
//
// Stats().Connections counts the connections yet to end while it waits
// (and how many were left when ctx ended it); RefusedAttempts counts the
// attempts refused meanwhile. A connection a Group holds delivers what
// its player still sends, then reports EventDisconnected as it ends; one
// from Accept sees Send fail at once, and Receive return what the player
// still sends, then an error wrapping net.ErrClosed as the connection
// ends (its Close, called meanwhile, stops it reading, as ever). Drain
// returns nil at once on a listener without connections, and may be
// called again, after it returned ctx's error, to wait some more. Close
// still has to be called. It is DrainWithError with code 0.
func (l *Listener) Drain(ctx context.Context, reason string) error {
	return l.DrainWithError(ctx, 0, reason)
}

// DrainWithError is Drain closing each connection as
// CloseWithError(code, reason) does: a knet player's *DisconnectError
// holds the code, for its program to branch on (go back to the
// matchmaker), beside the reason. Refused attempts are told the reason
// alone (a RefusedError has no code).
func (l *Listener) DrainWithError(ctx context.Context, code uint32, reason string) error {
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
			c.closeFor(code, why)
		}
		if len(cs) == 0 {
			return nil
		}
		for _, c := range cs {
			c.readOn.Store(true) // it reads on until its player is done (session_close.go)
			c.closeFor(code, why)
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
	for _, ep := range l.endpoints() {
		ep.mu.Lock()
		for _, c := range ep.conns {
			add(c)
		}
		ep.mu.Unlock()
	}
	return cs, streaming
}

// closeFor starts c's graceful close with code and why as its code and
// reason, unless the application gave them (CloseWithError,
// CloseWithReason, StartClose): what a Listener's Drain does to each
// connection. Like the Listener's Close it does not count as the
// application's Close, whose first call still reports how the connection
// ended.
func (c *Conn) closeFor(code uint32, why []byte) {
	c.sendq.mu.Lock()
	if c.sendq.closeReason == nil && (len(why) > 0 || code != 0) {
		c.sendq.closeCode, c.sendq.closeReason = code, why
		if why == nil {
			c.sendq.closeReason = []byte{} // given: a later close keeps it
		}
	}
	c.sendq.mu.Unlock()
	c.shutdown()
}
