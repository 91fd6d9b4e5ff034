//go:build linux

package udp

import (
	"encoding/binary"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
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
		// Sizes vary: not a bulk stream, which would turn GRO on.
		out[i] = Packet{Buf: make([]byte, 1+i%3), Addr: to}
		out[i].Buf[0] = byte(i)
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
		want := r.Want(len(in))
		k, err := cb.ReadBatch(r, in)
		assert.LessOrEqual(t, k, want, "Want tells how many buffers a read may fill")
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
	assert.Equal(t, 1, r.Want(len(in)), "a quiet reader needs one buffer")
}

func TestRuns(t *testing.T) {
	a := netip.MustParseAddrPort("127.0.0.1:1")
	b := netip.MustParseAddrPort("127.0.0.1:2")
	pk := func(size int, to netip.AddrPort) Packet { return Packet{Buf: make([]byte, size), Addr: to} }
	many := make([]Packet, 100)
	for i := range many {
		many[i] = pk(1000, a)
	}
	for _, tt := range []struct {
		name string
		ps   []Packet
		gso  bool
		want int
	}{
		{"no gso", []Packet{pk(100, a), pk(100, a)}, false, 1},
		{"one", []Packet{pk(100, a)}, true, 1},
		{"equal sizes", []Packet{pk(100, a), pk(100, a), pk(100, a)}, true, 3},
		{"a shorter one ends the run", []Packet{pk(100, a), pk(100, a), pk(50, a), pk(50, a)}, true, 3},
		{"a longer one starts a new run", []Packet{pk(100, a), pk(100, a), pk(200, a)}, true, 2},
		{"another peer starts a new run", []Packet{pk(100, a), pk(100, b)}, true, 1},
		{"an empty datagram goes alone", []Packet{pk(100, a), pk(0, a)}, true, 1},
		{"at most 64 segments", many, true, maxSegments},
		{"at most 65000 bytes", []Packet{pk(30000, a), pk(30000, a), pk(30000, a)}, true, 2},
	} {
		assert.Equal(t, tt.want, run(tt.ps, tt.gso), tt.name)
	}
}

// Runs of equal datagrams go out as GSO messages where the kernel takes
// them, and arrive as the datagrams they were, boundaries and order kept.
func TestSegmentedWrites(t *testing.T) {
	a, b := pair(t, "udp4", "127.0.0.1")
	_, c := pair(t, "udp4", "127.0.0.1")
	for _, pc := range []*net.UDPConn{b, c} {
		require.NoError(t, pc.SetReadBuffer(4<<20))
	}
	ca, cb, cc := New(a, false), New(b, false), New(c, false)
	t.Logf("UDP_SEGMENT supported: %v", ca.sys.gso.Load())
	w := ca.NewWriter()
	toB := b.LocalAddr().(*net.UDPAddr).AddrPort()
	toC := c.LocalAddr().(*net.UDPAddr).AddrPort()
	sizes := []int{1200, 1200, 1200, 700, 1200, 1200, 1300, 1, 1, 1}
	var out []Packet
	for round := range 10 { // 100 datagrams: two batches
		for i, n := range sizes {
			buf := make([]byte, n)
			buf[0] = byte(round*len(sizes) + i)
			to := toB
			if i == 5 {
				to = toC
			}
			out = append(out, Packet{Buf: buf, Addr: to})
		}
	}
	sent, err := ca.WriteBatch(w, out)
	require.NoError(t, err)
	require.Equal(t, len(out), sent)
	read := func(conn *Conn, want []Packet) {
		r := conn.NewReader()
		in := make([]Packet, 16)
		for i := range in {
			in[i].Buf = make([]byte, 2048)
		}
		for got := 0; got < len(want); {
			k, err := conn.ReadBatch(r, in)
			require.NoError(t, err)
			for _, p := range in[:k] {
				require.Equal(t, len(want[got].Buf), p.N, "datagram %d", got)
				require.Equal(t, want[got].Buf[0], p.Buf[0], "datagram %d", got)
				got++
			}
		}
	}
	var forB, forC []Packet
	for _, p := range out {
		if p.Addr == toC {
			forC = append(forC, p)
		} else {
			forB = append(forB, p)
		}
	}
	read(cb, forB)
	read(cc, forC)
}

