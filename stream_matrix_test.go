//go:build !js

package knet

// TestStreamAttackMatrix: the stream counterpart of TestAttackMatrix. A
// victim (a real knet client, over TCP or WebSocket, through an mxRelay)
// holds its server-side connection in one state; an attacker sends one
// crafted first frame from one source; the cell asserts what
// TestAttackMatrix asserts of UDP:
//   - nothing forged is delivered to the server's application;
//   - no connection from an attacker is accepted;
//   - the victim survives: a round trip, then a graceful close both ways
//     (closing, draining: its last message still taken, then the close
//     completes gracefully); in hello-sent, its connection is not offered
//     before its first sealed frame;
//   - a replayed secure hello, or a victim's UDP ConnectSyn in one, costs
//     no key exchange while the original is remembered and established,
//     is counted in ReplayedHandshakes (but by a draining listener, which
//     refuses before reading it) and gets no kind-6 answer; a copy of a
//     hello whose attempt is not yet established (pending, hello-sent,
//     admit-deciding) gets one attempt of its own by design (admission.go,
//     maxAttemptsPerMessage): at most one key exchange, never established;
//   - the server ends every attacker stream, its side and its Conn, while
//     the attacker keeps its own side open, within ConnectTimeout + 1 s,
//     and one whose first frame announces more than 4096 bytes within 1 s;
//     no stream is left pending (ListenerStats.Pending back to zero).
//
// Bytes injected into the victim's own secure stream must end the
// server's side never gracefully: with a *ProtocolError (or a
// *TimeoutError for a size field, 16 MiB's or garbage's, that the
// victim's frames never fill), nothing forged delivered; before the
// establishment the connection is never offered, and any end but a
// graceful one will do (a failed attempt); the client, unless the server
// said goodbye before the injection (closing, draining), must not end
// gracefully either. A FIN injected after the server's sealed close reads
// as the client's answer, by design (stream.go, streamEOF): logged. Plaintext cannot tell injected bytes
// from the victim's, by design: those cells are skipped. On a plaintext
// listener a hello that is a client's valid opening (a copy of the
// victim's, or the attacker's own) opens a connection of the attacker's
// own, by design: those cells only assert that it is not the victim's.
//
// Names: transport/security/state/frame/source, e.g.
// tcp/secure/open/replay-hello/from-other-ip; group-level checks are
// transport/security/state/victim (the victim shared by the cells from
// elsewhere) and .../leftovers. Groups and cells run concurrently (t.Run
// from goroutines, not t.Parallel, which -parallel would hold to two at a
// time): each group has its own listener, and its pre-open states last at
// most the listener's ConnectTimeout, which the attacks must fit in.

