//go:build unix

package knet

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/coder/websocket"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Issue 31: the doors of a Listener's streams (TCP, WebSocket) and of its
// secure admission that an attacker may walk through. Each test asserts
// the behaviour once fixed.

// doorSecureListener is a secure listener on UDP and TCP, with a
// WebSocket handler (url), whose AdmitConn counts its calls and marks the
// connection (SetUserData); client is a Config that reaches it.
func doorSecureListener(t *testing.T, mod func(*Config)) (l *Listener, url string, client *Config, admits *atomic.Int32) {
	server, client := secureConfigs(t)
	server.TCP = true
	admits = new(atomic.Int32)
	server.AdmitConn = func(c *Conn, payload []byte) ([]byte, error) {
		n := admits.Add(1)
		c.SetUserData(n)
		return []byte("welcome"), nil
	}
	if mod != nil {
		mod(server)
	}
	l = listen(t, server)
	return l, wsServer(t, l), client, admits
}

// doorReplay writes the frame f on n new raw streams to l (over TCP, or
// over WebSocket at url for the even ones if ws), and watches them until
// d after the write: what each got, and whether and when the server ended
// it.
func doorReplay(t *testing.T, l *Listener, url string, ws bool, f []byte, n int, d time.Duration) []doorSeen {
	t.Helper()
	ncs := make([]net.Conn, n)
	for i := range ncs {
		if ws && i%2 == 0 {
			ncs[i] = doorRawWS(t, url)
		} else {
			ncs[i] = doorRaw(t, l.Addr().String(), nil)
		}
	}
	start := time.Now()
	for _, nc := range ncs {
		_, err := nc.Write(f)
		require.NoError(t, err)
	}
	return doorWatchAll(ncs, start, start.Add(d))
}

// A secure stream's hello, recorded by a relay and sent again on new
// streams, is a replay: the listener never accepts it, nor asks Admit
// again, nor spends a key exchange on it, while it remembers the message,
// and the stream ends at once. Once it forgot the message (the replay
// window passed), a replay may cost a key exchange and an answer, but
// the replayer, who has not the client's keys, is never accepted, and
// the stream ends within ConnectTimeout.
func TestDoorReplayedSecureHello(t *testing.T) {
	t.Parallel()
	for _, tr := range []Transport{TransportTCP, TransportWebSocket} {
		t.Run(tr.String(), func(t *testing.T) {
			ws := tr == TransportWebSocket
			t.Run("remembered", func(t *testing.T) {
				l, url, ccfg, admits := doorSecureListener(t, func(c *Config) { c.ConnectTimeout = 5 * time.Second })
				ccfg.ConnectPayload = []byte("user=alice;password=hunter2")
				c, sc, hello := doorVictim(t, l, url, tr, ccfg)
				kind, _ := doorHelloContent(t, hello)
				require.Equal(t, byte(helloSecure), kind, "the victim's first frame")
				require.Equal(t, int32(1), sc.UserData())
				require.Equal(t, uint64(1), l.Stats().KeyExchanges)

				const replays = 5
				check := func(when string, seen []doorSeen) {
					answered, open := doorCount(seen)
					assert.Zero(t, answered, "%s: replays answered with the server's Noise message 2 (of %d)", when, len(seen))
					assert.Zero(t, open, "%s: replays still open 1 s after their hello (of %d)", when, len(seen))
				}
				check("victim connected", doorReplay(t, l, url, ws, hello, replays, time.Second))
				// The victim is still served.
				require.NoError(t, c.Send(Message{ID: 100, Payload: []byte("still me"), Reliable: true}))
				m, err := sc.Receive(within(t, 5*time.Second))
				require.NoError(t, err)
				assert.Equal(t, "still me", string(m.Payload))

				require.NoError(t, c.Close())
				waitDone(t, sc, 5*time.Second)
				check("victim gone", doorReplay(t, l, url, ws, hello, replays, time.Second))

				others := doorAcceptedBy(l, 200*time.Millisecond)
				assert.Zero(t, len(others), "connections AcceptConn returned besides the victim's")
				for _, o := range others {
					t.Logf("accepted a replay: %v over %v, user data %v", o.RemoteAddr(), o.Transport(), o.UserData())
				}
				st := l.Stats()
				assert.Equal(t, int32(1), admits.Load(), "AdmitConn calls")
				assert.Equal(t, uint64(1), st.KeyExchanges, "key exchanges")
				assert.GreaterOrEqual(t, st.ReplayedHandshakes, uint64(2*replays), "replays counted")
			})
			t.Run("forgotten", func(t *testing.T) {
				const connectTimeout = 2 * time.Second
				l, url, ccfg, _ := doorSecureListener(t, func(c *Config) { c.ConnectTimeout = connectTimeout })
				ccfg.ConnectPayload = []byte("user=alice;password=hunter2")
				c, sc, hello := doorVictim(t, l, url, tr, ccfg)
				require.NoError(t, c.Close())
				waitDone(t, sc, 5*time.Second)

				doorForget(t, l, hello)
				seen := doorReplay(t, l, url, ws, hello, 2, connectTimeout+time.Second)
				answered, open := doorCount(seen)
				t.Logf("%d of %d replays answered with Noise message 2", answered, len(seen))
				assert.Zero(t, open, "replays still open ConnectTimeout + 1 s after their hello (of %d)", len(seen))
				others := doorAcceptedBy(l, 200*time.Millisecond)
				assert.Zero(t, len(others), "connections AcceptConn returned besides the victim's")
			})
		})
	}
}

