//go:build !js

package knet

// errNoSockets is nil where the system has sockets (sockets_js.go).
var errNoSockets error
