//go:build !js

package knet

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Config.Simulate on TCP and WebSocket connections (streamsim.go), end to
// end over loopback: what a stream's player lives through on a bad
// network is delay and stalls, never a lost message.

// streamPair connects a client to a listener over tr, with their Configs,
// and returns the client's connection and the server's.
func streamPair(t *testing.T, ctx context.Context, tr Transport, srv, cli *Config) (client, server *Conn) {
	t.Helper()
	var err error
	switch tr {
	case TransportTCP:
		srv.TCP = true
		l := listen(t, srv)
		client, err = Dial(ctx, "tcp", l.Addr().String(), cli)
		require.NoError(t, err)
		server, err = l.AcceptConn(ctx)
	case TransportWebSocket:
		l := listen(t, srv)
		client, err = DialWebSocket(ctx, wsServer(t, l), cli)
		require.NoError(t, err)
		server, err = l.AcceptConn(ctx)
	}
	require.NoError(t, err)
	require.Equal(t, tr, client.Transport())
	t.Cleanup(func() { client.Close(); server.Close() })
	return client, server
}

var streamTransports = []Transport{TransportTCP, TransportWebSocket}

// stamped is a message carrying its number and when it was sent.
func stamped(i int, size int) Message {
	p := make([]byte, max(size, 16))
	binary.LittleEndian.PutUint64(p, uint64(i))
	binary.LittleEndian.PutUint64(p[8:], uint64(time.Now().UnixNano()))
	return Message{ID: 100, Payload: p, Reliable: true, InOrder: true}
}

// receiveStamped reads n stamped messages, checks that they come in their
// order, and returns when each arrived and how long each took.
func receiveStamped(t *testing.T, ctx context.Context, c *Conn, n int) (at, took []time.Duration) {
	t.Helper()
	start := time.Now()
	for i := range n {
		m, err := c.Receive(ctx)
		require.NoError(t, err, "message %d", i)
		now := time.Now()
		require.Equal(t, uint64(i), binary.LittleEndian.Uint64(m.Payload), "in order")
		sent := time.Unix(0, int64(binary.LittleEndian.Uint64(m.Payload[8:])))
		at = append(at, now.Sub(start))
		took = append(took, now.Sub(sent))
	}
	return at, took
}

// A 5% loss on a 20ms path: every reliable message still arrives, in
// order, each no sooner than the delay, and the lost segments show as
// stalls: a lost one comes once a later one's acknowledgement told the
// sender, a round trip and more after it was due, and what follows waits
// for it. Over 1% of the messages take that long. Without the simulation,
// they took a millisecond.
func TestStreamSimulateLoss(t *testing.T) {
	t.Parallel()
	const delay, n = 20 * time.Millisecond, 300
	stall := delay + 2*delay
	for _, tr := range streamTransports {
		t.Run(tr.String(), func(t *testing.T) {
			ctx := within(t, 30*time.Second)
			cli := testConfig()
			cli.Simulate = &Simulation{Loss: 0.05, Delay: delay, Seed: 1}
			client, server := streamPair(t, ctx, tr, testConfig(), cli)
			go func() {
				for i := range n {
					if client.SendContext(ctx, stamped(i, 16)) != nil {
						return
					}
					time.Sleep(5 * time.Millisecond)
				}
			}()
			_, took := receiveStamped(t, ctx, server, n)
			slices.Sort(took)
			p99 := took[len(took)*99/100]
			t.Logf("%s: min %v, p50 %v, p99 %v, max %v", tr, took[0], took[len(took)/2], p99, took[len(took)-1])
			assert.GreaterOrEqual(t, took[0], delay, "no faster than the path")
			assert.Greater(t, p99, stall, "the stalls of lost segments")
		})
	}
}

// A 20ms delay each way shows in Stats.RTT, which a stream measures with
// its pings: about twice the delay.
func TestStreamSimulateRTT(t *testing.T) {
	t.Parallel()
	const delay = 20 * time.Millisecond
	for _, tr := range streamTransports {
		t.Run(tr.String(), func(t *testing.T) {
			ctx := within(t, 30*time.Second)
			cfgs := [2]*Config{testConfig(), testConfig()}
			for i, cfg := range cfgs {
				cfg.PingInterval = 200 * time.Millisecond // a ping each 200ms
				cfg.Simulate = &Simulation{Delay: delay, Seed: uint64(i)}
			}
			client, server := streamPair(t, ctx, tr, cfgs[0], cfgs[1])
			for _, c := range []*Conn{client, server} {
				var rtt time.Duration
				for range 3 { // a fresh sample each time
					time.Sleep(250 * time.Millisecond)
					rtt = c.Stats().RTT
					if rtt >= 2*delay {
						break
					}
				}
				t.Logf("%s: RTT %v", tr, rtt)
				assert.GreaterOrEqual(t, rtt, 2*delay)
				assert.Less(t, rtt, 2*delay+25*time.Millisecond)
			}
		})
	}
}

