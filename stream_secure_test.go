//go:build !js

package knet

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Secure sessions over TCP (stream_secure.go), end to end on loopback.

// tcpRelay passes TCP connections to a server, frame by frame (it reads
// the size fields, in clear also on a secure stream), through hooks that
// may change, drop or repeat them: up for the client's frames, down for
// the server's. Each hook gets the frame's index in its direction and its
// bytes, and returns what to send instead. wire keeps every byte that
// went, both ways.
type tcpRelay struct {
	ln       net.Listener
	server   string
	up, down func(i int, f []byte) [][]byte
	mu       sync.Mutex
	wire     []byte
	wg       sync.WaitGroup
}

func newTCPRelay(t *testing.T, server string, up, down func(int, []byte) [][]byte) *tcpRelay {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	r := &tcpRelay{ln: ln, server: server, up: up, down: down}
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		for {
			a, err := ln.Accept()
			if err != nil {
				return
			}
			b, err := net.Dial("tcp", server)
			if err != nil {
				a.Close()
				continue
			}
			r.wg.Add(2)
			go r.pass(a, b, r.up)
			go r.pass(b, a, r.down)
		}
	}()
	t.Cleanup(func() { ln.Close(); r.wg.Wait() })
	return r
}

func (r *tcpRelay) Addr() string { return r.ln.Addr().String() }

// pass copies frames from src to dst through hook, and closes both when
// either side ends.
func (r *tcpRelay) pass(src, dst net.Conn, hook func(int, []byte) [][]byte) {
	defer r.wg.Done()
	defer src.Close()
	defer dst.Close()
	var buf []byte
	rb := make([]byte, 32<<10)
	i := 0
	for {
		n, err := src.Read(rb)
		buf = append(buf, rb[:n]...)
		for {
			size, k := consumeVLE32(buf)
			if k < 0 || len(buf) < k+int(size) {
				break
			}
			f := bytes.Clone(buf[:k+int(size)])
			buf = buf[k+int(size):]
			out := [][]byte{f}
			if hook != nil {
				out = hook(i, f)
			}
			i++
			for _, o := range out {
				r.mu.Lock()
				r.wire = append(r.wire, o...)
				r.mu.Unlock()
				if _, err := dst.Write(o); err != nil {
					return
				}
			}
		}
		if err != nil {
			return
		}
	}
}

func (r *tcpRelay) seen() []byte {
	r.mu.Lock()
	defer r.mu.Unlock()
	return bytes.Clone(r.wire)
}

// secureTCPConfigs are secureConfigs with the listener on TCP too.
func secureTCPConfigs(t *testing.T) (server, client *Config, ledger *nonceLedger) {
	server, client = secureConfigs(t)
	server.TCP = true
	ledger = withLedger(t, server, client)
	return server, client, ledger
}

// Every delivery mode crosses a secure stream, echoed; nothing of the
// application's crosses in clear, and no nonce seals two plaintexts.
func TestSecureTCPEchoEveryMode(t *testing.T) {
	scfg, ccfg, ledger := secureTCPConfigs(t)
	scfg.Admit = func(_ net.Addr, p []byte) ([]byte, error) {
		if string(p) != "SECRET-LOGIN" {
			return nil, errors.New("who are you")
		}
		return []byte("SECRET-WELCOME"), nil
	}
	ccfg.ConnectPayload = []byte("SECRET-LOGIN")
	l := listen(t, scfg)
	serveEcho(t, l)
	r := newTCPRelay(t, l.Addr().String(), nil, nil)
	ctx := within(t, 20*time.Second)
	c, err := Dial(ctx, "tcp", r.Addr(), ccfg)
	require.NoError(t, err)
	assert.True(t, c.Secure())
	assert.Equal(t, TransportTCP, c.Transport())
	syn, reply := c.Handshake()
	assert.Equal(t, "SECRET-LOGIN", string(syn))
	assert.Equal(t, "SECRET-WELCOME", string(reply))

	echoEveryMode(t, ctx, c)
	require.NoError(t, c.Close())
	waitDone(t, c, 15*time.Second)
	assert.ErrorIs(t, c.Err(), net.ErrClosed)

	wire := r.seen()
	assert.Greater(t, len(wire), 100_000, "the relay saw the traffic")
	for _, s := range []string{"SECRET", "m0150", "m0299", string(bytes.Repeat([]byte("x"), 32))} {
		assert.NotContains(t, string(wire), s, "crossed the wire in clear")
	}
	assert.Greater(t, ledger.count(), 600, "every frame went through the sealing tap")
}

