package knet

import (
	"math"
	"time"
)

// CongestionControl decides how fast a connection sends reliable
// datagrams. The connection's round calls its methods; an
// implementation need not be safe for concurrent use. Config's
// CongestionControl field plugs one in.
type CongestionControl interface {
	// OnAck reports the datagrams newly acked by one incoming datagram.
	OnAck(now time.Time, a AckEvent)
	// OnLoss reports reliable datagrams found lost because later ones
	// were acked (fast retransmit).
	OnLoss(now time.Time, lostBytes int)
	// OnTimeout reports that nothing was acked for a retransmission
	// timeout and a probe goes out.
	OnTimeout(now time.Time)
	// PacingRate is the rate, in bytes per second, to spread sends at.
	PacingRate() float64
	// Window is how many bytes of reliable datagrams may be unacked.
	Window() int
}

// AckEvent describes the acks carried by one incoming datagram.
type AckEvent struct {
	AckedBytes int // bytes of reliable datagrams newly acked
	InFlight   int // bytes still unacked afterwards
	// DeliveryRate is the rate, in bytes per second, at which the path
	// delivered data over the interval ending with the newest datagram
	// acked (draft-cheng-iccrg-delivery-rate-estimation); 0 if unknown.
	DeliveryRate float64
	// AppLimited is set when that datagram went out while the application
	// had too little to send to fill the window: the rate then says less
	// than the path could do.
	AppLimited bool
	// RTT is the newest sample; SRTT and MinRTT its smoothed value and the
	// lowest seen lately.
	RTT, SRTT, MinRTT time.Duration
}

// CongestionParams are what a controller starts from.
type CongestionParams struct {
	InitialRate  float64 // bytes per second, from Config.InitialDatagramRate
	MinRate      float64 // bytes per second, from Config.MinDatagramRate
	DatagramSize int     // Config.MaxDatagramSize
}

// NewDeliveryRateControl returns the default congestion controller. It
// estimates the path's bottleneck bandwidth as the highest delivery rate
// of the last ten round trips (what each delivered, over how long it took),
// and paces at it:
//
//   - slow start: the rate is pushed to 2.9 times the estimate, so that it
//     doubles each round trip, until the estimate stops growing by a
//     quarter for three round trips (the pipe is full); a round at a
//     lowered rate then drains the queue start-up built;
//   - then it cruises at the estimate, probing a quarter above it one round
//     trip in eight and draining below it in the next, an additive way of
//     finding bandwidth that appeared;
//   - random loss does not lower the estimate, so a few percent of loss
//     costs only the resends; a real bottleneck caps the delivery rate, and
//     with it the rate; when even the fastest round trip of two rounds
//     running is well above the path's minimum, a queue is standing at the
//     bottleneck: probing is gentler and the window shrinks to 1.25
//     bandwidth-delay products, which bounds that queue without lowering
//     the rate (so delay not of its making cannot talk the estimate down);
//   - heavy loss (over a quarter of the datagrams, counted over at least
//     sixty-four) is congestion the estimate did not see: the rate is cut
//     multiplicatively, and recovers by a tenth per round trip without loss
//     and per sixty-four datagrams without heavy loss.
//
// The window is two bandwidth-delay products, enough for acks that come in
// batches. Start-up also ends at a round trip losing a fifth of its
// datagrams (over at least 32): random loss of a few percent does not do
// that, overshooting a shallow queue does. This is the
// controller used when Config.CongestionControl is nil.
func NewDeliveryRateControl(p CongestionParams) CongestionControl {
	return &deliveryRate{p: p, state: drStartup, bw: p.InitialRate, cut: 1}
}

type drState uint8

const (
	drStartup drState = iota
	drDrain
	drCruise
)

const (
	startupGain      = 2.89 // 2/ln 2: doubles the delivery rate each round trip
	bwWindowRounds   = 10
	heavyLoss        = 0.25 // share of datagrams lost that is taken for congestion
	startupLoss      = 0.20 // share lost in a start-up round that ends start-up (well above random loss)
	gentleProbeGain  = 1.1  // probing gain while a queue stands
	queuedWindowGain = 1.25 // window, in bandwidth-delay products, while a queue stands
)

// drProbeGains is the cruise cycle: probe, drain, then six rounds at the
// estimate.
var drProbeGains = [...]float64{1.25, 0.75, 1, 1, 1, 1, 1, 1}

