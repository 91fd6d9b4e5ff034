package knet

import (
	"bytes"
	"crypto/subtle"
	"errors"
	"fmt"
	"strings"
	"time"
)

// The secure layer between a connection's socket and its session.
//
// The rule: once keys exist, no clear byte reaches the session; before
// they exist, a datagram is taken only when it is exactly the handshake
// message the state expects (a client: the ConnectSynAck, a Retry, a
// refusal; a server: the ConnectSyn the listener read), and even then the
// session never sees the datagram: this layer reads the message and tells
// the session what it means (setSyn, synArrived, synAgain, handshakeDone,
// refusedBy). Sealed datagrams reach the session once authenticated.

// handshakeContent returns the content of the handshake message in b: b
// must be a clear handshake datagram (unreliable, no InOrder flag) holding
// one whole message with ID id and nothing else, but for the padding that
// follows a ConnectSyn. ok is false for anything else.
func handshakeContent(b []byte, id uint32) (pid uint32, content []byte, ok bool) {
	var h header
	n, found, extra := 0, false, false
	err := scanDatagram(b, &h, func(m message) {
		n++
		switch {
		case m.fragment || m.order != orderNone:
			extra = true
		case n == 1 && m.id == id:
			found, content = true, m.payload
		case n == 2 && id == idConnectSyn && m.id == idPadding:
		default:
			extra = true
		}
	})
	if err != nil || !found || extra || h.reliable || h.inOrder {
		return 0, nil, false
	}
	return h.packetID, content, true
}

// sealOut encrypts an outgoing datagram of sess, the one its last poll
// returned, once the connection is open securely; the handshake's
// datagrams (ConnectSyn, ConnectSynAck, a refusal) go in clear, their
// contents being the Noise messages. spare is a buffer the datagram may be
// sealed into, when b is the session's own (kept for retransmission, so
// never sealed in place). An error (a packet number out of sequence: see
// seal) means b must not go, and the connection must end.
func (s *secureState) sealOut(sess *session, b, spare []byte) ([]byte, error) {
	if !s.ready.Load() || !sess.opened() {
		return b, nil
	}
	dst := spare[:0]
	if &spare[:1][0] == &b[0] {
		dst = b
	}
	out := sess.lastOut()
	return s.seal(dst, b, out.pn, out.fresh)
}

// in takes a datagram b for sess from the connection's address (atPeer)
// or from another, and returns the authenticated plaintext datagram for
// the session, or nil when b was a handshake message, taken here, or is
// dropped (counted in invalid or replays). fresh reports that the
// datagram returned was never received before: only such a datagram
// proves the peer alive (a reliable one received before may be the peer's
// resend, or a replay, and is acked again and delivers nothing).
func (s *secureState) in(sess *session, now time.Time, b []byte, atPeer bool) (pt []byte, fresh bool) {
	s.newest = false
	if !s.ready.Load() {
		// No keys: only the handshake message this side waits for,
		// in clear, from the peer's address.
		if !atPeer || !s.handshakeIn(sess, now, b) {
			s.invalid++
		}
		return nil, false
	}
	if atPeer && s.clearAgain(sess, b) {
		return nil, false
	}
	if s.ku != nil {
		s.ku.at(now, sess.rto())
	}
	pt, fresh = s.open(b)
	return pt, fresh
}

// handshakeIn takes b, from the peer's address before the keys exist, if
// it is the handshake message expected, and reports whether it was.
func (s *secureState) handshakeIn(sess *session, now time.Time, b []byte) bool {
	if !s.initiator {
		// The server's connection is made with message 1 read: the
		// ConnectSyn it came in, or the client's copies of it.
		_, content, ok := handshakeContent(b, idConnectSyn)
		if !ok || !s.sameSyn(content) {
			return false
		}
		if !sess.synArrived(now, len(b)) {
			sess.synAgain(len(b))
		}
		return true
	}
	if !sess.connecting() {
		return false
	}
	if _, content, ok := handshakeContent(b, idConnectSynAck); ok {
		reply, err := s.readSynAck(content)
		if err != nil {
			// Not the server's (a forgery, or an answer to another
			// handshake): the genuine one may still come. If none
			// does, Dial says so (dialErr).
			s.badSynAcks++
			return false
		}
		sess.handshakeDone(now, len(b), s.payload, reply)
		return true
	}
	if plaintextSynAck(b) {
		// A plaintext server's answer: not ours to read, but Dial
		// says what it was (dialErr).
		s.badSynAcks++
		return false
	}
	if _, content, ok := handshakeContent(b, idDisconnectAck); ok {
		// A refusal is in clear, its reason unauthenticated; it must at
		// least prove it answers our ConnectSyn (splitRefusalProof).
		reason, ok := splitRefusalProof(content, s.msg1)
		if !ok {
			s.unprovenRefusals++
			return false
		}
		sess.refusedBy(reason, len(b))
		return true
	}
	if _, cookie, ok := handshakeContent(b, idRetry); ok && len(cookie) == cookieSize {
		s.takeCookie(sess, cookie)
		return true
	}
	return false
}

