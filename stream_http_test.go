//go:build !js

package knet

import (
	"context"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestSniffHTTP(t *testing.T) {
	for _, c := range []struct {
		in           string
		isHTTP, told bool
	}{
		{"G", false, false},
		{"GE", false, false},
		{"GET", false, false},
		{"GET ", false, false},
		{"GET /", true, true},
		{"GET /knet HTTP/1.1\r\n", true, true},
		{"POST /token", true, true},
		{"OPTIONS * HTTP/1.1", true, true},
		{"PATCH /x", true, true},
		{"GET x", false, true},
		{"GETX", false, true},
		{"\x02\x01\x01", false, true},            // the reference's first ping
		{"\x0b\x02\x00kNT\x01\x01", false, true}, // a knet hello
		{"\x47\x45\x54\x20\x2f", true, true},     // a reference frame of 71 bytes, ID 69, payload "T /": taken for HTTP (Config.HTTP says so)
		{"\x83\x00\x0a\x41\x42", false, true},    // a longer VLE
		{"P", false, false},                      // POST, PUT, PATCH
		{"PO", false, false},
		{"PU", false, false},
		{"PX", false, true},
		{"", false, false},
	} {
		isHTTP, told := sniffHTTP([]byte(c.in))
		assert.Equal(t, c.isHTTP, isHTTP, "%q", c.in)
		assert.Equal(t, c.told, told, "%q", c.in)
	}
}

// UDP, kNet over TCP, a reference client over TCP, WebSocket and plain
// HTTP all on one port number (Config.HTTP): each works, and an HTTP
// stream is no failed connection attempt.
func TestHTTPOnGamePort(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /hello", func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "hello from the game port") })
	cfg := testConfig()
	cfg.TCP = true
	cfg.HTTP = mux
	l, err := Listen("udp", "127.0.0.1:0", cfg)
	require.NoError(t, err)
	t.Cleanup(func() { l.Close() })
	mux.Handle("/knet", l.WebSocketHandler())
	addr := l.Addr().String()
	ctx := within(t, 10*time.Second)

	exchange := func(what string, c *Conn) {
		t.Helper()
		s, err := l.AcceptConn(ctx)
		require.NoError(t, err, what)
		require.NoError(t, c.Send(Message{ID: 6, Payload: []byte(what), Reliable: true}))
		m, err := s.Receive(ctx)
		require.NoError(t, err, what)
		assert.Equal(t, what, string(m.Payload))
		c.Close()
	}
	for _, network := range []string{"udp", "tcp"} {
		c, err := Dial(ctx, network, addr, testConfig())
		require.NoError(t, err, network)
		exchange(network, c)
	}
	ref := testConfig()
	ref.Dialect = DialectReference
	c, err := Dial(ctx, "tcp", addr, ref)
	require.NoError(t, err)
	require.NoError(t, c.Send(Message{ID: 6, Payload: []byte("reference"), Reliable: true}))
	s, err := l.AcceptConn(ctx)
	require.NoError(t, err, "a reference client's first frame (a ping) is no HTTP")
	m, err := s.Receive(ctx)
	require.NoError(t, err)
	assert.Equal(t, "reference", string(m.Payload))
	c.Close()
	ws, err := DialWebSocket(ctx, "ws://"+addr+"/knet", testConfig())
	require.NoError(t, err)
	exchange("websocket", ws)
	for range 3 { // keep-alive and new streams alike
		resp, err := http.Get("http://" + addr + "/hello")
		require.NoError(t, err)
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.NoError(t, err)
		assert.Equal(t, "hello from the game port", string(b))
	}
	st := l.Stats()
	assert.Zero(t, st.FailedStreams, "an HTTP stream is no failed attempt")
}

// A stream that begins like a request line and stops holds its pending
// place as any stream that began its first frame does, and ends at
// ConnectTimeout: it is not handed to HTTP, and nothing is answered.
func TestHTTPSniffStalledEnds(t *testing.T) {
	cfg := testConfig()
	cfg.TCP = true
	cfg.HTTP = http.NotFoundHandler()
	cfg.ConnectTimeout = 300 * time.Millisecond
	l, err := Listen("udp", "127.0.0.1:0", cfg)
	require.NoError(t, err)
	t.Cleanup(func() { l.Close() })
	nc, err := net.Dial("tcp", l.Addr().String())
	require.NoError(t, err)
	t.Cleanup(func() { nc.Close() })
	_, err = nc.Write([]byte("GE"))
	require.NoError(t, err)
	nc.SetReadDeadline(time.Now().Add(10 * time.Second))
	b, err := io.ReadAll(nc)
	require.NoError(t, err, "the listener ends the stream")
	assert.Empty(t, b, "nothing answered")
	assert.Equal(t, uint64(1), l.Stats().FailedStreams)
}

// Config.HTTP is a Listener's, and served on its TCP port.
func TestHTTPConfigSides(t *testing.T) {
	_, err := Listen("udp", "127.0.0.1:0", &Config{HTTP: http.NotFoundHandler()})
	assert.ErrorContains(t, err, "Config.TCP")
	_, err = Dial(context.Background(), "udp", "127.0.0.1:1", &Config{HTTP: http.NotFoundHandler()})
	assert.ErrorContains(t, err, "Config.HTTP")
}
