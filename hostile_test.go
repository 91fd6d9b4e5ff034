package knet

import (
	"context"
	"errors"
	"math/rand/v2"
	"net"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Hostile peers: tests of the bounds a peer cannot push us past.

// rawPeer speaks the wire directly, through our codec but none of our
// session's rules: it acks only when told, and sends whatever it is given.
type rawPeer struct {
	t    testing.TB
	c    *net.UDPConn
	next uint32
	buf  []byte
}

// dialRaw opens a socket to addr and completes the handshake.
func dialRaw(t testing.TB, addr net.Addr) *rawPeer {
	t.Helper()
	c, err := net.DialUDP("udp", nil, addr.(*net.UDPAddr))
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	p := &rawPeer{t: t, c: c, next: 1, buf: make([]byte, 65536)}
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		p.send(false, message{id: idConnectSyn, payload: make([]byte, 64)})
		if d, ok := p.recv(200 * time.Millisecond); ok && len(d.msgs) > 0 && d.msgs[0].id == idConnectSynAck {
			p.send(true, message{id: idConnectAck})
			return p
		}
	}
	t.Fatal("no ConnectSynAck")
	return nil
}

func (p *rawPeer) send(reliable bool, msgs ...message) {
	b := appendDatagram(nil, &datagram{header: header{packetID: p.next, reliable: reliable}, msgs: msgs})
	p.next++
	p.c.Write(b)
}

// recv reads one datagram, or reports false after d.
func (p *rawPeer) recv(d time.Duration) (datagram, bool) {
	p.c.SetReadDeadline(time.Now().Add(d))
	n, err := p.c.Read(p.buf)
	if err != nil {
		return datagram{}, false
	}
	dg, _, err := parseDatagram(append([]byte(nil), p.buf[:n]...))
	require.NoError(p.t, err, "the server sent a malformed datagram")
	return dg, true
}

// serverConn accepts the next connection.
func serverConn(t testing.TB, l *Listener) *Conn {
	t.Helper()
	c, err := l.AcceptConn(within(t, 5*time.Second))
	require.NoError(t, err)
	return c
}

func TestPeerThatNeverReads(t *testing.T) {
	// The server's application never reads: what waits for it stays within
	// ReceiveBuffer, the client's Send blocks, nothing is lost.
	l := listen(t, &Config{ReceiveBuffer: 256 << 10, DisconnectTimeout: time.Second})
	c := dial(t, l.Addr().String(), &Config{SendBuffer: 256 << 10, DisconnectTimeout: time.Second})
	srv := serverConn(t, l)
	var sent atomic.Int64
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			c.SetWriteDeadline(time.Now().Add(100 * time.Millisecond))
			if err := c.Send(numbered(6, i, 1000)); err != nil {
				require.ErrorIs(t, err, errDeadline)
				continue
			}
			sent.Add(1)
		}
	}()
	time.Sleep(time.Second)
	held := srv.recvUsed()
	t.Logf("after 1s: %d messages sent, %d bytes waiting at the server, client %+v", sent.Load(), held, c.Stats())
	assert.LessOrEqual(t, held, 256<<10+maxDatagramSizeLimit)
	// The server asked the client to slow down (FlowControlRequest), or
	// left the excess unacked.
	assert.True(t, c.Stats().SendRate < 100 || srv.Stats().DroppedDatagrams > 0, "no backpressure: %+v", c.Stats())
	close(stop)
	<-done
	// The reader wakes up: everything sent arrives, exactly once.
	c.SetWriteDeadline(time.Time{})
	n := int(sent.Load())
	seen := make([]bool, 1<<20)
	for range n {
		m, err := srv.Receive(within(t, 30*time.Second))
		require.NoError(t, err)
		k := int(uint32(m.Payload[0]) | uint32(m.Payload[1])<<8 | uint32(m.Payload[2])<<16)
		require.False(t, seen[k], "message %d twice", k)
		seen[k] = true
	}
}

