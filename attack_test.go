package knet

// Attack tests: an attacker's view of secure sessions, on real loopback
// sockets. The attacker is a relay between a client and a server that
// sees every datagram and can drop, hold back or inject datagrams in
// either direction from the addresses the two ends know each other by
// (attackRelay), or a socket elsewhere that spoofs and replays
// (attackerSock). Each test asserts what a secure session must
// guarantee: nothing forged or replayed is delivered, no connection is
// made without the key exchange, the real connection survives, and an
// address that never proved itself gets no more bytes than it sent.

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// isForged reports whether a payload is one an attacker made up: no
// application may ever receive one.
func isForged(p []byte) bool {
	return bytes.Contains(p, []byte("INJECTED")) || bytes.Contains(p, []byte("MARKER"))
}

// attackWait bounds every wait for something that must happen.
const attackWait = 10 * time.Second

// Datagram helpers.

func holdsID(b []byte, id uint32) bool { ok, _ := holds(b, id); return ok }

func isClearSyn(b []byte) bool { return holdsID(b, idConnectSyn) }

func isClearSynAck(b []byte) bool { return holdsID(b, idConnectSynAck) }

// isClearHandshake reports whether b is a clear datagram of the handshake
// (everything else of a secure session is sealed).
func isClearHandshake(b []byte) bool {
	for _, id := range []uint32{idConnectSyn, idConnectSynAck, idDisconnectAck, idRetry} {
		if holdsID(b, id) {
			return true
		}
	}
	return false
}

func pidOf(b []byte) uint32 {
	if len(b) < minHeaderSize {
		return 0
	}
	return (uint32(b[0]) | uint32(b[1])<<8 | uint32(b[2])<<16) & packetIDMask
}

func isReliableDg(b []byte) bool {
	return len(b) >= minHeaderSize && b[2]&(headerFlagReliable>>16) != 0
}

func isInOrderDg(b []byte) bool { return len(b) >= minHeaderSize && b[2]&(headerFlagInOrder>>16) != 0 }

// clearDatagram is a datagram in clear holding msgs, under PacketID pid.
func clearDatagram(pid uint32, reliable bool, msgs ...message) []byte {
	return appendDatagram(nil, &datagram{header: header{packetID: pid, reliable: reliable}, msgs: msgs})
}

// contentOf returns the content of the first whole message id in b.
func contentOf(b []byte, id uint32) []byte {
	var content []byte
	var h header
	scanDatagram(b, &h, func(m message) {
		if content == nil && !m.fragment && m.id == id {
			content = bytes.Clone(m.payload)
		}
	})
	return content
}

// resentSyn is the ConnectSyn datagram syn as its client would send it
// again: the same content, padded the same, under a new PacketID. A
// server still waiting for the handshake to complete answers it with its
// ConnectSynAck again, after whatever came before it: the attacker's
// barrier. (The very same datagram is a duplicate, and gets no answer.)
func resentSyn(syn []byte) []byte {
	d := clearDatagram(1000, false, message{id: idConnectSyn, payload: contentOf(syn, idConnectSyn)})
	return appendPadding(d, synPadTo)
}

func addrOf(a net.Addr) netip.AddrPort { return unmap(a.(*net.UDPAddr).AddrPort()) }

func randomBytes(n int) []byte {
	b := make([]byte, n)
	rand.Read(b)
	return b
}

// attackRelay is an on-path attacker between one client and a server: it
// records every datagram both ways, and a rule per direction says which
// to pass, drop or hold back (pass sends what was held, in order). It
// injects datagrams of its own: to the server from the client's address
// as the server sees it (injectUp), to the client from the server's
// address as the client sees it (injectDown). rebind moves the client to
// a new address, as a NAT does: the old socket stays open but passes
// nothing on.
type attackRelay struct {
	t      testing.TB
	pc     *net.UDPConn // facing the client
	server netip.AddrPort
	client atomic.Pointer[netip.AddrPort]
	wg     sync.WaitGroup

	mu        sync.Mutex
	up, down  relayWay
	outer     *net.UDPConn   // the client's address, as the server sees it
	old       []*net.UDPConn // former outer sockets, forgotten
	closeOnce sync.Once
}

type relayFate uint8

const (
	relayPass relayFate = iota
	relayDrop
	relayHold
)

type relayEntry struct {
	b    []byte
	fate relayFate
	old  bool // down: it reached a former outer socket
}

// relayWay is one direction of an attackRelay.
type relayWay struct {
	log     []relayEntry
	changed chan struct{} // closed and replaced at each datagram
	rule    func(b []byte) relayFate
	held    [][]byte
}

func (w *relayWay) record(e relayEntry) {
	w.log = append(w.log, e)
	close(w.changed)
	w.changed = make(chan struct{})
}

// take records b and decides its fate by the rule.
func (w *relayWay) take(b []byte) relayFate {
	fate := relayPass
	if w.rule != nil {
		fate = w.rule(b)
	}
	if fate == relayHold {
		w.held = append(w.held, b)
	}
	w.record(relayEntry{b: b, fate: fate})
	return fate
}

func holdAll([]byte) relayFate { return relayHold }
func dropAll([]byte) relayFate { return relayDrop }

func newAttackRelay(t testing.TB, server net.Addr) *attackRelay {
	pc, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	r := &attackRelay{t: t, pc: pc, server: addrOf(server)}
	r.up.changed = make(chan struct{})
	r.down.changed = make(chan struct{})
	o := r.newOuter()
	r.mu.Lock()
	r.outer = o
	r.mu.Unlock()
	r.wg.Go(func() {
		buf := make([]byte, 65536)
		for {
			n, from, err := pc.ReadFromUDPAddrPort(buf)
			if err != nil {
				if errors.Is(err, net.ErrClosed) {
					return
				}
				continue
			}
			r.client.Store(&from)
			b := bytes.Clone(buf[:n])
			r.mu.Lock()
			fate := r.up.take(b)
			out := r.outer
			r.mu.Unlock()
			if fate == relayPass {
				out.WriteToUDPAddrPort(b, r.server)
			}
		}
	})
	t.Cleanup(r.close)
	return r
}

// newOuter opens a socket facing the server; what it receives goes to the
// client while it is the current one.
func (r *attackRelay) newOuter() *net.UDPConn {
	o, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(r.t, err)
	r.wg.Go(func() {
		buf := make([]byte, 65536)
		for {
			n, err := o.Read(buf)
			if err != nil {
				if errors.Is(err, net.ErrClosed) {
					return
				}
				continue // an ICMP report
			}
			b := bytes.Clone(buf[:n])
			r.mu.Lock()
			fate := relayDrop
			if o == r.outer {
				fate = r.down.take(b)
			} else {
				r.down.record(relayEntry{b: b, fate: relayDrop, old: true})
			}
			r.mu.Unlock()
			if to := r.client.Load(); fate == relayPass && to != nil {
				r.pc.WriteToUDPAddrPort(b, *to)
			}
		}
	})
	return o
}

func (r *attackRelay) Addr() string { return r.pc.LocalAddr().String() }

// outerAddr is the client's address as the server sees it now.
func (r *attackRelay) outerAddr() netip.AddrPort {
	r.mu.Lock()
	defer r.mu.Unlock()
	return addrOf(r.outer.LocalAddr())
}

// clientAddr is the client's own socket address.
func (r *attackRelay) clientAddr() netip.AddrPort {
	if a := r.client.Load(); a != nil {
		return *a
	}
	return netip.AddrPort{}
}

func (r *attackRelay) setRule(w *relayWay, rule func([]byte) relayFate) {
	r.mu.Lock()
	w.rule = rule
	r.mu.Unlock()
}

// pass lets everything through that way from now on, what was held first.
func (r *attackRelay) pass(w *relayWay) {
	r.mu.Lock()
	defer r.mu.Unlock()
	w.rule = nil
	for _, b := range w.held {
		if w == &r.up {
			r.outer.WriteToUDPAddrPort(b, r.server)
		} else if to := r.client.Load(); to != nil {
			r.pc.WriteToUDPAddrPort(b, *to)
		}
	}
	w.held = nil
}

func (r *attackRelay) passAll() {
	r.pass(&r.up)
	r.pass(&r.down)
}

// injectUp sends b to the server from the client's address.
func (r *attackRelay) injectUp(b []byte) {
	r.mu.Lock()
	out := r.outer
	r.mu.Unlock()
	out.WriteToUDPAddrPort(b, r.server)
}

