package knet

import (
	"context"
	"fmt"
	"net"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The scheduler (sched.go), in synctest bubbles over the network in
// memory: synctest.Wait returns once every goroutine of the bubble is
// blocked, and the bubble's clock only moves when all of them wait for
// it, so "at once" is a fact the test can check, not a timing guess.

// pairs makes n connections to l and returns each client with the
// server's side of it.
func pairs(t *testing.T, nw *testNet, l *Listener, cfg *Config, n int) (clients, servers []*Conn) {
	t.Helper()
	for range n {
		clients = append(clients, nw.dial(t, l.Addr().String(), cfg))
		servers = append(servers, serverConn(t, l))
	}
	return clients, servers
}

// TestLoneDatagramLeavesAtOnce: a message sent on an idle endpoint
// reaches its peer before the clock moves at all, in a write of its own:
// batching never holds a lone datagram back to wait for company.
func TestLoneDatagramLeavesAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		cfg := testConfig()
		l := nw.listen(t, cfg)
		clients, servers := pairs(t, nw, l, cfg, 20)
		synctest.Wait()
		for i, reliable := range []bool{false, true} {
			before := l.Stats()
			start := time.Now()
			msg := fmt.Sprintf("alone %d", i)
			require.NoError(t, servers[7].TrySend(Message{ID: 6, Payload: []byte(msg), Reliable: reliable}))
			synctest.Wait()
			assert.Equal(t, start, time.Now(), "the clock moved before the datagram left")
			assert.Equal(t, []string{msg}, queuedPayloads(clients[7]), "not delivered at once")
			after := l.Stats()
			assert.Equal(t, before.Writes+1, after.Writes, "one write for the lone datagram")
			assert.Equal(t, before.DatagramsWritten+1, after.DatagramsWritten)
			_, err := clients[7].Receive(within(t, time.Second))
			require.NoError(t, err)
		}
	})
}

// TestBroadcastBatchesWrites: a Broadcast to a hundred connections
// leaves in a few writes (sendmmsg batches on Linux), not one per
// connection, and every connection gets its message.
func TestBroadcastBatchesWrites(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		cfg := testConfig()
		l := nw.listen(t, cfg)
		const n = 100
		clients, servers := pairs(t, nw, l, cfg, n)
		synctest.Wait()
		for round := range 3 {
			before := l.Stats()
			msg := fmt.Sprintf("tick %d", round)
			require.Equal(t, n, Broadcast(servers, Message{ID: 6, Payload: []byte(msg)}, nil))
			synctest.Wait()
			after := l.Stats()
			for i, c := range clients {
				require.Equal(t, []string{msg}, queuedPayloads(c), "client %d", i)
				_, err := c.Receive(within(t, time.Second))
				require.NoError(t, err)
			}
			assert.Equal(t, before.DatagramsWritten+n, after.DatagramsWritten)
			// Each worker writes a batch when it is full (64) and when
			// the queue runs dry: at most two batches more than workers.
			writes := after.Writes - before.Writes
			assert.LessOrEqual(t, writes, uint64(2+2*workersFor(true)), "writes for %d datagrams", n)
			t.Logf("round %d: %d datagrams in %d writes", round, n, writes)
		}
	})
}

// TestTickLoopDeliversInOrder: a game loop's TrySend to each of many
// connections in turn, tick after tick: however the rounds and batches
// fall, every message arrives once, in order. (How many writes they took
// depends on how far the workers lag the loop: logged, not asserted.)
func TestTickLoopDeliversInOrder(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		cfg := testConfig()
		l := nw.listen(t, cfg)
		const n, ticks = 50, 20
		clients, servers := pairs(t, nw, l, cfg, n)
		before := l.Stats()
		for tick := range ticks {
			for _, sc := range servers {
				require.NoError(t, sc.TrySend(Message{ID: 6, Payload: []byte{byte(tick)}, Reliable: true, InOrder: true}))
			}
			time.Sleep(time.Second / 30) // the bubble's clock: the next tick
		}
		for i, c := range clients {
			for tick := range ticks {
				m, err := c.Receive(within(t, 5*time.Second))
				require.NoError(t, err)
				require.Equal(t, []byte{byte(tick)}, m.Payload, "client %d", i)
			}
		}
		after := l.Stats()
		t.Logf("%d datagrams in %d writes", after.DatagramsWritten-before.DatagramsWritten, after.Writes-before.Writes)
	})
}

// TestAdmitHookDoesNotHoldOthers: an Admit hook that takes its time (a
// database, a matchmaker) runs off the workers: connections already open
// go on meanwhile, and the attempt completes once the hook answers.
func TestAdmitHookDoesNotHoldOthers(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		release := make(chan struct{})
		var calls sync.WaitGroup
		var mu sync.Mutex
		first := true
		cfg := testConfig()
		cfg.Admit = func(_ net.Addr, _ []byte) ([]byte, error) {
			mu.Lock()
			slow := !first
			first = false
			mu.Unlock()
			if slow {
				calls.Done()
				<-release
			}
			return nil, nil
		}
		l := nw.listen(t, cfg)
		serveEcho(t, l)
		c := nw.dial(t, l.Addr().String(), forDial(cfg))
		calls.Add(1)
		dialed := make(chan error, 1)
		go func() {
			c2, err := nw.Dial(within(t, time.Minute), l.Addr().String(), forDial(cfg))
			if err == nil {
				c2.Close()
			}
			dialed <- err
		}()
		calls.Wait() // the hook is holding the second attempt
		for i := range 20 {
			require.NoError(t, c.Send(Message{ID: 6, Payload: []byte{byte(i)}, Reliable: true}))
			m, err := c.Receive(within(t, 5*time.Second))
			require.NoError(t, err)
			require.Equal(t, []byte{byte(i)}, m.Payload)
		}
		select {
		case err := <-dialed:
			t.Fatalf("the attempt ended while its Admit hook was still deciding: %v", err)
		default:
		}
		close(release)
		require.NoError(t, <-dialed)
	})
}