// plaintextSynAck reports whether b is a plaintext server's ConnectSynAck:
// its datagram is reliable (takeProof), a secure server's never is.
func plaintextSynAck(b []byte) bool {
	var h header
	first := true
	synAck := false
	err := scanDatagram(b, &h, func(m message) {
		synAck = synAck || first && !m.fragment && m.id == idConnectSynAck
		first = false
	})
	return err == nil && synAck && h.reliable
}

// A secure listener's refusals go in clear (it may not hold the keys: a
// client with another ServerKey) and nothing authenticates their reason,
// but each proves it answers the ConnectSyn it refuses: its content is
// the reason, a zero byte and the first refusalProofSize bytes of the
// ConnectSyn's Noise message 1 (of the client's ephemeral key, which is
// new for each Dial). Only who saw the ConnectSyn can make one: an
// attacker off the path cannot end a Dial with a forged refusal; one on
// the path could as well drop the ConnectSyn. A client takes no refusal
// without it.
const refusalProofSize = 8

// appendRefusalProof appends to reason the proof of a refusal of the
// ConnectSyn carrying msg1 (nothing if msg1 is nil: no secure one).
func appendRefusalProof(reason, msg1 []byte) []byte {
	if len(msg1) < refusalProofSize {
		return reason
	}
	return append(append(reason, 0), msg1[:refusalProofSize]...)
}

// splitRefusalProof returns the reason of a refusal's content, if it
// proves it answers the ConnectSyn carrying msg1.
func splitRefusalProof(content, msg1 []byte) (reason []byte, ok bool) {
	n := len(content) - 1 - refusalProofSize
	if n < 0 || len(msg1) < refusalProofSize || content[n] != 0 ||
		subtle.ConstantTimeCompare(content[n+1:], msg1[:refusalProofSize]) != 1 {
		return nil, false
	}
	return content[:n], true
}

// secureSynMsg1 returns the Noise message 1 of the datagram b, if it holds
// a secure ConnectSyn, or nil.
func secureSynMsg1(b []byte) []byte {
	var content []byte
	var h header
	scanDatagram(b, &h, func(m message) {
		if content == nil && !m.fragment && m.id == idConnectSyn {
			content = m.payload
		}
	})
	_, msg1, ok := splitSecureSyn(content)
	if !ok {
		return nil
	}
	return msg1
}

// sameSyn reports whether content, a ConnectSyn's, carries the message 1
// the listener read for this connection (the cookie before it may differ:
// a client echoes the last one it got).
func (s *secureState) sameSyn(content []byte) bool {
	_, msg1, ok := splitSecureSyn(content)
	return ok && s.msg1 != nil && bytes.Equal(msg1, s.msg1)
}

// clearAgain takes a copy of a handshake message that comes in clear after
// the keys exist, from the peer's address, and reports whether b was one:
// a server not yet open answers the client's ConnectSyn again (its
// ConnectSynAck was lost); a client drops a copy of the ConnectSynAck it
// read (counted as a duplicate). Nothing else in clear is taken.
func (s *secureState) clearAgain(sess *session, b []byte) bool {
	if !s.initiator {
		if sess.opened() {
			return false
		}
		_, content, ok := handshakeContent(b, idConnectSyn)
		if ok && s.sameSyn(content) {
			sess.synAgain(len(b))
			return true
		}
		return false
	}
	_, content, ok := handshakeContent(b, idConnectSynAck)
	if ok && bytes.Equal(content, s.msg2) {
		s.replays++
		return true
	}
	return false
}

// takeCookie takes the cookie of a listener under load (a Retry): the
// ConnectSyn goes again at once, echoing it, for the first maxRetries
// different cookies; later ones ride the next timed ConnectSyn. A forged
// Retry can cost the client a few ConnectSyns and its cookie, which the
// next genuine one replaces.
func (s *secureState) takeCookie(sess *session, cookie []byte) {
	if bytes.Equal(cookie, s.cookie) {
		return // the answer to a ConnectSyn sent again
	}
	s.cookie = append(s.cookie[:0], cookie...)
	now := s.retries < maxRetries
	if now {
		s.retries++
	}
	sess.setSyn(appendSecureSyn(nil, s.cookie, s.msg1), now)
}