func TestPeerThatNeverAcks(t *testing.T) {
	// A raw peer connects and never acks: the server's Send blocks once
	// SendBuffer is full, and the connection ends after the retransmission
	// limit, not holding anything past the buffer meanwhile.
	// (Rates high enough that the resends are not paced out over minutes.)
	cfg := &Config{SendBuffer: 64 << 10, MaxMessageSendCount: 6, DatagramTimeout: 100 * time.Millisecond, DisconnectTimeout: 200 * time.Millisecond,
		InitialDatagramRate: 500, MinDatagramRate: 500}
	l := listen(t, cfg)
	p := dialRaw(t, l.Addr())
	srv := serverConn(t, l)
	go func() { // keep the peer from looking silent
		for i := 0; ; i++ {
			select {
			case <-srv.Done():
				return
			case <-time.After(20 * time.Millisecond):
			}
			p.send(false, message{id: idPingRequest, payload: []byte{byte(i)}})
		}
	}()
	var queued int
	for i := range 1000 {
		srv.SetWriteDeadline(time.Now().Add(50 * time.Millisecond))
		if err := srv.Send(numbered(6, i, 1000)); err != nil {
			break
		}
		queued++
	}
	assert.Less(t, queued, 100, "Send blocks once the buffer is full")
	srv.sendMu.Lock()
	used := srv.sendUsed
	srv.sendMu.Unlock()
	assert.LessOrEqual(t, used, 64<<10+1000)
	select {
	case <-srv.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("a peer that never acks was never cut off")
	}
	assert.ErrorIs(t, srv.Err(), ErrRetransmitLimit)
}

func TestPeerFloodingUnreliableMessages(t *testing.T) {
	// A raw peer blasts unreliable messages at an application that does
	// not read: they are dropped and counted once the buffer is full; the
	// connection stays up.
	l := listen(t, &Config{ReceiveBuffer: 128 << 10, DisconnectTimeout: 200 * time.Millisecond})
	p := dialRaw(t, l.Addr())
	srv := serverConn(t, l)
	payload := make([]byte, 1000)
	for range 5000 {
		p.send(false, message{id: 6, payload: payload})
	}
	time.Sleep(200 * time.Millisecond)
	st := srv.Stats()
	t.Logf("server after 5000 unreliable datagrams: %+v", st)
	assert.LessOrEqual(t, srv.recvUsed(), 128<<10, "never past ReceiveBuffer")
	assert.Positive(t, st.DroppedMessages+st.DroppedDatagrams)
	assert.NoError(t, srv.Err())
	// It still works for the peer.
	p.send(false, message{id: idPingRequest, payload: []byte{42}})
	for {
		d, ok := p.recv(time.Second)
		require.True(t, ok, "no PingReply")
		if slices.ContainsFunc(d.msgs, func(m message) bool { return m.id == idPingReply }) {
			break
		}
	}
}

func TestPeerAnnouncingHugeTransfer(t *testing.T) {
	l := listen(t, &Config{MaxMessageSize: 1 << 20, DisconnectTimeout: 200 * time.Millisecond})
	p := dialRaw(t, l.Addr())
	srv := serverConn(t, l)
	var before runtime.MemStats
	runtime.ReadMemStats(&before)
	p.send(true, message{fragStart: true, fragment: true, id: 6, fragCount: 1<<30 - 1, transferID: 1, payload: make([]byte, 400)})
	select {
	case <-srv.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("not cut off")
	}
	var after runtime.MemStats
	runtime.ReadMemStats(&after)
	var pe *ProtocolError
	assert.ErrorAs(t, srv.Err(), &pe)
	assert.Equal(t, uint64(1), srv.Stats().ProtocolErrors)
	assert.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(8<<20), "nothing allocated by the announced size")
}

