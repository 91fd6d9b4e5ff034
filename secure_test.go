package knet

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// tapRelay is a UDP relay between one client and a server that sees every
// datagram: it records them and lets a hook decide what goes on instead
// (nothing, a changed copy, the datagram twice...).
type tapRelay struct {
	pc, sc *net.UDPConn // facing the client; dialed to the server
	client atomic.Pointer[netip.AddrPort]
	// up and down, when set, return what to forward for a datagram
	// going to the server and to the client. Each runs on one goroutine.
	up, down func(b []byte) [][]byte

	mu       sync.Mutex
	wire     []byte // every datagram, both ways, back to back
	largest  int
	wg       sync.WaitGroup
	closeOne sync.Once
}

func newTapRelay(t *testing.T, server net.Addr, up, down func([]byte) [][]byte) *tapRelay {
	pc, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	sc, err := net.DialUDP("udp", nil, server.(*net.UDPAddr))
	require.NoError(t, err)
	r := &tapRelay{pc: pc, sc: sc, up: up, down: down}
	r.wg.Go(func() {
		buf := make([]byte, 65536)
		for {
			n, from, err := pc.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			r.client.Store(&from)
			for _, b := range r.pass(buf[:n], r.up) {
				sc.Write(b)
			}
		}
	})
	r.wg.Go(func() {
		buf := make([]byte, 65536)
		for {
			n, err := sc.Read(buf)
			if err != nil {
				if errors.Is(err, net.ErrClosed) {
					return
				}
				continue // an ICMP report
			}
			to := r.client.Load()
			for _, b := range r.pass(buf[:n], r.down) {
				pc.WriteToUDPAddrPort(b, *to)
			}
		}
	})
	t.Cleanup(r.close)
	return r
}

func (r *tapRelay) pass(b []byte, hook func([]byte) [][]byte) [][]byte {
	r.mu.Lock()
	r.wire = append(r.wire, b...)
	r.largest = max(r.largest, len(b))
	r.mu.Unlock()
	if hook == nil {
		return [][]byte{b}
	}
	return hook(append([]byte(nil), b...))
}

func (r *tapRelay) Addr() string { return r.pc.LocalAddr().String() }

func (r *tapRelay) close() {
	r.closeOne.Do(func() {
		r.pc.Close()
		r.sc.Close()
		r.wg.Wait()
	})
}

// secureConfigs returns a server's and a client's Config for one key.
func secureConfigs(t testing.TB) (server, client *Config) {
	priv, pub, err := GenerateKey()
	require.NoError(t, err)
	server, client = testConfig(), testConfig()
	server.PrivateKey = priv
	client.ServerKey = pub
	withLedger(t, server, client) // no nonce seals two plaintexts
	return server, client
}

// echoOnce sends m and waits for its echo.
func echoOnce(t *testing.T, c *Conn, m Message) Message {
	t.Helper()
	require.NoError(t, c.Send(m))
	got, err := c.Receive(within(t, 5*time.Second))
	require.NoError(t, err)
	return got
}