// sealOut seals what the session sends, or ends the connection if it
// cannot be sealed (nil: nothing goes).
func (c *Conn) sealOut(b, spare []byte) []byte {
	c.rotateIfAsked()
	out, err := c.sec.sealOut(c.sess, b, spare)
	if err != nil {
		c.sess.fail(err)
		return nil
	}
	return out
}

// answerSynElsewhere takes a copy of the client's ConnectSyn from another
// address than the connection's, which the listener routes here while the
// connection is being made (Listener.repeated), and reports whether p was
// one. Whichever copy came first made the connection at its address: a
// replay, raced from elsewhere by someone who saw the client's, or the
// client's own. The copy gets the ConnectSynAck at its address, no larger
// than it (anti-amplification): only the client that made the ConnectSyn
// can read it, and its first sealed datagram, from its address, then
// opens the connection and starts a path check there; the connection is
// offered once that moved it (Conn.proven). The session hears nothing of
// the copy.
func (c *Conn) answerSynElsewhere(p *packet) bool {
	s := c.sec
	if s.initiator || c.sess.opened() || c.ep.l == nil {
		return false
	}
	_, content, ok := handshakeContent(p.b, idConnectSyn)
	if !ok || !s.sameSyn(content) {
		return false
	}
	if msg2 := c.sess.synAckOut(); msg2 != nil {
		d := appendHeader(make([]byte, 0, 16+len(msg2)), &header{})
		d = appendMessage(d, &message{id: idConnectSynAck, payload: msg2})
		c.ep.l.sendUnproven(c.ep, p.from, p.b, d)
	}
	return true
}

// takeSecure hands the session a datagram of a secure connection, if it
// authenticates (a handshake message is taken by the secure layer), and on
// a server checks where it came from.
func (c *Conn) takeSecure(now time.Time, p *packet) {
	size := len(p.b)
	atPeer := p.from == c.raddr
	if !atPeer && c.answerSynElsewhere(p) {
		return
	}
	b, fresh := c.sec.in(c.sess, now, p.b, atPeer)
	if b == nil {
		return
	}
	if !c.sess.client {
		c.cidSeen()
		c.checkPath(now, p.from, size)
	}
	c.sess.handleSealed(now, b, fresh)
	if data, ok := c.sess.pathResponse(); ok {
		c.pathAnswered(p.from, data)
	}
	c.cidMessages(now)
	if atPeer && !c.sec.proven && !c.sess.client {
		c.proven()
	}
	if atPeer && c.sess.client && c.ep.relay.Load() != nil {
		c.directConfirmed() // relay.go
	}
	c.keyUpdates(now)
}

// proven takes the proof that the server's connection is at the right
// address: an authenticated datagram from it, or a path check that moved
// the connection there. A connection that opened before (a copy of the
// client's ConnectSyn came first from another address, and the client
// opened the connection from its own) is offered now: Accept and a Group
// never see a connection at an address no datagram of its client came
// from.
func (c *Conn) proven() {
	c.sec.proven = true
	if c.sec.offerWait {
		c.sec.offerWait = false
		c.offer()
	}
}

// dialErr is Dial's error for a secure handshake that ended with err: a
// refusal for a failed handshake is ErrHandshakeFailed, one for the
// connect token ErrTokenRejected, with the refusal; a timeout after
// answers that did not authenticate (a plaintext server, another key) is
// ErrHandshakeFailed too, with the timeout.
func (s *secureState) dialErr(err error) error {
	var re *RefusedError
	var te *TimeoutError
	switch {
	case errors.As(err, &te) && s.badSynAcks > 0 && !s.ready.Load():
		return fmt.Errorf("%w: %d answers from the server did not prove it holds the private key of Config.ServerKey (a plaintext server, or another key?): %w", ErrHandshakeFailed, s.badSynAcks, err)
	case errors.As(err, &te) && s.unprovenRefusals > 0 && !s.ready.Load():
		return fmt.Errorf("%w (%d refusals that did not prove they came from the server were ignored)", err, s.unprovenRefusals)
	case !errors.As(err, &re):
	case re.Reason == ErrHandshakeFailed.Error():
		return fmt.Errorf("%w: the server could not read it (is Config.ServerKey the server's public key?): %w", ErrHandshakeFailed, err)
	case strings.HasPrefix(re.Reason, ErrTokenRejected.Error()):
		return fmt.Errorf("%w (Config.Token): %w", ErrTokenRejected, err)
	}
	return err
}
