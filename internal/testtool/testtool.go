// Package testtool holds the one rule for tests that need a program
// besides Go (tshark, chromium): without it, such a test skips and names
// the package to install, so that "go test ./..." passes on a machine
// with Go alone; with KNET_REQUIRE_TOOLS=1 in the environment (.ci/run
// sets it), it fails instead, so that CI cannot pass by skipping.
package testtool

import (
	"os"
	"os/exec"
	"testing"
)

// RequireEnv is the environment variable that turns a skip for a missing
// program into a failure.
const RequireEnv = "KNET_REQUIRE_TOOLS"

// Need returns the path of the program name, or of the first of others
// found in PATH (another name for it: "chromium-browser"). With none, it
// skips t saying what to run to install it (install: "apt-get install
// tshark"), or fails t if KNET_REQUIRE_TOOLS=1.
func Need(t testing.TB, name, install string, others ...string) string {
	t.Helper()
	for _, n := range append([]string{name}, others...) {
		if p, err := exec.LookPath(n); err == nil {
			return p
		}
	}
	Missing(t, name+" not found: this test needs it (Debian: "+install+")")
	return ""
}

// Missing skips t, saying what it lacks and how to get it (msg: "needs
// root: run as root"), or fails t if KNET_REQUIRE_TOOLS=1: the same rule
// as Need's, for what is not a program in PATH (root, a kernel feature).
func Missing(t testing.TB, msg string) {
	t.Helper()
	if os.Getenv(RequireEnv) == "1" {
		t.Fatal(msg + "; " + RequireEnv + "=1 makes that a failure")
	} else {
		t.Skip(msg + "; skipped (" + RequireEnv + "=1 would make it fail)")
	}
}