func TestSecureEchoNothingInClear(t *testing.T) {
	scfg, ccfg := secureConfigs(t)
	scfg.Admit = func(_ net.Addr, payload []byte) ([]byte, error) {
		if string(payload) != "SECRET-LOGIN-TOKEN" {
			return nil, fmt.Errorf("bad token %q", payload)
		}
		return []byte("SECRET-ADMIT-REPLY"), nil
	}
	ccfg.ConnectPayload = []byte("SECRET-LOGIN-TOKEN")
	l := listen(t, scfg)
	serveEcho(t, l)
	r := newTapRelay(t, l.Addr(), nil, nil)
	c := dial(t, r.Addr(), ccfg)
	require.True(t, c.Secure())
	syn, synAck := c.Handshake()
	assert.Equal(t, "SECRET-LOGIN-TOKEN", string(syn))
	assert.Equal(t, "SECRET-ADMIT-REPLY", string(synAck))

	secret := func(i, n int) []byte {
		return bytes.Repeat(fmt.Appendf(nil, "SECRET-PAYLOAD-%04d|", i), n)
	}
	for i := range 40 {
		m := Message{ID: 6, Payload: secret(i, 3), Reliable: i%2 == 0, InOrder: i%4 == 0}
		if i%2 == 1 {
			// Unreliable: the echo may not come on a real socket; a
			// reliable one follows to be sure.
			require.NoError(t, c.Send(m))
			continue
		}
		got := echoOnce(t, c, m)
		if !got.Reliable { // the unreliable echo came first
			got, _ = c.Receive(within(t, 5*time.Second))
		}
	}
	// A fragmented transfer, several datagrams long.
	big := secret(999, 800)
	require.NoError(t, c.Send(Message{ID: 7, Payload: big, Reliable: true}))
	for {
		got, err := c.Receive(within(t, 5*time.Second))
		require.NoError(t, err)
		if got.ID == 7 {
			assert.Equal(t, big, got.Payload)
			break
		}
	}
	require.NoError(t, c.Close())
	r.close()
	r.mu.Lock()
	defer r.mu.Unlock()
	assert.NotContains(t, string(r.wire), "SECRET", "application bytes crossed the wire in clear")
	assert.LessOrEqual(t, r.largest, defaultMaxPathDatagramSize, "sealing made a datagram larger than MaxPathDatagramSize")
	assert.Greater(t, len(r.wire), len(big), "the relay saw the traffic")
}

func TestSecureWrongServerKey(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		scfg, _ := secureConfigs(t)
		l := nw.listen(t, scfg)
		serveEcho(t, l)
		_, otherPub, err := GenerateKey()
		require.NoError(t, err)
		ccfg := testConfig()
		ccfg.ServerKey = otherPub
		_, err = nw.Dial(within(t, 5*time.Second), l.Addr().String(), ccfg)
		require.Error(t, err)
		assert.ErrorIs(t, err, ErrHandshakeFailed)
		assert.ErrorIs(t, err, ErrRefused)
		assert.Contains(t, err.Error(), "ServerKey")

		// A stealthy server says nothing: the attempt times out.
		scfg.Stealth = true
		l2 := nw.listen(t, scfg)
		ccfg.ConnectTimeout = 300 * time.Millisecond
		_, err = nw.Dial(within(t, 5*time.Second), l2.Addr().String(), ccfg)
		require.Error(t, err)
		var te *TimeoutError
		assert.ErrorAs(t, err, &te)
		assert.Positive(t, l2.Stats().RefusedAttempts)
	})
}

func TestSecureServerRefusesPlaintextClient(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		scfg, _ := secureConfigs(t)
		admitted := atomic.Bool{}
		scfg.Admit = func(net.Addr, []byte) ([]byte, error) { admitted.Store(true); return nil, nil }
		l := nw.listen(t, scfg)
		serveEcho(t, l)
		plain := testConfig()
		plain.ConnectPayload = bytes.Repeat([]byte{1}, 100) // as long as a handshake
		_, err := nw.Dial(within(t, 5*time.Second), l.Addr().String(), plain)
		require.Error(t, err)
		assert.ErrorIs(t, err, ErrRefused)
		assert.Contains(t, err.Error(), ErrHandshakeFailed.Error())
		assert.False(t, admitted.Load(), "Admit saw a plaintext attempt")

		// A reference-dialect peer is not served at all.
		ref := testConfig()
		ref.Dialect = DialectReference
		ref.ConnectTimeout = 300 * time.Millisecond
		_, err = nw.Dial(within(t, 5*time.Second), l.Addr().String(), ref)
		require.Error(t, err)
	})
}

func TestSecureClientRefusesPlaintextServer(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		// A server without the key admits the attempt (its Admit sees only
		// the Noise message) but cannot answer it: Dial fails.
		l := nw.listen(t, testConfig())
		serveEcho(t, l)
		_, ccfg := secureConfigs(t)
		_, err := nw.Dial(within(t, 5*time.Second), l.Addr().String(), ccfg)
		require.Error(t, err)
		assert.ErrorIs(t, err, ErrHandshakeFailed)
		assert.NotErrorIs(t, err, ErrRefused)
	})
}

