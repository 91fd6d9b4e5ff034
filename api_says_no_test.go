package knet

import (
	"bytes"
	"context"
	"net"
	"net/http"
	"reflect"
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
		var cut *cutSocket
		nw.wrapDial = func(s socket) socket {
			cut = &cutSocket{socket: s}
			return cut
		}
		l := nw.listen(t, testConfig())
		serveEcho(t, l)
		cfg := testConfig()
		cfg.SendBuffer = 8 << 10
		c := nw.dial(t, l.Addr().String(), cfg)
		// Nothing the client sends arrives from now on, so nothing is
		// acked and the buffer, once full, stays full: the connection's
		// rounds run beside this goroutine, and an ack between the
		// calls below made room (once in CI).
		cut.cut.Store(true)
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

// Receive, ReceiveInto and Read on a connection in a Group return
// ErrInGroup, a Receive already waiting included, rather than take
// messages from under Poll; after Remove they work again.
func TestAPIReceiveInGroup(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		serveEcho(t, l)
		c := nw.dial(t, l.Addr().String(), testConfig())
		g := NewGroup()
		waiting := make(chan error, 1)
		go func() {
			_, err := c.Receive(context.Background())
			waiting <- err
		}()
		synctest.Wait() // the Receive waits
		g.Add(c)
		synctest.Wait()
		select {
		case err := <-waiting:
			assert.ErrorIs(t, err, ErrInGroup, "a Receive waiting when c joined")
		default:
			t.Error("a Receive waiting when c joined still waits")
		}
		require.NoError(t, c.Send(Message{ID: 6, Reliable: true, Payload: []byte("x")}))
		ctx := within(t, 10*time.Second)
		require.NoError(t, g.Wait(ctx))
		synctest.Wait()
		_, err := c.Receive(ctx)
		assert.ErrorIs(t, err, ErrInGroup, "Receive")
		_, _, err = c.ReceiveInto(ctx, make([]byte, 10))
		assert.ErrorIs(t, err, ErrInGroup, "ReceiveInto")
		c.SetReadDeadline(time.Now().Add(time.Second)) // main's Read waited
		_, err = c.Read(make([]byte, 10))
		assert.ErrorIs(t, err, ErrInGroup, "Read")
		c.SetReadDeadline(time.Time{})
		// Poll has every message.
		var got []Event
		for len(got) < 2 {
			require.NoError(t, g.Wait(ctx))
			ev := make([]Event, 8)
			got = append(got, ev[:g.Poll(ev)]...)
		}
		require.Len(t, got, 2)
		assert.Equal(t, EventConnected, got[0].Kind)
		assert.Equal(t, EventMessage, got[1].Kind)
		assert.Equal(t, "x", string(got[1].Message.Payload))
		g.Remove(c)
		require.NoError(t, c.Send(Message{ID: 6, Reliable: true, Payload: []byte("y")}))
		m, err := c.Receive(ctx)
		require.NoError(t, err)
		assert.Equal(t, "y", string(m.Payload))
	})
}

// The zero Group works: Wait returns once an event waits.
func TestAPIZeroGroup(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		serveEcho(t, l)
		c := nw.dial(t, l.Addr().String(), testConfig())
		var g Group
		ctx := within(t, 10*time.Second)
		go func() {
			synctest.Wait()
			g.Add(c)
		}()
		require.NoError(t, g.Wait(ctx), "Wait on the zero Group before Add")
		require.NoError(t, c.Send(Message{ID: 6, Reliable: true, Payload: []byte("x")}))
		var got []Event
		for len(got) < 2 {
			require.NoError(t, g.Wait(ctx))
			ev := make([]Event, 8)
			got = append(got, ev[:g.Poll(ev)]...)
		}
		assert.Equal(t, EventMessage, got[len(got)-1].Kind)
		assert.Equal(t, 1, g.Len())
	})
}

