package main

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/knet-go/knet"
)

// A game server of the fleet: a secure knet Listener that admits players
// with the backend's connect tokens and echoes each reliable message back
// (the game, reduced to what the example measures). It is told what to do
// by lines on its control input, as a fleet manager would by its SDK and
// signals: "drain" (Agones: the game server is shutting down; SIGTERM),
// "quit" (the end of the example). As it ends it tells the backend which
// of each player's messages it got (the "got" lines), so that the
// backend can tell whether any was lost.

// msgPlay is the bots' reliable, ordered message: a sequence number the
// server echoes.
const msgPlay = 100

// closeDrain is the close code of a draining server (Listener.
// DrainWithError): the player goes back to the backend for another
// server. A player's program branches on the code in its
// *knet.DisconnectError, never on the reason, which is for people and
// logs. Codes are the game's own (a kick, a ban, a full server would
// have theirs, sent with Conn.CloseWithError); knet gives meaning to
// none but 0, no code.
const closeDrain = 1

// drainReason is what a draining server tells its players, beside
// closeDrain.
const drainReason = "server shutting down: rejoin"

// gameServer is one server's state.
type gameServer struct {
	id      int
	l       *knet.Listener
	echoed  atomic.Uint64
	players atomic.Int64 // connected now (Agones: player count)
	joined  atomic.Uint64
	got     received
	wg      sync.WaitGroup
}

// received is what a server's players sent it: each player's message
// numbers, as runs of consecutive ones in the order they came.
type received struct {
	mu   sync.Mutex
	runs map[uint64][][2]uint32 // by player: [first, end) runs
}

func (r *received) add(player uint64, seq uint32) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.runs == nil {
		r.runs = map[uint64][][2]uint32{}
	}
	runs := r.runs[player]
	if n := len(runs); n > 0 && runs[n-1][1] == seq {
		runs[n-1][1]++
	} else {
		runs = append(runs, [2]uint32{seq, seq + 1})
	}
	r.runs[player] = runs
}

// report writes a line for each player: "got PLAYER FIRST:END ...".
func (r *received) report(out io.Writer) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for player, runs := range r.runs {
		line := fmt.Sprintf("got %d", player)
		for _, run := range runs {
			line += fmt.Sprintf(" %d:%d", run[0], run[1])
		}
		fmt.Fprintln(out, line)
	}
}

// startServer listens on loopback with the fleet's keys and its ServerID
// (the first byte of every connection ID it hands out: a load balancer in
// front of the fleet could route on it, knet.ServerIDFromDatagram).
func startServer(id int, priv, tokenKey []byte, sim *knet.Simulation) (*gameServer, error) {
	s := &gameServer{id: id}
	cfg := &knet.Config{
		PrivateKey: priv,
		TokenKey:   tokenKey,
		ServerID:   []byte{byte(id)},
		AdmitConn: func(c *knet.Conn, _ []byte) ([]byte, error) {
			// The token was checked before this runs: who it names.
			c.SetUserData(c.Token().ClientID)
			return nil, nil
		},
		DisconnectTimeout: 3 * time.Second,
		Simulate:          sim,
	}
	l, err := knet.Listen("udp", "127.0.0.1:0", cfg)
	if err != nil {
		return nil, err
	}
	s.l = l
	s.wg.Go(s.accept)
	return s, nil
}

func (s *gameServer) addr() netip.AddrPort {
	return netip.MustParseAddrPort(s.l.Addr().String())
}

func (s *gameServer) accept() {
	for {
		c, err := s.l.AcceptConn(context.Background())
		if err != nil {
			return
		}
		s.players.Add(1)
		s.joined.Add(1)
		player, _ := c.UserData().(uint64)
		s.wg.Go(func() {
			defer s.players.Add(-1)
			for {
				// During a drain Receive goes on with what the player
				// still sends, until its connection ends.
				m, err := c.Receive(context.Background())
				if err != nil {
					c.Close()
					return
				}
				if len(m.Payload) == 4 {
					s.got.add(player, binary.LittleEndian.Uint32(m.Payload))
				}
				if c.Send(knet.Message{ID: msgPlay, Payload: m.Payload, Reliable: true, InOrder: true}) == nil {
					s.echoed.Add(1)
				}
			}
		})
	}
}

// drain is what the server does when the fleet manager shuts it down:
// stop admitting, tell every player why, wait for them to leave (within
// a bound), then close. progress hears how many players are left.
func (s *gameServer) drain(progress func(left int)) error {
	// Agones: SDK.Shutdown() is called once the players are gone (below);
	// until then the game server stays Allocated and the fleet's
	// matchmaker places nobody here (StopAdmitting refuses any who come
	// with an old token, with the reason).
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	progress(s.l.Stats().Connections)
	done := make(chan error, 1)
	go func() { done <- s.l.DrainWithError(ctx, closeDrain, drainReason) }()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case err := <-done:
			progress(s.l.Stats().Connections)
			return err
		case <-tick.C:
			progress(s.l.Stats().Connections)
		}
	}
}

func (s *gameServer) close() error {
	err := s.l.Close()
	s.wg.Wait()
	return err
}

// serve runs a server process: it says "ready ADDR" on out (Agones:
// SDK.Ready()), then obeys the lines of in.
func serve(id int, priv, tokenKey []byte, sim *knet.Simulation, in io.Reader, out io.Writer) error {
	s, err := startServer(id, priv, tokenKey, sim)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "ready %v\n", s.addr())
	sc := bufio.NewScanner(in)
	for sc.Scan() {
		switch strings.TrimSpace(sc.Text()) {
		case "drain":
			err := s.drain(func(left int) { fmt.Fprintf(out, "left %d\n", left) })
			if err != nil {
				fmt.Fprintf(out, "drain: %v\n", err)
			}
			err = s.close()
			s.got.report(out)
			fmt.Fprintf(out, "drained %d %d\n", s.joined.Load(), s.echoed.Load())
			return err
		case "quit":
			err := s.close()
			s.got.report(out)
			fmt.Fprintf(out, "quit %d %d\n", s.joined.Load(), s.echoed.Load())
			return err
		}
	}
	if err := sc.Err(); err != nil {
		return errors.Join(err, s.close())
	}
	return s.close()
}
