//go:build !js

package knet

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"math"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/netsim"
)

// Close codes (CloseWithError, #37 point 8): a knet peer's Err is a
// *DisconnectError with the closer's code and reason, over every
// transport, plaintext and secure, whichever side closes; CloseWithReason
// is code 0 and puts on the wire what it always did; the reference
// dialect carries neither. (On main these tests do not compile: neither
// CloseWithError nor DisconnectError.Code exists there.)

// ccCase is one close: by CloseWithReason when reason is the point,
// else by CloseWithError; want is what the peer's DisconnectError holds.
type ccCase struct {
	name       string
	withReason bool // CloseWithReason(reason)
	start      bool // StartCloseWithError, then wait for Done
	code       uint32
	reason     string
	want       DisconnectError
}

var ccCases = []ccCase{
	{name: "code", code: 403, reason: "banned until Tuesday", want: DisconnectError{Code: 403, Reason: "banned until Tuesday"}},
	{name: "CloseWithReason", withReason: true, reason: "kicked: spamming chat", want: DisconnectError{Reason: "kicked: spamming chat"}},
	// 300 bytes, cut to MaxReasonLength at a rune boundary: the code
	// still comes, all four bytes of it.
	{name: "longest-reason", code: math.MaxUint32, reason: strings.Repeat("é", 150), want: DisconnectError{Code: math.MaxUint32, Reason: strings.Repeat("é", MaxReasonLength/2)}},
	{name: "code-alone", code: 7, want: DisconnectError{Code: 7}},
	{name: "StartCloseWithError", start: true, code: 4, reason: "kicked: no input", want: DisconnectError{Code: 4, Reason: "kicked: no input"}},
}

// ccListener listens for tr, secure or not, and returns how to dial it
// and the client's Config.
func ccListener(t *testing.T, tr Transport, secure bool) (l *Listener, dial func(context.Context) (*Conn, error)) {
	scfg, ccfg := testConfig(), testConfig()
	if secure {
		scfg, ccfg = secureConfigs(t)
	}
	scfg.TCP = tr == TransportTCP
	l = listen(t, scfg)
	t.Cleanup(func() { l.Close() })
	switch tr {
	case TransportUDP:
		return l, func(ctx context.Context) (*Conn, error) { return Dial(ctx, "udp", l.Addr().String(), ccfg) }
	case TransportTCP:
		return l, func(ctx context.Context) (*Conn, error) { return Dial(ctx, "tcp", l.Addr().String(), ccfg) }
	default:
		url := wsServer(t, l)
		return l, func(ctx context.Context) (*Conn, error) { return DialWebSocket(ctx, url, ccfg) }
	}
}

