// Command bench compares knet with kcp-go, quic-go and raw UDP on loopback.
//
//	go run .                 # full run: 3 runs of everything, about 17 minutes
//	go run . -quick          # smoke run: 1 short run, about 1 minute
//	go run . -only=pingpong,lossy -libs=knet,kcp-go
//
// Every scenario runs for every library in the same process, one after
// the other in an order rotated each run, and the medians are printed as
// one Markdown table with knet/peer ratios. knet's main column sends
// reliable messages in order, like the peers' streams; "knet (unordered)"
// is the same without the order. See README.md for what each scenario
// measures.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"time"
)

type options struct {
	quick                 bool
	warmup, duration      time.Duration
	pathWarmup, pathDur   time.Duration
	pacedWarmup, pacedDur time.Duration
	sessions              int
	loss                  float64
	delay                 time.Duration
	capRate               float64 // MB/s
	capQueue              int
	capDelay              time.Duration
	pacedRates            []int // msg/s of each paced stream
	runs                  int
	trace                 time.Duration
	acceptDelay, acceptT  time.Duration
	seed                  uint64
	largeSize             int
	gameClients           []int // game scenario: client counts
	gameWarmup, gameDur   time.Duration
	gameProfile           string // base name of the game processes' CPU profiles
	gameTrace             string // base name of the game processes' execution traces
	gameTraceFor          time.Duration
}

var scenarioNames = []string{"pingpong", "throughput", "large", "sessions", "lossy", "capped", "late", "game"}

