package knet

import (
	"context"
	"errors"
	"net"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/udp"
)

// countingPC is a net.PacketConn that is not a *net.UDPConn: it counts
// the datagrams through it, which only the generic path carries.
type countingPC struct {
	net.PacketConn
	reads, writes atomic.Int64
}

func (c *countingPC) ReadFrom(b []byte) (int, net.Addr, error) {
	n, a, err := c.PacketConn.ReadFrom(b)
	if err == nil {
		c.reads.Add(1)
	}
	return n, a, err
}

func (c *countingPC) WriteTo(b []byte, a net.Addr) (int, error) {
	n, err := c.PacketConn.WriteTo(b, a)
	if err == nil {
		c.writes.Add(1)
	}
	return n, err
}

func loopbackPC(t *testing.T) *net.UDPConn {
	t.Helper()
	pc, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	t.Cleanup(func() { pc.Close() }) // its owner closed it already, as a rule
	return pc
}

// exchange sends a reliable message each way between a client and the
// server's connection, then closes the client and sees both ends end
// gracefully.
func exchange(t *testing.T, l *Listener, c *Conn) {
	t.Helper()
	sc, err := l.AcceptConn(within(t, 10*time.Second))
	require.NoError(t, err)
	require.NoError(t, c.Send(Message{ID: 100, Reliable: true, Payload: []byte("up")}))
	m, err := sc.Receive(within(t, 10*time.Second))
	require.NoError(t, err)
	assert.Equal(t, "up", string(m.Payload))
	require.NoError(t, sc.Send(Message{ID: 100, Reliable: true, Payload: []byte("down")}))
	m, err = c.Receive(within(t, 10*time.Second))
	require.NoError(t, err)
	assert.Equal(t, "down", string(m.Payload))
	require.NoError(t, c.Close())
	<-sc.Done()
	assert.ErrorIs(t, sc.Err(), ErrPeerClosed)
	assert.NoError(t, sc.Close())
}

// A Listener and a dialed Conn over the caller's sockets: a *net.UDPConn
// keeps the batched path (udpSocket), any other PacketConn takes the
// generic one (packetSocket), which the counts show carrying the
// traffic; messages go both ways and the close is clean; the sockets
// are the Listener's and the Conn's to close.
func TestListenDialPacket(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name           string
		wrapL, wrapD   bool
		batchL, batchD bool
	}{
		{"udp both", false, false, true, true},
		{"generic listener", true, false, false, true},
		{"generic dialer", false, true, true, false},
		{"generic both", true, true, false, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			lpc, dpc := loopbackPC(t), loopbackPC(t)
			var lc, dc *countingPC
			var lp, dp net.PacketConn = lpc, dpc
			if tt.wrapL {
				lc = &countingPC{PacketConn: lpc}
				lp = lc
			}
			if tt.wrapD {
				dc = &countingPC{PacketConn: dpc}
				dp = dc
			}
			l, err := ListenPacket(lp, testConfig())
			require.NoError(t, err)
			defer l.Close()
			assert.Equal(t, lpc.LocalAddr().String(), l.Addr().String())
			_, batched := l.eps[0].sock.(*udpSocket)
			assert.Equal(t, tt.batchL, batched, "listener's socket: %T", l.eps[0].sock)

			c, err := DialPacket(within(t, 10*time.Second), dp, l.Addr().String(), testConfig())
			require.NoError(t, err)
			_, batched = c.ep.sock.(*udpSocket)
			assert.Equal(t, tt.batchD, batched, "dialer's socket: %T", c.ep.sock)
			assert.Equal(t, dpc.LocalAddr().String(), c.LocalAddr().String())

			exchange(t, l, c)
			for _, pc := range []*countingPC{lc, dc} {
				if pc != nil {
					assert.GreaterOrEqual(t, pc.reads.Load(), int64(3), "handshake, message, close")
					assert.GreaterOrEqual(t, pc.writes.Load(), int64(3))
				}
			}
			require.NoError(t, l.Close())
			// Both sockets were closed with their owners (the dialed
			// one a moment after its Conn, endpoint.connDone).
			for _, pc := range []*net.UDPConn{lpc, dpc} {
				closed := false
				for i := 0; i < 500 && !closed; i++ {
					_, err := pc.WriteToUDP([]byte{0}, lpc.LocalAddr().(*net.UDPAddr))
					closed = errors.Is(err, net.ErrClosed)
					if !closed {
						runtime.Gosched()
						time.Sleep(10 * time.Millisecond) // bounded: the linger is at most DisconnectTimeout
					}
				}
				assert.True(t, closed, "%v still open", pc.LocalAddr())
			}
		})
	}
}

// What ListenPacket refuses, closing the socket it was given: several
// Sockets, a connected socket.
func TestListenPacketRefuses(t *testing.T) {
	pc := loopbackPC(t)
	_, err := ListenPacket(pc, &Config{Sockets: 2})
	assert.ErrorContains(t, err, "Sockets")
	_, err = pc.WriteToUDP([]byte{0}, pc.LocalAddr().(*net.UDPAddr))
	assert.ErrorIs(t, err, net.ErrClosed, "the socket is closed on failure")

	conn, err := net.DialUDP("udp", nil, loopbackPC(t).LocalAddr().(*net.UDPAddr))
	require.NoError(t, err)
	_, err = ListenPacket(conn, nil)
	assert.ErrorContains(t, err, "connected")
	_, err = DialPacket(context.Background(), nil, "127.0.0.1:1", nil)
	assert.Error(t, err)
}

// A datagram from an address that is no IP and port is dropped and
// counted, not taken as a peer's; one from an IP and port is read.
func TestPacketSocketOddAddress(t *testing.T) {
	s := &packetSocket{pc: &oddPC{from: []net.Addr{
		&net.UnixAddr{Name: "/relay", Net: "unixgram"},
		&net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 9},
	}}}
	ps := []udp.Packet{{Buf: make([]byte, 64)}}
	n, err := s.ReadBatch(ps)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	assert.Equal(t, "127.0.0.1:9", unmap(ps[0].Addr).String())
	assert.Equal(t, uint64(1), s.invalid.Load())
}

// oddPC reads a datagram from each address of from in turn.
type oddPC struct {
	net.PacketConn
	from []net.Addr
}

func (p *oddPC) ReadFrom(b []byte) (int, net.Addr, error) {
	a := p.from[0]
	p.from = p.from[1:]
	return copy(b, "hi"), a, nil
}
