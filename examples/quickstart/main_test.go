package main

import (
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// The README's quick start is this program, byte for byte from its
// package clause on, so that it compiles as written.
func TestReadmeQuickStart(t *testing.T) {
	readme, err := os.ReadFile("../../README.md")
	require.NoError(t, err)
	_, after, ok := strings.Cut(string(readme), "\n## Quick start\n")
	require.True(t, ok, "README has a Quick start section")
	_, block, ok := strings.Cut(after, "```go\n")
	require.True(t, ok, "Quick start has a go block")
	block, _, ok = strings.Cut(block, "```\n")
	require.True(t, ok)
	src, err := os.ReadFile("main.go")
	require.NoError(t, err)
	_, program, ok := strings.Cut(string(src), "package main\n")
	require.True(t, ok)
	require.Equal(t, "package main\n"+program, block, "README's quick start and examples/quickstart/main.go differ")
}

// It runs: the client's message comes back.
func Example() {
	main()
	// Output: hello
}