// ccConnect dials l and returns both ends.
func ccConnect(t *testing.T, l *Listener, dial func(context.Context) (*Conn, error)) (c, sc *Conn) {
	ctx := within(t, 10*time.Second)
	accepted := make(chan *Conn, 1)
	go func() {
		sc, err := l.AcceptConn(ctx)
		if err == nil {
			accepted <- sc
		}
		close(accepted)
	}()
	c, err := dial(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	sc = <-accepted
	require.NotNil(t, sc, "the listener accepted nothing")
	t.Cleanup(func() { sc.Close() })
	return c, sc
}

// ccClose closes closer as tc says, waits for peer's end, and returns
// peer's Err; the closer's close is graceful.
func ccClose(t *testing.T, tc ccCase, closer, peer *Conn) error {
	closed := make(chan error, 1)
	go func() {
		switch {
		case tc.withReason:
			closed <- closer.CloseWithReason(tc.reason)
		case tc.start:
			closer.StartCloseWithError(tc.code, tc.reason)
			<-closer.Done()
			closed <- nil
		default:
			closed <- closer.CloseWithError(tc.code, tc.reason)
		}
	}()
	select {
	case <-peer.Done():
	case <-within(t, 10*time.Second).Done():
		t.Fatal("the peer did not end")
	}
	select {
	case err := <-closed:
		assert.NoError(t, err, "the close is graceful")
	case <-within(t, 10*time.Second).Done():
		t.Fatal("the closer's close did not return")
	}
	return peer.Err()
}

func TestCloseWithErrorEveryTransport(t *testing.T) {
	t.Parallel()
	for _, tr := range []Transport{TransportUDP, TransportTCP, TransportWebSocket} {
		for _, secure := range []bool{false, true} {
			name := tr.String()
			if secure {
				name += "-secure"
			}
			t.Run(name, func(t *testing.T) {
				l, dial := ccListener(t, tr, secure)
				for _, server := range []bool{true, false} {
					for _, tc := range ccCases {
						dir := "client-closes"
						if server {
							dir = "server-closes"
						}
						t.Run(dir+"/"+tc.name, func(t *testing.T) {
							c, sc := ccConnect(t, l, dial)
							require.Equal(t, secure, c.Secure())
							require.Equal(t, tr, c.Transport())
							closer, peer := c, sc
							if server {
								closer, peer = sc, c
							}
							err := ccClose(t, tc, closer, peer)
							var de *DisconnectError
							require.True(t, errors.As(err, &de), "%v %T", err, err)
							assert.Equal(t, tc.want, *de)
							assert.ErrorIs(t, err, ErrPeerClosed)
							assert.ErrorIs(t, err, net.ErrClosed)
						})
					}
				}
			})
		}
	}
}

// The reference dialect carries neither code nor reason, over UDP and
// TCP (it has no WebSocket): its peer ends with ErrPeerClosed, as after
// CloseWithReason.
func TestCloseWithErrorReferenceDialect(t *testing.T) {
	for _, tr := range []Transport{TransportUDP, TransportTCP} {
		t.Run(tr.String(), func(t *testing.T) {
			scfg, ccfg := testConfig(), testConfig()
			scfg.TCP = tr == TransportTCP
			ccfg.Dialect = DialectReference
			l := listen(t, scfg)
			t.Cleanup(func() { l.Close() })
			network := "udp"
			if tr == TransportTCP {
				network = "tcp"
			}
			dial := func(ctx context.Context) (*Conn, error) { return Dial(ctx, network, l.Addr().String(), ccfg) }
			for _, server := range []bool{true, false} {
				name := "client-closes"
				if server {
					name = "server-closes"
				}
				t.Run(name, func(t *testing.T) {
					c, sc := ccConnect(t, l, dial)
					require.Equal(t, DialectReference, sc.Dialect())
					closer, peer := c, sc
					if server {
						closer, peer = sc, c
					}
					err := ccClose(t, ccCases[0], closer, peer)
					assert.Equal(t, ErrPeerClosed, err, "what a reference peer's close gives: %v", err)
				})
			}
		})
	}
}

// On the UDP wire (spec dialect): code 0 sends the Disconnect's datagram
// as it always was, the Disconnect alone with the reason; another code
// goes just before it, as a message of ID 5 (kind 4, the code u32
// little-endian), which a peer reading only the specification ignores,
// and a knet peer reads.
func TestCloseCodeWire(t *testing.T) {
	assert.Equal(t, "06000504efbeadde", hex.EncodeToString(appendCloseCode(nil, 0xdeadbeef)), "the close code's message block")
	for _, tc := range []struct {
		name   string
		code   uint32
		secure bool
	}{{"code0", 0, false}, {"code", 0xdeadbeef, false}, {"code-secure", 0xdeadbeef, true}} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := &Config{DisconnectTimeout: 3 * time.Second}
			scfg := *cfg
			link := netsim.Params{Delay: time.Millisecond}
			var p *simPair
			if tc.secure {
				p = newSecureSimPair(t, cfg, &scfg, link, link)
			} else {
				p = newSimPair(t, cfg, &scfg, link, link)
			}
			p.connect()
			var disc [][]byte // the server's Disconnect datagrams
			see := func(from int, b []byte) bool {
				d, _, err := parseDatagram(b)
				if err == nil && from == 1 && len(d.msgs) > 0 && d.msgs[len(d.msgs)-1].id == idDisconnect {
					disc = append(disc, bytes.Clone(b))
				}
				return false
			}
			if tc.secure {
				p.drop = see // sees the plaintext
			} else {
				p.tap = func(from int, b []byte) { see(from, b) }
			}
			s := p.server()
			s.closing.code, s.closing.reason = tc.code, []byte("kicked")
			s.requestClose(p.now)
			require.True(t, p.run(10*time.Second, func() bool { return p.client().done() && s.done() }))
			require.NotEmpty(t, disc)
			for _, b := range disc {
				d, _, err := parseDatagram(b)
				require.NoError(t, err)
				bye := appendMessage(nil, &message{id: idDisconnect, payload: []byte("kicked")})
				if tc.code == 0 {
					// Today's bytes: the header, the Disconnect.
					assert.Equal(t, hex.EncodeToString(append(appendHeader(nil, &d.header), bye...)), hex.EncodeToString(b))
				} else {
					assert.Equal(t, hex.EncodeToString(append(appendCloseCode(appendHeader(nil, &d.header), tc.code), bye...)), hex.EncodeToString(b))
				}
			}
			assert.Equal(t, tc.code, p.client().closing.peerCode)
			assert.Equal(t, "kicked", string(p.client().closing.peerReason))
		})
	}
}

