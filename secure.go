package knet

import (
	"bytes"
	"crypto/aes"
	"crypto/cipher"
	"crypto/ecdh"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/binary"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"net"
	"net/netip"
	"strings"
	"sync/atomic"
	"time"

	"github.com/flynn/noise"
)

// Secure sessions (Config.PrivateKey, Config.ServerKey): a Noise NK
// handshake carried in the ConnectSyn and ConnectSynAck contents, then
// every datagram sealed with AES-256-GCM, its header in clear as the
// associated data. See SECURE.md for the design, the datagram layout and
// what is left to do.

const (
	// KeySize is the size of a static private or public key (X25519).
	KeySize = 32
	// sealOverhead is what sealing adds to a datagram: the AEAD tag.
	sealOverhead = 16
	// noiseOverhead is what the Noise NK messages add to the ConnectSyn
	// and ConnectSynAck contents: an ephemeral public key and a tag.
	noiseOverhead = KeySize + 16
	// cidSize is the connection ID's size: the server picks it, tells
	// it in the ConnectSynAck's content, and the client's sealed
	// datagrams carry it after their header (see Migration in SECURE.md).
	cidSize = 4
	// wireOverhead is the most a sealed datagram adds to the session's.
	wireOverhead = sealOverhead + cidSize
)

// noisePrologue is mixed into the handshake hash: both sides must agree
// on it, so that a handshake for another protocol (or a later version of
// this one) cannot be taken for ours.
var noisePrologue = []byte("kNet-over-UDP secure v1")

var noiseSuite = noise.NewCipherSuite(noise.DH25519, noise.CipherAESGCM, noise.HashSHA256)

var (
	// ErrHandshakeFailed is Dial's error when the secure handshake did
	// not complete: the server could not read the client's first message
	// (it does not hold the private key of Config.ServerKey) or its answer
	// did not authenticate. It is also the reason a secure server gives a
	// client whose ConnectSyn is no secure handshake (a plaintext client).
	ErrHandshakeFailed = errors.New("knet: secure handshake failed")
	errBadKey          = errors.New("knet: a key must be 32 bytes (X25519)")
	errSecureRef       = errors.New("knet: the reference dialect cannot be secure")
	errTokenInClear    = errors.New("knet: Config.Token needs Config.ServerKey: a connect token travels only in a secure handshake")
	errTokenKeyAlone   = errors.New("knet: Config.TokenKey needs Config.PrivateKey: connect tokens are checked only by a secure listener")
	errTokenAddrs      = errors.New("knet: Config.TokenKey on an unspecified address needs Config.PublicAddrs, the addresses tokens name")
	// errNonceReuse ends a secure connection whose session would have a
	// datagram sealed under a packet number that does not fit: a bug,
	// and nothing may be sealed twice under one nonce.
	errNonceReuse = errors.New("knet: secure session: packet number out of sequence")
)

