package knet

import (
	"context"
	"errors"
	"io"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A drain that finds a connection half made, the server's answer with the
// client and the client's proof of its address not yet with the server,
// waits for the proof, then closes that connection as it closes the others:
// the player, whose Dial returned and whose Send took a message, hears the
// drain's reason, and the server gets the message. Before, the drain
// ended the server's side without a word, and the player sent on to a
// server gone until its connection timed out (the fleet example lost a
// moving player's messages so, now and then, under load).
func TestDrainWaitsForHalfMadeConnection(t *testing.T) {
	for _, secure := range []bool{false, true} {
		t.Run(map[bool]string{false: "plaintext", true: "secure"}[secure], func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			scfg, ccfg := testConfig(), testConfig()
			scfg.ConnectTimeout, ccfg.DisconnectTimeout = 10*time.Second, 5*time.Second
			if secure {
				priv, pub, err := GenerateKey()
				require.NoError(t, err)
				scfg.PrivateKey, ccfg.ServerKey = priv, pub
			}
			l := listen(t, scfg)
			r := newAttackRelay(t, l.Addr())
			// Once the server has answered, the client's datagrams wait
			// at the relay: its proof among them.
			var answered atomic.Bool
			r.setRule(&r.down, func([]byte) relayFate { answered.Store(true); return relayPass })
			r.setRule(&r.up, func([]byte) relayFate {
				if answered.Load() {
					return relayHold
				}
				return relayPass
			})
			c, err := Dial(ctx, "udp", r.Addr(), ccfg)
			require.NoError(t, err)
			defer c.Close()
			require.NoError(t, c.Send(Message{ID: 100, Reliable: true, Payload: []byte("mine")}))

			var half *Conn
			l.mu.Lock()
			for p := range l.pending {
				half = p
			}
			l.mu.Unlock()
			require.NotNil(t, half, "the server's side, not yet established")

			drained := make(chan error, 1)
			go func() { drained <- l.Drain(ctx, "moving") }()
			// The drain closed it. A plaintext server's ConnectSynAck,
			// resent after that, shows that the connection lives on,
			// waiting for the proof; a secure server resends nothing, and
			// the client's next resend, held, marks a time by which the
			// server's round has long taken the close.
			select {
			case <-half.closed:
			case <-ctx.Done():
				t.Fatal("the drain did not close the half-made connection")
			}
			way := &r.down
			if secure {
				way = &r.up
			}
			r.mu.Lock()
			seen, changed := len(way.log), way.changed
			r.mu.Unlock()
			for resent := false; !resent; {
				select {
				case <-changed:
				case <-half.done:
					t.Fatalf("the server's side ended, before the proof: %v", half.Err())
				case <-ctx.Done():
					t.Fatal("nothing resent")
				}
				r.mu.Lock()
				resent, changed = len(way.log) > seen, way.changed
				r.mu.Unlock()
			}
			select {
			case <-half.done:
				t.Fatalf("the server's side ended, before the proof: %v", half.Err())
			default:
			}
			r.passAll()

			s, err := l.AcceptConn(ctx)
			require.NoError(t, err, "established after the proof")
			m, err := s.Receive(ctx)
			require.NoError(t, err)
			assert.Equal(t, "mine", string(m.Payload))
			_, err = c.Receive(ctx)
			assert.ErrorIs(t, err, io.EOF, "the player hears of the drain")
			<-c.Done()
			var de *DisconnectError
			require.True(t, errors.As(c.Err(), &de), "%v", c.Err())
			assert.Equal(t, "moving", de.Reason)
			assert.NoError(t, <-drained)
		})
	}
}
