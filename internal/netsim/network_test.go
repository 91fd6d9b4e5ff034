package netsim

import (
	"errors"
	"net"
	"net/netip"
	"os"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/udp"
)

func TestNetworkDelivers(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		n := NewNetwork()
		a, err := n.Listen(netip.AddrPort{})
		require.NoError(t, err)
		defer a.Close()
		b, err := n.Listen(netip.MustParseAddrPort("127.0.0.1:7000"))
		require.NoError(t, err)
		defer b.Close()
		_, err = n.Listen(netip.MustParseAddrPort("127.0.0.1:7000"))
		assert.Error(t, err, "the address is taken")
		assert.Equal(t, "127.0.0.1:7000", b.LocalAddr().String())

		// A batch goes out; the reader takes what waits in one read, cut
		// to its buffers.
		out := []udp.Packet{{Buf: []byte("one"), Addr: b.Addr()}, {Buf: []byte("two"), Addr: b.Addr()}, {Buf: []byte("three!"), Addr: b.Addr()}}
		require.NoError(t, a.WriteBatch(nil, out))
		assert.Equal(t, 8, b.ReadWant(8), "a backlog: whole batches")
		ps := []udp.Packet{{Buf: make([]byte, 8)}, {Buf: make([]byte, 8)}, {Buf: make([]byte, 4)}, {Buf: make([]byte, 8)}}
		k, err := b.ReadBatch(ps)
		require.NoError(t, err)
		require.Equal(t, 3, k)
		assert.Equal(t, "one", string(ps[0].Buf[:ps[0].N]))
		assert.Equal(t, "two", string(ps[1].Buf[:ps[1].N]))
		assert.Equal(t, "thre", string(ps[2].Buf[:ps[2].N]))
		assert.True(t, ps[2].Trunc)
		assert.False(t, ps[0].Trunc)
		assert.Equal(t, a.Addr(), ps[0].Addr)
		assert.Equal(t, 1, b.ReadWant(8), "nothing waiting: one buffer")

		// A read waits, durably, until something comes.
		got := make(chan string)
		go func() {
			buf := make([]byte, 16)
			n, from, err := b.ReadFrom(buf)
			assert.NoError(t, err)
			assert.Equal(t, a.Addr(), from)
			got <- string(buf[:n])
		}()
		synctest.Wait()
		require.NoError(t, a.WriteTo([]byte("late"), b.Addr()))
		assert.Equal(t, "late", <-got)
		assert.Equal(t, uint64(4), n.Stats().Delivered)
	})
}

func TestNetworkConnectedSocket(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		refused := errors.New("refused")
		n := NewNetwork()
		n.Refusal = refused
		srv, err := n.Listen(netip.AddrPort{})
		require.NoError(t, err)
		defer srv.Close()
		other, err := n.Listen(netip.AddrPort{})
		require.NoError(t, err)
		defer other.Close()
		c, err := n.Dial(netip.AddrPort{}, srv.Addr())
		require.NoError(t, err)
		defer c.Close()
		assert.Equal(t, srv.LocalAddr(), c.RemoteAddr())

		// Writes go to the peer whatever they name; only the peer's
		// datagrams come in.
		require.NoError(t, c.WriteTo([]byte("hi"), other.Addr()))
		buf := make([]byte, 16)
		k, from, err := srv.ReadFrom(buf)
		require.NoError(t, err)
		assert.Equal(t, "hi", string(buf[:k]))
		require.NoError(t, other.WriteTo([]byte("stranger"), c.Addr()))
		require.NoError(t, srv.WriteTo([]byte("back"), from))
		k, err = c.Read(buf)
		require.NoError(t, err)
		assert.Equal(t, "back", string(buf[:k]))
		assert.Equal(t, uint64(1), n.Stats().Filtered)

		// Nothing at the peer's address: the next read says so, once.
		srv.Close()
		_, err = c.Write([]byte("anyone?"))
		require.NoError(t, err)
		_, err = c.Read(buf)
		assert.ErrorIs(t, err, refused)
		c.SetReadDeadline(time.Now().Add(time.Second))
		start := time.Now()
		_, err = c.Read(buf)
		assert.ErrorIs(t, err, os.ErrDeadlineExceeded)
		assert.Equal(t, time.Second, time.Since(start), "fake time: exactly the deadline")
	})
}

