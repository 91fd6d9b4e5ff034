//go:build !js

package knet

import (
	"fmt"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A stream whose first bytes leave the sniff undecided ("GE") and whose
// client then half-closes ends at once, as a knet stream cut mid-hello
// does: no more bytes can tell it HTTP, so it must not wait, its place
// and socket held, for ConnectTimeout (30s here).
func TestHTTPAttackUndecidedThenEOFEnds(t *testing.T) {
	for _, first := range []string{"", "\x05\x02", "G", "GE", "OPTIONS"} {
		t.Run(fmt.Sprintf("%q", first), func(t *testing.T) {
			l := httpListener(t, http.NotFoundHandler(), 4, nil)
			nc := rawTCP(t, l)
			_, err := nc.Write([]byte(first))
			require.NoError(t, err)
			require.NoError(t, nc.(*net.TCPConn).CloseWrite())
			closedWithin(t, nc, 5*time.Second)
			require.Eventually(t, func() bool { return l.Stats().Pending == 0 }, 5*time.Second, time.Millisecond)
		})
	}
}