// A bandwidth cap of 200 KB/s caps what a writer that sends as fast as it
// can gets through, within 20%. (Half a second of queue at the cap, so
// that a loaded test machine, slow to refill the send buffer, does not
// leave the path idle.)
func TestStreamSimulateBandwidth(t *testing.T) {
	t.Parallel()
	const bw, size, n = 200_000, 2000, 150
	for _, tr := range streamTransports {
		t.Run(tr.String(), func(t *testing.T) {
			ctx := within(t, 30*time.Second)
			cli := testConfig()
			cli.Simulate = &Simulation{Bandwidth: bw, QueueBytes: bw / 2, Delay: 5 * time.Millisecond, Seed: 3}
			client, server := streamPair(t, ctx, tr, testConfig(), cli)
			go func() {
				for i := range n {
					if client.SendContext(ctx, stamped(i, size)) != nil {
						return
					}
				}
			}()
			at, _ := receiveStamped(t, ctx, server, n)
			rate := float64((n-1)*size) / (at[n-1] - at[0]).Seconds()
			t.Logf("%s: %.0f B/s", tr, rate)
			assert.InEpsilon(t, bw, rate, 0.2)
		})
	}
}

// Close does not lose what the simulated path still carries: the peer
// reads every message, as late as the path makes them, and then the end.
func TestStreamSimulateClose(t *testing.T) {
	t.Parallel()
	const delay, bw, size, n = 100 * time.Millisecond, 50_000, 1000, 20
	for _, tr := range streamTransports {
		t.Run(tr.String(), func(t *testing.T) {
			ctx := within(t, 30*time.Second)
			cli := testConfig()
			cli.Simulate = &Simulation{Bandwidth: bw, Delay: delay, Seed: 4}
			client, server := streamPair(t, ctx, tr, testConfig(), cli)
			for i := range n {
				require.NoError(t, client.Send(stamped(i, size)))
			}
			closed := make(chan error, 1)
			go func() { closed <- client.Close() }()
			at, _ := receiveStamped(t, ctx, server, n)
			_, err := server.Receive(ctx)
			assert.True(t, errors.Is(err, io.EOF) || errors.Is(err, ErrPeerClosed), "then the end: %v", err)
			assert.GreaterOrEqual(t, at[n-1], delay+time.Duration(n*size)*time.Second/bw*8/10, "as late as the path makes it")
			select {
			case err := <-closed:
				assert.NoError(t, err)
			case <-ctx.Done():
				t.Fatal("Close did not return")
			}
		})
	}
}

// loopSimPair is a loopback TCP connection, its dialing end behind a
// simulated path of sim.
func loopSimPair(t *testing.T, sim *Simulation, disconnect time.Duration) (w net.Conn, r *net.TCPConn) {
	t.Helper()
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	defer ln.Close()
	nc, err := net.Dial("tcp", ln.Addr().String())
	require.NoError(t, err)
	r, err = ln.AcceptTCP()
	require.NoError(t, err)
	t.Cleanup(func() { nc.Close(); r.Close() })
	cfg := (&Config{Simulate: sim, DisconnectTimeout: disconnect}).resolve()
	return simulateStream(&endpoint{}, nc, cfg, true), r
}

// CloseWrite's FIN goes after every byte written before it, however long
// the path holds them.
func TestSimConnFinAfterData(t *testing.T) {
	const delay = 50 * time.Millisecond
	w, r := loopSimPair(t, &Simulation{Delay: delay, Bandwidth: 100_000}, time.Second)
	data := make([]byte, 20_000)
	for i := range data {
		data[i] = byte(i)
	}
	start := time.Now()
	n, err := w.Write(data)
	require.NoError(t, err)
	require.Equal(t, len(data), n)
	require.NoError(t, w.(interface{ CloseWrite() error }).CloseWrite())
	_, err = w.Write([]byte{1})
	assert.ErrorIs(t, err, net.ErrClosed, "nothing after the FIN")
	got, err := io.ReadAll(r)
	require.NoError(t, err, "the end, after the bytes")
	assert.Equal(t, data, got)
	assert.GreaterOrEqual(t, time.Since(start), delay+150*time.Millisecond, "at the path's pace")
	require.NoError(t, w.Close())
	<-w.(simTCPConn).done
}

// Close lets the path deliver what it holds, but no longer than the
// disconnect timeout: a peer that reads nothing does not keep the
// stream, nor its goroutine, and a writer waiting for room is let go.
func TestSimConnCloseIsBounded(t *testing.T) {
	t.Parallel()
	const wait = time.Second
	w, _ := loopSimPair(t, &Simulation{Delay: time.Millisecond}, wait)
	wrote := make(chan error, 1)
	go func() {
		var err error
		for err == nil {
			_, err = w.Write(make([]byte, 64<<10)) // until the socket's and the path's buffers are full
		}
		wrote <- err
	}()
	time.Sleep(200 * time.Millisecond)
	start := time.Now()
	require.NoError(t, w.Close())
	// At once: it may wait for the lock while the writer copies a few
	// MiB into the path (tens of ms under -race), not for the delivery.
	assert.Less(t, time.Since(start), wait/2, "Close returns at once, not after the path's delivery")
	select {
	case err := <-wrote:
		assert.ErrorIs(t, err, net.ErrClosed)
	case <-time.After(5 * time.Second):
		t.Fatal("the writer is still waiting")
	}
	select {
	case <-w.(simTCPConn).done:
		assert.Less(t, time.Since(start), wait+time.Second)
	case <-time.After(5 * time.Second):
		t.Fatal("the path's goroutine outlived the close")
	}
}
