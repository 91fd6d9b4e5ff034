package knet

import (
	"errors"
	"fmt"
	"net"
	"sync/atomic"
	"time"
)

// The Listener's receive budget (Config.ReceiveBudget): a bound on what
// all its connections together hold of what their peers sent and the
// application has not taken. ReceiveBuffer, ReassemblyBuffer and
// MaxMessageSize bound each connection; nothing else bounds their sum.
//
// What counts, for each connection (holding):
//   - the receive queue, as ReceiveBuffer counts it (recvQueue.charged);
//   - over UDP, the messages held for what they depend on (resolver.bytes,
//     or the reference wire's relHeldBytes) and the unfinished fragmented
//     transfers (reassembly.bytes);
//   - over a stream, the unfinished frame (tcpFramer.buffered), a first
//     frame waiting for the admission, and what the reader read ahead of
//     the rounds (streamConn.inN).
//
// Where it is counted: each connection adds the change in what it holds to
// the Listener's sum (receiveBudget.held) at the end of each round, and in
// the round whenever it grew or shrank by a step since (admits, and a
// stream's input), so that one round's datagrams cannot take the sum far
// past the budget unseen. A datagram costs a few additions and the load of
// a flag that changes only when the budget becomes spent or stops being.
//
// The rule: while the sum is at the budget or past it (spent), a
// connection holding more than its share, the budget divided among the
// Listener's connections, takes nothing more (budgetShare.refuses). Over
// UDP its reliable datagrams go unacked unless they make progress (fill
// what held messages wait for: see specWire.admits), its unreliable
// messages are dropped; a stream is not read. The others go on. A
// connection still over its share of a spent budget budgetGrace later is
// closed with budgetReason (closeOverBudget), and what it holds is let go
// when it ends.
//
// Those under their share may still take up to it while the ones over
// theirs wait for their close: past the budget by an eighth (full), every
// connection takes nothing more but what makes progress, until the sum is
// back under. The sum thus stays below the budget and an eighth, plus, for
// each round running at once, a step and a datagram, and for each
// stream not read what its reader reads ahead (streamInLimit and a
// read).

// receiveBudget is a Listener's budget. It is safe for concurrent use.
type receiveBudget struct {
	limit, ceiling int64 // spent, full (see budgetUnder)
	step           int   // see maxBudgetStep
	grace          time.Duration
	_              [64]byte
	// level is what held was, as the last report left it: loaded for
	// each datagram that would add, stored only when it changes, in a
	// cache line of its own.
	level atomic.Int32
	_     [64]byte
	// Atomic.
	held   atomic.Int64  // what the connections last reported holding
	conns  atomic.Int64  // the Listener's connections
	closed atomic.Uint64 // ListenerStats.ClosedOverBudget
}

// Budget levels: under the limit, at it or past it (spent: those over
// their share take nothing more), past the ceiling (full: nobody does). A
// budget spent stays so until the sum is back under seven eighths of it:
// what the connections under their share take and let go, as their
// application reads, does not start the grace of those over theirs anew
// each time.
const (
	budgetUnder int32 = iota
	budgetSpent
	budgetFull
)

// maxBudgetStep is how far what a connection holds may move within a
// round before it tells the budget: a 64th of the budget (an eighth of its
// headroom), at most this.
const maxBudgetStep = 64 << 10

// budgetReason is what a connection closed over the budget tells its peer.
const budgetReason = "knet: over the server's receive budget"

// ErrOverBudget ends a Listener's connection that held more than its share
// of Config.ReceiveBudget while the budget was spent, for longer than the
// budget's grace (see Config.ReceiveBudget). Its peer hears why.
var ErrOverBudget = fmt.Errorf("knet: the peer held more than its share of the receive budget: %w", net.ErrClosed)

func newReceiveBudget(cfg *config) *receiveBudget {
	limit := int64(cfg.receiveBudget)
	return &receiveBudget{limit: limit, ceiling: limit + limit/8, step: int(min(limit/64, maxBudgetStep)), grace: budgetGrace(cfg)}
}

