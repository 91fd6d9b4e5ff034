package knet

import (
	"errors"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/knet-go/knet/internal/netsim"
	"github.com/knet-go/knet/internal/udp"
)

// packet is a datagram read from the socket, in a pooled buffer.
type packet struct {
	buf  []byte
	b    []byte
	from netip.AddrPort // the sender
}

// endpoint is one socket and the goroutine that reads it, shared by a
// Listener's connections or owned by one dialed connection.
type endpoint struct {
	sock      socket
	connected bool // a dialed socket: writes go to its peer
	l         *Listener
	cfg       *config
	pool      *sync.Pool
	small     *sync.Pool   // smallPacketSize buffers, when pool's are larger
	sim       *netsim.Pipe // Config.Simulate, if set

	// When its connections park (Conn.park), and who hears of it.
	parkAfter time.Duration
	parkHook  func(*Conn)
	// roundHook, if set, runs after each pass of a connection's round
	// has put its datagrams in the batch (tests stall a round with it).
	roundHook func(*Conn)

	sched scheduler // runs the connections' rounds (sched.go)

	mu     sync.Mutex
	conns  map[netip.AddrPort]*Conn
	rd     cppDatagram // the reader's, for stray reference datagrams
	runBuf []*packet   // the reader's, for dispatch
	ready  []*Conn     // the reader's: connections dispatch gave datagrams

	// repunch is a dialed joiner's re-punching (repunch.go), if armed.
	repunch atomic.Pointer[joinRepunch]

	readerDone chan struct{}
	closeOnce  sync.Once
	// release, for a socket a Listener adopted (birthday.go), hears of
	// each connection's end there, and closes the socket once an
	// established one ended and none is left.
	release func(c *Conn)

	// A dialed connection's relay, if it dialed through one (relay.go):
	// on the endpoint, which is the connection's own, to keep Conn small.
	relay atomic.Pointer[relayRoute]

	// Atomic.
	invalid atomic.Uint64 // malformed datagrams from unknown endpoints
	stray   atomic.Uint64 // datagrams for no connection
	ignored atomic.Uint64 // connection attempts ignored: too many pending, or closed
	refused atomic.Uint64 // connection attempts refused
	// Admit replies too long for a ConnectSynAck
	oversized atomic.Uint64
	// Datagrams the system refused to send, outside a connection's own
	// batches: refusals, and what left a simulated network.
	sendErrs atomic.Uint64
	// Writes to the socket, and the datagrams they carried.
	writes, written atomic.Uint64
}

// endpointOptions are what tests set on the endpoints that Listen and
// Dial make (listenWith, dialWith): where their sockets come from, and
// when their connections park. The zero value is what Listen and Dial
// use: the system's UDP sockets, and a second.
type endpointOptions struct {
	// listen opens a listener's socket at laddr (reuse: one of several
	// sharing it, Config.Sockets), dial a dialed connection's socket,
	// connected to raddr. Nil: the system's.
	listen func(network string, laddr *net.UDPAddr, reuse bool) (socket, error)
	dial   func(network string, raddr *net.UDPAddr) (socket, error)
	// parkAfter is how long a connection is idle (nothing done) before
	// it counts as parked (Conn.park), and how long the endpoint's idle
	// workers wait for work before they end (sched.go). Zero:
	// defaultParkAfter.
	parkAfter time.Duration
	// parkHook, if set, hears of each connection's parking.
	parkHook func(*Conn)
	// roundHook, if set, runs after each pass of a round (endpoint).
	roundHook func(*Conn)
}

// defaultParkAfter is endpointOptions.parkAfter's default.
const defaultParkAfter = time.Second

func (o *endpointOptions) listenSocket(network string, laddr *net.UDPAddr, reuse bool) (socket, error) {
	if o.listen != nil {
		return o.listen(network, laddr, reuse)
	}
	var pc *net.UDPConn
	var err error
	if reuse {
		pc, err = listenReusePort(network, laddr)
	} else {
		pc, err = net.ListenUDP(network, laddr)
	}
	if err != nil {
		return nil, err
	}
	return newUDPSocket(pc, false), nil
}

func (o *endpointOptions) dialSocket(network string, raddr *net.UDPAddr) (socket, error) {
	if o.dial != nil {
		return o.dial(network, raddr)
	}
	pc, err := net.DialUDP(network, nil, raddr)
	if err != nil {
		return nil, err
	}
	return newUDPSocket(pc, true), nil
}

