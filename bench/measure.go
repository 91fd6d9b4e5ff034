package main

import (
	"encoding/binary"
	"fmt"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// epoch is the origin of the send timestamps carried in payloads; sender
// and receiver share the process, hence the monotonic clock.
var epoch = time.Now()

func stamp(b []byte) { binary.LittleEndian.PutUint64(b, uint64(time.Since(epoch))) }

func stampOf(b []byte) time.Duration { return time.Duration(binary.LittleEndian.Uint64(b)) }

// percentile returns the p-quantile (0..1) of sorted durations.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(float64(len(sorted))*p+0.5) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

func us(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }
func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

const loopback = "127.0.0.1:0"

// addNote records the counters of conns that have them.
func addNote(e *env, who string, c msgConn) {
	if n, ok := c.(noter); ok {
		e.note("%s: %s", who, n.Note())
	}
}

// ---------------------------------------------------------------- ping-pong

// pingPong measures round trips of size-byte messages, one in flight.
func pingPong(e *env, lb lib, size int, warm, dur time.Duration) ([]time.Duration, error) {
	l, err := lb.Listen(loopback)
	if err != nil {
		return nil, err
	}
	e.add("listener", l)
	go echoServer(e, l, size)
	c, err := lb.Dial(e.ctx, l.Addr())
	if err != nil {
		return nil, fmt.Errorf("dial: %w", err)
	}
	e.add("client", c)
	msg := make([]byte, size)
	buf := make([]byte, size+64)
	rtts := make([]time.Duration, 0, 1<<16)
	start := time.Now()
	measureFrom := start.Add(warm)
	end := measureFrom.Add(dur)
	for i := uint64(0); ; i++ {
		binary.LittleEndian.PutUint64(msg, i)
		t0 := time.Now()
		if t0.After(end) {
			break
		}
		if err := c.Send(msg); err != nil {
			return nil, fmt.Errorf("send: %w", err)
		}
		n, err := c.Recv(buf)
		if err != nil {
			return nil, fmt.Errorf("recv: %w", err)
		}
		t1 := time.Now()
		if n != size || binary.LittleEndian.Uint64(buf) != i {
			return nil, fmt.Errorf("echo mismatch: %d bytes, seq %d, want %d", n, binary.LittleEndian.Uint64(buf), i)
		}
		if t0.After(measureFrom) {
			rtts = append(rtts, t1.Sub(t0))
		}
	}
	addNote(e, "client", c)
	slices.Sort(rtts)
	return rtts, nil
}

// echoServer accepts connections and echoes every message on each.
func echoServer(e *env, l msgListener, size int) {
	for e.running() {
		c, err := l.Accept(e.ctx)
		if err != nil {
			if e.running() {
				e.fail(fmt.Errorf("accept: %w", err))
			}
			return
		}
		e.add("server conn", c)
		go func() {
			buf := make([]byte, size+64)
			for {
				n, err := c.Recv(buf)
				if err == nil {
					err = c.Send(buf[:n])
				}
				if err != nil {
					if e.running() {
						e.fail(fmt.Errorf("server: %w", err))
					}
					return
				}
			}
		}()
	}
}

// ---------------------------------------------------------------- one way

type oneWayOpts struct {
	size     int
	warm     time.Duration
	dur      time.Duration
	interval time.Duration // 0: send as fast as the transport takes; else one message per interval
	stamped  bool          // carry send timestamps and collect latencies
	path     *[2]pathConfig
	trace    time.Duration // > 0: print a timeline of knet's counters at this interval
	label    string        // names the timeline
}

type oneWayResult struct {
	msgs, bytes uint64
	elapsed     time.Duration
	lat         []time.Duration // sorted; stamped only
	maxGap      time.Duration   // longest time without a delivery; stamped only
	stalls      int             // gaps of at least stallGap; stamped only
	stalled     time.Duration   // their total
	relay       linkStats       // client→server direction, over the window
	relayDown   linkStats
}

func (r oneWayResult) msgRate() float64  { return float64(r.msgs) / r.elapsed.Seconds() }
func (r oneWayResult) byteRate() float64 { return float64(r.bytes) / r.elapsed.Seconds() / 1e6 }

// oneWay streams size-byte reliable messages from a client to a server,
// optionally through a relay, and counts what the server receives during
// dur after warm. The stream starts after a hello/ready exchange, so that
// it measures the steady state, not a race with Accept (see lateAccept).
func oneWay(e *env, lb lib, o oneWayOpts) (oneWayResult, error) {
	var res oneWayResult
	l, err := lb.Listen(loopback)
	if err != nil {
		return res, err
	}
	e.add("listener", l)
	addr := l.Addr()
	var rl *relay
	if o.path != nil {
		rl, err = newRelay(addr, o.path[0], o.path[1])
		if err != nil {
			return res, err
		}
		e.add("relay", rl)
		addr = rl.Addr()
	}

	var msgs, bytes atomic.Uint64
	var measuring atomic.Bool
	var server atomic.Pointer[msgConn]
	var latMu sync.Mutex
	var lat []time.Duration
	var gaps gapCounter
	go func() {
		c, err := l.Accept(e.ctx)
		if err != nil {
			if e.running() {
				e.fail(fmt.Errorf("accept: %w", err))
			}
			return
		}
		e.add("server conn", c)
		server.Store(&c)
		buf := make([]byte, o.size+64)
		// The first message is the client's hello: answer it, so that
		// the client starts streaming only once the server is reading.
		if _, err := c.Recv(buf); err != nil {
			if e.running() {
				e.fail(fmt.Errorf("server recv hello: %w", err))
			}
			return
		}
		if err := c.Send([]byte("ready")); err != nil {
			if e.running() {
				e.fail(fmt.Errorf("server send ready: %w", err))
			}
			return
		}
		for {
			n, err := c.Recv(buf)
			if err != nil {
				if e.running() {
					e.fail(fmt.Errorf("server recv: %w", err))
				}
				return
			}
			if n != o.size {
				e.fail(fmt.Errorf("server got %d bytes, want %d", n, o.size))
				return
			}
			if o.stamped && measuring.Load() {
				now := time.Since(epoch)
				latMu.Lock()
				lat = append(lat, now-stampOf(buf))
				gaps.add(now)
				latMu.Unlock()
			}
			msgs.Add(1)
			bytes.Add(uint64(n))
		}
	}()

	c, err := lb.Dial(e.ctx, addr)
	if err != nil {
		return res, fmt.Errorf("dial: %w", err)
	}
	e.add("client", c)
	if err := c.Send(make([]byte, o.size)); err != nil {
		return res, fmt.Errorf("send hello: %w", err)
	}
	if _, err := c.Recv(make([]byte, 64)); err != nil {
		return res, fmt.Errorf("recv ready: %w", err)
	}
	if o.trace > 0 {
		t := &tracer{w: os.Stderr, label: o.label, every: o.trace, client: c, server: &server, msgs: &msgs, size: o.size, started: time.Now()}
		go t.run(e.ctx.Done())
	}
	go func() {
		msg := make([]byte, o.size)
		next := time.Now()
		for e.running() {
			if o.interval > 0 {
				next = next.Add(o.interval)
				if d := time.Until(next); d > 0 {
					time.Sleep(d)
				}
			}
			if o.stamped {
				stamp(msg)
			}
			if err := c.Send(msg); err != nil {
				if e.running() {
					e.fail(fmt.Errorf("client send: %w", err))
				}
				return
			}
		}
	}()

	if !e.sleep(o.warm) {
		return res, nil
	}
	var up0, down0 linkStats
	if rl != nil {
		up0, down0 = rl.up.stats(), rl.down.stats()
	}
	latMu.Lock()
	gaps = gapCounter{last: time.Since(epoch)}
	latMu.Unlock()
	m0, b0, t0 := msgs.Load(), bytes.Load(), time.Now()
	measuring.Store(true)
	if !e.sleep(o.dur) {
		return res, nil
	}
	m1, b1, t1 := msgs.Load(), bytes.Load(), time.Now()
	measuring.Store(false)
	if rl != nil {
		res.relay = rl.up.stats().sub(up0)
		res.relayDown = rl.down.stats().sub(down0)
	}
	res.msgs, res.bytes, res.elapsed = m1-m0, b1-b0, t1.Sub(t0)
	latMu.Lock()
	res.lat = slices.Clone(lat)
	gaps.add(time.Since(epoch)) // the silence up to the window's end
	res.maxGap, res.stalls, res.stalled = gaps.max, gaps.n, gaps.total
	latMu.Unlock()
	slices.Sort(res.lat)
	addNote(e, "sender", c)
	if p := server.Load(); p != nil {
		addNote(e, "receiver", *p)
	}
	return res, nil
}

// gapCounter follows the gaps between deliveries: the longest, and those
// of at least stallGap.
type gapCounter struct {
	last  time.Duration // since epoch
	max   time.Duration
	n     int
	total time.Duration
}

func (g *gapCounter) add(now time.Duration) {
	d := now - g.last
	g.last = now
	g.max = max(g.max, d)
	if d >= stallGap {
		g.n++
		g.total += d
	}
}

// ---------------------------------------------------------------- sessions

const dialParallel = 8

// concurrentPingPong runs n clients against one server, each with one
// size-byte request in flight, and counts round trips per second.
func concurrentPingPong(e *env, lb lib, n, size int, warm, dur time.Duration) (float64, error) {
	l, err := lb.Listen(loopback)
	if err != nil {
		return 0, err
	}
	e.add("listener", l)
	go echoServer(e, l, size)

	// Connect dialParallel clients at a time: a stampede of handshakes
	// overflows quic-go's accept queue (32), which then refuses the rest.
	conns := make([]msgConn, n)
	var wg sync.WaitGroup
	var dialErr atomic.Pointer[error]
	slots := make(chan struct{}, dialParallel)
	for i := range conns {
		slots <- struct{}{}
		wg.Go(func() {
			defer func() { <-slots }()
			c, err := lb.Dial(e.ctx, l.Addr())
			if err != nil {
				dialErr.CompareAndSwap(nil, &err)
				return
			}
			e.add("client", c)
			conns[i] = c
		})
	}
	wg.Wait()
	if p := dialErr.Load(); p != nil {
		return 0, fmt.Errorf("dial: %w", *p)
	}
	var trips atomic.Uint64
	for _, c := range conns {
		go func() {
			msg := make([]byte, size)
			buf := make([]byte, size+64)
			for e.running() {
				if err := c.Send(msg); err != nil {
					if e.running() {
						e.fail(fmt.Errorf("client send: %w", err))
					}
					return
				}
				k, err := c.Recv(buf)
				if err != nil {
					if e.running() {
						e.fail(fmt.Errorf("client recv: %w", err))
					}
					return
				}
				if k != size {
					e.fail(fmt.Errorf("echo of %d bytes, want %d", k, size))
					return
				}
				trips.Add(1)
			}
		}()
	}
	if !e.sleep(warm) {
		return 0, nil
	}
	n0, t0 := trips.Load(), time.Now()
	if !e.sleep(dur) {
		return 0, nil
	}
	n1, t1 := trips.Load(), time.Now()
	return float64(n1-n0) / t1.Sub(t0).Seconds(), nil
}

// ---------------------------------------------------------------- late accept

type lateResult struct {
	first, fresh time.Duration // since Accept returned; -1 if never within limit
	backlog      int           // messages sent before Accept received before the first fresh one
	sentBefore   uint64        // messages the client had sent when Accept returned
}

// lateAccept dials, sends a size-byte message every interval, and accepts
// on the server only after delay. It then times the first message, and
// the first message sent after Accept returned, to arrive.
func lateAccept(e *env, lb lib, size int, interval, delay, limit time.Duration) (lateResult, error) {
	res := lateResult{first: -1, fresh: -1}
	l, err := lb.Listen(loopback)
	if err != nil {
		return res, err
	}
	e.add("listener", l)
	c, err := lb.Dial(e.ctx, l.Addr())
	if err != nil {
		return res, fmt.Errorf("dial: %w", err)
	}
	e.add("client", c)
	var sent atomic.Uint64
	go func() {
		msg := make([]byte, size)
		next := time.Now()
		for e.running() {
			stamp(msg)
			if err := c.Send(msg); err != nil {
				if e.running() {
					e.fail(fmt.Errorf("client send: %w", err))
				}
				return
			}
			sent.Add(1)
			next = next.Add(interval)
			if d := time.Until(next); d > 0 {
				time.Sleep(d)
			}
		}
	}()
	if !e.sleep(delay) {
		return res, nil
	}
	sc, err := l.Accept(e.ctx)
	if err != nil {
		return res, fmt.Errorf("accept: %w", err)
	}
	e.add("server conn", sc)
	accepted := time.Now()
	acceptedAt := time.Since(epoch)
	res.sentBefore = sent.Load()

	type arrival struct {
		at time.Duration // since accept
		ts time.Duration // send stamp
	}
	arrivals := make(chan arrival, 1024)
	go func() {
		buf := make([]byte, size+64)
		for {
			n, err := sc.Recv(buf)
			if err != nil {
				if e.running() {
					e.fail(fmt.Errorf("server recv: %w", err))
				}
				return
			}
			if n != size {
				e.fail(fmt.Errorf("server got %d bytes, want %d", n, size))
				return
			}
			select {
			case arrivals <- arrival{time.Since(accepted), stampOf(buf)}:
			case <-e.ctx.Done():
				return
			}
		}
	}()
	deadline := time.NewTimer(limit)
	defer deadline.Stop()
	for {
		select {
		case a := <-arrivals:
			if res.first < 0 {
				res.first = a.at
			}
			if a.ts >= acceptedAt {
				res.fresh = a.at
				addNote(e, "client", c)
				return res, nil
			}
			res.backlog++
		case <-deadline.C:
			addNote(e, "client", c)
			return res, nil
		case <-e.ctx.Done():
			return res, nil
		}
	}
}
