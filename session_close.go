package knet

import (
	"net"
	"time"
)

// requestClose starts a graceful close: what is queued goes out and is
// acked, then Disconnect, all within DisconnectTimeout.
func (s *session) requestClose(now time.Time) {
	switch s.state {
	case stateSyn, stateAdmit, stateSynAck:
		s.fail(net.ErrClosed)
	case stateLinger:
		s.state = stateDone
	case stateOK:
		if !s.closeAsked {
			s.closeAsked = true
			s.stopAccepting = true
			s.closeBy = now.Add(s.cfg.disconnect)
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
	if s.discAckedAt.IsZero() {
		return 0
	}
	return max(s.discAckedAt.Add(s.lingerTime()).Sub(now), 0)
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
