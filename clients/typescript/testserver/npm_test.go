//go:build !js

package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// TestTypeScriptClient runs the TypeScript client's tests (npm test in
// clients/typescript, after npm ci when its packages are not installed),
// which start this package's server. .ci/run runs npm itself, so under
// -short (as .ci/run's go test) this test leaves it to that. Without
// node and npm it skips, naming what to install, unless
// KNET_REQUIRE_TOOLS=1 says the tools must be there.
func TestTypeScriptClient(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: .ci/run runs the TypeScript tests itself (npm ci && npm test in clients/typescript)")
	}
	for _, tool := range []string{"node", "npm"} {
		if _, err := exec.LookPath(tool); err != nil {
			msg := "the TypeScript client's tests need Node.js 20.19 or later and npm (Debian: apt-get install nodejs npm): " + tool + " not found"
			if os.Getenv("KNET_REQUIRE_TOOLS") == "1" {
				t.Fatal(msg)
			}
			t.Skip(msg)
		}
	}
	dir, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	run := func(args ...string) {
		cmd := exec.Command("npm", args...)
		cmd.Dir = dir
		out, err := cmd.CombinedOutput()
		t.Logf("npm %v:\n%s", args, out)
		if err != nil {
			t.Fatalf("npm %v: %v", args, err)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "node_modules")); err != nil {
		run("ci")
	}
	run("test")
}
