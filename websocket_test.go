//go:build !js

package knet

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/coder/websocket"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// End-to-end tests of kNet over WebSocket (websocket.go): a Listener's
// WebSocketHandler on an httptest.Server, on loopback. The browser's side
// is websocket_browser_test.go's.

// wsServer serves l's WebSocketHandler and returns its ws:// URL.
func wsServer(t *testing.T, l *Listener) string {
	t.Helper()
	srv := httptest.NewServer(l.WebSocketHandler())
	t.Cleanup(srv.Close)
	return "ws" + strings.TrimPrefix(srv.URL, "http")
}

// A client over WebSocket reaches a Listener without Config.TCP, and
// every delivery mode crosses, echoed, in its order where it has one.
func TestWebSocketEchoEveryMode(t *testing.T) {
	l := listen(t, testConfig())
	defer l.Close()
	serveEcho(t, l)
	url := wsServer(t, l)
	ctx := within(t, 20*time.Second)
	c, err := DialWebSocket(ctx, url, testConfig())
	require.NoError(t, err)
	assert.Equal(t, TransportWebSocket, c.Transport())
	assert.Equal(t, DialectSpec, c.Dialect(), "a knet server said hello")
	assert.Nil(t, l.tcp, "no TCP socket needed")

	echoEveryMode(t, ctx, c)
	st := l.Stats()
	assert.Equal(t, 1, st.Connections)
	assert.Equal(t, uint64(1), st.Established)
	require.NoError(t, c.Close())
	assert.ErrorIs(t, c.Err(), net.ErrClosed)
}

// A close ends both sides cleanly, either way round, in a round trip or
// so: the knet hello says it, the WebSocket's close answers it, and
// nobody waits out DisconnectTimeout.
func TestWebSocketCloseBothWays(t *testing.T) {
	const disconnect = 10 * time.Second
	cfg := testConfig()
	cfg.DisconnectTimeout = disconnect
	l := listen(t, cfg)
	defer l.Close()
	url := wsServer(t, l)
	ctx := within(t, 20*time.Second)

	for _, clientCloses := range []bool{true, false} {
		c, err := DialWebSocket(ctx, url, cfg)
		require.NoError(t, err)
		sc, err := l.AcceptConn(ctx)
		require.NoError(t, err)
		assert.Equal(t, TransportWebSocket, sc.Transport())
		closer, peer := c, sc
		if !clientCloses {
			closer, peer = sc, c
		}
		require.NoError(t, closer.Send(Message{ID: 50, Payload: []byte("bye"), Reliable: true}))
		start := time.Now()
		require.NoError(t, closer.CloseWithReason("done here"))
		took := time.Since(start)
		m, err := peer.Receive(ctx)
		require.NoError(t, err)
		assert.Equal(t, "bye", string(m.Payload), "what was sent before the close arrives")
		_, err = peer.Receive(ctx)
		assert.ErrorIs(t, err, io.EOF)
		select {
		case <-peer.Done():
		case <-ctx.Done():
			t.Fatal("the peer's side did not end")
		}
		var de *DisconnectError
		require.ErrorAs(t, peer.Err(), &de, "client closes: %v", clientCloses)
		assert.Equal(t, "done here", de.Reason)
		assert.ErrorIs(t, closer.Err(), net.ErrClosed)
		assert.Less(t, took, disconnect/2, "Close returned on the peer's answer, not the timeout")
		t.Logf("client closes %v: Close took %v", clientCloses, took)
	}
	require.Eventually(t, func() bool { return l.Stats().Connections == 0 }, 5*time.Second, 5*time.Millisecond)
}

