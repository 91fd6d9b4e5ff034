package knet

import (
	"bytes"
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"runtime"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestCookieCheck(t *testing.T) {
	j := newCookieJar()
	addr := netip.MustParseAddrPort("192.0.2.1:5000")
	msg1 := bytes.Repeat([]byte{7}, 100)
	now := time.Unix(1_700_000_000, 0)
	c := j.appendCookie(nil, addr, msg1, now)
	require.Len(t, c, cookieSize)
	assert.True(t, j.check(c, addr, msg1, now))
	assert.True(t, j.check(c, addr, msg1, now.Add(cookieLifetime)))
	assert.True(t, j.check(c, netip.MustParseAddrPort("[::ffff:192.0.2.1]:5000"), msg1, now), "a dual-stack socket's form of the address")
	assert.False(t, j.check(c, addr, msg1, now.Add(cookieLifetime+time.Second)), "stale")
	assert.False(t, j.check(c, addr, msg1, now.Add(-2*time.Second)), "from the future")
	assert.False(t, j.check(c, netip.MustParseAddrPort("192.0.2.2:5000"), msg1, now), "another address")
	assert.False(t, j.check(c, netip.MustParseAddrPort("192.0.2.1:5001"), msg1, now), "another port")
	assert.False(t, j.check(c, addr, msg1[1:], now), "another handshake")
	assert.False(t, newCookieJar().check(c, addr, msg1, now), "another listener")
	for i := range c {
		f := bytes.Clone(c)
		f[i] ^= 1
		assert.False(t, j.check(f, addr, msg1, now), "byte %d", i)
	}
	assert.False(t, j.check(c[:cookieSize-1], addr, msg1, now))
	assert.False(t, j.check(nil, addr, msg1, now))

	// Answering a flood allocates nothing.
	if !raceEnabled {
		var buf [64]byte
		allocs := testing.AllocsPerRun(100, func() {
			appendRetry(buf[:0], j.appendCookie(buf[32:32], addr, msg1, now))
			j.check(c, addr, msg1, now)
		})
		assert.Zero(t, allocs)
	}

	// The Retry datagram: 30 bytes, MessageID 0.
	r := appendRetry(nil, c)
	assert.Len(t, r, 30)
	assert.Equal(t, "000000", fmt.Sprintf("%x", r[:3]))
	found, valid := holds(r, idRetry)
	assert.True(t, found && valid)
}

func TestSecureSynLayout(t *testing.T) {
	msg1 := bytes.Repeat([]byte{9}, noiseOverhead)
	cookie := bytes.Repeat([]byte{1}, cookieSize)
	for _, ck := range [][]byte{nil, cookie} {
		b := appendSecureSyn(nil, ck, msg1)
		gc, gm, ok := splitSecureSyn(b)
		require.True(t, ok)
		assert.Equal(t, len(ck), len(gc))
		assert.Equal(t, msg1, gm)
	}
	for _, bad := range [][]byte{nil, {0}, append([]byte{5}, msg1...), append([]byte{cookieSize}, msg1...)} {
		_, _, ok := splitSecureSyn(bad)
		assert.False(t, ok, "%x", bad)
	}
	tok, p, ok := splitSynPayload(appendSynPayload(nil, []byte("tok"), []byte("pay")))
	require.True(t, ok)
	assert.Equal(t, "tok", string(tok))
	assert.Equal(t, "pay", string(p))
	_, _, ok = splitSynPayload([]byte{5, 0, 1})
	assert.False(t, ok)
}

// synDatagram is a secure client's ConnectSyn for the server key pub, with
// token and cookie, padded as Dial pads it; also its Noise message.
func synDatagram(t *testing.T, pub, token, cookie []byte) (d, msg1 []byte) {
	_, syn, err := newClientSecure(pub, token, nil)
	require.NoError(t, err)
	_, msg1, _ = splitSecureSyn(syn)
	syn = appendSecureSyn(nil, cookie, msg1)
	d = appendHeader(nil, &header{})
	d = appendMessage(d, &message{id: idConnectSyn, payload: syn})
	return appendPadding(d, synPadTo), msg1
}

// flooder is a source of ConnectSyns that never answers what it gets: it
// only reads it, to count it.
type flooder struct {
	pc   *net.UDPConn
	addr netip.AddrPort
}

func newFlooder(t *testing.T, server net.Addr) *flooder {
	pc, err := net.DialUDP("udp", nil, server.(*net.UDPAddr))
	require.NoError(t, err)
	t.Cleanup(func() { pc.Close() })
	return &flooder{pc: pc, addr: addrPort(t, pc.LocalAddr())}
}

// send sends d and returns the answer, which must come.
func (f *flooder) send(t *testing.T, d []byte) []byte {
	t.Helper()
	_, err := f.pc.Write(d)
	require.NoError(t, err)
	f.pc.SetReadDeadline(time.Now().Add(5 * time.Second)) // a bound, not a wait
	buf := make([]byte, 2048)
	n, err := f.pc.Read(buf)
	require.NoError(t, err, "no answer")
	return buf[:n]
}

func isRetry(b []byte) bool { ok, _ := holds(b, idRetry); return ok }

func TestCookieRoundRealClient(t *testing.T) {
	scfg, ccfg := secureConfigs(t)
	scfg.CookieThreshold = -1 // always
	l := listen(t, scfg)
	serveEcho(t, l)
	c := dial(t, l.Addr().String(), ccfg)
	require.True(t, c.Secure())
	m := echoOnce(t, c, Message{ID: 6, Payload: []byte("after a cookie"), Reliable: true})
	assert.Equal(t, "after a cookie", string(m.Payload))
	assert.Equal(t, 1, c.sec.retries, "the client went through one cookie round")
	assert.Equal(t, uint64(1), l.Stats().CookiesSent)
}

func TestSpoofedFloodCostsNoState(t *testing.T) {
	// Every attempt is asked for a cookie: ConnectSyns from 32 addresses
	// that never echo one, or echo a forged, stale or someone else's
	// cookie, cost the listener nothing and get back less than they sent.
	scfg, ccfg := secureConfigs(t)
	scfg.CookieThreshold = -1
	var admitted atomic.Int32
	scfg.Admit = func(net.Addr, []byte) ([]byte, error) { admitted.Add(1); return nil, nil }
	l := listen(t, scfg)
	serveEcho(t, l)
	const flooders = 32
	fs := make([]*flooder, flooders)
	for i := range fs {
		fs[i] = newFlooder(t, l.Addr())
	}
	var in, out, n uint64
	for i, f := range fs {
		for kind := range 4 {
			var cookie []byte
			d, msg1 := synDatagram(t, ccfg.ServerKey, nil, nil)
			switch kind {
			case 1: // forged
				cookie = make([]byte, cookieSize)
				rand.Read(cookie)
			case 2: // stale
				cookie = l.cookies.appendCookie(nil, f.addr, msg1, time.Now().Add(-time.Minute))
			case 3: // another address's
				cookie = l.cookies.appendCookie(nil, fs[(i+1)%flooders].addr, msg1, time.Now())
			}
			if cookie != nil {
				d = rebuildSyn(cookie, msg1)
			}
			r := f.send(t, d)
			require.True(t, isRetry(r), "kind %d: not a cookie", kind)
			require.LessOrEqual(t, len(r), len(d))
			in += uint64(len(d))
			out += uint64(len(r))
			n++
		}
	}
	st := l.Stats()
	assert.Zero(t, st.Connections)
	assert.Zero(t, st.Pending)
	assert.Zero(t, st.RefusedAttempts)
	assert.Equal(t, n, st.CookiesSent)
	assert.Equal(t, in, l.unprovenIn.Load())
	assert.Equal(t, out, l.unprovenOut.Load(), "the listener sent more than the flooders got")
	assert.LessOrEqual(t, out*30, in, "a cookie reply is 30 bytes for a 1200-byte ConnectSyn")

	// A real client still connects, through the cookie round.
	c := dial(t, l.Addr().String(), ccfg)
	echoOnce(t, c, Message{ID: 6, Payload: []byte("x"), Reliable: true})
	assert.Equal(t, int32(1), admitted.Load())
}

// rebuildSyn is the ConnectSyn datagram echoing cookie with msg1.
func rebuildSyn(cookie, msg1 []byte) []byte {
	d := appendHeader(nil, &header{})
	d = appendMessage(d, &message{id: idConnectSyn, payload: appendSecureSyn(nil, cookie, msg1)})
	return appendPadding(d, synPadTo)
}

func TestFloodPastThreshold(t *testing.T) {
	// Threshold 4: the first four addresses get a pending connection
	// each (their handshakes are valid; they never finish them), the
	// others a cookie; a real client connects through a cookie round.
	scfg, ccfg := secureConfigs(t)
	scfg.CookieThreshold = 4
	l := listen(t, scfg)
	serveEcho(t, l)
	synAcks, retries := 0, 0
	for range 32 {
		f := newFlooder(t, l.Addr())
		d, _ := synDatagram(t, ccfg.ServerKey, nil, nil)
		r := f.send(t, d)
		require.LessOrEqual(t, len(r), len(d))
		switch {
		case isRetry(r):
			retries++
		default:
			ok, _ := holds(r, idConnectSynAck)
			require.True(t, ok, "neither a cookie nor a ConnectSynAck")
			synAcks++
		}
	}
	assert.Equal(t, 4, synAcks)
	assert.Equal(t, 28, retries)
	st := l.Stats()
	assert.Equal(t, 4, st.Pending)
	assert.Equal(t, 4, st.Connections)
	assert.Equal(t, uint64(28), st.CookiesSent)

	c := dial(t, l.Addr().String(), ccfg)
	echoOnce(t, c, Message{ID: 6, Payload: []byte("x"), Reliable: true})
	assert.Equal(t, 1, c.sec.retries)
}

func TestFloodOfBadTokensPastThreshold(t *testing.T) {
	// Valid handshakes with worthless tokens leave no connection, but
	// each costs a key exchange: once four failed, the listener asks
	// for cookies instead, and computes nothing more for the flood.
	l, key, ccfg, admitted := tokenServer(t, func(c *Config) { c.CookieThreshold = 4 })
	start := time.Now()
	refusals, retries := 0, 0
	for range 32 {
		f := newFlooder(t, l.Addr())
		junk := make([]byte, 100)
		rand.Read(junk)
		d, _ := synDatagram(t, ccfg.ServerKey, junk, nil)
		r := f.send(t, d)
		require.LessOrEqual(t, len(r), len(d))
		if isRetry(r) {
			retries++
		} else {
			refusals++
		}
	}
	st := l.Stats()
	// Failed handshakes count for one to two seconds: a slower run may
	// have let four more through.
	bound := 4 * (1 + int(time.Since(start)/time.Second))
	assert.GreaterOrEqual(t, refusals, 4)
	assert.LessOrEqual(t, refusals, bound)
	assert.Equal(t, uint64(refusals), st.RejectedTokens)
	assert.Equal(t, uint64(retries), st.CookiesSent)
	assert.Zero(t, st.Connections)
	assert.Zero(t, st.Pending)
	assert.Zero(t, admitted.Load())

	ccfg.Token = issue(t, key, sampleToken(addrPort(t, l.Addr())))
	c := dial(t, l.Addr().String(), ccfg)
	assert.Equal(t, 1, c.sec.retries)
	assert.Equal(t, int32(1), admitted.Load())
}

// FuzzCookieCheck feeds the cookie check anything: it never panics, a
// cookie it accepts is exactly the one the listener would have made for
// that address, handshake and time, and the one it made is accepted until
// it is stale. Seeds: testdata/fuzz/FuzzCookieCheck.
func FuzzCookieCheck(f *testing.F) {
	j := newCookieJar()
	now := time.Unix(1_800_000_000, 0)
	f.Fuzz(func(t *testing.T, msg1, cookie, ip []byte, port uint16, age int16) {
		a, ok := netip.AddrFromSlice(ip)
		if !ok {
			a = netip.IPv4Unspecified()
		}
		addr := netip.AddrPortFrom(a, port)
		at := now.Add(time.Duration(age) * time.Second)
		made := j.appendCookie(nil, addr, msg1, now)
		fresh := age >= -1 && time.Duration(age)*time.Second <= cookieLifetime
		require.Equal(t, fresh, j.check(made, addr, msg1, at))
		if j.check(cookie, addr, msg1, at) {
			issued := time.Unix(int64(binary.LittleEndian.Uint64(cookie)), 0)
			require.Equal(t, j.appendCookie(nil, addr, msg1, issued), cookie)
		}
	})
}

// BenchmarkAdmitCost compares what a secure listener spends on a
// ConnectSyn from a new address: reading its Noise message (an X25519),
// against making a cookie for it.
func BenchmarkAdmitCost(b *testing.B) {
	priv, pub, err := GenerateKey()
	require.NoError(b, err)
	_, syn, err := newClientSecure(pub, nil, make([]byte, 16))
	require.NoError(b, err)
	_, msg1, _ := splitSecureSyn(syn)
	addr := netip.MustParseAddrPort("192.0.2.1:5000")
	b.Run("handshake", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			s, _ := newServerSecure(priv, pub)
			if _, err := s.readSyn(msg1); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("cookie", func(b *testing.B) {
		j := newCookieJar()
		var c [cookieSize]byte
		var buf [64]byte
		now := time.Now()
		b.ReportAllocs()
		for b.Loop() {
			appendRetry(buf[:0], j.appendCookie(c[:0], addr, msg1, now))
		}
	})
}

func TestCookieRoundUnderLoss(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		// Retries and echoed ConnectSyns lost, duplicated, reordered: the
		// timed resends carry the cookie held, a new Retry replaces it.
		scfg, ccfg := secureConfigs(t)
		scfg.CookieThreshold = -1
		sim := func(seed uint64) *Simulation {
			return &Simulation{Loss: 0.3, Duplicate: 0.1, Reorder: 0.1, ReorderDelay: 3 * time.Millisecond, Seed: seed}
		}
		scfg.Simulate = sim(1)
		ccfg.ConnectTimeout = 10 * time.Second
		l := nw.listen(t, scfg)
		serveEcho(t, l)
		for seed := range uint64(4) {
			cfg := *ccfg
			cfg.Simulate = sim(seed + 2)
			c := nw.dial(t, l.Addr().String(), &cfg)
			require.True(t, c.Secure())
			assert.GreaterOrEqual(t, c.sec.retries, 1)
			c.StartClose("") // its end under loss is not what is tested
		}
		assert.GreaterOrEqual(t, l.Stats().CookiesSent, uint64(4))
	})
}

