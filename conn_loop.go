package knet

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"time"
)

// A connection's rounds (Conn.round), run by its endpoint's scheduler
// (sched.go): each round hands the session the datagrams in the inbox and
// the messages in the send queue, runs its timers, acts on its events,
// adds what it has ready to the driver's batch and publishes the results
// to the application's side. Between rounds a connection holds no
// goroutine; whatever hands it work calls kick. The session calls back
// into the connection (the session host methods) during rounds.

// push hands a datagram from the socket reader to the connection. It never
// blocks: a full inbox drops the datagram.
func (c *Conn) push(p *packet) bool {
	c.inbox.mu.Lock()
	if len(c.inbox.pkts) >= maxInbox {
		c.inbox.dropped++
		c.inbox.mu.Unlock()
		return false
	}
	c.inbox.pkts = append(c.inbox.pkts, p)
	c.inbox.mu.Unlock()
	c.kick()
	return true
}

// pushRun hands over several datagrams at once; what does not fit the
// inbox is dropped. It reports whether any was taken: the caller then
// runs a round of c or kicks it.
func (c *Conn) pushRun(run []*packet) bool {
	c.inbox.mu.Lock()
	room := max(0, maxInbox-len(c.inbox.pkts))
	take := min(room, len(run))
	c.inbox.pkts = append(c.inbox.pkts, run[:take]...)
	c.inbox.dropped += uint64(len(run) - take)
	c.inbox.mu.Unlock()
	for _, p := range run[take:] {
		c.ep.putPacket(p)
	}
	return take > 0
}

// maxInbox bounds the datagrams waiting for a connection's round.
const maxInbox = 2048

// end runs once the session is done: the connection ends.
func (c *Conn) end() {
	c.sched.timer.Stop()
	c.leaveBudget()
	if c.st != nil {
		c.streamFinish()
	} else {
		c.finish()
	}
	if l := c.ep.l; l != nil {
		l.loops.Done() // Add in handleNew
	}
}

// round runs the session until it has nothing to do before its next
// deadline, and reports whether it is done. Its datagrams go in d's batch.
// An idle connection, once quiet for its endpoint's parkAfter, counts as
// parked (parkHook) until work comes.
func (c *Conn) round(d *driver) (done bool) {
	if c.st != nil {
		return c.streamRound()
	}
	s := c.sess
	s.scratch = &d.scratch
	defer func() {
		s.scratch = nil
		d.scratch.release()
	}()
	if c.sched.timer == nil {
		// The timer only kicks the connection; it is moved only when
		// the next deadline changes.
		c.sched.timer = time.AfterFunc(time.Hour, c.kick)
		c.sched.quietFrom = time.Now()
	}
	c.parked.Store(false)
	for {
		now := c.drainInbox()
		if c.ep.relay.Load() != nil {
			c.takeDirect(now) // relay.go
		}
		c.takeMove(now)
		if !c.sched.next.IsZero() && !now.Before(c.sched.next) {
			// What arrived while we waited went before the timers: a
			// held message must not outlive its reorder window because
			// the datagram that completes it sat in the inbox.
			s.advance(now)
		}
		c.drainSendQueue(now)
		c.handleEvents()
		c.flush(now, d)
		if h := c.ep.roundHook; h != nil {
			h(c)
		}
		s.checkReach(int(c.refusals.Swap(0)))
		c.publish()
		if rp := c.ep.repunch.Load(); rp != nil {
			rp.heardNow(s.live.lastRecv)
		}
		if s.done() {
			return true
		}
		now = time.Now()
		if c.sched.active {
			c.sched.active = false
			c.sched.quietFrom = now
		}
		next := s.nextDeadline(now)
		if !next.After(now) {
			c.sched.next = now // due: the next pass runs the timers
			// The batch goes before them: it holds the session's own
			// buffers (a reliable datagram, kept until acked), which
			// the next pass may change. A timeout there resends on the
			// reference wire by renumbering the datagram in place, and
			// the batch then carried it twice under the new PacketID,
			// which the reference drops (CI, once, after a stall of the
			// round longer than the probe timeout).
			d.flushBatch()
			continue
		}
		c.sched.next = next
		wait := next
		if idle := c.sched.quietFrom.Add(c.ep.parkAfter); idle.Before(next) {
			if !now.Before(idle) {
				c.park()
			} else {
				wait = idle // to park then, unless something comes
			}
		}
		c.setTimer(wait, now)
		return false
	}
}

// setTimer has the timer kick the connection at t.
func (c *Conn) setTimer(t, now time.Time) {
	if t != c.sched.armed {
		c.sched.timer.Reset(t.Sub(now))
		c.sched.armed = t
	}
}

