package knet

import (
	"errors"
	"sort"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// End-to-end tests of the Disconnect/DisconnectAck exchange.

// endedByExchange fails the test if c's close ended by DisconnectTimeout
// rather than by the Disconnect/DisconnectAck exchange.
func endedByExchange(t testing.TB, c *Conn, who string) {
	t.Helper()
	var te *TimeoutError
	if errors.As(c.Err(), &te) {
		t.Errorf("%s: close ended by the timeout (%v), not by a DisconnectAck; %d datagrams sent", who, c.Err(), c.Stats().DatagramsSent)
	}
}

func TestCloseAgainstLossyServerEndsByDisconnectAck(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		// The server loses 30% of what it sends, DisconnectAcks included, and
		// its application closes each connection on io.EOF, forgetting it. A
		// client whose DisconnectAck was lost resends its Disconnect (backed
		// off) and the listener answers statelessly: every Close ends by the
		// exchange, none by the DisconnectTimeout (before: 8-16 of 30, each
		// resending ~110 Disconnects a second for the whole 3s).
		const timeout = 3 * time.Second
		srv := &Config{DisconnectTimeout: timeout, Simulate: &Simulation{Loss: 0.3, Seed: 9}}
		l := nw.listen(t, srv)
		serveEcho(t, l)
		var mu sync.Mutex
		var took []time.Duration
		var wg sync.WaitGroup
		for i := range 30 {
			wg.Go(func() {
				c, err := nw.Dial(within(t, 20*time.Second), l.Addr().String(),
					&Config{DisconnectTimeout: timeout, ConnectTimeout: 10 * time.Second})
				if err != nil {
					t.Error(err)
					return
				}
				defer c.Close()
				// One echo first, so that the close has data to get
				// acked before its Disconnect.
				if err := c.Send(numbered(7, i, 10)); err != nil {
					t.Error(err)
					return
				}
				if _, err := c.Receive(within(t, 10*time.Second)); err != nil {
					t.Error(err)
					return
				}
				before := c.Stats().DatagramsSent
				start := time.Now()
				c.Close()
				d := time.Since(start)
				endedByExchange(t, c, "client")
				sent := c.Stats().DatagramsSent - before
				// A close that timed out used to send ~330; now a few
				// probes and backed-off Disconnects at most.
				assert.LessOrEqual(t, sent, uint64(40), "datagrams sent while closing, in %v", d)
				mu.Lock()
				took = append(took, d)
				mu.Unlock()
			})
		}
		wg.Wait()
		sort.Slice(took, func(i, j int) bool { return took[i] < took[j] })
		t.Logf("close times: %v; listener %+v", took, l.Stats())
	})
}

func TestSimultaneousCloseOverSimulatedDelay(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		// Both ends close at the same moment, each with 1ms of simulated
		// delay. The side that answers first used to close its socket, and its
		// simulated network dropped the DisconnectAck in flight; the other
		// side then waited out the whole DisconnectTimeout, every time.
		for round := range 5 {
			cfg := func() *Config {
				c := testConfig()
				c.Simulate = &Simulation{Delay: time.Millisecond, Seed: uint64(round)}
				return c
			}
			l := nw.listen(t, cfg())
			accepted := make(chan *Conn, 1)
			go func() {
				c, err := l.AcceptConn(within(t, 10*time.Second))
				if err == nil {
					accepted <- c
				}
				close(accepted)
			}()
			c := nw.dial(t, l.Addr().String(), cfg())
			s, ok := <-accepted
			require.True(t, ok, "no connection accepted")
			var wg sync.WaitGroup
			start := time.Now()
			wg.Go(func() { c.Close() })
			wg.Go(func() { s.Close() })
			wg.Wait()
			t.Logf("round %d: both closed in %v", round, time.Since(start))
			endedByExchange(t, c, "client")
			endedByExchange(t, s, "server")
			l.Close()
		}
	})
}

// readOne reads the next datagram, waiting at most 5s.
func readOne(t testing.TB, c rawConn) []byte {
	t.Helper()
	buf := make([]byte, 2048)
	require.NoError(t, c.SetReadDeadline(time.Now().Add(5*time.Second)))
	n, err := c.Read(buf)
	require.NoError(t, err, "no answer")
	return buf[:n]
}

func disconnectDatagram(pid uint32, inOrder bool) []byte {
	return appendDatagram(nil, &datagram{header: header{packetID: pid, inOrder: inOrder}, msgs: []message{{id: idDisconnect}}})
}

