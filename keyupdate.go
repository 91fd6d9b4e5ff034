package knet

import (
	"crypto/cipher"
	"crypto/hkdf"
	"crypto/sha256"
	"errors"
	"fmt"
	"time"
)

// Key updates (SECURE.md, "Limits"; docs/PROTOCOL.md §7.5): each
// direction of a secure session replaces its key well before AES-GCM's
// limits, with no pause in traffic, and the key it leaves is erased.
//
// Keys derive one way: the key of phase n+1 is HKDF-Expand (SHA-256) of
// phase n's with the label keyUpdateLabel; phase 0's is the handshake's
// (the Noise Split). Nothing on the wire names a phase: over UDP the
// receiver tries its current key, then the previous one while it keeps
// it, then the next one, and takes the next phase on the first datagram
// that authenticates under it (trial decryption: the clear header has no
// bit to spare). Over a stream, frames are in order, and the sender says
// where the new key starts with a sealed frame (streamKeyUpdate).
//
// UDP, the sender. It moves from phase n to n+1 only once a datagram it
// sealed under phase n was acked (a packet number at or above the first
// it sealed new in phase n): the receiver holds phase n then, so it is
// never more than one phase behind, and current, previous and next cover
// every datagram it can get. A datagram sent again keeps its packet
// number (its nonce) and bytes, and is sealed under the current key: one
// packet number sealed under two keys carries the same plaintext, and
// under one key a packet number is either new (above all sealed before)
// or that same plaintext again. The sender erases its old key at once.
//
// UDP, the receiver. It takes phase n+1 from any datagram that
// authenticates under it (only the peer holds that key, and the peer
// seals under it only once it is there), unless it has sealed nothing
// since it took phase n: then the peer cannot have had the ack it needs,
// and the datagram is refused and counted (the peer updates too fast). It
// keeps phase n's key for reordered datagrams keyDropPTOs
// retransmission timeouts, or until it takes phase n+2, then erases it.
// Replays are the replay window's, whose packet numbers run across
// phases.
//
// Negotiation. A peer of before key updates (or with them off) must never
// be sent one: each side announces the extension in a sealed path message
// (pathKeyUpdates, which such a peer ignores, as any path kind it does not
// know), sent again every retransmission timeout until the peer's says it
// heard ours, at most announceMax times; a side updates its sending keys
// only once it heard the peer's. Over a stream, the announcement is a
// knet hello that such a peer drops (helloPath).

const (
	// defaultKeyUpdatePackets: a key seals at most this many datagrams
	// (or frames) before the next replaces it. 2^20 is an eighth of
	// AES-GCM's confidentiality limit (2^23 packets, RFC 9001 §6.6):
	// what is sealed while the update waits for its ack, and every
	// resend, stays far within it; an update costs one HKDF and one AES
	// key schedule, nothing measurable at that rate.
	defaultKeyUpdatePackets = 1 << 20
	// defaultKeyUpdateTime bounds a key's life on a slow connection, as
	// WireGuard's 120 s does: a key taken from memory opens what it
	// sealed in the last minutes at most. Five minutes, as updates cost
	// nothing and a shorter bound would buy little against a thief who
	// holds the memory now.
	defaultKeyUpdateTime = 5 * time.Minute
	// keyLimitPackets is AES-GCM's confidentiality limit per key: a side
	// whose peer takes key updates ends the connection rather than seal
	// more under one key (an update that never gets its ack).
	keyLimitPackets = 1 << 23
	// keyDropPTOs is how long a receiver keeps the previous phase's key,
	// in retransmission timeouts: QUIC's three PTOs (RFC 9001 §6.5).
	keyDropPTOs = 3
	// announceMax bounds the announcements to a peer that never answers
	// (one of before key updates).
	announceMax = 10

	// Path message kinds of key updates (session_path.go).
	pathKeyUpdates = 5 // the announcement: a flags byte, then zeros
	pathKeyUpdate  = 6 // over a stream: the next frame is sealed under the next key

	// Flags of the announcement.
	kuSupport = 1 << 0 // the sender takes key updates
	kuHeard   = 1 << 1 // the sender heard the receiver's announcement
	kuReply   = 1 << 2 // an answer to an announcement: not to be answered
)

// keyUpdateLabel is HKDF's info: it keeps this derivation apart from any
// other use of the keys.
const keyUpdateLabel = "knet key update v1"

var (
	errKeyLimit         = errors.New("knet: secure session: a key reached AES-GCM's limit, and no key update could be made")
	errKeyUpdateTooFast = errors.New("knet: the peer updated its key before it could know we had the previous one")
)

// nextKey derives the key of the phase after k's.
func nextKey(k *[32]byte) [32]byte {
	b, err := hkdf.Expand(sha256.New, k[:], keyUpdateLabel, 32)
	if err != nil {
		panic("knet: HKDF-Expand of 32 bytes failed: " + err.Error())
	}
	var n [32]byte
	copy(n[:], b)
	clear(b)
	return n
}

