package knet

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/netsim"
)

// What the system says about our sends: errors are counted, never
// counted as sent, and a peer that is gone is noticed as soon as the system
// says so again and again.

// waitDone waits for c to end, at most d.
func waitDone(t *testing.T, c *Conn, d time.Duration) {
	t.Helper()
	select {
	case <-c.Done():
	case <-time.After(d):
		t.Fatalf("connection still up after %v (stats %+v)", d, c.Stats())
	}
}

func TestDialNothingListeningFailsFast(t *testing.T) {
	gone, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	addr := gone.LocalAddr().String()
	gone.Close()

	start := time.Now()
	_, err = sysNet().Dial(within(t, 10*time.Second), addr, &Config{ConnectTimeout: 5 * time.Second})
	took := time.Since(start)
	require.ErrorIs(t, err, ErrPortUnreachable)
	assert.ErrorIs(t, err, syscall.ECONNREFUSED, "as a TCP user would check")
	assert.Less(t, took, 2*time.Second, "not the ConnectTimeout")
	t.Logf("failed after %v: %v", took, err)
}

// serveHalfway answers one ConnectSyn with a ConnectSynAck and does
// nothing more: a server that completes the handshake, then vanishes when
// its socket is closed.
func serveHalfway(t *testing.T) *net.UDPConn {
	srv, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	t.Cleanup(func() { srv.Close() })
	var wg sync.WaitGroup
	wg.Go(func() {
		buf := make([]byte, 2048)
		_, from, err := srv.ReadFromUDPAddrPort(buf)
		if err != nil {
			return
		}
		srv.WriteToUDPAddrPort(appendDatagram(nil, &datagram{msgs: []message{{id: idConnectSynAck}}}), from)
	})
	t.Cleanup(wg.Wait)
	return srv
}

func TestOpenConnectionEndsWhenServerVanishes(t *testing.T) {
	srv := serveHalfway(t)
	c := dial(t, srv.LocalAddr().String(), testConfig())
	srv.Close() // the process is gone: its port answers with ICMP
	require.NoError(t, c.Send(Message{ID: 6, Payload: []byte("anyone?"), Reliable: true}))
	// Not ConnectionLostTimeout (15s) nor the retransmission limit: the
	// resends draw port unreachable reports, and three end it.
	waitDone(t, c, 5*time.Second)
	err := c.Err()
	assert.ErrorIs(t, err, ErrPortUnreachable)
	assert.ErrorIs(t, err, syscall.ECONNREFUSED)
	assert.ErrorIs(t, err, net.ErrClosed)
	_, err = c.Receive(context.Background())
	assert.ErrorIs(t, err, ErrPortUnreachable)
}

func TestPortUnreachableMustRepeat(t *testing.T) {
	// Reports injected as the socket reader makes them: fewer than
	// openStrikes in a row, or broken by a datagram from the peer, leave
	// the connection up.
	cfg := testConfig()
	cfg.DisconnectTimeout = 200 * time.Millisecond // the server's side, when the client is gone
	l := listen(t, forListen(cfg))
	serveEcho(t, l)
	c := dial(t, l.Addr().String(), cfg)
	for range 3 {
		c.refusals.Add(openStrikes - 1)
		c.kick()
		require.NoError(t, c.Send(Message{ID: 6, Reliable: true}))
		_, err := c.Receive(within(t, 5*time.Second)) // the peer is heard: the count starts again
		require.NoError(t, err)
	}
	require.NoError(t, c.Err())
	c.refusals.Add(openStrikes)
	c.kick()
	waitDone(t, c, 5*time.Second)
	assert.ErrorIs(t, c.Err(), ErrPortUnreachable)
}

// relayed runs an echo server behind a lossless relay, and returns the
// relay, the client and, once accepted, the server's side.
func relayed(t *testing.T, cfg *Config) (*netsim.Relay, *Conn, *Conn) {
	l := listen(t, forListen(cfg))
	r, err := netsim.NewRelay(l.Addr().String(), netsim.Params{}, netsim.Params{})
	require.NoError(t, err)
	t.Cleanup(func() { r.Close() })
	c := dial(t, r.Addr().String(), forDial(cfg))
	sc := serverConn(t, l)
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			m, err := sc.Receive(context.Background())
			if err != nil {
				return
			}
			if sc.Send(m) != nil {
				return
			}
		}
	})
	t.Cleanup(func() { sc.Close(); wg.Wait() })
	return r, c, sc
}

// pingPong sends n messages one at a time, reliable and unreliable in
// turn, each waiting for its echo (an unreliable one at most a while).
func pingPong(t *testing.T, c *Conn, n, size int) {
	p := make([]byte, size)
	for i := range n {
		binary.LittleEndian.PutUint32(p, uint32(i))
		require.NoError(t, c.Send(Message{ID: 6, Payload: p, Reliable: i%2 == 0}))
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_, err := c.Receive(ctx)
		cancel()
		if i%2 == 0 {
			require.NoError(t, err)
		}
	}
}

