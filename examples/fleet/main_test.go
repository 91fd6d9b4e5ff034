package main

import (
	"bytes"
	"strings"
	"testing"
	"time"
)

// The fleet's round with its servers on goroutines: every player of the
// drained server moves to another and no reliable message is lost (run
// fails otherwise), on a clean network and at 5% loss each way; the
// report says so, and that the drain left the moving players nothing
// unacknowledged (the bots resend nothing of their own).
//
// At 5% loss, before a drain waited for what its players had in flight,
// each round lost a few of the messages the players sent as the drain
// reached them.
func TestFleetRound(t *testing.T) {
	for _, loss := range []float64{0, 0.05} {
		t.Run(map[bool]string{false: "clean", true: "loss5"}[loss > 0], func(t *testing.T) {
			var out bytes.Buffer
			err := run(options{players: 12, servers: 3, duration: 2 * time.Second, every: 20 * time.Millisecond, loss: loss, spawn: spawnInProcess}, &out)
			t.Log("\n" + out.String())
			if err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(out.String(), "players moved off server 2: 4 of 12") {
				t.Error("the matchmaker placed 4 players on each server; the 4 of server 2 should have moved")
			}
			if !strings.Contains(out.String(), " 0 lost") {
				t.Error("reliable messages lost")
			}
			if !strings.Contains(out.String(), "; 0 left unacknowledged") {
				t.Error("a connection ended with messages unacknowledged")
			}
		})
	}
}