import (
	"bytes"
	"context"
	"errors"
	"hash/fnv"
	"io"
	"math/rand/v2"
	"net/http/httptest"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const (
	mxWait           = 10 * time.Second
	mxConnectTimeout = 3 * time.Second  // the listener's: attacker streams live this long
	mxServerLost     = 12 * time.Second // the listener's ConnectionLostTimeout: never reached on a loaded machine
	mxGroupsAtOnce   = 6                // the race detector allows 8128 goroutines; a loaded 2-core machine, less
)

// Securities of a group's listener.
const (
	mxPlain  = "plain"  // plaintext, Dialect DialectSpec: knet hellos only
	mxRef    = "ref"    // plaintext, Dialect DialectReference, a reference-dialect victim
	mxSecure = "secure" // PrivateKey
)

// States of the victim's server-side connection.
const (
	mxPending   = "pending"        // its stream open, its first frame held in the relay
	mxHelloSent = "hello-sent"     // the server sent its kind-6 answer; the client's first sealed frame held
	mxAdmitting = "admit-deciding" // AdmitConn holds it
	mxOpen      = "open"           // established, a round trip done
	mxClosing   = "closing"        // the server's Conn called StartClose; its goodbye held in the relay
	mxDraining  = "draining"       // the listener's Drain began; the goodbye held in the relay
)

// Sources of the attacker's frame.
const (
	mxFromVictimIP = "from-victim-ip" // a new TCP connection from 127.0.0.1
	mxFromOtherIP  = "from-other-ip"  // a new TCP connection from 127.0.0.2
	mxOverWS       = "over-websocket" // a new WebSocket to the listener's handler
	mxInjected     = "injected"       // into the victim's own stream, through the relay
)

type mxGroup struct {
	tr    Transport
	sec   string
	state string
}

func (g mxGroup) name() string { return g.tr.String() + "/" + g.sec + "/" + g.state }

func (g mxGroup) preOpen() bool {
	return g.state == mxPending || g.state == mxHelloSent || g.state == mxAdmitting
}

// ownConnByDesign reports whether the frame is, on this listener, a
// client's valid opening: plaintext has no identity, and a copy of a
// victim's hello, or a hello of the attacker's own, opens a connection of
// the attacker's own. The cell then asserts nothing of it but that it is
// not the victim's.
func (g mxGroup) ownConnByDesign(frame string) bool {
	switch g.sec {
	case mxPlain:
		return frame == "replay-hello" || frame == "knet-hello"
	case mxRef:
		return frame == "replay-hello" || frame == "ref-ping" || frame == "ref-app"
	}
	return false
}

func mxGroups() []mxGroup {
	var gs []mxGroup
	for _, tr := range []Transport{TransportTCP, TransportWebSocket} {
		for _, sec := range []string{mxPlain, mxRef, mxSecure} {
			if sec == mxRef && tr == TransportWebSocket {
				continue // the reference speaks no WebSocket
			}
			for _, st := range []string{mxPending, mxHelloSent, mxAdmitting, mxOpen, mxClosing, mxDraining} {
				if st == mxHelloSent && sec != mxSecure {
					continue
				}
				gs = append(gs, mxGroup{tr, sec, st})
			}
		}
	}
	return gs
}

// mxOp is a step of an attack: bytes written, bytes trickled a byte every
// 50 ms, or the end of what the attacker sends.
type mxOp struct {
	write, trickle []byte
	fin            bool
}

// mxMaterial is what an attack is made of.
type mxMaterial struct {
	hello  []byte // the victim's first frame
	udpSyn []byte // the content of a UDP victim's ConnectSyn
	seed   string // the cell's name: its garbage
}

type mxFrame struct {
	name      string
	oversized bool // its first frame announces more than 4096 bytes
	// swallows: its size field may announce more than the victim's
	// frames behind it fill; injected, the server can only time the
	// frame out (a *TimeoutError).
	swallows bool
	build    func(m mxMaterial, injected bool) []mxOp
}

func mxFrames() []mxFrame {
	w := func(b []byte) []mxOp { return []mxOp{{write: b}} }
	fs := []mxFrame{
		{name: "replay-hello", build: func(m mxMaterial, _ bool) []mxOp { return w(m.hello) }},
		{name: "udp-syn", build: func(m mxMaterial, _ bool) []mxOp { return w(knetHello(helloSecure, m.udpSyn)) }},
		{name: "ref-ping", build: func(mxMaterial, bool) []mxOp { return w(appendTCPFrame(nil, idPingRequest, []byte{1})) }},
		{name: "ref-app", build: func(mxMaterial, bool) []mxOp { return w(appendTCPFrame(nil, 100, []byte("INJECTED ref-app"))) }},
		{name: "knet-hello", build: func(mxMaterial, bool) []mxOp {
			return w(knetHello(helloClient, []byte("INJECTED knet-hello")))
		}},
	}
	for _, k := range []byte{helloAccept, helloRefuse, helloClose, helloSecureAccept} {
		fs = append(fs, mxFrame{name: "server-hello-" + string('0'+k), build: func(mxMaterial, bool) []mxOp {
			return w(knetHello(k, []byte("INJECTED server hello")))
		}})
	}
	return append(fs,
		mxFrame{name: "oversized", oversized: true, swallows: true, build: func(mxMaterial, bool) []mxOp {
			b := appendVLE32(nil, 16<<20)
			b = appendVLE32(b, idPingReply)
			return w(append(b, "INJECTED"...))
		}},
		mxFrame{name: "trickle", build: func(_ mxMaterial, injected bool) []mxOp {
			// Over the relay, the victim's frames fill the rest.
			n := 190
			if injected {
				n = 10
			}
			return []mxOp{{write: appendVLE32(nil, 200)}, {trickle: bytes.Repeat([]byte("I"), n)}}
		}},
		mxFrame{name: "truncated-fin", build: func(m mxMaterial, _ bool) []mxOp {
			return []mxOp{{write: m.hello[:len(m.hello)/2]}, {fin: true}}
		}},
		mxFrame{name: "fin", build: func(mxMaterial, bool) []mxOp { return []mxOp{{fin: true}} }},
		mxFrame{name: "garbage", swallows: true, build: func(m mxMaterial, _ bool) []mxOp { return w(mxGarbage(m.seed)) }},
	)
}

// mxGarbage is 256 random bytes, the same for a seed, that hold no whole
// frame of at most 4096 bytes at their start (which could be a
// reference client's valid opening).
func mxGarbage(seed string) []byte {
	h := fnv.New64a()
	h.Write([]byte(seed))
	var key [32]byte
	copy(key[:], h.Sum(nil))
	rng := rand.NewChaCha8(key)
	b := make([]byte, 256)
	for range 100 {
		rng.Read(b)
		if _, _, n, err := parseTCPFrame(b, 4096); err != nil || n == 0 {
			break
		}
	}
	return b
}

type mxCell struct {
	name     string
	frame    mxFrame
	src      string
	skip     string
	victim   *mxVictim // its own, or nil: the group's shared one
	sent     chan struct{}
	sentOnce sync.Once
}

func (c *mxCell) markSent() { c.sentOnce.Do(func() { close(c.sent) }) }

// mxEnv is a group's listener, its server application and victims.
type mxEnv struct {
	g         mxGroup
	l         *Listener
	tcpAddr   string
	wsURL     string
	ccfg      *Config
	udpSyn    []byte
	udpVictim *Conn
	shared    *mxVictim

	mu        sync.Mutex
	served    []*mxServed
	gates     map[netip.AddrPort]*mxGate
	victims   map[netip.AddrPort]string
	attackers map[netip.AddrPort]string
	changed   chan struct{}

	kx        sync.Mutex // held by a cell while it measures KeyExchanges
	goCh      chan struct{}
	finishing chan struct{}
	drained   chan error
	wg        sync.WaitGroup
}

func (env *mxEnv) signalLocked() {
	close(env.changed)
	env.changed = make(chan struct{})
}

func newMxEnv(t *testing.T, g mxGroup) *mxEnv {
	var scfg, ccfg *Config
	if g.sec == mxSecure {
		scfg, ccfg = secureConfigs(t)
	} else {
		scfg, ccfg = testConfig(), testConfig()
	}
	scfg.TCP = true
	scfg.ConnectTimeout = mxConnectTimeout
	scfg.ConnectionLostTimeout = mxServerLost
	scfg.DisconnectTimeout = 8 * time.Second // longer than the holds of closing and draining
	ccfg.ConnectTimeout = mxWait
	ccfg.ConnectionLostTimeout = 18 * time.Second // pings every 6 s: within the listener's lost timeout
	ccfg.DisconnectTimeout = 5 * time.Second
	switch g.sec {
	case mxPlain:
		scfg.Dialect = DialectSpec
	case mxRef:
		scfg.Dialect, ccfg.Dialect = DialectReference, DialectReference
	}
	if g.sec != mxRef {
		ccfg.ConnectPayload = []byte("VICTIM-LOGIN")
	}
	env := &mxEnv{g: g, ccfg: ccfg, changed: make(chan struct{}),
		gates: map[netip.AddrPort]*mxGate{}, victims: map[netip.AddrPort]string{}, attackers: map[netip.AddrPort]string{},
		goCh: make(chan struct{}), finishing: make(chan struct{})}
	scfg.AdmitConn = func(c *Conn, _ []byte) ([]byte, error) {
		env.mu.Lock()
		gate := env.gates[mxAddr(c.RemoteAddr())]
		env.mu.Unlock()
		if gate != nil {
			gate.enterOnce.Do(func() { close(gate.entered) })
			select {
			case <-gate.release:
			case <-time.After(mxWait):
			}
		}
		return nil, nil
	}
	env.l = listen(t, scfg)
	env.tcpAddr = env.l.Addr().String()
	srv := httptest.NewServer(env.l.WebSocketHandler())
	env.wsURL = "ws" + strings.TrimPrefix(srv.URL, "http")
	env.wg.Go(func() {
		for {
			c, err := env.l.AcceptConn(context.Background())
			if err != nil {
				return
			}
			sv := &mxServed{c: c, from: mxAddr(c.RemoteAddr()), at: time.Now()}
			env.mu.Lock()
			env.served = append(env.served, sv)
			env.signalLocked()
			env.mu.Unlock()
			env.wg.Go(func() { env.serve(sv) })
		}
	})
	t.Cleanup(func() {
		env.mu.Lock()
		for _, g := range env.gates {
			g.open()
		}
		env.mu.Unlock()
		srv.Close()
		env.l.Close()
		env.wg.Wait()
		if env.drained != nil {
			<-env.drained
		}
	})
	if g.sec != mxRef {
		// A victim over UDP: its ConnectSyn's content is the material
		// of the udp-syn cells (the reference dialect has none).
		r := newAttackRelay(t, env.l.Addr())
		env.victims[r.outerAddr()] = "the UDP victim"
		ucfg := *ccfg
		ucfg.Dialect = DialectAuto
		env.udpVictim = dial(t, r.Addr(), &ucfg)
		_, syn := r.mustAwait(t, &r.up, 0, "ConnectSyn", func(e relayEntry) bool { return isClearSyn(e.b) })
		env.udpSyn = contentOf(syn, idConnectSyn)
	}
	return env
}

// serve records what sv delivers, and echoes it (but ID 9).
func (env *mxEnv) serve(sv *mxServed) {
	for {
		m, err := sv.c.Receive(context.Background())
		if err != nil {
			return
		}
		env.mu.Lock()
		sv.msgs = append(sv.msgs, m)
		env.signalLocked()
		env.mu.Unlock()
		if m.ID != 9 {
			sv.c.Send(m)
		}
	}
}

// accepted returns what the application accepted from addr over a
// stream since the time given, waiting up to d for it. (A UDP connection
// may come from the same address and port number: the UDP victim, through
// its relay. An earlier stream may have had the port: an attacker's
// stream accepted by design and closed, whose port the system gave to a
// later one, which then failed its notAccepted once, in a busy run.)
func (env *mxEnv) accepted(addr netip.AddrPort, since time.Time, d time.Duration) *mxServed {
	timer := time.NewTimer(d)
	defer timer.Stop()
	for {
		env.mu.Lock()
		i := slices.IndexFunc(env.served, func(sv *mxServed) bool {
			return sv.from == addr && sv.c.Transport() != TransportUDP && !sv.at.Before(since)
		})
		changed := env.changed
		var sv *mxServed
		if i >= 0 {
			sv = env.served[i]
		}
		env.mu.Unlock()
		if sv != nil {
			return sv
		}
		select {
		case <-changed:
		case <-timer.C:
			return nil
		}
	}
}

// notAccepted asserts that the application accepted no connection from
// addr since the time given.
func (env *mxEnv) notAccepted(t *testing.T, addr netip.AddrPort, since time.Time, msg string) {
	if sv := env.accepted(addr, since, 0); sv != nil {
		env.mu.Lock()
		delivered := mxPayloads(sv.msgs)
		env.mu.Unlock()
		assert.Fail(t, msg, "from %s over %v, accepted %v after the time asked; its application received %q", sv.from, sv.c.Transport(), sv.at.Sub(since), delivered)
	}
}

// delivered lists the payloads c delivered: those its application took,
// and those still in its queue (a closing connection's application no
// longer reads).
func (env *mxEnv) delivered(c *Conn) []string {
	out := queuedPayloads(c)
	env.mu.Lock()
	defer env.mu.Unlock()
	for _, sv := range env.served {
		if sv.c == c {
			out = append(out, mxPayloads(sv.msgs)...)
		}
	}
	return out
}

// awaitHandled waits, at most a second, until the listener settled a
// secure hello just sent: a key exchange done, or the stream (sc, or the
// one from addr) ended. (A replay is counted before a copy's own attempt
// is key-exchanged: the count alone settles nothing.)
func (env *mxEnv) awaitHandled(addr netip.AddrPort, before ListenerStats, sc *Conn) {
	var seen *Conn
	mxPoll(time.Second, func() bool {
		if env.l.Stats().KeyExchanges > before.KeyExchanges {
			return true
		}
		if sc != nil {
			return isDone(sc)
		}
		if c := mxConnFrom(env.l, addr); c != nil {
			seen = c
			return isDone(c)
		}
		return seen != nil
	})
}

// mxVictim is a knet client through an mxRelay.
type mxVictim struct {
	env    *mxEnv
	name   string
	r      *mxRelay
	gate   *mxGate
	dialed chan struct{}
	c      *Conn
	err    error
	sc     *Conn // the server's side of its stream
	hello  []byte
}

// newVictim dials through a relay: the first frame held, not yet connected
// to the listener, for a state before the opening; open, after a round
// trip, for the others.
func (env *mxEnv) newVictim(t *testing.T, name string) *mxVictim {
	g := env.g
	holdFrom := -1
	switch g.state {
	case mxPending:
		holdFrom = 0
	case mxHelloSent:
		holdFrom = 1
	}
	r := newMxRelay(t, g.tr, env.tcpAddr, env.wsURL, holdFrom)
	v := &mxVictim{env: env, name: name, r: r, dialed: make(chan struct{})}
	if g.state == mxAdmitting {
		v.gate = newMxGate()
	}
	r.onConnect = func(a netip.AddrPort) {
		env.mu.Lock()
		env.victims[a] = name
		if v.gate != nil {
			env.gates[a] = v.gate
		}
		env.mu.Unlock()
	}
	go func() {
		defer close(v.dialed)
		ctx, cancel := context.WithTimeout(context.Background(), 2*mxWait)
		defer cancel()
		if g.tr == TransportTCP {
			v.c, v.err = Dial(ctx, "tcp", r.addr, env.ccfg)
		} else {
			v.c, v.err = DialWebSocket(ctx, r.addr, env.ccfg)
		}
	}()
	t.Cleanup(func() {
		<-v.dialed
		if v.c != nil {
			v.c.Close()
		}
	})
	t.Cleanup(r.close) // first: a Dial still waiting fails
	if v.gate != nil {
		t.Cleanup(v.gate.open)
	}
	require.True(t, r.up.await(1, mxWait), "victim %s: no first frame", name)
	v.hello = r.up.frame(0)
	if g.preOpen() {
		return v
	}
	require.NoError(t, r.connectUp())
	v.mustDial(t)
	sv := env.accepted(r.upLocal, time.Time{}, mxWait)
	require.NotNil(t, sv, "victim %s: the server accepted no connection", name)
	v.sc = sv.c
	v.roundTrip(t, "setup")
	return v
}

func (v *mxVictim) mustDial(t *testing.T) {
	t.Helper()
	select {
	case <-v.dialed:
	case <-time.After(mxWait):
		require.FailNow(t, "Dial did not return", "victim %s", v.name)
	}
	require.NoError(t, v.err, "victim %s: Dial failed", v.name)
}

// enter brings the victim's server side into the group's state (draining
// is the group's: mxEnv.drain).
func (v *mxVictim) enter(t *testing.T) {
	env := v.env
	switch env.g.state {
	case mxHelloSent:
		v.mustDial(t)
	case mxAdmitting:
		select {
		case <-v.gate.entered:
		case <-time.After(mxWait):
			require.FailNow(t, "AdmitConn was not called", "victim %s", v.name)
		}
	case mxClosing:
		v.r.down.hold()
		v.sc.StartClose("")
	}
	if v.sc == nil {
		require.True(t, mxPoll(mxWait, func() bool { v.sc = mxConnFrom(env.l, v.r.upLocal); return v.sc != nil }),
			"victim %s: the listener has no stream from %s", v.name, v.r.upLocal)
	}
}

// drain starts the listener's Drain, the victims' goodbyes held.
func (env *mxEnv) drain(t *testing.T, vs []*mxVictim) {
	for _, v := range vs {
		v.r.down.hold()
	}
	env.drained = make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 3*mxWait)
		defer cancel()
		env.drained <- env.l.Drain(ctx, "draining")
	}()
	for _, v := range vs {
		require.True(t, mxPoll(mxWait, v.sc.isClosed), "victim %s: Drain did not close its connection", v.name)
	}
}

