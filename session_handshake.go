package knet

import "time"

// clientEstablished completes the client's side of the handshake on the
// ConnectSynAck carrying synAck; the ConnectAck goes next.
func (s *session) clientEstablished(now time.Time, synAck []byte) {
	s.synAck = append([]byte(nil), synAck...)
	s.state = stateOK
	s.wasOpen = true
	s.needSyn = false
	s.needAck = !s.ref // the reference dialect has no ConnectAck
	if s.synSends == 1 {
		s.loss.rtt.sample(now.Sub(s.started)) // Karn: only when unambiguous
	}
	s.nextPing = now.Add(s.cfg.keepalive())
	s.events |= evEstablished
}

// establishServer completes the server side of the handshake: a ConnectAck
// or any application message does it.
func (s *session) establishServer(now time.Time) {
	if s.client || s.state != stateSynAck {
		return
	}
	s.state = stateOK
	s.wasOpen = true
	s.needSynAck = false
	if s.synAckSends == 1 {
		s.loss.rtt.sample(now.Sub(s.synAckSent))
	}
	s.nextPing = now.Add(s.cfg.keepalive())
	s.events |= evEstablished
}

// admitted records the application's decision on the ConnectSyn.
func (s *session) admitted(now time.Time, reply []byte, ok bool) {
	if s.state != stateAdmit {
		return
	}
	s.admitWaiting = false
	if !ok {
		s.state = stateDone
		s.err = ErrRefused
		s.refuseReason = reply // the reason, for a refusal
		// The reference dialect has no refusal: any datagram would open
		// the connection for a reference client.
		s.needDiscAck = !s.cfg.stealth && !s.ref
		return
	}
	s.synAck = reply
	s.state = stateSynAck
	s.needSynAck = true
	s.started = now
}

// A ConnectSyn goes again after firstSynResend, then at intervals
// doubling up to maxSynBackoff, until ConnectTimeout.
const (
	firstSynResend = 200 * time.Millisecond
	maxSynBackoff  = time.Second
)

// synPadTo is the size a client pads its ConnectSyn datagram to, so that
// the server may answer with a ConnectSynAck of about that size at once.
// A plaintext client pads to its MaxDatagramSize if that is smaller; a
// secure client always pads to it (QUIC's rule for its Initial packets,
// RFC 9000 14.1): a secure listener drops a smaller ConnectSyn unread,
// so that an attempt costing it a key exchange costs the sender 1200
// bytes, and its answers (a cookie, a refusal) stay far below that.
const synPadTo = 1200

// synPadding is the size the client's ConnectSyn datagram is padded to.
func (s *session) synPadding() int {
	if s.client && s.cfg.serverKey != nil {
		return synPadTo
	}
	return min(synPadTo, s.cfg.maxDatagram)
}

// idPadding is the reserved MessageID 5, which receivers ignore: the
// ConnectSyn's padding.
const idPadding = 5

// appendPadding fills the datagram b up to size bytes with one padding
// message, when there is room for one.
func appendPadding(b []byte, size int) []byte {
	room := size - len(b) - 3 // message header and the 1-byte MessageID
	if room < 0 {
		return b
	}
	room = min(room, maxContentLength-1)
	b = appendMessage(b, &message{id: idPadding})
	b[len(b)-3] = byte(1 + room) // ContentLength, u16 little-endian
	b[len(b)-2] = byte((1 + room) >> 8)
	return append(b, make([]byte, room)...)
}