type deliveryRate struct {
	p     CongestionParams
	state drState
	bw    float64 // bottleneck bandwidth estimate, bytes/s
	// Max filter over rounds: the best sample of each of the last rounds.
	rounds    [bwWindowRounds]float64
	round     int
	roundEnd  time.Time
	fullBw    float64
	fullCount int
	cycle     int
	cycleAt   time.Time
	srtt      time.Duration
	minRTT    time.Duration
	// Heavy-loss detection, per round.
	roundStart           time.Time
	ackedRound           int // bytes acked this round
	ackedLoss, lostRound int // bytes acked and lost since the last loss check
	appLimitedRound      bool
	roundMinRTT          time.Duration
	queued               int     // rounds running with a standing queue
	cut                  float64 // 1, or less after heavy loss, back to 1 over time
	lostNow              int     // bytes lost this round
	baseLoss             float64 // share of datagrams lost, averaged over windows of 64
	lastRate             float64 // the last round's delivery rate, counted or not
	probeBase            float64 // the estimate when the probe under way began
	windows              int     // windows of 64 seen
}

func (c *deliveryRate) OnAck(now time.Time, a AckEvent) {
	c.srtt, c.minRTT = a.SRTT, a.MinRTT
	c.ackedRound += a.AckedBytes
	c.ackedLoss += a.AckedBytes
	c.appLimitedRound = c.appLimitedRound || a.AppLimited
	if a.RTT > 0 && (c.roundMinRTT == 0 || a.RTT < c.roundMinRTT) {
		c.roundMinRTT = a.RTT
	}
	if c.roundStart.IsZero() {
		c.roundStart = now
		c.roundEnd = now.Add(max(c.srtt, time.Millisecond))
	}
	if now.Before(c.roundEnd) {
		return
	}
	// A round trip has passed: what it delivered, over how long it took,
	// is the round's sample. Taken over the whole round rather than per
	// ack, it is not fooled by acks that arrive bunched. A round in which
	// the application had too little to send says only that the path can
	// do at least that much: it counts only if it beats the estimate.
	// Likewise a round sent under a heavy-loss cut: the rate was held
	// down on purpose, and counting it would make the estimate follow the
	// cut down round after round (at 20% random loss each way, a 1 MiB
	// transfer crawled at 100 kB/s for 13 s).
	//
	// Random loss makes a round deliver less than it sent: at a fifth lost,
	// pacing at what was delivered sends a fifth less next time, and the
	// estimate sinks round after round. Up to a fifth, what was lost counts
	// as carried; beyond, loss is congestion, which the cut answers.
	if dt := now.Sub(c.roundStart); dt > 0 {
		carried := float64(c.ackedRound)
		if c.ackedRound > 0 {
			lost := min(float64(c.lostNow), carried/4) // a fifth of the total
			carried += lost
		}
		rate := carried / dt.Seconds()
		c.lastRate = rate
		if !c.appLimitedRound && c.cut == 1 || rate > c.bw {
			c.rounds[c.round%bwWindowRounds] = rate
		}
	}
	c.endRound(now)
}

func (c *deliveryRate) endRound(now time.Time) {
	c.roundStart = now
	c.roundEnd = now.Add(max(c.srtt, time.Millisecond))
	best := 0.0
	for _, r := range c.rounds {
		best = max(best, r)
	}
	if best > 0 {
		c.bw = best
	}
	// Start-up overshooting a shallow queue: leave it at the first round
	// losing more than startupLoss (BBRv2), before the queue overflows for
	// long.
	if total := c.ackedLoss + c.lostRound; c.state == drStartup && total >= 32*c.p.DatagramSize &&
		float64(c.lostRound) > startupLoss*float64(total) {
		c.state = drDrain
	}
	delivered := c.ackedRound > 0
	c.ackedRound = 0
	// A standing queue: even the round's fastest round trip is well above
	// the path's minimum, two rounds running. The estimate runs a little
	// high (the best of ten noisy rounds; acks come bunched); the window
	// then bounds what that builds.
	if c.roundMinRTT > c.minRTT+max(c.minRTT/8, 2*time.Millisecond) {
		c.queued++
	} else {
		c.queued = 0
	}
	c.roundMinRTT = 0
	// Heavy loss: congestion that the delivery rate missed. Judged over
	// enough datagrams that random loss of a few percent never looks like
	// it.
	// Recovery is per round trip without loss as well as per window
	// without heavy loss: after a deep cut the rate may be so low that
	// sixty-four datagrams take many seconds, and a receiver refusing what
	// its buffer cannot hold looks like loss until the rate is down.
	recover := c.lostNow == 0 && delivered
	if total := c.ackedLoss + c.lostRound; total >= 64*c.p.DatagramSize {
		// Heavy is well above what the path loses anyway: random loss of
		// a fifth crossed a quarter in one window of sixty-four in eight,
		// and each cut cost a round of recovery.
		// The first window only learns the base: start-up's own
		// overshoot is answered by leaving start-up.
		f := float64(c.lostRound) / float64(total)
		threshold := max(heavyLoss, c.baseLoss+0.1)
		if c.windows == 0 {
			threshold, c.baseLoss = 1, f
		}
		c.windows++
		c.baseLoss += (f - c.baseLoss) / 8
		if f > threshold {
			c.cut = max(c.cut*0.7, 0.05)
			recover = false
			if c.state == drStartup {
				c.state = drCruise
			}
		} else {
			recover = true
		}
		c.ackedLoss, c.lostRound = 0, 0
	}
	if recover && c.cut < 1 {
		c.cut = min(1, c.cut*1.1)
	}
	c.lostNow = 0
	switch c.state {
	case drStartup:
		if c.bw >= c.fullBw*1.25 {
			c.fullBw = c.bw
			c.fullCount = 0
		} else if !c.appLimitedRound {
			// Only rounds that had enough to send tell that the pipe
			// is full.
			if c.fullCount++; c.fullCount >= 3 {
				c.state = drDrain
			}
		}
	case drDrain:
		c.state = drCruise
		c.cycle = 2
		c.cycleAt = now
	case drCruise:
		if c.cycle == 0 && !c.appLimitedRound && c.queued == 0 && c.lastRate >= 1.15*c.probeBase {
			// The probe went through whole, no queue behind it: there
			// may be more, so probe again at once rather than a cycle
			// later. A start-up ended early (a stall of the host looks
			// like a full pipe) otherwise takes seconds to find the rest.
			c.probeBase = c.bw
			break
		}
		c.cycle = (c.cycle + 1) % len(drProbeGains)
		if c.cycle == 0 {
			c.probeBase = c.bw
		}
	}
	c.round++
	c.rounds[c.round%bwWindowRounds] = 0
	c.appLimitedRound = false
}

