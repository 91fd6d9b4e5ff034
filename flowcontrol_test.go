package knet

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"math"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/netsim"
)

// countingControl is the default controller, counting the congestion
// signals it gets.
type countingControl struct {
	CongestionControl
	timeouts, losses int
}

func (c *countingControl) OnTimeout(now time.Time) {
	c.timeouts++
	c.CongestionControl.OnTimeout(now)
}

func (c *countingControl) OnLoss(now time.Time, lost int) {
	c.losses++
	c.CongestionControl.OnLoss(now, lost)
}

func TestPeerRaisingItsLimitIsNoCongestionSignal(t *testing.T) {
	// The peer asks for fewer datagrams, then nothing is acked for a while
	// (probe timeouts back off), then the peer lifts its limit. What
	// waited goes again at once, but the controller hears of no timeout:
	// a raised limit says nothing about congestion.
	var cc *countingControl
	client := &Config{CongestionControl: func(p CongestionParams) CongestionControl {
		cc = &countingControl{CongestionControl: NewDeliveryRateControl(p)}
		return cc
	}}
	delay := netsim.Params{Delay: 10 * time.Millisecond}
	p := newSimPair(t, client, nil, delay, delay)
	p.connect()
	p.server().sendFlowControl(20)
	p.run(time.Second, nil)
	require.Equal(t, 20.0, p.client().rc.maxRate)

	p.cut[1] = true // acks from the server are lost
	for i := range 10 {
		p.send(0, numbered(100, i, 100))
	}
	require.True(t, p.run(5*time.Second, func() bool { return p.client().loss.ptoCount >= 2 }))
	timeouts := cc.timeouts

	var lift []byte
	p.tap = func(from int, b []byte) {
		d, _, _ := parseDatagram(b)
		for _, m := range d.msgs {
			if from == 1 && m.id == idFlowControlRequest && lift == nil {
				lift = append([]byte(nil), b...)
			}
		}
	}
	p.server().sendFlowControl(0xffff)
	p.run(time.Millisecond, nil)
	require.NotNil(t, lift)
	p.tap = nil
	resent := p.client().stats.Retransmits
	p.inject(0, lift)
	assert.Zero(t, p.client().rc.maxRate, "limit lifted")
	assert.Equal(t, timeouts, cc.timeouts, "the lifted limit was reported as a timeout")
	assert.Zero(t, p.client().loss.ptoCount, "probe timer starts afresh")
	p.client().poll(p.now, p.buf)
	assert.Equal(t, resent+1, p.client().stats.Retransmits, "what waited went again at once")
}

// A FlowControlRequest caps the peer's datagram rate (spec "Flow Control",
// DECISIONS §7), never below MinDatagramRate, until 65535 lifts the cap. On
// the fake clock the rates are exact.
func TestSessionFlowControlRequest(t *testing.T) {
	d := netsim.Params{Delay: 5 * time.Millisecond}
	p := newSimPair(t, nil, nil, d, d)
	p.connect()
	// sent runs the pair for d and returns how many datagrams the client
	// sent meanwhile.
	sent := func(d time.Duration) int {
		before := p.client().stats.DatagramsSent
		p.run(d, nil)
		return int(p.client().stats.DatagramsSent - before)
	}
	p.server().sendFlowControl(20)
	sent(100 * time.Millisecond) // the request crosses the path
	// 150s of sending at 20/s.
	const n = 3000
	for i := range n {
		p.send(0, numbered(100, i, 1000))
	}
	got := sent(10 * time.Second)
	t.Logf("asked for 20/s: %d datagrams in 10s", got)
	assert.InDelta(t, 200, got, 10, "the asked rate")
	assert.Less(t, len(p.h[1].msgs), n, "still streaming")

	p.server().sendFlowControl(1)
	sent(100 * time.Millisecond)
	got = sent(10 * time.Second)
	t.Logf("asked for 1/s: %d datagrams in 10s", got)
	assert.InDelta(t, 10*defaultMinDatagramRate, got, 5, "never below MinDatagramRate")

	// Lifted, the rest (over 2500 datagrams, two minutes at 20/s) goes
	// within 10s: the rate climbs back from the capped one.
	p.server().sendFlowControl(0xffff)
	left := n - len(p.h[1].msgs)
	require.Greater(t, left, 2500)
	require.True(t, p.run(10*time.Second, func() bool { return len(p.h[1].msgs) == n }),
		"%d of %d messages left at a lifted cap", n-len(p.h[1].msgs), left)
}

