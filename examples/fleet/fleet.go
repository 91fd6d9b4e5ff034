package main

import (
	"bufio"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"

	"github.com/knet-go/knet"
)

// The backend's side of the fleet: the server processes it started (a
// fleet manager's game servers) and the matchmaker that places players
// on them with connect tokens.

// serverHandle is a running game server, in a process of its own or (in
// the test) on goroutines: its control input and the lines it writes.
type serverHandle struct {
	id    int
	addr  netip.AddrPort
	in    io.WriteCloser
	lines chan string   // its output after "ready", closed when it ends
	read  chan struct{} // closed once its output is all read
	done  chan error
}

// send writes a control line.
func (h *serverHandle) send(cmd string) { fmt.Fprintln(h.in, cmd) }

// waitReady reads the server's "ready ADDR" line (Agones: the game
// server called SDK.Ready() and can be allocated).
func waitReady(h *serverHandle, out io.Reader) error {
	sc := bufio.NewScanner(out)
	if !sc.Scan() {
		return fmt.Errorf("server %d said nothing: %v", h.id, sc.Err())
	}
	a, ok := strings.CutPrefix(sc.Text(), "ready ")
	if !ok {
		return fmt.Errorf("server %d: %q", h.id, sc.Text())
	}
	var err error
	if h.addr, err = netip.ParseAddrPort(a); err != nil {
		return err
	}
	h.lines = make(chan string, 64)
	h.read = make(chan struct{})
	go func() {
		for sc.Scan() {
			h.lines <- sc.Text()
		}
		close(h.lines)
		close(h.read)
	}()
	return nil
}

// spawnProcess starts server id as a process of this program (-serve),
// handing it the fleet's keys in its environment.
func spawnProcess(id int, priv, tokenKey []byte, sim *knet.Simulation) (*serverHandle, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	args := []string{"-serve", fmt.Sprint(id)}
	if sim != nil {
		args = append(args, "-loss", fmt.Sprint(sim.Loss))
	}
	cmd := exec.Command(exe, args...)
	cmd.Env = append(os.Environ(), fmt.Sprintf("KNET_FLEET_KEY=%x", priv), fmt.Sprintf("KNET_FLEET_TOKEN_KEY=%x", tokenKey))
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
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
	h := &serverHandle{id: id, in: in, done: make(chan error, 1)}
	if err := waitReady(h, out); err != nil {
		cmd.Process.Kill()
		cmd.Wait()
		return nil, err
	}
	go func() {
		<-h.read // Wait closes the pipe: not before its last line is read
		h.done <- cmd.Wait()
	}()
	return h, nil
}

// spawnInProcess runs server id on goroutines of this process, through
// the same control lines (the test's way: no binary to start).
func spawnInProcess(id int, priv, tokenKey []byte, sim *knet.Simulation) (*serverHandle, error) {
	inR, inW := io.Pipe()
	outR, outW := io.Pipe()
	h := &serverHandle{id: id, in: inW, done: make(chan error, 1)}
	go func() {
		err := serve(id, priv, tokenKey, sim, inR, outW)
		outW.Close()
		h.done <- err
	}()
	if err := waitReady(h, outR); err != nil {
		inW.Close()
		return nil, err
	}
	return h, nil
}

// matchmaker places players: on the live server with the fewest of them,
// in a token that lists the other live servers after it, so that Dial
// goes on to the next if the first does not take the player.
type matchmaker struct {
	tokenKey []byte
	mu       sync.Mutex
	servers  []*serverHandle
	draining map[int]bool
	load     map[int]int // players placed, by server
	placed   map[int]int // server of each player
}

func (m *matchmaker) token(player int) ([]byte, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	var live []*serverHandle
	for _, s := range m.servers {
		if !m.draining[s.id] {
			live = append(live, s)
		}
	}
	if len(live) == 0 {
		return nil, fmt.Errorf("no server to place player %d on", player)
	}
	best := 0
	for i, s := range live {
		if m.load[s.id] < m.load[live[best].id] {
			best = i
		}
	}
	if old, ok := m.placed[player]; ok {
		m.load[old]--
	}
	m.load[live[best].id]++
	m.placed[player] = live[best].id
	addrs := []netip.AddrPort{live[best].addr}
	for i, s := range live {
		if i != best {
			addrs = append(addrs, s.addr)
		}
	}
	return knet.IssueToken(m.tokenKey, knet.Token{
		ClientID: uint64(player),
		Expires:  time.Now().Add(5 * time.Minute),
		Servers:  addrs,
	})
}

// drain takes server id out of placement, before it starts draining.
func (m *matchmaker) drain(id int) {
	m.mu.Lock()
	m.draining[id] = true
	m.mu.Unlock()
}

// serverAt names the server at addr.
func (m *matchmaker) serverAt(addr string) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, s := range m.servers {
		if s.addr.String() == addr {
			return s.id
		}
	}
	return -1
}
