package knet

import "errors"

// errNoSockets is why Listen and Dial fail: in a browser (GOOS=js
// GOARCH=wasm) a program has no UDP or TCP socket, only the browser's
// WebSocket.
var errNoSockets = errors.New("knet: no UDP or TCP sockets in a browser (js/wasm): connect with DialWebSocket")
