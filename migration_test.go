package knet

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// natRelay stands for a NAT between one client and a server: the client
// talks to pc, the relay to the server from its outer socket. rebind
// replaces the outer socket by a new one (a new source port, as when a
// NAT's mapping changes); the old one stays open but passes nothing on,
// as a NAT that forgot the mapping, and counts what reaches it. Every
// datagram to the server is recorded.
type natRelay struct {
	t      *testing.T
	pc     *net.UDPConn // facing the client
	server netip.AddrPort
	client atomic.Pointer[netip.AddrPort]
	wg     sync.WaitGroup

	mu      sync.Mutex
	outer   *net.UDPConn
	old     []*net.UDPConn
	oldIn   int      // bytes the old outer sockets received since they were replaced
	sent    [][]byte // datagrams to the server, in order
	hold    bool     // keep back the next unreliable datagram to the server
	held    []byte
	heldNow chan struct{}
	divert  *net.UDPConn // the next divertN datagrams to the server go from here instead
	divertN int
	dropIn  int // datagrams from the server to drop at the current outer socket
	dropped int
	// swapTo, when set, becomes the outer socket as the next datagram to
	// the server goes out from the old one: the NAT rebinds between the
	// client's datagram and the server's answer, which is lost.
	swapTo *net.UDPConn
}

func newNATRelay(t *testing.T, server net.Addr) *natRelay {
	pc, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	r := &natRelay{t: t, pc: pc, server: server.(*net.UDPAddr).AddrPort(), heldNow: make(chan struct{}, 1)}
	r.outer = r.newOuter()
	r.wg.Go(func() {
		buf := make([]byte, 65536)
		for {
			n, from, err := pc.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			r.client.Store(&from)
			b := append([]byte(nil), buf[:n]...)
			r.mu.Lock()
			r.sent = append(r.sent, b)
			out := r.outer
			switch {
			case r.hold && b[2]&(headerFlagReliable>>16) == 0:
				r.hold = false
				r.held = b
				signal(r.heldNow)
				out = nil
			case r.divertN > 0:
				r.divertN--
				out = r.divert
			case r.swapTo != nil:
				r.old = append(r.old, r.outer)
				r.outer, r.swapTo = r.swapTo, nil
			}
			r.mu.Unlock()
			if out != nil {
				out.WriteToUDPAddrPort(b, r.server)
			}
		}
	})
	t.Cleanup(r.close)
	return r
}

// newOuter opens an outer socket and passes what it receives to the
// client while it is the current one.
func (r *natRelay) newOuter() *net.UDPConn {
	o, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(r.t, err)
	r.wg.Go(func() {
		buf := make([]byte, 65536)
		for {
			n, err := o.Read(buf)
			if errors.Is(err, net.ErrClosed) {
				return
			}
			r.mu.Lock()
			current := o == r.outer
			if !current {
				r.oldIn += n
			} else if r.dropIn > 0 {
				r.dropIn--
				r.dropped++
				current = false
			}
			r.mu.Unlock()
			if to := r.client.Load(); current && err == nil && to != nil {
				r.pc.WriteToUDPAddrPort(buf[:n], *to)
			}
		}
	})
	return o
}

func (r *natRelay) Addr() string { return r.pc.LocalAddr().String() }

// outerAddr is where the server sees the client now.
func (r *natRelay) outerAddr() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.outer.LocalAddr().String()
}

// rebind moves the client to a new outer address.
func (r *natRelay) rebind() {
	o := r.newOuter()
	r.mu.Lock()
	r.old = append(r.old, r.outer)
	r.outer = o
	r.mu.Unlock()
}

// fromOld sends b to the server from the first outer address, which the
// NAT no longer uses: a datagram late or copied from there.
func (r *natRelay) fromOld(b []byte) {
	r.mu.Lock()
	o := r.old[0]
	r.mu.Unlock()
	_, err := o.WriteToUDPAddrPort(b, r.server)
	require.NoError(r.t, err)
}

func (r *natRelay) recorded() [][]byte {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.sent)
}

func (r *natRelay) oldReceived() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.oldIn
}

func (r *natRelay) close() {
	r.pc.Close()
	r.mu.Lock()
	r.outer.Close()
	for _, o := range r.old {
		o.Close()
	}
	r.mu.Unlock()
	r.wg.Wait()
}

