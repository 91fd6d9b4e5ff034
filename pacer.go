package knet

import (
	"math"
	"time"
)

// pacer is a token bucket: rate tokens a second, at most burst banked.
type pacer struct {
	tokens float64
	last   time.Time
}

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

// wait is how long until need tokens at rate.
func (p *pacer) wait(need, rate float64) time.Duration {
	if p.tokens >= need || rate <= 0 {
		return 0
	}
	return time.Duration((need - p.tokens) / rate * float64(time.Second))
}

// rateControl applies a congestion controller and the protocol's limits to
// the datagrams a session sends.
type rateControl struct {
	cc      CongestionControl
	minRate float64 // datagrams/s always allowed
	maxRate float64 // datagrams/s the peer asked for, 0 if no limit
	dgSize  int
	bytes   pacer // the controller's pacing, in bytes
	peer    pacer // the peer's limit, in datagrams
	// forceRate, when set (tests), replaces the controller's pacing: so
	// many full datagrams a second.
	forceRate float64
}

const (
	minBurstDatagrams = 16 // may always leave back to back
	// burstTime is how much of the pacing rate may leave at once: sub-
	// millisecond timers are not to be had.
	burstTime = 2 * time.Millisecond
)

func newRateControl(cfg *config) rateControl {
	p := CongestionParams{
		InitialRate:  cfg.initialRate * float64(cfg.maxDatagram),
		MinRate:      cfg.minRate * float64(cfg.maxDatagram),
		DatagramSize: cfg.maxDatagram,
	}
	mk := cfg.congestion
	if mk == nil {
		mk = NewDeliveryRateControl
	}
	cc := mk(p)
	if cc == nil {
		cc = NewDeliveryRateControl(p) // a nil controller would crash the connection
	}
	return rateControl{cc: cc, minRate: cfg.minRate, dgSize: cfg.maxDatagram}
}

// byteRate is the pacing rate in bytes per second.
func (r *rateControl) byteRate() float64 {
	if r.forceRate > 0 {
		return r.forceRate * float64(r.dgSize)
	}
	return max(r.cc.PacingRate(), r.minRate*float64(r.dgSize))
}

// canSend reports whether a datagram of size bytes may go now.
func (r *rateControl) canSend(now time.Time, size int) bool {
	rate := r.byteRate()
	r.bytes.refill(now, rate, max(minBurstDatagrams*float64(r.dgSize), rate*burstTime.Seconds()))
	if r.bytes.tokens < float64(size) {
		return false
	}
	return r.peerAllows(now)
}

// peerAllows reports whether the peer's FlowControlRequest leaves room for
// one more datagram now. MinDatagramRate is always allowed.
func (r *rateControl) peerAllows(now time.Time) bool {
	if r.maxRate <= 0 {
		return true
	}
	rate := max(r.maxRate, r.minRate)
	r.peer.refill(now, rate, max(minBurstDatagrams/4, rate*burstTime.Seconds()))
	return r.peer.tokens >= 1
}

// sent spends the tokens of a paced datagram.
func (r *rateControl) sent(size int) {
	r.bytes.tokens -= float64(size)
	r.peer.tokens--
}

// sentUnpaced spends against the peer's limit only.
func (r *rateControl) sentUnpaced() { r.peer.tokens-- }

// nextSend is when a datagram of size bytes may next go.
func (r *rateControl) nextSend(now time.Time, size int) time.Time {
	w := r.bytes.wait(float64(size), r.byteRate())
	if r.maxRate > 0 {
		w = max(w, r.peer.wait(1, max(r.maxRate, r.minRate)))
	}
	return now.Add(max(w, 20*time.Microsecond))
}

// window is how many bytes of reliable datagrams may be unacked.
func (r *rateControl) window() int {
	if r.forceRate > 0 {
		return 1 << 30
	}
	return r.cc.Window()
}

// datagramRate is the rate now allowed, in datagrams per second, for Stats.
func (r *rateControl) datagramRate() float64 {
	d := r.byteRate() / float64(r.dgSize)
	if r.maxRate > 0 {
		d = min(d, max(r.maxRate, r.minRate))
	}
	return d
}
