package knet

import (
	"context"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/knet-go/knet/internal/udp"

	"github.com/knet-go/knet/internal/netsim"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Under the peer's flow control (a FlowControlRequest capping the
// datagrams a second), higher-priority latest state still goes: a
// snapshot at priority 2 every 33ms beside a reliable download at -1
// that could fill every datagram the cap allows. Before, reliable
// datagrams took the cap's room first and nearly every snapshot was
// replaced in the queue by the next one.
func TestPriorityHoldsUnderPeerFlowControl(t *testing.T) {
	path := netsim.Params{Delay: 15 * time.Millisecond}
	p := newSimPair(t, nil, nil, path, path)
	p.connect()
	p.client().peerRateRequest(p.now, 60) // the peer asked for 60 datagrams a second
	for range 200 {
		p.send(0, Message{ID: 130, Payload: make([]byte, 1200), Reliable: true, InOrder: true, Priority: -1})
	}
	const snapshots = 60
	for k := range snapshots {
		p.send(0, Message{ID: 131, Payload: seqPayload(k), ContentID: 1, Priority: 2})
		p.run(33*time.Millisecond, nil)
	}
	p.run(100*time.Millisecond, nil)
	got, bulk := 0, 0
	for _, m := range p.h[1].msgs {
		switch m.ID {
		case 131:
			got++
		case 130:
			bulk++
		}
	}
	st := p.client().snapshot()
	t.Logf("snapshots %d of %d, replaced %d; bulk messages in %d", got, snapshots, st.ReplacedMessages, bulk)
	assert.GreaterOrEqual(t, got, snapshots*95/100, "snapshots through the cap")
	require.Positive(t, bulk, "the download still uses what is left")
}

// gatedSocket blocks its writes while its gate is shut: a socket whose
// buffer other traffic filled.
type gatedSocket struct {
	socket
	mu   sync.Mutex
	open chan struct{} // closed while writes go through
}

func (g *gatedSocket) wait() {
	g.mu.Lock()
	open := g.open
	g.mu.Unlock()
	<-open
}

func (g *gatedSocket) shut() {
	g.mu.Lock()
	g.open = make(chan struct{})
	g.mu.Unlock()
}

func (g *gatedSocket) release() {
	g.mu.Lock()
	close(g.open)
	g.mu.Unlock()
}

func (g *gatedSocket) WriteTo(b []byte, to netip.AddrPort) error {
	g.wait()
	return g.socket.WriteTo(b, to)
}

func (g *gatedSocket) WriteBatch(w *udp.Writer, ps []udp.Packet) error {
	g.wait()
	return g.socket.WriteBatch(w, ps)
}

// cutSocket drops what it is given to write once cut: a path gone dark.
type cutSocket struct {
	socket
	cut atomic.Bool
}

func (c *cutSocket) WriteTo(b []byte, to netip.AddrPort) error {
	if c.cut.Load() {
		return nil
	}
	return c.socket.WriteTo(b, to)
}

func (c *cutSocket) WriteBatch(w *udp.Writer, ps []udp.Packet) error {
	if c.cut.Load() {
		return nil
	}
	return c.socket.WriteBatch(w, ps)
}

// TrySend never waits, whatever the socket does: on a dialed connection,
// whose round a Send after a pause runs on the caller's goroutine, a
// TrySend leaves it to the worker, as a write may wait for room in the
// socket.
func TestTrySendNeverWaitsForTheSocket(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		var gate *gatedSocket
		nw.wrapDial = func(s socket) socket {
			gate = &gatedSocket{socket: s, open: make(chan struct{})}
			close(gate.open)
			return gate
		}
		l := nw.listen(t, testConfig())
		c := nw.dial(t, l.Addr().String(), testConfig())
		time.Sleep(time.Second) // the bubble's clock: past any inline gap
		synctest.Wait()
		gate.shut()
		done := make(chan error, 1)
		go func() { done <- c.TrySend(Message{ID: 6, Payload: []byte("input")}) }()
		synctest.Wait()
		select {
		case err := <-done:
			require.NoError(t, err)
		default:
			gate.release()
			t.Fatal("TrySend waited for the socket")
		}
		gate.release()
	})
}