// doorRoundTrip checks that c (a client) and sc (its server's connection)
// still carry a message each way.
func doorRoundTrip(t *testing.T, c, sc *Conn, what string) {
	t.Helper()
	ctx := within(t, 5*time.Second)
	require.NoError(t, c.Send(Message{ID: 100, Payload: []byte("up " + what), Reliable: true}))
	m, err := sc.Receive(ctx)
	require.NoError(t, err, "up, %s", what)
	assert.Equal(t, "up "+what, string(m.Payload))
	require.NoError(t, sc.Send(Message{ID: 100, Payload: []byte("down " + what), Reliable: true}))
	m, err = c.Receive(ctx)
	require.NoError(t, err, "down, %s", what)
	assert.Equal(t, "down "+what, string(m.Payload))
}

// A secure ConnectSyn seen over UDP, its content put in a stream's secure
// hello, is the same handshake message: a replay, dropped without a key
// exchange, an Admit call or an answer, over TCP and over WebSocket; the
// victim over UDP is served on.
func TestDoorUDPSynReplayedOverStream(t *testing.T) {
	l, url, ccfg, admits := doorSecureListener(t, func(c *Config) { c.ConnectTimeout = 5 * time.Second })
	ccfg.ConnectPayload = []byte("user=alice;password=hunter2")
	r := newAttackRelay(t, l.Addr())
	ctx := within(t, 10*time.Second)
	c, err := Dial(ctx, "udp", r.Addr(), ccfg)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	sc, err := l.AcceptConn(ctx)
	require.NoError(t, err)
	var content []byte
	for _, d := range r.datagrams(&r.up) {
		if content = contentOf(d, idConnectSyn); content != nil {
			break
		}
	}
	require.NotNil(t, content, "the victim's ConnectSyn")
	before := l.Stats()
	require.Equal(t, uint64(1), before.KeyExchanges)
	require.Equal(t, int32(1), admits.Load())

	hello := knetHello(helloSecure, content)
	tcp, ws := doorRaw(t, l.Addr().String(), nil), doorRawWS(t, url)
	start := time.Now()
	for _, nc := range []net.Conn{tcp, ws} {
		_, err := nc.Write(hello)
		require.NoError(t, err)
	}
	seen := doorWatchAll([]net.Conn{tcp, ws}, start, start.Add(time.Second))
	for i, tr := range []string{"tcp", "websocket"} {
		assert.False(t, seen[i].got(helloSecureAccept), "%s: the replay got the server's Noise message 2", tr)
		assert.True(t, seen[i].closed, "%s: the replay still open %v after its hello", tr, seen[i].took)
	}
	others := doorAcceptedBy(l, 200*time.Millisecond)
	assert.Zero(t, len(others), "connections AcceptConn returned besides the victim's")
	st := l.Stats()
	assert.Equal(t, before.KeyExchanges, st.KeyExchanges, "key exchanges")
	assert.GreaterOrEqual(t, st.ReplayedHandshakes, before.ReplayedHandshakes+2, "replays counted")
	assert.Equal(t, int32(1), admits.Load(), "AdmitConn calls")
	doorRoundTrip(t, c, sc, "after the replays")
}