// injectDown sends b to the client from the server's address.
func (r *attackRelay) injectDown(b []byte) {
	if to := r.client.Load(); to != nil {
		r.pc.WriteToUDPAddrPort(b, *to)
	}
}

// rebind moves the client to a new outer address.
func (r *attackRelay) rebind() {
	o := r.newOuter()
	r.mu.Lock()
	r.old = append(r.old, r.outer)
	r.outer = o
	r.mu.Unlock()
}

func (r *attackRelay) snapshot(w *relayWay) ([]relayEntry, chan struct{}) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return w.log[:len(w.log):len(w.log)], w.changed
}

func (r *attackRelay) datagrams(w *relayWay) [][]byte {
	log, _ := r.snapshot(w)
	out := make([][]byte, len(log))
	for i, e := range log {
		out[i] = e.b
	}
	return out
}

// await waits up to d for a datagram that way, at index from or later,
// that pred accepts.
func (r *attackRelay) await(w *relayWay, from int, d time.Duration, pred func(relayEntry) bool) (int, []byte, bool) {
	timer := time.NewTimer(d)
	defer timer.Stop()
	for {
		log, changed := r.snapshot(w)
		for i := from; i < len(log); i++ {
			if pred(log[i]) {
				return i, log[i].b, true
			}
		}
		from = max(from, len(log))
		select {
		case <-changed:
		case <-timer.C:
			return -1, nil, false
		}
	}
}

func (r *attackRelay) mustAwait(t testing.TB, w *relayWay, from int, what string, pred func(relayEntry) bool) (int, []byte) {
	t.Helper()
	i, b, ok := r.await(w, from, attackWait, pred)
	require.True(t, ok, "the relay saw no %s", what)
	return i, b
}

func (r *attackRelay) close() {
	r.closeOnce.Do(func() {
		r.pc.Close()
		r.mu.Lock()
		r.outer.Close()
		for _, o := range r.old {
			o.Close()
		}
		r.mu.Unlock()
		r.wg.Wait()
	})
}

// attackerSock is a socket of the attacker's elsewhere: it counts what it
// sends and what it gets (anti-amplification), and keeps what it gets.
type attackerSock struct {
	pc   *net.UDPConn
	addr netip.AddrPort
	sent atomic.Int64
	wg   sync.WaitGroup

	mu      sync.Mutex
	got     [][]byte
	gotN    int
	changed chan struct{}
}

func newAttackerSock(t testing.TB) *attackerSock {
	pc, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	a := &attackerSock{pc: pc, addr: addrOf(pc.LocalAddr()), changed: make(chan struct{})}
	a.wg.Go(func() {
		buf := make([]byte, 65536)
		for {
			n, _, err := pc.ReadFromUDPAddrPort(buf)
			if err != nil {
				if errors.Is(err, net.ErrClosed) {
					return
				}
				continue
			}
			a.mu.Lock()
			a.got = append(a.got, bytes.Clone(buf[:n]))
			a.gotN += n
			close(a.changed)
			a.changed = make(chan struct{})
			a.mu.Unlock()
		}
	})
	t.Cleanup(func() { pc.Close(); a.wg.Wait() })
	return a
}

func (a *attackerSock) send(b []byte, to netip.AddrPort) {
	a.sent.Add(int64(len(b)))
	a.pc.WriteToUDPAddrPort(b, to)
}

func (a *attackerSock) received() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.gotN
}

// await waits up to d for a datagram, from index from on, that pred
// accepts, and returns its index.
func (a *attackerSock) await(from int, d time.Duration, pred func([]byte) bool) (int, bool) {
	timer := time.NewTimer(d)
	defer timer.Stop()
	for {
		a.mu.Lock()
		got, changed := a.got, a.changed
		a.mu.Unlock()
		for i := from; i < len(got); i++ {
			if pred(got[i]) {
				return i, true
			}
		}
		from = max(from, len(got))
		select {
		case <-changed:
		case <-timer.C:
			return -1, false
		}
	}
}

func (a *attackerSock) count() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.got)
}

// attackServer is a secure listener whose application echoes every
// message back and keeps what each connection received; an AdmitConn gate
// can hold the admission of one address.
type attackServer struct {
	l  *Listener
	wg sync.WaitGroup

	mu      sync.Mutex
	conns   []*servedConn
	gate    *admitGate
	changed chan struct{}
}

type servedConn struct {
	c     *Conn
	from  netip.AddrPort // where it was accepted from
	msgs  []Message
	end   error // what ended the application's Receive
	taken bool
}

// admitGate holds the admission of the connection from one address.
type admitGate struct {
	from             netip.AddrPort
	entered, release chan struct{}
	once             sync.Once
}

func (g *admitGate) open() { g.once.Do(func() { close(g.release) }) }

func newAttackServer(t *testing.T, cfg *Config) *attackServer {
	s := &attackServer{changed: make(chan struct{})}
	admit := cfg.AdmitConn
	cfg.AdmitConn = func(c *Conn, payload []byte) ([]byte, error) {
		s.mu.Lock()
		g := s.gate
		if g != nil && addrOf(c.RemoteAddr()) == g.from {
			s.gate = nil
		} else {
			g = nil
		}
		s.mu.Unlock()
		if g != nil {
			close(g.entered)
			select {
			case <-g.release:
			case <-time.After(attackWait):
			}
		}
		if admit != nil {
			return admit(c, payload)
		}
		return nil, nil
	}
	s.l = listen(t, cfg)
	s.wg.Go(func() {
		for {
			c, err := s.l.AcceptConn(context.Background())
			if err != nil {
				return
			}
			sc := &servedConn{c: c, from: addrOf(c.RemoteAddr())}
			s.mu.Lock()
			s.conns = append(s.conns, sc)
			s.signal()
			s.mu.Unlock()
			s.wg.Go(func() { s.serve(sc) })
		}
	})
	t.Cleanup(func() { s.l.Close(); s.wg.Wait() })
	return s
}

func (s *attackServer) signal() {
	close(s.changed)
	s.changed = make(chan struct{})
}

func (s *attackServer) serve(sc *servedConn) {
	for {
		m, err := sc.c.Receive(context.Background())
		s.mu.Lock()
		if err != nil {
			sc.end = err
		} else {
			sc.msgs = append(sc.msgs, m)
		}
		s.signal()
		s.mu.Unlock()
		if err != nil {
			return
		}
		if m.ID != 9 {
			sc.c.Send(m)
		}
	}
}

// setGate holds the admission of the next connection from addr.
func (s *attackServer) setGate(from netip.AddrPort) *admitGate {
	g := &admitGate{from: from, entered: make(chan struct{}), release: make(chan struct{})}
	s.mu.Lock()
	s.gate = g
	s.mu.Unlock()
	return g
}

// wait waits up to d for cond, checked under the lock at every change.
func (s *attackServer) wait(d time.Duration, cond func() bool) bool {
	timer := time.NewTimer(d)
	defer timer.Stop()
	for {
		s.mu.Lock()
		ok, changed := cond(), s.changed
		s.mu.Unlock()
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

// take returns the connection accepted from addr.
func (s *attackServer) take(t testing.TB, from netip.AddrPort) *Conn {
	t.Helper()
	return s.takeWithin(t, from, attackWait, fmt.Sprintf("the server accepted no connection from %s", from))
}

func (s *attackServer) takeWithin(t testing.TB, from netip.AddrPort, d time.Duration, msg string) *Conn {
	t.Helper()
	var got *Conn
	ok := s.wait(d, func() bool {
		for _, sc := range s.conns {
			if !sc.taken && sc.from == from {
				sc.taken, got = true, sc.c
				return true
			}
		}
		return false
	})
	require.True(t, ok, msg)
	return got
}

func (s *attackServer) served(c *Conn) *servedConn {
	for _, sc := range s.conns {
		if sc.c == c {
			return sc
		}
	}
	return nil
}

// awaitMsg waits up to d for c's application to receive a message with
// payload p.
func (s *attackServer) awaitMsg(c *Conn, p []byte, d time.Duration) bool {
	return s.wait(d, func() bool {
		sc := s.served(c)
		return sc != nil && slices.ContainsFunc(sc.msgs, func(m Message) bool { return bytes.Equal(m.Payload, p) })
	})
}

// awaitEnd waits for c's application's Receive to fail and returns why.
func (s *attackServer) awaitEnd(t testing.TB, c *Conn) error {
	t.Helper()
	var end error
	ok := s.wait(attackWait, func() bool {
		sc := s.served(c)
		if sc != nil && sc.end != nil {
			end = sc.end
			return true
		}
		return false
	})
	require.True(t, ok, "the server's connection did not end")
	return end
}

// forged lists the forged messages the server's application received, and
// payloads received twice.
func (s *attackServer) forged() (forged, twice []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, sc := range s.conns {
		seen := map[string]bool{}
		for _, m := range sc.msgs {
			p := string(m.Payload)
			switch {
			case isForged(m.Payload):
				forged = append(forged, fmt.Sprintf("%q (ID %d) on the connection from %s", p, m.ID, sc.from))
			case seen[p] && m.Reliable:
				twice = append(twice, fmt.Sprintf("%q on the connection from %s", p, sc.from))
			}
			seen[p] = true
		}
	}
	return forged, twice
}

// acceptedFrom lists the addresses connections were accepted from.
func (s *attackServer) acceptedFrom() []netip.AddrPort {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []netip.AddrPort
	for _, sc := range s.conns {
		out = append(out, sc.from)
	}
	return out
}

// noConnFrom asserts that no connection was accepted from addrs.
func (s *attackServer) noConnFrom(t testing.TB, msg string, addrs ...netip.AddrPort) {
	t.Helper()
	var bad []string
	for _, from := range s.acceptedFrom() {
		if slices.Contains(addrs, from) {
			bad = append(bad, from.String())
		}
	}
	assert.Empty(t, bad, msg)
}

// asyncDial runs Dial on its own goroutine.
type asyncDial struct {
	ch   chan struct{}
	c    *Conn
	err  error
	once sync.Once
}

func dialAsync(addr string, cfg *Config) *asyncDial {
	d := &asyncDial{ch: make(chan struct{})}
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*attackWait)
		defer cancel()
		d.c, d.err = sysNet().Dial(ctx, addr, cfg)
		close(d.ch)
	}()
	return d
}

