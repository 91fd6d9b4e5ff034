package knet

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// parkWatch lowers parkAfter for a test and reports each connection's
// goroutine parking on a channel.
func parkWatch(t *testing.T, after time.Duration) <-chan *Conn {
	parked := make(chan *Conn, 64)
	old := parkAfter.Swap(int64(after))
	h := func(c *Conn) {
		select {
		case parked <- c:
		default:
		}
	}
	parkHook.Store(&h)
	t.Cleanup(func() {
		parkHook.Store(nil)
		parkAfter.Store(old)
	})
	return parked
}

// waitGoroutineParked waits until c's goroutine parked.
func waitGoroutineParked(t *testing.T, parked <-chan *Conn, c *Conn) {
	t.Helper()
	timeout := time.After(10 * time.Second) // a bound, not a wait
	for {
		if c.parked.Load() {
			return // its report may have gone to an earlier wait
		}
		select {
		case <-parked:
		case <-timeout:
			t.Fatal("the connection's goroutine did not park")
		}
	}
}

// TestIdleConnectionParks: an idle connection's goroutine ends, and every
// kind of work starts it again: a datagram from the peer, a Send, the
// keepalive timer, the peer's close, Close.
func TestIdleConnectionParks(t *testing.T) {
	parked := parkWatch(t, 20*time.Millisecond)
	cfg := testConfig()
	cfg.PingInterval = 50 * time.Millisecond
	cfg.ConnectionLostTimeout = 200 * time.Millisecond
	l := listen(t, cfg)
	c := dial(t, l.Addr().String(), cfg)
	sc := serverConn(t, l)
	roundTrip := func(from, to *Conn, what string) {
		t.Helper()
		require.NoError(t, from.Send(Message{ID: 6, Payload: []byte(what), Reliable: true}))
		got, err := to.Receive(within(t, 5*time.Second))
		require.NoError(t, err)
		require.Equal(t, what, string(got.Payload))
	}
	roundTrip(c, sc, "hello")

	// Both park; a Send on one and the datagram on the other start them.
	waitGoroutineParked(t, parked, c)
	waitGoroutineParked(t, parked, sc)
	roundTrip(c, sc, "to the server")
	waitGoroutineParked(t, parked, c)
	waitGoroutineParked(t, parked, sc)
	roundTrip(sc, c, "to the client")

	// The keepalive keeps them alive through many parkings: several
	// lost timeouts pass with no application traffic.
	pings := c.Stats().DatagramsSent
	timeout := time.After(10 * time.Second) // a bound, not a wait
	for n := 0; n < 12; {
		select {
		case p := <-parked:
			if p == c {
				n++ // parked again after a keepalive woke it
			}
		case <-timeout:
			t.Fatalf("parked %d times, want 12", n)
		}
	}
	assert.Greater(t, c.Stats().DatagramsSent, pings, "keepalive pings while parked")
	roundTrip(c, sc, "still there")
	require.NoError(t, c.Err())
	require.NoError(t, sc.Err())

	// The peer's close reaches a parked connection, and so does Close.
	waitGoroutineParked(t, parked, sc)
	waitGoroutineParked(t, parked, c)
	require.NoError(t, c.Close())
	_, err := sc.Receive(within(t, 5*time.Second))
	assert.Error(t, err)
	select {
	case <-sc.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the parked server connection did not end on the peer's close")
	}
}

// TestParkRacesWithWork: many connections parking and being kicked at
// once lose no message.
func TestParkRacesWithWork(t *testing.T) {
	parkWatch(t, time.Millisecond)
	cfg := testConfig()
	l := listen(t, cfg)
	serveEcho(t, l)
	var wg sync.WaitGroup
	for range 8 {
		c := dial(t, l.Addr().String(), cfg)
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
					time.Sleep(2 * time.Millisecond) // idle long enough to park
				}
			}
		})
	}
	wg.Wait()
}

// TestListenerCloseEndsParkedConnections: a Listener's Close returns once
// its connections ended, parked ones included.
func TestListenerCloseEndsParkedConnections(t *testing.T) {
	parked := parkWatch(t, 20*time.Millisecond)
	cfg := testConfig()
	l, err := Listen("udp", "127.0.0.1:0", cfg)
	require.NoError(t, err)
	var server []*Conn
	for range 3 {
		c := dial(t, l.Addr().String(), cfg)
		require.NoError(t, c.Send(Message{ID: 6, Reliable: true}))
		sc, err := l.AcceptConn(within(t, 5*time.Second))
		require.NoError(t, err)
		_, err = sc.Receive(within(t, 5*time.Second))
		require.NoError(t, err)
		server = append(server, sc)
	}
	for _, sc := range server {
		waitGoroutineParked(t, parked, sc)
	}
	require.NoError(t, l.Close())
	for i, sc := range server {
		select {
		case <-sc.Done():
		default:
			t.Errorf("connection %d not ended when Close returned", i)
		}
	}
}
