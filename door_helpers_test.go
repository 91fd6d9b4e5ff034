//go:build unix

package knet

import (
	"bytes"
	"context"
	"errors"
	"hash/maphash"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/coder/websocket"
	"github.com/stretchr/testify/require"
)

// Helpers of door_attack_test.go (issue 31): raw streams opened by hand,
// what the server sends on them and when it ends them, a victim whose
// first frame is recorded, and the connections a listener accepts.

// doorRaw opens a raw TCP stream to addr, from the local IP address from
// (nil: the system's choice); the test's end closes it.
func doorRaw(t testing.TB, addr string, from net.IP) net.Conn {
	t.Helper()
	d := net.Dialer{Timeout: 5 * time.Second}
	if from != nil {
		d.LocalAddr = &net.TCPAddr{IP: from}
	}
	nc, err := d.Dial("tcp", addr)
	require.NoError(t, err)
	nc.(*net.TCPConn).SetNoDelay(true)
	t.Cleanup(func() { nc.Close() })
	return nc
}

// doorRawWS opens a raw WebSocket to url, as a byte stream of binary
// messages (each Write one message); the test's end closes it.
func doorRawWS(t testing.TB, url string) net.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ws, _, err := websocket.Dial(ctx, url, nil)
	require.NoError(t, err)
	nc := websocket.NetConn(context.Background(), ws, websocket.MessageBinary)
	t.Cleanup(func() { ws.CloseNow() })
	return nc
}

// doorSeen is what a raw stream got from the server while watched.
type doorSeen struct {
	closed bool          // the server ended the stream before the watch's end
	took   time.Duration // from the watch's reference time to the end
	kinds  []byte        // the knet hellos' kinds among the frames in clear, up to a helloSecureAccept
	bytes  int
}

func (s doorSeen) got(kind byte) bool { return bytes.IndexByte(s.kinds, kind) >= 0 }

// doorWatch reads nc until the server ends it or until, and parses the
// frames in clear (those after a helloSecureAccept are sealed: not
// parsed). took counts from since.
func doorWatch(nc net.Conn, since, until time.Time) doorSeen {
	return (&doorWatcher{nc: nc}).watch(since, until, false)
}

// doorWatcher watches a raw stream, in several steps if need be.
type doorWatcher struct {
	nc     net.Conn
	s      doorSeen
	buf    []byte
	sealed bool
}

// watch reads the stream until the server ends it or until, or if first
// until something came; the result counts everything read so far.
func (w *doorWatcher) watch(since, until time.Time, first bool) doorSeen {
	rb := make([]byte, 32<<10)
	w.nc.SetReadDeadline(until)
	defer w.nc.SetReadDeadline(time.Time{})
	for !w.s.closed {
		n, err := w.nc.Read(rb)
		w.s.bytes += n
		if !w.sealed {
			w.buf = append(w.buf, rb[:n]...)
			for !w.sealed {
				size, k := consumeVLE32(w.buf)
				if k < 0 || size == 0 || len(w.buf) < k+int(size) {
					break
				}
				body := w.buf[k : k+int(size)]
				w.buf = w.buf[k+int(size):]
				id, m := consumeVLE32(body)
				if m < 0 || id != idPingReply {
					continue
				}
				if kind, _, ok := parseStreamHello(body[m:]); ok {
					w.s.kinds = append(w.s.kinds, kind)
					w.sealed = kind == helloSecureAccept
				}
			}
		}
		w.s.took = time.Since(since)
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() || errors.Is(err, context.Canceled) {
				// The deadline (a WebSocket's NetConn cancels its
				// read's context at the deadline).
				break
			}
			w.s.closed = true
		}
		if first && n > 0 {
			break
		}
	}
	return w.s
}

// doorWatchAll watches every stream of ncs at once (doorWatch), each from
// since until until.
func doorWatchAll(ncs []net.Conn, since, until time.Time) []doorSeen {
	out := make([]doorSeen, len(ncs))
	var wg sync.WaitGroup
	for i, nc := range ncs {
		wg.Go(func() { out[i] = doorWatch(nc, since, until) })
	}
	wg.Wait()
	return out
}

// doorHelloContent returns the content of the knet hello in the frame f.
func doorHelloContent(t testing.TB, f []byte) (kind byte, content []byte) {
	t.Helper()
	id, p, n, err := parseTCPFrame(f, 1<<20)
	require.NoError(t, err)
	require.Equal(t, len(f), n, "one whole frame")
	require.Equal(t, uint32(idPingReply), id)
	kind, content, ok := parseStreamHello(p)
	require.True(t, ok, "a knet hello")
	return kind, bytes.Clone(content)
}

// doorForget makes l forget the handshake message of the secure hello
// frame f, as when the window in which it remembers one has passed.
func doorForget(t testing.TB, l *Listener, f []byte) {
	t.Helper()
	kind, content := doorHelloContent(t, f)
	require.Equal(t, byte(helloSecure), kind)
	_, msg1, ok := splitSecureSyn(content)
	require.True(t, ok)
	l.mu.Lock()
	l.hs.seen.forget(maphash.Bytes(l.hs.seed, msg1))
	l.mu.Unlock()
}

// doorRecConn is a stream that keeps a copy of what is written on it.
type doorRecConn struct {
	net.Conn
	mu    sync.Mutex
	wrote []byte
}