func main() {
	// quic-go warns on stderr when the kernel caps its socket buffers
	// below 7 MB; the other libraries get the same (capped) buffers.
	os.Setenv("QUIC_GO_DISABLE_RECEIVE_BUFFER_WARNING", "true")

	var o options
	only := flag.String("only", "", "comma-separated scenarios to run: "+strings.Join(scenarioNames, ","))
	libsFlag := flag.String("libs", "knet,knet-unordered,knet-secure,kcp-go,quic-go,udp,udp-batch", "comma-separated libraries: knet (in order), knet-unordered, knet-secure (in order, encrypted), kcp-go, quic-go, udp, udp-batch (game scenario only: raw UDP with recvmmsg/sendmmsg)")
	flag.BoolVar(&o.quick, "quick", false, "smoke run, about 1 minute: one run of short windows (overrides the duration flags)")
	flag.DurationVar(&o.warmup, "warmup", 500*time.Millisecond, "loopback scenarios: warm-up before each measurement window")
	flag.DurationVar(&o.duration, "duration", 1500*time.Millisecond, "loopback scenarios: measurement window")
	flag.DurationVar(&o.pathWarmup, "path-warmup", 2*time.Second, "relay scenarios (lossy, capped): warm-up")
	flag.DurationVar(&o.pathDur, "path-duration", 4*time.Second, "relay scenarios: measurement window")
	flag.DurationVar(&o.pacedWarmup, "paced-warmup", time.Second, "lossy scenario, paced streams: warm-up")
	flag.DurationVar(&o.pacedDur, "paced-duration", 3*time.Second, "lossy scenario, paced streams: measurement window")
	flag.IntVar(&o.sessions, "sessions", 100, "sessions scenario: concurrent client connections")
	flag.Float64Var(&o.loss, "loss", 0.05, "lossy scenario: drop probability each way")
	flag.DurationVar(&o.delay, "delay", 20*time.Millisecond, "lossy scenario: one-way delay")
	pacedRates := flag.String("paced-rates", "50,2000", "lossy scenario: comma-separated rates, msg/s of 1200 B, of the paced (latency) streams")
	runs := flag.Int("runs", 3, "runs of every scenario (the table shows the median and the range); 1 with -quick unless given")
	flag.Float64Var(&o.capRate, "cap", 10, "capped scenario: bottleneck rate, MB/s (10^6 bytes/s), each way")
	flag.IntVar(&o.capQueue, "cap-queue", 100_000, "capped scenario: bottleneck queue, bytes (drop-tail)")
	flag.DurationVar(&o.capDelay, "cap-delay", 10*time.Millisecond, "capped scenario: one-way delay")
	flag.DurationVar(&o.acceptDelay, "accept-delay", time.Second, "late scenario: how long the server waits before Accept")
	flag.DurationVar(&o.acceptT, "accept-limit", 15*time.Second, "late scenario: how long to wait for data after Accept")
	flag.Uint64Var(&o.seed, "seed", 1, "seed of the relay's random drops")
	flag.IntVar(&o.largeSize, "large-size", 1<<20, "large scenario: message size, bytes")
	cpuProfile := flag.String("cpuprofile", "", "write a CPU profile of the whole run to this file")
	gameClients := flag.String("game-clients", "100,1000,2000,3000,5000", "game scenario: comma-separated numbers of clients (100 with -quick unless given)")
	flag.DurationVar(&o.gameWarmup, "game-warmup", 2*time.Second, "game scenario: warm-up once all clients are connected")
	flag.DurationVar(&o.gameDur, "game-duration", 5*time.Second, "game scenario: measurement window")
	flag.StringVar(&o.gameProfile, "game-cpuprofile", "", "game scenario: write CPU profiles over the window of the server process to FILE.<lib>-<N> (and its heap at the window's end to FILE.<lib>-<N>.heap) and of the clients process to FILE.<lib>-<N>.clients (the last run's)")
	flag.StringVar(&o.gameTrace, "game-trace", "", "game scenario: write execution traces (runtime/trace) of the server process to FILE.<lib>-<N>.server and of the clients process to FILE.<lib>-<N>.clients, over the window's first -game-trace-for")
	flag.DurationVar(&o.gameTraceFor, "game-trace-for", time.Second, "game scenario: how much of the window -game-trace records")
	traceReport := flag.String("game-trace-report", "", "read the traces FILE.server and FILE.clients that -game-trace wrote (e.g. /tmp/gt.knet-1000), print where the snapshots' time goes, and exit")
	var gf gameFlags
	flag.StringVar(&gf.role, "game-role", "", "internal: run as the game scenario's server or clients process")
	flag.StringVar(&gf.lib, "game-lib", "", "internal: library of a game process (knet, kcp, udp)")
	flag.StringVar(&gf.addr, "game-addr", "", "internal: server address for the game clients process")
	flag.IntVar(&gf.n, "game-n", 0, "internal: number of game clients")
	flag.DurationVar(&o.trace, "trace", 0, "relay scenarios: print knet's counters on both ends to stderr at this interval (e.g. 100ms)")
	flag.Parse()
	if gf.role != "" {
		gf.warmup, gf.dur, gf.cpuprofile = o.gameWarmup, o.gameDur, o.gameProfile
		gf.trace, gf.traceFor = o.gameTrace, o.gameTraceFor
		gameChild(gf)
		return
	}
	if *traceReport != "" {
		if err := gameTraceReport(os.Stdout, *traceReport); err != nil {
			fmt.Fprintln(os.Stderr, "game-trace-report:", err)
			os.Exit(1)
		}
		return
	}
	o.runs = *runs
	explicit := map[string]bool{}
	flag.Visit(func(f *flag.Flag) { explicit[f.Name] = true })
	if o.quick && !explicit["runs"] {
		o.runs = 1
	}
	if o.runs < 1 {
		fmt.Fprintln(os.Stderr, "-runs must be at least 1")
		os.Exit(2)
	}
	for _, f := range strings.Split(*pacedRates, ",") {
		v, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || v <= 0 {
			fmt.Fprintf(os.Stderr, "bad -paced-rates entry %q: want a positive number of msg/s\n", f)
			os.Exit(2)
		}
		o.pacedRates = append(o.pacedRates, v)
	}
	if o.quick && !explicit["game-clients"] {
		*gameClients = "100"
	}
	for _, f := range strings.Split(*gameClients, ",") {
		v, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || v <= 0 {
			fmt.Fprintf(os.Stderr, "bad -game-clients entry %q: want a positive number of clients\n", f)
			os.Exit(2)
		}
		o.gameClients = append(o.gameClients, v)
	}
	if o.quick {
		if !explicit["game-warmup"] {
			o.gameWarmup = time.Second
		}
		if !explicit["game-duration"] {
			o.gameDur = 2 * time.Second
		}
		o.warmup, o.duration = 200*time.Millisecond, 400*time.Millisecond
		o.pathWarmup, o.pathDur = 400*time.Millisecond, 800*time.Millisecond
		o.pacedWarmup, o.pacedDur = 400*time.Millisecond, 800*time.Millisecond
		o.acceptDelay, o.acceptT = 500*time.Millisecond, 2*time.Second
	}

	var sel map[string]bool
	if *only != "" {
		sel = make(map[string]bool)
		for _, s := range strings.Split(*only, ",") {
			s = strings.TrimSpace(s)
			if !slices.Contains(scenarioNames, s) {
				fmt.Fprintf(os.Stderr, "unknown scenario %q; choose from %s\n", s, strings.Join(scenarioNames, ","))
				os.Exit(2)
			}
			sel[s] = true
		}
	}
	h := &harness{o: o, t: newTable(), sel: sel}
	for _, s := range strings.Split(*libsFlag, ",") {
		switch strings.TrimSpace(s) {
		case "knet":
			h.libs = append(h.libs, knetLib{})
		case "knet-unordered", "knet (unordered)", "unordered":
			h.libs = append(h.libs, knetLib{unordered: true})
		case "knet-secure", "knet (secure)", "secure":
			h.libs = append(h.libs, knetLib{secure: true})
		case "kcp-go", "kcp":
			h.libs = append(h.libs, kcpLib{})
		case "quic-go", "quic":
			h.libs = append(h.libs, quicLib{})
		case "udp", "raw", "raw UDP":
			h.udp = true
		case "udp-batch", "raw UDP batched":
			h.udpBatch = true
		case "":
		default:
			fmt.Fprintf(os.Stderr, "unknown library %q\n", s)
			os.Exit(2)
		}
	}

	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err == nil {
			err = pprof.StartCPUProfile(f)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "cpuprofile:", err)
			os.Exit(1)
		}
		defer pprof.StopCPUProfile()
	}
	start := time.Now()
	loadBefore := loadAvg()
	h.declare()
	// Every run goes through all the scenarios, so that a burst of load
	// from elsewhere spoils one sample of several rows rather than every
	// sample of one; each run starts the libraries at another place in
	// the rotation, so that none always runs first (or right after the
	// heaviest one).
	for run := range o.runs {
		h.run = run
		for _, name := range scenarioNames {
			if sel != nil && !sel[name] {
				continue
			}
			jobs := h.scenario(name)
			k := run % max(len(jobs), 1)
			for _, j := range append(jobs[k:], jobs[:k]...) {
				j.run()
			}
		}
		h.loads = append(h.loads, loadAvg())
	}

	w := bufio.NewWriter(os.Stdout)
	defer w.Flush()
	fmt.Fprintln(w)
	fmt.Fprintf(w, "### knet benchmark (loopback, one process)\n\n")
	fmt.Fprintf(w, "Machine: %s/%s, %d CPUs (%s), %s. %s.  \n", runtime.GOOS, runtime.GOARCH, runtime.NumCPU(), cpuModel(), runtime.Version(), depVersions())
	fmt.Fprintf(w, "Command: `%s` (%s, total %v, %d run(s) per scenario). Load average (1 min) before: %s; after each run: %s.\n\n", strings.Join(append([]string{"go run ."}, os.Args[1:]...), " "), time.Now().Format("2006-01-02 15:04 MST"), time.Since(start).Round(time.Second), o.runs, loadBefore, strings.Join(h.loads, ", "))
	h.gameLargestOnTime()
	h.t.write(w, sel)
	fmt.Fprintln(w)
	fmt.Fprintln(w, h.legend())
	if s := h.targets(); s != "" {
		fmt.Fprintln(w)
		fmt.Fprintln(w, s)
	}
	if len(h.t.notes) > 0 {
		fmt.Fprintln(w)
		fmt.Fprintln(w, "Notes (connection counters and anomalies, per run):")
		fmt.Fprintln(w)
		for _, n := range h.t.notes {
			fmt.Fprintln(w, "- "+n)
		}
	}
}