// keyUpdates is a secure session's key update state, both directions. Nil
// on a secure state when Config.KeyUpdateInterval turns them off.
type keyUpdates struct {
	packets uint64        // a key seals at most this many datagrams
	every   time.Duration // or lives this long; 0: no time bound

	// Negotiation.
	peer      bool // the peer announced it takes key updates
	heard     bool // the peer heard our announcement
	replyOwed bool // an announcement came that wants an answer
	announced int  // announcements sent (not replies)
	lastAnn   time.Time

	// Sending.
	sendKey     [32]byte
	sendPhase   uint64
	sendCount   uint64    // datagrams sealed under sendKey
	sendSince   time.Time // when sendKey took over; zero until a datagram came
	sendFirst   uint64    // the first packet number sealed new under sendKey
	sendStarted bool      // sendFirst is one

	// Receiving: the current key is the secure state's recv.
	recvKey   [32]byte
	recvPhase uint64
	prev      cipher.AEAD // the phase before, while kept
	prevUntil time.Time
	next      cipher.AEAD // the phase after, once tried
	nextKey   [32]byte
	// sealedSince: this side sealed a datagram since it took recvPhase
	// (the peer may have its ack).
	sealedSince bool
	scratch     []byte // the ciphertext, for the next trial
	now         time.Time
	pto         time.Duration

	// Counters.
	updatesOut, updatesIn uint64
	tooFast               uint64 // next-phase datagrams refused: the peer updated too fast
}

// newKeyUpdates returns the key update state a secure connection made
// with cfg starts with, or nil when cfg turns them off.
func newKeyUpdates(cfg *config) *keyUpdates {
	if cfg.keyUpdatePackets == 0 {
		return nil
	}
	return &keyUpdates{packets: cfg.keyUpdatePackets, every: cfg.keyUpdateTime}
}

// start takes the handshake's keys as phase 0's.
func (k *keyUpdates) start(send, recv [32]byte) {
	k.sendKey, k.recvKey = send, recv
}

// sealing counts a datagram (or frame) about to be sealed under the
// current key, with packet number pn; fresh: a new one. It refuses when
// the key reached AES-GCM's limit on a connection whose peer takes
// updates (the update is overdue: its ack never came).
func (k *keyUpdates) sealing(pn uint64, fresh bool) error {
	if k.peer && k.sendCount >= keyLimitPackets {
		return errKeyLimit
	}
	k.sendCount++
	if fresh && !k.sendStarted {
		k.sendFirst, k.sendStarted = pn, true
	}
	k.sealedSince = true
	return nil
}

// sendDue reports whether the sending key is due for replacement at now.
func (k *keyUpdates) sendDue(now time.Time) bool {
	if !k.peer {
		return false
	}
	if k.sendSince.IsZero() {
		k.sendSince = now
	}
	return k.sendCount >= k.packets || k.every > 0 && now.Sub(k.sendSince) >= k.every
}

// rekeySend replaces the sending key with the next phase's in s (and the
// nonce ledger's fingerprint of it), erasing the old one.
func (k *keyUpdates) rekeySend(s *secureState, now time.Time) error {
	n := nextKey(&k.sendKey)
	aead, err := newGCM(n)
	if err != nil {
		return err
	}
	clear(k.sendKey[:])
	k.sendKey = n
	clear(n[:])
	s.send = aead
	if s.tap != nil {
		s.tapKey = keyPrint(&k.sendKey)
	}
	k.sendPhase++
	k.sendCount, k.sendSince, k.sendStarted = 0, now, false
	k.updatesOut++
	return nil
}

// keyPrint is the nonce ledger's fingerprint of a key.
func keyPrint(k *[32]byte) (p [8]byte) {
	h := sha256.Sum256(k[:])
	copy(p[:], h[:])
	return p
}

// at gives the receiving side the time of the datagram being opened and
// the retransmission timeout, and erases the previous phase's key once it
// has been kept long enough.
func (k *keyUpdates) at(now time.Time, pto time.Duration) {
	k.now, k.pto = now, pto
	if k.prev != nil && !now.Before(k.prevUntil) {
		k.prev = nil
	}
}

// openSealed authenticates and decrypts ct in place under packet number
// pn with associated data ad: under the current receiving key, or, when
// key updates are on, the previous one while kept, or the next one, which
// the receiver then takes (see the top of this file). It returns the
// plaintext, or an error with ct spoiled.
func (s *secureState) openSealed(ct []byte, pn uint64, ad []byte) ([]byte, error) {
	nonce := nonceFor(&s.recvNonce, pn)
	k := s.ku
	if k == nil {
		return s.recv.Open(ct[:0], nonce, ct, ad)
	}
	// A failed Open clears what it decrypted into: keep the
	// ciphertext for the next trial.
	k.scratch = append(k.scratch[:0], ct...)
	pt, err := s.recv.Open(ct[:0], nonce, ct, ad)
	if err == nil {
		return pt, nil
	}
	if k.prev != nil {
		copy(ct, k.scratch)
		if pt, err = k.prev.Open(ct[:0], nonce, ct, ad); err == nil {
			return pt, nil
		}
	}
	if k.next == nil {
		k.nextKey = nextKey(&k.recvKey)
		if k.next, err = newGCM(k.nextKey); err != nil {
			return nil, err
		}
	}
	copy(ct, k.scratch)
	if pt, err = k.next.Open(ct[:0], nonce, ct, ad); err != nil {
		return nil, err
	}
	if !k.sealedSince {
		k.tooFast++
		clear(pt)
		return nil, errKeyUpdateTooFast
	}
	k.rekeyRecv(s)
	return pt, nil
}

