//go:build linux

package knet

import (
	"context"
	"fmt"
	"net"
	"os/exec"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/nattest"
)

// natPair is an unordered pair of NAT types, the more open first.
type natPair [2]nattest.Type

func natPairOf(a, b nattest.Type) natPair {
	if a > b {
		a, b = b, a
	}
	return natPair{a, b}
}

// natOutcome is what a pair of NAT types is expected to do: the route a
// joiner's connection takes, and for a route, the bound on the time from
// the joiner's ask to its first reliable message echoed, at p95 of the
// runs (every run of such a pair must connect).
type natOutcome struct {
	route string
	p95   time.Duration
	// relayedMay is the share of runs that may fall back to the relay
	// instead (birthday probing finds the port it guesses with a
	// probability: 2048 probes at 256 ports open, about 99.97%).
	relayedMay float64
}

// natExpected is issue 35's table: what each of the 10 pairs of NAT
// types does, whichever side hosts. Work that makes a pair connect
// changes its line: birthday probing makes port-restricted cone with
// symmetric direct, the relay makes symmetric with symmetric relayed.
var natExpected = map[natPair]natOutcome{
	{nattest.FullCone, nattest.FullCone}:                     {natRouteDirect, time.Second, 0},
	{nattest.FullCone, nattest.RestrictedCone}:               {natRouteDirect, time.Second, 0},
	{nattest.FullCone, nattest.PortRestrictedCone}:           {natRouteDirect, time.Second, 0},
	{nattest.FullCone, nattest.Symmetric}:                    {natRouteDirect, time.Second, 0},
	{nattest.RestrictedCone, nattest.RestrictedCone}:         {natRouteDirect, time.Second, 0},
	{nattest.RestrictedCone, nattest.PortRestrictedCone}:     {natRouteDirect, time.Second, 0},
	{nattest.RestrictedCone, nattest.Symmetric}:              {natRouteDirect, time.Second, 0},
	{nattest.PortRestrictedCone, nattest.PortRestrictedCone}: {natRouteDirect, time.Second, 0},
	{nattest.PortRestrictedCone, nattest.Symmetric}:          {natRouteDirect, 3 * time.Second, 0.05}, // birthday probing (birthday.go)
	{nattest.Symmetric, nattest.Symmetric}:                   {natRouteRelayed, 4 * time.Second, 0},   // the relay, after 2 s of probing (relay.go)
}

// natIntroOptions: both sides learn from a second knet server whether
// their NAT maps each destination to a port of its own (birthday.go).
var natIntroOptions = &IntroOptions{Reflector: "203.0.113.2:7000"}

// natMatrixServers starts the matrix's public servers on n: an
// introducer at introAddr that also relays, and a second reflector at
// natIntroOptions.Reflector.
func natMatrixServers(t *testing.T, n *nattest.Net, introAddr string) *Listener {
	intro := listenIn(t, n.Public, introAddr, testConfig())
	intro.ServeIntroductions()
	relayIn(t, n.Public, intro, RelayConfig{}) // its allocations' sockets in the public network
	listenIn(t, n.Public, natIntroOptions.Reflector, testConfig())
	return intro
}

// natMatrixDial is how a matrix run's joiner connects, once introduced:
// the one call that a fallback (a relay) would change.
func natMatrixDial(ctx context.Context, pc net.PacketConn, in Introduction, cfg *Config) (*Conn, error) {
	return DialCandidates(ctx, pc, in, cfg)
}

// natLossConfig is testConfig with the default ConnectTimeout (10 s), for
// lossy links. A plaintext server holds a connection attempt until the
// client proves its address by acking the ConnectSynAck, which the server
// sends again on a timer (0.2 s, then doubling to 1 s); the client is
// connected as soon as one ConnectSynAck reaches it. With 10 % loss on
// each of two private links, 34 % of round trips fail, and testConfig's
// 3 s leave the server five ConnectSynAcks: 0.34^5, about 1 attempt in
// 200, ended on the server while its client thought itself connected (the
// flake seen in TestNATPunchLoss: 3 of about 570 runs). 10 s leave it
// eleven: about 1 in 100,000.
func natLossConfig() *Config {
	cfg := testConfig()
	cfg.ConnectTimeout = 10 * time.Second
	return cfg
}

// natRun is one run's result: the route it took and the time from the
// joiner's ask to its reliable message echoed (or to its failure).
type natRun struct {
	route  string
	took   time.Duration
	err    error
	detail func() string // what the run saw, for a run not as expected
}