func cpuModel() string {
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return "cpu model unknown"
	}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return "cpu model unknown"
}

// loadAvg is the 1-minute load average, a hint that something else
// competed for the CPUs during the run.
func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return "?"
	}
	return f[0]
}

func depVersions() string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return ""
	}
	var out []string
	for _, d := range bi.Deps {
		switch d.Path {
		case "github.com/xtaci/kcp-go/v5", "github.com/quic-go/quic-go":
			out = append(out, d.Path[strings.LastIndex(strings.TrimSuffix(d.Path, "/v5"), "/")+1:]+" "+d.Version)
		}
	}
	return strings.Join(out, ", ")
}

// harness runs the scenarios and fills the table.
type harness struct {
	o        options
	t        *table
	sel      map[string]bool
	libs     []lib
	udp      bool
	udpBatch bool // the game scenario's batched raw UDP server

	run   int      // current run, from 0
	loads []string // load average after each run
}

// job is one library's part of a scenario in one run.
type job struct {
	col string
	run func()
}

// results collects what one measurement reports, applied to the table
// only if the measurement finishes within its bound.
type results struct {
	vals  map[string]float64
	texts map[string]string
	marks map[string]string
}

// mark attaches a caveat to row id's value.
func (r *results) mark(id, reason string) { r.marks[id] = reason }

func (r *results) set(id string, v float64) { r.vals[id] = v }

// setRate sets a throughput, marking a zero as a stall.
func (r *results) setRate(id string, v float64) {
	if v == 0 {
		r.setText(id, 0, "0 (stalled)")
		return
	}
	r.set(id, v)
}
func (r *results) setText(id string, v float64, text string) {
	r.vals[id] = v
	r.texts[id] = text
}

