//go:build !js

package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"image/png"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/coder/websocket"
	"github.com/knet-go/knet"
	"github.com/knet-go/knet/internal/testtool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The bot in a real browser: headless Chromium loads the page from the
// example's server on loopback, runs the bot (Go compiled to WebAssembly)
// in its JavaScript engine, over the browser's WebSocket, and the bot
// posts its report. The tests need chromium (.ci/run installs it); without
// it they skip.

// browserWait bounds every wait on the browser.
const browserWait = 60 * time.Second

var bot struct {
	once sync.Once
	dir  string
	wasm string
	exec string
	err  error
}

// botFiles builds the bot for the browser once, and finds wasm_exec.js.
func botFiles(t *testing.T) (wasm, execJS string) {
	t.Helper()
	bot.once.Do(func() {
		// go test caches a passing result by the files the test
		// binary is built from and those the test opens: the bot's
		// source, built for js only, is one of the latter.
		if _, bot.err = os.ReadFile("bot.go"); bot.err != nil {
			return
		}
		if bot.dir, bot.err = os.MkdirTemp("", "wasmbot-test"); bot.err != nil {
			return
		}
		bot.wasm = filepath.Join(bot.dir, "bot.wasm")
		if bot.err = buildBot(bot.wasm); bot.err != nil {
			return
		}
		bot.exec, bot.err = wasmExecJS()
	})
	require.NoError(t, bot.err)
	return bot.wasm, bot.exec
}

func TestMain(m *testing.M) {
	code := m.Run()
	if bot.dir != "" {
		os.RemoveAll(bot.dir)
	}
	os.Exit(code)
}

// startServer runs the example's server on an httptest.Server.
func startServer(t *testing.T) (*server, string) {
	wasm, execJS := botFiles(t)
	s, err := newServer(wasm, execJS)
	require.NoError(t, err)
	hs := httptest.NewServer(s)
	t.Cleanup(func() {
		hs.Close()
		s.Close()
	})
	return s, hs.URL + "/"
}

// chromium returns the path of Chromium; without it, the test skips
// (fails with KNET_REQUIRE_TOOLS=1, as in .ci/run: internal/testtool).
func chromium(t *testing.T) string {
	t.Helper()
	return testtool.Need(t, "chromium", "apt-get install chromium", "chromium-browser")
}

// startChromium opens url in headless Chromium (at path), which runs
// until the test ends; it returns what Chromium writes on stderr, line by
// line.
func startChromium(t *testing.T, path, url string, args ...string) <-chan string {
	t.Helper()
	args = append([]string{
		"--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
		"--no-first-run", "--user-data-dir=" + t.TempDir(), "--window-size=800,600",
	}, args...)
	cmd := exec.Command(path, append(args, url)...)
	stderr, err := cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	lines := make(chan string, 64)
	done := make(chan struct{})
	go func() {
		defer close(done)
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			select {
			case lines <- sc.Text():
			default: // nobody is asking: Chromium's chatter
			}
		}
	}()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-done
		cmd.Wait()
	})
	return lines
}

// awaitReport waits for the bot's post.
func awaitReport(t *testing.T, s *server) report {
	t.Helper()
	select {
	case r := <-s.reports:
		return r
	case <-time.After(browserWait):
		t.Fatalf("no report from the bot within %v", browserWait)
	}
	panic("unreachable")
}

// The bot, in Chromium's engine, reaches the Go server over WebSocket
// and every delivery mode crosses: what the bot reports and what the
// server saw agree.
func TestBrowserBotExchange(t *testing.T) {
	browser := chromium(t)
	s, url := startServer(t)
	start := time.Now()
	startChromium(t, browser, url)
	rep := awaitReport(t, s)
	t.Logf("the bot reported after %v: %+v", time.Since(start), rep)
	assert.True(t, rep.OK, "the bot's error: %s", rep.Error)
	assert.Equal(t, "websocket", rep.Transport)
	assert.Equal(t, "spec", rep.Dialect, "the server said knet's hello")
	assert.Equal(t, "welcome, "+payload, rep.Welcome, "the Admit reply reached the browser")
	assert.Contains(t, rep.DialUDP, "DialWebSocket", "Dial in a browser says what to use instead")
	assert.Equal(t, perMode, rep.Echoed["reliable"])
	assert.Equal(t, perMode, rep.Echoed["ordered"])
	assert.True(t, rep.InOrder)
	assert.True(t, rep.BigOK)
	assert.Empty(t, rep.CloseErr, "a graceful close returns nil in the browser")

	var v seen
	select {
	case v = <-s.seen:
	case <-time.After(browserWait):
		t.Fatal("the server's connection did not end")
	}
	t.Logf("the server saw: %+v", v)
	assert.Equal(t, knet.TransportWebSocket, v.Transport)
	assert.Equal(t, payload, v.Payload)
	for _, m := range modes {
		switch m.name {
		case "reliable", "ordered":
			assert.Equal(t, perMode, v.Received[m.id], m.name)
		default:
			assert.GreaterOrEqual(t, v.Received[m.id], 1, m.name)
		}
		assert.LessOrEqual(t, rep.Echoed[m.name], v.Received[m.id], "%s: no more echoes than messages", m.name)
	}
	assert.Equal(t, bigSize, v.BigSize)
	var de *knet.DisconnectError
	require.ErrorAs(t, v.CloseError, &de, "the bot closed with a reason")
	assert.Equal(t, reason, de.Reason)
	assert.Equal(t, 0, s.l.Stats().Connections, "nothing left on the listener")
}

