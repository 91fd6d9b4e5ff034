package knet

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"time"
)

// handshakeState is the opening of the connection: the ConnectSyn and its
// answer, the client's resends, the server's wait for its application
// and for the client's proof of its address, and what a server may send
// an address not yet proven.
type handshakeState struct {
	syn, synAck  []byte
	admitWaiting bool // server: ConnectSyn in, Admit not yet run
	wasOpen      bool // the handshake completed
	proven       bool // server: the peer proved it is at its address (addressProven)
	confirmed    bool // server: the client said it is open (establishServer)
	// pinging: a reference client whose pings the server has not yet
	// answered pings at the opening's pace (openPings).
	pinging bool
	// challenge is what a plaintext server's peer must echo to prove its
	// address, set as the ConnectSynAck first goes (takeProof): its
	// PacketID (the spec's wire), its PingRequest's ID (the reference's).
	challenge uint32
	started   time.Time // the attempt's start (server: its admission)
	// synResend is when our side of the opening goes again: a client's
	// ConnectSyn, a plaintext server's ConnectSynAck until the proof.
	synResend     time.Time
	synBackoff    time.Duration
	synSends      int
	synAckSent    time.Time
	synAckSends   int
	preIn, preOut int // server: bytes from and to the peer before it proved its address
}

// The handshake as the secure layer drives it (secure_layer.go): it reads the
// handshake messages itself, the session never sees a clear datagram of a
// secure connection, and these tell the session what happened.

// connecting reports whether a client waits for the server's answer.
func (s *session) connecting() bool { return s.client && s.state == stateSyn }

// setSyn replaces a client's ConnectSyn content (one echoing a listener's
// cookie), sent at once if now, else with the next timed one.
func (s *session) setSyn(content []byte, now bool) {
	if !s.connecting() {
		return
	}
	s.handshake.syn = content
	if now {
		s.owed.owe(oweSyn)
	}
}

// synArrived takes a server's first ConnectSyn, a datagram of n bytes
// whose content the listener read: the application decides next
// (evAdmit). It reports false if the ConnectSyn came before.
//
// The PacketIDs of the handshake's clear datagrams stay out of the
// receive window: nothing authenticates them, and one taken for received
// would make the peer's sealed datagram of that PacketID a duplicate.
func (s *session) synArrived(now time.Time, n int) bool {
	if s.client || s.state != stateAdmit || s.handshake.admitWaiting {
		return false
	}
	s.countIn(n)
	s.recv.uniqueIn++ // for Stats.LossRate: it took a PacketID
	s.handshake.admitWaiting = true
	s.events |= evAdmit
	s.live.lastRecv = now
	return true
}

// synAgain takes the client's ConnectSyn again (n bytes, credit for the
// answer): our ConnectSynAck was lost, and goes again.
func (s *session) synAgain(n int) {
	if s.client || s.handshake.wasOpen || s.state == stateDone {
		return
	}
	s.countIn(n)
	s.recv.uniqueIn++
	if s.state == stateSynAck {
		s.owed.owe(oweSynAck)
	}
}

// opened reports whether the handshake completed.
func (s *session) opened() bool { return s.handshake.wasOpen }

// lastOut is the packet number of the datagram poll (or pathChallenge)
// returned last, and whether it is new: what sealing it needs.
func (s *session) lastOut() outInfo { return s.send.out }

// rto is the retransmission timeout, which paces path challenges.
func (s *session) rto() time.Duration { return s.loss.rto() }

// synAckOut is a server's ConnectSynAck content, once it sends it (nil
// before, and once the connection is open).
func (s *session) synAckOut() []byte {
	if s.state != stateSynAck {
		return nil
	}
	return s.handshake.synAck
}

// handshakeDone completes a client's handshake on the server's answer (a
// datagram of n bytes), read and authenticated by the secure layer; syn
// and synAck are what the handshake carried in clear. (Its PacketID,
// which nothing authenticates, stays out of the receive window: see
// synArrived.)
func (s *session) handshakeDone(now time.Time, n int, syn, synAck []byte) {
	if !s.connecting() {
		return
	}
	s.countIn(n)
	s.recv.uniqueIn++
	s.clientEstablished(now, synAck)
	s.handshake.syn = syn
	s.live.lastRecv = now
}

