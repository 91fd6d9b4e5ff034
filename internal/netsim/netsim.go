// Package netsim simulates a bad network path for datagrams: loss (uniform
// or in bursts), latency with jitter, duplication, reordering, corruption
// and a bandwidth cap with a bounded queue. A Link decides what happens to
// each datagram from a seeded random source, so that a run can be replayed;
// a Pipe carries datagrams over a Link with real timers; a Relay is a UDP
// proxy with a Pipe each way; a Network is sockets in memory, with Links
// between them, for tests in testing/synctest bubbles. A Stream is one
// direction of a TCP connection over a Link: the same network as its
// reader lives it, losses turned into stalls.
package netsim

import (
	"container/heap"
	"math"
	"math/rand/v2"
	"net/netip"
	"sync"
	"time"
)

// Params describe one direction of a path. The zero value is a perfect
// path.
type Params struct {
	// Loss is the probability that a datagram is dropped. With BurstLen,
	// it is the long-run average; with BurstDuration, the long-run
	// fraction of time the path drops everything.
	Loss float64
	// BurstLen, when above 1, makes losses come in bursts of this mean
	// length in datagrams (a Gilbert-Elliott chain whose bad state drops
	// everything, stepped once per datagram).
	BurstLen float64
	// BurstDuration, when above 0, makes losses come in bursts of this
	// mean length in time instead: the Gilbert-Elliott chain runs in
	// continuous time, whatever the traffic, so a burst lasts about
	// BurstDuration whether it catches one datagram or a hundred, as
	// on a real link. It takes precedence over BurstLen.
	BurstDuration time.Duration
	// Duplicate is the probability that a datagram is delivered twice.
	Duplicate float64
	// Reorder is the probability that a datagram is held back by
	// ReorderDelay (default 1ms) beyond its normal delay, so that later
	// ones overtake it.
	Reorder      float64
	ReorderDelay time.Duration
	// Delay is the one-way latency; Jitter adds a uniform random 0..Jitter
	// to it, drawn for each datagram on its own, so that jitter reorders
	// datagrams sent closer together than it, as a real path with several
	// routes or queues does.
	Delay  time.Duration
	Jitter time.Duration
	// JitterKeepsOrder makes jitter keep the send order, as a single
	// queue would: a datagram is never delivered before the one sent
	// before it unless Reorder says so.
	JitterKeepsOrder bool
	// Corrupt is the probability that one byte of a datagram is flipped.
	Corrupt float64
	// Bandwidth caps the path in bytes per second (0: no cap). Datagrams
	// queue behind the cap; beyond QueueBytes (default: 50ms at the cap)
	// they are dropped.
	Bandwidth  int
	QueueBytes int
	// MaxSize, when above 0, drops every datagram larger than it, in
	// bytes, as a path with that MTU and no ICMP does (a black hole for
	// path MTU discovery). Link.SetMaxSize changes it on a link in use.
	MaxSize int
	// Seed seeds the random choices.
	Seed uint64
}

// Fate is what happens to one datagram: delivered after each of After
// (none: lost), with byte Flip xor-ed with 0xff if Flip >= 0.
type Fate struct {
	After []time.Duration
	Flip  int
}

// Stats count what a Link did.
type Stats struct {
	Sent, Delivered, Lost, QueueDrops, Duplicated, Reordered, Corrupted uint64
	// TooBig counts the datagrams dropped for being above MaxSize.
	TooBig uint64
	// Bytes counts the bytes of the datagrams sent.
	Bytes uint64
}

// Link decides the fate of datagrams on one direction of a path. It is
// safe for concurrent use.
type Link struct {
	mu       sync.Mutex
	p        Params
	rng      *rand.Rand
	bad      bool      // Gilbert-Elliott state
	badAt    time.Time // when bad was last drawn, with BurstDuration
	badDrawn bool      // bad has been drawn, with BurstDuration
	busy     time.Time // when the bottleneck is free again
	lastOut  time.Time // latest delivery time handed out, for JitterKeepsOrder
	stats    Stats
	queueCap int
}

// NewLink returns a Link with the given parameters.
func NewLink(p Params) *Link {
	if p.ReorderDelay == 0 {
		p.ReorderDelay = time.Millisecond
	}
	l := &Link{p: p, rng: rand.New(rand.NewPCG(p.Seed, p.Seed^0x9e3779b97f4a7c15))}
	if p.Bandwidth > 0 {
		l.queueCap = p.QueueBytes
		if l.queueCap == 0 {
			l.queueCap = p.Bandwidth / 20
		}
	}
	return l
}