// measure runs fn for column col with a time bound. If it fails, every
// row in ids is marked n/a with the reason; otherwise the rows get what fn
// set.
func (h *harness) measure(scenario, col string, ids []string, limit time.Duration, fn func(e *env, r *results) error) {
	fmt.Fprintf(os.Stderr, "run %d/%d %-14s %-16s ... ", h.run+1, h.o.runs, scenario, col)
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	e := newEnv(ctx)
	r := &results{vals: map[string]float64{}, texts: map[string]string{}, marks: map[string]string{}}
	done := make(chan error, 1)
	go func() {
		defer func() {
			if p := recover(); p != nil {
				done <- fmt.Errorf("panic: %v", p)
			}
		}()
		err := fn(e, r)
		if ferr := e.finish(); ferr != nil {
			err = ferr // the first failure explains the others
		}
		done <- err
	}()
	var err error
	hung := false
	select {
	case err = <-done:
		if err == nil && errors.Is(ctx.Err(), context.DeadlineExceeded) {
			err = fmt.Errorf("timed out after %v", limit)
		} else if err != nil && errors.Is(ctx.Err(), context.DeadlineExceeded) {
			err = fmt.Errorf("timed out after %v (%v)", limit, err)
		}
	case <-time.After(limit + closeLimit + 2*time.Second):
		hung = true
		err = fmt.Errorf("hung: did not return within %v", limit+closeLimit+2*time.Second)
	}
	if !hung && err == nil {
		for id, v := range r.vals {
			if t, ok := r.texts[id]; ok {
				h.t.setText(id, col, v, t)
			} else {
				h.t.set(id, col, v)
			}
		}
		for id, m := range r.marks {
			h.t.mark(id, col, m)
		}
	}
	if err != nil {
		msg := fmt.Sprintf("%s: %v", scenario, err)
		for _, id := range ids {
			h.t.setNA(id, col, msg)
		}
		fmt.Fprintf(os.Stderr, "error: %v\n", err)
	} else {
		fmt.Fprintf(os.Stderr, "done in %v\n", time.Since(start).Round(time.Millisecond))
	}
	e.mu.Lock()
	for _, n := range e.notes {
		h.t.note("run %d, %s, %s: %s", h.run+1, scenario, col, n)
	}
	e.mu.Unlock()
	runtime.GC()
	time.Sleep(50 * time.Millisecond) // let the kernel drain what is left
}

// declare adds the table's rows in order.
func (h *harness) declare() {
	o := h.o
	t := h.t
	t.add("pingpong", "pp50", "Ping-pong RTT p50, 32 B", "us", true)
	t.add("pingpong", "pp99", "Ping-pong RTT p99, 32 B", "us", true)
	// knet over its other transports (knetTransports), in knet's column
	// only: a player without UDP. WebSocket's rows come with its entry.
	notKnet := []string{colKnetU, colKnetS, colKCP, colQUIC, colUDP}
	for _, tr := range knetTransports {
		t.add("pingpong", transportRowID("pp50", tr), "Ping-pong RTT p50, 32 B, knet over "+tr.name, "us", true, notKnet...).ratios = false
	}
	t.add("throughput", "tp64", "One-way 64 B msgs (raw UDP: 1 msg/datagram)", "msg/s", false)
	t.add("throughput", "tp64p", "One-way 64 B msgs vs raw UDP 16 msgs/datagram (same knet run)", "msg/s", false, colKnetU, colKnetS, colKCP, colQUIC)
	t.add("throughput", "tp1200", "One-way 1200 B msgs", "MB/s", false)
	t.add("throughput", "tp1200m", "One-way 1200 B msgs", "msg/s", false)
	for _, tr := range knetTransports {
		t.add("throughput", transportRowID("tp1200", tr), "One-way 1200 B msgs, knet over "+tr.name, "MB/s", false, notKnet...).ratios = false
	}
	t.add("large", "lg", fmt.Sprintf("One-way %s msgs", sizeName(o.largeSize)), "msg/s", false, colUDP)
	t.add("large", "lgb", fmt.Sprintf("One-way %s msgs", sizeName(o.largeSize)), "MB/s", false, colUDP)
	t.add("sessions", "ss", fmt.Sprintf("%d sessions ping-pong 32 B, total", o.sessions), "rt/s", false)
	lossy := h.lossyLabel()
	t.add("lossy", "lsg", lossy+": goodput 1200 B", "MB/s", false, colUDP)
	t.add("lossy", "ls50", lossy+": latency p50, saturated", "ms", true, colUDP)
	t.add("lossy", "ls99", lossy+": latency p99, saturated", "ms", true, colUDP)
	t.add("lossy", "lsst", lossy+": time stalled (gaps ≥ 100 ms), saturated", "%", true, colUDP).ratios = false
	for i, rate := range o.pacedRates {
		paced := fmt.Sprintf("paced %d msg/s (%s MB/s)", rate, strconv.FormatFloat(float64(rate)*1200/1e6, 'g', 3, 64))
		t.add("lossy", pacedID("lp50", i), lossy+": latency p50, "+paced, "ms", true, colUDP)
		t.add("lossy", pacedID("lp99", i), lossy+": latency p99, "+paced, "ms", true, colUDP)
	}
	capped := fmt.Sprintf("Capped %g MB/s, %d kB queue, %v", o.capRate, o.capQueue/1000, o.capDelay)
	t.add("capped", "cg", capped+": goodput, % of cap", "%", false, colUDP)
	t.add("capped", "cl", capped+": relay drop rate", "%", true, colUDP).ratios = false
	t.add("late", "la", fmt.Sprintf("Late accept (%v): first message after Accept", o.acceptDelay), "ms", true, colUDP)
	t.add("late", "lf", fmt.Sprintf("Late accept (%v): message sent after Accept arrives", o.acceptDelay), "ms", true, colUDP)
	for _, n := range o.gameClients {
		game := fmt.Sprintf("Game %d clients", n)
		t.add("game", gameRowID("cpu", n), game+": server CPU per client", "us", true, colKnetU, colKnetS, colQUIC)
		t.add("game", gameRowID("cpum", n), game+": server CPU per message", "us", true, colKnetU, colKnetS, colQUIC)
		t.add("game", gameRowID("scores", n), game+": server process CPU", "cores", true, colKnetU, colKnetS, colQUIC)
		t.add("game", gameRowID("ccores", n), game+": clients process CPU (not the server's)", "cores", true, colKnetU, colKnetS, colQUIC)
		t.add("game", gameRowID("p50", n), game+": snapshot latency p50", "us", true, colKnetU, colKnetS, colQUIC)
		t.add("game", gameRowID("p99", n), game+": snapshot latency p99", "us", true, colKnetU, colKnetS, colQUIC)
		t.add("game", gameRowID("mem", n), game+": server memory per connection", "KiB", true, colKnetU, colKnetS, colQUIC)
		t.add("game", gameRowID("tick", n), game+": server tick work p99", "us", true, colKnetU, colKnetS, colQUIC)
		t.add("game", gameRowID("sys", n), game+": server send system calls per snapshot", "calls", true, colKnetU, colKnetS, colQUIC)
		t.add("game", gameRowID("dlv", n), game+": snapshots delivered", "%", false, colKnetU, colKnetS, colQUIC).ratios = false
		t.add("game", gameRowID("ok", n), game+": on time", "", false, colKnetU, colKnetS, colQUIC).ratios = false
	}
	t.add("game", "g.maxn", "Game: largest N on time (of those tried)", "clients", false, colKnetU, colKnetS, colQUIC).ratios = false
}

