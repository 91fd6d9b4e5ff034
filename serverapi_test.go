package knet

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// MaxUnreliablePayload is the line between one unreliable datagram and a
// reliable fragmented transfer, and crossing it shows in Stats.
func TestMaxUnreliablePayload(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		assert.Equal(t, 1104, (*Config)(nil).MaxUnreliablePayload()) // the 1200-byte base less 96
		assert.Equal(t, 500-96, (&Config{MaxDatagramSize: 500}).MaxUnreliablePayload())
		l := nw.listen(t, testConfig())
		got := make(chan Message, 4)
		serveFunc(t, l, func(c *Conn, m Message) { got <- m })
		c := nw.dial(t, l.Addr().String(), testConfig())
		max := c.MaxUnreliablePayload()
		require.NoError(t, c.Send(Message{ID: 100, Payload: make([]byte, max)}))
		m := <-got
		assert.False(t, m.Reliable, "at the limit: one unreliable datagram")
		assert.Zero(t, c.Stats().UnreliableAsReliable)
		require.NoError(t, c.Send(Message{ID: 100, Payload: make([]byte, max+1)}))
		m = <-got
		assert.Len(t, m.Payload, max+1)
		// Stats are published at the end of the connection's round, which
		// may come just after the message is through.
		synctest.Wait()
		assert.Equal(t, uint64(1), c.Stats().UnreliableAsReliable)
	})
}

// serveFunc accepts connections on l and calls f with each message.
func serveFunc(t *testing.T, l *Listener, f func(*Conn, Message)) {
	go func() {
		for {
			c, err := l.AcceptConn(context.Background())
			if err != nil {
				return
			}
			go func() {
				for {
					m, err := c.Receive(context.Background())
					if err != nil {
						return
					}
					f(c, m)
				}
			}()
		}
	}()
}

// Conns lists the established connections, not the ended ones.
func TestListenerConns(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		serveEcho(t, l)
		a := nw.dial(t, l.Addr().String(), testConfig())
		b := nw.dial(t, l.Addr().String(), testConfig())
		for _, c := range []*Conn{a, b} { // an echo: the server has it established
			require.NoError(t, c.Send(Message{ID: 100, Reliable: true}))
			_, err := c.Receive(within(t, 5*time.Second))
			require.NoError(t, err)
		}
		assert.Len(t, l.Conns(), 2)
		remotes := map[string]bool{}
		for _, c := range l.Conns() {
			remotes[c.RemoteAddr().String()] = true
		}
		assert.True(t, remotes[a.LocalAddr().String()] && remotes[b.LocalAddr().String()])
		require.NoError(t, a.Close())
		synctest.Wait() // the server's side has ended too
		assert.Len(t, l.Conns(), 1)
	})
}

// Broadcast never waits: a client whose send buffer is full misses a
// reliable message (and is named), the others get it.
func TestBroadcastSkipsSlowClient(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		scfg := testConfig()
		scfg.SendBuffer = 16 << 10
		g := NewGroup()
		scfg.Group = g
		l := nw.listen(t, scfg)
		fast := nw.dial(t, l.Addr().String(), testConfig())
		slowCfg := testConfig()
		slowCfg.ReceiveBuffer = 8 << 10 // and it never reads
		slow := nw.dial(t, l.Addr().String(), slowCfg)
		events := make([]Event, 4)
		for joined := 0; joined < 2; {
			require.NoError(t, g.Wait(within(t, 5*time.Second)))
			joined += g.Poll(events)
		}
		conns := l.Conns()
		require.Len(t, conns, 2)
		var slowServer *Conn
		for _, c := range conns {
			if c.RemoteAddr().String() == slow.LocalAddr().String() {
				slowServer = c
			}
		}
		require.NotNil(t, slowServer)
		payload := make([]byte, 1000)
		var mu sync.Mutex
		missed := map[*Conn]int{}
		got := 0
		ctx := within(t, 10*time.Second)
		// The fast client reads; the slow one does not. Broadcast until the
		// slow one's buffer is full and it misses one, a game tick apart:
		// the bubble's clock moves only while everything waits, and a
		// fast client's acks go within MaxAckDelay of the clock, so
		// without the tick none would go and the fast client's send
		// buffer would fill as the slow one's does.
		for i := 0; missed[slowServer] == 0; i++ {
			require.Less(t, i, 10000, "the slow client never missed a message")
			if i > 0 {
				<-time.After(time.Second / 30) // the bubble's clock: the next tick
			}
			n := Broadcast(conns, Message{ID: 100, Reliable: true, Payload: payload}, func(c *Conn, err error) {
				mu.Lock()
				missed[c]++
				mu.Unlock()
				assert.ErrorIs(t, err, ErrSendBufferFull)
			})
			assert.GreaterOrEqual(t, n, 1)
			for {
				m, err := fast.Receive(ctx)
				require.NoError(t, err)
				if len(m.Payload) == 1000 {
					got++
					break
				}
			}
		}
		assert.Zero(t, missed[conns[0]]+missed[conns[1]]-missed[slowServer], "the fast client missed nothing")
	})
}

