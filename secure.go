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

	// A client's, for a listener asking for a cookie: the handshake
	// message, the last cookie received, how many were answered at once.
	// A server keeps the client's handshake message too (a copy).
	msg1    []byte
	cookie  []byte
	retries int

	send, recv cipher.AEAD
	sendNonce  [12]byte
	recvNonce  [12]byte
	sendTop    uint64 // highest packet number sealed
	replay     replayWindow
	h          header // parsed headers, reused

	// initiator: the client, whose sealed datagrams carry cid; the
	// server's carry none (its address does not change).
	initiator bool
	cid       uint32    // connection ID, the server's choice; 0 until known
	newest    bool      // the last datagram open returned had the highest packet number so far
	path      pathCheck // server: a new client address being checked

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
	hs, err := noise.NewHandshakeState(noise.Config{
		CipherSuite: noiseSuite,
		Pattern:     noise.HandshakeNK,
		Initiator:   true,
		Prologue:    noisePrologue,
		PeerStatic:  serverKey,
	})
	if err != nil {
		return nil, nil, err
	}
	msg1, _, _, err := hs.WriteMessage(nil, appendSynPayload(nil, token, payload))
	if err != nil {
		return nil, nil, err
	}
	return &secureState{hs: hs, payload: payload, msg1: msg1, initiator: true}, appendSecureSyn(nil, nil, msg1), nil
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
func (s *secureState) readSynAck(msg2 []byte) ([]byte, error) {
	if s.hs == nil {
		return nil, ErrHandshakeFailed
	}
	payload, toServer, toClient, err := s.hs.ReadMessage(nil, msg2)
	s.hs = nil
	if err != nil {
		return nil, fmt.Errorf("%w: the server did not prove it holds the private key of Config.ServerKey", ErrHandshakeFailed)
	}
	if len(payload) < cidSize {
		return nil, fmt.Errorf("%w: no connection ID in the server's answer", ErrHandshakeFailed)
	}
	s.cid = binary.LittleEndian.Uint32(payload)
	reply := payload[cidSize:]
	if err := s.keys(toServer, toClient); err != nil {
		return nil, err
	}
	s.reply = reply
	return reply, nil
}

