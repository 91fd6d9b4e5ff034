package knet

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"hash"
	"net/netip"
	"sync"
	"time"
)

// Stateless cookies (Config.CookieThreshold), QUIC's Retry: a secure
// listener under load answers a ConnectSyn with a cookie instead of
// running the handshake, and only a ConnectSyn echoing a fresh cookie
// for its source address costs it a key exchange and a connection. See
// SECURE.md ("Stateless cookies") for the layout.

const (
	// idRetry is the knet extension message carrying a cookie, in the
	// reserved MessageID 0 (DECISIONS §2). Only a secure listener sends
	// it, and only in answer to a secure ConnectSyn: no other kNet peer
	// ever receives one. The path messages of migration share the ID
	// (idPath): a Retry travels only in clear, before the keys, and holds
	// the 24-byte cookie; path messages only in sealed datagrams, 9 bytes.
	idRetry = idPath
	// cookieSize: u64 issue time, 16 bytes of HMAC-SHA256.
	cookieSize = 8 + 16
	// cookieLifetime is how long a cookie is accepted after it was made.
	cookieLifetime = 10 * time.Second
	// defaultCookieThreshold is how many handshakes may be in progress
	// before cookies are asked for.
	defaultCookieThreshold = 64
	// maxRetries is how many cookies a client answers at once; later
	// ones ride its next timed ConnectSyn, so that forged cookies cannot
	// make it send more than a few extra ConnectSyns.
	maxRetries = 4
	// secureSynExtra is what a secure ConnectSyn's content holds beyond
	// the Noise message and the ConnectPayload: the cookie's length byte,
	// room for a cookie, the token's length.
	secureSynExtra = 1 + cookieSize + 2
)

// cookieAD starts what a cookie's MAC covers.
const cookieAD = "knet cookie v1"

// cookieJar makes and checks a listener's cookies, under a random secret
// of its own made at Listen (restarting the listener changes it; the
// issue time inside each cookie makes rotating it unnecessary). Safe for
// concurrent use.
type cookieJar struct {
	macs sync.Pool // *cookieMAC
}

// cookieMAC is an HMAC-SHA256 under a jar's secret, with room for its
// input and output, so that a flood of ConnectSyns allocates nothing.
type cookieMAC struct {
	h   hash.Hash
	in  [len(cookieAD) + 16 + 2 + 8]byte
	sum [sha256.Size]byte
}

func newCookieJar() *cookieJar {
	secret := make([]byte, 32)
	rand.Read(secret) // never fails (crypto/rand)
	return &cookieJar{macs: sync.Pool{New: func() any { return &cookieMAC{h: hmac.New(sha256.New, secret)} }}}
}

// appendMAC appends the 16-byte MAC of a cookie issued at issued (Unix
// seconds) for the ConnectSyn whose Noise message is msg1, from addr.
func (j *cookieJar) appendMAC(b []byte, addr netip.AddrPort, issued uint64, msg1 []byte) []byte {
	m := j.macs.Get().(*cookieMAC)
	m.h.Reset()
	in := m.in[:]
	copy(in, cookieAD)
	ip := addr.Addr().Unmap().As16()
	copy(in[len(cookieAD):], ip[:])
	binary.LittleEndian.PutUint16(in[len(cookieAD)+16:], addr.Port())
	binary.LittleEndian.PutUint64(in[len(cookieAD)+18:], issued)
	m.h.Write(in)
	m.h.Write(msg1)
	b = append(b, m.h.Sum(m.sum[:0])[:cookieSize-8]...)
	j.macs.Put(m)
	return b
}

// appendCookie appends a cookie for msg1 from addr at now.
func (j *cookieJar) appendCookie(b []byte, addr netip.AddrPort, msg1 []byte, now time.Time) []byte {
	issued := uint64(now.Unix())
	b = binary.LittleEndian.AppendUint64(b, issued)
	return j.appendMAC(b, addr, issued, msg1)
}

// check reports whether cookie is one this jar made for msg1 from addr,
// less than cookieLifetime before now.
func (j *cookieJar) check(cookie []byte, addr netip.AddrPort, msg1 []byte, now time.Time) bool {
	if len(cookie) != cookieSize {
		return false
	}
	issued := binary.LittleEndian.Uint64(cookie)
	age := now.Unix() - int64(issued)
	if int64(issued) < 0 || age < -1 || age > int64(cookieLifetime/time.Second) {
		return false // -1: our clock stepped back a little
	}
	var mac [cookieSize - 8]byte
	return hmac.Equal(j.appendMAC(mac[:0], addr, issued, msg1), cookie[8:])
}

// appendRetry appends the datagram that asks for cookie to be echoed: a
// header (PacketID 0, no flags) and one message block, MessageID 0 with
// the cookie as content. 30 bytes.
func appendRetry(b, cookie []byte) []byte {
	b = appendHeader(b, &header{})
	return appendMessage(b, &message{id: idRetry, payload: cookie})
}

// appendSecureSyn appends a secure ConnectSyn's content: the cookie's
// length (0 or cookieSize), the cookie, the Noise message.
func appendSecureSyn(b, cookie, msg1 []byte) []byte {
	b = append(b, byte(len(cookie)))
	b = append(b, cookie...)
	return append(b, msg1...)
}

// splitSecureSyn is appendSecureSyn's inverse; ok is false for a content
// that is no secure ConnectSyn. The results alias content.
func splitSecureSyn(content []byte) (cookie, msg1 []byte, ok bool) {
	if len(content) < 1 {
		return nil, nil, false
	}
	n := int(content[0])
	if n != 0 && n != cookieSize || len(content) < 1+n+noiseOverhead {
		return nil, nil, false
	}
	return content[1 : 1+n], content[1+n:], true
}

// appendSynPayload appends the payload of a secure ConnectSyn's Noise
// message: the token's length (u16 little-endian), the token, the
// ConnectPayload.
func appendSynPayload(b, token, payload []byte) []byte {
	b = binary.LittleEndian.AppendUint16(b, uint16(len(token)))
	b = append(b, token...)
	return append(b, payload...)
}

// splitSynPayload is appendSynPayload's inverse. The results alias p.
func splitSynPayload(p []byte) (token, payload []byte, ok bool) {
	if len(p) < 2 {
		return nil, nil, false
	}
	n := int(binary.LittleEndian.Uint16(p))
	if len(p) < 2+n {
		return nil, nil, false
	}
	return p[2 : 2+n], p[2+n:], true
}

// handshakeLoad counts the handshakes a listener computed that left no
// connection behind (they failed: a Noise message not for our key, a bad
// token), in one-second windows: with the pending connections, what the
// cookie threshold is compared with. Guarded by the Listener's mu.
type handshakeLoad struct {
	start     time.Time // of the current window
	cur, prev int
}

func (h *handshakeLoad) roll(now time.Time) {
	switch d := now.Sub(h.start); {
	case d < time.Second:
		return
	case d < 2*time.Second:
		h.prev = h.cur
	default:
		h.prev = 0
	}
	h.cur = 0
	h.start = now
}

// failed counts a handshake computed in vain at now.
func (h *handshakeLoad) failed(now time.Time) {
	h.roll(now)
	h.cur++
}

// recent returns the failed handshakes of this window and the last.
func (h *handshakeLoad) recent(now time.Time) int {
	h.roll(now)
	return h.cur + h.prev
}