func TestSecureConfigChecks(t *testing.T) {
	_, err := Listen("udp", "127.0.0.1:0", &Config{PrivateKey: []byte{1, 2, 3}})
	assert.Error(t, err)
	priv, pub, err := GenerateKey()
	require.NoError(t, err)
	assert.Len(t, priv, KeySize)
	assert.Len(t, pub, KeySize)
	_, err = Listen("udp", "127.0.0.1:0", &Config{PrivateKey: priv, Dialect: DialectReference})
	assert.ErrorIs(t, err, errSecureCpp)
	_, err = Dial(context.Background(), "udp", "127.0.0.1:9", &Config{ServerKey: pub[:5]})
	assert.Error(t, err)
	ccfg := &Config{ServerKey: pub, ConnectPayload: make([]byte, defaultMaxDatagramSize)}
	_, err = Dial(context.Background(), "udp", "127.0.0.1:9", ccfg)
	assert.ErrorIs(t, err, ErrHandshakeTooLarge)

	// A plaintext connection says so.
	l := listen(t, testConfig())
	serveEcho(t, l)
	c := dial(t, l.Addr().String(), testConfig())
	assert.False(t, c.Secure())
}

func TestSecureBitFlipsDropped(t *testing.T) {
	t.Parallel()
	// Once open, every fifth datagram each way has one bit flipped,
	// header or sealed part: each is dropped and counted, and the
	// connection carries everything reliable on.
	scfg, ccfg := secureConfigs(t)
	l := listen(t, scfg)
	var flipping atomic.Bool
	flipper := func() func([]byte) [][]byte {
		n := 0
		return func(b []byte) [][]byte {
			if flipping.Load() {
				if n++; n%5 == 0 {
					i := (n / 5) % len(b)
					b[i] ^= 1 << (n % 8)
				}
			}
			return [][]byte{b}
		}
	}
	r := newTapRelay(t, l.Addr(), flipper(), flipper())
	c := dial(t, r.Addr(), ccfg)
	sc := serverConn(t, l)
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			m, err := sc.Receive(context.Background())
			if err != nil || sc.Send(m) != nil {
				return
			}
		}
	})
	t.Cleanup(func() { sc.Close(); wg.Wait() })
	flipping.Store(true)
	for i := range 100 {
		p := fmt.Appendf(nil, "message %d", i)
		got := echoOnce(t, c, Message{ID: 6, Payload: p, Reliable: true, InOrder: true})
		require.Equal(t, p, got.Payload)
	}
	require.NoError(t, c.Err())
	assert.Positive(t, c.Stats().InvalidDatagrams, "the client dropped none")
	assert.Positive(t, sc.Stats().InvalidDatagrams, "the server dropped none")
	assert.True(t, sc.Secure())
}

func TestSecureReplayDropped(t *testing.T) {
	// Every datagram from the client reaches the server twice, the
	// second time after the next one: an unreliable message is delivered
	// once, a reliable one once (its copy acked again).
	scfg, ccfg := secureConfigs(t)
	l := listen(t, scfg)
	var replaying atomic.Bool
	var last []byte
	up := func(b []byte) [][]byte {
		if !replaying.Load() {
			return [][]byte{b}
		}
		out := [][]byte{b}
		if last != nil {
			out = append(out, last)
		}
		last = b
		return out
	}
	r := newTapRelay(t, l.Addr(), up, nil)
	c := dial(t, r.Addr(), ccfg)
	sc := serverConn(t, l)
	replaying.Store(true)
	const n = 30
	for i := range n {
		require.NoError(t, c.Send(Message{ID: 6, Payload: []byte{byte(i)}, Reliable: i%2 == 0}))
		if i%2 == 0 {
			got, err := sc.Receive(within(t, 5*time.Second))
			require.NoError(t, err)
			for !got.Reliable { // an unreliable one before it
				got, err = sc.Receive(within(t, 5*time.Second))
				require.NoError(t, err)
			}
			require.Equal(t, []byte{byte(i)}, got.Payload, "a reliable message came twice or out of turn")
		}
	}
	// Flush the last copy with a final reliable message.
	require.NoError(t, c.Send(Message{ID: 7, Reliable: true}))
	seen := map[byte]int{}
	for {
		got, err := sc.Receive(within(t, 5*time.Second))
		require.NoError(t, err)
		if got.ID == 7 {
			break
		}
		seen[got.Payload[0]]++
	}
	for k, v := range seen {
		assert.Equal(t, 1, v, "unreliable message %d delivered %d times", k, v)
	}
	assert.Positive(t, sc.Stats().DuplicateDatagrams)
	assert.Zero(t, sc.Stats().InvalidDatagrams)
}

