package main

import (
	"math/rand/v2"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"
)

// pathConfig describes one direction of the emulated path.
type pathConfig struct {
	Delay time.Duration // one-way propagation delay
	Loss  float64       // probability that a datagram is dropped, 0..1
	Rate  float64       // bottleneck, bytes per second; 0 means unlimited
	Queue int           // bottleneck queue, bytes (drop-tail); used when Rate > 0
	Seed  uint64        // seed of the random drops
}

// relay is an in-process UDP middlebox: clients send to its front socket,
// it forwards each client's datagrams to the target from a socket of its
// own for that client, and the target's replies back to the client. Each
// direction goes through a link that drops at random, serialises through a
// bandwidth-limited drop-tail queue and delays by a fixed amount.
type relay struct {
	front  *net.UDPConn
	target *net.UDPAddr

	up, down *link // client→target, target→client

	mu     sync.Mutex
	flows  map[netip.AddrPort]*net.UDPConn
	closed bool
	wg     sync.WaitGroup
	done   chan struct{}
}

// linkStats are counts of one direction, in datagrams.
type linkStats struct {
	Offered, Lost, QueueDrops, Overflow, Delivered uint64
}

func (s linkStats) sub(o linkStats) linkStats {
	return linkStats{s.Offered - o.Offered, s.Lost - o.Lost, s.QueueDrops - o.QueueDrops, s.Overflow - o.Overflow, s.Delivered - o.Delivered}
}

// Dropped counts every datagram the link did not deliver.
func (s linkStats) Dropped() uint64 { return s.Lost + s.QueueDrops + s.Overflow }

func newRelay(target string, up, down pathConfig) (*relay, error) {
	taddr, err := net.ResolveUDPAddr("udp", target)
	if err != nil {
		return nil, err
	}
	front, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		return nil, err
	}
	front.SetReadBuffer(4 << 20)
	front.SetWriteBuffer(4 << 20)
	r := &relay{
		front:  front,
		target: taddr,
		flows:  make(map[netip.AddrPort]*net.UDPConn),
		done:   make(chan struct{}),
	}
	r.up = newLink(up, r.done, 1)
	r.down = newLink(down, r.done, 2)
	r.wg.Add(3)
	go func() { defer r.wg.Done(); r.up.run() }()
	go func() { defer r.wg.Done(); r.down.run() }()
	go func() { defer r.wg.Done(); r.readFront() }()
	return r, nil
}

// Addr is where clients send to reach the target.
func (r *relay) Addr() string { return r.front.LocalAddr().String() }

func (r *relay) Close() error {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return nil
	}
	r.closed = true
	close(r.done)
	r.front.Close()
	for _, c := range r.flows {
		c.Close()
	}
	r.mu.Unlock()
	r.wg.Wait()
	return nil
}

func (r *relay) readFront() {
	buf := make([]byte, 64<<10)
	for {
		n, from, err := r.front.ReadFromUDPAddrPort(buf)
		if err != nil {
			select {
			case <-r.done:
				return
			default:
				continue // e.g. ICMP errors reported on the socket
			}
		}
		back := r.flow(from)
		if back == nil {
			continue
		}
		r.up.offer(buf[:n], back, netip.AddrPort{})
	}
}

// flow returns the relay's socket towards the target for client from,
// opening it on first use.
func (r *relay) flow(from netip.AddrPort) *net.UDPConn {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil
	}
	if c := r.flows[from]; c != nil {
		return c
	}
	c, err := net.DialUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)}, r.target)
	if err != nil {
		return nil
	}
	c.SetReadBuffer(4 << 20)
	c.SetWriteBuffer(4 << 20)
	r.flows[from] = c
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		buf := make([]byte, 64<<10)
		for {
			n, err := c.Read(buf)
			if err != nil {
				select {
				case <-r.done:
					return
				default:
					continue
				}
			}
			r.down.offer(buf[:n], r.front, from)
		}
	}()
	return c
}

// link is one direction of the path: a drop stage, a bottleneck queue
// model and a delay line drained by one goroutine.
type link struct {
	cfg  pathConfig
	done chan struct{}
	q    chan relayPacket
	pool sync.Pool

	mu       sync.Mutex
	rng      *rand.Rand
	linkFree time.Time // when the bottleneck finishes sending what it holds

	offered, lost, queueDrops, overflow, delivered atomic.Uint64
}

type relayPacket struct {
	b   *[]byte
	n   int
	due time.Time
	out *net.UDPConn
	to  netip.AddrPort // zero: out is connected
}

const linkSlots = 1 << 16

func newLink(cfg pathConfig, done chan struct{}, stream uint64) *link {
	l := &link{
		cfg:  cfg,
		done: done,
		q:    make(chan relayPacket, linkSlots),
		rng:  rand.New(rand.NewPCG(cfg.Seed, stream)),
	}
	l.pool.New = func() any { b := make([]byte, 2048); return &b }
	return l
}

func (l *link) stats() linkStats {
	return linkStats{l.offered.Load(), l.lost.Load(), l.queueDrops.Load(), l.overflow.Load(), l.delivered.Load()}
}

// offer takes a datagram arriving at the link at the current time.
func (l *link) offer(b []byte, out *net.UDPConn, to netip.AddrPort) {
	l.offered.Add(1)
	now := time.Now()
	l.mu.Lock()
	if l.cfg.Loss > 0 && l.rng.Float64() < l.cfg.Loss {
		l.mu.Unlock()
		l.lost.Add(1)
		return
	}
	due := now
	if l.cfg.Rate > 0 {
		if l.linkFree.Before(now) {
			l.linkFree = now
		}
		backlog := l.linkFree.Sub(now).Seconds() * l.cfg.Rate // bytes still queued
		if int(backlog)+len(b) > l.cfg.Queue {
			l.mu.Unlock()
			l.queueDrops.Add(1)
			return
		}
		l.linkFree = l.linkFree.Add(time.Duration(float64(len(b)) / l.cfg.Rate * float64(time.Second)))
		due = l.linkFree
	}
	l.mu.Unlock()
	due = due.Add(l.cfg.Delay)

	var p *[]byte
	if len(b) <= 2048 {
		p = l.pool.Get().(*[]byte)
	} else {
		big := make([]byte, len(b))
		p = &big
	}
	n := copy(*p, b)
	select {
	case l.q <- relayPacket{b: p, n: n, due: due, out: out, to: to}:
	default:
		l.overflow.Add(1)
		l.put(p)
	}
}

func (l *link) put(p *[]byte) {
	if cap(*p) == 2048 {
		l.pool.Put(p)
	}
}

// run sends each datagram when it is due. Datagrams enter in order of
// their due time (constant delay, FIFO bottleneck), so a FIFO suffices.
func (l *link) run() {
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	for {
		var p relayPacket
		select {
		case p = <-l.q:
		case <-l.done:
			return
		}
		if d := time.Until(p.due); d > 0 {
			t.Reset(d)
			select {
			case <-t.C:
			case <-l.done:
				return
			}
		}
		b := (*p.b)[:p.n]
		var err error
		if p.to.IsValid() {
			_, err = p.out.WriteToUDPAddrPort(b, p.to)
		} else {
			_, err = p.out.Write(b)
		}
		if err == nil {
			l.delivered.Add(1)
		}
		l.put(p.b)
	}
}
