package knet

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	"github.com/knet-go/knet/internal/udp"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// End-to-end tests of kNet over TCP (stream.go) on real loopback sockets.

func tcpConfig() *Config {
	cfg := testConfig()
	cfg.TCP = true
	return cfg
}

// A client over TCP reaches a Listener's TCP socket on the UDP port, and
// every delivery mode crosses, echoed, in its order where it has one.
func TestTCPEchoEveryMode(t *testing.T) {
	l := listen(t, tcpConfig())
	serveEcho(t, l)
	ctx := within(t, 20*time.Second)
	c, err := Dial(ctx, "tcp", l.Addr().String(), testConfig())
	require.NoError(t, err)
	assert.Equal(t, TransportTCP, c.Transport())
	assert.Equal(t, DialectSpec, c.Dialect(), "a knet server said hello")
	assert.IsType(t, &net.TCPAddr{}, c.RemoteAddr())
	assert.Equal(t, l.Addr().(*net.UDPAddr).Port, c.RemoteAddr().(*net.TCPAddr).Port, "the same port number")

	echoEveryMode(t, ctx, c)
	require.NoError(t, c.Close())
	assert.ErrorIs(t, c.Err(), net.ErrClosed)
}

// The server's Admit hook reads the client's ConnectPayload over TCP, and
// its reply reaches the client's Handshake; a refusal reaches Dial with
// its reason, and a CloseWithReason the peer's Err.
func TestTCPAdmitReplyRefusalAndReason(t *testing.T) {
	cfg := tcpConfig()
	cfg.Admit = func(_ net.Addr, p []byte) ([]byte, error) {
		if string(p) == "let me in" {
			return []byte("welcome"), nil
		}
		return nil, errors.New("no such player")
	}
	l := listen(t, cfg)
	ctx := within(t, 20*time.Second)

	ccfg := testConfig()
	ccfg.ConnectPayload = []byte("intruder")
	_, err := Dial(ctx, "tcp", l.Addr().String(), ccfg)
	require.ErrorIs(t, err, ErrRefused)
	var re *RefusedError
	require.ErrorAs(t, err, &re)
	assert.Equal(t, "no such player", re.Reason)

	ccfg.ConnectPayload = []byte("let me in")
	c, err := Dial(ctx, "tcp", l.Addr().String(), ccfg)
	require.NoError(t, err)
	syn, synAck := c.Handshake()
	assert.Equal(t, "let me in", string(syn))
	assert.Equal(t, "welcome", string(synAck))
	sc, err := l.AcceptConn(ctx)
	require.NoError(t, err)
	assert.Equal(t, TransportTCP, sc.Transport())
	syn, _ = sc.Handshake()
	assert.Equal(t, "let me in", string(syn))
	assert.GreaterOrEqual(t, l.Stats().RefusedAttempts, uint64(1))

	require.NoError(t, sc.Send(Message{ID: 9, Payload: []byte("last words"), Reliable: true}))
	require.NoError(t, sc.CloseWithReason("server shutting down"))
	m, err := c.Receive(ctx)
	require.NoError(t, err)
	assert.Equal(t, "last words", string(m.Payload), "what was sent before the close arrives")
	_, err = c.Receive(ctx)
	assert.ErrorIs(t, err, io.EOF)
	<-c.Done()
	var de *DisconnectError
	require.ErrorAs(t, c.Err(), &de)
	assert.Equal(t, "server shutting down", de.Reason)
	l.Close()
}

// A server that only speaks UDP: Dial over TCP fails at once (nothing
// listens on TCP), and a Listener without Config.TCP has no TCP socket.
func TestTCPNotListening(t *testing.T) {
	l := listen(t, testConfig())
	defer l.Close()
	_, err := Dial(within(t, 10*time.Second), "tcp", l.Addr().String(), testConfig())
	require.Error(t, err)
	assert.Nil(t, l.tcp)
}