// A secure client's ConnectSyn over UDP, seen by an attacker who puts it
// in a stream's secure hello before it reaches the server (or at once,
// racing it), must not let the attacker take the client's connect token:
// the attacker has not the client's keys. The client gets in, over UDP,
// with its token; the attacker's stream is never accepted and ends within
// ConnectTimeout.
func TestDoorTokenNotStolenByStreamReplay(t *testing.T) {
	t.Parallel()
	const connectTimeout = 2 * time.Second
	setup := func(t *testing.T) (*Listener, *doorAcceptor, func(id uint64) *Config) {
		key := newTokenKey(t)
		l, _, ccfg, _ := doorSecureListener(t, func(c *Config) {
			c.TokenKey = key
			c.ConnectTimeout = connectTimeout
		})
		ccfg.ConnectTimeout = 5 * time.Second
		client := func(id uint64) *Config {
			tok := sampleToken(addrPort(t, l.Addr()))
			tok.ClientID = id
			cfg := *ccfg
			cfg.Token = issue(t, key, tok)
			return &cfg
		}
		return l, doorAcceptAll(t, l), client
	}
	type dialed struct {
		c   *Conn
		err error
	}
	dialVia := func(t *testing.T, r *attackRelay, cfg *Config) chan dialed {
		res := make(chan dialed, 1)
		go func() {
			c, err := Dial(within(t, 10*time.Second), "udp", r.Addr(), cfg)
			if c != nil {
				t.Cleanup(func() { c.Close() })
			}
			res <- dialed{c, err}
		}()
		return res
	}
	isSyn := func(e relayEntry) bool { return contentOf(e.b, idConnectSyn) != nil }
	// checkAccepted checks that a accepted the clients ids over UDP, each
	// with its token, and nothing else.
	checkAccepted := func(t *testing.T, a *doorAcceptor, ids []uint64) {
		doorPollUntil(time.Second, func() bool { return int(a.n.Load()) >= len(ids) })
		var got []uint64
		for _, c := range a.accepted() {
			if c.Transport() != TransportUDP {
				t.Errorf("accepted a connection over %v from %v (user data %v)", c.Transport(), c.RemoteAddr(), c.UserData())
				continue
			}
			if tok := c.Token(); assert.NotNil(t, tok) {
				got = append(got, tok.ClientID)
			}
		}
		assert.ElementsMatch(t, ids, got, "the clients accepted over UDP, by their token's ClientID")
	}

	t.Run("held", func(t *testing.T) {
		l, acc, client := setup(t)
		r := newAttackRelay(t, l.Addr())
		r.setRule(&r.up, holdAll)
		res := dialVia(t, r, client(1))
		_, syn := r.mustAwait(t, &r.up, 0, "ConnectSyn", isSyn)
		w := &doorWatcher{nc: doorRaw(t, l.Addr().String(), nil)}
		start := time.Now()
		_, err := w.nc.Write(knetHello(helloSecure, contentOf(syn, idConnectSyn)))
		require.NoError(t, err)
		early := w.watch(start, start.Add(300*time.Millisecond), true)
		t.Logf("the attacker's stream after %v: hellos %v, closed %v", early.took, early.kinds, early.closed)
		r.pass(&r.up)
		d := <-res
		assert.NoError(t, d.err, "the victim's Dial")
		seen := w.watch(start, start.Add(connectTimeout+time.Second), false)
		assert.True(t, seen.closed, "the attacker's stream still open %v after its hello (hellos %v)", seen.took, seen.kinds)
		checkAccepted(t, acc, []uint64{1})
	})
	t.Run("raced", func(t *testing.T) {
		l, acc, client := setup(t)
		const rounds = 10
		var ws []*doorWatcher
		var ids []uint64
		var last time.Time
		for i := range rounds {
			id := uint64(100 + i)
			r := newAttackRelay(t, l.Addr())
			w := &doorWatcher{nc: doorRaw(t, l.Addr().String(), nil)}
			res := dialVia(t, r, client(id))
			_, syn := r.mustAwait(t, &r.up, 0, "ConnectSyn", isSyn)
			last = time.Now()
			_, err := w.nc.Write(knetHello(helloSecure, contentOf(syn, idConnectSyn)))
			require.NoError(t, err)
			ws = append(ws, w)
			d := <-res
			if assert.NoError(t, d.err, "round %d: the victim's Dial", i) {
				ids = append(ids, id)
				d.c.Close()
			}
		}
		open := 0
		for _, w := range ws {
			if s := w.watch(last, last.Add(connectTimeout+time.Second), false); !s.closed {
				open++
			}
		}
		assert.Zero(t, open, "the attacker's streams still open ConnectTimeout + 1 s after its last hello (of %d)", rounds)
		assert.Len(t, ids, rounds, "victims that got in")
		checkAccepted(t, acc, ids)
	})
}