// Params returns the link's parameters.
func (l *Link) Params() Params { return l.p }

// SetMaxSize changes the largest datagram the link carries (Params.MaxSize)
// from now on; 0 lifts the limit.
func (l *Link) SetMaxSize(n int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.p.MaxSize = max(n, 0)
}

// Stats returns what the link has done so far.
func (l *Link) Stats() Stats {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.stats
}

// lost draws whether the next datagram, sent at now, is lost.
func (l *Link) lost(now time.Time) bool {
	p := l.p.Loss
	if p <= 0 {
		return false
	}
	if p >= 1 {
		return true
	}
	if l.p.BurstDuration > 0 {
		return l.lostInTime(now)
	}
	if l.p.BurstLen <= 1 {
		return l.rng.Float64() < p
	}
	// The bad state lasts BurstLen datagrams on average: leave it with
	// probability 1/BurstLen; enter it so that its share of time is p.
	leave := 1 / l.p.BurstLen
	enter := p * leave / (1 - p)
	if l.bad {
		if l.rng.Float64() < leave {
			l.bad = false
		}
	} else if l.rng.Float64() < enter {
		l.bad = true
	}
	return l.bad
}

// lostInTime steps the continuous-time Gilbert-Elliott chain to now and
// reports whether it is in the bad state. The bad state lasts
// BurstDuration on average (B) and the good state B(1-p)/p, so that the
// bad state's share of time is p. The chain is memoryless, so it is drawn
// only when a datagram asks: the chance of being bad a time t after being
// in state s (1 bad, 0 good) is p + (s-p)·exp(-t/(B(1-p))). A chain never
// asked before starts from its long-run distribution.
func (l *Link) lostInTime(now time.Time) bool {
	p := l.p.Loss
	pBad := p
	if l.badDrawn {
		t := max(now.Sub(l.badAt), 0)
		s := 0.0
		if l.bad {
			s = 1
		}
		pBad = p + (s-p)*math.Exp(-t.Seconds()/(l.p.BurstDuration.Seconds()*(1-p)))
	}
	l.bad = l.rng.Float64() < pBad
	if !l.badDrawn || now.After(l.badAt) {
		l.badDrawn = true
		l.badAt = now
	}
	return l.bad
}

// Decide returns the fate of a datagram of size bytes sent at now.
func (l *Link) Decide(now time.Time, size int) Fate {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.stats.Sent++
	l.stats.Bytes += uint64(size)
	f := Fate{Flip: -1}
	if l.p.MaxSize > 0 && size > l.p.MaxSize {
		l.stats.TooBig++
		return f
	}
	if l.lost(now) {
		l.stats.Lost++
		return f
	}
	// Bottleneck: serialise at the cap behind what is queued.
	var wait time.Duration
	if l.p.Bandwidth > 0 {
		start := now
		if l.busy.After(now) {
			start = l.busy
		}
		queued := int(start.Sub(now).Seconds() * float64(l.p.Bandwidth))
		if queued+size > l.queueCap {
			l.stats.QueueDrops++
			return f
		}
		tx := time.Duration(float64(size) / float64(l.p.Bandwidth) * float64(time.Second))
		l.busy = start.Add(tx)
		wait = l.busy.Sub(now)
	}
	d := wait + l.p.Delay
	if l.p.Jitter > 0 {
		d += time.Duration(l.rng.Int64N(int64(l.p.Jitter) + 1))
		if l.p.JitterKeepsOrder {
			if at := now.Add(d); at.Before(l.lastOut) {
				d = l.lastOut.Sub(now)
			}
		}
	}
	if l.p.Reorder > 0 && l.rng.Float64() < l.p.Reorder {
		d += l.p.ReorderDelay
		l.stats.Reordered++
	} else if at := now.Add(d); at.After(l.lastOut) {
		l.lastOut = at
	}
	f.After = append(f.After, d)
	if l.p.Duplicate > 0 && l.rng.Float64() < l.p.Duplicate {
		f.After = append(f.After, d+time.Duration(l.rng.Int64N(int64(time.Millisecond))))
		l.stats.Duplicated++
	}
	if l.p.Corrupt > 0 && size > 0 && l.rng.Float64() < l.p.Corrupt {
		f.Flip = l.rng.IntN(size)
		l.stats.Corrupted++
	}
	l.stats.Delivered += uint64(len(f.After))
	return f
}

