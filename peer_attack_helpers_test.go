package knet

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/netsim"
)

// The malicious peer of issue 38: a peer that completed the handshake,
// plaintext or secure (it holds the session keys: it made them), and now
// speaks the wire as it likes to make the other end flood or burn CPU. It
// is scripted from the package's own codec and secure layer, with no
// session of its own: peerEvil.

// peerUDPOverhead is what IPv4 and UDP add to every datagram on the wire.
const peerUDPOverhead = 28

// peerEvil is a scripted peer on the network in memory: as a client, it
// connects to a Listener (peerDialEvil); as a server, a dialed Conn
// connects to it (peerListenEvil). In a secure session it holds the keys
// its handshake made, and seals and opens with the secure layer's own
// secureState (seal, open), numbering its datagrams itself: PacketID and
// packet number are one, counting up from 1.
type peerEvil struct {
	t      testing.TB
	sock   *netsim.Socket
	client bool

	mu     sync.Mutex // guards what follows: the reader and the senders share sec
	to     netip.AddrPort
	sec    *secureState // nil: plaintext
	next   uint32       // the PacketID (and packet number) of our next datagram
	newest uint32       // the newest PacketID the victim sent us
	seen   bool
	got    []uint32 // reliable PacketIDs received and not yet acked (honest acks)
	inWire int      // bytes received, on the wire (peerUDPOverhead each)
	inN    int
	outN   int
	out    int         // bytes sent, on the wire
	open   bool        // the handshake is over: what comes is the session's
	synAck chan []byte // the ConnectSynAck's content, while a client waits for it
	// synAckPID is the ConnectSynAck's PacketID, which a plaintext
	// client acks.
	synAckPID uint32
	syn       chan peerSyn // the ConnectSyn, while a server waits for it
	done      chan struct{}
}

type peerSyn struct {
	from    netip.AddrPort
	content []byte
}

// peerPaths puts the datagrams from the victim to the evil peer through a
// link with parameters down and those back through one with up, and
// returns the links. victim may be zero (any address: a dialed victim's
// address is known only once it dials).
func peerPaths(nw *testNet, victim, evil netip.AddrPort, down, up netsim.Params) (toEvil, fromEvil *netsim.Link) {
	return nw.mem.SetLink(victim, evil, &down), nw.mem.SetLink(evil, victim, &up)
}

// newPeerEvil makes the peer around its socket and starts its reader.
func newPeerEvil(t testing.TB, sock *netsim.Socket, client bool) *peerEvil {
	e := &peerEvil{t: t, sock: sock, client: client, next: 1, synAck: make(chan []byte, 1), syn: make(chan peerSyn, 1), done: make(chan struct{})}
	t.Cleanup(func() {
		sock.Close()
		<-e.done
	})
	go e.read()
	return e
}

// peerEvilSocket opens the evil peer's socket: connected to server, or
// listening if server is zero.
func peerEvilSocket(t testing.TB, nw *testNet, server netip.AddrPort) *netsim.Socket {
	t.Helper()
	var s *netsim.Socket
	var err error
	if server.IsValid() {
		s, err = nw.mem.Dial(netip.AddrPort{}, server)
	} else {
		s, err = nw.mem.Listen(netip.AddrPort{})
	}
	require.NoError(t, err)
	return s
}

