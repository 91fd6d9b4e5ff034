package knet

import (
	"testing"
	"time"

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