func TestGarbageOnLiveConnections(t *testing.T) {
	// Garbage and truncated datagrams from a connected peer's own address:
	// every malformed one counted, none harming the connection.
	l := listen(t, &Config{DisconnectTimeout: 200 * time.Millisecond})
	p := dialRaw(t, l.Addr())
	srv := serverConn(t, l)
	rng := rand.New(rand.NewPCG(9, 9))
	good := appendDatagram(nil, &datagram{header: header{packetID: 50000, reliable: true}, msgs: []message{
		{id: 6, payload: []byte("a real message")}, {id: 7, payload: make([]byte, 300)},
	}})
	malformed := 0
	for i := range 2000 {
		var b []byte
		if i%2 == 0 {
			b = make([]byte, rng.IntN(200))
			for j := range b {
				b[j] = byte(rng.Uint32())
			}
		} else {
			b = good[:rng.IntN(len(good))] // truncated
		}
		if _, _, err := parseDatagram(b); err != nil {
			malformed++
			p.c.Write(b)
		}
	}
	// A real message after all that still arrives.
	p.send(true, message{id: 9, payload: []byte("still fine")})
	for {
		m, err := srv.Receive(within(t, 5*time.Second))
		require.NoError(t, err)
		if m.ID == 9 {
			assert.Equal(t, "still fine", string(m.Payload))
			break
		}
	}
	require.Eventually(t, func() bool { return srv.Stats().InvalidDatagrams == uint64(malformed) }, 2*time.Second, 10*time.Millisecond,
		"invalid %d of %d", srv.Stats().InvalidDatagrams, malformed)
	assert.NoError(t, srv.Err())
}

// roundTrips measures n reliable echo round trips on c.
func roundTrips(t testing.TB, c *Conn, n int) []time.Duration {
	var rtts []time.Duration
	for i := range n {
		start := time.Now()
		require.NoError(t, c.Send(numbered(6, i, 32)))
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_, err := c.Receive(ctx)
		cancel()
		require.NoError(t, err)
		rtts = append(rtts, time.Since(start))
	}
	return rtts
}

func p99(d []time.Duration) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[len(s)*99/100]
}