// A secure client may send a message larger than a hello the moment Dial
// returns: the server, which reads its client's first sealed frame (the
// proof) under the hello's limit, takes what comes behind it under the
// connection's. It once ended the stream whenever the proof and the size
// field of such a message came in one read: most times over TCP, and now
// and then over WebSocket.
func TestSecureStreamLargeMessageBehindTheProof(t *testing.T) {
	scfg, ccfg := secureConfigs(t)
	scfg.TCP = true
	l := listen(t, scfg)
	serveEcho(t, l)
	url := wsServer(t, l)
	ctx := within(t, 60*time.Second)
	big := bytes.Repeat([]byte{7}, 100_000)
	for i := range 20 {
		for _, ws := range []bool{false, true} {
			var c *Conn
			var err error
			if ws {
				c, err = DialWebSocket(ctx, url, ccfg)
			} else {
				c, err = Dial(ctx, "tcp", l.Addr().String(), ccfg)
			}
			require.NoError(t, err)
			require.NoError(t, c.Send(Message{ID: 10, Payload: big, Reliable: true}))
			m, err := c.Receive(ctx)
			require.NoError(t, err, "attempt %d (websocket %v): %v", i, ws, c.Err())
			assert.Equal(t, len(big), len(m.Payload))
			require.NoError(t, c.Close())
			waitDone(t, c, 15*time.Second)
		}
	}
}

// A connect token over TCP is checked and used as over UDP: it gets in
// once, and its replay is refused with the reason.
func TestSecureTCPTokenOnce(t *testing.T) {
	l, key, ccfg, admitted := tokenServer(t, func(c *Config) { c.TCP = true })
	ccfg.Token = issue(t, key, sampleToken(addrPort(t, l.Addr())))
	ctx := within(t, 10*time.Second)
	c, err := Dial(ctx, "tcp", l.Addr().String(), ccfg)
	require.NoError(t, err)
	assert.True(t, c.Secure())
	echoOnce(t, c, Message{ID: 100, Payload: []byte("hi"), Reliable: true})
	assert.Equal(t, int32(1), admitted.Load())

	_, err = Dial(ctx, "tcp", l.Addr().String(), ccfg)
	require.Error(t, err)
	assert.ErrorIs(t, err, ErrTokenRejected)
	assert.ErrorIs(t, err, ErrRefused)
	assert.Contains(t, err.Error(), "connect token rejected")
	assert.Equal(t, uint64(1), l.Stats().RejectedTokens)
	assert.Equal(t, int32(1), admitted.Load(), "Admit never saw the replay")

	// A token of another key: refused, the reason reaching the client.
	ccfg.Token = issue(t, newTokenKey(t), sampleToken(addrPort(t, l.Addr())))
	_, err = Dial(ctx, "tcp", l.Addr().String(), ccfg)
	assert.ErrorIs(t, err, ErrTokenRejected)
	assert.Contains(t, err.Error(), "invalid")
	require.NoError(t, c.Close())
}

// A secure listener serves no plaintext over TCP: a knet client in clear
// is refused with the reason, a reference-dialect client's stream closed;
// Admit sees neither.
func TestSecureTCPRefusesPlaintext(t *testing.T) {
	scfg, _, _ := secureTCPConfigs(t)
	admitted := make(chan struct{}, 4)
	scfg.Admit = func(net.Addr, []byte) ([]byte, error) { admitted <- struct{}{}; return nil, nil }
	l := listen(t, scfg)
	serveEcho(t, l)
	ctx := within(t, 10*time.Second)

	_, err := Dial(ctx, "tcp", l.Addr().String(), testConfig())
	require.Error(t, err)
	assert.ErrorIs(t, err, ErrRefused)
	assert.Contains(t, err.Error(), "secure listener")

	ref := testConfig()
	ref.Dialect = DialectReference
	ref.ConnectTimeout = time.Second
	// The reference's client waits for no answer: its Dial may return
	// before the server closes the stream, or see it closed.
	if c, err := Dial(ctx, "tcp", l.Addr().String(), ref); err == nil {
		c.Send(Message{ID: 100, Payload: []byte("hello"), Reliable: true})
		_, err = c.Receive(ctx)
		require.Error(t, err, "the server closed the stream")
		select {
		case <-c.Done():
		case <-ctx.Done():
			t.Fatal("the reference client's connection did not end")
		}
	}
	assert.Len(t, admitted, 0)
	assert.GreaterOrEqual(t, l.Stats().RefusedAttempts, uint64(2))
}

