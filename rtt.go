package knet

import "time"

// rttEstimator follows RFC 6298: SRTT, RTTVAR and the retransmission
// timeout derived from them.
type rttEstimator struct {
	srtt, rttvar, min, latest time.Duration
	samples                   int
}

// initialRTO is the retransmission timeout before the first sample
// (RFC 6298 2.1).
const initialRTO = time.Second

// sampleHandshake takes the handshake's round trip d (a ConnectSyn to its
// ConnectSynAck, a ConnectSynAck to the ConnectAck) as a sample, unless it
// is above initialRTO: then it is not a round trip of the path but a peer
// that took its time, an Admit hook that did, or an answer to a resend we
// cannot tell from one to the first send (a ConnectAck resent after the
// client's timeout). Taken, a ConnectAck held 9s made the smoothed RTT 9s,
// and with it how long acks were repeated (issue 38). Ignored, the
// estimator stays as before any sample (the initial timeout, one second)
// until the first ack of data; a path slower than that takes its first
// sample there.
func (r *rttEstimator) sampleHandshake(d time.Duration) {
	if d <= initialRTO {
		r.sample(d)
	}
}

func (r *rttEstimator) sample(d time.Duration) {
	if d <= 0 {
		d = time.Microsecond
	}
	r.latest = d
	if r.samples == 0 || d < r.min {
		r.min = d
	}
	if r.samples == 0 {
		r.srtt = d
		r.rttvar = d / 2
	} else {
		diff := r.srtt - d
		if diff < 0 {
			diff = -diff
		}
		r.rttvar = (3*r.rttvar + diff) / 4
		r.srtt = (7*r.srtt + d) / 8
	}
	r.samples++
}

// rto is SRTT + max(G, 4*RTTVAR) clamped to [floor, ceiling]; before any
// sample it is initial.
func (r *rttEstimator) rto(initial, floor, ceiling time.Duration) time.Duration {
	if r.samples == 0 {
		return initial
	}
	v := max(4*r.rttvar, time.Millisecond)
	return min(max(r.srtt+v, floor), ceiling)
}
