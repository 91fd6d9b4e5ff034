package knet

import (
	"bytes"
	"errors"
	"net/netip"
	"time"
)

// A secure listener's admission of a ConnectSyn, before it allocates
// anything for the attempt (handleNew): the cookie under load, the Noise
// message, the connect token. What it sends to the unproven address is
// never more bytes than the ConnectSyn's datagram.

// admitSecure decides on a ConnectSyn p from addr, a new address, for a
// secure listener. It returns the handshake, its first message read and
// the token checked, for the connection to be made; or nil when it
// answered (a cookie, a refusal) or ignored the attempt, having kept
// nothing.
func (l *Listener) admitSecure(ep *endpoint, addr netip.AddrPort, p []byte) *secureState {
	l.unprovenIn.Add(uint64(len(p)))
	var content []byte
	var h header
	scanDatagram(p, &h, func(m message) {
		if content == nil && !m.fragment && m.id == idConnectSyn {
			content = m.payload
		}
	})
	cookie, msg1, ok := splitSecureSyn(content)
	if !ok {
		l.refuseUnproven(ep, addr, p, ErrHandshakeFailed)
		return nil
	}
	if len(p) < synPadTo {
		// A secure client pads its ConnectSyn to synPadTo: a shorter
		// one gets neither a key exchange nor an answer.
		ep.invalid.Add(1)
		return nil
	}
	now := time.Now()
	l.mu.Lock()
	if l.closing || len(l.pending) >= l.cfg.maxPending {
		l.mu.Unlock()
		ep.ignored.Add(1)
		return nil
	}
	load := len(l.pending) + l.load.recent(now)
	l.mu.Unlock()
	if load >= l.cfg.cookieThreshold && !(len(cookie) > 0 && l.cookies.check(cookie, addr, msg1, now)) {
		var c [cookieSize]byte
		var buf [64]byte
		l.sendUnproven(ep, addr, p, appendRetry(buf[:0], l.cookies.appendCookie(c[:0], addr, msg1, now)))
		l.cookiesSent.Add(1)
		return nil
	}
	sec, err := newServerSecure(l.cfg.privateKey, l.cfg.publicKey)
	if err == nil {
		var inner []byte
		inner, err = sec.readSyn(msg1)
		if err == nil {
			err = l.checkSynPayload(sec, inner, now)
		}
		// Kept, so that the connection knows the client's ConnectSyn
		// when it comes again.
		sec.msg1 = bytes.Clone(msg1)
	}
	if err != nil {
		l.mu.Lock()
		l.load.failed(now)
		l.mu.Unlock()
		if errors.Is(err, ErrTokenRejected) {
			l.rejectedTokens.Add(1)
		}
		l.refuseUnproven(ep, addr, p, err)
		return nil
	}
	return sec
}

// checkSynPayload splits the payload of the client's Noise message into
// the token, which it checks when the listener takes tokens, and the
// ConnectPayload.
func (l *Listener) checkSynPayload(sec *secureState, inner []byte, now time.Time) error {
	token, payload, ok := splitSynPayload(inner)
	if !ok {
		return ErrHandshakeFailed
	}
	sec.payload = payload
	if l.tokens == nil {
		return nil // a token is ignored where none is asked for
	}
	t, id, err := l.tokens.check(token, now)
	sec.token, sec.tokenID = t, id
	return err
}

// useToken marks the connect token of c, a server's connection being
// established, as used, and reports whether it may be: a token is checked
// at admission but used only here, once the client proved it holds the
// session's keys, so that an attempt that never completes does not burn
// it. Another attempt with the same token may have completed first: c is
// then refused, counted as a rejected token.
func (l *Listener) useToken(c *Conn) bool {
	if l.tokens == nil || c.sec == nil || c.sec.token == nil {
		return true
	}
	err := l.tokens.use(c.sec.tokenID, c.sec.token.Expires.Unix(), time.Now().Unix())
	if err == nil {
		return true
	}
	l.rejectedTokens.Add(1)
	c.ep.refused.Add(1)
	if lg := l.cfg.logger; lg != nil {
		lg.Info("knet: connection refused", "remote", c.remote.Load(), "reason", err)
	}
	return false
}

// refuseUnproven refuses an attempt from an address not proven to be the
// sender, keeping nothing: a DisconnectAck saying why, or without the
// reason if that would make it larger than what came (it cannot with a
// ConnectSyn padded to 1200 bytes), or nothing with Stealth.
func (l *Listener) refuseUnproven(ep *endpoint, addr netip.AddrPort, in []byte, why error) {
	ep.refused.Add(1)
	if lg := l.cfg.logger; lg != nil {
		lg.Info("knet: connection refused", "remote", addr, "reason", why)
	}
	if l.cfg.stealth {
		return
	}
	var buf [16 + MaxReasonLength]byte
	d := appendHeader(buf[:0], &header{})
	d = appendMessage(d, &message{id: idDisconnectAck, payload: reasonBytes(why.Error())})
	if len(d) > len(in) {
		d = appendMessage(appendHeader(buf[:0], &header{}), &message{id: idDisconnectAck})
	}
	l.sendUnproven(ep, addr, in, d)
}

// sendUnproven sends d to addr in answer to the datagram in, unless d is
// larger (anti-amplification: an address that never answered gets no more
// bytes than it sent).
func (l *Listener) sendUnproven(ep *endpoint, addr netip.AddrPort, in, d []byte) {
	if len(d) > len(in) {
		return
	}
	l.unprovenOut.Add(uint64(len(d)))
	ep.write(d, addr)
}
