package knet

import "time"

// Resuming (Config.ResumeTimeout; docs/secure-sessions.md, "Resuming"): an
// established connection whose peer was silent for ConnectionLostTimeout
// does not end, when ResumeTimeout is set, but waits suspended for that
// much longer, and carries on when the peer is heard again.
//
// Suspended, it sends as little as it can and still be found: a probe (a
// PingRequest in a new datagram) every resumeProbeGap, nothing reliable,
// and no application unreliable message (they wait in the send queue,
// within SendBuffer, as they do behind the peer's flow control). The probe
// timer of what is in flight runs on, but what it finds lost waits for the
// peer with the rest: resends would only spend the datagrams'
// MaxMessageSendCount on a dead path. What the application sends
// meanwhile is queued within SendBuffer as always (Send blocks, TrySend
// and an unreliable Send past it as documented there).
//
// A new datagram from the peer wakes it, and the answer to a ping sent
// since resumes it: what was in flight goes again at once, what was
// queued follows, in order, and the receiver's window drops what it
// already had, so that every reliable message arrives once. Waking sends
// nothing but a ping at once (and the probes, acks and answers of a
// suspended connection): a datagram the peer never saw, held on the path
// and sent later (from anywhere, by anyone, if the session is in clear),
// proves nothing of where the peer is now, and must not make us send
// everything in flight to its old address (TestResumeAttack*Amplifies).
// The ping's ID is drawn at random at the wake, so that a plaintext
// peer's 4-tuple spoofed blind guesses the answer once in 256 tries.
// A secure client's probe from a new address (its NAT's mapping changed)
// reaches its connection by the connection ID and authenticates, which
// resumes it; the connection moves to the address once the path check
// answers (migration.go), and the datagrams in flight go again there. A
// copy of an old datagram, from anywhere, proves nothing of the peer's
// life (session.alive) and wakes nothing; a datagram that does not
// authenticate never reaches the session. A plaintext server's connection
// is found by its client's address only, so it resumes when its client
// comes back from the same address, and not otherwise.
//
// Nothing on the wire is new: a probe is the PingRequest every knet and
// kNet peer answers.

// resumeProbeGap is the most time between two probes of a suspended
// connection: it bounds how long a peer that is back waits to be heard
// (the peer's own probes, every as long, find it too), at about 40 bytes
// a second.
const resumeProbeGap = time.Second

// resumable reports whether a connection whose peer is silent for the
// lost timeout waits for it rather than ending.
func (s *session) resumable() bool {
	return s.cfg.resumeTimeout > 0 && !s.closing.asked && !s.closing.flushing
}

// suspend starts the wait for the silent peer.
func (s *session) suspend(now time.Time) {
	s.live.suspended, s.live.waking = true, false
	s.stats.Suspended = true
	s.stats.Suspensions++
	s.live.nextPing = now
}

// wakeSuspended takes a new datagram from a suspended connection's peer: a ping
// goes at once (the first time), whose answer resumes the connection.
func (s *session) wakeSuspended(now time.Time) {
	if s.live.waking {
		return
	}
	s.live.waking = true
	// Only the answer to a ping sent from now on resumes: those sent
	// before count as answered, and the IDs start again at random.
	for i := range s.live.pings {
		s.live.pings[i].answered = true
	}
	s.live.nextPingID = uint8(randomBits(0xff))
	s.live.nextPing = now
}

// resume ends the suspension: the peer answered a ping sent since it
// woke.
func (s *session) resume(now time.Time) {
	s.live.suspended, s.live.waking = false, false
	s.stats.Suspended = false
	s.stats.Resumes++
	s.live.nextPing = now.Add(s.cfg.keepalive())
	s.owed.owe(oweAckNow)
	if !s.loss.resendAll(now) {
		s.fail(ErrRetransmitLimit)
	}
}

// suspendedDeadline adds a suspended connection's timers: the next probe
// and the end of the wait.
func (s *session) suspendedDeadline(t *deadlines) {
	t.at(s.live.nextPing)
	t.at(s.live.lastRecv.Add(s.cfg.lostTimeout + s.cfg.resumeTimeout))
}

// advanceSuspended ends a suspended connection whose wait is over, and
// has a probe go when one is due (with the next poll).
func (s *session) advanceSuspended(now time.Time) {
	silent := now.Sub(s.live.lastRecv)
	if silent >= s.cfg.lostTimeout+s.cfg.resumeTimeout {
		s.fail(&TimeoutError{Silent: silent, Op: "resume"})
	}
}

// resumeProbeDue gives a suspended connection's probe its pace: the ping
// that just went is followed by the next one resumeProbeGap later, or a
// keepalive if that is shorter.
func (s *session) resumeProbeDue(now time.Time) time.Time {
	return now.Add(min(resumeProbeGap, s.cfg.keepalive()))
}
