package knet

import (
	"context"
	"errors"
	"math"
	"net"
	"os"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/netsim"
)

// Hostile and odd values through the public API: each gets a clear error or
// a documented clamp, never a panic.

func TestConnectPayloadTooLarge(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		serveEcho(t, l)
		limit := (&Config{}).resolve().handshakeLimit()
		require.Equal(t, 1096, limit, "the limit Config.ConnectPayload documents")

		// The largest allowed arrives whole.
		c := nw.dial(t, l.Addr().String(), &Config{ConnectPayload: make([]byte, limit)})
		syn, _ := c.Handshake()
		assert.Len(t, syn, limit)

		// Beyond it Dial says so, before sending anything. 2100 bytes and more
		// used to panic the connection's goroutine (a message block holds 2047).
		for _, n := range []int{limit + 1, 2040, 2100, 70000} {
			_, err := nw.Dial(within(t, 5*time.Second), l.Addr().String(), &Config{ConnectPayload: make([]byte, n)})
			assert.ErrorIs(t, err, ErrHandshakeTooLarge, "%d bytes", n)
		}
		// The limit follows MaxDatagramSize.
		_, err := nw.Dial(within(t, 5*time.Second), l.Addr().String(), &Config{MaxDatagramSize: 300, ConnectPayload: make([]byte, 300-104+1)})
		assert.ErrorIs(t, err, ErrHandshakeTooLarge)
		c = nw.dial(t, l.Addr().String(), &Config{MaxDatagramSize: 300, ConnectPayload: make([]byte, 300-104)})
		syn, _ = c.Handshake()
		assert.Len(t, syn, 300-104)
	})
}

func TestAdmitReplyTooLong(t *testing.T) {
	for _, stealth := range []bool{false, true} {
		t.Run(map[bool]string{false: "responsive", true: "stealth"}[stealth], func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				nw := memNet(t)
				limit := (&Config{}).resolve().handshakeLimit()
				cfg := testConfig()
				cfg.Stealth = stealth
				cfg.Admit = func(_ net.Addr, p []byte) ([]byte, error) {
					// The client names the reply's length.
					if string(p) == "long" {
						return make([]byte, limit+1), nil
					}
					return make([]byte, limit), nil
				}
				l := nw.listen(t, cfg)
				serveEcho(t, l)

				c := nw.dial(t, l.Addr().String(), &Config{ConnectPayload: []byte("max")})
				_, synAck := c.Handshake()
				assert.Len(t, synAck, limit, "the largest reply arrives whole")

				// One byte more is never cut: the attempt is refused, and the
				// server's stats say why.
				_, err := nw.Dial(context.Background(), l.Addr().String(), &Config{ConnectPayload: []byte("long"), ConnectTimeout: 500 * time.Millisecond})
				if stealth {
					var te *TimeoutError
					assert.ErrorAs(t, err, &te, "stealth: no answer")
				} else {
					assert.ErrorIs(t, err, ErrRefused)
				}
				// (Stealth: each resent ConnectSyn is refused again.)
				st := l.Stats()
				assert.Positive(t, st.OversizedReplies)
				assert.Equal(t, st.OversizedReplies, st.RefusedAttempts)
			})
		})
	}
}