func newEndpoint(sock socket, connected bool, cfg *config, o *endpointOptions) *endpoint {
	ep := &endpoint{
		sock:       sock,
		connected:  connected,
		cfg:        cfg,
		parkAfter:  o.parkAfter,
		parkHook:   o.parkHook,
		roundHook:  o.roundHook,
		conns:      make(map[netip.AddrPort]*Conn),
		readerDone: make(chan struct{}),
	}
	if ep.parkAfter <= 0 {
		ep.parkAfter = defaultParkAfter
	}
	ep.sched.init(ep, workersFor(!connected))
	ep.pool = packetPool(max(cfg.readSize(), 2048) + 1)
	if cfg.readSize()+1 > smallPacketSize {
		ep.small = packetPool(smallPacketSize)
	}
	return ep
}

// smallPacketSize is the read buffer of an endpoint with the default
// sizes. An endpoint reading larger datagrams (MaxPathDatagramSize)
// moves a datagram that fits one into one before queuing it (dispatch):
// a connection's inbox may hold maxInbox datagrams, and a peer sending
// small ones must not make each pin a buffer of 64 KiB.
const smallPacketSize = 2048 + 1

// Packet buffers are pooled across endpoints by size: a pool per dialed
// connection would keep its buffers for two garbage collections after the
// connection is gone.
var (
	poolsMu sync.Mutex
	pools   = map[int]*sync.Pool{}
)

func packetPool(size int) *sync.Pool {
	poolsMu.Lock()
	defer poolsMu.Unlock()
	p := pools[size]
	if p == nil {
		p = &sync.Pool{New: func() any { return &packet{buf: make([]byte, size)} }}
		pools[size] = p
	}
	return p
}

// simulate puts the Config's simulated network on the send path. The seed
// is salted with the side, so that a Config shared by a client and a
// server still gives the two directions different (and replayable) fates.
func (ep *endpoint) simulate(salt uint64) {
	if ep.cfg.simulate == nil {
		return
	}
	p := ep.cfg.simulate.params()
	p.Seed = p.Seed*0x9e3779b97f4a7c15 + salt
	ep.sim = netsim.NewPipe(netsim.NewLink(p), ep.writeNow)
}

func (ep *endpoint) getPacket() *packet { return ep.pool.Get().(*packet) }

func (ep *endpoint) putPacket(p *packet) {
	p.b = nil
	if ep.small != nil && len(p.buf) == smallPacketSize {
		ep.small.Put(p)
		return
	}
	ep.pool.Put(p)
}

// shrink returns p, holding a datagram of n bytes, or, if n fits a small
// buffer and p's is larger, a small packet holding a copy of it (p goes
// back to the pool).
func (ep *endpoint) shrink(p *packet, n int) *packet {
	if ep.small == nil || n >= smallPacketSize || len(p.buf) == smallPacketSize {
		return p
	}
	q := ep.small.Get().(*packet)
	copy(q.buf, p.buf[:n])
	ep.putPacket(p)
	return q
}

// unmap makes IPv4 addresses read from dual-stack sockets match the same
// addresses read from IPv4 ones.
func unmap(a netip.AddrPort) netip.AddrPort {
	return netip.AddrPortFrom(a.Addr().Unmap(), a.Port())
}

// writeBatch sends datagrams, across the simulated network if there is one.
// It returns the first error the system gave, each packet's Err saying
// which did not go; with a simulated network, a datagram has gone once it
// is in it (errors of its delivery are the endpoint's, see writeNow).
func (ep *endpoint) writeBatch(w *writeBatch, ps []udp.Packet) error {
	if ep.sim != nil {
		for _, p := range ps {
			ep.sim.Send(p.Buf, p.Addr)
		}
		return nil
	}
	ep.writes.Add(1)
	ep.written.Add(uint64(len(ps)))
	if len(ps) == 1 {
		return ep.sock.WriteBatch(nil, ps) // no batch state
	}
	if w.w == nil || w.w.Size() < len(ps) {
		w.w = udp.NewWriterSize(len(w.ps))
	}
	return ep.sock.WriteBatch(w.w, ps)
}

// write sends one datagram.
func (ep *endpoint) write(b []byte, to netip.AddrPort) {
	if ep.sim != nil {
		ep.sim.Send(b, to)
		return
	}
	ep.writeNow(b, to)
}

