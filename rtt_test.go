package knet

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
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
