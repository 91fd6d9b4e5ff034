package main

// The game scenario: one server, N clients, the traffic of a real-time
// game. Each client sends a 32-byte input 60 times a second; the server
// runs a 30 Hz tick loop that sends every client a 200-byte snapshot per
// tick and a 64-byte reliable event once a second (spread over the
// ticks). The server and the clients run in two child processes (the
// bench binary started again with -game-role), so that the server's CPU
// time and memory are its own. See README.md, "game".

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"runtime/metrics"
	"runtime/pprof"
	"runtime/trace"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/knet-go/knet"
	kcp "github.com/xtaci/kcp-go/v5"
)

// Traffic of the game scenario.
const (
	gameTickHz   = 30
	gameTick     = time.Second / gameTickHz
	gameInputHz  = 60
	gameInputLen = 32
	gameSnapLen  = 200
	gameEventLen = 64
	// gameInputSlots spreads each client's inputs over its input period:
	// the senders wake gameInputSlots times a period and each time send
	// for one slot's share of the clients, as unsynchronised players do.
	gameInputSlots = 8
	// Delivery: at least this share of the expected snapshots must reach
	// the clients, and of the expected ticks must run, for on time.
	gameOnTimeShare = 0.95
	// gameConnectLimit bounds how long the server waits for all the
	// clients to connect.
	gameConnectLimit = 90 * time.Second
)

// Message kinds, the first payload byte (knet also uses them as IDs, +10).
const (
	kindInput    = 1
	kindSnapshot = 2
	kindEvent    = 3
)

// Phase of the server, carried in snapshots so that the clients count
// only those sent during the measurement window.
const (
	phaseWarmup  = 0
	phaseMeasure = 1
	phaseAfter   = 2
)

// gameFlags are the flags of the child processes (and of the parent,
// which passes them on).
type gameFlags struct {
	role       string
	lib        string
	addr       string
	n          int
	warmup     time.Duration
	dur        time.Duration
	cpuprofile string
	trace      string        // runtime/trace of each process, base name
	traceFor   time.Duration // from the window's start
}

// gameServerResult is what the server process reports, as one JSON line.
type gameServerResult struct {
	N            int     `json:"n"`
	Connected    int     `json:"connected"`
	Window       float64 `json:"window_s"`
	CPU          float64 `json:"cpu_s"` // user+sys over the window
	Ticks        int     `json:"ticks"`
	TickP50      float64 `json:"tick_p50_us"`
	TickP99      float64 `json:"tick_p99_us"`
	TickMax      float64 `json:"tick_max_us"`
	LateP99      float64 `json:"late_p99_us"` // tick start after its due time
	SnapsSent    uint64  `json:"snaps_sent"`
	SnapsMissed  uint64  `json:"snaps_missed"` // send buffer full / write refused
	EventsSent   uint64  `json:"events_sent"`
	EventsMissed uint64  `json:"events_missed"`
	Inputs       uint64  `json:"inputs"`
	MemBase      uint64  `json:"mem_base"` // heap in use + stacks after GC, no clients
	MemAfter     uint64  `json:"mem_after"`
	Goroutines   int     `json:"goroutines"`
	GCs          uint32  `json:"gcs"`           // GC cycles during the window
	RcvbufErrors uint64  `json:"rcvbuf_errors"` // system-wide, over the window
	SchedP50     float64 `json:"sched_p50_us"`  // goroutines' wait while runnable, over the window
	SchedP99     float64 `json:"sched_p99_us"`
	SchedN       uint64  `json:"sched_n"`  // goroutine schedulings in the window
	VolCS        uint64  `json:"vol_cs"`   // the process's voluntary context switches in the window
	InvolCS      uint64  `json:"invol_cs"` // and involuntary ones (preempted by the OS)
	Extra        string  `json:"extra,omitempty"`
	Profile      string  `json:"profile,omitempty"`
	Trace        string  `json:"trace,omitempty"`
	MachineBusy  float64 `json:"machine_busy,omitempty"` // all CPUs, all processes (/proc/stat), over the window
	// System calls over the window (perf), if counted.
	SendCalls uint64 `json:"send_calls,omitempty"`
	RecvCalls uint64 `json:"recv_calls,omitempty"`
	Counted   bool   `json:"counted,omitempty"`
}

// gameClientResult is what the clients process reports.
type gameClientResult struct {
	Connected int     `json:"connected"`
	Snaps     uint64  `json:"snaps"` // snapshots of the window received
	Events    uint64  `json:"events"`
	InputsOK  uint64  `json:"inputs_ok"`
	LatP50    float64 `json:"lat_p50_us"`
	LatP99    float64 `json:"lat_p99_us"`
	LatMax    float64 `json:"lat_max_us"`
	CPU       float64 `json:"cpu_s"` // whole life of the process
	Life      float64 `json:"life_s"`
	// Over the server's window as the clients saw it: from the first
	// snapshot of the window to the first one sent after it.
	WinCPU   float64 `json:"win_cpu_s,omitempty"`
	Win      float64 `json:"win_s,omitempty"`
	SchedP50 float64 `json:"sched_p50_us,omitempty"` // goroutines' wait while runnable, over the window
	SchedP99 float64 `json:"sched_p99_us,omitempty"`
	SchedN   uint64  `json:"sched_n,omitempty"`
	VolCS    uint64  `json:"vol_cs,omitempty"`
	InvolCS  uint64  `json:"invol_cs,omitempty"`
	Profile  string  `json:"profile,omitempty"`
	Trace    string  `json:"trace,omitempty"`
	Extra    string  `json:"extra,omitempty"`
}

// ---------------------------------------------------------------- parent

// gameResult is one run of the scenario, both processes' reports.
type gameResult struct {
	srv gameServerResult
	cli gameClientResult
}

// gameSaturated is the share of the machine's cores (GOMAXPROCS) that
// the server and clients processes together may use over the window
// before the run is flagged as saturated: beyond it the server's figures
// say as much about the CPU its own load generator took as about it.
const gameSaturated = 0.9

// gameCores is the cores the processes may use: GOMAXPROCS, which the
// children inherit (NumCPU unless set).
func gameCores() int { return min(runtime.GOMAXPROCS(0), runtime.NumCPU()) }

// serverCores is the server process's CPU over the window / window.
func (r gameResult) serverCores() float64 { return r.srv.CPU / r.srv.Window }

// clientCores is the clients process's CPU over the window / window.
func (r gameResult) clientCores() (float64, bool) {
	if r.cli.Win <= 0 {
		return 0, false
	}
	return r.cli.WinCPU / r.cli.Win, true
}

// saturated reports whether server + clients used at least
// gameSaturated of the cores over the window (own), and whether the
// whole machine, other processes included, was that busy (machine).
func (r gameResult) saturated() (own, machine bool) {
	c, ok := r.clientCores()
	own = ok && r.serverCores()+c >= gameSaturated*float64(gameCores())
	return own, r.srv.MachineBusy >= gameSaturated
}

func (r gameResult) cpuPerClient() float64 { // µs of CPU per client per second
	return r.srv.CPU / r.srv.Window / float64(r.srv.N) * 1e6
}