// Pipe carries datagrams over a Link with real timers, delivering from one
// goroutine in order of due time (ties in send order).
type Pipe struct {
	link *Link
	out  func(b []byte, to netip.AddrPort)

	mu      sync.Mutex
	q       pending
	seq     uint64
	drainAt time.Time     // Drain waits for what is due by then
	drained chan struct{} // closed once it is delivered
	kick    chan struct{}
	shut    chan struct{}
	done    chan struct{}
	close   sync.Once
}

// NewPipe returns a Pipe that hands delivered datagrams to out, which must
// not keep them. Close stops it.
func NewPipe(l *Link, out func(b []byte, to netip.AddrPort)) *Pipe {
	p := &Pipe{link: l, out: out, kick: make(chan struct{}, 1), shut: make(chan struct{}), done: make(chan struct{})}
	go p.run()
	return p
}

// Link returns the pipe's link.
func (p *Pipe) Link() *Link { return p.link }

// Send puts a copy of b on the path towards to.
func (p *Pipe) Send(b []byte, to netip.AddrPort) {
	now := time.Now()
	f := p.link.Decide(now, len(b))
	if len(f.After) == 0 {
		return
	}
	p.mu.Lock()
	for _, d := range f.After {
		c := append([]byte(nil), b...)
		if f.Flip >= 0 {
			c[f.Flip] ^= 0xff
		}
		p.seq++
		heap.Push(&p.q, item{at: now.Add(d), seq: p.seq, b: c, to: to})
	}
	p.mu.Unlock()
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

func (p *Pipe) run() {
	defer close(p.done)
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	var due []item
	for {
		p.mu.Lock()
		due = due[:0]
		now := time.Now()
		for p.q.Len() > 0 && !p.q[0].at.After(now) {
			due = append(due, heap.Pop(&p.q).(item))
		}
		wait := time.Hour
		if p.q.Len() > 0 {
			wait = p.q[0].at.Sub(now)
		}
		drained := p.drained
		if drained != nil && (p.q.Len() == 0 || p.q[0].at.After(p.drainAt)) {
			p.drained = nil
		} else {
			drained = nil
		}
		p.mu.Unlock()
		for _, it := range due {
			p.out(it.b, it.to)
		}
		if drained != nil {
			close(drained) // what was due by drainAt is out
		}
		if len(due) > 0 {
			continue
		}
		t.Reset(wait)
		select {
		case <-t.C:
		case <-p.kick:
		case <-p.shut:
			return
		}
	}
}

// Drain waits until every datagram sent before the call has been handed to
// out, as a real path still delivers what is in flight once its sender is
// done, or until max has passed. It is not for concurrent use.
func (p *Pipe) Drain(max time.Duration) {
	p.mu.Lock()
	var last time.Time
	for _, it := range p.q {
		if it.at.After(last) {
			last = it.at
		}
	}
	if last.IsZero() {
		p.mu.Unlock()
		return
	}
	p.drainAt = last
	p.drained = make(chan struct{})
	drained := p.drained
	p.mu.Unlock()
	select {
	case p.kick <- struct{}{}:
	default:
	}
	t := time.NewTimer(max)
	defer t.Stop()
	select {
	case <-drained:
	case <-t.C:
	case <-p.done:
	}
}

// Close drops what is in flight and stops the delivery goroutine.
func (p *Pipe) Close() {
	p.close.Do(func() { close(p.shut) })
	<-p.done
}

type item struct {
	at   time.Time
	seq  uint64
	b    []byte
	to   netip.AddrPort
	from *Socket // a Network's
}

type pending []item

func (q pending) Len() int { return len(q) }
func (q pending) Less(i, j int) bool {
	if !q[i].at.Equal(q[j].at) {
		return q[i].at.Before(q[j].at)
	}
	return q[i].seq < q[j].seq
}
func (q pending) Swap(i, j int) { q[i], q[j] = q[j], q[i] }
func (q *pending) Push(x any)   { *q = append(*q, x.(item)) }
func (q *pending) Pop() any {
	old := *q
	it := old[len(old)-1]
	*q = old[:len(old)-1]
	return it
}