func TestConfigClamps(t *testing.T) {
	huge := math.MaxInt
	r := (&Config{
		PingInterval: 1, DatagramTimeout: 1, ConnectionLostTimeout: 1,
		MaxAckDelay: math.MaxInt64, ConnectTimeout: math.MaxInt64, DisconnectTimeout: math.MaxInt64, ReorderWindow: math.MaxInt64,
		MaxFragmentSize: 1, MaxDatagramSize: 1, AcceptBacklog: huge, Sockets: huge,
		CongestionControl: func(CongestionParams) CongestionControl { return nil },
	}).resolve()
	assert.Equal(t, time.Millisecond, r.pingInterval)
	assert.Equal(t, 10*time.Millisecond, r.datagramTimeout)
	assert.Equal(t, 10*time.Millisecond, r.lostTimeout)
	for _, d := range []time.Duration{r.maxAckDelay, r.connectTimeout, r.disconnect, r.reorderWindow} {
		assert.Equal(t, 24*time.Hour, d)
	}
	assert.Equal(t, 64, r.maxFragment)
	assert.Equal(t, 256, r.maxDatagram)
	assert.Equal(t, 1<<16, r.backlog)
	assert.Equal(t, 256, r.sockets)
	assert.NotNil(t, newRateControl(r).cc, "a nil controller falls back to the default")

	r = (&Config{PingInterval: math.MaxInt64, MaxFragmentSize: huge, MaxDatagramSize: huge}).resolve()
	assert.Equal(t, 24*time.Hour, r.lostTimeout, "derived from the clamped PingInterval, not overflowed")
	assert.Equal(t, maxContentLength-8, r.maxFragment)
	assert.Equal(t, 65507, r.maxDatagram)

	// Negative means the default, as zero does.
	assert.Equal(t, (&Config{}).resolve(), (&Config{
		PingInterval: -1, MaxAckDelay: -1, DatagramTimeout: -1, ConnectionLostTimeout: -1,
		ConnectTimeout: -1, DisconnectTimeout: -1, InitialDatagramRate: -1, MinDatagramRate: -1,
		MaxMessageSendCount: -1, MaxFragmentSize: -1, MaxDatagramSize: -1, MaxMessageSize: -1,
		SendBuffer: -1, ReceiveBuffer: -1, ReassemblyBuffer: -1, MaxPendingConnections: -1,
		AcceptBacklog: -1, Sockets: -1,
	}).resolve())
	assert.Negative(t, (&Config{ReorderWindow: -time.Second}).resolve().reorderWindow, "negative: no wait")
	assert.Equal(t, 24*time.Hour, (&Config{ReorderWindow: time.Duration(math.MaxInt64)}).resolve().reorderWindow)
	assert.Equal(t, 24*time.Hour, (&Config{ReorderWindows: map[uint32]time.Duration{7: time.Duration(math.MaxInt64)}}).resolve().reorderWindows[7])

	p := (&Simulation{Loss: -1, Duplicate: 2, Reorder: math.NaN(), Corrupt: math.Inf(1), BurstLen: -3,
		Delay: -time.Second, Jitter: math.MaxInt64, ReorderDelay: -1, Bandwidth: -5, QueueBytes: -5, MaxSize: -5}).params()
	assert.Equal(t, netsim.Params{Duplicate: 1, Corrupt: 1, Jitter: time.Hour}, p)

	assert.Equal(t, 65507, (&Config{MaxPathDatagramSize: math.MaxInt}).resolve().maxPathDatagram())
	assert.Zero(t, (&Config{MaxPathDatagramSize: 1000}).resolve().pathExtra, "below MaxDatagramSize: off")
	assert.Zero(t, (&Config{MaxPathDatagramSize: -1}).resolve().pathExtra)
}

// hostileConfigs are Configs that used to crash or wedge a connection,
// and others at the edges of their ranges.
var hostileConfigs = map[string]Config{
	"tiny fragments":      {MaxFragmentSize: 1},
	"huge fragments":      {MaxFragmentSize: math.MaxInt},
	"tiny datagrams":      {MaxDatagramSize: 1},
	"huge datagrams":      {MaxDatagramSize: math.MaxInt},
	"negative everything": {MaxDatagramSize: -1, MaxFragmentSize: -1, MaxMessageSize: -1, SendBuffer: -1, PingInterval: -1, ReorderWindow: -1},
	"one-byte buffers":    {SendBuffer: 1, ReceiveBuffer: 1, ReassemblyBuffer: 1},
	"huge sizes":          {MaxMessageSize: math.MaxInt, SendBuffer: math.MaxInt, ReceiveBuffer: math.MaxInt, ReassemblyBuffer: math.MaxInt},
	"nanosecond timers":   {PingInterval: 1, MaxAckDelay: 1, DatagramTimeout: 1, ReorderWindow: 1},
	"endless timers": {PingInterval: math.MaxInt64, MaxAckDelay: math.MaxInt64, DatagramTimeout: math.MaxInt64,
		ConnectionLostTimeout: math.MaxInt64, DisconnectTimeout: math.MaxInt64, ReorderWindow: math.MaxInt64},
	"huge rates":       {InitialDatagramRate: math.MaxInt, MinDatagramRate: math.MaxInt, MaxMessageSendCount: math.MaxInt},
	"huge backlog":     {AcceptBacklog: math.MaxInt, MaxPendingConnections: math.MaxInt},
	"huge path":        {MaxPathDatagramSize: math.MaxInt, MaxDatagramSize: 1},
	"nil controller":   {CongestionControl: func(CongestionParams) CongestionControl { return nil }},
	"simulation range": {Simulate: &Simulation{Loss: -1, Duplicate: 2, Reorder: math.NaN(), BurstLen: -3, Delay: -time.Second, Jitter: -time.Second, ReorderDelay: -1, Bandwidth: -5, QueueBytes: -5}},
	"endless jitter":   {Simulate: &Simulation{Jitter: math.MaxInt64}},
}