// cpuPerMessage is µs of server CPU per message carried: inputs the
// server received, snapshots the clients received, events sent. Unlike
// CPU per client it does not fall when the server falls behind and
// carries less (snapshots sent counts those a newer one replaced in the
// send queue, which cost little: hence the clients' count).
func (r gameResult) cpuPerMessage() float64 {
	n := r.srv.Inputs + r.cli.Snaps + r.srv.EventsSent
	if n == 0 {
		return 0
	}
	return r.srv.CPU / float64(n) * 1e6
}

// sendCallsPerSnap is the server's send system calls over the window
// per snapshot it sent (acks and events included in the calls).
func (r gameResult) sendCallsPerSnap() (float64, bool) {
	if !r.srv.Counted || r.srv.SnapsSent == 0 {
		return 0, false
	}
	return float64(r.srv.SendCalls) / float64(r.srv.SnapsSent), true
}

func (r gameResult) memPerConn() float64 { // KiB
	if r.srv.MemAfter < r.srv.MemBase {
		return 0
	}
	return float64(r.srv.MemAfter-r.srv.MemBase) / float64(r.srv.N) / 1024
}

// delivered is the share of the window's snapshots that the server
// meant to send (one per client per tick) and the clients received.
func (r gameResult) delivered() float64 {
	want := float64(r.srv.N) * float64(r.srv.Ticks)
	if want == 0 {
		return 0
	}
	return min(1, float64(r.cli.Snaps)/want)
}

// onTime is the scenario's definition: the tick's work stays under the
// tick period at p99, at least 95 % of the window's ticks ran, and at
// least 95 % of the snapshots they were to send reached the clients.
func (r gameResult) onTime() bool {
	wantTicks := r.srv.Window * gameTickHz
	return r.srv.TickP99 < float64(gameTick/time.Microsecond) &&
		float64(r.srv.Ticks) >= gameOnTimeShare*wantTicks &&
		r.delivered() >= gameOnTimeShare
}

// gameLibName is the -game-lib value of a column.
func gameLibName(col string) string {
	switch col {
	case colKnet:
		return "knet"
	case colKCP:
		return "kcp"
	case colUDP:
		return "udp"
	case colUDPB:
		return "udpbatch"
	}
	return ""
}

// child is a started child process with its stdout as lines.
type child struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	lines chan string
}

func startChild(e *env, name string, args ...string) (*child, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(exe, args...)
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = childAttr()
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	c := &child{cmd: cmd, stdin: stdin, lines: make(chan string, 16)}
	go func() {
		sc := bufio.NewScanner(out)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			c.lines <- sc.Text()
		}
		close(c.lines)
	}()
	var once sync.Once
	e.add(name, closerFunc(func() error {
		once.Do(func() {
			stdin.Close()
			done := make(chan struct{})
			go func() { cmd.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(3 * time.Second):
				cmd.Process.Kill()
				<-done
			}
		})
		return nil
	}))
	return c, nil
}

// expect waits for a line starting with prefix and returns the rest.
func (c *child) expect(e *env, who, prefix string, limit time.Duration) (string, error) {
	t := time.NewTimer(limit)
	defer t.Stop()
	for {
		select {
		case l, ok := <-c.lines:
			if !ok {
				return "", fmt.Errorf("%s exited before %q", who, prefix)
			}
			if rest, ok := strings.CutPrefix(l, prefix); ok {
				return strings.TrimSpace(rest), nil
			}
			if rest, ok := strings.CutPrefix(l, "error "); ok {
				return "", fmt.Errorf("%s: %s", who, rest)
			}
		case <-t.C:
			return "", fmt.Errorf("%s: no %q within %v", who, prefix, limit)
		case <-e.ctx.Done():
			return "", e.ctx.Err()
		}
	}
}

// runGame runs the scenario once for one library and n clients.
func runGame(e *env, col string, n int, warm, dur time.Duration, profile, trace string, traceFor time.Duration) (gameResult, error) {
	var res gameResult
	common := []string{"-game-lib=" + gameLibName(col), "-game-n=" + strconv.Itoa(n),
		"-game-warmup=" + warm.String(), "-game-duration=" + dur.String()}
	if profile != "" {
		common = append(common, "-game-cpuprofile="+profile)
	}
	if trace != "" {
		common = append(common, "-game-trace="+trace, "-game-trace-for="+traceFor.String())
	}
	sargs := append([]string{"-game-role=server"}, common...)
	srv, err := startChild(e, "server process", sargs...)
	if err != nil {
		return res, err
	}
	addr, err := srv.expect(e, "server", "addr ", 10*time.Second)
	if err != nil {
		return res, err
	}
	cli, err := startChild(e, "clients process", append([]string{"-game-role=clients", "-game-addr=" + addr}, common...)...)
	if err != nil {
		return res, err
	}
	line, err := srv.expect(e, "server", "result ", gameConnectLimit+warm+dur+10*time.Second)
	if err != nil {
		return res, err
	}
	if err := json.Unmarshal([]byte(line), &res.srv); err != nil {
		return res, fmt.Errorf("server result: %w", err)
	}
	// Snapshots sent at the window's end are still on their way.
	if !e.sleep(300 * time.Millisecond) {
		return res, nil
	}
	cli.stdin.Close()
	line, err = cli.expect(e, "clients", "result ", 20*time.Second)
	if err != nil {
		return res, err
	}
	if err := json.Unmarshal([]byte(line), &res.cli); err != nil {
		return res, fmt.Errorf("clients result: %w", err)
	}
	return res, nil
}

// ---------------------------------------------------------------- children

// gameChild runs a child process's role and exits.
func gameChild(g gameFlags) {
	raiseNoFile()
	out := bufio.NewWriter(os.Stdout)
	say := func(format string, args ...any) {
		fmt.Fprintf(out, format+"\n", args...)
		out.Flush()
	}
	var err error
	switch g.role {
	case "server":
		err = gameServe(g, say)
	case "clients":
		err = gameClients(g, say)
	default:
		err = fmt.Errorf("unknown -game-role %q", g.role)
	}
	if err != nil {
		say("error %v", err)
		fmt.Fprintf(os.Stderr, "game %s (%s, %d clients): %v\n", g.role, g.lib, g.n, err)
		os.Exit(1)
	}
}

// stdinClosed is closed when the parent closes our stdin: time to stop.
func stdinClosed() <-chan struct{} {
	ch := make(chan struct{})
	go func() {
		io.Copy(io.Discard, os.Stdin)
		close(ch)
	}()
	return ch
}

// memInUse is heap in use plus goroutine stacks, after a GC.
func memInUse() uint64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapInuse + ms.StackInuse
}

func gcCount() uint32 {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.NumGC
}

// A gameServer is one library's server side. tick runs on the tick
// loop: it takes what arrived and sends snap to every client, and event
// (reliably) to those whose turn it is.
type gameServer interface {
	addr() string
	clients() int
	tick(t int, snap, event []byte)
	counters() (snapsSent, snapsMissed, eventsSent, eventsMissed, inputs uint64)
	close()
}