// keys sets up the AEAD of each direction from the Noise Split, whose
// keys feed the standard library's AES-GCM (hardware accelerated, and
// sealing without allocating, the nonce in s).
func (s *secureState) keys(send, recv *noise.CipherState) error {
	var err error
	if s.send, err = newGCM(send.UnsafeKey()); err != nil {
		return err
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
func (s *secureState) seal(dst, b []byte) ([]byte, error) {
	n, err := parseHeader(b, &s.h)
	if err != nil {
		return nil, err
	}
	pn := expandPacketNumber(s.h.packetID, s.sendTop)
	s.sendTop = max(s.sendTop, pn)
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
func (s *secureState) open(b []byte) []byte {
	s.newest = false
	n, err := parseHeader(b, &s.h)
	ad := n
	if !s.initiator {
		ad += cidSize
	}
	if err != nil || len(b)-ad < sealOverhead || ad > n && binary.LittleEndian.Uint32(b[n:]) != s.cid {
		s.invalid++
		return nil
	}
	pn := expandPacketNumber(s.h.packetID, s.replay.top)
	fresh, inWindow := s.replay.check(pn)
	if !inWindow || !fresh && !s.h.reliable {
		s.replays++
		return nil
	}
	pt, err := s.recv.Open(b[ad:ad], nonceFor(&s.recvNonce, pn), b[ad:], b[:ad])
	if err != nil {
		s.invalid++
		return nil
	}
	s.newest = !s.replay.started || pn > s.replay.top
	s.replay.mark(pn)
	if ad > n {
		// Drop the ID: the header moves up against the plaintext.
		copy(b[ad-n:ad], b[:n])
		b = b[ad-n:]
	}
	return b[:n+len(pt)]
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

// Conn side.

// sealOut encrypts an outgoing datagram once the connection is open
// securely; the handshake's datagrams (ConnectSyn, ConnectSynAck, a
// refusal) go in clear, their contents being the Noise messages. spare is
// a buffer of the write batch the datagram may be sealed into, when b is
// the session's own (kept for retransmission, so never sealed in place).
func (c *Conn) sealOut(b, spare []byte) []byte {
	s := c.sec
	if !s.ready.Load() || !c.sess.wasOpen {
		return b
	}
	dst := spare[:0]
	if &spare[:1][0] == &b[0] {
		dst = b
	}
	out, err := s.seal(dst, b)
	if err != nil {
		// The session built a datagram we cannot parse: a bug, and
		// nothing may go out in clear.
		panic("knet: sealing a malformed datagram: " + err.Error())
	}
	return out
}

// openIn authenticates and decrypts an incoming datagram from the address
// from, or says to drop it (nil). Before the handshake completes only the
// handshake's clear datagrams are taken; after it, only sealed ones, but
// for a client's ConnectSyn sent again while the server's ConnectSynAck
// is on its way (the session answers it with the ConnectSynAck again).
// Clear datagrams are taken only from the connection's address: from
// another, only a sealed one can be a client that moved.
func (c *Conn) openIn(b []byte, from netip.AddrPort) []byte {
	s := c.sec
	client := c.ep.l == nil
	if from != c.raddr && !s.ready.Load() {
		s.invalid++
		return nil
	}
	if !s.ready.Load() {
		var ok bool
		if client {
			if retry, _ := holds(b, idRetry); retry {
				c.takeCookie(b)
				return nil
			}
			ok, _ = holds(b, idConnectSynAck)
			if !ok {
				ok, _ = holds(b, idDisconnectAck)
			}
		} else {
			ok, _ = holds(b, idConnectSyn)
		}
		if !ok {
			s.invalid++
			return nil
		}
		return b
	}
	if !client && !c.sess.wasOpen && from == c.raddr {
		// The client sent its ConnectSyn again, our ConnectSynAck not
		// yet with it: the session answers with the ConnectSynAck again.
		if syn, _ := holds(b, idConnectSyn); syn {
			return b
		}
	}
	return s.open(b)
}

// takeSecure hands the session a datagram of a secure connection, if it
// authenticates (or is one of the handshake's clear ones), and on a
// server checks where it came from.
func (c *Conn) takeSecure(now time.Time, p *packet) {
	size := len(p.b)
	b := c.openIn(p.b, p.from)
	switch {
	case b == nil:
	case c.sess.client:
		c.sess.handleDatagram(now, b)
		c.finishClientHandshake()
	default:
		if c.sec.ready.Load() {
			c.checkPath(now, p.from, size)
		}
		c.sess.handleDatagram(now, b)
		if c.sess.pathGot {
			c.sess.pathGot = false
			c.pathAnswered(p.from)
		}
	}
}

// takeCookie takes the cookie of a listener under load (a Retry
// datagram, b): the ConnectSyn goes again at once, echoing it, for the
// first maxRetries different cookies; later ones ride the next timed
// ConnectSyn. A forged Retry can cost the client a few ConnectSyns and
// its cookie, which the next genuine one replaces.
func (c *Conn) takeCookie(b []byte) {
	s := c.sec
	var cookie []byte
	var h header
	scanDatagram(b, &h, func(m message) {
		if !m.fragment && m.id == idRetry {
			cookie = m.payload
		}
	})
	if len(cookie) != cookieSize || c.sess.state != stateSyn {
		s.invalid++
		return
	}
	if bytes.Equal(cookie, s.cookie) {
		return // the answer to a ConnectSyn sent again
	}
	s.cookie = append(s.cookie[:0], cookie...)
	c.sess.syn = appendSecureSyn(nil, s.cookie, s.msg1)
	if s.retries < maxRetries {
		s.retries++
		c.sess.needSyn = true
	}
}

// finishClientHandshake reads the ConnectSynAck's content, once the
// session took one: the server's proof, and the keys.
func (c *Conn) finishClientHandshake() {
	s := c.sec
	if s.ready.Load() || !c.sess.wasOpen {
		return
	}
	reply, err := s.readSynAck(c.sess.synAck)
	if err != nil {
		c.sess.events &^= evEstablished
		c.sess.fail(err)
		return
	}
	c.sess.syn, c.sess.synAck = s.payload, reply
	c.sess.pathMsgs = true
}

// secureRefusal maps a refusal for a failed handshake to
// ErrHandshakeFailed, and one for the connect token to ErrTokenRejected,
// with the refusal.
func secureRefusal(err error) error {
	var re *RefusedError
	switch {
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

// Path messages: MessageID 0 (idPath, reserved by the spec and ignored by
// kNet receivers), content u8 kind, then 8 bytes.
const (
	pathChallenge = 1
	pathResponse  = 2
	pathDataSize  = 8
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
	if !pc.due(now, c.sess.loss.rto()) {
		return
	}
	var content [1 + pathDataSize]byte
	content[0] = pathChallenge
	copy(content[1:], pc.challenge[:])
	buf := make([]byte, 0, challengeSize)
	b := c.sess.control(buf, idPath, content[:])
	b, err := c.sec.seal(b, b)
	if err != nil || len(b) != challengeSize {
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
func (c *Conn) pathAnswered(from netip.AddrPort) {
	pc := &c.sec.path
	if pc.sends == 0 || from != pc.to || c.sess.pathHeard != pc.challenge {
		return
	}
	c.moveTo(from)
	*pc = pathCheck{}
}

// moveTo makes to the connection's address: the endpoint routes it here
// and everything goes there.
func (c *Conn) moveTo(to netip.AddrPort) {
	ep := c.ep
	ep.mu.Lock()
	if ep.conns[c.raddr] == c {
		delete(ep.conns, c.raddr)
	}
	// Another connection there is stale: the client proved it is here.
	ep.conns[to] = c
	c.raddr = to
	ep.mu.Unlock()
	c.remote.Store(net.UDPAddrFromAddrPort(to))
	c.sec.migrations++
	c.sess.ackNow = true // news for the client at once, from here
	// What is in flight went to the old address, which the client left:
	// it goes again now rather than at the probe timeouts (a second and
	// more before the connection has a round-trip time).
	if !c.sess.loss.resendAll(time.Now()) {
		c.sess.fail(ErrRetransmitLimit)
	}
	if l := c.cfg.logger; l != nil {
		l.Info("knet: connection moved", "remote", to)
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

// routeByID hands a datagram from an address with no connection to the
// secure connection its connection ID names, and reports whether it did.
// The connection authenticates it; a clear ConnectSyn is never taken
// for one (it is a connection attempt).
func (l *Listener) routeByID(p *packet) bool {
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
	if c == nil {
		return false
	}
	if syn, _ := isConnectSyn(p.b); syn {
		return false
	}
	c.push(p)
	return true
}