// natMatrixRun is one run over n, a Net whose site A hosts and site B
// joins, with the introducer intro at introAddr: the host's Listener
// and the joiner's socket are new, on ports of this seed (so new NAT
// mappings; no run reuses another's ports), the host registers under an
// ID of this seed, and the clock starts at the joiner's ask, once the
// introducer has the host. The host echoes the joiner's first reliable
// message, and the run connected when the echo came back.
func natMatrixRun(t *testing.T, n *nattest.Net, intro *Listener, introAddr string, seed int, cfg *Config) natRun {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	id := fmt.Sprintf("matrix-%d", seed)
	host := listenIn(t, n.A.Host, fmt.Sprintf("0.0.0.0:%d", 20000+seed), cfg)
	defer host.Close()
	hosting := make(chan error, 1)
	go func() {
		// In the host's namespace: a hard host's extra sockets
		// (birthday.go) open there.
		hosting <- n.A.Host.Run(func() error {
			in, err := host.HostWith(ctx, introAddr, id, natIntroOptions)
			if err == nil {
				err = host.Punch(ctx, in)
			}
			return err
		})
	}()
	echoed := make(chan error, 1)
	var hostSaw atomic.Value // the address the host's Listener accepted the joiner from
	go func() {
		sc, err := host.AcceptConn(ctx)
		if err == nil {
			hostSaw.Store(sc.RemoteAddr().String())
			defer sc.Close()
			var m Message
			if m, err = sc.Receive(ctx); err == nil {
				err = sc.Send(Message{ID: m.ID, Payload: m.Payload, Reliable: true})
			}
		}
		echoed <- err
	}()
	require.Eventually(t, func() bool {
		intro.punch.mu.Lock()
		defer intro.punch.mu.Unlock()
		return intro.punch.hosts[id] != nil
	}, 10*time.Second, 2*time.Millisecond, "the introducer has the host")

	pc := n.B.Host.ListenUDP(t, fmt.Sprintf("0.0.0.0:%d", 30000+seed))
	start := time.Now()
	var in Introduction
	var c *Conn
	var dialErr error
	require.NoError(t, n.B.Host.Run(func() (err error) {
		// In the joiner's namespace: a hard joiner's extra sockets
		// open there.
		if in, err = JoinWith(ctx, pc, introAddr, id, natIntroOptions); err != nil {
			return err
		}
		c, dialErr = natMatrixDial(ctx, pc, in, cfg)
		return nil
	}), "seed %d: the introducer knows the host", seed)
	detail := func() string {
		joiner := "none"
		if c != nil {
			joiner = fmt.Sprintf("to %v, %+v", c.RemoteAddr(), c.Stats())
		}
		return fmt.Sprintf("seed %d: joiner's error %v; the host's candidates %v; the joiner's connection %s; the host accepted %v; the host's Listener %+v; the routers' conntrack:\n%s\n%s",
			seed, dialErr, in.Peer, joiner, hostSaw.Load(), host.Stats(), natConntrack(n.A.Router), natConntrack(n.B.Router))
	}
	if dialErr != nil {
		r := natRun{route: natRouteNone, took: time.Since(start), err: dialErr, detail: detail}
		require.NoError(t, <-hosting, "seed %d: the host's Host and Punch", seed)
		return r
	}
	defer c.Close()
	payload := []byte(id)
	require.NoError(t, c.Send(Message{ID: 100, Payload: payload, Reliable: true}))
	m, err := c.Receive(ctx)
	require.NoError(t, err, "seed %d: the echo", seed)
	r := natRun{route: natRouteDirect, took: time.Since(start), detail: detail}
	require.Equal(t, payload, m.Payload)
	if c.RemoteAddr().(*net.UDPAddr).AddrPort().Addr() != n.A.Router.Addr() {
		// Not to the host's NAT: through someone in the public network.
		r.route = natRouteRelayed
	}
	require.NoError(t, <-hosting, "seed %d: the host's Host and Punch", seed)
	require.NoError(t, <-echoed, "seed %d: the host echoed", seed)
	return r
}

// natConntrack is the conntrack table of a router's namespace.
func natConntrack(r *nattest.Node) string {
	out, err := exec.Command("ip", "netns", "exec", r.Name, "cat", "/proc/net/nf_conntrack").CombinedOutput()
	if err != nil {
		return fmt.Sprintf("%s: %v", r.Name, err)
	}
	return r.Name + ":\n" + string(out)
}

// natPairResult is one ordered pair's runs.
type natPairResult struct {
	host, joiner nattest.Type
	runs         []natRun
	lossOK       int
	lossRuns     int
}

// natResults are what TestNATMatrix and TestNATMatrixLoss measured in
// this process, for the grid.
var natResults struct {
	sync.Mutex
	byPair map[[2]nattest.Type]*natPairResult
}

