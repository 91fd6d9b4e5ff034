// Command fleet runs a small fleet of knet game servers on loopback, in
// the manner of a fleet manager (Agones on Kubernetes): a backend starts
// three server processes, places players on them with connect tokens
// that name several servers, drains one server in the middle of the
// round, and moves its players to the others, which they reach with new
// tokens. It prints what each moved player saw: how long it was without
// a server and how many reliable messages were lost (none, at any loss:
// the drain waits for what the players have in flight, and the bots
// resend nothing themselves).
//
//	go run ./examples/fleet [-players 60] [-duration 4s] [-loss 0.05]
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
	"strconv"
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
	loss     float64       // each datagram's chance to be lost, both ways (Config.Simulate)
	// spawn starts a game server: a process of this program, or (the
	// test) goroutines of this one.
	spawn func(id int, priv, tokenKey []byte, sim *knet.Simulation) (*serverHandle, error)
}

// simulation is the bad network every player and server sends through,
// nil for none.
func (o options) simulation() *knet.Simulation {
	if o.loss <= 0 {
		return nil
	}
	return &knet.Simulation{Loss: o.loss}
}

func main() {
	o := options{servers: 3, spawn: spawnProcess}
	serveID := flag.Int("serve", 0, "run as game server N (the backend starts these)")
	flag.IntVar(&o.players, "players", 60, "bots to place on the fleet")
	flag.DurationVar(&o.duration, "duration", 4*time.Second, "length of the round; the second server drains halfway")
	flag.DurationVar(&o.every, "every", 50*time.Millisecond, "how often each bot sends a reliable message")
	flag.Float64Var(&o.loss, "loss", 0, "the chance that a datagram is lost, each way (0.05: 5%)")
	flag.Parse()
	log.SetFlags(0)
	if *serveID > 0 {
		// A game server process: its keys come from the backend.
		priv, err1 := hex.DecodeString(os.Getenv("KNET_FLEET_KEY"))
		tokenKey, err2 := hex.DecodeString(os.Getenv("KNET_FLEET_TOKEN_KEY"))
		if err := errors.Join(err1, err2); err != nil {
			log.Fatal("fleet server: ", err)
		}
		if err := serve(*serveID, priv, tokenKey, o.simulation(), os.Stdin, os.Stdout); err != nil {
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
	sim := o.simulation()

	mm := &matchmaker{tokenKey: tokenKey, draining: map[int]bool{}, load: map[int]int{}, placed: map[int]int{}}
	got := arrivals{}
	stopAll := func() {
		for _, s := range mm.servers {
			s.send("quit")
			s.in.Close()
			for line := range s.lines {
				got.take(line)
			}
			<-s.done
		}
	}
	for id := 1; id <= o.servers; id++ {
		h, err := o.spawn(id, priv, tokenKey, sim)
		if err != nil {
			stopAll()
			return fmt.Errorf("server %d: %w", id, err)
		}
		mm.servers = append(mm.servers, h)
		fmt.Fprintf(out, "server %d ready on %v (Agones: SDK.Ready)\n", id, h.addr)
	}
	if sim != nil {
		fmt.Fprintf(out, "every player and server loses %.0f%% of the datagrams it sends\n", 100*o.loss)
	}

	// The round: the bots play until play ends, then close their
	// connections.
	start := time.Now()
	// The round lasts o.duration, and at least until the drain is over:
	// every player of the drained server has heard of it.
	play, endPlay := context.WithCancel(context.Background())
	defer endPlay()
	bots := make([]*bot, o.players)
	var wg sync.WaitGroup
	for i := range bots {
		bots[i] = &bot{id: i + 1}
		wg.Go(func() { bots[i].play(play, mm, pub, o.every, sim) })
	}

	// Halfway, the fleet manager shuts server 2 down (a scale-down, a
	// rolling update): the matchmaker stops placing players there, then
	// the server drains.
	var drainLog []string
	var drained string
	time.Sleep(o.duration / 2)
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
		} else if !got.take(line) {
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

	time.Sleep(time.Until(start.Add(o.duration)))
	endPlay()
	wg.Wait()
	stopAll()
	return report(out, bots, victim.id, got)
}

// arrivals is what the servers got from each player: how many times
// each of its message numbers arrived, from their "got" lines.
type arrivals map[int]map[uint32]int

// take reads a "got PLAYER FIRST:END ..." line; it reports false for any
// other line.
func (a arrivals) take(line string) bool {
	rest, ok := strings.CutPrefix(line, "got ")
	if !ok {
		return false
	}
	fields := strings.Fields(rest)
	if len(fields) == 0 {
		return false
	}
	player, err := strconv.Atoi(fields[0])
	if err != nil {
		return false
	}
	if a[player] == nil {
		a[player] = map[uint32]int{}
	}
	for _, f := range fields[1:] {
		var first, end uint32
		if _, err := fmt.Sscanf(f, "%d:%d", &first, &end); err != nil {
			continue
		}
		for seq := first; seq < end; seq++ {
			a[player][seq]++
		}
	}
	return true
}

// report prints what the players saw and fails if a reliable message was
// lost or a player of the drained server did not move.
func report(out io.Writer, bots []*bot, victim int, got arrivals) error {
	var problems []error
	var moved []*bot
	sent, arrived, twice, lost, unacked := 0, 0, 0, 0, 0
	lostOf := func(b *bot) int {
		n := 0
		for seq := range b.sent {
			if got[b.id][seq] == 0 {
				n++
			}
		}
		return n
	}
	for _, b := range bots {
		sent += int(b.sent)
		for seq, n := range got[b.id] {
			if seq < b.sent {
				arrived++
				twice += n - 1
			}
		}
		lost += lostOf(b)
		unacked += b.unacked
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
	fmt.Fprintf(out, "%-7s %-9s %14s %6s %6s\n", "player", "servers", "without server", "sent", "lost")
	var offline []time.Duration
	for _, b := range moved {
		var path []string
		for _, s := range b.servers {
			path = append(path, fmt.Sprint(s))
		}
		fmt.Fprintf(out, "%-7d %-9s %14v %6d %6d\n", b.id, strings.Join(path, "→"), b.offline.Round(100*time.Microsecond), b.sent, lostOf(b))
		offline = append(offline, b.offline)
	}
	slices.Sort(offline)
	if n := len(offline); n > 0 {
		fmt.Fprintf(out, "time without a server: median %v, max %v\n",
			offline[n/2].Round(100*time.Microsecond), offline[n-1].Round(100*time.Microsecond))
	}
	fmt.Fprintf(out, "reliable messages: %d sent, %d arrived, %d lost (%d arrived twice); %d left unacknowledged by an ended connection\n",
		sent, arrived, lost, twice, unacked)
	if lost > 0 {
		problems = append(problems, fmt.Errorf("%d reliable messages lost", lost))
	}
	if len(moved) == 0 {
		problems = append(problems, fmt.Errorf("no player was on server %d", victim))
	}
	return errors.Join(problems...)
}