func TestNetworkLinkDelayKeepsOrder(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		n := NewNetwork()
		a, _ := n.Listen(netip.AddrPort{})
		b, _ := n.Listen(netip.AddrPort{})
		defer a.Close()
		defer b.Close()
		n.SetLink(a.Addr(), netip.AddrPort{}, &Params{Delay: 30 * time.Millisecond})
		start := time.Now()
		for i := range 10 {
			a.WriteTo([]byte{byte(i)}, b.Addr()) // one instant: ties keep the send order
		}
		buf := make([]byte, 4)
		for i := range 10 {
			_, err := b.Read(buf)
			require.NoError(t, err)
			assert.Equal(t, byte(i), buf[0])
		}
		assert.Equal(t, 30*time.Millisecond, time.Since(start))
		// The other way is perfect.
		b.WriteTo([]byte{1}, a.Addr())
		_, err := a.Read(buf)
		require.NoError(t, err)
		assert.Equal(t, 30*time.Millisecond, time.Since(start))
	})
}

func TestNetworkLinkLoss(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		n := NewNetwork()
		a, _ := n.Listen(netip.AddrPort{})
		b, _ := n.Listen(netip.AddrPort{})
		defer a.Close()
		defer b.Close()
		l := n.SetLink(netip.AddrPort{}, netip.AddrPort{}, &Params{Loss: 0.5, Seed: 1})
		for range 100 {
			a.WriteTo([]byte("x"), b.Addr())
		}
		st := l.Stats()
		assert.Equal(t, uint64(100), st.Sent)
		assert.Positive(t, st.Lost)
		assert.Equal(t, st.Delivered, n.Stats().Delivered)
		assert.Len(t, b.in, int(st.Delivered))
		n.SetLink(netip.AddrPort{}, netip.AddrPort{}, nil)
		a.WriteTo([]byte("x"), b.Addr())
		assert.Len(t, b.in, int(st.Delivered)+1, "a perfect path again")
	})
}

func TestNetworkCloseEndsRead(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		n := NewNetwork()
		n.QueueLen = 2
		a, _ := n.Listen(netip.AddrPort{})
		b, _ := n.Listen(netip.AddrPort{})
		for range 3 {
			a.WriteTo([]byte("x"), b.Addr())
		}
		assert.Equal(t, uint64(1), n.Stats().Overflow, "a full queue drops")
		b.Close()
		b.Close()
		_, err := b.ReadBatch(make([]udp.Packet, 1))
		assert.ErrorIs(t, err, net.ErrClosed)
		done := make(chan error)
		go func() {
			_, err := a.ReadBatch([]udp.Packet{{Buf: make([]byte, 8)}})
			done <- err
		}()
		synctest.Wait()
		a.Close()
		assert.ErrorIs(t, <-done, net.ErrClosed)
		assert.ErrorIs(t, a.WriteTo([]byte("x"), b.Addr()), net.ErrClosed)
		assert.Equal(t, uint64(0), n.Stats().Unbound)
		<-n.Empty()
		assert.Empty(t, n.Open())
	})
}

// A datagram to Broadcast reaches every socket at its port that is not
// connected, whatever its address, and not the sender.
func TestNetworkBroadcast(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		n := NewNetwork()
		var at7000 []*Socket
		for _, a := range []string{"10.0.0.1:7000", "10.0.0.2:7000"} {
			s, err := n.Listen(netip.MustParseAddrPort(a))
			require.NoError(t, err)
			defer s.Close()
			at7000 = append(at7000, s)
		}
		other, err := n.Listen(netip.MustParseAddrPort("10.0.0.3:7001"))
		require.NoError(t, err)
		defer other.Close()
		connected, err := n.Dial(netip.MustParseAddrPort("10.0.0.4:7000"), netip.MustParseAddrPort("10.0.0.9:1"))
		require.NoError(t, err)
		defer connected.Close()
		sender, err := n.Listen(netip.AddrPort{})
		require.NoError(t, err)
		defer sender.Close()

		require.NoError(t, sender.WriteTo([]byte("anyone?"), netip.AddrPortFrom(Broadcast, 7000)))
		for _, s := range at7000 {
			buf := make([]byte, 16)
			k, from, err := s.ReadFrom(buf)
			require.NoError(t, err)
			assert.Equal(t, "anyone?", string(buf[:k]))
			assert.Equal(t, sender.Addr(), from)
		}
		assert.Equal(t, NetworkStats{Delivered: 2}, n.Stats(), "nothing for the other port or the connected socket")
	})
}
