package knet

import "time"

// rttEstimator follows RFC 6298: SRTT, RTTVAR and the retransmission
// timeout derived from them.
type rttEstimator struct {
	srtt, rttvar, min, latest time.Duration
	samples                   int
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
