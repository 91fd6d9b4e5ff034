package knet

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// knet talking to knet in the reference dialect: a Dial with
// DialectReference against a Listener detecting it. The reference peer
// itself is played by referencepeer_test.go; this pair checks what knet adds on
// both ends (ordering by reliable number, reassembly, retransmission under
// new PacketIDs) over clean and bad networks.

// cppWorkload is what the client sends: kind, ID and payload of each
// message, every payload tagged with its index.
type cppWorkItem struct {
	m    Message
	size int
}

func cppWorkload() []cppWorkItem {
	var w []cppWorkItem
	add := func(m Message, size int) { w = append(w, cppWorkItem{m, size}) }
	for range 20 {
		add(Message{ID: 10}, 40)
	}
	for range 20 {
		add(Message{ID: 11, Reliable: true}, 19)
	}
	for range 200 {
		add(Message{ID: 12, Reliable: true, InOrder: true}, 16)
	}
	add(Message{ID: 70000, Reliable: true, InOrder: true}, 100000)
	for _, id := range []uint32{127, 128, 16383, 16384} {
		add(Message{ID: id, Reliable: true, InOrder: true}, 8)
	}
	add(Message{ID: 50, Reliable: true, InOrder: true}, 0)
	add(Message{ID: 13, Reliable: true, InOrder: true}, 8) // the last: all echoes in
	return w
}

// cppPayload is message i's payload: its index, then a pattern.
func cppPayload(i, size int) []byte {
	p := make([]byte, size)
	if size >= 4 {
		binary.LittleEndian.PutUint32(p, uint32(i))
	}
	for k := 4; k < size; k++ {
		p[k] = byte(i*7 + k)
	}
	return p
}

func TestReferenceDialectPair(t *testing.T) {
	for _, tc := range []struct {
		name string
		sim  *Simulation
	}{
		{"clean", nil},
		{"loss5", &Simulation{Loss: 0.05, Delay: time.Millisecond}},
		{"loss5-reorder", &Simulation{Loss: 0.05, Reorder: 0.2, ReorderDelay: 4 * time.Millisecond, Delay: time.Millisecond}},
		{"bursty", &Simulation{Loss: 0.08, BurstLen: 4, Delay: 2 * time.Millisecond, Jitter: 3 * time.Millisecond}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			synctest.Test(t, func(t *testing.T) {
				nw := memNet(t)
				scfg := testConfig()
				ccfg := testConfig()
				ccfg.Dialect = DialectReference
				if tc.sim != nil {
					s1, s2 := *tc.sim, *tc.sim
					s1.Seed, s2.Seed = 1, 2
					scfg.Simulate, ccfg.Simulate = &s1, &s2
				}
				l := nw.listen(t, scfg)
				accepted := make(chan *Conn, 1)
				go func() {
					c, err := l.AcceptConn(context.Background())
					if err != nil {
						return
					}
					accepted <- c
					for {
						m, err := c.Receive(context.Background())
						if err != nil {
							return
						}
						if c.Send(m) != nil {
							return
						}
					}
				}()
				c := nw.dial(t, l.Addr().String(), ccfg)
				assert.Equal(t, DialectReference, c.Dialect())
				var sc *Conn
				select {
				case sc = <-accepted:
				case <-time.After(5 * time.Second):
					t.Fatal("the listener accepted nothing")
				}
				assert.Equal(t, DialectReference, sc.Dialect())
				syn, synAck := sc.Handshake()
				assert.Empty(t, syn)
				assert.Empty(t, synAck)

				work := cppWorkload()
				for i, w := range work {
					m := w.m
					m.Payload = cppPayload(i, w.size)
					require.NoError(t, c.Send(m))
				}
				ctx := within(t, 20*time.Second)
				lastOrdered := -1
				got := map[int]bool{}
				for {
					m, err := c.Receive(ctx)
					require.NoError(t, err, "echoes so far: %d", len(got))
					i := -1
					if len(m.Payload) >= 4 {
						i = int(binary.LittleEndian.Uint32(m.Payload))
					} else {
						for k, w := range work {
							if w.size == 0 && w.m.ID == m.ID {
								i = k
							}
						}
					}
					require.True(t, i >= 0 && i < len(work), "echo of no message sent: ID %d, %d bytes", m.ID, len(m.Payload))
					w := work[i]
					require.False(t, got[i], "message %d twice", i)
					got[i] = true
					assert.Equal(t, w.m.ID, m.ID, "message %d", i)
					assert.Equal(t, w.m.Reliable, m.Reliable, "message %d", i)
					assert.True(t, bytes.Equal(cppPayload(i, w.size), m.Payload), "message %d content", i)
					if w.m.InOrder {
						assert.True(t, m.InOrder)
						assert.Greater(t, i, lastOrdered, "in-order message %d after %d", i, lastOrdered)
						lastOrdered = i
					}
					if i == len(work)-1 {
						break
					}
				}
				for i, w := range work {
					if w.m.Reliable {
						assert.True(t, got[i], "reliable message %d (ID %d) never echoed", i, w.m.ID)
					}
				}
				if tc.sim == nil {
					assert.Len(t, got, len(work), "nothing lost on a clean path")
				}
				require.NoError(t, c.Close())
				_, err := sc.Receive(within(t, 5*time.Second))
				assert.ErrorIs(t, err, io.EOF)
				st := c.Stats()
				t.Logf("client: sent %d datagrams, %d retransmits, RTT %v; server: %d duplicate messages",
					st.DatagramsSent, st.Retransmits, st.RTT, sc.Stats().DuplicateMessages)
			})
		})
	}
}

