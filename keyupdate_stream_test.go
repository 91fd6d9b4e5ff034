//go:build !js

package knet

import (
	"bytes"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestKeyUpdateStream: a secure TCP or WebSocket connection whose ends
// update their keys after every frame (KeyUpdateInterval 1) carries 2,000
// echoed messages: every one comes back in order and intact, each side
// made thousands of updates both ways, and the nonce ledger finds no
// frame number sealed twice under one key with different plaintexts.
func TestKeyUpdateStream(t *testing.T) {
	for _, tr := range []Transport{TransportTCP, TransportWebSocket} {
		t.Run(tr.String(), func(t *testing.T) {
			scfg, ccfg, ledger := secureTCPConfigs(t)
			scfg.KeyUpdateInterval, ccfg.KeyUpdateInterval = 1, 1
			l := listen(t, scfg)
			serveEcho(t, l)
			ctx := within(t, 60*time.Second)
			var c *Conn
			var err error
			if tr == TransportTCP {
				c, err = Dial(ctx, "tcp", l.Addr().String(), ccfg)
			} else {
				c, err = DialWebSocket(ctx, wsServer(t, l), ccfg)
			}
			require.NoError(t, err)
			require.Equal(t, tr, c.Transport())
			const n = 2000
			go func() {
				for i := range n {
					if c.Send(Message{ID: 100, Payload: fmt.Appendf(nil, "m%05d", i), Reliable: true, InOrder: true}) != nil {
						return
					}
				}
			}()
			for i := range n {
				m, err := c.Receive(ctx)
				require.NoError(t, err, "message %d; client %+v", i, c.Stats())
				require.Equal(t, fmt.Sprintf("m%05d", i), string(m.Payload))
			}
			require.NoError(t, c.Close())
			waitDone(t, c, 15*time.Second)
			// About one update a frame each way: the client's 2,000 and
			// the server's 2,000 (Stats once the connection is done: all
			// published).
			st := c.Stats()
			assert.Greater(t, st.KeyUpdates, uint64(n), "stats %+v", st)
			keys, sealed := ledger.keys()
			assert.Greater(t, keys, 2*n, "%d frames sealed", sealed)
		})
	}
}

// TestKeyUpdateStreamOldPeer: against a side with key updates off (as a
// peer of before them: it never announces them and drops the
// announcement, a hello of a kind it does not know), a side that wants an
// update after every frame makes none, and the connection works.
func TestKeyUpdateStreamOldPeer(t *testing.T) {
	for _, old := range []string{"client", "server"} {
		t.Run(old, func(t *testing.T) {
			scfg, ccfg, ledger := secureTCPConfigs(t)
			scfg.KeyUpdateInterval, ccfg.KeyUpdateInterval = 1, 1
			if old == "client" {
				ccfg.KeyUpdateInterval = -1
			} else {
				scfg.KeyUpdateInterval = -1
			}
			l := listen(t, scfg)
			serveEcho(t, l)
			ctx := within(t, 30*time.Second)
			c, err := Dial(ctx, "tcp", l.Addr().String(), ccfg)
			require.NoError(t, err)
			for i := range 200 {
				m := echoOnce(t, c, Message{ID: 100, Payload: fmt.Appendf(nil, "m%05d", i), Reliable: true})
				require.Equal(t, fmt.Sprintf("m%05d", i), string(m.Payload))
			}
			assert.Zero(t, c.Stats().KeyUpdates)
			require.NoError(t, c.Close())
			waitDone(t, c, 15*time.Second)
			keys, _ := ledger.keys()
			assert.Equal(t, 2, keys, "one key each way")
		})
	}
}

// TestKeyUpdateStreamAttackReplayAcrossUpdate: a relay that replays, after
// a few key updates, a frame of the client's sealed under an earlier key:
// it opens under no key (nor nonce) the server holds, and the connection
// ends at it with a *ProtocolError, having delivered exactly the messages
// before it.
func TestKeyUpdateStreamAttackReplayAcrossUpdate(t *testing.T) {
	var early []byte
	up := func(i int, f []byte) [][]byte {
		switch {
		case i == 0 || !appFrame(f):
		case early == nil:
			early = bytes.Clone(f)
		case i >= 12:
			return [][]byte{f, early}
		}
		return [][]byte{f}
	}
	scfg, ccfg, _ := secureTCPConfigs(t)
	scfg.KeyUpdateInterval, ccfg.KeyUpdateInterval = 1, 1
	l := listen(t, scfg)
	r := newTCPRelay(t, l.Addr().String(), up, nil)
	ctx := within(t, 20*time.Second)
	c, err := Dial(ctx, "tcp", r.Addr(), ccfg)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	sc, err := l.AcceptConn(ctx)
	require.NoError(t, err)
	got := 0
	for i := range 20 {
		require.NoError(t, c.Send(Message{ID: 100, Payload: append(bytes.Repeat([]byte{'p'}, 40), byte(i)), Reliable: true}))
		if _, err := sc.Receive(ctx); err != nil {
			break
		}
		got++
	}
	waitDone(t, sc, 15*time.Second)
	var pe *ProtocolError
	require.ErrorAs(t, sc.Err(), &pe)
	assert.ErrorIs(t, sc.Err(), errStreamOpen)
	assert.Less(t, got, 20, "the replay ends the connection")
	assert.Positive(t, sc.Stats().KeyUpdates, "keys changed before the replay")
}

// TestKeyUpdateStreamAttackTooFast: the rules a stream receiver holds a
// sealed key update signal to. A signal right after another, with no
// frame in between (a peer updating faster than any interval), and a
// signal from a peer to which we announced no key updates both end the
// connection (the frames after it could not be read): each the peer's
// doing, and counted. A signal in clear, before the keys, is ignored.
func TestKeyUpdateStreamAttackTooFast(t *testing.T) {
	_, ss := securePair(t)
	ss.ku = newKeyUpdates(&config{keyUpdatePackets: 1})
	ss.ku.start([32]byte{1}, [32]byte{2})
	s := newStreamSession(nil, 1<<20, time.Minute, time.Now())
	s.pathHello([]byte{pathKeyUpdate})
	require.NoError(t, s.err, "in clear: ignored")
	s.startSealing(ss)
	s.seal.recvN = 5
	s.pathHello([]byte{pathKeyUpdate})
	require.NoError(t, s.err)
	require.Equal(t, uint64(1), ss.ku.recvPhase)
	s.seal.recvN = 7 // a frame in between
	s.pathHello([]byte{pathKeyUpdate})
	require.NoError(t, s.err)
	require.Equal(t, uint64(2), ss.ku.recvPhase)
	s.seal.recvN = 8 // right after
	s.pathHello([]byte{pathKeyUpdate})
	assert.ErrorIs(t, s.err, errKeyUpdateTooFast)
	assert.Equal(t, uint64(2), ss.ku.recvPhase)
	assert.Equal(t, uint64(1), ss.ku.tooFast)
	assert.Equal(t, uint64(1), s.stats.ProtocolErrors)

	_, old := securePair(t) // no key updates
	s = newStreamSession(nil, 1<<20, time.Minute, time.Now())
	s.startSealing(old)
	s.seal.recvN = 3
	s.pathHello([]byte{pathKeyUpdate})
	var pe *ProtocolError
	assert.ErrorAs(t, s.err, &pe)
}

// TestKeyUpdateUDPLoopback: the same over real UDP sockets: a connection
// whose ends update their keys after every acked datagram echoes 300
// messages one at a time, then 2,000 at once: every one comes back, in
// order, with updates both ways, nothing invalid, no nonce reused.
func TestKeyUpdateUDPLoopback(t *testing.T) {
	scfg, ccfg := secureConfigs(t)
	scfg.KeyUpdateInterval, ccfg.KeyUpdateInterval = 1, 1
	l := listen(t, scfg)
	serveEcho(t, l)
	ctx := within(t, 60*time.Second)
	c, err := Dial(ctx, "udp", l.Addr().String(), ccfg)
	require.NoError(t, err)
	for i := range 300 {
		m := echoOnce(t, c, Message{ID: 100, Payload: fmt.Appendf(nil, "m%05d", i), Reliable: true})
		require.Equal(t, fmt.Sprintf("m%05d", i), string(m.Payload))
	}
	const n = 2000
	go func() {
		for i := range n {
			if c.Send(Message{ID: 100, Payload: fmt.Appendf(nil, "b%05d", i), Reliable: true, InOrder: true}) != nil {
				return
			}
		}
	}()
	for i := range n {
		m, err := c.Receive(ctx)
		require.NoError(t, err)
		require.Equal(t, fmt.Sprintf("b%05d", i), string(m.Payload))
	}
	st := c.Stats()
	require.NoError(t, c.Close())
	waitDone(t, c, 15*time.Second)
	assert.Greater(t, st.KeyUpdates, uint64(300), "stats %+v", st)
	assert.Zero(t, st.InvalidDatagrams)
}
