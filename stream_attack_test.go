//go:build !js

package knet

import (
	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// An attacker's stream input, in each state of a server's stream (before
// the first frame, during admission, open, closing): what it costs us and
// how it ends. The peers here are raw TCP sockets writing bytes by hand.

// attackConfig is a TCP listener's Config whose timeouts are long, so that
// a stream that ends soon was ended by its input, not by a timeout.
func attackConfig() *Config {
	cfg := tcpConfig()
	cfg.ConnectTimeout = 30 * time.Second
	cfg.ConnectionLostTimeout = 30 * time.Second
	cfg.DisconnectTimeout = 30 * time.Second
	return cfg
}

func rawTCP(t *testing.T, l *Listener) net.Conn {
	nc, err := net.Dial("tcp", l.Addr().String())
	require.NoError(t, err)
	t.Cleanup(func() { nc.Close() })
	return nc
}

// knetHello is a knet hello frame of kind with content.
func knetHello(kind byte, content []byte) []byte {
	return appendTCPFrame(nil, idPingReply, appendStreamHello(nil, kind, content))
}

// hugeFrame is the size field of a frame announcing 2^30-1 bytes.
var hugeFrame = appendVLE32(nil, maxVLE32)

// closedWithin reads nc until the server ends it, and fails if that takes
// longer than d. It returns how long it took.
func closedWithin(t *testing.T, nc net.Conn, d time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	nc.SetReadDeadline(start.Add(d))
	buf := make([]byte, 64<<10)
	for {
		_, err := nc.Read(buf)
		if err == nil {
			continue
		}
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			t.Fatalf("the stream is still open after %v", d)
		}
		return time.Since(start)
	}
}

// readFrame reads nc until a whole frame came through fr.
func readFrame(t *testing.T, nc net.Conn, fr *tcpFramer) (uint32, []byte) {
	t.Helper()
	nc.SetReadDeadline(time.Now().Add(10 * time.Second))
	defer nc.SetReadDeadline(time.Time{})
	buf := make([]byte, 4096)
	for {
		id, p, ok, err := fr.next()
		require.NoError(t, err)
		if ok {
			return id, p
		}
		n, err := nc.Read(buf)
		require.NoError(t, err)
		fr.feed(buf[:n])
	}
}

// rawOpen opens a knet stream by hand and returns it with the server's
// Conn and a framer of what the server sends.
func rawOpen(t *testing.T, l *Listener) (net.Conn, *Conn, *tcpFramer) {
	nc := rawTCP(t, l)
	_, err := nc.Write(knetHello(helloClient, []byte("raw")))
	require.NoError(t, err)
	fr := newTCPFramer(1 << 20)
	id, p := readFrame(t, nc, fr)
	kind, _, ok := parseStreamHello(p)
	require.True(t, ok && id == idPingReply && kind == helloAccept, "the server's accept")
	sc, err := l.AcceptConn(within(t, 10*time.Second))
	require.NoError(t, err)
	return nc, sc, fr
}

// A frame announcing more than MaxMessageSize ends the stream at once,
// whatever its state, and nothing of its announced size is allocated.
func TestStreamOversizedFrameEachState(t *testing.T) {
	cfg := attackConfig()
	release := make(chan struct{})
	cfg.Admit = func(_ net.Addr, p []byte) ([]byte, error) {
		if string(p) == "wait" {
			<-release
		}
		return nil, nil
	}
	l := listen(t, cfg)

	t.Run("before the first frame", func(t *testing.T) {
		nc := rawTCP(t, l)
		nc.Write(hugeFrame)
		closedWithin(t, nc, 5*time.Second)
	})
	t.Run("during admission", func(t *testing.T) {
		// Held back while the Admit hook decides, but its size field,
		// read with the first frame, ends the stream at once.
		nc := rawTCP(t, l)
		nc.Write(append(knetHello(helloClient, []byte("wait")), hugeFrame...))
		closedWithin(t, nc, 5*time.Second)
		close(release)
	})
	t.Run("open", func(t *testing.T) {
		nc, sc, _ := rawOpen(t, l)
		nc.Write(hugeFrame)
		closedWithin(t, nc, 5*time.Second)
		waitDone(t, sc, 15*time.Second)
		var pe *ProtocolError
		require.ErrorAs(t, sc.Err(), &pe)
		assert.ErrorIs(t, sc.Err(), errTCPFrameTooLarge)
		assert.Equal(t, uint64(1), sc.Stats().ProtocolErrors)
	})
	t.Run("closing", func(t *testing.T) {
		nc, sc, fr := rawOpen(t, l)
		go sc.Close()
		for { // the server's close hello: it waits for our end now
			id, p := readFrame(t, nc, fr)
			if kind, _, ok := parseStreamHello(p); ok && id == idPingReply && kind == helloClose {
				break
			}
		}
		nc.Write(hugeFrame)
		waitDone(t, sc, 15*time.Second) // not DisconnectTimeout (30 s) later
		assert.ErrorIs(t, sc.Err(), errTCPFrameTooLarge)
	})
	assert.Equal(t, uint64(2), l.Stats().FailedStreams, "the two that never opened")
}

