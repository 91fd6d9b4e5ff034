package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"regexp"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// lockedBuffer is the run's output, read by the test while the run writes.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// The arena runs with two bots over each transport until every bot has
// had botFed snapshots; the HTTP side serves the page and the metrics
// meanwhile; then the run ends as on SIGTERM: the drain tells every bot
// closeDrain, waits for all of them and returns without error. (The page
// in a browser: clients/typescript/test/arena.test.js.)
func TestArena(t *testing.T) {
	const perTransport = 2
	fed := make(chan struct{})
	ctx, sigterm := context.WithCancel(context.Background())
	defer sigterm()
	var out lockedBuffer
	type result struct {
		reports []transportReport
		err     error
	}
	done := make(chan result, 1)
	go func() {
		rs, err := run(ctx, options{addr: "127.0.0.1:0", bots: perTransport, fed: fed}, &out)
		done <- result{rs, err}
	}()
	select {
	case <-fed:
	case r := <-done:
		t.Fatalf("the run ended before every bot had %d snapshots: %v\n%s", botFed, r.err, out.String())
	case <-time.After(30 * time.Second): // a failure detector: fed comes in about a second
		t.Fatalf("the bots had no %d snapshots each in 30s\n%s", botFed, out.String())
	}

	// The page and the metrics, while the bots play.
	m := regexp.MustCompile(`http://([0-9.:]+)/`).FindStringSubmatch(out.String())
	require.NotNil(t, m, "the run names its HTTP address:\n%s", out.String())
	page := get(t, "http://"+m[1]+"/")
	assert.Contains(t, page, `src="game.js"`, "the page at /")
	assert.Contains(t, get(t, "http://"+m[1]+"/game.js"), "from './knet.js'", "the page's game loop")
	assert.Contains(t, get(t, "http://"+m[1]+"/knet.js"), "noble", "the bundled client, with its cryptography")
	var metrics map[string]transportStats
	require.NoError(t, json.Unmarshal([]byte(get(t, "http://"+m[1]+"/metrics")), &metrics))
	for _, tr := range botTransports {
		assert.Equal(t, perTransport, metrics[tr.String()].Players, "/metrics: %v players", tr)
		assert.NotZero(t, metrics[tr.String()].Sent, "/metrics: %v messages sent", tr)
		assert.NotZero(t, metrics[tr.String()].Received, "/metrics: %v messages received", tr)
	}

	sigterm()
	var r result
	select {
	case r = <-done:
	case <-time.After(30 * time.Second): // the drain's own bound is 5s
		t.Fatalf("the run did not end after its drain\n%s", out.String())
	}
	t.Log("\n" + out.String())
	require.NoError(t, r.err, "the drain")
	require.Len(t, r.reports, len(botTransports))
	for _, rep := range r.reports {
		assert.Equal(t, perTransport, rep.Bots, "%v", rep.Transport)
		assert.GreaterOrEqual(t, rep.Snapshots, perTransport*botFed, "%v: snapshots", rep.Transport)
		assert.Positive(t, rep.P50, "%v: snapshot age", rep.Transport)
		assert.Equal(t, perTransport, rep.Drained, "%v: bots told closeDrain; others ended with %v", rep.Transport, rep.Errs)
	}
	assert.Contains(t, out.String(), "drained: 0 players left (err <nil>)")
}

func get(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode, url)
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return string(b)
}
