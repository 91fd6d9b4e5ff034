package knet

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/netsim"
)

// drainLossCase is one wire a drain under loss runs over, and how the
// server reads: a Group's game loop, or Receive on each connection from
// AcceptConn.
type drainLossCase struct {
	name    string
	configs func(t testing.TB) (server, client *Config)
	receive bool
}

var drainLossCases = []drainLossCase{
	{"plaintext", func(testing.TB) (*Config, *Config) { return testConfig(), testConfig() }, false},
	{"secure", secureConfigs, false},
	{"receive", func(testing.TB) (*Config, *Config) { return testConfig(), testConfig() }, true},
}

// A drain at 5% loss each way (seeded) while the players keep sending:
// every reliable message a player's Send accepted before it learned of
// the drain (every Send that returned nil: the first to fail is the
// news) reaches the server's application, in order, and so does every
// one the server's Send accepted before the drain reach the player.
// Each player's connection ends with the drain's reason and nothing left
// unacknowledged; Drain returns nil. Over plaintext and secure UDP, and
// with a server that reads with Receive, which goes on during the drain
// until its connection ends.
//
// Before the drain waited for its players' messages, a player answered
// the server's Disconnect at once and dropped what it had in flight:
// seed 0 lost 6 messages in plaintext, 5 secure; Receive failed as the
// drain began, and the server's application saw none of the messages
// that came in the meantime.
func TestDrainUnderLossLosesNothing(t *testing.T) {
	t.Parallel()
	for _, tc := range drainLossCases {
		for seed := range uint64(3) {
			t.Run(fmt.Sprintf("%s/seed%d", tc.name, seed), func(t *testing.T) {
				synctest.Test(t, func(t *testing.T) { testDrainUnderLoss(t, tc, seed, true) })
			})
		}
	}
}

// The reference dialect has no way to say that a drain reads on (no ID
// 5, no reason): a drain is what it was, its players answer the
// Disconnect at once, and what they had in flight is lost to the server;
// but nothing is lost for good: a player's Unacknowledged returns every
// message the server did not get, the tail of its stream (and perhaps a
// few before, that arrived but whose acks did not).
func TestDrainUnderLossReferenceDialect(t *testing.T) {
	t.Parallel()
	for seed := range uint64(3) {
		t.Run(fmt.Sprintf("seed%d", seed), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				testDrainUnderLoss(t, drainLossCase{"reference", func(testing.TB) (*Config, *Config) {
					s, c := testConfig(), testConfig()
					s.Dialect, c.Dialect = DialectReference, DialectReference
					return s, c
				}, false}, seed, false)
			})
		})
	}
}