// GenerateKey returns a new static key pair for a server (X25519, 32 bytes
// each): the private key goes in the server's Config.PrivateKey, the
// public key in its clients' Config.ServerKey.
func GenerateKey() (private, public []byte, err error) {
	k, err := ecdh.X25519().GenerateKey(rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	return k.Bytes(), k.PublicKey().Bytes(), nil
}

// publicKeyOf returns the X25519 public key of private.
func publicKeyOf(private []byte) ([]byte, error) {
	if len(private) != KeySize {
		return nil, errBadKey
	}
	k, err := ecdh.X25519().NewPrivateKey(private)
	if err != nil {
		return nil, err
	}
	return k.PublicKey().Bytes(), nil
}

// sealTap sees a datagram about to be sealed: a fingerprint of the key
// (its direction's), the packet number (the nonce) and the plaintext, which
// it must not keep. Tests keep a ledger with it: no nonce may seal two
// plaintexts.
type sealTap func(key [8]byte, pn uint64, plaintext []byte)

// Secure reports whether the connection is encrypted and the server
// authenticated: both ends were configured for it (Config.ServerKey,
// Config.PrivateKey) and the handshake completed.
func (c *Conn) Secure() bool { return c.sec != nil && c.sec.ready.Load() }

// secureState is a connection's half of a secure session: the handshake
// until it completes, then the keys of each direction. Owned by the
// connection's goroutine, but ready, which Secure reads.
type secureState struct {
	hs      *noise.HandshakeState // until the keys are derived
	payload []byte                // the ConnectPayload, in clear
	reply   []byte                // the Admit reply, in clear
	ready   atomic.Bool
	token   *Token // a server's: the client's connect token, checked

	// The token's nonce: used (Listener.useToken) once established.
	tokenID [tokenNonceSize]byte

	// msg1 is the client's Noise message 1: a client's own, sent again
	// with a listener's cookie; a server's, as the listener read it, to
	// know the client's ConnectSyn when it comes again. A client keeps the
	// last cookie received and how many were answered at once.
	msg1    []byte
	cookie  []byte
	retries int
	// A client's, to read a ConnectSynAck again after one that did not
	// authenticate (a forgery must not end the handshake): the server's
	// key, the ephemeral private key and message 1's payload, from which
	// the handshake state after message 1 is made again (readSynAck).
	serverKey []byte
	eph       []byte
	synInner  []byte
	// A client's: message 2 as read, to know the server's ConnectSynAck
	// when it comes again; how many did not authenticate before it.
	msg2       []byte
	badSynAcks int
	// A client's count of refusals that did not prove they answer its
	// ConnectSyn (forged, or from a server of before the proof).
	unprovenRefusals int

	send, recv cipher.AEAD
	tap        sealTap // tests only
	tapKey     [8]byte // with tap, the send key's fingerprint
	sendNonce  [12]byte
	recvNonce  [12]byte
	sendTop    uint64 // highest packet number sealed
	sealed     bool   // a datagram was sealed: sendTop is one
	replay     replayWindow
	h          header // parsed headers, reused

	// initiator: the client, whose sealed datagrams carry cid; the
	// server's carry none (its address does not change).
	initiator bool
	cid       uint32    // connection ID, the server's choice; 0 until known
	newest    bool      // the last datagram open returned had the highest packet number so far
	path      pathCheck // server: a new client address being checked
	// A server's: an authenticated datagram came from the connection's
	// address, or a path check moved it (Conn.proven); the connection
	// opened before that waits to be offered (offerWait).
	proven, offerWait bool

	// Counters, added to the connection's Stats.
	invalid    uint64 // failed authentication, or clear when it must not be
	replays    uint64 // unreliable datagrams received before
	migrations uint64
	challenges atomic.Uint64 // PathChallenges sent (for tests)
}

// newClientSecure starts the initiator's side of the handshake and
// returns it with its first message, the ConnectSyn content: the Noise
// message whose payload carries the connect token and the ConnectPayload,
// with no cookie yet (appendSecureSyn).
func newClientSecure(serverKey, token, payload []byte) (*secureState, []byte, error) {
	eph := make([]byte, KeySize)
	if _, err := rand.Read(eph); err != nil {
		return nil, nil, err
	}
	s := &secureState{payload: payload, initiator: true, serverKey: serverKey, eph: eph,
		synInner: appendSynPayload(nil, token, payload)}
	var err error
	if s.msg1, err = s.writeSyn(); err != nil {
		return nil, nil, err
	}
	return s, appendSecureSyn(nil, nil, s.msg1), nil
}

// writeSyn starts the initiator's handshake with its ephemeral key (the
// handshake draws it from Random: the same bytes each time) and writes
// message 1. Writing it again gives the same bytes (the same
// keys, the payload encrypted under the same key and nonce), and leaves
// the handshake where the first left it: ready to read message 2.
func (s *secureState) writeSyn() ([]byte, error) {
	hs, err := noise.NewHandshakeState(noise.Config{
		CipherSuite: noiseSuite,
		Pattern:     noise.HandshakeNK,
		Initiator:   true,
		Prologue:    noisePrologue,
		PeerStatic:  s.serverKey,
		Random:      bytes.NewReader(s.eph),
	})
	if err != nil {
		return nil, err
	}
	msg1, _, _, err := hs.WriteMessage(nil, s.synInner)
	if err != nil {
		return nil, err
	}
	s.hs = hs
	return msg1, nil
}

// newServerSecure prepares the responder's side: the handshake starts
// with the client's first message (readSyn).
func newServerSecure(private, public []byte) (*secureState, error) {
	hs, err := noise.NewHandshakeState(noise.Config{
		CipherSuite:   noiseSuite,
		Pattern:       noise.HandshakeNK,
		Initiator:     false,
		Prologue:      noisePrologue,
		StaticKeypair: noise.DHKey{Private: private, Public: public},
	})
	if err != nil {
		return nil, err
	}
	return &secureState{hs: hs}, nil
}

// readSyn reads the client's first handshake message and returns the
// payload it carries (appendSynPayload).
func (s *secureState) readSyn(msg1 []byte) ([]byte, error) {
	if s.hs == nil {
		return nil, ErrHandshakeFailed
	}
	payload, _, _, err := s.hs.ReadMessage(nil, msg1)
	if err != nil {
		s.hs = nil
		return nil, ErrHandshakeFailed
	}
	return payload, nil
}

// writeSynAck seals the connection ID (s.cid) and the Admit reply in the
// responder's message, the ConnectSynAck content, and derives the session
// keys.
func (s *secureState) writeSynAck(reply []byte) ([]byte, error) {
	payload := binary.LittleEndian.AppendUint32(make([]byte, 0, cidSize+len(reply)), s.cid)
	msg2, toServer, toClient, err := s.hs.WriteMessage(nil, append(payload, reply...))
	s.hs = nil
	if err != nil {
		return nil, err
	}
	if err := s.keys(toClient, toServer); err != nil {
		return nil, err
	}
	s.reply = reply
	return msg2, nil
}

// readSynAck reads the responder's message, proof that the server holds
// the private key, and derives the session keys. It returns the Admit
// reply, and keeps the connection ID that came before it.
//
// A message 2 that does not authenticate changes nothing: it may be an
// attacker's, and the genuine one may still come (a reading spoils the
// handshake state, which is made again from the ephemeral key for the
// next).
func (s *secureState) readSynAck(msg2 []byte) ([]byte, error) {
	if s.hs == nil {
		if _, err := s.writeSyn(); err != nil {
			return nil, err
		}
	}
	payload, toServer, toClient, err := s.hs.ReadMessage(nil, msg2)
	s.hs = nil
	if err == nil && len(payload) < cidSize {
		err = errors.New("no connection ID")
	}
	if err != nil {
		return nil, fmt.Errorf("%w: the server's answer did not prove it holds the private key of Config.ServerKey", ErrHandshakeFailed)
	}
	s.cid = binary.LittleEndian.Uint32(payload)
	reply := payload[cidSize:]
	if err := s.keys(toServer, toClient); err != nil {
		return nil, err
	}
	s.reply = reply
	s.msg2 = bytes.Clone(msg2)
	// The handshake is over: what made it again goes.
	clear(s.eph)
	s.eph, s.synInner, s.msg1, s.cookie = nil, nil, nil, nil
	return reply, nil
}

// keys sets up the AEAD of each direction from the Noise Split, whose
// keys feed the standard library's AES-GCM (hardware accelerated, and
// sealing without allocating, the nonce in s).
func (s *secureState) keys(send, recv *noise.CipherState) error {
	var err error
	k := send.UnsafeKey()
	if s.send, err = newGCM(k); err != nil {
		return err
	}
	if s.tap != nil {
		h := sha256.Sum256(k[:])
		copy(s.tapKey[:], h[:])
	}
	if s.recv, err = newGCM(recv.UnsafeKey()); err != nil {
		return err
	}
	s.ready.Store(true)
	return nil
}

func newGCM(k [32]byte) (cipher.AEAD, error) {
	b, err := aes.NewCipher(k[:])
	if err != nil {
		return nil, err
	}
	return cipher.NewGCM(b)
}

// nonceFor writes n as Noise's AESGCM nonce: 32 zero bits, then n as a
// big-endian 64-bit integer (Noise spec 12.4).
func nonceFor(nonce *[12]byte, n uint64) []byte {
	binary.BigEndian.PutUint64(nonce[4:], n)
	return nonce[:]
}

// seal encrypts the datagram b into dst (which may be b itself, with
// wireOverhead bytes of spare capacity) and returns it: the header stays
// in clear as the associated data, the rest is encrypted and followed by
// the tag. A client's datagram carries the connection ID after the
// header, in clear and authenticated with it. The nonce is the
// datagram's 64-bit packet number, expanded from its PacketID: a
// datagram sent again (same PacketID) is the same bytes under the same
// nonce, hence the same ciphertext.
//
// pn is the datagram's packet number, as the session numbered it
// (session.numberNew): a datagram sent again keeps its first send's, and
// only a fresh (new) datagram may take one above every number sealed
// before. A number that would break that is refused (errNonceReuse)
// before anything is sealed: GCM must never seal two plaintexts under one
// nonce.
func (s *secureState) seal(dst, b []byte, pn uint64, fresh bool) ([]byte, error) {
	n, err := parseHeader(b, &s.h)
	if err != nil {
		return nil, err
	}
	switch {
	case uint32(pn)&packetIDMask != s.h.packetID:
		return nil, fmt.Errorf("%w: packet number %d for PacketID %d", errNonceReuse, pn, s.h.packetID)
	case fresh && s.sealed && pn <= s.sendTop:
		return nil, fmt.Errorf("%w: new packet number %d not above %d", errNonceReuse, pn, s.sendTop)
	case !fresh && (!s.sealed || pn > s.sendTop):
		return nil, fmt.Errorf("%w: packet number %d sent again was never sealed", errNonceReuse, pn)
	}
	if fresh {
		s.sendTop, s.sealed = pn, true
	}
	if s.tap != nil {
		s.tap(s.tapKey, pn, b)
	}
	ad := n
	if s.initiator {
		ad += cidSize
	}
	var body []byte
	if len(dst) == 0 || &dst[:1][0] != &b[0] {
		dst = append(dst[:0], b[:n]...)
		body = b[n:]
	} else {
		// In place: the body moves up to make room for the ID.
		dst = b[:len(b)+ad-n]
		body = dst[ad:]
		copy(body, b[n:])
		dst = dst[:n]
	}
	if s.initiator {
		dst = binary.LittleEndian.AppendUint32(dst, s.cid)
	}
	return s.send.Seal(dst, nonceFor(&s.sendNonce, pn), body, dst[:ad]), nil
}

// sealedCID returns the connection ID of a client's sealed datagram: the
// four bytes after its header. ok is false when b is too short to be one.
// It reads the header without keeping it, and allocates nothing.
func sealedCID(b []byte) (id uint32, ok bool) {
	n := headerSize(b)
	if n < 0 || len(b)-n < cidSize+sealOverhead {
		return 0, false
	}
	return binary.LittleEndian.Uint32(b[n:]), true
}

// headerSize is the length of the datagram header at the start of b, or
// -1 if b is too short for it (see parseHeader).
func headerSize(b []byte) int {
	if len(b) < minHeaderSize {
		return -1
	}
	n := minHeaderSize
	if b[2]&(headerFlagInOrder>>16) == 0 {
		return n
	}
	if len(b) < n+1 {
		return -1
	}
	count := int(b[n])
	n++
	// 2 x count VLE-1.7/8: one byte each, or two when the first has its
	// top bit set.
	for range 2 * count {
		if n >= len(b) {
			return -1
		}
		if b[n] >= 0x80 {
			n++
		}
		n++
	}
	if n > len(b) {
		return -1
	}
	return n
}

// open authenticates and decrypts the datagram b in place and returns its
// plaintext form (without the connection ID), or nil if it is to be
// dropped: it failed authentication or bears another connection ID
// (counted invalid), or is an unreliable datagram received before, or
// too old for the replay window (counted replays). Nothing changes unless
// it authenticates; then s.newest says whether its packet number is the
// highest yet (only such a datagram may start a migration). A reliable
// datagram received before is returned: it may be the peer's
// retransmission, whose ack was lost, and the session acks it again (and
// drops it as a duplicate).
func (s *secureState) open(b []byte) (pt []byte, fresh bool) {
	s.newest = false
	n, err := parseHeader(b, &s.h)
	ad := n
	if !s.initiator {
		ad += cidSize
	}
	if err != nil || len(b)-ad < sealOverhead || ad > n && binary.LittleEndian.Uint32(b[n:]) != s.cid {
		s.invalid++
		return nil, false
	}
	pn := expandPacketNumber(s.h.packetID, s.replay.top)
	fresh, inWindow := s.replay.check(pn)
	if !inWindow || !fresh && !s.h.reliable {
		s.replays++
		return nil, false
	}
	pt, err = s.recv.Open(b[ad:ad], nonceFor(&s.recvNonce, pn), b[ad:], b[:ad])
	if err != nil {
		s.invalid++
		return nil, false
	}
	s.newest = !s.replay.started || pn > s.replay.top
	s.replay.mark(pn)
	if ad > n {
		// Drop the ID: the header moves up against the plaintext.
		copy(b[ad-n:ad], b[:n])
		b = b[ad-n:]
	}
	return b[:n+len(pt)], fresh
}

// Packet numbers: 64 bits, of which the wire carries the low 22 (the
// PacketID). A receiver takes the value nearest the one after the highest
// it authenticated (QUIC's algorithm, RFC 9000 A.3); a sender the one
// nearest the one after the highest it sealed. Both start from 0, as the
// session's PacketIDs do, and a sender never has a datagram unacked
// 2^15 or more behind its newest (recvSpan), far within the 2^21 either
// way the expansion tolerates.
const (
	pnWindow = 1 << 22
	pnHalf   = pnWindow / 2
)

func expandPacketNumber(pid uint32, top uint64) uint64 {
	expected := top + 1
	cand := expected&^(pnWindow-1) | uint64(pid&packetIDMask)
	switch {
	case cand+pnHalf <= expected && cand < 1<<62:
		return cand + pnWindow
	case cand > expected+pnHalf && cand >= pnWindow:
		return cand - pnWindow
	}
	return cand
}

// replayWindow remembers which of the last recvSpan packet numbers have
// been authenticated: as far back as a sender may resend (spanFull).
type replayWindow struct {
	top     uint64
	started bool
	bits    [recvSpan / 64]uint64
}

// check reports whether packet number n is new, and whether it is within
// the window at all (older ones are dropped).
func (w *replayWindow) check(n uint64) (fresh, inWindow bool) {
	if !w.started || n > w.top {
		return true, true
	}
	if w.top-n >= recvSpan {
		return false, false
	}
	i := n % recvSpan
	return w.bits[i/64]&(1<<(i%64)) == 0, true
}

// mark records packet number n as received.
func (w *replayWindow) mark(n uint64) {
	switch {
	case !w.started:
		w.started = true
		w.top = n
	case n > w.top:
		if n-w.top >= recvSpan {
			clear(w.bits[:])
		} else {
			for i := w.top + 1; i < n; i++ {
				j := i % recvSpan
				w.bits[j/64] &^= 1 << (j % 64)
			}
		}
		w.top = n
	}
	i := n % recvSpan
	w.bits[i/64] |= 1 << (i % 64)
}

// secureListener checks and completes a Listener's resolved Config: its
// private key, whose public half it derives, and the dialect (a secure
// listener serves the specification's only).
func (c *config) secureListener() error {
	c.token = nil
	if c.tokenKey != nil && c.privateKey == nil {
		return errTokenKeyAlone
	}
	if c.privateKey == nil {
		if c.serverKey != nil { // a Config shared with clients
			c.serverKey = nil
			c.maxDatagram += sealOverhead
		}
		return nil
	}
	pub, err := publicKeyOf(c.privateKey)
	if err != nil {
		return fmt.Errorf("knet: Config.PrivateKey: %w", err)
	}
	if c.dialect == DialectReference {
		return errSecureRef
	}
	c.publicKey = pub
	c.dialect = DialectSpec
	return nil
}

// secureDialer checks a Dial's resolved Config: the server's key.
func (c *config) secureDialer() error {
	c.tokenKey = nil
	if c.token != nil && c.serverKey == nil {
		return errTokenInClear
	}
	if c.serverKey == nil {
		if c.privateKey != nil { // a Config shared with a server
			c.privateKey = nil
			c.maxDatagram += sealOverhead
		}
		return nil
	}
	c.privateKey = nil
	if len(c.serverKey) != KeySize {
		return fmt.Errorf("knet: Config.ServerKey: %w", errBadKey)
	}
	if _, err := ecdh.X25519().NewPublicKey(c.serverKey); err != nil {
		return fmt.Errorf("knet: Config.ServerKey: %w", err)
	}
	if c.dialect == DialectReference {
		return errSecureRef
	}
	if len(c.token) > maxTokenSize {
		return fmt.Errorf("knet: Config.Token of %d bytes, a connect token has at most %d", len(c.token), maxTokenSize)
	}
	// The connection ID takes room from every datagram too.
	c.maxDatagram -= cidSize
	return nil
}

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
	if _, content, ok := handshakeContent(b, idDisconnectAck); ok {
		// A refusal is in clear, its reason unauthenticated; it must at
		// least prove it answers our ConnectSyn (refusalProof).
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
		c.checkPath(now, p.from, size)
	}
	c.sess.handleSealed(now, b, fresh)
	if data, ok := c.sess.pathResponse(); ok {
		c.pathAnswered(p.from, data)
	}
	if atPeer && !c.sec.proven && !c.sess.client {
		c.proven()
	}
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

// Migration (SECURE.md, "Migration"): a server's connection follows its
// client to a new address once the client proved it receives there.
//
// A sealed datagram from an address the listener does not know finds its
// connection by the connection ID it carries (Listener.routeByID). If it
// authenticates, its content is taken like any other; if it is also the
// newest (highest packet number yet), the connection checks the address:
// a PathChallenge, 8 random bytes in a sealed datagram, goes there, and
// the connection moves when a sealed PathResponse with those bytes comes
// back from there. Until then everything else still goes to the old
// address, and the new one gets no more than amplification times the
// bytes of authenticated datagrams it sent (QUIC's rule, RFC 9000 8.1).

// Checking a new address (the path messages themselves are in
// session_path.go).
const (
	// amplification bounds what an unproven address gets: this many times
	// what it sent.
	amplification = 3
	// A PathChallenge goes only when a datagram comes from the address
	// checked (the address is not chased on a timer), and waits for its
	// answer an RTO, then two, then four at most (challengeBackoff
	// doublings). There is no cap on their number: the amplification
	// limit bounds what the address gets, and a client whose challenges
	// were lost must not be stranded at an address its NAT forgot.
	challengeBackoff = 2
	// challengeSize is a sealed datagram holding a PathChallenge: header,
	// message block header, the MessageID, the content, the tag.
	challengeSize = minHeaderSize + 2 + 1 + 1 + pathDataSize + sealOverhead
)

// pathCheck is the check of one new address of the client.
type pathCheck struct {
	to        netip.AddrPort // the address being checked; zero if none
	challenge [pathDataSize]byte
	in, out   int // bytes received from it (authenticated) and sent to it
	sends     int
	sentAt    time.Time
}

// due reports whether a PathChallenge may go now: the last one long
// enough ago (an rto, doubling with each one up to challengeBackoff
// times), and the address sent enough to earn it.
func (pc *pathCheck) due(now time.Time, rto time.Duration) bool {
	if pc.sends > 0 && now.Sub(pc.sentAt) < rto<<min(pc.sends-1, challengeBackoff) {
		return false
	}
	return pc.out+challengeSize <= amplification*pc.in
}

// checkPath runs after a datagram of size bytes on the wire, from the
// address from, authenticated on a server's connection.
func (c *Conn) checkPath(now time.Time, from netip.AddrPort, size int) {
	s := c.sec
	pc := &s.path
	switch {
	case from == c.raddr:
		if s.newest {
			// The client is where it was (a copy of its datagram,
			// racing it from elsewhere, started the check).
			*pc = pathCheck{}
		}
		return
	case pc.to == from:
		pc.in += size
	case s.newest:
		*pc = pathCheck{to: from, in: size}
		rand.Read(pc.challenge[:])
	default:
		// Late from an old address, or a copy of an older datagram:
		// its content counts, the connection stays.
		return
	}
	c.challenge(now)
}

// challenge sends the address being checked a PathChallenge, when one is
// due and the amplification limit allows.
func (c *Conn) challenge(now time.Time) {
	pc := &c.sec.path
	if !pc.due(now, c.sess.rto()) {
		return
	}
	var content [1 + pathDataSize]byte
	content[0] = pathChallenge
	copy(content[1:], pc.challenge[:])
	buf := make([]byte, 0, challengeSize)
	b := c.sess.pathChallenge(buf, content[:])
	if b == nil {
		return // no new datagram may go now (session.spanFull)
	}
	out := c.sess.lastOut()
	b, err := c.sec.seal(b, b, out.pn, out.fresh)
	if err != nil {
		c.sess.fail(err)
		return
	}
	if len(b) != challengeSize {
		panic("knet: a PathChallenge of the wrong size")
	}
	c.ep.write(b, pc.to)
	pc.out += len(b)
	pc.sends++
	pc.sentAt = now
	c.sec.challenges.Add(1)
}

// pathAnswered takes the PathResponse the session heard in a datagram
// from the address from: the connection moves there if it answers the
// challenge sent there.
func (c *Conn) pathAnswered(from netip.AddrPort, data [pathDataSize]byte) {
	pc := &c.sec.path
	if pc.sends == 0 || from != pc.to || data != pc.challenge {
		return
	}
	c.moveTo(from)
	*pc = pathCheck{}
}

// moveTo makes to the connection's address: the endpoint routes it here
// and everything goes there.
func (c *Conn) moveTo(to netip.AddrPort) {
	c.takeAddr(to)
	if c.isEstablished() {
		c.sec.migrations++ // a move of a connection being made is no migration
	}
	c.sess.moved(time.Now())
	c.proven()
	if l := c.cfg.logger; l != nil {
		l.Info("knet: connection moved", "remote", to)
	}
}

// takeAddr makes to the connection's address: the endpoint routes it here
// and everything goes there. Another connection there is stale: the
// client proved it is here; one still being made (an attempt someone
// started from that address, which only the client could complete) ends.
func (c *Conn) takeAddr(to netip.AddrPort) {
	ep := c.ep
	ep.mu.Lock()
	if ep.conns[c.raddr] == c {
		delete(ep.conns, c.raddr)
	}
	old := ep.conns[to]
	ep.conns[to] = c
	c.raddr = to
	ep.mu.Unlock()
	c.remote.Store(net.UDPAddrFromAddrPort(to))
	if old != nil && old != c && old.sec != nil && !old.isEstablished() {
		old.shutdown()
	}
}

// Listener side.

// newCID registers c under a new connection ID and returns it.
func (l *Listener) newCID(c *Conn) uint32 {
	l.cidMu.Lock()
	defer l.cidMu.Unlock()
	if l.cids == nil {
		l.cids = make(map[uint32]*Conn)
	}
	for {
		// Not a secret: it only names the connection whose keys a
		// datagram must then authenticate under.
		id := mrand.Uint32()
		if id != 0 && l.cids[id] == nil {
			l.cids[id] = c
			return id
		}
	}
}

// dropCID forgets c's connection ID.
func (l *Listener) dropCID(c *Conn) {
	if c.sec == nil || c.sec.cid == 0 {
		return
	}
	l.cidMu.Lock()
	if l.cids[c.sec.cid] == c {
		delete(l.cids, c.sec.cid)
	}
	l.cidMu.Unlock()
}

// routeByID hands a datagram from an address with no connection (or
// whose connection is not, unless nil) to the secure connection its
// connection ID names, and reports whether it did. The connection
// authenticates it; a clear ConnectSyn is never taken for one (it is a
// connection attempt).
func (l *Listener) routeByID(p *packet, not *Conn) bool {
	if l.cfg.privateKey == nil {
		return false
	}
	id, ok := sealedCID(p.b)
	if !ok {
		return false
	}
	l.cidMu.Lock()
	c := l.cids[id]
	l.cidMu.Unlock()
	if c == nil || c == not {
		return false
	}
	if syn, _ := isConnectSyn(p.b); syn {
		return false
	}
	c.push(p)
	return true
}