func TestSecureUnderLoss(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		// The handshake and the retransmissions (each the same bytes under
		// the same packet number) survive loss, duplication and reordering.
		scfg, ccfg := secureConfigs(t)
		sim := func(seed uint64) *Simulation {
			return &Simulation{Loss: 0.2, Duplicate: 0.05, Reorder: 0.1, ReorderDelay: 3 * time.Millisecond, Seed: seed}
		}
		scfg.Simulate, ccfg.Simulate = sim(1), sim(2)
		scfg.DatagramTimeout, ccfg.DatagramTimeout = 100*time.Millisecond, 100*time.Millisecond
		ccfg.ConnectTimeout = 10 * time.Second
		l := nw.listen(t, scfg)
		serveEcho(t, l)
		c := nw.dial(t, l.Addr().String(), ccfg)
		payload := bytes.Repeat([]byte("x"), 3000)
		for i := range 10 {
			require.NoError(t, c.Send(Message{ID: 6, Payload: payload, Reliable: true, InOrder: true}), i)
		}
		for range 10 {
			got, err := c.Receive(within(t, 20*time.Second))
			require.NoError(t, err)
			require.Equal(t, payload, got.Payload)
		}
		assert.Positive(t, c.Stats().Retransmits)
	})
}

// securePair returns the two ends' secure states after a handshake run
// directly.
func securePair(t testing.TB) (client, server *secureState) {
	priv, pub, err := GenerateKey()
	require.NoError(t, err)
	client, syn, err := newClientSecure(pub, []byte("token"), []byte("hello"))
	require.NoError(t, err)
	server, err = newServerSecure(priv, mustPublic(t, priv))
	require.NoError(t, err)
	cookie, msg1, ok := splitSecureSyn(syn)
	require.True(t, ok)
	require.Empty(t, cookie)
	got, err := server.readSyn(msg1)
	require.NoError(t, err)
	token, payload, ok := splitSynPayload(got)
	require.True(t, ok)
	require.Equal(t, "token", string(token))
	require.Equal(t, "hello", string(payload))
	server.cid = 0x04030201
	msg2, err := server.writeSynAck([]byte("welcome"))
	require.NoError(t, err)
	reply, err := client.readSynAck(msg2)
	require.NoError(t, err)
	require.Equal(t, "welcome", string(reply))
	require.Equal(t, server.cid, client.cid)
	return client, server
}

func mustPublic(t testing.TB, priv []byte) []byte {
	pub, err := publicKeyOf(priv)
	require.NoError(t, err)
	return pub
}

// plainDatagram is a well-formed datagram with PacketID pid.
func plainDatagram(pid uint32, reliable bool, payload []byte) []byte {
	b := appendHeader(nil, &header{packetID: pid, reliable: reliable})
	return appendMessage(b, &message{id: 6, payload: payload})
}

