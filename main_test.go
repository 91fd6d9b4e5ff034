package knet

import (
	"flag"
	"fmt"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"
)

// parkFlag runs the suite with connections parking their goroutine after
// this much idleness instead of a second (defaultParkAfter), so that every
// wait goes through parking and kick: go test -race -knet.park=1ms . It
// applies to the connections the tests make through a testNet
// (testnet_test.go: listen, dial, sysNet, memNet), not to those of
// examples and benchmarks, which call Listen and Dial.
var parkFlag = flag.Duration("knet.park", 0, "park idle connections' goroutines after this long (default: a second)")

// TestMain fails the run if any goroutine of the package outlives the tests:
// every Conn and Listener must clean up after Close.
func TestMain(m *testing.M) {
	flag.Parse()
	code := m.Run()
	if code == 0 {
		if leaked := waitForLeaks(10 * time.Second); leaked != "" {
			fmt.Fprintf(os.Stderr, "goroutines left behind:\n%s\n", leaked)
			code = 1
		}
	}
	os.Exit(code)
}

// waitForLeaks returns the stacks of package goroutines still running after
// up to d, or "" once there are none.
func waitForLeaks(d time.Duration) string {
	deadline := time.Now().Add(d)
	for {
		leaked := packageGoroutines()
		if leaked == "" || time.Now().After(deadline) {
			return leaked
		}
		time.Sleep(20 * time.Millisecond) // no event says a goroutine ended: poll, after every test is done
	}
}

func packageGoroutines() string {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		if !strings.Contains(g, "knet-go/knet") || strings.Contains(g, "packageGoroutines") ||
			strings.Contains(g, "testing.(*M)") || strings.Contains(g, "testing.tRunner") {
			continue
		}
		out = append(out, g)
	}
	return strings.Join(out, "\n\n")
}
