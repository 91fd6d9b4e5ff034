package knet

import (
	"encoding/binary"
	"net"
	"time"
)

// closeState is the end of the connection: the close the application
// asked for, the Disconnect exchange and its resends, the reasons each
// side gave, and the linger after answering the peer's Disconnect.
type closeState struct {
	asked         bool // the application asked to close (requestClose)
	stopAccepting bool // no more messages queue

	// A drain's close (readOn, the closer's side) and the peer's
	// (peerReadsOn, flushing: ours), see peerDisconnect.
	readOn      bool // ours reads on after its Disconnect: the drain notice goes with it
	peerReadsOn bool // the peer's Disconnect came with the drain notice
	flushing    bool // the peer's Disconnect came: what Send took goes out before our DisconnectAck
	sealed      bool // no more messages come from the application (Conn.drainSendQueue)

	// by is when the close ends, DisconnectTimeout after the application
	// asked, or after the peer's Disconnect came while flushing
	// (whichever came first).
	by           time.Time
	reason       []byte // ours, sent in our Disconnect
	refuseReason []byte // sent in the DisconnectAck that refuses
	peerReason   []byte // the peer's, from its Disconnect
	code         uint32 // ours, sent beside our Disconnect when not 0 (extCloseCode)
	peerCode     uint32 // the peer's, from the close code beside its Disconnect
	discResend   time.Time
	discBackoff  time.Duration // between Disconnects, doubling
	discAckedAt  time.Time     // when we answered the peer's Disconnect
	lingerUntil  time.Time
}

// requestClose starts a graceful close: what is queued goes out and is
// acked, then Disconnect, all within DisconnectTimeout.
func (s *session) requestClose(now time.Time) {
	switch s.state {
	case stateSynAck:
		if !s.client && s.closing.readOn {
			// A drain: the client may hold our ConnectSynAck and play
			// already. Once it proves itself, the session closes as an
			// established one, with the drain's notice and reason
			// (stateOK below), so that the player hears why and moves on
			// with what its Send took; one that never does ends at its
			// ConnectTimeout.
			return
		}
		s.fail(net.ErrClosed)
	case stateSyn, stateAdmit:
		s.fail(net.ErrClosed)
	case stateLinger:
		if s.secure || s.cfg.stealth {
			// Nothing answers the peer's resent Disconnect once the
			// session is gone (its datagrams are sealed; a stealthy
			// listener answers nobody): the linger runs its course,
			// lest a lost DisconnectAck leave the peer to its
			// DisconnectTimeout. Close waits for it, lingerTime at most.
			return
		}
		s.state = stateDone // the socket answers statelessly (disconnectAnswer)
	case stateOK:
		if !s.closing.asked {
			s.closing.asked = true
			s.closing.stopAccepting = true
			s.closing.sealed = true
			if !s.closing.flushing {
				s.closing.by = now.Add(s.cfg.disconnect)
			}
		}
	}
}

// The drain: a closer that will read on after its Disconnect (a
// Listener's Drain) says so with the drain notice, a message of reserved
// ID 5 whose content is extDrain, in the Disconnect's datagram (the spec
// dialect's only: the reference's wire has no ID 5). It then keeps
// taking, delivering and acking the peer's datagrams until the
// DisconnectAck. A knet peer that finds the notice answers only once
// every reliable message its Send accepted before it learned of the
// close (before its Receive saw io.EOF and its Send ErrPeerClosed) is
// acked, or after its own DisconnectTimeout: the closer's Disconnect
// overtakes nothing the player had in flight. The DisconnectAck, in
// order, comes after all of it. A peer that does not know the notice
// ignores it and answers at once, as the specification has it, and a
// close without the notice (Close, CloseWithReason) is answered at once:
// its application reads no more.

// extDrain is the idExt kind of the drain notice. It has no further
// content.
const extDrain = 3

var drainNotice = [1]byte{extDrain}

// isDrainNotice reports whether m is the drain notice.
func isDrainNotice(m *message) bool {
	return m.id == idExt && !m.fragment && len(m.payload) == 1 && m.payload[0] == extDrain
}

// The close code (CloseWithError): a closer with a code other than 0
// says it with a message of reserved ID 5 whose content is extCloseCode
// and the code, a u32 little-endian, in the Disconnect's datagram, just
// before the Disconnect (and after the drain notice, if any); the
// Disconnect's content is the reason, as ever. A knet peer takes it for
// the code of the close, whatever the order the Disconnect is applied in
// (the datagram is sent only with the Disconnect); a peer that does not
// know it ignores it, and reads the reason alone. Code 0 sends nothing:
// CloseWithReason's datagram is what it always was. The reference's
// wire has no ID 5, and carries neither code nor reason.

// extCloseCode is the idExt kind of the close code.
const extCloseCode = 4

// closeCodeSize is the close code's message content: the kind, the code.
const closeCodeSize = 5

// appendCloseCode appends the close code's message block for code.
func appendCloseCode(b []byte, code uint32) []byte {
	p := [closeCodeSize]byte{extCloseCode}
	binary.LittleEndian.PutUint32(p[1:], code)
	return appendMessage(b, &message{id: idExt, payload: p[:]})
}

