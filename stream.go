package knet

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"
)

// A Conn over a byte stream (TCP, WebSocket) instead of UDP datagrams: the
// same Conn, its queues and its Group, with a streamSession for a session
// (streamsession.go). Its rounds run on the scheduler of an endpoint as a
// UDP connection's do (a Listener's first socket's, or one of its own for
// a dialed connection); two goroutines of its own read and write the
// stream, so that a round never waits for either.

// Transport is what a connection runs over.
type Transport uint8

const (
	TransportUDP       Transport = iota // kNet over UDP datagrams
	TransportTCP                        // kNet over TCP, the reference's framing
	TransportWebSocket                  // the TCP framing in WebSocket binary messages
)

func (t Transport) String() string {
	switch t {
	case TransportUDP:
		return "udp"
	case TransportTCP:
		return "tcp"
	case TransportWebSocket:
		return "websocket"
	}
	return fmt.Sprintf("Transport(%d)", uint8(t))
}

// Transport returns what the connection runs over: TransportUDP, or
// TransportTCP or TransportWebSocket for a player without UDP. Over a
// stream, Dialect says whether the peer is knet (DialectSpec: it sent
// knet's hello) or speaks only the reference's wire (DialectReference).
func (c *Conn) Transport() Transport {
	if c.st != nil {
		return c.st.transport
	}
	return TransportUDP
}

// streamReadSize is what the reader asks the stream for at a time, and
// streamInLimit how much it reads ahead of the rounds before it waits. A
// server's stream not yet established reads streamHelloReadSize at a time,
// at most streamHelloInLimit ahead: what a client that has proven nothing
// makes us hold is about a hello's size (Listener.establish raises them).
const (
	streamReadSize      = 32 << 10
	streamInLimit       = 256 << 10
	streamHelloReadSize = 4 << 10
	streamHelloInLimit  = 8 << 10
	streamWriteMax      = 64 << 10 // what a round hands the writer at most
)

var (
	streamBufs      = sync.Pool{New: func() any { b := make([]byte, streamReadSize); return &b }}
	streamHelloBufs = sync.Pool{New: func() any { b := make([]byte, streamHelloReadSize); return &b }}
)

// putStreamBuf returns a read buffer to its pool.
func putStreamBuf(bp *[]byte) {
	if cap(*bp) == streamHelloReadSize {
		streamHelloBufs.Put(bp)
	} else {
		streamBufs.Put(bp)
	}
}

// streamConn is a stream Conn's transport state.
type streamConn struct {
	nc        net.Conn
	transport Transport
	client    bool
	sess      *streamSession // owned by the round

	// Owned by the round.
	phase     streamPhase
	deadline  time.Time // of the phase: the opening, or the close
	closing   bool      // Close was called: flush, then end the stream
	finSent   bool
	byeSent   bool   // the close hello, to a knet peer
	reason    []byte // CloseWithReason's, for a knet peer
	code      uint32 // CloseWithError's, for a knet peer
	eof       bool   // the peer ended its side
	writeErr  error
	writeFrom time.Time // when the write under way began
	born      time.Time // when the stream was taken
	admitted  atomic.Pointer[admission]
	keyedRes  atomic.Pointer[keyResult] // a secure hello's key exchange, from a handshake worker
	needKnet  bool                      // a client that must reach a knet server (ConnectPayload)
	sealedIn  bool                      // a server's: the client's first sealed frame opened (clientProven)
	refusal   []byte                    // a server's: the reason it refused the client with
	// sniff: a server's TCP stream with Config.HTTP, its first bytes
	// still to tell kNet from HTTP (sniffing), or told HTTP
	// (sniffedHTTP: the round hands it to the Listener's HTTP server;
	// stream_http.go).
	sniff atomic.Int32

	// The reader's, under mu.
	mu    sync.Mutex
	in    []*[]byte
	inLen []int
	inN   int
	rerr  error
	room  chan struct{} // capacity 1: the rounds took what was read

	// How far the reader reads ahead, and in what pieces: small until a
	// server's stream is established (streamHelloInLimit).
	inLimit atomic.Int32

	// The writer's: the round hands it a buffer on wch when writing is
	// false, and it reports how much went (wn, werr) before clearing it.
	writing atomic.Bool
	wch     chan []byte
	wmu     sync.Mutex
	wn      int
	werr    error
	wbuf    []byte
}