func (c *doorRecConn) Write(b []byte) (int, error) {
	c.mu.Lock()
	c.wrote = append(c.wrote, b...)
	c.mu.Unlock()
	return c.Conn.Write(b)
}

// firstFrame is the first whole frame written, if any.
func (c *doorRecConn) firstFrame() []byte {
	c.mu.Lock()
	defer c.mu.Unlock()
	size, k := consumeVLE32(c.wrote)
	if k < 0 || len(c.wrote) < k+int(size) {
		return nil
	}
	return bytes.Clone(c.wrote[:k+int(size)])
}

// doorVictim connects a client (ccfg) to l over tr (TCP: through a relay
// recording its frames; WebSocket: to url), takes its connection from
// AcceptConn, and returns both with the client's first frame, its hello.
// The test's end closes the client.
func doorVictim(t *testing.T, l *Listener, url string, tr Transport, ccfg *Config) (c, sc *Conn, hello []byte) {
	t.Helper()
	ctx := within(t, 10*time.Second)
	var err error
	switch tr {
	case TransportTCP:
		first := make(chan []byte, 1)
		r := newTCPRelay(t, l.Addr().String(), func(i int, f []byte) [][]byte {
			if i == 0 {
				first <- bytes.Clone(f)
			}
			return [][]byte{f}
		}, nil)
		c, err = Dial(ctx, "tcp", r.Addr(), ccfg)
		require.NoError(t, err)
		hello = <-first
	case TransportWebSocket:
		rc := ccfg.resolve()
		require.NoError(t, rc.secureDialer())
		ws, _, err := websocket.Dial(ctx, url, nil)
		require.NoError(t, err)
		rec := &doorRecConn{Conn: newWSConn(ws, rc)}
		c, err = dialStream(ctx, rec, TransportWebSocket, rc, &endpointOptions{})
		require.NoError(t, err)
		hello = rec.firstFrame()
	default:
		t.Fatalf("no victim over %v", tr)
	}
	t.Cleanup(func() { c.Close() })
	sc, err = l.AcceptConn(ctx)
	require.NoError(t, err)
	require.NotEmpty(t, hello)
	return c, sc, hello
}

// doorAcceptor takes every connection l establishes, until l closes.
type doorAcceptor struct {
	mu    sync.Mutex
	conns []*Conn
	n     atomic.Int32
	done  chan struct{}
}

// doorAcceptAll starts a doorAcceptor on l; the test's end closes l and
// waits for it.
func doorAcceptAll(t testing.TB, l *Listener) *doorAcceptor {
	a := &doorAcceptor{done: make(chan struct{})}
	go func() {
		defer close(a.done)
		for {
			c, err := l.AcceptConn(context.Background())
			if err != nil {
				return
			}
			a.mu.Lock()
			a.conns = append(a.conns, c)
			a.mu.Unlock()
			a.n.Add(1)
		}
	}()
	t.Cleanup(func() { l.Close(); <-a.done })
	return a
}

func (a *doorAcceptor) accepted() []*Conn {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]*Conn(nil), a.conns...)
}

// doorAcceptedBy takes what l's AcceptConn returns within d of each call,
// until a call gets nothing.
func doorAcceptedBy(l *Listener, d time.Duration) []*Conn {
	var cs []*Conn
	for range 100 {
		ctx, cancel := context.WithTimeout(context.Background(), d)
		c, err := l.AcceptConn(ctx)
		cancel()
		if err != nil {
			break
		}
		cs = append(cs, c)
	}
	return cs
}

// doorPollUntil waits, at most d, for cond; it reports whether it held.
func doorPollUntil(d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(2 * time.Millisecond) // a poll: no event tells of a counter's change
	}
}

// doorGraceful reports whether err reads as a graceful end.
func doorGraceful(err error) bool {
	return err == nil || errors.Is(err, ErrPeerClosed) || errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed)
}

// doorCount counts the streams of seen that the server answered with its
// Noise message 2, and those it left open.
func doorCount(seen []doorSeen) (answered, open int) {
	for _, s := range seen {
		if s.got(helloSecureAccept) {
			answered++
		}
		if !s.closed {
			open++
		}
	}
	return answered, open
}

// doorCutRelay passes TCP streams to server: the server's bytes as they
// come (its FIN too), the client's frame by frame (the size fields are in
// clear, on a secure stream too) while pass says so. At the first frame
// pass refuses, it half-closes its stream to the server, a FIN as if the
// client had ended its side there, and drops all that follows.
func doorCutRelay(t testing.TB, server string, pass func(i int, f []byte) bool) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var wg sync.WaitGroup
	wg.Go(func() {
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
			wg.Go(func() {
				io.Copy(a, b)
				a.(*net.TCPConn).CloseWrite()
			})
			wg.Go(func() {
				defer a.Close()
				defer b.Close()
				var buf []byte
				rb := make([]byte, 32<<10)
				cut := false
				for i := 0; ; {
					n, err := a.Read(rb)
					if !cut {
						buf = append(buf, rb[:n]...)
					}
					for !cut {
						size, k := consumeVLE32(buf)
						if k < 0 || len(buf) < k+int(size) {
							break
						}
						f := buf[:k+int(size)]
						if !pass(i, f) {
							cut = true
							b.(*net.TCPConn).CloseWrite()
							buf = nil
							break
						}
						if _, err := b.Write(f); err != nil {
							return
						}
						buf = buf[len(f):]
						i++
					}
					if err != nil {
						return
					}
				}
			})
		}
	})
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	return ln.Addr().String()
}