// peerDialEvil has the evil peer, on sock (connected to the Listener at
// server), complete a handshake, secure if pub is not nil (the Listener's
// public key): ConnectSyn, ConnectSynAck, then the ConnectAck after
// ackDelay. It returns once the ConnectAck went.
func peerDialEvil(t testing.TB, sock *netsim.Socket, server netip.AddrPort, pub []byte, ackDelay time.Duration) *peerEvil {
	t.Helper()
	e := newPeerEvil(t, sock, true)
	content := []byte("evil")
	var sec *secureState
	if pub != nil {
		var err error
		sec, content, err = newClientSecure(pub, nil, content)
		require.NoError(t, err)
	}
	e.mu.Lock()
	e.to, e.sec = server, sec
	e.mu.Unlock()
	syn := appendDatagram(nil, &datagram{msgs: []message{{id: idConnectSyn, payload: content}}})
	syn = appendPadding(syn, synPadTo)
	var synAck []byte
	for try, got := 0, false; !got; try++ {
		require.Less(t, try, 20, "no ConnectSynAck")
		e.writeRaw(syn)
		select {
		case synAck = <-e.synAck:
			got = true
		case <-time.After(200 * time.Millisecond):
		}
	}
	if pub != nil {
		e.mu.Lock()
		_, err := e.sec.readSynAck(synAck)
		e.mu.Unlock()
		require.NoError(t, err)
	}
	e.mu.Lock()
	e.open = true
	synAckPID := e.synAckPID
	e.mu.Unlock()
	time.Sleep(ackDelay)
	msgs := []message{{id: idConnectAck}}
	if pub == nil {
		// The ack of the ConnectSynAck's PacketID: the plaintext
		// server's proof of our address.
		msgs = append(msgs, message{id: idPacketAck, payload: appendPacketAck(nil, packetAck{base: synAckPID})})
	}
	e.send(true, header{}, msgs...)
	return e
}

// peerListenEvil makes the evil peer a server on sock, a listening
// socket; accept answers the ConnectSyn.
func peerListenEvil(t testing.TB, sock *netsim.Socket) *peerEvil {
	return newPeerEvil(t, sock, false)
}

// accept answers the first ConnectSyn with a ConnectSynAck, secure with
// the key pair priv, pub if priv is not nil. It reports what went wrong,
// for goroutines other than the test's.
func (e *peerEvil) accept(priv, pub []byte, d time.Duration) error {
	var s peerSyn
	select {
	case s = <-e.syn:
	case <-time.After(d):
		return errors.New("no ConnectSyn")
	}
	reply := []byte("ok")
	e.mu.Lock()
	e.to = s.from
	if priv != nil {
		_, msg1, ok := splitSecureSyn(s.content)
		if !ok {
			e.mu.Unlock()
			return errors.New("not a secure ConnectSyn")
		}
		sec, err := newServerSecure(priv, pub)
		if err == nil {
			_, err = sec.readSyn(msg1)
		}
		if err == nil {
			sec.cid = 0x5eed0038
			reply, err = sec.writeSynAck(nil)
		}
		if err != nil {
			e.mu.Unlock()
			return err
		}
		e.sec = sec
	}
	e.open = true
	e.mu.Unlock()
	e.writeRaw(appendDatagram(nil, &datagram{msgs: []message{{id: idConnectSynAck, payload: reply}}}))
	return nil
}

