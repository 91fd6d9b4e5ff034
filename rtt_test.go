package knet

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/netsim"
)

func TestRTTEstimator(t *testing.T) {
	var r rttEstimator
	assert.Equal(t, time.Second, r.rto(time.Second, 5*time.Millisecond, 2*time.Second))
	r.sample(100 * time.Millisecond)
	assert.Equal(t, 100*time.Millisecond, r.srtt)
	assert.Equal(t, 50*time.Millisecond, r.rttvar)
	assert.Equal(t, 300*time.Millisecond, r.rto(time.Second, 5*time.Millisecond, 2*time.Second))
	r.sample(200 * time.Millisecond)
	// RFC 6298: RTTVAR = 3/4*50 + 1/4*100 = 62.5ms; SRTT = 7/8*100 + 1/8*200 = 112.5ms.
	assert.Equal(t, 62500*time.Microsecond, r.rttvar)
	assert.Equal(t, 112500*time.Microsecond, r.srtt)
	assert.Equal(t, 100*time.Millisecond, r.min)
	assert.Equal(t, 362500*time.Microsecond, r.rto(time.Second, 5*time.Millisecond, 2*time.Second))
	assert.Equal(t, 200*time.Millisecond, r.rto(time.Second, 5*time.Millisecond, 200*time.Millisecond), "ceiling")
	var fast rttEstimator
	fast.sample(50 * time.Microsecond)
	assert.Equal(t, 5*time.Millisecond, fast.rto(time.Second, 5*time.Millisecond, 2*time.Second), "floor")
}

// A handshake's round trip above the initial timeout is no sample: a
// ConnectAck held 3s left the server's smoothed RTT at 3s.
func TestSessionLateConnectAckNoRTTSample(t *testing.T) {
	path := netsim.Params{Delay: 10 * time.Millisecond}
	p := newSecureSimPair(t, nil, nil, path, path)
	var until time.Time
	p.drop = func(from int, b []byte) bool {
		if from != 0 || p.client().state != stateOK {
			return false
		}
		if until.IsZero() {
			until = p.now.Add(3 * time.Second)
		}
		return p.now.Before(until)
	}
	p.connect()
	srv := p.server()
	t.Logf("established after %v; the server's RTT samples %d, smoothed %v", p.now.Sub(timeZero), srv.loss.rtt.samples, srv.loss.rtt.srtt)
	require.True(t, p.now.Sub(timeZero) > 3*time.Second)
	assert.Zero(t, srv.loss.rtt.samples)
	assert.Equal(t, initialRTO, srv.loss.rto())

	var r rttEstimator
	r.sampleHandshake(initialRTO + time.Millisecond)
	assert.Zero(t, r.samples)
	r.sampleHandshake(300 * time.Millisecond)
	assert.Equal(t, 300*time.Millisecond, r.srtt)
}
