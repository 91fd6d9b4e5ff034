package knet

import (
	"context"
	"encoding/binary"
	"testing"
	"testing/synctest"
	"time"

	"github.com/knet-go/knet/internal/netsim"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// receiptsOf maps each Ref told to its receipts, in the order told.
func receiptsOf(rs []Receipt) map[Ref][]bool {
	m := make(map[Ref][]bool)
	for _, r := range rs {
		m[r.Ref] = append(m[r.Ref], r.Delivered)
	}
	return m
}

// seqPayload returns the 4-byte payload naming message k.
func seqPayload(k int) []byte { return binary.LittleEndian.AppendUint32(nil, uint32(k)) }

// receivedNumbers is which numbered payloads side h took.
func receivedNumbers(h *simHost) map[int]bool {
	got := make(map[int]bool)
	for _, m := range h.msgs {
		if len(m.Payload) == 4 {
			got[int(binary.LittleEndian.Uint32(m.Payload))] = true
		}
	}
	return got
}

// An unreliable message's receipt says delivered exactly when the peer took
// it: under loss on the way there (every ack arriving), each message sent
// gets one receipt, and it is true for those that arrived and false for
// those that did not.
func TestReceiptsUnreliableTellWhatArrived(t *testing.T) {
	for _, seed := range []uint64{1, 2, 3} {
		up := netsim.Params{Loss: 0.2, Delay: 20 * time.Millisecond, Jitter: 5 * time.Millisecond, Seed: seed}
		down := netsim.Params{Delay: 20 * time.Millisecond}
		p := newSimPair(t, &Config{Receipts: true}, nil, up, down)
		p.connect()
		const n = 300
		refs := make([]Ref, n)
		for k := range n {
			refs[k] = p.send(0, Message{ID: 100, Payload: seqPayload(k)})
			p.run(10*time.Millisecond, nil)
		}
		all := func() bool { return len(p.h[0].receipts) >= n }
		require.True(t, p.run(5*time.Second, all), "seed %d: %d receipts of %d", seed, len(p.h[0].receipts), n)
		got := receivedNumbers(p.h[1])
		told := receiptsOf(p.h[0].receipts)
		delivered := 0
		for k, ref := range refs {
			require.Len(t, told[ref], 1, "seed %d: message %d told once", seed, k)
			assert.Equal(t, got[k], told[ref][0], "seed %d: message %d arrived %v", seed, k, got[k])
			if told[ref][0] {
				delivered++
			}
		}
		assert.Less(t, delivered, n, "seed %d: the loss took some", seed)
		assert.Greater(t, delivered, n/2, "seed %d", seed)
		st := p.client().snapshot()
		assert.Equal(t, uint64(delivered), st.ReceiptsDelivered)
		assert.Equal(t, uint64(n-delivered), st.ReceiptsLost)
	}
}

// Lost acks make a delivered message's receipt say lost, never the
// reverse: under loss both ways, delivered implies arrived.
func TestReceiptsNeverClaimWhatDidNotArrive(t *testing.T) {
	lossy := netsim.Params{Loss: 0.25, Delay: 15 * time.Millisecond, Jitter: 10 * time.Millisecond, Duplicate: 0.05, Seed: 7}
	p := newSimPair(t, &Config{Receipts: true}, nil, lossy, lossy)
	p.connect()
	const n = 400
	refs := make([]Ref, n)
	for k := range n {
		refs[k] = p.send(0, Message{ID: 100, Payload: seqPayload(k)})
		if k%7 == 0 {
			p.send(0, Message{ID: 101, Payload: []byte("event"), Reliable: true})
		}
		p.run(5*time.Millisecond, nil)
	}
	require.True(t, p.run(10*time.Second, func() bool { return len(p.h[0].receipts) >= n+n/7+1 }))
	got := receivedNumbers(p.h[1])
	told := receiptsOf(p.h[0].receipts)
	arrivedLost := 0
	for k, ref := range refs {
		require.Len(t, told[ref], 1, "message %d", k)
		if told[ref][0] {
			assert.True(t, got[k], "message %d reported delivered, never arrived", k)
		} else if got[k] {
			arrivedLost++
		}
	}
	t.Logf("%d arrived but were reported lost (their acks lost)", arrivedLost)
}

// A reliable message's receipt says delivered once, when acked, however
// many times it was sent; and its datagram carries no ack request.
func TestReceiptsReliableDeliveredOnce(t *testing.T) {
	lossy := netsim.Params{Loss: 0.2, Delay: 10 * time.Millisecond, Seed: 3}
	p := newSimPair(t, &Config{Receipts: true}, nil, lossy, lossy)
	requests := 0
	p.tap = func(from int, b []byte) {
		if from == 0 {
			if d, _, err := parseDatagram(b); err == nil && d.header.reliable && asksAck(d.msgs) {
				requests++
			}
		}
	}
	p.connect()
	var refs []Ref
	for k := range 50 {
		refs = append(refs, p.send(0, Message{ID: 100, Payload: seqPayload(k), Reliable: true}))
	}
	// And one fragmented.
	refs = append(refs, p.send(0, Message{ID: 100, Payload: make([]byte, 5000), Reliable: true}))
	require.True(t, p.run(10*time.Second, func() bool { return len(p.h[0].receipts) >= len(refs) }))
	p.run(time.Second, nil)
	told := receiptsOf(p.h[0].receipts)
	require.Len(t, p.h[0].receipts, len(refs))
	for k, ref := range refs {
		assert.Equal(t, []bool{true}, told[ref], "message %d", k)
	}
	assert.Equal(t, len(refs), len(p.h[1].msgs))
	assert.Zero(t, requests, "reliable datagrams are acked anyway")
	assert.Positive(t, p.client().snapshot().Retransmits, "the loss made it resend")
}

// What never left, or never got its ack, is lost when the connection
// ends: a reliable message unacked, unreliable ones still queued, and an
// unreliable latest-state version replaced in the queue.
func TestReceiptsLostWhenNotSent(t *testing.T) {
	p := newSimPair(t, &Config{Receipts: true}, nil, perfect, perfect)
	p.connect()
	a := p.send(0, Message{ID: 100, Payload: []byte("a"), ContentID: 1})
	b := p.send(0, Message{ID: 100, Payload: []byte("b"), ContentID: 1})
	p.run(100*time.Millisecond, nil)
	told := receiptsOf(p.h[0].receipts)
	assert.Equal(t, []bool{false}, told[a], "replaced before it left")
	assert.Equal(t, []bool{true}, told[b])

	p.cut[0] = true // nothing more reaches the server
	r := p.send(0, Message{ID: 100, Payload: []byte("r"), Reliable: true})
	u := p.send(0, Message{ID: 100, Payload: []byte("u")})
	p.run(20*time.Millisecond, nil)
	_, told2 := len(p.h[0].receipts), receiptsOf(p.h[0].receipts)
	assert.Empty(t, told2[r], "a reliable message is not lost while it may yet be acked")
	p.client().fail(ErrRetransmitLimit)
	told = receiptsOf(p.h[0].receipts)
	assert.Equal(t, []bool{false}, told[r])
	assert.Equal(t, []bool{false}, told[u])
}

// A receiver acks an unreliable datagram only when it took every message
// in it: one dropped for want of room leaves it unacked, and the sender
// hears lost.
func TestReceiptsNotAckedWhenDropped(t *testing.T) {
	p := newSimPair(t, &Config{Receipts: true}, nil, perfect, perfect)
	p.connect()
	ok := p.send(0, Message{ID: 100, Payload: []byte("in")})
	p.run(200*time.Millisecond, nil)
	p.h[1].full = true
	dropped := p.send(0, Message{ID: 100, Payload: []byte("dropped")})
	p.run(time.Second, nil)
	told := receiptsOf(p.h[0].receipts)
	assert.Equal(t, []bool{true}, told[ok])
	assert.Equal(t, []bool{false}, told[dropped])
	assert.Equal(t, uint64(1), p.server().snapshot().DroppedMessages)
}

// Unreliable datagrams carry an ack request only with a message that
// wants a receipt, and the request does not make the receiver take the
// datagram for reliable: nothing is resent.
func TestReceiptsAckRequestOnlyWhenWanted(t *testing.T) {
	p := newSimPair(t, &Config{Receipts: true}, nil, perfect, perfect)
	var with, without int
	p.tap = func(from int, b []byte) {
		d, _, err := parseDatagram(b)
		if from != 0 || err != nil || d.header.reliable {
			return
		}
		if asksAck(d.msgs) {
			with++
		} else {
			without++
		}
	}
	p.connect()
	p.send(0, Message{ID: 100, Payload: []byte("x")})
	p.run(100*time.Millisecond, nil)
	// Not tracked: no receipt wanted.
	o := p.client().newMsg()
	*o = outMsg{ref: 1 << 20, id: 100, payload: []byte("y")}
	p.client().enqueue(o)
	p.run(100*time.Millisecond, nil)
	assert.Equal(t, 1, with)
	assert.Positive(t, without)
	assert.Len(t, p.h[0].receipts, 1)
	assert.Zero(t, p.client().snapshot().Retransmits)
}

// The reference dialect has no ack request: its unreliable messages are
// reported lost, its reliable ones delivered.
func TestReceiptsReferenceDialect(t *testing.T) {
	p := newSimPairIn(t, DialectReference, &Config{Receipts: true}, nil, perfect, perfect)
	p.connect()
	u := p.send(0, Message{ID: 100, Payload: []byte("u")})
	r := p.send(0, Message{ID: 100, Payload: []byte("r"), Reliable: true})
	require.True(t, p.run(2*time.Second, func() bool { return len(p.h[0].receipts) == 2 }))
	told := receiptsOf(p.h[0].receipts)
	assert.Equal(t, []bool{false}, told[u])
	assert.Equal(t, []bool{true}, told[r])
	assert.Len(t, p.h[1].msgs, 2)
}

// A forged ack request in a reliable datagram, or one of another kind,
// changes nothing; and a peer's acks of PacketIDs that carried no receipted
// message tell nothing.
func TestReceiptsHostileAckRequests(t *testing.T) {
	for _, c := range []struct {
		name string
		msgs []message
		rel  bool
		ack  bool
	}{
		{"request", []message{{id: 100, payload: []byte("x")}, {id: idExt, payload: []byte{extAckRequest}}}, false, true},
		{"unknown kind", []message{{id: 100, payload: []byte("x")}, {id: idExt, payload: []byte{9}}}, false, false},
		{"empty", []message{{id: idExt}}, false, false},
		{"alone", []message{{id: idExt, payload: []byte{extAckRequest, 1, 2, 3}}}, false, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := newSimPair(t, nil, nil, perfect, perfect)
			p.connect()
			p.run(200*time.Millisecond, nil) // acks of the handshake out
			var acked []uint32
			p.tap = func(from int, b []byte) {
				d, _, err := parseDatagram(b)
				if from != 1 || err != nil {
					return
				}
				for _, m := range d.msgs {
					if m.id == idPacketAck && !m.fragment {
						if a, ok := parsePacketAck(m.payload); ok {
							a.each(func(id uint32) { acked = append(acked, id) })
						}
					}
				}
			}
			pid := p.client().send.nextPID
			p.client().numberNew(c.rel)
			h := header{packetID: pid, reliable: c.rel}
			b := appendHeader(nil, &h)
			for i := range c.msgs {
				b = appendMessage(b, &c.msgs[i])
			}
			p.inject(1, b)
			p.run(200*time.Millisecond, nil)
			assert.Equal(t, c.ack, containsID(acked, pid), "acks %v", acked)
			assert.Equal(t, stateOK, p.server().state)
		})
	}
}