// read takes what the victim sends until the socket closes: the handshake
// message awaited, then datagrams, opened if secure.
func (e *peerEvil) read() {
	defer close(e.done)
	buf := make([]byte, 1<<16)
	for {
		n, from, err := e.sock.ReadFrom(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		b := append([]byte(nil), buf[:n]...)
		e.mu.Lock()
		e.inN++
		e.inWire += n + peerUDPOverhead
		if !e.open {
			e.mu.Unlock()
			e.handshakeIn(from, b)
			continue
		}
		pt := b
		if e.sec != nil {
			pt, _ = e.sec.open(b)
		}
		if pt != nil {
			e.note(pt)
		}
		e.mu.Unlock()
	}
}

// handshakeIn takes a clear handshake datagram.
func (e *peerEvil) handshakeIn(from netip.AddrPort, b []byte) {
	if e.client {
		pid, content, ok := handshakeContent(b, idConnectSynAck)
		if !ok && e.sec == nil {
			// A plaintext server's comes in a reliable datagram, whose
			// ack proves our address (plainproof, merged meanwhile).
			var d datagram
			if parseInto(b, &d) == nil && d.reliable && len(d.msgs) > 0 && !d.msgs[0].fragment && d.msgs[0].id == idConnectSynAck {
				pid, content, ok = d.packetID, d.msgs[0].payload, true
			}
		}
		if ok {
			e.mu.Lock()
			e.synAckPID = pid
			e.mu.Unlock()
			select {
			case e.synAck <- append([]byte(nil), content...):
			default:
			}
		}
		return
	}
	if _, content, ok := handshakeContent(b, idConnectSyn); ok {
		select {
		case e.syn <- peerSyn{from, append([]byte(nil), content...)}:
		default:
		}
	}
}

// note records a datagram of the victim's, in plaintext; e.mu is held.
func (e *peerEvil) note(b []byte) {
	var d datagram
	if parseInto(b, &d) != nil {
		return
	}
	pid := d.header.packetID
	if !e.seen || seqLess(e.newest, pid) {
		e.newest, e.seen = pid, true
	}
	if d.header.reliable {
		e.got = append(e.got, pid)
	}
}

// newestSeen returns the newest PacketID the victim sent us.
func (e *peerEvil) newestSeen() (uint32, bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.newest, e.seen
}

// writeRaw sends b as it is.
func (e *peerEvil) writeRaw(b []byte) {
	e.mu.Lock()
	to := e.to
	e.outN++
	e.out += len(b) + peerUDPOverhead
	e.mu.Unlock()
	e.sock.WriteTo(b, to)
}

// send sends msgs in a datagram with header h under our next PacketID,
// sealed in a secure session, and returns its PacketID.
func (e *peerEvil) send(reliable bool, h header, msgs ...message) uint32 {
	e.mu.Lock()
	pid := e.next
	e.next = (e.next + 1) & packetIDMask
	e.mu.Unlock()
	e.sendAs(pid, reliable, h, msgs...)
	return pid
}

// sendAs is send under PacketID pid, which must be above every one sent
// before in a secure session (it is the packet number).
func (e *peerEvil) sendAs(pid uint32, reliable bool, h header, msgs ...message) {
	h.packetID, h.reliable = pid, reliable
	b := appendDatagram(nil, &datagram{header: h, msgs: msgs})
	e.mu.Lock()
	if e.sec != nil {
		var err error
		if b, err = e.sec.seal(nil, b, uint64(pid), true); err != nil {
			e.mu.Unlock()
			e.t.Errorf("seal: %v", err)
			return
		}
	}
	if seqLess(e.next, pid) || e.next == pid {
		e.next = (pid + 1) & packetIDMask
	}
	to := e.to
	e.outN++
	e.out += len(b) + peerUDPOverhead
	e.mu.Unlock()
	e.sock.WriteTo(b, to)
}

// skip reserves n PacketIDs, never sent, and returns the first.
func (e *peerEvil) skip(n uint32) uint32 {
	e.mu.Lock()
	defer e.mu.Unlock()
	first := e.next
	e.next = (e.next + n) & packetIDMask
	return first
}

// traffic returns the bytes (on the wire) and datagrams each way so far.
func (e *peerEvil) traffic() (in, inN, out, outN int) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.inWire, e.inN, e.out, e.outN
}

// peerAckMsgs returns PacketAcks naming every PacketID from first to last.
func peerAckMsgs(first, last uint32) []message {
	var msgs []message
	for base := first; !seqLess(last, base); base = (base + packetAckSpan) & packetIDMask {
		more := uint64(1)<<packetAckBits - 1
		if d := seqDiff(base, last); d < packetAckBits {
			more = uint64(1)<<uint(d) - 1
		}
		msgs = append(msgs, message{id: idPacketAck, payload: appendPacketAck(nil, packetAck{base: base, more: more})})
	}
	return msgs
}

// ackOptimistic acks every PacketID from back before the newest the
// victim sent us to ahead after it, received or not, and the reliable
// datagrams received outside that range (resends of old PacketIDs).
func (e *peerEvil) ackOptimistic(back, ahead uint32) {
	e.mu.Lock()
	newest, ok, got := e.newest, e.seen, e.got
	e.got = nil
	e.mu.Unlock()
	if !ok {
		return
	}
	first := uint32(1)
	if newest > back {
		first = newest - back
	}
	last := (newest + ahead) & packetIDMask
	msgs := peerAckMsgs(first, last)
	var extra []uint32
	for _, id := range got {
		if seqLess(id, first) || seqLess(last, id) {
			extra = append(extra, id)
		}
	}
	msgs = append(msgs, peerAckList(extra)...)
	e.sendAcks(msgs)
}

// ackHonest acks exactly the reliable datagrams received since the last
// call.
func (e *peerEvil) ackHonest() {
	e.mu.Lock()
	ids := e.got
	e.got = nil
	e.mu.Unlock()
	e.sendAcks(peerAckList(ids))
}

