package knet

import (
	"bytes"
	"errors"
	"fmt"
)

// Server key rotation (Config.NextPrivateKey, Listener.SetKeys): a secure
// Listener holds one or two static private keys and reads a client's
// Noise message 1 under each in turn until one authenticates it. Noise NK's
// message 1 is an ephemeral public key and a payload encrypted under a key
// mixed from the ephemeral key and the responder's static key; nothing in
// it says which static key the client meant, so the listener tries: the
// current key first (most clients have it), then the next. A message 1 no
// key reads costs two key exchanges instead of one, and is refused as
// before (ErrHandshakeFailed, through refuseUnproven), so the rules on
// unproven addresses apply unchanged. See "Rotating the server's key" in
// docs/secure-sessions.md for the procedure.

var (
	errNextKeyAlone = errors.New("knet: Config.NextPrivateKey needs Config.PrivateKey: the next key is a secure listener's second")
	errNotSecure    = errors.New("knet: not a secure listener (Config.PrivateKey): it has no keys to change")
	errNoCurrentKey = errors.New("knet: Listener.SetKeys needs a current key: a secure listener cannot become a plaintext one")
)

// serverKeys are the static key pairs a secure Listener reads handshakes
// under: the current one, then the next one if any. Never changed once
// stored: SetKeys stores another.
type serverKeys struct {
	pairs []serverKey
}

type serverKey struct{ private, public []byte }

// checkNextKey checks a Listener's Config.NextPrivateKey.
func (c *config) checkNextKey() error {
	if c.nextPrivateKey == nil {
		return nil
	}
	if _, err := publicKeyOf(c.nextPrivateKey); err != nil {
		return fmt.Errorf("knet: Config.NextPrivateKey: %w", err)
	}
	return nil
}

// newServerKeys returns the key pairs of current and next (nil: none).
func newServerKeys(current, next []byte) (*serverKeys, error) {
	if current == nil {
		return nil, errNoCurrentKey
	}
	ks := &serverKeys{}
	for i, priv := range [][]byte{current, next} {
		if priv == nil {
			continue
		}
		pub, err := publicKeyOf(priv)
		if err != nil {
			return nil, fmt.Errorf("knet: %s key: %w", [...]string{"current", "next"}[i], err)
		}
		if len(ks.pairs) > 0 && bytes.Equal(pub, ks.pairs[0].public) {
			continue // the same key twice: one trial is enough
		}
		ks.pairs = append(ks.pairs, serverKey{bytes.Clone(priv), pub})
	}
	return ks, nil
}

// SetKeys replaces the static private keys a secure Listener
// (Config.PrivateKey) accepts handshakes under: current, and next, a
// second key (nil for none), as Config.PrivateKey and
// Config.NextPrivateKey. Handshakes read from then on use the new keys;
// connections already made keep theirs (their session keys owe nothing to
// the static key once made). A rotation, as docs/secure-sessions.md
// describes it: SetKeys(old, new), publish new's public key to the
// clients, wait until they all have it, then SetKeys(new, nil). A client
// whose Config.ServerKey is a key the Listener no longer holds fails Dial
// with ErrHandshakeFailed. It fails for a plaintext Listener, a nil
// current key, or a key that is no X25519 private key.
func (l *Listener) SetKeys(current, next []byte) error {
	if l.cfg.privateKey == nil {
		return errNotSecure
	}
	ks, err := newServerKeys(current, next)
	if err != nil {
		return err
	}
	l.keys.Store(ks)
	return nil
}

// PublicKeys returns the public keys of the static keys the Listener
// accepts handshakes under: the current one, and the next one (nil if
// none); both nil for a plaintext Listener. They are what a backend
// hands its clients as Config.ServerKey.
func (l *Listener) PublicKeys() (current, next []byte) {
	ks := l.keys.Load()
	if ks == nil {
		return nil, nil
	}
	current = bytes.Clone(ks.pairs[0].public)
	if len(ks.pairs) > 1 {
		next = bytes.Clone(ks.pairs[1].public)
	}
	return current, next
}

// readSyn reads a client's Noise message 1 under each of the listener's
// keys until one authenticates it, and returns the responder's state and
// the payload. sec is nil only when no key exchange ran (a state could
// not be made); err is ErrHandshakeFailed when no key read msg1.
func (l *Listener) readSyn(msg1 []byte) (sec *secureState, payload []byte, err error) {
	ks := l.keys.Load()
	if ks == nil {
		return nil, nil, errNotSecure
	}
	for _, k := range ks.pairs {
		s, err := newServerSecure(k.private, k.public)
		if err != nil {
			return sec, nil, err
		}
		sec = s
		if payload, err = s.readSyn(msg1); err == nil {
			return s, payload, nil
		}
	}
	return sec, nil, ErrHandshakeFailed
}