func (h *harness) lossyLabel() string {
	return fmt.Sprintf("Lossy %g%%/%v each way", h.o.loss*100, h.o.delay)
}

// transportRowID names a row of knet over another transport than UDP.
func transportRowID(id string, tr *knetTransport) string { return id + "." + tr.network }

// hasKnet reports whether knet's main column is measured.
func (h *harness) hasKnet() bool {
	return slices.ContainsFunc(h.libs, func(lb lib) bool { return lb.Name() == colKnet })
}

// pacedID names the rows of the i-th paced stream.
func pacedID(base string, i int) string { return base + "." + strconv.Itoa(i) }

// stallGap is the gap between deliveries counted as a stall: 2.5 round
// trips of the default lossy path, more than a loss recovered by one
// retransmission takes.
const stallGap = 100 * time.Millisecond

func sizeName(n int) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%d MiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d B", n)
}

func (h *harness) legend() string {
	o := h.o
	return strings.Join(append([]string{
		"Each cell: the median of the runs, and (lowest–highest). Ratios are medians divided: knet's value over the peer's, and knet in order over knet unordered; the last column says whether lower or higher is better.",
		"knet sends reliable messages InOrder on one channel, the service a kcp-go session or a QUIC stream gives; \"knet (unordered)\" sends them reliable and unordered.",
		"quic-go encrypts and authenticates every packet (TLS 1.3, AES-GCM or ChaCha20); knet, kcp-go (no block cipher, no FEC) and raw UDP send plaintext.",
		"MB = 10^6 bytes of message payload. kcp-go and quic-go carry a 4-byte length prefix per message on their stream (not counted).",
		fmt.Sprintf("Loopback windows: %v after %v warm-up; relay windows: %v after %v warm-up; paced: %v after %v. The libraries run one at a time, in an order rotated each run; the lossy path's drop seed is -seed plus the run's number.", o.duration, o.warmup, o.pathDur, o.pathWarmup, o.pacedDur, o.pacedWarmup),
		"Latency = receive time - send time stamped in the payload before Send (queueing in the sender's buffers included).",
		fmt.Sprintf("Time stalled: share of the window spent in gaps of at least %v between two deliveries to the application.", stallGap),
		"Late accept: the client sends a 64 B message every 1 ms from Dial on; times are from Accept's return.",
	}, h.gameLegend()...), "  \n")
}

// targets sums up the acceptance figures for the lossy path, when
// they were measured: knet's ordered goodput against its unordered one, and
// its paced p99 against kcp-go's.
func (h *harness) targets() string {
	var out []string
	if s := ratioText(h.t.index["lsg"], colKnet, colKnetU); s != "" {
		out = append(out, fmt.Sprintf("%s: knet in-order goodput / unordered goodput = %s (target ≥ 0.8×).", h.lossyLabel(), s))
	}
	for i, rate := range h.o.pacedRates {
		if s := ratioText(h.t.index[pacedID("lp99", i)], colKnet, colKCP); s != "" {
			out = append(out, fmt.Sprintf("Paced %d msg/s: knet in-order p99 / kcp-go p99 = %s (target ≤ 1×).", rate, s))
		}
	}
	out = append(out, h.gameTargets()...)
	return strings.Join(out, "  \n")
}