// A listener serves spec and reference clients side by side on one
// socket; one that takes only one dialect ignores the other.
func TestDialectsSideBySide(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		serveEcho(t, l)
		for _, d := range []Dialect{DialectSpec, DialectReference, DialectAuto} {
			cfg := testConfig()
			cfg.Dialect = d
			c := nw.dial(t, l.Addr().String(), cfg)
			want := d
			if d == DialectAuto {
				want = DialectSpec
			}
			assert.Equal(t, want, c.Dialect())
			require.NoError(t, c.Send(Message{ID: 9, Reliable: true, Payload: []byte(d.String())}))
			m, err := c.Receive(within(t, 5*time.Second))
			require.NoError(t, err)
			assert.Equal(t, d.String(), string(m.Payload))
			require.NoError(t, c.Close())
		}
	})

	for _, tc := range []struct{ listen, dial Dialect }{
		{DialectSpec, DialectReference},
		{DialectReference, DialectSpec},
	} {
		t.Run(fmt.Sprintf("%v-listener-%v-client", tc.listen, tc.dial), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				nw := memNet(t)
				cfg := testConfig()
				cfg.Dialect = tc.listen
				l := nw.listen(t, cfg)
				cc := &Config{Dialect: tc.dial, ConnectTimeout: 300 * time.Millisecond}
				_, err := nw.Dial(context.Background(), l.Addr().String(), cc)
				var te *TimeoutError
				assert.True(t, errors.As(err, &te), "no answer, so a timeout: %v", err)
				assert.Positive(t, l.Stats().InvalidDatagrams)
			})
		})
	}
}

// Handshake payloads are not on the reference wire: a long one is no
// error there, and Admit sees none.
func TestReferenceDialectIgnoresHandshakePayloads(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		cfg := testConfig()
		admitted := make(chan []byte, 1)
		cfg.Admit = func(_ net.Addr, syn []byte) ([]byte, error) {
			admitted <- syn
			return make([]byte, 10000), nil // far too long for a ConnectSynAck
		}
		l := nw.listen(t, cfg)
		serveEcho(t, l)
		cc := testConfig()
		cc.Dialect = DialectReference
		cc.ConnectPayload = make([]byte, 5000)
		c := nw.dial(t, l.Addr().String(), cc)
		assert.Empty(t, <-admitted)
		require.NoError(t, c.Send(Message{ID: 9, Reliable: true, Payload: []byte("x")}))
		m, err := c.Receive(within(t, 5*time.Second))
		require.NoError(t, err)
		assert.Equal(t, "x", string(m.Payload))
		assert.Zero(t, l.Stats().OversizedReplies)

		cc.Dialect = DialectSpec
		_, err = nw.Dial(context.Background(), l.Addr().String(), cc)
		assert.ErrorIs(t, err, ErrHandshakeTooLarge, "the spec's dialect still refuses it")
	})
}

// A reference peer's Disconnect to a connection already forgotten (its
// DisconnectAck was lost) is answered statelessly, each answer under its
// own PacketID and never larger than the Disconnect.
func TestStatelessReferenceDisconnectAck(t *testing.T) {
	var d cppDatagram
	disc := func(pid uint32) []byte {
		return appendCppDatagram(nil, &cppDatagram{cppHeader: cppHeader{packetID: pid, reliable: true, inOrder: true, relBase: 541},
			msgs: []cppMessage{{reliable: true, inOrder: true, relNum: 541, id: idDisconnect}}})
	}
	a1 := cppDisconnectAnswer(nil, disc(270), &d)
	a2 := cppDisconnectAnswer(nil, disc(271), &d)
	require.NotNil(t, a1)
	require.NotNil(t, a2)
	assert.LessOrEqual(t, len(a1), len(disc(270)))
	var r cppDatagram
	require.NoError(t, parseCppInto(a1, &r))
	assert.True(t, r.has(idDisconnectAck))
	p1 := r.packetID
	require.NoError(t, parseCppInto(a2, &r))
	assert.NotEqual(t, p1, r.packetID)
	assert.Nil(t, cppDisconnectAnswer(nil, a1, &d), "a DisconnectAck is never answered")

	// Through a listener: the peer's late Disconnect gets an answer.
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		pc := nw.rawSocket(t, l.Addr())
		_, err := pc.Write(disc(300))
		require.NoError(t, err)
		buf := make([]byte, 64)
		n, err := pc.Read(buf)
		require.NoError(t, err)
		require.NoError(t, parseCppInto(buf[:n], &r))
		assert.True(t, r.has(idDisconnectAck))
	})
}
