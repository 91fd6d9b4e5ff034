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

// The door bounds what one source may hold without proving anything:
// MaxPendingPerSource streams (TestDoorOneSourceCannotFillPending,
// TestStreamConnectionFlood). A stream told HTTP gives its pending place
// back as it is handed over; the http.Server then holds it, for
// ReadHeaderTimeout, or IdleTimeout between requests. Found by the
// attacker's review: with no bound there, one source that sent
// "GET / HTTP/1.1\r\n" and stopped, again and again, held as many
// sockets as it opened, past every pending limit, until the process ran
// out of file descriptors and accept failed for every player; so did one
// that made requests and left each connection idle. Now a stream held
// with no request in progress counts against its source's places and the
// Listener's (httpOn.hold): past them it is closed. Here 4 places, and 64
// streams from one source, each handed over before the next.
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
