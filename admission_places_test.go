package knet

import (
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The places of the pending attempts (admission.go): a source (an IPv4
// address, an IPv6 /64) takes at most MaxPendingPerSource of them, every
// source together MaxPendingConnections, whatever the transport; what
// leaves gives its place back, once.
func TestAdmissionPlacesPerSource(t *testing.T) {
	cfg := testConfig()
	cfg.MaxPendingConnections = 10
	cfg.MaxPendingPerSource = 3
	l := listen(t, cfg)
	a := netip.MustParseAddr("192.0.2.1")
	b := netip.MustParseAddr("192.0.2.2")
	v6 := netip.MustParseAddr("2001:db8:1:2::1")
	v6same := netip.MustParseAddr("2001:db8:1:2:ffff::7") // the same /64
	v6other := netip.MustParseAddr("2001:db8:1:3::1")
	mapped := netip.MustParseAddr("::ffff:192.0.2.1") // a, dual-stack

	l.mu.Lock()
	defer l.mu.Unlock()
	var ts []ticket
	take := func(ip netip.Addr) bool {
		var t ticket
		ok := l.enterLocked(ip, &t)
		if ok {
			ts = append(ts, t)
		}
		return ok
	}
	for range 3 {
		require.True(t, take(a))
	}
	assert.False(t, take(a), "a fourth from one address")
	assert.False(t, take(mapped), "the same address, IPv4-mapped")
	assert.True(t, take(b), "another address has its own")
	require.True(t, take(v6))
	require.True(t, take(v6same))
	require.True(t, take(v6))
	assert.False(t, take(v6same), "one IPv6 /64 is one source")
	assert.True(t, take(v6other))
	assert.Equal(t, 8, l.attempts)

	// The places overall: 10.
	c := netip.MustParseAddr("192.0.2.3")
	assert.True(t, take(c))
	assert.True(t, take(c))
	assert.False(t, take(c), "every place is taken")
	assert.False(t, l.roomLocked(netip.MustParseAddr("198.51.100.9")))

	// Leaving gives a place back, to that source and overall, once.
	l.leaveLocked(&ts[0])
	l.leaveLocked(&ts[0])
	assert.Equal(t, 9, l.attempts)
	assert.True(t, take(a))
	for i := range ts {
		l.leaveLocked(&ts[i])
	}
	assert.Zero(t, l.attempts)
	assert.Empty(t, l.sources, "nothing kept for sources that hold nothing")
}

// The default share per source: a sixteenth of MaxPendingConnections, at
// least 16 (or MaxPendingConnections if smaller).
func TestMaxPendingPerSourceDefault(t *testing.T) {
	for _, tt := range []struct{ pending, perSource, want int }{
		{0, 0, 64}, // the defaults: 1024/16
		{4096, 0, 256},
		{100, 0, 16},
		{4, 0, 4},
		{1024, 500, 500},
		{8, 500, 8}, // never more than the whole
	} {
		rc := (&Config{MaxPendingConnections: tt.pending, MaxPendingPerSource: tt.perSource}).resolve()
		assert.Equal(t, tt.want, rc.maxPendingPerSource, "%+v", tt)
	}
}

// A copy of a handshake message that cost a key exchange lately: refused
// again if that failed; over UDP, handed to a UDP attempt holding it; an
// attempt of its own while only attempts that cannot answer it hold it,
// up to maxAttemptsPerMessage; dropped otherwise.
func TestCopyOfHandshakeMessage(t *testing.T) {
	scfg, _ := secureConfigs(t)
	l := listen(t, scfg)
	udpConn := &Conn{}
	onStream := &Conn{st: &streamConn{}}
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, tt := range []struct {
		name  string
		prev  seenHandshake
		conns []*Conn
		udp   bool
		want  copyFate
		to    *Conn
	}{
		{"failed", seenHandshake{failed: true, attempts: 1}, nil, true, copyRefuse, nil},
		{"failed, over a stream", seenHandshake{failed: true, attempts: 1}, []*Conn{onStream}, false, copyRefuse, nil},
		{"established: none pending", seenHandshake{attempts: 1}, nil, true, copyDrop, nil},
		{"established, over a stream", seenHandshake{attempts: 1}, nil, false, copyDrop, nil},
		{"to the UDP attempt", seenHandshake{attempts: 1}, []*Conn{udpConn}, true, copyToConn, udpConn},
		{"a stream holds it, a UDP copy", seenHandshake{attempts: 1}, []*Conn{onStream}, true, copyAttempt, nil},
		{"a UDP attempt holds it, a stream copy", seenHandshake{attempts: 1}, []*Conn{udpConn}, false, copyAttempt, nil},
		{"a stream holds it, another stream", seenHandshake{attempts: 2}, []*Conn{onStream, onStream}, false, copyAttempt, nil},
		{"enough attempts", seenHandshake{attempts: maxAttemptsPerMessage}, []*Conn{onStream}, false, copyDrop, nil},
		{"enough attempts, UDP still served", seenHandshake{attempts: maxAttemptsPerMessage}, []*Conn{onStream, udpConn}, true, copyToConn, udpConn},
	} {
		const h = 42
		l.hs.conns[h] = tt.conns
		fate, to := l.copyOfLocked(tt.prev, h, tt.udp)
		assert.Equal(t, tt.want, fate, tt.name)
		assert.Same(t, tt.to, to, tt.name)
		delete(l.hs.conns, h)
	}
}

// A handshake message is remembered for the window, but one whose
// connection was established for as long as the table keeps it: a copy,
// however late, is a replay, and costs no key exchange.
func TestSeenHandshakesEstablishedOutlastWindow(t *testing.T) {
	now := time.Unix(1000, 0)
	s := newSeenHandshakes(4, 10*time.Second, now)
	s.add(1, now)
	s.add(2, now)
	s.established(2)
	later := now.Add(time.Minute)
	assert.False(t, s.has(1, later), "past the window")
	assert.True(t, s.has(2, later), "established: remembered")
	// The ring still bounds it: four newer messages push it out.
	for h := uint64(3); h <= 6; h++ {
		s.add(h, later)
	}
	assert.False(t, s.has(2, later), "pushed out by newer ones")
}
