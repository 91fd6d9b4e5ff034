package knet

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/netsim"
)

// seqMessage is the n-th message of a numbered reliable stream.
func seqMessage(n uint32) Message {
	return Message{ID: 100, Reliable: true, InOrder: true, Payload: binary.BigEndian.AppendUint32(nil, n)}
}

// A drain while both sides keep sending: every reliable message the
// server's Send accepted reaches its client, in order, before the end;
// what the server's Group got from each client is the start of what it
// sent, with no hole; each client ends with the drain's reason, the Group
// sees each connection's EventDisconnected, the listener's count of
// connections falls to 0 and Drain returns nil; afterwards a Dial is
// refused with the reason.
func TestDrainWhileSending(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const clients = 3
		const reason = "server shutting down: find another"
		nw := memNet(t)
		g := NewGroup()
		cfg := testConfig()
		cfg.Group = g
		l := nw.listen(t, cfg)

		// The server: a game loop on the group, and a sender for each
		// connection counting what its Send accepted.
		var mu sync.Mutex
		accepted := map[*Conn]uint32{}
		var senders sync.WaitGroup
		type served struct {
			got  uint32 // messages received, each the next number
			hole bool
			end  error
		}
		serverSide := make(chan map[*Conn]*served, 1)
		go func() {
			seen := map[*Conn]*served{}
			ended := 0
			events := make([]Event, 64)
			for ended < clients {
				if g.Wait(context.Background()) != nil {
					break
				}
				for _, e := range events[:g.Poll(events)] {
					switch e.Kind {
					case EventConnected:
						seen[e.Conn] = &served{}
						c := e.Conn
						senders.Go(func() {
							for n := uint32(0); ; n++ {
								if c.Send(seqMessage(n)) != nil {
									return
								}
								mu.Lock()
								accepted[c] = n + 1
								mu.Unlock()
								time.Sleep(time.Millisecond) // a game's pace, on the bubble's clock
							}
						})
					case EventMessage:
						s := seen[e.Conn]
						if binary.BigEndian.Uint32(e.Message.Payload) != s.got {
							s.hole = true
						}
						s.got++
					case EventDisconnected:
						seen[e.Conn].end = e.Err
						ended++
					}
				}
			}
			serverSide <- seen
		}()

		// The clients: each sends a numbered stream and reads the
		// server's until it ends.
		type client struct {
			c       *Conn
			got     uint32
			hole    bool
			recvEnd error
			sendEnd error
		}
		var cs [clients]*client
		var wg sync.WaitGroup
		for i := range cs {
			cl := &client{c: nw.dial(t, l.Addr().String(), testConfig())}
			cs[i] = cl
			wg.Go(func() {
				for n := uint32(0); ; n++ {
					if cl.sendEnd = cl.c.Send(seqMessage(n)); cl.sendEnd != nil {
						return
					}
					time.Sleep(time.Millisecond)
				}
			})
			wg.Go(func() {
				for {
					m, err := cl.c.Receive(context.Background())
					if err != nil {
						cl.recvEnd = err
						return
					}
					if binary.BigEndian.Uint32(m.Payload) != cl.got {
						cl.hole = true
					}
					cl.got++
				}
			})
		}
		// Traffic flows both ways before the drain.
		for i := 0; ; i++ {
			require.Less(t, i, 1000, "no traffic")
			mu.Lock()
			n := len(accepted)
			low := uint32(1 << 31)
			for _, a := range accepted {
				low = min(low, a)
			}
			mu.Unlock()
			if n == clients && low > 100 && l.Stats().Connections == clients {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}

		// The progress, sampled while the drain runs.
		drained := make(chan struct{})
		progress := make(chan []int, 1)
		before := l.Stats().Connections
		go func() {
			seen := []int{before}
			for {
				seen = append(seen, l.Stats().Connections)
				select {
				case <-drained:
					progress <- append(seen, l.Stats().Connections)
					return
				case <-time.After(time.Millisecond):
				}
			}
		}()
		require.NoError(t, l.Drain(within(t, time.Minute), reason))
		close(drained)
		assert.Zero(t, l.Stats().Connections)
		seen := <-progress
		assert.Equal(t, clients, seen[0])
		assert.Zero(t, seen[len(seen)-1])
		for i := 1; i < len(seen); i++ {
			assert.LessOrEqual(t, seen[i], seen[i-1], "the count of connections only falls: %v", seen)
		}

		wg.Wait()
		senders.Wait()
		server := <-serverSide
		for _, cl := range cs {
			var sc *Conn
			for c := range server {
				if c.RemoteAddr().String() == cl.c.LocalAddr().String() {
					sc = c
				}
			}
			require.NotNil(t, sc)
			mu.Lock()
			sent := accepted[sc]
			mu.Unlock()
			assert.Equal(t, sent, cl.got, "every message the server's Send accepted arrives")
			assert.False(t, cl.hole, "and in order")
			assert.Equal(t, io.EOF, cl.recvEnd)
			<-cl.c.Done() // after its linger
			var de *DisconnectError
			require.True(t, errors.As(cl.c.Err(), &de), "%v", cl.c.Err())
			assert.Equal(t, reason, de.Reason)
			assert.ErrorIs(t, cl.sendEnd, ErrPeerClosed)

			s := server[sc]
			assert.False(t, s.hole, "the server got each client's stream without a hole")
			assert.Greater(t, s.got, uint32(0))
			assert.ErrorIs(t, s.end, net.ErrClosed, "EventDisconnected: this side closed")
			assert.NoError(t, sc.Close(), "a drained connection ended gracefully")
		}

		// Still open but drained: a newcomer is told why.
		refused := l.Stats().RefusedAttempts
		_, err := nw.Dial(within(t, 10*time.Second), l.Addr().String(), testConfig())
		var re *RefusedError
		require.True(t, errors.As(err, &re), "%v", err)
		assert.Equal(t, reason, re.Reason)
		assert.Equal(t, refused+1, l.Stats().RefusedAttempts)
		l.SetListenOpen(true)
		_, err = nw.Dial(within(t, 10*time.Second), l.Addr().String(), testConfig())
		assert.ErrorIs(t, err, ErrRefused, "a drained listener does not reopen")
	})
}

