package knet

import (
	"context"
	"errors"
	"net"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The Admit hook's error reaches the refused client, still ErrRefused; a
// stealthy server says nothing.
func TestRefusalCarriesReason(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		cfg := testConfig()
		cfg.Admit = func(net.Addr, []byte) ([]byte, error) { return nil, errors.New("banned until Tuesday") }
		l := nw.listen(t, cfg)
		_, err := nw.Dial(context.Background(), l.Addr().String(), testConfig())
		require.ErrorIs(t, err, ErrRefused)
		var re *RefusedError
		require.True(t, errors.As(err, &re), "%v", err)
		assert.Equal(t, "banned until Tuesday", re.Reason)

		cfg.Stealth = true
		l = nw.listen(t, cfg)
		cc := testConfig()
		cc.ConnectTimeout = 300 * time.Millisecond
		_, err = nw.Dial(context.Background(), l.Addr().String(), cc)
		var te *TimeoutError
		assert.True(t, errors.As(err, &te), "a stealthy server answers nothing: %v", err)
	})
}

// A kick's reason reaches the peer: Receive ends with io.EOF, Err and
// Send say why, still ErrPeerClosed; Close on the kicking side is nil.
func TestCloseWithReason(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		accepted := make(chan *Conn, 1)
		go func() {
			c, err := l.AcceptConn(context.Background())
			if err == nil {
				accepted <- c
			}
		}()
		c := nw.dial(t, l.Addr().String(), testConfig())
		sc := <-accepted
		require.NoError(t, sc.Send(Message{ID: 100, Reliable: true, Payload: []byte("last words")}))
		require.NoError(t, sc.CloseWithReason("kicked: spamming chat"))
		m, err := c.Receive(within(t, 5*time.Second))
		require.NoError(t, err)
		assert.Equal(t, "last words", string(m.Payload), "what was sent before comes first")
		_, err = c.Receive(within(t, 5*time.Second))
		require.Equal(t, err.Error(), "EOF")
		<-c.Done()
		var de *DisconnectError
		require.True(t, errors.As(c.Err(), &de), "%v %T", c.Err(), c.Err())
		assert.Equal(t, "kicked: spamming chat", de.Reason)
		assert.ErrorIs(t, c.Err(), ErrPeerClosed)
		assert.ErrorIs(t, c.Err(), net.ErrClosed)
		assert.NoError(t, c.Close(), "a close by the peer is graceful")
	})
}

// AdmitConn decides who the player is while admitting: the data it sets
// is on the connection the game gets.
func TestAdmitConnSetsUserData(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		type player struct{ name string }
		g := NewGroup()
		cfg := testConfig()
		cfg.Group = g
		cfg.AdmitConn = func(c *Conn, payload []byte) ([]byte, error) {
			if string(payload) == "" {
				return nil, errors.New("no join token")
			}
			c.SetUserData(&player{name: string(payload)})
			return []byte("welcome"), nil
		}
		l := nw.listen(t, cfg)
		_, err := nw.Dial(context.Background(), l.Addr().String(), testConfig())
		var re *RefusedError
		require.True(t, errors.As(err, &re))
		assert.Equal(t, "no join token", re.Reason)

		cc := testConfig()
		cc.ConnectPayload = []byte("alice")
		c := nw.dial(t, l.Addr().String(), cc)
		_, synAck := c.Handshake()
		assert.Equal(t, "welcome", string(synAck))
		events := make([]Event, 4)
		require.NoError(t, g.Wait(within(t, 5*time.Second)))
		require.Equal(t, 1, g.Poll(events))
		require.Equal(t, EventConnected, events[0].Kind)
		p, ok := events[0].Conn.UserData().(*player)
		require.True(t, ok)
		assert.Equal(t, "alice", p.name)
		assert.Nil(t, c.UserData())
	})
}