// TestDialedSendRunsHere: a dialed connection has its socket to itself,
// so a Send after a pause, with little queued, runs the round on the
// caller's goroutine: the datagram has gone when Send returns, with no
// hand-off to a worker (the counters that round published say so at
// once). Messages sent in a burst still share datagrams.
func TestDialedSendRunsHere(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		cfg := testConfig()
		l := nw.listen(t, cfg)
		serveEcho(t, l)
		c := nw.dial(t, l.Addr().String(), cfg)
		for i := range 20 {
			<-time.After(inlineGap) // on the bubble's clock: a pause between inputs
			synctest.Wait()         // everything idle: no worker has the connection
			sent := c.Stats().DatagramsSent
			require.NoError(t, c.Send(Message{ID: 6, Payload: []byte{byte(i)}, Reliable: true}))
			assert.Greater(t, c.Stats().DatagramsSent, sent, "send %d: not sent when Send returned", i)
			m, err := c.Receive(within(t, 5*time.Second))
			require.NoError(t, err)
			require.Equal(t, []byte{byte(i)}, m.Payload)
		}
		<-time.After(inlineGap)
		synctest.Wait()
		sent := c.Stats().DatagramsSent
		const burst = 50
		for i := range burst {
			require.NoError(t, c.Send(Message{ID: 7, Payload: []byte{byte(i)}}))
		}
		for i := range burst {
			m, err := c.Receive(within(t, 5*time.Second))
			require.NoError(t, err)
			require.Equal(t, []byte{byte(i)}, m.Payload)
		}
		synctest.Wait()
		assert.Less(t, c.Stats().DatagramsSent-sent, uint64(burst/2), "a burst's messages did not share datagrams")
	})
}

// TestReplyRunsHere: a Send right after Receive took a message (an echo,
// a response, a client's next request) runs its round on the caller's
// goroutine, on a server's connection as on a dialed one, however soon after
// the last: its datagram has left when Send returns.
func TestReplyRunsHere(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		cfg := testConfig()
		l := nw.listen(t, cfg)
		accepted := make(chan *Conn, 1)
		go func() {
			sc, err := l.AcceptConn(context.Background())
			if err == nil {
				accepted <- sc
			}
		}()
		c := nw.dial(t, l.Addr().String(), cfg)
		ctx := within(t, 5*time.Second)
		require.NoError(t, c.Send(Message{ID: 6, Payload: []byte{0}, Reliable: true}))
		sc := <-accepted
		for i := range 20 {
			m, err := sc.Receive(ctx)
			require.NoError(t, err)
			synctest.Wait() // no worker has the connection
			sent := sc.Stats().DatagramsSent
			require.NoError(t, sc.Send(Message{ID: 6, Payload: m.Payload, Reliable: true}))
			assert.Greater(t, sc.Stats().DatagramsSent, sent, "reply %d: not sent when Send returned", i)

			m, err = c.Receive(ctx)
			require.NoError(t, err)
			require.Equal(t, []byte{byte(i)}, m.Payload)
			synctest.Wait()
			sent = c.Stats().DatagramsSent
			require.NoError(t, c.Send(Message{ID: 6, Payload: []byte{byte(i + 1)}, Reliable: true}))
			assert.Greater(t, c.Stats().DatagramsSent, sent, "request %d: not sent when Send returned", i+1)
		}
	})
}

// TestRunQueueKeepsOrderAndBounds: the run queue hands connections out
// first in, first out, and one that never runs dry (a server behind its
// load) does not keep what was taken from it.
func TestRunQueueKeepsOrderAndBounds(t *testing.T) {
	var q scheduler // max 0: no workers start, the test takes
	q.wake = make(chan struct{})
	conns := make([]*Conn, 5000)
	for i := range conns {
		conns[i] = new(Conn)
	}
	next, taken := 0, 0
	for round := 0; round < 200; round++ {
		for range 25 {
			q.push(conns[next%len(conns)])
			next++
		}
		for range 24 { // one fewer than pushed: never empty
			c := q.pop()
			require.Same(t, conns[taken%len(conns)], c, "out of order at %d", taken)
			taken++
		}
		assert.LessOrEqual(t, len(q.queue), 3*1024, "round %d: the queue keeps %d entries for %d waiting", round, len(q.queue), next-taken)
	}
	assert.Equal(t, 200, next-taken)
}

// A worker's rounds share its scratch space: nothing one connection's round
// leaves there reaches the next connection's session.
func TestScratchReleasedBetweenRounds(t *testing.T) {
	var sc scratchSpace
	sc.acked = ackResult{appBytes: 700, tids: []byte{3, 4}, rels: []relRange{{}}, fragDgrams: 2}
	h := &held{}
	sc.ready = readyHeap{h}
	sc.woken = []*held{h}
	sc.dropped = []*held{h}
	sc.expired = []*held{h}
	sc.release()
	require.Zero(t, sc.acked.appBytes)
	require.Zero(t, sc.acked.fragDgrams)
	require.Empty(t, sc.acked.tids)
	require.Empty(t, sc.acked.rels)
	require.Empty(t, sc.ready)
	for _, s := range [][]*held{sc.woken, sc.dropped, sc.expired, sc.ready} {
		require.Empty(t, s)
		require.Nil(t, s[:cap(s)][0], "a pointer kept past the slice's end")
	}
}