// rekeyRecv takes the next phase: its key becomes the current one, the
// current the previous (kept keyDropPTOs), and the previous is erased.
func (k *keyUpdates) rekeyRecv(s *secureState) {
	k.prev, k.prevUntil = s.recv, k.now.Add(keyDropPTOs*k.pto)
	s.recv, k.next = k.next, nil
	clear(k.recvKey[:])
	k.recvKey = k.nextKey
	clear(k.nextKey[:])
	k.recvPhase++
	k.updatesIn++
	k.sealedSince = false
}

// afterIn runs after the session took an authenticated datagram: it takes
// the peer's announcement if the datagram carried one, replaces the
// sending key when due and allowed (an ack of a datagram sealed under it
// came: ackedTop), and returns a sealed announcement to send the peer,
// in a new buffer, when one is due (nil otherwise).
func (s *secureState) afterIn(sess *session, now time.Time) ([]byte, error) {
	k := s.ku
	if k == nil || !sess.opened() {
		return nil, nil
	}
	if flags, ok := sess.keyUpdatesHeard(); ok && flags&kuSupport != 0 {
		k.peer = true
		k.heard = k.heard || flags&kuHeard != 0
		k.replyOwed = k.replyOwed || flags&kuReply == 0
	}
	if k.sendDue(now) && k.sendStarted {
		if sess.loss.ackedTop > k.sendFirst {
			if err := k.rekeySend(s, now); err != nil {
				return nil, err
			}
		} else {
			sess.pingForProof(now, k.sendFirst)
		}
	}
	reply := k.replyOwed
	if sess.state != stateOK {
		return nil, nil // closing: no announcement more
	}
	if !reply && (k.heard || k.announced >= announceMax || k.announced > 0 && now.Sub(k.lastAnn) < sess.rto()) {
		return nil, nil
	}
	var content [1 + pathDataSize]byte
	content[0] = pathKeyUpdates
	content[1] = kuSupport
	if k.peer {
		content[1] |= kuHeard
	}
	if reply {
		content[1] |= kuReply
	}
	b := sess.pathChallenge(make([]byte, 0, challengeSize+cidSize), content[:])
	if b == nil {
		return nil, nil // no new datagram may go now: the next one
	}
	if reply {
		k.replyOwed = false
	} else {
		k.announced++
		k.lastAnn = now
	}
	out := sess.lastOut()
	return s.seal(b, b, out.pn, out.fresh)
}

// keyUpdateCount is how many key updates s made, both directions.
func (s *secureState) keyUpdateCount() uint64 {
	if s == nil || s.ku == nil {
		return 0
	}
	return s.ku.updatesOut + s.ku.updatesIn
}

// String describes the state for a test's failure message.
func (k *keyUpdates) String() string {
	return fmt.Sprintf("peer %v heard %v announced %d; send phase %d (%d sealed); recv phase %d; too fast %d",
		k.peer, k.heard, k.announced, k.sendPhase, k.sendCount, k.recvPhase, k.tooFast)
}

// keyUpdates runs a connection's key updates after an authenticated
// datagram (afterIn), and sends the announcement due, if any, to the
// peer's address: once the server's connection is proven there.
func (c *Conn) keyUpdates(now time.Time) {
	s := c.sec
	if s.ku == nil || !c.sess.client && !s.proven {
		return
	}
	b, err := s.afterIn(c.sess, now)
	if err != nil {
		c.sess.fail(err)
		return
	}
	if b != nil {
		c.ep.write(b, c.raddr)
	}
}

// keyUpdates resolves Config.KeyUpdateInterval and KeyUpdateTime.
func (c *Config) keyUpdates() (packets uint64, every time.Duration) {
	switch {
	case c.KeyUpdateInterval < 0:
		return 0, 0
	case c.KeyUpdateInterval == 0:
		packets = defaultKeyUpdatePackets
	default:
		packets = uint64(min(c.KeyUpdateInterval, defaultKeyUpdatePackets))
	}
	switch {
	case c.KeyUpdateTime < 0:
	case c.KeyUpdateTime == 0:
		every = defaultKeyUpdateTime
	default:
		every = clampDur(c.KeyUpdateTime, time.Millisecond)
	}
	return packets, every
}
