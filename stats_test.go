package knet

import (
	"errors"
	"net"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"
)

// The rate ring keeps the message and PacketID counters in their low 32
// bits: rates across the wrap are still right, and rates fall when the
// traffic stops.
func TestRateRingAcrossWrap(t *testing.T) {
	var r rateRing
	t0 := time.Now()
	st := Stats{BytesSent: 1 << 40, MessagesSent: 1<<32 - 50, MessagesReceived: 7}
	r.note(t0, &st, 1<<32-10, 1<<32-10)
	for k := 1; k <= 8; k++ {
		st.BytesSent += 1000
		st.MessagesSent += 25
		r.note(t0.Add(time.Duration(k)*rateStep), &st, 1<<32-10+uint64(k)*10, 1<<32-10+uint64(k)*9)
	}
	var got Stats
	r.fill(t0.Add(2*time.Second), &got)
	require.InDelta(t, 4000, got.SendBytesPerSecond, 1e-6)
	require.InDelta(t, 100, got.SendMessagesPerSecond, 1e-6)
	require.Zero(t, got.ReceiveMessagesPerSecond)
	require.InDelta(t, 0.1, got.LossRate, 1e-9)

	// Two seconds of silence: the window starts at the last note.
	var quiet Stats
	r.note(t0.Add(4*time.Second), &st, 1<<32-10+80, 1<<32-10+72)
	r.fill(t0.Add(4*time.Second+time.Second), &quiet)
	require.Less(t, quiet.SendBytesPerSecond, got.SendBytesPerSecond)
}

// A connection publishes its counters only once Stats is asked for them:
// until then its rounds skip the work and it holds no copy. The first call
// still sees everything so far, and a call after the end returns the
// final counters at once.
func TestStatsPublishedOnceAsked(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		serveEcho(t, l)
		c := nw.dial(t, l.Addr().String(), testConfig())
		ctx := within(t, 10*time.Second)
		const n = 20
		for i := range n {
			require.NoError(t, c.Send(Message{ID: 100, Payload: []byte{byte(i)}, Reliable: true, InOrder: true}))
			_, err := c.Receive(ctx)
			require.NoError(t, err)
		}
		time.Sleep(500 * time.Millisecond) // the bubble's clock: a life to average over
		c.state.mu.Lock()
		require.Nil(t, c.state.pub, "published before asked")
		c.state.mu.Unlock()
		require.False(t, c.state.watched.Load())

		st := c.Stats()
		require.Equal(t, uint64(n), st.MessagesSent)
		require.Equal(t, uint64(n), st.MessagesReceived)
		require.InDelta(t, n/0.5, st.SendMessagesPerSecond, n/0.5*0.1, "the first window is the connection's life")
		require.True(t, c.state.watched.Load())

		require.NoError(t, c.Send(Message{ID: 100, Payload: []byte{1}, Reliable: true, InOrder: true}))
		_, err := c.Receive(ctx)
		require.NoError(t, err)
		require.Equal(t, uint64(n+1), c.Stats().MessagesSent, "later rounds publish")

		// A connection never asked: the end publishes for a late call.
		c2 := nw.dial(t, l.Addr().String(), testConfig())
		require.NoError(t, c2.Send(Message{ID: 100, Payload: []byte{2}, Reliable: true}))
		_, err = c2.Receive(ctx)
		require.NoError(t, err)
		require.NoError(t, c2.Close())
		<-c2.Done()
		require.Equal(t, uint64(1), c2.Stats().MessagesReceived)
	})
}

// ListenerStats.Established counts the handshakes that completed, not the
// attempts: a refused one is not in it, and a connection that ended stays
// counted.
func TestListenerStatsEstablished(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		cfg := testConfig()
		cfg.Admit = func(_ net.Addr, payload []byte) ([]byte, error) {
			if string(payload) == "stranger" {
				return nil, errors.New("go away")
			}
			return nil, nil
		}
		l := nw.listen(t, cfg)
		ctx := within(t, 10*time.Second)
		for range 2 {
			nw.dial(t, l.Addr().String(), testConfig())
			c, err := l.AcceptConn(ctx)
			require.NoError(t, err)
			require.NoError(t, c.Close())
		}
		_, err := nw.Dial(ctx, l.Addr().String(), &Config{ConnectPayload: []byte("stranger")})
		require.ErrorIs(t, err, ErrRefused)
		synctest.Wait() // the counts after the accepts are in
		st := l.Stats()
		require.Equal(t, uint64(2), st.Established)
		require.Equal(t, uint64(1), st.RefusedAttempts)
	})
}