func containsID(ids []uint32, id uint32) bool {
	for _, x := range ids {
		if x == id {
			return true
		}
	}
	return false
}

// End to end: a server in a Group hears each snapshot's fate as
// EventDelivered or EventLost, a delivered one always one the client
// received; a client without a Group takes its reliable messages'
// receipts from Conn.Receipts, all delivered once Close returns.
func TestReceiptsThroughGroupAndConn(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		g := NewGroup()
		scfg := testConfig()
		scfg.Group, scfg.Receipts = g, true
		scfg.Simulate = &Simulation{Loss: 0.15, Delay: 5 * time.Millisecond, Seed: 11}
		l := nw.listen(t, scfg)
		ccfg := testConfig()
		ccfg.Receipts = true
		c, err := nw.Dial(context.Background(), l.Addr().String(), ccfg)
		require.NoError(t, err)

		const snapshots, events = 60, 20
		arrived := make(map[int]bool)
		recvDone := make(chan struct{})
		go func() {
			defer close(recvDone)
			for {
				m, err := c.Receive(context.Background())
				if err != nil {
					return
				}
				if len(m.Payload) == 4 {
					arrived[int(binary.LittleEndian.Uint32(m.Payload))] = true
				}
			}
		}()
		var crefs []Ref
		for k := range events {
			r, err := c.SendRef(Message{ID: 101, Payload: []byte("event"), Reliable: true})
			require.NoError(t, err)
			require.NotZero(t, r)
			crefs = append(crefs, r)
			_ = k
		}

		var server *Conn
		sent := make(map[Ref]int)
		told := make(map[Ref]EventKind)
		evs := make([]Event, 32)
		ctx := within(t, 30*time.Second)
		tick := time.NewTicker(16 * time.Millisecond)
		defer tick.Stop()
		k := 0
		for len(told) < snapshots {
			select {
			case <-tick.C:
			case <-ctx.Done():
				t.Fatalf("%d receipts of %d", len(told), snapshots)
			}
			for n := g.Poll(evs); n > 0; n = g.Poll(evs) {
				for _, e := range evs[:n] {
					switch e.Kind {
					case EventConnected:
						server = e.Conn
					case EventDelivered, EventLost:
						_, dup := told[e.Ref]
						require.False(t, dup, "told twice")
						require.Contains(t, sent, e.Ref)
						told[e.Ref] = e.Kind
					}
				}
			}
			if server != nil && k < snapshots {
				r, err := server.SendRef(Message{ID: 100, Payload: seqPayload(k)})
				require.NoError(t, err)
				sent[r] = k
				k++
			}
		}
		require.NoError(t, c.Close())
		<-recvDone
		delivered := 0
		for r, kind := range told {
			if kind == EventDelivered {
				delivered++
				assert.True(t, arrived[sent[r]], "snapshot %d reported delivered, never arrived", sent[r])
			}
		}
		assert.Greater(t, delivered, snapshots/2)
		assert.Less(t, delivered, snapshots, "the loss took some")

		got := receiptsOf(c.Receipts(nil))
		for _, r := range crefs {
			assert.Equal(t, []bool{true}, got[r])
		}
		assert.Empty(t, c.Receipts(nil), "taken once")
		st := c.Stats()
		assert.Equal(t, uint64(events), st.ReceiptsDelivered)
	})
}

