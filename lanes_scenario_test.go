package knet

import (
	"context"
	"encoding/binary"
	"flag"
	"fmt"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
)

// The download scenario of issue 22 part 3, measured with -knet.lanes:
//
//	go test -run TestLanesDownloadScenario -knet.lanes -v .
//	go test -run TestLanesDownloadScenario -knet.lanes -knet.lanes.defaults -v .
//
// A game server (a Group ticking at 30 Hz, a 600-byte latest-state
// snapshot to each player every tick at Priority 2, a reliable event to
// all every half second) serves 50 players, who send 60 inputs a second
// (unreliable sequenced). After a few seconds 10 of them start
// downloading a 20 MB asset in 64 KiB reliable ordered chunks at
// Priority -1. Every datagram crosses Simulation{Loss: 0.02, Delay: 30ms,
// Jitter: 5ms} on both ends. It runs in a synctest bubble over the network
// in memory: times are the bubble's, so the figures are the protocol's,
// not the machine's load (-knet.lanes.real runs it on loopback in real
// time instead). It reports, for the downloaders and the others,
// the snapshots kept, the longest gap and the snapshot delay p99 (from the
// server's tick to the client's Receive) before and during the downloads,
// and how long each download took.
var (
	lanesTest     = flag.Bool("knet.lanes", false, "run TestLanesDownloadScenario (a minute or two)")
	lanesDefaults = flag.Bool("knet.lanes.defaults", false, "TestLanesDownloadScenario: knet's default buffers instead of 256 KiB")
	lanesAsset    = flag.Int("knet.lanes.asset", 20<<20, "TestLanesDownloadScenario: bytes per download")
	lanesReal     = flag.Bool("knet.lanes.real", false, "TestLanesDownloadScenario: on loopback in real time, where the machine's CPU counts, instead of in a bubble")
)

type lanesClient struct {
	mu         sync.Mutex
	download   bool
	snaps      int
	before     []time.Duration // snapshot delays before the downloads started
	during     []time.Duration // and while they ran
	lastSnap   time.Time
	maxGap     time.Duration
	gotBytes   int
	doneAt     time.Time
	downloaded chan struct{}
}

func TestLanesDownloadScenario(t *testing.T) {
	if !*lanesTest {
		t.Skip("a measurement: run with -knet.lanes")
	}
	p := lanesParams{players: 50, downloaders: 10, asset: *lanesAsset, defaults: *lanesDefaults}
	if *lanesReal {
		runLanesScenario(t, sysNet(), p)
		return
	}
	synctest.Test(t, func(t *testing.T) { runLanesScenario(t, memNet(t), p) })
}

// Downloads beside gameplay, small enough for every run: 12 players, 3 of
// them downloading 2 MB at Priority -1 beside 30 Hz snapshots at 2,
// through 2% loss and 30 ms each way, with 256 KiB buffers, in a bubble.
// The downloaders keep their snapshots (no gap of half a second, their
// delay p99 within 1.5x of their own before), and the downloads finish.
// Before the fixes of issue 22 part 3, a 2 MB download took up to 52 s and
// a downloader went 15 s without a snapshot.
func TestDownloadBesideGameplay(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		dl, others := runLanesScenario(t, memNet(t), lanesParams{players: 12, downloaders: 3, asset: 2 << 20})
		for _, g := range []lanesResult{dl, others} {
			assert.GreaterOrEqual(t, g.keptMin, 0.9, "%s: snapshots kept", g.name)
			assert.Less(t, g.gap, 500*time.Millisecond, "%s: longest gap", g.name)
			assert.LessOrEqual(t, g.ratioMax, 1.5, "%s: delay p99 during/before", g.name)
		}
		assert.Zero(t, dl.unfinished, "downloads unfinished")
		assert.Less(t, dl.tookMax, 20*time.Second, "the slowest 2 MB download")
	})
}

// lanesParams sets the download scenario's size.
type lanesParams struct {
	players, downloaders, asset int
	defaults                    bool // knet's default buffers, not 256 KiB
}

// lanesResult is what a group of players saw.
type lanesResult struct {
	name       string
	keptMin    float64       // the lowest share of snapshots kept
	gap        time.Duration // the longest gap between two snapshots
	ratioMax   float64       // the highest delay p99 during / before
	tookMax    time.Duration // the slowest download
	unfinished int
}