func TestSecureSealOpen(t *testing.T) {
	c, s := securePair(t)
	d := plainDatagram(0, true, []byte("abc"))
	sealed, err := c.seal(nil, d, 0, true)
	require.NoError(t, err)
	assert.Len(t, sealed, len(d)+cidSize+sealOverhead)
	assert.Equal(t, d[:3], sealed[:3], "the header is in clear")
	assert.Equal(t, []byte{1, 2, 3, 4}, sealed[3:7], "the connection ID follows it")
	id, ok := sealedCID(sealed)
	assert.True(t, ok)
	assert.Equal(t, s.cid, id)
	// A resend of the same datagram is the same bytes: nothing new is
	// revealed, the nonce is used for one plaintext only.
	again, err := c.seal(nil, d, 0, false)
	require.NoError(t, err)
	assert.Equal(t, sealed, again)

	got, fresh := s.open(append([]byte(nil), sealed...))
	require.Equal(t, d, got)
	assert.True(t, fresh)
	// A reliable one again passes (it is acked again), but not as
	// fresh; an unreliable one again does not pass.
	got, fresh = s.open(append([]byte(nil), sealed...))
	assert.NotNil(t, got)
	assert.False(t, fresh)
	u, err := c.seal(nil, plainDatagram(1, false, []byte("u")), 1, true)
	require.NoError(t, err)
	assert.NotNil(t, opened(s, append([]byte(nil), u...)))
	assert.Nil(t, opened(s, append([]byte(nil), u...)))
	assert.Equal(t, uint64(1), s.replays)

	// Any change to the header or the rest fails.
	for i := range sealed {
		b := append([]byte(nil), sealed...)
		b[i] ^= 0x10
		before := s.replay
		assert.Nil(t, opened(s, b), "byte %d changed", i)
		assert.Equal(t, before, s.replay)
	}
	assert.Equal(t, uint64(len(sealed)), s.invalid)
	// The other direction has its own key: our own datagram does not
	// open as the peer's.
	assert.Nil(t, opened(c, append([]byte(nil), sealed...)))
	// In-place sealing, as for the datagrams built in a write batch.
	buf := make([]byte, 0, 64)
	buf = append(buf, plainDatagram(2, false, []byte("in place"))...)
	out, err := c.seal(buf, buf, 2, true)
	require.NoError(t, err)
	assert.Equal(t, &buf[:1][0], &out[0])
	assert.Equal(t, "in place", string(opened(s, out)[3+3:]))
	// The server's datagrams carry no ID, sealed in place or not.
	back := plainDatagram(0, true, []byte("down"))
	sealed, err = s.seal(nil, back, 0, true)
	require.NoError(t, err)
	assert.Len(t, sealed, len(back)+sealOverhead)
	buf = append(make([]byte, 0, 64), back...)
	out, err = s.seal(buf, buf, 0, false)
	require.NoError(t, err)
	assert.Equal(t, sealed, out)
	assert.Equal(t, back, opened(c, out))
}

// opened is what open returns of b, fresh or not.
func opened(s *secureState, b []byte) []byte {
	pt, _ := s.open(b)
	return pt
}

// TestSecureSealRefusesNonceReuse: a packet number is sealed once as new,
// and sent again only as what it was; a new one must be above every
// number sealed before, and must be the datagram's PacketID. Anything
// else is refused before sealing (the connection then ends).
func TestSecureSealRefusesNonceReuse(t *testing.T) {
	c, _ := securePair(t)
	_, err := c.seal(nil, plainDatagram(5, false, nil), 5, false)
	assert.ErrorIs(t, err, errNonceReuse, "sent again, never sealed")
	_, err = c.seal(nil, plainDatagram(5, true, []byte("a")), 5, true)
	require.NoError(t, err)
	_, err = c.seal(nil, plainDatagram(5, true, []byte("b")), 5, true)
	assert.ErrorIs(t, err, errNonceReuse, "a new datagram under a number sealed")
	_, err = c.seal(nil, plainDatagram(4, true, nil), 4, true)
	assert.ErrorIs(t, err, errNonceReuse, "a new datagram under an older number")
	_, err = c.seal(nil, plainDatagram(6, true, nil), 7, true)
	assert.ErrorIs(t, err, errNonceReuse, "a number that is not the PacketID's")
	_, err = c.seal(nil, plainDatagram(9, true, nil), 9, false)
	assert.ErrorIs(t, err, errNonceReuse, "sent again above every number sealed")
	// The next cycle of PacketIDs: the same PacketID, a new number.
	_, err = c.seal(nil, plainDatagram(5, true, []byte("c")), pnWindow+5, true)
	assert.NoError(t, err)
	_, err = c.seal(nil, plainDatagram(5, true, []byte("a")), 5, false)
	assert.NoError(t, err, "an old one sent again keeps its number")
}