// The Admit hook reads the ConnectPayload of a client over WebSocket, and
// its reply reaches the client; a refusal reaches DialWebSocket with its
// reason.
func TestWebSocketAdmitAndRefusal(t *testing.T) {
	cfg := testConfig()
	cfg.Admit = func(_ net.Addr, p []byte) ([]byte, error) {
		if string(p) == "let me in" {
			return []byte("welcome"), nil
		}
		return nil, errors.New("no such player")
	}
	l := listen(t, cfg)
	defer l.Close()
	url := wsServer(t, l)
	ctx := within(t, 20*time.Second)

	ccfg := testConfig()
	ccfg.ConnectPayload = []byte("intruder")
	_, err := DialWebSocket(ctx, url, ccfg)
	require.ErrorIs(t, err, ErrRefused)
	var re *RefusedError
	require.ErrorAs(t, err, &re)
	assert.Equal(t, "no such player", re.Reason)

	ccfg.ConnectPayload = []byte("let me in")
	c, err := DialWebSocket(ctx, url, ccfg)
	require.NoError(t, err)
	defer c.Close()
	_, synAck := c.Handshake()
	assert.Equal(t, "welcome", string(synAck))
	sc, err := l.AcceptConn(ctx)
	require.NoError(t, err)
	syn, _ := sc.Handshake()
	assert.Equal(t, "let me in", string(syn))
	assert.GreaterOrEqual(t, l.Stats().RefusedAttempts, uint64(1))
}

// A WebSocket message longer than any write of a knet writer (the read
// limit newWSConn sets) ends that connection, with the reason, and
// nothing else; a plain HTTP request to the handler is answered and gets
// no connection.
func TestWebSocketHostileInput(t *testing.T) {
	cfg := testConfig()
	cfg.MaxMessageSize = 1 << 10
	l := listen(t, cfg)
	defer l.Close()
	url := wsServer(t, l)
	ctx := within(t, 20*time.Second)

	resp, err := http.Get("http" + strings.TrimPrefix(url, "ws"))
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, http.StatusUpgradeRequired, resp.StatusCode)
	assert.Equal(t, 0, l.Stats().Connections)

	// A knet client's opening, by hand, then a message of valid frames
	// (each within MaxMessageSize) but longer than a writer's write.
	ws, _, err := websocket.Dial(ctx, url, nil)
	require.NoError(t, err)
	defer ws.CloseNow()
	hello := appendTCPFrame(nil, idPingReply, appendStreamHello(nil, helloClient, nil))
	require.NoError(t, ws.Write(ctx, websocket.MessageBinary, hello))
	sc, err := l.AcceptConn(ctx)
	require.NoError(t, err)
	limit := streamWriteMax + cfg.MaxMessageSize + wsReadSlack
	var huge []byte
	for len(huge) <= limit {
		huge = appendTCPFrame(huge, 100, make([]byte, 1000))
	}
	wrote := make(chan error, 1)
	go func() { wrote <- ws.Write(ctx, websocket.MessageBinary, huge) }()
	select {
	case <-sc.Done():
	case <-ctx.Done():
		t.Fatal("the server's connection read on past the limit")
	}
	assert.ErrorIs(t, sc.Err(), websocket.ErrMessageTooBig)
	ws.CloseNow()
	<-wrote // its error, if any, is the reset's

	c, err := DialWebSocket(ctx, url, testConfig())
	require.NoError(t, err, "the listener serves on")
	require.NoError(t, c.Close())
	require.Eventually(t, func() bool { return l.Stats().Connections == 0 }, 5*time.Second, 5*time.Millisecond)
}

// DialWebSocket refuses what it cannot do yet, at once.
func TestWebSocketDialErrors(t *testing.T) {
	//lint:ignore SA1012 the nil context is the point
	_, err := DialWebSocket(nil, "ws://127.0.0.1:1/", nil) //nolint:staticcheck
	assert.ErrorIs(t, err, errNilContext)
	_, err = DialWebSocket(context.Background(), "ws://127.0.0.1:1/", &Config{ServerKey: make([]byte, 5)})
	assert.Error(t, err, "a ServerKey of the wrong size")
}

