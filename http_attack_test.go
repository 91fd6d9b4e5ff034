//go:build !js

package knet

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Attacks on Config.HTTP (stream_http.go): a stream is sniffed only
// after it took its pending place, and an HTTP one leaves the door.

// httpListener is a TCP Listener with Config.HTTP serving h, its pending
// places few so that holding them is cheap for an attacker.
func httpListener(t *testing.T, h http.Handler, places int, mod func(*Config)) *Listener {
	cfg := attackConfig()
	cfg.HTTP = h
	cfg.MaxPendingConnections = places
	cfg.MaxPendingPerSource = places
	if mod != nil {
		mod(cfg)
	}
	l, err := Listen("udp", "127.0.0.1:0", cfg)
	require.NoError(t, err)
	t.Cleanup(func() { l.Close() })
	return l
}

// dialUntil dials a knet client over TCP until one connects, for at most
// d, and returns it: a refused attempt is tried again (polling).
func dialUntil(t *testing.T, l *Listener, d time.Duration) *Conn {
	t.Helper()
	end := time.Now().Add(d)
	var err error
	for tries := 0; time.Now().Before(end) && tries < 10_000; tries++ {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		var c *Conn
		c, err = Dial(ctx, "tcp", l.Addr().String(), testConfig())
		cancel()
		if err == nil {
			return c
		}
		time.Sleep(20 * time.Millisecond) // the next try; nothing asserted on it
	}
	t.Fatalf("no knet client connected within %v: %v", d, err)
	return nil
}

// Streams each saying "GE" (a method's start: the sniff cannot tell yet)
// and stalling hold every pending place; they give way as streams that
// began a knet hello do (streamHelloGrace), and a knet client from the
// same address gets in long before ConnectTimeout (30s here).
func TestHTTPAttackUndecidedStreamsGiveWay(t *testing.T) {
	t.Parallel()
	const places = 8
	l := httpListener(t, http.NotFoundHandler(), places, nil)
	serveEcho(t, l)
	for range places {
		nc := rawTCP(t, l)
		_, err := nc.Write([]byte("GE"))
		require.NoError(t, err)
	}
	require.Eventually(t, func() bool { return l.Stats().Pending == places }, 5*time.Second, time.Millisecond)
	c := dialUntil(t, l, 10*time.Second) // well before ConnectTimeout (30s)
	defer c.Close()
	echoOnce(t, c, Message{ID: 100, Payload: []byte("in"), Reliable: true})
	assert.LessOrEqual(t, l.Stats().Pending, places)
}

// A flood of HTTP requests whose handler never returns does not hold
// the door: each stream gives back its pending place when it is handed
// to HTTP, so with 4 places, 32 requests held open by the handler and a
// knet client still connects at once; none counted a failed stream.
func TestHTTPAttackHeldRequestsLeaveTheDoor(t *testing.T) {
	const places, held = 4, 32
	arrived := make(chan struct{}, held)
	release := make(chan struct{})
	var once sync.Once
	free := func() { once.Do(func() { close(release) }) }
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrived <- struct{}{}
		select {
		case <-release:
		case <-r.Context().Done():
		}
	})
	l := httpListener(t, h, places, nil)
	t.Cleanup(free) // before the Listener's Close (cleanups run last first)
	serveEcho(t, l)
	for i := range held {
		nc := rawTCP(t, l)
		_, err := io.WriteString(nc, "GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
		require.NoError(t, err)
		select {
		case <-arrived:
		case <-time.After(10 * time.Second):
			t.Fatalf("request %d never reached the handler", i)
		}
	}
	require.Eventually(t, func() bool { return l.Stats().Pending == 0 }, 5*time.Second, time.Millisecond)
	ctx := within(t, 5*time.Second)
	c, err := Dial(ctx, "tcp", l.Addr().String(), testConfig())
	require.NoError(t, err, "a knet client beside 32 held HTTP requests")
	defer c.Close()
	echoOnce(t, c, Message{ID: 100, Payload: []byte("in"), Reliable: true})
	st := l.Stats()
	assert.Zero(t, st.FailedStreams)
	assert.Zero(t, st.IgnoredAttempts)
	free()
}

