package main

// -game-trace-report: reads the two execution traces that -game-trace
// wrote for one run (FILE.<lib>-N.server and FILE.<lib>-N.clients) and
// prints where the time between a tick and its snapshots' delivery goes:
// when the server's send system calls ran relative to the tick's start,
// and how long each process's goroutines waited to run once runnable.
// Both traces' clocks are mapped to the wall clock through their Sync
// events' clock snapshots, so the clients' events are placed on the
// server's ticks.

import (
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/exp/trace"
)

// traceStats is what one process's trace says.
type traceStats struct {
	span       time.Duration
	wallOff    int64            // wall clock - trace clock, ns (0 if unknown)
	ticks      []int64          // server: tick starts (trace clock)
	sends      [][2]int64       // send system calls: start, end
	recvs      [][2]int64       // receive system calls
	wait       map[string][]int // runnable → running, ns, by goroutine entry function
	goroutines map[string]int   // goroutines seen, by entry function
	procBusy   time.Duration    // sum over Ps of the time they ran
	procs      int
}

// sysKind classifies a system call by its stack: 's' a datagram send,
// 'r' a receive, 0 anything else (files, pipes, perf).
func sysKind(st trace.Stack) byte {
	var fns []string
	for f := range st.Frames() {
		fns = append(fns, f.Func)
	}
	all := strings.Join(fns, " ")
	if strings.Contains(all, "os.(*File)") || strings.Contains(all, "os/exec") {
		return 0
	}
	for _, fn := range fns[:min(len(fns), 3)] {
		switch {
		case strings.Contains(fn, "sendmmsg"), strings.Contains(fn, "sendto"), strings.Contains(fn, "sendmsg"),
			fn == "syscall.write", strings.Contains(fn, "sysWriter"):
			return 's'
		case strings.Contains(fn, "recvmmsg"), strings.Contains(fn, "recvfrom"), strings.Contains(fn, "recvmsg"),
			fn == "syscall.read", strings.Contains(fn, "sysReader"):
			return 'r'
		}
	}
	return 0
}

// entry is a goroutine's entry function: the outermost frame.
func entry(st trace.Stack) string {
	last := ""
	for f := range st.Frames() {
		last = f.Func
	}
	return last
}