// echoEveryMode sends messages in every delivery mode and a large one
// through an echo server, and checks what comes back: everything, in
// send order, as a stream carries it when nothing is behind.
func echoEveryMode(t *testing.T, ctx context.Context, c *Conn) {
	t.Helper()
	var sent []Message
	for k := range 300 {
		m := Message{ID: 100 + uint32(k%5), Payload: fmt.Appendf(nil, "m%04d", k)}
		switch k % 5 {
		case 0:
			m.Reliable = true
		case 1:
			m.Reliable, m.InOrder = true, true
		case 2:
			m.InOrder = true // sequenced
		case 3:
			m.Reliable, m.ContentID = true, uint32(k)
		}
		require.NoError(t, c.Send(m))
		sent = append(sent, m)
	}
	big := bytes.Repeat([]byte("x"), 100_000)
	require.NoError(t, c.Send(Message{ID: 200, Payload: big, Reliable: true}))
	for _, m := range sent {
		got, err := c.Receive(ctx)
		require.NoError(t, err)
		require.Equal(t, m.ID, got.ID, "message %s", m.Payload)
		require.Equal(t, string(m.Payload), string(got.Payload), "in send order: nothing dropped on an idle stream")
	}
	got, err := c.Receive(ctx)
	require.NoError(t, err)
	assert.Equal(t, big, got.Payload)
}

// deafSocket is a UDP socket that reads and drops every datagram: UDP
// blocked on the way to the server.
type deafSocket struct{ socket }

func (s deafSocket) ReadBatch(ps []udp.Packet) (int, error) {
	for {
		if _, err := s.socket.ReadBatch(ps); err != nil {
			return 0, err
		}
	}
}

// With Config.FallbackTCP, a client whose UDP gets no answer reaches the
// server over TCP within fallbackDelay and a few round trips, and every
// delivery mode works there; where UDP answers, UDP wins.
func TestFallbackToTCPWhenUDPBlocked(t *testing.T) {
	deaf := &endpointOptions{listen: func(network string, laddr *net.UDPAddr, reuse bool) (socket, error) {
		s, err := (&endpointOptions{}).listenSocket(network, laddr, reuse)
		return deafSocket{s}, err
	}}
	l, err := listenWith("udp", "127.0.0.1:0", tcpConfig(), deaf)
	require.NoError(t, err)
	serveEcho(t, l)
	ctx := within(t, 20*time.Second)
	cfg := testConfig()
	cfg.FallbackTCP = true
	start := time.Now()
	c, err := Dial(ctx, "udp", l.Addr().String(), cfg)
	require.NoError(t, err)
	took := time.Since(start)
	assert.Equal(t, TransportTCP, c.Transport())
	assert.GreaterOrEqual(t, took, fallbackDelay, "UDP had its chance first")
	assert.Less(t, took, fallbackDelay+2*time.Second, "TCP right after the fallback delay")
	t.Logf("connected over TCP after %v", took)
	echoEveryMode(t, ctx, c)
	require.NoError(t, c.Close())

	// UDP answering: UDP it is.
	l2 := listen(t, tcpConfig())
	serveEcho(t, l2)
	c2, err := Dial(ctx, "udp", l2.Addr().String(), cfg)
	require.NoError(t, err)
	assert.Equal(t, TransportUDP, c2.Transport())
	require.NoError(t, c2.Send(Message{ID: 7, Payload: []byte("hi"), Reliable: true}))
	m, err := c2.Receive(ctx)
	require.NoError(t, err)
	assert.Equal(t, "hi", string(m.Payload))
	require.NoError(t, c2.Close())
}

