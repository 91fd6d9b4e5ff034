//go:build linux

package main

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/knet-go/knet/internal/nattest"
)

// mainEnv, set in a process this test binary starts, makes it run the
// example's main instead of the tests: the program, built once, with the
// example's flags.
const mainEnv = "KNET_RENDEZVOUS_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(mainEnv) == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// exampleRoute is the route the example's joiner behind a port-restricted
// cone takes to a host behind a symmetric NAT: direct, by birthday
// probing, since both ask the introducer's second address (-reflector)
// what their NAT is. Should the probing miss (about 3 in 10,000), the
// introducer's relay carries the connection: the run still passes, and
// says so.
const exampleRoute = "direct"

// proc is one of the example's processes, run in a namespace.
type proc struct {
	name string
	cmd  *exec.Cmd
	mu   sync.Mutex
	out  bytes.Buffer
	line chan string // each line of its output, as it comes (buffered)
	done chan error  // its exit
}

// start runs the example in node's namespace with args, its output
// (log's, on stderr) kept and passed line by line.
func start(t *testing.T, name string, node *nattest.Node, args ...string) *proc {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("ip", append([]string{"netns", "exec", node.Name, self}, args...)...)
	cmd.Env = append(os.Environ(), mainEnv+"=1")
	r, w := io.Pipe()
	cmd.Stdout, cmd.Stderr = w, w
	p := &proc{name: name, cmd: cmd, line: make(chan string, 64), done: make(chan error, 1)}
	if err := cmd.Start(); err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	go func() {
		sc := bufio.NewScanner(r)
		for sc.Scan() {
			p.mu.Lock()
			p.out.WriteString(sc.Text() + "\n")
			p.mu.Unlock()
			select {
			case p.line <- sc.Text():
			default:
			}
		}
	}()
	go func() {
		err := cmd.Wait()
		w.Close()
		p.done <- err
	}()
	t.Cleanup(func() {
		// The introducer serves until killed; the others have ended.
		cmd.Process.Kill()
		t.Logf("%s said:\n%s", name, p.output())
	})
	return p
}

func (p *proc) output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.out.String()
}

// wait returns the process's exit, failing t if it takes longer than d.
func (p *proc) wait(t *testing.T, d time.Duration) error {
	t.Helper()
	select {
	case err := <-p.done:
		return err
	case <-time.After(d):
		t.Fatalf("%s did not end within %v; it said:\n%s", p.name, d, p.output())
		return nil
	}
}

// The example's three processes behind real NATs on one machine: the
// introducer in the public network, the host behind a symmetric NAT, the
// joiner behind a port-restricted cone, each a process of its own in its
// namespace. The joiner reports the route its connection took, and both
// players end: today with no route, the joiner naming ErrNoDirectPath and
// the host saying its joiner did not connect, both exiting with status 1;
// with a route (exampleRoute), both exchange their greetings and exit 0.
func TestNATExampleSymmetricHostPortRestrictedJoiner(t *testing.T) {
	n := nattest.New(t, nattest.Symmetric, nattest.PortRestrictedCone, nil)
	const via, reflector = "203.0.113.1:7000", "203.0.113.1:7001"
	intro := start(t, "introducer", n.Public, "-introducer", via, "-reflector", reflector)
	deadline := time.After(10 * time.Second)
	for up := false; !up; {
		select {
		case l := <-intro.line:
			up = strings.HasPrefix(l, "introducer on")
		case err := <-intro.done:
			t.Fatalf("the introducer ended: %v", err)
		case <-deadline:
			t.Fatal("the introducer did not say it listens")
		}
	}
	host := start(t, "host", n.A.Host, "-host", "game-35", "-via", via, "-reflector", reflector, "-wait", "30s", "-punchwait", "5s")
	joiner := start(t, "joiner", n.B.Host, "-join", "game-35", "-via", via, "-reflector", reflector, "-wait", "30s")
	jerr := joiner.wait(t, 30*time.Second)
	herr := host.wait(t, 30*time.Second)
	jout, hout := joiner.output(), host.output()
	var exit *exec.ExitError
	switch exampleRoute {
	case "none":
		if !errors.As(jerr, &exit) || exit.ExitCode() != 1 {
			t.Errorf("the joiner ended with %v, want status 1", jerr)
		}
		for _, want := range []string{"joiner: route: none", "no direct path to the host"} {
			if !strings.Contains(jout, want) {
				t.Errorf("the joiner did not say %q", want)
			}
		}
		if !errors.As(herr, &exit) || exit.ExitCode() != 1 {
			t.Errorf("the host ended with %v, want status 1", herr)
		}
		if !strings.Contains(hout, "the joiner did not connect") {
			t.Errorf("the host did not say that its joiner did not connect")
		}
	default:
		if jerr != nil || herr != nil {
			t.Errorf("the joiner ended with %v, the host with %v", jerr, herr)
		}
		if strings.Contains(jout, "joiner: route: relayed") {
			t.Logf("birthday probing missed; the relay carried the connection")
		} else if !strings.Contains(jout, "joiner: route: "+exampleRoute) {
			t.Errorf("the joiner did not report the route %s", exampleRoute)
		}
		if !strings.Contains(jout, `the host says "welcome to game-35"`) || !strings.Contains(hout, `says "hello from the joiner"`) {
			t.Errorf("the greetings did not go both ways")
		}
	}
	// Both sides found each other through the introducer, from their
	// NATs' public addresses.
	if !strings.Contains(hout, "host: a joiner at [203.0.113.12:") {
		t.Errorf("the host was not told of the joiner at its NAT's address")
	}
	if !strings.Contains(jout, "joiner: the host at [203.0.113.11:") {
		t.Errorf("the joiner was not told of the host at its NAT's address")
	}
}