// echoServer sends every message of c back as it came, but ID 9's.
func echoServer(t *testing.T, c *Conn) {
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			m, err := c.Receive(context.Background())
			if err != nil {
				return
			}
			if m.ID != 9 && c.Send(m) != nil {
				return
			}
		}
	})
	t.Cleanup(func() { c.Close(); wg.Wait() })
}

// echoBoth sends a reliable and an unreliable message and waits for their
// echoes: afterwards the server has taken everything the client sent
// before, and published its stats of the round that did.
func echoBoth(t *testing.T, c *Conn, tag byte) {
	t.Helper()
	for _, rel := range []bool{true, false} {
		m := Message{ID: 6, Payload: []byte{tag, 0xee}, Reliable: rel}
		got := echoOnce(t, c, m)
		require.Equal(t, m.Payload, got.Payload)
		require.Equal(t, rel, got.Reliable)
	}
}

// mustNotReceive checks that nothing waits at pc.
func mustNotReceive(t *testing.T, pc *net.UDPConn) {
	t.Helper()
	n, count := queued(t, pc)
	assert.Zero(t, count, "%d datagrams (%d bytes) arrived", count, n)
}

// queued reads what waits at pc, already sent to it, and returns its size
// in bytes and datagrams. A read with a deadline already past returns
// nothing, whatever waits (the runtime checks the deadline before it
// reads), so each read may wait a little: on loopback a datagram is at
// the socket when its send returns, and what the test waits for was sent
// before the event it synchronised on.
func queued(t *testing.T, pc *net.UDPConn) (bytes, count int) {
	t.Helper()
	buf := make([]byte, 65536)
	for {
		require.NoError(t, pc.SetReadDeadline(time.Now().Add(20*time.Millisecond)))
		n, _, err := pc.ReadFromUDPAddrPort(buf)
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return bytes, count
		}
		require.NoError(t, err)
		bytes += n
		count++
	}
}

func loopbackSocket(t *testing.T) *net.UDPConn {
	pc, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	t.Cleanup(func() { pc.Close() })
	return pc
}

// behindNAT starts a secure echo server and a client that reaches it
// through a natRelay, and returns them with the server's side of the
// connection.
func behindNAT(t *testing.T, scfg, ccfg *Config) (l *Listener, r *natRelay, c, sc *Conn) {
	t.Helper()
	l = listen(t, scfg)
	r = newNATRelay(t, l.Addr())
	c = dial(t, r.Addr(), ccfg)
	sc = serverConn(t, l)
	echoServer(t, sc)
	return l, r, c, sc
}