type streamPhase uint8

const (
	phaseOpening   streamPhase = iota // waiting for the peer's first frame
	phaseKeying                       // a server's: a handshake worker reads the client's secure hello
	phaseAdmitting                    // a server's: the Admit hook has the client's first frame
	phaseProving                      // a secure server's: answered, waiting for the client's first sealed frame
	phaseOpen
)

// newStreamConn makes a Conn over nc. A server's (l != nil) waits for
// the client's first frame; a client's says hello unless it speaks the
// reference dialect.
func newStreamConn(ep *endpoint, nc net.Conn, tr Transport, cfg *config, client bool) *Conn {
	nc = simulateStream(ep, nc, cfg, client) // Config.Simulate (streamsim.go)
	dialect := DialectSpec
	if cfg.dialect == DialectReference {
		dialect = DialectReference
	}
	c := newConn(ep, unmap(streamAddr(nc.RemoteAddr())), cfg, client, dialect)
	now := time.Now()
	s := newStreamSession(c, cfg.maxMessage, cfg.lostTimeout, now)
	s.pingEvery = min(streamPingInterval, cfg.lostTimeout/3)
	st := &streamConn{
		nc:        nc,
		transport: tr,
		client:    client,
		sess:      s,
		room:      make(chan struct{}, 1),
		wch:       make(chan []byte, 1),
		deadline:  now.Add(cfg.connectTimeout),
		born:      now,
	}
	c.st = st
	st.inLimit.Store(streamInLimit)
	if !client && cfg.http != nil && tr == TransportTCP {
		st.sniff.Store(sniffing)
	}
	if !client {
		// What a client that has proven nothing may make us hold: a
		// first frame of a hello's size, read in small pieces.
		st.inLimit.Store(streamHelloInLimit)
		s.fr.setLimit(streamHelloLimit)
		// What follows the first frame is read once the connection is
		// established, under its limit: a secure client's message
		// right behind its first sealed frame (its proof), larger than
		// a hello, is no reason to end the stream.
		s.fr.peekMax = tcpMaxFrame(cfg.maxMessage)
	}
	if client && dialect == DialectReference {
		// The reference's wire: nothing to wait for, established
		// from the start.
		st.phase = phaseOpen
		c.streamOffer()
	} else {
		s.gate = true
		switch {
		case client && cfg.serverKey != nil:
			// A secure client: the key exchange in its hello, and
			// nothing else until the server's answer gives the keys.
			sec, syn, err := newClientSecure(cfg.serverKey, cfg.token, cfg.connectPayload)
			if err != nil {
				s.err = err
				break
			}
			sec.tap = cfg.sealTap
			sec.ku = newKeyUpdates(cfg)
			c.sec = sec
			st.needKnet = true
			s.quiet = true
			s.sendHello(helloSecure, syn)
		case client:
			st.needKnet = len(cfg.connectPayload) > 0
			s.sendHello(helloClient, cfg.connectPayload)
		default:
			s.quiet = true // nothing before the client's first frame
		}
	}
	return c
}

// start runs the stream's reader and writer and the first round.
func (c *Conn) startStream() {
	go c.st.readLoop(c)
	go c.st.writeLoop(c)
	c.kick()
}

// streamAddr is a stream peer's address as a netip.AddrPort (TCP's;
// zero for a stream without one).
func streamAddr(a net.Addr) netip.AddrPort {
	if t, ok := a.(*net.TCPAddr); ok {
		return t.AddrPort()
	}
	ap, _ := addrPortOf(a)
	return ap
}

