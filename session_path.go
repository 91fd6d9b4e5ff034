package knet

import "time"

// Path messages: MessageID 0 (idPath, reserved by the spec and ignored by
// kNet receivers), content u8 kind, then 8 bytes. Only secure sessions
// send them and take them (secure.go checks a new address with them).
const (
	pathChallenge = 1
	pathResponse  = 2
	pathDataSize  = 8
)

// pathState is a secure session's side of the path checks: a client
// answers the latest PathChallenge (owePathResponse), a server's
// connection reads the PathResponse heard (pathResponse) after each
// datagram, and moves when secure.go finds the client at a new address.
type pathState struct {
	got bool
	// The flags of the peer's key update announcement, if the last
	// datagram carried one (keyupdate.go).
	kuGot   bool
	kuFlags byte
	// The connection ID rotation message heard (cidrotation.go), its
	// length (0 if none) and its buffer, made at the first.
	cidLen    uint8
	challenge [pathDataSize]byte // the challenge to answer
	heard     [pathDataSize]byte // the response heard
	cidMsg    *[maxCIDMessage]byte
}

// handlePath takes a PathChallenge (a client answers the latest one) or a
// PathResponse (a server's connection checks it against its challenge).
func (s *session) handlePath(p []byte) {
	if len(p) > 0 && (p[0] == pathNewCIDs || p[0] == pathWantCIDs) {
		if len(p) <= maxCIDMessage {
			if s.path.cidMsg == nil {
				s.path.cidMsg = new([maxCIDMessage]byte)
			}
			s.path.cidLen = uint8(copy(s.path.cidMsg[:], p))
		}
		return
	}
	if len(p) != 1+pathDataSize {
		return
	}
	switch {
	case p[0] == pathChallenge && s.client:
		copy(s.path.challenge[:], p[1:])
		s.owed.owe(owePathResponse)
	case p[0] == pathResponse && !s.client:
		copy(s.path.heard[:], p[1:])
		s.path.got = true
	case p[0] == pathKeyUpdates:
		s.path.kuGot, s.path.kuFlags = true, p[1]
	}
}

// keyUpdatesHeard returns the flags of the peer's key update announcement
// the last datagram carried, if any.
func (s *session) keyUpdatesHeard() (flags byte, ok bool) {
	ok, flags = s.path.kuGot, s.path.kuFlags
	s.path.kuGot = false
	return flags, ok
}

// pathResponse returns the PathResponse the last datagram carried, if any
// (a server's connection checks it against its challenge).
func (s *session) pathResponse() (data [pathDataSize]byte, ok bool) {
	if !s.path.got {
		return data, false
	}
	s.path.got = false
	return s.path.heard, true
}

// cidMessage returns the connection ID rotation message the last datagram
// carried, if any (cidrotation.go). It aliases the session's buffer.
func (s *session) cidMessage() []byte {
	n := int(s.path.cidLen)
	if n == 0 {
		return nil
	}
	s.path.cidLen = 0
	return s.path.cidMsg[:n]
}

// pathChallenge builds, in buf, a new datagram holding a PathChallenge
// with content (a server's connection checking a new address), or returns
// nil when no new datagram may go now (spanFull).
func (s *session) pathChallenge(buf, content []byte) []byte {
	return s.wire.control(buf, idPath, content)
}

// moved takes a server connection's move to the client's new address:
// news go there at once, and what is in flight, which went to the address
// the client left, goes again now rather than at the probe timeouts (a
// second and more before the connection has a round-trip time).
func (s *session) moved(now time.Time) {
	s.owed.owe(oweAckNow)
	if s.live.waking {
		// The wake's ping went to the old address: the next goes to
		// the proven one now (resume.go).
		s.live.nextPing = now
	}
	if !s.loss.resendAll(now) {
		s.fail(ErrRetransmitLimit)
	}
}
