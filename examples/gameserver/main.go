// Command gameserver runs an authoritative game server and a crowd of bots
// in one process, on loopback, and reports how the game's traffic fared.
//
//	go run ./examples/gameserver                          # 32 bots, 5 seconds
//	go run ./examples/gameserver -bots 100 -duration 10s
//	go run ./examples/gameserver -loss 0.05 -delay 40ms -jitter 10ms
//	go run ./examples/gameserver -full                    # snapshots without deltas
//
// The server runs a fixed 30 Hz tick on one goroutine: each tick it takes
// everything that happened from a knet.Group with Poll (no goroutine per
// connection in the game code), applies the inputs, moves everyone, and
// sends each player a snapshot of the world around it. Each kind of
// traffic travels in the delivery mode that suits it:
//
//   - inputs, client to server: unreliable sequenced (InOrder on a channel);
//   - snapshots, server to client: latest state (unreliable, ContentID),
//     each sent with SendRef and encoded as a delta against the newest
//     snapshot its client is known to have: Config.Receipts makes the
//     Group report each one delivered or lost (-full sends them whole);
//   - spawn, despawn and round-over events: reliable ordered;
//   - scores: reliable latest state (Reliable, ContentID the player's id):
//     the newest score of each player arrives, an older one never after it;
//   - chat: reliable ordered on a channel of its own.
//
// The server takes UDP and TCP on one port number (Config.TCP), and
// WebSocket on an HTTP path (Listener.WebSocketHandler): -tcp bots connect
// over TCP, as players on networks that block UDP would, and -ws bots over
// WebSocket, as players in a browser would; the game loop serves them all
// through the same Group without telling them apart.
//
// Players join with a token checked by Config.AdmitConn, which attaches
// the player to the connection as its user data. Besides the -bots
// ordinary bots, three misbehave on purpose: one presents a forged token
// and is refused with a reason, one floods the chat and one stops sending
// input, and the server kicks both with a code and a reason
// (StartCloseWithError), which they print.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/knet-go/knet"
)

type options struct {
	bots     int
	duration time.Duration
	rate     int // ticks per second, server and bots
	sim      knet.Simulation
	worst    int  // per-client rows printed
	full     bool // snapshots in full, never as deltas
	// plain leaves the three misbehaving bots out (the smoke test's
	// 20% loss run, where a handshake lost twice makes one join too
	// late in a short round to be kicked).
	plain bool
	// How many of the ordinary bots connect over TCP instead of UDP
	// (the server takes both on one port number), as players on a
	// network that blocks UDP would.
	tcp int
	// And how many over WebSocket, as players in a browser would.
	ws int
}

func main() {
	var o options
	flag.IntVar(&o.bots, "bots", 32, "ordinary bots (three misbehaving ones join besides)")
	flag.DurationVar(&o.duration, "duration", 5*time.Second, "length of the round")
	flag.IntVar(&o.rate, "rate", 30, "ticks per second, server and bots")
	flag.Float64Var(&o.sim.Loss, "loss", 0, "simulate this datagram loss (0..1) on both sides' sends")
	flag.DurationVar(&o.sim.Delay, "delay", 0, "simulate this one-way delay on both sides' sends")
	flag.DurationVar(&o.sim.Jitter, "jitter", 0, "add up to this much random delay per datagram")
	flag.Uint64Var(&o.sim.Seed, "seed", 1, "seed of the simulated network")
	flag.BoolVar(&o.full, "full", false, "send every snapshot in full, not as a delta against what the client has")
	flag.IntVar(&o.worst, "rows", 8, "per-client rows to print (the worst by snapshot age)")
	flag.IntVar(&o.tcp, "tcp", 4, "how many of the bots connect over TCP instead of UDP (players without UDP)")
	flag.IntVar(&o.ws, "ws", 4, "how many of the bots connect over WebSocket (players in a browser)")
	flag.Parse()
	log.SetFlags(0)
	if _, err := run(context.Background(), o, os.Stdout); err != nil {
		log.Fatal("gameserver: ", err)
	}
}

// result is what a run measured, for the smoke test.
type result struct {
	queryInfo                 string // the server query's answer, before the bots came
	bots                      []*bot // the ordinary ones
	refused, spammer, idler   *bot
	snapsSent, snapsRecv      int
	inputsSent, inputsApplied int
	ageP50, ageP99            time.Duration
	// Snapshot bytes: as sent, and as they would have been in full;
	// snapshots sent as deltas; worlds the bots checked, wrong ones, and
	// snapshots they could not read.
	sentBytes, fullBytes, deltas int
	deltaBytes, deltaFull        int // of the snapshots sent as deltas
	checked, wrong, bad          int
}