// roundTrip sends a message and waits for its echo; the victim receives
// nothing else.
func (v *mxVictim) roundTrip(t *testing.T, tag string) {
	t.Helper()
	p := "VICTIM:" + v.name + ":" + tag
	require.NoError(t, v.c.Send(Message{ID: 7, Payload: []byte(p), Reliable: true}), "victim %s: %v", v.name, v.c.Err())
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for range 100 {
		m, err := v.c.Receive(ctx)
		require.NoError(t, err, "victim %s: no echo of %q: %v", v.name, p, v.c.Err())
		require.True(t, strings.HasPrefix(string(m.Payload), "VICTIM:"+v.name+":"), "victim %s received a message it did not send: %q", v.name, m.Payload)
		if string(m.Payload) == p {
			return
		}
	}
}

// survive asserts that the victim survived an attack from elsewhere: it
// connects, makes a round trip and closes gracefully both ways (closing,
// draining: its last message is taken, then the close completes).
func (v *mxVictim) survive(t *testing.T) {
	env, r := v.env, v.r
	if env.g.state == mxHelloSent {
		env.notAccepted(t, r.upLocal, time.Time{}, "the server offered the victim's connection before its first sealed frame came")
	}
	switch env.g.state {
	case mxPending, mxHelloSent:
		r.up.pass()
	case mxAdmitting:
		v.gate.open()
	}
	v.mustDial(t)
	switch env.g.state {
	case mxClosing, mxDraining:
		probe := "VICTIM:" + v.name + ":probe"
		require.NoError(t, v.c.Send(Message{ID: 9, Payload: []byte(probe), Reliable: true}))
		require.True(t, mxPoll(mxWait, func() bool { return slices.Contains(env.delivered(v.sc), probe) || isDone(v.sc) }),
			"the closing server never took the victim's last message")
		require.False(t, isDone(v.sc), "the closing server's connection ended before the victim answered: %v", v.sc.Err())
		r.down.pass()
		awaitDone(t, v.sc, mxWait, "the server's close did not complete")
		assert.True(t, mxGraceful(v.sc.Err()), "the server's close ended with %v", v.sc.Err())
		ctx, cancel := context.WithTimeout(context.Background(), mxWait)
		defer cancel()
		for range 100 {
			m, err := v.c.Receive(ctx)
			if err != nil {
				assert.ErrorIs(t, err, io.EOF, "the victim did not hear the server's close")
				break
			}
			assert.True(t, strings.HasPrefix(string(m.Payload), "VICTIM:"+v.name+":"), "the victim received %q", m.Payload)
		}
		awaitDone(t, v.c, mxWait, "the victim's side did not end")
		assert.True(t, mxGraceful(v.c.Err()), "the victim's side ended with %v", v.c.Err())
	default:
		sv := env.accepted(r.upLocal, time.Time{}, mxWait)
		require.NotNil(t, sv, "the victim connected, the server never offered its connection")
		require.Same(t, v.sc, sv.c)
		v.roundTrip(t, "after")
		assert.NoError(t, v.c.Close(), "the victim's close did not end gracefully")
		awaitDone(t, v.sc, mxWait, "the server's side did not end after the victim's close")
		assert.True(t, mxGraceful(v.sc.Err()), "the server's side ended with %v", v.sc.Err())
	}
	assert.Empty(t, mxForeign(env.delivered(v.sc)), "the server delivered forged messages on the victim's connection")
}

