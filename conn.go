package knet

import (
	"errors"
	"net"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

// Conn is one kNet connection. It sends and receives messages (Send,
// Receive) and is also a net.Conn whose Read and Write carry a byte stream
// as reliable in-order messages on channel 0 with ID StreamMessageID.
//
// A Conn is safe for concurrent use.
type Conn struct {
	ep      *endpoint
	raddr   netip.AddrPort // owned by the round; changed under ep.mu (moveTo)
	remote  atomic.Pointer[net.UDPAddr]
	cfg     *config
	dialect Dialect // DialectSpec or DialectReference

	// Owned by the round (Conn.round).
	sess  *session
	sec   *secureState // a secure session's keys, nil if plaintext
	st    *streamConn  // a connection over TCP or WebSocket (stream.go), nil over UDP
	sched connSched
	// Datagrams the system refused to send, and their bytes (counted
	// sent by the session, taken off in the Stats).
	sendErrs, unsentBytes uint64

	// Any goroutine's: a channel and atomics.
	run      atomic.Int32  // runIdle, runQueued, ... (sched.go)
	parked   atomic.Bool   // idle for parkAfter, until the next round
	refusals atomic.Uint32 // port unreachable reports, from the reader
	readOn   atomic.Bool   // a Listener's Drain closed it: Receive goes on until the end (drain.go)
	userData atomic.Value  // SetUserData's

	// The three ways in and out of the rounds, each behind its own mutex.
	inbox connInbox     // datagrams from the socket reader
	sendq connSendQueue // messages from the application
	recvq connRecvQueue // messages for the application

	readDL, writeDL deadline

	// The Group taking this connection's messages, if any, and its
	// place there (guarded by the group's mutex).
	group   atomic.Pointer[Group]
	inGroup connInGroup

	// A server's: its place among the listener's pending attempts
	// (admission.go; guarded by the Listener's mu), and whether another
	// attempt with its handshake message was established (abandon).
	ticket    ticket
	silent    bool // a stream that has said nothing yet (evictSilentLocked)
	abandoned atomic.Bool

	estOnce    sync.Once
	estab      chan struct{}
	userClosed atomic.Bool // Close was called (not only the Listener's)
	closeOnce  sync.Once
	closed     chan struct{} // Close was called
	done       chan struct{} // loop has exited

	state connState // what the rounds publish: counters, why it ended
}

// connSched is the rounds' own: the timer, when it is set for, the next
// deadline, whether the round did anything, and since when nothing was
// done. Owned by the round.
type connSched struct {
	admission atomic.Pointer[admission] // the Admit hook's, from its goroutine
	sentHere  time.Time                 // the last round a Send ran on its own goroutine
	timer     *time.Timer
	armed     time.Time
	next      time.Time
	active    bool
	quietFrom time.Time
}

// connInbox holds the datagrams the socket reader hands a connection
// (push) until its loop takes them (drainInbox).
type connInbox struct {
	// Guarded by mu.
	mu      sync.Mutex
	pkts    []*packet
	dropped uint64 // datagrams a full inbox dropped

	// Owned by the round (Conn.round).
	work []*packet // the slice pkts is swapped with each round
	peak int       // the most datagrams one round took since the last tidy
}

// connSendQueue holds the messages the application queued (Send) until
// a round hands them to the session (drainSendQueue), and the send
// buffer's accounting.
type connSendQueue struct {
	// Guarded by mu.
	mu          sync.Mutex
	msgs        []appMsg
	lastRef     uint64 // the last Ref handed out >> 1: the tag, the count
	closing     bool   // Close was called
	peerGone    bool   // the peer closed (beside closing: one word for both)
	closeCode   uint32 // CloseWithError's (beside the bools: no room taken)
	closeReason []byte // CloseWithReason's, CloseWithError's
	flowReq     int    // FlowControl rate to send, 0 if none
	used        int    // payload bytes queued or unacked
	drops       uint64
	space       chan struct{} // capacity 1

	// Owned by the round (Conn.round).
	spare    []appMsg // the slice msgs is swapped with each round
	peak     int      // the most messages one round took since the last tidy
	released int      // send buffer bytes to hand back
}

// appMsg is a message the application queued, as the send queue holds it
// until a round makes it the session's outMsg: 80 bytes, not outMsg's 200,
// in two slices per connection that a burst grows.
type appMsg struct {
	ref       Ref
	id        uint32
	contentID uint32
	payload   []byte
	pbuf      *[]byte // the pooled buffer behind payload
	after     []Ref
	reliable  bool
	inOrder   bool
	tracked   bool
	channel   uint8
	priority  int8
}

// outMsg makes a the session's message m, keeping m's recycled storage.
func (a *appMsg) outMsg(m *outMsg) {
	deps := m.deps[:0]
	*m = outMsg{ref: a.ref, id: a.id, payload: a.payload, pbuf: a.pbuf, reliable: a.reliable, inOrder: a.inOrder,
		tracked: a.tracked, channel: a.channel, priority: a.priority, contentID: a.contentID, after: a.after, deps: deps}
}

// connRecvQueue holds the messages the rounds delivered (deliver) until the
// application takes them (Receive, Read, a Group).
type connRecvQueue struct {
	// Guarded by mu.
	mu   sync.Mutex
	msgs recvQueue
	eof  bool // peer closed: after msgs, io.EOF
	// receipts wait for Receipts or the Group (Config.Receipts), at
	// most maxReceipts; dropped counts those that did not fit.
	receipts        []Receipt
	receiptsDropped uint64
	ready           chan struct{} // capacity 1: Receive's waiters
	streamReady     chan struct{} // capacity 1: Read's waiters

	// took is set when Receive or Read takes a message and cleared by
	// the next Send: a reply (an echo, a response, a client's next
	// request) runs its round on the caller's goroutine (Conn.queue).
	took atomic.Bool

	// Owned by the round (Conn.round).
	delivered bool // signal ready after this round
}

// wake tells the waiting readers to look again: Receive's, and Read's,
// which wait apart so that a Read finding only other messages leaves the
// news to a Receive.
func (q *connRecvQueue) wake() {
	signal(q.ready)
	signal(q.streamReady)
}

// connInGroup is a connection's place in its Group. Guarded by the
// group's mutex.
type connInGroup struct {
	queued  bool // in the group's ready list
	joined  bool // EventConnected reported
	ended   bool // EventDisconnected reported
	noticed bool // the group has seen it (Add)
}

// connState is what the rounds publish for the application's calls
// (Stats, Err, Handshake). Guarded by mu.
type connState struct {
	mu     sync.Mutex
	err    error // why the connection ended
	syn    []byte
	synAck []byte
	// pub is what Stats reads, made by its first call: until then the
	// rounds publish nothing (most of a server's connections are never
	// asked), and watched tells them so without the lock.
	pub     *published
	watched atomic.Bool
}

// published is a connection's counters as its last round left them, and
// their history for the rates.
type published struct {
	stats  Stats
	rates  rateRing
	filled bool          // stats hold a round's values
	ready  chan struct{} // closed once filled (made by the Stats call waiting)
}

func newConn(ep *endpoint, raddr netip.AddrPort, cfg *config, client bool, dialect Dialect) *Conn {
	c := &Conn{
		dialect: dialect,
		ep:      ep,
		raddr:   raddr,
		cfg:     cfg.forDialect(dialect),
		sendq:   connSendQueue{space: make(chan struct{}, 1), lastRef: newRefTag() << (refTagShift - 1)},
		recvq:   connRecvQueue{ready: make(chan struct{}, 1), streamReady: make(chan struct{}, 1)},
		estab:   make(chan struct{}),
		closed:  make(chan struct{}),
		done:    make(chan struct{}),
	}
	c.remote.Store(net.UDPAddrFromAddrPort(raddr))
	c.readDL.init(c.recvq.ready) // SetReadDeadline signals streamReady too
	c.writeDL.init(c.sendq.space)
	c.sess = newSession(cfg, c, client, dialect, time.Now())
	c.joinBudget()
	// A secure connection's c.sec is set by its maker: Dial, or the
	// listener once the client's handshake message and token are read
	// (admitSecure).
	return c
}

func signal(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// isEstablished reports whether the connection's handshake completed (a
// server's: it was offered to Accept or a Group). Safe from any goroutine.
func (c *Conn) isEstablished() bool {
	select {
	case <-c.estab:
		return true
	default:
		return false
	}
}

func (c *Conn) isClosed() bool {
	select {
	case <-c.closed:
		return true
	default:
		return false
	}
}

// SetUserData attaches v to the connection, for the application: the
// player a connection is, typically set by Config.AdmitConn.
func (c *Conn) SetUserData(v any) { c.userData.Store(&v) }

// UserData returns what SetUserData attached, or nil.
func (c *Conn) UserData() any {
	if p, _ := c.userData.Load().(*any); p != nil {
		return *p
	}
	return nil
}

// StartClose begins what CloseWithReason does (reason may be empty) and
// returns at once: for a game loop that kicks a player without waiting
// for the close to end. The end shows on Done, and as EventDisconnected
// in a Group; Err then says how it ended (net.ErrClosed when gracefully).
func (c *Conn) StartClose(reason string) { c.StartCloseWithError(0, reason) }

// StartCloseWithError begins what CloseWithError does and returns at once,
// as StartClose: a game loop's kick with a code the client branches on.
func (c *Conn) StartCloseWithError(code uint32, reason string) {
	c.sendq.mu.Lock()
	if c.sendq.closeReason == nil && (reason != "" || code != 0) {
		c.sendq.closeCode, c.sendq.closeReason = code, reasonBytes(reason)
	}
	c.sendq.mu.Unlock()
	c.userClosed.Store(true)
	c.shutdown()
}

// CloseWithReason is Close, telling the peer why: a kick, a ban, a full
// server, a shutdown. The reason (at most MaxReasonLength bytes) rides in
// the Disconnect; a knet peer's connection then ends with a
// *DisconnectError holding it. A peer that only reads the specification
// ignores it, and the reference dialect cannot carry it. It is
// CloseWithError with code 0.
func (c *Conn) CloseWithReason(reason string) error {
	return c.CloseWithError(0, reason)
}

// CloseWithError is CloseWithReason with a code the peer's program can
// branch on instead of comparing reasons, as QUIC's application error
// codes and GameNetworkingSockets' end reasons: a knet peer's connection
// ends with a *DisconnectError holding both, over UDP (plaintext or
// secure), TCP and WebSocket. The codes are the application's to define;
// 0 means none, and sends exactly what CloseWithReason always did. A peer
// that only reads the specification sees the reason alone, and the
// reference dialect carries neither. Only the first close's code and
// reason are sent.
func (c *Conn) CloseWithError(code uint32, reason string) error {
	c.sendq.mu.Lock()
	if c.sendq.closeReason == nil {
		c.sendq.closeCode, c.sendq.closeReason = code, reasonBytes(reason)
	}
	c.sendq.mu.Unlock()
	return c.Close()
}

// Dialect returns the wire the connection speaks: DialectSpec or
// DialectReference, never DialectAuto.
func (c *Conn) Dialect() Dialect { return c.dialect }

// MaxUnreliablePayload is Config.MaxUnreliablePayload for this
// connection.
func (c *Conn) MaxUnreliablePayload() int { return c.cfg.wholeLimit() }

// Handshake returns the content of the ConnectSyn and of the ConnectSynAck
// of this connection (empty in the reference dialect, which has none).
func (c *Conn) Handshake() (syn, synAck []byte) {
	c.state.mu.Lock()
	defer c.state.mu.Unlock()
	return append([]byte(nil), c.state.syn...), append([]byte(nil), c.state.synAck...)
}

// Stats returns the connection's counters and its recent quality.
//
// It never waits for the connection's next round: a connection publishes
// its counters once asked, and the first call reads them itself between
// rounds (waiting at most for a round under way, as for a lock); its rates
// and loss are averaged over the connection's life so far. Later calls
// read what the rounds published, with rates over the last two seconds.
func (c *Conn) Stats() Stats {
	c.state.mu.Lock()
	p := c.state.pub
	if p == nil {
		p = &published{ready: make(chan struct{})}
		c.state.pub = p
		c.state.watched.Store(true)
	}
	filled := p.filled
	c.state.mu.Unlock()
	for !filled {
		// No round runs while we hold the connection (claim): its
		// session is ours to read, and no worker need come. A round
		// under way publishes as it ends, watched being set; one queued
		// (kicked) has not started: we wait for its turn to pass and
		// claim the connection after it, or find it filled.
		if c.claim() {
			st := c.snapshot()
			c.state.mu.Lock()
			c.fillLocked(p, &st)
			c.state.mu.Unlock()
			c.release()
			break
		}
		select {
		case <-p.ready:
		case <-c.done: // finish filled it
		default:
			runtime.Gosched()
			c.state.mu.Lock()
			filled = p.filled
			c.state.mu.Unlock()
			continue
		}
		break
	}
	now := time.Now()
	c.state.mu.Lock()
	st := p.stats
	p.rates.fill(now, &st)
	c.state.mu.Unlock()
	c.sendq.mu.Lock()
	st.DroppedMessages += c.sendq.drops
	st.QueuedBytes = c.sendq.used
	c.sendq.mu.Unlock()
	c.recvq.mu.Lock()
	st.ReceiveQueuedBytes = c.recvq.msgs.used()
	st.ReceiptsDropped = c.recvq.receiptsDropped
	c.recvq.mu.Unlock()
	st.Jitter = st.RTTVar
	st.Quality = quality(st.LossRate, st.RTT)
	return st
}

// Err returns why the connection ended, or nil while it is up.
func (c *Conn) Err() error {
	select {
	case <-c.done:
	default:
		return nil
	}
	c.state.mu.Lock()
	defer c.state.mu.Unlock()
	return c.state.err
}

// Done returns a channel closed when the connection has ended.
func (c *Conn) Done() <-chan struct{} { return c.done }

// Close ends the connection gracefully: what was sent is delivered and
// acked, then the Disconnect/DisconnectAck exchange runs, all within
// DisconnectTimeout, after which Close returns. Receive and Send fail from
// the moment Close is called. Close is safe from any goroutine, and every
// call waits for the end. After the peer closed (Receive returned io.EOF)
// the end may still be a moment away: the connection first delivers what
// Send accepted if the peer reads on (a Listener's Drain), and a secure
// one then stays to answer the peer's Disconnect again should its answer
// have been lost (nothing else can).
//
// Close returns nil when the connection ended gracefully (this close, or
// the peer's), and otherwise the reason it ended, before Close or during
// it, as Err reports it: a *TimeoutError when the peer fell silent or did
// not answer the Disconnect within DisconnectTimeout (Op "disconnect"),
// ErrPortUnreachable, ErrRetransmitLimit, a *PathMTUError, a
// *ProtocolError. As with a
// net.Conn, only the first call says so: later ones return an error
// wrapping net.ErrClosed. (A Listener's Close, which closes its
// connections, does not count as a call.)
func (c *Conn) Close() error {
	if c.userClosed.Swap(true) {
		<-c.done
		return c.opError("close", net.ErrClosed)
	}
	c.shutdown()
	<-c.done
	c.state.mu.Lock()
	err := c.state.err
	c.state.mu.Unlock()
	if err == net.ErrClosed || errors.Is(err, ErrPeerClosed) {
		return nil // the graceful ends
	}
	return err
}

// shutdown starts the graceful close and releases every waiter. It does
// not wait for the end.
func (c *Conn) shutdown() {
	c.closeOnce.Do(func() {
		c.sendq.mu.Lock()
		c.sendq.closing = true
		c.sendq.mu.Unlock()
		close(c.closed)
		c.kick()
		c.recvq.wake()
		signal(c.sendq.space)
	})
}