// evictable reports whether a server's stream whose first frame has not
// been read may give its place to a new one (Listener.evictSilentLocked):
// one that sent nothing, or that has been sending its first frame for a
// while; not one whose first bytes just came (a client's hello comes
// right behind its connection, before a round reads it).
func (st *streamConn) evictable(now time.Time) bool {
	st.mu.Lock()
	heard := st.inN > 0 || st.rerr != nil
	st.mu.Unlock()
	return !heard || now.Sub(st.born) > streamHelloGrace
}

// streamHelloGrace is how long a stream that began its first frame keeps
// its place against new streams.
const streamHelloGrace = time.Second

// readLoop reads the stream into buffers for the rounds, at most
// streamInLimit ahead of them.
func (st *streamConn) readLoop(c *Conn) {
	for {
		limit := int(st.inLimit.Load())
		pool := &streamBufs
		if limit < streamInLimit {
			pool = &streamHelloBufs
		}
		bp := pool.Get().(*[]byte)
		n, err := st.nc.Read(*bp)
		st.mu.Lock()
		if n > 0 {
			st.in = append(st.in, bp)
			st.inLen = append(st.inLen, n)
			st.inN += n
		} else {
			putStreamBuf(bp)
		}
		if err != nil {
			st.rerr = err
		}
		full := st.inN >= int(st.inLimit.Load())
		toHTTP := false
		if st.sniff.Load() == sniffing && n > 0 {
			switch isHTTP, told := sniffHTTP(st.inBytes(sniffLen)); {
			case isHTTP:
				st.sniff.Store(sniffedHTTP)
				toHTTP = true
			case told:
				st.sniff.Store(0)
			}
		}
		if err != nil && st.sniff.Load() == sniffing {
			// No more bytes can tell it HTTP: a knet stream cut short,
			// which the rounds end now (not at ConnectTimeout).
			st.sniff.Store(0)
		}
		st.mu.Unlock()
		c.kick()
		if err != nil || toHTTP {
			return // an HTTP stream is read by the HTTP server from now on
		}
		if full {
			select {
			case <-st.room:
			case <-c.done:
				return
			}
		}
	}
}

// writeLoop writes what the rounds hand it.
func (st *streamConn) writeLoop(c *Conn) {
	for b := range st.wch {
		n, err := st.nc.Write(b)
		st.wmu.Lock()
		st.wn, st.werr = n, err
		st.wmu.Unlock()
		st.writing.Store(false)
		c.kick()
	}
}

