package knet

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"testing"
	"testing/synctest"
	"time"

	"github.com/knet-go/knet/internal/netsim"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Reliable latest state through a blackout (issue 32): every version of a
// state sent while the path drops everything one way, the newest must
// arrive once the path is back, promptly, once, and nothing older after
// it.

// A path that drops everything one way while every version of a state is
// sent, one every 5ms (issue 32): each version leaves in a datagram of its
// own, all lost. Once the path is back, the newest must go again, promptly,
// and arrive once; what was replaced goes no more. Versions in flight are
// probed oldest first, and a probe that finds only replaced versions sends
// nothing, so that, before the fix, the newest of 300 went 150 backed-off
// probe timeouts later (a minute and more), with nothing sent meanwhile.
// The blackout ends with the last version, a little after it (within the
// RTO: the probe has not fired yet), or long after it (the probe timer has
// backed off; past the keepalive, whose pings are lost too); it covers
// every version or only the last ones; it cuts the sender's direction, in
// plaintext or secure, from the client or from the server.
func TestReliableLatestStateBlackout(t *testing.T) {
	const versions, every = 300, 5 * time.Millisecond
	const rto = 33 * time.Millisecond // MaxAckDelay's, the floor
	sending := versions * every
	for _, c := range []struct {
		name string
		// The blackout, from the first version's send.
		from, until time.Duration
		// How soon after the path is back the newest must arrive: the
		// first probe, an RTO (33ms) after the last send; or, after
		// probes lost in the blackout, the next, backed off (up to
		// maxProbeBackoff).
		within time.Duration
	}{
		{"every version", 0, sending, 2 * rto},
		{"every version, past the last by less than the RTO", 0, sending + 20*time.Millisecond, 2 * rto},
		{"every version, past the last by 3 RTOs", 0, sending + 100*time.Millisecond, 5 * rto},
		{"every version, past the keepalive", 0, sending + 2500*time.Millisecond, maxProbeBackoff + 2*rto},
		{"the last 4, shorter than the RTO", sending - 20*time.Millisecond, sending, 2 * rto},
		{"the last 40, longer than the RTO", sending - 200*time.Millisecond, sending, 2 * rto},
	} {
		for _, secure := range []bool{false, true} {
			for _, from := range []int{0, 1} {
				name := fmt.Sprintf("%s/%s/%s", c.name, map[bool]string{false: "plain", true: "secure"}[secure], [2]string{"client", "server"}[from])
				t.Run(name, func(t *testing.T) {
					// A keepalive of 2s: the longest blackout outlasts it.
					cfg := &Config{ConnectionLostTimeout: 6 * time.Second}
					path := netsim.Params{Delay: time.Millisecond}
					var p *simPair
					if secure {
						p = newSecureSimPair(t, cfg, cfg, path, path)
					} else {
						p = newSimPair(t, cfg, cfg, path, path)
					}
					p.connect()
					to := 1 - from
					p.send(from, Message{ID: 119, Payload: []byte("warm-up"), Reliable: true})
					require.True(t, p.run(time.Second, func() bool { return len(p.h[to].msgs) == 1 }), "the warm-up arrives")
					p.run(100*time.Millisecond, nil)
					start := p.now
					cut := func() { p.cut[from] = !p.now.Before(start.Add(c.from)) && p.now.Before(start.Add(c.until)) }
					for v := 1; v <= versions; v++ {
						cut()
						p.send(from, Message{ID: 120, Payload: versionPayload(v, 4), Reliable: true, ContentID: 1})
						p.run(every, nil)
					}
					cut()
					if p.cut[from] {
						p.run(start.Add(c.until).Sub(p.now), nil)
						p.cut[from] = false
					}
					back := p.now
					newest := func() bool {
						for _, m := range p.h[to].msgs {
							if m.ID == 120 && binary.LittleEndian.Uint32(m.Payload) == versions {
								return true
							}
						}
						return false
					}
					s := p.s[from]
					arrived := p.run(3*time.Second, newest)
					took := p.now.Sub(back)
					p.run(time.Second, nil)
					require.True(t, arrived, "the newest version arrives once the path is back: in flight %d, sent %d, retransmits %d, replaced %d",
						s.loss.sent.count, s.snapshot().DatagramsSent, s.snapshot().Retransmits, s.snapshot().ReplacedMessages)
					require.Equal(t, rto, s.loss.rto())
					assert.LessOrEqual(t, took, c.within, "promptly")
					checkVersions(t, p.h[to], map[uint32]int{120: versions})
					assert.Equal(t, stateOK, s.state)
					assert.Zero(t, s.loss.sent.count, "nothing left in flight")
					assert.Zero(t, s.latestQueued())
				})
			}
		}
	}
}

// blackoutVersions and blackoutEvery are the finding's traffic: 300
// versions of one state, one every 5ms, all sent in a blackout of 1.5s.
const (
	blackoutVersions = 300
	blackoutEvery    = 5 * time.Millisecond
)