// wait waits up to timeout for Dial to return.
func (d *asyncDial) wait(timeout time.Duration) (*Conn, error, bool) {
	select {
	case <-d.ch:
		return d.c, d.err, true
	case <-time.After(timeout):
		return nil, nil, false
	}
}

// closeAfter waits for Dial and closes what it made.
func (d *asyncDial) closeAfter() {
	d.once.Do(func() {
		<-d.ch
		if d.c != nil {
			d.c.Close()
		}
	})
}

// echoThrough sends a reliable message and waits up to d for its echo: the
// connection carries real traffic. A forged message on the way fails
// the test.
func echoThrough(t testing.TB, c *Conn, tag string, d time.Duration) {
	t.Helper()
	p := []byte("ECHO:" + tag)
	require.NoError(t, c.Send(Message{ID: 7, Payload: p, Reliable: true}), "the connection is gone: %v", c.Err())
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	for {
		m, err := c.Receive(ctx)
		require.NoError(t, err, "no echo of %q: %v", p, c.Err())
		assert.False(t, isForged(m.Payload), "the client delivered a forged message: %q", m.Payload)
		if bytes.Equal(m.Payload, p) {
			return
		}
	}
}

func isDone(c *Conn) bool {
	select {
	case <-c.Done():
		return true
	default:
		return false
	}
}

func awaitDone(t testing.TB, c *Conn, d time.Duration, what string) {
	t.Helper()
	select {
	case <-c.Done():
	case <-time.After(d):
		require.Fail(t, what)
	}
}

// awaitEither waits up to d until a or b holds; each returns whether it
// holds and a channel closed at its next change.
func awaitEither(d time.Duration, a, b func() (bool, <-chan struct{})) bool {
	timer := time.NewTimer(d)
	defer timer.Stop()
	for {
		okA, chA := a()
		okB, chB := b()
		if okA || okB {
			return true
		}
		select {
		case <-chA:
		case <-chB:
		case <-timer.C:
			return false
		}
	}
}

// answeredSince says whether the attacker got, from index from on, a
// datagram that pred accepts.
func (a *attackerSock) answeredSince(from int, pred func([]byte) bool) func() (bool, <-chan struct{}) {
	return func() (bool, <-chan struct{}) {
		a.mu.Lock()
		defer a.mu.Unlock()
		return slices.ContainsFunc(a.got[min(from, len(a.got)):], pred), a.changed
	}
}

// acceptedFromAddr says whether the server accepted a connection from addr.
func (s *attackServer) acceptedFromAddr(addr netip.AddrPort) func() (bool, <-chan struct{}) {
	return func() (bool, <-chan struct{}) {
		s.mu.Lock()
		defer s.mu.Unlock()
		return slices.ContainsFunc(s.conns, func(sc *servedConn) bool { return sc.from == addr }), s.changed
	}
}

// TestAttackClearDatagramDuringHandshake: once a secure server sent its
// ConnectSynAck, and until the client's first sealed datagram comes, it
// takes a clear datagram from the client's address that holds a
// ConnectSyn (a resent one). An on-path attacker adds a ConnectAck and an
// application message to one, under the PacketID of the client's next
// real datagram: the message must not be delivered, the connection not
// be established by it, and the client's real datagram under that
// PacketID must not be taken for a duplicate.
func TestAttackClearDatagramDuringHandshake(t *testing.T) {
	scfg, ccfg := secureConfigs(t)
	srv := newAttackServer(t, scfg)
	r := newAttackRelay(t, srv.l.Addr())
	// The client's ConnectSyns pass; its sealed datagrams are held back.
	r.setRule(&r.up, func(b []byte) relayFate {
		if isClearSyn(b) {
			return relayPass
		}
		return relayHold
	})
	c := dial(t, r.Addr(), ccfg)
	t.Cleanup(r.passAll) // before the client's Close
	// The client is open; its ConnectAck went, then a real message, in a
	// datagram the size tells.
	real := bytes.Repeat([]byte("REAL"), 100)
	require.NoError(t, c.Send(Message{ID: 7, Payload: real, Reliable: true}))
	_, realDg := r.mustAwait(t, &r.up, 0, "datagram with the real message", func(e relayEntry) bool {
		return e.fate == relayHold && len(e.b) > len(real)
	})
	_, syn := r.mustAwait(t, &r.up, 0, "ConnectSyn", func(e relayEntry) bool { return isClearSyn(e.b) })

	downBefore := len(r.datagrams(&r.down))
	forged := clearDatagram(pidOf(realDg), true,
		message{id: idConnectSyn, payload: contentOf(syn, idConnectSyn)},
		message{id: idConnectAck},
		message{id: 100, payload: []byte("INJECTED")})
	r.injectUp(forged)
	// Then the ConnectSyn again: a server still waiting answers it with
	// its ConnectSynAck, after it took the forgery.
	r.injectUp(resentSyn(syn))
	// Whichever comes first: the server accepts the connection, or it
	// answers the ConnectSyn (having taken the forgery before it).
	answered := func() (bool, <-chan struct{}) {
		log, changed := r.snapshot(&r.down)
		return slices.ContainsFunc(log[downBefore:], func(e relayEntry) bool { return isClearSynAck(e.b) }), changed
	}
	accepted := func() (bool, <-chan struct{}) {
		srv.mu.Lock()
		defer srv.mu.Unlock()
		return len(srv.conns) > 0, srv.changed
	}
	awaitEither(attackWait, answered, accepted)
	var early *Conn
	if ok, _ := accepted(); ok {
		early = srv.conns[0].c
		t.Logf("the server accepted the connection before any sealed datagram of the client's came")
	}

	// The client's datagrams go through: the connection opens, and the
	// real message, under the PacketID the forgery used, arrives.
	r.pass(&r.up)
	sc := srv.take(t, r.outerAddr())
	if early != nil {
		require.Same(t, early, sc)
	}
	assert.True(t, srv.awaitMsg(sc, real, 5*time.Second),
		"the client's real message, in the datagram whose PacketID the forgery took, was lost (acked as a duplicate)")
	if early != nil {
		// Accepted early, the connection must not have the forged
		// message first.
		srv.mu.Lock()
		msgs := slices.Clone(srv.served(sc).msgs)
		srv.mu.Unlock()
		if assert.NotEmpty(t, msgs) {
			assert.NotEqual(t, "INJECTED", string(msgs[0].Payload), "the server's application got the forged clear message first")
		}
	}
	echoThrough(t, c, "after", 5*time.Second)
	forgedMsgs, twice := srv.forged()
	assert.Empty(t, forgedMsgs, "the server delivered a message injected in clear during the handshake")
	assert.Empty(t, twice)
	assert.NoError(t, c.Err())
	assert.NoError(t, sc.Err())
}

