package knet

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The memory a server holds per connection, measured with -knet.mem:
//
//	go test -run TestMemoryPerConnection -knet.mem -v .
//	go test -run TestMemoryPerConnection -knet.mem -knet.mem.conns=2000 -knet.mem.profile=heap.out -v .
//	go tool pprof -sample_index=inuse_space -top heap.out
//
// The clients run in a child process (this test binary again, running
// TestMemoryClients), so that the server's heap is all this process
// holds: the figures are the server side's, per connection.
var (
	memTest    = flag.Bool("knet.mem", false, "run TestMemoryPerConnection (about 40s)")
	memConns   = flag.Int("knet.mem.conns", 200, "TestMemoryPerConnection: connections")
	memLoad    = flag.Duration("knet.mem.load", 5*time.Second, "TestMemoryPerConnection: how long the game load runs before measuring")
	memIdle    = flag.Duration("knet.mem.idle", 11*time.Second, "TestMemoryPerConnection: how long connections stay idle before measuring")
	memProfile = flag.String("knet.mem.profile", "", "TestMemoryPerConnection: write the heap profile under load to this file (and .idle for the idle one)")
)

const (
	memInputID    = 10 // client to server: 32 bytes, unreliable sequenced, 60/s
	memSnapshotID = 11 // server to client: 200 bytes, latest state, 30/s
	memEventID    = 12 // server to client: reliable in-order, now and then
	memEnvAddr    = "KNET_MEM_ADDR"
	memEnvConns   = "KNET_MEM_CONNS"
)

// heapNow is the live heap and the goroutine stacks after collecting
// twice (pooled buffers survive one collection).
func heapNow() (heap, stack uint64) {
	var m runtime.MemStats
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&m)
	return m.HeapAlloc, m.StackInuse
}

func TestMemoryPerConnection(t *testing.T) {
	if !*memTest {
		t.Skip("a measurement: run with -knet.mem")
	}
	if *memProfile != "" {
		runtime.MemProfileRate = 256 // every site, not one in 512 KiB
	}
	n := *memConns
	g := NewGroup()
	cfg := testConfig()
	cfg.Group = g
	cfg.ConnectTimeout = 30 * time.Second
	cfg.MaxPendingConnections = max(1024, n)
	l := listen(t, cfg)

	// The server's tick loop: 30 ticks a second, a snapshot to every
	// connection when loaded, a reliable event to each every 2s.
	var loaded atomic.Bool
	var connected, inputs atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		events := make([]Event, 1024)
		var conns []*Conn
		snapshot, event := make([]byte, 200), make([]byte, 48)
		tick := time.NewTicker(time.Second / 30)
		defer tick.Stop()
		for k := 0; ; k++ {
			select {
			case <-stop:
				return
			case <-tick.C:
			}
			for {
				m := g.Poll(events)
				for _, e := range events[:m] {
					switch e.Kind {
					case EventConnected:
						conns = append(conns, e.Conn)
						connected.Add(1)
					case EventMessage:
						inputs.Add(1)
					}
				}
				if m < len(events) {
					break
				}
			}
			if !loaded.Load() {
				continue
			}
			for i, c := range conns {
				snapshot[0] = byte(k)
				c.TrySend(Message{ID: memSnapshotID, Payload: snapshot, ContentID: 1})
				if (k+i)%60 == 0 {
					c.TrySend(Message{ID: memEventID, Payload: event, Reliable: true, InOrder: true})
				}
			}
		}
	})
	defer func() { close(stop); wg.Wait() }()

	heap0, stack0 := heapNow()
	goroutines0 := runtime.NumGoroutine()

	cmd := exec.Command(os.Args[0], "-test.run=^TestMemoryClients$", "-test.count=1")
	cmd.Env = append(os.Environ(), memEnvAddr+"="+l.Addr().String(), memEnvConns+"="+strconv.Itoa(n))
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	defer func() {
		stdin.Close()
		cmd.Wait()
	}()
	lines := bufio.NewScanner(stdout)
	require.True(t, lines.Scan(), "the clients did not start")
	require.Equal(t, "ready", lines.Text())
	go io.Copy(io.Discard, stdout)
	require.Eventually(t, func() bool { return connected.Load() == int64(n) }, time.Minute, 10*time.Millisecond)

	report := func(what, profile string) {
		t.Helper()
		heap, stack := heapNow()
		per := func(a, b uint64) float64 { return (float64(a) - float64(b)) / float64(n) / 1024 }
		t.Logf("%-12s %d connections: heap %.2f KiB, stacks %.2f KiB, %.2f goroutines per connection (server side)",
			what, n, per(heap, heap0), per(stack, stack0), float64(runtime.NumGoroutine()-goroutines0)/float64(n))
		if profile != "" {
			f, err := os.Create(profile)
			require.NoError(t, err)
			require.NoError(t, pprof.Lookup("heap").WriteTo(f, 0))
			require.NoError(t, f.Close())
		}
	}
	profile := func(suffix string) string {
		if *memProfile == "" {
			return ""
		}
		return *memProfile + suffix
	}

	time.Sleep(*memIdle) // the measurement's subject: idle connections
	report("idle", profile(".idle"))

	loaded.Store(true)
	fmt.Fprintln(stdin, "load")
	in0 := inputs.Load()
	time.Sleep(*memLoad) // the measurement's subject: a loaded server
	report("game load", profile(""))
	t.Logf("inputs received: %.0f/s per connection (60 sent)", float64(inputs.Load()-in0)/memLoad.Seconds()/float64(n))

	loaded.Store(false)
	fmt.Fprintln(stdin, "idle")
	time.Sleep(*memIdle) // the measurement's subject: idle again
	report("idle after", profile(".after"))
}

