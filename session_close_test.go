package knet

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/netsim"
)

// The server answers the client's Disconnect, the DisconnectAck is lost,
// and the server's application closes at once (on io.EOF). A secure
// listener cannot answer the client's next Disconnect statelessly (it is
// sealed), nor can a stealthy one (it answers nobody): the server's
// connection lingers all the same, and answers it, so that the client's
// close ends by the exchange, not by its DisconnectTimeout.
//
// Before, the application's close ended the linger at once: the client
// waited out its DisconnectTimeout and ended with a *TimeoutError (the
// fleet example at 5% loss: a player or two a round).
func TestSessionCloseOnEOFKeepsLingering(t *testing.T) {
	for _, tc := range []struct {
		name string
		pair func(cfg, scfg *Config, link netsim.Params) *simPair
	}{
		{"secure", func(cfg, scfg *Config, link netsim.Params) *simPair {
			return newSecureSimPair(t, cfg, scfg, link, link)
		}},
		{"stealth", func(cfg, scfg *Config, link netsim.Params) *simPair {
			scfg.Stealth = true
			return newSimPair(t, cfg, scfg, link, link)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := &Config{DisconnectTimeout: 3 * time.Second}
			scfg := *cfg
			link := netsim.Params{Delay: time.Millisecond}
			p := tc.pair(cfg, &scfg, link)
			p.connect()
			p.send(0, numbered(100, 1, 10))
			p.endpoints = true
			lost := 0
			p.drop = func(from int, b []byte) bool {
				d, _, err := parseDatagram(b)
				if err == nil && from == 1 && len(d.msgs) == 1 && d.msgs[0].id == idDisconnectAck && lost == 0 {
					lost++
					return true
				}
				return false
			}
			p.client().requestClose(p.now)
			start := p.now
			require.True(t, p.run(time.Second, func() bool { return p.h[1].eof }))
			p.server().requestClose(p.now) // the application closes on io.EOF
			assert.False(t, p.server().done(), "the server still lingers")
			require.True(t, p.run(10*time.Second, func() bool { return p.client().done() }))
			assert.Equal(t, 1, lost)
			assert.NoError(t, p.client().err, "ended by a DisconnectAck, not by the timeout")
			assert.Less(t, p.now.Sub(start), 100*time.Millisecond)
			require.True(t, p.run(10*time.Second, func() bool { return p.server().done() }), "the linger ends")
			assert.Equal(t, []Message{numbered(100, 1, 10)}, p.h[1].msgs)
		})
	}
}