// forgeAfterReplay is the attack on a replayed ConnectSyn: the attacker
// sends syn from its own address; if the server answers with a
// ConnectSynAck (which it cannot read), it sends the ConnectAck, and then
// the message, in clear: with a ConnectSyn in the same datagram (which a
// waiting server takes in clear) and without. Then the ConnectSyn again:
// a connection still waiting answers it after taking the rest. It
// reports whether the server answered the replay at all.
func forgeAfterReplay(a *attackerSock, server netip.AddrPort, syn []byte, s *attackServer, msgs ...message) bool {
	before := s.l.Stats().ReplayedHandshakes
	a.send(syn, server)
	// Answered, or taken by the listener for a copy of a handshake
	// message it key-exchanged lately (then dropped unanswered, or
	// passed to the attempt being made with it).
	i := -1
	for deadline := time.Now().Add(attackWait); i < 0 && time.Now().Before(deadline); runtime.Gosched() {
		i, _ = a.await(0, 0, func(b []byte) bool { return isClearSynAck(b) || holdsID(b, idDisconnectAck) })
		if i < 0 && s.l.Stats().ReplayedHandshakes > before {
			return false
		}
	}
	if i < 0 {
		return false
	}
	a.mu.Lock()
	synAck := isClearSynAck(a.got[i])
	a.mu.Unlock()
	if !synAck {
		return false // refused
	}
	withSyn := append([]message{{id: idConnectSyn, payload: contentOf(syn, idConnectSyn)}, {id: idConnectAck}}, msgs...)
	a.send(clearDatagram(1, true, append([]message{{id: idConnectAck}}, msgs...)...), server)
	a.send(clearDatagram(2, true, withSyn...), server)
	n := a.count()
	a.send(resentSyn(syn), server)
	awaitEither(attackWait, a.answeredSince(n, isClearSynAck), s.acceptedFromAddr(a.addr))
	return true
}

// TestAttackReplayedConnectSyn: a victim's ConnectSyn (its Noise message 1
// and encrypted ConnectPayload), replayed from another address, gets an
// answer the attacker cannot read; a ConnectAck and messages in clear
// must not make a connection of it, nor fill the accept backlog. With
// connect tokens, an attacker who takes the victim's ConnectSyn off the
// path and sends it from its own address must not get a connection with
// the victim's token, and the victim should still connect.
func TestAttackReplayedConnectSyn(t *testing.T) {
	t.Parallel()
	t.Run("after the victim left", func(t *testing.T) {
		scfg, ccfg := secureConfigs(t)
		var admitted atomic.Int32
		scfg.AdmitConn = func(*Conn, []byte) ([]byte, error) { admitted.Add(1); return nil, nil }
		srv := newAttackServer(t, scfg)
		server := addrOf(srv.l.Addr())
		r := newAttackRelay(t, srv.l.Addr())
		victim := dial(t, r.Addr(), ccfg)
		vsc := srv.take(t, r.outerAddr())
		echoThrough(t, victim, "victim", 5*time.Second)
		require.NoError(t, victim.Close())
		awaitDone(t, vsc, attackWait, "the victim's server side did not end")
		_, syn := r.mustAwait(t, &r.up, 0, "ConnectSyn", func(e relayEntry) bool { return isClearSyn(e.b) })

		a := newAttackerSock(t)
		answered := forgeAfterReplay(a, server, syn, srv, message{id: 100, payload: []byte("INJECTED")})
		t.Logf("the server answered the replay: %v; AdmitConn ran %d times", answered, admitted.Load())
		srv.noConnFrom(t, "the server accepted a connection from a replayed ConnectSyn and a ConnectAck in clear", a.addr)
		forged, _ := srv.forged()
		assert.Empty(t, forged, "the server delivered a message sent in clear on a replayed handshake")
		assert.LessOrEqual(t, a.received(), int(a.sent.Load()), "the attacker's address got more bytes than it sent")
		st := srv.l.Stats()
		assert.Equal(t, st.Pending, st.Connections, "a connection without a key exchange is established")
	})

	t.Run("accept backlog", func(t *testing.T) {
		scfg, ccfg := secureConfigs(t)
		scfg.AcceptBacklog = 4
		srv := newAttackServer(t, scfg)
		server := addrOf(srv.l.Addr())
		r := newAttackRelay(t, srv.l.Addr())
		victim := dial(t, r.Addr(), ccfg)
		vsc := srv.take(t, r.outerAddr())
		require.NoError(t, victim.Close())
		awaitDone(t, vsc, attackWait, "the victim's server side did not end")
		syn := r.datagrams(&r.up)[0]
		require.True(t, isClearSyn(syn))
		var attackers []netip.AddrPort
		for range 8 {
			a := newAttackerSock(t)
			attackers = append(attackers, a.addr)
			forgeAfterReplay(a, server, syn, srv)
			assert.LessOrEqual(t, a.received(), int(a.sent.Load()), "the attacker's address got more bytes than it sent")
		}
		srv.noConnFrom(t, "fake connections (a replayed handshake, a ConnectAck in clear) were accepted", attackers...)
		st := srv.l.Stats()
		assert.Equal(t, st.Pending, st.Connections, "connections without a key exchange are established: %+v", st)
		// A real client still gets in.
		c := dial(t, r.Addr(), ccfg)
		srv.take(t, r.outerAddr())
		echoThrough(t, c, "real", 5*time.Second)
	})

	t.Run("token taken off the path", func(t *testing.T) {
		scfg, ccfg := secureConfigs(t)
		key := newTokenKey(t)
		scfg.TokenKey = key
		srv := newAttackServer(t, scfg)
		server := addrOf(srv.l.Addr())
		tok := sampleToken(server)
		ccfg.Token = issue(t, key, tok)
		ccfg.ConnectTimeout = attackWait
		r := newAttackRelay(t, srv.l.Addr())
		// On the path: the victim's datagrams go no further.
		r.setRule(&r.up, dropAll)
		d := dialAsync(r.Addr(), ccfg)
		t.Cleanup(d.closeAfter)
		t.Cleanup(r.passAll)
		_, syn := r.mustAwait(t, &r.up, 0, "ConnectSyn", func(e relayEntry) bool { return isClearSyn(e.b) })

		a := newAttackerSock(t)
		answered := forgeAfterReplay(a, server, syn, srv, message{id: 100, payload: []byte("INJECTED")})
		t.Logf("the server answered the attacker's copy: %v", answered)

		// The victim's path clears: its ConnectSyn, sent again, reaches
		// the server (at once here, rather than on its timer).
		r.pass(&r.up)
		r.injectUp(syn)
		c, err, ok := d.wait(attackWait)
		require.True(t, ok, "Dial did not return")
		if assert.NoError(t, err, "the victim could not connect: its token was spent on an attempt of the attacker's that never completed") {
			vsc := srv.take(t, r.outerAddr())
			echoThrough(t, c, "victim", 5*time.Second)
			require.NotNil(t, vsc.Token())
			assert.Equal(t, tok.ClientID, vsc.Token().ClientID)
		}
		srv.mu.Lock()
		for _, sc := range srv.conns {
			if sc.from == a.addr {
				id := uint64(0)
				if tk := sc.c.Token(); tk != nil {
					id = tk.ClientID
				}
				assert.Fail(t, "the attacker got a connection with the victim's token", "from %s, ClientID %#x", sc.from, id)
			}
		}
		srv.mu.Unlock()
		forged, _ := srv.forged()
		assert.Empty(t, forged, "the server delivered a message sent in clear by the attacker")
		assert.LessOrEqual(t, a.received(), int(a.sent.Load()), "the attacker's address got more bytes than it sent")
	})
}

