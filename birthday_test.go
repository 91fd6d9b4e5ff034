package knet

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The flags byte after an ask's or an answer's candidates says whether
// the side's NAT is hard; an ask or answer from before the flags (none,
// or padding) reads as easy, and unknown bits are ignored.
func TestBirthdayWire(t *testing.T) {
	self := []netip.AddrPort{netip.MustParseAddrPort("10.0.2.2:5000")}
	for _, flags := range []byte{0, introFlagHard} {
		_, _, _, got, f, ok := parseIntroAsk(appendIntroAsk(nil, introRoleJoin, nil, "room", self, flags))
		require.True(t, ok)
		assert.Equal(t, self, got)
		assert.Equal(t, flags, f)
	}
	// An ask ending at its candidates (an introducer pads an old
	// asker's with zeros, which read as no flags).
	body := appendIntroAsk(nil, introRoleHost, nil, "room", self, introFlagHard)
	_, _, _, _, f, ok := parseIntroAsk(body[:len(body)-1])
	require.True(t, ok)
	assert.Zero(t, f)
	_, _, _, _, f, ok = parseIntroAsk(append(appendIntroAsk(nil, introRoleHost, nil, "room", self, 0xfe), 0))
	require.True(t, ok)
	assert.Zero(t, f, "unknown bits ignored")

	var nonce [queryNonceSize]byte
	nonce[2] = 0x35
	answer := appendReflectBody([]byte{1, 2, 3, 4, 5, 6, 7, 8, 0, 200, 1}, &nonce, netip.MustParseAddrPort("203.0.113.12:40000"))
	in, ok := parseIntroduced(answer, &nonce, time.Now(), netip.AddrPort{})
	require.True(t, ok)
	assert.False(t, in.PeerHard, "an introducer from before the flags")
	in, ok = parseIntroduced(append(answer, introFlagHard), &nonce, time.Now(), netip.AddrPort{})
	require.True(t, ok)
	assert.True(t, in.PeerHard)
	assert.Equal(t, []netip.AddrPort{netip.MustParseAddrPort("203.0.113.12:40000")}, in.Peer)
}

// An easy side's spray sends exactly birthdayProbes probes, at most
// birthdayPerRound a round, each to a different port from 1024 up of the
// hard peer's address (never its known port, probed anyway), in an
// order its seed decides; no spray unless the peer alone is hard.
func TestBirthdaySprayBudget(t *testing.T) {
	peer := netip.MustParseAddrPort("203.0.113.12:40000")
	in := Introduction{Peer: []netip.AddrPort{peer}, PeerHard: true, seed: 7}
	sprayed := func(in Introduction) []netip.AddrPort {
		s := newBirthdaySpray(in)
		var all []netip.AddrPort
		for range 3 * punchRounds {
			n := 0
			s.round(func(to netip.AddrPort) { all = append(all, to); n++ })
			assert.LessOrEqual(t, n, birthdayPerRound)
		}
		return all
	}
	all := sprayed(in)
	require.Len(t, all, birthdayProbes)
	seen := make(map[uint16]bool)
	for _, a := range all {
		assert.Equal(t, peer.Addr(), a.Addr())
		assert.GreaterOrEqual(t, a.Port(), uint16(birthdayMinPort))
		assert.NotEqual(t, peer.Port(), a.Port())
		assert.False(t, seen[a.Port()], "port %d twice", a.Port())
		seen[a.Port()] = true
	}
	assert.Equal(t, all, sprayed(in), "the same seed, the same ports")
	in.seed = 8
	assert.NotEqual(t, all, sprayed(in))

	assert.Nil(t, newBirthdaySpray(Introduction{Peer: in.Peer}), "an easy peer")
	assert.Nil(t, newBirthdaySpray(Introduction{Peer: in.Peer, PeerHard: true, Hard: true}), "both hard: a relay's case")
	newBirthdaySpray(Introduction{}).round(func(netip.AddrPort) { t.Error("a nil spray sent") })
}

// fakeHost is a UDP socket standing for a host on loopback: it counts
// what each source sent it.
type fakeHost struct {
	pc   *net.UDPConn
	mu   sync.Mutex
	from map[netip.AddrPort][]byte // each source's datagram kinds
	got  chan struct{}             // a datagram came
}