// budgetGrace is how long a connection may stay over its share while the
// budget is spent: twice DatagramTimeout, time for its peer to resend what
// fills a hole, and for the application to read what it was handed.
func budgetGrace(cfg *config) time.Duration { return max(2*cfg.datagramTimeout, time.Second) }

// share is what each connection may hold while the budget is spent.
func (b *receiveBudget) share() int64 { return b.limit / max(b.conns.Load(), 1) }

// spent reports whether the budget is spent.
func (b *receiveBudget) spent() bool { return b.level.Load() >= budgetSpent }

// budgetShare is one connection's part in its Listener's budget. Owned by
// the round.
type budgetShare struct {
	b         *receiveBudget
	charged   int         // what b.held counts for this connection
	overSince time.Time   // since when it has been over its share, zero if not
	timer     *time.Timer // kicks the connection when its grace runs out, or to look again
	closing   bool        // closed over the budget (closeOverBudget)
	stalled   bool        // a stream left unread this round (streamOverBudget)
}

// budgetRecheck is how soon a stream left unread for the budget looks
// again: nothing else wakes it when the budget has room again, as a UDP
// peer's resent datagrams do.
const budgetRecheck = 100 * time.Millisecond

// report makes the budget count mine for this connection.
func (p *budgetShare) report(mine int) {
	d := mine - p.charged
	if d == 0 {
		return
	}
	b := p.b
	p.charged = mine
	held := b.held.Add(int64(d))
	was := b.level.Load()
	level := was
	switch {
	case held >= b.ceiling:
		level = budgetFull
	case held >= b.limit:
		level = budgetSpent
	case held < b.limit-b.limit/8:
		level = budgetUnder
	case was == budgetFull:
		level = budgetSpent
	}
	if level != was {
		b.level.Store(level)
	}
}

// refuses reports whether the connection, holding mine, is to take
// nothing more: it is being closed over the budget, the budget is full, or
// it is spent and the connection holds more than its share. It first
// reports mine if it moved by a step since the last report.
func (p *budgetShare) refuses(mine int) bool {
	if d := mine - p.charged; d >= p.b.step || d <= -p.b.step {
		p.report(mine)
	}
	switch p.b.level.Load() {
	case budgetUnder:
		return p.closing
	case budgetSpent:
		return p.closing || int64(mine) > p.b.share()
	}
	return true
}

// over reports whether the connection, holding mine, is over its share of
// a spent budget: what closes it if it lasts.
func (p *budgetShare) over(mine int) bool { return p.b.spent() && int64(mine) > p.b.share() }

// pressed reports whether the connection may be refused at all: the budget
// is spent, or the connection is being closed over it. Cheap, for what
// only a refusal needs to measure.
func (p *budgetShare) pressed() bool { return p.closing || p.b.spent() }

// joinBudget gives a Listener's connection its share of the budget.
func (c *Conn) joinBudget() {
	if l := c.ep.l; l != nil && l.budget != nil {
		c.sess.budget = &budgetShare{b: l.budget}
		l.budget.conns.Add(1)
	}
}

// holding is what a UDP session holds of what its peer sent, the receive
// queue's used bytes given.
func (s *session) holding(used int) int {
	n := used + s.recv.res.bytes + s.recv.reasm.bytes
	if w, ok := s.wire.(*cppWire); ok {
		n += w.relHeldBytes
	}
	return n
}

// overBudget reports whether the session, whose receive queue holds used,
// is to take nothing more (budgetShare.refuses).
func (s *session) overBudget(used int) bool {
	if s.budget == nil {
		return false
	}
	return s.budget.refuses(s.holding(used))
}

// dropOverBudget reports whether an unreliable message is to be dropped
// for the budget: without measuring unless the budget is spent.
func (s *session) dropOverBudget() bool {
	return s.budget != nil && s.budget.pressed() && s.overBudget(s.recvUsed())
}