// cut asserts what an injection into the victim's own secure stream must
// do: end it, never gracefully, nothing forged delivered.
func (v *mxVictim) cut(t *testing.T, c *mxCell) {
	env, r, state := v.env, v.r, v.env.g.state
	switch state {
	case mxPending, mxHelloSent:
		r.up.pass()
	case mxAdmitting:
		v.gate.open()
	}
	select {
	case <-v.dialed:
	case <-time.After(mxWait):
		require.FailNow(t, "Dial did not return")
	}
	if v.err == nil {
		for i := range 5 {
			p := "VICTIM:" + v.name + ":" + string(rune('0'+i)) + strings.Repeat(".", 100)
			v.c.Send(Message{ID: 7, Payload: []byte(p), Reliable: true})
		}
	}
	awaitDone(t, v.sc, mxServerLost+4*time.Second, "the server's side of the victim's stream is still up after the injection")
	err := v.sc.Err()
	var pe *ProtocolError
	var te *TimeoutError
	switch {
	case env.g.preOpen():
		// Before the establishment the injection makes a failed
		// attempt, never offered (asserted below): any end but a
		// graceful one (in pending the attacker's bytes even come
		// first, and are refused as a first frame).
		assert.True(t, mxNonGraceful(err), "the server's side ended with %v", err)
	case (state == mxClosing || state == mxDraining) && c.frame.name == "fin" && mxGraceful(err):
		// By design (stream.go, streamEOF): once the server said its
		// sealed close, an end of the stream is the client's answer,
		// which a proxy may pass without the client's own close. A FIN
		// injected then reads as that answer: what the client sent
		// after the cut is lost without a word.
		t.Logf("a FIN injected after the server's close read as the client's answer: %v", err)
	case mxGraceful(err):
		assert.Fail(t, "the server's side of the victim's stream ended gracefully after an injection", "%v", err)
	default:
		assert.True(t, errors.As(err, &pe) || c.frame.swallows && errors.As(err, &te),
			"the server's side of the victim's stream ended with %v (%T), not a *ProtocolError", err, err)
	}
	if env.g.preOpen() {
		env.notAccepted(t, r.upLocal, time.Time{}, "the server offered the victim's connection though its first sealed frame did not open")
	}
	assert.Empty(t, mxForeign(env.delivered(v.sc)), "the server delivered forged messages on the victim's connection")
	switch state {
	case mxClosing, mxDraining:
		// The server said goodbye before the injection: the client
		// may take it for a graceful end.
		r.down.pass()
	default:
		if v.err == nil {
			awaitDone(t, v.c, mxWait, "the victim's side is still up after the server's ended")
			assert.True(t, mxNonGraceful(v.c.Err()), "the victim's side believes its connection ended gracefully: %v", v.c.Err())
		}
	}
}