func newFakeHost(t *testing.T) *fakeHost {
	pc, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	h := &fakeHost{pc: pc, from: make(map[netip.AddrPort][]byte), got: make(chan struct{}, 1)}
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 2048)
		for {
			n, from, err := pc.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			kind, _, _, ok := parseQueryDatagram(buf[:n])
			if !ok {
				kind = 0
			}
			h.mu.Lock()
			h.from[from] = append(h.from[from], kind)
			h.mu.Unlock()
			select {
			case h.got <- struct{}{}:
			default:
			}
		}
	}()
	t.Cleanup(func() { pc.Close(); <-done })
	return h
}

func (h *fakeHost) addr() netip.AddrPort { return h.pc.LocalAddr().(*net.UDPAddr).AddrPort() }

// sources is how many sources sent at least one datagram of kind.
func (h *fakeHost) sources(kind byte) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, ks := range h.from {
		for _, k := range ks {
			if k == kind {
				n++
				break
			}
		}
	}
	return n
}

// countingConn counts the datagrams written to its socket.
type countingConn struct {
	net.PacketConn
	writes atomic.Int64
}

func (c *countingConn) WriteTo(b []byte, to net.Addr) (int, error) {
	n, err := c.PacketConn.WriteTo(b, to)
	if err == nil {
		c.writes.Add(1)
	}
	return n, err
}

func listenCounting(t *testing.T) *countingConn {
	s, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	return &countingConn{PacketConn: s}
}

// recordingOpen opens loopback sockets for probeBirthday, keeping them.
type recordingOpen struct {
	mu    sync.Mutex
	socks []*countingConn
}

func (r *recordingOpen) open() (net.PacketConn, error) {
	s, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		return nil, err
	}
	c := &countingConn{PacketConn: s}
	r.mu.Lock()
	r.socks = append(r.socks, c)
	r.mu.Unlock()
	return c, nil
}

// sent is how many of the sockets opened wrote at least one datagram.
func (r *recordingOpen) sent() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, s := range r.socks {
		if s.writes.Load() > 0 {
			n++
		}
	}
	return n
}

func isClosed(s net.PacketConn) bool {
	_, err := s.WriteTo([]byte{0}, &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 9})
	return errors.Is(err, net.ErrClosed)
}

// A hard joiner with no path within the budget opens birthdaySockets
// extra sockets, sends from each one probe of 20 bytes and one more a
// second later, probes from its own socket once a round, and fails with
// ErrNoDirectPath after 2 s with every extra socket closed and its own
// left open (DialCandidates closes it).
func TestBirthdayJoinerBudget(t *testing.T) {
	t.Parallel()
	h := newFakeHost(t)
	pc := listenCounting(t)
	var rec recordingOpen
	in := Introduction{Peer: []netip.AddrPort{h.addr()}, Hard: true, Start: time.Now()}
	start := time.Now()
	got, _, err := probeBirthday(within(t, 10*time.Second), pc, in, rec.open)
	require.ErrorIs(t, err, ErrNoDirectPath)
	assert.Same(t, pc, got)
	assert.GreaterOrEqual(t, time.Since(start), time.Duration(punchRounds-1)*punchInterval)
	require.Len(t, rec.socks, birthdaySockets)
	for _, s := range rec.socks {
		assert.True(t, isClosed(s), "an extra socket left open")
	}

	// What was sent: pc's padded probes, one a round, and two from
	// each extra socket.
	assert.Equal(t, int64(punchRounds), pc.writes.Load())
	for _, s := range rec.socks {
		assert.Equal(t, int64(punchRounds/birthdayResend), s.writes.Load())
	}
	// The host got the probes of every socket (on loopback, some may
	// be dropped when its buffer fills).
	require.Eventually(t, func() bool { return h.sources(birthdayKindOpen) >= birthdaySockets/2 }, 5*time.Second, 5*time.Millisecond)
	assert.False(t, isClosed(pc))
}

