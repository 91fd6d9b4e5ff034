package knet

import (
	"context"
	"encoding/binary"
	"flag"
	"net"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/netsim"
)

// resumeOutage is the outage of TestResumeAfterOutage. The connections run
// in a testing/synctest bubble on a network in memory, so that a minute
// of outage takes a fraction of a second of real time; the flag only
// makes it shorter or longer.
var resumeOutage = flag.Duration("knet.resume.outage", time.Minute, "the outage TestResumeAfterOutage* resumes from")

// memNAT stands between one client and a server on a network in memory,
// as a NAT on a path that may lose everything both ways for a while
// (setDown) and come back with a new mapping (rebind): the client sends to
// inner, and the server sees the client at the outer socket's address.
// An outer socket replaced stays open and passes nothing on (the NAT
// forgot it): old is the first one, and oldIn counts what reached them.
type memNAT struct {
	t      *testing.T
	nw     *netsim.Network
	inner  *netsim.Socket
	server netip.AddrPort
	wg     sync.WaitGroup

	mu      sync.Mutex
	client  netip.AddrPort
	outer   *netsim.Socket
	old     []*netsim.Socket
	oldIn   int
	down    bool
	dropped [2]int   // bytes lost to the outage: to the server, to the client
	sent    [][]byte // datagrams the client sent the server, in order
}

func newMemNAT(t *testing.T, nw *netsim.Network, server net.Addr) *memNAT {
	inner, err := nw.Listen(netip.AddrPort{})
	require.NoError(t, err)
	n := &memNAT{t: t, nw: nw, inner: inner, server: unmap(server.(*net.UDPAddr).AddrPort())}
	n.outer = n.newOuter()
	n.wg.Go(func() {
		buf := make([]byte, 65536)
		for {
			k, from, err := inner.ReadFrom(buf)
			if err != nil {
				return
			}
			b := append([]byte(nil), buf[:k]...)
			n.mu.Lock()
			n.client = from
			n.sent = append(n.sent, b)
			out := n.outer
			if n.down {
				n.dropped[0] += k
				out = nil
			}
			n.mu.Unlock()
			if out != nil {
				out.WriteTo(b, n.server)
			}
		}
	})
	t.Cleanup(n.close)
	return n
}

// newOuter opens an outer socket, which passes what the server sends to
// the client while it is the current one and the path is up.
func (n *memNAT) newOuter() *netsim.Socket {
	o, err := n.nw.Listen(netip.AddrPort{})
	require.NoError(n.t, err)
	n.wg.Go(func() {
		buf := make([]byte, 65536)
		for {
			k, _, err := o.ReadFrom(buf)
			if err != nil {
				return
			}
			n.mu.Lock()
			pass := o == n.outer && !n.down
			switch {
			case o != n.outer:
				n.oldIn += k
			case n.down:
				n.dropped[1] += k
			}
			to := n.client
			n.mu.Unlock()
			if pass {
				n.inner.WriteTo(buf[:k], to)
			}
		}
	})
	return o
}

func (n *memNAT) Addr() string { return n.inner.Addr().String() }

// outerAddr is where the server sees the client now.
func (n *memNAT) outerAddr() string {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.outer.Addr().String()
}

// setDown loses everything both ways while down.
func (n *memNAT) setDown(down bool) {
	n.mu.Lock()
	n.down = down
	n.mu.Unlock()
}

// rebind moves the client to a new outer address.
func (n *memNAT) rebind() {
	o := n.newOuter()
	n.mu.Lock()
	n.old = append(n.old, n.outer)
	n.outer = o
	n.mu.Unlock()
}

func (n *memNAT) droppedBytes() [2]int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.dropped
}

func (n *memNAT) recorded() [][]byte {
	n.mu.Lock()
	defer n.mu.Unlock()
	return slices.Clone(n.sent)
}

func (n *memNAT) oldReceived() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.oldIn
}