// extraNoter is a server or client set with counters worth a note.
type extraNoter interface{ extra() string }

func extraOf(v any) string {
	if x, ok := v.(extraNoter); ok {
		return x.extra()
	}
	return ""
}

// schedHist reads the runtime's histogram of how long goroutines waited
// to run once runnable.
func schedHist() *metrics.Float64Histogram {
	s := []metrics.Sample{{Name: "/sched/latencies:seconds"}}
	metrics.Read(s)
	if s[0].Value.Kind() != metrics.KindFloat64Histogram {
		return nil
	}
	return s[0].Value.Float64Histogram()
}

// schedQuantiles gives the p50 and p99 (µs, upper bucket bounds) and the
// count of b's samples not in a.
func schedQuantiles(a, b *metrics.Float64Histogram) (p50, p99 float64, n uint64) {
	if a == nil || b == nil || len(a.Counts) != len(b.Counts) {
		return 0, 0, 0
	}
	d := make([]uint64, len(b.Counts))
	for i := range d {
		d[i] = b.Counts[i] - a.Counts[i]
		n += d[i]
	}
	q := func(p float64) float64 {
		want := uint64(float64(n)*p + 0.5)
		var acc uint64
		for i, c := range d {
			acc += c
			if acc >= max(want, 1) {
				return b.Buckets[i+1] * 1e6
			}
		}
		return 0
	}
	if n == 0 {
		return 0, 0, 0
	}
	return q(0.5), q(0.99), n
}

// udpRcvbufErrors is the system's count of UDP datagrams dropped for a
// full socket receive buffer (all processes).
func udpRcvbufErrors() uint64 {
	b, err := os.ReadFile("/proc/net/snmp")
	if err != nil {
		return 0
	}
	var head []string
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) == 0 || f[0] != "Udp:" {
			continue
		}
		if head == nil {
			head = f
			continue
		}
		for i, name := range head {
			if name == "RcvbufErrors" && i < len(f) {
				v, _ := strconv.ParseUint(f[i], 10, 64)
				return v
			}
		}
	}
	return 0
}

// eventTurn reports whether client i gets this tick's reliable event:
// each client once a second, spread over the ticks.
func eventTurn(i, t int) bool { return i%gameTickHz == t%gameTickHz }

func gameServe(g gameFlags, say func(string, ...any)) error {
	base := memInUse()
	var s gameServer
	var err error
	switch g.lib {
	case "knet":
		s, err = newKnetGameServer()
	case "kcp":
		s, err = newKCPGameServer()
	case "udp":
		s, err = newUDPGameServer()
	case "udpbatch":
		s, err = newUDPBatchGameServer()
	default:
		err = fmt.Errorf("unknown -game-lib %q", g.lib)
	}
	if err != nil {
		return err
	}
	defer s.close()
	say("addr %s", s.addr())
	stop := stdinClosed()

	snap := make([]byte, gameSnapLen)
	event := make([]byte, gameEventLen)
	snap[0], event[0] = kindSnapshot, kindEvent
	var (
		res                 = gameServerResult{N: g.n, MemBase: base}
		phase               = phaseWarmup
		started             = time.Now()
		warmEnd, windowEnd  time.Time
		work, late          []time.Duration
		cpu0                float64
		rcv0                uint64
		sched0              *metrics.Float64Histogram
		vcs0, ics0          uint64
		sent0, miss0, evS0  uint64
		evM0, in0           uint64
		gc0                 uint32
		profFile            *os.File
		ticker              = time.NewTicker(gameTick)
		stopped             bool
		connectedAll        bool
		windowStart         time.Time
		sent1, miss1, evS1  uint64
		evM1, in1           uint64
		cpu1                float64
		windowTicks, tickNo int
		calls               *syscallCounter
		traceFile           *os.File
		traceEnd            time.Time
		busy0, all0         uint64
	)
	defer ticker.Stop()
	for !stopped {
		var due time.Time
		select {
		case due = <-ticker.C:
		case <-stop:
			stopped = true
			continue
		}
		start := time.Now()
		if traceFile != nil {
			// The tick's wall-clock start at this point of the trace.
			trace.Log(context.Background(), "tick", strconv.FormatInt(start.UnixNano(), 10))
		}
		binary.LittleEndian.PutUint64(snap[2:], uint64(start.UnixNano()))
		binary.LittleEndian.PutUint64(event[2:], uint64(start.UnixNano()))
		snap[1], event[1] = byte(phase), byte(phase)
		s.tick(tickNo, snap, event)
		tickNo++
		d := time.Since(start)
		if phase == phaseMeasure {
			work = append(work, d)
			late = append(late, start.Sub(due))
			windowTicks++
		}
		now := time.Now()
		if traceFile != nil && now.After(traceEnd) {
			stopTrace(traceFile)
			traceFile = nil
		}
		switch {
		case !connectedAll:
			if s.clients() >= g.n {
				connectedAll = true
				warmEnd = now.Add(g.warmup)
			} else if now.Sub(started) > gameConnectLimit {
				return fmt.Errorf("only %d of %d clients connected within %v", s.clients(), g.n, gameConnectLimit)
			}
		case phase == phaseWarmup && now.After(warmEnd):
			phase = phaseMeasure
			if g.cpuprofile != "" {
				res.Profile = fmt.Sprintf("%s.%s-%d", g.cpuprofile, g.lib, g.n)
				if profFile, err = os.Create(res.Profile); err == nil {
					err = pprof.StartCPUProfile(profFile)
				}
				if err != nil {
					return err
				}
			}
			if g.trace != "" {
				res.Trace = fmt.Sprintf("%s.%s-%d.server", g.trace, g.lib, g.n)
				if traceFile, err = startTrace(res.Trace); err != nil {
					return err
				}
				traceEnd = now.Add(g.traceFor)
			}
			calls = countSyscalls()
			busy0, all0 = machineBusy()
			gc0 = gcCount()
			sent0, miss0, evS0, evM0, in0 = s.counters()
			rcv0 = udpRcvbufErrors()
			sched0 = schedHist()
			vcs0, ics0 = ctxSwitches()
			cpu0 = cpuTime()
			windowStart = time.Now()
			windowEnd = windowStart.Add(g.dur)
		case phase == phaseMeasure && now.After(windowEnd):
			cpu1 = cpuTime()
			// The window ends here, with the CPU time: stopping perf
			// below takes a while (0.3 s seen), which is not the window.
			res.Window = time.Since(windowStart).Seconds()
			busy1, all1 := machineBusy()
			if all1 > all0 {
				res.MachineBusy = float64(busy1-busy0) / float64(all1-all0)
			}
			sent1, miss1, evS1, evM1, in1 = s.counters()
			res.RcvbufErrors = udpRcvbufErrors() - rcv0
			res.SchedP50, res.SchedP99, res.SchedN = schedQuantiles(sched0, schedHist())
			vcs1, ics1 := ctxSwitches()
			res.VolCS, res.InvolCS = vcs1-vcs0, ics1-ics0
			if traceFile != nil {
				stopTrace(traceFile)
				traceFile = nil
			}
			// Stopping perf waits for it to exit: not on the tick loop,
			// whose next snapshots tell the clients the window is over.
			callsDone := make(chan struct{})
			go func() {
				res.SendCalls, res.RecvCalls, res.Counted = calls.stop()
				close(callsDone)
			}()
			if profFile != nil {
				pprof.StopCPUProfile()
				profFile.Close()
			}
			res.GCs = gcCount() - gc0
			phase = phaseAfter
			res.Connected = s.clients()
			res.CPU = cpu1 - cpu0
			res.Ticks = windowTicks
			res.SnapsSent, res.SnapsMissed = sent1-sent0, miss1-miss0
			res.EventsSent, res.EventsMissed, res.Inputs = evS1-evS0, evM1-evM0, in1-in0
			slices.Sort(work)
			slices.Sort(late)
			res.TickP50, res.TickP99 = us(percentile(work, 0.5)), us(percentile(work, 0.99))
			res.TickMax, res.LateP99 = us(work[len(work)-1]), us(percentile(late, 0.99))
			res.Goroutines = runtime.NumGoroutine()
			res.Extra = extraOf(s)
			res.MemAfter = memInUse()
			if res.Profile != "" {
				if f, err := os.Create(res.Profile + ".heap"); err == nil {
					pprof.Lookup("heap").WriteTo(f, 0)
					f.Close()
				}
			}
			go func() { // res is final: the loop only ticks from here
				<-callsDone
				b, _ := json.Marshal(res)
				say("result %s", b)
			}()
		}
	}
	return nil
}