func run(ctx context.Context, o options, out io.Writer) (*result, error) {
	o.bots = max(o.bots, 1)
	o.rate = max(o.rate, 1)
	o.worst = max(o.worst, 0)
	tick := time.Second / time.Duration(o.rate)
	var sim func(seed uint64) *knet.Simulation
	if o.sim.Loss > 0 || o.sim.Delay > 0 || o.sim.Jitter > 0 {
		sim = func(seed uint64) *knet.Simulation { s := o.sim; s.Seed = seed; return &s }
	} else {
		sim = func(uint64) *knet.Simulation { return nil }
	}
	epoch := time.Now()
	srv, err := newServer("127.0.0.1:0", tick, sim(o.sim.Seed), epoch, !o.full)
	if err != nil {
		return nil, err
	}
	netDesc := "perfect loopback"
	if s := sim(0); s != nil {
		netDesc = fmt.Sprintf("loss %.1f%%, delay %v, jitter %v on each side's sends", 100*s.Loss, s.Delay, s.Jitter)
	}
	fmt.Fprintf(out, "server on %v (UDP and TCP) and %s: %d bots (%d over TCP, %d over WebSocket) + 3 misbehaving, %d Hz, %v; network: %s\n",
		srv.l.Addr(), srv.webURL(), o.bots, min(o.tcp, o.bots), min(o.ws, o.bots), o.rate, o.duration, netDesc)

	// What a server browser sees, without connecting: a server query.
	info, rtt, err := knet.Query(ctx, "udp", srv.l.Addr().String())
	if err != nil {
		srv.close()
		return nil, fmt.Errorf("server query: %w", err)
	}
	fmt.Fprintf(out, "server query: %q in %v\n", info, rtt.Round(time.Microsecond))

	// The bots: each has its own connection and goroutines.
	var bots []*bot
	for i := range o.bots {
		name := fmt.Sprintf("bot%02d", i+1)
		b := &bot{name: name, kind: normalBot, token: srv.issueToken(name), transport: knet.TransportUDP}
		switch {
		case i >= o.bots-o.ws:
			b.transport = knet.TransportWebSocket
		case i >= o.bots-o.ws-o.tcp:
			b.transport = knet.TransportTCP
		}
		bots = append(bots, b)
	}
	res := &result{
		queryInfo: string(info),
		bots:      bots,
		spammer:   &bot{name: "spammer", kind: spammerBot, token: srv.issueToken("spammer")},
		idler:     &bot{name: "idler", kind: idleBot, token: srv.issueToken("idler")},
		refused:   &bot{name: "intruder", kind: badTokenBot, token: "forged"},
	}
	everyone := slices.Clone(bots)
	if !o.plain {
		everyone = append(everyone, res.spammer, res.idler, res.refused)
	}
	// The bots stop on the round-over event; this only bounds a run
	// whose server broke.
	botCtx, cancel := context.WithTimeout(ctx, o.duration+30*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	errs := make([]error, len(everyone))
	cpu0, cpuOK := processCPU()
	start := time.Now()
	for i, b := range everyone {
		wg.Go(func() {
			addr := srv.l.Addr().String()
			if b.transport == knet.TransportWebSocket {
				addr = srv.webURL()
			}
			errs[i] = b.run(botCtx, addr, tick, sim(o.sim.Seed+1+uint64(i)), epoch)
		})
	}
	botsDone := make(chan struct{})
	go func() { wg.Wait(); close(botsDone) }()

	// The tick loop.
	t := time.NewTicker(tick)
	defer t.Stop()
	deadline := start.Add(o.duration)
	var cpu1 time.Duration
	var liveTicks int
	var endedAt time.Time
	for {
		now := <-t.C
		live := now.Before(deadline)
		if !live && endedAt.IsZero() {
			endedAt = now
			cpu1, _ = processCPU()
			srv.endRound()
		}
		srv.step(now, live)
		if live {
			liveTicks++
		}
		if !live {
			select {
			case <-botsDone:
			default:
				if now.Sub(endedAt) > 20*time.Second {
					srv.close()
					return nil, errors.New("the bots did not leave within 20s of the round's end")
				}
				continue
			}
			if srv.group.Len() == 0 {
				break
			}
		}
	}
	elapsed := endedAt.Sub(start)
	if err := srv.close(); err != nil {
		return nil, err
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return res, report(out, o, srv, res, elapsed, liveTicks, cpu1-cpu0, cpuOK)
}

// report prints the figures and says whether the run was sane.
func report(out io.Writer, o options, srv *server, res *result, elapsed time.Duration, liveTicks int, cpu time.Duration, cpuOK bool) error {
	var problems []error
	fail := func(format string, a ...any) { problems = append(problems, fmt.Errorf(format, a...)) }

	// The misbehaving bots.
	if r := res.refused.refused; r != "" {
		fmt.Fprintf(out, "%s refused: %q (*knet.RefusedError.Reason)\n", res.refused.name, r)
	} else if !o.plain {
		fail("the bot with a forged token was not refused")
	}
	for _, b := range []*bot{res.spammer, res.idler} {
		if o.plain {
			break
		}
		switch {
		case b.kickCode != 0:
			fmt.Fprintf(out, "%s kicked: code %d, %q (*knet.DisconnectError)\n", b.name, b.kickCode, b.kickReason)
		case b == res.idler && o.duration < idleLimit+time.Second:
			fmt.Fprintf(out, "%s: the round was too short to kick it\n", b.name)
		default:
			fail("%s was not kicked (ended with %v)", b.name, b.endErr)
		}
	}

	// Per-client figures, by player name.
	byName := map[string]*player{}
	for _, p := range srv.all {
		byName[p.name] = p
	}
	type row struct {
		b        *bot
		p        *player
		p50, p99 time.Duration
	}
	var rows []row
	var ages []time.Duration
	events, chats, scores := 0, 0, 0
	for _, b := range res.bots {
		p := byName[b.name]
		if p == nil {
			fail("%s never joined", b.name)
			continue
		}
		r := row{b: b, p: p, p50: percentile(b.ages, 0.5), p99: percentile(b.ages, 0.99)}
		rows = append(rows, r)
		ages = append(ages, b.ages...)
		res.snapsSent += p.snapsSent
		res.snapsRecv += b.snaps
		res.inputsSent += b.inputsSent
		res.inputsApplied += p.inputsApplied
		events += b.events
		chats += b.chats
		scores += b.scoresGot
		res.sentBytes += p.sentBytes
		res.fullBytes += p.fullBytes
		res.deltas += p.deltas
		res.deltaBytes += p.deltaBytes
		res.deltaFull += p.deltaFull
		if b.staleScores > 0 {
			fail("%s got %d scores older than one it had", b.name, b.staleScores)
		}
		res.checked += b.checked
		res.wrong += b.wrong
		res.bad += b.bad
		if b.kickCode == closeRoundOver {
			// Its handshake took longer than the round (datagrams
			// lost, again and again): it joined once the round was
			// over, and the server sent it away at once.
			fmt.Fprintf(out, "%s joined after the round ended\n", b.name)
			continue
		}
		if b.snaps == 0 {
			fail("%s received no snapshot", b.name)
		}
		if !b.sawEnd || b.kickCode != 0 || b.endErr != nil {
			fail("%s did not leave at the round's end: kicked %q, error %v", b.name, b.kickReason, b.endErr)
		}
	}
	slices.SortFunc(rows, func(a, b row) int { return int(b.p99 - a.p99) })
	if n := min(o.worst, len(rows)); n > 0 {
		if n < len(rows) {
			fmt.Fprintf(out, "\nper client, the %d worst of %d by snapshot age p99:\n", n, len(rows))
		} else {
			fmt.Fprintf(out, "\nper client:\n")
		}
		fmt.Fprintf(out, "%-8s %8s %7s %7s %7s %13s %8s %8s %11s\n",
			"client", "rtt", "loss↑", "loss↓", "quality", "snapshots", "age p50", "age p99", "inputs")
		for _, r := range rows[:n] {
			st := r.p.final // as the server sees the connection
			fmt.Fprintf(out, "%-8s %8s %6.1f%% %6.1f%% %7.2f %6d/%-6d %8s %8s %5d/%-5d\n",
				r.b.name, round(st.RTT), 100*st.LossRate, 100*r.b.stats.LossRate, st.Quality,
				r.b.snaps, r.p.snapsSent, round(r.p50), round(r.p99), r.p.inputsApplied, r.b.inputsSent)
		}
		fmt.Fprintf(out, "(rtt and quality as the server's Stats give them at the round's end; loss↑ is the\n"+
			" server's datagrams from the client that never came, loss↓ the client's from the server;\n"+
			" snapshots received/sent, inputs applied by the server/sent by the client)\n")
	}

	res.ageP50, res.ageP99 = percentile(ages, 0.5), percentile(ages, 0.99)
	ratio := func(a, b int) float64 {
		if b == 0 {
			return 0
		}
		return float64(a) / float64(b)
	}
	fmt.Fprintf(out, "\ndelivery: snapshots %d/%d (%.1f%%), inputs %d/%d (%.1f%%); reliable: %d events, %d chat lines; %d scores (latest state)\n",
		res.snapsRecv, res.snapsSent, 100*ratio(res.snapsRecv, res.snapsSent),
		res.inputsApplied, res.inputsSent, 100*ratio(res.inputsApplied, res.inputsSent), events, chats, scores)
	fmt.Fprintf(out, "snapshot deltas alone: %.2fx smaller than in full (the rest went in full: no baseline acked yet)\n",
		float64(res.deltaFull)/float64(max(res.deltaBytes, 1)))
	fmt.Fprintf(out, "snapshot size: %.0f B on average, %.0f B in full: %.2fx smaller (%d of %d sent as deltas); "+
		"the bots rebuilt %d worlds, %d wrong, %d unreadable\n",
		float64(res.sentBytes)/float64(max(res.snapsSent, 1)), float64(res.fullBytes)/float64(max(res.snapsSent, 1)),
		float64(res.fullBytes)/float64(max(res.sentBytes, 1)), res.deltas, res.snapsSent, res.checked, res.wrong, res.bad)
	fmt.Fprintf(out, "snapshot age p50 %v, p99 %v, max %v (from the server tick's start to the bot's Receive)\n",
		round(res.ageP50), round(res.ageP99), round(percentile(ages, 1)))
	for _, tr := range []knet.Transport{knet.TransportUDP, knet.TransportTCP, knet.TransportWebSocket} {
		var n, snaps, checked, wrong int
		var trAges []time.Duration
		for _, b := range res.bots {
			if b.transport == tr && b.used == tr {
				n++
				snaps += b.snaps
				checked += b.checked
				wrong += b.wrong
				trAges = append(trAges, b.ages...)
			}
		}
		if n > 0 {
			slices.Sort(trAges)
			fmt.Fprintf(out, "  over %v: %d bots, %d snapshots, age p50 %v p99 %v, %d worlds checked, %d wrong\n",
				tr, n, snaps, round(percentile(trAges, 0.5)), round(percentile(trAges, 0.99)), checked, wrong)
		}
	}
	for _, b := range res.bots {
		if b.used != b.transport && b.refused == "" {
			fail("%s connected over %v, not %v", b.name, b.used, b.transport)
		}
	}
	clients := len(res.bots) + 2
	secs := elapsed.Seconds()
	fmt.Fprintf(out, "server tick: %d ticks in %.2fs, work mean %v max %v; %.1f µs per client per second\n",
		liveTicks, secs, round(srv.tickWork/time.Duration(max(liveTicks, 1))), round(srv.maxTick),
		float64(srv.tickWork.Microseconds())/secs/float64(clients))
	fmt.Fprintf(out, "  (wall time of the game loop's work: Poll, inputs, world, building and queueing snapshots\n"+
		"   and events; not the connections' goroutines that pack, pace and write datagrams)\n")
	if cpuOK {
		fmt.Fprintf(out, "process CPU: %.2fs user+sys in %.2fs = %.2f cores; %.2f ms per client per second\n",
			cpu.Seconds(), secs, cpu.Seconds()/secs, float64(cpu.Microseconds())/1000/secs/float64(clients))
		fmt.Fprintf(out, "  (everything in the process: the server, the bots, both ends of every connection\n"+
			"   and the simulated network; an upper bound for the server alone)\n")
	}

	if r := ratio(res.snapsRecv, res.snapsSent); r < 0.5 {
		fail("only %.0f%% of the snapshots arrived", 100*r)
	}
	if res.wrong > 0 || res.bad > 0 {
		fail("the bots rebuilt %d wrong worlds and could not read %d snapshots", res.wrong, res.bad)
	}
	if r := ratio(res.inputsApplied, res.inputsSent); r < 0.5 {
		fail("only %.0f%% of the inputs were applied", 100*r)
	}
	return errors.Join(problems...)
}

func percentile(d []time.Duration, q float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return s[min(len(s)-1, int(q*float64(len(s))))]
}

func round(d time.Duration) time.Duration {
	switch {
	case d >= 10*time.Millisecond:
		return d.Round(100 * time.Microsecond)
	case d >= time.Millisecond:
		return d.Round(10 * time.Microsecond)
	}
	return d.Round(time.Microsecond)
}