// A drain whose ctx ends first returns its error and leaves the
// connections that did not answer counted; a Dial meanwhile is refused
// with the reason; a second Drain waits for the rest, which end by
// DisconnectTimeout.
func TestDrainDeadline(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const reason = "maintenance"
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		accepted := make(chan *Conn, 2)
		go func() {
			for {
				c, err := l.AcceptConn(context.Background())
				if err != nil {
					return
				}
				accepted <- c
			}
		}()
		a := nw.dial(t, l.Addr().String(), testConfig())
		<-accepted
		b := nw.dial(t, l.Addr().String(), testConfig())
		<-accepted
		// b falls silent, both ways.
		srv := unmap(l.Addr().(*net.UDPAddr).AddrPort())
		bAddr := unmap(b.LocalAddr().(*net.UDPAddr).AddrPort())
		nw.mem.SetLink(bAddr, srv, &netsim.Params{Loss: 1})
		nw.mem.SetLink(srv, bAddr, &netsim.Params{Loss: 1})

		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		defer cancel()
		start := time.Now()
		drainErr := make(chan error, 1)
		go func() { drainErr <- l.Drain(ctx, reason) }()
		<-a.Done() // the drain is under way
		var de *DisconnectError
		require.True(t, errors.As(a.Err(), &de), "%v", a.Err())
		assert.Equal(t, reason, de.Reason)

		_, err := nw.Dial(within(t, 10*time.Second), l.Addr().String(), testConfig())
		var re *RefusedError
		require.True(t, errors.As(err, &re), "a Dial during the drain: %v", err)
		assert.Equal(t, reason, re.Reason)

		err = <-drainErr
		assert.ErrorIs(t, err, context.DeadlineExceeded)
		assert.Equal(t, 500*time.Millisecond, time.Since(start), "when ctx ended")
		st := l.Stats()
		assert.Equal(t, 1, st.Connections, "the silent one is left")
		assert.Equal(t, uint64(1), st.RefusedAttempts)

		// Waiting longer: the silent connection ends by DisconnectTimeout.
		require.NoError(t, l.Drain(within(t, time.Minute), reason))
		assert.Zero(t, l.Stats().Connections)
		assert.LessOrEqual(t, time.Since(start), testConfig().DisconnectTimeout+time.Second)
		require.NoError(t, l.Close())
		nw.mem.SetLink(bAddr, srv, nil)
		nw.mem.SetLink(srv, bAddr, nil)
	})
}

// StopAdmitting, the gentle first step: attempts are refused with the
// reason while the connections made go on; SetListenOpen(true) reopens.
func TestStopAdmitting(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		serveEcho(t, l)
		c := nw.dial(t, l.Addr().String(), testConfig())

		l.StopAdmitting("match in progress")
		_, err := nw.Dial(within(t, 10*time.Second), l.Addr().String(), testConfig())
		var re *RefusedError
		require.True(t, errors.As(err, &re), "%v", err)
		assert.Equal(t, "match in progress", re.Reason)

		require.NoError(t, c.Send(seqMessage(7)))
		m, err := c.Receive(within(t, 5*time.Second))
		require.NoError(t, err, "the connections made are served")
		assert.Equal(t, seqMessage(7).Payload, m.Payload)

		l.SetListenOpen(true)
		nw.dial(t, l.Addr().String(), testConfig())
	})
}