// A replayed secure hello that the listener answers (it forgot the
// message: the replay window passed) is no connection until the client
// proves it has the keys: the replayer, who cannot, trickling a sealed
// frame a byte at a time, is ended within ConnectTimeout of its hello,
// not ConnectionLostTimeout, and never accepted.
func TestDoorReplayedStreamEndsByConnectTimeout(t *testing.T) {
	t.Parallel()
	const connectTimeout = time.Second
	// A size over the first sealed frame's limit ends the stream at
	// once; one within it, trickled, by ConnectTimeout from the hello.
	for _, size := range []uint32{60000, 4000} {
		t.Run(fmt.Sprint(size), func(t *testing.T) {
			l, url, ccfg, _ := doorSecureListener(t, func(c *Config) {
				c.ConnectTimeout = connectTimeout
				c.ConnectionLostTimeout = 10 * time.Second
			})
			c, sc, hello := doorVictim(t, l, url, TransportTCP, ccfg)
			require.NoError(t, c.Close())
			waitDone(t, sc, 5*time.Second)
			doorForget(t, l, hello)

			w := &doorWatcher{nc: doorRaw(t, l.Addr().String(), nil)}
			start := time.Now()
			_, err := w.nc.Write(hello)
			require.NoError(t, err)
			first := w.watch(start, start.Add(connectTimeout), true)
			t.Logf("the replay after %v: hellos %v, closed %v", first.took, first.kinds, first.closed)
			stop := make(chan struct{})
			trickled := make(chan struct{})
			go func() {
				defer close(trickled)
				if _, err := w.nc.Write(appendVLE32(nil, size)); err != nil {
					return
				}
				tick := time.NewTicker(50 * time.Millisecond)
				defer tick.Stop()
				for range size {
					select {
					case <-tick.C:
					case <-stop:
						return
					}
					if _, err := w.nc.Write([]byte{0x5a}); err != nil {
						return
					}
				}
			}()
			seen := w.watch(start, start.Add(connectTimeout+time.Second), false)
			close(stop)
			<-trickled
			assert.True(t, seen.closed, "the replay still open %v after its hello (hellos %v)", seen.took, seen.kinds)
			t.Logf("closed %v after the hello", seen.took)
			others := doorAcceptedBy(l, 200*time.Millisecond)
			assert.Zero(t, len(others), "connections AcceptConn returned besides the victim's")
		})
	}
}

// doorHeap is the live heap, after a collection.
func doorHeap() int64 {
	var m runtime.MemStats
	runtime.GC()
	runtime.GC() // the pools' victims too
	runtime.ReadMemStats(&m)
	return int64(m.HeapAlloc)
}

// A stream's first frame (and a secure stream's first sealed frame) is
// small: at most 4096 bytes. Streams announcing 16 MiB in it and sending
// 15 MiB are ended at once, and hold nothing of it; a first frame over
// 4096 bytes (a knet hello) is refused at once, before the Admit hook and
// any key exchange.
func TestDoorFirstFrameBounded(t *testing.T) {
	const (
		streams  = 16
		announce = 16 << 20
		send     = 15 << 20
		chunk    = 64 << 10
	)
	for _, tt := range []struct {
		name           string
		secure, sealed bool
	}{
		{"plaintext", false, false},
		{"secure", true, false},
		{"secure, the first sealed frame", true, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cfg, ccfg := tcpConfig(), testConfig()
			if tt.secure {
				cfg, ccfg = secureConfigs(t)
				cfg.TCP = true
			}
			// Longer than the writers write (1.5 s): a timeout ends no
			// stream here.
			cfg.ConnectTimeout = 5 * time.Second
			cfg.ConnectionLostTimeout = 5 * time.Second
			cfg.DisconnectTimeout = time.Second
			var admits atomic.Int32
			cfg.AdmitConn = func(*Conn, []byte) ([]byte, error) { admits.Add(1); return nil, nil }
			l := listen(t, cfg)

			ncs := make([]net.Conn, streams)
			for i := range ncs {
				ncs[i] = doorRaw(t, l.Addr().String(), nil)
				if !tt.sealed {
					continue
				}
				_, syn, err := newClientSecure(ccfg.ServerKey, nil, nil)
				require.NoError(t, err)
				_, err = ncs[i].Write(knetHello(helloSecure, syn))
				require.NoError(t, err)
				id, p := readFrame(t, ncs[i], newTCPFramer(1<<20))
				kind, _, ok := parseStreamHello(p)
				require.True(t, ok && id == idPingReply && kind == helloSecureAccept, "the server's Noise message 2")
			}
			failed := l.Stats().FailedStreams
			before := doorHeap()
			start := time.Now()
			buf := make([]byte, chunk)
			var writers sync.WaitGroup
			var sent atomic.Int64
			seen := make([]doorSeen, streams)
			var readers sync.WaitGroup
			for i, nc := range ncs {
				nc.SetWriteDeadline(start.Add(1500 * time.Millisecond))
				_, err := nc.Write(appendVLE32(nil, announce))
				require.NoError(t, err)
				writers.Go(func() {
					for n := 0; n < send; n += chunk {
						if _, err := nc.Write(buf); err != nil {
							return
						}
						sent.Add(chunk)
					}
				})
				readers.Go(func() { seen[i] = doorWatch(nc, start, start.Add(1250*time.Millisecond)) })
			}
			writers.Wait()
			grew := doorHeap() - before
			readers.Wait()
			open, late := 0, 0
			var slowest time.Duration
			for _, s := range seen {
				switch {
				case !s.closed:
					open++
				case s.took > time.Second:
					late++
				}
				slowest = max(slowest, s.took)
			}
			t.Logf("%d MiB sent in all; the heap grew %d MiB", sent.Load()>>20, grew>>20)
			assert.Zero(t, open+late, "streams not closed within 1 s (%d still open after 1.25 s, %d later than 1 s; slowest %v)", open, late, slowest)
			assert.Less(t, grew, int64(8<<20), "the heap's growth while the streams sent their first frame")
			assert.True(t, doorPollUntil(time.Second, func() bool { return l.Stats().FailedStreams >= failed+streams }),
				"FailedStreams %d, want %d more than %d", l.Stats().FailedStreams, streams, failed)
			others := doorAcceptedBy(l, 100*time.Millisecond)
			assert.Zero(t, len(others), "streams accepted")

			if tt.sealed {
				return
			}
			// A knet hello over 4096 bytes.
			var hello []byte
			if tt.secure {
				_, syn, err := newClientSecure(ccfg.ServerKey, nil, make([]byte, 4900))
				require.NoError(t, err)
				hello = knetHello(helloSecure, syn)
			} else {
				hello = knetHello(helloClient, make([]byte, 5000))
			}
			admitted, exchanged := admits.Load(), l.Stats().KeyExchanges
			nc := doorRaw(t, l.Addr().String(), nil)
			start = time.Now()
			_, err := nc.Write(hello)
			require.NoError(t, err)
			s := doorWatch(nc, start, start.Add(time.Second))
			assert.True(t, s.closed, "a first frame of %d bytes: still open after %v", len(hello), s.took)
			assert.Equal(t, admitted, admits.Load(), "AdmitConn calls")
			assert.Equal(t, exchanged, l.Stats().KeyExchanges, "key exchanges")
			assert.Zero(t, len(doorAcceptedBy(l, 100*time.Millisecond)), "accepted")
		})
	}
}