func TestHostileConfigValues(t *testing.T) {
	t.Parallel()
	for name, hc := range hostileConfigs {
		t.Run(name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				nw := memNet(t)
				cfg := hc
				cfg.ConnectTimeout = 500 * time.Millisecond
				cfg.DisconnectTimeout = 500 * time.Millisecond
				l, err := nw.Listen(&cfg)
				require.NoError(t, err)
				defer l.Close()
				serveEcho(t, l)
				c, err := nw.Dial(within(t, 5*time.Second), l.Addr().String(), forDial(&cfg))
				if err != nil {
					// Only a lossy simulation may keep the handshake from completing.
					var te *TimeoutError
					require.ErrorAs(t, err, &te)
					require.NotNil(t, cfg.Simulate)
					return
				}
				defer c.Close()
				for _, n := range []int{0, 100, 5000} {
					err := c.Send(Message{ID: 100, Payload: make([]byte, n), Reliable: true})
					if err != nil {
						assertClear(t, err)
						continue
					}
					ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
					_, err = c.Receive(ctx)
					cancel()
					if err != nil && !errors.Is(err, context.DeadlineExceeded) {
						assertClear(t, err)
					}
				}
			})
		})
	}
}

// assertClear checks that err says it is knet's, or is a deadline.
func assertClear(t *testing.T, err error) {
	t.Helper()
	if errors.Is(err, os.ErrDeadlineExceeded) || errors.Is(err, context.DeadlineExceeded) {
		return
	}
	assert.True(t, strings.HasPrefix(err.Error(), "knet: ") || strings.Contains(err.Error(), ": knet: "), "unclear error %q", err)
}

func TestHostileSendValues(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		serveEcho(t, l)
		c := nw.dial(t, l.Addr().String(), &Config{MaxMessageSize: 1 << 16})
		rel, err := c.SendRef(Message{ID: 6, Reliable: true})
		require.NoError(t, err)
		unrel, err := c.SendRef(Message{ID: 6})
		require.NoError(t, err)
		for _, tt := range []struct {
			name string
			m    Message
			want error
		}{
			{"ID 0", Message{ID: 0}, ErrReservedID},
			{"ID 5", Message{ID: 5, Reliable: true}, ErrReservedID},
			{"ID above the range", Message{ID: MaxMessageID + 1}, ErrReservedID},
			{"ID MaxUint32", Message{ID: math.MaxUint32}, ErrReservedID},
			{"payload above MaxMessageSize", Message{ID: 6, Payload: make([]byte, 1<<16+1)}, ErrMessageTooLarge},
			{"too many dependencies", Message{ID: 6, DependsOn: make([]Ref, MaxDependencies+1)}, ErrBadDependency},
			{"zero Ref", Message{ID: 6, DependsOn: []Ref{0}}, ErrBadDependency},
			{"Ref 1 names no message", Message{ID: 6, Reliable: true, DependsOn: []Ref{1}}, ErrBadDependency},
			{"Ref never handed out", Message{ID: 6, DependsOn: []Ref{math.MaxUint64}}, ErrBadDependency},
			{"reliable on unreliable", Message{ID: 6, Reliable: true, DependsOn: []Ref{unrel}}, ErrBadDependency},
			{"nil payload", Message{ID: 6}, nil},
			{"MaxMessageID", Message{ID: MaxMessageID, Reliable: true}, nil},
			{"edges of the other fields", Message{ID: 6, Channel: 255, Priority: math.MinInt8, InOrder: true, ContentID: math.MaxUint32}, nil},
			{"ContentID on reliable", Message{ID: 6, Reliable: true, Priority: math.MaxInt8, ContentID: math.MaxUint32}, nil},
			{"largest payload, fragmented", Message{ID: 6, Payload: make([]byte, 1<<16), ContentID: 3, InOrder: true}, nil},
			{"same dependency repeated", Message{ID: 6, DependsOn: []Ref{rel, rel, unrel, unrel}}, nil},
		} {
			err := c.Send(tt.m)
			if tt.want == nil {
				assert.NoError(t, err, tt.name)
			} else {
				assert.ErrorIs(t, err, tt.want, tt.name)
			}
		}
		_, err = c.SendRef(Message{ID: 6, DependsOn: []Ref{rel}})
		assert.NoError(t, err)
		// Whatever was accepted arrives: the connection is unharmed.
		require.NoError(t, c.Send(Message{ID: 7, Reliable: true}))
		ctx := within(t, 10*time.Second)
		for {
			m, err := c.Receive(ctx)
			require.NoError(t, err)
			if m.ID == 7 {
				break
			}
		}
	})
}

