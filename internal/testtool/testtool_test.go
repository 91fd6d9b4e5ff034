package testtool

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
)

// recorder is a testing.TB whose Skip and Fatal are recorded, not run.
type recorder struct {
	testing.TB
	skipped, failed string
}

func (r *recorder) Helper()           {}
func (r *recorder) Skip(args ...any)  { r.skipped = fmt.Sprint(args...) }
func (r *recorder) Fatal(args ...any) { r.failed = fmt.Sprint(args...) }

// A program found by any of its names is returned; a missing one skips,
// naming the package, or fails under KNET_REQUIRE_TOOLS=1.
func TestNeed(t *testing.T) {
	dir := t.TempDir()
	tool := filepath.Join(dir, "knet-tool-b")
	assert.NoError(t, os.WriteFile(tool, []byte("#!/bin/sh\n"), 0o755))
	t.Setenv("PATH", dir)

	for _, req := range []string{"", "1"} {
		t.Setenv(RequireEnv, req)
		r := &recorder{TB: t}
		assert.Equal(t, tool, Need(r, "knet-tool-a", "apt-get install knet-tool", "knet-tool-b"))
		assert.Empty(t, r.skipped+r.failed)
	}

	t.Setenv(RequireEnv, "")
	r := &recorder{TB: t}
	assert.Empty(t, Need(r, "knet-tool-a", "apt-get install knet-tool"))
	assert.Contains(t, r.skipped, "apt-get install knet-tool")
	assert.Empty(t, r.failed)

	t.Setenv(RequireEnv, "1")
	r = &recorder{TB: t}
	Need(r, "knet-tool-a", "apt-get install knet-tool")
	assert.Contains(t, r.failed, "apt-get install knet-tool")
	assert.Contains(t, r.failed, RequireEnv)
	assert.Empty(t, r.skipped)
}

// Missing skips with the message, or fails under KNET_REQUIRE_TOOLS=1.
func TestMissing(t *testing.T) {
	t.Setenv(RequireEnv, "")
	r := &recorder{TB: t}
	Missing(r, "needs root")
	assert.Contains(t, r.skipped, "needs root")
	assert.Empty(t, r.failed)

	t.Setenv(RequireEnv, "1")
	r = &recorder{TB: t}
	Missing(r, "needs root")
	assert.Contains(t, r.failed, "needs root")
	assert.Empty(t, r.skipped)
}