// What a stream session allocates for a frame announcing more than it
// takes, or announcing the most it takes and sending a few bytes of it:
// nothing of the announced size.
func TestStreamAnnouncedSizeNotAllocated(t *testing.T) {
	allocated := func(announce uint32) uint64 {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		for range 10 {
			s := newStreamSession(new(simHost), defaultMaxMessageSize, time.Minute, timeZero)
			b := appendVLE32(nil, announce)
			s.received(timeZero, append(b, "a few bytes"...))
		}
		runtime.ReadMemStats(&after)
		return after.TotalAlloc - before.TotalAlloc
	}
	require.Greater(t, tcpMaxFrame(defaultMaxMessageSize), 1<<20, "the limit is larger than what we allow below")
	assert.Less(t, allocated(maxVLE32), uint64(10*64<<10), "over the limit")
	assert.Less(t, allocated(uint32(tcpMaxFrame(defaultMaxMessageSize))), uint64(10*64<<10), "at the limit")

	s := newStreamSession(new(simHost), defaultMaxMessageSize, time.Minute, timeZero)
	assert.Error(t, s.received(timeZero, hugeFrame))
	allocs := testing.AllocsPerRun(100, func() { s.received(timeZero, hugeFrame) })
	assert.Zero(t, allocs, "a stream already failed takes nothing more")
}

// A peer that connects and sends nothing, or a byte now and then, is
// bounded: by ConnectTimeout before its first frame is whole (and while
// the Admit hook decides), by the lost timeout counted from a frame's first
// byte once open, however often bytes of it come.
func TestStreamSlowloris(t *testing.T) {
	t.Parallel()
	cfg := attackConfig()
	cfg.ConnectTimeout = 500 * time.Millisecond
	cfg.ConnectionLostTimeout = 900 * time.Millisecond
	block := make(chan struct{})
	t.Cleanup(func() { close(block) })
	cfg.Admit = func(_ net.Addr, p []byte) ([]byte, error) {
		if string(p) == "block" {
			<-block
		}
		return nil, nil
	}
	l := listen(t, cfg)

	// trickle sends b a byte every 50 ms until the stream ends.
	trickle := func(nc net.Conn, b []byte) {
		go func() {
			tick := time.NewTicker(50 * time.Millisecond)
			defer tick.Stop()
			for i := range b {
				if _, err := nc.Write(b[i : i+1]); err != nil {
					return
				}
				<-tick.C
			}
		}()
	}
	t.Run("silent", func(t *testing.T) {
		took := closedWithin(t, rawTCP(t, l), 10*time.Second)
		assert.GreaterOrEqual(t, took, 400*time.Millisecond, "ConnectTimeout ended it")
	})
	t.Run("first frame a byte at a time", func(t *testing.T) {
		nc := rawTCP(t, l)
		trickle(nc, knetHello(helloClient, make([]byte, 1000)))
		closedWithin(t, nc, 10*time.Second)
	})
	t.Run("admission never ends", func(t *testing.T) {
		nc := rawTCP(t, l)
		nc.Write(knetHello(helloClient, []byte("block")))
		closedWithin(t, nc, 10*time.Second)
	})
	t.Run("open, a frame a byte at a time", func(t *testing.T) {
		nc, sc, _ := rawOpen(t, l)
		frame := appendTCPFrame(nil, 100, make([]byte, 1000))
		trickle(nc, frame)
		closedWithin(t, nc, 10*time.Second)
		waitDone(t, sc, 15*time.Second)
		var te *TimeoutError
		require.ErrorAs(t, sc.Err(), &te)
		assert.Equal(t, "frame", te.Op, "a frame not whole within the lost timeout, though bytes came")
	})
	t.Run("closing, a frame a byte at a time", func(t *testing.T) {
		nc, sc, fr := rawOpen(t, l)
		go sc.Close()
		for { // the server's close hello: it waits for our end now
			id, p := readFrame(t, nc, fr)
			if kind, _, ok := parseStreamHello(p); ok && id == idPingReply && kind == helloClose {
				break
			}
		}
		trickle(nc, appendTCPFrame(nil, 100, make([]byte, 1000)))
		waitDone(t, sc, 15*time.Second) // not DisconnectTimeout (30 s) later
		var te *TimeoutError
		require.ErrorAs(t, sc.Err(), &te)
		assert.Equal(t, "frame", te.Op)
	})
}

