package knet

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"net/netip"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/netsim"
)

// unackedServer takes l's connections and records what each delivers;
// got returns the messages so far.
func unackedServer(t testing.TB, l *Listener) (got func() []Message, conns <-chan *Conn) {
	var mu sync.Mutex
	var msgs []Message
	cs := make(chan *Conn, 16)
	go func() {
		for {
			c, err := l.AcceptConn(context.Background())
			if err != nil {
				return
			}
			cs <- c
			go func() {
				for {
					m, err := c.Receive(context.Background())
					if err != nil {
						return
					}
					mu.Lock()
					msgs = append(msgs, m)
					mu.Unlock()
				}
			}()
		}
	}()
	return func() []Message {
		mu.Lock()
		defer mu.Unlock()
		return append([]Message(nil), msgs...)
	}, cs
}

// cutLinks drops everything between a and b, each way that is set.
func cutLinks(nw *testNet, a, b netip.AddrPort, ab, ba bool) {
	if ab {
		nw.mem.SetLink(a, b, &netsim.Params{Loss: 1})
	}
	if ba {
		nw.mem.SetLink(b, a, &netsim.Params{Loss: 1})
	}
}

func udpAddrOf(a net.Addr) netip.AddrPort { return unmap(a.(*net.UDPAddr).AddrPort()) }

// unackedBatch is what the tests send once the path is gone: every kind
// of reliable message (in order on a channel, unordered, a higher
// priority, one fragmented, two versions of one state), an unreliable
// one among them, and what Unacknowledged should return of it: the
// reliable ones, in send order (the urgent one, packed first, in its
// place), as they were sent, of the state only its newer version.
func unackedBatch() (sent, want []Message) {
	big := bytes.Repeat([]byte("0123456789"), 500) // several datagrams
	sent = []Message{
		seqMessage(5),
		{ID: 101, Payload: []byte("on channel 3"), Reliable: true, InOrder: true, Channel: 3},
		{ID: 102, Payload: []byte("urgent"), Reliable: true, Priority: 5},
		{ID: 103, Payload: big, Reliable: true},
		{ID: 104, Payload: []byte("state v1"), Reliable: true, ContentID: 9},
		{ID: 105, Payload: []byte("unreliable"), InOrder: true},
		{ID: 104, Payload: []byte("state v2"), Reliable: true, ContentID: 9},
		seqMessage(6),
	}
	want = []Message{sent[0], sent[1], sent[2], sent[3], sent[6], sent[7]}
	return sent, want
}

// A dialed connection whose server falls silent: once it has ended
// (peer silent, or the retransmit limit), Unacknowledged returns exactly
// the reliable messages Send accepted after the path went, none of those
// acked before, in send order and as they were sent (unackedBatch); it
// returns nil before the end, and for the server's connection.
func TestUnacknowledgedAfterTimeout(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		got, conns := unackedServer(t, l)
		c := nw.dial(t, l.Addr().String(), testConfig())
		sc := <-conns
		for i := range uint32(5) {
			require.NoError(t, c.Send(seqMessage(i)))
		}
		time.Sleep(time.Second) // delivered and acked
		require.Len(t, got(), 5)
		require.Zero(t, c.Stats().InFlight)

		cutLinks(nw, udpAddrOf(c.LocalAddr()), udpAddrOf(l.Addr()), true, true)
		sent, want := unackedBatch()
		for _, m := range sent {
			require.NoError(t, c.Send(m))
		}
		assert.Nil(t, c.Unacknowledged(), "nothing before the end")
		<-c.Done()
		assert.ErrorIs(t, c.Err(), net.ErrClosed)
		var te *TimeoutError
		assert.True(t, errors.As(c.Err(), &te) || errors.Is(c.Err(), ErrRetransmitLimit), "%v", c.Err())
		assert.Equal(t, want, c.Unacknowledged())
		assert.Equal(t, want, c.Unacknowledged(), "each call returns them")
		assert.Len(t, got(), 5, "the server got none of them")

		<-sc.Done()
		assert.Nil(t, sc.Unacknowledged(), "a Listener's connection keeps nothing")
	})
}

// A Close while the server cannot be reached gives up after
// DisconnectTimeout; Unacknowledged then returns what the close could not
// deliver. A Close that delivered everything leaves nothing.
func TestUnacknowledgedAfterClose(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		got, _ := unackedServer(t, l)

		ok := nw.dial(t, l.Addr().String(), testConfig())
		for i := range uint32(20) {
			require.NoError(t, ok.Send(seqMessage(i)))
		}
		require.NoError(t, ok.Close())
		assert.Len(t, got(), 20)
		assert.Empty(t, ok.Unacknowledged(), "a close that delivered everything")

		c := nw.dial(t, l.Addr().String(), testConfig())
		require.NoError(t, c.Send(seqMessage(0)))
		time.Sleep(time.Second)
		cutLinks(nw, udpAddrOf(c.LocalAddr()), udpAddrOf(l.Addr()), true, true)
		sent, want := unackedBatch()
		for _, m := range sent {
			require.NoError(t, c.Send(m))
		}
		start := time.Now()
		err := c.Close()
		var te *TimeoutError
		require.True(t, errors.As(err, &te), "%v", err)
		assert.Equal(t, "disconnect", te.Op)
		assert.Equal(t, testConfig().DisconnectTimeout, time.Since(start))
		assert.Equal(t, want, c.Unacknowledged())
	})
}