// A request line written a byte at a time (each its own TCP segment) is
// still HTTP: the sniff waits while the bytes could begin a method.
func TestHTTPAttackRequestLineByteByByte(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "path="+r.URL.Path) })
	l := httpListener(t, h, 4, nil)
	for _, method := range []string{"GET", "OPTIONS", "PATCH"} {
		nc := rawTCP(t, l)
		nc.(*net.TCPConn).SetNoDelay(true)
		req := method + " /slow HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
		for i := range len(req) {
			_, err := nc.Write([]byte{req[i]})
			require.NoError(t, err)
		}
		nc.SetReadDeadline(time.Now().Add(10 * time.Second))
		resp, err := http.ReadResponse(bufio.NewReader(nc), nil)
		require.NoError(t, err, method)
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		assert.Equal(t, "path=/slow", string(b), method)
	}
	assert.Zero(t, l.Stats().FailedStreams)
}

// A knet hello written a byte at a time is knet, not HTTP, whatever the
// sniff saw first; so is one whose first bytes spell a method's start
// but not a request line ("GET" then no space).
func TestHTTPAttackKnetHelloByteByByte(t *testing.T) {
	l := httpListener(t, http.NotFoundHandler(), 4, nil)
	nc := rawTCP(t, l)
	nc.(*net.TCPConn).SetNoDelay(true)
	hello := knetHello(helloClient, []byte("raw"))
	for i := range hello {
		_, err := nc.Write(hello[i : i+1])
		require.NoError(t, err)
	}
	fr := newTCPFramer(1 << 20)
	id, p := readFrame(t, nc, fr)
	kind, _, ok := parseStreamHello(p)
	require.True(t, ok && id == idPingReply && kind == helloAccept, "the server's accept")
	_, err := l.AcceptConn(within(t, 10*time.Second))
	require.NoError(t, err)

	for _, first := range []string{"GETX", "GET\x00", "POST!"} {
		nc := rawTCP(t, l)
		_, err := io.WriteString(nc, first)
		require.NoError(t, err)
		// Told knet (sniff 0) as soon as the bytes are no method's
		// start followed by a space: the stream stays a knet attempt.
		require.Eventually(t, func() bool {
			for _, c := range l.streamConns(false) {
				if c.st.nc.RemoteAddr().String() == nc.LocalAddr().String() {
					return c.st.sniff.Load() == 0
				}
			}
			return false
		}, 5*time.Second, time.Millisecond, "%q", first)
		nc.Close()
	}
}

// With a PrivateKey (a secure Listener), HTTP on the port works and so
// does a secure knet client over TCP: the sniff reads the bytes before
// any secure layer.
func TestHTTPAttackSecureListener(t *testing.T) {
	priv, pub, err := GenerateKey()
	require.NoError(t, err)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	l := httpListener(t, h, 4, func(c *Config) { c.PrivateKey = priv })
	serveEcho(t, l)
	resp, err := http.Get("http://" + l.Addr().String() + "/")
	require.NoError(t, err)
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	assert.Equal(t, "ok", string(b))
	cfg := testConfig()
	cfg.ServerKey = pub
	c, err := Dial(within(t, 10*time.Second), "tcp", l.Addr().String(), cfg)
	require.NoError(t, err)
	defer c.Close()
	echoOnce(t, c, Message{ID: 100, Payload: []byte("sealed"), Reliable: true})
}