func (n *memNAT) close() {
	n.inner.Close()
	n.mu.Lock()
	n.outer.Close()
	for _, o := range n.old {
		o.Close()
	}
	n.mu.Unlock()
	n.wg.Wait()
}

// seqReceiver reads c's messages of ID 7, each a sequence number, and
// hands the numbers on in the order they came, until c ends; then the channel
// closes.
func seqReceiver(c *Conn) <-chan uint32 {
	ch := make(chan uint32, 4096)
	go func() {
		defer close(ch)
		for {
			m, err := c.Receive(context.Background())
			if err != nil {
				return
			}
			if m.ID == 7 {
				ch <- binary.LittleEndian.Uint32(m.Payload)
			}
		}
	}()
	return ch
}

// sendSeq sends c the reliable in-order messages numbered from..to-1.
func sendSeq(t *testing.T, c *Conn, from, to uint32) {
	t.Helper()
	for i := from; i < to; i++ {
		require.NoError(t, c.Send(Message{ID: 7, Payload: binary.LittleEndian.AppendUint32(nil, i), Reliable: true, InOrder: true}))
	}
}

// expectSeq reads from ch the numbers from..to-1, in that order, each
// once, within d.
func expectSeq(t *testing.T, ch <-chan uint32, from, to uint32, d time.Duration) {
	t.Helper()
	timeout := time.After(d)
	for want := from; want < to; want++ {
		select {
		case got, ok := <-ch:
			require.True(t, ok, "the connection ended at message %d of %d..%d", want, from, to)
			require.Equal(t, want, got, "messages lost, duplicated or out of order")
		case <-timeout:
			t.Fatalf("message %d of %d..%d not delivered within %v", want, from, to, d)
		}
	}
}

// resumeConfigs are a secure server's and client's settings for the
// resume tests: the connection is taken for lost after 6s of silence, and
// waits suspended two minutes more. The server counts its admissions.
func resumeConfigs(t *testing.T, secure bool) (scfg, ccfg *Config, admits *atomic.Int32) {
	if secure {
		scfg, ccfg = secureConfigs(t)
	} else {
		scfg, ccfg = testConfig(), testConfig()
	}
	for _, c := range []*Config{scfg, ccfg} {
		c.ConnectionLostTimeout = 6 * time.Second
		c.ResumeTimeout = 2 * time.Minute
	}
	admits = new(atomic.Int32)
	scfg.Admit = func(net.Addr, []byte) ([]byte, error) {
		admits.Add(1)
		return nil, nil
	}
	return scfg, ccfg, admits
}

// resumeSetup connects a client through a memNAT and returns both sides.
func resumeSetup(t *testing.T, nw *testNet, scfg, ccfg *Config) (l *Listener, nat *memNAT, c, sc *Conn) {
	t.Helper()
	l = nw.listen(t, scfg)
	nat = newMemNAT(t, nw.mem, l.Addr())
	c = nw.dial(t, nat.Addr(), ccfg)
	sc = serverConn(t, l)
	t.Cleanup(func() { sc.Close() })
	return l, nat, c, sc
}

// noNewConn checks that the listener offers no connection within a
// second.
func noNewConn(t *testing.T, l *Listener) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	extra, err := l.AcceptConn(ctx)
	require.ErrorIs(t, err, context.DeadlineExceeded, "a new connection %v", extra)
}

