//go:build linux

package knet

import (
	"fmt"
	"net"
	"net/netip"
	"sort"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/nattest"
)

// birthdayRun is one run of a pair's birthday probing: whether the
// joiner connected directly, and the times from its ask (its two
// reflections included) and from the agreed start to connected.
type birthdayRun struct {
	direct          bool
	fromAsk, toPath time.Duration
	err             error
}

// runBirthdayPair makes a Net whose site A (the host) is behind a NAT
// of type host and site B (the joiner) behind one of type joiner, and
// connects them through an introducer, both sides learning their NAT's
// mapping from a second reflector. seed seeds the host's random ports.
// It fails t for what is not the probing's to decide (the introduction,
// the flags passed on); the probing's outcome is in the result.
func runBirthdayPair(t *testing.T, host, joiner nattest.Type, seed uint64) birthdayRun {
	n := nattest.New(t, host, joiner, nil)
	intro := listenIn(t, n.Public, "203.0.113.1:7000", testConfig())
	intro.ServeIntroductions()
	listenIn(t, n.Public, "203.0.113.2:7000", testConfig()) // a second reflector: any knet server
	opts := &IntroOptions{Reflector: "203.0.113.2:7000"}
	hl := listenIn(t, n.A.Host, "0.0.0.0:0", testConfig())
	ctx := within(t, 15*time.Second)

	type hosted struct {
		in  Introduction
		err error
	}
	punched := make(chan hosted, 1)
	go func() {
		var in Introduction
		err := n.A.Host.Run(func() (err error) {
			in, err = hl.HostWith(ctx, "203.0.113.1:7000", "bday", opts)
			if err != nil {
				return err
			}
			// On this goroutine: a hard host's extra sockets open in
			// its namespace.
			in.seed = seed
			return hl.Punch(ctx, in)
		})
		punched <- hosted{in, err}
	}()
	accepted := make(chan *Conn, 1)
	go func() {
		c, err := hl.AcceptConn(ctx)
		if err == nil {
			accepted <- c
		}
		close(accepted)
	}()
	require.Eventually(t, func() bool {
		intro.punch.mu.Lock()
		defer intro.punch.mu.Unlock()
		return intro.punch.hosts["bday"] != nil
	}, 5*time.Second, 10*time.Millisecond)

	pc := n.B.Host.ListenUDP(t, "0.0.0.0:0")
	start := time.Now()
	var in Introduction
	var c *Conn
	var dialErr error
	require.NoError(t, n.B.Host.Run(func() (err error) {
		in, err = JoinWith(ctx, pc, "203.0.113.1:7000", "bday", opts)
		if err != nil {
			return err
		}
		// On this goroutine: the extra sockets open in the joiner's
		// namespace.
		c, dialErr = DialCandidates(ctx, pc, in, testConfig())
		return nil
	}))
	run := birthdayRun{fromAsk: time.Since(start), toPath: time.Since(in.Start), err: dialErr}
	h := <-punched
	require.NoError(t, h.err)
	assert.Equal(t, joiner == nattest.Symmetric, in.Hard, "the joiner learned its NAT's mapping")
	assert.Equal(t, host == nattest.Symmetric, in.PeerHard, "the introducer passed on the host's")
	assert.Equal(t, host == nattest.Symmetric, h.in.Hard, "the host learned its NAT's mapping")
	assert.Equal(t, joiner == nattest.Symmetric, h.in.PeerHard, "the introducer passed on the joiner's")
	if dialErr != nil {
		require.ErrorIs(t, dialErr, ErrNoDirectPath)
		return run
	}
	defer c.Close()
	sc, ok := <-accepted
	require.True(t, ok, "the host's Listener accepted the joiner")
	defer sc.Close()
	assert.Equal(t, n.A.Router.Addr(), c.RemoteAddr().(*net.UDPAddr).AddrPort().Addr(), "through the host's NAT")
	assert.Equal(t, n.B.Router.Addr(), sc.RemoteAddr().(*net.UDPAddr).AddrPort().Addr(), "from the joiner's NAT")
	require.NoError(t, c.Send(Message{ID: 100, Payload: []byte("hello host"), Reliable: true}))
	m, err := sc.Receive(ctx)
	require.NoError(t, err)
	assert.Equal(t, "hello host", string(m.Payload))
	require.NoError(t, sc.Send(Message{ID: 100, Payload: []byte("hello joiner"), Reliable: true}))
	m, err = c.Receive(ctx)
	require.NoError(t, err)
	assert.Equal(t, "hello joiner", string(m.Payload))
	adopted := func() int {
		hl.punch.mu.Lock()
		defer hl.punch.mu.Unlock()
		return len(hl.punch.adopted)
	}
	hl.punch.mu.Lock()
	_, onAdopted := hl.punch.adopted[sc.ep]
	hl.punch.mu.Unlock()
	if h.in.Hard && !onAdopted {
		// The Listener's own socket probes the joiner too, which opens
		// one more mapping toward it: the spray hits that one once in
		// 257, and the connection runs there, a direct path as good.
		assert.Same(t, hl.eps[0], sc.ep, "the connection runs on an adopted socket or the Listener's own")
		t.Logf("seed %d: the spray found the Listener's own mapping", seed)
	}
	if h.in.Hard && onAdopted {
		// Over the extra socket the joiner's probe came in on, which
		// the Listener serves until the connection ends.
		assert.Len(t, hl.Conns(), 1, "the Listener lists it")
		c.Close()
		require.Eventually(t, func() bool { return adopted() == 0 }, 10*time.Second, 5*time.Millisecond, "the adopted socket closed after its connection")
	} else if !h.in.Hard {
		assert.Zero(t, adopted())
	}
	run.direct = true
	return run
}

