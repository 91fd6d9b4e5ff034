package knet

import (
	"math/rand/v2"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// An introduction ask's body comes back as it went, and no bytes make
// the parsers panic or accept more candidates than fit.
func TestPunchWire(t *testing.T) {
	self := []netip.AddrPort{netip.MustParseAddrPort("10.0.1.2:4000"), netip.MustParseAddrPort("[fd00::2]:4000")}
	cookie := make([]byte, cookieSize)
	cookie[3] = 9
	role, c, id, got, _, ok := parseIntroAsk(appendIntroAsk(nil, introRoleJoin, cookie, "room-7", self, 0))
	require.True(t, ok)
	assert.Equal(t, byte(introRoleJoin), role)
	assert.Equal(t, cookie, c)
	assert.Equal(t, "room-7", id)
	assert.Equal(t, self, got)
	_, c, _, _, _, ok = parseIntroAsk(appendIntroAsk(nil, introRoleHost, nil, "x", nil, 0))
	require.True(t, ok)
	assert.Nil(t, c)

	var nonce [queryNonceSize]byte
	nonce[0] = 0x5a
	b := []byte{1, 2, 3, 4, 5, 6, 7, 8, 0, 200, 1}
	b = appendReflectBody(b, &nonce, netip.MustParseAddrPort("203.0.113.11:40000"))
	now := time.Now()
	in, ok := parseIntroduced(b, &nonce, now, netip.AddrPort{})
	require.True(t, ok)
	assert.Equal(t, [8]byte{1, 2, 3, 4, 5, 6, 7, 8}, in.Token)
	assert.Equal(t, now.Add(200*time.Millisecond), in.Start)
	assert.Equal(t, []netip.AddrPort{netip.MustParseAddrPort("203.0.113.11:40000")}, in.Peer)

	r := rand.New(rand.NewPCG(35, 35))
	buf := make([]byte, 256)
	for range 20000 {
		n := r.IntN(len(buf))
		for i := range n {
			buf[i] = byte(r.IntN(12)) // small values: plausible roles, lengths, families
		}
		if _, _, _, cs, _, ok := parseIntroAsk(buf[:n]); ok {
			assert.LessOrEqual(t, len(cs), maxCandidates)
		}
		if in, ok := parseIntroduced(buf[:n], &nonce, now, netip.AddrPort{}); ok {
			assert.LessOrEqual(t, len(in.Peer), maxCandidates)
		}
	}
}

// An introducer does nothing for an address that has not echoed its
// cookie, and answers no ask with more bytes than it had: a short ask
// gets nothing, a padded one without a cookie a cookie (45 bytes), and
// only the cookie of the address it came from registers a host.
func TestPunchIntroducerUnproven(t *testing.T) {
	l, err := Listen("udp4", "127.0.0.1:0", testConfig())
	require.NoError(t, err)
	defer l.Close()
	l.ServeIntroductions()
	server := l.Addr().(*net.UDPAddr)
	pc, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	defer pc.Close()
	other, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	defer other.Close()

	var nonce [queryNonceSize]byte
	nonce[1] = 1
	ask := func(cookie []byte, size int) []byte {
		return appendQueryDatagram(nil, introKindAsk, &nonce, appendIntroAsk(nil, introRoleHost, cookie, "game", nil, 0), size)
	}
	read := func(c *net.UDPConn) []byte {
		buf := make([]byte, 2048)
		require.NoError(t, c.SetReadDeadline(time.Now().Add(5*time.Second)))
		n, _, err := c.ReadFromUDP(buf)
		require.NoError(t, err)
		return buf[:n]
	}
	registered := func() bool {
		l.punch.mu.Lock()
		defer l.punch.mu.Unlock()
		return l.punch.hosts["game"] != nil
	}

	// Short: dropped, and counted before the padded ask after it is
	// answered (the reader takes them in order).
	_, err = pc.WriteToUDP(ask(nil, 600), server)
	require.NoError(t, err)
	_, err = pc.WriteToUDP(ask(nil, queryPadTo), server)
	require.NoError(t, err)
	d := read(pc)
	assert.Equal(t, uint64(1), l.Stats().PunchDropped)
	kind, got, body, ok := parseQueryDatagram(d)
	require.True(t, ok)
	assert.Equal(t, byte(introKindAnswer), kind)
	assert.Equal(t, nonce, got)
	require.Len(t, body, 1+cookieSize)
	assert.Equal(t, byte(introProve), body[0])
	assert.Equal(t, 45, len(d))
	assert.False(t, registered(), "no host before its address is proven")
	cookie := body[1:]

	// The cookie from another address: proven it is not.
	_, err = other.WriteToUDP(ask(cookie, queryPadTo), server)
	require.NoError(t, err)
	_, _, body, ok = parseQueryDatagram(read(other))
	require.True(t, ok)
	assert.Equal(t, byte(introProve), body[0])
	assert.False(t, registered())

	// Echoed from its own address: registered, waiting for a joiner.
	_, err = pc.WriteToUDP(ask(cookie, queryPadTo), server)
	require.NoError(t, err)
	d = read(pc)
	_, _, body, ok = parseQueryDatagram(d)
	require.True(t, ok)
	assert.Equal(t, []byte{introWaiting}, body)
	assert.True(t, registered())
	assert.Less(t, len(d), queryPadTo)
}