// doorDialFrom connects a client (cfg) to l over tr, its stream from the
// local address from: TCP to l's port, or a WebSocket to url.
func doorDialFrom(ctx context.Context, l *Listener, url string, tr Transport, from net.IP, cfg *Config) (*Conn, error) {
	rc := cfg.resolve()
	if err := rc.secureDialer(); err != nil {
		return nil, err
	}
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: from}}
	if tr == TransportWebSocket {
		tp := &http.Transport{DialContext: d.DialContext}
		defer tp.CloseIdleConnections()
		ws, _, err := websocket.Dial(ctx, url, &websocket.DialOptions{HTTPClient: &http.Client{Transport: tp}})
		if err != nil {
			return nil, err
		}
		return dialStream(ctx, newWSConn(ws, rc), TransportWebSocket, rc, &endpointOptions{})
	}
	nc, err := d.DialContext(ctx, "tcp", l.Addr().String())
	if err != nil {
		return nil, err
	}
	nc.(*net.TCPConn).SetNoDelay(true)
	return dialStream(ctx, nc, TransportTCP, rc, &endpointOptions{})
}

var (
	doorLocalhost = net.IPv4(127, 0, 0, 1)
	doorOther     = net.IPv4(127, 0, 0, 2)
)

// One source address cannot take every pending place of a listener:
// MaxPendingConnections silent TCP streams from 127.0.0.1 leave room for
// a client from 127.0.0.2, over TCP or WebSocket; what one source opens
// past its share (MaxPendingConnections/16) is closed at once and counted
// ignored.
func TestDoorOneSourceCannotFillPending(t *testing.T) {
	const flood = defaultMaxPending
	for _, tt := range []struct {
		name   string
		secure bool
		tr     Transport
	}{
		{"tcp", false, TransportTCP},
		{"tcp, secure", true, TransportTCP},
		{"websocket", false, TransportWebSocket},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cfg, ccfg := tcpConfig(), testConfig()
			if tt.secure {
				cfg, ccfg = secureConfigs(t)
				cfg.TCP = true
			}
			cfg.ConnectTimeout = 30 * time.Second
			cfg.DisconnectTimeout = time.Second
			l := listen(t, cfg)
			serveEcho(t, l)
			url := wsServer(t, l)
			for range flood {
				doorRaw(t, l.Addr().String(), doorLocalhost)
			}
			took := doorPollUntil(5*time.Second, func() bool {
				st := l.Stats()
				return uint64(st.Pending)+st.IgnoredAttempts >= flood
			})
			st := l.Stats()
			require.True(t, took, "the listener took the flood's streams: pending %d, ignored %d", st.Pending, st.IgnoredAttempts)
			t.Logf("after the flood: pending %d, ignored %d", st.Pending, st.IgnoredAttempts)
			assert.Positive(t, st.IgnoredAttempts, "streams of the flood closed at once and counted")

			ctx := within(t, 2*time.Second)
			c, err := doorDialFrom(ctx, l, url, tt.tr, doorOther, ccfg)
			if assert.NoError(t, err, "a client from 127.0.0.2 over %v", tt.tr) {
				echoOnce(t, c, Message{ID: 100, Payload: []byte("in"), Reliable: true})
				c.Close()
			}
		})
	}
}