// A stream cut inside a frame is a *ProtocolError, in every state where
// someone hears of it: a client's Dial when the server's answer is cut, a
// server's Conn once open or closing.
func TestStreamCutMidFrame(t *testing.T) {
	t.Run("the server's answer", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		defer ln.Close()
		go func() {
			nc, err := ln.Accept()
			if err != nil {
				return
			}
			fr := newTCPFramer(1 << 20)
			buf := make([]byte, 4096)
			for { // the client's hello
				if _, _, ok, _ := fr.next(); ok {
					break
				}
				n, err := nc.Read(buf)
				if err != nil {
					return
				}
				fr.feed(buf[:n])
			}
			h := knetHello(helloAccept, []byte("welcome"))
			nc.Write(h[:len(h)-3])
			// A FIN, then what the client sent is read to its end: a
			// close with unread bytes would be a reset, which may
			// discard the cut frame before the client reads it.
			nc.(*net.TCPConn).CloseWrite()
			io.Copy(io.Discard, nc)
			nc.Close()
		}()
		_, err = Dial(within(t, 10*time.Second), "tcp", ln.Addr().String(), testConfig())
		var pe *ProtocolError
		require.ErrorAs(t, err, &pe)
	})
	l := listen(t, attackConfig())
	t.Run("before the first frame", func(t *testing.T) {
		before := l.Stats().FailedStreams
		nc := rawTCP(t, l)
		h := knetHello(helloClient, []byte("cut"))
		nc.Write(h[:len(h)-1])
		nc.(*net.TCPConn).CloseWrite()
		closedWithin(t, nc, 5*time.Second)
		require.Eventually(t, func() bool { return l.Stats().FailedStreams == before+1 }, 5*time.Second, time.Millisecond)
	})
	t.Run("open", func(t *testing.T) {
		nc, sc, _ := rawOpen(t, l)
		f := appendTCPFrame(nil, 100, []byte("a message cut short"))
		nc.Write(f[:len(f)-4])
		nc.(*net.TCPConn).CloseWrite()
		waitDone(t, sc, 15*time.Second)
		var pe *ProtocolError
		require.ErrorAs(t, sc.Err(), &pe)
	})
	t.Run("closing", func(t *testing.T) {
		nc, sc, fr := rawOpen(t, l)
		go sc.Close()
		for {
			id, p := readFrame(t, nc, fr)
			if kind, _, ok := parseStreamHello(p); ok && id == idPingReply && kind == helloClose {
				break
			}
		}
		f := appendTCPFrame(nil, 100, []byte("a message cut short"))
		nc.Write(f[:len(f)-4])
		nc.(*net.TCPConn).CloseWrite()
		waitDone(t, sc, 15*time.Second)
		var pe *ProtocolError
		require.ErrorAs(t, sc.Err(), &pe)
	})
}

