package knet

import (
	"math"
	"time"
)

// Rate control (spec "Flow Control", DECISIONS §7). Sends are paced to a
// rate in datagrams per second by a token bucket; reliable datagrams in
// flight are also capped by a window, so that a path that stops acking stops
// us too.

// pacer is a token bucket: rate tokens a second, at most burst banked.
type pacer struct {
	tokens float64
	last   time.Time
}

// refill adds the tokens earned since the last call.
func (p *pacer) refill(now time.Time, rate, burst float64) {
	if p.last.IsZero() {
		p.tokens = burst
		p.last = now
		return
	}
	if dt := now.Sub(p.last); dt > 0 {
		p.tokens = math.Min(burst, p.tokens+dt.Seconds()*rate)
		p.last = now
	}
}

// ready reports whether a datagram may go now.
func (p *pacer) ready() bool { return p.tokens >= 1 }

func (p *pacer) spend() { p.tokens-- }

// wait is how long until the next token at rate.
func (p *pacer) wait(rate float64) time.Duration {
	if p.tokens >= 1 || rate <= 0 {
		return 0
	}
	return time.Duration((1 - p.tokens) / rate * float64(time.Second))
}

// controller is the default congestion controller: slow start from the
// initial rate, doubling each round trip while acks keep coming, then
// additive increase; on loss a multiplicative decrease, never below the
// minimum rate and never above what the peer asked for.
type controller struct {
	rate     float64 // datagrams per second
	minRate  float64
	maxRate  float64 // the peer's FlowControlRequest, 0 if none
	ssthresh float64
	lastCut  time.Time
	pace     pacer
	peer     pacer // unreliable datagrams, against maxRate only
}

const (
	rateCeiling = 4e6  // no pacing above this many datagrams/s
	minWindow   = 32   // reliable datagrams in flight, at the least
	maxWindow   = 8192 // and at the most (the protocol allows up to 2^15)
	minBurst    = 16   // datagrams that may always leave back to back
)

func newController(initial, minRate float64) controller {
	return controller{rate: initial, minRate: minRate, ssthresh: math.Inf(1)}
}

// allowed is the rate actually used: the controller's, capped by the peer.
func (c *controller) allowed() float64 {
	r := c.rate
	if c.maxRate > 0 && r > c.maxRate {
		r = c.maxRate
	}
	return math.Max(r, c.minRate)
}

func (c *controller) burst(srtt time.Duration) float64 {
	return math.Max(minBurst, c.allowed()*math.Max(srtt.Seconds(), 0.002))
}

// canSend reports whether a paced datagram may go now.
func (c *controller) canSend(now time.Time, srtt time.Duration) bool {
	c.pace.refill(now, c.allowed(), c.burst(srtt))
	return c.pace.ready()
}

func (c *controller) onSent() { c.pace.spend() }

// onSentUnpaced counts a datagram that did not wait for the pacer against
// the peer's limit only.
func (c *controller) onSentUnpaced() { c.peer.spend() }

// peerAllows reports whether the peer's FlowControlRequest leaves room for
// one more datagram now.
func (c *controller) peerAllows(now time.Time) bool {
	c.peer.refill(now, c.maxRate, math.Max(minBurst, c.maxRate/10))
	return c.peer.ready()
}

// nextSend is when the next paced datagram may go.
func (c *controller) nextSend(now time.Time) time.Time {
	return now.Add(max(c.pace.wait(c.allowed()), 50*time.Microsecond))
}

// window is how many reliable datagrams may be unacked at once: two
// round trips' worth at the current rate.
func (c *controller) window(srtt, ackDelay time.Duration) int {
	w := 2 * c.allowed() * (srtt + ackDelay).Seconds()
	return int(math.Min(maxWindow, math.Max(minWindow, w)))
}

// onAck grows the rate for n datagrams acked.
func (c *controller) onAck(n int, srtt time.Duration) {
	s := math.Max(srtt.Seconds(), 1e-4)
	if c.rate < c.ssthresh {
		c.rate += float64(n) / s // doubles each round trip
	} else {
		c.rate += float64(n) / (c.rate * s * s) // one more datagram per round trip, per round trip
	}
	c.rate = math.Min(c.rate, rateCeiling)
}

// onLoss cuts the rate once per round trip.
func (c *controller) onLoss(now time.Time, srtt time.Duration) {
	if now.Sub(c.lastCut) < srtt {
		return
	}
	c.lastCut = now
	c.rate = math.Max(c.minRate, c.rate*0.7)
	c.ssthresh = c.rate
}