// TestAttackExtraBlocksBesideSynAck: an on-path attacker adds message
// blocks of its own to the server's genuine ConnectSynAck datagram, which
// travels in clear. The client must take none of them; ignoring the
// datagram and waiting for the next ConnectSynAck (the answer to its
// resent ConnectSyn) is fine: Dial succeeds once the attacker lets one
// through, and the connection is whole.
func TestAttackExtraBlocksBesideSynAck(t *testing.T) {
	t.Parallel()
	scfg, ccfg := secureConfigs(t)
	srv := newAttackServer(t, scfg)
	injected := message{id: 100, payload: []byte("INJECTED")}
	ackAll := message{id: idPacketAck, payload: appendPacketAck(nil, packetAck{base: 0, more: 1<<packetAckBits - 1})}
	disc := message{id: idDisconnect, payload: []byte("INJECTED disconnect")}
	discAck := message{id: idDisconnectAck}
	for _, tt := range []struct {
		name  string
		extra []message
	}{
		{"application message", []message{injected}},
		{"PacketAck", []message{ackAll}},
		{"Disconnect", []message{disc}},
		{"DisconnectAck", []message{discAck}},
		{"all of them", []message{ackAll, injected, disc}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r := newAttackRelay(t, srv.l.Addr())
			var tampered atomic.Bool
			r.setRule(&r.down, func(b []byte) relayFate {
				if !isClearSynAck(b) || !tampered.CompareAndSwap(false, true) {
					return relayPass
				}
				for i := range tt.extra {
					b = appendMessage(b, &tt.extra[i])
				}
				r.injectDown(b)
				return relayDrop
			})
			c, err := sysNet().Dial(within(t, attackWait), r.Addr(), ccfg)
			require.NoError(t, err, "Dial failed after a ConnectSynAck with blocks added in clear")
			t.Cleanup(func() { c.Close() })
			t.Cleanup(r.passAll)
			require.True(t, tampered.Load())
			require.True(t, c.Secure())
			echoThrough(t, c, "after", 5*time.Second)
			sc := srv.take(t, r.outerAddr())
			echoThrough(t, c, "again", 5*time.Second)
			assert.NoError(t, c.Err())
			assert.NoError(t, sc.Err())
			forged, _ := srv.forged()
			assert.Empty(t, forged)
		})
	}
}

// TestAttackForgedSynAck: before the server's genuine ConnectSynAck, the
// client gets a forged one from the server's address: garbage, random
// bytes, an old genuine one of another session. A forgery must not end
// the attempt: Dial completes when the genuine one comes.
func TestAttackForgedSynAck(t *testing.T) {
	scfg, ccfg := secureConfigs(t)
	srv := newAttackServer(t, scfg)
	// An old genuine ConnectSynAck: another session's with this server.
	r0 := newAttackRelay(t, srv.l.Addr())
	c0 := dial(t, r0.Addr(), ccfg)
	srv.take(t, r0.outerAddr())
	_, old := r0.mustAwait(t, &r0.down, 0, "ConnectSynAck", func(e relayEntry) bool { return isClearSynAck(e.b) })
	require.NoError(t, c0.Close())
	synAck := func(content []byte) []byte {
		return clearDatagram(0, false, message{id: idConnectSynAck, payload: content})
	}
	for _, tt := range []struct {
		name string
		dg   []byte
	}{
		{"empty", synAck(nil)},
		{"garbage", synAck([]byte("garbage"))},
		{"random 48 bytes", synAck(randomBytes(noiseOverhead))},
		{"random 64 bytes", synAck(randomBytes(64))},
		{"another session's", old},
		{"another session's, with a message", appendMessage(bytes.Clone(old), &message{id: 100, payload: []byte("INJECTED")})},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r := newAttackRelay(t, srv.l.Addr())
			var forged atomic.Bool
			r.setRule(&r.up, func(b []byte) relayFate {
				if isClearSyn(b) && forged.CompareAndSwap(false, true) {
					r.injectDown(tt.dg) // before the ConnectSyn goes on
				}
				return relayPass
			})
			c, err := sysNet().Dial(within(t, attackWait), r.Addr(), ccfg)
			require.NoError(t, err, "Dial failed on a forged ConnectSynAck that came before the genuine one")
			t.Cleanup(func() { c.Close() })
			require.True(t, forged.Load())
			require.True(t, c.Secure())
			srv.take(t, r.outerAddr())
			echoThrough(t, c, "after", 5*time.Second)
			assert.NoError(t, c.Err())
		})
	}
}

// TestAttackReplayKeepsAlive: the client of a secure connection vanishes,
// and an attacker replays one of its reliable sealed datagrams every
// 100ms from its address. A replay is no sign of life: the server's
// connection must end as lost within a bounded time.
func TestAttackReplayKeepsAlive(t *testing.T) {
	t.Parallel()
	const lost = time.Second
	scfg, ccfg := secureConfigs(t)
	scfg.ConnectionLostTimeout, ccfg.ConnectionLostTimeout = lost, lost
	scfg.PingInterval, ccfg.PingInterval = lost/4, lost/4
	srv := newAttackServer(t, scfg)
	r := newAttackRelay(t, srv.l.Addr())
	c := dial(t, r.Addr(), ccfg)
	t.Cleanup(r.passAll)
	sc := srv.take(t, r.outerAddr())
	for i := range 3 {
		echoThrough(t, c, fmt.Sprint(i), 5*time.Second)
	}
	var replay []byte
	for _, b := range r.datagrams(&r.up) {
		if !isClearHandshake(b) && isReliableDg(b) {
			replay = b
		}
	}
	require.NotNil(t, replay, "no reliable sealed datagram of the client's")

	// The client vanishes: nothing passes any more, either way.
	r.setRule(&r.up, dropAll)
	r.setRule(&r.down, dropAll)
	vanished := time.Now()
	dups := sc.Stats().DuplicateDatagrams
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	limit := time.NewTimer(3 * lost)
	defer limit.Stop()
	ended := false
	for !ended {
		select {
		case <-sc.Done():
			ended = true
		case <-tick.C:
			r.injectUp(replay)
		case <-limit.C:
			assert.Fail(t, "replays kept a connection alive",
				"the server's connection is still open %v after its client vanished (ConnectionLostTimeout %v); DuplicateDatagrams %d -> %d",
				time.Since(vanished).Round(time.Millisecond), lost, dups, sc.Stats().DuplicateDatagrams)
			ended = true
		}
	}
	if isDone(sc) {
		var te *TimeoutError
		assert.ErrorAs(t, sc.Err(), &te, "the connection ended, but not as lost")
	}
}

// The matrix: every kind of crafted datagram, against each end of a
// secure connection in each of its states, from the peer's address and
// from elsewhere.

// material is what an attacker has on hand against one end (the target)
// of a connection: what it saw on the wire.
type material struct {
	toTarget   [][]byte // the peer's datagrams to the target, so far
	fromTarget [][]byte // the target's own
	donorTo    [][]byte // another session's datagrams in the same direction
	donorFrom  [][]byte
	syn        []byte // the client's ConnectSyn datagram
	synAck     []byte // a genuine ConnectSynAck content: this session's, or another's
	nextPID    uint32 // the PacketID of the peer's next datagram
	cid        uint32 // the connection ID, when seen
	hasCID     bool
	server     bool // the target is the server
	marker     message
}

// peers is the peer's datagrams, or, if the peer sent none yet, another
// session's.
func (m *material) peers() [][]byte {
	if len(m.toTarget) > 0 {
		return m.toTarget
	}
	return m.donorTo
}

func (m *material) own() [][]byte {
	if len(m.fromTarget) > 0 {
		return m.fromTarget
	}
	return m.donorFrom
}

// bases are the peer's datagrams to mangle: its last sealed one (or
// another session's, if it sent none yet) and its last in clear, if any.
func (m *material) bases() [][]byte {
	var out [][]byte
	last := func(ds [][]byte, clear bool) []byte {
		for _, b := range slices.Backward(ds) {
			if isClearHandshake(b) == clear {
				return b
			}
		}
		return nil
	}
	sealed := last(m.toTarget, false)
	if sealed == nil {
		sealed = last(m.donorTo, false)
	}
	out = append(out, sealed)
	if b := last(m.toTarget, true); b != nil {
		out = append(out, b)
	}
	return out
}

// wrongKey is another session's sealed datagrams in the same direction,
// under our connection ID if we know it.
func (m *material) wrongKey() [][]byte {
	var out [][]byte
	for _, b := range m.donorTo {
		if isClearHandshake(b) {
			continue
		}
		b = bytes.Clone(b)
		if n := headerSize(b); m.server && m.hasCID && n >= 0 && len(b) >= n+cidSize {
			binary.LittleEndian.PutUint32(b[n:], m.cid)
		}
		out = append(out, b)
	}
	return out
}

type attackKind struct {
	name  string
	build func(m *material) [][]byte
}