// testDrainUnderLoss runs a drain at 5% loss; with lossless, nothing
// a player's Send accepted may miss the server and nothing may be left
// unacknowledged, and otherwise what missed it must be left
// unacknowledged.
func testDrainUnderLoss(t *testing.T, tc drainLossCase, seed uint64, lossless bool) {
	const players = 4
	const reason = "server shutting down: rejoin"
	nw := memNet(t)
	scfg, ccfg := tc.configs(t)
	g := NewGroup()
	if !tc.receive {
		scfg.Group = g
	}
	l := nw.listen(t, scfg)
	srv := unmap(l.Addr().(*net.UDPAddr).AddrPort())

	// The server: its game loop counts what each player sent, and a
	// sender per player counts what its Send accepted.
	type served struct {
		got      uint32
		hole     bool
		accepted uint32 // by the server's Send
	}
	var mu sync.Mutex
	seen := map[string]*served{} // by the player's address
	var senders sync.WaitGroup
	joined := func(c *Conn) *served {
		s := &served{}
		mu.Lock()
		seen[c.RemoteAddr().String()] = s
		mu.Unlock()
		senders.Go(func() {
			for n := uint32(0); ; n++ {
				if c.Send(seqMessage(n)) != nil {
					return
				}
				mu.Lock()
				s.accepted = n + 1
				mu.Unlock()
				time.Sleep(3 * time.Millisecond)
			}
		})
		return s
	}
	took := func(s *served, m Message) {
		mu.Lock()
		if binary.BigEndian.Uint32(m.Payload) != s.got {
			s.hole = true
		}
		s.got++
		mu.Unlock()
	}
	loopDone := make(chan struct{})
	go func() {
		defer close(loopDone)
		if tc.receive {
			var readers sync.WaitGroup
			for range players {
				c, err := l.AcceptConn(context.Background())
				if err != nil {
					break
				}
				s := joined(c)
				readers.Go(func() {
					for {
						m, err := c.Receive(context.Background())
						if err != nil {
							return
						}
						took(s, m)
					}
				})
			}
			readers.Wait()
			return
		}
		ended := 0
		events := make([]Event, 64)
		byConn := map[*Conn]*served{}
		for ended < players {
			if g.Wait(context.Background()) != nil {
				return
			}
			for _, e := range events[:g.Poll(events)] {
				switch e.Kind {
				case EventConnected:
					byConn[e.Conn] = joined(e.Conn)
				case EventMessage:
					took(byConn[e.Conn], e.Message)
				case EventDisconnected:
					ended++
				}
			}
		}
	}()

	// The players: each sends a numbered stream every 2ms and reads the
	// server's.
	type player struct {
		c        *Conn
		accepted uint32 // Sends that returned nil
		sendErr  error
		got      uint32
		hole     bool
	}
	ps := make([]*player, players)
	var wg sync.WaitGroup
	for i := range ps {
		p := &player{c: nw.dial(t, l.Addr().String(), ccfg)}
		ps[i] = p
		addr := unmap(p.c.LocalAddr().(*net.UDPAddr).AddrPort())
		nw.mem.SetLink(addr, srv, &netsim.Params{Loss: 0.05, Delay: 10 * time.Millisecond, Seed: seed*100 + uint64(i)})
		nw.mem.SetLink(srv, addr, &netsim.Params{Loss: 0.05, Delay: 10 * time.Millisecond, Seed: seed*100 + uint64(i) + 50})
		wg.Go(func() {
			for n := uint32(0); ; n++ {
				if p.sendErr = p.c.Send(seqMessage(n)); p.sendErr != nil {
					return
				}
				p.accepted = n + 1
				time.Sleep(2 * time.Millisecond)
			}
		})
		wg.Go(func() {
			for {
				m, err := p.c.Receive(context.Background())
				if err != nil {
					return
				}
				if binary.BigEndian.Uint32(m.Payload) != p.got {
					p.hole = true
				}
				p.got++
			}
		})
	}
	time.Sleep(time.Second) // a second of play

	require.NoError(t, l.Drain(within(t, time.Minute), reason))
	wg.Wait()
	senders.Wait()
	<-loopDone
	lost := 0
	for _, p := range ps {
		<-p.c.Done()
		mu.Lock()
		s := seen[p.c.LocalAddr().String()]
		mu.Unlock()
		require.NotNil(t, s)
		assert.ErrorIs(t, p.sendErr, ErrPeerClosed, "Send fails once the player knows")
		if tc.name != "reference" { // the reference dialect carries no reason
			var de *DisconnectError
			if assert.True(t, errors.As(p.c.Err(), &de), "%v", p.c.Err()) {
				assert.Equal(t, reason, de.Reason)
			}
		}
		assert.Greater(t, p.accepted, uint32(100))
		lost += int(p.accepted) - int(s.got)
		assert.False(t, s.hole, "in order")
		assert.Equal(t, s.accepted, p.got, "every message the server's Send accepted reaches the player")
		assert.False(t, p.hole)
		left := p.c.Unacknowledged()
		if lossless {
			assert.Equal(t, p.accepted, s.got, "every message the player's Send accepted reaches the server")
			assert.Empty(t, left, "nothing left unacknowledged")
			continue
		}
		// What the server did not get is left unacknowledged: the
		// stream's tail, in order, from no later than the first
		// message missing.
		require.NotEmpty(t, left)
		first := binary.BigEndian.Uint32(left[0].Payload)
		assert.LessOrEqual(t, first, s.got, "the messages the server did not get are left unacknowledged")
		for i, m := range left {
			assert.Equal(t, seqMessage(first+uint32(i)), m, "in send order, as sent")
		}
		assert.Equal(t, p.accepted, first+uint32(len(left)), "up to the last Send accepted")
	}
	t.Logf("%d messages missed the server", lost)
	assert.Zero(t, l.Stats().Connections)
}