// TestResumeAfterOutage: a secure session's path loses everything both
// ways for a minute, in the middle of ordered reliable streams both sides
// keep sending, and the client comes back from a new address (its NAT's
// mapping changed). Both sides suspend at ConnectionLostTimeout; the
// client's probe from the new address resumes the server's connection,
// whose path check moves it there; every message is delivered once, in
// order, on the same *Conn, with no second Admit.
func TestResumeAfterOutage(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		scfg, ccfg, admits := resumeConfigs(t, true)
		l, nat, c, sc := resumeSetup(t, nw, scfg, ccfg)
		atClient, atServer := seqReceiver(c), seqReceiver(sc)
		first := nat.outerAddr()
		require.Equal(t, first, sc.RemoteAddr().String())

		const before, per = 50, 2 // messages before the outage; each side's every second during it
		sendSeq(t, c, 0, before)
		sendSeq(t, sc, 0, before)
		expectSeq(t, atServer, 0, before, 10*time.Second)
		expectSeq(t, atClient, 0, before, 10*time.Second)

		outage := *resumeOutage
		nat.setDown(true)
		start := time.Now()
		next := uint32(before)
		var suspended [2]Stats // each side's, once both suspended
		var wireThen [2]int    // the bytes lost to the outage then
		tick := time.NewTicker(time.Second / per)
		for time.Since(start) < outage {
			<-tick.C
			sendSeq(t, c, next, next+1)
			sendSeq(t, sc, next, next+1)
			next++
			// A game's state too, unreliable: it waits while suspended.
			require.NoError(t, c.Send(Message{ID: 8, Payload: make([]byte, 100)}))
			require.NoError(t, sc.Send(Message{ID: 8, Payload: make([]byte, 100)}))
			if suspended[0].Suspensions == 0 && time.Since(start) > ccfg.ConnectionLostTimeout+time.Second {
				suspended = [2]Stats{c.Stats(), sc.Stats()}
				wireThen = nat.droppedBytes()
			}
		}
		tick.Stop()
		during := [2]Stats{c.Stats(), sc.Stats()}
		wireNow := nat.droppedBytes()
		for i, st := range during {
			assert.True(t, st.Suspended, "side %d", i)
			assert.Equal(t, uint64(1), st.Suspensions, "side %d", i)
			assert.Zero(t, st.Resumes, "side %d", i)
		}
		// What a suspended side sent: probes, about one a second.
		secs := (outage - ccfg.ConnectionLostTimeout - time.Second).Seconds()
		for i := range 2 {
			n := during[i].DatagramsSent - suspended[i].DatagramsSent
			t.Logf("%s suspended for %.0fs: %d datagrams, %d bytes on the wire", [2]string{"client", "server"}[i], secs, n, wireNow[i]-wireThen[i])
			assert.LessOrEqual(t, float64(n), secs+2, "side %d probed faster than once a second", i)
			assert.Positive(t, n, "side %d never probed", i)
		}

		nat.rebind()
		nat.setDown(false)
		back := time.Now()
		expectSeq(t, atServer, before, next, 30*time.Second)
		serverDone := time.Since(back)
		expectSeq(t, atClient, before, next, 30*time.Second)
		clientDone := time.Since(back)
		// The client's next probe (a second at most) finds the server,
		// and the backlog follows within a few round trips.
		assert.LessOrEqual(t, clientDone, 2*resumeProbeGap)
		t.Logf("outage %v, %d messages each way during it: all delivered %v (to the server) and %v (to the client) after the path came back",
			outage, next-before, serverDone, clientDone)

		// The session goes on.
		sendSeq(t, c, next, next+50)
		sendSeq(t, sc, next, next+50)
		expectSeq(t, atServer, next, next+50, 10*time.Second)
		expectSeq(t, atClient, next, next+50, 10*time.Second)

		second := nat.outerAddr()
		require.NotEqual(t, first, second)
		assert.Equal(t, second, sc.RemoteAddr().String(), "the server's connection did not move")
		cs, ss := c.Stats(), sc.Stats()
		for i, st := range []Stats{cs, ss} {
			assert.False(t, st.Suspended, "side %d", i)
			assert.Equal(t, uint64(1), st.Resumes, "side %d", i)
		}
		assert.Equal(t, uint64(1), ss.Migrations)
		assert.Zero(t, ss.InvalidDatagrams)
		assert.Equal(t, int32(1), admits.Load(), "a new Admit")
		noNewConn(t, l)
		require.NoError(t, c.Close())
	})
}