// gameClients runs n clients until stdin closes, then reports.
func gameClients(g gameFlags, say func(string, ...any)) error {
	born := time.Now()
	var c gameClientSet
	switch g.lib {
	case "knet":
		c = &knetGameClients{}
	case "kcp":
		c = &kcpGameClients{}
	case "udp", "udpbatch": // the batched server's clients are raw UDP's
		c = &udpGameClients{}
	default:
		return fmt.Errorf("unknown -game-lib %q", g.lib)
	}
	st := &gameClientStats{}
	w := &clientWindow{g: g}
	st.onBegin, st.onEnd = w.begin, w.end
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stop := stdinClosed()
	go func() { <-stop; cancel() }()
	k, err := c.dial(ctx, g.addr, g.n, st)
	if err != nil {
		return err
	}
	go gameSendInputs(ctx, k, c.send, st)
	<-ctx.Done()
	res := gameClientResult{Connected: k, Snaps: st.snaps.Load(), Events: st.events.Load(), InputsOK: st.inputs.Load()}
	res.LatP50, res.LatP99, res.LatMax = st.lat.quantile(0.5), st.lat.quantile(0.99), st.lat.max()
	res.CPU, res.Life = cpuTime(), time.Since(born).Seconds()
	st.endOnce.Do(w.end) // if no snapshot after the window arrived
	w.report(&res)
	res.Extra = extraOf(c)
	b, _ := json.Marshal(res)
	say("result %s", b)
	c.close()
	return nil
}

// clientWindow measures the clients process over the server's window,
// from the first snapshot of the window received to the first one sent
// after it, and profiles or traces it when asked.
type clientWindow struct {
	g          gameFlags
	mu         sync.Mutex
	t0, t1     time.Time
	cpu0, cpu1 float64
	sched0     *metrics.Float64Histogram
	sched1     *metrics.Float64Histogram
	vcs, ics   [2]uint64
	profile    string
	prof       *os.File
	traceName  string
	trace      *os.File
}

func (w *clientWindow) begin() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.cpu0, w.t0 = cpuTime(), time.Now()
	w.sched0 = schedHist()
	w.vcs[0], w.ics[0] = ctxSwitches()
	if w.g.cpuprofile != "" {
		w.profile = fmt.Sprintf("%s.%s-%d.clients", w.g.cpuprofile, w.g.lib, w.g.n)
		if f, err := os.Create(w.profile); err == nil {
			if pprof.StartCPUProfile(f) == nil {
				w.prof = f
			} else {
				f.Close()
			}
		}
	}
	if w.g.trace != "" {
		w.traceName = fmt.Sprintf("%s.%s-%d.clients", w.g.trace, w.g.lib, w.g.n)
		if f, err := startTrace(w.traceName); err == nil {
			w.trace = f
			go w.traceClock(f)
			time.AfterFunc(w.g.traceFor, func() {
				w.mu.Lock()
				defer w.mu.Unlock()
				if w.trace != nil {
					stopTrace(w.trace)
					w.trace = nil
				}
			})
		}
	}
}

// traceClock logs the wall clock into the trace every millisecond, so
// that its events can be set against the server's (whose ticks log
// their wall-clock start).
func (w *clientWindow) traceClock(f *os.File) {
	for {
		w.mu.Lock()
		on := w.trace == f
		w.mu.Unlock()
		if !on {
			return
		}
		trace.Log(context.Background(), "wall", strconv.FormatInt(time.Now().UnixNano(), 10))
		time.Sleep(time.Millisecond)
	}
}

func (w *clientWindow) end() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.t0.IsZero() {
		return
	}
	w.cpu1, w.t1 = cpuTime(), time.Now()
	w.sched1 = schedHist()
	w.vcs[1], w.ics[1] = ctxSwitches()
	if w.prof != nil {
		pprof.StopCPUProfile()
		w.prof.Close()
		w.prof = nil
	}
	if w.trace != nil {
		stopTrace(w.trace)
		w.trace = nil
	}
}

func (w *clientWindow) report(r *gameClientResult) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.t1.IsZero() {
		return
	}
	r.WinCPU, r.Win = w.cpu1-w.cpu0, w.t1.Sub(w.t0).Seconds()
	r.SchedP50, r.SchedP99, r.SchedN = schedQuantiles(w.sched0, w.sched1)
	r.VolCS, r.InvolCS = w.vcs[1]-w.vcs[0], w.ics[1]-w.ics[0]
	r.Profile, r.Trace = w.profile, w.traceName
}

// startTrace starts the execution tracer into a new file.
func startTrace(name string) (*os.File, error) {
	f, err := os.Create(name)
	if err != nil {
		return nil, err
	}
	if err := trace.Start(f); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

func stopTrace(f *os.File) {
	trace.Stop()
	f.Close()
}

// machineBusy is the machine's CPU time so far (/proc/stat, all CPUs,
// all processes): busy and total, in clock ticks.
func machineBusy() (busy, total uint64) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 5 || f[0] != "cpu" {
		return 0, 0
	}
	for i, x := range f[1:] {
		v, _ := strconv.ParseUint(x, 10, 64)
		if i >= 7 { // guest time is counted in user already
			break
		}
		total += v
		if i != 3 && i != 4 { // idle, iowait
			busy += v
		}
	}
	return busy, total
}

// gameClientSet is one library's n clients.
type gameClientSet interface {
	// dial connects n clients (or as many as it can, k) and starts
	// receiving on them into st.
	dial(ctx context.Context, addr string, n int, st *gameClientStats) (k int, err error)
	send(i int, input []byte) bool
	close()
}

