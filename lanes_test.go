package knet

import (
	"net/netip"
	"sync"
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
