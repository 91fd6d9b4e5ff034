//go:build !js

package knet

// The stream attack matrix's machinery (stream_matrix_test.go): a relay
// between a victim and the listener that holds, passes and injects
// frames each way; an attacker's own streams (TCP from an IP of its
// choice, WebSocket); the server's application, which records what each
// connection delivered; the listener's stream connections as the
// attacker sees them (by address).

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/coder/websocket"
	"github.com/stretchr/testify/require"
)

// mxAddr is a's address (TCP or UDP), unmapped.
func mxAddr(a net.Addr) netip.AddrPort {
	switch a := a.(type) {
	case *net.TCPAddr:
		return unmap(a.AddrPort())
	case *net.UDPAddr:
		return unmap(a.AddrPort())
	}
	return netip.AddrPort{}
}

var (
	mxVictimIP = net.IPv4(127, 0, 0, 1)
	mxOtherIP  = net.IPv4(127, 0, 0, 2)
)

// mxDialWS opens a WebSocket to url from ip, and returns it with its
// local address: the address the listener sees.
func mxDialWS(ctx context.Context, url string, ip net.IP) (*websocket.Conn, netip.AddrPort, error) {
	var mu sync.Mutex
	var local netip.AddrPort
	tr := &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: ip}}
		c, err := d.DialContext(ctx, network, addr)
		if err == nil {
			mu.Lock()
			local = mxAddr(c.LocalAddr())
			mu.Unlock()
		}
		return c, err
	}}
	defer tr.CloseIdleConnections()
	ws, _, err := websocket.Dial(ctx, url, &websocket.DialOptions{HTTPClient: &http.Client{Transport: tr}})
	if err != nil {
		return nil, netip.AddrPort{}, err
	}
	mu.Lock()
	defer mu.Unlock()
	return ws, local, nil
}

// mxStream is an attacker's stream to the listener.
type mxStream struct {
	nc     net.Conn
	ws     *websocket.Conn // nil over TCP
	local  netip.AddrPort
	opened time.Time

	got       []byte
	finned    bool
	closeDone chan struct{} // over WebSocket: our close handshake ended
	stop      chan struct{} // ends a trickle
	wg        sync.WaitGroup
	closeOnce sync.Once
}

func mxDialTCP(ctx context.Context, to string, ip net.IP) (*mxStream, error) {
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: ip}}
	opened := time.Now()
	nc, err := d.DialContext(ctx, "tcp", to)
	if err != nil {
		return nil, err
	}
	nc.(*net.TCPConn).SetNoDelay(true)
	return &mxStream{nc: nc, local: mxAddr(nc.LocalAddr()), opened: opened, stop: make(chan struct{})}, nil
}

func mxDialWSStream(ctx context.Context, url string, ip net.IP) (*mxStream, error) {
	opened := time.Now()
	ws, local, err := mxDialWS(ctx, url, ip)
	if err != nil {
		return nil, err
	}
	nc := websocket.NetConn(context.Background(), ws, websocket.MessageBinary)
	return &mxStream{nc: nc, ws: ws, local: local, opened: opened, stop: make(chan struct{})}, nil
}

func (s *mxStream) write(b []byte) { s.nc.Write(b) }

// fin ends what the attacker sends: a TCP half-close; over WebSocket,
// which has none, the close handshake.
func (s *mxStream) fin() {
	s.finned = true
	if s.ws == nil {
		s.nc.(*net.TCPConn).CloseWrite()
		return
	}
	s.closeDone = make(chan struct{})
	s.wg.Go(func() {
		s.ws.Close(websocket.StatusNormalClosure, "")
		close(s.closeDone)
	})
}

// trickle writes b a byte every 50 ms, on a goroutine, until the stream
// fails or close.
func (s *mxStream) trickle(b []byte) {
	s.wg.Go(func() {
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for i := range b {
			if _, err := s.nc.Write(b[i : i+1]); err != nil {
				return
			}
			select {
			case <-tick.C:
			case <-s.stop:
				return
			}
		}
	})
}

// awaitClosed reads what the server sends until it ends the stream, or
// until deadline; it reports whether the server ended it, and when.
func (s *mxStream) awaitClosed(deadline time.Time) (closed bool, at time.Time) {
	if s.finned && s.ws != nil {
		// Reading would race the close handshake for its frame.
		select {
		case <-s.closeDone:
			return true, time.Now()
		case <-time.After(time.Until(deadline)):
			return false, time.Time{}
		}
	}
	s.nc.SetReadDeadline(deadline)
	buf := make([]byte, 4096)
	for {
		n, err := s.nc.Read(buf)
		s.got = append(s.got, buf[:n]...)
		if err == nil {
			continue
		}
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() || !time.Now().Before(deadline) {
			return false, time.Time{}
		}
		return true, time.Now()
	}
}

func (s *mxStream) close() {
	s.closeOnce.Do(func() {
		close(s.stop)
		if s.ws != nil {
			s.ws.CloseNow()
		} else {
			s.nc.Close()
		}
		s.wg.Wait()
	})
}