type gameClientStats struct {
	snaps, events, inputs atomic.Uint64
	lat                   latHist
	// onBegin runs at the first message of the window, onEnd at the
	// first one sent after it.
	onBegin, onEnd     func()
	beginOnce, endOnce sync.Once
}

// got counts a message received at now.
func (st *gameClientStats) got(p []byte, now int64) {
	if len(p) < 10 {
		return
	}
	switch p[1] {
	case phaseMeasure:
		st.beginOnce.Do(st.onBegin)
	case phaseAfter:
		st.endOnce.Do(st.onEnd)
		return
	default:
		return
	}
	switch p[0] {
	case kindSnapshot:
		st.snaps.Add(1)
		st.lat.add(time.Duration(now - int64(binary.LittleEndian.Uint64(p[2:]))))
	case kindEvent:
		st.events.Add(1)
	}
}

// gameSendInputs sends every client's input gameInputHz times a second,
// the clients spread over gameInputSlots slots of the period.
func gameSendInputs(ctx context.Context, n int, send func(int, []byte) bool, st *gameClientStats) {
	period := time.Second / gameInputHz / gameInputSlots
	t := time.NewTicker(period)
	defer t.Stop()
	in := make([]byte, gameInputLen)
	in[0] = kindInput
	var seq uint32
	for slot := 0; ; slot = (slot + 1) % gameInputSlots {
		select {
		case <-t.C:
		case <-ctx.Done():
			return
		}
		if slot == 0 {
			seq++
			binary.LittleEndian.PutUint32(in[2:], seq)
		}
		for i := slot; i < n; i += gameInputSlots {
			if send(i, in) {
				st.inputs.Add(1)
			}
		}
	}
}

// dialAll dials n clients, gameDialParallel at a time, and returns how
// many connected; it fails only if none did.
func dialAll(ctx context.Context, n int, dial func(i int) error) (int, error) {
	const gameDialParallel = 32
	var wg sync.WaitGroup
	var ok atomic.Int64
	var first atomic.Pointer[error]
	slots := make(chan struct{}, gameDialParallel)
	for i := range n {
		if ctx.Err() != nil {
			break
		}
		slots <- struct{}{}
		wg.Go(func() {
			defer func() { <-slots }()
			if err := dial(i); err != nil {
				first.CompareAndSwap(nil, &err)
				return
			}
			ok.Add(1)
		})
	}
	wg.Wait()
	k := int(ok.Load())
	if p := first.Load(); p != nil {
		fmt.Fprintf(os.Stderr, "game clients: %d of %d dials failed; first: %v\n", n-k, n, *p)
		if k == 0 {
			return 0, *p
		}
	}
	return k, nil
}

// latHist is a histogram of latencies in 10 µs buckets up to 2 s.
type latHist struct {
	b   [200_000]atomic.Uint64
	top atomic.Int64
}

const latBucket = 10 * time.Microsecond

func (h *latHist) add(d time.Duration) {
	d = max(d, 0)
	i := min(int(d/latBucket), len(h.b)-1)
	h.b[i].Add(1)
	for {
		t := h.top.Load()
		if int64(d) <= t || h.top.CompareAndSwap(t, int64(d)) {
			return
		}
	}
}

// quantile is the upper end of the bucket holding the q-quantile, in µs.
func (h *latHist) quantile(q float64) float64 {
	var total uint64
	for i := range h.b {
		total += h.b[i].Load()
	}
	if total == 0 {
		return 0
	}
	want := uint64(float64(total)*q + 0.5)
	var acc uint64
	for i := range h.b {
		acc += h.b[i].Load()
		if acc >= max(want, 1) {
			return us(time.Duration(i+1) * latBucket)
		}
	}
	return h.max()
}

func (h *latHist) max() float64 { return us(time.Duration(h.top.Load())) }

// ---------------------------------------------------------------- knet

const (
	gameKnetInputID = 10 + kindInput
	gameKnetSnapID  = 10 + kindSnapshot
	gameKnetEventID = 10 + kindEvent
)

// knetGameServer is the way a game server uses knet: connections handed
// to a Group, one tick loop that Polls it and sends with TrySend, no
// goroutine of its own per connection.
type knetGameServer struct {
	l      *knet.Listener
	g      *knet.Group
	events []knet.Event
	conns  []*knet.Conn
	n      atomic.Int64

	snapsSent, snapsMissed, eventsSent, eventsMissed, inputs atomic.Uint64
}

func newKnetGameServer() (*knetGameServer, error) {
	s := &knetGameServer{g: knet.NewGroup(), events: make([]knet.Event, 256)}
	cfg := knetConfig()
	cfg.Group = s.g
	l, err := knet.Listen("udp", loopback, cfg)
	if err != nil {
		return nil, err
	}
	s.l = l
	return s, nil
}

func (s *knetGameServer) extra() string { return knetTotals(s.conns) }
func (s *knetGameServer) addr() string  { return s.l.Addr().String() }
func (s *knetGameServer) clients() int  { return int(s.n.Load()) }
func (s *knetGameServer) close()        { s.l.Close() }
func (s *knetGameServer) counters() (uint64, uint64, uint64, uint64, uint64) {
	return s.snapsSent.Load(), s.snapsMissed.Load(), s.eventsSent.Load(), s.eventsMissed.Load(), s.inputs.Load()
}

func (s *knetGameServer) tick(t int, snap, event []byte) {
	for {
		n := s.g.Poll(s.events)
		for i := range s.events[:n] {
			ev := &s.events[i]
			switch ev.Kind {
			case knet.EventConnected:
				s.conns = append(s.conns, ev.Conn)
			case knet.EventMessage:
				if ev.Message.ID == gameKnetInputID {
					s.inputs.Add(1)
				}
			case knet.EventDisconnected:
				if j := slices.Index(s.conns, ev.Conn); j >= 0 {
					s.conns = slices.Delete(s.conns, j, j+1)
				}
			}
		}
		if n < len(s.events) {
			break
		}
	}
	s.n.Store(int64(len(s.conns)))
	var sent, missed, evSent, evMissed uint64
	for i, c := range s.conns {
		// Latest state: a newer snapshot replaces one still queued.
		if c.TrySend(knet.Message{ID: gameKnetSnapID, ContentID: 1, Payload: snap}) == nil {
			sent++
		} else {
			missed++
		}
		if eventTurn(i, t) {
			if c.TrySend(knet.Message{ID: gameKnetEventID, Payload: event, Reliable: true, InOrder: true, Channel: 2}) == nil {
				evSent++
			} else {
				evMissed++
			}
		}
	}
	s.snapsSent.Add(sent)
	s.snapsMissed.Add(missed)
	s.eventsSent.Add(evSent)
	s.eventsMissed.Add(evMissed)
}

// knetGameClients are real knet clients, each a Dial with its own
// socket, all handed to a few Groups; one goroutine per Group receives
// (Wait, then Poll) and one goroutine sends every client's inputs.
type knetGameClients struct {
	conns  []*knet.Conn
	groups []*knet.Group
}