// peerAckList returns PacketAcks naming exactly ids.
func peerAckList(ids []uint32) []message {
	if len(ids) == 0 {
		return nil
	}
	sortSerial(ids)
	acks, _ := packAcks(nil, ids, len(ids), packetAckBits)
	msgs := make([]message, len(acks))
	for i, a := range acks {
		msgs[i] = message{id: idPacketAck, payload: appendPacketAck(nil, a)}
	}
	return msgs
}

// peerAcksPerDatagram is how many PacketAcks (10 bytes each) the evil
// peer puts in one datagram: within the default MaxDatagramSize.
const peerAcksPerDatagram = 120

// sendAcks sends PacketAck messages, unreliable, as many per datagram as
// fit.
func (e *peerEvil) sendAcks(msgs []message) {
	for len(msgs) > 0 {
		n := min(len(msgs), peerAcksPerDatagram)
		e.send(false, header{}, msgs[:n]...)
		msgs = msgs[n:]
	}
}

// peerDownload has c send reliable messages, each filling a datagram, as
// fast as it may until stop is called: a large download.
func peerDownload(c *Conn) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		p := make([]byte, c.MaxUnreliablePayload())
		for ctx.Err() == nil {
			if err := c.SendContext(ctx, Message{ID: 6, Payload: p, Reliable: true}); err != nil && !errors.Is(err, context.Canceled) {
				return
			}
		}
	}()
	return func() {
		cancel()
		<-done
	}
}

// peerProtocolError reports whether c ended with a *ProtocolError.
func peerProtocolError(c *Conn) bool {
	if !isDone(c) {
		return false
	}
	var pe *ProtocolError
	return errors.As(c.Err(), &pe)
}

// peerSecureMode names the session kinds the attacks run in.
type peerSecureMode struct {
	name   string
	secure bool
}

var peerModes = []peerSecureMode{{"plaintext", false}, {"secure", true}}

// peerKeys returns a key pair for a secure mode, nils otherwise.
func peerKeys(t testing.TB, secure bool) (priv, pub []byte) {
	if !secure {
		return nil, nil
	}
	priv, pub, err := GenerateKey()
	require.NoError(t, err)
	return priv, pub
}

// Costly datagrams (issue 38, finding 3): a server session driven directly,
// one shape of datagram after another, its CPU per byte measured.

// peerSinkHost is a receive queue nobody reads but the bench, between
// batches: deliveries cost what a Conn's cost (recvQueue.push under its
// lock, once for the messages a datagram hands over together), and the
// queue never fills.
type peerSinkHost struct {
	mu sync.Mutex
	q  recvQueue
}

func (h *peerSinkHost) deliver(ds []delivery) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.q.compact()
	for i := range ds {
		d := &ds[i]
		if d.buf != nil {
			h.q.pushOwned(d.id, d.payload, d.buf, d.reliable, d.inOrder)
		} else {
			h.q.add(d.id, d.payload, d.reliable, d.inOrder)
		}
		d.taken = true
	}
	h.q.peaks()
}

func (h *peerSinkHost) recvUsed() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.q.charged()
}

func (h *peerSinkHost) sendDone(int)    {}
func (h *peerSinkHost) receipt(Receipt) {}
func (h *peerSinkHost) drain() {
	h.mu.Lock()
	defer h.mu.Unlock()
	for h.q.len() > 0 {
		h.q.pop()
	}
}

// peerShape is a kind of datagram a peer sends: next builds the next one
// from the peer's next PacketID (and moves it on); setup readies the
// server session first; settle is how long after a batch the session's
// timers run (held messages given up on), part of what is measured.
type peerShape struct {
	name   string
	setup  func(b *peerBench)
	next   func(g *peerGen) []byte
	settle time.Duration
}

// peerGen is what a shape's datagrams are built from: the peer's next
// PacketID, how many were built, and the PacketID the server sends next
// (what acks ahead of what was sent start from).
type peerGen struct {
	pid   uint32
	n     uint32
	ahead func() uint32
}

