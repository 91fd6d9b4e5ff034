package knet

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestReferenceHandshakeDatagramLost drops, one kind at a time, the
// datagrams of a reference-dialect opening: the client's 8 zero bytes,
// the server's PingRequest challenge, the client's PingReply echoing it.
// Each loss costs a resend, never the attempt, and the server sends the
// unproven address no more than it received.
//
// The client's PingReply is what mattered (TestChaosConn
// reference-bursty/10): the client is open once the challenge arrives, and
// sent nothing more until its keepalive ping 5s later; the server may not
// send its challenge again without that credit (amplifies), so with that
// ping's reply lost too, ConnectTimeout (10s) ended the server's attempt
// and the client heard nothing more.
func TestReferenceHandshakeDatagramLost(t *testing.T) {
	kind := func(from int, b []byte) string {
		if isCppOpening(b) {
			return "opening"
		}
		var d cppDatagram
		require.NoError(t, parseCppInto(b, &d))
		switch {
		case from == 1 && d.has(idPingRequest):
			return "challenge"
		case from == 0 && d.has(idPingReply):
			return "PingReply"
		}
		return ""
	}
	for _, tt := range []struct {
		what string
		n    int
	}{
		{"opening", 1},
		{"opening", 3},
		{"challenge", 1},
		{"challenge", 3},
		{"PingReply", 1},
		{"PingReply", 2},
		{"PingReply", 4},
	} {
		t.Run(fmt.Sprintf("%s %dx", tt.what, tt.n), func(t *testing.T) {
			p := newSimPairIn(t, DialectReference, nil, nil, perfect, perfect)
			dropped := 0
			in, out := 0, 0 // before the proof: bytes the server received and sent
			p.drop = func(from int, b []byte) bool {
				unproven := !p.server().addressProven()
				if from == 1 && unproven {
					out += len(b)
				}
				if kind(from, b) == tt.what && dropped < tt.n && unproven {
					dropped++
					return true
				}
				if from == 0 && unproven {
					in += len(b)
				}
				return false
			}
			start := p.now
			ok := p.run(15*time.Second, func() bool { return p.h[0].est && p.h[1].est })
			require.True(t, ok, "established: client %v, server %v %v", p.client().state, p.server().state, p.server().err)
			t.Logf("connected after %v", p.now.Sub(start))
			assert.Equal(t, tt.n, dropped)
			assert.Less(t, p.now.Sub(start), 4*time.Second, "connected by resends, well before the keepalive ping")
			assert.True(t, p.server().addressProven())
			require.True(t, p.run(time.Second, func() bool { return !p.client().handshake.pinging }), "the client's pings answered")
			assert.Greater(t, p.client().live.nextPing.Sub(p.now), time.Second, "then at the keepalive's pace")
			assert.LessOrEqual(t, out, in, "no more to the unproven address than it sent")
			assert.LessOrEqual(t, p.server().handshake.preOut, p.server().handshake.preIn)
		})
	}
}