func (c *knetGameClients) dial(ctx context.Context, addr string, n int, st *gameClientStats) (int, error) {
	c.conns = make([]*knet.Conn, n)
	c.groups = make([]*knet.Group, runtime.GOMAXPROCS(0))
	for i := range c.groups {
		g := knet.NewGroup()
		c.groups[i] = g
		go func() {
			events := make([]knet.Event, 256)
			for g.Wait(ctx) == nil {
				n := g.Poll(events)
				now := time.Now().UnixNano()
				for j := range events[:n] {
					if events[j].Kind == knet.EventMessage {
						st.got(events[j].Message.Payload, now)
					}
				}
			}
		}()
	}
	k, err := dialAll(ctx, n, func(i int) error {
		cfg := knetConfig()
		cfg.Group = c.groups[i%len(c.groups)]
		conn, err := knet.Dial(ctx, "udp", addr, cfg)
		if err != nil {
			return err
		}
		c.conns[i] = conn
		return nil
	})
	c.conns = slices.DeleteFunc(c.conns, func(c *knet.Conn) bool { return c == nil })
	return k, err
}

func (c *knetGameClients) send(i int, in []byte) bool {
	// Unreliable sequenced: never an older input after a newer one.
	return c.conns[i].TrySend(knet.Message{ID: gameKnetInputID, Payload: in, InOrder: true, Channel: 1}) == nil
}

func (c *knetGameClients) extra() string { return knetTotals(c.conns) }

// knetTotals sums the connections' counters (over their whole life).
func knetTotals(conns []*knet.Conn) string {
	var t knet.Stats
	var rate, rtt []float64
	for _, c := range conns {
		s := c.Stats()
		rate = append(rate, s.SendRate)
		rtt = append(rtt, float64(s.RTT)/1e6)
		t.QueuedBytes = max(t.QueuedBytes, s.QueuedBytes)
		t.DatagramsSent += s.DatagramsSent
		t.DatagramsReceived += s.DatagramsReceived
		t.Retransmits += s.Retransmits
		t.DroppedDatagrams += s.DroppedDatagrams
		t.DroppedMessages += s.DroppedMessages
		t.MessagesSent += s.MessagesSent
		t.MessagesReceived += s.MessagesReceived
	}
	slices.Sort(rate)
	slices.Sort(rtt)
	q := func(v []float64, p float64) float64 {
		if len(v) == 0 {
			return 0
		}
		return v[min(int(float64(len(v))*p), len(v)-1)]
	}
	return fmt.Sprintf("knet totals over %d conns: msgs sent %d, received %d, dgrams sent %d, received %d, retransmits %d, dropped dgrams %d, dropped unreliable msgs %d; send rate allowed min %.0f / median %.0f dgram/s, RTT median %.1f ms / max %.1f ms, largest send queue %d B",
		len(conns), t.MessagesSent, t.MessagesReceived, t.DatagramsSent, t.DatagramsReceived, t.Retransmits, t.DroppedDatagrams, t.DroppedMessages,
		q(rate, 0), q(rate, 0.5), q(rtt, 0.5), q(rtt, 1), t.QueuedBytes)
}

func (c *knetGameClients) close() {
	var wg sync.WaitGroup
	for _, conn := range c.conns {
		wg.Go(func() { conn.Close() })
	}
	waitAtMost(&wg, 3*time.Second)
}

func waitAtMost(wg *sync.WaitGroup, d time.Duration) {
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(d):
	}
}

// ---------------------------------------------------------------- kcp-go

// kcpGameServer is what kcp-go offers: a session per client, a
// goroutine per session to Read it, and the tick loop Writing to each
// session. A Write deadline in the past makes Write return at once when
// the session's send window is full (the message is then not sent), so
// the tick never blocks. kcp has no unreliable mode: every input and
// snapshot is a reliable, ordered kcp message (message mode: one Write,
// one message, one Read).
type kcpGameServer struct {
	l  *kcp.Listener
	mu sync.Mutex
	ss []*kcp.UDPSession

	snapsSent, snapsMissed, eventsSent, eventsMissed, inputs atomic.Uint64
	view                                                     []*kcp.UDPSession
}

var pastDeadline = time.Unix(1, 0)

func newKCPGameServer() (*kcpGameServer, error) {
	l, err := kcp.ListenWithOptions(loopback, nil, 0, 0)
	if err != nil {
		return nil, err
	}
	l.SetReadBuffer(4 << 20)
	l.SetWriteBuffer(4 << 20)
	s := &kcpGameServer{l: l}
	go func() {
		for {
			ss, err := l.AcceptKCP()
			if err != nil {
				return
			}
			tuneKCP(ss)
			ss.SetWriteDeadline(pastDeadline)
			s.mu.Lock()
			s.ss = append(s.ss, ss)
			s.mu.Unlock()
			go func() {
				buf := make([]byte, 1500)
				for {
					n, err := ss.Read(buf)
					if err != nil {
						return
					}
					if n > 0 && buf[0] == kindInput {
						s.inputs.Add(1)
					}
				}
			}()
		}
	}()
	return s, nil
}

func (s *kcpGameServer) addr() string { return s.l.Addr().String() }
func (s *kcpGameServer) clients() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.ss)
}
func (s *kcpGameServer) counters() (uint64, uint64, uint64, uint64, uint64) {
	return s.snapsSent.Load(), s.snapsMissed.Load(), s.eventsSent.Load(), s.eventsMissed.Load(), s.inputs.Load()
}

func (s *kcpGameServer) close() {
	s.mu.Lock()
	ss := s.ss
	s.mu.Unlock()
	for _, x := range ss {
		x.Close()
	}
	s.l.Close()
}

func (s *kcpGameServer) tick(t int, snap, event []byte) {
	s.mu.Lock()
	s.view = append(s.view[:0], s.ss...)
	s.mu.Unlock()
	var sent, missed, evSent, evMissed uint64
	for i, ss := range s.view {
		if _, err := ss.Write(snap); err == nil {
			sent++
		} else {
			missed++
		}
		if eventTurn(i, t) {
			if _, err := ss.Write(event); err == nil {
				evSent++
			} else {
				evMissed++
			}
		}
	}
	s.snapsSent.Add(sent)
	s.snapsMissed.Add(missed)
	s.eventsSent.Add(evSent)
	s.eventsMissed.Add(evMissed)
}

// kcpGameClients: a kcp-go session per client (its own socket), a
// goroutine per session to Read.
type kcpGameClients struct{ ss []*kcp.UDPSession }

func (c *kcpGameClients) dial(ctx context.Context, addr string, n int, st *gameClientStats) (int, error) {
	c.ss = make([]*kcp.UDPSession, n)
	k, err := dialAll(ctx, n, func(i int) error {
		ss, err := kcp.DialWithOptions(addr, nil, 0, 0)
		if err != nil {
			return err
		}
		tuneKCP(ss)
		ss.SetWriteDeadline(pastDeadline)
		c.ss[i] = ss
		// kcp-go's server learns of a session from its first message.
		hello := make([]byte, gameInputLen)
		if _, err := ss.Write(hello); err != nil {
			ss.Close()
			c.ss[i] = nil
			return err
		}
		go func() {
			buf := make([]byte, 1500)
			for {
				n, err := ss.Read(buf)
				if err != nil {
					return
				}
				st.got(buf[:n], time.Now().UnixNano())
			}
		}()
		return nil
	})
	c.ss = slices.DeleteFunc(c.ss, func(s *kcp.UDPSession) bool { return s == nil })
	return k, err
}