// writeNow sends one datagram, counting a failure as the endpoint's.
func (ep *endpoint) writeNow(b []byte, to netip.AddrPort) {
	ep.writes.Add(1)
	ep.written.Add(1)
	if err := ep.sock.WriteTo(b, to); err != nil {
		ep.sendErrs.Add(1)
		if isRefusal(err) {
			ep.reportRefusal()
		}
	}
}

// reportRefusal passes on the system's report that nothing listens at the
// peer's port to the connection of a dialed socket (only a connected
// socket gets such reports).
func (ep *endpoint) reportRefusal() {
	if !ep.connected {
		return
	}
	ep.mu.Lock()
	for _, c := range ep.conns {
		c.refusal()
	}
	ep.mu.Unlock()
}

// writeBatch is what a driver (sched.go) needs to send a batch: pooled,
// since few goroutines send at any one moment. It starts small
// and grows as flushes need: a busy server has many connections flushing
// at once, most of them a datagram or two, and a batch made whole (64
// buffers of MaxDatagramSize and the system call's state, about 100 KiB)
// for each of them cost more than all their sessions.
type writeBatch struct {
	w    *udp.Writer  // as long as ps, made for the first batch of several datagrams
	ps   []udp.Packet // firstBatch long, then doubling to udp.MaxBatch
	bufs [][]byte     // for datagrams built on the spot, each made when first used
	size int
	used int // entries of ps that may hold references
}

// firstBatch is how many datagrams a new batch holds.
const firstBatch = 4

// writeBatches holds a pool of batches for each buffer size in use: one as
// a rule, a few when connections differ (a secure client's datagrams
// leave room for the connection ID, a server's do not; MaxDatagramSize
// may differ between Configs). One pool for all sizes would drop and
// remake a batch whenever two sizes took turns.
var writeBatches sync.Map // int -> *sync.Pool

func getWriteBatch(size int) *writeBatch {
	if p, ok := writeBatches.Load(size); ok {
		if w, ok := p.(*sync.Pool).Get().(*writeBatch); ok {
			return w
		}
	}
	return &writeBatch{size: size, ps: make([]udp.Packet, firstBatch), bufs: make([][]byte, firstBatch)}
}

// buf returns the n-th buffer, empty.
func (w *writeBatch) buf(n int) []byte {
	if w.bufs[n] == nil {
		w.bufs[n] = make([]byte, 0, w.size)
	}
	return w.bufs[n][:0]
}

// grow doubles the batch, up to udp.MaxBatch; it reports false at that
// size. What the batch holds stays.
func (w *writeBatch) grow() bool {
	n := len(w.ps)
	if n >= udp.MaxBatch {
		return false
	}
	n = min(2*n, udp.MaxBatch)
	w.ps = append(w.ps, make([]udp.Packet, n-len(w.ps))...)
	w.bufs = append(w.bufs, make([][]byte, n-len(w.bufs))...)
	return true
}

func putWriteBatch(w *writeBatch) {
	clear(w.ps[:w.used])
	w.used = 0
	p, ok := writeBatches.Load(w.size)
	if !ok {
		p, _ = writeBatches.LoadOrStore(w.size, new(sync.Pool))
	}
	p.(*sync.Pool).Put(w)
}

// readLoop reads the socket, a batch at a time, and hands each datagram to
// its connection, never waiting on one.
func (ep *endpoint) readLoop() {
	defer close(ep.readerDone)
	batch := 16 // a dialed connection: each buffer held is 2 KB
	if ep.l != nil {
		batch = udp.MaxBatch
	}
	ps := make([]udp.Packet, batch)
	pkts := make([]*packet, batch)
	defer func() {
		for _, p := range pkts {
			if p != nil {
				ep.putPacket(p)
			}
		}
	}()
	d := newDriver(ep)
	defer d.close()
	fails, held := 0, 0
	for {
		// Buffers only for what the read may fill: one, unless a
		// backlog has the reader taking batches.
		want := ep.sock.ReadWant(batch)
		for i := want; i < held; i++ {
			if pkts[i] != nil {
				ep.putPacket(pkts[i])
				pkts[i] = nil
			}
		}
		held = want
		for i := range want {
			if pkts[i] == nil {
				pkts[i] = ep.getPacket()
			}
			ps[i].Buf = pkts[i].buf
		}
		n, err := ep.sock.ReadBatch(ps[:want])
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// ICMP errors surface here on a dialed socket: the
			// connection decides what a port unreachable means. Keep
			// reading, but do not spin on a socket that keeps failing.
			if isRefusal(err) {
				ep.reportRefusal()
			}
			if fails++; fails > 8 {
				time.Sleep(time.Millisecond)
			}
			continue
		}
		fails = 0
		ep.dispatch(ps[:n], pkts[:n])
		ep.runReady(d, want == 1)
	}
}

