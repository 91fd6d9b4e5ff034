//go:build !js

package knet

import (
	"context"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// rotationListener is a secure listener on UDP, TCP and WebSocket with the
// keys old and next, echoing, and a dial function over each transport.
func rotationListener(t *testing.T, old, next []byte) (*Listener, func(ctx context.Context, tr Transport, serverKey []byte) (*Conn, error)) {
	t.Helper()
	scfg := testConfig()
	scfg.PrivateKey, scfg.NextPrivateKey = old, next
	scfg.TCP = true
	mux := http.NewServeMux()
	scfg.HTTP = mux
	l := listen(t, scfg)
	mux.Handle("/knet", l.WebSocketHandler())
	serveEcho(t, l)
	addr := l.Addr().String()
	return l, func(ctx context.Context, tr Transport, serverKey []byte) (*Conn, error) {
		ccfg := testConfig()
		ccfg.ServerKey = serverKey
		switch tr {
		case TransportTCP:
			return Dial(ctx, "tcp", addr, ccfg)
		case TransportWebSocket:
			return DialWebSocket(ctx, "ws://"+addr+"/knet", ccfg)
		}
		return Dial(ctx, "udp", addr, ccfg)
	}
}

var rotationTransports = []Transport{TransportUDP, TransportTCP, TransportWebSocket}

// TestServerKeyRotationOverlap: a listener holding the current and the
// next key admits clients given either public key, over UDP, TCP and
// WebSocket; once the old key is retired (SetKeys), a client with it is
// refused with ErrHandshakeFailed, one with the new key connects, and a
// connection made under the old key carries on.
func TestServerKeyRotationOverlap(t *testing.T) {
	oldPriv, oldPub, err := GenerateKey()
	require.NoError(t, err)
	newPriv, newPub, err := GenerateKey()
	require.NoError(t, err)
	l, dialOn := rotationListener(t, oldPriv, newPriv)
	cur, next := l.PublicKeys()
	assert.Equal(t, oldPub, cur)
	assert.Equal(t, newPub, next)
	ctx := within(t, 30*time.Second)

	var underOld []*Conn
	for _, tr := range rotationTransports {
		for i, key := range [][]byte{oldPub, newPub} {
			c, err := dialOn(ctx, tr, key)
			require.NoError(t, err, "%v, key %d, during the overlap", tr, i)
			assert.True(t, c.Secure())
			echoOnce(t, c, Message{ID: 6, Payload: []byte("overlap"), Reliable: true})
			if i == 0 {
				underOld = append(underOld, c)
			} else {
				c.Close()
			}
		}
	}

	require.NoError(t, l.SetKeys(newPriv, nil))
	cur, next = l.PublicKeys()
	assert.Equal(t, newPub, cur)
	assert.Nil(t, next)
	for _, tr := range rotationTransports {
		_, err := dialOn(within(t, 10*time.Second), tr, oldPub)
		require.Error(t, err, "%v: the retired key", tr)
		assert.ErrorIs(t, err, ErrHandshakeFailed, "%v", tr)
		assert.Contains(t, err.Error(), "ServerKey", "%v: the error says which setting to look at", tr)
		c, err := dialOn(ctx, tr, newPub)
		require.NoError(t, err, "%v: the new key", tr)
		echoOnce(t, c, Message{ID: 6, Payload: []byte("after"), Reliable: true})
		c.Close()
	}
	for i, c := range underOld {
		got := echoOnce(t, c, Message{ID: 6, Payload: []byte("still here"), Reliable: true})
		assert.Equal(t, "still here", string(got.Payload), "connection %d made under the retired key", i)
		c.Close()
	}
}

// TestServerKeyRotationNothingRefused: clients connect throughout a
// rotation done as docs/secure-sessions.md says (hold both keys, publish
// the new one, retire the old one once no client uses it any more), each
// with the key published when it starts, over UDP and TCP: none is
// refused.
func TestServerKeyRotationNothingRefused(t *testing.T) {
	oldPriv, oldPub, err := GenerateKey()
	require.NoError(t, err)
	newPriv, newPub, err := GenerateKey()
	require.NoError(t, err)
	l, dialOn := rotationListener(t, oldPriv, nil)

	// The backend: the key it hands clients, and the dials with the
	// old one under way.
	var mu sync.Mutex
	published := oldPub
	var oldDials sync.WaitGroup
	var failures atomic.Int64
	var firstErr atomic.Value
	done := make(chan struct{}, 1<<16)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			tr := []Transport{TransportUDP, TransportTCP}[w%2]
			for {
				select {
				case <-stop:
					return
				default:
				}
				mu.Lock()
				key := published
				old := &key[0] == &oldPub[0]
				if old {
					oldDials.Add(1)
				}
				mu.Unlock()
				c, err := dialOn(within(t, 10*time.Second), tr, key)
				if err == nil {
					if err = c.Send(Message{ID: 6, Payload: []byte("x"), Reliable: true}); err == nil {
						_, err = c.Receive(within(t, 5*time.Second))
					}
					c.Close()
				}
				if err != nil {
					failures.Add(1)
					firstErr.CompareAndSwap(nil, err)
				}
				if old {
					oldDials.Done()
				}
				done <- struct{}{}
			}
		})
	}
	waitDials := func(n int) {
		t.Helper()
		timeout := time.After(20 * time.Second)
		for range n {
			select {
			case <-done:
			case <-timeout:
				t.Fatal("the clients stalled")
			}
		}
	}
	waitDials(8)
	// 1. The listener takes the next key as well.
	require.NoError(t, l.SetKeys(oldPriv, newPriv))
	waitDials(8)
	// 2. The backend hands out the new key.
	mu.Lock()
	published = newPub
	mu.Unlock()
	// 3. The overlap: until no client is left with the old key.
	overlap := make(chan struct{})
	go func() { oldDials.Wait(); close(overlap) }()
	select {
	case <-overlap:
	case <-time.After(20 * time.Second):
		t.Fatal("clients with the old key never finished")
	}
	// 4. The old key is retired.
	require.NoError(t, l.SetKeys(newPriv, nil))
	waitDials(8)
	close(stop)
	wg.Wait()
	if err, _ := firstErr.Load().(error); err != nil {
		t.Errorf("first failure: %v", err)
	}
	assert.Zero(t, failures.Load())
	assert.Zero(t, l.Stats().RefusedAttempts)
}