// parseCloseCode reads m as a close code; ok is false if it is none.
func parseCloseCode(m *message) (code uint32, ok bool) {
	if m.id != idExt || m.fragment || len(m.payload) != closeCodeSize || m.payload[0] != extCloseCode {
		return 0, false
	}
	return binary.LittleEndian.Uint32(m.payload[1:]), true
}

// peerDisconnect applies the peer's Disconnect, in order after what the
// peer sent before it. Open, a connection answers at once (its
// DisconnectAck is owed, what it was sending dropped and kept for
// Unacknowledged), unless the peer reads on (peerReadsOn): then it
// delivers first what its application queued (flushing) and answers
// once that is acked (flushed), or DisconnectTimeout after the
// Disconnect (closing.by, unless the application's close came first
// and ends sooner). Closing too (our
// Disconnect crossed the peer's), the close is done.
func (s *session) peerDisconnect(now time.Time, reason []byte) {
	if len(reason) > 0 && s.closing.peerReason == nil {
		s.closing.peerReason = reasonBytes(string(reason))
	}
	switch s.state {
	case stateOK:
		if s.closing.flushing {
			return // a Disconnect sent again: answered once flushed
		}
		if !s.closing.asked {
			s.events |= evPeerClosed
		}
		if s.closing.peerReadsOn {
			s.closing.flushing = true
			if !s.closing.asked {
				s.closing.by = now.Add(s.cfg.disconnect)
			}
			return
		}
		s.answerDisconnect(now)
	case stateClosing:
		s.owed.owe(oweDiscAck)
		s.closeDone()
	default:
		s.owed.owe(oweDiscAck)
	}
}

// answerDisconnect ends an open connection whose peer closed: what it was
// still sending is dropped (and kept for Unacknowledged), the
// DisconnectAck is owed, and the connection lingers to answer the peer's
// Disconnect again should the answer be lost, unless the application
// closed too: then our answer ends it.
func (s *session) answerDisconnect(now time.Time) {
	s.owed.owe(oweDiscAck)
	s.dropSending()
	if s.closing.asked {
		s.state = stateDone
		return
	}
	s.state = stateLinger
	s.closing.lingerUntil = now.Add(s.lingerTime())
}

// flushed reports whether a connection flushing for its peer's
// Disconnect has delivered everything: the application can queue no
// more, nothing is queued or in flight, and no receipt waits for an ack.
func (s *session) flushed() bool {
	return s.closing.sealed && s.sendIdle()
}

// sendIdle reports whether nothing is queued or in flight, and no
// unreliable message waits for the ack its receipt needs.
func (s *session) sendIdle() bool {
	return s.send.relQ.len() == 0 && s.send.unrelQ.len() == 0 && s.latestQueued() == 0 && s.loss.sent.count == 0 && !s.rcptOf().awaitsAck()
}

// lingerTime is how long a connection that answered its peer's Disconnect
// stays to answer it again, in case the DisconnectAck was lost: a few of
// the peer's backed-off resends. A dialed connection, whose application
// waits for its end (a player moving after a drain), stays four RTOs;
// a Listener's, which nobody waits for but its application's Close,
// through the peer's first four resends (half a second on a LAN): at 5%
// loss each way three tries failed about once in a thousand closes, and
// a secure peer, which nothing else answers once the connection is gone,
// then waited out its DisconnectTimeout.
func (s *session) lingerTime() time.Duration {
	d := 4 * s.loss.rto()
	if !s.client {
		// The peer's schedule, as advanceClose keeps it, with our RTO
		// for its.
		r, span := min(s.loss.rto(), firstDiscResend), time.Duration(0)
		for range 4 {
			span += r
			r = min(2*max(r, s.loss.minRTO()), maxDiscBackoff)
		}
		d = max(d, span+s.loss.rto())
	}
	return min(max(d, 50*time.Millisecond), s.cfg.disconnect)
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
		if s.closing.asked || s.closing.flushing {
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
		if s.closing.flushing {
			if !now.Before(s.closing.by) {
				// Gave up delivering what was queued: the peer is
				// answered, what is left kept for Unacknowledged.
				s.answerDisconnect(now)
			}
			return
		}
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

// pollClosing returns, once our Disconnect went, the acks owed the peer
// if the close reads on (readOn: a drain), at once, since the peer waits
// for them to answer; nil otherwise (the specification has the closer
// send nothing more).
func (s *session) pollClosing(now time.Time, buf []byte) []byte {
	if !s.closing.readOn || s.acks.pending() == 0 {
		return nil
	}
	s.owed.owe(oweAckNow)
	return s.wire.pollUnreliable(now, buf)
}

// pollFlushed answers the peer's Disconnect once everything is
// delivered: the DisconnectAck goes (in order after it all).
func (s *session) pollFlushed(now time.Time, buf []byte) []byte {
	if !s.flushed() {
		return nil
	}
	s.answerDisconnect(now)
	return s.poll(now, buf)
}