func TestStatsMatchWhatCrossedTheSocket(t *testing.T) {
	// Everything each side counts as sent went through the relay, byte
	// for byte: ping-pong, a bulk stream (GSO runs on Linux), fragmented
	// messages, the handshake and the Disconnect exchange.
	r, c, sc := relayed(t, testConfig())
	pingPong(t, c, 500, 64)
	const bulk = 2000
	for i := range bulk {
		require.NoError(t, c.Send(Message{ID: 7, Payload: make([]byte, 1200), Reliable: true}))
		if i%100 == 0 {
			require.NoError(t, c.Send(Message{ID: 8, Payload: make([]byte, 20000), Reliable: true}))
		}
	}
	ctx := within(t, 30*time.Second)
	for range bulk + bulk/100 {
		_, err := c.Receive(ctx)
		require.NoError(t, err)
	}
	require.NoError(t, c.Close())
	waitDone(t, sc, 10*time.Second)
	require.Eventually(t, func() bool {
		up, down := r.Stats()
		cs, ss := c.Stats(), sc.Stats()
		return cs.DatagramsSent == up.Sent && cs.BytesSent == up.Bytes && ss.DatagramsSent == down.Sent && ss.BytesSent == down.Bytes
	}, 5*time.Second, time.Millisecond)
	up, down := r.Stats()
	t.Logf("client sent %d datagrams, %d bytes; server %d, %d; send errors %d, %d", up.Sent, up.Bytes, down.Sent, down.Bytes, c.Stats().SendErrors, sc.Stats().SendErrors)
}

func TestPingPongDatagramsStaySmall(t *testing.T) {
	// The echo example's pattern: one 64-byte message at a time. Each
	// datagram carries the message and the acks it owes; acks repeated for
	// safety must not add a block each (they made the datagrams twice as
	// large as the message and its headers).
	r, c, _ := relayed(t, testConfig())
	pingPong(t, c, 2000, 64)
	up, _ := r.Stats()
	st := c.Stats()
	avg := float64(up.Bytes) / float64(up.Sent)
	t.Logf("client: %d datagrams, %d bytes on the wire, %.1f a datagram; stats say %d, %d", up.Sent, up.Bytes, avg, st.DatagramsSent, st.BytesSent)
	// 64 bytes of payload, 3 of datagram header, 3 of message header,
	// a PacketAck block (10) and room for a second and a ping.
	assert.Less(t, avg, 100.0)
}

func TestCloseReportsHowItEnded(t *testing.T) {
	closedAgain := func(t *testing.T, c *Conn) {
		t.Helper()
		err := c.Close()
		assert.ErrorIs(t, err, net.ErrClosed, "a second Close, as net.Conn's")
		var op *net.OpError
		assert.ErrorAs(t, err, &op)
	}
	t.Run("graceful", func(t *testing.T) {
		l := listen(t, testConfig())
		serveEcho(t, l)
		c := dial(t, l.Addr().String(), testConfig())
		pingPong(t, c, 4, 16)
		assert.NoError(t, c.Close())
		closedAgain(t, c)
	})
	t.Run("peer closed first", func(t *testing.T) {
		l := listen(t, testConfig())
		c := dial(t, l.Addr().String(), testConfig())
		require.NoError(t, c.Send(Message{ID: 6, Reliable: true}))
		sc := serverConn(t, l)
		assert.NoError(t, sc.Close())
		_, err := c.Receive(within(t, 5*time.Second))
		require.ErrorIs(t, err, io.EOF)
		assert.NoError(t, c.Close())
		closedAgain(t, c)
	})
	t.Run("closed by the listener", func(t *testing.T) {
		l := listen(t, testConfig())
		c := dial(t, l.Addr().String(), testConfig())
		require.NoError(t, c.Send(Message{ID: 6, Reliable: true}))
		sc := serverConn(t, l)
		require.NoError(t, l.Close())
		assert.NoError(t, sc.Close(), "the application's first Close")
		closedAgain(t, sc)
	})
	t.Run("server vanished", func(t *testing.T) {
		srv := serveHalfway(t)
		c := dial(t, srv.LocalAddr().String(), testConfig())
		srv.Close()
		require.NoError(t, c.Send(Message{ID: 6, Reliable: true}))
		waitDone(t, c, 5*time.Second)
		assert.ErrorIs(t, c.Close(), ErrPortUnreachable, "why it ended, before Close")
		closedAgain(t, c)
	})
	t.Run("peer fell silent", func(t *testing.T) {
		cfg := testConfig()
		cfg.ConnectionLostTimeout = 300 * time.Millisecond
		cfg.DisconnectTimeout = 200 * time.Millisecond
		r, c, _ := relayed(t, cfg)
		pingPong(t, c, 4, 16)
		r.Blackhole(true)
		waitDone(t, c, 5*time.Second)
		var te *TimeoutError
		assert.ErrorAs(t, c.Close(), &te)
		closedAgain(t, c)
	})
}