// A flood of TCP connections that say nothing: past MaxPendingConnections
// each new one takes the place of the oldest that has said nothing, which
// is closed and counted; an established client goes on echoing
// throughout, and never more than MaxPendingConnections are pending.
func TestStreamConnectionFlood(t *testing.T) {
	cfg := attackConfig()
	cfg.MaxPendingConnections = 4
	cfg.MaxPendingPerSource = 4 // all from 127.0.0.1: the bound overall
	l := listen(t, cfg)
	serveEcho(t, l)
	ctx := within(t, 20*time.Second)
	c, err := Dial(ctx, "tcp", l.Addr().String(), testConfig())
	require.NoError(t, err)
	defer c.Close()

	var conns []net.Conn
	for range 4 {
		conns = append(conns, rawTCP(t, l))
	}
	// The four are pending before more come (the listener takes them in
	// order; wait until it has).
	require.Eventually(t, func() bool { return len(l.streamConns(false)) == 5 }, 5*time.Second, time.Millisecond)
	for i := range 20 {
		conns = append(conns, rawTCP(t, l))
		// The oldest silent one gives way (and the listener took the new
		// one before the next comes).
		closedWithin(t, conns[i], 5*time.Second)
		require.Eventually(t, func() bool { return l.Stats().IgnoredAttempts == uint64(i+1) }, 5*time.Second, time.Millisecond)
		assert.LessOrEqual(t, l.Stats().Pending, 4)
		m := Message{ID: 100, Payload: []byte{byte(i)}, Reliable: true}
		require.NoError(t, c.Send(m))
		got, err := c.Receive(ctx)
		require.NoError(t, err)
		assert.Equal(t, m.Payload, got.Payload, "the established client still echoes")
	}
	for _, nc := range conns[20:] {
		nc.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
		_, err := nc.Read(make([]byte, 1))
		var ne net.Error
		require.ErrorAs(t, err, &ne, "the newest ones are still pending")
		assert.True(t, ne.Timeout())
	}
}

// Streams that say nothing cannot keep a client out, from their own
// address either: 1024 silent streams from 127.0.0.1 (renewed as they
// are closed) and a knet client from 127.0.0.1 still connects, over TCP
// and over WebSocket, the listener full or only the address.
func TestDoorSilentStreamsGiveWay(t *testing.T) {
	for _, full := range []bool{false, true} {
		t.Run(fmt.Sprintf("listener-full=%v", full), func(t *testing.T) {
			cfg := attackConfig()
			if full {
				// One source may take every place.
				cfg.MaxPendingConnections = 256
				cfg.MaxPendingPerSource = 256
			}
			l := listen(t, cfg)
			serveEcho(t, l)
			url := wsServer(t, l)
			const silent = 1024
			for range silent {
				rawTCP(t, l)
			}
			// The listener has taken them all, each past the places
			// making the oldest give way.
			places := l.cfg.maxPendingPerSource
			require.Eventually(t, func() bool { return l.Stats().IgnoredAttempts >= uint64(silent-places) }, 10*time.Second, time.Millisecond)
			ctx := within(t, 10*time.Second)
			c, err := Dial(ctx, "tcp", l.Addr().String(), testConfig())
			require.NoError(t, err, "a client from the flooding address, over TCP")
			echoOnce(t, c, Message{ID: 100, Payload: []byte("tcp"), Reliable: true})
			c.Close()
			w, err := DialWebSocket(ctx, url, testConfig())
			require.NoError(t, err, "over WebSocket")
			echoOnce(t, w, Message{ID: 100, Payload: []byte("ws"), Reliable: true})
			w.Close()
			assert.LessOrEqual(t, l.Stats().Pending, l.cfg.maxPending)
		})
	}
}

// A peer that never reads: our writes block, and the connection ends
// after the lost timeout though the peer keeps sending (pings, whose
// replies are bounded meanwhile); other connections are unaffected.
func TestStreamPeerNeverReads(t *testing.T) {
	t.Parallel()
	cfg := attackConfig()
	cfg.ConnectionLostTimeout = 1500 * time.Millisecond
	l := listen(t, cfg)
	ctx := within(t, 30*time.Second)

	nc, sc, _ := rawOpen(t, l)
	nc.(*net.TCPConn).SetReadBuffer(4096)
	stop := make(chan struct{})
	defer close(stop)
	go func() { // pings, many and often, never reading a reply
		ping := appendTCPFrame(nil, idPingRequest, []byte{7})
		burst := make([]byte, 0, 2000*len(ping))
		for range 2000 {
			burst = append(burst, ping...)
		}
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for {
			if _, err := nc.Write(burst); err != nil {
				return
			}
			select {
			case <-tick.C:
			case <-stop:
				return
			}
		}
	}()
	go func() { // the server sends until its writes block
		big := make([]byte, 60<<10)
		for sc.Send(Message{ID: 100, Payload: big, Reliable: true}) == nil {
		}
	}()

	// Meanwhile another client is served.
	serveOther := make(chan error, 1)
	go func() {
		sc2, err := l.AcceptConn(ctx)
		if err == nil {
			for {
				m, err := sc2.Receive(ctx)
				if err != nil {
					break
				}
				sc2.Send(m)
			}
		}
		serveOther <- err
	}()
	c, err := Dial(ctx, "tcp", l.Addr().String(), testConfig())
	require.NoError(t, err)
	defer c.Close()
	for i := range 10 {
		echoOnce(t, c, Message{ID: 100, Payload: []byte{byte(i)}, Reliable: true})
	}

	select {
	case <-sc.Done():
	case <-ctx.Done():
		t.Fatal("a peer that never reads held the connection")
	}
	var te *TimeoutError
	require.ErrorAs(t, sc.Err(), &te)
	assert.Positive(t, sc.Stats().DroppedDatagrams, "ping replies beyond the bound were dropped")
	echoOnce(t, c, Message{ID: 100, Payload: []byte("after"), Reliable: true})
}