func natResult(host, joiner nattest.Type) *natPairResult {
	natResults.Lock()
	defer natResults.Unlock()
	if natResults.byPair == nil {
		natResults.byPair = make(map[[2]nattest.Type]*natPairResult)
	}
	r := natResults.byPair[[2]nattest.Type{host, joiner}]
	if r == nil {
		r = &natPairResult{host: host, joiner: joiner}
		natResults.byPair[[2]nattest.Type{host, joiner}] = r
	}
	return r
}

// natOrderedPairs are the 16 ordered pairs: each of the 10 pairs, and
// for the 6 of two types, both orders (the host behind either).
func natOrderedPairs() [][2]nattest.Type {
	var out [][2]nattest.Type
	for _, h := range nattest.Types {
		for _, j := range nattest.Types {
			out = append(out, [2]nattest.Type{h, j})
		}
	}
	return out
}

// natQuantile is the q-quantile (nearest rank) of sorted durations.
func natQuantile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	k := int(q*float64(len(sorted))+0.999999) - 1
	return sorted[max(0, min(k, len(sorted)-1))]
}

// natMatrixRuns is how many runs an ordered pair gets: 20. With -short
// (as CI runs), a pair of two types gets 10 in each order, so that each
// of the 10 unordered pairs still gets 20, and a pair expected to find no
// route gets 2 (each is the 2 s probing budget, and all are alike).
func natMatrixRuns(pair [2]nattest.Type, want natOutcome) int {
	switch {
	case !testing.Short():
		return 20
	case want.route == natRouteNone:
		return 2
	case want.route == natRouteRelayed:
		return 5 // each takes the 2 s of probing first
	case pair[0] != pair[1]:
		return 10
	}
	return 20
}

// Issue 35's matrix: for each of the 16 ordered pairs of NAT types (the
// host behind site A's, the joiner behind site B's), 20 runs, each with a
// host Listener and a joiner socket of their own on ports of the run's
// seed, over one Net per pair. Each run measures the time from the
// joiner's ask to the introducer to its first reliable message echoed by
// the host. A pair expected to go direct connects in every run, directly
// (to the host's NAT), with p95 within its bound (1 s); a pair expected
// to find no route fails every run with ErrNoDirectPath. With -short,
// fewer runs (natMatrixRuns): 20 per unordered pair still, the p95 bound
// holding in each order's 10. Each pair logs p50, p95 and max; with
// -knet.nat.grid, the grid in README.md and docs/nat.md is rewritten
// from them.
func TestNATMatrix(t *testing.T) {
	nattest.Require(t)
	began := time.Now()
	t.Run("pairs", func(t *testing.T) {
		for _, pair := range natOrderedPairs() {
			want := natExpected[natPairOf(pair[0], pair[1])]
			t.Run(fmt.Sprintf("%v-hosts-%v-joins", pair[0], pair[1]), func(t *testing.T) {
				t.Parallel()
				n := nattest.New(t, pair[0], pair[1], nil)
				const introAddr = "203.0.113.1:7000"
				intro := natMatrixServers(t, n, introAddr)
				res := natResult(pair[0], pair[1])
				res.runs = nil // -count: this run's only
				for seed := range natMatrixRuns(pair, want) {
					r := natMatrixRun(t, n, intro, introAddr, seed, testConfig())
					res.runs = append(res.runs, r)
					if r.route != want.route || want.p95 > 0 && r.took > want.p95 {
						t.Logf("NAT matrix: %v hosts, %v joins: a run %s in %v, expected %s: %s", pair[0], pair[1], r.route, r.took, want.route, r.detail())
					}
					if want.route == natRouteNone {
						assert.ErrorIs(t, r.err, ErrNoDirectPath, "seed %d", seed)
					}
				}
				var took, failed []time.Duration
				routes := map[string]int{}
				for _, r := range res.runs {
					routes[r.route]++
					if r.err == nil {
						took = append(took, r.took)
					} else {
						failed = append(failed, r.took)
					}
				}
				slices.Sort(took)
				slices.Sort(failed)
				p50, p95 := natQuantile(took, 0.5), natQuantile(took, 0.95)
				t.Logf("NAT matrix: %v hosts, %v joins (expected %s, p95 within %v): routes %v over %d runs; connected in p50 %v, p95 %v, max %v; failed in p50 %v",
					pair[0], pair[1], want.route, want.p95, routes, len(res.runs), p50.Round(time.Millisecond), p95.Round(time.Millisecond),
					natQuantile(took, 1).Round(time.Millisecond), natQuantile(failed, 0.5).Round(time.Millisecond))
				fellBack := 0
				if want.relayedMay > 0 {
					fellBack = routes[natRouteRelayed]
					assert.LessOrEqual(t, float64(fellBack), want.relayedMay*float64(len(res.runs)), "runs that fell back to the relay")
				}
				assert.Equal(t, len(res.runs), routes[want.route]+fellBack, "every run takes the route expected (%s)", want.route)
				if want.route != natRouteNone {
					assert.LessOrEqual(t, p95, want.p95, "p95 of the time to a working connection")
				}
			})
		}
	})
	t.Logf("NAT matrix: %v in all", time.Since(began).Round(time.Second))
	natWriteGrid(t)
}