// scenario returns one run's jobs of a scenario, one per library.
func (h *harness) scenario(name string) []job {
	o := h.o
	loopLimit := o.warmup + o.duration + 20*time.Second
	var jobs []job
	add := func(col string, run func()) { jobs = append(jobs, job{col, run}) }
	switch name {
	case "pingpong":
		ids := []string{"pp50", "pp99"}
		setRTT := func(r *results, rtts []time.Duration) {
			if len(rtts) == 0 {
				return
			}
			r.set("pp50", us(percentile(rtts, 0.50)))
			r.set("pp99", us(percentile(rtts, 0.99)))
		}
		for _, lb := range h.libs {
			add(lb.Name(), func() {
				h.measure(name, lb.Name(), ids, loopLimit, func(e *env, r *results) error {
					rtts, err := pingPong(e, lb, 32, o.warmup, o.duration)
					setRTT(r, rtts)
					if err == nil && len(rtts) == 0 {
						err = errors.New("no round trip completed")
					}
					return err
				})
			})
		}
		for _, tr := range knetTransports {
			if !h.hasKnet() {
				break
			}
			lb := knetLib{transport: tr}
			add(colKnet, func() {
				id := transportRowID("pp50", tr)
				h.measure(name+" "+tr.network, colKnet, []string{id}, loopLimit, func(e *env, r *results) error {
					rtts, err := pingPong(e, lb, 32, o.warmup, o.duration)
					if len(rtts) > 0 {
						r.set(id, us(percentile(rtts, 0.50)))
					}
					if err == nil && len(rtts) == 0 {
						err = errors.New("no round trip completed")
					}
					return err
				})
			})
		}
		if h.udp {
			add(colUDP, func() {
				h.measure(name, colUDP, ids, loopLimit, func(e *env, r *results) error {
					rtts, err := udpPingPong(e, 32, o.warmup, o.duration)
					setRTT(r, rtts)
					return err
				})
			})
		}

	case "throughput":
		for _, lb := range h.libs {
			add(lb.Name(), func() {
				h.measure(name+" 64B", lb.Name(), []string{"tp64", "tp64p"}, loopLimit, func(e *env, r *results) error {
					res, err := oneWay(e, lb, oneWayOpts{size: 64, warm: o.warmup, dur: o.duration})
					if err == nil && res.elapsed > 0 {
						r.setRate("tp64", res.msgRate())
						if lb.Name() == colKnet {
							r.setRate("tp64p", res.msgRate())
						}
					}
					return err
				})
				h.measure(name+" 1200B", lb.Name(), []string{"tp1200", "tp1200m"}, loopLimit, func(e *env, r *results) error {
					res, err := oneWay(e, lb, oneWayOpts{size: 1200, warm: o.warmup, dur: o.duration})
					if err == nil && res.elapsed > 0 {
						r.setRate("tp1200", res.byteRate())
						r.setRate("tp1200m", res.msgRate())
					}
					return err
				})
			})
		}
		for _, tr := range knetTransports {
			if !h.hasKnet() {
				break
			}
			lb := knetLib{transport: tr}
			add(colKnet, func() {
				id := transportRowID("tp1200", tr)
				h.measure(name+" 1200B "+tr.network, colKnet, []string{id}, loopLimit, func(e *env, r *results) error {
					res, err := oneWay(e, lb, oneWayOpts{size: 1200, warm: o.warmup, dur: o.duration})
					if err == nil && res.elapsed > 0 {
						r.setRate(id, res.byteRate())
					}
					return err
				})
			})
		}
		if h.udp {
			add(colUDP, func() {
				h.measure(name+" 64B", colUDP, []string{"tp64"}, loopLimit, func(e *env, r *results) error {
					rate, loss, err := udpBlast(e, 64, o.warmup, o.duration)
					if err == nil && rate > 0 {
						r.set("tp64", rate)
						e.note("1 msg/datagram, %.1f%% of datagrams sent were dropped by the kernel", loss)
					}
					return err
				})
				h.measure(name+" 16x64B", colUDP, []string{"tp64p"}, loopLimit, func(e *env, r *results) error {
					rate, loss, err := udpBlast(e, 16*64, o.warmup, o.duration)
					if err == nil && rate > 0 {
						r.set("tp64p", 16*rate)
						e.note("16 msgs/datagram, %.1f%% of datagrams sent were dropped by the kernel", loss)
					}
					return err
				})
				h.measure(name+" 1200B", colUDP, []string{"tp1200", "tp1200m"}, loopLimit, func(e *env, r *results) error {
					rate, loss, err := udpBlast(e, 1200, o.warmup, o.duration)
					if err == nil && rate > 0 {
						r.set("tp1200", rate*1200/1e6)
						r.set("tp1200m", rate)
						e.note("1200 B datagrams, %.1f%% of datagrams sent were dropped by the kernel", loss)
					}
					return err
				})
			})
		}

	case "large":
		for _, lb := range h.libs {
			add(lb.Name(), func() {
				h.measure(name, lb.Name(), []string{"lg", "lgb"}, loopLimit, func(e *env, r *results) error {
					res, err := oneWay(e, lb, oneWayOpts{size: o.largeSize, warm: o.warmup, dur: o.duration})
					if err == nil && res.elapsed > 0 {
						r.setRate("lg", res.msgRate())
						r.setRate("lgb", res.byteRate())
					}
					return err
				})
			})
		}

	case "sessions":
		for _, lb := range h.libs {
			add(lb.Name(), func() {
				h.measure(name, lb.Name(), []string{"ss"}, loopLimit+10*time.Second, func(e *env, r *results) error {
					rate, err := concurrentPingPong(e, lb, o.sessions, 32, o.warmup, o.duration)
					if err == nil {
						r.setRate("ss", rate)
					}
					return err
				})
			})
		}
		if h.udp {
			add(colUDP, func() {
				h.measure(name, colUDP, []string{"ss"}, loopLimit, func(e *env, r *results) error {
					rate, err := udpConcurrent(e, o.sessions, 32, o.warmup, o.duration)
					if err == nil {
						r.setRate("ss", rate)
					}
					return err
				})
			})
		}

	case "lossy":
		path := pathConfig{Delay: o.delay, Loss: o.loss, Seed: o.seed + uint64(h.run)}
		limit := o.pathWarmup + o.pathDur + 20*time.Second
		for _, lb := range h.libs {
			add(lb.Name(), func() {
				h.measure(name, lb.Name(), []string{"lsg", "ls50", "ls99", "lsst"}, limit, func(e *env, r *results) error {
					res, err := oneWay(e, lb, oneWayOpts{size: 1200, warm: o.pathWarmup, dur: o.pathDur, stamped: true, path: &[2]pathConfig{path, path},
						trace: o.trace, label: fmt.Sprintf("run %d %s %s", h.run+1, name, lb.Name())})
					if err != nil || res.elapsed == 0 {
						return err
					}
					r.setRate("lsg", res.byteRate())
					if len(res.lat) > 0 {
						r.set("ls50", ms(percentile(res.lat, 0.50)))
						r.set("ls99", ms(percentile(res.lat, 0.99)))
					}
					r.set("lsst", 100*res.stalled.Seconds()/res.elapsed.Seconds())
					e.note("goodput %.2f MB/s; longest gap between deliveries %v, %d gaps ≥ %v adding up to %v",
						res.byteRate(), res.maxGap.Round(time.Millisecond), res.stalls, stallGap, res.stalled.Round(time.Millisecond))
					e.note("relay client→server: %d offered, %d dropped at random; server→client: %d offered, %d dropped",
						res.relay.Offered, res.relay.Lost, res.relayDown.Offered, res.relayDown.Lost)
					return nil
				})
				for i, rate := range o.pacedRates {
					ids := []string{pacedID("lp50", i), pacedID("lp99", i)}
					h.measure(fmt.Sprintf("%s paced %d", name, rate), lb.Name(), ids, o.pacedWarmup+o.pacedDur+20*time.Second, func(e *env, r *results) error {
						res, err := oneWay(e, lb, oneWayOpts{size: 1200, warm: o.pacedWarmup, dur: o.pacedDur, stamped: true,
							interval: time.Second / time.Duration(rate), path: &[2]pathConfig{path, path},
							trace: o.trace, label: fmt.Sprintf("run %d %s paced %d %s", h.run+1, name, rate, lb.Name())})
						if err != nil || res.elapsed == 0 {
							return err
						}
						if len(res.lat) == 0 {
							return errors.New("no message delivered in the window")
						}
						r.set(ids[0], ms(percentile(res.lat, 0.50)))
						r.set(ids[1], ms(percentile(res.lat, 0.99)))
						if got := res.msgRate(); got < 0.9*float64(rate) {
							for _, id := range ids {
								r.mark(id, fmt.Sprintf("paced %d msg/s: in some run, less than 90%% of the offered rate was delivered (see the notes), so the latency grew with queueing in the sender", rate))
							}
						}
						e.note("paced %d msg/s: %d msgs delivered in %v (%.0f msg/s), longest gap between deliveries %v; latency p90 %.1f ms, p95 %.1f ms, p99 %.1f ms, max %.1f ms",
							rate, res.msgs, res.elapsed.Round(time.Millisecond), res.msgRate(), res.maxGap.Round(time.Millisecond),
							ms(percentile(res.lat, 0.90)), ms(percentile(res.lat, 0.95)), ms(percentile(res.lat, 0.99)), ms(res.lat[len(res.lat)-1]))
						return nil
					})
				}
			})
		}

	case "capped":
		path := pathConfig{Delay: o.capDelay, Rate: o.capRate * 1e6, Queue: o.capQueue}
		limit := o.pathWarmup + o.pathDur + 20*time.Second
		for _, lb := range h.libs {
			add(lb.Name(), func() {
				h.measure(name, lb.Name(), []string{"cg", "cl"}, limit, func(e *env, r *results) error {
					res, err := oneWay(e, lb, oneWayOpts{size: 1200, warm: o.pathWarmup, dur: o.pathDur, path: &[2]pathConfig{path, path},
						trace: o.trace, label: fmt.Sprintf("run %d %s %s", h.run+1, name, lb.Name())})
					if err != nil || res.elapsed == 0 {
						return err
					}
					r.setRate("cg", 100*res.byteRate()/o.capRate)
					if res.relay.Offered > 0 {
						r.set("cl", 100*float64(res.relay.Dropped())/float64(res.relay.Offered))
					}
					e.note("relay client→server: %d datagrams offered, %d dropped at the queue, %d overflow; goodput %.2f MB/s",
						res.relay.Offered, res.relay.QueueDrops, res.relay.Overflow, res.byteRate())
					return nil
				})
			})
		}

	case "game":
		cols := []string{}
		for _, lb := range h.libs {
			if lb.Name() == colKnet || lb.Name() == colKCP {
				cols = append(cols, lb.Name())
			}
		}
		if h.udp {
			cols = append(cols, colUDP)
		}
		if h.udpBatch {
			cols = append(cols, colUDPB)
		}
		limit := gameConnectLimit + o.gameWarmup + o.gameDur + 40*time.Second
		for _, col := range cols {
			add(col, func() {
				for _, n := range o.gameClients {
					ids := []string{gameRowID("cpu", n), gameRowID("p50", n), gameRowID("p99", n), gameRowID("mem", n), gameRowID("tick", n), gameRowID("dlv", n), gameRowID("ok", n), gameRowID("cpum", n), gameRowID("sys", n), gameRowID("scores", n), gameRowID("ccores", n)}
					h.measure(fmt.Sprintf("%s %d", name, n), col, ids, limit, func(e *env, r *results) error {
						res, err := runGame(e, col, n, o.gameWarmup, o.gameDur, o.gameProfile, o.gameTrace, o.gameTraceFor)
						if err != nil {
							return err
						}
						if res.srv.Window == 0 {
							return nil // ended early: the env says why
						}
						r.set(ids[0], res.cpuPerClient())
						r.set(ids[7], res.cpuPerMessage())
						if !res.onTime() {
							r.mark(ids[0], "in some run the server was not on time: it ran fewer ticks or handled fewer inputs than due, so its CPU per client understates the load's cost (see CPU per message, and the notes)")
						}
						if res.cli.Snaps > 0 {
							r.set(ids[1], res.cli.LatP50)
							r.set(ids[2], res.cli.LatP99)
						}
						r.set(ids[3], res.memPerConn())
						r.set(ids[4], res.srv.TickP99)
						if v, ok := res.sendCallsPerSnap(); ok {
							r.set(ids[8], v)
						}
						r.set(ids[9], res.serverCores())
						if c, ok := res.clientCores(); ok {
							r.set(ids[10], c)
						}
						// A saturated machine: the server's rows say as much
						// about the CPU it could get as about the server.
						mark := ""
						switch own, machine := res.saturated(); {
						case own:
							mark = fmt.Sprintf("in some run the machine was saturated: the server and clients processes together used ≥ %.0f %% of the %d cores (GOMAXPROCS) over the window, so the server competed with its own load generator for CPU (see the two CPU rows)", gameSaturated*100, gameCores())
						case machine:
							mark = fmt.Sprintf("in some run the machine was saturated by other work too: all its CPUs were ≥ %.0f %% busy over the window (/proc/stat, every process; the notes give the share), so the server and its clients competed with other processes for CPU", gameSaturated*100)
						}
						if mark != "" {
							for _, id := range []string{ids[0], ids[7], ids[1], ids[2], ids[4], ids[9]} {
								r.mark(id, mark)
							}
						}
						r.set(ids[5], 100*res.delivered())
						if res.onTime() {
							r.setText(ids[6], 1, "yes")
						} else {
							r.setText(ids[6], 0, "no")
						}
						e.note("%s", gameNote(res))
						return nil
					})
				}
			})
		}

	case "late":
		for _, lb := range h.libs {
			limit := o.acceptDelay + o.acceptT + 10*time.Second
			add(lb.Name(), func() {
				h.measure(name, lb.Name(), []string{"la", "lf"}, limit, func(e *env, r *results) error {
					res, err := lateAccept(e, lb, 64, time.Millisecond, o.acceptDelay, o.acceptT)
					if err != nil {
						return err
					}
					over := fmt.Sprintf("> %v", o.acceptT)
					if res.first >= 0 {
						r.set("la", ms(res.first))
					} else {
						r.setText("la", ms(o.acceptT), over)
					}
					if res.fresh >= 0 {
						r.set("lf", ms(res.fresh))
					} else {
						r.setText("lf", ms(o.acceptT), over)
					}
					e.note("client had sent %d msgs when Accept returned; %d of them arrived before the first later one", res.sentBefore, res.backlog)
					return nil
				})
			})
		}
	}
	return jobs
}