func attackKinds() []attackKind {
	type clearKind struct {
		name     string
		reliable bool
		msg      func(m *material) message
	}
	clears := []clearKind{
		{"ConnectSyn", false, func(m *material) message { return message{id: idConnectSyn, payload: contentOf(m.syn, idConnectSyn)} }},
		{"ConnectSynAck", false, func(m *material) message { return message{id: idConnectSynAck, payload: m.synAck} }},
		{"ConnectAck", true, func(*material) message { return message{id: idConnectAck} }},
		{"Retry", false, func(*material) message { return message{id: idRetry, payload: randomBytes(cookieSize)} }},
		{"DisconnectAck", false, func(*material) message { return message{id: idDisconnectAck} }},
		{"Disconnect", false, func(*material) message { return message{id: idDisconnect} }},
		// Connection ID rotation's path messages (cidrotation.go), in
		// clear: spare IDs handed to the client, an ask for them.
		{"CIDRotation NewConnectionIDs", true, func(*material) message {
			p := binary.LittleEndian.AppendUint32([]byte{pathNewCIDs}, 1)
			p = append(p, 2)
			return message{id: idPath, payload: append(p, randomBytes(8)...)}
		}},
		{"CIDRotation ConnectionIDsWanted", false, func(*material) message {
			return message{id: idPath, payload: binary.LittleEndian.AppendUint32([]byte{pathWantCIDs}, 0)}
		}},
	}
	var ks []attackKind
	for _, k := range clears {
		ks = append(ks,
			attackKind{"clear " + k.name, func(m *material) [][]byte {
				return [][]byte{clearDatagram(m.nextPID, k.reliable, k.msg(m))}
			}},
			attackKind{"clear " + k.name + "+message", func(m *material) [][]byte {
				return [][]byte{clearDatagram(m.nextPID, true, k.msg(m), m.marker)}
			}})
	}
	_, retired, err := GenerateKey()
	if err != nil {
		panic(err)
	}
	return append(ks,
		// A client's ConnectSyn under a key the listener does not hold
		// (one retired by a rotation): two trials, the usual refusal.
		attackKind{"ServerKeyRotation ConnectSyn under a retired key", func(*material) [][]byte {
			s, _, err := newClientSecure(retired, nil, []byte("retired"))
			if err != nil {
				panic(err)
			}
			return [][]byte{rebuildSyn(nil, s.msg1)}
		}},
		attackKind{"replay", func(m *material) [][]byte { return m.peers() }},
		attackKind{"reflection", func(m *material) [][]byte { return m.own() }},
		attackKind{"reordered", func(m *material) [][]byte {
			ds := slices.Clone(m.peers())
			slices.Reverse(ds)
			return ds
		}},
		attackKind{"wrong key", func(m *material) [][]byte { return m.wrongKey() }},
		// The peer's last sealed datagram under a connection ID it
		// never had: retired, or a spare never handed out, look alike.
		attackKind{"CIDRotation unknown ID", func(m *material) [][]byte {
			var out [][]byte
			for _, b := range m.bases()[:1] {
				if n := headerSize(b); n >= 0 && len(b) >= n+cidSize && !isClearHandshake(b) {
					c := bytes.Clone(b)
					c[n+3] ^= 0x5a
					out = append(out, c)
				}
			}
			return out
		}},
		attackKind{"truncated", func(m *material) [][]byte {
			var out [][]byte
			for _, b := range m.bases() {
				h := max(headerSize(b), minHeaderSize)
				seen := map[int]bool{}
				for _, n := range []int{0, 1, 2, h, h + cidSize, len(b) / 2, len(b) - sealOverhead, len(b) - 1} {
					if n >= 0 && n < len(b) && !seen[n] {
						seen[n] = true
						out = append(out, bytes.Clone(b[:n]))
					}
				}
			}
			return out
		}},
		attackKind{"bit flips", func(m *material) [][]byte {
			var out [][]byte
			for _, b := range m.bases() {
				h := max(headerSize(b), minHeaderSize)
				for _, f := range []struct {
					at  int
					bit byte
				}{{0, 1}, {2, 0x40}, {2, 0x80}, {h, 1}, {h + 2, 1}, {len(b) / 2, 0x10}, {len(b) - sealOverhead, 1}, {len(b) - 1, 0x80}} {
					if f.at < len(b) {
						c := bytes.Clone(b)
						c[f.at] ^= f.bit
						out = append(out, c)
					}
				}
			}
			return out
		}},
	)
}

type attackSource int

const (
	fromPeer     attackSource = iota // the peer's address, through the relay
	fromElse                         // a socket elsewhere
	fromReplayer                     // a socket elsewhere that first replays the client's ConnectSyn
)

func (s attackSource) String() string {
	return [...]string{"the peer's address", "another address", "a replayer"}[s]
}

// matrixEnv is one state's listener and what the matrix knows of it.
type matrixEnv struct {
	// owner is the state's test: the sockets of every cell stay open
	// until the state ends, so that no port the listener still knows
	// (a pending attempt, an attacker's connection) is taken again by a
	// later cell's socket.
	owner              testing.TB
	ccfg               *Config
	srv                *attackServer
	serverAddr         netip.AddrPort
	donorUp, donorDown [][]byte
	known              map[netip.AddrPort]bool   // the fixtures' addresses, as the server sees them
	attackers          map[netip.AddrPort]string // attackers' addresses, by cell
	reported           map[string]bool
}

// matrixFixture is a connection held in one state, and how to attack and
// check it.
type matrixFixture struct {
	r      *attackRelay
	c, sc  *Conn
	server bool // the target is the server
	pid    uint32
	hasPID bool                  // forge under pid rather than the next one
	inject func(b []byte)        // to the target, from the peer's address
	target func() netip.AddrPort // where attackers elsewhere send
	// finish ends the attack and checks the connection survived it.
	finish func(t *testing.T, cell string)
	final  func(t *testing.T) // for a reused fixture, after the last cell
	broken bool
}

func (fx *matrixFixture) atClient() {
	fx.inject, fx.target = fx.r.injectDown, fx.r.clientAddr
}

func (fx *matrixFixture) atServer(env *matrixEnv) {
	fx.server = true
	fx.inject = fx.r.injectUp
	fx.target = func() netip.AddrPort { return env.serverAddr }
}

func (fx *matrixFixture) material(env *matrixEnv, cell string) *material {
	upLog, _ := fx.r.snapshot(&fx.r.up)
	downLog, _ := fx.r.snapshot(&fx.r.down)
	m := &material{server: fx.server, marker: message{id: 100, payload: []byte("MARKER:" + cell)}}
	to, from := downLog, upLog
	m.donorTo, m.donorFrom = env.donorDown, env.donorUp
	if fx.server {
		to, from = upLog, downLog
		m.donorTo, m.donorFrom = env.donorUp, env.donorDown
	}
	for _, e := range to {
		m.toTarget = append(m.toTarget, e.b)
		if e.fate == relayPass && !e.old {
			m.nextPID = max(m.nextPID, pidOf(e.b)+1)
		}
	}
	for _, e := range from {
		m.fromTarget = append(m.fromTarget, e.b)
	}
	if fx.hasPID {
		m.nextPID = fx.pid
	}
	for _, e := range upLog {
		if m.syn == nil && isClearSyn(e.b) {
			m.syn = e.b
		}
		if !m.hasCID && !isClearHandshake(e.b) {
			m.cid, m.hasCID = sealedCID(e.b)
		}
	}
	for _, b := range append(fx.r.datagrams(&fx.r.down), env.donorDown...) {
		if isClearSynAck(b) {
			m.synAck = contentOf(b, idConnectSynAck)
			break
		}
	}
	return m
}

func (env *matrixEnv) know(a netip.AddrPort) { env.known[a] = true }

// openFixture is a secure connection through a relay, open and tried.
func (env *matrixEnv) openFixture(t *testing.T) *matrixFixture {
	r := newAttackRelay(env.owner, env.srv.l.Addr())
	env.know(r.outerAddr())
	c := dial(t, r.Addr(), env.ccfg)
	t.Cleanup(r.passAll) // before the client's Close
	fx := &matrixFixture{r: r, c: c}
	fx.sc = env.srv.take(t, r.outerAddr())
	echoThrough(t, c, "setup", 5*time.Second)
	return fx
}

// openChecks is the check of an open connection: a round trip.
func (fx *matrixFixture) openChecks(t *testing.T, cell string) {
	echoThrough(t, fx.c, cell, 5*time.Second)
	require.NoError(t, fx.c.Err())
	require.NoError(t, fx.sc.Err())
}

// queuedPayloads is what waits in c's receive queue: after Close the
// application cannot read it any more, but it was delivered.
func queuedPayloads(c *Conn) []string {
	c.recvq.mu.Lock()
	defer c.recvq.mu.Unlock()
	var out []string
	for i := c.recvq.msgs.head; i < len(c.recvq.msgs.entries); i++ {
		out = append(out, string(c.recvq.msgs.bytes(&c.recvq.msgs.entries[i])))
	}
	return out
}