// runReady gives the connections that dispatch handed datagrams their
// round: here, with no hand-off, if inline and no one else has the
// connection, and otherwise by their endpoint's workers. The reader
// takes them inline when it reads a datagram at a time (no backlog):
// then the round costs less than waking a worker for it, and its answer
// leaves at once. Under a backlog the reader keeps reading and the
// workers run the rounds, on the other processors.
func (ep *endpoint) runReady(d *driver, inline bool) {
	for i, c := range ep.ready {
		ep.ready[i] = nil
		// A handshake's work (an Admit decision, a key exchange) stays
		// off the reader.
		if inline && c.isEstablished() && c.claim() {
			d.run(c)
		} else {
			c.kick()
		}
	}
	ep.ready = ep.ready[:0]
	d.write()
}

// dispatch hands a batch of datagrams to their connections, consecutive
// ones for the same connection together.
func (ep *endpoint) dispatch(ps []udp.Packet, pkts []*packet) {
	var run []*packet
	var runConn *Conn
	flush := func() {
		if runConn != nil && len(run) > 0 && runConn.pushRun(run) {
			if n := len(ep.ready); n == 0 || ep.ready[n-1] != runConn {
				ep.ready = append(ep.ready, runConn)
			}
		}
		run = run[:0]
	}
	ep.mu.Lock()
	defer ep.mu.Unlock()
	run = ep.runBuf[:0]
	for i := range ps {
		p := pkts[i]
		pkts[i] = nil
		if ps[i].Trunc || ps[i].N >= len(p.buf) {
			// Larger than any datagram we accept: cut short.
			ep.invalid.Add(1)
			ep.putPacket(p)
			continue
		}
		p = ep.shrink(p, ps[i].N)
		p.b = p.buf[:ps[i].N]
		addr := unmap(ps[i].Addr)
		p.from = addr
		if rp := ep.repunch.Load(); rp != nil && rp.take(addr, p.b) {
			ep.putPacket(p) // a re-punch's (repunch.go)
			continue
		}
		c := ep.conns[addr]
		if c != runConn {
			flush()
			runConn = c
		}
		switch {
		case c != nil && c.sec != nil && ep.l != nil && !c.isEstablished():
			// A secure attempt still being made holds this address, but
			// it may be an attacker's (a ConnectSyn sent from a client's
			// new address before the client moved there): a sealed
			// datagram naming another connection goes to that one.
			flush()
			ep.mu.Unlock()
			routed := ep.l.routeByID(p, c)
			ep.mu.Lock()
			if routed {
				runConn = nil
				continue
			}
			run = append(run, p)
		case c != nil:
			run = append(run, p)
		case ep.l != nil:
			ep.mu.Unlock()
			// A server query (query.go), a secure connection's client
			// that moved, or a new one.
			if !ep.l.answerQuery(ep, addr, p) && !ep.l.routeByID(p, nil) {
				ep.l.handleNew(ep, addr, p)
			}
			ep.mu.Lock()
			runConn = nil
		case ep.directAnswer(addr, p.b):
			// The host's answer to a relayed connection's probe (relay.go).
			ep.putPacket(p)
		default:
			// A dialed socket outliving its connection (connDone):
			// the peer may still wait for our DisconnectAck.
			ep.stray.Add(1)
			ep.answerDisconnect(addr, p.b)
			ep.putPacket(p)
		}
	}
	flush()
	ep.runBuf = run[:0]
}

// remove forgets c's address, and the relay's it left (relay.go).
func (ep *endpoint) remove(c *Conn) {
	ep.mu.Lock()
	if ep.conns[c.raddr] == c {
		delete(ep.conns, c.raddr)
	}
	if r := ep.relay.Load(); r != nil && ep.conns[r.via] == c {
		delete(ep.conns, r.via)
	}
	ep.mu.Unlock()
	if ep.l != nil {
		ep.l.endAttempt(c, c.sess.err, c.sess.closing.refuseReason) // no longer pending, whatever became of it
		ep.l.dropCID(c)
	}
}

