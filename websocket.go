package knet

import (
	"context"
	"net"
	"net/http"

	"github.com/coder/websocket"
)

// kNet over WebSocket, for players in a browser: the reference's TCP
// framing (tcpframe.go) carried in binary messages, one message for each
// write of the stream's writer, read back as one byte stream. The
// WebSocket protocol itself (RFC 6455: the upgrade, masking,
// fragmentation, the close handshake; in a browser, its WebSocket object)
// is github.com/coder/websocket's.

// WebSocketHandler returns an http.Handler that takes kNet connections
// over WebSocket for l: it upgrades each request and runs a connection
// over it as over a TCP stream (Transport returns TransportWebSocket),
// through the same admission, Accept or Group, and Stats as l's other
// connections. Mount it on a path of an existing server, which gives it
// its TLS (wss://); the Listener needs no Config.TCP for it.
//
// Browsers send an Origin header: by default only a page of the server's
// own host may connect. origins adds host patterns allowed besides (as
// path.Match takes them against the Origin's host, "example.com" or
// "*.example.com"; "*" allows any page, which suits a game whose
// admission does not rest on the browser's cookies).
func (l *Listener) WebSocketHandler(origins ...string) http.Handler {
	opts := &websocket.AcceptOptions{OriginPatterns: origins}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ws, err := websocket.Accept(w, r, opts)
		if err != nil {
			// Accept answered the request (400, 403, ...).
			l.eps[0].ignored.Add(1)
			return
		}
		// The connection outlives the request: its context, which ends
		// when this handler returns, is not the stream's.
		l.takeStream(newWSConn(ws, l.cfg), TransportWebSocket)
	})
}

// DialWebSocket connects to a kNet server over WebSocket, at a URL
// ("ws://host/path" or "wss://host/path") where a Listener's
// WebSocketHandler serves. It returns once the server admitted the
// connection, as Dial does. It connects with net/http's default client
// (for wss://, the system's roots). Compiled for the browser (GOOS=js
// GOARCH=wasm), it goes through the browser's WebSocket, and is then the
// only way to connect: Dial and Listen have no sockets there.
func DialWebSocket(ctx context.Context, url string, cfg *Config) (*Conn, error) {
	if ctx == nil {
		return nil, errNilContext
	}
	rc, err := cfg.resolveDialer()
	if err != nil {
		return nil, err
	}
	ws, _, err := websocket.Dial(ctx, url, nil)
	if err != nil {
		return nil, err
	}
	return dialStream(ctx, newWSConn(ws, rc), TransportWebSocket, rc, &endpointOptions{})
}

// wsReadSlack is what a write of the stream's writer carries besides its
// frames of messages: control frames (pings, knet's hello, whose content
// the handshake limit keeps far below this) and frame headers.
const wsReadSlack = 64 << 10

// wsConn is a WebSocket as a net.Conn for a stream connection.
type wsConn struct {
	net.Conn
}

// newWSConn wraps ws for a stream connection whose messages are at most
// cfg.maxMessage bytes.
func newWSConn(ws *websocket.Conn, cfg *config) net.Conn {
	nc := websocket.NetConn(context.Background(), ws, websocket.MessageBinary)
	// NetConn lifts the read limit; a WebSocket message is one write of
	// the peer's writer: at most streamWriteMax bytes of frames, and a
	// frame over that only if it is the one message that takes it past
	// (cfg.maxMessage at most: any more, and the framer would refuse it
	// anyway). A longer message closes the WebSocket (StatusMessageTooBig).
	ws.SetReadLimit(int64(streamWriteMax + cfg.maxMessage + wsReadSlack))
	return wsConn{nc}
}

// Close starts the WebSocket's close handshake and returns: it waits
// (the library bounds it by seconds) for the peer's answer, and the
// connection's round, which calls Close, must not. By then kNet's own
// close has been said (knet's hello), or the connection failed.
func (c wsConn) Close() error {
	go c.Conn.Close()
	return nil
}