func TestSecureMigration(t *testing.T) {
	// The client's NAT rebinds mid-session: the connection carries on
	// from the new address, the server moves to it after the path
	// check, nothing reliable is lost, and datagrams late or copied from
	// the old address do not move it back.
	scfg, ccfg := secureConfigs(t)
	l, r, c, sc := behindNAT(t, scfg, ccfg)
	first := r.outerAddr()
	require.Equal(t, first, sc.RemoteAddr().String())
	for i := range 10 {
		echoBoth(t, c, byte(i))
	}

	// An unreliable datagram sent before the rebinding is held back, to
	// come late from the old address.
	r.mu.Lock()
	r.hold = true
	r.mu.Unlock()
	require.NoError(t, c.Send(Message{ID: 9, Payload: []byte("late")}))
	select {
	case <-r.heldNow:
	case <-time.After(5 * time.Second):
		t.Fatal("the relay held back nothing")
	}
	before := len(r.recorded())

	r.rebind()
	second := r.outerAddr()
	require.NotEqual(t, first, second)
	const n = 20
	for i := range n {
		require.NoError(t, c.Send(Message{ID: 7, Payload: []byte{byte(i)}, Reliable: true, InOrder: true}))
	}
	for i := range n {
		got, err := c.Receive(within(t, 10*time.Second))
		require.NoError(t, err)
		require.Equal(t, uint32(7), got.ID, "message %d", i)
		require.Equal(t, []byte{byte(i)}, got.Payload, "reliable messages lost or out of order")
	}
	// The echoes came through the new address only: the server moved.
	assert.Equal(t, second, sc.RemoteAddr().String())
	for i := range 10 {
		echoBoth(t, c, byte(100+i))
	}
	st := sc.Stats()
	assert.Equal(t, uint64(1), st.Migrations)
	assert.Zero(t, st.InvalidDatagrams)
	assert.Zero(t, c.Stats().Migrations)
	challenges := sc.sec.challenges.Load()
	assert.GreaterOrEqual(t, challenges, uint64(1))
	assert.LessOrEqual(t, challenges, uint64(4), "lossless: a challenge or two")

	// Late and copied datagrams from the old address: taken (the late
	// one is new to the server), but the connection stays, and nothing
	// goes there.
	oldIn := r.oldReceived()
	r.mu.Lock()
	held := r.held
	r.mu.Unlock()
	r.fromOld(held)
	for _, b := range r.recorded()[:before] {
		// (A ConnectSyn again would be a new connection attempt.)
		if syn, _ := isConnectSyn(b); !syn {
			r.fromOld(b)
		}
	}
	echoBoth(t, c, 200)
	echoBoth(t, c, 201)
	st = sc.Stats()
	assert.Equal(t, second, sc.RemoteAddr().String())
	assert.Equal(t, uint64(1), st.Migrations)
	assert.Equal(t, challenges, sc.sec.challenges.Load())
	assert.Positive(t, st.DuplicateDatagrams)
	assert.Zero(t, st.InvalidDatagrams)
	assert.Equal(t, oldIn, r.oldReceived(), "the server sent to the old address")
	assert.Zero(t, l.Stats().StrayDatagrams+l.Stats().InvalidDatagrams)
	require.NoError(t, c.Close())
}

// TestSecureMigrationChallengesLost: the first path challenges to the new
// address are lost; the check goes on as long as the client sends from
// there (within the amplification limit), and the connection moves. A cap
// on the challenges once stranded such a connection: everything went to
// the old address, which the NAT had forgotten.
func TestSecureMigrationChallengesLost(t *testing.T) {
	t.Parallel()
	scfg, ccfg := secureConfigs(t)
	_, r, c, sc := behindNAT(t, scfg, ccfg)
	echoBoth(t, c, 1)

	r.rebind()
	r.mu.Lock()
	r.dropIn = 6 // before the move only challenges go there
	r.mu.Unlock()
	const n = 20
	for i := range n {
		require.NoError(t, c.Send(Message{ID: 7, Payload: []byte{byte(i)}, Reliable: true, InOrder: true}))
	}
	for i := range n {
		got, err := c.Receive(within(t, 20*time.Second))
		require.NoError(t, err, "message %d", i)
		require.Equal(t, []byte{byte(i)}, got.Payload, "reliable messages lost or out of order")
	}
	r.mu.Lock()
	dropped := r.dropped
	r.mu.Unlock()
	assert.Equal(t, 6, dropped)
	// One more round trip: the server's round that moved it published
	// its Stats before it took this message.
	echoOnce(t, c, Message{ID: 6, Payload: []byte("after"), Reliable: true})
	assert.Equal(t, uint64(1), sc.Stats().Migrations)
	assert.Equal(t, r.outerAddr(), sc.RemoteAddr().String())
	assert.Greater(t, sc.sec.challenges.Load(), uint64(6))
}

// TestSecureMigrationQuietClient: the NAT rebinds while the client's
// last message is unacked and the client has nothing new to send: its
// resends (old packet numbers, which cannot start a migration) come from
// the new address, the server's answers go to the forgotten one. A
// probe timeout makes a secure client send a fresh datagram too (a
// ping), so that the server checks the new address at once rather than
// at the next keepalive.
func TestSecureMigrationQuietClient(t *testing.T) {
	scfg, ccfg := secureConfigs(t)
	ccfg.PingInterval = time.Minute // the keepalive would hide the wait
	scfg.PingInterval = time.Minute
	_, r, c, sc := behindNAT(t, scfg, ccfg)
	echoBoth(t, c, 1)

	spare := r.newOuter()
	r.mu.Lock()
	r.swapTo = spare
	r.mu.Unlock()
	require.NoError(t, c.Send(Message{ID: 7, Payload: []byte("last words"), Reliable: true}))
	got, err := c.Receive(within(t, 10*time.Second))
	require.NoError(t, err)
	require.Equal(t, "last words", string(got.Payload))
	// One more round trip: the server's round that moved it published
	// its Stats before it took this message.
	echoOnce(t, c, Message{ID: 6, Payload: []byte("after"), Reliable: true})
	assert.Equal(t, uint64(1), sc.Stats().Migrations)
	assert.Equal(t, spare.LocalAddr().String(), sc.RemoteAddr().String())
}