// peerBench is a server session, connected, taking one shape of datagram.
// In a secure pair, the peer seals what it sends with the client's keys
// and the server's secure layer opens it, as a Conn's does (takeSecure).
type peerBench struct {
	t      testing.TB
	shape  peerShape
	p      *simPair
	srv    *session
	secure bool
	host   *peerSinkHost
	now    time.Time
	gen    peerGen
	batch  [][]byte
	size   int // bytes of the datagrams of the last batch
	buf    []byte
	spare  []byte
}

// newPeerBench connects a pair of sessions, secure or not, and takes the
// server's.
func newPeerBench(t testing.TB, sh peerShape, secure bool) *peerBench {
	var p *simPair
	if secure {
		p = newSecureSimPair(t, nil, nil, perfect, perfect)
	} else {
		p = newSimPair(t, nil, nil, perfect, perfect)
	}
	p.connect()
	p.run(100*time.Millisecond, nil)
	if secure {
		// The pair's nonce ledger hashes every datagram sealed: not
		// what a connection does.
		p.sec[0].tap, p.sec[1].tap = nil, nil
	}
	b := &peerBench{t: t, shape: sh, p: p, srv: p.server(), secure: secure, host: new(peerSinkHost), now: p.now,
		buf: make([]byte, 0, 65536), spare: make([]byte, 0, 65536+wireOverhead)}
	b.gen = peerGen{pid: p.client().send.nextPID, ahead: func() uint32 { return b.srv.send.nextPID }}
	b.srv.host = b.host
	if sh.setup != nil {
		sh.setup(b)
	}
	b.tidy()
	return b
}

// prepare builds the next n datagrams, sealed in a secure pair.
func (b *peerBench) prepare(n int) {
	b.batch = b.batch[:0]
	b.size = 0
	for range n {
		d := b.shape.next(&b.gen)
		b.gen.n++
		if b.secure {
			var h header
			_, err := parseHeader(d, &h)
			require.NoError(b.t, err)
			d, err = b.p.sec[0].seal(nil, d, uint64(h.packetID), true)
			require.NoError(b.t, err)
		}
		b.batch = append(b.batch, d)
		b.size += len(d)
	}
}

// peerBenchStep is the time between two datagrams of the peer's: a
// thousand a second. (All at one instant, each ack datagram repeats all
// the acks sent before it, ackRepeatWindow: the honest datagram's cost
// was mostly that.)
const peerBenchStep = time.Millisecond

// handle has the server take the batch prepared, each datagram a round of
// its own as a connection's round takes it, peerBenchStep apart: the
// timers due run, the datagram is opened if secure and handled, and what
// it calls for is sent (acks, sealed if secure); the timers run again
// settle after the last (held messages given up on).
func (b *peerBench) handle() {
	for _, d := range b.batch {
		b.now = b.now.Add(peerBenchStep)
		if !b.srv.nextDeadline(b.now).After(b.now) {
			b.srv.advance(b.now)
		}
		b.srv.beginRound()
		if b.secure {
			if pt, fresh := b.p.sec[1].in(b.srv, b.now, d, true); pt != nil {
				b.srv.handleSealed(b.now, pt, fresh)
			}
		} else {
			b.srv.handleDatagram(b.now, d)
		}
		b.flush()
	}
	if b.shape.settle > 0 {
		b.now = b.now.Add(b.shape.settle)
		b.srv.advance(b.now)
		b.flush()
	}
}

// flush sends what the server has to send, sealed if secure.
func (b *peerBench) flush() {
	for range 1 << 16 {
		d := b.srv.poll(b.now, b.buf)
		if d == nil {
			return
		}
		if b.secure {
			if _, err := b.p.sec[1].sealOut(b.srv, d, b.spare); err != nil {
				b.t.Fatal(err)
			}
		}
	}
}

// tidy does what the application does between rounds, unmeasured: reads
// what was delivered.
func (b *peerBench) tidy() {
	b.flush()
	b.srv.takeEvents()
	b.host.drain()
}

// perByte times one batch of n datagrams and returns the CPU per byte, in
// nanoseconds: the thread's CPU time (threadCPU), not the wall clock, which
// on a machine the tests share counts whatever else ran meanwhile (the
// ratios of one shape varied 25-170x from run to run).
func (b *peerBench) perByte(n int) float64 {
	b.prepare(n)
	return timedPerByte(b.handle, b.tidy, b.size)
}