func (c *kcpGameClients) send(i int, in []byte) bool {
	_, err := c.ss[i].Write(in)
	return err == nil
}

func (c *kcpGameClients) close() {
	for _, s := range c.ss {
		s.Close()
	}
}

// ---------------------------------------------------------------- raw UDP

// udpGameServer is the floor: one socket, one goroutine reading inputs
// (a new address is a new client), the tick loop writing snapshots and
// events with WriteTo; nothing is acknowledged or resent.
type udpGameServer struct {
	pc *net.UDPConn
	mu sync.Mutex
	by map[netip.AddrPort]struct{}
	to []netip.AddrPort

	snapsSent, snapsMissed, eventsSent, eventsMissed, inputs atomic.Uint64
	view                                                     []netip.AddrPort
}

func newUDPGameServer() (*udpGameServer, error) {
	pc, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		return nil, err
	}
	pc.SetReadBuffer(4 << 20)
	pc.SetWriteBuffer(4 << 20)
	s := &udpGameServer{pc: pc, by: map[netip.AddrPort]struct{}{}}
	go func() {
		buf := make([]byte, 1500)
		for {
			n, from, err := pc.ReadFromUDPAddrPort(buf)
			if err != nil {
				if errors.Is(err, net.ErrClosed) {
					return
				}
				continue
			}
			if n == 0 || buf[0] != kindInput {
				continue
			}
			s.inputs.Add(1)
			s.mu.Lock()
			if _, ok := s.by[from]; !ok {
				s.by[from] = struct{}{}
				s.to = append(s.to, from)
			}
			s.mu.Unlock()
		}
	}()
	return s, nil
}

func (s *udpGameServer) addr() string { return s.pc.LocalAddr().String() }
func (s *udpGameServer) close()       { s.pc.Close() }
func (s *udpGameServer) clients() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.to)
}
func (s *udpGameServer) counters() (uint64, uint64, uint64, uint64, uint64) {
	return s.snapsSent.Load(), s.snapsMissed.Load(), s.eventsSent.Load(), s.eventsMissed.Load(), s.inputs.Load()
}

func (s *udpGameServer) tick(t int, snap, event []byte) {
	s.mu.Lock()
	s.view = append(s.view[:0], s.to...)
	s.mu.Unlock()
	var sent, missed, evSent, evMissed uint64
	for i, to := range s.view {
		if _, err := s.pc.WriteToUDPAddrPort(snap, to); err == nil {
			sent++
		} else {
			missed++
		}
		if eventTurn(i, t) {
			if _, err := s.pc.WriteToUDPAddrPort(event, to); err == nil {
				evSent++
			} else {
				evMissed++
			}
		}
	}
	s.snapsSent.Add(sent)
	s.snapsMissed.Add(missed)
	s.eventsSent.Add(evSent)
	s.eventsMissed.Add(evMissed)
}

// udpGameClients: a connected UDP socket per client, a goroutine per
// socket to read (Go has no other way to wait on many sockets).
type udpGameClients struct{ cs []*net.UDPConn }

func (c *udpGameClients) dial(ctx context.Context, addr string, n int, st *gameClientStats) (int, error) {
	to, err := net.ResolveUDPAddr("udp", addr)
	if err != nil {
		return 0, err
	}
	for range n {
		pc, err := net.DialUDP("udp", nil, to)
		if err != nil {
			if len(c.cs) == 0 {
				return 0, err
			}
			fmt.Fprintf(os.Stderr, "game clients: %d of %d sockets; then: %v\n", len(c.cs), n, err)
			break
		}
		c.cs = append(c.cs, pc)
		go func() {
			buf := make([]byte, 1500)
			for {
				n, err := pc.Read(buf)
				if err != nil {
					if errors.Is(err, net.ErrClosed) {
						return
					}
					continue // e.g. ECONNREFUSED before the server is up
				}
				st.got(buf[:n], time.Now().UnixNano())
			}
		}()
	}
	return len(c.cs), nil
}

func (c *udpGameClients) send(i int, in []byte) bool {
	_, err := c.cs[i].Write(in)
	return err == nil
}

func (c *udpGameClients) close() {
	for _, pc := range c.cs {
		pc.Close()
	}
}

// ---------------------------------------------------------------- report

// gameRowID names a row of the game scenario for n clients.
func gameRowID(base string, n int) string { return "g." + base + "." + strconv.Itoa(n) }

// gameLargestOnTime fills the "largest N on time" row from the on-time
// rows' medians: the largest N on time in most runs with every smaller N
// tried on time too (a larger N on time after a smaller one that was
// not is noise, and is named in brackets).
func (h *harness) gameLargestOnTime() {
	if h.sel != nil && !h.sel["game"] {
		return
	}
	for _, col := range []string{colKnet, colKCP, colUDP, colUDPB} {
		best, any, failed := 0, false, false
		var stray []string
		for _, n := range slices.Sorted(slices.Values(h.o.gameClients)) {
			c := h.t.index[gameRowID("ok", n)].cells[col]
			if c == nil {
				continue
			}
			m, ok := c.median()
			if !ok {
				failed = true // no measurement counts as not on time
				continue
			}
			any = true
			switch {
			case m.v < 0.5:
				failed = true
			case failed:
				stray = append(stray, strconv.Itoa(n))
			default:
				best = n
			}
		}
		if !any {
			continue
		}
		text := strconv.Itoa(best)
		if best == 0 {
			text = fmt.Sprintf("< %d", slices.Min(h.o.gameClients))
		}
		if len(stray) > 0 {
			text += " (" + strings.Join(stray, ", ") + " too)"
		}
		h.t.setText("g.maxn", col, float64(best), text)
	}
}

// gameTargets are the targets for the game load, as measured.
func (h *harness) gameTargets() []string {
	if h.sel != nil && !h.sel["game"] {
		return nil
	}
	var out []string
	for _, n := range h.o.gameClients {
		if s := ratioText(h.t.index[gameRowID("cpu", n)], colKnet, colKCP); s != "" {
			out = append(out, fmt.Sprintf("Game, %d clients: knet server CPU per client / kcp-go's = %s (target ≤ 0.5×).", n, s))
		}
		if s := ratioText(h.t.index[gameRowID("cpu", n)], colKnet, colUDPB); s != "" {
			// Per client flatters a server that fell behind; per
			// message does not, so both are given.
			out = append(out, fmt.Sprintf("Game, %d clients: knet server CPU per client / raw UDP batched's = %s, per message %s (target ≤ 2×).",
				n, s, ratioText(h.t.index[gameRowID("cpum", n)], colKnet, colUDPB)))
		}
	}
	if slices.Contains(h.o.gameClients, 1000) {
		ok, okOK := medianOf(h.t, gameRowID("ok", 1000), colKnet)
		p99, p99OK := medianOf(h.t, gameRowID("p99", 1000), colKnet)
		if okOK && p99OK {
			out = append(out, fmt.Sprintf("Game, 1,000 clients: knet on time: %s, snapshot p99 %s (target: on time, p99 < 5 ms).",
				map[bool]string{true: "yes", false: "no"}[ok >= 0.5], formatValue(p99, "us")))
		}
	}
	for _, n := range h.o.gameClients {
		if m, ok := medianOf(h.t, gameRowID("mem", n), colKnet); ok {
			out = append(out, fmt.Sprintf("Game, %d clients: knet server memory per connection %s (target ≤ 32 KiB).", n, formatValue(m, "KiB")))
		}
	}
	return out
}