// Under 10 % loss on both private links (each router drops a tenth of
// what it forwards, both ways), every ordered pair expected to connect
// still connects, by the route expected, in each of its runs (5, or 2
// with -short); the pairs expected to find no route are not run.
func TestNATMatrixLoss(t *testing.T) {
	nattest.Require(t)
	runs := 5
	if testing.Short() {
		runs = 2
	}
	t.Run("pairs", func(t *testing.T) {
		for _, pair := range natOrderedPairs() {
			want := natExpected[natPairOf(pair[0], pair[1])]
			if want.route == natRouteNone {
				continue
			}
			t.Run(fmt.Sprintf("%v-hosts-%v-joins", pair[0], pair[1]), func(t *testing.T) {
				t.Parallel()
				n := nattest.New(t, pair[0], pair[1], &nattest.Options{Loss: 0.1})
				const introAddr = "203.0.113.1:7000"
				intro := natMatrixServers(t, n, introAddr)
				var took []time.Duration
				ok := 0
				for seed := range runs {
					r := natMatrixRun(t, n, intro, introAddr, seed, natLossConfig())
					if r.err != nil || r.route != want.route {
						t.Logf("NAT matrix at 10%% loss: %v hosts, %v joins: a run %s: %s", pair[0], pair[1], r.route, r.detail())
					}
					// At 10% loss a pair that probes may fall back to the
					// relay: it still connects.
					if assert.NoError(t, r.err, "seed %d", seed) && (r.route == natRouteRelayed || assert.Equal(t, want.route, r.route, "seed %d", seed)) {
						ok++
						took = append(took, r.took)
					}
				}
				res := natResult(pair[0], pair[1])
				res.lossOK, res.lossRuns = ok, runs
				slices.Sort(took)
				t.Logf("NAT matrix at 10%% loss: %v hosts, %v joins: %d of %d runs connected, in %v", pair[0], pair[1], ok, runs, took)
			})
		}
	})
	natWriteGrid(t)
}

// natWriteGrid rewrites the grid from what this process measured, with
// -knet.nat.grid, once TestNATMatrix measured every pair.
func natWriteGrid(t *testing.T) {
	if !*natGridFlag || t.Failed() {
		return
	}
	natResults.Lock()
	defer natResults.Unlock()
	var rows []natGridRow
	runs, lossRuns := 0, 0
	for _, pair := range natOrderedPairs() {
		res := natResults.byPair[pair]
		if res == nil || len(res.runs) == 0 {
			t.Logf("NAT grid: not rewritten: %v hosting for %v was not measured (run TestNATMatrix)", pair[0], pair[1])
			return
		}
		want := natExpected[natPairOf(pair[0], pair[1])]
		row := natGridRow{
			Host:     natTypeNames[slices.Index(nattest.Types, pair[0])],
			Joiner:   natTypeNames[slices.Index(nattest.Types, pair[1])],
			Expect:   want.route,
			Route:    natRouteNone,
			Runs:     len(res.runs),
			LossOK:   res.lossOK,
			LossRuns: res.lossRuns,
		}
		if want.p95 > 0 {
			row.Expect = fmt.Sprintf("%s ≤ %v", want.route, want.p95)
		}
		var took []time.Duration
		for _, r := range res.runs {
			if r.err == nil {
				took = append(took, r.took)
				row.Route = r.route
			}
		}
		sort.Slice(took, func(i, j int) bool { return took[i] < took[j] })
		row.Connected = len(took)
		row.P50, row.P95, row.Max = natQuantile(took, 0.5), natQuantile(took, 0.95), natQuantile(took, 1)
		runs = max(runs, row.Runs)
		lossRuns = max(lossRuns, row.LossRuns)
		rows = append(rows, row)
	}
	race := ""
	if raceEnabled {
		race = "-race "
	}
	how := fmt.Sprintf("Measured %s by `sudo go test %s-run 'TestNATMatrix' -knet.nat.grid .` (real NATs in network namespaces, `internal/nattest`): up to %d runs per pair, each with sockets of its own; times from the joiner's ask to the introducer to its first reliable message echoed by the host.",
		time.Now().UTC().Format("2006-01-02"), race, runs)
	if lossRuns > 0 {
		how += fmt.Sprintf(" At 10 %% loss on both private links, %d runs per pair that connects.", lossRuns)
	}
	if testing.Short() {
		how += " With -short."
	}
	require.NoError(t, writeNATGrid(formatNATGrid(rows, how)))
	t.Logf("NAT grid written to %s", strings.Join(natGridFiles, " and "))
}
