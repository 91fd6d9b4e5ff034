//go:build !js

package knet

import (
	"context"
	"encoding/binary"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A drain over TCP and WebSocket while the players keep sending: every
// message a player's Send accepted before it learned of the drain
// reaches the server's application, whether it reads from a Group or
// with Receive (which goes on during a drain until the connection ends),
// and nothing is left unacknowledged (a stream keeps nothing for it).
//
// The stream's close always let a player write what it had queued
// before its own end of the stream, and a Group took it; before a
// drained connection's Receive went on, a server reading with Receive
// lost everything that came after the drain began.
func TestDrainStreamsLoseNothing(t *testing.T) {
	for _, tr := range []Transport{TransportTCP, TransportWebSocket} {
		for _, receive := range []bool{false, true} {
			name := tr.String() + "/group"
			if receive {
				name = tr.String() + "/receive"
			}
			t.Run(name, func(t *testing.T) { testDrainStream(t, tr, receive) })
		}
	}
}

func testDrainStream(t *testing.T, tr Transport, receive bool) {
	const players = 3
	const reason = "server shutting down: rejoin"
	scfg := tcpConfig()
	g := NewGroup()
	if !receive {
		scfg.Group = g
	}
	l := listen(t, scfg)
	url := wsServer(t, l)

	var mu sync.Mutex
	got := map[uint32]uint32{} // by message ID: the player's
	hole := false
	took := func(_ *Conn, m Message) {
		mu.Lock()
		defer mu.Unlock()
		if binary.BigEndian.Uint32(m.Payload) != got[m.ID] {
			hole = true
		}
		got[m.ID]++
	}
	served := make(chan struct{})
	go func() {
		defer close(served)
		if receive {
			var readers sync.WaitGroup
			defer readers.Wait()
			for range players {
				c, err := l.AcceptConn(context.Background())
				if err != nil {
					return
				}
				readers.Go(func() {
					for {
						m, err := c.Receive(context.Background())
						if err != nil {
							return
						}
						took(c, m)
					}
				})
			}
			return
		}
		events := make([]Event, 64)
		for ended := 0; ended < players; {
			if g.Wait(context.Background()) != nil {
				return
			}
			for _, e := range events[:g.Poll(events)] {
				switch e.Kind {
				case EventMessage:
					took(e.Conn, e.Message)
				case EventDisconnected:
					ended++
				}
			}
		}
	}()

	type player struct {
		c        *Conn
		accepted uint32
		sendErr  error
	}
	ps := make([]*player, players)
	var wg sync.WaitGroup
	var warm sync.WaitGroup // each player's Send took 50 messages
	warm.Add(players)
	ctx := within(t, 20*time.Second)
	for i := range ps {
		var c *Conn
		var err error
		if tr == TransportTCP {
			c, err = Dial(ctx, "tcp", l.Addr().String(), testConfig())
		} else {
			c, err = DialWebSocket(ctx, url, testConfig())
		}
		require.NoError(t, err)
		t.Cleanup(func() { c.Close() })
		p := &player{c: c}
		ps[i] = p
		wg.Go(func() {
			for n := uint32(0); ; n++ {
				m := seqMessage(n)
				m.ID += uint32(i)
				if p.sendErr = c.Send(m); p.sendErr != nil {
					if n < 50 {
						warm.Done()
					}
					return
				}
				p.accepted = n + 1
				if p.accepted == 50 {
					warm.Done()
				}
				time.Sleep(time.Millisecond)
			}
		})
		wg.Go(func() {
			for {
				if _, err := c.Receive(context.Background()); err != nil {
					return
				}
			}
		})
	}
	warm.Wait() // then the drain finds messages in flight from each
	require.NoError(t, l.Drain(within(t, 10*time.Second), reason))
	wg.Wait()
	<-served
	mu.Lock()
	defer mu.Unlock()
	assert.False(t, hole, "in order")
	for i, p := range ps {
		<-p.c.Done()
		assert.ErrorIs(t, p.sendErr, ErrPeerClosed)
		var de *DisconnectError
		if assert.True(t, errors.As(p.c.Err(), &de), "%v", p.c.Err()) {
			assert.Equal(t, reason, de.Reason)
		}
		assert.GreaterOrEqual(t, p.accepted, uint32(50))
		assert.Equal(t, p.accepted, got[seqMessage(0).ID+uint32(i)], "every message the player's Send accepted reaches the server's application")
		assert.Nil(t, p.c.Unacknowledged())
	}
}