func TestSecureOldReplayDropped(t *testing.T) {
	c, s := securePair(t)
	first, err := c.seal(nil, plainDatagram(0, true, nil), 0, true)
	require.NoError(t, err)
	require.NotNil(t, opened(s, append([]byte(nil), first...)))
	// recvSpan datagrams later, the first is out of the window.
	for pid := uint32(1); pid <= recvSpan; pid += 1000 {
		b, err := c.seal(nil, plainDatagram(pid, false, nil), uint64(pid), true)
		require.NoError(t, err)
		require.NotNil(t, opened(s, b))
	}
	last, err := c.seal(nil, plainDatagram(recvSpan, false, nil), recvSpan, true)
	require.NoError(t, err)
	require.NotNil(t, opened(s, last))
	assert.Nil(t, opened(s, append([]byte(nil), first...)))
}

func TestSecurePacketNumbersAcrossWrap(t *testing.T) {
	// A long connection: PacketIDs wrap every 2^22 datagrams, the packet
	// numbers go on, so do nonces, and the receiver follows, even
	// with datagrams lost and resent out of order.
	c, s := securePair(t)
	pn := uint64(0)
	for pn < 3*pnWindow {
		pid := uint32(pn & packetIDMask)
		b, err := c.seal(nil, plainDatagram(pid, true, nil), pn, true)
		require.NoError(t, err)
		require.Equal(t, pn, c.sendTop)
		require.NotNil(t, opened(s, b), "packet number %d", pn)
		require.Equal(t, pn, s.replay.top)
		pn += 40000 // more than the window, less than half the PacketIDs
	}
	assert.Equal(t, uint64(1000), expandPacketNumber(1000, 0))
	assert.Equal(t, uint64(pnWindow+5), expandPacketNumber(5, pnWindow-10))
	assert.Equal(t, uint64(pnWindow-10), expandPacketNumber(pnWindow-10, pnWindow+5))
	assert.Equal(t, uint64(2*pnWindow-1), expandPacketNumber(packetIDMask, 2*pnWindow+100))
}

func TestSecureNoAllocation(t *testing.T) {
	c, s := securePair(t)
	d := plainDatagram(0, true, make([]byte, 1200))
	out := make([]byte, 0, 1400)
	in := make([]byte, 0, 1400)
	pid := uint32(0)
	allocs := testing.AllocsPerRun(100, func() {
		pid++
		d[0], d[1], d[2] = byte(pid), byte(pid>>8), byte(pid>>16)|0x40
		b, _ := c.seal(out, d, uint64(pid), true)
		in = append(in[:0], b...)
		if pt, _ := s.open(in); pt == nil {
			panic("did not open")
		}
	})
	assert.Zero(t, allocs)
}

func BenchmarkSecureSealOpen1200(b *testing.B) {
	c, s := securePair(b)
	d := plainDatagram(0, true, make([]byte, 1200))
	out := make([]byte, 0, 1400)
	b.SetBytes(int64(len(d)))
	pid := uint32(0)
	for b.Loop() {
		pid++
		d[0], d[1], d[2] = byte(pid), byte(pid>>8), byte(pid>>16)&0x3f|0x40
		sealed, _ := c.seal(out, d, uint64(pid), true)
		if pt, _ := s.open(sealed); pt == nil {
			b.Fatal("did not open")
		}
	}
}