// TestResumeTimeoutExpires: a path that never comes back ends the
// suspended connection on both sides ResumeTimeout after
// ConnectionLostTimeout, with a *TimeoutError whose Op is "resume".
func TestResumeTimeoutExpires(t *testing.T) {
	for _, secure := range []bool{true, false} {
		t.Run(map[bool]string{true: "secure", false: "plaintext"}[secure], func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				nw := memNet(t)
				scfg, ccfg, _ := resumeConfigs(t, secure)
				_, nat, c, sc := resumeSetup(t, nw, scfg, ccfg)
				atClient, atServer := seqReceiver(c), seqReceiver(sc)
				sendSeq(t, c, 0, 1)
				expectSeq(t, atServer, 0, 1, 5*time.Second)
				nat.setDown(true)
				start := time.Now()
				sendSeq(t, c, 1, 10)
				sendSeq(t, sc, 0, 10)
				for _, ch := range []<-chan uint32{atClient, atServer} {
					for range ch {
						// Nothing more comes; the channel closes as the
						// connection ends.
					}
				}
				took := time.Since(start)
				limit := ccfg.ConnectionLostTimeout + ccfg.ResumeTimeout
				assert.GreaterOrEqual(t, took, limit)
				assert.Less(t, took, limit+3*time.Second)
				for i, cn := range []*Conn{c, sc} {
					var te *TimeoutError
					require.ErrorAs(t, cn.Err(), &te, "side %d", i)
					assert.Equal(t, "resume", te.Op, "side %d", i)
					assert.ErrorIs(t, cn.Err(), net.ErrClosed)
					assert.Contains(t, te.Error(), "ResumeTimeout")
					st := cn.Stats()
					assert.Equal(t, uint64(1), st.Suspensions, "side %d", i)
					assert.Zero(t, st.Resumes, "side %d", i)
				}
			})
		})
	}
}

// TestResumeOffEndsAtLostTimeout: without ResumeTimeout a silent peer
// ends the connection at ConnectionLostTimeout, as before, and nothing is
// suspended.
func TestResumeOffEndsAtLostTimeout(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		scfg, ccfg, _ := resumeConfigs(t, true)
		scfg.ResumeTimeout, ccfg.ResumeTimeout = 0, 0
		_, nat, c, _ := resumeSetup(t, nw, scfg, ccfg)
		atClient := seqReceiver(c)
		nat.setDown(true)
		start := time.Now()
		for range atClient {
		}
		took := time.Since(start)
		assert.GreaterOrEqual(t, took, ccfg.ConnectionLostTimeout)
		assert.Less(t, took, ccfg.ConnectionLostTimeout+time.Second)
		var te *TimeoutError
		require.ErrorAs(t, c.Err(), &te)
		assert.Empty(t, te.Op)
		assert.Zero(t, c.Stats().Suspensions)
	})
}

// TestResumePlaintextSameAddress: a plaintext session resumes when its
// client comes back from the address it had, with everything sent during
// the outage delivered once, in order, on the same *Conn.
func TestResumePlaintextSameAddress(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		scfg, ccfg, admits := resumeConfigs(t, false)
		l, nat, c, sc := resumeSetup(t, nw, scfg, ccfg)
		atClient, atServer := seqReceiver(c), seqReceiver(sc)
		nat.setDown(true)
		sendSeq(t, c, 0, 20)
		sendSeq(t, sc, 0, 20)
		time.Sleep(30 * time.Second) // the outage, on the bubble's clock
		for i, st := range []Stats{c.Stats(), sc.Stats()} {
			assert.True(t, st.Suspended, "side %d", i)
		}
		sendSeq(t, c, 20, 40)
		sendSeq(t, sc, 20, 40)
		nat.setDown(false)
		expectSeq(t, atServer, 0, 40, 10*time.Second)
		expectSeq(t, atClient, 0, 40, 10*time.Second)
		for i, st := range []Stats{c.Stats(), sc.Stats()} {
			assert.False(t, st.Suspended, "side %d", i)
			assert.Equal(t, uint64(1), st.Resumes, "side %d", i)
		}
		assert.Equal(t, int32(1), admits.Load())
		noNewConn(t, l)
	})
}

