//go:build linux

package udp

import (
	"net"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A backlog turns single reads into batches; once batches stop coming back
// full, reads go one at a time again.
func TestReadsBatchOnlyUnderBacklog(t *testing.T) {
	a, b := pair(t, "udp4", "127.0.0.1")
	ca, cb := New(a, false), New(b, false)
	w, r := ca.NewWriter(), cb.NewReader()
	to := b.LocalAddr().(*net.UDPAddr).AddrPort()
	out := make([]Packet, 100) // well within the socket buffer
	for i := range out {
		out[i] = Packet{Buf: []byte{byte(i)}, Addr: to}
	}
	sent, err := ca.WriteBatch(w, out)
	require.NoError(t, err)
	require.Equal(t, len(out), sent)

	in := make([]Packet, 8)
	for i := range in {
		in[i].Buf = make([]byte, 64)
	}
	var sizes []int
	for got := 0; got < len(out); {
		k, err := cb.ReadBatch(r, in)
		require.NoError(t, err)
		for i := range k {
			require.Equal(t, byte(got+i), in[i].Buf[0], "in order, none lost")
		}
		got += k
		sizes = append(sizes, k)
	}
	for i := range backlogStreak {
		assert.Equal(t, 1, sizes[i], "read %d, before the backlog shows", i)
	}
	assert.Equal(t, len(in), sizes[backlogStreak], "the backlog is read by batches")
	assert.Less(t, len(sizes), backlogStreak+len(out)/len(in)+2)

	// The last batch came back short: the next lone datagram is read alone.
	_, err = ca.WriteBatch(w, out[:1])
	require.NoError(t, err)
	k, err := cb.ReadBatch(r, in)
	require.NoError(t, err)
	assert.Equal(t, 1, k)
	assert.False(t, r.sys.batching)
}