func (env *mxEnv) material(c *mxCell) mxMaterial {
	v := c.victim
	if v == nil {
		v = env.shared
	}
	return mxMaterial{hello: v.hello, udpSyn: env.udpSyn, seed: env.g.name() + "/" + c.name}
}

// kind5 reports whether the cell sends a secure hello the listener may
// key-exchange: those are sent one at a time, under env.kx.
func (env *mxEnv) kind5(c *mxCell) bool {
	if env.g.sec != mxSecure || c.frame.name != "replay-hello" && c.frame.name != "udp-syn" {
		return false
	}
	return c.src != mxInjected || env.g.state == mxPending
}

func (env *mxEnv) runCell(t *testing.T, c *mxCell) {
	defer c.markSent()
	if c.skip != "" {
		t.Skip(c.skip)
	}
	select {
	case <-env.goCh:
	case <-time.After(3 * mxWait):
		require.FailNow(t, "the group's victims never reached their state")
	}
	if c.src == mxInjected {
		env.injectCell(t, c)
	} else {
		env.externalCell(t, c)
	}
}

func (env *mxEnv) injectCell(t *testing.T, c *mxCell) {
	v := c.victim
	kind5 := env.kind5(c)
	var before ListenerStats
	if kind5 {
		env.kx.Lock()
		before = env.l.Stats()
	}
	var trickling sync.WaitGroup
	defer trickling.Wait()
	for _, op := range c.frame.build(env.material(c), true) {
		switch {
		case op.fin:
			v.r.up.injectFIN()
		case op.trickle != nil:
			// The victim's frames, and its release, wait behind it
			// on the relay's lock; the other cells need not.
			trickling.Go(func() { v.r.up.trickle(op.trickle) })
		default:
			v.r.up.inject(op.write)
		}
	}
	if kind5 {
		env.awaitHandled(netip.AddrPort{}, before, v.sc)
		env.kx.Unlock()
	}
	c.markSent()
	<-env.finishing
	v.cut(t, c)
}