// A bulk stream of runs turns GRO on: the runs arrive whole and are split
// into the datagrams they were, in order.
func TestGRO(t *testing.T) {
	a, b := pair(t, "udp4", "127.0.0.1")
	ca, cb := New(a, false), New(b, false)
	if !ca.sys.gso.Load() {
		t.Skip("no UDP_SEGMENT on this kernel")
	}
	w, r := ca.NewWriter(), cb.NewReader()
	to := b.LocalAddr().(*net.UDPAddr).AddrPort()
	const size = 1000
	// The writer streams runs until the reader has seen enough of them:
	// a fixed number of datagrams could all be sent (most of them dropped
	// by the kernel) before a reader slowed down by a busy machine had
	// turned GRO on, and the test would see no run.
	stop := make(chan struct{})
	writerDone := make(chan error, 1)
	go func() {
		out := make([]Packet, MaxBatch)
		for i := range out {
			out[i] = Packet{Buf: make([]byte, size), Addr: to}
		}
		for seq := 0; ; seq += len(out) {
			select {
			case <-stop:
				writerDone <- nil
				return
			default:
			}
			for i := range out {
				binary.BigEndian.PutUint32(out[i].Buf, uint32(seq+i))
			}
			if _, err := ca.WriteBatch(w, out); err != nil {
				writerDone <- err
				return
			}
		}
	}()
	in := make([]Packet, MaxBatch)
	for i := range in {
		in[i].Buf = make([]byte, 1500)
	}
	last, got, wasOn := -1, 0, false
	require.NoError(t, b.SetReadDeadline(time.Now().Add(30*time.Second))) // against hanging only
	for r.sys.runs <= 10 {
		k, err := cb.ReadBatch(r, in)
		require.NoError(t, err, "%d datagrams read, GRO on: %v, %d runs", got, wasOn, r.sys.runs)
		wasOn = wasOn || r.sys.big != nil
		for _, p := range in[:k] {
			require.Equal(t, size, p.N)
			require.False(t, p.Trunc)
			seq := int(binary.BigEndian.Uint32(p.Buf))
			require.Greater(t, seq, last, "in order, none twice")
			last = seq
			got++
		}
	}
	close(stop)
	require.NoError(t, <-writerDone)
	t.Logf("%d datagrams read; %d reads returned runs", got, r.sys.runs)
	assert.True(t, wasOn, "GRO turned on")

	// Drain the tail of the stream, so that the socket has room for what
	// follows: the writer has stopped, so once a read times out with the
	// socket's queue empty, all of it has been read.
	for {
		require.NoError(t, b.SetReadDeadline(time.Now().Add(100*time.Millisecond)))
		if _, err := cb.ReadBatch(r, in); err != nil && queued(t, b) == 0 {
			break
		}
	}
	// A peer without runs now: single datagrams still come through.
	require.NoError(t, b.SetReadDeadline(time.Now().Add(30*time.Second)))
	for i := range 10 {
		_, err := ca.WriteBatch(w, []Packet{{Buf: []byte{byte(i), 2, 3}, Addr: to}})
		require.NoError(t, err)
	}
	for got := 0; got < 10; {
		k, err := cb.ReadBatch(r, in)
		require.NoError(t, err)
		for _, p := range in[:k] {
			if p.N == size {
				continue // the tail of the stream, split out of a run read before
			}
			require.Equal(t, []byte{byte(got), 2, 3}, p.Buf[:p.N])
			got++
		}
	}
}

// queued is the size of the first datagram waiting on pc, 0 if none.
func queued(t *testing.T, pc *net.UDPConn) int {
	rc, err := pc.SyscallConn()
	require.NoError(t, err)
	var n int
	require.NoError(t, rc.Control(func(fd uintptr) {
		n, err = unix.IoctlGetInt(int(fd), unix.SIOCINQ)
	}))
	require.NoError(t, err)
	return n
}
