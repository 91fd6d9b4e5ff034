package knet

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/udp"
)

// The memory a default Listener holds for clients that each keep a hole
// open in a reliable ordered stream (issue 31, finding 14), measured with
// -knet.budget.mem:
//
//	go test -run TestBudgetMemory -knet.budget.mem -v .
//	go test -run TestBudgetMemory -knet.budget.mem -knet.budget.holders=24 -v .
//
// As TestMemoryPerConnection does, the clients run in a child process
// (TestBudgetMemoryClients), so that the heap measured is the server's.
// The file uses nothing of the receive budget's, so that it measures the
// code before it too.
var (
	budgetMemTest    = flag.Bool("knet.budget.mem", false, "run TestBudgetMemory (about 30s)")
	budgetMemHolders = flag.Int("knet.budget.holders", 6, "TestBudgetMemory: clients holding a hole open")
	budgetMemFor     = flag.Duration("knet.budget.for", 20*time.Second, "TestBudgetMemory: how long the clients send")
)

const (
	budgetEnvAddr    = "KNET_BUDGET_ADDR"
	budgetEnvHolders = "KNET_BUDGET_HOLDERS"
	budgetEnvFor     = "KNET_BUDGET_FOR"
)

// budgetHeld, when set (budget_test.go), reads what the listener's budget
// counts.
var budgetHeld func(l *Listener) string

func TestBudgetMemory(t *testing.T) {
	if !*budgetMemTest {
		t.Skip("a measurement: run with -knet.budget.mem")
	}
	l, err := Listen("udp", "127.0.0.1:0", nil) // a default Listener
	require.NoError(t, err)
	defer l.Close()
	var honest atomic.Int64
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := l.AcceptConn(context.Background())
			if err != nil {
				return
			}
			wg.Go(func() {
				for {
					m, err := c.Receive(context.Background())
					if err != nil {
						return
					}
					if m.ID == 7 {
						honest.Add(1)
					}
				}
			})
		}
	})
	defer wg.Wait()
	defer l.Close()

	heap0, _ := heapNow()
	cmd := exec.Command(os.Args[0], "-test.run=^TestBudgetMemoryClients$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), budgetEnvAddr+"="+l.Addr().String(),
		budgetEnvHolders+"="+strconv.Itoa(*budgetMemHolders), budgetEnvFor+"="+budgetMemFor.String())
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	done := make(chan struct{})
	go func() {
		lines := bufio.NewScanner(out)
		for lines.Scan() {
			if line := lines.Text(); strings.Contains(line, "client") {
				t.Log("child:", strings.TrimSpace(line))
			}
		}
		close(done)
	}()
	var peak uint64
	start := time.Now()
	for {
		select {
		case <-done:
		case <-time.After(time.Second):
			heap, _ := heapNow()
			peak = max(peak, heap)
			held := ""
			if budgetHeld != nil {
				held = budgetHeld(l)
			}
			t.Logf("%3.0fs heap %+d MiB%s", time.Since(start).Seconds(), (int64(heap)-int64(heap0))>>20, held)
			continue
		}
		break
	}
	cmd.Wait()
	heap, _ := heapNow()
	t.Logf("%d clients holding a hole, one honest: the server's heap grew %d MiB at the peak, %+d MiB at the end; the honest client's messages: %d arrived",
		*budgetMemHolders, (int64(peak)-int64(heap0))>>20, (int64(heap)-int64(heap0))>>20, honest.Load())
}

// TestBudgetMemoryClients is TestBudgetMemory's child process.
func TestBudgetMemoryClients(t *testing.T) {
	addr := os.Getenv(budgetEnvAddr)
	if addr == "" {
		t.Skip("TestBudgetMemory's child process")
	}
	holders, err := strconv.Atoi(os.Getenv(budgetEnvHolders))
	require.NoError(t, err)
	d, err := time.ParseDuration(os.Getenv(budgetEnvFor))
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	hole := &endpointOptions{dial: func(network string, raddr *net.UDPAddr) (socket, error) {
		pc, err := net.DialUDP(network, nil, raddr)
		if err != nil {
			return nil, err
		}
		return newHoleSocket(newUDPSocket(pc, true)), nil
	}}
	cfg := &Config{MaxMessageSendCount: 1 << 30} // they never give up on the hole
	var conns []*Conn
	for range holders {
		c, err := dialWith(context.Background(), "udp", addr, cfg, hole)
		require.NoError(t, err)
		conns = append(conns, c)
	}
	honest, err := Dial(context.Background(), "udp", addr, nil)
	require.NoError(t, err)
	var wg sync.WaitGroup
	for _, c := range conns {
		wg.Go(func() {
			p := make([]byte, 1000)
			for c.SendContext(ctx, Message{ID: 6, Payload: p, Reliable: true, InOrder: true}) == nil {
			}
		})
	}
	sent := 0
	wg.Go(func() {
		p := make([]byte, 1000)
		for ctx.Err() == nil && honest.Send(Message{ID: 7, Payload: p, Reliable: true, InOrder: true}) == nil {
			sent++
			time.Sleep(20 * time.Millisecond)
		}
	})
	wg.Wait()
	for i, c := range conns {
		fmt.Printf("client %d: %v\n", i, c.Err())
	}
	time.Sleep(time.Second) // the honest client's last messages
	fmt.Printf("client honest: %d sent, %v\n", sent, honest.Err())
	for _, c := range append(conns, honest) {
		c.StartClose("")
	}
	for _, c := range append(conns, honest) {
		<-c.Done()
	}
}

// holeSocket loses, for good, the first reliable datagram carrying an
// application message that its client sends, and every copy of it (a
// datagram keeps its PacketID when sent again): the server holds all that
// follows it in order, which is what issue 31's finding 14 did to a
// Listener with six clients.
type holeSocket struct {
	socket
	hole atomic.Int64 // the PacketID lost, -1 until chosen
}

func newHoleSocket(s socket) *holeSocket {
	h := &holeSocket{socket: s}
	h.hole.Store(-1)
	return h
}

// lost reports whether b is to be lost.
func (h *holeSocket) lost(b []byte) bool {
	d, _, err := parseDatagram(b)
	if err != nil || !d.header.reliable {
		return false
	}
	if pid := int64(d.header.packetID); pid == h.hole.Load() {
		return true
	}
	for _, m := range d.msgs {
		if m.id >= MinMessageID && m.id <= MaxMessageID && h.hole.CompareAndSwap(-1, int64(d.header.packetID)) {
			return true
		}
	}
	return false
}

func (h *holeSocket) WriteTo(b []byte, to netip.AddrPort) error {
	if h.lost(b) {
		return nil
	}
	return h.socket.WriteTo(b, to)
}

func (h *holeSocket) WriteBatch(w *udp.Writer, ps []udp.Packet) error {
	var first error
	for i := range ps {
		if h.lost(ps[i].Buf) {
			continue
		}
		if err := h.socket.WriteTo(ps[i].Buf, ps[i].Addr); err != nil {
			ps[i].Err = err
			if first == nil {
				first = err
			}
		}
	}
	return first
}