// Stats measure the path: a clean one is quality 1; 20% loss shows as
// about that.
func TestStatsQuality(t *testing.T) {
	for _, tc := range []struct {
		name     string
		loss     float64
		min, max float64
	}{
		{"clean", 0, 0, 0},
		{"loss20", 0.2, 0.1, 0.32},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				nw := memNet(t)
				scfg := testConfig()
				if tc.loss > 0 {
					scfg.Simulate = &Simulation{Loss: tc.loss, Seed: 7}
				}
				l := nw.listen(t, scfg)
				// The server sends unreliable messages at a steady pace; the
				// client measures what arrives.
				done := make(chan struct{})
				t.Cleanup(func() { close(done) })
				go func() {
					c, err := l.AcceptConn(context.Background())
					if err != nil {
						return
					}
					tick := time.NewTicker(2 * time.Millisecond)
					defer tick.Stop()
					for {
						select {
						case <-done:
							return
						case <-tick.C:
							if c.Send(Message{ID: 100, Payload: make([]byte, 100)}) != nil {
								return
							}
						}
					}
				}()
				c := nw.dial(t, l.Addr().String(), testConfig())
				ctx := within(t, 10*time.Second)
				for n := 0; n < 600; n++ {
					_, err := c.Receive(ctx)
					require.NoError(t, err)
				}
				st := c.Stats()
				t.Logf("loss %.3f quality %.2f recv %.0f msg/s %.0f B/s rtt %v", st.LossRate, st.Quality, st.ReceiveMessagesPerSecond, st.ReceiveBytesPerSecond, st.RTT)
				assert.GreaterOrEqual(t, st.LossRate, tc.min)
				assert.LessOrEqual(t, st.LossRate, tc.max)
				assert.Positive(t, st.ReceiveMessagesPerSecond)
				assert.Greater(t, st.ReceiveBytesPerSecond, st.ReceiveMessagesPerSecond*100)
				if tc.loss == 0 {
					assert.Greater(t, st.Quality, 0.8, "a clean path")
				} else {
					assert.Less(t, st.Quality, 0.6)
				}
			})
		})
	}
	assert.Equal(t, 1.0, quality(0, 80*time.Millisecond))
	assert.InDelta(t, 0.5, quality(0.125, 0), 1e-9)
	assert.InDelta(t, 0.5, quality(0, 290*time.Millisecond), 1e-9)
	assert.Zero(t, quality(0.3, 0))
	assert.Zero(t, quality(0, time.Second))
}

// The Logger hears a connection's life, not its traffic.
func TestLoggerLifecycle(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		var mu sync.Mutex
		var buf bytes.Buffer
		logger := slog.New(slog.NewTextHandler(lockedWriter{&mu, &buf}, &slog.HandlerOptions{Level: slog.LevelDebug}))
		cfg := testConfig()
		cfg.Logger = logger
		cfg.Admit = func(_ net.Addr, p []byte) ([]byte, error) {
			if string(p) == "bad" {
				return nil, errors.New("bad token")
			}
			return nil, nil
		}
		l := nw.listen(t, cfg)
		serveEcho(t, l)
		bad := testConfig()
		bad.ConnectPayload = []byte("bad")
		_, err := nw.Dial(context.Background(), l.Addr().String(), bad)
		require.ErrorIs(t, err, ErrRefused)
		c := nw.dial(t, l.Addr().String(), testConfig())
		for range 50 {
			require.NoError(t, c.Send(Message{ID: 100, Reliable: true, Payload: []byte("x")}))
			_, err := c.Receive(within(t, 5*time.Second))
			require.NoError(t, err)
		}
		require.NoError(t, c.CloseWithReason("bye"))
		require.NoError(t, l.Close())
		mu.Lock()
		out := buf.String()
		mu.Unlock()
		assert.Contains(t, out, "connection refused")
		assert.Contains(t, out, "bad token")
		assert.Contains(t, out, "connection established")
		assert.Contains(t, out, "connection ended")
		assert.Contains(t, out, "bye", "the server logs the client's reason")
		assert.Less(t, strings.Count(out, "\n"), 10, "no line per message:\n%s", out)
	})
}

type lockedWriter struct {
	mu *sync.Mutex
	b  *bytes.Buffer
}

func (w lockedWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

// TrySend never waits: a full send buffer is ErrSendBufferFull. StartClose
// returns at once; the peer still gets the reason, and the end shows on
// Done.
func TestTrySendAndStartClose(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		accepted := make(chan *Conn, 1)
		go func() {
			c, err := l.AcceptConn(context.Background())
			if err == nil {
				accepted <- c
			}
		}()
		ccfg := testConfig()
		ccfg.SendBuffer = 8 << 10
		c := nw.dial(t, l.Addr().String(), ccfg)
		sc := <-accepted
		payload := make([]byte, 1000)
		var err error
		for i := 0; err == nil; i++ {
			require.Less(t, i, 1000, "TrySend never found the buffer full")
			err = c.TrySend(Message{ID: 100, Reliable: true, Payload: payload})
		}
		assert.ErrorIs(t, err, ErrSendBufferFull)
		assert.ErrorIs(t, c.TrySend(Message{ID: 100, Payload: payload}), ErrSendBufferFull, "unreliable too")

		sc.StartClose("server shutting down")
		<-sc.Done()
		<-c.Done()
		var de *DisconnectError
		require.True(t, errors.As(c.Err(), &de), "%v", c.Err())
		assert.Equal(t, "server shutting down", de.Reason)
		assert.ErrorIs(t, sc.Err(), net.ErrClosed)
	})
}
