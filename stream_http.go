package knet

import (
	"bytes"
	"errors"
	"net"
	"net/http"
	"sync"
)

// HTTP on the game's TCP port (Config.HTTP): a server's TCP stream is
// taken, through the same door as any (a pending place, the per-source
// limits, the eviction of silent streams), and its first bytes tell kNet
// from HTTP. A knet hello starts with its size and MessageID 2, the
// reference's first ping with 02 01 01: neither is a letter, so the
// second byte at the latest tells them from a request line. An HTTP
// stream leaves the door (its attempt ends, not counted failed) and goes,
// with the bytes read of it, to the Listener's http.Server.

// The sniff states of a stream (streamConn.sniff); 0: told kNet, or not
// asked.
const (
	sniffing    = 1
	sniffedHTTP = 2
)

// sniffLen is how many first bytes sniffHTTP needs at most: the longest
// method, its space and the target's first byte.
const sniffLen = len("OPTIONS") + 2

// errStreamToHTTP ends the connection of a stream handed to HTTP.
var errStreamToHTTP = errors.New("knet: the stream is HTTP (Config.HTTP)")

var httpMethods = [...]string{"GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH"}

// sniffHTTP reports whether b, a stream's first bytes, begin an HTTP/1
// request line (a method, a space, then "/" or "*"), and whether they
// tell at all: told is false while b could still become one.
func sniffHTTP(b []byte) (isHTTP, told bool) {
	for _, m := range httpMethods {
		n := min(len(b), len(m))
		if !bytes.Equal(b[:n], []byte(m)[:n]) {
			continue
		}
		switch {
		case len(b) <= len(m):
			return false, false // a method's start
		case b[len(m)] != ' ':
			continue
		case len(b) == len(m)+1:
			return false, false
		}
		return b[len(m)+1] == '/' || b[len(m)+1] == '*', true
	}
	return false, true
}

// inBytes returns a copy of up to max bytes that the reader read and no
// round took; st.mu is held.
func (st *streamConn) inBytes(max int) []byte {
	b := make([]byte, 0, min(max, st.inN))
	for i, bp := range st.in {
		if len(b) == max {
			break
		}
		b = append(b, (*bp)[:min(st.inLen[i], max-len(b))]...)
	}
	return b
}

// httpOn is a Listener's HTTP server on its TCP port.
type httpOn struct {
	once sync.Once
	srv  *http.Server
	ln   *streamsListener

	// What the door bounds for attempts it bounds for HTTP streams that
	// hold a socket with no request in progress (new, or idle between
	// requests): at most MaxPendingPerSource of one source, and
	// MaxPendingConnections in all (heldOK). A stream handed over past
	// them is closed; so is one going idle past them. A request in
	// progress is the handler's to bound.
	mu     sync.Mutex
	held   map[sourceKey]int
	total  int
	counts map[net.Conn]sourceKey // the streams counted in held
}

// hold counts c, of source k, among the HTTP streams held idle, and
// reports false (counting nothing) past the bounds.
func (h *httpOn) hold(l *Listener, c net.Conn, k sourceKey) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, ok := h.counts[c]; ok {
		return true
	}
	if h.total >= l.cfg.maxPending || h.held[k] >= l.cfg.maxPendingPerSource {
		return false
	}
	if h.held == nil {
		h.held, h.counts = make(map[sourceKey]int), make(map[net.Conn]sourceKey)
	}
	h.held[k]++
	h.total++
	h.counts[c] = k
	return true
}

// release stops counting c (a request in progress, or its end).
func (h *httpOn) release(c net.Conn) {
	h.mu.Lock()
	defer h.mu.Unlock()
	k, ok := h.counts[c]
	if !ok {
		return
	}
	delete(h.counts, c)
	h.total--
	if h.held[k]--; h.held[k] == 0 {
		delete(h.held, k)
	}
}

// connState keeps the count of held streams as the server moves them.
func (l *Listener) connState(c net.Conn, st http.ConnState) {
	h := &l.http
	switch st {
	case http.StateIdle:
		if !h.hold(l, c, sourceOf(unmap(streamAddr(c.RemoteAddr())).Addr())) {
			l.eps[0].ignored.Add(1)
			c.Close() // past the bounds: the idle connection goes
		}
	case http.StateActive, http.StateHijacked, http.StateClosed:
		h.release(c)
	}
}

// serveHTTP hands nc, whose first bytes pre were read already, to the
// Listener's HTTP server, started on first use.
func (l *Listener) serveHTTP(nc net.Conn, pre []byte) {
	h := &l.http
	h.once.Do(func() {
		h.ln = &streamsListener{addr: l.tcp.Addr(), conns: make(chan net.Conn, 64), closed: make(chan struct{})}
		h.srv = &http.Server{Handler: l.cfg.http, ReadHeaderTimeout: l.cfg.connectTimeout, IdleTimeout: l.cfg.lostTimeout, ConnState: l.connState}
		go h.srv.Serve(h.ln)
	})
	if h.ln == nil {
		nc.Close() // the Listener closed first (closeHTTP)
		return
	}
	c := &prefixedConn{Conn: nc, pre: pre}
	if !h.hold(l, c, sourceOf(unmap(streamAddr(nc.RemoteAddr())).Addr())) {
		l.eps[0].ignored.Add(1)
		nc.Close() // its source, or the Listener, holds as many as the door lets wait
		return
	}
	if !h.ln.put(c) {
		h.release(c) // closed, never the server's
	}
}

// closeHTTP ends the HTTP server and the streams it serves (Close).
func (l *Listener) closeHTTP() {
	h := &l.http
	h.once.Do(func() {}) // none starts after this
	if h.srv != nil {
		h.srv.Close()
	}
}

// streamsListener is a net.Listener of the streams handed to HTTP.
type streamsListener struct {
	addr   net.Addr
	conns  chan net.Conn
	closed chan struct{}
	// mu orders put against Close: a stream put after Close, or left in
	// conns when it came, is closed, never left where no Accept takes it.
	mu   sync.Mutex
	done bool
}

// put queues c for Accept, or closes it if the listener is closed or
// the server is behind by 64 streams.
func (s *streamsListener) put(c net.Conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.done {
		c.Close()
		return false
	}
	select {
	case s.conns <- c:
		return true
	default:
		c.Close() // the server is behind by 64 streams: this one goes
		return false
	}
}

func (s *streamsListener) Accept() (net.Conn, error) {
	select {
	case <-s.closed: // before a queued stream, which Close closes
		return nil, net.ErrClosed
	default:
	}
	select {
	case c := <-s.conns:
		return c, nil
	case <-s.closed:
		return nil, net.ErrClosed
	}
}

func (s *streamsListener) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.done {
		return nil
	}
	s.done = true
	close(s.closed)
	for {
		select {
		case c := <-s.conns:
			c.Close() // queued, never accepted
		default:
			return nil
		}
	}
}

func (s *streamsListener) Addr() net.Addr { return s.addr }

// prefixedConn is a stream whose first bytes, pre, were read already.
type prefixedConn struct {
	net.Conn
	pre []byte
}

func (c *prefixedConn) Read(b []byte) (int, error) {
	if len(c.pre) > 0 {
		n := copy(b, c.pre)
		c.pre = c.pre[n:]
		return n, nil
	}
	return c.Conn.Read(b)
}

// CloseWrite half-closes the TCP stream, as net/http does after an error.
func (c *prefixedConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return c.Conn.Close()
}