// A hard joiner dials from the extra socket on which the host's probe
// came in, the first success ending the probing: its other sockets are
// closed, pc too, and the host is told (two answers from that socket).
// Probes from a stranger without the token, which came in first on every
// socket, are neither taken nor answered.
func TestBirthdayAttackJoinerStranger(t *testing.T) {
	t.Parallel()
	h := newFakeHost(t)
	stranger, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	defer stranger.Close()
	pc := listenCounting(t)
	var rec recordingOpen
	in := Introduction{Peer: []netip.AddrPort{h.addr()}, Hard: true, Start: time.Now()}
	in.Token[0] = 35
	ctx := within(t, 10*time.Second)

	type result struct {
		pc   net.PacketConn
		from netip.AddrPort
		err  error
	}
	done := make(chan result, 1)
	go func() {
		s, from, err := probeBirthday(ctx, pc, in, rec.open)
		done <- result{s, from, err}
	}()
	// Every extra socket has sent its probe.
	require.Eventually(t, func() bool { return rec.sent() == birthdaySockets }, 5*time.Second, time.Millisecond)
	rec.mu.Lock()
	socks := append([]*countingConn(nil), rec.socks...)
	rec.mu.Unlock()
	require.Len(t, socks, birthdaySockets)
	var wrong [8]byte
	wrong[0] = 36
	for _, s := range append(socks, pc) {
		to := s.LocalAddr()
		for _, d := range [][]byte{
			appendQueryDatagram(nil, punchKindProbe, &wrong, nil, queryPadTo),
			appendQueryDatagram(nil, punchKindAnswer, &wrong, nil, 0),
			[]byte("not a probe"),
		} {
			_, err := stranger.WriteTo(d, to)
			require.NoError(t, err)
		}
	}
	// The host's probe, to the 100th extra socket, after the stranger's.
	winner := socks[99]
	_, err = h.pc.WriteTo(appendQueryDatagram(nil, punchKindProbe, &in.Token, nil, 0), winner.LocalAddr())
	require.NoError(t, err)
	r := <-done
	require.NoError(t, r.err)
	assert.Same(t, winner, r.pc.(*countingConn), "the socket the host's probe came in on")
	assert.Equal(t, h.addr(), r.from)
	assert.LessOrEqual(t, winner.writes.Load(), int64(2+punchRounds/birthdayResend), "its probes and its two answers, within the budget")
	for _, s := range socks {
		assert.Equal(t, s != winner, isClosed(s))
	}
	assert.True(t, isClosed(pc), "pc: another socket won")
	winnerAddr := winner.LocalAddr().(*net.UDPAddr).AddrPort()
	require.Eventually(t, func() bool {
		h.mu.Lock()
		defer h.mu.Unlock()
		ks := h.from[winnerAddr]
		return len(ks) >= 3
	}, 5*time.Second, 5*time.Millisecond)
	h.mu.Lock()
	ks := h.from[winnerAddr]
	h.mu.Unlock()
	assert.Equal(t, []byte{punchKindAnswer, punchKindAnswer}, ks[len(ks)-2:], "told the host twice")
	winner.Close()

	// The stranger got nothing back: the socket that won is open until
	// here, and the others were closed before it read a second datagram.
	require.NoError(t, stranger.SetReadDeadline(time.Now().Add(50*time.Millisecond)))
	_, _, err = stranger.ReadFrom(make([]byte, 2048))
	var ne net.Error
	require.True(t, errors.As(err, &ne) && ne.Timeout(), "the stranger got an answer: %v", err)
}

// Cancelled while probing, a hard joiner closes every extra socket it
// opened.
func TestBirthdayJoinerCancel(t *testing.T) {
	t.Parallel()
	h := newFakeHost(t)
	pc := listenCounting(t)
	var rec recordingOpen
	ctx, cancel := context.WithCancel(context.Background())
	in := Introduction{Peer: []netip.AddrPort{h.addr()}, Hard: true, Start: time.Now()}
	done := make(chan error, 1)
	go func() { _, _, err := probeBirthday(ctx, pc, in, rec.open); done <- err }()
	<-h.got
	cancel()
	require.ErrorIs(t, <-done, context.Canceled)
	require.NotEmpty(t, rec.socks)
	for _, s := range rec.socks {
		assert.True(t, isClosed(s))
	}
}