// A download's large messages leave an eighth of the send buffer to
// messages that fit a datagram: with the buffer as full of them as they
// may make it, a snapshot's TrySend still goes. Before, bulk data filled
// the buffer and every TrySend and Broadcast to the player was refused.
func TestSendBufferLeavesRoomForSmallMessages(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		var cut *cutSocket
		nw.wrapDial = func(s socket) socket {
			cut = &cutSocket{socket: s}
			return cut
		}
		l := nw.listen(t, testConfig())
		cfg := testConfig()
		cfg.SendBuffer = 64 << 10
		c := nw.dial(t, l.Addr().String(), cfg)
		synctest.Wait()
		cut.cut.Store(true) // nothing arrives, nothing is acked
		ctx, cancel := context.WithCancel(context.Background())
		sent := 0
		done := make(chan struct{})
		go func() {
			defer close(done)
			for c.SendContext(ctx, Message{ID: 6, Payload: make([]byte, 8<<10), Reliable: true}) == nil {
				sent++
			}
		}()
		synctest.Wait() // the bulk sender waits for room
		assert.Equal(t, 7, sent, "bulk fills seven eighths")
		for k := range 5 { // a few ticks' worth, in the eighth left
			require.NoError(t, c.TrySend(Message{ID: 7, Payload: make([]byte, 600), ContentID: 1}), "snapshot %d", k)
			require.NoError(t, c.TrySend(Message{ID: 8, Payload: make([]byte, 300), Reliable: true}), "event %d", k)
		}
		cancel()
		<-done
	})
}

// The peer is asked to slow down only when the application leaves half
// the receive buffer unread for a round trip (20ms at least): a burst of
// large messages delivered at once and read within the round, or unread
// for a moment, asks nothing. Before, each such burst capped the peer.
func TestFlowControlWaitsForAnApplicationBehind(t *testing.T) {
	p := newSimPair(t, &Config{ReceiveBuffer: 256 << 10}, nil, perfect, perfect)
	p.connect()
	s, h := p.client(), p.h[0]
	p.run(100*time.Millisecond, nil)
	owes := func() bool { return s.owed.owes(oweFlow) }

	// This round delivered 192 KiB, which the application has not seen
	// yet: nothing.
	s.beginRound()
	h.used = 192 << 10
	s.flowControl(p.now)
	assert.False(t, owes(), "delivered this round")

	// Unread at the start of the next round, 5ms later: still nothing.
	p.now = p.now.Add(5 * time.Millisecond)
	s.beginRound()
	s.flowControl(p.now)
	assert.False(t, owes(), "unread for a moment")

	// Read meanwhile, and the clock starts again.
	h.used = 0
	p.now = p.now.Add(30 * time.Millisecond)
	s.beginRound()
	s.flowControl(p.now)
	h.used = 192 << 10
	p.now = p.now.Add(30 * time.Millisecond)
	s.beginRound()
	s.flowControl(p.now)
	assert.False(t, owes(), "behind since the last round only")

	// Still unread a round trip later: the application is behind.
	p.now = p.now.Add(behindFor(s.loss.rtt.srtt))
	s.beginRound()
	s.flowControl(p.now)
	assert.True(t, owes(), "behind")
}

// Two downloads at one priority on channels weighted 3 and 1 share what the
// path allows three to one, counted in bytes; without weights they go in
// send order, the first before the second.
func TestChannelWeightsShareBulk(t *testing.T) {
	path := netsim.Params{Delay: 10 * time.Millisecond, Bandwidth: 200_000, QueueBytes: 20_000}
	share := func(weights map[uint8]int) (a, b int) {
		p := newSimPair(t, &Config{ChannelWeights: weights}, nil, path, path)
		p.connect()
		for range 60 {
			p.send(0, Message{ID: 150, Payload: make([]byte, 4000), Reliable: true, InOrder: true, Channel: 1})
		}
		for range 60 {
			p.send(0, Message{ID: 151, Payload: make([]byte, 4000), Reliable: true, InOrder: true, Channel: 2})
		}
		require.True(t, p.run(30*time.Second, func() bool { return len(p.h[1].msgs) >= 40 }))
		for _, m := range p.h[1].msgs {
			switch m.ID {
			case 150:
				a++
			case 151:
				b++
			}
		}
		return a, b
	}
	a, b := share(map[uint8]int{1: 3, 2: 1})
	t.Logf("weights 3:1: %d and %d of the first 40+ chunks", a, b)
	assert.InDelta(t, 3.0, float64(a)/float64(max(b, 1)), 0.6, "%d:%d", a, b)
	a, b = share(nil)
	t.Logf("no weights: %d and %d", a, b)
	assert.Zero(t, b, "send order: the second download waits for the first")
}
