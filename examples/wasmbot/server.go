//go:build !js

// Command wasmbot serves a page whose Go program, compiled to WebAssembly,
// reaches a kNet server from the browser over WebSocket.
//
//	go run ./examples/wasmbot                # then open http://localhost:8080/
//	go run ./examples/wasmbot -addr :9000 -wasm bot.wasm
//
// The server builds the bot (this package, GOOS=js GOARCH=wasm) into a
// temporary directory at start unless -wasm names one built already, and
// serves, on one HTTP address: the page (index.html), Go's wasm_exec.js,
// the bot, the kNet endpoint (/knet: a Listener's WebSocketHandler) and
// /result, where the bot posts its report. The bot connects, sends
// messages in every delivery mode and a large one, which the server
// echoes, and turns the page green if all came back as each mode
// promises, red otherwise.
package main

import (
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"

	"github.com/knet-go/knet"
)

//go:embed index.html
var indexHTML []byte

// botPackage is the bot's import path, built for the browser.
const botPackage = "github.com/knet-go/knet/examples/wasmbot"

func main() {
	addr := flag.String("addr", "localhost:8080", "HTTP address to serve on")
	wasm := flag.String("wasm", "", "the bot, built already (default: build it now)")
	flag.Parse()
	log.SetFlags(0)
	if *wasm == "" {
		dir, err := os.MkdirTemp("", "wasmbot")
		if err != nil {
			log.Fatal(err)
		}
		defer os.RemoveAll(dir)
		*wasm = filepath.Join(dir, "bot.wasm")
		log.Printf("building the bot (GOOS=js GOARCH=wasm)…")
		if err := buildBot(*wasm); err != nil {
			log.Fatal(err)
		}
	}
	exec, err := wasmExecJS()
	if err != nil {
		log.Fatal(err)
	}
	s, err := newServer(*wasm, exec)
	if err != nil {
		log.Fatal(err)
	}
	defer s.Close()
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		log.Fatal(err)
	}
	log.Printf("open http://%s/", ln.Addr())
	go func() {
		for {
			select {
			case r := <-s.reports:
				b, _ := json.Marshal(r)
				log.Printf("the bot reports: %s", b)
			case v := <-s.seen:
				log.Printf("server side: %+v", v)
			}
		}
	}()
	log.Fatal(http.Serve(ln, s))
}

// buildBot builds the bot for the browser into out.
func buildBot(out string) error {
	cmd := exec.Command("go", "build", "-o", out, botPackage)
	// GOFLAGS as CI sets it (-race) has no meaning for js/wasm.
	cmd.Env = append(os.Environ(), "GOOS=js", "GOARCH=wasm", "GOFLAGS=")
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("building the bot: %v\n%s", err, b)
	}
	return nil
}

// wasmExecJS finds the Go toolchain's wasm_exec.js, the glue between a Go
// program and the browser: lib/wasm since Go 1.24, misc/wasm before.
func wasmExecJS() (string, error) {
	b, err := exec.Command("go", "env", "GOROOT").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOROOT: %w", err)
	}
	root := strings.TrimSpace(string(b))
	for _, dir := range []string{"lib/wasm", "misc/wasm"} {
		p := filepath.Join(root, dir, "wasm_exec.js")
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("no wasm_exec.js in %s", root)
}

// seen is what the server saw of a bot's connection, once it ended.
type seen struct {
	Transport  knet.Transport
	Payload    string         // its ConnectPayload
	Received   map[uint32]int // messages, by ID
	BigSize    int            // the large message's length
	CloseError error          // how it ended
}

// server serves the page, the bot and the kNet endpoint.
type server struct {
	l       *knet.Listener
	mux     *http.ServeMux
	reports chan report // the bots' posts
	seen    chan seen   // their connections, once ended
	wg      sync.WaitGroup
}

// newServer serves the bot at wasmPath with the wasm_exec.js at execPath.
func newServer(wasmPath, execPath string) (*server, error) {
	s := &server{reports: make(chan report, 16), seen: make(chan seen, 16)}
	cfg := &knet.Config{
		Admit: func(_ net.Addr, p []byte) ([]byte, error) {
			if string(p) != payload {
				return nil, errors.New("only wasmbots here")
			}
			return []byte("welcome, " + payload), nil
		},
	}
	// The UDP socket is the Listener's, on loopback; browsers come over
	// WebSocket.
	l, err := knet.Listen("udp", "127.0.0.1:0", cfg)
	if err != nil {
		return nil, err
	}
	s.l = l
	s.mux = http.NewServeMux()
	s.mux.HandleFunc("GET /{$}", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		w.Write(indexHTML)
	})
	s.mux.HandleFunc("GET /wasm_exec.js", func(w http.ResponseWriter, r *http.Request) {
		http.ServeFile(w, r, execPath)
	})
	s.mux.HandleFunc("GET /bot.wasm", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/wasm")
		http.ServeFile(w, r, wasmPath)
	})
	s.mux.Handle("/knet", l.WebSocketHandler())
	s.mux.HandleFunc("POST /result", s.result)
	s.wg.Go(s.serve)
	return s, nil
}

func (s *server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.mux.ServeHTTP(w, r) }

// Close closes the Listener and waits for the echoes to end.
func (s *server) Close() error {
	err := s.l.Close()
	s.wg.Wait()
	return err
}

// result takes a bot's report.
func (s *server) result(w http.ResponseWriter, r *http.Request) {
	var rep report
	if err := json.NewDecoder(io.LimitReader(r.Body, 64<<10)).Decode(&rep); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	select {
	case s.reports <- rep:
	default: // nobody reads them
	}
	w.WriteHeader(http.StatusNoContent)
}

// serve echoes every message of every connection, and reports each
// connection when it ends.
func (s *server) serve() {
	for {
		c, err := s.l.AcceptConn(context.Background())
		if err != nil {
			return
		}
		s.wg.Go(func() { s.echo(c) })
	}
}

func (s *server) echo(c *knet.Conn) {
	defer c.Close()
	syn, _ := c.Handshake()
	v := seen{Transport: c.Transport(), Payload: string(syn), Received: map[uint32]int{}}
	for {
		m, err := c.Receive(context.Background())
		if err != nil {
			break
		}
		v.Received[m.ID]++
		if m.ID == bigID {
			v.BigSize = len(m.Payload)
		}
		if err := c.Send(m); err != nil && !errors.Is(err, knet.ErrSendBufferFull) {
			break // an unreliable echo with no room is dropped, not an end
		}
	}
	<-c.Done()
	v.CloseError = c.Err()
	select {
	case s.seen <- v:
	default:
	}
}
