package knet

import (
	"context"
	"encoding/binary"
	"net"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A game loop serving every connection from one goroutine: each client's
// arrival, its messages in order and its end come out of Poll, in that
// order, and nothing after the end.
func TestGroupServesManyConnections(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		g := NewGroup()
		cfg := testConfig()
		cfg.Group = g
		l := nw.listen(t, cfg)
		const clients, msgs = 12, 40
		var wg sync.WaitGroup
		for range clients {
			wg.Go(func() {
				c, err := nw.Dial(context.Background(), l.Addr().String(), testConfig())
				if !assert.NoError(t, err) {
					return
				}
				for i := range msgs {
					p := binary.LittleEndian.AppendUint32(nil, uint32(i))
					assert.NoError(t, c.Send(Message{ID: 100, Reliable: true, InOrder: true, Payload: p}))
				}
				assert.NoError(t, c.Close())
			})
		}
		type seen struct {
			joined, ended bool
			next          int
		}
		conns := map[*Conn]*seen{}
		ended := 0
		events := make([]Event, 16)
		ctx := within(t, 20*time.Second)
		for ended < clients {
			require.NoError(t, g.Wait(ctx), "connections ended so far: %d", ended)
			n := g.Poll(events)
			for _, e := range events[:n] {
				s := conns[e.Conn]
				switch e.Kind {
				case EventConnected:
					require.Nil(t, s, "connected twice")
					conns[e.Conn] = &seen{joined: true}
				case EventMessage:
					require.NotNil(t, s, "a message before the connection")
					require.False(t, s.ended, "a message after the end")
					assert.Equal(t, uint32(s.next), binary.LittleEndian.Uint32(e.Message.Payload))
					s.next++
				case EventDisconnected:
					require.NotNil(t, s)
					require.False(t, s.ended, "ended twice")
					s.ended = true
					ended++
					assert.ErrorIs(t, e.Err, ErrPeerClosed)
					assert.Equal(t, msgs, s.next, "every message before the end")
				}
			}
		}
		wg.Wait()
		assert.Len(t, conns, clients)
		assert.Zero(t, g.Len())
		// Nothing more.
		assert.Zero(t, g.Poll(events))
		_, err := l.AcceptConn(within(t, 50*time.Millisecond))
		assert.ErrorIs(t, err, context.DeadlineExceeded, "grouped connections never reach Accept")
	})
}

// What Poll has not taken counts against ReceiveBuffer: a loop that falls
// behind slows the peer down, it loses nothing reliable; and a connection
// taken out of the group reads with Receive again.
func TestGroupBackpressureAndRemove(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		g := NewGroup()
		scfg := testConfig()
		scfg.ReceiveBuffer = 64 << 10
		scfg.Group = g
		l := nw.listen(t, scfg)
		ccfg := testConfig()
		ccfg.SendBuffer = 64 << 10
		c := nw.dial(t, l.Addr().String(), ccfg)
		payload := make([]byte, 1000)
		sent := make(chan int)
		go func() {
			n := 0
			ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
			defer cancel()
			for ; n < 1000; n++ {
				if c.SendContext(ctx, Message{ID: 100, Reliable: true, Payload: payload}) != nil {
					break
				}
			}
			sent <- n
		}()
		n := <-sent
		assert.Less(t, n, 1000, "the sender blocked: nobody polled")
		events := make([]Event, 64)
		got := 0
		var sc *Conn
		ctx := within(t, 10*time.Second)
		for got < n {
			require.NoError(t, g.Wait(ctx), "%d of %d", got, n)
			k := g.Poll(events)
			for _, e := range events[:k] {
				if e.Kind == EventMessage {
					got++
					sc = e.Conn
				}
			}
		}
		g.Remove(sc)
		assert.Zero(t, g.Len())
		require.NoError(t, c.Send(Message{ID: 101, Reliable: true, Payload: []byte("direct")}))
		m, err := sc.Receive(within(t, 5*time.Second))
		require.NoError(t, err)
		assert.Equal(t, "direct", string(m.Payload))
	})
}

// A dialed connection joins the group of its Config too, and Add moves a
// connection between groups.
func TestGroupDialAndAdd(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		serveEcho(t, l)
		g1, g2 := NewGroup(), NewGroup()
		cfg := testConfig()
		cfg.Group = g1
		c := nw.dial(t, l.Addr().String(), cfg)
		assert.Equal(t, 1, g1.Len())
		g2.Add(c)
		assert.Zero(t, g1.Len())
		assert.Equal(t, 1, g2.Len())
		require.NoError(t, c.Send(Message{ID: 100, Reliable: true, Payload: []byte("hi")}))
		events := make([]Event, 4)
		var kinds []EventKind
		for len(kinds) < 2 {
			require.NoError(t, g2.Wait(within(t, 5*time.Second)))
			for _, e := range events[:g2.Poll(events)] {
				kinds = append(kinds, e.Kind)
				if e.Kind == EventMessage {
					assert.Equal(t, "hi", string(e.Message.Payload))
				}
			}
		}
		assert.Equal(t, []EventKind{EventConnected, EventMessage}, kinds)
		assert.Zero(t, g1.Poll(events))
		require.NoError(t, c.Close())
		require.NoError(t, g2.Wait(within(t, 5*time.Second)))
		n := g2.Poll(events)
		require.Equal(t, 1, n)
		assert.Equal(t, EventDisconnected, events[0].Kind)
		assert.ErrorIs(t, events[0].Err, net.ErrClosed, "closed by this side")
	})
}

func TestGroupPollNoAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts are meaningless under -race; .ci/run runs this test without it")
	}
	client, server := benchPair(t, &Config{DisconnectTimeout: time.Second})
	g := NewGroup()
	g.Add(server)
	events := make([]Event, 32)
	g.Poll(events) // EventConnected
	small := make([]byte, 32)
	ctx := context.Background()
	run := func() {
		for range 8 {
			require.NoError(t, client.Send(Message{ID: 6, Payload: small, Reliable: true}))
		}
		for got := 0; got < 8; {
			require.NoError(t, g.Wait(ctx))
			got += g.Poll(events)
		}
	}
	for range 500 {
		run()
	}
	assert.Zero(t, steadyAllocs(500, run), "allocations per 8 messages")
}
