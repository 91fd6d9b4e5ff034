package knet

import (
	"fmt"
	"net"
)

// reachState is what the system reported of the peer's reachability:
// reports in a row that the peer cannot be reached (see unreachable), the
// latest one's error, and DatagramsReceived when they started.
type reachState struct {
	strikes   int
	strikeErr error
	heard     uint64
}

// Fail-fast rules. One error must not end a connection (a full buffer, a
// route flapping), but a client whose server is gone should learn it as
// fast as TCP would tell it, not after a timeout.
const (
	// handshakeStrikes failed ConnectSyn attempts in a row fail Dial: each
	// a send error or an ICMP port unreachable. With the ConnectSyn resent
	// after 200ms, Dial to a port where nothing listens fails in about
	// that time.
	handshakeStrikes = 2
	// openStrikes port unreachable reports in a row, with nothing heard
	// from the peer in between, end an established connection.
	openStrikes = 3
)

// unreachable takes the system's report that a datagram did not reach the
// peer: a send error, or errConnRefused for an ICMP port unreachable. Every
// one counts while handshaking, only port unreachable once open (other
// send errors are counted in Stats.SendErrors and left to the timeouts).
func (s *session) unreachable(err error) {
	if isRefusal(err) && s.trustsICMP() || s.state == stateSyn {
		s.reach.strikes++
		s.reach.strikeErr = err
	}
}

// trustsICMP reports whether the system's reports of an ICMP port
// unreachable count against the connection. Nothing authenticates them:
// anyone who knows the addresses and ports can forge one. A secure
// connection, once open, leaves a peer that is gone to the lost timeout
// rather than let a forgery end it; while connecting it fails fast, as it
// does on a refusal, which is no more authenticated (SECURE.md).
func (s *session) trustsICMP() bool { return !s.secure || !s.handshake.wasOpen }

// checkReach ends the connection when the reports are many enough,
// refusals more having come from the socket's reader (ICMP port
// unreachable).
func (s *session) checkReach(refusals int) {
	if got := s.stats.DatagramsReceived; got != s.reach.heard {
		s.reach.heard, s.reach.strikes = got, 0 // the peer is there after all
	}
	if refusals > 0 && s.trustsICMP() {
		s.reach.strikes += refusals
		s.reach.strikeErr = errConnRefused
	}
	switch {
	case s.state == stateSyn && s.reach.strikes >= handshakeStrikes:
		if isRefusal(s.reach.strikeErr) {
			s.fail(ErrPortUnreachable)
		} else {
			s.fail(fmt.Errorf("knet: cannot send to the peer: %w", s.reach.strikeErr))
		}
	case s.state == stateOK && s.reach.strikes >= openStrikes:
		s.fail(errUnreachableClosed)
	case s.state == stateClosing && s.reach.strikes >= openStrikes:
		// Closing, only the DisconnectAck was missing: with the peer
		// gone, waiting for it is pointless, and nothing was lost.
		s.fail(net.ErrClosed)
	}
}