// Read returns the payloads of StreamMessageID messages only: a message of
// another ID from the peer stays, in its order, for Receive, instead of
// ending up in the byte stream.
func TestAPIReadOnlyStream(t *testing.T) {
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
		t.Cleanup(func() { sc.Close() })
		big := bytes.Repeat([]byte("b"), 5000) // reassembled: a buffer of its own
		for _, m := range []Message{
			{ID: 100, Payload: []byte("other"), Reliable: true, InOrder: true},
			{ID: StreamMessageID, Payload: []byte("hello "), Reliable: true, InOrder: true},
			{ID: 101, Payload: big, Reliable: true, InOrder: true},
			{ID: StreamMessageID, Payload: []byte("world"), Reliable: true, InOrder: true},
			{ID: 102, Payload: []byte("last"), Reliable: true, InOrder: true},
		} {
			require.NoError(t, sc.Send(m))
		}
		_, err := sc.Write(big)
		require.NoError(t, err)
		require.NoError(t, sc.Send(Message{ID: 103, Reliable: true, InOrder: true}))
		want := "hello world" + string(big)
		got := make([]byte, 0, len(want))
		buf := make([]byte, 7) // reads cut payloads, the first behind others
		for len(got) < len(want) {
			n, err := c.Read(buf)
			require.NoError(t, err)
			got = append(got, buf[:n]...)
		}
		assert.Equal(t, want, string(got))
		ctx := within(t, 10*time.Second)
		for _, w := range []struct {
			id      uint32
			payload string
		}{{100, "other"}, {101, string(big)}, {102, "last"}, {103, ""}} {
			m, err := c.Receive(ctx)
			require.NoError(t, err)
			assert.Equal(t, w.id, m.ID)
			assert.Equal(t, w.payload, string(m.Payload))
		}
	})
}

// A second Listener.Close returns an error wrapping net.ErrClosed, as a
// second Conn.Close and a net.Listener's do.
func TestAPIListenerCloseTwice(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		require.NoError(t, l.Close())
		assert.ErrorIs(t, l.Close(), net.ErrClosed)
	})
}

// Listen and ListenPacket refuse a Config that sets a field only Dial
// reads, and Dial, DialPacket and DialWebSocket (over every network) one
// that sets a field only a Listener reads, naming the field; Admit and
// AdmitConn together are refused too. Every Config field is one side's or
// both's (TestAPIConfigFieldsSided).
func TestAPIConfigSides(t *testing.T) {
	done, cancel := context.WithCancel(context.Background())
	cancel() // a Dial that got past the check fails at once
	for _, f := range dialFields {
		cfg := configWith(t, f)
		l, err := Listen("udp", "127.0.0.1:0", cfg)
		if assert.Error(t, err, "Listen with %s", f) {
			assert.ErrorContains(t, err, "Config."+f)
		} else {
			l.Close()
		}
		pc, err := net.ListenPacket("udp", "127.0.0.1:0")
		require.NoError(t, err)
		l, err = ListenPacket(pc, cfg)
		if assert.Error(t, err, "ListenPacket with %s", f) {
			assert.ErrorContains(t, err, "Config."+f)
		} else {
			l.Close()
		}
	}
	for _, f := range listenFields {
		cfg := configWith(t, f)
		for _, network := range []string{"udp", "udp4", "tcp", "tcp4"} {
			_, err := Dial(done, network, "127.0.0.1:9", cfg)
			assert.ErrorContains(t, err, "Config."+f, "Dial %s with %s", network, f)
		}
		_, err := DialWebSocket(done, "ws://127.0.0.1:9/knet", cfg)
		assert.ErrorContains(t, err, "Config."+f, "DialWebSocket with %s", f)
		pc, err := net.ListenPacket("udp", "127.0.0.1:0")
		require.NoError(t, err)
		_, err = DialPacket(done, pc, "127.0.0.1:9", cfg)
		assert.ErrorContains(t, err, "Config."+f, "DialPacket with %s", f)
	}
	both := &Config{
		Admit:     func(net.Addr, []byte) ([]byte, error) { return nil, nil },
		AdmitConn: func(*Conn, []byte) ([]byte, error) { return nil, nil },
	}
	l, err := Listen("udp", "127.0.0.1:0", both)
	if assert.Error(t, err, "Admit and AdmitConn") {
		assert.ErrorContains(t, err, "AdmitConn")
	} else {
		l.Close()
	}
	// Each side's own fields, and those of both, are fine.
	l, err = Listen("udp", "127.0.0.1:0", &Config{TCP: true, Stealth: true, ReceiveBudget: 1 << 20, DisconnectTimeout: time.Second})
	require.NoError(t, err)
	require.NoError(t, l.Close())
}