// connDone is called as a connection ends (Conn.end). A dialed socket
// goes with its connection, but if the connection ended by answering the
// peer's Disconnect, only after a moment in which it answers the peer's
// resent Disconnects (dispatch): the DisconnectAck may have been lost, and
// the peer would otherwise wait out its DisconnectTimeout.
func (ep *endpoint) connDone(c *Conn) {
	if ep.l != nil {
		if ep.release != nil {
			ep.release(c)
		}
		return
	}
	if d := c.sess.socketLinger(time.Now()); d > 0 {
		time.Sleep(d)
	}
	ep.close()
}

// close closes the socket and waits for the reader to stop.
func (ep *endpoint) close() {
	ep.closeOnce.Do(func() {
		if ep.sim != nil {
			// What is in flight still lands, as on a real network: a
			// last DisconnectAck, say.
			ep.sim.Drain(ep.cfg.disconnect)
			ep.sim.Close()
		}
		ep.sock.Close()
		<-ep.readerDone
		ep.sched.stop()
	})
}

// disconnectAnswer returns, built in buf, the DisconnectAck answering b
// when b is a well-formed datagram holding a Disconnect, and nil otherwise.
// It answers for a connection already forgotten: one that finished the
// exchange but whose DisconnectAck was lost, so that the peer, resending its
// Disconnect, need not wait out its DisconnectTimeout. (DECISIONS §1 drops
// what an unknown endpoint sends, bar a ConnectSyn; a Disconnect is the
// other exception, answered as a refused ConnectSyn is.)
//
// The answer keeps no state: PacketID 0 (a closing session takes a
// DisconnectAck whatever its PacketID), no dependency, and b's InOrder flag
// (both messages are in-order, spec "Disconnect"; control sets the flag on
// ours once the connection was open). So it is never larger than b: 9 or
// 10 bytes, and a datagram holding a Disconnect is at least that, 10 with
// the flag (anti-amplification, as for refusals). Only a Disconnect is
// answered, never a DisconnectAck, so two endpoints cannot keep each other
// talking.
func disconnectAnswer(buf, b []byte) []byte {
	var h header
	disc := false
	if scanDatagram(b, &h, func(m message) { disc = disc || !m.fragment && m.id == idDisconnect }) != nil || !disc {
		return nil
	}
	d := appendHeader(buf[:0], &header{inOrder: h.inOrder})
	d = appendMessage(d, &message{id: idDisconnectAck})
	if len(d) > len(b) {
		return nil // cannot happen; the rule is worth the check
	}
	return d
}

// answerDisconnect sends addr the DisconnectAck answering b, if b is a
// Disconnect (see disconnectAnswer).
//
// Not on a secure endpoint: its peers' Disconnects are sealed, and one in
// clear is nobody's (an answer would only serve whoever forged it).
func (ep *endpoint) answerDisconnect(addr netip.AddrPort, b []byte) {
	if ep.cfg.privateKey != nil || ep.cfg.serverKey != nil {
		return
	}
	var buf [16]byte
	d := disconnectAnswer(buf[:0], b)
	if d == nil && ep.cfg.dialect != DialectSpec {
		d = cppDisconnectAnswer(buf[:0], b, &ep.rd)
	}
	if d != nil {
		ep.write(d, addr)
	}
}

// cppDisconnectAnswer is disconnectAnswer for a reference peer: the
// reference's DisconnectAck (7 bytes), never larger than its Disconnect
// (at least 10). Its PacketID is taken from the Disconnect's, counted
// down from the top of the range: a reference receiver drops a PacketID
// it has seen, so answers to successive resends must differ, and the
// top of the range is far from the PacketIDs of a connection just ended.
func cppDisconnectAnswer(buf, b []byte, d *cppDatagram) []byte {
	if parseCppInto(b, d) != nil || !d.has(idDisconnect) {
		return nil
	}
	h := cppHeader{packetID: (packetIDMask - d.packetID) & packetIDMask, inOrder: true}
	a := appendCppHeader(buf[:0], &h)
	a = appendCppMessage(a, &cppMessage{inOrder: true, id: idDisconnectAck}, 0)
	if len(a) > len(b) {
		return nil
	}
	return a
}
