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
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
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
		d.c, d.err = Dial(ctx, "udp", addr, cfg)
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
	a.send(syn, server)
	i, ok := a.await(0, attackWait, func(b []byte) bool { return isClearSynAck(b) || holdsID(b, idDisconnectAck) })
	if !ok {
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
			c, err := Dial(within(t, attackWait), "udp", r.Addr(), ccfg)
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
			c, err := Dial(within(t, attackWait), "udp", r.Addr(), ccfg)
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
