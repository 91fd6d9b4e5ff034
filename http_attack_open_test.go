//go:build !js

package knet

import (
	"errors"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// KNOWN WEAKNESS, left failing on purpose (see the attack39 report).
//
// The door bounds what one source may hold without proving anything:
// MaxPendingPerSource streams (TestDoorOneSourceCannotFillPending,
// TestStreamConnectionFlood). A stream told HTTP gives its pending place
// back as it is handed over, and the http.Server then holds it, a
// goroutine and its buffers for ReadHeaderTimeout (ConnectTimeout), or
// IdleTimeout between requests, with no bound on how many: one source
// that sends "GET / HTTP/1.1\r\n" and stops, again and again, holds as
// many sockets as it opens, past every pending limit, until the process
// runs out of file descriptors and accept fails for every player; so
// does one that makes requests and leaves each connection idle (keep-
// alive). Here 4 places, and of 64 streams from one source, each handed
// over before the next, nearly all stay open either way.
//
// A fix (not small, so not made here): keep the handed stream counted
// against its source's pending places (or a like bound of its own) while
// the http.Server holds it with no request in progress, through
// http.Server.ConnState (StateNew and StateIdle counted, StateActive,
// StateHijacked and StateClosed not), closing a new one past the bound.
func TestHTTPAttackStalledHeadsBoundedPerSource(t *testing.T) {
	const places, streams = 4, 64
	for _, tc := range []struct{ name, send string }{
		{"stalled-head", "GET / HTTP/1.1\r\n"},                   // held for ReadHeaderTimeout
		{"idle-keep-alive", "GET / HTTP/1.1\r\nHost: x\r\n\r\n"}, // answered, then held for IdleTimeout
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := httpListener(t, http.NotFoundHandler(), places, nil)
			var conns []net.Conn
			for range streams {
				nc := rawTCP(t, l)
				_, err := io.WriteString(nc, tc.send)
				require.NoError(t, err)
				conns = append(conns, nc)
				// Handed to HTTP: its place is free again before the next.
				require.Eventually(t, func() bool { return l.Stats().Pending == 0 }, 5*time.Second, time.Millisecond)
			}
			open := 0
			for _, nc := range conns {
				for {
					// An answer (404) may come first: read past it.
					nc.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
					_, err := nc.Read(make([]byte, 4096))
					if err == nil {
						continue
					}
					var ne net.Error
					if errors.As(err, &ne) && ne.Timeout() {
						open++
					}
					break
				}
			}
			assert.LessOrEqual(t, open, places, "HTTP streams one source holds open at once (ConnectTimeout and ConnectionLostTimeout are 30s)")
		})
	}
}
