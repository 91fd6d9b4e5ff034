package knet

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/knet-go/knet/internal/udp"
)

// Conn is one kNet connection. It sends and receives messages (Send,
// Receive) and is also a net.Conn whose Read and Write carry a byte stream
// as reliable in-order messages on channel 0 with ID StreamMessageID.
//
// A Conn is safe for concurrent use.
type Conn struct {
	ep      *endpoint
	raddr   netip.AddrPort // owned by loop; changed under ep.mu (moveTo)
	remote  atomic.Pointer[net.UDPAddr]
	cfg     *config
	dialect Dialect // DialectSpec or DialectReference

	// Owned by loop.
	sess     *session
	sec      *secureState // a secure session's keys, nil if plaintext
	released int          // send buffer bytes to hand back
	inWork   []*packet
	// The most datagrams and messages one round took from the inbox and
	// the send queue since the last tidy.
	inPeak, sendPeak int
	// Datagrams the system refused to send, and their bytes (counted
	// sent by the session, taken off in the Stats).
	sendErrs, unsentBytes uint64

	// The goroutine's own, kept while it is parked: the timer, when it
	// is set for, the next deadline, whether the round did anything, and
	// since when nothing was done.
	timer     *time.Timer
	armed     time.Time
	next      time.Time
	active    bool
	quietFrom time.Time

	refusals atomic.Uint32 // port unreachable reports, from the reader

	wake   chan struct{} // capacity 1: inbox, send queue or Close
	parked atomic.Bool   // the goroutine ended while idle: kick starts it

	// Guarded by inMu.
	inMu  sync.Mutex
	inbox []*packet

	// Guarded by sendMu.
	sendMu      sync.Mutex
	sendq       []outMsg
	sendSpare   []outMsg
	lastRef     uint64
	closing     bool   // Close was called
	closeReason []byte // CloseWithReason's
	userData    atomic.Value
	flowReq     int  // FlowControl rate to send, 0 if none
	peerGone    bool // the peer closed
	sendUsed    int  // payload bytes queued or unacked
	sendDrops   uint64
	sendSpace   chan struct{} // capacity 1

	// Guarded by recvMu.
	recvMu    sync.Mutex
	recvq     recvQueue
	recvEOF   bool          // peer closed: after recvq, io.EOF
	recvReady chan struct{} // capacity 1
	delivered bool          // loop-side: signal recvReady after this round

	readDL, writeDL deadline

	// The Group taking this connection's messages, if any. The rest is
	// guarded by the group's mutex.
	group    atomic.Pointer[Group]
	gQueued  bool // in the group's ready list
	gJoined  bool // EventConnected reported
	gEnded   bool // EventDisconnected reported
	gNoticed bool // the group has seen it (Add)

	estOnce    sync.Once
	estab      chan struct{}
	userClosed atomic.Bool // Close was called (not only the Listener's)
	closeOnce  sync.Once
	closed     chan struct{} // Close was called
	done       chan struct{} // loop has exited

	// Guarded by stateMu.
	stateMu   sync.Mutex
	rates     rateRing
	err       error // why the connection ended
	syn       []byte
	synAck    []byte
	stats     Stats
	inDropped uint64
}