// runLanesScenario runs the scenario on nw and returns what the
// downloaders and the others saw.
func runLanesScenario(t *testing.T, nw *testNet, lp lanesParams) (dlRes, othersRes lanesResult) {
	const (
		chunk    = 64 << 10
		tick     = time.Second / 30
		warm     = 3 * time.Second
		snapSize = 600
	)
	players, downloaders, asset := lp.players, lp.downloaders, lp.asset
	{
		sim := func(seed uint64) *Simulation {
			return &Simulation{Loss: 0.02, Delay: 30 * time.Millisecond, Jitter: 5 * time.Millisecond, Seed: seed}
		}
		g := NewGroup()
		scfg := &Config{Group: g, Simulate: sim(1), ConnectTimeout: 30 * time.Second, MaxPendingConnections: 256}
		ccfg := func(i int) *Config {
			c := &Config{Simulate: sim(uint64(100 + i)), ConnectTimeout: 30 * time.Second}
			if !lp.defaults {
				c.SendBuffer, c.ReceiveBuffer = 256<<10, 256<<10
			}
			return c
		}
		if !lp.defaults {
			scfg.SendBuffer, scfg.ReceiveBuffer = 256<<10, 256<<10
		}
		l := nw.listen(t, scfg)
		epoch := time.Now()

		clients := make([]*lanesClient, players)
		conns := make([]*Conn, players)
		var startDL time.Time
		var startMu sync.Mutex
		started := func() time.Time {
			startMu.Lock()
			defer startMu.Unlock()
			return startDL
		}
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		var wg sync.WaitGroup
		for i := range players {
			lc := &lanesClient{download: i < downloaders, downloaded: make(chan struct{})}
			clients[i] = lc
			c, err := nw.Dial(context.Background(), l.Addr().String(), ccfg(i))
			if err != nil {
				t.Fatal(err)
			}
			conns[i] = c
			wg.Go(func() { // inputs
				tk := time.NewTicker(time.Second / 60)
				defer tk.Stop()
				for seq := uint32(0); ; seq++ {
					select {
					case <-tk.C:
					case <-ctx.Done():
						return
					}
					c.TrySend(Message{ID: 140, Payload: binary.LittleEndian.AppendUint32(nil, seq), InOrder: true, Channel: 1})
				}
			})
			wg.Go(func() { // receive
				for {
					m, err := c.Receive(ctx)
					if err != nil {
						return
					}
					now := time.Now()
					switch m.ID {
					case 141: // snapshot
						sent := epoch.Add(time.Duration(binary.LittleEndian.Uint64(m.Payload)))
						lc.mu.Lock()
						lc.snaps++
						d := now.Sub(sent)
						if s := started(); s.IsZero() || sent.Before(s) {
							lc.before = append(lc.before, d)
						} else if lc.doneAt.IsZero() {
							lc.during = append(lc.during, d)
						}
						if !lc.lastSnap.IsZero() && now.Sub(epoch) > time.Second {
							lc.maxGap = max(lc.maxGap, now.Sub(lc.lastSnap))
						}
						lc.lastSnap = now
						lc.mu.Unlock()
					case 143: // chunk
						lc.mu.Lock()
						lc.gotBytes += len(m.Payload)
						if lc.gotBytes >= asset && lc.doneAt.IsZero() {
							lc.doneAt = now
							close(lc.downloaded)
						}
						lc.mu.Unlock()
					}
				}
			})
		}

		// The server's tick loop.
		var served []*Conn
		sentSnaps := map[*Conn]int{}
		events := make([]Event, 256)
		snap := make([]byte, snapSize)
		tk := time.NewTicker(tick)
		defer tk.Stop()
		var dl sync.WaitGroup
		dlDone := make(chan struct{})
		ticks := 0
		for {
			<-tk.C
			ticks++
			for n := g.Poll(events); n > 0; n = g.Poll(events) {
				for _, e := range events[:n] {
					if e.Kind == EventConnected {
						served = append(served, e.Conn)
					}
				}
			}
			now := time.Now()
			binary.LittleEndian.PutUint64(snap, uint64(now.Sub(epoch)))
			for _, c := range served {
				if c.TrySend(Message{ID: 141, Payload: snap, ContentID: 1, Priority: 2}) == nil {
					sentSnaps[c]++
				}
			}
			if ticks%15 == 0 {
				Broadcast(served, Message{ID: 142, Payload: []byte("event"), Reliable: true, InOrder: true, Channel: 2}, nil)
			}
			if startDL.IsZero() && now.Sub(epoch) >= warm && len(served) == players {
				startMu.Lock()
				startDL = now
				startMu.Unlock()
				// The server's connections in the clients' order: match by
				// the client's address.
				for i := range downloaders {
					var sc *Conn
					for _, c := range served {
						if c.RemoteAddr().String() == conns[i].LocalAddr().String() {
							sc = c
						}
					}
					if sc == nil {
						t.Fatalf("no server connection for client %d", i)
					}
					dl.Go(func() {
						buf := make([]byte, chunk)
						for off := 0; off < asset; off += chunk {
							if err := sc.Send(Message{ID: 143, Payload: buf[:min(chunk, asset-off)], Reliable: true, InOrder: true, Channel: 3, Priority: -1}); err != nil {
								return
							}
						}
					})
				}
				go func() { dl.Wait(); close(dlDone) }()
			}
			if !startDL.IsZero() {
				all := true
				for _, lc := range clients[:downloaders] {
					select {
					case <-lc.downloaded:
					default:
						all = false
					}
				}
				if all || now.Sub(startDL) > 60*time.Second {
					break
				}
			}
		}
		end := time.Now()
		if testing.Verbose() {
			for i := range downloaders {
				for _, c := range served {
					if c.RemoteAddr().String() == conns[i].LocalAddr().String() {
						s, cs := c.Stats(), conns[i].Stats()
						clients[i].mu.Lock()
						t.Logf("downloader %d: got %d done %v snaps %d gap %v; server: sent %d snaps, replaced %d, dropped %d, send errors %d, queued %d inflight %d rate %.0f rto %v retx %d; client: dropped dgrams %d msgs %d, invalid %d, loss %.3f",
							i, clients[i].gotBytes, !clients[i].doneAt.IsZero(), clients[i].snaps, clients[i].maxGap, sentSnaps[c], s.ReplacedMessages, s.DroppedMessages, s.SendErrors, s.QueuedBytes, s.InFlight, s.SendRate, s.RTO, s.Retransmits, cs.DroppedDatagrams, cs.DroppedMessages, cs.InvalidDatagrams, cs.LossRate)
						clients[i].mu.Unlock()
					}
				}
			}
		}
		cancel()
		for _, c := range conns {
			c.Close()
		}
		wg.Wait()
		<-dlDone

		// The figures.
		p99 := func(d []time.Duration) time.Duration {
			if len(d) == 0 {
				return 0
			}
			s := slices.Clone(d)
			slices.Sort(s)
			return s[min(len(s)-1, len(s)*99/100)]
		}
		sentTo := func(i int) int {
			for c, n := range sentSnaps {
				if c.RemoteAddr().String() == conns[i].LocalAddr().String() {
					return n
				}
			}
			return 0
		}
		bufs := "256 KiB buffers"
		if lp.defaults {
			bufs = "default buffers"
		}
		t.Logf("%d players, %d downloading %d MB each in %d KiB chunks; %s; downloads ran %v",
			players, downloaders, asset>>20, chunk>>10, bufs, end.Sub(startDL).Round(time.Millisecond))
		for _, grp := range []struct {
			name     string
			from, to int
		}{{"downloaders", 0, downloaders}, {"others", downloaders, players}} {
			var kept []float64
			var gap time.Duration
			var ratios []float64
			var before, during []time.Duration
			var took []time.Duration
			for i := grp.from; i < grp.to; i++ {
				lc := clients[i]
				lc.mu.Lock()
				kept = append(kept, float64(lc.snaps)/float64(max(sentTo(i), 1)))
				gap = max(gap, lc.maxGap)
				before = append(before, lc.before...)
				during = append(during, lc.during...)
				if b := p99(lc.before); b > 0 {
					ratios = append(ratios, float64(p99(lc.during))/float64(b))
				}
				if lc.download {
					if lc.doneAt.IsZero() {
						took = append(took, -1)
					} else {
						took = append(took, lc.doneAt.Sub(startDL))
					}
				}
				lc.mu.Unlock()
			}
			slices.Sort(kept)
			slices.Sort(ratios)
			r := lanesResult{name: grp.name, keptMin: kept[0], gap: gap, ratioMax: ratios[len(ratios)-1]}
			for _, d := range took {
				if d < 0 {
					r.unfinished++
				}
				r.tookMax = max(r.tookMax, d)
			}
			if grp.from == 0 {
				dlRes = r
			} else {
				othersRes = r
			}
			line := fmt.Sprintf("%s: snapshots kept %.1f%%..%.1f%%, longest gap %v, delay p99 before %v during %v (per client during/before %.2f..%.2f)",
				grp.name, 100*kept[0], 100*kept[len(kept)-1], gap.Round(time.Millisecond),
				p99(before).Round(100*time.Microsecond), p99(during).Round(100*time.Microsecond), ratios[0], ratios[len(ratios)-1])
			if len(took) > 0 {
				slices.Sort(took)
				line += fmt.Sprintf("; downloads took %v..%v (-1: unfinished)", took[0].Round(time.Millisecond), took[len(took)-1].Round(time.Millisecond))
			}
			t.Log(line)
		}
	}
	return dlRes, othersRes
}