// One Group serves UDP and TCP players alike: their connections,
// messages, a Broadcast to all, receipts and their ends come out of the
// same Poll, and Stats count a stream's traffic.
func TestGroupServesUDPAndTCP(t *testing.T) {
	g := NewGroup()
	cfg := tcpConfig()
	cfg.Group = g
	cfg.Receipts = true
	l := listen(t, cfg)
	defer l.Close()
	ctx := within(t, 20*time.Second)
	udpc, err := Dial(ctx, "udp", l.Addr().String(), testConfig())
	require.NoError(t, err)
	tcpc, err := Dial(ctx, "tcp", l.Addr().String(), testConfig())
	require.NoError(t, err)

	events := make([]Event, 64)
	conns := map[Transport]*Conn{}
	hello := map[Transport]string{}
	require.NoError(t, udpc.Send(Message{ID: 10, Payload: []byte("udp player"), Reliable: true}))
	require.NoError(t, tcpc.Send(Message{ID: 10, Payload: []byte("tcp player"), Reliable: true}))
	for len(hello) < 2 {
		require.NoError(t, g.Wait(ctx))
		n := g.Poll(events)
		for _, e := range events[:n] {
			switch e.Kind {
			case EventConnected:
				conns[e.Conn.Transport()] = e.Conn
			case EventMessage:
				hello[e.Conn.Transport()] = string(e.Message.Payload)
			}
		}
	}
	assert.Equal(t, map[Transport]string{TransportUDP: "udp player", TransportTCP: "tcp player"}, hello)
	require.Len(t, conns, 2)

	sent := Broadcast([]*Conn{conns[TransportUDP], conns[TransportTCP]}, Message{ID: 11, Payload: []byte("tick"), Reliable: true}, nil)
	assert.Equal(t, 2, sent)
	for _, c := range []*Conn{udpc, tcpc} {
		m, err := c.Receive(ctx)
		require.NoError(t, err)
		assert.Equal(t, "tick", string(m.Payload))
	}
	ref, err := conns[TransportTCP].SendRef(Message{ID: 12, Payload: []byte("tracked"), Reliable: true})
	require.NoError(t, err)
	delivered := false
	for !delivered {
		require.NoError(t, g.Wait(ctx))
		n := g.Poll(events)
		for _, e := range events[:n] {
			if e.Kind == EventDelivered && e.Ref == ref {
				delivered = true
			}
		}
	}
	st := conns[TransportTCP].Stats()
	assert.Equal(t, uint64(1), st.MessagesReceived)
	assert.GreaterOrEqual(t, st.MessagesSent, uint64(2))
	assert.Greater(t, st.BytesSent, uint64(0))
	assert.Greater(t, st.BytesReceived, uint64(0))

	require.NoError(t, tcpc.Close())
	for gone := false; !gone; {
		require.NoError(t, g.Wait(ctx))
		n := g.Poll(events)
		for _, e := range events[:n] {
			if e.Kind == EventDisconnected {
				assert.Equal(t, TransportTCP, e.Conn.Transport())
				assert.ErrorIs(t, e.Err, ErrPeerClosed)
				gone = true
			}
		}
	}
	require.NoError(t, udpc.Close())
}

// Drain reaches players over TCP and WebSocket as over UDP: each hears the
// reason, the listener waits for them, and a new player over TCP is
// refused with the reason.
func TestDrainStreams(t *testing.T) {
	l := listen(t, tcpConfig())
	serveEcho(t, l)
	ctx := within(t, 20*time.Second)
	var cs []*Conn
	for _, network := range []string{"udp", "tcp", "tcp"} {
		c, err := Dial(ctx, network, l.Addr().String(), testConfig())
		require.NoError(t, err)
		cs = append(cs, c)
	}
	for _, c := range cs {
		require.NoError(t, c.Send(Message{ID: 7, Payload: []byte("before"), Reliable: true}))
		m, err := c.Receive(ctx)
		require.NoError(t, err)
		require.Equal(t, "before", string(m.Payload))
	}
	require.Equal(t, 3, l.Stats().Connections)
	require.NoError(t, l.Drain(ctx, "moving you to another server"))
	assert.Equal(t, 0, l.Stats().Connections)
	for _, c := range cs {
		select {
		case <-c.Done():
		case <-ctx.Done():
			t.Fatalf("a player over %v still connected after the drain", c.Transport())
		}
		var de *DisconnectError
		require.ErrorAs(t, c.Err(), &de, "over %v", c.Transport())
		assert.Equal(t, "moving you to another server", de.Reason)
	}
	_, err := Dial(ctx, "tcp", l.Addr().String(), testConfig())
	var re *RefusedError
	require.ErrorAs(t, err, &re)
	assert.Equal(t, "moving you to another server", re.Reason)
}

// writeFailConn is a stream whose writes fail, as when the server dropped
// it, and whose reads wait for Close: the writer hears of the end first.
type writeFailConn struct {
	net.Conn // nil: only the methods below are used
	closed   chan struct{}
}

func (c *writeFailConn) Write([]byte) (int, error) { return 0, errors.New("connection reset by peer") }
func (c *writeFailConn) Read([]byte) (int, error) {
	<-c.closed
	return 0, net.ErrClosed
}
func (c *writeFailConn) Close() error {
	select {
	case <-c.closed:
	default:
		close(c.closed)
	}
	return nil
}
func (c *writeFailConn) LocalAddr() net.Addr {
	return &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 1}
}
func (c *writeFailConn) RemoteAddr() net.Addr {
	return &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 2}
}

// A server that drops the stream before answering refuses the client,
// whether the client's reader or, here, its writer hears of it first.
func TestStreamDroppedBeforeAnswerIsRefused(t *testing.T) {
	ctx := within(t, 10*time.Second)
	_, err := dialStream(ctx, &writeFailConn{closed: make(chan struct{})}, TransportTCP, testConfig().resolve(), &endpointOptions{})
	require.ErrorIs(t, err, ErrRefused)
	assert.ErrorContains(t, err, "connection reset by peer", "the cause is kept")
}