// refusedBy ends a client's attempt on the server's refusal (n bytes).
func (s *session) refusedBy(reason []byte, n int) {
	if !s.connecting() {
		return
	}
	s.countIn(n)
	s.fail(refusedErr(reason))
}

// handleSealed is handleDatagram for a secure connection's datagram, once
// authenticated: fresh says it was never received before, and only such a
// datagram proves the peer alive (one received before may be a replay).
func (s *session) handleSealed(now time.Time, b []byte, fresh bool) {
	s.live.stale = !fresh
	s.handleDatagram(now, b)
	s.live.stale = false
}

// clientEstablished completes the client's side of the handshake on the
// ConnectSynAck carrying synAck; the ConnectAck goes next.
func (s *session) clientEstablished(now time.Time, synAck []byte) {
	s.handshake.synAck = append([]byte(nil), synAck...)
	s.state = stateOK
	s.handshake.wasOpen = true
	s.owed.take(oweSyn)
	if s.wire.hasConnectAck() {
		s.owed.owe(oweAck)
	}
	if s.handshake.synSends == 1 {
		s.loss.rtt.sampleHandshake(now.Sub(s.handshake.started)) // Karn: only when unambiguous
	}
	s.live.nextPing = now.Add(s.cfg.keepalive())
	s.events |= evEstablished
}

// establishServer completes the server side of the handshake: the
// client says it is open (DECISIONS §1: a ConnectAck or any application
// message; on the reference's wire, any datagram), and it has proven its
// address (addressProven), in either order. A secure session's caller
// proves it: its message came in a datagram that opened under the
// session's keys. A plaintext session's proof is takeProof's; a
// ConnectAck or an application message before it establishes nothing
// (anyone can send one from any address), though its datagram is taken:
// its messages wait in the receive queue.
func (s *session) establishServer(now time.Time) {
	if s.client || s.state != stateSynAck {
		return
	}
	s.handshake.confirmed = true
	if s.secure {
		s.handshake.proven = true
	}
	if !s.handshake.proven {
		return
	}
	s.state = stateOK
	s.handshake.wasOpen = true
	s.owed.take(oweSynAck)
	if s.handshake.synAckSends == 1 {
		s.loss.rtt.sampleHandshake(now.Sub(s.handshake.synAckSent))
	}
	s.live.nextPing = now.Add(s.cfg.keepalive())
	s.events |= evEstablished
}

// addressProven reports whether the peer has proven that it is at the
// connection's address, and not someone spoofing it (issue 31): a client
// always has; a secure server once a datagram opened under the session's
// keys (establishServer); a plaintext server once the peer echoed the
// challenge its ConnectSynAck carried (takeProof). Until then a server's
// connection is not established, so never offered to Accept or a Group,
// and it sends the address no more bytes than it received from there
// (amplifies).
func (s *session) addressProven() bool { return s.client || s.handshake.proven }

// awaitsProof reports whether the session is a plaintext server that
// answered the ConnectSyn and waits for its peer's proof.
func (s *session) awaitsProof() bool {
	return !s.client && !s.secure && s.state == stateSynAck && !s.handshake.proven
}

// errWrongProof ends a plaintext server's attempt whose peer acked, or
// echoed, what the server never sent its address: a blind guess by a
// sender spoofing that address. Nobody hears of it (the connection was
// never offered) but ListenerStats.InvalidDatagrams.
var errWrongProof = errors.New("knet: the peer's proof of its address named nothing sent to it")

// takeProof takes, on a plaintext server awaiting it (awaitsProof), the
// peer's answer to the challenge its ConnectSynAck carried, right says
// whether the answer names it: in the spec's wire a PacketAck naming the
// ConnectSynAck's PacketID (the datagram is reliable, its first PacketID
// random: 22 bits), in the reference's the PingReply echoing the
// PingRequest's ID (random: 8 bits). The right answer establishes the
// connection, once the client said it is open (establishServer); a wrong
// one ends the attempt silently: a blind sender gets one guess per
// ConnectSyn (35 PacketIDs, one PacketAck's worth; one ping ID in 256),
// each bounded by what the address sent (amplifies). It reports right.
func (s *session) takeProof(now time.Time, right bool) bool {
	if !right || s.handshake.synAckSends == 0 {
		s.stats.InvalidDatagrams++
		s.fail(errWrongProof)
		return false
	}
	s.handshake.proven = true
	if s.handshake.confirmed {
		s.establishServer(now)
	}
	return true
}