// TestServerKeyRotationAttackRetiredKey: a ConnectSyn under a retired key
// costs the key exchanges of the keys held and gets the usual refusal,
// no larger than what came (no amplification), and nothing stays
// pending; during the overlap, a message 1 no key reads is refused the
// same way.
func TestServerKeyRotationAttackRetiredKey(t *testing.T) {
	oldPriv, oldPub, err := GenerateKey()
	require.NoError(t, err)
	newPriv, _, err := GenerateKey()
	require.NoError(t, err)
	scfg := testConfig()
	scfg.PrivateKey, scfg.NextPrivateKey = oldPriv, newPriv
	scfg.CookieThreshold = 1000
	l := listen(t, scfg)
	require.NoError(t, l.SetKeys(newPriv, nil))

	for i, msg1 := range [][]byte{synUnder(t, oldPub), nil} {
		var d []byte
		if msg1 == nil {
			d, msg1 = garbageSyn(nil)
		} else {
			d = rebuildSyn(nil, msg1)
		}
		if i == 1 {
			require.NoError(t, l.SetKeys(newPriv, oldPriv)) // two keys held, neither reads it
		}
		before := l.Stats()
		inBefore, outBefore := l.unprovenIn.Load(), l.unprovenOut.Load()
		f := newFlooder(t, l.Addr())
		r := f.send(t, d)
		_, reason, ok := handshakeContent(r, idDisconnectAck)
		require.True(t, ok, "case %d: the usual refusal", i)
		got, proven := splitRefusalProof(reason, msg1)
		require.True(t, proven, "case %d: the refusal proves it answers the ConnectSyn", i)
		assert.Equal(t, ErrHandshakeFailed.Error(), string(got), "case %d", i)
		assert.LessOrEqual(t, len(r), len(d), "case %d: amplification", i)
		assert.LessOrEqual(t, l.unprovenOut.Load()-outBefore, l.unprovenIn.Load()-inBefore, "case %d", i)
		st := l.Stats()
		assert.Equal(t, uint64(1), st.KeyExchanges-before.KeyExchanges, "case %d: one attempt counted", i)
		assert.Equal(t, uint64(1), st.RefusedAttempts-before.RefusedAttempts, "case %d", i)
		assert.Zero(t, st.Pending, "case %d", i)
		probe(t, l)
		f.quiet(t)
	}
}

// synUnder returns a client's Noise message 1 to the server key pub.
func synUnder(t *testing.T, pub []byte) []byte {
	t.Helper()
	s, _, err := newClientSecure(pub, nil, []byte("hello"))
	require.NoError(t, err)
	return s.msg1
}

// TestServerKeyRotationConfig: the next key needs a current one, and both
// must be keys; SetKeys refuses a plaintext listener and a nil current
// key.
func TestServerKeyRotationConfig(t *testing.T) {
	priv, _, err := GenerateKey()
	require.NoError(t, err)
	cfg := testConfig()
	cfg.NextPrivateKey = priv
	_, err = Listen("udp", "127.0.0.1:0", cfg)
	assert.ErrorIs(t, err, errNextKeyAlone)
	cfg.PrivateKey = priv
	cfg.NextPrivateKey = []byte("short")
	_, err = Listen("udp", "127.0.0.1:0", cfg)
	assert.ErrorContains(t, err, "NextPrivateKey")

	plain := listen(t, testConfig())
	assert.ErrorIs(t, plain.SetKeys(priv, nil), errNotSecure)
	cur, next := plain.PublicKeys()
	assert.Nil(t, cur)
	assert.Nil(t, next)

	cfg.NextPrivateKey = nil
	l := listen(t, cfg)
	assert.ErrorIs(t, l.SetKeys(nil, priv), errNoCurrentKey)
	assert.Error(t, l.SetKeys(priv, []byte("short")))
}

// BenchmarkServerKeyRotationReadSyn: reading a message 1 under the
// current key (one trial), under the next (two), and under neither (two,
// then the refusal).
func BenchmarkServerKeyRotationReadSyn(b *testing.B) {
	cur, curPub, _ := GenerateKey()
	next, nextPub, _ := GenerateKey()
	_, otherPub, _ := GenerateKey()
	l := &Listener{}
	ks, err := newServerKeys(cur, next)
	require.NoError(b, err)
	l.keys.Store(ks)
	for _, c := range []struct {
		name string
		pub  []byte
	}{{"current", curPub}, {"next", nextPub}, {"neither", otherPub}} {
		s, _, err := newClientSecure(c.pub, nil, []byte("hello"))
		require.NoError(b, err)
		b.Run(c.name, func(b *testing.B) {
			for b.Loop() {
				l.readSyn(s.msg1)
			}
		})
	}
}
