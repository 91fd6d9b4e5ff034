package knet

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// benchTCPPair is benchPair over TCP.
func benchTCPPair(tb testing.TB, cfg *Config) (client, server *Conn) {
	lcfg := *cfg
	lcfg.TCP = true
	l, err := Listen("udp", "127.0.0.1:0", &lcfg)
	require.NoError(tb, err)
	tb.Cleanup(func() { l.Close() })
	accepted := make(chan *Conn, 1)
	go func() {
		c, err := l.AcceptConn(context.Background())
		if err == nil {
			accepted <- c
		}
	}()
	client, err = Dial(context.Background(), "tcp", l.Addr().String(), cfg)
	require.NoError(tb, err)
	tb.Cleanup(func() { client.Close() })
	require.NoError(tb, client.Send(Message{ID: 6, Reliable: true}))
	server = <-accepted
	_, err = server.Receive(context.Background())
	require.NoError(tb, err)
	return client, server
}

// BenchmarkTCPOneWay1200 is BenchmarkOneWay1200 over kNet over TCP.
func BenchmarkTCPOneWay1200(b *testing.B) {
	client, server := benchTCPPair(b, &Config{DisconnectTimeout: time.Second})
	benchOneWayOn(b, 1200, client, server)
}

// BenchmarkTCPPingPong is BenchmarkPingPong over kNet over TCP.
func BenchmarkTCPPingPong(b *testing.B) {
	client, server := benchTCPPair(b, &Config{DisconnectTimeout: time.Second})
	benchPingPongOn(b, client, server)
}