func TestStatelessDisconnectAck(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		raw := nw.rawSocket(t, l.Addr())

		// A Disconnect from an endpoint the listener does not know, as our
		// sessions send it (InOrder, once the connection was open) and
		// without the flag: one DisconnectAck each, no larger, same flag.
		for _, inOrder := range []bool{true, false} {
			in := disconnectDatagram(77, inOrder)
			_, err := raw.Write(in)
			require.NoError(t, err)
			out := readOne(t, raw)
			assert.LessOrEqual(t, len(out), len(in), "never more bytes than it carried")
			d, _, err := parseDatagram(out)
			require.NoError(t, err)
			require.Len(t, d.msgs, 1)
			assert.Equal(t, uint32(idDisconnectAck), d.msgs[0].id)
			assert.Equal(t, inOrder, d.inOrder)
			assert.False(t, d.reliable)
			assert.Empty(t, d.deltas)
		}

		// Nothing else gets an answer: odd and malformed datagrams, a
		// DisconnectAck (no loops), a Disconnect cut short or in a fragment.
		// The probe after them, a Disconnect without the InOrder flag, must
		// be answered first: had any of them been answered, that answer
		// would come before it (the path keeps the order, and the reader
		// answers as it reads).
		full := disconnectDatagram(78, true)
		for _, b := range [][]byte{
			{},
			{0},
			{0, 0, 0},
			{0, 0, 0x80},
			full[:len(full)-1],
			appendDatagram(nil, &datagram{header: header{packetID: 5, inOrder: true}, msgs: []message{{id: idDisconnectAck}}}),
			appendDatagram(nil, &datagram{header: header{packetID: 6}, msgs: []message{{id: idDisconnectAck}}}),
			appendDatagram(nil, &datagram{header: header{packetID: 7, reliable: true}, msgs: []message{{fragment: true, fragNumber: 1, payload: []byte{0xff, 0xff, 0xff, 0xff}}}}),
			appendDatagram(nil, &datagram{header: header{packetID: 8}, msgs: []message{{id: idPingRequest, payload: []byte{1}}}}),
		} {
			_, err := raw.Write(b)
			require.NoError(t, err)
		}
		probe := disconnectDatagram(79, false)
		_, err := raw.Write(probe)
		require.NoError(t, err)
		out := readOne(t, raw)
		assert.Equal(t, appendDatagram(nil, &datagram{msgs: []message{{id: idDisconnectAck}}}), out,
			"the first answer is the probe's")
		assert.Equal(t, len(probe), len(out))

		// A stealth listener says nothing: the first answer is to the
		// ConnectSyn sent after the Disconnect.
		sl := nw.listen(t, &Config{Stealth: true, DisconnectTimeout: 200 * time.Millisecond, ConnectTimeout: 200 * time.Millisecond})
		sraw := nw.rawSocket(t, sl.Addr())
		_, err = sraw.Write(disconnectDatagram(1, true))
		require.NoError(t, err)
		syn := appendPadding(appendDatagram(nil, &datagram{header: header{packetID: 2}, msgs: []message{{id: idConnectSyn}}}), synPadTo)
		_, err = sraw.Write(syn)
		require.NoError(t, err)
		d, _, err := parseDatagram(readOne(t, sraw))
		require.NoError(t, err)
		require.NotEmpty(t, d.msgs)
		assert.Equal(t, uint32(idConnectSynAck), d.msgs[0].id)
		assert.Positive(t, sl.Stats().StrayDatagrams)
	})
}

func FuzzDisconnectAnswer(f *testing.F) {
	f.Add(disconnectDatagram(1, true))
	f.Add(disconnectDatagram(2, false))
	f.Add(appendDatagram(nil, &datagram{header: header{packetID: 3, inOrder: true, deltas: []uint16{1}, indices: []uint16{0}},
		msgs: []message{{id: 6, payload: []byte("x")}, {id: idDisconnect, order: 1}}}))
	for _, b := range fuzzSeeds(1) {
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		a := disconnectAnswer(nil, b)
		if a == nil {
			return
		}
		// Never more bytes than came in, and only ever a lone
		// DisconnectAck, which is itself never answered.
		require.LessOrEqual(t, len(a), len(b))
		d, _, err := parseDatagram(a)
		require.NoError(t, err)
		require.Len(t, d.msgs, 1)
		require.Equal(t, uint32(idDisconnectAck), d.msgs[0].id)
		require.Nil(t, disconnectAnswer(nil, a))
		in, _, err := parseDatagram(b)
		require.NoError(t, err, "only a well-formed datagram is answered")
		require.Equal(t, in.inOrder, d.inOrder)
	})
}
