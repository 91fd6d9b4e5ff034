//go:build unix

package knet

import (
	"context"
	"encoding/binary"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Soak and scale tests take minutes; they run only with -knet.soak:
//
//	go test -run Soak -knet.soak -timeout 30m .
var (
	soak         = flag.Bool("knet.soak", false, "run the soak and scale tests (minutes each)")
	soakDuration = flag.Duration("knet.soak.duration", 2*time.Minute, "how long TestSoakLossyConnections runs")
)

func needSoak(t *testing.T) {
	if !*soak {
		t.Skip("a soak test: run with -knet.soak")
	}
}

// cpuTime is the process's user plus system CPU time.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func memInUse() uint64 {
	var m runtime.MemStats
	runtime.GC()
	runtime.GC() // pooled buffers survive one collection
	runtime.ReadMemStats(&m)
	return m.HeapInuse + m.StackInuse
}

func TestSoakLossyConnections(t *testing.T) {
	needSoak(t)
	// 1000 connections at 10% loss each way, every reliable message
	// verified exactly once, for -knet.soak.duration.
	const conns = 1000
	sim := func(seed uint64) *Simulation {
		return &Simulation{Loss: 0.10, Delay: 5 * time.Millisecond, Jitter: 2 * time.Millisecond, Seed: seed}
	}
	srvCfg := testConfig()
	srvCfg.Simulate = sim(1)
	srvCfg.ConnectTimeout = 30 * time.Second
	l := listen(t, srvCfg)
	serveEcho(t, l)
	base, baseG := memInUse(), runtime.NumGoroutine()
	clients := make([]*Conn, conns)
	var dialWG sync.WaitGroup
	for i := range conns {
		dialWG.Go(func() {
			cfg := testConfig()
			cfg.Simulate = sim(uint64(100 + i))
			cfg.ConnectTimeout = 30 * time.Second
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			c, err := Dial(ctx, "udp", l.Addr().String(), cfg)
			if assert.NoError(t, err, "client %d", i) {
				clients[i] = c
			}
		})
	}
	dialWG.Wait()
	t.Cleanup(func() {
		var wg sync.WaitGroup
		for _, c := range clients {
			if c != nil {
				wg.Go(func() { c.Close() })
			}
		}
		wg.Wait()
	})
	require.NotContains(t, clients, (*Conn)(nil))
	t.Logf("%d connections up: %d goroutines, %.1f KiB per connection (both ends, in one process)",
		conns, runtime.NumGoroutine()-baseG, float64(memInUse()-base)/conns/1024)

	stop := time.Now().Add(*soakDuration)
	cpu0, wall0 := cpuTime(), time.Now()
	var verified, failures atomic.Int64
	var wg sync.WaitGroup
	for k, c := range clients {
		wg.Go(func() {
			next := 0
			received := map[uint32]bool{}
			for time.Now().Before(stop) {
				// Ten in flight, then their echoes, each exactly once.
				for j := range 10 {
					if err := c.Send(numbered(uint32(10+k%1000), next+j, 64)); err != nil {
						failures.Add(1)
						return
					}
				}
				for range 10 {
					ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
					m, err := c.Receive(ctx)
					cancel()
					if err != nil {
						failures.Add(1)
						t.Errorf("client %d: %v", k, err)
						return
					}
					i := binary.LittleEndian.Uint32(m.Payload)
					if received[i] || int(i) < next || int(i) >= next+10 {
						failures.Add(1)
						t.Errorf("client %d: message %d twice or out of place", k, i)
						return
					}
					received[i] = true
					verified.Add(1)
				}
				clear(received)
				next += 10
				time.Sleep(100 * time.Millisecond) // real sockets, real time: the soak's traffic comes in batches 100ms apart
			}
		})
	}
	wg.Wait()
	wall := time.Since(wall0)
	var retransmits, sent uint64
	for _, c := range clients {
		st := c.Stats()
		retransmits += st.Retransmits
		sent += st.DatagramsSent
	}
	t.Logf("%v: %d messages echoed and verified, %d failures; client datagrams %d, retransmits %d (%.1f%%); CPU %.0f%% of a core; %d goroutines; %.1f KiB per connection",
		wall.Round(time.Second), verified.Load(), failures.Load(), sent, retransmits, 100*float64(retransmits)/float64(sent),
		100*float64(cpuTime()-cpu0)/float64(wall), runtime.NumGoroutine()-baseG, float64(memInUse()-base)/conns/1024)
	assert.Zero(t, failures.Load())
	assert.Positive(t, verified.Load())
}