// streamRound is round for a stream connection.
func (c *Conn) streamRound() (done bool) {
	st, s := c.st, c.st.sess
	if c.sched.timer == nil {
		c.sched.timer = time.AfterFunc(time.Hour, c.kick)
	}
	now := time.Now()
	// What the writer finished.
	if !st.writing.Load() && st.wbuf != nil {
		st.wmu.Lock()
		n, err := st.wn, st.werr
		st.wmu.Unlock()
		s.wrote(n)
		st.wbuf = nil
		if err != nil && st.writeErr == nil {
			st.writeErr = err
		}
	}
	if c.abandoned.Load() && st.phase != phaseOpen && s.err == nil {
		// Another attempt took its place: one with its handshake
		// message was established, or it gave way, silent, to a new
		// stream (Listener.evictSilentLocked).
		c.streamDrop(errAttemptGaveWay)
	}
	c.streamInput(now)
	if k := st.keyedRes.Swap(nil); k != nil {
		c.streamKeyed(now, k)
	}
	if a := st.admitted.Swap(nil); a != nil {
		c.streamDecide(now, a)
		c.streamInput(now)
	}
	c.streamSendQueue(now)
	if st.phase == phaseOpen || st.client {
		s.advance(now)
	}
	if s.peerClose && !st.eof && st.phase == phaseOpen {
		// A knet peer's close: its FIN follows.
		c.streamPeerClosed()
	}
	c.streamWrite(now)
	c.publish()
	if c.streamDone(now) {
		return true
	}
	next := s.deadline()
	if st.phase != phaseOpen || st.finSent {
		next = minTime(next, st.deadline)
	}
	if st.wbuf != nil && !st.writeFrom.IsZero() {
		// A write that does not move for the lost timeout: the peer
		// reads nothing.
		next = minTime(next, st.writeFrom.Add(c.cfg.lostTimeout))
	}
	if !next.After(now) {
		next = now.Add(time.Millisecond)
	}
	c.setTimer(next, now)
	return false
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

// streamInput hands the session what the reader read, while the receive
// queue has room (the stream's own flow control does the rest: the peer
// waits) and the gate is open.
func (c *Conn) streamInput(now time.Time) {
	st, s := c.st, c.st.sess
	switch st.sniff.Load() {
	case sniffing:
		return // the first bytes do not tell yet: they wait in st.in
	case sniffedHTTP:
		if s.err == nil {
			s.err = errStreamToHTTP // the connection ends, the stream goes on (streamFinish)
		}
		return
	}
	for {
		if s.err != nil || s.gate && s.sawFirst || c.recvUsed() >= c.cfg.recvBuffer || c.streamOverBudget() {
			break
		}
		st.mu.Lock()
		if len(st.in) == 0 {
			rerr := st.rerr
			st.mu.Unlock()
			if rerr != nil && !st.eof {
				st.eof = true
				c.streamEOF(rerr)
			}
			break
		}
		bp, n := st.in[0], st.inLen[0]
		st.in[0] = nil
		st.in, st.inLen = st.in[1:], st.inLen[1:]
		wasFull := st.inN >= int(st.inLimit.Load())
		st.inN -= n
		st.mu.Unlock()
		if wasFull {
			signal(st.room)
		}
		s.received(now, (*bp)[:n])
		putStreamBuf(bp)
		c.sched.active = true
	}
	if s.gate && s.sawFirst && s.err == nil && (st.phase == phaseOpening || st.phase == phaseProving) {
		if st.phase == phaseOpening {
			c.streamFirstFrame(now)
		} else {
			c.streamProven(now)
		}
		if st.phase == phaseOpen {
			c.streamInput(now) // what came behind it
		}
	}
}

// streamEOF handles the end of what the peer sends: a graceful close if
// it ended between frames after the opening, a failure otherwise.
func (c *Conn) streamEOF(rerr error) {
	st, s := c.st, c.st.sess
	switch {
	case s.err != nil:
	case st.phase == phaseOpening && s.fr.buffered() > 0:
		s.stats.ProtocolErrors++
		s.err = &ProtocolError{Err: fmt.Errorf("the stream ended inside the peer's first frame (%d bytes of it)", s.fr.buffered())}
	case st.phase != phaseOpen:
		if st.client {
			s.err = fmt.Errorf("%w: the server closed the stream before it answered", ErrRefused)
		} else {
			s.err = errors.New("knet: the client closed the stream before it was established")
		}
	case !errors.Is(rerr, io.EOF) && !(st.transport == TransportWebSocket && (s.peerClose || st.finSent)):
		// A WebSocket ends with its close handshake, which a browser's
		// reports as a read on a closed connection: once either end
		// said its close (knet's hello), that is the end, not a failure.
		s.err = rerr
	case s.fr.buffered() > 0:
		s.stats.ProtocolErrors++
		s.err = &ProtocolError{Err: fmt.Errorf("the stream ended inside a frame (%d bytes of it)", s.fr.buffered())}
	case s.seal != nil && !s.peerClose && !st.byeSent:
		// A secure peer says it closes in a sealed frame before its end
		// of the stream: an end without it, before we said ours, was
		// cut on the path (a FIN anyone there can send), and what the
		// peer sent after the cut is lost. (After ours, the end is the
		// peer's answer: a proxy that ends both ways at the first end
		// need not pass the peer's close.)
		s.stats.ProtocolErrors++
		s.err = &ProtocolError{Err: errors.New("the secure stream ended without the peer's sealed close: cut on the path")}
	default:
		c.streamPeerClosed()
	}
}

// streamPeerClosed notes the peer's close: Receive reads io.EOF after the
// messages it sent, and our side closes once what is queued is written.
func (c *Conn) streamPeerClosed() {
	if c.st.eof && c.st.closing {
		return
	}
	c.st.eof = true
	c.peerClosed()
	// Send refuses from now on: what it queued since this round took the
	// queue is its last, and goes before our end, as over UDP
	// (drainSendQueue). Left there, a message Send had accepted was
	// neither sent nor refused (TestDrainStreamsLoseNothing, 1 run in
	// several hundred).
	c.streamSendQueue(time.Now())
	c.st.closing = true
}

// streamFirstFrame reads the peer's first frame: a knet hello, or the
// reference's first frame (a ping, or application data). A server's goes
// to its admission (streamClientFirst).
func (c *Conn) streamFirstFrame(now time.Time) {
	st, s := c.st, c.st.sess
	kind, content, knet := byte(0), []byte(nil), false
	if s.firstID == idPingReply {
		kind, content, knet = parseStreamHello(s.first)
	}
	if !st.client {
		c.streamClientFirst(now, knet, kind, content)
		return
	}
	if c.sec != nil {
		c.streamSecureAnswer(now, knet, kind, content)
		return
	}
	switch {
	case knet && kind == helloAccept:
		s.knet = true
		c.state.mu.Lock()
		c.state.syn = append([]byte(nil), c.cfg.connectPayload...)
		c.state.synAck = append([]byte(nil), content...)
		c.state.mu.Unlock()
		st.phase = phaseOpen
		s.open(now, true)
		c.streamOffer()
	case knet && kind == helloRefuse:
		s.err = refusedErr(content)
	case st.needKnet:
		s.err = fmt.Errorf("%w: the server speaks kNet over TCP without knet's hello, and so cannot read ConnectPayload", ErrRefused)
	default:
		// The reference: established from the start.
		c.dialect = DialectReference // before Dial returns c
		st.phase = phaseOpen
		s.open(now, false)
		c.streamOffer()
	}
}

// streamOffer hands an established stream connection to its application:
// a server's, whose client has proven itself, through the listener's
// admission (Listener.establish) to Accept or its Group; a client's to
// Dial. It reports whether it did: a server's that could not be is
// refused.
func (c *Conn) streamOffer() bool {
	if l := c.ep.l; l != nil {
		if err := l.establish(c); err != nil {
			c.streamRefused(err, c.st.sess.knet)
			return false
		}
		// Established: the limits of a client that has proven
		// nothing no longer apply.
		c.st.sess.fr.setLimit(tcpMaxFrame(c.cfg.maxMessage))
		c.st.inLimit.Store(streamInLimit)
		signal(c.st.room)
	}
	c.estOnce.Do(func() { close(c.estab) })
	if l := c.cfg.logger; l != nil {
		l.Info("knet: connection established", "remote", c.RemoteAddr(), "transport", c.st.transport, "client", c.ep.l == nil)
	}
	return true
}

// streamRefused refuses a server's stream: a knet client hears why
// (unless the listener is stealthy), then the stream closes.
func (c *Conn) streamRefused(err error, knet bool) {
	st, s := c.st, c.st.sess
	c.ep.refused.Add(1)
	if l := c.cfg.logger; l != nil {
		l.Info("knet: connection refused", "remote", c.RemoteAddr(), "transport", st.transport, "reason", err)
	}
	st.refusal = reasonBytes(err.Error())
	if knet && !c.cfg.stealth {
		s.sendHello(helloRefuse, st.refusal)
	} else {
		st.refusal = nil
	}
	if s.err == nil {
		s.err = fmt.Errorf("%w: %v", ErrRefused, err)
	}
	st.closing = true
	st.deadline = time.Now().Add(c.cfg.disconnect)
}

// streamDrop ends a server's stream at once, without an answer (counted
// among the failed streams): what the admission drops over UDP, it drops
// here too.
func (c *Conn) streamDrop(err error) {
	if s := c.st.sess; s.err == nil {
		s.err = err
	}
}

// streamSendQueue hands the session the application's messages, and
// notes a close.
func (c *Conn) streamSendQueue(now time.Time) {
	st, s := c.st, c.st.sess
	c.sendq.mu.Lock()
	q := c.sendq.msgs
	c.sendq.msgs = c.sendq.spare[:0]
	closing, why, code := c.sendq.closing, c.sendq.closeReason, c.sendq.closeCode
	c.sendq.flowReq = 0 // the stream has its own
	c.sendq.mu.Unlock()
	for i := range q {
		m := s.newMsg()
		q[i].outMsg(m)
		s.enqueue(m)
		q[i] = appMsg{}
		c.sched.active = true
	}
	c.sendq.spare = q[:0]
	if closing && !st.closing {
		st.closing = true
		st.reason, st.code = why, code
		if st.phase != phaseOpen {
			// Nothing to say goodbye to yet.
			s.failQueue()
			if !st.client && s.err == nil {
				// A server's attempt (a Drain, the Listener's Close):
				// refused, told why if it said hello, and ended once
				// that is written, not waiting for its peer's end.
				reason := "knet: the server closed the connection"
				if len(why) > 0 {
					reason = string(why)
				}
				c.streamRefused(errors.New(reason), s.knet)
			}
		}
	}
}

// streamWrite hands the writer what is ready, when it is free; once a
// closing connection has written everything, it ends our side of the
// stream.
func (c *Conn) streamWrite(now time.Time) {
	st, s := c.st, c.st.sess
	if st.wbuf != nil || st.writeErr != nil || s.err != nil && !st.closing {
		return // a write under way, or its result not yet taken
	}
	if st.finSent {
		// Nothing goes after our end of the stream: a ping written
		// there failed, and the failure ended the close before the
		// peer's end came.
		return
	}
	if st.closing && !st.finSent && !st.byeSent && st.phase == phaseOpen && s.knet && !s.peerClose && len(s.q) == 0 {
		// A knet peer hears of the close, and why, in a frame: a
		// WebSocket has no half-close to say it with; over a secure
		// stream, an end without it is a cut (streamEOF).
		s.sendClose(st.code, st.reason)
		st.byeSent = true
	}
	if b := s.take(streamWriteMax); len(b) > 0 {
		st.wbuf = b
		st.writeFrom = now
		st.writing.Store(true)
		st.wch <- b
		c.sched.active = true
		return
	}
	st.writeFrom = time.Time{}
	if st.closing && !st.finSent {
		st.finSent = true
		if cw, ok := st.nc.(interface{ CloseWrite() error }); ok {
			cw.CloseWrite()
		}
		// The peer's end of the stream answers ours, within the
		// disconnect timeout (the reference's does not: then the
		// timeout ends it).
		st.deadline = now.Add(c.cfg.disconnect)
	}
}

// streamDone reports whether the connection has ended.
func (c *Conn) streamDone(now time.Time) bool {
	st, s := c.st, c.st.sess
	switch {
	case st.writeErr != nil:
		switch {
		case s.err != nil || st.finSent:
		case st.closing && (s.peerClose || st.eof):
			// The peer ended first, with its close (a WebSocket's
			// library shuts the socket on the peer's close frame, and
			// what we still had to write, after our own close, fails):
			// a graceful end, as streamEOF takes it.
		case st.client && st.phase != phaseOpen:
			// The server dropped the stream before it answered: as
			// when its end is read first (streamEOF), whichever of
			// the reader and the writer hears of it first.
			s.err = fmt.Errorf("%w: the server closed the stream before it answered (%v)", ErrRefused, st.writeErr)
		default:
			s.err = st.writeErr
		}
		return true
	case st.wbuf != nil:
		if !st.writeFrom.IsZero() && now.Sub(st.writeFrom) >= c.cfg.lostTimeout && s.err == nil {
			s.err = &TimeoutError{Silent: now.Sub(st.writeFrom)}
			return true
		}
		return false
	case st.phase != phaseOpen && s.err == nil && !now.Before(st.deadline):
		s.err = &TimeoutError{Op: "connect", Silent: c.cfg.connectTimeout}
		return true
	case s.err != nil:
		// A refusal's answer goes out first.
		return !st.closing || st.finSent || !s.queued()
	case st.finSent && !st.eof && !now.Before(st.deadline) && (s.knet || s.fr.buffered() > 0):
		// A knet peer answers our close with its end within
		// DisconnectTimeout; one that did not, or that left a frame
		// unfinished, did not close: as over UDP, a timeout (the
		// reference answers a FIN only when its application closes).
		s.err = &TimeoutError{Op: "disconnect", Silent: c.cfg.disconnect}
		return true
	case st.finSent:
		return st.eof || !now.Before(st.deadline)
	}
	return false
}

// streamFinish is finish for a stream connection (Conn.end).
func (c *Conn) streamFinish() {
	st, s := c.st, c.st.sess
	toHTTP := s.err == errStreamToHTTP
	if l := c.ep.l; l != nil && !c.isEstablished() {
		if !errors.Is(s.err, ErrRefused) && !toHTTP {
			l.failedStreams.Add(1) // before the peer sees the stream end
		}
		l.endAttempt(c, s.err, st.refusal)
	}
	if l := c.ep.l; toHTTP && l != nil {
		st.mu.Lock()
		pre := st.inBytes(st.inN)
		st.mu.Unlock()
		l.serveHTTP(st.nc, pre) // what was read of it goes first
	} else {
		st.nc.Close()
	}
	close(st.wch)
	s.failQueue()
	c.recvq.mu.Lock()
	eof := c.recvq.eof
	c.recvq.mu.Unlock()
	err := s.err
	switch {
	case err != nil:
	case eof && (len(s.closeWhy) > 0 || s.closeCode != 0):
		err = &DisconnectError{Code: s.closeCode, Reason: string(s.closeWhy)}
	case eof:
		err = ErrPeerClosed
	default:
		err = net.ErrClosed
	}
	if l := c.cfg.logger; l != nil && c.isEstablished() {
		graceful := err == net.ErrClosed || errors.Is(err, ErrPeerClosed)
		level := slog.LevelInfo
		if !graceful {
			level = slog.LevelWarn
		}
		l.Log(context.Background(), level, "knet: connection ended", "remote", c.RemoteAddr(), "transport", st.transport, "reason", err)
	}
	st2 := c.snapshot()
	c.state.mu.Lock()
	c.state.err = err
	if c.state.pub == nil {
		c.state.pub = new(published)
	}
	c.fillLocked(c.state.pub, &st2)
	c.state.mu.Unlock()
	st.mu.Lock()
	for _, bp := range st.in {
		putStreamBuf(bp)
	}
	st.in, st.inLen = nil, nil
	st.mu.Unlock()
	if l := c.ep.l; l != nil {
		l.streamEnded(c)
	}
	close(c.done)
	c.recvq.wake()
	signal(c.sendq.space)
	c.readDL.stop()
	c.writeDL.stop()
	if g := c.group.Load(); g != nil {
		g.notify(c)
	}
	if c.ep.l == nil {
		c.ep.sched.stop()
	}
}

// streamSnapshot is snapshot for a stream connection.
func (c *Conn) streamSnapshot() Stats {
	s := c.st.sess
	st := s.stats
	st.RTT = s.rtt
	st.KeyUpdates = c.sec.keyUpdateCount()
	return st
}