// openPings has a client open on the reference's wire ping at once, and
// then at the pace of its openings (firstSynResend, backing off to
// maxSynBackoff) until a ping is answered or ConnectTimeout has passed,
// instead of every keepalive interval. Its PingReply to the server's
// challenge is the proof a knet server waits for (takeProof), and goes
// once: if it is lost, only another challenge gets another, and the
// server may send one only on the credit of a datagram from the client
// (amplifies). The reference's client pings at once too (README fact 2);
// a server answers a ping once it holds the connection open, the
// reference's at once, a knet server with the proof.
func (s *session) openPings(now time.Time) {
	s.handshake.pinging = true
	s.handshake.synBackoff = firstSynResend
	s.live.nextPing = now
}

// pingGap is the time from a ping going now to the next (pingNow).
func (s *session) pingGap(now time.Time) time.Duration {
	if !s.handshake.pinging || !now.Before(s.handshake.started.Add(s.cfg.connectTimeout)) {
		s.handshake.pinging = false
		return s.cfg.keepalive()
	}
	d := s.handshake.synBackoff
	s.handshake.synBackoff = min(2*d, maxSynBackoff)
	return d
}

// randomBits returns a number from crypto/rand, masked by mask.
func randomBits(mask uint32) uint32 {
	var b [4]byte
	rand.Read(b[:]) // never fails (crypto/rand)
	return binary.LittleEndian.Uint32(b[:]) & mask
}

// synAckWent records a ConnectSynAck going out. A plaintext server sends
// it again on a timer, backing off as a client's ConnectSyn does, until
// the peer's proof (a client whose ack or PingReply was lost is open and
// has nothing to resend that carries it), and never past what the
// address sent (amplifies); a secure one only to the client's ConnectSyn
// sent again.
func (s *session) synAckWent(now time.Time) {
	s.handshake.synAckSent = now
	s.handshake.synAckSends++
	if !s.secure && s.handshake.synAckSends == 1 {
		s.handshake.synBackoff = firstSynResend
		s.handshake.synResend = now.Add(s.handshake.synBackoff)
	}
}

// admitted records the application's decision on the ConnectSyn.
func (s *session) admitted(now time.Time, reply []byte, ok bool) {
	if s.state != stateAdmit {
		return
	}
	s.handshake.admitWaiting = false
	if !ok {
		s.state = stateDone
		s.err = ErrRefused
		s.closing.refuseReason = reply // the reason, for a refusal
		// The C++ wire has no refusal: any datagram would open the
		// connection for its client.
		if !s.cfg.stealth && s.wire.hasRefusal() {
			s.owed.owe(oweDiscAck)
		}
		return
	}
	s.handshake.synAck = reply
	s.state = stateSynAck
	s.owed.owe(oweSynAck)
	s.handshake.started = now
}

// handshakeDeadline adds the handshake's timers (states stateSyn,
// stateAdmit, stateSynAck): ConnectTimeout, a client's next ConnectSyn,
// and a plaintext server's next ConnectSynAck.
func (s *session) handshakeDeadline(t *deadlines) {
	if s.state == stateSyn || s.awaitsProof() {
		t.at(s.handshake.synResend)
	}
	t.at(s.handshake.started.Add(s.cfg.connectTimeout))
}

// advanceHandshake gives up the handshake after ConnectTimeout; until
// then a client sends the ConnectSyn again, backing off, and a plaintext
// server its ConnectSynAck (synAckWent).
func (s *session) advanceHandshake(now time.Time) {
	switch {
	case !now.Before(s.handshake.started.Add(s.cfg.connectTimeout)):
		s.fail(&TimeoutError{Op: "connect", Silent: s.cfg.connectTimeout})
	case s.state == stateSyn && !now.Before(s.handshake.synResend):
		s.owed.owe(oweSyn)
		s.handshake.synBackoff = min(2*s.handshake.synBackoff, maxSynBackoff)
		s.handshake.synResend = now.Add(s.handshake.synBackoff)
	case s.awaitsProof() && !s.handshake.synResend.IsZero() && !now.Before(s.handshake.synResend):
		s.owed.owe(oweSynAck)
		s.handshake.synBackoff = min(2*s.handshake.synBackoff, maxSynBackoff)
		s.handshake.synResend = now.Add(s.handshake.synBackoff)
	}
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