// Over a stream, code 0 is the close hello (kind 4) it always was;
// another code is kind 7: the code, u32 little-endian, then the reason.
func TestCloseCodeStreamHello(t *testing.T) {
	var a, b streamSession
	a.sendClose(0, []byte("bye"))
	b.sendHello(helloClose, []byte("bye"))
	assert.Equal(t, hex.EncodeToString(b.ctrl), hex.EncodeToString(a.ctrl), "code 0: today's close hello")
	assert.Equal(t, "0a02006b4e540104627965", hex.EncodeToString(a.ctrl))

	var c streamSession
	c.sendClose(0x01020304, []byte("bye"))
	assert.Equal(t, "0e02006b4e54010704030201627965", hex.EncodeToString(c.ctrl))
	var peer streamSession
	kind, content, ok := parseStreamHello(c.ctrl[2:])
	require.True(t, ok)
	peer.hello(kind, content)
	assert.True(t, peer.peerClose)
	assert.Equal(t, uint32(0x01020304), peer.closeCode)
	assert.Equal(t, "bye", string(peer.closeWhy))

	// A kind 7 too short for its code is a close without one.
	var short streamSession
	short.hello(helloCloseCode, []byte{1, 2})
	assert.True(t, short.peerClose)
	assert.Zero(t, short.closeCode)
	assert.Empty(t, short.closeWhy)
}

// DrainWithError closes each connection as CloseWithError does: every
// player's DisconnectError holds the code, over every transport.
func TestDrainWithErrorCarriesCode(t *testing.T) {
	for _, tr := range []Transport{TransportUDP, TransportTCP, TransportWebSocket} {
		for _, secure := range []bool{false, true} {
			name := tr.String()
			if secure {
				name += "-secure"
			}
			t.Run(name, func(t *testing.T) {
				l, dial := ccListener(t, tr, secure)
				c, _ := ccConnect(t, l, dial)
				require.NoError(t, l.DrainWithError(within(t, 10*time.Second), 4001, "server shutting down: rejoin"))
				select {
				case <-c.Done():
				case <-within(t, 10*time.Second).Done():
					t.Fatal("the player did not end")
				}
				var de *DisconnectError
				require.True(t, errors.As(c.Err(), &de), "%v %T", c.Err(), c.Err())
				assert.Equal(t, DisconnectError{Code: 4001, Reason: "server shutting down: rejoin"}, *de)
			})
		}
	}
}
