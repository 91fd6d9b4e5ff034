package knet

import (
	"runtime"
	"sync"
	"time"

	"github.com/knet-go/knet/internal/udp"
)

// Who runs a connection's rounds (Conn.round). A connection has no
// goroutine of its own: whatever hands it work (a datagram, a Send, its
// timer, Close) calls kick, which puts it on its endpoint's run queue, and
// the endpoint's workers take connections from the queue and run a round
// of each. Two shortcuts skip the hand-off when no one else has the
// connection: the socket reader runs the round of a connection it just
// gave a datagram to while it reads one at a time (endpoint.runReady),
// and a dialed connection's Send after a pause runs it on the caller's
// goroutine (runHere).
//
// One goroutine at a time runs a connection: its run state (Conn.run)
// goes idle -> queued -> running -> idle, and a kick while it runs marks
// it to be queued again when it is released.
//
// Each worker (and the reader) gathers the datagrams of the rounds it runs
// into one batch (driver), written with one system call (sendmmsg on
// Linux) when the batch is full or the queue is empty: a game tick that
// queues a snapshot for each of a thousand connections wakes a worker or
// two, not a thousand goroutines, and the snapshots leave in a few dozen
// system calls. A lone datagram goes at once: the queue is empty after
// its round. A connection whose datagrams wait in a batch is held until
// the batch is written, so that no other round frees a buffer the batch
// still points at (a reliable datagram is the session's own buffer until
// acked).

// Run states of a connection (Conn.run).
const (
	runIdle    int32 = iota // no round running, not queued
	runQueued               // in its endpoint's run queue
	runRunning              // a round runs, or its datagrams wait in a batch
	runKicked               // running, and work came meanwhile
	runDone                 // the session ended: no more rounds
)

// scheduler is an endpoint's run queue and its workers. Workers start
// when work is queued and none is free, up to max; one with nothing to do
// waits for work for the endpoint's parkAfter, then ends.
type scheduler struct {
	mu      sync.Mutex
	queue   []*Conn
	head    int
	workers int // started and not ended
	waiting int // waiting for work, less those woken
	max     int
	wake    chan struct{} // a token for each waiting worker woken
	free    []*driver     // drivers of ended workers
	closed  bool          // the endpoint closed: idle workers end at once
	ep      *endpoint
}

// stop has the workers end once the queue is empty (the endpoint closed).
func (q *scheduler) stop() {
	q.mu.Lock()
	q.closed = true
	wake := q.waiting
	q.waiting = 0
	q.mu.Unlock()
	for range wake {
		q.wake <- struct{}{}
	}
}

func (q *scheduler) init(ep *endpoint, workers int) {
	q.ep = ep
	q.max = workers
	q.wake = make(chan struct{}, workers)
}

// workersFor is how many workers an endpoint's scheduler may run: a
// listener's connections may keep every processor busy, a dialed
// connection needs one.
func workersFor(listener bool) int {
	if listener {
		return runtime.GOMAXPROCS(0)
	}
	return 1
}

// push queues c, and wakes or starts a worker if none is free to take it.
func (q *scheduler) push(c *Conn) {
	q.mu.Lock()
	q.queue = append(q.queue, c)
	q.more(1)
}

// pushAll queues cs, and wakes or starts as many workers as may take them.
func (q *scheduler) pushAll(cs []*Conn) {
	q.mu.Lock()
	q.queue = append(q.queue, cs...)
	q.more(len(cs))
}

// more finds workers for n connections just queued; q.mu is held, and
// released.
func (q *scheduler) more(n int) {
	wake := min(n, q.waiting)
	q.waiting -= wake
	n -= wake
	start := 0
	if n > 0 && q.waiting == 0 {
		// Every worker is busy: add one for each connection queued
		// beyond what they will take next.
		busy := q.workers - wake
		start = max(0, min(q.max-q.workers, len(q.queue)-q.head-busy-wake))
	}
	q.workers += start
	q.mu.Unlock()
	for range wake {
		q.wake <- struct{}{}
	}
	for range start {
		go q.work()
	}
}

