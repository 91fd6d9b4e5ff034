// Command fleet runs a small fleet of knet game servers on loopback, in
// the manner of a fleet manager (Agones on Kubernetes): a backend starts
// three server processes, places players on them with connect tokens
// that name several servers, drains one server in the middle of the
// round, and moves its players to the others, which they reach with new
// tokens. It prints what each moved player saw: how long it was without
// a server and how many reliable messages were lost (none).
//
//	go run ./examples/fleet [-players 60] [-duration 4s]
//
// Where an Agones game server would call its SDK, the code says so:
// Ready once it listens, Shutdown once its players are gone; the player
// count comes from the listener. Nothing here needs Kubernetes.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/knet-go/knet"
)

type options struct {
	players  int
	servers  int
	duration time.Duration
	every    time.Duration // a bot's message interval
	// spawn starts a game server: a process of this program, or (the
	// test) goroutines of this one.
	spawn func(id int, priv, tokenKey []byte) (*serverHandle, error)
}

func main() {
	o := options{servers: 3, spawn: spawnProcess}
	serveID := flag.Int("serve", 0, "run as game server N (the backend starts these)")
	flag.IntVar(&o.players, "players", 60, "bots to place on the fleet")
	flag.DurationVar(&o.duration, "duration", 4*time.Second, "length of the round; the second server drains halfway")
	flag.DurationVar(&o.every, "every", 50*time.Millisecond, "how often each bot sends a reliable message")
	flag.Parse()
	log.SetFlags(0)
	if *serveID > 0 {
		// A game server process: its keys come from the backend.
		priv, err1 := hex.DecodeString(os.Getenv("KNET_FLEET_KEY"))
		tokenKey, err2 := hex.DecodeString(os.Getenv("KNET_FLEET_TOKEN_KEY"))
		if err := errors.Join(err1, err2); err != nil {
			log.Fatal("fleet server: ", err)
		}
		if err := serve(*serveID, priv, tokenKey, os.Stdin, os.Stdout); err != nil {
			log.Fatal("fleet server: ", err)
		}
		return
	}
	if err := run(o, os.Stdout); err != nil {
		log.Fatal("fleet: ", err)
	}
}

// run is the backend: it starts the fleet, plays the round and reports.
func run(o options, out io.Writer) error {
	priv, pub, err := knet.GenerateKey()
	if err != nil {
		return err
	}
	tokenKey := make([]byte, knet.TokenKeySize)
	rand.Read(tokenKey)

	mm := &matchmaker{tokenKey: tokenKey, draining: map[int]bool{}, load: map[int]int{}, placed: map[int]int{}}
	stopAll := func() {
		for _, s := range mm.servers {
			s.send("quit")
			s.in.Close()
			<-s.done
		}
	}
	for id := 1; id <= o.servers; id++ {
		h, err := o.spawn(id, priv, tokenKey)
		if err != nil {
			stopAll()
			return fmt.Errorf("server %d: %w", id, err)
		}
		mm.servers = append(mm.servers, h)
		fmt.Fprintf(out, "server %d ready on %v (Agones: SDK.Ready)\n", id, h.addr)
	}

	// The round: the bots play until play ends; then they have settle to
	// get their last echoes.
	start := time.Now()
	play, endPlay := context.WithTimeout(context.Background(), o.duration)
	defer endPlay()
	settle, endSettle := context.WithTimeout(context.Background(), o.duration+15*time.Second)
	defer endSettle()
	bots := make([]*bot, o.players)
	var wg sync.WaitGroup
	for i := range bots {
		bots[i] = &bot{id: i + 1}
		wg.Go(func() { bots[i].play(play, settle, mm, pub, o.every) })
	}

	// Halfway, the fleet manager shuts server 2 down (a scale-down, a
	// rolling update): the matchmaker stops placing players there, then
	// the server drains.
	var drainLog []string
	var drained string
	select {
	case <-time.After(o.duration / 2):
	case <-play.Done():
	}
	mm.mu.Lock()
	for _, s := range mm.servers {
		fmt.Fprintf(out, "server %d: %d players placed\n", s.id, mm.load[s.id])
	}
	mm.mu.Unlock()
	victim := mm.servers[min(1, len(mm.servers)-1)]
	mm.drain(victim.id)
	drainAt := time.Since(start)
	victim.send("drain")
	for line := range victim.lines {
		if left, ok := strings.CutPrefix(line, "left "); ok {
			if len(drainLog) == 0 || drainLog[len(drainLog)-1] != left {
				drainLog = append(drainLog, left)
			}
		} else if d, ok := strings.CutPrefix(line, "drained "); ok {
			drained = d
		} else {
			fmt.Fprintf(out, "server %d: %s\n", victim.id, line)
		}
	}
	if err := <-victim.done; err != nil {
		return fmt.Errorf("server %d: %w", victim.id, err)
	}
	drainTook := time.Since(start) - drainAt
	mm.mu.Lock()
	mm.servers = slices.DeleteFunc(mm.servers, func(s *serverHandle) bool { return s == victim })
	mm.mu.Unlock()
	fmt.Fprintf(out, "server %d drained at %.2fs in %v (players left: %s), then exited (Agones: SDK.Shutdown); joined, echoed: %s\n",
		victim.id, drainAt.Seconds(), drainTook.Round(time.Millisecond), strings.Join(drainLog, " "), drained)

	wg.Wait()
	stopAll()
	return report(out, bots, victim.id)
}

// report prints what the players saw and fails if a reliable message was
// lost or a player of the drained server did not move.
func report(out io.Writer, bots []*bot, victim int) error {
	var problems []error
	var moved []*bot
	sent, resent, lost := 0, 0, 0
	for _, b := range bots {
		sent += b.sent
		resent += b.resent
		lost += b.lost
		if b.err != nil {
			problems = append(problems, fmt.Errorf("player %d: %w", b.id, b.err))
		}
		if slices.Contains(b.servers, victim) {
			moved = append(moved, b)
			if b.moves == 0 || b.servers[len(b.servers)-1] == victim {
				problems = append(problems, fmt.Errorf("player %d stayed on the drained server %d", b.id, victim))
			}
		}
	}
	fmt.Fprintf(out, "\nplayers moved off server %d: %d of %d\n", victim, len(moved), len(bots))
	fmt.Fprintf(out, "%-7s %-9s %14s %8s %6s\n", "player", "servers", "without server", "resent", "lost")
	var offline []time.Duration
	for _, b := range moved {
		var path []string
		for _, s := range b.servers {
			path = append(path, fmt.Sprint(s))
		}
		fmt.Fprintf(out, "%-7d %-9s %14v %8d %6d\n", b.id, strings.Join(path, "→"), b.offline.Round(100*time.Microsecond), b.resent, b.lost)
		offline = append(offline, b.offline)
	}
	slices.Sort(offline)
	if n := len(offline); n > 0 {
		fmt.Fprintf(out, "time without a server: median %v, max %v\n",
			offline[n/2].Round(100*time.Microsecond), offline[n-1].Round(100*time.Microsecond))
	}
	fmt.Fprintf(out, "reliable messages: %d sent, %d sent again after a move, %d lost\n", sent, resent, lost)
	if lost > 0 {
		problems = append(problems, fmt.Errorf("%d reliable messages lost", lost))
	}
	if len(moved) == 0 {
		problems = append(problems, fmt.Errorf("no player was on server %d", victim))
	}
	return errors.Join(problems...)
}
