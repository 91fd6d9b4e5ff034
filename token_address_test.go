//go:build !js

package knet

import (
	"context"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Which address a connect token must name, on each transport: one of the
// Listener's PublicAddrs, or without them its UDP socket's address, which
// a TCP client dials too (the same port number). Over WebSocket it is not
// the address of the HTTP server the client dials: the check is the
// Listener's, the same for every transport (token.go, tokenChecker.forUs).
func TestTokenAddressEachTransport(t *testing.T) {
	t.Parallel()
	for _, public := range []bool{false, true} {
		pub := netip.MustParseAddrPort("203.0.113.7:7000") // where a NAT or balancer takes players
		l, key, ccfg, _ := tokenServer(t, func(c *Config) {
			c.TCP = true
			if public {
				c.PublicAddrs = []netip.AddrPort{pub}
			}
		})
		ws := wsServer(t, l)
		sock := addrPort(t, l.Addr())
		httpAddr := netip.MustParseAddrPort(strings.TrimPrefix(ws, "ws://"))
		want, others := sock, []netip.AddrPort{httpAddr, pub}
		if public {
			want, others = pub, []netip.AddrPort{httpAddr, sock}
		}
		for _, tr := range []Transport{TransportUDP, TransportTCP, TransportWebSocket} {
			dial := func(tok []byte) error {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				cfg := *ccfg
				cfg.Token = tok
				var c *Conn
				var err error
				switch tr {
				case TransportUDP:
					c, err = Dial(ctx, "udp", sock.String(), &cfg)
				case TransportTCP:
					c, err = Dial(ctx, "tcp", sock.String(), &cfg)
				default:
					c, err = DialWebSocket(ctx, ws, &cfg)
				}
				if err == nil {
					assert.Equal(t, tr, c.Transport())
					c.Close()
				}
				return err
			}
			assert.NoError(t, dial(issue(t, key, sampleToken(want))), "public %v, %v: a token naming %v", public, tr, want)
			for _, a := range others {
				err := dial(issue(t, key, sampleToken(a)))
				assert.ErrorIs(t, err, ErrTokenRejected, "public %v, %v: a token naming %v", public, tr, a)
				if err != nil {
					assert.Contains(t, err.Error(), "not for this server")
				}
			}
		}
		require.NoError(t, l.Close())
	}
}