// Every exported Config field is Dial's (dialFields), a Listener's
// (listenFields) or both's: a field added later is placed on purpose.
func TestAPIConfigFieldsSided(t *testing.T) {
	both := []string{"PingInterval", "MaxAckDelay", "DatagramTimeout", "ConnectionLostTimeout", "ResumeTimeout",
		"ConnectTimeout", "DisconnectTimeout", "InitialDatagramRate", "MinDatagramRate",
		"MaxMessageSendCount", "MaxFragmentSize", "MaxDatagramSize", "MaxPathDatagramSize",
		"MaxMessageSize", "SendBuffer", "ReceiveBuffer", "ReassemblyBuffer", "ReorderWindow",
		"ReorderWindows", "CongestionControl", "Simulate", "Dialect", "Group", "ChannelWeights",
		"Receipts", "Logger", "KeyUpdateInterval", "KeyUpdateTime"}
	placed := map[string]int{}
	for _, fs := range [][]string{both, dialFields, listenFields} {
		for _, f := range fs {
			placed[f]++
		}
	}
	typ := reflect.TypeFor[Config]()
	for i := range typ.NumField() {
		if f := typ.Field(i); f.IsExported() {
			assert.Equal(t, 1, placed[f.Name], "Config.%s placed once", f.Name)
			delete(placed, f.Name)
		}
	}
	assert.Empty(t, placed, "names of no field")
}

// configWith is a Config with only the named field set (to a value not
// zero).
func configWith(t *testing.T, field string) *Config {
	cfg := new(Config)
	v := reflect.ValueOf(cfg).Elem().FieldByName(field)
	require.True(t, v.IsValid(), field)
	switch v.Kind() {
	case reflect.Bool:
		v.SetBool(true)
	case reflect.Int:
		v.SetInt(1)
	case reflect.Slice:
		v.Set(reflect.MakeSlice(v.Type(), 1, 1))
	case reflect.Func:
		v.Set(reflect.MakeFunc(v.Type(), func([]reflect.Value) []reflect.Value {
			out := make([]reflect.Value, v.Type().NumOut())
			for i := range out {
				out[i] = reflect.Zero(v.Type().Out(i))
			}
			return out
		}))
	case reflect.Interface: // Config.HTTP, an http.Handler
		v.Set(reflect.ValueOf(http.NotFoundHandler()))
	default:
		t.Fatalf("configWith: %s is a %v", field, v.Kind())
	}
	return cfg
}

// Point 7: Stats never waits for the connection's next round. The first
// call reads the counters itself between rounds: with the scheduler held
// (no worker can pop or queue a round), it answers, complete; before, it
// kicked the connection and waited for a worker's round.
func TestAPIStatsNeverWaitsForARound(t *testing.T) {
	nw := sysNet()
	l := nw.listen(t, testConfig())
	defer l.Close()
	c := nw.dial(t, l.Addr().String(), testConfig())
	defer c.Close()
	srv := serverConn(t, l)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	const n = 5
	for i := range n {
		require.NoError(t, c.Send(Message{ID: 100, Payload: []byte{byte(i)}, Reliable: true}))
		_, err := srv.Receive(ctx)
		require.NoError(t, err)
	}
	q := &srv.ep.sched
	q.mu.Lock()
	got := make(chan Stats, 1)
	go func() { got <- srv.Stats() }()
	var st Stats
	select {
	case st = <-got:
	case <-time.After(5 * time.Second): // a failure detector: the call takes microseconds
	}
	q.mu.Unlock()
	if st.MessagesReceived == 0 {
		st = <-got
		t.Fatalf("Stats waited for a round while the scheduler was held (then: %d received)", st.MessagesReceived)
	}
	assert.EqualValues(t, n, st.MessagesReceived)
}