func readGameTrace(name string) (*traceStats, error) {
	f, err := os.Open(name)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	r, err := trace.NewReader(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	s := &traceStats{wait: map[string][]int{}, goroutines: map[string]int{}}
	kind := map[trace.GoID]string{}
	runnable := map[trace.GoID]int64{}
	inSys := map[trace.GoID][2]int64{} // kind, start
	procOn := map[trace.ProcID]int64{}
	var first, last int64
	for {
		ev, err := r.ReadEvent()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		t := int64(ev.Time())
		if first == 0 {
			first = t
		}
		last = t
		switch ev.Kind() {
		case trace.EventSync:
			if c := ev.Sync().ClockSnapshot; c != nil && s.wallOff == 0 {
				s.wallOff = c.Wall.UnixNano() - int64(c.Trace)
			}
		case trace.EventLog:
			if l := ev.Log(); l.Category == "tick" {
				s.ticks = append(s.ticks, t)
			}
		case trace.EventStateTransition:
			st := ev.StateTransition()
			switch st.Resource.Kind {
			case trace.ResourceProc:
				p := st.Resource.Proc()
				from, to := st.Proc()
				if to == trace.ProcRunning {
					procOn[p] = t
				} else if from == trace.ProcRunning {
					if t0, ok := procOn[p]; ok {
						s.procBusy += time.Duration(t - t0)
						delete(procOn, p)
					}
				}
				s.procs = max(s.procs, int(p)+1)
			case trace.ResourceGoroutine:
				g := st.Resource.Goroutine()
				from, to := st.Goroutine()
				if _, ok := kind[g]; !ok && st.Stack != trace.NoStack {
					if e := entry(st.Stack); e != "" {
						kind[g] = e
						s.goroutines[e]++
					}
				}
				switch {
				case to == trace.GoRunnable:
					runnable[g] = t
				case from == trace.GoRunnable && to == trace.GoRunning:
					if t0, ok := runnable[g]; ok {
						k := kind[g]
						s.wait[k] = append(s.wait[k], int(t-t0))
						delete(runnable, g)
					}
				}
				if to == trace.GoSyscall {
					if k := sysKind(st.Stack); k != 0 {
						inSys[g] = [2]int64{int64(k), t}
					}
				} else if from == trace.GoSyscall {
					if x, ok := inSys[g]; ok {
						delete(inSys, g)
						if x[0] == 's' {
							s.sends = append(s.sends, [2]int64{x[1], t})
						} else {
							s.recvs = append(s.recvs, [2]int64{x[1], t})
						}
					}
				}
			}
		}
	}
	for _, t0 := range procOn {
		s.procBusy += time.Duration(last - t0)
	}
	s.span = time.Duration(last - first)
	slices.Sort(s.ticks)
	return s, nil
}

// sinceTick gives, for each time (trace clock of ticks' trace, after
// adding shift), how long after the latest tick start it was; times
// before the first or after the last tick are left out.
func sinceTick(ticks []int64, times []int64, shift int64) []time.Duration {
	var out []time.Duration
	for _, t := range times {
		t += shift
		i, _ := slices.BinarySearch(ticks, t+1)
		if i == 0 || i >= len(ticks) {
			continue
		}
		out = append(out, time.Duration(t-ticks[i-1]))
	}
	slices.Sort(out)
	return out
}

func fmtQ(d []time.Duration) string {
	if len(d) == 0 {
		return "none"
	}
	q := func(p float64) string {
		return strconv.FormatFloat(float64(d[min(int(float64(len(d))*p), len(d)-1)])/1e6, 'f', 2, 64)
	}
	return fmt.Sprintf("p50 %s, p90 %s, p99 %s ms", q(0.5), q(0.9), q(0.99))
}

// gameTraceReport prints the report for the traces base+".server" and
// base+".clients".
func gameTraceReport(w io.Writer, base string) error {
	srv, err := readGameTrace(base + ".server")
	if err != nil {
		return err
	}
	cli, err := readGameTrace(base + ".clients")
	if err != nil {
		return err
	}
	if len(srv.ticks) < 2 {
		return fmt.Errorf("%s.server: fewer than 2 ticks traced", base)
	}
	shift := int64(0) // clients' trace clock → server's
	if srv.wallOff != 0 && cli.wallOff != 0 {
		shift = cli.wallOff - srv.wallOff
	}
	starts := func(x [][2]int64) []int64 {
		var out []int64
		for _, c := range x {
			out = append(out, c[0])
		}
		return out
	}
	for _, p := range []struct {
		name string
		s    *traceStats
		sh   int64
	}{{"server", srv, 0}, {"clients", cli, shift}} {
		s := p.s
		fmt.Fprintf(w, "%s: %v traced, Ps running %.0f %% of the time (%d Ps)\n", p.name, s.span.Round(time.Millisecond),
			100*s.procBusy.Seconds()/s.span.Seconds()/float64(max(s.procs, 1)), s.procs)
		kinds := slices.SortedFunc(func(yield func(string) bool) {
			for k := range s.wait {
				if !yield(k) {
					return
				}
			}
		}, func(a, b string) int { return len(s.wait[b]) - len(s.wait[a]) })
		for _, k := range kinds[:min(len(kinds), 6)] {
			d := make([]time.Duration, len(s.wait[k]))
			for i, v := range s.wait[k] {
				d[i] = time.Duration(v)
			}
			slices.Sort(d)
			name := k
			if name == "" {
				name = "(unknown)"
			}
			fmt.Fprintf(w, "  wait to run, %d goroutines of %s: %d/s, %s\n", s.goroutines[k], name, int(float64(len(d))/s.span.Seconds()), fmtQ(d))
		}
		for _, x := range []struct {
			what  string
			calls [][2]int64
		}{{"send", s.sends}, {"receive", s.recvs}} {
			if len(x.calls) == 0 {
				continue
			}
			var in time.Duration
			for _, c := range x.calls {
				in += time.Duration(c[1] - c[0])
			}
			fmt.Fprintf(w, "  %s system calls: %d/s, %.0f %% of the time in them; start after the tick's start: %s\n",
				x.what, int(float64(len(x.calls))/s.span.Seconds()), 100*in.Seconds()/s.span.Seconds(), fmtQ(sinceTick(srv.ticks, starts(x.calls), p.sh)))
		}
	}
	// The server's last send of each tick period.
	last := map[int]time.Duration{}
	for _, c := range srv.sends {
		i, _ := slices.BinarySearch(srv.ticks, c[0]+1)
		if i == 0 || i >= len(srv.ticks) {
			continue
		}
		last[i] = max(last[i], time.Duration(c[1]-srv.ticks[i-1]))
	}
	var ends []time.Duration
	for _, d := range last {
		ends = append(ends, d)
	}
	slices.Sort(ends)
	fmt.Fprintf(w, "server: the last send system call of a tick period ends after the tick's start: %s (%d ticks)\n", fmtQ(ends), len(ends))
	return nil
}