func (env *mxEnv) externalCell(t *testing.T, c *mxCell) {
	g := env.g
	ctx, cancel := context.WithTimeout(context.Background(), mxWait)
	defer cancel()
	var s *mxStream
	var err error
	switch c.src {
	case mxFromVictimIP:
		s, err = mxDialTCP(ctx, env.tcpAddr, mxVictimIP)
	case mxFromOtherIP:
		s, err = mxDialTCP(ctx, env.tcpAddr, mxOtherIP)
	case mxOverWS:
		s, err = mxDialWSStream(ctx, env.wsURL, mxVictimIP)
	}
	require.NoError(t, err)
	defer s.close()
	own := g.ownConnByDesign(c.frame.name)
	env.mu.Lock()
	env.attackers[s.local] = c.name
	env.mu.Unlock()

	kind5 := env.kind5(c)
	// replay: the original's attempt is established (the UDP victim's
	// always), and a copy costs no key exchange and gets no answer. Before
	// the victim's stream is established, a copy of its hello gets an
	// attempt of its own, by design (admission.go, maxAttemptsPerMessage:
	// the attempt holding the message cannot answer a copy on another
	// stream, and a raced client must still get in); in pending the copy
	// even comes first. Those copies may cost a key exchange and get
	// their answer; they must still never be established.
	replay := kind5 && !(g.preOpen() && c.frame.name == "replay-hello")
	var before, after ListenerStats
	if kind5 {
		env.kx.Lock()
		before = env.l.Stats()
	}
	wrote := time.Now()
	for _, op := range c.frame.build(env.material(c), false) {
		switch {
		case op.fin:
			s.fin()
		case op.trickle != nil:
			s.trickle(op.trickle)
		default:
			s.write(op.write)
		}
	}
	if kind5 {
		env.awaitHandled(s.local, before, nil)
		after = env.l.Stats()
		env.kx.Unlock()
	}
	c.markSent()

	// The attacker's stream, while the victim finishes: only assert
	// here, which may run beside the test's goroutine.
	checked := make(chan struct{})
	defer func() { <-checked }() // before the cell ends, though survive fail it
	go func() {
		defer close(checked)
		if replay {
			assert.Equal(t, before.KeyExchanges, after.KeyExchanges, "a replayed secure hello cost a key exchange")
			if g.state != mxDraining { // a draining listener refuses any stream before its hello is read
				assert.Greater(t, after.ReplayedHandshakes, before.ReplayedHandshakes, "a replayed secure hello was not counted in ReplayedHandshakes")
			}
		} else if kind5 {
			assert.LessOrEqual(t, after.KeyExchanges, before.KeyExchanges+1, "a copy of a hello cost more than its one attempt's key exchange")
		}
		if own {
			env.accepted(s.local, s.opened, mxConnectTimeout+time.Second)
			s.close()
		} else {
			deadline := s.opened.Add(mxConnectTimeout + time.Second)
			if c.frame.oversized {
				deadline = wrote.Add(time.Second)
			}
			// Closed: the server ended its side and dropped its
			// connection, while the attacker kept its own side open (a
			// half-close alone leaves the server's Conn to the
			// attacker).
			closed, at := s.awaitClosed(deadline)
			gone := closed && mxPoll(time.Until(deadline), func() bool { return mxConnFrom(env.l, s.local) == nil })
			switch {
			case closed && gone:
				t.Logf("closed by the server %v after it opened", at.Sub(s.opened).Round(time.Millisecond))
			case c.frame.oversized:
				assert.Fail(t, "a first frame announcing 16 MiB: the stream is still open 1 s later", "the server ended its side of the stream: %v; its Conn is still up", closed)
			default:
				assert.Fail(t, "the attacker's stream is still open "+(mxConnectTimeout+time.Second).String()+" after it opened",
					"the server ended its side of the stream: %v; its Conn is still up", closed)
			}
			if replay {
				assert.NotContains(t, mxHellos(s.got), byte(helloSecureAccept), "a replayed secure hello got a kind-6 answer")
			}
			s.close()
			env.notAccepted(t, s.local, s.opened, "the server accepted a connection from the attacker")
		}
		assert.True(t, mxPoll(2*time.Second, func() bool { return mxConnFrom(env.l, s.local) == nil }),
			"the attacker's stream left a connection behind on the listener")
	}()
	if c.victim != nil {
		select {
		case <-env.finishing:
			c.victim.survive(t)
		case <-time.After(3 * mxWait):
			assert.Fail(t, "the group never finished its attacks")
		}
	}
}