type matrixState struct {
	name     string
	server   bool // the target is the server
	reusable bool // one fixture serves every cell until one breaks it
	setup    func(t *testing.T, env *matrixEnv, cell string) *matrixFixture
}

func matrixStates() []matrixState {
	return []matrixState{
		{"client connecting", false, false, setupClientConnecting},
		{"client open", false, true, func(t *testing.T, env *matrixEnv, _ string) *matrixFixture {
			fx := env.openFixture(t)
			fx.atClient()
			fx.finish = fx.openChecks
			return fx
		}},
		{"client closing", false, false, setupClientClosing},
		{"server admitting", true, false, setupServerAdmitting},
		{"server waiting for the ConnectAck", true, false, setupServerSynAckWait},
		{"server open", true, true, func(t *testing.T, env *matrixEnv, _ string) *matrixFixture {
			fx := env.openFixture(t)
			fx.atServer(env)
			fx.finish = fx.openChecks
			return fx
		}},
		{"server closing", true, false, setupServerClosing},
		{"server migrating", true, true, setupServerMigrating},
	}
}

// setupClientConnecting: the client's ConnectSyn is held back; the client
// waits for a ConnectSynAck.
func setupClientConnecting(t *testing.T, env *matrixEnv, _ string) *matrixFixture {
	r := newAttackRelay(env.owner, env.srv.l.Addr())
	env.know(r.outerAddr())
	r.setRule(&r.up, holdAll)
	d := dialAsync(r.Addr(), env.ccfg)
	t.Cleanup(d.closeAfter)
	t.Cleanup(r.passAll)
	r.mustAwait(t, &r.up, 0, "ConnectSyn", func(e relayEntry) bool { return isClearSyn(e.b) })
	fx := &matrixFixture{r: r}
	fx.atClient()
	fx.finish = func(t *testing.T, cell string) {
		r.pass(&r.up)
		c, err, ok := d.wait(attackWait)
		require.True(t, ok, "Dial did not return")
		require.NoError(t, err, "the attack made Dial fail")
		fx.c = c
		require.True(t, c.Secure())
		fx.sc = env.srv.take(t, r.outerAddr())
		echoThrough(t, c, cell, 5*time.Second)
	}
	return fx
}

// setupClientClosing: the client called Close; its Disconnect is dropped.
func setupClientClosing(t *testing.T, env *matrixEnv, _ string) *matrixFixture {
	fx := env.openFixture(t)
	fx.atClient()
	r, c, sc := fx.r, fx.c, fx.sc
	r.setRule(&r.up, dropAll)
	n := len(r.datagrams(&r.up))
	c.StartClose("")
	_, disc := r.mustAwait(t, &r.up, n, "Disconnect", func(e relayEntry) bool { return isInOrderDg(e.b) && !isReliableDg(e.b) })
	fx.finish = func(t *testing.T, cell string) {
		// A real message from the server, after the attack: the client
		// takes it, and nothing else.
		probe := "PROBE:" + cell
		require.NoError(t, sc.Send(Message{ID: 7, Payload: []byte(probe), Reliable: true}))
		require.Eventually(t, func() bool { return slices.Contains(queuedPayloads(c), probe) || isDone(c) }, attackWait, time.Millisecond)
		require.False(t, isDone(c), "the closing client ended before its peer answered: %v", c.Err())
		assert.Equal(t, []string{probe}, queuedPayloads(c), "the closing client took a message its peer did not send")
		r.pass(&r.up)
		r.injectUp(disc)
		awaitDone(t, c, attackWait, "the client's close did not complete")
		assert.ErrorIs(t, c.Err(), net.ErrClosed, "the client's close did not end gracefully")
		assert.ErrorIs(t, env.srv.awaitEnd(t, sc), io.EOF, "the server did not hear the client's Disconnect")
	}
	return fx
}

// setupServerAdmitting: the server's AdmitConn holds the attempt.
func setupServerAdmitting(t *testing.T, env *matrixEnv, _ string) *matrixFixture {
	r := newAttackRelay(env.owner, env.srv.l.Addr())
	env.know(r.outerAddr())
	gate := env.srv.setGate(r.outerAddr())
	d := dialAsync(r.Addr(), env.ccfg)
	t.Cleanup(d.closeAfter)
	t.Cleanup(gate.open)
	select {
	case <-gate.entered:
	case <-time.After(attackWait):
		require.Fail(t, "AdmitConn was not called")
	}
	fx := &matrixFixture{r: r}
	fx.atServer(env)
	fx.finish = func(t *testing.T, cell string) {
		gate.open()
		c, err, ok := d.wait(attackWait)
		require.True(t, ok, "Dial did not return")
		require.NoError(t, err, "the attack made Dial fail")
		fx.c = c
		// The server speaks first: its connection is established by the
		// client's ConnectAck alone.
		fx.sc = env.srv.takeWithin(t, r.outerAddr(), 5*time.Second,
			"the client is open, the server never established its connection (the client's ConnectAck was lost)")
		echoThrough(t, c, cell, 5*time.Second)
	}
	return fx
}

// setupServerSynAckWait: the server sent its ConnectSynAck; the client's
// sealed datagrams (its ConnectAck, then a message) are held back.
func setupServerSynAckWait(t *testing.T, env *matrixEnv, cell string) *matrixFixture {
	r := newAttackRelay(env.owner, env.srv.l.Addr())
	env.know(r.outerAddr())
	r.setRule(&r.up, func(b []byte) relayFate {
		if isClearSyn(b) {
			return relayPass
		}
		return relayHold
	})
	c := dial(t, r.Addr(), env.ccfg)
	t.Cleanup(r.passAll)
	held := []byte("HELD:" + cell + strings.Repeat(".", 300))
	require.NoError(t, c.Send(Message{ID: 9, Payload: held, Reliable: true}))
	_, dg := r.mustAwait(t, &r.up, 0, "datagram with the held message", func(e relayEntry) bool {
		return e.fate == relayHold && len(e.b) > len(held)
	})
	// Forgeries take the PacketID of that datagram.
	fx := &matrixFixture{r: r, c: c, pid: pidOf(dg), hasPID: true}
	fx.atServer(env)
	fx.finish = func(t *testing.T, cell string) {
		r.pass(&r.up)
		fx.sc = env.srv.take(t, r.outerAddr())
		assert.True(t, env.srv.awaitMsg(fx.sc, held, 5*time.Second), "the client's message held back during the attack was lost")
		echoThrough(t, c, cell, 5*time.Second)
	}
	return fx
}

// setupServerClosing: the server's connection called Close; its
// Disconnect is dropped.
func setupServerClosing(t *testing.T, env *matrixEnv, _ string) *matrixFixture {
	fx := env.openFixture(t)
	fx.atServer(env)
	r, c, sc := fx.r, fx.c, fx.sc
	r.setRule(&r.down, dropAll)
	n := len(r.datagrams(&r.down))
	sc.StartClose("")
	_, disc := r.mustAwait(t, &r.down, n, "Disconnect", func(e relayEntry) bool { return isInOrderDg(e.b) && !isReliableDg(e.b) })
	fx.finish = func(t *testing.T, cell string) {
		probe := "PROBE:" + cell
		require.NoError(t, c.Send(Message{ID: 7, Payload: []byte(probe), Reliable: true}))
		require.Eventually(t, func() bool { return slices.Contains(queuedPayloads(sc), probe) || isDone(sc) }, attackWait, time.Millisecond)
		require.False(t, isDone(sc), "the closing server ended before its peer answered: %v", sc.Err())
		assert.Equal(t, []string{probe}, queuedPayloads(sc), "the closing server took a message its peer did not send")
		r.pass(&r.down)
		r.injectDown(disc)
		awaitDone(t, sc, attackWait, "the server's close did not complete")
		assert.ErrorIs(t, sc.Err(), net.ErrClosed, "the server's close did not end gracefully")
		ctx, cancel := context.WithTimeout(context.Background(), attackWait)
		defer cancel()
		for {
			m, err := c.Receive(ctx)
			if err != nil {
				assert.ErrorIs(t, err, io.EOF, "the client did not hear the server's Disconnect")
				break
			}
			assert.False(t, isForged(m.Payload), "the client delivered a forged message: %q", m.Payload)
		}
	}
	return fx
}

