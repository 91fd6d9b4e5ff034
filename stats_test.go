package knet

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The rate ring keeps the message and PacketID counters in their low 32
// bits: rates across the wrap are still right, and rates fall when the
// traffic stops.
func TestRateRingAcrossWrap(t *testing.T) {
	var r rateRing
	t0 := time.Now()
	st := Stats{BytesSent: 1 << 40, MessagesSent: 1<<32 - 50, MessagesReceived: 7}
	r.note(t0, &st, 1<<32-10, 1<<32-10)
	for k := 1; k <= 8; k++ {
		st.BytesSent += 1000
		st.MessagesSent += 25
		r.note(t0.Add(time.Duration(k)*rateStep), &st, 1<<32-10+uint64(k)*10, 1<<32-10+uint64(k)*9)
	}
	var got Stats
	r.fill(t0.Add(2*time.Second), &got)
	require.InDelta(t, 4000, got.SendBytesPerSecond, 1e-6)
	require.InDelta(t, 100, got.SendMessagesPerSecond, 1e-6)
	require.Zero(t, got.ReceiveMessagesPerSecond)
	require.InDelta(t, 0.1, got.LossRate, 1e-9)

	// Two seconds of silence: the window starts at the last note.
	var quiet Stats
	r.note(t0.Add(4*time.Second), &st, 1<<32-10+80, 1<<32-10+72)
	r.fill(t0.Add(4*time.Second+time.Second), &quiet)
	require.Less(t, quiet.SendBytesPerSecond, got.SendBytesPerSecond)
}
