package knet

import (
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Parking (Conn.park), in synctest bubbles over a network in memory: the
// tests wait for parkings as events, and the bubble's clock says when
// they came.

// parkWatcher hears of the parkings of a testNet's connections.
type parkWatcher struct {
	mu    sync.Mutex
	count map[*Conn]int
	note  map[*Conn]chan struct{} // capacity 1: signalled at each parking
}

// watchParking has n's connections park after this much idleness and
// report it. Set it before the connections are made.
func (n *testNet) watchParking(after time.Duration) *parkWatcher {
	w := &parkWatcher{count: make(map[*Conn]int), note: make(map[*Conn]chan struct{})}
	n.parkAfter = after
	n.parkHook = func(c *Conn) {
		w.mu.Lock()
		w.count[c]++
		ch := w.noteLocked(c)
		w.mu.Unlock()
		signal(ch)
	}
	return w
}

func (w *parkWatcher) noteLocked(c *Conn) chan struct{} {
	ch := w.note[c]
	if ch == nil {
		ch = make(chan struct{}, 1)
		w.note[c] = ch
	}
	return ch
}

// parkings is how many times c's goroutine parked.
func (w *parkWatcher) parkings(c *Conn) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.count[c]
}

// until waits until cond holds, looking again at each parking of c. The
// bound is on the bubble's clock: it fails the test at once in real time.
func (w *parkWatcher) until(t testing.TB, c *Conn, what string, cond func() bool) {
	t.Helper()
	w.mu.Lock()
	ch := w.noteLocked(c)
	w.mu.Unlock()
	timeout := time.After(time.Minute)
	for !cond() {
		select {
		case <-ch:
		case <-timeout:
			t.Fatalf("%s: not within a minute", what)
		}
	}
}

// parked waits until c's goroutine is parked.
func (w *parkWatcher) parked(t testing.TB, c *Conn) {
	t.Helper()
	w.until(t, c, "the connection's goroutine did not park", c.parked.Load)
}

// TestIdleConnectionParks: an idle connection's goroutine ends once it
// has been idle for parkAfter, and every kind of work starts it again: a
// datagram from the peer, a Send, the keepalive timer, the peer's close,
// Close.
func TestIdleConnectionParks(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const after = 20 * time.Millisecond
		nw := memNet(t)
		w := nw.watchParking(after)
		cfg := testConfig()
		cfg.PingInterval = 50 * time.Millisecond
		cfg.ConnectionLostTimeout = 200 * time.Millisecond
		l := nw.listen(t, cfg)
		c := nw.dial(t, l.Addr().String(), cfg)
		sc := serverConn(t, l)
		roundTrip := func(from, to *Conn, what string) {
			t.Helper()
			require.NoError(t, from.Send(Message{ID: 6, Payload: []byte(what), Reliable: true}))
			got, err := to.Receive(within(t, 5*time.Second))
			require.NoError(t, err)
			require.Equal(t, what, string(got.Payload))
		}
		roundTrip(c, sc, "hello")

		// Both park, not before parkAfter; a Send on one and the
		// datagram on the other start them.
		idle := time.Now()
		w.parked(t, c)
		w.parked(t, sc)
		assert.GreaterOrEqual(t, time.Since(idle), after, "parked before parkAfter")
		roundTrip(c, sc, "to the server")
		w.parked(t, c)
		w.parked(t, sc)
		roundTrip(sc, c, "to the client")

		// The keepalive keeps them alive through many parkings: several
		// lost timeouts pass with no application traffic.
		pings := c.Stats().DatagramsSent
		from := w.parkings(c)
		start := time.Now()
		w.until(t, c, "12 parkings", func() bool { return w.parkings(c) >= from+12 })
		assert.Greater(t, time.Since(start), 2*cfg.ConnectionLostTimeout, "parkings between keepalives, a ping interval apart")
		assert.Greater(t, c.Stats().DatagramsSent, pings, "keepalive pings while parked")
		roundTrip(c, sc, "still there")
		require.NoError(t, c.Err())
		require.NoError(t, sc.Err())

		// The peer's close reaches a parked connection, and so does Close.
		w.parked(t, sc)
		w.parked(t, c)
		require.NoError(t, c.Close())
		_, err := sc.Receive(within(t, 5*time.Second))
		assert.Error(t, err)
		<-sc.Done() // the parked server connection ends on the peer's close
	})
}

// TestParkRacesWithWork: many connections parking and being kicked at
// once lose no message.
func TestParkRacesWithWork(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		w := nw.watchParking(time.Millisecond)
		cfg := testConfig()
		l := nw.listen(t, cfg)
		serveEcho(t, l)
		var wg sync.WaitGroup
		for range 8 {
			c := nw.dial(t, l.Addr().String(), cfg)
			wg.Go(func() {
				for i := range 60 {
					if err := c.Send(Message{ID: 6, Payload: []byte{byte(i)}, Reliable: true}); !assert.NoError(t, err) {
						return
					}
					got, err := c.Receive(within(t, 5*time.Second))
					if !assert.NoError(t, err) || !assert.Equal(t, []byte{byte(i)}, got.Payload) {
						return
					}
					if i%7 == 0 {
						w.parked(t, c) // idle long enough to park
					}
				}
			})
		}
		wg.Wait()
	})
}

// TestListenerCloseEndsParkedConnections: a Listener's Close returns once
// its connections ended, parked ones included.
func TestListenerCloseEndsParkedConnections(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		w := nw.watchParking(20 * time.Millisecond)
		cfg := testConfig()
		l, err := nw.Listen(cfg)
		require.NoError(t, err)
		var server []*Conn
		for range 3 {
			c := nw.dial(t, l.Addr().String(), cfg)
			require.NoError(t, c.Send(Message{ID: 6, Reliable: true}))
			sc, err := l.AcceptConn(within(t, 5*time.Second))
			require.NoError(t, err)
			_, err = sc.Receive(within(t, 5*time.Second))
			require.NoError(t, err)
			server = append(server, sc)
		}
		for _, sc := range server {
			w.parked(t, sc)
		}
		require.NoError(t, l.Close())
		for i, sc := range server {
			select {
			case <-sc.Done():
			default:
				t.Errorf("connection %d not ended when Close returned", i)
			}
		}
	})
}