// TestSecureMigrationUnderLoss: a rebinding in the middle of a stream
// over a lossy, reordering path (both ways): path checks and their
// answers get lost too, and every reliable message still arrives, in
// order, with the connection at the new address.
func TestSecureMigrationUnderLoss(t *testing.T) {
	t.Parallel()
	for seed := range uint64(4) {
		t.Run(fmt.Sprint(seed+1), func(t *testing.T) {
			scfg, ccfg := secureConfigs(t)
			for i, cfg := range []*Config{scfg, ccfg} {
				cfg.Simulate = &Simulation{Loss: 0.15, Duplicate: 0.02, Reorder: 0.1,
					ReorderDelay: 3 * time.Millisecond, Delay: time.Millisecond, Seed: 2*seed + uint64(i) + 1}
				cfg.ConnectTimeout = 10 * time.Second
			}
			_, r, c, sc := behindNAT(t, scfg, ccfg)
			const n = 60
			for i := range n {
				if i == n/3 {
					r.rebind()
				}
				require.NoError(t, c.Send(Message{ID: 7, Payload: []byte{byte(i)}, Reliable: true, InOrder: true}))
			}
			for i := range n {
				got, err := c.Receive(within(t, 20*time.Second))
				require.NoError(t, err, "message %d", i)
				require.Equal(t, []byte{byte(i)}, got.Payload, "reliable messages lost or out of order")
			}
			// A reliable round trip: the server's answers reach the
			// client (unreliable ones may be lost on this path; a lost
			// echo waits for the server's probe timeout, which a lossy
			// handshake may have left at its initial second).
			require.NoError(t, c.Send(Message{ID: 6, Payload: []byte("after"), Reliable: true}))
			got, err := c.Receive(within(t, 20*time.Second))
			require.NoError(t, err)
			require.Equal(t, "after", string(got.Payload))
			assert.Equal(t, r.outerAddr(), sc.RemoteAddr().String())
			assert.Equal(t, uint64(1), sc.Stats().Migrations)
		})
	}
}

func TestSecureMigrationAcrossSockets(t *testing.T) {
	// A listener with several sockets: the kernel spreads peers over them
	// by address, so a client that moved may reach another socket than
	// its connection's; it is found by its connection ID all the same.
	// Several moves in a row, each checked and counted.
	if runtime.GOOS != "linux" {
		t.Skip("Config.Sockets above 1 needs Linux")
	}
	scfg, ccfg := secureConfigs(t)
	scfg.Sockets = 4
	l, r, c, sc := behindNAT(t, scfg, ccfg)
	echoBoth(t, c, 0)
	const moves = 6
	for i := range moves {
		r.rebind()
		for j := range 5 {
			require.NoError(t, c.Send(Message{ID: 7, Payload: []byte{byte(i), byte(j)}, Reliable: true, InOrder: true}))
		}
		for j := range 5 {
			got, err := c.Receive(within(t, 10*time.Second))
			require.NoError(t, err)
			require.Equal(t, []byte{byte(i), byte(j)}, got.Payload)
		}
		require.Equal(t, r.outerAddr(), sc.RemoteAddr().String(), "move %d", i)
	}
	echoBoth(t, c, 1)
	assert.Equal(t, uint64(moves), sc.Stats().Migrations)
	assert.Equal(t, 1, l.Stats().Connections)
}