// setupServerMigrating: the client's NAT rebinds; the server's path check
// of the new address is under way, its PathChallenges dropped.
func setupServerMigrating(t *testing.T, env *matrixEnv, _ string) *matrixFixture {
	fx := env.openFixture(t)
	fx.atServer(env)
	r, c, sc := fx.r, fx.c, fx.sc
	oldAddr := r.outerAddr()
	r.rebind()
	newAddr := r.outerAddr()
	env.know(newAddr)
	r.setRule(&r.down, dropAll) // at the new address: the challenges
	n := len(r.datagrams(&r.down))
	move := []byte("MOVE")
	require.NoError(t, c.Send(Message{ID: 9, Payload: move, Reliable: true}))
	r.mustAwait(t, &r.down, n, "PathChallenge", func(e relayEntry) bool { return !e.old && len(e.b) == challengeSize })
	require.True(t, env.srv.awaitMsg(sc, move, attackWait), "the server did not take the message from the new address")
	fx.finish = func(t *testing.T, cell string) {
		// A message from the client's new address after the attack: the
		// server still takes them, and stays where the client is.
		probe := []byte("PROBE:" + cell)
		require.NoError(t, c.Send(Message{ID: 9, Payload: probe, Reliable: true}))
		require.True(t, env.srv.awaitMsg(sc, probe, 5*time.Second), "the server no longer takes the client's messages")
		require.NoError(t, sc.Err())
		require.NoError(t, c.Err())
		ra := addrOf(sc.RemoteAddr())
		assert.True(t, ra == oldAddr || ra == newAddr, "the connection moved to %s, not to the client", ra)
	}
	fx.final = func(t *testing.T) {
		// The challenges pass: the connection moves, and works.
		r.pass(&r.down)
		echoThrough(t, c, "moved", attackWait)
		// One more: the server's round that moved it published its
		// Stats before it took this one.
		echoThrough(t, c, "moved again", attackWait)
		assert.Equal(t, newAddr, addrOf(sc.RemoteAddr()))
		assert.Equal(t, uint64(1), sc.Stats().Migrations)
	}
	return fx
}

// attackDonor runs another secure session with the same server key and
// returns its datagrams: material sealed under other keys, and an old
// genuine ConnectSynAck. Its messages carry markers.
func attackDonor(t *testing.T, scfg, ccfg *Config) (up, down [][]byte) {
	l := listen(t, scfg)
	serveEcho(t, l)
	r := newAttackRelay(t, l.Addr())
	c := dial(t, r.Addr(), ccfg)
	for i := range 4 {
		p := []byte(fmt.Sprintf("MARKER:donor %d", i))
		require.NoError(t, c.Send(Message{ID: 7, Payload: p, Reliable: i%2 == 0}))
		for i%2 == 0 {
			m, err := c.Receive(within(t, 5*time.Second))
			require.NoError(t, err)
			if bytes.Equal(m.Payload, p) {
				break
			}
		}
	}
	return r.datagrams(&r.up), r.datagrams(&r.down)
}

// check is what every cell asserts of the server: nothing forged
// delivered, nothing delivered twice, no connection from an attacker.
func (env *matrixEnv) check(t *testing.T) {
	forged, twice := env.srv.forged()
	for _, f := range forged {
		if !env.reported[f] {
			env.reported[f] = true
			assert.Fail(t, "the server delivered a forged message", f)
		}
	}
	for _, f := range twice {
		if !env.reported["twice "+f] {
			env.reported["twice "+f] = true
			assert.Fail(t, "the server delivered a message twice", f)
		}
	}
	for _, from := range env.srv.acceptedFrom() {
		if key := "conn " + from.String(); !env.known[from] && !env.reported[key] {
			env.reported[key] = true
			assert.Fail(t, "the server accepted a connection from an attacker", "from %s (%s)", from, env.attackers[from])
		}
	}
}

// replay sends the client's ConnectSyn syn from the replayer a, and waits
// until the listener handled it: a new attempt, whose key exchange is
// answered (a ConnectSynAck or a refusal), or a copy of a handshake under
// way, counted as a replayed handshake, which its connection answers only
// once it has its ConnectSynAck (not while Admit runs).
// It reports whether the replayer got an answer.
func (env *matrixEnv) replay(a *attackerSock, syn []byte, to netip.AddrPort) (answered bool) {
	n, before := a.count(), env.srv.l.Stats().ReplayedHandshakes
	a.send(syn, to)
	got := a.answeredSince(n, func(b []byte) bool { return isClearSynAck(b) || holdsID(b, idDisconnectAck) })
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); runtime.Gosched() {
		if ok, _ := got(); ok {
			return true
		}
		if env.srv.l.Stats().ReplayedHandshakes > before {
			return false
		}
	}
	return false
}

func (env *matrixEnv) runCell(t *testing.T, fx *matrixFixture, k attackKind, src attackSource, cell string) {
	m := fx.material(env, cell)
	ds := k.build(m)
	require.NotEmpty(t, ds)
	var a *attackerSock
	if src == fromPeer {
		for _, b := range ds {
			fx.inject(b)
		}
	} else {
		a = newAttackerSock(env.owner)
		env.attackers[a.addr] = cell
		to := fx.target()
		attempt := false // the replayer's ConnectSyn made an attempt of its own
		if src == fromReplayer {
			attempt = env.replay(a, m.syn, to)
		}
		for _, b := range ds {
			a.send(b, to)
		}
		if src == fromReplayer {
			// The ConnectSyn again: the replayer's attempt, if still
			// waiting, answers it after it took the rest; if the rest
			// made a connection of it, it is accepted.
			n := a.count()
			if env.replay(a, resentSyn(m.syn), to) || attempt {
				awaitEither(5*time.Second, a.answeredSince(n, isClearSynAck), env.srv.acceptedFromAddr(a.addr))
			}
			// If it was accepted, what it got delivered is in the log
			// before the checks.
			env.srv.wait(5*time.Second, func() bool {
				for _, sc := range env.srv.conns {
					if sc.from == a.addr && len(sc.msgs) == 0 && sc.end == nil {
						return false
					}
				}
				return true
			})
		}
	}
	fx.finish(t, cell)
	env.check(t)
	if a != nil {
		assert.LessOrEqual(t, a.received(), int(a.sent.Load()), "an address that never proved itself got more bytes than it sent")
	}
}

// TestAttackMatrix: each kind of crafted datagram against each end of a
// secure connection in each state, from the peer's address and from
// elsewhere. In every cell: nothing forged is delivered, the connection
// survives (Dial succeeds, a round trip works, a close completes), no
// connection appears from an attacker, and an attacker's address gets no
// more bytes than it sent.
func TestAttackMatrix(t *testing.T) {
	base, ccfg := secureConfigs(t)
	base.CookieThreshold = 1 << 20 // attempts pile up: no cookies here
	// Every cell during a server key rotation: the listener reads
	// handshakes under its key and a next one (serverkey.go).
	next, _, err := GenerateKey()
	require.NoError(t, err)
	base.NextPrivateKey = next
	base.ConnectTimeout, base.DisconnectTimeout = 5*time.Second, 5*time.Second
	ccfg.ConnectTimeout, ccfg.DisconnectTimeout = attackWait, 5*time.Second
	dcfg := *base
	donorUp, donorDown := attackDonor(t, &dcfg, ccfg)
	kinds := attackKinds()
	for _, st := range matrixStates() {
		t.Run(st.name, func(t *testing.T) {
			scfg := *base
			t.Parallel()
			env := &matrixEnv{owner: t, ccfg: ccfg, donorUp: donorUp, donorDown: donorDown,
				known: map[netip.AddrPort]bool{}, attackers: map[netip.AddrPort]string{}, reported: map[string]bool{}}
			env.srv = newAttackServer(t, &scfg)
			env.serverAddr = addrOf(env.srv.l.Addr())
			sources := []attackSource{fromPeer, fromElse}
			if st.server {
				sources = append(sources, fromReplayer)
			}
			var shared *matrixFixture
			for _, k := range kinds {
				for _, src := range sources {
					if src == fromReplayer && strings.HasPrefix(k.name, "ServerKeyRotation") {
						// A ConnectSyn of its own: its refusal, late
						// behind two key exchanges, would pass for an
						// answer to the replayer's.
						continue
					}
					name := k.name + " from " + src.String()
					cell := st.name + "/" + name
					if st.reusable && (shared == nil || shared.broken) {
						shared = st.setup(t, env, "")
					}
					t.Run(name, func(t *testing.T) {
						fx := shared
						if !st.reusable {
							fx = st.setup(t, env, cell)
						}
						defer func() {
							if t.Failed() {
								fx.broken = true
							}
						}()
						env.runCell(t, fx, k, src, cell)
					})
				}
			}
			if shared != nil && !shared.broken && shared.final != nil {
				t.Run("afterwards", shared.final)
			}
		})
	}
}