// birthdayRuns is how many seeded runs a pair gets (5 with -short, to
// keep the short suite's time), and birthdayWithin the time from the
// agreed start to connected that a run must meet.
const (
	birthdayRuns   = 20
	birthdayWithin = 3 * time.Second
)

// runBirthdayPairs runs a pair birthdayRuns times (seeds 1 to 20) and
// asserts that at least 95 % (19 of 20; 5 of 5 with -short) connect
// directly within birthdayWithin of the agreed start, logging the times
// to a path.
func runBirthdayPairs(t *testing.T, host, joiner nattest.Type) {
	nattest.Require(t)
	n := birthdayRuns
	if testing.Short() {
		n = 5
	}
	runs := make([]birthdayRun, n)
	t.Run("runs", func(t *testing.T) {
		for i := range runs {
			t.Run(fmt.Sprintf("seed-%d", i+1), func(t *testing.T) {
				t.Parallel()
				runs[i] = runBirthdayPair(t, host, joiner, uint64(i+1))
			})
		}
	})
	if t.Failed() {
		return
	}
	ok := 0
	var times []time.Duration
	for i, r := range runs {
		if r.direct && r.toPath <= birthdayWithin {
			ok++
		} else {
			t.Logf("seed %d: direct %v, %v from the start: %v", i+1, r.direct, r.toPath.Round(time.Millisecond), r.err)
		}
		if r.direct {
			times = append(times, r.toPath)
		}
	}
	sort.Slice(times, func(i, j int) bool { return times[i] < times[j] })
	if len(times) > 0 {
		t.Logf("NAT pair %v hosts, %v joins: %d of %d direct within %v; time to path from the agreed start: min %v, median %v, max %v",
			host, joiner, ok, len(runs), birthdayWithin, times[0].Round(time.Millisecond), times[len(times)/2].Round(time.Millisecond), times[len(times)-1].Round(time.Millisecond))
	}
	assert.GreaterOrEqual(t, ok, len(runs)-len(runs)/20, "runs direct within %v", birthdayWithin)
}

// A joiner behind a symmetric NAT reaches a host behind a
// port-restricted cone, which TestNATPunch's probing never does: the
// joiner opens 256 extra sockets toward the host's address, the host
// probes random ports of the joiner's, and the joiner dials from the
// socket a probe came in on. At least 19 of 20 runs connect within 3 s
// of the agreed start.
func TestNATBirthdayJoinerSymmetric(t *testing.T) {
	runBirthdayPairs(t, nattest.PortRestrictedCone, nattest.Symmetric)
}

// A host behind a symmetric NAT is reached by a joiner behind a
// port-restricted cone (the example): the host opens 256 extra
// sockets toward the joiner's address, the joiner probes random ports of
// the host's, and the host's Listener adopts the socket the joiner's
// probe came in on, over which it accepts the joiner's connection. At
// least 19 of 20 runs connect within 3 s of the agreed start.
func TestNATBirthdayHostSymmetric(t *testing.T) {
	runBirthdayPairs(t, nattest.Symmetric, nattest.PortRestrictedCone)
}