func TestSecureMigrationCopyFromElsewhere(t *testing.T) {
	// Copies of the client's datagrams, already delivered, sent from
	// another address (a spoofer replaying what it saw): dropped or
	// acked as duplicates to the real client; no path check, no move,
	// nothing sent to the spoofer.
	scfg, ccfg := secureConfigs(t)
	_, r, c, sc := behindNAT(t, scfg, ccfg)
	for i := range 5 {
		echoBoth(t, c, byte(i))
	}
	spoofer := loopbackSocket(t)
	sent := r.recorded()
	dups := sc.Stats().DuplicateDatagrams
	for _, b := range sent[1:] { // the ConnectSyn is no copy of interest
		_, err := spoofer.WriteToUDPAddrPort(b, r.server)
		require.NoError(t, err)
	}
	echoBoth(t, c, 50)
	echoBoth(t, c, 51)
	st := sc.Stats()
	assert.Equal(t, r.outerAddr(), sc.RemoteAddr().String())
	assert.Zero(t, st.Migrations)
	assert.Zero(t, sc.sec.challenges.Load())
	assert.GreaterOrEqual(t, st.DuplicateDatagrams-dups, uint64(len(sent)-2))
	mustNotReceive(t, spoofer)
}

func TestSecureMigrationForgedDropped(t *testing.T) {
	// From a new address: a datagram bearing the connection's ID that
	// does not authenticate (bit-flipped, truncated, another ID in its
	// place) is dropped and counted, and changes nothing; one bearing
	// no known ID is the listener's stray.
	scfg, ccfg := secureConfigs(t)
	l, r, c, sc := behindNAT(t, scfg, ccfg)
	echoBoth(t, c, 1)
	sent := r.recorded()
	real := sent[len(sent)-1] // sealed, the last one echoed
	id, ok := sealedCID(real)
	require.True(t, ok)
	require.Equal(t, sc.sec.cid, id)
	n := headerSize(real)

	forger := loopbackSocket(t)
	send := func(b []byte) {
		_, err := forger.WriteToUDPAddrPort(b, r.server)
		require.NoError(t, err)
	}
	// Under a PacketID the server has not seen (else the replay window
	// drops it before any decryption): the old body under a new header,
	// then with a bit flipped, or cut short.
	fresh := slices.Clone(real)
	v := uint32(fresh[0]) | uint32(fresh[1])<<8 | uint32(fresh[2])<<16
	v = v&^packetIDMask | (v+100)&packetIDMask
	fresh[0], fresh[1], fresh[2] = byte(v), byte(v>>8), byte(v>>16)
	forged := [][]byte{fresh, fresh[:len(fresh)-1]}
	for i := n + cidSize; i < len(fresh); i += 3 { // body and tag
		b := slices.Clone(fresh)
		b[i] ^= 0x01
		forged = append(forged, b)
	}
	for _, b := range forged {
		send(b)
	}
	stray := l.Stats().StrayDatagrams + l.Stats().InvalidDatagrams
	unknown := slices.Clone(real)
	binary.LittleEndian.PutUint32(unknown[n:], id+1)
	send(unknown)
	echoBoth(t, c, 2)
	echoBoth(t, c, 3)
	st := sc.Stats()
	assert.Equal(t, uint64(len(forged)), st.InvalidDatagrams)
	assert.Zero(t, st.Migrations)
	assert.Zero(t, sc.sec.challenges.Load())
	assert.Equal(t, r.outerAddr(), sc.RemoteAddr().String())
	assert.Equal(t, stray+1, l.Stats().StrayDatagrams+l.Stats().InvalidDatagrams)
	mustNotReceive(t, forger)
}

