package knet

import (
	"context"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Steady-state allocations per message, counted across the whole process
// (both connections' goroutines and the socket readers). .ci/run runs these
// without -race, under which sync.Pool drops items on purpose.

func TestNoAllocsPerMessage(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts are meaningless under -race; .ci/run runs this test without it")
	}
	priv, pub, err := GenerateKey()
	require.NoError(t, err)
	// A secure session too: its two ends' datagrams differ in size (the
	// client's carry a connection ID), which once made every flush
	// allocate a write batch.
	t.Run("plaintext", func(t *testing.T) { noAllocsPerMessage(t, &Config{DisconnectTimeout: time.Second}) })
	t.Run("secure", func(t *testing.T) {
		noAllocsPerMessage(t, &Config{DisconnectTimeout: time.Second, PrivateKey: priv, ServerKey: pub})
	})
	// The C++ implementation's wire, whose reading and building are its
	// own (session_cpp.go, session_cppsend.go).
	t.Run("reference", func(t *testing.T) {
		noAllocsPerMessage(t, &Config{DisconnectTimeout: time.Second, Dialect: DialectReference})
	})
}

func noAllocsPerMessage(t *testing.T, cfg *Config) {
	client, server := benchPair(t, cfg)
	ctx := context.Background()
	buf := make([]byte, 2048)
	small := make([]byte, 32)
	for _, tt := range []struct {
		name  string
		batch int
		m     Message
	}{
		{"reliable round trip", 1, Message{ID: 6, Payload: small, Reliable: true}},
		{"unreliable round trip", 1, Message{ID: 7, Payload: small}},
		{"reliable in-order round trip", 1, Message{ID: 8, Payload: small, Reliable: true, InOrder: true, Channel: 3}},
		{"16 reliable coalesced", 16, Message{ID: 9, Payload: small, Reliable: true}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			run := func() {
				for range tt.batch {
					require.NoError(t, client.Send(tt.m))
				}
				for range tt.batch {
					_, _, err := server.ReceiveInto(ctx, buf)
					require.NoError(t, err)
				}
			}
			for range 2000 { // warm up pools, queues and maps
				run()
			}
			allocs := steadyAllocs(2000, run)
			assert.Zero(t, allocs, "allocations per %d message(s)", tt.batch)
		})
	}
}

// steadyAllocs is testing.AllocsPerRun(runs, f) for traffic over real
// sockets, measured up to three times: the lowest. A hiccup of a shared
// machine (an ack or a timer late) can leave more messages in flight
// than the warm-up ever had, and the connection's free lists grow once
// for it (TestGroupPollNoAllocs, 1 to 3 times in 100); steady traffic
// allocates nothing in a window without one, and traffic that allocates
// on every message does in each.
func steadyAllocs(runs int, f func()) float64 {
	best := testing.AllocsPerRun(runs, f)
	for i := 0; i < 2 && best > 0; i++ {
		best = min(best, testing.AllocsPerRun(runs, f))
	}
	return best
}

func TestReadWriteNoAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts are meaningless under -race; .ci/run runs this test without it")
	}
	client, server := benchPair(t, &Config{DisconnectTimeout: time.Second})
	out := []byte("a small chunk of a byte stream")
	in := make([]byte, 64)
	run := func() {
		_, err := client.Write(out)
		require.NoError(t, err)
		n := 0
		for n < len(out) {
			k, err := server.Read(in[n:])
			require.NoError(t, err)
			n += k
		}
	}
	for range 2000 {
		run()
	}
	assert.Zero(t, steadyAllocs(2000, run))
}

// Every connection holds a Conn and a session: a field added to either
// must not tip it into the next allocation size class unnoticed (a
// thousand idle connections pay it a thousand times). The limits are the
// size classes they fit in today; raise one only knowingly.
func TestConnStateSizes(t *testing.T) {
	for _, c := range []struct {
		what       string
		size, most uintptr
	}{
		{"Conn", unsafe.Sizeof(Conn{}), 896},
		{"session", unsafe.Sizeof(session{}), 2688},
		{"rateRing", unsafe.Sizeof(rateRing{}), 448},
	} {
		require.LessOrEqual(t, c.size, c.most, "%s is %d bytes", c.what, c.size)
	}
}