// A hard host adopts the extra socket on which the joiner's probe came
// in, never one on which only a stranger's came (without the token, or
// not a probe), and serves it: it probes the joiner from it at once,
// stops its Punch when the joiner's word comes in there, and closes it
// with the Listener. The stranger gets nothing back.
func TestBirthdayAttackHostAdopts(t *testing.T) {
	t.Parallel()
	joiner := newFakeHost(t)
	stranger, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	defer stranger.Close()
	hl, err := Listen("udp4", "127.0.0.1:0", testConfig())
	require.NoError(t, err)
	defer hl.Close()
	in := Introduction{Peer: []netip.AddrPort{joiner.addr()}, Hard: true, Start: time.Now()}
	in.Token[0] = 35
	ctx := within(t, 10*time.Second)
	punched := make(chan error, 1)
	go func() { punched <- hl.Punch(ctx, in) }()

	// The extra sockets' probes come (some may be lost on loopback
	// when the joiner's buffer fills).
	own := hl.Addr().(*net.UDPAddr).AddrPort()
	extras := func() []netip.AddrPort {
		joiner.mu.Lock()
		defer joiner.mu.Unlock()
		var out []netip.AddrPort
		for from := range joiner.from {
			if from != own {
				out = append(out, from)
			}
		}
		return out
	}
	require.Eventually(t, func() bool { return len(extras()) >= 16 }, 5*time.Second, time.Millisecond)
	socks := extras()
	assert.LessOrEqual(t, len(socks), birthdaySockets)
	var wrong [8]byte
	wrong[0] = 36
	for _, to := range socks {
		for _, d := range [][]byte{
			appendQueryDatagram(nil, punchKindProbe, &wrong, nil, queryPadTo),
			appendQueryDatagram(nil, punchKindAnswer, &wrong, nil, 0),
			[]byte("not a probe"),
		} {
			_, err := stranger.WriteToUDPAddrPort(d, to)
			require.NoError(t, err)
		}
	}
	chosen := socks[len(socks)/2]
	_, err = joiner.pc.WriteToUDPAddrPort(appendQueryDatagram(nil, punchKindProbe, &in.Token, nil, 0), chosen)
	require.NoError(t, err)
	var ep *endpoint
	require.Eventually(t, func() bool {
		hl.punch.mu.Lock()
		defer hl.punch.mu.Unlock()
		for e := range hl.punch.adopted {
			ep = e
		}
		return ep != nil
	}, 5*time.Second, time.Millisecond)
	hl.punch.mu.Lock()
	assert.Len(t, hl.punch.adopted, 1)
	hl.punch.mu.Unlock()
	adoptedAt, _ := addrPortOf(ep.sock.LocalAddr())
	assert.Equal(t, chosen.Port(), adoptedAt.Port(), "the socket the joiner's probe came in on")
	// It probes the joiner at once: a probe after what opened its
	// mapping.
	require.Eventually(t, func() bool {
		joiner.mu.Lock()
		defer joiner.mu.Unlock()
		ks := joiner.from[chosen]
		return len(ks) >= 2 && ks[len(ks)-1] == punchKindProbe
	}, 5*time.Second, time.Millisecond)
	joiner.mu.Lock()
	assert.Equal(t, byte(birthdayKindOpen), joiner.from[chosen][0], "opening the mapping: no probe")
	joiner.mu.Unlock()

	// The joiner's word, on the adopted socket, ends the Punch.
	_, err = joiner.pc.WriteToUDPAddrPort(appendQueryDatagram(nil, punchKindAnswer, &in.Token, nil, 0), chosen)
	require.NoError(t, err)
	require.NoError(t, <-punched)

	require.NoError(t, hl.Close())
	select {
	case <-ep.readerDone:
	default:
		t.Error("the adopted socket outlived its Listener")
	}
	require.NoError(t, stranger.SetReadDeadline(time.Now().Add(50*time.Millisecond)))
	_, _, err = stranger.ReadFrom(make([]byte, 2048))
	var ne net.Error
	require.True(t, errors.As(err, &ne) && ne.Timeout(), "the stranger got an answer: %v", err)
}

// A side whose reflections go unanswered (loss, a reflector down) counts
// as easy and goes on to punch, rather than failing HostWith or
// JoinWith; only the end of ctx is an error.
func TestBirthdayUnansweredReflectionIsEasy(t *testing.T) {
	o := &IntroOptions{Reflector: "192.0.2.1:7000"}
	silent := func(context.Context, string) (netip.AddrPort, error) {
		return netip.AddrPort{}, &TimeoutError{Op: "reflect"}
	}
	hard, err := o.hard(context.Background(), silent, "192.0.2.2:7000")
	require.NoError(t, err)
	assert.False(t, hard)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = o.hard(ctx, silent, "192.0.2.2:7000")
	assert.ErrorIs(t, err, context.Canceled)
}