// doorCPU is the CPU time the process used so far, user and system.
func doorCPU(t *testing.T) time.Duration {
	var ru syscall.Rusage
	require.NoError(t, syscall.Getrusage(syscall.RUSAGE_SELF, &ru))
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// Streams that connect and say nothing wait for their first frame at no
// cost but their memory: 300 of them, for 2 s, take less than a tenth of
// a core.
func TestDoorIdleStreamsCostNoCPU(t *testing.T) {
	const (
		sources   = 10
		perSource = 30
		window    = 2 * time.Second
	)
	cfg := tcpConfig()
	cfg.ConnectTimeout = 30 * time.Second
	cfg.DisconnectTimeout = time.Second
	l := listen(t, cfg)
	for i := range sources {
		from := net.IPv4(127, 0, 0, byte(2+i))
		for range perSource {
			doorRaw(t, l.Addr().String(), from)
		}
	}
	require.True(t, doorPollUntil(5*time.Second, func() bool { return l.Stats().Pending == sources*perSource }),
		"the listener took the streams: %+v", l.Stats())
	before, start := doorCPU(t), time.Now()
	time.Sleep(window) // the measurement's window, not a wait for an event
	used, elapsed := doorCPU(t)-before, time.Since(start)
	cores := used.Seconds() / elapsed.Seconds()
	t.Logf("%d idle streams: %v of CPU in %v (%.2f cores)", sources*perSource, used, elapsed, cores)
	assert.Less(t, cores, 0.1, "cores used by idle streams")
	assert.Equal(t, sources*perSource, l.Stats().Pending, "the streams are still pending")
}

// Handshakes begun and never completed do not hold the connection IDs a
// client needs: with a 3-byte ServerID (256 IDs), 256 secure ConnectSyns
// from 127.0.0.1 left half open still let a client from 127.0.0.2 in.
func TestDoorHalfOpenCannotExhaustIDs(t *testing.T) {
	t.Parallel()
	const attempts, batch = 256, 32
	scfg, ccfg := secureConfigs(t)
	scfg.ServerID = []byte{0x12, 0x34, 0x56}
	scfg.CookieThreshold = 1 << 30 // no cookies
	scfg.ConnectTimeout = 10 * time.Second
	scfg.DisconnectTimeout = 500 * time.Millisecond
	l := listen(t, scfg)
	serveEcho(t, l)
	server := l.Addr().(*net.UDPAddr)

	pcs := make([]*net.UDPConn, attempts)
	for i := range pcs {
		pc, err := net.ListenUDP("udp", &net.UDPAddr{IP: doorLocalhost})
		require.NoError(t, err)
		t.Cleanup(func() { pc.Close() })
		pcs[i] = pc
		_, syn, err := newClientSecure(ccfg.ServerKey, nil, nil)
		require.NoError(t, err)
		// As a secure client sends it (session_specsend.go: control).
		d := appendPadding(clearDatagram(0, false, message{id: idConnectSyn, payload: syn}), synPadTo)
		require.Len(t, d, synPadTo)
		_, err = pc.WriteToUDP(d, server)
		require.NoError(t, err)
		if (i+1)%batch == 0 {
			// In batches, so that the listener's socket buffer
			// drops none.
			require.True(t, doorPollUntil(5*time.Second, func() bool {
				st := l.Stats()
				return st.KeyExchanges+st.IgnoredAttempts >= uint64(i+1)
			}), "key exchanges: %+v", l.Stats())
		}
	}
	// Those answered got a ConnectSynAck; once the source holds its
	// share of the IDs, the rest are dropped before their key exchange
	// (or, raced, refused after it).
	buf := make([]byte, 2048)
	answered := 0
	deadline := time.Now().Add(time.Second) // for them all
	for i, pc := range pcs {
		pc.SetReadDeadline(deadline)
		n, err := pc.Read(buf)
		if err != nil {
			continue
		}
		if contentOf(buf[:n], idConnectSynAck) != nil {
			answered++
		} else {
			require.True(t, holdsID(buf[:n], idDisconnectAck), "attempt %d answered with a ConnectSynAck or a refusal", i)
		}
	}
	t.Logf("%d of %d half-open attempts got a connection ID", answered, attempts)
	assert.Positive(t, answered)
	assert.LessOrEqual(t, answered, 256/16, "one source holds at most a sixteenth of the IDs")
	st := l.Stats()
	t.Logf("half open: pending %d, key exchanges %d, refused %d", st.Pending, st.KeyExchanges, st.RefusedAttempts)

	o := &endpointOptions{dial: func(network string, raddr *net.UDPAddr) (socket, error) {
		pc, err := net.DialUDP(network, &net.UDPAddr{IP: doorOther}, raddr)
		if err != nil {
			return nil, err
		}
		return newUDPSocket(pc, true), nil
	}}
	c, err := dialWith(within(t, 5*time.Second), "udp", l.Addr().String(), ccfg, o)
	if assert.NoError(t, err, "a client from 127.0.0.2") {
		assert.Equal(t, doorOther.String(), c.LocalAddr().(*net.UDPAddr).IP.String())
		echoOnce(t, c, Message{ID: 100, Payload: []byte("in"), Reliable: true})
		c.Close()
	}
}

// Streams opened while a listener drains and that never say anything do
// not hold the Drain: with a UDP and a TCP client, and a new silent TCP
// stream every 300 ms meanwhile, Drain returns nil within 3 s
// (DisconnectTimeout 1 s).
func TestDoorDrainNotHeldBySilentStreams(t *testing.T) {
	cfg := tcpConfig()
	cfg.DisconnectTimeout = time.Second
	cfg.ConnectTimeout = 30 * time.Second
	l := listen(t, cfg)
	serveEcho(t, l)
	ctx := within(t, 10*time.Second)
	for _, network := range []string{"udp", "tcp"} {
		c, err := Dial(ctx, network, l.Addr().String(), testConfig())
		require.NoError(t, err)
		t.Cleanup(func() { c.Close() })
		echoOnce(t, c, Message{ID: 100, Payload: []byte(network), Reliable: true})
	}

	// The first silent stream comes as the Drain begins: the listener
	// has taken it.
	silent := []net.Conn{doorRaw(t, l.Addr().String(), nil)}
	require.True(t, doorPollUntil(5*time.Second, func() bool { return l.Stats().Pending == 1 }), "the first silent stream pending")
	dctx, cancel := context.WithTimeout(context.Background(), 8*time.Second)
	defer cancel()
	drained := make(chan error, 1)
	start := time.Now()
	go func() { drained <- l.Drain(dctx, "bye") }()
	var err error
	var took time.Duration
	tick := time.NewTicker(300 * time.Millisecond)
	defer tick.Stop()
	deadline := time.NewTimer(3 * time.Second)
	defer deadline.Stop()
wait:
	for range 100 {
		select {
		case err = <-drained:
			took = time.Since(start)
			break wait
		case <-tick.C:
			if nc, err := net.Dial("tcp", l.Addr().String()); err == nil {
				silent = append(silent, nc)
				t.Cleanup(func() { nc.Close() })
			}
		case <-deadline.C:
			cancel() // Drain returns ctx's error now
			err = <-drained
			took = time.Since(start)
			t.Errorf("Drain still waiting after %v", took)
			break wait
		}
	}
	t.Logf("Drain returned %v after %v; %d silent streams opened meanwhile", err, took, len(silent))
	assert.NoError(t, err, "Drain")
	assert.Less(t, took, 3*time.Second)
}

// doorNotGraceful checks that err, how a connection ended, does not read
// as a graceful end.
func doorNotGraceful(t *testing.T, err error, who string) {
	t.Helper()
	assert.Error(t, err, who)
	assert.False(t, doorGraceful(err), "%s: a graceful end (%v, %T)", who, err, err)
}

// A FIN that a relay injects in a secure stream, cutting the client's
// messages short, is no close of the client's: a secure peer's close is
// said in a sealed frame. The server reads the messages that came, then
// an error, not io.EOF, and neither end reads the cut as graceful. A
// close said by either end still is.
func TestDoorInjectedFINIsNotGraceful(t *testing.T) {
	scfg, ccfg, _ := secureTCPConfigs(t)
	l := listen(t, scfg)
	ctx := within(t, 15*time.Second)
	// A sealed control frame (ping, ping reply) is 18 bytes after its
	// size field, the announcement of key updates 25 (a path hello of
	// kind 5); the client's messages here are longer.
	control := 1 + 1 + sealOverhead
	announce := 1 + len(streamHelloMagic) + 1 + 2 + sealOverhead
	apps := 0
	relay := doorCutRelay(t, l.Addr().String(), func(i int, f []byte) bool {
		if size, _ := consumeVLE32(f); i == 0 || int(size) == control || int(size) == announce {
			return true // the hello, a ping, the announcement
		}
		apps++
		return apps <= 2
	})
	c, err := Dial(ctx, "tcp", relay, ccfg)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	sc, err := l.AcceptConn(ctx)
	require.NoError(t, err)
	for i := range 5 {
		require.NoError(t, c.Send(Message{ID: 100, Payload: fmt.Appendf(nil, "message %d of 5, numbered", i), Reliable: true}))
	}
	for i := range 2 {
		m, err := sc.Receive(ctx)
		require.NoError(t, err)
		assert.Equal(t, fmt.Sprintf("message %d of 5, numbered", i), string(m.Payload))
	}
	_, err = sc.Receive(ctx)
	assert.Error(t, err, "the server's Receive after the cut")
	assert.NotErrorIs(t, err, io.EOF, "the server's Receive after the cut")
	waitDone(t, sc, 5*time.Second)
	doorNotGraceful(t, sc.Err(), "the server's connection")
	waitDone(t, c, 5*time.Second)
	doorNotGraceful(t, c.Err(), "the client's connection")

	for _, clientCloses := range []bool{true, false} {
		c, err := Dial(ctx, "tcp", l.Addr().String(), ccfg)
		require.NoError(t, err)
		sc, err := l.AcceptConn(ctx)
		require.NoError(t, err)
		closer, peer := c, sc
		if !clientCloses {
			closer, peer = sc, c
		}
		require.NoError(t, closer.Send(Message{ID: 100, Payload: []byte("last words"), Reliable: true}))
		assert.NoError(t, closer.Close(), "client closes: %v", clientCloses)
		m, err := peer.Receive(ctx)
		require.NoError(t, err)
		assert.Equal(t, "last words", string(m.Payload))
		_, err = peer.Receive(ctx)
		assert.ErrorIs(t, err, io.EOF, "client closes: %v", clientCloses)
		waitDone(t, peer, 5*time.Second)
		assert.ErrorIs(t, peer.Err(), ErrPeerClosed, "client closes: %v", clientCloses)
	}
}

// Config.Dialect holds over a stream as over UDP: a DialectSpec listener
// takes no reference-dialect stream (a first frame that is no knet hello),
// and a DialectReference listener no knet client.
func TestDoorStreamDialect(t *testing.T) {
	t.Run("spec listener, reference stream", func(t *testing.T) {
		cfg := tcpConfig()
		cfg.Dialect = DialectSpec
		cfg.ConnectTimeout = 5 * time.Second
		l := listen(t, cfg)
		for _, f := range []struct {
			name  string
			frame []byte
		}{
			{"a PingRequest", appendTCPFrame(nil, idPingRequest, []byte{1})},
			{"an application frame", appendTCPFrame(nil, 100, []byte("hello"))},
		} {
			before := l.Stats()
			nc := doorRaw(t, l.Addr().String(), nil)
			start := time.Now()
			_, err := nc.Write(f.frame)
			require.NoError(t, err)
			s := doorWatch(nc, start, start.Add(time.Second))
			assert.True(t, s.closed, "%s first: the stream still open after %v", f.name, s.took)
			others := doorAcceptedBy(l, 100*time.Millisecond)
			for _, o := range others {
				t.Logf("%s first: accepted %v, dialect %v", f.name, o.RemoteAddr(), o.Dialect())
			}
			assert.Zero(t, len(others), "%s first: connections accepted", f.name)
			after := l.Stats()
			assert.Equal(t, before.FailedStreams+before.RefusedAttempts+1, after.FailedStreams+after.RefusedAttempts,
				"%s first: counted failed or refused", f.name)
		}
	})
	t.Run("reference listener, knet client", func(t *testing.T) {
		cfg := tcpConfig()
		cfg.Dialect = DialectReference
		l := listen(t, cfg)
		ccfg := testConfig()
		ccfg.ConnectTimeout = time.Second
		c, err := Dial(within(t, 5*time.Second), "tcp", l.Addr().String(), ccfg)
		if err == nil {
			t.Cleanup(func() { c.Close() })
			select {
			case <-c.Done():
			case <-time.After(time.Second):
				t.Errorf("a knet client's Dial to a DialectReference listener returned a connection that is still up 1 s later (dialect %v)", c.Dialect())
			}
		}
		others := doorAcceptedBy(l, 200*time.Millisecond)
		for _, o := range others {
			t.Logf("accepted %v, dialect %v", o.RemoteAddr(), o.Dialect())
		}
		assert.Zero(t, len(others), "connections accepted")
	})
}