func TestConnectSynFlood(t *testing.T) {
	// Thousands of ConnectSyn a second from many source ports while 20
	// clients echo: their p99 round trip at most doubles, the server's
	// memory stays flat, and no flooding endpoint gets more bytes back
	// than it sent. Calm and flooded phases alternate, and their p99s are
	// compared by median, so that scheduling noise on a small machine does
	// not decide.
	cfg := testConfig()
	cfg.MaxPendingConnections = 1000
	cfg.ConnectTimeout = 2 * time.Second
	cfg.Admit = func(net.Addr, []byte) ([]byte, error) { return []byte("welcome to the server"), nil }
	l := listen(t, cfg)
	serveEcho(t, l)
	var clients []*Conn
	for range 20 {
		clients = append(clients, dial(t, l.Addr().String(), testConfig()))
	}
	measure := func() time.Duration {
		var mu sync.Mutex
		var all []time.Duration
		var wg sync.WaitGroup
		for _, c := range clients {
			wg.Go(func() {
				r := roundTrips(t, c, 50)
				mu.Lock()
				all = append(all, r...)
				mu.Unlock()
			})
		}
		wg.Wait()
		return p99(all)
	}
	measure() // warm up

	var flooding atomic.Bool
	stop := make(chan struct{})
	var sent, sentBytes, gotBytes, worstRatio atomic.Int64
	var fwg sync.WaitGroup
	syn := appendDatagram(nil, &datagram{msgs: []message{{id: idConnectSyn, payload: []byte("x")}}})
	for range 4 {
		fwg.Go(func() {
			buf := make([]byte, 2048)
			for {
				select {
				case <-stop:
					return
				default:
				}
				if !flooding.Load() {
					time.Sleep(time.Millisecond)
					continue
				}
				// A fresh source port for every few attempts.
				s, err := net.DialUDP("udp", nil, l.Addr().(*net.UDPAddr))
				if err != nil {
					continue
				}
				out, in := 0, 0
				for range 3 {
					s.Write(syn)
					out += len(syn)
					sent.Add(1)
				}
				s.SetReadDeadline(time.Now().Add(2 * time.Millisecond))
				for {
					n, err := s.Read(buf)
					if err != nil {
						break
					}
					in += n
				}
				s.Close()
				sentBytes.Add(int64(out))
				gotBytes.Add(int64(in))
				if int64(in*100/out) > worstRatio.Load() {
					worstRatio.Store(int64(in * 100 / out))
				}
			}
		})
	}
	defer func() {
		close(stop)
		fwg.Wait()
	}()
	var calm, flooded []time.Duration
	var heap []uint64
	floodTime := time.Duration(0)
	// Five rounds: on this 2-core VM a thread preempted inside a send
	// system call loses a 4 ms scheduler tick, calm or flooded (seen in
	// execution traces), and one such stall sets a phase's p99; the
	// median of five phases is rarely decided by it.
	rounds := 5
	if testing.Short() {
		rounds = 1
	}
	for round := range rounds {
		calm = append(calm, measure())
		flooding.Store(true)
		start := time.Now()
		time.Sleep(300 * time.Millisecond) // the flood reaches its steady state
		flooded = append(flooded, measure())
		var m runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&m)
		heap = append(heap, m.HeapInuse)
		flooding.Store(false)
		floodTime += time.Since(start)
		t.Logf("round %d: p99 calm %v, flooded %v, heap %d KiB", round, calm[round], flooded[round], m.HeapInuse>>10)
	}
	st := l.Stats()
	rate := float64(sent.Load()) / floodTime.Seconds()
	t.Logf("flood: %d ConnectSyn (%.0f/s, %d bytes), %d bytes back, worst ratio %d%%; listener %+v", sent.Load(), rate, sentBytes.Load(), gotBytes.Load(), worstRatio.Load(), st)
	median := func(d []time.Duration) time.Duration { s := slices.Clone(d); slices.Sort(s); return s[len(s)/2] }
	assert.Greater(t, rate, 1000.0, "thousands a second")
	assert.LessOrEqual(t, worstRatio.Load(), int64(100), "never more bytes back than sent")
	assert.LessOrEqual(t, st.Pending, cfg.MaxPendingConnections)
	var m runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&m)
	assert.Less(t, int64(m.HeapInuse)-int64(heap[0]), int64(16<<20), "memory flat once the flood is steady")
	t.Logf("median p99: calm %v, flooded %v (%.2fx)", median(calm), median(flooded), float64(median(flooded))/float64(median(calm)))
	if testing.Short() {
		return // the timing comparison needs the longer run and a quiet machine
	}
	assert.LessOrEqual(t, median(flooded), 2*median(calm), "p99 at most doubles")
}

func TestCloseFromManyGoroutines(t *testing.T) {
	l := listen(t, testConfig())
	serveEcho(t, l)
	c := dial(t, l.Addr().String(), testConfig())
	var wg sync.WaitGroup
	var first, again atomic.Int32
	for range 20 {
		wg.Go(func() {
			// The first Close says how it ended (nil, or why not: a Send
			// racing the listener's close may find the server gone); the
			// others that it was closed already.
			var op *net.OpError
			if err := c.Close(); errors.As(err, &op) && op.Op == "close" {
				assert.ErrorIs(t, err, net.ErrClosed)
				again.Add(1)
			} else {
				first.Add(1)
			}
		})
		wg.Go(func() { l.Close() })
		wg.Go(func() { c.Send(Message{ID: 6, Reliable: true}) })
		wg.Go(func() { c.SetDeadline(time.Now().Add(time.Hour)) })
	}
	wg.Wait()
	assert.Equal(t, int32(1), first.Load())
	assert.Equal(t, int32(19), again.Load())
	assert.ErrorIs(t, c.Send(Message{ID: 6}), net.ErrClosed)
}