// A client with another ServerKey fails the handshake over TCP; a secure
// client reaching a plaintext listener is refused with why.
func TestSecureTCPWrongKey(t *testing.T) {
	scfg, _, _ := secureTCPConfigs(t)
	l := listen(t, scfg)
	serveEcho(t, l)
	ctx := within(t, 10*time.Second)
	_, other, err := GenerateKey()
	require.NoError(t, err)
	ccfg := testConfig()
	ccfg.ServerKey = other
	_, err = Dial(ctx, "tcp", l.Addr().String(), ccfg)
	require.Error(t, err)
	assert.ErrorIs(t, err, ErrHandshakeFailed)
	assert.Contains(t, err.Error(), "ServerKey")

	plain := listen(t, tcpConfig())
	serveEcho(t, plain)
	_, err = Dial(ctx, "tcp", plain.Addr().String(), ccfg)
	require.Error(t, err)
	assert.ErrorIs(t, err, ErrRefused)
	assert.Contains(t, err.Error(), "PrivateKey")
}

// secureRelayed dials l through a relay with the hooks, and returns the
// client and the server's connection, which records what it receives in
// got until it ends.
func secureRelayed(t *testing.T, up, down func(int, []byte) [][]byte) (c, sc *Conn, got chan Message) {
	scfg, ccfg, _ := secureTCPConfigs(t)
	l := listen(t, scfg)
	r := newTCPRelay(t, l.Addr().String(), up, down)
	ctx := within(t, 10*time.Second)
	c, err := Dial(ctx, "tcp", r.Addr(), ccfg)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	sc, err = l.AcceptConn(ctx)
	require.NoError(t, err)
	require.True(t, sc.Secure())
	got = make(chan Message, 100)
	go func() {
		defer close(got)
		for {
			m, err := sc.Receive(context.Background())
			if err != nil {
				return
			}
			got <- m
		}
	}()
	return c, sc, got
}

// appFrame reports whether a sealed frame is larger than a ping: the
// application's (the tests' payloads are longer than a ping's byte).
func appFrame(f []byte) bool { return len(f) > 30 }

// relayHook applies do to the n-th application frame after the handshake.
func relayHook(n int, do func(f []byte, next func() []byte) [][]byte) func(int, []byte) [][]byte {
	seen := -1
	var held []byte
	return func(i int, f []byte) [][]byte {
		if i == 0 || !appFrame(f) {
			return [][]byte{f}
		}
		seen++
		switch {
		case seen == n:
			if out := do(f, nil); out != nil {
				return out
			}
			held = f // to go after the next
			return nil
		case seen == n+1 && held != nil:
			return [][]byte{f, held}
		}
		return [][]byte{f}
	}
}

// sendNumbered sends k reliable messages whose payloads are long enough
// to tell from pings.
func sendNumbered(t *testing.T, c *Conn, k int) {
	for i := range k {
		require.NoError(t, c.Send(Message{ID: 100, Payload: append(bytes.Repeat([]byte{'p'}, 40), byte('0'+i)), Reliable: true}))
	}
}

// checkCut checks that the server's connection ended on a frame that did
// not open, having delivered exactly the first n messages, untouched.
func checkCut(t *testing.T, sc *Conn, got chan Message, n int) {
	t.Helper()
	var ms []Message
	for m := range got {
		ms = append(ms, m)
	}
	waitDone(t, sc, 15*time.Second)
	require.Len(t, ms, n, "only the messages before the bad frame")
	for i, m := range ms {
		assert.Equal(t, byte('0'+i), m.Payload[len(m.Payload)-1])
	}
	var pe *ProtocolError
	require.ErrorAs(t, sc.Err(), &pe)
	assert.ErrorIs(t, sc.Err(), errStreamOpen)
	assert.Equal(t, uint64(1), sc.Stats().InvalidDatagrams)
}

// A byte flipped in a sealed frame by a relay ends the connection, with a
// *ProtocolError, and nothing forged is delivered: the messages before it
// are, none after.
func TestSecureTCPTamperedFrame(t *testing.T) {
	flip := func(f []byte, _ func() []byte) [][]byte {
		g := bytes.Clone(f)
		g[len(g)/2] ^= 0x01
		return [][]byte{g}
	}
	c, sc, got := secureRelayed(t, relayHook(2, flip), nil)
	sendNumbered(t, c, 5)
	checkCut(t, sc, got, 2)

	// The other way: the client's connection ends so.
	c, sc, _ = secureRelayed(t, nil, relayHook(0, flip))
	require.NoError(t, sc.Send(Message{ID: 100, Payload: bytes.Repeat([]byte{'q'}, 50), Reliable: true}))
	_, err := c.Receive(within(t, 10*time.Second))
	require.Error(t, err, "nothing forged delivered")
	waitDone(t, c, 15*time.Second)
	var pe *ProtocolError
	require.ErrorAs(t, c.Err(), &pe)
	assert.ErrorIs(t, c.Err(), errStreamOpen)
}

