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
