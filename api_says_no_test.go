package knet

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Issue 37, "An API that says no": each misuse of the API is an error,
// never a silent wrong result.

// A Ref names its connection: in another connection's DependsOn it is
// ErrBadDependency, even where that connection has sent as many messages.
func TestAPIForeignRef(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		serveEcho(t, l)
		a := nw.dial(t, l.Addr().String(), testConfig())
		b := nw.dial(t, l.Addr().String(), testConfig())
		ra, err := a.SendRef(Message{ID: 6, Reliable: true})
		require.NoError(t, err)
		rb, err := b.SendRef(Message{ID: 6, Reliable: true})
		require.NoError(t, err)
		assert.ErrorIs(t, b.Send(Message{ID: 6, Reliable: true, DependsOn: []Ref{ra}}), ErrBadDependency)
		_, err = b.SendRef(Message{ID: 6, DependsOn: []Ref{ra}})
		assert.ErrorIs(t, err, ErrBadDependency)
		assert.ErrorIs(t, b.TrySend(Message{ID: 6, DependsOn: []Ref{rb, ra}}), ErrBadDependency)
		assert.NoError(t, b.Send(Message{ID: 6, Reliable: true, DependsOn: []Ref{rb}}), "its own Ref")
		assert.NoError(t, a.Send(Message{ID: 6, Reliable: true, DependsOn: []Ref{ra}}), "its own Ref")
	})
}

// Broadcast refuses a message with DependsOn: it sends it to no one,
// returns 0 and reports ErrBadDependency to miss for each connection.
func TestAPIBroadcastDependsOn(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		serveEcho(t, l)
		a := nw.dial(t, l.Addr().String(), testConfig())
		b := nw.dial(t, l.Addr().String(), testConfig())
		ra, err := a.SendRef(Message{ID: 6, Reliable: true})
		require.NoError(t, err)
		_, err = b.SendRef(Message{ID: 6, Reliable: true})
		require.NoError(t, err)
		missed := map[*Conn]error{}
		n := Broadcast([]*Conn{a, b}, Message{ID: 7, Reliable: true, DependsOn: []Ref{ra}}, func(c *Conn, err error) {
			missed[c] = err
		})
		assert.Zero(t, n)
		assert.ErrorIs(t, missed[a], ErrBadDependency)
		assert.ErrorIs(t, missed[b], ErrBadDependency)
		assert.Zero(t, Broadcast([]*Conn{a, b}, Message{ID: 7, DependsOn: []Ref{ra}}, nil), "nil miss")
		// Nothing of ID 7 was sent: the echo of a later message comes first.
		require.NoError(t, a.Send(Message{ID: 8, Reliable: true, InOrder: true}))
		ctx := within(t, 10*time.Second)
		for {
			m, err := a.Receive(ctx)
			require.NoError(t, err)
			require.NotEqual(t, uint32(7), m.ID)
			if m.ID == 8 {
				break
			}
		}
	})
}

// An unreliable message dropped for lack of room is ErrSendBufferFull from
// Send, SendContext and SendRef, as from TrySend.
func TestAPISendRefDropped(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		serveEcho(t, l)
		cfg := testConfig()
		cfg.SendBuffer = 8 << 10
		c := nw.dial(t, l.Addr().String(), cfg)
		payload := make([]byte, 1000)
		var err error
		for i := 0; err == nil; i++ {
			require.Less(t, i, 1000, "TrySend never found the buffer full")
			err = c.TrySend(Message{ID: 100, Reliable: true, Payload: payload})
		}
		require.ErrorIs(t, err, ErrSendBufferFull)
		ref, err := c.SendRef(Message{ID: 100, Payload: payload})
		assert.ErrorIs(t, err, ErrSendBufferFull, "SendRef")
		assert.Zero(t, ref)
		assert.ErrorIs(t, c.Send(Message{ID: 100, Payload: payload}), ErrSendBufferFull, "Send")
		assert.ErrorIs(t, c.SendContext(context.Background(), Message{ID: 100, Payload: payload}), ErrSendBufferFull, "SendContext")
		assert.ErrorIs(t, c.TrySend(Message{ID: 100, Payload: payload}), ErrSendBufferFull, "TrySend")
	})
}