// Close while HTTP requests come in, under -race: no data race, Close
// returns, and every client's stream ends.
func TestHTTPAttackCloseWhileHandingOver(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	l := httpListener(t, h, 64, nil)
	addr := l.Addr().String()
	var wg sync.WaitGroup
	var conns []net.Conn
	var mu sync.Mutex
	for range 16 {
		wg.Go(func() {
			for range 8 {
				nc, err := net.Dial("tcp", addr)
				if err != nil {
					return
				}
				mu.Lock()
				conns = append(conns, nc)
				mu.Unlock()
				io.WriteString(nc, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
			}
		})
	}
	require.NoError(t, l.Close())
	wg.Wait()
	for _, nc := range conns {
		closedWithin(t, nc, 10*time.Second)
		nc.Close()
	}
}

// A stream told HTTP as the Listener closes (its round hands it over
// after closeHTTP ran) is closed, not left in the hand-off channel that
// no server reads any more: its client must not wait on it forever.
func TestHTTPAttackHandOverAfterClose(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	l := httpListener(t, h, 4, nil)
	resp, err := http.Get("http://" + l.Addr().String() + "/") // the HTTP server starts
	require.NoError(t, err)
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	require.NoError(t, l.Close())
	for i := range 32 {
		ours, theirs := net.Pipe()
		l.serveHTTP(ours, nil)
		theirs.SetReadDeadline(time.Now().Add(2 * time.Second))
		_, err := theirs.Read(make([]byte, 1))
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			t.Fatalf("stream %d handed over after Close is still open", i)
		}
		theirs.Close()
	}
}

// WebSockets upgraded over the game port and then silent come back to
// the door (takeStream) as any WebSocket does: with 4 places, 16 of them
// from one source, and a knet client from that source still gets in
// over TCP, the silent ones giving way; never more than 4 pending.
func TestHTTPAttackSilentWebSocketsOnGamePort(t *testing.T) {
	const places, silent = 4, 16
	mux := http.NewServeMux()
	l := httpListener(t, mux, places, nil)
	mux.Handle("/knet", l.WebSocketHandler())
	serveEcho(t, l)
	for i := range silent {
		nc := rawTCP(t, l)
		_, err := io.WriteString(nc, "GET /knet HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"+
			"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
		require.NoError(t, err)
		nc.SetReadDeadline(time.Now().Add(10 * time.Second))
		resp, err := http.ReadResponse(bufio.NewReader(nc), nil)
		require.NoError(t, err, "upgrade %d", i)
		require.Equal(t, http.StatusSwitchingProtocols, resp.StatusCode)
		nc.SetReadDeadline(time.Time{})
	}
	require.Eventually(t, func() bool { return l.Stats().IgnoredAttempts >= silent-places }, 10*time.Second, time.Millisecond)
	// An evicted stream counts among Pending until its round ends it
	// (endAttempt), a moment after the stream that took its place entered:
	// one over, briefly (seen once in CI). The places themselves stay at
	// most places (enterLocked), and the client below still gets in.
	require.Eventually(t, func() bool { return l.Stats().Pending <= places }, 10*time.Second, time.Millisecond)
	c := dialUntil(t, l, 10*time.Second)
	defer c.Close()
	echoOnce(t, c, Message{ID: 100, Payload: []byte("in"), Reliable: true})
}

// Drain while HTTP requests are handed over, under -race: it returns,
// and every client's stream ends once the Listener closes.
func TestHTTPAttackDrainWhileHandingOver(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	l := httpListener(t, h, 64, nil)
	addr := l.Addr().String()
	var wg sync.WaitGroup
	var conns []net.Conn
	var mu sync.Mutex
	for range 8 {
		wg.Go(func() {
			for range 8 {
				nc, err := net.Dial("tcp", addr)
				if err != nil {
					return
				}
				mu.Lock()
				conns = append(conns, nc)
				mu.Unlock()
				io.WriteString(nc, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
			}
		})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	l.Drain(ctx, "drain")
	wg.Wait()
	l.Close()
	for _, nc := range conns {
		closedWithin(t, nc, 10*time.Second)
		nc.Close()
	}
}
