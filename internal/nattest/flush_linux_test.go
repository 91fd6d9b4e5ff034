//go:build linux

package nattest

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

// Flush makes a router forget its mappings: a symmetric NAT maps the
// same socket and server to a new port afterwards, and a port-restricted
// cone, which kept the private port, no longer lets in a server the host
// talked to before the flush (it did before).
func TestNATFlush(t *testing.T) {
	t.Parallel()
	n := New(t, Symmetric, PortRestrictedCone, nil)
	s := n.Public.ListenUDP(t, "203.0.113.1:7000")
	m := n.Public.ListenUDP(t, "203.0.113.2:7000")

	c := n.A.Host.ListenUDP(t, "0.0.0.0:0")
	before := exchange(t, c, s)
	assert.Equal(t, before, exchange(t, c, s), "a mapping is kept while used")
	n.Flush(t, n.A)
	after := exchange(t, c, s)
	assert.NotEqual(t, before, after, "the symmetric NAT mapped the flow afresh")

	b := n.B.Host.ListenUDP(t, "0.0.0.0:0")
	seen := exchange(t, b, s)
	exchange(t, b, m)
	assert.True(t, reaches(t, s, seen, b, m), "a contacted server gets in before the flush")
	n.Flush(t, n.B)
	again := exchange(t, b, m)
	assert.Equal(t, seen, again, "the cone kept the private port")
	assert.False(t, reaches(t, s, seen, b, m), "the flow to s is forgotten: its answer is dropped")
}