// pop takes the next connection, or nil if the queue is empty.
func (q *scheduler) pop() *Conn {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.head == len(q.queue) {
		q.queue, q.head = q.queue[:0], 0
		return nil
	}
	c := q.queue[q.head]
	q.queue[q.head] = nil
	q.head++
	if q.head >= 1024 && 2*q.head >= len(q.queue) {
		// A queue that never runs dry (a server behind its load) would
		// otherwise keep what was taken from it.
		n := copy(q.queue, q.queue[q.head:])
		clear(q.queue[n:])
		q.queue, q.head = q.queue[:n], 0
	}
	return c
}

// work is a worker: it runs rounds while connections are queued, writing
// its batch whenever the queue runs dry, and waits for more for
// parkAfter before it ends.
func (q *scheduler) work() {
	d := q.getDriver()
	var idle *time.Timer
	for {
		if c := q.pop(); c != nil {
			c.run.Store(runRunning) // from runQueued: only its taker moves it
			d.run(c)
			continue
		}
		d.write()
		if !q.idle(d, &idle) {
			return
		}
	}
}

// idle waits for work, and reports false if the worker is to end.
func (q *scheduler) idle(d *driver, idle **time.Timer) bool {
	q.mu.Lock()
	if q.head < len(q.queue) {
		q.mu.Unlock()
		return true
	}
	if q.closed {
		return q.end(d)
	}
	q.waiting++
	q.mu.Unlock()
	if *idle == nil {
		*idle = time.NewTimer(q.ep.parkAfter)
	} else {
		(*idle).Reset(q.ep.parkAfter)
	}
	select {
	case <-q.wake:
		(*idle).Stop()
		return true // to work, or to end if the endpoint closed
	case <-(*idle).C:
	}
	q.mu.Lock()
	if q.waiting == 0 {
		// A push counted this worker woken: its token is on the way.
		q.mu.Unlock()
		<-q.wake
		return true
	}
	q.waiting--
	return q.end(d)
}

// end ends a worker; q.mu is held, and released.
func (q *scheduler) end(d *driver) bool {
	q.workers--
	q.mu.Unlock()
	d.close() // its batch was written: this gives back its buffers
	q.putDriver(d)
	return false
}

// kick hands c work: it queues c unless c is queued or running already
// (then a running round is followed by another).
func (c *Conn) kick() {
	if c.mark() {
		c.ep.sched.push(c)
	}
}

// kicks gathers connections to kick together (Broadcast): those of one
// endpoint go on its run queue at once, so that its workers find them all
// there and batch their datagrams.
type kicks struct {
	cs []*Conn
}

var kicksPool = sync.Pool{New: func() any { return new(kicks) }}

func getKicks() *kicks  { return kicksPool.Get().(*kicks) }
func putKicks(k *kicks) { kicksPool.Put(k) }

func (k *kicks) add(c *Conn) { k.cs = append(k.cs, c) }

// run kicks the connections gathered.
func (k *kicks) run() {
	cs := k.cs
	// Those to queue move to the front, grouped by endpoint as they come
	// (a Listener's are one endpoint unless it has several sockets).
	n := 0
	for _, c := range cs {
		if c.mark() {
			cs[n] = c
			n++
		}
	}
	for i := 0; i < n; {
		ep := cs[i].ep
		j := i + 1
		for j < n && cs[j].ep == ep {
			j++
		}
		ep.sched.pushAll(cs[i:j])
		i = j
	}
	clear(cs)
	k.cs = cs[:0]
}

// mark is kick's first half: it reports whether c is to be queued (it
// was idle), and otherwise makes sure a running round is followed by
// another.
func (c *Conn) mark() bool {
	for {
		switch st := c.run.Load(); st {
		case runIdle:
			if c.run.CompareAndSwap(runIdle, runQueued) {
				return true
			}
		case runRunning:
			if c.run.CompareAndSwap(runRunning, runKicked) {
				return false
			}
		default: // queued, kicked or done
			return false
		}
	}
}

// A Send on a dialed connection runs its round on the caller's goroutine
// when at most inlineSendBytes are queued or unacked and the last such
// round was at least inlineGap ago.
const (
	inlineSendBytes = 16 << 10
	inlineGap       = time.Millisecond
)

// runHere runs a round of c, claimed, on the calling goroutine, and
// writes what it produced.
func (q *scheduler) runHere(c *Conn) {
	d := q.getDriver()
	d.run(c)
	d.write()
	q.putDriver(d)
}

// getDriver takes a driver from those no goroutine is using, or makes one.
func (q *scheduler) getDriver() *driver {
	q.mu.Lock()
	defer q.mu.Unlock()
	if n := len(q.free); n > 0 {
		d := q.free[n-1]
		q.free = q.free[:n-1]
		return d
	}
	return newDriver(q.ep)
}