// A frame replayed or two frames swapped by a relay: the nonces no longer
// match, and the connection ends at the first frame out of place.
func TestSecureTCPReplayedAndReorderedFrames(t *testing.T) {
	replay := func(f []byte, _ func() []byte) [][]byte { return [][]byte{f, f} }
	c, sc, got := secureRelayed(t, relayHook(1, replay), nil)
	sendNumbered(t, c, 5)
	checkCut(t, sc, got, 2)

	swap := func([]byte, func() []byte) [][]byte { return nil }
	c, sc, got = secureRelayed(t, relayHook(1, swap), nil)
	sendNumbered(t, c, 5)
	checkCut(t, sc, got, 1)
}

// Unit: sealed frames open in order on the other side, each direction its
// own key; any changed byte, a repeat or a skip fails; a frame's size
// field is its sealed length; the counter refuses to wrap.
func TestStreamSealOpen(t *testing.T) {
	cs, ss := securePair(t)
	c, s := &streamSeal{sec: cs}, &streamSeal{sec: ss}
	var wire []byte
	var frames [][]byte
	for i := range 5 {
		start := len(wire)
		var err error
		wire, err = c.appendFrame(wire, 100+uint32(i), bytes.Repeat([]byte{byte('a' + i)}, 10*i))
		require.NoError(t, err)
		frames = append(frames, bytes.Clone(wire[start:]))
	}
	fr := newTCPFramer(1 << 10)
	fr.sealed = true
	fr.feed(wire)
	for i := range 5 {
		_, body, ok, err := fr.next()
		require.NoError(t, err)
		require.True(t, ok)
		require.Len(t, frames[i], sizeVLE32(uint32(len(body)))+len(body))
		id, p, err := s.open(bytes.Clone(body))
		require.NoError(t, err, "frame %d", i)
		assert.Equal(t, 100+uint32(i), id)
		assert.Equal(t, bytes.Repeat([]byte{byte('a' + i)}, 10*i), p)
	}
	assert.Equal(t, uint64(5), s.recvN)

	body := func(f []byte) []byte { _, k := consumeVLE32(f); return bytes.Clone(f[k:]) }
	fresh := func() *streamSeal { return &streamSeal{sec: ss} }
	// Every byte flipped, in the first frame: none opens.
	for i := range len(body(frames[1])) {
		b := body(frames[1])
		b[i] ^= 0x80
		z := fresh()
		_, _, err := z.open(body(frames[0]))
		require.NoError(t, err)
		_, _, err = z.open(b)
		require.ErrorIs(t, err, errStreamOpen, "byte %d", i)
	}
	// A repeat, a skip, the other direction's key: none opens.
	z := fresh()
	_, _, err := z.open(body(frames[0]))
	require.NoError(t, err)
	_, _, err = z.open(body(frames[0]))
	assert.ErrorIs(t, err, errStreamOpen, "repeated")
	_, _, err = fresh().open(body(frames[1]))
	assert.ErrorIs(t, err, errStreamOpen, "skipped")
	_, _, err = (&streamSeal{sec: cs}).open(body(frames[0]))
	assert.ErrorIs(t, err, errStreamOpen, "its own direction's key")
	_, _, err = fresh().open(make([]byte, sealOverhead))
	assert.ErrorIs(t, err, errStreamSealedSize)

	c.sendN = ^uint64(0)
	_, err = c.appendFrame(nil, 100, nil)
	assert.ErrorIs(t, err, errNonceReuse, "the counter does not wrap")
}

