package main

import (
	"bytes"
	"strings"
	"testing"
	"time"
)

// The fleet's round with its servers on goroutines: every player of the
// drained server moves to another and no reliable message is lost (run
// fails otherwise); the report says so.
func TestFleetRound(t *testing.T) {
	var out bytes.Buffer
	err := run(options{players: 12, servers: 3, duration: 2 * time.Second, every: 50 * time.Millisecond, spawn: spawnInProcess}, &out)
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
}
