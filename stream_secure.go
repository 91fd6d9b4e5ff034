package knet

import (
	"errors"
	"fmt"
	"slices"
	"time"
)

// Secure sessions over a stream (TCP, WebSocket): the same Noise NK
// handshake, keys and connect tokens as over UDP (secure.go), carried in
// knet hellos, then every frame sealed with the session's AES-256-GCM keys.
// See docs/PROTOCOL.md §9.4 and SECURE.md, "Over a stream".
//
// The client's first frame is a hello of kind helloSecure whose content is
// a secure ConnectSyn's (appendSecureSyn, no cookie: Noise message 1,
// carrying the connect token and the ConnectPayload). The server answers
// with a hello of kind helloSecureAccept whose content is what writeSynAck
// makes (Noise message 2, carrying a connection ID of 0 and the Admit
// reply), or with a refusal in clear (helloRefuse, as a plaintext server's).
// Every later frame, in each direction, is sealed:
//
//	size      VLE-1.7/1.7/16, in clear: the bytes after this field
//	sealed    AES-256-GCM of (MessageID VLE, payload), then the 16-byte tag
//
// The nonce is the frame's number in its direction, counted from 0 by both
// ends (a stream is ordered and lossless: nothing on the wire), as Noise's
// AESGCM nonce (nonceFor). No associated data: GCM authenticates the
// ciphertext's length, hence the size field's value. A frame that does not
// open ends the connection: a stream cannot skip a frame and resynchronise,
// and a frame dropped, replayed or moved by a relay shifts every nonce
// after it.

// The knet hello kinds of a secure session (see helloClient).
const (
	helloSecure       = 5 // the client's first frame; content: a secure ConnectSyn's
	helloSecureAccept = 6 // the server's answer; content: Noise message 2
)

var (
	errStreamOpen       = errors.New("knet: a sealed frame did not authenticate (tampered with, replayed, reordered or another key)")
	errStreamSealedSize = errors.New("knet: a sealed frame shorter than its tag")
	errStreamNotSecure  = errors.New("knet: this server has no secure sessions (Config.PrivateKey): it takes no secure hello")
	// errKeyExchangeLimited ends, unanswered, a stream whose source IP
	// address had cost as many key exchanges as a UDP one may
	// (RateLimitedHandshakes).
	errKeyExchangeLimited = errors.New("knet: too many key exchanges from this address")
)

// streamSeal seals and opens a secure stream's frames with the keys of its
// handshake (sec.send, sec.recv), each direction's nonce a frame counter.
type streamSeal struct {
	sec       *secureState
	sendN     uint64 // the next frame's number, each way
	recvN     uint64
	sendNonce [12]byte
	recvNonce [12]byte
	// Key updates (keyupdate_stream.go): the time bound passed; the
	// update signal is being sealed; the number of the frame after the
	// peer's last signal.
	updateDue, updating bool
	lastUpdate          uint64
}

// appendFrame appends a sealed frame carrying message id with payload.
func (z *streamSeal) appendFrame(b []byte, id uint32, payload []byte) ([]byte, error) {
	if z.sendN == ^uint64(0) {
		return b, fmt.Errorf("%w: the frame counter would wrap", errNonceReuse)
	}
	if !z.updating {
		var err error
		if b, err = z.updateSend(b); err != nil {
			return b, err
		}
	}
	size := sizeVLE32(id) + len(payload) + sealOverhead
	if size > maxVLE32 {
		return b, errTCPFrameTooLarge
	}
	b = appendVLE32(b, uint32(size))
	start := len(b)
	b = appendVLE32(b, id)
	b = append(b, payload...)
	b = slices.Grow(b, sealOverhead)
	pt := b[start:]
	n := z.sendN
	if k := z.sec.ku; k != nil {
		if err := k.sealing(n, true); err != nil {
			return b[:start-sizeVLE32(uint32(size))], err
		}
	}
	z.sendN++
	if z.sec.tap != nil {
		z.sec.tap(z.sec.tapKey, n, pt)
	}
	ct := z.sec.send.Seal(pt[:0], nonceFor(&z.sendNonce, n), pt, nil)
	return b[:start+len(ct)], nil
}