// Config.FallbackTCP with a secure Config and a connect token: UDP blocked,
// the client gets in over TCP, securely, its token used there.
func TestSecureFallbackToTCPWithToken(t *testing.T) {
	t.Parallel()
	deaf := &endpointOptions{listen: func(network string, laddr *net.UDPAddr, reuse bool) (socket, error) {
		s, err := (&endpointOptions{}).listenSocket(network, laddr, reuse)
		return deafSocket{s}, err
	}}
	scfg, ccfg, _ := secureTCPConfigs(t)
	key := newTokenKey(t)
	scfg.TokenKey = key
	l, err := listenWith("udp", "127.0.0.1:0", scfg, deaf)
	require.NoError(t, err)
	t.Cleanup(func() { l.Close() })
	serveEcho(t, l)
	ccfg.FallbackTCP = true
	ccfg.Token = issue(t, key, sampleToken(addrPort(t, l.Addr())))
	ctx := within(t, 20*time.Second)
	c, err := Dial(ctx, "udp", l.Addr().String(), ccfg)
	require.NoError(t, err)
	assert.Equal(t, TransportTCP, c.Transport())
	assert.True(t, c.Secure())
	echoOnce(t, c, Message{ID: 100, Payload: []byte("over tcp"), Reliable: true})
	require.NoError(t, c.Close())
	ccfg.ConnectTimeout = time.Second // the UDP attempt's, which gets no answer
	_, err = Dial(ctx, "udp", l.Addr().String(), ccfg)
	assert.ErrorIs(t, err, ErrTokenRejected, "used once, whichever transport")
}

// Over TCP a source IP address has the key exchange budget it has over UDP
// (256 at once, 1,000 a second): streams past it are closed unanswered,
// counted in RateLimitedHandshakes, without a key exchange.
func TestSecureTCPKeyExchangeRateLimited(t *testing.T) {
	scfg, _, _ := secureTCPConfigs(t)
	scfg.ConnectTimeout = 30 * time.Second
	l := listen(t, scfg)
	// 127.0.0.1 spends its budget, a minute ahead: no refill meanwhile.
	ahead := time.Now().Add(time.Minute)
	l.mu.Lock()
	for l.hs.sources.allow(netip.MustParseAddr("127.0.0.1"), ahead) {
	}
	l.mu.Unlock()
	garbage := knetHello(helloSecure, appendSecureSyn(nil, nil, bytes.Repeat([]byte{0x55}, 100)))
	for range 5 {
		nc := rawTCP(t, l)
		_, err := nc.Write(garbage)
		require.NoError(t, err)
		n, _ := io.ReadFull(nc, make([]byte, 1))
		assert.Zero(t, n, "closed unanswered")
	}
	st := l.Stats()
	assert.Equal(t, uint64(5), st.RateLimitedHandshakes)
	assert.Zero(t, st.KeyExchanges)
	assert.Zero(t, st.RefusedAttempts)
	assert.Equal(t, uint64(5), st.FailedStreams)
}

// BenchmarkStreamSealOpen1200 seals and opens one 1200-byte frame.
func BenchmarkStreamSealOpen1200(b *testing.B) {
	cs, ss := securePair(b)
	c, s := &streamSeal{sec: cs}, &streamSeal{sec: ss}
	payload := make([]byte, 1200)
	buf := make([]byte, 0, 2048)
	b.SetBytes(1200)
	b.ReportAllocs()
	for b.Loop() {
		f, err := c.appendFrame(buf[:0], 100, payload)
		if err != nil {
			b.Fatal(err)
		}
		_, k := consumeVLE32(f)
		if _, _, err := s.open(f[k:]); err != nil {
			b.Fatal(err)
		}
	}
}

// FuzzSecureStreamReceive feeds a secure stream's receiving side any
// bytes, in pieces: it never panics, and nothing forged is delivered (the
// seeds' one genuine frame excepted, when it comes first and whole).
func FuzzSecureStreamReceive(f *testing.F) {
	cs, ss := securePair(f)
	genuine, err := (&streamSeal{sec: cs}).appendFrame(nil, 100, []byte("genuine"))
	require.NoError(f, err)
	f.Add(genuine, uint8(3))
	f.Add(append(bytes.Clone(genuine), genuine...), uint8(7))
	f.Add([]byte{0x85, 0x01, 0x02}, uint8(1))
	f.Add(hugeFrame, uint8(2))
	f.Fuzz(func(t *testing.T, b []byte, cut uint8) {
		h := new(simHost)
		s := newStreamSession(h, 1<<16, time.Minute, timeZero)
		s.startSealing(ss)
		in := bytes.Clone(b)
		step := int(cut%16) + 1
		for len(in) > 0 && s.err == nil {
			n := min(step, len(in))
			s.received(timeZero, in[:n])
			in = in[n:]
		}
		for _, m := range h.msgs {
			if m.ID != 100 || string(m.Payload) != "genuine" || !bytes.HasPrefix(b, genuine) {
				t.Fatalf("forged message delivered: %d %q", m.ID, m.Payload)
			}
		}
		assert.LessOrEqual(t, len(h.msgs), 1, "the genuine frame opens once: its copy is a replay")
	})
}