// park notes that the connection has been idle for parkAfter: it holds
// nothing but its state until work comes (a datagram, a Send, its timer,
// Close). Tests hear of it (parkHook).
func (c *Conn) park() {
	c.parked.Store(true)
	if h := c.ep.parkHook; h != nil {
		h(c)
	}
}

// drainInbox hands the datagrams waiting to the session and returns the
// time it gave them, read once they were taken: a time read before could
// stamp a datagram that came in meanwhile as older than it is, and an ack
// so stamped makes a round-trip sample shorter than the path (a descheduled
// goroutine once put one at 34ms on a 40ms path, which the rate control
// then took for the path's minimum).
func (c *Conn) drainInbox() time.Time {
	c.inbox.mu.Lock()
	work := c.inbox.pkts
	c.inbox.pkts = c.inbox.work[:0]
	c.inbox.mu.Unlock()
	now := time.Now()
	c.inbox.peak = max(c.inbox.peak, len(work))
	if len(work) > 0 {
		c.sched.active = true
		c.sess.beginRound()
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
	c.inbox.work = work[:0]
	return now
}

func (c *Conn) drainSendQueue(now time.Time) {
	c.sendq.mu.Lock()
	q := c.sendq.msgs
	c.sendq.msgs = c.sendq.spare[:0]
	closing, why, code := c.sendq.closing, c.sendq.closeReason, c.sendq.closeCode
	gone := c.sendq.peerGone // Send refuses from now on: q is its last
	flow := c.sendq.flowReq
	c.sendq.flowReq = 0
	c.sendq.mu.Unlock()
	if flow > 0 {
		c.sess.sendFlowControl(flow)
	}
	c.sendq.peak = max(c.sendq.peak, len(q))
	if len(q) > 0 || closing || flow > 0 {
		c.sched.active = true
	}
	for i := range q {
		m := c.sess.newMsg()
		q[i].outMsg(m)
		c.sess.prepare(m)
		c.sess.enqueue(m)
		q[i] = appMsg{}
	}
	c.sendq.spare = q[:0]
	if gone {
		c.sess.closing.sealed = true // session_close.go
	}
	if closing {
		if c.sess.closing.reason == nil && c.dialect != DialectReference {
			c.sess.closing.code, c.sess.closing.reason = code, why
		}
		if !c.sess.closing.asked && c.dialect != DialectReference {
			// A drain reads on after its Disconnect, and says so
			// (session_close.go); the reference's wire cannot.
			c.sess.closing.readOn = c.readOn.Load() && !c.userClosed.Load()
		}
		c.sess.requestClose(now)
	}
	c.sess.flowControl(now)
}

// admit decides on a ConnectSyn. The application's Admit hook, if it has
// one, runs on a goroutine of its own, since it may take its time (a
// database, a matchmaker): the session waits for the decision meanwhile,
// and a later round takes it (admission).
func (c *Conn) admit() {
	if c.cfg.admitConn == nil && c.cfg.admit == nil {
		c.decide(nil, nil)
		return
	}
	syn := append([]byte(nil), c.sess.handshake.syn...)
	if c.sec != nil {
		// The listener read the handshake message (admitSecure).
		syn = c.sec.payload
	}
	go func() {
		var a admission
		if c.cfg.admitConn != nil {
			a.reply, a.err = c.cfg.admitConn(c, syn)
		} else {
			a.reply, a.err = c.cfg.admit(c.remote.Load(), syn)
		}
		c.sched.admission.Store(&a)
		c.kick()
	}()
}

// admission is the Admit hook's answer.
type admission struct {
	reply []byte
	err   error
}

// decide carries out the decision on a ConnectSyn: the hook's reply and
// error, then the server's own checks. A refusal carries its reason to
// the client (the hook's error text, or why the server could not take
// it), unless the listener is stealthy.
func (c *Conn) decide(reply []byte, err error) {
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
		c.sec.cid, err = c.ep.l.takeCID(c)
	}
	if err == nil && c.sec != nil {
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
			why = appendRefusalProof(why, c.sec.msg1) // in clear: see refusalProofSize
		}
	}
	c.sess.admitted(time.Now(), why, false)
}