// mxHellos returns the knet hellos among the frames of b, what a server
// sends in clear: a secure server's too, until its kind-6 answer.
func mxHellos(b []byte) (kinds []byte) {
	fr := newTCPFramer(1 << 20)
	fr.feed(b)
	for range 1000 {
		id, p, ok, err := fr.next()
		if err != nil || !ok {
			break
		}
		if kind, _, isHello := parseStreamHello(p); isHello && id == idPingReply {
			kinds = append(kinds, kind)
		}
	}
	return kinds
}

// mxWay is one direction of an mxRelay: the frames read from its source,
// each written to its destination unless held.
type mxWay struct {
	mu       sync.Mutex
	dst      net.Conn
	fin      func()
	frames   [][]byte // every frame read, in order; nil: the source's end
	changed  chan struct{}
	holdFrom int // frames from this index on are held; -1: none
	held     []mxHeld
	finned   bool
}

type mxHeld struct {
	i int
	f []byte
}

func (w *mxWay) take(f []byte) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.held = append(w.held, mxHeld{len(w.frames), f})
	w.frames = append(w.frames, f)
	close(w.changed)
	w.changed = make(chan struct{})
	w.flushLocked()
}

func (w *mxWay) flushLocked() {
	if w.dst == nil {
		return
	}
	for len(w.held) > 0 && (w.holdFrom < 0 || w.held[0].i < w.holdFrom) {
		w.send(w.held[0].f)
		w.held = w.held[1:]
	}
}

// send writes f (nil: the end) to the destination; w.mu is held.
func (w *mxWay) send(f []byte) {
	if w.finned {
		return
	}
	if f == nil {
		w.finned = true
		w.fin()
		return
	}
	w.dst.Write(f)
}

func (w *mxWay) connect(dst net.Conn, fin func()) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.dst, w.fin = dst, fin
	w.flushLocked()
}

// hold holds every frame from the next one on.
func (w *mxWay) hold() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.holdFrom = len(w.frames)
}

// pass sends what is held and passes everything from now on.
func (w *mxWay) pass() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.holdFrom = -1
	w.flushLocked()
}

// inject writes b between two frames, before any held.
func (w *mxWay) inject(b []byte) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.send(b)
}

func (w *mxWay) injectFIN() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.send(nil)
}

// trickle writes b a byte every 50 ms, between two frames: the source's
// frames wait behind it.
func (w *mxWay) trickle(b []byte) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for i := range b {
		if w.finned {
			return
		}
		w.dst.Write(b[i : i+1])
		time.Sleep(50 * time.Millisecond) // pacing the trickle
	}
}

func (w *mxWay) count() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.frames)
}

func (w *mxWay) frame(i int) []byte {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.frames[i]
}

// await waits up to d until n frames were read.
func (w *mxWay) await(n int, d time.Duration) bool {
	timer := time.NewTimer(d)
	defer timer.Stop()
	for {
		w.mu.Lock()
		ok, changed := len(w.frames) >= n, w.changed
		w.mu.Unlock()
		if ok {
			return true
		}
		select {
		case <-changed:
		case <-timer.C:
			return false
		}
	}
}

// mxRelay passes one victim's stream to the listener frame by frame
// (their size fields are in clear, a secure stream's too): up the
// victim's frames, down the server's. It can hold either way, inject
// bytes or a FIN up between two frames, and connect to the listener only
// when told (connectUp), so that the server's side of the stream opens
// when the matrix wants it to.
type mxRelay struct {
	tr        Transport
	addr      string // what the victim dials: host:port, or a ws:// URL
	serverTCP string
	serverWS  string
	onConnect func(netip.AddrPort) // before the first byte goes up

	up, down mxWay
	victim   chan struct{} // closed when the victim's stream came
	ready    chan struct{} // closed when connectUp is done
	upLocal  netip.AddrPort

	vc, sc      net.Conn
	vws, sws    *websocket.Conn
	ln          net.Listener
	srv         *httptest.Server
	acceptOnce  sync.Once
	connectOnce sync.Once
	connectErr  error
	wg          sync.WaitGroup
	closeOnce   sync.Once
	closing     chan struct{}
}

func newMxRelay(t testing.TB, tr Transport, serverTCP, serverWS string, holdUpFrom int) *mxRelay {
	r := &mxRelay{tr: tr, serverTCP: serverTCP, serverWS: serverWS,
		victim: make(chan struct{}), ready: make(chan struct{}), closing: make(chan struct{})}
	r.up.changed, r.down.changed = make(chan struct{}), make(chan struct{})
	r.up.holdFrom, r.down.holdFrom = holdUpFrom, -1
	if tr == TransportTCP {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		r.ln, r.addr = ln, ln.Addr().String()
		r.wg.Go(func() {
			nc, err := ln.Accept()
			ln.Close()
			if err != nil {
				return
			}
			nc.(*net.TCPConn).SetNoDelay(true)
			r.gotVictim(nc, nil)
		})
	} else {
		r.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
			ws, err := websocket.Accept(w, req, nil)
			if err != nil {
				return
			}
			first := false
			r.acceptOnce.Do(func() { first = true })
			if !first {
				ws.CloseNow()
				return
			}
			r.gotVictim(websocket.NetConn(context.Background(), ws, websocket.MessageBinary), ws)
		}))
		r.addr = "ws" + strings.TrimPrefix(r.srv.URL, "http")
	}
	return r
}