// mxRun runs f for each name as a subtest, all at once.
func mxRun[T any](t *testing.T, items []T, name func(T) string, f func(*testing.T, T)) {
	var wg sync.WaitGroup
	for _, it := range items {
		wg.Go(func() { t.Run(name(it), func(t *testing.T) { f(t, it) }) })
	}
	wg.Wait()
}

func mxRunGroup(t *testing.T, g mxGroup) {
	start := time.Now()
	env := newMxEnv(t, g)
	var cells []*mxCell
	for _, f := range mxFrames() {
		if f.name == "udp-syn" && g.sec == mxRef {
			continue
		}
		for _, src := range []string{mxFromVictimIP, mxFromOtherIP, mxOverWS, mxInjected} {
			c := &mxCell{name: f.name + "/" + src, frame: f, src: src, sent: make(chan struct{})}
			if src == mxInjected && g.sec != mxSecure {
				// Plaintext cannot tell the victim's bytes from bytes
				// injected on its path: by design (SECURE.md, threat
				// model, "Plaintext connections").
				c.skip = "plaintext cannot detect bytes injected into the victim's stream, by design"
			}
			cells = append(cells, c)
		}
	}

	// The victims: one shared by the cells from elsewhere, one for each
	// replay of its own hello and each injection.
	env.shared = env.newVictim(t, "shared")
	victims := []*mxVictim{env.shared}
	for _, c := range cells {
		if c.skip == "" && (c.src == mxInjected || c.frame.name == "replay-hello") {
			c.victim = env.newVictim(t, c.name)
			victims = append(victims, c.victim)
		}
	}
	// Their server sides open now, all at once: a pre-open state lasts
	// ConnectTimeout at most.
	connecting := time.Now()
	errs := make([]error, len(victims))
	var cw sync.WaitGroup
	for i, v := range victims {
		if g.preOpen() {
			cw.Go(func() { errs[i] = v.r.connectUp() })
		}
	}
	cw.Wait()
	for i, err := range errs {
		require.NoError(t, err, "victim %s: the relay could not reach the listener", victims[i].name)
	}
	for _, v := range victims {
		v.enter(t)
	}
	if g.state == mxDraining {
		env.drain(t, victims)
	}
	ready := time.Now()
	close(env.goCh)

	byFrame := map[string][]*mxCell{}
	var frames []string
	for _, c := range cells {
		if _, ok := byFrame[c.frame.name]; !ok {
			frames = append(frames, c.frame.name)
		}
		byFrame[c.frame.name] = append(byFrame[c.frame.name], c)
	}
	// Each cell is sent once it ran its attack, or once its subtest
	// returned (one -run left out).
	var wg sync.WaitGroup
	for _, f := range frames {
		wg.Go(func() {
			t.Run(f, func(t *testing.T) {
				var cw sync.WaitGroup
				for _, c := range byFrame[f] {
					cw.Go(func() {
						t.Run(c.src, func(t *testing.T) { env.runCell(t, c) })
						c.markSent()
					})
				}
				cw.Wait()
			})
			for _, c := range byFrame[f] {
				c.markSent()
			}
		})
	}
	sentBy, cancel := context.WithTimeout(context.Background(), 2*mxWait)
	for _, c := range cells {
		select {
		case <-c.sent:
		case <-sentBy.Done():
		}
	}
	cancel()
	t.Logf("victims connected in %v, in their state %v later, attacks sent %v later",
		connecting.Sub(start).Round(time.Millisecond), ready.Sub(connecting).Round(time.Millisecond), time.Since(ready).Round(time.Millisecond))
	close(env.finishing)
	wg.Go(func() { t.Run("victim", env.shared.survive) })
	wg.Wait()
	t.Run("leftovers", env.leftovers)
	t.Logf("group took %v", time.Since(start).Round(time.Millisecond))
}

