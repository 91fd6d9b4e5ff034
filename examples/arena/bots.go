package main

// Bots: players over each transport, as a game's client would be. Each
// asks the token endpoint for a ticket, dials, sends a move every tick
// and measures each snapshot's age (from the server's tick to Receive;
// one process, one clock). A drain ends them with closeDrain.

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/knet-go/knet"
)

const botFed = 10 // snapshots each bot gets before options.fed closes

// ticket is the token endpoint's answer.
type ticket struct {
	Token, ServerKey []byte
	Game, WebSocket  string
}

var botTransports = []knet.Transport{knet.TransportUDP, knet.TransportTCP, knet.TransportWebSocket}

type botSet struct {
	wg     sync.WaitGroup
	mu     sync.Mutex
	bots   []*bot
	fed    chan struct{}
	hungry int // bots with fewer than botFed snapshots
}

type bot struct {
	transport knet.Transport
	snapshots int
	ages      []time.Duration
	err       error // why it ended: a *knet.DisconnectError with closeDrain after a drain
}

// transportReport is what one transport's bots saw.
type transportReport struct {
	Transport knet.Transport
	Bots      int
	Snapshots int
	P50, P99  time.Duration // snapshot ages
	Drained   int           // bots whose connection ended with closeDrain
	Errs      []error       // the others' ends
}

// startBots starts n bots over each transport.
func startBots(base string, n int, fed chan struct{}) *botSet {
	bs := &botSet{fed: fed, hungry: n * len(botTransports)}
	for _, tr := range botTransports {
		for range n {
			b := &bot{transport: tr}
			bs.bots = append(bs.bots, b)
			bs.wg.Go(func() { b.err = bs.play(b, base) })
		}
	}
	return bs
}

// play is one bot's life: ticket, dial, play until the connection ends.
func (bs *botSet) play(b *bot, base string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := http.Post(base+"/token", "", nil)
	if err != nil {
		return err
	}
	var t ticket
	err = json.NewDecoder(resp.Body).Decode(&t)
	resp.Body.Close()
	if err != nil {
		return fmt.Errorf("token endpoint: %w", err)
	}
	cfg := &knet.Config{ServerKey: t.ServerKey, Token: t.Token}
	var c *knet.Conn
	switch b.transport {
	case knet.TransportUDP:
		c, err = knet.Dial(ctx, "udp", t.Game, cfg)
	case knet.TransportTCP: // where Dial over UDP with Config.FallbackTCP ends when UDP is blocked
		c, err = knet.Dial(ctx, "tcp", t.Game, cfg)
	case knet.TransportWebSocket: // as a browser would
		c, err = knet.DialWebSocket(ctx, "ws"+strings.TrimPrefix(base, "http")+t.WebSocket, cfg)
	}
	if err != nil {
		return err
	}
	defer c.Close()
	go func() { // a move every tick, reliable and in order
		tick := time.NewTicker(time.Second / tickRate)
		defer tick.Stop()
		for {
			select {
			case <-c.Done():
				return
			case <-tick.C:
			}
			c.Send(knet.Message{ID: msgInput, Payload: []byte{1, 0xff}, Reliable: true, InOrder: true})
		}
	}()
	for {
		m, err := c.Receive(ctx)
		if err != nil {
			break // io.EOF after the server's close; c.Err says why, once it ended
		}
		if m.ID != msgSnapshot || len(m.Payload) < 8 {
			continue
		}
		age := time.Since(time.Unix(0, int64(binary.LittleEndian.Uint64(m.Payload))))
		bs.mu.Lock()
		b.snapshots++
		b.ages = append(b.ages, age)
		if b.snapshots == botFed {
			if bs.hungry--; bs.hungry == 0 && bs.fed != nil {
				close(bs.fed)
			}
		}
		bs.mu.Unlock()
	}
	<-c.Done()
	return c.Err()
}

// report waits for the bots to end and prints what each transport's saw.
// It returns the drain's error (drainErr) joined with the bots' failures:
// a transport whose bots had no snapshot, or a bot not told closeDrain.
func (bs *botSet) report(out io.Writer, drainErr error) ([]transportReport, error) {
	bs.wg.Wait()
	if len(bs.bots) == 0 {
		return nil, drainErr
	}
	errs := []error{drainErr}
	var rs []transportReport
	for _, tr := range botTransports {
		r := transportReport{Transport: tr}
		var ages []time.Duration
		for _, b := range bs.bots {
			if b.transport != tr {
				continue
			}
			r.Bots++
			r.Snapshots += b.snapshots
			ages = append(ages, b.ages...)
			var de *knet.DisconnectError
			if errors.As(b.err, &de) && de.Code == closeDrain {
				r.Drained++
			} else {
				r.Errs = append(r.Errs, b.err)
			}
		}
		slices.Sort(ages)
		if n := len(ages); n > 0 {
			r.P50, r.P99 = ages[n/2], ages[n*99/100]
		}
		fmt.Fprintf(out, "%-9s bots %d: %d snapshots, age p50 %v p99 %v; %d drained\n",
			tr, r.Bots, r.Snapshots, r.P50.Round(time.Microsecond), r.P99.Round(time.Microsecond), r.Drained)
		for _, err := range r.Errs {
			errs = append(errs, fmt.Errorf("a bot over %v ended with %v, not closeDrain", tr, err))
		}
		if r.Snapshots == 0 {
			errs = append(errs, fmt.Errorf("no bot over %v had a snapshot", tr))
		}
		rs = append(rs, r)
	}
	return rs, errors.Join(errs...)
}