func TestNoGoroutinesLeftAfterClose(t *testing.T) {
	base := runtime.NumGoroutine()
	for range 20 {
		l, err := Listen("udp", "127.0.0.1:0", testConfig())
		require.NoError(t, err)
		go func() {
			for {
				c, err := l.AcceptConn(context.Background())
				if err != nil {
					return
				}
				go func() {
					for {
						if _, err := c.Receive(context.Background()); err != nil {
							return
						}
					}
				}()
			}
		}()
		var conns []*Conn
		for range 5 {
			c, err := Dial(within(t, 5*time.Second), "udp", l.Addr().String(), &Config{Simulate: &Simulation{Delay: time.Millisecond}})
			require.NoError(t, err)
			c.SetDeadline(time.Now().Add(time.Hour)) // a timer that must not outlive the Conn
			require.NoError(t, c.Send(Message{ID: 6, Payload: []byte("x"), Reliable: true}))
			conns = append(conns, c)
		}
		for _, c := range conns[:2] {
			c.Close()
		}
		l.Close() // closes the rest gracefully from the server side
		for _, c := range conns {
			<-c.Done()
			c.Close()
		}
	}
	for deadline := time.Now().Add(5 * time.Second); runtime.NumGoroutine() > base && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	assert.LessOrEqual(t, runtime.NumGoroutine(), base, "goroutines left behind")
	assert.Empty(t, packageGoroutines())
}

// synRaw opens a socket to addr and runs the handshake up to the server's
// ConnectSynAck, leaving the ConnectAck to the caller.
func synRaw(t testing.TB, addr net.Addr) *rawPeer {
	t.Helper()
	c, err := net.DialUDP("udp", nil, addr.(*net.UDPAddr))
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	p := &rawPeer{t: t, c: c, next: 1, buf: make([]byte, 65536)}
	for range 25 {
		p.send(false, message{id: idConnectSyn, payload: make([]byte, 64)})
		if d, ok := p.recv(200 * time.Millisecond); ok && len(d.msgs) > 0 && d.msgs[0].id == idConnectSynAck {
			return p
		}
	}
	t.Fatal("no ConnectSynAck")
	return nil
}

func TestStealthNeverAnswersBacklogRefusal(t *testing.T) {
	// Two attempts are admitted while the accept backlog (one) is empty;
	// when both complete, the backlog takes one and the other is refused
	// after all. Responsive, that one hears a DisconnectAck; with Stealth,
	// neither hears anything.
	for _, stealth := range []bool{false, true} {
		t.Run(map[bool]string{false: "responsive", true: "stealth"}[stealth], func(t *testing.T) {
			cfg := testConfig()
			cfg.Stealth = stealth
			cfg.AcceptBacklog = 1
			cfg.DisconnectTimeout = 200 * time.Millisecond // the raw peer never answers
			l := listen(t, cfg)
			peers := []*rawPeer{synRaw(t, l.Addr()), synRaw(t, l.Addr())}
			for _, p := range peers {
				p.send(true, message{id: idConnectAck})
			}
			// The refused connection's goroutine has ended: anything it
			// had to send is on the loopback already.
			require.Eventually(t, func() bool {
				st := l.Stats()
				return st.RefusedAttempts == 1 && st.Connections == 1
			}, 5*time.Second, time.Millisecond)
			answers := 0
			for _, p := range peers {
				for {
					d, ok := p.recv(50 * time.Millisecond)
					if !ok {
						break
					}
					for _, m := range d.msgs {
						if !m.fragment && m.id == idDisconnectAck {
							answers++
						}
					}
				}
			}
			if stealth {
				assert.Zero(t, answers, "a stealth server answered a refused attempt")
			} else {
				assert.Equal(t, 1, answers)
			}
		})
	}
}