func newConn(ep *endpoint, raddr netip.AddrPort, cfg *config, client bool, dialect Dialect) *Conn {
	c := &Conn{
		dialect:   dialect,
		ep:        ep,
		raddr:     raddr,
		cfg:       cfg,
		wake:      make(chan struct{}, 1),
		sendSpace: make(chan struct{}, 1),
		recvReady: make(chan struct{}, 1),
		estab:     make(chan struct{}),
		closed:    make(chan struct{}),
		done:      make(chan struct{}),
	}
	c.remote.Store(net.UDPAddrFromAddrPort(raddr))
	c.readDL.init(c.recvReady)
	c.writeDL.init(c.sendSpace)
	c.sess = newSession(cfg, c, client, dialect == DialectReference, time.Now())
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

// push hands a datagram from the socket reader to the connection. It never
// blocks: a full inbox drops the datagram.
func (c *Conn) push(p *packet) bool {
	c.inMu.Lock()
	if len(c.inbox) >= maxInbox {
		c.inDropped++
		c.inMu.Unlock()
		return false
	}
	c.inbox = append(c.inbox, p)
	c.inMu.Unlock()
	c.kick()
	return true
}

// pushRun hands over several datagrams at once; what does not fit the
// inbox is dropped.
func (c *Conn) pushRun(run []*packet) {
	c.inMu.Lock()
	room := max(0, maxInbox-len(c.inbox))
	take := min(room, len(run))
	c.inbox = append(c.inbox, run[:take]...)
	c.inDropped += uint64(len(run) - take)
	c.inMu.Unlock()
	for _, p := range run[take:] {
		c.ep.putPacket(p)
	}
	if take > 0 {
		c.kick()
	}
}

// maxInbox bounds the datagrams waiting for a connection's goroutine.
const maxInbox = 2048

// loop is the connection's goroutine: it owns the session. It ends when
// the session is done, or, for a while, when the connection has been idle
// for its endpoint's parkAfter: kick starts it again.
func (c *Conn) loop() {
	if c.timer == nil {
		// The timer only wakes the loop, so that waiting is one channel
		// receive; it is moved only when the next deadline changes.
		c.timer = time.AfterFunc(time.Hour, c.kick)
		c.quietFrom = time.Now()
	}
	if c.run() {
		c.timer.Stop()
		c.finish()
		if l := c.ep.l; l != nil {
			l.loops.Done() // Add in handleNew: the connection's goroutine, parked or not, is done
		}
	}
}

// run drives the session until it is done (true) or the connection idle
// (false: the goroutine parked, see park).
func (c *Conn) run() (done bool) {
	s := c.sess
	for {
		now := c.drainInbox()
		if !c.next.IsZero() && !now.Before(c.next) {
			// What arrived while we waited went before the timers: a
			// held message must not outlive its reorder window because
			// the datagram that completes it sat in the inbox.
			s.advance(now)
		}
		c.drainSendQueue(now)
		c.handleEvents()
		c.flush(now)
		s.checkReach(int(c.refusals.Swap(0)))
		c.publish()
		if s.done() {
			return true
		}
		now = time.Now()
		if c.active {
			c.active = false
			c.quietFrom = now
		}
		next := s.nextDeadline(now)
		if !next.After(now) {
			c.next = now // due: the next round runs the timers
			continue
		}
		c.next = next
		wait := next
		if idle := c.quietFrom.Add(c.ep.parkAfter); idle.Before(next) {
			if !now.Before(idle) {
				c.setTimer(next, now)
				if c.park() {
					return false
				}
				continue
			}
			wait = idle // to park then, unless something comes
		}
		c.setTimer(wait, now)
		<-c.wake
	}
}

// setTimer has the timer kick the connection at t.
func (c *Conn) setTimer(t, now time.Time) {
	if t != c.armed {
		c.timer.Reset(t.Sub(now))
		c.armed = t
	}
}

// park ends the connection's goroutine, unless a wake came meanwhile
// (then it reports false and the goroutine goes on). From here kick
// starts a new one; the session's state passes to it through parked.
func (c *Conn) park() bool {
	c.parked.Store(true)
	select {
	case <-c.wake:
		if c.parked.CompareAndSwap(true, false) {
			return false // ours to go on with
		}
		// A kick started another goroutine already: it runs a round
		// at once, so the wake taken here is not lost.
	default:
	}
	if h := c.ep.parkHook; h != nil {
		h(c)
	}
	return true
}

// kick wakes the connection's goroutine, or starts it again if it parked.
// Whatever hands the connection work calls it after handing it over.
func (c *Conn) kick() {
	signal(c.wake)
	if c.parked.Load() && c.parked.CompareAndSwap(true, false) {
		go c.loop()
	}
}

// drainInbox hands the datagrams waiting to the session and returns the
// time it gave them, read once they were taken: a time read before could
// stamp a datagram that came in meanwhile as older than it is, and an ack
// so stamped makes a round-trip sample shorter than the path (a descheduled
// goroutine once put one at 34ms on a 40ms path, which the rate control
// then took for the path's minimum).
func (c *Conn) drainInbox() time.Time {
	c.inMu.Lock()
	work := c.inbox
	c.inbox = c.inWork[:0]
	c.inMu.Unlock()
	now := time.Now()
	c.inPeak = max(c.inPeak, len(work))
	if len(work) > 0 {
		c.active = true
	}
	for i, p := range work {
		if c.sec == nil {
			c.sess.handleDatagram(now, p.b)
		} else {
			c.takeSecure(now, p)
		}
		c.ep.putPacket(p)
		work[i] = nil
	}
	c.inWork = work[:0]
	return now
}

func (c *Conn) drainSendQueue(now time.Time) {
	c.sendMu.Lock()
	q := c.sendq
	c.sendq = c.sendSpare[:0]
	closing, why := c.closing, c.closeReason
	flow := c.flowReq
	c.flowReq = 0
	c.sendMu.Unlock()
	if flow > 0 {
		c.sess.sendFlowControl(flow)
	}
	c.sendPeak = max(c.sendPeak, len(q))
	if len(q) > 0 || closing || flow > 0 {
		c.active = true
	}
	for i := range q {
		m := c.sess.newMsg()
		deps := m.deps[:0] // keep the recycled message's storage
		*m = q[i]
		m.deps = deps
		c.sess.prepare(m)
		c.sess.enqueue(m)
		q[i] = outMsg{}
	}
	c.sendSpare = q[:0]
	if closing {
		if c.sess.closeReason == nil && c.dialect != DialectReference {
			c.sess.closeReason = why
		}
		c.sess.requestClose(now)
	}
	c.sess.flowControl(now)
}

// admit runs the application's Admit hook on a ConnectSyn. A refusal
// carries its reason to the client (the hook's error text, or why the
// server could not take it), unless the listener is stealthy.
func (c *Conn) admit() {
	var reply []byte
	var err error
	syn := append([]byte(nil), c.sess.syn...)
	if c.sec != nil {
		// The listener read the handshake message (admitSecure).
		syn = c.sec.payload
	}
	switch {
	case c.cfg.admitConn != nil:
		reply, err = c.cfg.admitConn(c, syn)
	case c.cfg.admit != nil:
		reply, err = c.cfg.admit(c.remote.Load(), syn)
	}
	if err == nil && c.dialect != DialectReference && len(reply) > c.cfg.payloadLimit() {
		// Cutting it would hand the client something the server never
		// meant to say: refuse, and let the server's stats show why.
		err = ErrHandshakeTooLarge
		c.ep.oversized.Add(1)
	}
	if err == nil && c.ep.l != nil && !c.ep.l.roomToAccept() {
		err = errServerFull
	}
	if err == nil && c.sec != nil {
		c.sec.cid = c.ep.l.newCID(c)
		reply, err = c.sec.writeSynAck(reply)
	}
	if err == nil {
		c.sess.admitted(time.Now(), reply, true)
		return
	}
	if c.ep.l != nil {
		c.ep.refused.Add(1)
	}
	if l := c.cfg.logger; l != nil {
		l.Info("knet: connection refused", "remote", c.remote.Load(), "reason", err)
	}
	var why []byte
	if !c.cfg.stealth && c.dialect != DialectReference {
		why = reasonBytes(err.Error())
		if c.sec != nil {
			why = appendRefusalProof(why, c.sec.msg1) // in clear: see refusalProof
		}
	}
	c.sess.admitted(time.Now(), why, false)
}

// handleEvents acts on what the session's last calls did.
func (c *Conn) handleEvents() {
	ev := c.sess.takeEvents()
	if ev&evAdmit != 0 {
		c.admit()
	}
	if ev&evEstablished != 0 {
		c.established()
	}
	if ev&evPeerClosed != 0 {
		c.peerClosed()
	}
	if ev&evTidy != 0 {
		c.tidy()
	}
}

// tidy lets go of the queues' storage that a burst grew and the last
// keepalive's worth of rounds did not use (see session.tidy): steady
// traffic keeps what it uses, an idle connection little.
func (c *Conn) tidy() {
	// The inbox and the send queue each swap two slices every round.
	big := func(n, peak int) bool { return n > 0 && (peak == 0 || n > 2*peak+16) }
	if big(cap(c.inWork), c.inPeak) {
		c.inWork = nil
	}
	c.inMu.Lock()
	if len(c.inbox) == 0 && big(cap(c.inbox), c.inPeak) {
		c.inbox = nil
	}
	c.inMu.Unlock()
	if big(cap(c.sendSpare), c.sendPeak) {
		c.sendSpare = nil
	}
	c.sendMu.Lock()
	if len(c.sendq) == 0 && big(cap(c.sendq), c.sendPeak) {
		c.sendq = nil
	}
	c.sendMu.Unlock()
	c.inPeak, c.sendPeak = 0, 0
	c.recvMu.Lock()
	c.recvq.trim()
	c.recvMu.Unlock()
}

// flush sends every datagram the session has ready, in batches of one
// system call each.
func (c *Conn) flush(now time.Time) {
	var w *writeBatch
	n := 0
	for {
		if w == nil {
			w = getWriteBatch(c.cfg.maxDatagram + wireOverhead)
		}
		b := c.sess.poll(now, w.buf(n))
		if b == nil {
			break
		}
		if c.sec != nil {
			if b = c.sealOut(b, w.bufs[n]); b == nil {
				continue // the connection failed: nothing goes unsealed
			}
		}
		// A reliable datagram is the session's own buffer, kept until
		// acked; nothing is acked before the batch goes out.
		w.ps[n] = udp.Packet{Buf: b, Addr: c.raddr}
		w.used = max(w.used, n+1)
		if n++; n == len(w.ps) && !w.grow() {
			c.write(w, w.ps[:n])
			c.active = true
			n = 0
		}
	}
	if n > 0 {
		c.write(w, w.ps[:n])
		c.active = true
	}
	if w != nil {
		putWriteBatch(w)
	}
}

// write sends a batch and takes note of what the system refused: a
// reliable datagram among them goes again as if lost on the way.
func (c *Conn) write(w *writeBatch, ps []udp.Packet) {
	if c.ep.writeBatch(w, ps) == nil {
		return
	}
	for i := range ps {
		if err := ps[i].Err; err != nil {
			c.sendErrs++
			c.unsentBytes += uint64(len(ps[i].Buf))
			c.sess.unreachable(err)
		}
	}
}

// refusal is the socket reader's report of an ICMP port unreachable. It
// never blocks.
func (c *Conn) refusal() {
	c.refusals.Add(1)
	c.kick()
}

// isRefusal reports whether err is the system's word that nothing listens
// at the peer's port.
func isRefusal(err error) bool { return errors.Is(err, errConnRefused) }

// snapshot is the session's counters with the connection's corrections:
// what the session built but the system did not send was not sent.
func (c *Conn) snapshot() Stats {
	st := c.sess.snapshot()
	st.DatagramsSent -= c.sendErrs
	st.BytesSent -= c.unsentBytes
	st.SendErrors = c.sendErrs
	if c.sec != nil {
		st.InvalidDatagrams += c.sec.invalid
		st.DuplicateDatagrams += c.sec.replays
		st.Migrations = c.sec.migrations
	}
	if c.ep.l == nil {
		st.SendErrors += c.ep.sendErrs.Load() // the socket is ours alone
	}
	return st
}

// publish hands the round's results to the application side.
func (c *Conn) publish() {
	if c.released > 0 {
		c.sendMu.Lock()
		c.sendUsed -= c.released
		c.sendMu.Unlock()
		c.released = 0
		signal(c.sendSpace)
	}
	if c.delivered {
		c.delivered = false
		signal(c.recvReady)
		if g := c.group.Load(); g != nil {
			g.notify(c)
		}
	}
	st := c.snapshot()
	now := time.Now()
	c.stateMu.Lock()
	st.DroppedDatagrams += c.inDroppedLocked()
	c.stats = st
	c.rates.note(now, &st, c.sess.pidAdvance, c.sess.uniqueIn)
	c.stateMu.Unlock()
}

func (c *Conn) inDroppedLocked() uint64 {
	c.inMu.Lock()
	n := c.inDropped
	c.inMu.Unlock()
	return n
}

// finish runs when the loop exits.
func (c *Conn) finish() {
	s := c.sess
	err := s.err
	c.sendMu.Lock()
	closing := c.closing
	c.sendMu.Unlock()
	c.recvMu.Lock()
	eof := c.recvEOF
	c.recvMu.Unlock()
	switch {
	case err != nil:
	case eof:
		err = ErrPeerClosed
		if len(s.peerReason) > 0 {
			err = &DisconnectError{Reason: string(s.peerReason)}
		}
	case closing:
		err = net.ErrClosed
	default:
		err = net.ErrClosed
	}
	if l := c.cfg.logger; l != nil && s.wasOpen {
		graceful := err == net.ErrClosed || errors.Is(err, ErrPeerClosed)
		level := slog.LevelInfo
		if !graceful {
			level = slog.LevelWarn
		}
		l.Log(context.Background(), level, "knet: connection ended", "remote", c.remote.Load(), "reason", err)
	}
	c.stateMu.Lock()
	c.err = err
	c.stats = c.snapshot()
	c.stats.DroppedDatagrams += c.inDroppedLocked()
	c.stateMu.Unlock()
	c.ep.remove(c)
	c.inMu.Lock()
	for _, p := range c.inbox {
		c.ep.putPacket(p)
	}
	c.inbox = nil
	c.inMu.Unlock()
	close(c.done)
	signal(c.recvReady)
	signal(c.sendSpace)
	c.readDL.stop()
	c.writeDL.stop()
	if g := c.group.Load(); g != nil {
		g.notify(c)
	}
	c.ep.connDone(c)
}

// Session host.

func (c *Conn) deliver(id uint32, payload []byte, buf *[]byte, reliable, inOrder bool) bool {
	c.recvMu.Lock()
	defer c.recvMu.Unlock()
	if !reliable && c.recvq.used()+len(payload) > c.cfg.recvBuffer {
		putPayload(buf)
		return false
	}
	if buf != nil {
		c.recvq.pushOwned(id, payload, buf, reliable, inOrder)
	} else {
		c.recvq.push(id, payload, reliable, inOrder)
	}
	c.delivered = true
	return true
}

func (c *Conn) recvUsed() int {
	c.recvMu.Lock()
	n := c.recvq.used()
	c.recvMu.Unlock()
	return n
}

func (c *Conn) sendDone(n int) { c.released += n }

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

func (c *Conn) established() {
	c.stateMu.Lock()
	c.syn, c.synAck = c.sess.syn, c.sess.synAck
	if c.sec != nil {
		c.syn, c.synAck = c.sec.payload, c.sec.reply
	}
	c.stateMu.Unlock()
	if c.sec != nil && c.ep.l != nil && !c.sec.proven {
		// Opened from another address than the connection's: offered
		// once one is proven (Conn.proven).
		c.sec.offerWait = true
		return
	}
	c.offer()
}

// offer hands an established connection to its application: a server's to
// Accept or its Group (or refuses it after all), a client's to Dial.
func (c *Conn) offer() {
	if l := c.ep.l; l != nil && (!l.useToken(c) || !l.offer(c)) {
		// The backlog filled up since admission, or the connect token
		// was used meanwhile: refuse after all, with a DisconnectAck
		// unless the listener is stealthy (DECISIONS §1: a rejected
		// attempt gets no answer).
		c.sess.refuse(!c.cfg.stealth)
		return
	}
	c.estOnce.Do(func() { close(c.estab) })
	if l := c.cfg.logger; l != nil {
		l.Info("knet: connection established", "remote", c.remote.Load(), "dialect", c.dialect, "client", c.ep.l == nil)
	}
}

func (c *Conn) peerClosed() {
	c.recvMu.Lock()
	c.recvEOF = true
	c.recvMu.Unlock()
	c.sendMu.Lock()
	c.peerGone = true
	c.sendMu.Unlock()
	c.delivered = true
	signal(c.sendSpace)
}

// Messages.

// Send queues m for sending and returns once the payload is copied. A
// reliable message waits for room in the send buffer until the write
// deadline; an unreliable one is dropped and counted if there is none.
// Send fails after Close, once the connection is lost, and for messages
// the protocol cannot carry (see ErrReservedID, ErrMessageTooLarge,
// ErrBadDependency).
func (c *Conn) Send(m Message) error {
	_, err := c.send(context.Background(), &m, false)
	return dropIsNoError(err)
}

// errSendDropped is send's report of an unreliable message dropped for
// lack of room, which Send and friends take for success (the message is
// counted dropped).
var errSendDropped = errors.New("knet: unreliable message dropped: send buffer full")

func dropIsNoError(err error) error {
	if err == errSendDropped {
		return nil
	}
	return err
}

// SendContext is Send that also gives up when ctx is done.
func (c *Conn) SendContext(ctx context.Context, m Message) error {
	if ctx == nil {
		return errNilContext
	}
	_, err := c.send(ctx, &m, false)
	return dropIsNoError(err)
}

// TrySend is Send that never waits: when the send buffer has no room, it
// returns ErrSendBufferFull (the message is not sent; an unreliable one
// is counted dropped), for a game loop that must not stall on one slow
// client.
func (c *Conn) TrySend(m Message) error {
	_, err := c.send(doneCtx, &m, false)
	if err == errSendDropped || errors.Is(err, context.Canceled) {
		return ErrSendBufferFull
	}
	return err
}

// SendRef is Send that also returns a Ref naming the message, so that
// later messages can list it in DependsOn.
func (c *Conn) SendRef(m Message) (Ref, error) {
	ref, err := c.send(context.Background(), &m, true)
	return ref, dropIsNoError(err)
}

func (c *Conn) send(ctx context.Context, m *Message, tracked bool) (Ref, error) {
	if m.ID < MinMessageID || m.ID > MaxMessageID {
		return 0, ErrReservedID
	}
	if len(m.Payload) > c.cfg.maxMessage {
		return 0, ErrMessageTooLarge
	}
	if len(m.DependsOn) > MaxDependencies {
		return 0, ErrBadDependency
	}
	n := len(m.Payload)
	c.sendMu.Lock()
	for {
		if err := c.sendErrLocked(); err != nil {
			c.sendMu.Unlock()
			signal(c.sendSpace) // pass the news to the next waiting sender
			return 0, err
		}
		if c.writeDL.passed() {
			c.sendMu.Unlock()
			return 0, errDeadline
		}
		if c.sendUsed == 0 || c.sendUsed+n <= c.cfg.sendBuffer {
			break
		}
		if !m.Reliable {
			c.sendDrops++
			c.sendMu.Unlock()
			return 0, errSendDropped
		}
		c.sendMu.Unlock()
		if err := waitSignal(ctx, c.sendSpace, c.writeDL.wait()); err != nil {
			return 0, err
		}
		c.sendMu.Lock()
	}
	for _, r := range m.DependsOn {
		if r>>1 == 0 || uint64(r>>1) > c.lastRef || m.Reliable && !r.reliable() {
			c.sendMu.Unlock()
			return 0, ErrBadDependency
		}
	}
	pbuf := getPayload(n)
	c.lastRef++
	ref := Ref(c.lastRef << 1)
	if m.Reliable {
		ref |= 1
	}
	o := outMsg{
		ref:       ref,
		id:        m.ID,
		pbuf:      pbuf,
		payload:   append((*pbuf)[:0], m.Payload...),
		reliable:  m.Reliable,
		inOrder:   m.InOrder,
		tracked:   tracked,
		channel:   m.Channel,
		priority:  m.Priority,
		contentID: m.ContentID,
	}
	if len(m.DependsOn) > 0 {
		o.after = append([]Ref(nil), m.DependsOn...)
	}
	c.sendq = append(c.sendq, o)
	c.sendUsed += n
	room := c.sendUsed < c.cfg.sendBuffer
	c.sendMu.Unlock()
	c.kick()
	if room {
		signal(c.sendSpace) // let another waiting sender look
	}
	return ref, nil
}

// sendErrLocked is why Send cannot queue, or nil.
func (c *Conn) sendErrLocked() error {
	if c.closing {
		return net.ErrClosed
	}
	if c.peerGone {
		return ErrPeerClosed
	}
	select {
	case <-c.done:
		return c.Err()
	default:
		return nil
	}
}

// Receive returns the next message. It waits until one arrives, the read
// deadline passes or ctx is done; a message already waiting is returned
// whatever the deadline or ctx. After the peer closed gracefully and every
// earlier message has been received, it returns io.EOF.
func (c *Conn) Receive(ctx context.Context) (Message, error) {
	var m Message
	if ctx == nil {
		return m, errNilContext
	}
	err := c.waitRecv(ctx, func(q *recvQueue) {
		e := q.peek()
		m = Message{ID: e.id, Payload: q.take(e), Reliable: e.reliable, InOrder: e.inOrder}
	})
	return m, err
}

// ReceiveInto is Receive without allocating: it copies the payload into
// buf and returns the message with Payload aliasing buf. If buf is too
// short the payload is cut to fit and n reports the full length.
func (c *Conn) ReceiveInto(ctx context.Context, buf []byte) (m Message, n int, err error) {
	if ctx == nil {
		return m, 0, errNilContext
	}
	err = c.waitRecv(ctx, func(q *recvQueue) {
		e := q.peek()
		n = e.n
		k := copy(buf, q.bytes(e))
		m = Message{ID: e.id, Payload: buf[:k], Reliable: e.reliable, InOrder: e.inOrder}
		q.pop()
	})
	return m, n, err
}

// waitRecv waits for a message and calls take with the queue locked.
func (c *Conn) waitRecv(ctx context.Context, take func(q *recvQueue)) error {
	for {
		c.recvMu.Lock()
		if c.isClosed() {
			c.recvMu.Unlock()
			signal(c.recvReady) // pass the news to the next waiting reader
			return net.ErrClosed
		}
		if c.recvq.len() > 0 {
			before := c.recvq.used()
			take(&c.recvq)
			more := c.recvq.len() > 0
			after := c.recvq.used()
			c.recvMu.Unlock()
			if more {
				signal(c.recvReady)
			}
			// Reading freed what the peer may be waiting for: let the
			// loop tell it (flow control) and take what it resends.
			if q := c.cfg.recvBuffer / 4; before >= q && after < q {
				c.kick()
			}
			return nil
		}
		eof := c.recvEOF
		c.recvMu.Unlock()
		if eof {
			signal(c.recvReady)
			return io.EOF
		}
		select {
		case <-c.done:
			c.recvMu.Lock()
			n, eof := c.recvq.len(), c.recvEOF
			c.recvMu.Unlock()
			if n > 0 {
				continue
			}
			signal(c.recvReady)
			if eof {
				return io.EOF
			}
			return c.Err()
		default:
		}
		if c.readDL.passed() {
			return errDeadline
		}
		if err := waitSignal(ctx, c.recvReady, c.readDL.wait()); err != nil {
			return err
		}
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
func (c *Conn) StartClose(reason string) {
	c.sendMu.Lock()
	if c.closeReason == nil && reason != "" {
		c.closeReason = reasonBytes(reason)
	}
	c.sendMu.Unlock()
	c.userClosed.Store(true)
	c.shutdown()
}

// CloseWithReason is Close, telling the peer why: a kick, a ban, a full
// server, a shutdown. The reason (at most MaxReasonLength bytes) rides in
// the Disconnect; a knet peer's connection then ends with a
// *DisconnectError holding it. A peer that only reads the specification
// ignores it, and the reference dialect cannot carry it.
func (c *Conn) CloseWithReason(reason string) error {
	c.sendMu.Lock()
	if c.closeReason == nil {
		c.closeReason = reasonBytes(reason)
	}
	c.sendMu.Unlock()
	return c.Close()
}

// Dialect returns the wire the connection speaks: DialectSpec or
// DialectReference, never DialectAuto.
func (c *Conn) Dialect() Dialect { return c.dialect }

// Handshake returns the content of the ConnectSyn and of the ConnectSynAck
// of this connection (empty in the reference dialect, which has none).
func (c *Conn) Handshake() (syn, synAck []byte) {
	c.stateMu.Lock()
	defer c.stateMu.Unlock()
	return append([]byte(nil), c.syn...), append([]byte(nil), c.synAck...)
}

// Stats returns the connection's counters and its recent quality.
func (c *Conn) Stats() Stats {
	now := time.Now()
	c.stateMu.Lock()
	st := c.stats
	c.rates.fill(now, &st)
	c.stateMu.Unlock()
	c.sendMu.Lock()
	st.DroppedMessages += c.sendDrops
	st.QueuedBytes = c.sendUsed
	c.sendMu.Unlock()
	c.recvMu.Lock()
	st.ReceiveQueuedBytes = c.recvq.used()
	c.recvMu.Unlock()
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
	c.stateMu.Lock()
	defer c.stateMu.Unlock()
	return c.err
}

// Done returns a channel closed when the connection has ended.
func (c *Conn) Done() <-chan struct{} { return c.done }

// FlowControl asks the peer to send at most rate datagrams a second (a
// FlowControlRequest); the peer may always send MinDatagramRate.
func (c *Conn) FlowControl(rate int) {
	c.sendMu.Lock()
	c.flowReq = max(rate, 1)
	c.sendMu.Unlock()
	c.kick()
}

// Close ends the connection gracefully: what was sent is delivered and
// acked, then the Disconnect/DisconnectAck exchange runs, all within
// DisconnectTimeout, after which Close returns. Receive and Send fail from
// the moment Close is called. Close is safe from any goroutine, and every
// call waits for the end.
//
// Close returns nil when the connection ended gracefully (this close, or
// the peer's), and otherwise the reason it ended, before Close or during
// it, as Err reports it: a *TimeoutError when the peer fell silent or did
// not answer the Disconnect within DisconnectTimeout (Op "disconnect"),
// ErrPortUnreachable, ErrRetransmitLimit, a *ProtocolError. As with a
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
	c.stateMu.Lock()
	err := c.err
	c.stateMu.Unlock()
	if err == net.ErrClosed || errors.Is(err, ErrPeerClosed) {
		return nil // the graceful ends
	}
	return err
}

// shutdown starts the graceful close and releases every waiter. It does
// not wait for the end.
func (c *Conn) shutdown() {
	c.closeOnce.Do(func() {
		c.sendMu.Lock()
		c.closing = true
		c.sendMu.Unlock()
		close(c.closed)
		c.kick()
		signal(c.recvReady)
		signal(c.sendSpace)
	})
}

// net.Conn.

// Read reads the payloads of received messages as one byte stream, in the
// order they are received; a long payload takes several Reads. It returns
// io.EOF once the peer has closed and everything is read.
func (c *Conn) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	var n int
	for n == 0 {
		err := c.waitRecv(context.Background(), func(q *recvQueue) {
			n = q.read(p)
		})
		if err != nil {
			if err == io.EOF {
				return 0, io.EOF
			}
			return 0, c.opError("read", err)
		}
	}
	return n, nil
}

// Write sends b as one reliable in-order message on channel 0 with ID
// StreamMessageID (several, if b is larger than MaxMessageSize).
func (c *Conn) Write(b []byte) (int, error) {
	n := 0
	for {
		k := min(len(b)-n, c.cfg.maxMessage)
		m := Message{ID: StreamMessageID, Payload: b[n : n+k], Reliable: true, InOrder: true}
		if _, err := c.send(context.Background(), &m, false); err != nil {
			return n, c.opError("write", err)
		}
		n += k
		if n == len(b) {
			return n, nil
		}
	}
}

func (c *Conn) opError(op string, err error) error {
	return &net.OpError{Op: op, Net: "knet", Source: c.LocalAddr(), Addr: c.remote.Load(), Err: err}
}

// LocalAddr returns the local address of the socket.
func (c *Conn) LocalAddr() net.Addr { return c.ep.sock.LocalAddr() }

// RemoteAddr returns the peer's address. A secure connection's client may
// move (NAT rebinding, another network): on the server, the address
// changes once the client proved it receives at the new one (see
// Stats.Migrations).
func (c *Conn) RemoteAddr() net.Addr { return c.remote.Load() }

// SetDeadline sets the read and write deadlines.
func (c *Conn) SetDeadline(t time.Time) error {
	c.readDL.set(t)
	c.writeDL.set(t)
	return nil
}

// SetReadDeadline sets the deadline for Read and Receive.
func (c *Conn) SetReadDeadline(t time.Time) error {
	c.readDL.set(t)
	return nil
}

// SetWriteDeadline sets the deadline for Write and Send.
func (c *Conn) SetWriteDeadline(t time.Time) error {
	c.writeDL.set(t)
	return nil
}