// TestMemoryClients is TestMemoryPerConnection's child process: it dials
// the connections and, when told "load" on its standard input, sends each
// one's inputs 60 times a second until told "idle". It ends when its
// standard input does.
func TestMemoryClients(t *testing.T) {
	addr := os.Getenv(memEnvAddr)
	if addr == "" {
		t.Skip("TestMemoryPerConnection's child process")
	}
	n, err := strconv.Atoi(os.Getenv(memEnvConns))
	require.NoError(t, err)
	g := NewGroup()
	cfg := testConfig()
	cfg.Group = g
	cfg.ConnectTimeout = 30 * time.Second
	conns := make([]*Conn, n)
	var dialWG sync.WaitGroup
	sem := make(chan struct{}, 64)
	for i := range conns {
		dialWG.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			c, err := Dial(context.Background(), "udp", addr, cfg)
			require.NoError(t, err)
			conns[i] = c
		})
	}
	dialWG.Wait()
	defer func() {
		var wg sync.WaitGroup
		for _, c := range conns {
			wg.Go(func() { c.Close() })
		}
		wg.Wait()
	}()
	fmt.Println("ready")

	var loaded atomic.Bool
	done := make(chan struct{})
	go func() {
		defer close(done)
		lines := bufio.NewScanner(os.Stdin)
		for lines.Scan() {
			loaded.Store(strings.TrimSpace(lines.Text()) == "load")
		}
	}()
	events := make([]Event, 1024)
	input := make([]byte, 32)
	tick := time.NewTicker(time.Second / 60)
	defer tick.Stop()
	for {
		select {
		case <-done:
			return
		case <-tick.C:
		}
		for g.Poll(events) == len(events) {
		}
		if loaded.Load() {
			for _, c := range conns {
				input[0]++
				c.TrySend(Message{ID: memInputID, Payload: input, InOrder: true})
			}
		}
	}
}

func TestFreeListTrim(t *testing.T) {
	var f freeList[*int]
	for range 10 {
		f.put(new(int), 0)
	}
	f.trim() // nothing asked since the list was made: all go
	require.Nil(t, f.items)
	for range 10 {
		f.put(new(int), 0)
	}
	f.trim()
	for range 10 {
		f.put(new(int), 0)
	}
	// A round that takes 3 and gives them back: the 7 never taken go.
	var got []*int
	for range 3 {
		v, ok := f.get()
		require.True(t, ok)
		got = append(got, v)
	}
	for _, v := range got {
		f.put(v, 0)
	}
	f.trim()
	require.Len(t, f.items, 3)
	for _, v := range got {
		require.Contains(t, f.items, v, "the values in use are the ones kept")
	}
	// Steady use keeps what it takes at once.
	for range 5 {
		v, _ := f.get()
		w, _ := f.get()
		f.put(v, 0)
		f.put(w, 0)
	}
	f.trim()
	require.Len(t, f.items, 2)
	// A run past the list's end: as many are kept as were taken.
	f.get()
	f.get()
	_, ok := f.get()
	require.False(t, ok)
	for range 5 {
		f.put(new(int), 0)
	}
	f.trim()
	require.Len(t, f.items, 3)
	f.trim()
	require.Nil(t, f.items)
}

func TestRecvQueueTrim(t *testing.T) {
	var q recvQueue
	payload := make([]byte, 1000)
	fill := func(n int) {
		for range n {
			q.push(StreamMessageID, payload, true, true)
		}
		for q.len() > 0 {
			q.pop()
		}
	}
	fill(100)
	q.trim() // used as much as it holds: kept
	require.NotNil(t, q.arena)
	fill(1)
	q.trim() // a burst's worth, a message used: goes
	require.Nil(t, q.arena)
	require.Nil(t, q.entries)
	fill(1)
	q.trim()
	require.NotNil(t, q.arena)
	q.trim() // not used at all: goes
	require.Nil(t, q.arena)
	require.Nil(t, q.entries)
	q.push(StreamMessageID, payload, true, true)
	q.trim() // not empty: kept
	require.Equal(t, payload, q.bytes(q.peek()))
}
