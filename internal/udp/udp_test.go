package udp

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func pair(t *testing.T, network, ip string) (a, b *net.UDPConn) {
	a, err := net.ListenUDP(network, &net.UDPAddr{IP: net.ParseIP(ip)})
	if err != nil {
		t.Skipf("no %s on this machine: %v", network, err)
	}
	b, err = net.ListenUDP(network, &net.UDPAddr{IP: net.ParseIP(ip)})
	require.NoError(t, err)
	t.Cleanup(func() { a.Close(); b.Close() })
	return a, b
}

func TestBatchRoundTrip(t *testing.T) {
	for _, tt := range []struct{ network, ip string }{{"udp4", "127.0.0.1"}, {"udp6", "::1"}} {
		t.Run(tt.network, func(t *testing.T) {
			a, b := pair(t, tt.network, tt.ip)
			ca, cb := New(a, false), New(b, false)
			w, r := ca.NewWriter(), cb.NewReader()
			to := b.LocalAddr().(*net.UDPAddr).AddrPort()
			const n = 100 // more than one batch
			out := make([]Packet, n)
			for i := range out {
				out[i] = Packet{Buf: []byte(fmt.Sprintf("datagram %d", i)), Addr: to}
			}
			sent, err := ca.WriteBatch(w, out)
			require.NoError(t, err)
			require.Equal(t, n, sent)
			in := make([]Packet, 16)
			for i := range in {
				in[i].Buf = make([]byte, 64)
			}
			got := 0
			for got < n {
				k, err := cb.ReadBatch(r, in)
				require.NoError(t, err)
				for _, p := range in[:k] {
					assert.Equal(t, fmt.Sprintf("datagram %d", got), string(p.Buf[:p.N]))
					assert.Equal(t, a.LocalAddr().(*net.UDPAddr).Port, int(p.Addr.Port()))
					assert.False(t, p.Trunc)
					got++
				}
			}
		})
	}
}

func TestConnectedAndTruncated(t *testing.T) {
	a, b := pair(t, "udp4", "127.0.0.1")
	a.Close()
	c, err := net.DialUDP("udp4", nil, b.LocalAddr().(*net.UDPAddr))
	require.NoError(t, err)
	defer c.Close()
	cc, cb := New(c, true), New(b, false)
	_, err = cc.WriteBatch(cc.NewWriter(), []Packet{{Buf: bytes.Repeat([]byte{7}, 100)}, {Buf: []byte("ok")}})
	require.NoError(t, err)
	in := []Packet{{Buf: make([]byte, 10)}, {Buf: make([]byte, 10)}}
	r := cb.NewReader()
	got := 0
	for got < 2 {
		k, err := cb.ReadBatch(r, in[got:])
		require.NoError(t, err)
		got += k
	}
	assert.True(t, in[0].Trunc, "100 bytes into 10")
	assert.Equal(t, "ok", string(in[1].Buf[:in[1].N]))
	assert.Equal(t, netip.MustParseAddrPort(c.LocalAddr().String()).Port(), in[1].Addr.Port())
}

func TestNoAllocations(t *testing.T) {
	a, b := pair(t, "udp4", "127.0.0.1")
	ca, cb := New(a, false), New(b, false)
	w, r := ca.NewWriter(), cb.NewReader()
	out := make([]Packet, 8)
	to := b.LocalAddr().(*net.UDPAddr).AddrPort()
	for i := range out {
		out[i] = Packet{Buf: make([]byte, 1200), Addr: to}
	}
	in := make([]Packet, 8)
	for i := range in {
		in[i].Buf = make([]byte, 2048)
	}
	allocs := testing.AllocsPerRun(200, func() {
		ca.WriteBatch(w, out)
		for got := 0; got < len(out); {
			k, _ := cb.ReadBatch(r, in)
			got += k
		}
	})
	assert.Zero(t, allocs)
}

// A datagram the system refuses does not keep the rest of the batch from
// going out, and says why.
func TestWriteErrorsPerPacket(t *testing.T) {
	a, b := pair(t, "udp4", "127.0.0.1")
	ca, cb := New(a, false), New(b, false)
	to := b.LocalAddr().(*net.UDPAddr).AddrPort()
	port0 := netip.MustParseAddrPort("127.0.0.1:0") // EINVAL: no port to send to
	out := []Packet{{Buf: []byte("a"), Addr: to}, {Buf: []byte("no"), Addr: port0}, {Buf: []byte("b"), Addr: to}, {Buf: []byte("c"), Addr: to}}
	out[1].Err = errors.New("stale")
	sent, err := ca.WriteBatch(ca.NewWriter(), out)
	require.Error(t, err)
	assert.Equal(t, 3, sent)
	for i, p := range out {
		if i == 1 {
			assert.Equal(t, err, p.Err)
		} else {
			assert.NoError(t, p.Err, "datagram %d", i)
		}
	}
	r := cb.NewReader()
	in := []Packet{{Buf: make([]byte, 8)}}
	var got []string
	for len(got) < 3 {
		k, err := cb.ReadBatch(r, in)
		require.NoError(t, err)
		if k > 0 {
			got = append(got, string(in[0].Buf[:in[0].N]))
		}
	}
	assert.Equal(t, []string{"a", "b", "c"}, got)
}

// On a connected socket the ICMP port unreachable a datagram drew comes back
// as ECONNREFUSED on a later write, for the datagram it stopped (on loopback
// the reports may keep coming: each datagram sent draws one).
func TestWriteRefusedOnConnectedSocket(t *testing.T) {
	gone, _ := pair(t, "udp4", "127.0.0.1")
	addr := gone.LocalAddr().(*net.UDPAddr)
	gone.Close()
	c, err := net.DialUDP("udp4", nil, addr)
	require.NoError(t, err)
	defer c.Close()
	cc := New(c, true)
	w := cc.NewWriter()
	out := []Packet{{Buf: []byte("x")}, {Buf: []byte("y")}, {Buf: []byte("z")}}
	for range 1000 { // each write draws a report; one soon comes back
		sent, err := cc.WriteBatch(w, out)
		if err == nil {
			require.Equal(t, 3, sent)
			continue
		}
		require.ErrorIs(t, err, syscall.ECONNREFUSED)
		failed := 0
		for _, p := range out {
			if p.Err != nil {
				assert.ErrorIs(t, p.Err, syscall.ECONNREFUSED)
				failed++
			}
		}
		assert.Positive(t, failed)
		assert.Equal(t, len(out), sent+failed)
		return
	}
	t.Fatal("no ECONNREFUSED reported")
}