func (r *mxRelay) gotVictim(vc net.Conn, vws *websocket.Conn) {
	select {
	case <-r.closing:
		vc.Close()
		return
	default:
	}
	r.vc, r.vws = vc, vws
	close(r.victim)
	r.wg.Go(func() { r.read(vc, &r.up) })
}

// connectUp opens the stream to the listener; the victim's stream must
// have come.
func (r *mxRelay) connectUp() error {
	r.connectOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), mxWait)
		defer cancel()
		if r.tr == TransportTCP {
			d := net.Dialer{LocalAddr: &net.TCPAddr{IP: mxVictimIP}}
			nc, err := d.DialContext(ctx, "tcp", r.serverTCP)
			if err != nil {
				r.connectErr = err
				return
			}
			nc.(*net.TCPConn).SetNoDelay(true)
			r.sc, r.upLocal = nc, mxAddr(nc.LocalAddr())
		} else {
			ws, local, err := mxDialWS(ctx, r.serverWS, mxVictimIP)
			if err != nil {
				r.connectErr = err
				return
			}
			r.sc, r.sws, r.upLocal = websocket.NetConn(context.Background(), ws, websocket.MessageBinary), ws, local
		}
		if r.onConnect != nil {
			r.onConnect(r.upLocal)
		}
		r.up.connect(r.sc, r.finner(r.sc, r.sws))
		r.down.connect(r.vc, r.finner(r.vc, r.vws))
		close(r.ready)
		r.wg.Go(func() { r.read(r.sc, &r.down) })
	})
	return r.connectErr
}

// finner half-closes nc: over WebSocket, which has none, a close
// handshake (on a goroutine: it waits for the peer's answer).
func (r *mxRelay) finner(nc net.Conn, ws *websocket.Conn) func() {
	if ws == nil {
		return func() { nc.(*net.TCPConn).CloseWrite() }
	}
	return func() { r.wg.Go(func() { ws.Close(websocket.StatusNormalClosure, "") }) }
}

// read cuts what src sends into frames for w.
func (r *mxRelay) read(src net.Conn, w *mxWay) {
	var buf []byte
	rb := make([]byte, 32<<10)
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
			w.take(f)
		}
		if err != nil {
			w.take(nil)
			return
		}
	}
}

func (r *mxRelay) close() {
	r.closeOnce.Do(func() {
		close(r.closing)
		if r.ln != nil {
			r.ln.Close()
		}
		if r.srv != nil {
			r.srv.Close()
		}
		select {
		case <-r.victim:
			if r.vws != nil {
				r.vws.CloseNow()
			} else {
				r.vc.Close()
			}
		default:
		}
		select {
		case <-r.ready:
			if r.sws != nil {
				r.sws.CloseNow()
			} else {
				r.sc.Close()
			}
		default:
		}
		r.wg.Wait()
	})
}

// mxServed is a connection the server's application accepted.
type mxServed struct {
	c    *Conn
	from netip.AddrPort
	at   time.Time // when the application accepted it
	msgs []Message
}

// mxGate holds the admission of one victim's stream (AdmitConn).
type mxGate struct {
	entered, release chan struct{}
	enterOnce, once  sync.Once
}

func newMxGate() *mxGate {
	return &mxGate{entered: make(chan struct{}), release: make(chan struct{})}
}

func (g *mxGate) open() { g.once.Do(func() { close(g.release) }) }

// mxConnFrom returns the listener's stream connection from addr, if any.
func mxConnFrom(l *Listener, addr netip.AddrPort) *Conn {
	for _, c := range l.streamConns(false) {
		if mxAddr(c.RemoteAddr()) == addr {
			return c
		}
	}
	return nil
}

// mxGraceful reports whether err is how a connection ends gracefully.
func mxGraceful(err error) bool {
	var de *DisconnectError
	return err == net.ErrClosed || errors.Is(err, ErrPeerClosed) || errors.As(err, &de)
}

// mxNonGraceful reports whether err says the connection did not end
// well: never nil, a graceful end or a bare end of the stream.
func mxNonGraceful(err error) bool {
	return err != nil && !mxGraceful(err) && !errors.Is(err, io.EOF)
}

// mxPoll checks cond every millisecond for up to d: a bounded poll for a
// state no event announces (the listener's counters, its stream table).
func mxPoll(d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(time.Millisecond)
	}
}

// mxPayloads lists the payloads of msgs.
func mxPayloads(msgs []Message) []string {
	out := make([]string, 0, len(msgs))
	for _, m := range msgs {
		out = append(out, string(m.Payload))
	}
	return out
}

// mxForeign returns the payloads that are none of the victims'.
func mxForeign(ps []string) []string {
	return slices.DeleteFunc(slices.Clone(ps), func(p string) bool { return strings.HasPrefix(p, "VICTIM:") })
}
