package main

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"
)

// The three roles on loopback: the joiner connects to the host's Listener
// and each hears the other.
func TestRendezvous(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var mu sync.Mutex
	var lines []string
	logf := func(f string, a ...any) {
		mu.Lock()
		defer mu.Unlock()
		lines = append(lines, fmt.Sprintf(f, a...))
	}
	if err := runAll(ctx, logf); err != nil {
		t.Fatal(err)
	}
	out := strings.Join(lines, "\n")
	t.Log(out)
	for _, want := range []string{"joiner: route: direct", `says "hello from the joiner" (direct)`, `the host says "welcome to game-1"`} {
		if !strings.Contains(out, want) {
			t.Errorf("no %q in the log", want)
		}
	}
}
