//go:build unix

package knet

import (
	"net"
	"sync/atomic"
	"testing"
	"time"

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
				const connectTimeout = time.Second
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