// Secure sessions over WebSocket are those over TCP: the same hellos and
// sealed frames, the same token and Admit. A secure listener's handler
// takes a secure client, which echoes in every mode, refuses a replayed
// token and a plaintext client.
func TestWebSocketSecure(t *testing.T) {
	priv, pub, err := GenerateKey()
	require.NoError(t, err)
	tokenKey := make([]byte, TokenKeySize)
	cfg := testConfig()
	cfg.PrivateKey, cfg.TokenKey = priv, tokenKey
	cfg.PublicAddrs = []netip.AddrPort{netip.MustParseAddrPort("127.0.0.1:7000")}
	l := listen(t, cfg)
	defer l.Close()
	serveEcho(t, l)
	url := wsServer(t, l)
	ctx := within(t, 20*time.Second)
	tok, err := IssueToken(tokenKey, Token{ClientID: 42, Expires: time.Now().Add(time.Minute), Servers: cfg.PublicAddrs})
	require.NoError(t, err)
	ccfg := testConfig()
	ccfg.ServerKey, ccfg.Token = pub, tok
	c, err := DialWebSocket(ctx, url, ccfg)
	require.NoError(t, err)
	assert.True(t, c.Secure())
	assert.Equal(t, TransportWebSocket, c.Transport())
	echoEveryMode(t, ctx, c)
	require.NoError(t, c.Close())

	_, err = DialWebSocket(ctx, url, ccfg)
	assert.ErrorIs(t, err, ErrTokenRejected, "a token gets in once")
	_, err = DialWebSocket(ctx, url, testConfig())
	assert.ErrorIs(t, err, ErrRefused, "no plaintext at a secure listener")
}

// Closing the Listener ends its WebSocket connections as it does the
// others, and its handler takes no more.
func TestWebSocketListenerClose(t *testing.T) {
	l := listen(t, testConfig())
	url := wsServer(t, l)
	ctx := within(t, 20*time.Second)
	c, err := DialWebSocket(ctx, url, testConfig())
	require.NoError(t, err)
	_, err = l.AcceptConn(ctx)
	require.NoError(t, err)
	require.NoError(t, l.Close())
	select {
	case <-c.Done():
	case <-ctx.Done():
		t.Fatal("the client's connection outlived the listener")
	}
	assert.ErrorIs(t, c.Err(), ErrPeerClosed)
	_, err = DialWebSocket(ctx, url, testConfig())
	assert.ErrorIs(t, err, ErrRefused, "a closed listener's handler drops the stream")
}

// The handler serves under its server's TLS (wss://) as without.
func TestWebSocketOverTLS(t *testing.T) {
	l := listen(t, testConfig())
	defer l.Close()
	serveEcho(t, l)
	srv := httptest.NewTLSServer(l.WebSocketHandler())
	defer srv.Close()
	ctx := within(t, 20*time.Second)
	// DialWebSocket's client trusts the system's roots only: the test
	// server's certificate needs its own client.
	ws, _, err := websocket.Dial(ctx, "wss"+strings.TrimPrefix(srv.URL, "https"), &websocket.DialOptions{HTTPClient: srv.Client()})
	require.NoError(t, err)
	rc := testConfig().resolve()
	c, err := dialStream(ctx, newWSConn(ws, rc), TransportWebSocket, rc, &endpointOptions{})
	require.NoError(t, err)
	require.NoError(t, c.Send(Message{ID: 50, Payload: []byte("secret"), Reliable: true}))
	m, err := c.Receive(ctx)
	require.NoError(t, err)
	assert.Equal(t, "secret", string(m.Payload))
	require.NoError(t, c.Close())
}

// A page of another host is refused unless the handler names it.
func TestWebSocketOrigins(t *testing.T) {
	l := listen(t, testConfig())
	defer l.Close()
	ctx := within(t, 20*time.Second)
	foreign := &websocket.DialOptions{HTTPHeader: http.Header{"Origin": {"https://games.example"}}}
	for _, tc := range []struct {
		origins []string
		ok      bool
	}{
		{nil, false},
		{[]string{"other.example"}, false},
		{[]string{"*.example"}, true},
	} {
		srv := httptest.NewServer(l.WebSocketHandler(tc.origins...))
		ws, resp, err := websocket.Dial(ctx, "ws"+strings.TrimPrefix(srv.URL, "http"), foreign)
		if tc.ok {
			require.NoError(t, err, "origins %q", tc.origins)
			ws.CloseNow()
		} else {
			require.Error(t, err, "origins %q", tc.origins)
			assert.Equal(t, http.StatusForbidden, resp.StatusCode)
		}
		srv.Close()
	}
}
