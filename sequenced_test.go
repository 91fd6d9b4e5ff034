package knet

import (
	"context"
	"encoding/binary"
	"fmt"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestSequencedDeliversWhatArrives: a sequenced channel through loss and
// jitter that reorders its messages delivers what arrives in time, never an
// older message after a newer one (issue 22, part 6). 3,000 messages a
// millisecond apart, each echoed by the server on its own sequenced
// channel, over Simulation{Loss: 0.1, Delay: 1ms, Jitter: 9ms} on both
// sides: about 90 % reach the server and 81 % come back. When a message
// waiting for a lost one was itself waited for by a later one that arrived
// first, and the later one's reorder window ran out first, the waiting
// message was dropped though it had arrived: the server delivered 2444 and
// 1922 came back.
func TestSequencedDeliversWhatArrives(t *testing.T) {
	t.Parallel()
	const n = 3000
	for seed := uint64(1); seed <= 3; seed++ {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				nw := memNet(t)
				sim := func(s uint64) *Simulation {
					return &Simulation{Loss: 0.1, Delay: time.Millisecond, Jitter: 9 * time.Millisecond, Seed: s}
				}
				scfg := testConfig()
				scfg.Simulate = sim(2 * seed)
				l := nw.listen(t, scfg)
				atServer := make(chan int, 1)
				go func() {
					c, err := l.AcceptConn(context.Background())
					if err != nil {
						atServer <- 0
						return
					}
					got := 0
					for {
						ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
						m, err := c.Receive(ctx)
						cancel()
						if err != nil {
							atServer <- got
							return
						}
						got++
						require.NoError(t, c.Send(Message{ID: 100, Payload: m.Payload, InOrder: true, Channel: 1}))
					}
				}()
				ccfg := testConfig()
				ccfg.Simulate = sim(2*seed + 1)
				c := nw.dial(t, l.Addr().String(), ccfg)
				back := make(chan int, 1)
				go func() {
					last, got := -1, 0
					for {
						ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
						m, err := c.Receive(ctx)
						cancel()
						if err != nil {
							back <- got
							return
						}
						k := int(binary.LittleEndian.Uint32(m.Payload))
						assert.Greater(t, k, last, "an older message after a newer one")
						last = k
						got++
					}
				}()
				tick := time.NewTicker(time.Millisecond)
				for i := range n {
					<-tick.C
					var b [8]byte
					binary.LittleEndian.PutUint32(b[:], uint32(i))
					require.NoError(t, c.Send(Message{ID: 100, Payload: b[:], InOrder: true, Channel: 1}))
				}
				tick.Stop()
				server, client := <-atServer, <-back
				t.Logf("of %d: %d at the server (%.1f %%), %d back (%.1f %%)", n, server, 100*float64(server)/n, client, 100*float64(client)/n)
				// 10 % loss leaves 90 % at the server and 81 % back;
				// what comes later than the reorder window allows is
				// dropped, a few percent at most.
				assert.GreaterOrEqual(t, server, n*85/100)
				assert.GreaterOrEqual(t, client, n*73/100)
			})
		})
	}
}
