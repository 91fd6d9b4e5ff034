//go:build js && wasm

package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"syscall/js"
	"time"

	"github.com/knet-go/knet"
)

// The bot: built for the browser (GOOS=js GOARCH=wasm), loaded by
// index.html. It connects over WebSocket to the server that served the
// page, exchanges messages in every delivery mode, shows the result on the
// page and posts it to /result.

func main() {
	rep := run()
	show(rep)
	b, _ := json.Marshal(rep)
	if resp, err := http.Post("result", "application/json", bytes.NewReader(b)); err == nil {
		resp.Body.Close()
	} else {
		js.Global().Get("console").Call("log", "posting the result:", err.Error())
	}
}

// run dials the page's server and runs the exchange.
func run() (rep report) {
	rep.Echoed = map[string]int{}
	fail := func(err error) report {
		rep.Error = err.Error()
		return rep
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	status("connecting…")

	// No sockets in a browser: Dial says so.
	if _, err := knet.Dial(ctx, "udp", "127.0.0.1:1", nil); err != nil {
		rep.DialUDP = err.Error()
	}

	loc := js.Global().Get("location")
	scheme := "ws"
	if loc.Get("protocol").String() == "https:" {
		scheme = "wss"
	}
	url := scheme + "://" + loc.Get("host").String() + "/knet"
	c, err := knet.DialWebSocket(ctx, url, &knet.Config{ConnectPayload: []byte(payload)})
	if err != nil {
		return fail(fmt.Errorf("DialWebSocket %s: %w", url, err))
	}
	closed := false
	defer func() {
		if !closed {
			c.CloseWithReason(reason)
		}
	}()
	rep.Transport = c.Transport().String()
	rep.Dialect = c.Dialect().String()
	_, welcome := c.Handshake()
	rep.Welcome = string(welcome)
	status("connected over " + rep.Transport + ": exchanging…")

	for k := range perMode {
		for _, m := range modes {
			if err := c.Send(m.message(k)); err != nil && !errors.Is(err, knet.ErrSendBufferFull) {
				return fail(err) // an unreliable one dropped is not the end
			}
		}
	}
	big := bytes.Repeat([]byte("knet"), bigSize/4)
	if err := c.Send(knet.Message{ID: bigID, Payload: big, Reliable: true}); err != nil {
		return fail(err)
	}
	names := map[uint32]string{}
	for _, m := range modes {
		names[m.id] = m.name
	}
	next := map[string]int{"reliable": 0, "ordered": 0}
	rep.InOrder = true
	for {
		m, err := c.Receive(ctx)
		if err != nil {
			return fail(err)
		}
		if m.ID == bigID {
			rep.BigOK = bytes.Equal(m.Payload, big)
			break // the last one sent: whatever else comes back is in
		}
		name := names[m.ID]
		rep.Echoed[name]++
		if k, ok := next[name]; ok {
			if len(m.Payload) != 1 || int(m.Payload[0]) != k {
				rep.InOrder = false
			}
			next[name] = k + 1
		}
	}
	// A graceful close returns nil, in a browser as natively.
	closed = true
	if err := c.CloseWithReason(reason); err != nil {
		rep.CloseErr = err.Error()
	}
	rep.OK = rep.CloseErr == "" && rep.BigOK && rep.InOrder && rep.Echoed["reliable"] == perMode &&
		rep.Echoed["ordered"] == perMode && rep.Echoed["latest"] >= 1 &&
		strings.Contains(rep.DialUDP, "DialWebSocket")
	if !rep.OK {
		rep.Error = "the exchange came back incomplete"
	}
	return rep
}

// status shows what the bot is doing.
func status(s string) {
	js.Global().Get("document").Call("getElementById", "status").Set("textContent", s)
}

// show puts the result on the page: a green page for success, red for
// failure, and the report.
func show(rep report) {
	doc := js.Global().Get("document")
	if rep.OK {
		status("success: every delivery mode crossed over " + rep.Transport)
		doc.Get("body").Get("style").Set("background", successColor)
	} else {
		status("failure: " + rep.Error)
		doc.Get("body").Get("style").Set("background", failureColor)
	}
	b, _ := json.MarshalIndent(rep, "", "  ")
	doc.Call("getElementById", "report").Set("textContent", string(b))
}