// putDriver gives back a driver whose batch was written.
func (q *scheduler) putDriver(d *driver) {
	q.mu.Lock()
	q.free = append(q.free, d)
	q.mu.Unlock()
}

// claim takes c to run a round of it here, if no one else has it.
func (c *Conn) claim() bool { return c.run.CompareAndSwap(runIdle, runRunning) }

// release ends c's turn: if work came meanwhile, c is queued again.
func (c *Conn) release() {
	if c.run.CompareAndSwap(runRunning, runIdle) {
		return
	}
	if c.run.CompareAndSwap(runKicked, runQueued) {
		c.ep.sched.push(c)
	}
}

// driver runs rounds on one goroutine (a worker, or the socket reader)
// and gathers their datagrams into one batch.
type driver struct {
	ep    *endpoint
	w     *writeBatch
	n     int     // datagrams in w
	owner []*Conn // owner[i] sent w.ps[i]
	held  []*Conn // connections with datagrams in w
	ended []*Conn // connections whose session ended, to finish after the write
	// Connections whose datagrams the system refused: they run again,
	// to act on it.
	failed []*Conn
	// scratch is the space the sessions of its rounds work in, one at a
	// time.
	scratch scratchSpace
}

func newDriver(ep *endpoint) *driver { return &driver{ep: ep} }

// run runs a round of c, which the caller claimed, and holds c until
// the batch is written if the round added to it.
func (d *driver) run(c *Conn) {
	if c.round(d) {
		c.run.Store(runDone)
		d.ended = append(d.ended, c)
		d.write() // its last datagrams (a DisconnectAck) go before it ends
		return
	}
	if d.n > 0 && d.owner[d.n-1] == c {
		// Its datagrams are the batch's last: it waits for the write.
		d.held = append(d.held, c)
		return
	}
	c.release()
}

// buf returns the buffer for the next datagram, of at least size bytes.
func (d *driver) buf(size int) []byte {
	if d.w != nil && d.w.size != size {
		d.write() // connections with another MaxDatagramSize
		putWriteBatch(d.w)
		d.w = nil
	}
	if d.w == nil {
		d.w = getWriteBatch(size)
	}
	return d.w.buf(d.n)
}

// add puts b, c's datagram built in the buffer buf returned (or in the
// session's own), in the batch, writing the batch when it is full.
func (d *driver) add(c *Conn, b []byte) {
	w := d.w
	w.ps[d.n] = udp.Packet{Buf: b, Addr: c.raddr}
	w.used = max(w.used, d.n+1)
	d.owner = append(d.owner, c)
	if d.n++; d.n == len(w.ps) && !w.grow() {
		// Full: written now, and the connections it held released
		// (the one whose round is adding is not among them).
		d.write()
	}
}

// spare is the batch's buffer for the datagram being built, for sealing
// into.
func (d *driver) spare() []byte { return d.w.bufs[d.n] }

// flushBatch writes the batch.
func (d *driver) flushBatch() {
	if d.n == 0 {
		return
	}
	ps := d.w.ps[:d.n]
	if d.ep.writeBatch(d.w, ps) != nil {
		for i := range ps {
			if err := ps[i].Err; err != nil {
				c := d.owner[i]
				c.sendErrs++
				c.unsentBytes += uint64(len(ps[i].Buf))
				c.sess.unreachable(err)
				if len(d.failed) == 0 || d.failed[len(d.failed)-1] != c {
					d.failed = append(d.failed, c)
				}
			}
		}
	}
	clear(d.owner)
	d.owner = d.owner[:0]
	d.n = 0
}

// write writes the batch and releases the connections it held.
func (d *driver) write() {
	d.flushBatch()
	for i, c := range d.held {
		c.release()
		d.held[i] = nil
	}
	d.held = d.held[:0]
	for i, c := range d.failed {
		c.kick()
		d.failed[i] = nil
	}
	d.failed = d.failed[:0]
	for i, c := range d.ended {
		go c.end()
		d.ended[i] = nil
	}
	d.ended = d.ended[:0]
}

// close writes what is left and gives back the batch.
func (d *driver) close() {
	d.write()
	if d.w != nil {
		putWriteBatch(d.w)
		d.w = nil
	}
}
