package knet

import (
	"fmt"
	"time"
)

// Key updates over a stream (keyupdate.go for the rules; docs/PROTOCOL.md
// §9.7). Frames arrive in order, so the sender says where its next key
// starts: a sealed knet hello of kind helloPath whose content is the path
// message pathKeyUpdate, sealed under the old key; every frame after it is
// sealed under the next. The frame counter, the nonce, runs on across
// keys. The receiver takes the next key on that frame and erases the old
// one at once: no frame sealed under it can come after. Each side
// announces key updates once, in a helloPath holding pathKeyUpdates, first
// thing after the handshake; a side updates only after the peer's
// announcement came.

// helloPath is the knet hello that carries a path message over a stream:
// content u8 kind, then the kind's bytes. A knet peer of before it drops
// the hello (a kind past helloCloseCode reads as no hello: an unsolicited
// PingReply). Kinds are those of UDP's sealed path messages.
const helloPath = 8

// announceKeyUpdates queues the announcement, when key updates are on.
func (s *streamSession) announceKeyUpdates(sec *secureState) {
	if sec.ku != nil {
		s.sendHello(helloPath, []byte{pathKeyUpdates, kuSupport})
	}
}

// pathHello acts on a helloPath: the peer's announcement, or its key
// update signal. Either in clear, before the keys, is ignored; a key
// update from a peer to which we announced none, or one right after
// another with no frame in between (a peer updating faster than any
// interval), ends the connection: the frames after it cannot be read.
func (s *streamSession) pathHello(content []byte) {
	if s.seal == nil || len(content) < 1 {
		return
	}
	k := s.seal.sec.ku
	switch content[0] {
	case pathKeyUpdates:
		if k != nil && len(content) >= 2 && content[1]&kuSupport != 0 {
			k.peer = true
		}
	case pathKeyUpdate:
		switch {
		case k == nil:
			s.err = &ProtocolError{Err: fmt.Errorf("knet: a key update, never announced")}
		case s.seal.recvN == s.seal.lastUpdate+1 && k.recvPhase > 0:
			k.tooFast++
			s.err = &ProtocolError{Err: errKeyUpdateTooFast}
		default:
			s.seal.rekeyRecv()
		}
		if s.err != nil {
			s.stats.ProtocolErrors++
		}
	}
}

// rekeyRecv takes the peer's next key for the frames after this one, and
// erases the old.
func (z *streamSeal) rekeyRecv() {
	k := z.sec.ku
	n := nextKey(&k.recvKey)
	aead, err := newGCM(n)
	if err != nil {
		panic("knet: AES-256 refused a 32-byte key: " + err.Error())
	}
	clear(k.recvKey[:])
	k.recvKey = n
	clear(n[:])
	z.sec.recv = aead
	k.recvPhase++
	k.updatesIn++
	z.lastUpdate = z.recvN
}

// tick gives the sending side the time, for KeyUpdateTime.
func (z *streamSeal) tick(now time.Time) {
	if k := z.sec.ku; k != nil && k.sendDue(now) {
		z.updateDue = true
	}
}

// updateSend, before a frame is sealed, seals the key update signal and
// takes the next key when the current one is due for replacement (and
// the peer takes updates).
func (z *streamSeal) updateSend(b []byte) ([]byte, error) {
	k := z.sec.ku
	if k == nil || !k.peer || !z.updateDue && k.sendCount < k.packets {
		return b, nil
	}
	z.updateDue = false
	z.updating = true
	b, err := z.appendFrame(b, idPingReply, appendStreamHello(nil, helloPath, []byte{pathKeyUpdate}))
	z.updating = false
	if err != nil {
		return b, err
	}
	return b, k.rekeySend(z.sec, time.Time{})
}