// TestResumePlaintextNewAddressEnds: a plaintext session cannot follow its
// client to a new address (nothing proves the datagrams from there are
// its client's): the server takes them for strays, the connection stays
// suspended on both sides, and ends at ResumeTimeout; no connection is
// made from the new address.
func TestResumePlaintextNewAddressEnds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		scfg, ccfg, admits := resumeConfigs(t, false)
		l, nat, c, sc := resumeSetup(t, nw, scfg, ccfg)
		atClient := seqReceiver(c)
		nat.setDown(true)
		sendSeq(t, c, 0, 5)
		time.Sleep(30 * time.Second)
		nat.rebind()
		nat.setDown(false)
		strays := l.Stats().StrayDatagrams
		time.Sleep(10 * time.Second)
		assert.Greater(t, l.Stats().StrayDatagrams, strays, "the client's probes did not reach the server")
		for i, st := range []Stats{c.Stats(), sc.Stats()} {
			assert.True(t, st.Suspended, "side %d", i)
			assert.Zero(t, st.Resumes, "side %d", i)
		}
		for range atClient {
		}
		var te *TimeoutError
		require.ErrorAs(t, c.Err(), &te)
		assert.Equal(t, "resume", te.Op)
		<-sc.Done()
		require.ErrorAs(t, sc.Err(), &te)
		assert.Equal(t, "resume", te.Op)
		assert.Equal(t, int32(1), admits.Load())
		noNewConn(t, l)
	})
}

// TestResumeAttackWithoutKeys: while a secure connection is suspended, a
// stranger replays the client's sealed datagrams, and forges ones under
// its connection ID, from a new address and from the client's own: none
// authenticates as new, so the connection neither wakes nor moves nor
// checks the stranger's address, and the stranger hears nothing. The real
// client then resumes it.
func TestResumeAttackWithoutKeys(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		scfg, ccfg, _ := resumeConfigs(t, true)
		l, nat, c, sc := resumeSetup(t, nw, scfg, ccfg)
		atClient, atServer := seqReceiver(c), seqReceiver(sc)
		sendSeq(t, c, 0, 20)
		expectSeq(t, atServer, 0, 20, 5*time.Second)
		// Every datagram the client sent so far reached the server.
		synctest.Wait()
		heard := nat.recorded()
		nat.setDown(true)
		sendSeq(t, c, 20, 30)
		sendSeq(t, sc, 0, 10)
		time.Sleep(ccfg.ConnectionLostTimeout + 2*time.Second)
		st := sc.Stats()
		require.True(t, st.Suspended)
		challenges := sc.sec.challenges.Load()

		// The client's datagrams, the handshake's but for the ConnectSyn
		// (a ConnectSyn again is a new attempt, not this connection's),
		// and forgeries of each: one byte of the sealed part changed.
		var replays, forged [][]byte
		for _, b := range heard {
			if syn, _ := isConnectSyn(b); syn {
				continue
			}
			replays = append(replays, b)
			f := slices.Clone(b)
			f[len(f)-1] ^= 0x55
			forged = append(forged, f)
		}
		require.NotEmpty(t, replays)
		stranger := nw.rawSocket(t, l.Addr())
		nat.mu.Lock()
		own := nat.outer // the connection's address: spoofed, as it were
		nat.mu.Unlock()
		for range 3 {
			for _, b := range slices.Concat(replays, forged) {
				_, err := stranger.Write(b)
				require.NoError(t, err)
				require.NoError(t, own.WriteTo(b, nat.server))
			}
			time.Sleep(time.Second)
		}
		after := sc.Stats()
		assert.True(t, after.Suspended, "a datagram without the keys woke the connection")
		assert.Zero(t, after.Resumes)
		assert.Zero(t, after.Migrations)
		assert.Equal(t, own.Addr().String(), sc.RemoteAddr().String())
		assert.Equal(t, challenges, sc.sec.challenges.Load(), "the stranger's address was path-checked")
		assert.Greater(t, after.InvalidDatagrams, st.InvalidDatagrams, "the forgeries were not counted")
		require.NoError(t, stranger.SetReadDeadline(time.Now().Add(5*time.Second)))
		buf := make([]byte, 2048)
		n, err := stranger.Read(buf)
		assert.Error(t, err, "the stranger heard %d bytes", n)

		// The real client comes back, from a new address: the session
		// resumes, everything arrives once, in order.
		nat.rebind()
		nat.setDown(false)
		expectSeq(t, atServer, 20, 30, 30*time.Second)
		expectSeq(t, atClient, 0, 10, 30*time.Second)
		assert.Equal(t, uint64(1), sc.Stats().Resumes)
		assert.Equal(t, nat.outerAddr(), sc.RemoteAddr().String())
	})
}