// Conn.FlowControl on a real connection: the peer's sends drop to the asked
// rate, and rise again once the request is lifted. Only bounds a loaded
// machine cannot break are checked: a cap is an upper bound on what is
// sent in any stretch of time, however the goroutines are scheduled; a
// lifted cap is seen as a transfer that could not have fitted under it.
func TestConnFlowControl(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		c := nw.dial(t, l.Addr().String(), &Config{SendBuffer: 256 << 10, DisconnectTimeout: 10 * time.Second})
		srv := serverConn(t, l)
		stop := make(chan struct{})
		streamed := make(chan int, 1)
		go func() { // the client streams until stopped
			n := 0
			defer func() { streamed <- n }()
			for {
				select {
				case <-stop:
					return
				default:
				}
				c.SetWriteDeadline(time.Now().Add(100 * time.Millisecond))
				err := c.Send(numbered(6, n, 1000))
				if err == nil {
					n++
				} else if !errors.Is(err, errDeadline) {
					t.Error(err)
					return
				}
			}
		}()
		received := make(chan int, 1)
		go func() { // the server reads everything, each message once, until EOF
			seen := map[uint32]bool{}
			defer func() { received <- len(seen) }()
			for {
				m, err := srv.Receive(context.Background())
				if err != nil {
					if err != io.EOF {
						t.Error(err)
					}
					return
				}
				k := binary.LittleEndian.Uint32(m.Payload)
				if seen[k] {
					t.Errorf("message %d twice", k)
				}
				seen[k] = true
			}
		}()
		defer func() { // stop, then check that every message sent arrived
			close(stop)
			n := <-streamed
			c.SetWriteDeadline(time.Time{})
			require.NoError(t, c.Close())
			select {
			case got := <-received:
				assert.Equal(t, n, got, "messages received of those sent")
			case <-time.After(10 * time.Second):
				t.Error("the server did not see the end of the stream")
			}
		}()
		// The stream gets well above the cap to come.
		const rate = 100
		require.Eventually(t, func() bool { return c.Stats().SendRate > 5*rate }, 30*time.Second, time.Millisecond,
			"the stream never got going: %+v", c.Stats())

		srv.FlowControl(rate)
		require.Eventually(t, func() bool { return c.Stats().SendRate <= rate }, 10*time.Second, time.Millisecond,
			"the request was not applied: %+v", c.Stats())
		// Under the cap, 2*rate datagrams take at least (2*rate - slack)/rate
		// seconds; slack covers the pacer's burst, acks and pings, which do
		// not wait for the pacer, and a round of the loop already under way.
		const slack = 20
		sent0, start := c.Stats().DatagramsSent, time.Now()
		require.Eventually(t, func() bool { return c.Stats().DatagramsSent-sent0 >= 2*rate }, 30*time.Second, time.Millisecond,
			"the peer stopped sending: %+v", c.Stats())
		took := time.Since(start)
		t.Logf("capped at %d/s: %d datagrams took %v", rate, 2*rate, took)
		assert.GreaterOrEqual(t, took.Seconds(), float64(2*rate-slack)/rate, "sent faster than asked")

		// Lifted (65535 is the spec's "no limit"): 30*rate more datagrams,
		// which under the cap would take 30s, come in far less.
		srv.FlowControl(math.MaxUint16)
		require.Eventually(t, func() bool { return c.Stats().SendRate > rate }, 10*time.Second, time.Millisecond,
			"the cap was not lifted: %+v", c.Stats())
		sent0, start = c.Stats().DatagramsSent, time.Now()
		require.Eventually(t, func() bool { return c.Stats().DatagramsSent-sent0 >= 30*rate }, 15*time.Second, time.Millisecond,
			"still capped: %+v", c.Stats())
		t.Logf("lifted: %d datagrams took %v", 30*rate, time.Since(start))
		assert.NoError(t, c.Err())
		assert.NoError(t, srv.Err())
	})
}

// tallyControl wraps a congestion controller and counts, from any
// goroutine, what the connection tells it and asks it.
type tallyControl struct {
	CongestionControl
	acks, losses, timeouts, paced *atomic.Int64
}

func (c tallyControl) OnAck(now time.Time, a AckEvent) {
	c.acks.Add(1)
	c.CongestionControl.OnAck(now, a)
}

func (c tallyControl) OnLoss(now time.Time, lostBytes int) {
	c.losses.Add(1)
	c.CongestionControl.OnLoss(now, lostBytes)
}

func (c tallyControl) OnTimeout(now time.Time) {
	c.timeouts.Add(1)
	c.CongestionControl.OnTimeout(now)
}

func (c tallyControl) PacingRate() float64 {
	c.paced.Add(1)
	return c.CongestionControl.PacingRate()
}

// Config.CongestionControl with NewAIMDControl, end to end over a lossy
// path: everything arrives, exactly once, and the connection really runs
// on the controller it was given.
func TestAIMDControlEndToEnd(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		var made, acks, losses, timeouts, paced atomic.Int64
		cli := testConfig()
		cli.CongestionControl = func(p CongestionParams) CongestionControl {
			made.Add(1)
			assert.Equal(t, CongestionParams{InitialRate: 15 * 1200, MinRate: 5 * 1200, DatagramSize: 1200}, p)
			return tallyControl{NewAIMDControl(p), &acks, &losses, &timeouts, &paced}
		}
		cli.Simulate = &Simulation{Loss: 0.05, Delay: 2 * time.Millisecond, Seed: 21}
		srv := testConfig()
		srv.Simulate = &Simulation{Loss: 0.05, Delay: 2 * time.Millisecond, Seed: 22}
		l := nw.listen(t, srv)
		serveEcho(t, l)
		c := nw.dial(t, l.Addr().String(), cli)
		const n = 1000
		go func() {
			for i := range n {
				if err := c.Send(numbered(6, i, 1000)); err != nil {
					t.Error(err)
					return
				}
			}
		}()
		ctx := within(t, 60*time.Second)
		seen := make([]bool, n)
		for range n {
			m, err := c.Receive(ctx)
			require.NoError(t, err)
			i := binary.LittleEndian.Uint32(m.Payload)
			require.Less(t, int(i), n)
			require.False(t, seen[i], "message %d twice", i)
			seen[i] = true
		}
		st := c.Stats()
		t.Logf("client %+v; controller: %d acks, %d losses, %d timeouts, %d rate reads", st, acks.Load(), losses.Load(), timeouts.Load(), paced.Load())
		assert.Equal(t, int64(1), made.Load(), "one controller for the one connection")
		assert.Positive(t, acks.Load())
		assert.Positive(t, losses.Load()+timeouts.Load(), "the losses were reported to it")
		assert.Positive(t, paced.Load(), "the pacing asked it")
		assert.Positive(t, st.Retransmits)
	})
}