func (c *deliveryRate) OnLoss(now time.Time, lostBytes int) {
	c.lostRound += lostBytes
	c.lostNow += lostBytes
}

// OnTimeout leaves the estimate alone: a probe timeout says a datagram or
// its ack went missing, not that the path slowed; if it did, the delivery
// rate shows it within ten round trips.
func (c *deliveryRate) OnTimeout(now time.Time) {}

func (c *deliveryRate) gain() float64 {
	switch c.state {
	case drStartup:
		return startupGain
	case drDrain:
		return 1 / startupGain
	}
	g := drProbeGains[c.cycle]
	if c.queued >= 1 && g > 1 {
		// A queue stands: probe gently. Not at all would trap the rate
		// when the delay is not ours.
		return gentleProbeGain
	}
	return g
}

func (c *deliveryRate) PacingRate() float64 {
	return max(c.gain()*c.bw*c.cut, c.p.MinRate)
}

// Window is two bandwidth-delay products, taken with the minimum round
// trip (the smoothed one grows with the queue we build), but at least a
// millisecond of it: on loopback the minimum is microseconds while acks
// come in batches a scheduling quantum apart.
func (c *deliveryRate) Window() int {
	rtt := max(c.minRTT, min(c.srtt, time.Millisecond))
	gain := 2.0
	switch {
	case c.state == drStartup:
		gain = startupGain
	case c.queued >= 2:
		// A queue stands at the bottleneck: keep at most a quarter of a
		// bandwidth-delay product in it, whatever the estimate says.
		gain = queuedWindowGain
	}
	w := gain * c.bw * c.cut * rtt.Seconds()
	return int(max(w, float64(16*c.p.DatagramSize)))
}

// NewAIMDControl returns a classic controller, like the reference
// implementation's: slow start doubling the rate each round trip until the
// first loss, then additive increase (one datagram more each round trip)
// and a multiplicative decrease by half on each round trip with loss or a
// timeout. It treats any loss as congestion, so random loss holds it far
// below what the path could carry.
func NewAIMDControl(p CongestionParams) CongestionControl {
	return &aimd{p: p, rate: p.InitialRate, ssthresh: math.Inf(1)}
}

type aimd struct {
	p        CongestionParams
	rate     float64 // bytes/s
	ssthresh float64
	srtt     time.Duration
	lastCut  time.Time
}

func (c *aimd) OnAck(now time.Time, a AckEvent) {
	c.srtt = a.SRTT
	s := max(a.SRTT, 100*time.Microsecond).Seconds()
	if c.rate < c.ssthresh {
		c.rate += float64(a.AckedBytes) / s
	} else {
		c.rate += float64(a.AckedBytes) * float64(c.p.DatagramSize) / (c.rate * s * s)
	}
}

func (c *aimd) OnLoss(now time.Time, lostBytes int) { c.decrease(now) }

func (c *aimd) OnTimeout(now time.Time) { c.decrease(now) }

func (c *aimd) decrease(now time.Time) {
	if now.Sub(c.lastCut) < c.srtt {
		return
	}
	c.lastCut = now
	c.rate = max(c.p.MinRate, c.rate/2)
	c.ssthresh = c.rate
}

func (c *aimd) PacingRate() float64 { return max(c.rate, c.p.MinRate) }

func (c *aimd) Window() int {
	w := 2 * c.rate * max(c.srtt, time.Millisecond).Seconds()
	return int(max(w, float64(4*c.p.DatagramSize)))
}