// TestResumePeerWithout: a server without ResumeTimeout ends the
// connection at its ConnectionLostTimeout, as before; the client, which
// has it, waits suspended, its probes reach a listener that has forgotten
// it (counted, answered with nothing), and it ends at its
// ResumeTimeout. No new connection is made.
func TestResumePeerWithout(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		scfg, ccfg, admits := resumeConfigs(t, true)
		scfg.ResumeTimeout = 0
		l, nat, c, sc := resumeSetup(t, nw, scfg, ccfg)
		atClient := seqReceiver(c)
		nat.setDown(true)
		<-sc.Done()
		var te *TimeoutError
		require.ErrorAs(t, sc.Err(), &te)
		assert.Empty(t, te.Op, "the server's connection ended otherwise than at its lost timeout")
		time.Sleep(10 * time.Second)
		nat.setDown(false)
		ls := l.Stats()
		time.Sleep(10 * time.Second)
		// Sealed, they read as neither a connection attempt nor a
		// plaintext datagram: invalid.
		assert.Greater(t, l.Stats().InvalidDatagrams+l.Stats().StrayDatagrams, ls.InvalidDatagrams+ls.StrayDatagrams)
		assert.True(t, c.Stats().Suspended)
		for range atClient {
		}
		require.ErrorAs(t, c.Err(), &te)
		assert.Equal(t, "resume", te.Op)
		assert.Equal(t, int32(1), admits.Load())
		noNewConn(t, l)
	})
}

// TestResumeSendBufferWhileSuspended: a suspended connection takes what
// the application sends within SendBuffer, and says no past it
// (TrySend's ErrSendBufferFull); what it took is delivered once, in
// order, when the peer is back.
func TestResumeSendBufferWhileSuspended(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		scfg, ccfg, _ := resumeConfigs(t, true)
		ccfg.SendBuffer = 4096
		_, nat, c, sc := resumeSetup(t, nw, scfg, ccfg)
		atServer := seqReceiver(sc)
		nat.setDown(true)
		time.Sleep(ccfg.ConnectionLostTimeout + time.Second)
		require.True(t, c.Stats().Suspended)
		var took uint32
		for ; ; took++ {
			p := binary.LittleEndian.AppendUint32(make([]byte, 0, 100), took)
			err := c.TrySend(Message{ID: 7, Payload: p[:100], Reliable: true, InOrder: true})
			if err != nil {
				require.ErrorIs(t, err, ErrSendBufferFull)
				break
			}
			require.Less(t, took, uint32(1000), "the send buffer took everything")
		}
		assert.InDelta(t, 4096/100, took, 2)
		nat.setDown(false)
		expectSeq(t, atServer, 0, took, 10*time.Second)
		assert.Equal(t, uint64(1), sc.Stats().Resumes)
	})
}