// FuzzSecureOpen feeds the secure receive path anything: it never panics,
// and what fails authentication changes nothing.
func FuzzSecureOpen(f *testing.F) {
	c, s0 := securePair(f)
	for i, rel := range []bool{true, false} {
		b, err := c.seal(nil, plainDatagram(uint32(i), rel, []byte("seed")), uint64(i), true)
		require.NoError(f, err)
		f.Add(b)
	}
	f.Add([]byte{0, 0, 0x80, 2, 1, 1})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		s := &secureState{recv: s0.recv, cid: s0.cid}
		before := s.replay
		if pt, _ := s.open(b); pt == nil {
			if before != s.replay {
				t.Fatal("a dropped datagram changed the replay window")
			}
		}
	})
}

func TestHeaderSize(t *testing.T) {
	for _, h := range []header{
		{packetID: 5},
		{packetID: 7, reliable: true, inOrder: true},
		{packetID: 9, inOrder: true, deltas: []uint16{1, 300}, indices: []uint16{0, 200}},
	} {
		b := appendHeader(nil, &h)
		assert.Equal(t, len(b), headerSize(append(b, 1, 2, 3)))
		assert.Equal(t, -1, headerSize(b[:len(b)-1]))
	}
}

// FuzzSealedCID: the listener's look at a datagram from an unknown
// address never panics, and finds the header where parseHeader does.
func FuzzSealedCID(f *testing.F) {
	c, _ := securePair(f)
	for i, d := range [][]byte{plainDatagram(3, true, []byte("x")), appendHeader(nil, &header{packetID: 4, inOrder: true, deltas: []uint16{200}, indices: []uint16{1}})} {
		b, err := c.seal(nil, d, uint64(3+i), true)
		require.NoError(f, err)
		f.Add(b)
	}
	f.Add([]byte{0, 0, 0x80, 3, 0x81})
	f.Fuzz(func(t *testing.T, b []byte) {
		var h header
		n, err := parseHeader(b, &h)
		if err != nil {
			n = -1
		}
		if got := headerSize(b); got != n {
			t.Fatalf("headerSize %d, parseHeader %d", got, n)
		}
		if _, ok := sealedCID(b); ok != (n >= 0 && len(b)-n >= cidSize+sealOverhead) {
			t.Fatal("sealedCID disagrees")
		}
	})
}

// TestSecureGroup: a secure listener serving its connections through a
// Group: the events are those of a plaintext one, the messages in clear
// to the game loop, and the connection secure.
func TestSecureGroup(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		scfg, ccfg := secureConfigs(t)
		g := NewGroup()
		scfg.Group = g
		l := nw.listen(t, scfg)
		c := nw.dial(t, l.Addr().String(), ccfg)
		const msgs = 20
		for i := range msgs {
			require.NoError(t, c.Send(Message{ID: 100, Reliable: true, InOrder: true, Payload: []byte{byte(i)}}))
		}
		events := make([]Event, 8)
		ctx := within(t, 10*time.Second)
		next := 0
		var sc *Conn
		for next < msgs {
			require.NoError(t, g.Wait(ctx))
			for _, e := range events[:g.Poll(events)] {
				switch e.Kind {
				case EventConnected:
					require.Nil(t, sc, "connected twice")
					sc = e.Conn
					assert.True(t, sc.Secure())
				case EventMessage:
					require.Same(t, sc, e.Conn)
					require.Equal(t, []byte{byte(next)}, e.Message.Payload)
					next++
				}
			}
		}
		require.NoError(t, sc.Send(Message{ID: 101, Reliable: true, Payload: []byte("from the loop")}))
		got, err := c.Receive(within(t, 5*time.Second))
		require.NoError(t, err)
		assert.Equal(t, "from the loop", string(got.Payload))
	})
}