// open authenticates and decrypts a sealed frame's body in place, and
// returns its MessageID and payload.
func (z *streamSeal) open(body []byte) (id uint32, payload []byte, err error) {
	if len(body) < sealOverhead+1 {
		return 0, nil, errStreamSealedSize
	}
	n := z.recvN
	pt, err := z.sec.recv.Open(body[:0], nonceFor(&z.recvNonce, n), body, nil)
	if err != nil {
		return 0, nil, errStreamOpen
	}
	z.recvN++
	id, k := consumeVLE32(pt)
	if k < 0 {
		return 0, nil, errTCPFrameID
	}
	return id, pt[k:], nil
}

// reseal seals the plaintext frames in b (appendTCPFrame's) one by one into
// dst: control frames are queued in clear, and sealed in the order they
// are written.
func (z *streamSeal) reseal(dst, b []byte) ([]byte, error) {
	for len(b) > 0 {
		id, payload, n, err := parseTCPFrame(b, maxVLE32)
		if err != nil || n == 0 {
			return dst, fmt.Errorf("knet: a control frame of our own does not parse: %v", err)
		}
		if dst, err = z.appendFrame(dst, id, payload); err != nil {
			return dst, err
		}
		b = b[n:]
	}
	return dst, nil
}

// parseSealedFrame is parseTCPFrame for a sealed frame: the body after the
// size field is returned whole (its MessageID is sealed inside), and the
// limit is the plaintext's plus the tag.
func parseSealedFrame(b []byte, maxSize int) (body []byte, n int, err error) {
	size, k := consumeVLE32(b)
	if k < 0 {
		return nil, 0, nil
	}
	if size == 0 {
		return nil, 0, errTCPFrameSize0
	}
	if int64(size) > int64(maxSize)+sealOverhead {
		return nil, 0, fmt.Errorf("%w: size %d, the limit %d", errTCPFrameTooLarge, size, maxSize+sealOverhead)
	}
	end := k + int(size)
	if len(b) < end {
		return nil, 0, nil
	}
	return b[k:end:end], end, nil
}

// startSealing seals every frame after those already queued (in clear:
// the handshake's hellos), and opens every frame after the one just read.
func (s *streamSession) startSealing(sec *secureState) {
	s.out = append(s.out, s.ctrl...)
	s.ctrl = s.ctrl[:0]
	s.seal = &streamSeal{sec: sec}
	s.fr.sealed = true
	s.announceKeyUpdates(sec)
}

// streamSecureAnswer reads the server's answer to a secure client's hello:
// Noise message 2, which proves the server holds the private key of
// Config.ServerKey and gives the keys, or a refusal. Anything else (a
// plaintext server's answer) fails the handshake.
func (c *Conn) streamSecureAnswer(now time.Time, knet bool, kind byte, content []byte) {
	s := c.st.sess
	switch {
	case knet && kind == helloSecureAccept:
		reply, err := c.sec.readSynAck(content)
		if err != nil {
			s.stats.InvalidDatagrams++
			s.err = err
			return
		}
		s.knet = true
		c.state.mu.Lock()
		c.state.syn = append([]byte(nil), c.cfg.connectPayload...)
		c.state.synAck = append([]byte(nil), reply...)
		c.state.mu.Unlock()
		s.startSealing(c.sec)
		c.st.phase = phaseOpen
		// A sealed ping at once: the server establishes the
		// connection on the first frame that opens under the keys.
		s.nextPing = now
		s.open(now, true)
		c.streamOffer()
	case knet && kind == helloRefuse:
		s.err = refusedErr(content)
	default:
		s.err = fmt.Errorf("%w: the server answered in clear (a server without Config.PrivateKey?)", ErrHandshakeFailed)
	}
}
