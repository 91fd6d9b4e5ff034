package knet

import (
	"bytes"
	"crypto/aes"
	"crypto/cipher"
	"crypto/ecdh"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/flynn/noise"
)

// Secure sessions (Config.PrivateKey, Config.ServerKey): a Noise NK
// handshake carried in the ConnectSyn and ConnectSynAck contents, then
// every datagram sealed with AES-256-GCM, its header in clear as the
// associated data. See SECURE.md for the design, the datagram layout and
// what is left to do.
//
// This file holds the keys, the handshake, sealing and opening, packet
// numbers and the replay window, and the checks of a secure Config;
// secure_layer.go the layer between a connection's socket and its session
// (what a datagram in clear may be, what the session hears of it);
// migration.go the path checks, moves and connection IDs.

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
	errSecureCpp       = errors.New("knet: the reference dialect cannot be secure")
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
// connection's rounds, but ready, which Secure reads.
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
	ku         *keyUpdates // key updates (keyupdate.go); nil when off
	tap        sealTap     // tests only
	tapKey     [8]byte     // with tap, the send key's fingerprint
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

	// Spare connection IDs (cidrotation.go).
	rot cidRotation

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
	k, r := send.UnsafeKey(), recv.UnsafeKey()
	if s.send, err = newGCM(k); err != nil {
		return err
	}
	if s.tap != nil {
		s.tapKey = keyPrint(&k)
	}
	if s.recv, err = newGCM(r); err != nil {
		return err
	}
	if s.ku != nil {
		s.ku.start(k, r)
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
	if s.ku != nil {
		if err := s.ku.sealing(pn, fresh); err != nil {
			return nil, err
		}
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
	if err != nil || len(b)-ad < sealOverhead || ad > n && !s.openCID(binary.LittleEndian.Uint32(b[n:])) {
		s.invalid++
		return nil, false
	}
	pn := expandPacketNumber(s.h.packetID, s.replay.top)
	fresh, inWindow := s.replay.check(pn)
	if !inWindow || !fresh && !s.h.reliable {
		s.replays++
		return nil, false
	}
	pt, err = s.openSealed(b[ad:], pn, b[:ad])
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
	if c.nextPrivateKey != nil && c.privateKey == nil {
		return errNextKeyAlone
	}
	if c.privateKey == nil {
		return nil
	}
	pub, err := publicKeyOf(c.privateKey)
	if err != nil {
		return fmt.Errorf("knet: Config.PrivateKey: %w", err)
	}
	if c.dialect == DialectReference {
		return errSecureCpp
	}
	c.publicKey = pub
	c.dialect = DialectSpec
	return c.checkNextKey()
}

// secureDialer checks a Dial's resolved Config: the server's key.
func (c *config) secureDialer() error {
	c.tokenKey = nil
	if c.token != nil && c.serverKey == nil {
		return errTokenInClear
	}
	if c.serverKey == nil {
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
		return errSecureCpp
	}
	if len(c.token) > maxTokenSize {
		return fmt.Errorf("knet: Config.Token of %d bytes, a connect token has at most %d", len(c.token), maxTokenSize)
	}
	// The connection ID takes room from every datagram too.
	c.maxDatagram -= cidSize
	return nil
}