// timedPerByte runs handle, a batch of size bytes prepared beforehand, and
// returns the thread's CPU time for it per byte, in nanoseconds; tidy
// runs after, untimed.
func timedPerByte(handle, tidy func(), size int) float64 {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	t0 := threadCPU()
	handle()
	d := threadCPU() - t0
	tidy()
	return float64(d) / float64(size)
}

// peerHonestPayload fills a 1200-byte reliable datagram.
const peerHonestPayload = 1200 - minHeaderSize - 2 - 1

// peerShapes are the datagrams of finding 3, honest first.
func peerShapes() []peerShape {
	payload := make([]byte, peerHonestPayload)
	// 255 entries naming messages 0-254 of the datagram before, never
	// sent; two unreliable messages naming all of them.
	deltas, indices, multi := make([]uint16, maxDeps), make([]uint16, maxDeps), make([]byte, maxDeps)
	for i := range multi {
		indices[i], multi[i] = uint16(i), byte(i)
	}
	empties := make([]message, 465)
	for i := range empties {
		empties[i] = message{id: 6}
	}
	return []peerShape{
		{name: "honest", next: func(g *peerGen) []byte {
			g.pid++
			return appendDatagram(nil, &datagram{header: header{packetID: g.pid - 1, reliable: true}, msgs: []message{{id: 6, payload: payload}}})
		}},
		{name: "inOrder255", settle: 300 * time.Millisecond, next: func(g *peerGen) []byte {
			g.pid += 2 // the one before is never sent
			h := header{packetID: g.pid - 1, inOrder: true, deltas: deltas, indices: indices}
			m := message{id: 6, order: orderMulti, orderMulti: multi}
			return appendDatagram(nil, &datagram{header: h, msgs: []message{m, m}})
		}},
		{name: "acksAhead", setup: peerInFlight(3000), next: func(g *peerGen) []byte {
			g.pid++
			ahead := g.ahead()
			msgs := make([]message, 139)
			for i := range msgs {
				a := packetAck{base: (ahead + uint32(i)*packetAckSpan) & packetIDMask, more: 1<<packetAckBits - 1}
				msgs[i] = message{id: idPacketAck, payload: appendPacketAck(nil, a)}
			}
			return appendDatagram(nil, &datagram{header: header{packetID: g.pid - 1}, msgs: msgs})
		}},
		{name: "emptyFragments", next: func(g *peerGen) []byte {
			g.pid++
			const count = 260
			tid := uint8(g.n % 200)
			msgs := make([]message, count)
			// The first carries a byte: a transfer of nothing at all
			// never completes (reassembly returns its nil arena).
			msgs[0] = message{fragStart: true, fragment: true, id: 6, fragCount: count, transferID: tid, payload: []byte{0}}
			for i := 1; i < count; i++ {
				msgs[i] = message{fragment: true, transferID: tid, fragNumber: uint32(i)}
			}
			return appendDatagram(nil, &datagram{header: header{packetID: g.pid - 1, reliable: true}, msgs: msgs})
		}},
		{name: "emptyMessages", next: func(g *peerGen) []byte {
			g.pid++
			return appendDatagram(nil, &datagram{header: header{packetID: g.pid - 1, reliable: true}, msgs: empties})
		}},
	}
}

// peerInFlight puts n reliable datagrams of the server's in flight, none
// of which the peer acks.
func peerInFlight(n int) func(b *peerBench) {
	return func(b *peerBench) {
		s := b.srv
		for range n {
			d := appendDatagram(make([]byte, 0, 1200), &datagram{header: header{packetID: s.send.nextPID, reliable: true}, msgs: []message{{id: 6, payload: make([]byte, 1100)}}})
			s.sentReliable(b.now, s.send.nextPID, d, &packing{})
			if b.secure {
				_, err := b.p.sec[1].sealOut(s, d, b.spare) // resends must have been sealed once
				require.NoError(b.t, err)
			}
		}
		require.Equal(b.t, n, s.loss.sent.count)
	}
}