func TestSoakConnectDisconnectCycles(t *testing.T) {
	needSoak(t)
	// 10,000 connections opened, used and closed: nothing left behind.
	l := listen(t, testConfig())
	serveEcho(t, l)
	base, baseG := memInUse(), runtime.NumGoroutine()
	const cycles, workers = 10000, 50
	var done atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for w := range workers {
		wg.Go(func() {
			for i := w; i < cycles; i += workers {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				c, err := Dial(ctx, "udp", l.Addr().String(), testConfig())
				cancel()
				if !assert.NoError(t, err) {
					return
				}
				assert.NoError(t, roundTrip(c, 0))
				c.Close()
				done.Add(1)
			}
		})
	}
	wg.Wait()
	for deadline := time.Now().Add(10 * time.Second); runtime.NumGoroutine() > baseG && time.Now().Before(deadline); {
		time.Sleep(50 * time.Millisecond) // no event says a goroutine ended: poll the count, on real sockets
	}
	after := memInUse()
	t.Logf("%d cycles in %v; goroutines %d -> %d; memory in use %d -> %d KiB; listener %+v",
		done.Load(), time.Since(start).Round(time.Millisecond), baseG, runtime.NumGoroutine(), base>>10, after>>10, l.Stats())
	assert.Equal(t, int64(cycles), done.Load())
	assert.LessOrEqual(t, runtime.NumGoroutine(), baseG)
	assert.Less(t, int64(after)-int64(base), int64(8<<20), "memory back to where it was")
	assert.Zero(t, l.Stats().Connections)
}

func TestSoakIdleConnections(t *testing.T) {
	needSoak(t)
	// 10,000 idle connections on one Listener, their clients in another
	// process so that the figures are the server's alone.
	n := 10000
	if v := os.Getenv("KNET_SOAK_IDLE"); v != "" {
		n, _ = strconv.Atoi(v)
	}
	cfg := testConfig()
	cfg.MaxPendingConnections = n
	cfg.AcceptBacklog = n
	l := listen(t, cfg)
	var accepted atomic.Int64
	all := make(chan struct{}) // closed once n are accepted
	go func() {
		for {
			if _, err := l.AcceptConn(context.Background()); err != nil {
				return
			}
			if accepted.Add(1) == int64(n) {
				close(all)
			}
		}
	}()
	base, baseG := memInUse(), runtime.NumGoroutine()
	child := exec.Command(os.Args[0], "-test.run=^TestSoakIdleClients$", "-knet.soak")
	child.Env = append(os.Environ(), "KNET_SOAK_ADDR="+l.Addr().String(), fmt.Sprintf("KNET_SOAK_N=%d", n))
	child.Stdout, child.Stderr = os.Stdout, os.Stderr
	stdin, err := child.StdinPipe()
	require.NoError(t, err)
	require.NoError(t, child.Start())
	defer func() {
		stdin.Close() // the clients close when their stdin does
		child.Wait()
	}()
	start := time.Now()
	select {
	case <-all:
	case <-time.After(5 * time.Minute): // a bound, not a wait
	}
	require.Equal(t, int64(n), accepted.Load(), "connections established")
	t.Logf("%d connections in %v", n, time.Since(start).Round(time.Millisecond))
	time.Sleep(5 * time.Second) // the measurement's subject, on real sockets: settle, the handshakes' acks and first pings behind
	cpu0, wall0 := cpuTime(), time.Now()
	time.Sleep(30 * time.Second) // the measurement's subject, on real sockets: idle, keepalive pings only
	cpu := float64(cpuTime()-cpu0) / float64(time.Since(wall0))
	mem := memInUse()
	st := l.Stats()
	t.Logf("%d idle connections: %.1f KiB per connection (heap and stacks), %d goroutines (%.2f per connection), CPU %.1f%% of a core while idle; listener %+v",
		n, float64(mem-base)/float64(n)/1024, runtime.NumGoroutine()-baseG, float64(runtime.NumGoroutine()-baseG)/float64(n), 100*cpu, st)
	assert.Equal(t, n, st.Connections)
}

// TestSoakIdleClients is the client side of TestSoakIdleConnections, run
// in a child process.
func TestSoakIdleClients(t *testing.T) {
	addr := os.Getenv("KNET_SOAK_ADDR")
	if addr == "" || !*soak {
		t.Skip("the child process of TestSoakIdleConnections")
	}
	n, _ := strconv.Atoi(os.Getenv("KNET_SOAK_N"))
	conns := make([]*Conn, n)
	var wg sync.WaitGroup
	sem := make(chan struct{}, 200)
	for i := range n {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			c, err := Dial(within(t, time.Minute), "udp", addr, &Config{ConnectTimeout: 30 * time.Second, DisconnectTimeout: time.Second})
			if err == nil {
				c.Send(Message{ID: 6, Reliable: true}) // the server accepts once it hears from us
				conns[i] = c
			}
		})
	}
	wg.Wait()
	buf := make([]byte, 1)
	os.Stdin.Read(buf) // until the parent closes it
	for _, c := range conns {
		if c != nil {
			go c.Close()
		}
	}
}