// Garbage for a first frame: closed and counted, on a plaintext listener
// and a secure one, which both go on serving.
func TestStreamGarbageFirstFrames(t *testing.T) {
	scfg, ccfg, _ := secureTCPConfigs(t)
	scfg.ConnectTimeout, scfg.ConnectionLostTimeout = 30*time.Second, 30*time.Second
	for _, tt := range []struct {
		name string
		cfg  *Config
		ccfg *Config
	}{
		{"plaintext", attackConfig(), testConfig()},
		{"secure", scfg, ccfg},
	} {
		t.Run(tt.name, func(t *testing.T) {
			l := listen(t, tt.cfg)
			serveEcho(t, l)
			garbage := [][]byte{
				{0},                      // a frame of size 0
				{0xff, 0xff, 0xff, 0xff}, // over any limit
				append(appendVLE32(nil, 3), 0xff, 0xff, 0xff), // its MessageID past the frame
				knetHello(helloClient, make([]byte, 64<<10)),  // a ConnectPayload past any ConnectSyn's
				knetHello(helloSecure, []byte("not a Noise message")),
				knetHello(helloSecureAccept, []byte("a server's hello from a client")),
			}
			for _, g := range garbage {
				nc := rawTCP(t, l)
				nc.Write(g)
				closedWithin(t, nc, 5*time.Second)
			}
			st := l.Stats()
			assert.Equal(t, uint64(len(garbage)), st.FailedStreams+st.RefusedAttempts, "each counted")
			c, err := Dial(within(t, 10*time.Second), "tcp", l.Addr().String(), tt.ccfg)
			require.NoError(t, err)
			echoOnce(t, c, Message{ID: 100, Payload: []byte("still serving"), Reliable: true})
			c.Close()
		})
	}
}

// On the fake clock: a frame trickled a byte at a time ends the stream a
// lost timeout after it began, though bytes keep coming; a large frame
// gaining 4 KiB within each lost timeout goes on, and is delivered.
func TestStreamSlowFrameGoesOn(t *testing.T) {
	const lost = time.Second
	frame := appendTCPFrame(nil, 100, make([]byte, 100<<10))

	h := new(simHost)
	s := newStreamSession(h, defaultMaxMessageSize, lost, timeZero)
	now := timeZero
	for len(frame) > 0 {
		n := min(len(frame), streamFrameProgress)
		require.NoError(t, s.received(now, frame[:n]))
		frame = frame[n:]
		now = now.Add(lost - time.Millisecond)
		s.advance(now)
		require.NoError(t, s.err, "4 KiB within each lost timeout")
	}
	require.Len(t, h.msgs, 1)
	assert.Len(t, h.msgs[0].Payload, 100<<10)

	h = new(simHost)
	s = newStreamSession(h, defaultMaxMessageSize, lost, timeZero)
	frame = appendTCPFrame(nil, 100, make([]byte, 1000))
	now = timeZero
	for i := 0; s.err == nil && i < len(frame); i++ {
		s.received(now, frame[i:i+1])
		now = now.Add(100 * time.Millisecond)
		s.advance(now)
	}
	var te *TimeoutError
	require.ErrorAs(t, s.err, &te)
	assert.Equal(t, "frame", te.Op)
	assert.Equal(t, lost, te.Silent, "a lost timeout after the frame's first byte")
	assert.Empty(t, h.msgs)
}