func medianOf(t *table, id, col string) (float64, bool) {
	r := t.index[id]
	if r == nil || r.cells[col] == nil {
		return 0, false
	}
	m, ok := r.cells[col].median()
	return m.v, ok
}

func (h *harness) gameLegend() []string {
	if h.sel != nil && !h.sel["game"] {
		return nil
	}
	return []string{
		fmt.Sprintf("Game: one server, N clients; each client sends a %d B input %d times a second (knet: unreliable sequenced), the server's %d Hz tick sends each client a %d B snapshot (knet: latest state, ContentID) and, once a second per client, a %d B reliable ordered event. kcp-go has no unreliable mode: its inputs and snapshots are reliable ordered kcp messages. Server and clients run in two separate processes; window %v after %v warm-up (from when all N are connected).",
			gameInputLen, gameInputHz, gameTickHz, gameSnapLen, gameEventLen, h.o.gameDur, h.o.gameWarmup),
		"Game server CPU per client: the server process's user+sys CPU time over the window / window / N, in µs of CPU per client per second (the clients' process is not counted).",
		fmt.Sprintf("Game server / clients process CPU: each process's user+sys CPU time over the window / window, in cores (the clients' window: from the first snapshot of the window they receive to the first one sent after it); of %d cores (GOMAXPROCS). A run where the two together used ≥ %.0f %% of them, or where the whole machine (all processes, /proc/stat) was ≥ %.0f %% busy, is marked on the server's rows: they then measure the CPU the server could get as much as the server.", gameCores(), gameSaturated*100, gameSaturated*100),
		"Raw UDP batched (game only): the raw UDP server with recvmmsg/sendmmsg (x/net ipv4 ReadBatch/WriteBatch: one sendmmsg per 1,024 datagrams of a tick), no protocol work, raw UDP's clients: the machine's limit for this load.",
		"Game snapshot latency: client receive time - the server tick's start time stamped in the snapshot (wall clock shared by the two processes), over the window's snapshots that arrived.",
		"Game server CPU per message: the same CPU time / (inputs the server received + snapshots the clients received + events sent) in the window: it does not shrink when a server that falls behind carries fewer messages.",
		"Game memory per connection: the server process's heap in use + goroutine stacks after GC at the window's end, minus the same before any client, / N.",
		"Game server send system calls per snapshot: the server process's sendto, sendmsg, sendmmsg, write and writev calls over the window, counted by perf from the kernel's syscall tracepoints (n/a without perf), / the snapshots it sent; the calls carry its acks and events too. Raw UDP sends one sendto per snapshot.",
		"Game tick work p99: wall time of the tick loop's own work (take what arrived, send every snapshot and event), 99th percentile over the window's ticks; the period is 33.3 ms.",
		fmt.Sprintf("Game snapshots delivered: snapshots of the window received by the clients / (N × ticks run). On time: tick work p99 under 33.3 ms, at least %.0f %% of the window's ticks ran, and at least %.0f %% of the snapshots delivered. Largest N on time: the largest N tried that was on time in most runs, every smaller N tried being on time too; a larger N on time after one that was not is named in brackets (noise).", gameOnTimeShare*100, gameOnTimeShare*100),
	}
}

// gameNote is one run's details, for the notes.
func gameNote(r gameResult) string {
	files := ""
	if r.srv.Profile != "" {
		files += ", CPU profile of the window in " + r.srv.Profile
	}
	if r.srv.Trace != "" {
		files += ", execution trace in " + r.srv.Trace
	}
	cliFiles := ""
	if r.cli.Profile != "" {
		cliFiles += ", CPU profile of the window in " + r.cli.Profile
	}
	if r.cli.Trace != "" {
		cliFiles += ", execution trace in " + r.cli.Trace
	}
	cliWin := "window not seen"
	if c, ok := r.clientCores(); ok {
		cliWin = fmt.Sprintf("%.2f s CPU in the window's %.2f s (%.2f cores), goroutines waited to run p50 %.0f µs, p99 %.0f µs (%d schedulings sampled), %.0f voluntary and %.0f involuntary context switches/s",
			r.cli.WinCPU, r.cli.Win, c, r.cli.SchedP50, r.cli.SchedP99, r.cli.SchedN, float64(r.cli.VolCS)/r.cli.Win, float64(r.cli.InvolCS)/r.cli.Win)
	}
	return fmt.Sprintf("server: %d connected, %.2f s CPU in %.2f s (%.2f cores), %d ticks (work p50 %.0f µs, p99 %.0f µs, max %.0f µs; start late p99 %.0f µs), goroutines waited to run p50 %.0f µs, p99 %.0f µs (%d schedulings sampled), %.0f voluntary and %.0f involuntary context switches/s, snapshots sent %d, missed %d (send buffer/window full), events sent %d, missed %d, inputs received %d (%.0f/s/client), %d goroutines, %d GCs in the window, memory %.1f MiB → %.1f MiB, system-wide UDP receive-buffer drops in the window %d, machine busy %.0f %% of all CPUs in the window (all processes)%s%s; clients: %d connected, %d snapshots and %d events of the window received, inputs accepted %d, latency max %.1f ms, %s, whole process %.1f s CPU in %.1f s%s%s",
		r.srv.Connected, r.srv.CPU, r.srv.Window, r.serverCores(), r.srv.Ticks, r.srv.TickP50, r.srv.TickP99, r.srv.TickMax, r.srv.LateP99, r.srv.SchedP50, r.srv.SchedP99, r.srv.SchedN, float64(r.srv.VolCS)/r.srv.Window, float64(r.srv.InvolCS)/r.srv.Window,
		r.srv.SnapsSent, r.srv.SnapsMissed, r.srv.EventsSent, r.srv.EventsMissed, r.srv.Inputs,
		float64(r.srv.Inputs)/r.srv.Window/float64(max(r.srv.N, 1)), r.srv.Goroutines, r.srv.GCs,
		float64(r.srv.MemBase)/(1<<20), float64(r.srv.MemAfter)/(1<<20), r.srv.RcvbufErrors, 100*r.srv.MachineBusy, prefixed("; ", r.srv.Extra), files,
		r.cli.Connected, r.cli.Snaps, r.cli.Events, r.cli.InputsOK, r.cli.LatMax/1000, cliWin, r.cli.CPU, r.cli.Life, prefixed("; ", r.cli.Extra), cliFiles)
}

func prefixed(p, s string) string {
	if s == "" {
		return ""
	}
	return p + s
}