// Messages the server took whose acks were lost are left unacknowledged
// too: the sender cannot tell them from lost ones (a game that must not
// take one twice numbers them).
func TestUnacknowledgedIncludesUnackedArrivals(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		got, _ := unackedServer(t, l)
		c := nw.dial(t, l.Addr().String(), testConfig())
		cutLinks(nw, udpAddrOf(c.LocalAddr()), udpAddrOf(l.Addr()), false, true) // acks lost
		var sent []Message
		for i := range uint32(4) {
			sent = append(sent, seqMessage(i))
			require.NoError(t, c.Send(sent[i]))
		}
		<-c.Done()
		assert.Equal(t, sent, got(), "they arrived")
		assert.Equal(t, sent, c.Unacknowledged(), "unacked all the same")
	})
}

// A player that cannot deliver what it had in flight when a drain
// reached it (its path to the server went a moment before) answers after
// its DisconnectTimeout, and its Unacknowledged returns exactly what the
// server's application did not get: the tail of its stream, in order.
func TestUnacknowledgedAfterDrainTimeout(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		got, _ := unackedServer(t, l)
		c := nw.dial(t, l.Addr().String(), testConfig())
		toServer := &netsim.Params{Delay: 10 * time.Millisecond}
		nw.mem.SetLink(udpAddrOf(c.LocalAddr()), udpAddrOf(l.Addr()), toServer)
		var accepted uint32
		sending := make(chan struct{})
		go func() {
			defer close(sending)
			for n := uint32(0); c.Send(seqMessage(n)) == nil; n++ {
				accepted = n + 1
				time.Sleep(time.Millisecond)
			}
		}()
		learned := make(chan time.Time, 1)
		go func() {
			for {
				if _, err := c.Receive(context.Background()); err != nil {
					assert.Equal(t, io.EOF, err)
					learned <- time.Now()
					return
				}
			}
		}()
		time.Sleep(500 * time.Millisecond)
		cutLinks(nw, udpAddrOf(c.LocalAddr()), udpAddrOf(l.Addr()), true, false)
		time.Sleep(100 * time.Millisecond)
		drained := make(chan error, 1)
		go func() { drained <- l.Drain(context.Background(), "bye") }()
		at := <-learned
		<-sending
		<-c.Done()
		took := time.Since(at)
		assert.GreaterOrEqual(t, took, testConfig().DisconnectTimeout, "the player gave up after its DisconnectTimeout")
		assert.Less(t, took, testConfig().DisconnectTimeout+time.Second)
		var de *DisconnectError
		require.True(t, errors.As(c.Err(), &de), "%v", c.Err())
		assert.Equal(t, "bye", de.Reason)
		require.NoError(t, <-drained)

		server := uint32(len(got()))
		left := c.Unacknowledged()
		require.NotEmpty(t, left)
		assert.Greater(t, len(left), 50, "the messages of the last 100ms")
		assert.Equal(t, server, binary.BigEndian.Uint32(left[0].Payload), "from the first the server did not get")
		for i, m := range left {
			assert.Equal(t, seqMessage(server+uint32(i)), m)
		}
		assert.Equal(t, accepted, server+uint32(len(left)), "up to the last Send accepted")
	})
}

// A state sent again and again while the peer acks nothing (its
// versions replaced in the queue): what the connection keeps for
// Unacknowledged stays within a few hundred messages, not one per version
// sent, and the end leaves the first message and the newest version.
func TestUnacknowledgedLetsGoOfReplacedVersions(t *testing.T) {
	link := netsim.Params{Delay: time.Millisecond}
	p := newSimPair(t, nil, nil, link, link)
	p.connect()
	p.cut[0] = true // nothing the client sends arrives
	first := Message{ID: 100, Payload: []byte("first"), Reliable: true}
	p.send(0, first)
	var last Message
	most := 0
	for i := range uint32(20000) {
		last = Message{ID: 101, ContentID: 7, Reliable: true, Payload: binary.BigEndian.AppendUint32(nil, i)}
		p.send(0, last)
		if i%100 == 0 {
			p.run(time.Millisecond, nil)
		}
		k := p.client().keptOf()
		most = max(most, len(k.msgs)-k.head)
	}
	assert.Less(t, most, 4*minKeptSweep, "kept at most")
	p.client().fail(ErrRetransmitLimit)
	assert.Equal(t, []Message{first, last}, p.client().keptOf().left)
}