// Receipts the application never takes stop at maxReceipts: the oldest
// quarter goes when it is reached, counted in Stats.ReceiptsDropped, and
// the newest are kept, each once, in order.
func TestReceiptsBoundedWhenNotTaken(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		cfg := testConfig()
		cfg.Receipts = true
		c := nw.dial(t, l.Addr().String(), cfg)
		const n = maxReceipts + maxReceipts/4 - 100
		refs := make([]Ref, 0, n)
		for k := range n {
			r, err := c.SendRef(Message{ID: 100, Payload: seqPayload(k)})
			require.NoError(t, err)
			require.NotZero(t, r)
			refs = append(refs, r)
			if k%256 == 0 {
				time.Sleep(time.Millisecond) // the bubble's clock: let them go
			}
		}
		time.Sleep(2 * time.Second) // every receipt told
		synctest.Wait()
		st := c.Stats()
		assert.Equal(t, uint64(n), st.ReceiptsDelivered+st.ReceiptsLost, "each told once")
		assert.Equal(t, uint64(maxReceipts/4), st.ReceiptsDropped)
		got := c.Receipts(nil)
		require.Len(t, got, n-maxReceipts/4)
		for i, r := range got {
			assert.Equal(t, refs[maxReceipts/4+i], r.Ref, "receipt %d", i)
		}
	})
}