// handleEvents acts on what the session's last calls did.
func (c *Conn) handleEvents() {
	if c.abandoned.Load() && c.abandoned.Swap(false) && !c.isEstablished() {
		// Another attempt with its handshake message was established
		// (Listener.establish): this one ends, unanswered.
		c.sess.refuse(false)
	}
	if a := c.sched.admission.Swap(nil); a != nil {
		c.decide(a.reply, a.err)
	}
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
	if big(cap(c.inbox.work), c.inbox.peak) {
		c.inbox.work = nil
	}
	c.inbox.mu.Lock()
	if len(c.inbox.pkts) == 0 && big(cap(c.inbox.pkts), c.inbox.peak) {
		c.inbox.pkts = nil
	}
	c.inbox.mu.Unlock()
	// The send queue's two slices: a game server's thousand connections
	// each took a snapshot and an event a round, yet kept room for 20
	// from the ticks when their rounds fell behind.
	bigQ := func(n, peak int) bool { return n > 2*peak+2 }
	if bigQ(cap(c.sendq.spare), c.sendq.peak) {
		c.sendq.spare = nil
	}
	c.sendq.mu.Lock()
	if len(c.sendq.msgs) == 0 && bigQ(cap(c.sendq.msgs), c.sendq.peak) {
		c.sendq.msgs = nil
	}
	c.sendq.mu.Unlock()
	c.inbox.peak, c.sendq.peak = 0, 0
	c.recvq.mu.Lock()
	c.recvq.msgs.trim()
	c.recvq.mu.Unlock()
}

// flush adds every datagram the session has ready to d's batch.
func (c *Conn) flush(now time.Time, d *driver) {
	size := c.cfg.maxPathDatagram() + wireOverhead
	for {
		b := c.sess.poll(now, d.buf(size))
		if b == nil {
			return
		}
		if c.sec != nil {
			if b = c.sealOut(b, d.spare()); b == nil {
				continue // the connection failed: nothing goes unsealed
			}
		}
		// A reliable datagram is the session's own buffer, kept until
		// acked and changed by nothing before the batch goes out: the
		// driver holds the connection until then, and a round that
		// runs again writes the batch first (round).
		d.add(c, b)
		c.sched.active = true
	}
}

// refusal is the socket reader's report of an ICMP port unreachable. It
// never blocks.
func (c *Conn) refusal() {
	c.refusals.Add(1)
	c.kick()
}

// snapshot is the session's counters with the connection's corrections:
// what the session built but the system did not send was not sent.
func (c *Conn) snapshot() Stats {
	if c.st != nil {
		return c.streamSnapshot()
	}
	st := c.sess.snapshot()
	st.DatagramsSent -= c.sendErrs
	st.BytesSent -= c.unsentBytes
	st.SendErrors = c.sendErrs
	if c.sec != nil {
		st.InvalidDatagrams += c.sec.invalid
		st.DuplicateDatagrams += c.sec.replays
		st.Migrations = c.sec.migrations
		st.KeyUpdates = c.sec.keyUpdateCount()
	}
	if c.ep.l == nil {
		st.SendErrors += c.ep.sendErrs.Load() // the socket is ours alone
	}
	return st
}

// publish hands the round's results to the application side.
func (c *Conn) publish() {
	c.budgetRound()
	if c.sendq.released > 0 {
		c.sendq.mu.Lock()
		c.sendq.used -= c.sendq.released
		c.sendq.mu.Unlock()
		c.sendq.released = 0
		signal(c.sendq.space)
	}
	if c.recvq.delivered {
		c.recvq.delivered = false
		c.recvq.wake()
		if g := c.group.Load(); g != nil {
			g.notify(c)
		}
	}
	if c.state.watched.Load() {
		st := c.snapshot()
		c.state.mu.Lock()
		c.fillLocked(c.state.pub, &st)
		c.state.mu.Unlock()
	}
}

// fillLocked publishes st, the session's counters, in p.
func (c *Conn) fillLocked(p *published, st *Stats) {
	st.DroppedDatagrams += c.inDroppedLocked()
	p.stats = *st
	s := c.sess
	if !p.filled {
		// The first window: the connection's life so far.
		p.rates.note(s.live.epoch, &Stats{}, 0, 0)
	}
	p.rates.note(time.Now(), st, s.recv.pidAdvance, s.recv.uniqueIn)
	if !p.filled {
		p.filled = true
		if p.ready != nil {
			close(p.ready)
		}
	}
}

func (c *Conn) inDroppedLocked() uint64 {
	c.inbox.mu.Lock()
	n := c.inbox.dropped
	c.inbox.mu.Unlock()
	return n
}