func TestSecureMigrationAmplificationBound(t *testing.T) {
	// An on-path attacker sends the client's next datagrams from a victim
	// instead (they authenticate, and are the newest): the victim gets
	// path challenges, at most 3x the bytes "it" sent, never the
	// connection's traffic, and the connection stays where it is.
	scfg, ccfg := secureConfigs(t)
	_, r, c, sc := behindNAT(t, scfg, ccfg)
	echoBoth(t, c, 1)
	victim := loopbackSocket(t)
	r.mu.Lock()
	r.divert, r.divertN = victim, 3
	before := len(r.sent)
	r.mu.Unlock()
	// Sent through the victim: the server takes them, acks and echoes
	// them to the client's real address.
	for i := range 3 {
		require.NoError(t, c.Send(Message{ID: 7, Payload: make([]byte, 10+i), Reliable: true}))
	}
	require.NoError(t, victim.SetReadDeadline(time.Now().Add(5*time.Second)))
	buf := make([]byte, 2048)
	got, _, err := victim.ReadFromUDPAddrPort(buf)
	require.NoError(t, err, "no path challenge came")
	assert.Equal(t, challengeSize, got)
	for range 3 {
		m, err := c.Receive(within(t, 5*time.Second))
		require.NoError(t, err)
		require.Equal(t, uint32(7), m.ID)
	}
	echoBoth(t, c, 2)
	r.mu.Lock()
	require.Zero(t, r.divertN)
	divertedBytes := 0
	for _, b := range r.sent[before : before+3] {
		divertedBytes += len(b)
	}
	r.mu.Unlock()
	n, _ := queued(t, victim)
	got += n
	assert.LessOrEqual(t, got, amplification*divertedBytes)
	assert.Equal(t, uint64(got/challengeSize), sc.sec.challenges.Load())
	assert.Zero(t, sc.Stats().Migrations)
	assert.Equal(t, r.outerAddr(), sc.RemoteAddr().String())
}

func TestSecurePathCheckBudget(t *testing.T) {
	// The amplification limit and the pace of PathChallenges.
	now := time.Unix(1000, 0)
	rto := 200 * time.Millisecond
	pc := pathCheck{in: 20}
	require.True(t, pc.due(now, rto))
	pc.out, pc.sends, pc.sentAt = challengeSize, 1, now
	assert.False(t, pc.due(now.Add(rto), rto), "60 bytes earned, 31 spent: no second one")
	pc.in += 20
	assert.False(t, pc.due(now.Add(rto/2), rto), "not before an RTO")
	assert.True(t, pc.due(now.Add(rto), rto))
	// The wait doubles, up to four RTOs; the number is not capped.
	pc = pathCheck{in: 1 << 20, sends: 2, sentAt: now}
	assert.False(t, pc.due(now.Add(2*rto-1), rto))
	assert.True(t, pc.due(now.Add(2*rto), rto))
	pc.sends = 50
	assert.False(t, pc.due(now.Add(4*rto-1), rto))
	assert.True(t, pc.due(now.Add(4*rto), rto))
	assert.Equal(t, 31, challengeSize)
}

// TestSecureMigrationNotHeldByAttempt: an attacker who knows where a
// client is moving to (or sends from there first) opens a secure attempt
// of its own from that address, a fresh ConnectSyn: the address is then
// the attempt's. The client's sealed datagrams from there still reach its
// connection (by their connection ID, which names another connection than
// the attempt), the connection moves there, and the attempt ends.
func TestSecureMigrationNotHeldByAttempt(t *testing.T) {
	scfg, ccfg := secureConfigs(t)
	l, r, c, sc := behindNAT(t, scfg, ccfg)
	echoBoth(t, c, 1)
	r.rebind()
	syn, _ := synDatagram(t, ccfg.ServerKey, nil, nil)
	r.mu.Lock()
	_, err := r.outer.WriteToUDPAddrPort(syn, r.server)
	r.mu.Unlock()
	require.NoError(t, err)
	// The attempt is made at the client's new address (its ConnectSynAck
	// goes on to the client, which drops it: not its handshake).
	var attempt *Conn
	for deadline := time.Now().Add(5 * time.Second); attempt == nil; runtime.Gosched() {
		require.True(t, time.Now().Before(deadline), "no attempt from the new address")
		l.mu.Lock()
		for a := range l.pending {
			attempt = a
		}
		l.mu.Unlock()
	}
	for i := range 5 {
		echoBoth(t, c, byte(10+i))
	}
	assert.Equal(t, r.outerAddr(), sc.RemoteAddr().String(), "moved to the client's new address")
	assert.Equal(t, uint64(1), sc.Stats().Migrations)
	// The attempt saw none of the client's datagrams, and ended when the
	// connection moved there (not at its ConnectTimeout).
	select {
	case <-attempt.Done():
	case <-within(t, 5*time.Second).Done():
		require.Fail(t, "the attempt at the client's address did not end")
	}
	assert.ErrorIs(t, attempt.Err(), net.ErrClosed)
	assert.Zero(t, attempt.Stats().InvalidDatagrams, "the client's datagrams went to the attempt")
}