// sendBuilt sends d, a datagram built whole (its PacketID set), sealed in
// a secure session; our next PacketID moves past it.
func (e *peerEvil) sendBuilt(d []byte) {
	var h header
	if _, err := parseHeader(d, &h); err != nil {
		e.t.Errorf("sendBuilt: %v", err)
		return
	}
	e.mu.Lock()
	if e.sec != nil {
		var err error
		if d, err = e.sec.seal(nil, d, uint64(h.packetID), true); err != nil {
			e.mu.Unlock()
			e.t.Errorf("seal: %v", err)
			return
		}
	}
	if !seqLess(h.packetID, e.next) {
		e.next = (h.packetID + 1) & packetIDMask
	}
	to := e.to
	e.outN++
	e.out += len(d) + peerUDPOverhead
	e.mu.Unlock()
	e.sock.WriteTo(d, to)
}

// peerMatrix is a Listener with two connections: the evil peer's, whose
// server side is the victim, and an honest client's, served an echo; each
// has a path of its own (the evil peer's down capped at 1 Mbit/s).
type peerMatrix struct {
	*peerVictim
	honest *Conn
}

// newPeerMatrix sets up the Listener, the honest client and the evil peer.
func newPeerMatrix(t *testing.T, nw *testNet, secure bool) *peerMatrix {
	t.Helper()
	priv, pub := peerKeys(t, secure)
	l := nw.listen(t, &Config{PrivateKey: priv, DisconnectTimeout: 200 * time.Millisecond})
	server := addrOf(l.Addr())
	sock := peerEvilSocket(t, nw, server)
	evilAddr := sock.Addr()
	// The honest client's path, and anyone's but the evil peer's.
	honestPath := netsim.Params{Delay: peerPathDelay}
	nw.mem.SetLink(server, netip.AddrPort{}, &honestPath)
	nw.mem.SetLink(netip.AddrPort{}, server, &honestPath)
	m := &peerMatrix{peerVictim: &peerVictim{l: l}}
	m.toEvil, _ = peerPaths(nw, server, evilAddr, netsim.Params{Delay: peerPathDelay, Bandwidth: peerPathRate}, netsim.Params{Delay: peerPathDelay})
	victims := make(chan *Conn, 1)
	go func() {
		for {
			c, err := l.AcceptConn(context.Background())
			if err != nil {
				return
			}
			if addrOf(c.RemoteAddr()) == evilAddr {
				victims <- c
				continue
			}
			go func() {
				for {
					msg, err := c.Receive(context.Background())
					if err != nil || c.Send(msg) != nil {
						return
					}
				}
			}()
		}
	}()
	m.honest = nw.dial(t, l.Addr().String(), &Config{ServerKey: pub, DisconnectTimeout: 200 * time.Millisecond})
	echoThrough(t, m.honest, "before", time.Second)
	m.e = peerDialEvil(t, sock, server, pub, 0)
	select {
	case m.c = <-victims:
	case <-time.After(5 * time.Second):
		t.Fatal("the evil peer's connection was not accepted")
	}
	return m
}

// peerEcho is an echo of the honest client's during an attack.
type peerEcho struct {
	took time.Duration
	err  error
}

// echoing has the honest client echo a message every 100ms until the
// function returned is called, which returns what each took.
func (m *peerMatrix) echoing() func() []peerEcho {
	stop, done := make(chan struct{}), make(chan []peerEcho)
	go func() {
		var es []peerEcho
		defer func() { done <- es }()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-time.After(100 * time.Millisecond):
			}
			es = append(es, peerEchoOnce(m.honest, fmt.Sprintf("during %d", i)))
		}
	}()
	return func() []peerEcho {
		close(stop)
		return <-done
	}
}

// peerEchoOnce sends a reliable message and waits up to a second for its
// echo.
func peerEchoOnce(c *Conn, tag string) peerEcho {
	t0 := time.Now()
	p := []byte("ECHO:" + tag)
	if err := c.Send(Message{ID: 7, Payload: p, Reliable: true}); err != nil {
		return peerEcho{err: err}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	for {
		msg, err := c.Receive(ctx)
		if err != nil {
			return peerEcho{took: time.Since(t0), err: err}
		}
		if string(msg.Payload) == string(p) {
			return peerEcho{took: time.Since(t0)}
		}
	}
}