// holding is what the connection holds of what its peer sent.
func (c *Conn) holding() int {
	if c.st == nil {
		return c.sess.holding(c.recvUsed())
	}
	st, s := c.st, c.st.sess
	st.mu.Lock()
	ahead := st.inN
	st.mu.Unlock()
	return c.recvUsed() + s.fr.buffered() + len(s.first) + ahead
}

// streamOverBudget reports whether a stream is not to be read for the
// budget (budgetShare.refuses).
func (c *Conn) streamOverBudget() bool {
	p := c.sess.budget
	if p == nil || !p.refuses(c.holding()) {
		return false
	}
	p.stalled = true
	return true
}

// watch follows a connection holding mine at now, once a round: it
// reports whether the connection has been over its share of a spent
// budget for the grace (expired), and otherwise, when it is over, how long
// until then (wait).
func (p *budgetShare) watch(mine int, now time.Time) (wait time.Duration, expired bool) {
	if p.closing || !p.over(mine) {
		p.overSince = time.Time{}
		return 0, false
	}
	if p.overSince.IsZero() {
		p.overSince = now
	}
	wait = p.b.grace - now.Sub(p.overSince)
	return wait, wait <= 0
}

// budgetRound ends each round of a Listener's connection: it reports what
// the connection holds, and closes it once it has been over its share of a
// spent budget for the grace. The clock is read only for one that is.
func (c *Conn) budgetRound() {
	p := c.sess.budget
	if p == nil {
		return
	}
	mine := c.holding()
	p.report(mine)
	stalled := p.stalled && !p.closing
	p.stalled = false
	if !stalled && p.overSince.IsZero() && (p.closing || !p.over(mine)) {
		return
	}
	wait, expired := p.watch(mine, time.Now())
	if expired {
		c.closeOverBudget()
		return
	}
	if stalled && (wait <= 0 || wait > budgetRecheck) {
		wait = budgetRecheck
	}
	switch {
	case wait <= 0: // no longer over
		if p.timer != nil {
			p.timer.Stop()
		}
	case p.timer == nil:
		p.timer = time.AfterFunc(wait, c.kick)
	default:
		p.timer.Reset(wait)
	}
}

// closeOverBudget closes the connection as CloseWithReason does, telling
// the peer budgetReason; it takes nothing more meanwhile. A stream, which
// is not read any more, ends once the reason and its end are written, as
// a refused one does, instead of waiting for the peer's end.
func (c *Conn) closeOverBudget() {
	p := c.sess.budget
	p.closing = true
	p.overSince = time.Time{}
	p.b.closed.Add(1)
	if l := c.cfg.logger; l != nil {
		l.Warn("knet: closing a connection over the receive budget", "remote", c.RemoteAddr(), "holding", p.charged, "share", p.b.share())
	}
	why := reasonBytes(budgetReason)
	if st := c.st; st != nil {
		switch s := st.sess; {
		case s.err != nil:
		case st.phase != phaseOpen:
			c.streamRefused(errors.New(budgetReason), s.knet)
		default:
			st.closing, st.reason = true, why
			if s.knet && !s.peerClose && !st.byeSent {
				s.sendHello(helloClose, why)
				st.byeSent = true
			}
			s.err = ErrOverBudget
		}
	}
	c.closeFor(0, why)
}

// leaveBudget runs as the connection ends: the budget no longer counts it,
// and one closed over it ends with ErrOverBudget, whatever its close met.
func (c *Conn) leaveBudget() {
	p := c.sess.budget
	if p == nil {
		return
	}
	p.report(0)
	p.b.conns.Add(-1)
	if p.timer != nil {
		p.timer.Stop()
	}
	if !p.closing {
		return
	}
	if c.st != nil {
		if !errors.Is(c.st.sess.err, ErrRefused) { // refused before it opened
			c.st.sess.err = ErrOverBudget
		}
	} else {
		c.sess.err = ErrOverBudget
	}
}

// fill adds the budget's figures to st.
func (b *receiveBudget) fill(st *ListenerStats) {
	if b == nil {
		return
	}
	st.ReceiveHeld = int(b.held.Load())
	st.ClosedOverBudget = b.closed.Load()
}
