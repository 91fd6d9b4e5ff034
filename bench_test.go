package knet

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Benchmarks over loopback: go test -run XXX -bench . -benchmem

// benchPair returns a connected client and the server's side of it.
func benchPair(tb testing.TB, cfg *Config) (client, server *Conn) {
	l, err := Listen("udp", "127.0.0.1:0", forListen(cfg))
	require.NoError(tb, err)
	tb.Cleanup(func() { l.Close() })
	accepted := make(chan *Conn, 1)
	go func() {
		c, err := l.AcceptConn(context.Background())
		if err == nil {
			accepted <- c
		}
	}()
	client, err = Dial(context.Background(), "udp", l.Addr().String(), forDial(cfg))
	require.NoError(tb, err)
	tb.Cleanup(func() { client.Close() })
	require.NoError(tb, client.Send(Message{ID: 6, Reliable: true}))
	server = <-accepted
	_, err = server.Receive(context.Background())
	require.NoError(tb, err)
	return client, server
}

func benchOneWay(b *testing.B, size int) {
	benchOneWayWith(b, size, &Config{DisconnectTimeout: time.Second})
}

// BenchmarkSecureOneWay1200 is BenchmarkOneWay1200 over a secure session
// (one Config with both keys serves both ends); the target is at least
// 0.7 times the plaintext rate.
func BenchmarkSecureOneWay1200(b *testing.B) {
	priv, pub, err := GenerateKey()
	require.NoError(b, err)
	benchOneWayWith(b, 1200, &Config{DisconnectTimeout: time.Second, PrivateKey: priv, ServerKey: pub})
}

func benchOneWayWith(b *testing.B, size int, cfg *Config) {
	client, server := benchPair(b, cfg)
	benchOneWayOn(b, size, client, server)
}

// benchOneWayOn sends b.N reliable messages of size bytes from client to
// server.
func benchOneWayOn(b *testing.B, size int, client, server *Conn) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, size)
		for range b.N {
			if _, _, err := server.ReceiveInto(context.Background(), buf); err != nil {
				return
			}
		}
	}()
	payload := make([]byte, size)
	b.SetBytes(int64(size))
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		if err := client.Send(Message{ID: 6, Payload: payload, Reliable: true}); err != nil {
			b.Fatal(err)
		}
	}
	<-done
	b.StopTimer()
	st := client.Stats()
	b.ReportMetric(float64(st.Retransmits)/float64(max(st.DatagramsSent, 1)), "resent/dgram")
}

func BenchmarkOneWay64(b *testing.B)   { benchOneWay(b, 64) }
func BenchmarkOneWay1200(b *testing.B) { benchOneWay(b, 1200) }
func BenchmarkOneWay1MiB(b *testing.B) { benchOneWay(b, 1<<20) }

func BenchmarkPingPong(b *testing.B) { benchPingPong(b, &Config{DisconnectTimeout: time.Second}) }

// BenchmarkSecurePingPong is BenchmarkPingPong over a secure session; the
// target is a p50 round trip at most 1.1 times the plaintext one.
func BenchmarkSecurePingPong(b *testing.B) {
	priv, pub, err := GenerateKey()
	require.NoError(b, err)
	benchPingPong(b, &Config{DisconnectTimeout: time.Second, PrivateKey: priv, ServerKey: pub})
}

func benchPingPong(b *testing.B, cfg *Config) {
	client, server := benchPair(b, cfg)
	benchPingPongOn(b, client, server)
}

// benchPingPongOn runs b.N round trips of 32 bytes between client and
// server.
func benchPingPongOn(b *testing.B, client, server *Conn) {
	go func() {
		buf := make([]byte, 64)
		for {
			m, _, err := server.ReceiveInto(context.Background(), buf)
			if err != nil {
				return
			}
			server.Send(m)
		}
	}()
	payload := make([]byte, 32)
	buf := make([]byte, 64)
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		client.Send(Message{ID: 6, Payload: payload, Reliable: true})
		if _, _, err := client.ReceiveInto(context.Background(), buf); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	b.ReportMetric(float64(client.Stats().DatagramsSent+server.Stats().DatagramsSent)/float64(b.N), "dgrams/op")
}

// BenchmarkSessions: 100 clients doing ping-pong with one server at once;
// one op is one round trip.
func BenchmarkSessions(b *testing.B) { benchSessions(b, &Config{DisconnectTimeout: time.Second}) }

// BenchmarkSecureSessions is BenchmarkSessions over secure sessions.
func BenchmarkSecureSessions(b *testing.B) {
	priv, pub, err := GenerateKey()
	require.NoError(b, err)
	benchSessions(b, &Config{DisconnectTimeout: time.Second, PrivateKey: priv, ServerKey: pub})
}

func benchSessions(b *testing.B, cfg *Config) {
	l, err := Listen("udp", "127.0.0.1:0", forListen(cfg))
	require.NoError(b, err)
	defer l.Close()
	go func() {
		for {
			c, err := l.AcceptConn(context.Background())
			if err != nil {
				return
			}
			go func() {
				buf := make([]byte, 64)
				for {
					m, _, err := c.ReceiveInto(context.Background(), buf)
					if err != nil {
						return
					}
					c.Send(m)
				}
			}()
		}
	}()
	const sessions = 100
	clients := make([]*Conn, sessions)
	for i := range clients {
		clients[i], err = Dial(context.Background(), "udp", l.Addr().String(), forDial(cfg))
		require.NoError(b, err)
		defer clients[i].Close()
	}
	payload := make([]byte, 32)
	b.ReportAllocs()
	b.ResetTimer()
	var wg sync.WaitGroup
	per := b.N/sessions + 1
	for _, c := range clients {
		wg.Go(func() {
			buf := make([]byte, 64)
			for range per {
				c.Send(Message{ID: 6, Payload: payload, Reliable: true})
				if _, _, err := c.ReceiveInto(context.Background(), buf); err != nil {
					return
				}
			}
		})
	}
	wg.Wait()
	b.StopTimer()
	var sent uint64
	for _, c := range clients {
		sent += c.Stats().DatagramsSent
	}
	b.ReportMetric(float64(sent)/float64(b.N), "client-dgrams/op")
}