// TestSecureListenerAnswersNoClearDisconnect: a listener answers a stray
// Disconnect statelessly, for a peer whose DisconnectAck was lost; a
// secure listener's peers seal theirs, so one in clear is nobody's and
// gets no answer. The refusal of a later ConnectSyn from the same socket
// (a plaintext one: "secure handshake failed") shows the listener read
// the Disconnect before it.
func TestSecureListenerAnswersNoClearDisconnect(t *testing.T) {
	for _, secure := range []bool{false, true} {
		t.Run(fmt.Sprint("secure=", secure), func(t *testing.T) {
			scfg, _ := secureConfigs(t)
			if !secure {
				scfg.PrivateKey = nil
			}
			l := listen(t, scfg)
			if !secure {
				l.SetListenOpen(false) // a plaintext listener refuses the ConnectSyn then
			}
			c, err := net.DialUDP("udp", nil, l.Addr().(*net.UDPAddr))
			require.NoError(t, err)
			defer c.Close()
			c.Write(clearDatagram(7, false, message{id: idDisconnect}))
			// No secure ConnectSyn, padded to earn the refusal's reason.
			c.Write(clearDatagram(8, false, message{id: idConnectSyn, payload: []byte{1, 2, 3}}, message{id: idPadding, payload: make([]byte, 200)}))
			buf := make([]byte, 2048)
			c.SetReadDeadline(time.Now().Add(5 * time.Second))
			n, err := c.Read(buf)
			require.NoError(t, err)
			_, content, ok := handshakeContent(buf[:n], idDisconnectAck)
			require.True(t, ok, "a DisconnectAck")
			if secure {
				assert.Equal(t, ErrHandshakeFailed.Error(), string(content), "the refusal, not an answer to the Disconnect")
			} else {
				assert.Empty(t, content, "the stateless answer to the Disconnect comes first")
			}
		})
	}
}

// TestSecureRacedSynStillConnects: someone who sees a client's first
// ConnectSyn sends a copy from its own address that reaches the server
// first, and (actively) drops the client's, or (passively) lets it follow.
// The copy's connection cannot open (its ConnectSynAck is readable only
// by the client), and the client's own ConnectSyn, the same handshake
// message, costs no second key exchange: it goes to that connection,
// which answers it where the client is; the client opens the connection
// from there, and after a path check has moved it to the client it is
// offered to Accept. The attacker gets no more bytes than it sent, and one
// connection is made.
func TestSecureRacedSynStillConnects(t *testing.T) {
	t.Parallel()
	for _, drop := range []bool{false, true} {
		t.Run(fmt.Sprint("drop=", drop), func(t *testing.T) {
			scfg, ccfg := secureConfigs(t)
			l := listen(t, scfg)
			attacker, err := net.DialUDP("udp", nil, l.Addr().(*net.UDPAddr))
			require.NoError(t, err)
			defer attacker.Close()
			var sent atomic.Int64
			var raced atomic.Bool
			r := newTapRelay(t, l.Addr(), func(b []byte) [][]byte {
				if _, _, syn := handshakeContent(b, idConnectSyn); syn && !raced.Load() {
					raced.Store(true)
					attacker.Write(b)
					sent.Add(int64(len(b)))
					if drop {
						return nil
					}
				}
				return [][]byte{b}
			}, nil)
			ctx := within(t, 10*time.Second)
			c, err := sysNet().Dial(ctx, r.Addr(), ccfg)
			require.NoError(t, err)
			defer c.Close()
			sc, err := l.AcceptConn(ctx)
			require.NoError(t, err)
			// Offered once at the client's address (the path check that
			// moved it there is no migration of an established one).
			assert.Equal(t, r.sc.LocalAddr().String(), sc.RemoteAddr().String())
			go echoServer(t, sc)
			echoOnce(t, c, Message{ID: 100, Payload: []byte("after"), Reliable: true})
			assert.True(t, raced.Load())
			assert.Equal(t, 1, l.Stats().Connections)
			assert.Zero(t, sc.Stats().Migrations)
			// What the attacker's address got: at most what it sent.
			got, _ := queued(t, attacker)
			assert.LessOrEqual(t, int64(got), sent.Load())
			assert.Positive(t, got, "the copy got its ConnectSynAck")
		})
	}
}