// The page shows the bot's success: a screenshot (Chrome DevTools
// protocol, taken once the bot has posted) has the success colour.
func TestBrowserPageScreenshot(t *testing.T) {
	browser := chromium(t)
	s, url := startServer(t)
	lines := startChromium(t, browser, url, "--remote-debugging-port=0")
	devtools := ""
	deadline := time.After(browserWait)
	for devtools == "" {
		select {
		case l := <-lines:
			if _, u, ok := strings.Cut(l, "DevTools listening on "); ok {
				devtools = strings.TrimSpace(u)
			}
		case <-deadline:
			t.Fatal("chromium did not open its DevTools port")
		}
	}
	rep := awaitReport(t, s)
	require.True(t, rep.OK, "the bot's error: %s", rep.Error)

	ctx, cancel := context.WithTimeout(context.Background(), browserWait)
	defer cancel()
	shot := screenshot(t, ctx, devtools)
	img, err := png.Decode(bytes.NewReader(shot))
	require.NoError(t, err)
	b := img.Bounds()
	require.Greater(t, b.Dx(), 100)
	require.Greater(t, b.Dy(), 100)
	want := [3]uint32{0, 160, 64} // successColor
	for _, p := range [][2]int{{b.Min.X + 2, b.Min.Y + 2}, {b.Max.X - 3, b.Max.Y - 3}, {b.Min.X + 2, b.Max.Y - 3}} {
		r, g, bl, _ := img.At(p[0], p[1]).RGBA()
		got := [3]uint32{r >> 8, g >> 8, bl >> 8}
		assert.Equal(t, want, got, "pixel %v: the page's background", p)
	}
	if t.Failed() {
		f := filepath.Join(t.TempDir(), "page.png")
		os.WriteFile(f, shot, 0o644)
		t.Logf("screenshot: %s", f)
	}
}

// screenshot captures the page that Chromium, whose DevTools browser
// endpoint is devtools, shows: the protocol's Page.captureScreenshot.
func screenshot(t *testing.T, ctx context.Context, devtools string) []byte {
	t.Helper()
	// The browser endpoint's host serves the list of pages.
	host := strings.TrimPrefix(devtools, "ws://")
	host, _, _ = strings.Cut(host, "/")
	req, err := http.NewRequestWithContext(ctx, "GET", "http://"+host+"/json/list", nil)
	require.NoError(t, err)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	var targets []struct{ Type, URL, WebSocketDebuggerURL string }
	err = json.NewDecoder(resp.Body).Decode(&targets)
	resp.Body.Close()
	require.NoError(t, err)
	page := ""
	for _, tg := range targets {
		if tg.Type == "page" {
			page = tg.WebSocketDebuggerURL
		}
	}
	require.NotEmpty(t, page, "no page among %+v", targets)

	ws, _, err := websocket.Dial(ctx, page, nil)
	require.NoError(t, err)
	defer ws.CloseNow()
	ws.SetReadLimit(32 << 20)
	cmd := `{"id":1,"method":"Page.captureScreenshot","params":{"format":"png"}}`
	require.NoError(t, ws.Write(ctx, websocket.MessageText, []byte(cmd)))
	for {
		_, b, err := ws.Read(ctx)
		require.NoError(t, err)
		var r struct {
			ID     int
			Result struct{ Data string }
			Error  *struct{ Message string }
		}
		require.NoError(t, json.Unmarshal(b, &r))
		if r.ID != 1 {
			continue // an event
		}
		require.Nil(t, r.Error, "Page.captureScreenshot: %+v", r.Error)
		shot, err := base64.StdEncoding.DecodeString(r.Result.Data)
		require.NoError(t, err)
		return shot
	}
}