// blackoutConns sends the finding's traffic from sender to receiver: a
// reliable warm-up, delivered, then the versions with cut(true) in force,
// then cut(false). It returns the versions received (in order) up to 3s
// after the path came back, or a second after the newest, and how long
// after the path came back the newest came (negative if it did not).
func blackoutConns(t *testing.T, sender, receiver *Conn, cut func(bool)) (got []int, took time.Duration) {
	t.Helper()
	type arrival struct {
		v  int
		at time.Time
	}
	arrivals := make(chan arrival, 2*blackoutVersions)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			m, err := receiver.Receive(ctx)
			if err != nil {
				return
			}
			v := -1 // the warm-up
			if m.ID == 120 {
				v = int(binary.LittleEndian.Uint32(m.Payload))
			}
			arrivals <- arrival{v, time.Now()}
		}
	}()
	defer func() { cancel(); <-done }()
	require.NoError(t, sender.Send(Message{ID: 119, Payload: []byte("warm-up"), Reliable: true}))
	select {
	case a := <-arrivals:
		require.Equal(t, -1, a.v)
	case <-time.After(2 * time.Second):
		t.Fatal("the warm-up did not arrive")
	}
	cut(true)
	for v := 1; v <= blackoutVersions; v++ {
		require.NoError(t, sender.Send(Message{ID: 120, Payload: versionPayload(v, 4), Reliable: true, ContentID: 1}))
		time.Sleep(blackoutEvery)
	}
	cut(false)
	back := time.Now()
	took = -1
	end := time.After(3 * time.Second)
	for {
		select {
		case a := <-arrivals:
			got = append(got, a.v)
			if a.v == blackoutVersions && took < 0 {
				took = a.at.Sub(back)
				end = time.After(time.Second) // for a copy, or an older one
			}
		case <-end:
			return got, took
		}
	}
}

// checkBlackout asserts the promise of what blackoutConns returned: the
// newest once, within the bound, nothing older after a newer one, and the
// sender's connection open.
func checkBlackout(t *testing.T, sender *Conn, got []int, took, within time.Duration) {
	t.Helper()
	st := sender.Stats()
	require.GreaterOrEqual(t, took, time.Duration(0), "the newest version never came: received %v; the sender's stats: %d datagrams sent, %d retransmits, %d in flight, err %v",
		got, st.DatagramsSent, st.Retransmits, st.InFlight, sender.Err())
	assert.LessOrEqual(t, took, within, "the newest came promptly once the path was back")
	for i := 1; i < len(got); i++ {
		assert.Greater(t, got[i], got[i-1], "version %d after %d: %v", got[i], got[i-1], got)
	}
	assert.Equal(t, blackoutVersions, got[len(got)-1], "the newest last")
	assert.NoError(t, sender.Err())
}

// The finding end to end, in a synctest bubble over a network in memory:
// Conns, plaintext and secure, the client's direction cut or the
// server's, the connections parking after 1ms idle or a second.
func TestReliableLatestStateBlackoutConn(t *testing.T) {
	for _, secure := range []bool{false, true} {
		for _, fromServer := range []bool{false, true} {
			for _, park := range []time.Duration{0, time.Millisecond} {
				name := fmt.Sprintf("%s/%s/park%v", map[bool]string{false: "plain", true: "secure"}[secure],
					map[bool]string{false: "client to server", true: "server to client"}[fromServer], park)
				t.Run(name, func(t *testing.T) {
					synctest.Test(t, func(t *testing.T) {
						nw := memNet(t)
						nw.parkAfter = park
						ccfg, scfg := testConfig(), testConfig()
						if secure {
							priv, pub, err := GenerateKey()
							require.NoError(t, err)
							ccfg.ServerKey, scfg.PrivateKey = pub, priv
						}
						l := nw.listen(t, scfg)
						c := nw.dial(t, l.Addr().String(), ccfg)
						sc := serverConn(t, l)
						t.Cleanup(func() { sc.Close() })
						require.Equal(t, secure, c.Secure())
						a := unmap(l.Addr().(*net.UDPAddr).AddrPort())
						from, to := netip.AddrPort{}, a // the client's datagrams
						sender, receiver := c, sc
						if fromServer {
							from, to = a, netip.AddrPort{}
							sender, receiver = sc, c
						}
						cut := func(on bool) {
							if on {
								nw.mem.SetLink(from, to, &netsim.Params{Loss: 1})
							} else {
								nw.mem.SetLink(from, to, nil)
							}
						}
						got, took := blackoutConns(t, sender, receiver, cut)
						// An RTO after the last version's send (MaxAckDelay's
						// 33ms, the floor), 5ms before the path came back.
						checkBlackout(t, sender, got, took, 2*33*time.Millisecond)
					})
				})
			}
		}
	}
}

// The finding over the system's loopback, through a relay that cuts one
// direction (with -short, the client's only: each takes 3s).
func TestReliableLatestStateBlackoutRelay(t *testing.T) {
	t.Parallel()
	for _, fromServer := range []bool{false, true} {
		if fromServer && testing.Short() {
			continue
		}
		t.Run(map[bool]string{false: "client to server", true: "server to client"}[fromServer], func(t *testing.T) {
			l := listen(t, testConfig())
			r, err := netsim.NewRelay(l.Addr().String(), netsim.Params{}, netsim.Params{})
			require.NoError(t, err)
			t.Cleanup(func() { r.Close() })
			c := dial(t, r.Addr().String(), testConfig())
			sc := serverConn(t, l)
			t.Cleanup(func() { sc.Close() })
			sender, receiver := c, sc
			cut := func(on bool) { r.Cut(on, false) }
			if fromServer {
				sender, receiver = sc, c
				cut = func(on bool) { r.Cut(false, on) }
			}
			got, took := blackoutConns(t, sender, receiver, cut)
			// On a loaded host the RTO may be above its floor, and a probe
			// lost in the blackout backs off: at most maxProbeBackoff.
			checkBlackout(t, sender, got, took, maxProbeBackoff)
		})
	}
}
