package knet

import (
	"errors"
	"fmt"
	"time"
)

// A server's stream, from the client's first frame to its establishment:
// the stream's side of the listener's admission (admission.go), which
// decides everything here as it does for UDP. The phases:
//
//	phaseOpening    the client's first frame, at most streamHelloLimit bytes
//	phaseKeying     a secure hello waits for its key exchange, which the
//	                listener's handshake workers run (as a UDP ConnectSyn's)
//	phaseAdmitting  the Admit hook decides
//	phaseProving    secure: the answer (Noise message 2) went; the client's
//	                first sealed frame, at most streamHelloLimit bytes, must
//	                open under the session's keys
//	phaseOpen       established: offered to Accept or the Group
//
// Until phaseOpen the stream is bounded by ConnectTimeout from its start,
// whatever bytes come (a stream replayed by someone without the keys
// never leaves phaseProving), and nothing it sends feeds a timer.

// streamHelloLimit is the largest first frame a server reads from a
// client, and the largest first sealed frame: a hello carries at most a
// ConnectPayload (2035 bytes) and a connect token (460), a client's first
// sealed frame a ping. A larger size field ends the stream before the
// frame is read.
const streamHelloLimit = 4 << 10

var (
	errStreamDialect  = errors.New("knet: this server speaks only the specification's dialect: a stream must open with knet's hello")
	errStreamRefOnly  = errors.New("knet: this server speaks only the reference dialect")
	errStreamReplay   = errors.New("knet: a secure hello whose handshake message was seen already")
	errAttemptGaveWay = errors.New("knet: the attempt gave way to another")
)

// keyResult is a secure hello's key exchange, from a handshake worker.
type keyResult struct {
	sec *secureState
	err error
}

// keyed hands c the key exchange of its secure hello (Listener.handshake).
func (c *Conn) keyed(sec *secureState, err error) {
	c.st.keyedRes.Store(&keyResult{sec, err})
	c.kick()
}

// streamClientFirst reads a client's first frame (kind, content: its knet
// hello, if knet) and goes on with the admission: the listener's rules
// first, then a secure hello's key exchange, or the Admit hook.
func (c *Conn) streamClientFirst(now time.Time, knet bool, kind byte, content []byte) {
	st, s := c.st, c.st.sess
	l := c.ep.l
	l.spoke(c)
	var payload, secure []byte
	switch {
	case knet && kind == helloClient:
		s.knet = true
		payload = append([]byte(nil), content...)
	case knet && kind == helloSecure:
		s.knet = true
		secure = append([]byte(nil), content...)
	case knet:
		// A server's hello, or a close, for a first frame.
		c.streamRefused(fmt.Errorf("knet: a first frame that is no client's hello (kind %d)", kind), true)
		return
	case c.cfg.dialect == DialectSpec:
		// The reference's first frame, which such a listener (a
		// secure one among them) does not serve: refused, unanswered
		// (the reference's wire has no refusal).
		c.streamRefused(errStreamDialect, false)
		return
	default:
		c.dialect = DialectReference // before the application sees c
	}
	if knet && c.cfg.dialect == DialectReference {
		c.streamRefused(errStreamRefOnly, true)
		return
	}
	if !l.open.Load() || l.draining.Load() {
		why := errors.New("knet: the server admits no connections")
		if r := l.refusal(); len(r) > 0 {
			why = errors.New(string(r))
		}
		c.streamRefused(why, knet)
		return
	}
	switch {
	case c.cfg.privateKey != nil && secure == nil:
		c.streamRefused(errors.New("knet: a secure listener takes no plaintext over a stream"), knet)
		return
	case c.cfg.privateKey == nil && secure != nil:
		c.streamRefused(errStreamNotSecure, knet)
		return
	}
	if knet && len(payload) > c.cfg.synPayloadLimit() {
		c.streamRefused(ErrHandshakeTooLarge, knet)
		return
	}
	if secure != nil {
		st.phase = phaseKeying
		if refuse, err := l.admitStreamHello(c, secure); err != nil {
			if refuse {
				c.streamRefused(err, true)
			} else {
				c.streamDrop(err)
			}
		}
		return
	}
	st.phase = phaseAdmitting
	c.state.mu.Lock()
	c.state.syn = payload
	c.state.mu.Unlock()
	c.streamAdmit(payload)
}

// streamKeyed takes the key exchange of a secure client's hello: the
// client's ConnectPayload and token, read, go to the Admit hook.
func (c *Conn) streamKeyed(now time.Time, k *keyResult) {
	st := c.st
	if st.phase != phaseKeying || st.sess.err != nil {
		return
	}
	if k.err != nil {
		c.streamRefused(k.err, true)
		return
	}
	if len(k.sec.payload) > c.cfg.payloadLimit() {
		c.streamRefused(ErrHandshakeTooLarge, true)
		return
	}
	c.sec = k.sec // before the Admit hook runs (Conn.Token)
	st.phase = phaseAdmitting
	c.state.mu.Lock()
	c.state.syn = k.sec.payload
	c.state.mu.Unlock()
	c.streamAdmit(k.sec.payload)
}

// streamAdmit asks the Admit hook, if any, on a goroutine of its own.
func (c *Conn) streamAdmit(payload []byte) {
	st := c.st
	if c.cfg.admitConn == nil && c.cfg.admit == nil {
		st.admitted.Store(&admission{})
		return
	}
	go func() {
		var a admission
		if c.cfg.admitConn != nil {
			a.reply, a.err = c.cfg.admitConn(c, payload)
		} else {
			a.reply, a.err = c.cfg.admit(c.RemoteAddr(), payload)
		}
		st.admitted.Store(&a)
		c.kick()
	}()
}

// streamDecide carries out the admission's decision on a server's stream:
// a plaintext client is established at once, a secure one gets the answer
// and must prove it holds the session's keys.
func (c *Conn) streamDecide(now time.Time, a *admission) {
	st, s := c.st, c.st.sess
	if st.phase != phaseAdmitting || s.err != nil {
		return
	}
	err := a.err
	if err == nil && s.knet && len(a.reply) > c.cfg.payloadLimit() {
		err = ErrHandshakeTooLarge
		c.ep.oversized.Add(1)
	}
	if err == nil && !c.ep.l.roomToAccept() {
		err = errServerFull
	}
	var msg2 []byte
	if err == nil && c.sec != nil {
		msg2, err = c.sec.writeSynAck(a.reply)
	}
	if err != nil {
		c.streamRefused(err, s.knet)
		return
	}
	c.state.mu.Lock()
	c.state.synAck = append([]byte(nil), a.reply...)
	c.state.mu.Unlock()
	if c.sec != nil {
		// The answer, then everything sealed; the gate holds the
		// client's first sealed frame for streamProven.
		s.sendHello(helloSecureAccept, msg2)
		s.startSealing(c.sec)
		s.sawFirst, s.first = false, nil
		st.phase = phaseProving
		return
	}
	if !c.streamOffer() {
		return
	}
	if s.knet {
		s.sendHello(helloAccept, a.reply)
	}
	st.phase = phaseOpen
	s.open(now, s.knet)
}

// streamProven takes a secure client's first sealed frame, which opened
// under the session's keys: the client proved it holds them, and the
// connection is established; the frame is then handled as any.
func (c *Conn) streamProven(now time.Time) {
	st, s := c.st, c.st.sess
	st.sealedIn = true
	if !c.streamOffer() {
		return
	}
	st.phase = phaseOpen
	s.open(now, false)
}