// finish runs when the session is done (Conn.end).
func (c *Conn) finish() {
	s := c.sess
	err := s.err
	c.sendq.mu.Lock()
	closing := c.sendq.closing
	c.sendq.mu.Unlock()
	c.recvq.mu.Lock()
	eof := c.recvq.eof
	c.recvq.mu.Unlock()
	switch {
	case err != nil:
	case eof:
		err = ErrPeerClosed
		if len(s.closing.peerReason) > 0 || s.closing.peerCode != 0 {
			err = &DisconnectError{Code: s.closing.peerCode, Reason: string(s.closing.peerReason)}
		}
	case closing:
		err = net.ErrClosed
	default:
		err = net.ErrClosed
	}
	if l := c.cfg.logger; l != nil && s.opened() {
		graceful := err == net.ErrClosed || errors.Is(err, ErrPeerClosed)
		level := slog.LevelInfo
		if !graceful {
			level = slog.LevelWarn
		}
		l.Log(context.Background(), level, "knet: connection ended", "remote", c.remote.Load(), "reason", err)
	}
	c.endUnacked() // unacked.go
	st := c.snapshot()
	c.state.mu.Lock()
	c.state.err = err
	if c.state.pub == nil {
		c.state.pub = new(published) // for a Stats call after the end
	}
	c.fillLocked(c.state.pub, &st)
	c.state.mu.Unlock()
	c.ep.remove(c)
	c.inbox.mu.Lock()
	for _, p := range c.inbox.pkts {
		c.ep.putPacket(p)
	}
	c.inbox.pkts = nil
	c.inbox.mu.Unlock()
	close(c.done)
	c.recvq.wake()
	signal(c.sendq.space)
	c.readDL.stop()
	c.writeDL.stop()
	if g := c.group.Load(); g != nil {
		g.notify(c)
	}
	c.ep.connDone(c)
}

// Session host.

func (c *Conn) deliver(ds []delivery) {
	c.recvq.mu.Lock()
	defer c.recvq.mu.Unlock()
	q := &c.recvq.msgs
	q.compact()
	for i := range ds {
		d := &ds[i]
		if !d.reliable && c.st == nil && q.charged()+len(d.payload)+recvEntryCost > c.cfg.recvBuffer {
			// (A stream's messages are never dropped here: its rounds
			// stop reading the stream instead, see streamInput.)
			putPayload(d.buf)
			continue
		}
		if d.buf != nil {
			q.pushOwned(d.id, d.payload, d.buf, d.reliable, d.inOrder)
		} else {
			q.add(d.id, d.payload, d.reliable, d.inOrder)
		}
		d.taken = true
		c.recvq.delivered = true
	}
	q.peaks()
}

func (c *Conn) recvUsed() int {
	c.recvq.mu.Lock()
	n := c.recvq.msgs.charged()
	c.recvq.mu.Unlock()
	return n
}

func (c *Conn) sendDone(n int) { c.sendq.released += n }

func (c *Conn) receipt(r Receipt) {
	c.recvq.mu.Lock()
	if len(c.recvq.receipts) == maxReceipts {
		// Nobody takes them: the oldest quarter goes.
		n := copy(c.recvq.receipts, c.recvq.receipts[maxReceipts/4:])
		c.recvq.receipts = c.recvq.receipts[:n]
		c.recvq.receiptsDropped += maxReceipts / 4
	}
	c.recvq.receipts = append(c.recvq.receipts, r)
	c.recvq.mu.Unlock()
	c.recvq.delivered = true
}

// Receipts appends to dst the receipts that came since the last call
// (Config.Receipts), without waiting, and returns it. In a Group, they
// come out of Poll instead (whichever takes them first).
func (c *Conn) Receipts(dst []Receipt) []Receipt {
	c.recvq.mu.Lock()
	dst = append(dst, c.recvq.receipts...)
	clear(c.recvq.receipts)
	c.recvq.receipts = c.recvq.receipts[:0]
	c.recvq.mu.Unlock()
	return dst
}

func (c *Conn) established() {
	c.state.mu.Lock()
	c.state.syn, c.state.synAck = c.sess.handshake.syn, c.sess.handshake.synAck
	if c.sec != nil {
		c.state.syn, c.state.synAck = c.sec.payload, c.sec.reply
	}
	c.state.mu.Unlock()
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
	if l := c.ep.l; l != nil && l.establish(c) != nil {
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
	c.recvq.mu.Lock()
	c.recvq.eof = true
	c.recvq.mu.Unlock()
	c.sendq.mu.Lock()
	c.sendq.peerGone = true
	c.sendq.mu.Unlock()
	c.recvq.delivered = true
	signal(c.sendq.space)
	if c.st == nil {
		// The next round takes what Send queued before it refused, and
		// tells the session that nothing more comes (drainSendQueue):
		// a connection delivering it before its DisconnectAck waits
		// for that.
		c.kick()
	}
}