func TestNilContext(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		serveEcho(t, l)
		//lint:ignore SA1012 a nil context is the hostile value under test
		_, err := nw.Dial(nil, l.Addr().String(), nil) //nolint:staticcheck
		assert.EqualError(t, err, "knet: nil context")
		c := nw.dial(t, l.Addr().String(), nil)
		_, err = c.Receive(nil) //nolint:staticcheck
		assert.Error(t, err)
		_, _, err = c.ReceiveInto(nil, nil) //nolint:staticcheck
		assert.Error(t, err)
		assert.Error(t, c.SendContext(nil, Message{ID: 6})) //nolint:staticcheck
		_, err = l.AcceptConn(nil)                          //nolint:staticcheck
		assert.Error(t, err)
	})
}

func TestOddAddresses(t *testing.T) {
	for _, tt := range []struct {
		network, address string
		dialErr          bool // fails at once, without waiting for a handshake
		listenErr        bool
	}{
		{"udp", "", true, false},
		{"udp", ":0", true, false},
		{"udp", "127.0.0.1:0", true, false},
		{"udp6", "127.0.0.1:9", true, true},
		{"udp4", "[::1]:9", true, true},
		{"tcp", "127.0.0.1:9", true, true},
		{"", "127.0.0.1:9", true, true},
		{"udp", "localhost:99999", true, true},
		{"udp", "127.0.0.1:-1", true, true},
		{"udp", "no port", true, true},
		{"udp", "[fe80::1%no-such-interface]:9", true, true},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		start := time.Now()
		c, err := Dial(ctx, tt.network, tt.address, &Config{ConnectTimeout: 3 * time.Second})
		cancel()
		if c != nil {
			c.Close()
		}
		if tt.dialErr {
			assert.Error(t, err, "dial %s %q", tt.network, tt.address)
			assert.Less(t, time.Since(start), time.Second, "dial %s %q failed at once", tt.network, tt.address)
		}
		l, err := Listen(tt.network, tt.address, nil)
		if l != nil {
			l.Close()
		}
		if tt.listenErr {
			assert.Error(t, err, "listen %s %q", tt.network, tt.address)
		} else {
			assert.NoError(t, err, "listen %s %q", tt.network, tt.address)
		}
	}
}

func TestMethodsAfterClose(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		serveEcho(t, l)
		c := nw.dial(t, l.Addr().String(), testConfig())
		c.Close()
		assert.ErrorIs(t, c.Send(Message{ID: 6}), net.ErrClosed)
		_, err := c.SendRef(Message{ID: 6, Reliable: true})
		assert.ErrorIs(t, err, net.ErrClosed)
		_, err = c.Receive(context.Background())
		assert.ErrorIs(t, err, net.ErrClosed)
		_, _, err = c.ReceiveInto(context.Background(), nil)
		assert.ErrorIs(t, err, net.ErrClosed)
		_, err = c.Write([]byte("x"))
		assert.ErrorIs(t, err, net.ErrClosed)
		_, err = c.Read(make([]byte, 1))
		assert.ErrorIs(t, err, net.ErrClosed)
		c.FlowControl(-1)
		c.FlowControl(math.MaxInt)
		c.SetDeadline(time.Now())
		c.SetReadDeadline(time.Time{})
		c.Handshake()
		c.Stats()
		assert.ErrorIs(t, c.Err(), net.ErrClosed)
		assert.NotNil(t, c.LocalAddr())
		assert.NotNil(t, c.RemoteAddr())

		l.Close()
		_, err = l.Accept()
		assert.ErrorIs(t, err, net.ErrClosed)
		_, err = l.AcceptConn(context.Background())
		assert.ErrorIs(t, err, net.ErrClosed)
		l.SetListenOpen(true)
		l.Stats()
		assert.NotNil(t, l.Addr())
		l.Close()
	})
}