// Without the second reflector neither side knows that the joiner's NAT
// is symmetric, and the pair fails as before: what connects
// TestNATBirthdayJoinerSymmetric is the birthday probing.
func TestNATBirthdayNeedsReflector(t *testing.T) {
	t.Parallel()
	n := nattest.New(t, nattest.PortRestrictedCone, nattest.Symmetric, nil)
	intro := listenIn(t, n.Public, "203.0.113.1:7000", testConfig())
	intro.ServeIntroductions()
	hl := listenIn(t, n.A.Host, "0.0.0.0:0", testConfig())
	ctx := within(t, 10*time.Second)
	punched := make(chan error, 1)
	go func() {
		in, err := hl.Host(ctx, "203.0.113.1:7000", "plain")
		if err == nil {
			err = hl.Punch(ctx, in)
		}
		punched <- err
	}()
	pc := n.B.Host.ListenUDP(t, "0.0.0.0:0")
	var err error
	require.NoError(t, n.B.Host.Run(func() error {
		in, jerr := Join(ctx, pc, "203.0.113.1:7000", "plain")
		if jerr != nil {
			return jerr
		}
		assert.False(t, in.Hard || in.PeerHard)
		_, err = DialCandidates(ctx, pc, in, testConfig())
		return nil
	}))
	require.ErrorIs(t, err, ErrNoDirectPath)
	require.NoError(t, <-punched)
}

// A host facing a hard joiner sends, besides a probe a round to each
// candidate, exactly birthdayProbes probes to random ports of the
// joiner's address, and answers only what any punching host answers: a
// padded probe carrying its token, once, from whoever sends it; a
// probe with another token, or one too short for an answer, gets
// nothing. (In a namespace of its own: the probes go to random ports.)
func TestNATBirthdayAttackPunchBudget(t *testing.T) {
	t.Parallel()
	n := nattest.New(t, nattest.FullCone, nattest.FullCone, nil)
	hl := listenIn(t, n.Public, "203.0.113.1:0", testConfig())
	stranger := n.Public.ListenUDP(t, "203.0.113.2:0")
	ctx := within(t, 10*time.Second)
	in := Introduction{
		Peer:     []netip.AddrPort{netip.MustParseAddrPort("203.0.113.3:40000")},
		PeerHard: true,
		Start:    time.Now(),
	}
	in.Token[0] = 35
	before := hl.Stats()
	punched := make(chan error, 1)
	go func() { punched <- hl.Punch(ctx, in) }()

	host := hl.Addr().(*net.UDPAddr).AddrPort()
	host = netip.AddrPortFrom(netip.MustParseAddr("203.0.113.1"), host.Port())
	var wrong [8]byte
	wrong[0] = 36
	require.Eventually(t, func() bool {
		hl.punch.mu.Lock()
		defer hl.punch.mu.Unlock()
		return hl.punch.tokens[in.Token] != nil
	}, 5*time.Second, time.Millisecond, "the Punch runs")
	// A wrong token and a short probe first: the host reads in order,
	// so the answer to the third says the first two were handled.
	for _, d := range [][]byte{
		appendQueryDatagram(nil, punchKindProbe, &wrong, nil, queryPadTo),
		appendQueryDatagram(nil, punchKindProbe, &in.Token, nil, 0),
		appendQueryDatagram(nil, punchKindProbe, &in.Token, nil, queryPadTo),
	} {
		_, err := stranger.WriteToUDPAddrPort(d, host)
		require.NoError(t, err)
	}
	buf := make([]byte, 2048)
	require.NoError(t, stranger.SetReadDeadline(time.Now().Add(5*time.Second)))
	got, from, err := stranger.ReadFromUDPAddrPort(buf)
	require.NoError(t, err)
	assert.Equal(t, host, from)
	kind, tok, body, ok := parseQueryDatagram(buf[:got])
	require.True(t, ok)
	assert.Equal(t, byte(punchKindAnswer), kind)
	assert.Equal(t, in.Token, tok)
	assert.Empty(t, body)
	assert.Equal(t, queryOverhead, got, "20 bytes")
	require.NoError(t, <-punched)
	st := hl.Stats()
	assert.Equal(t, uint64(1), st.PunchAnswered-before.PunchAnswered, "one answer: to the padded probe with the token")
	assert.Equal(t, uint64(punchRounds+birthdayProbes+1), st.Writes-before.Writes, "a round's probe to the candidate, the spray, the answer")
	assert.Equal(t, uint64(1), st.PunchDropped-before.PunchDropped, "the short probe")
}
