package knet

import (
	"testing"
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
	require.True(t, p.run(5*time.Second, func() bool { return p.client().ptoCount >= 2 }))
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
	assert.Zero(t, p.client().ptoCount, "probe timer starts afresh")
	p.client().poll(p.now, p.buf)
	assert.Equal(t, resent+1, p.client().stats.Retransmits, "what waited went again at once")
}
