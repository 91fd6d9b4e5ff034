package knet

import (
	"net"
	"time"
)

// closeState is the end of the connection: the close the application
// asked for, the Disconnect exchange and its resends, the reasons each
// side gave, and the linger after answering the peer's Disconnect.
type closeState struct {
	asked         bool      // the application asked to close (requestClose)
	stopAccepting bool      // no more messages queue
	by            time.Time // DisconnectTimeout: the close ends by then
	reason        []byte    // ours, sent in our Disconnect
	refuseReason  []byte    // sent in the DisconnectAck that refuses
	peerReason    []byte    // the peer's, from its Disconnect
	discResend    time.Time
	discBackoff   time.Duration // between Disconnects, doubling
	discAckedAt   time.Time     // when we answered the peer's Disconnect
	lingerUntil   time.Time
}

// requestClose starts a graceful close: what is queued goes out and is
// acked, then Disconnect, all within DisconnectTimeout.
func (s *session) requestClose(now time.Time) {
	switch s.state {
	case stateSyn, stateAdmit, stateSynAck:
		s.fail(net.ErrClosed)
	case stateLinger:
		s.state = stateDone
	case stateOK:
		if !s.closing.asked {
			s.closing.asked = true
			s.closing.stopAccepting = true
			s.closing.by = now.Add(s.cfg.disconnect)
		}
	}
}

// lingerTime is how long a connection that answered its peer's Disconnect
// stays to answer it again, in case the DisconnectAck was lost: a few of
// the peer's backed-off resends.
func (s *session) lingerTime() time.Duration {
	return min(max(4*s.loss.rto(), 50*time.Millisecond), s.cfg.disconnect)
}

// socketLinger is how much longer, at now, the socket of a dialed
// connection that has ended should stay open to answer its peer's resent
// Disconnects statelessly (see disconnectAnswer): the rest of the linger
// time after our DisconnectAck, or zero if we sent none.
func (s *session) socketLinger(now time.Time) time.Duration {
	if s.closing.discAckedAt.IsZero() {
		return 0
	}
	return max(s.closing.discAckedAt.Add(s.lingerTime()).Sub(now), 0)
}

// closeDeadline adds the close's timers: DisconnectTimeout (once the
// application asked to close), the next Disconnect, the linger's end.
func (s *session) closeDeadline(t *deadlines) {
	switch s.state {
	case stateOK:
		if s.closing.asked {
			t.at(s.closing.by)
		}
	case stateClosing:
		t.at(s.closing.discResend)
		t.at(s.closing.by)
	case stateLinger:
		t.at(s.closing.lingerUntil)
	}
}

// closeDone ends a close the peer answered. Receipts still owed (an
// unreliable message's ack that did not come before the Disconnect went)
// are told lost: none is left untold as the connection ends.
func (s *session) closeDone() {
	s.state = stateDone
	s.endReceipts()
}

// advanceClose runs the close's timers. Open, a close that has not
// delivered what was queued by DisconnectTimeout gives up on it and
// sends the Disconnect; closing, the Disconnect goes again, backing off,
// until DisconnectTimeout; lingering, the session ends.
func (s *session) advanceClose(now time.Time) {
	switch s.state {
	case stateOK:
		if s.closing.asked && !now.Before(s.closing.by) {
			// Gave up delivering what was queued; still tell the peer, so
			// that it does not wait for a lost timeout.
			s.dropSending()
			s.state = stateClosing
			s.owed.owe(oweDisc)
		}
	case stateClosing:
		if s.owed.owes(oweDisc) {
			return // goes out before the end
		}
		if !now.Before(s.closing.by) {
			// No DisconnectAck: the peer is declared lost (spec
			// "DisconnectTimeOut").
			s.fail(&TimeoutError{Op: "disconnect", Silent: s.cfg.disconnect})
		} else if !now.Before(s.closing.discResend) {
			// Resent with backoff: a peer that does not answer is gone or
			// far, and DisconnectTimeout bounds the wait anyway.
			s.owed.owe(oweDisc)
			s.closing.discBackoff = min(2*max(s.closing.discBackoff, s.loss.minRTO()), maxDiscBackoff)
			s.closing.discResend = now.Add(s.closing.discBackoff)
		}
	case stateLinger:
		if !now.Before(s.closing.lingerUntil) {
			s.state = stateDone
		}
	}
}

// A Disconnect goes again after the RTO, but no later than
// firstDiscResend (as the ConnectSyn: before the first RTT sample the RTO
// is a full second, a long wait for a lost 10-byte datagram when the whole
// close has DisconnectTimeout), then at doubling intervals up to
// maxDiscBackoff: a peer that forgot us and answers statelessly gets many
// chances within DisconnectTimeout, one that is gone a few datagrams a
// second at most.
const (
	firstDiscResend = 200 * time.Millisecond
	maxDiscBackoff  = 250 * time.Millisecond
)