// leftovers: the attackers' streams left nothing pending, and no
// connection came from an address nobody knows.
func (env *mxEnv) leftovers(t *testing.T) {
	var st ListenerStats
	ok := mxPoll(mxWait, func() bool { st = env.l.Stats(); return st.Pending == 0 })
	assert.True(t, ok, "streams left pending on the listener: %+v", st)
	env.mu.Lock()
	defer env.mu.Unlock()
	for _, sv := range env.served {
		if env.victims[sv.from] == "" && env.attackers[sv.from] == "" {
			assert.Fail(t, "the server accepted a connection from an unknown address", "%s", sv.from)
		}
	}
	if env.udpVictim != nil {
		assert.Empty(t, mxForeign(queuedPayloads(env.udpVictim)), "forged messages on the UDP victim's connection")
	}
}

// TestStreamAttackMatrix: see the top of this file.
func TestStreamAttackMatrix(t *testing.T) {
	t.Parallel()
	sem := make(chan struct{}, mxGroupsAtOnce)
	groups := mxGroups()
	type key struct{ tr, sec string }
	var trs []string
	bySec := map[string][]string{}
	byState := map[key][]mxGroup{}
	for _, g := range groups {
		tr := g.tr.String()
		if _, ok := bySec[tr]; !ok {
			trs = append(trs, tr)
		}
		if !slices.Contains(bySec[tr], g.sec) {
			bySec[tr] = append(bySec[tr], g.sec)
		}
		byState[key{tr, g.sec}] = append(byState[key{tr, g.sec}], g)
	}
	id := func(s string) string { return s }
	mxRun(t, trs, id, func(t *testing.T, tr string) {
		mxRun(t, bySec[tr], id, func(t *testing.T, sec string) {
			mxRun(t, byState[key{tr, sec}], func(g mxGroup) string { return g.state }, func(t *testing.T, g mxGroup) {
				sem <- struct{}{}
				defer func() { <-sem }()
				mxRunGroup(t, g)
			})
		})
	})
}