// FuzzConfig drives a pair of sessions, on the fake clock, with Config
// values from the fuzzer: resolving them must give the documented ranges,
// and nothing may panic.
func FuzzConfig(f *testing.F) {
	for _, s := range fuzzConfigSeeds {
		f.Add(s.datagram, s.fragment, s.message, s.buffer, s.rate, int64(s.ping), int64(s.timeout), int64(s.window), s.loss, int64(s.jitter), s.synLen, s.payload)
	}
	f.Fuzz(func(t *testing.T, datagram, fragment, message, buffer, rate int, pingNs, timeoutNs, windowNs int64, loss float64, jitterNs int64, synLen uint16, payload uint32) {
		ping, timeout, window, jitter := time.Duration(pingNs), time.Duration(timeoutNs), time.Duration(windowNs), time.Duration(jitterNs)
		cfg := &Config{
			MaxDatagramSize: datagram, MaxFragmentSize: fragment, MaxMessageSize: message,
			SendBuffer: buffer, ReceiveBuffer: buffer, ReassemblyBuffer: buffer,
			InitialDatagramRate: rate, MinDatagramRate: rate / 3, MaxMessageSendCount: rate,
			PingInterval: ping, MaxAckDelay: ping / 7, ConnectionLostTimeout: timeout, DatagramTimeout: timeout / 5,
			ConnectTimeout: timeout, DisconnectTimeout: timeout, ReorderWindow: window,
			AcceptBacklog: buffer, MaxPendingConnections: buffer, Sockets: rate,
			Simulate: &Simulation{Loss: loss, Duplicate: loss * 2, Reorder: -loss, BurstLen: loss * 10, Jitter: jitter, Delay: jitter * 3},
		}
		r := cfg.resolve()
		require.GreaterOrEqual(t, r.maxDatagram, minDatagramSize)
		require.LessOrEqual(t, r.maxDatagram, maxDatagramSizeLimit)
		require.GreaterOrEqual(t, r.maxFragment, minFragmentSize)
		require.Positive(t, r.handshakeLimit())
		require.GreaterOrEqual(t, r.fragSize(), minFragAverage, "a knet receiver takes smaller fragments for an attack")
		for _, d := range []time.Duration{r.pingInterval, r.maxAckDelay, r.datagramTimeout, r.lostTimeout, r.connectTimeout, r.disconnect} {
			require.Positive(t, d)
			require.LessOrEqual(t, d, 3*maxDuration)
		}
		require.Positive(t, r.keepalive())
		require.Positive(t, r.backlog)
		require.LessOrEqual(t, r.backlog, maxBacklog)
		require.LessOrEqual(t, r.sockets, maxSockets)

		link := netsim.NewLink(cfg.Simulate.params())
		for i := range 16 {
			link.Decide(timeZero.Add(time.Duration(i)*time.Millisecond), 100+i)
		}

		cfg.ConnectPayload = make([]byte, min(int(synLen), r.handshakeLimit()))
		p := newSimPair(t, cfg, cfg, netsim.Params{Loss: min(max(loss, 0), 0.5), Seed: 1}, netsim.Params{Seed: 2})
		if !p.run(time.Minute, func() bool { return p.h[0].est && p.h[1].est || p.client().done() || p.server().done() }) {
			return
		}
		n := int(payload % (64 << 10))
		if n > r.maxMessage {
			return // Send refuses it
		}
		p.send(0, Message{ID: 6, Payload: make([]byte, n), Reliable: true})
		p.send(0, Message{ID: 7, Payload: make([]byte, n/2), InOrder: true})
		p.run(10*time.Second, func() bool { return len(p.h[1].msgs) > 0 || p.client().done() })
	})
}

type fuzzConfigSeed struct {
	datagram, fragment, message, buffer, rate int
	ping, timeout, window                     time.Duration
	loss                                      float64
	jitter                                    time.Duration
	synLen                                    uint16
	payload                                   uint32
}

// fuzzConfigSeeds are the defaults and the values that crashed before
// Config's ranges were enforced; testdata/fuzz/FuzzConfig holds them too.
var fuzzConfigSeeds = []fuzzConfigSeed{
	{payload: 3000},
	{fragment: 1, payload: 5000},                        // fragments of 0 bytes: division by zero
	{fragment: 16, payload: 60000, message: 60000},      // fragments under the receiver's 16-byte average
	{jitter: -5, loss: 0.1},                             // rand.Int64N of a negative
	{jitter: math.MaxInt64},                             // and of an overflowed one
	{synLen: 2100},                                      // a ConnectSyn no message block holds
	{ping: math.MaxInt64},                               // 3*PingInterval overflowing to a negative timeout
	{ping: 1, timeout: 1, window: 1},                    // timers of a nanosecond
	{datagram: 1, fragment: math.MaxInt, payload: 9000}, // datagrams below the headers
	{buffer: math.MaxInt, rate: math.MaxInt},            // a backlog channel too large to make
	{loss: math.NaN(), payload: 100},
}
