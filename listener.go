package knet

import (
	"context"
	"errors"
	"fmt"
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
	buf []byte
	b   []byte
}

// endpoint is one UDP socket and the goroutine that reads it, shared by a
// Listener's connections or owned by one dialed connection.
type endpoint struct {
	pc        *net.UDPConn
	uc        *udp.Conn
	connected bool // a dialed socket: Write, not WriteTo
	l         *Listener
	cfg       *config
	pool      *sync.Pool
	sim       *netsim.Pipe // Config.Simulate, if set

	mu      sync.Mutex
	conns   map[netip.AddrPort]*Conn
	runBuf  []*packet      // the reader's, for dispatch
	pending map[*Conn]bool // server connections not yet established
	closing bool

	readerDone chan struct{}
	closeOnce  sync.Once

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
}

// socketBuffer is the kernel buffer size asked for, each way; the kernel
// may grant less (net.core.rmem_max, wmem_max on Linux).
const socketBuffer = 4 << 20

func newEndpoint(pc *net.UDPConn, connected bool, cfg *config) *endpoint {
	pc.SetReadBuffer(socketBuffer)
	pc.SetWriteBuffer(socketBuffer)
	ep := &endpoint{
		pc:         pc,
		uc:         udp.New(pc, connected),
		connected:  connected,
		cfg:        cfg,
		conns:      make(map[netip.AddrPort]*Conn),
		readerDone: make(chan struct{}),
	}
	ep.pool = packetPool(max(cfg.maxDatagram, 2048) + 1)
	return ep
}

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
	ep.pool.Put(p)
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
	_, err := ep.uc.WriteBatch(w.w, ps)
	return err
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
	var err error
	if ep.connected {
		_, err = ep.pc.Write(b)
	} else {
		_, err = ep.pc.WriteToUDPAddrPort(b, to)
	}
	if err != nil {
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

// writeBatch is what a connection's goroutine needs to send a batch:
// pooled, since few connections send at any one moment.
type writeBatch struct {
	w    *udp.Writer
	ps   [udp.MaxBatch]udp.Packet
	bufs [udp.MaxBatch][]byte // for datagrams built on the spot
	size int
	used int // entries of ps that may hold references
}

var writeBatches sync.Pool

func getWriteBatch(c *udp.Conn, size int) *writeBatch {
	if w, ok := writeBatches.Get().(*writeBatch); ok && w.size == size {
		return w
	}
	w := &writeBatch{w: c.NewWriter(), size: size}
	for i := range w.bufs {
		w.bufs[i] = make([]byte, 0, size)
	}
	return w
}

func putWriteBatch(w *writeBatch) {
	clear(w.ps[:w.used])
	w.used = 0
	writeBatches.Put(w)
}

// readLoop reads the socket, a batch at a time, and hands each datagram to
// its connection, never waiting on one.
func (ep *endpoint) readLoop() {
	defer close(ep.readerDone)
	batch := 16 // a dialed connection: each buffer held is 2 KB
	if ep.l != nil {
		batch = udp.MaxBatch
	}
	r := ep.uc.NewReader()
	ps := make([]udp.Packet, batch)
	pkts := make([]*packet, batch)
	defer func() {
		for _, p := range pkts {
			if p != nil {
				ep.putPacket(p)
			}
		}
	}()
	fails, held := 0, 0
	for {
		// Buffers only for what the read may fill: one, unless a
		// backlog has the reader taking batches.
		want := r.Want(batch)
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
		n, err := ep.uc.ReadBatch(r, ps[:want])
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
	}
}

// dispatch hands a batch of datagrams to their connections, consecutive
// ones for the same connection together.
func (ep *endpoint) dispatch(ps []udp.Packet, pkts []*packet) {
	var run []*packet
	var runConn *Conn
	flush := func() {
		if runConn != nil && len(run) > 0 {
			runConn.pushRun(run)
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
		p.b = p.buf[:ps[i].N]
		addr := unmap(ps[i].Addr)
		c := ep.conns[addr]
		if c != runConn {
			flush()
			runConn = c
		}
		switch {
		case c != nil:
			run = append(run, p)
		case ep.l != nil:
			ep.mu.Unlock()
			ep.l.handleNew(ep, addr, p)
			ep.mu.Lock()
			runConn = nil
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

// remove forgets c's address.
func (ep *endpoint) remove(c *Conn) {
	ep.mu.Lock()
	if ep.conns[c.raddr] == c {
		delete(ep.conns, c.raddr)
	}
	ep.mu.Unlock()
	if ep.l != nil {
		ep.l.established(c) // no longer pending, whatever became of it
	}
}

// connDone is called as a connection's goroutine exits. A dialed socket
// goes with its connection, but if the connection ended by answering the
// peer's Disconnect, only after a moment in which it answers the peer's
// resent Disconnects (dispatch): the DisconnectAck may have been lost, and
// the peer would otherwise wait out its DisconnectTimeout.
func (ep *endpoint) connDone(c *Conn) {
	if ep.l != nil {
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
		ep.pc.Close()
		<-ep.readerDone
	})
}

// Listener accepts kNet connections on one UDP socket (or several sharing
// its address, with Config.Sockets). It is a net.Listener whose Accept
// returns *Conn values.
//
// A Listener is safe for concurrent use.
type Listener struct {
	eps       []*endpoint
	cfg       *config
	acceptq   chan *Conn
	closed    chan struct{}
	closeOnce sync.Once
	open      atomic.Bool
	loops     sync.WaitGroup

	mu      sync.Mutex
	pending map[*Conn]bool // connections not yet established
	closing bool
}

// ListenerStats are a Listener's counters.
type ListenerStats struct {
	Connections      int    // connections on the socket(s), pending ones included
	Pending          int    // connections whose handshake is not complete
	InvalidDatagrams uint64 // malformed datagrams from unknown endpoints, dropped
	StrayDatagrams   uint64 // datagrams from unknown endpoints that were not connection attempts (a Disconnect among them is answered, unless Stealth)
	IgnoredAttempts  uint64 // connection attempts ignored (too many pending, listener closed)
	RefusedAttempts  uint64 // connection attempts refused by Admit or a full backlog
	SendErrors       uint64 // datagrams the system refused to send that were no connection's: refusals, and deliveries of Config.Simulate
	OversizedReplies uint64 // Admit replies longer than a ConnectSynAck carries: those attempts were refused (see Config.Admit)
	Sockets          int    // sockets sharing the address (Config.Sockets)
}

// Listen opens a UDP socket on address and accepts kNet connections on it.
// The network is "udp", "udp4" or "udp6". With Config.Sockets above 1 it
// opens that many on the same address (SO_REUSEPORT, Linux), each read by
// its own goroutine; the kernel spreads peers over them by address, and a
// connection stays on the socket its peer reached.
func Listen(network, address string, cfg *Config) (*Listener, error) {
	if err := checkNetwork(network); err != nil {
		return nil, err
	}
	laddr, err := net.ResolveUDPAddr(network, address)
	if err != nil {
		return nil, err
	}
	rc := cfg.resolve()
	var pcs []*net.UDPConn
	fail := func(err error) (*Listener, error) {
		for _, pc := range pcs {
			pc.Close()
		}
		return nil, err
	}
	for i := range rc.sockets {
		var pc *net.UDPConn
		if rc.sockets == 1 {
			pc, err = net.ListenUDP(network, laddr)
		} else {
			pc, err = listenReusePort(network, laddr)
		}
		if err != nil {
			return fail(err)
		}
		pcs = append(pcs, pc)
		if i == 0 {
			laddr = pc.LocalAddr().(*net.UDPAddr) // the others take the same port
		}
	}
	l := &Listener{
		cfg:     rc,
		acceptq: make(chan *Conn, rc.backlog),
		closed:  make(chan struct{}),
		pending: make(map[*Conn]bool),
	}
	l.open.Store(true)
	for i, pc := range pcs {
		ep := newEndpoint(pc, false, rc)
		ep.simulate(1 + uint64(i)*2)
		ep.l = l
		l.eps = append(l.eps, ep)
	}
	for _, ep := range l.eps {
		go ep.readLoop()
	}
	return l, nil
}

func checkNetwork(network string) error {
	switch network {
	case "udp", "udp4", "udp6":
		return nil
	}
	return fmt.Errorf("knet: network %q not one of udp, udp4, udp6", network)
}

// Addr returns the address of the socket.
func (l *Listener) Addr() net.Addr { return l.eps[0].pc.LocalAddr() }

// Accept waits for the next established connection and returns it, a
// *Conn, as a net.Conn.
func (l *Listener) Accept() (net.Conn, error) {
	c, err := l.AcceptConn(context.Background())
	if err != nil {
		return nil, err
	}
	return c, nil
}

// AcceptConn waits for the next established connection, until ctx is done
// or the listener is closed.
func (l *Listener) AcceptConn(ctx context.Context) (*Conn, error) {
	if ctx == nil {
		return nil, errNilContext
	}
	select {
	case c := <-l.acceptq:
		return c, nil
	default:
	}
	select {
	case c := <-l.acceptq:
		return c, nil
	case <-l.closed:
		return nil, net.ErrClosed
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// SetListenOpen opens or closes the listener for new connections (the
// spec's listen-open mode). Closed, it serves only the connections it has;
// connection attempts are refused (or ignored, with Config.Stealth).
// A Listener starts open.
func (l *Listener) SetListenOpen(open bool) { l.open.Store(open) }

// Stats returns the listener's counters.
func (l *Listener) Stats() ListenerStats {
	st := ListenerStats{Sockets: len(l.eps)}
	for _, ep := range l.eps {
		ep.mu.Lock()
		st.Connections += len(ep.conns)
		ep.mu.Unlock()
		st.InvalidDatagrams += ep.invalid.Load()
		st.StrayDatagrams += ep.stray.Load()
		st.IgnoredAttempts += ep.ignored.Load()
		st.RefusedAttempts += ep.refused.Load()
		st.SendErrors += ep.sendErrs.Load()
		st.OversizedReplies += ep.oversized.Load()
	}
	l.mu.Lock()
	st.Pending = len(l.pending)
	l.mu.Unlock()
	return st
}

// Close stops accepting, closes every connection gracefully (in parallel,
// within DisconnectTimeout) and then the sockets. It is idempotent.
func (l *Listener) Close() error {
	l.closeOnce.Do(func() {
		close(l.closed)
		l.mu.Lock()
		l.closing = true
		l.mu.Unlock()
		var conns []*Conn
		for _, ep := range l.eps {
			ep.mu.Lock()
			for _, c := range ep.conns {
				conns = append(conns, c)
			}
			ep.mu.Unlock()
		}
		var wg sync.WaitGroup
		for _, c := range conns {
			wg.Go(func() {
				c.shutdown()
				<-c.done
			})
		}
		wg.Wait()
		l.loops.Wait()
		for _, ep := range l.eps {
			ep.close()
		}
	})
	return nil
}

// handleNew handles a datagram from an address with no connection on ep: a
// connection attempt if it is a well-formed datagram with a ConnectSyn
// (DECISIONS §1), otherwise dropped.
func (l *Listener) handleNew(ep *endpoint, addr netip.AddrPort, p *packet) {
	if ok, valid := isConnectSyn(p.b); !ok {
		if valid {
			ep.stray.Add(1) // say, late from a connection that ended
			if !l.cfg.stealth {
				ep.answerDisconnect(addr, p.b)
			}
		} else {
			ep.invalid.Add(1)
		}
		ep.putPacket(p)
		return
	}
	if !l.open.Load() {
		ep.refused.Add(1)
		if !l.cfg.stealth {
			refuse(ep, addr)
		}
		ep.putPacket(p)
		return
	}
	l.mu.Lock()
	if l.closing || len(l.pending) >= l.cfg.maxPending {
		l.mu.Unlock()
		ep.ignored.Add(1)
		ep.putPacket(p)
		return
	}
	c := newConn(ep, addr, l.cfg, false)
	l.pending[c] = true
	l.loops.Add(1)
	l.mu.Unlock()
	ep.mu.Lock()
	ep.conns[addr] = c
	ep.mu.Unlock()
	c.push(p)
	go func() {
		defer l.loops.Done()
		c.loop()
	}()
}

// established forgets c from the pending connections.
func (l *Listener) established(c *Conn) {
	l.mu.Lock()
	delete(l.pending, c)
	l.mu.Unlock()
}

// isConnectSyn reports whether b is a well-formed datagram holding a
// ConnectSyn, and whether it is well-formed at all.
func isConnectSyn(b []byte) (syn, valid bool) {
	var h header
	n, err := parseHeader(b, &h)
	if err != nil {
		return false, false
	}
	for n < len(b) {
		m, k, err := parseMessage(b[n:])
		if err != nil || checkOrder(&h, &m) != nil {
			return false, false
		}
		if !m.fragment && m.id == idConnectSyn {
			syn = true
		}
		n += k
	}
	return syn, true
}

// refuse answers a connection attempt with a DisconnectAck. The datagram
// (nine bytes) is never larger than the ConnectSyn's.
func refuse(ep *endpoint, addr netip.AddrPort) {
	var b [16]byte
	d := appendHeader(b[:0], &header{})
	d = appendMessage(d, &message{id: idDisconnectAck})
	ep.write(d, addr)
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
	n, err := parseHeader(b, &h)
	if err != nil {
		return nil
	}
	disc := false
	for n < len(b) {
		m, k, err := parseMessage(b[n:])
		if err != nil || checkOrder(&h, &m) != nil {
			return nil
		}
		if !m.fragment && m.id == idDisconnect {
			disc = true
		}
		n += k
	}
	if !disc {
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
func (ep *endpoint) answerDisconnect(addr netip.AddrPort, b []byte) {
	var buf [16]byte
	if d := disconnectAnswer(buf[:0], b); d != nil {
		ep.write(d, addr)
	}
}

// roomToAccept reports whether the accept backlog has room.
func (l *Listener) roomToAccept() bool { return len(l.acceptq) < cap(l.acceptq) }

// offer queues an established connection for Accept.
func (l *Listener) offer(c *Conn) bool {
	l.established(c)
	select {
	case l.acceptq <- c:
		return true
	default:
		c.ep.refused.Add(1)
		return false
	}
}

// Dial connects to a kNet server at address, over its own UDP socket. The
// network is "udp", "udp4" or "udp6". It returns once the handshake is
// complete, or fails with ErrRefused, a *TimeoutError after
// ConnectTimeout, or ctx's error.
func Dial(ctx context.Context, network, address string, cfg *Config) (*Conn, error) {
	if ctx == nil {
		return nil, errNilContext
	}
	if err := checkNetwork(network); err != nil {
		return nil, err
	}
	rc := cfg.resolve()
	if n := len(rc.connectPayload); n > rc.handshakeLimit() {
		return nil, fmt.Errorf("%w: ConnectPayload of %d bytes, at most %d fit a ConnectSyn", ErrHandshakeTooLarge, n, rc.handshakeLimit())
	}
	raddr, err := net.ResolveUDPAddr(network, address)
	if err != nil {
		return nil, err
	}
	if raddr.Port == 0 {
		// The system would take it, and the attempt would only time out.
		return nil, fmt.Errorf("knet: dial %s %q: no port to connect to", network, address)
	}
	pc, err := net.DialUDP(network, nil, raddr)
	if err != nil {
		return nil, err
	}
	ep := newEndpoint(pc, true, rc)
	ep.simulate(2)
	c := newConn(ep, unmap(raddr.AddrPort()), rc, true)
	ep.conns[c.raddr] = c
	go ep.readLoop()
	go c.loop()
	select {
	case <-c.estab:
		return c, nil
	case <-c.done:
		return nil, c.Err()
	case <-ctx.Done():
		c.shutdown()
		<-c.done
		return nil, ctx.Err()
	}
}