// BenchmarkSecureFlood is what one datagram of the review's flood costs a
// secure listener's socket reader (handleNew), which every connection on
// the socket waits behind: the same 1,200-byte ConnectSyn each time, with
// a valid cookie for its address and a Noise message that does not read.
// It is answered with a refusal (a system call), or nothing with Stealth.
// For scale, "retry" is the same without the cookie: a Retry each time.
func BenchmarkSecureFlood(b *testing.B) {
	for _, kind := range []string{"refused", "stealth", "retry"} {
		b.Run(kind, func(b *testing.B) {
			scfg, _ := secureConfigs(b)
			scfg.CookieThreshold = -1
			scfg.Stealth = kind == "stealth"
			l := listen(b, scfg)
			// Where the answers go: never read, the kernel drops them
			// once its buffer is full.
			sink, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
			require.NoError(b, err)
			defer sink.Close()
			addr := addrPort(b, sink.LocalAddr())
			msg1 := make([]byte, noiseOverhead+200)
			rand.Read(msg1)
			var cookie []byte
			if kind != "retry" {
				cookie = l.cookies.appendCookie(nil, addr, msg1, time.Now())
			}
			d := rebuildSyn(cookie, msg1)
			ep := l.eps[0]
			feed := func() {
				p := ep.getPacket()
				p.b = append(p.buf[:0], d...)
				p.from = addr
				l.handleNew(ep, addr, p)
			}
			if cookie != nil {
				feed()
				for l.Stats().RefusedAttempts == 0 {
					runtime.Gosched() // the first one's key exchange failed
				}
			}
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				feed()
			}
		})
	}
}
