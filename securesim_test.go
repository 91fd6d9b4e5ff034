package knet

import (
	"bytes"
	"crypto/sha256"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/netsim"
)

// nonceLedger records every datagram sealed, by key and packet number (the
// nonce), and finds any number sealed twice with different plaintexts: the
// one thing AES-GCM must never do.
type nonceLedger struct {
	mu     sync.Mutex
	seen   map[ledgerKey][sha256.Size]byte
	sealed int
	reused []string
}

type ledgerKey struct {
	key [8]byte
	pn  uint64
}

func newNonceLedger() *nonceLedger {
	return &nonceLedger{seen: make(map[ledgerKey][sha256.Size]byte)}
}

// tap is the ledger's sealTap.
func (l *nonceLedger) tap(key [8]byte, pn uint64, pt []byte) {
	h := sha256.Sum256(pt)
	k := ledgerKey{key, pn}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.sealed++
	if old, ok := l.seen[k]; ok && old != h && len(l.reused) < 10 {
		l.reused = append(l.reused, fmt.Sprintf("key %x packet number %d (PacketID %d) sealed with two plaintexts", key, pn, pn&packetIDMask))
	}
	l.seen[k] = h
}

// check fails t on any reuse.
func (l *nonceLedger) check(t testing.TB) {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, r := range l.reused {
		t.Error("nonce reuse: " + r)
	}
}

// count is how many datagrams were sealed.
func (l *nonceLedger) count() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.sealed
}

// withLedger has every connection made with cfgs seal through one ledger,
// checked when the test ends.
func withLedger(t testing.TB, cfgs ...*Config) *nonceLedger {
	l := newNonceLedger()
	for _, c := range cfgs {
		c.sealTap = l.tap
	}
	t.Cleanup(func() { l.check(t) })
	return l
}

// newSecureSimPair is newSimPair for a secure session: every datagram goes
// through the secure layer as a Conn's do (sealOut on the way out, in on
// the way in), the server's made from the first ConnectSyn that reads as
// a listener's would, and every datagram sealed is in a ledger checked
// when the test ends.
func newSecureSimPair(t testing.TB, client, server *Config, up, down netsim.Params) *simPair {
	priv, pub, err := GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	return newSecureSimPairKeys(t, priv, pub, client, server, up, down)
}

// newSecureSimPairKeys is newSecureSimPair with the server's key pair.
func newSecureSimPairKeys(t testing.TB, priv, pub []byte, client, server *Config, up, down netsim.Params) *simPair {
	c, s := Config{}, Config{}
	if client != nil {
		c = *client
	}
	if server != nil {
		s = *server
	}
	c.ServerKey, s.PrivateKey = pub, priv
	ledger := withLedger(t, &c, &s)
	cc, sc := c.resolve(), s.resolve()
	if err := cc.secureDialer(); err != nil {
		t.Fatal(err)
	}
	if err := sc.secureListener(); err != nil {
		t.Fatal(err)
	}
	p := &simPair{t: t, now: timeZero, buf: make([]byte, 0, 65536), spare: make([]byte, 0, 65536+wireOverhead),
		secure: true, priv: priv, pub: pub, ledger: ledger}
	p.h[0], p.h[1] = new(simHost), new(simHost)
	p.s[0] = newSession(cc, p.h[0], true, DialectSpec, p.now)
	p.s[1] = newSession(sc, p.h[1], false, DialectSpec, p.now)
	p.links[0], p.links[1] = netsim.NewLink(up), netsim.NewLink(down)
	p.seedSkips(up, down)
	sec, syn, err := newClientSecure(pub, nil, cc.connectPayload)
	if err != nil {
		t.Fatal(err)
	}
	sec.tap = cc.sealTap
	sec.ku = newKeyUpdates(cc)
	p.sec[0] = sec
	p.s[0].setSyn(syn, false)
	return p
}

// receiveSecure hands b to side to's secure layer, from its peer's address
// (atPeer) or another, and what authenticates to its session. The server's
// secure layer is made from the first datagram that reads as a secure
// ConnectSyn, as admitSecure does.
func (p *simPair) receiveSecure(to int, b []byte, atPeer bool) {
	s := p.s[to]
	if p.sec[to] == nil {
		if to == 0 || !atPeer {
			return
		}
		if p.sec[1] = p.simAdmit(b); p.sec[1] == nil {
			return
		}
	}
	if pt, fresh := p.sec[to].in(s, p.now, b, atPeer); pt != nil {
		s.beginRound()
		s.handleSealed(p.now, pt, fresh)
		// Key updates, as Conn.keyUpdates.
		ann, err := p.sec[to].afterIn(s, p.now)
		if err != nil {
			p.t.Fatalf("side %d: %v", to, err)
		}
		if ann != nil {
			p.transmit(to, ann)
		}
	}
}

// simAdmit is a listener's reading of a ConnectSyn b (admitSecure without
// the cookie and the token): the server's secure layer, or nil.
func (p *simPair) simAdmit(b []byte) *secureState {
	var content []byte
	var h header
	scanDatagram(b, &h, func(m message) {
		if content == nil && !m.fragment && m.id == idConnectSyn {
			content = m.payload
		}
	})
	_, msg1, ok := splitSecureSyn(content)
	if !ok {
		return nil
	}
	sec, err := newServerSecure(p.priv, p.pub)
	if err != nil {
		p.t.Fatal(err)
	}
	sec.tap = p.s[1].cfg.sealTap
	sec.ku = newKeyUpdates(p.s[1].cfg)
	inner, err := sec.readSyn(msg1)
	if err != nil {
		return nil
	}
	_, payload, ok := splitSynPayload(inner)
	if !ok {
		return nil
	}
	sec.payload = payload
	sec.msg1 = bytes.Clone(msg1)
	return sec
}

func TestSecureSimHandshake(t *testing.T) {
	p := newSecureSimPair(t, &Config{ConnectPayload: []byte("hello")}, nil, lossy(1, 0.1), lossy(2, 0.1))
	var got []byte
	p.admit = func(syn []byte) ([]byte, bool) { got = syn; return []byte("welcome"), true }
	p.connect()
	require.Equal(t, "hello", string(got))
	require.Equal(t, "welcome", string(p.client().handshake.synAck))
	const n = 300
	for i := range n {
		p.send(0, numbered(100, i, 10+i))
		p.send(1, numbered(101, i, 10+i))
	}
	require.True(t, p.run(30*time.Second, func() bool { return len(p.h[0].msgs) == n && len(p.h[1].msgs) == n }),
		"delivered %d and %d of %d; client %v %v, server %v %v", len(p.h[0].msgs), len(p.h[1].msgs), n,
		p.client().state, p.client().err, p.server().state, p.server().err)
}

// lostReliable sets p to drop, from side from, the datagrams that carry
// message id while drop says so (given how many times one was sent), and
// reports the first one's PacketID.
func lostReliable(p *simPair, from int, id uint32, drop func(sends int) bool) (pid *uint32, sends *int) {
	pid, sends = new(uint32), new(int)
	p.drop = func(side int, b []byte) bool {
		if side != from {
			return false
		}
		var d datagram
		if parseInto(b, &d) != nil || !d.has(id) {
			return false
		}
		if *sends == 0 {
			*pid = d.packetID
		}
		*sends++
		return drop(*sends)
	}
	return pid, sends
}

// TestSpanHoldsBehindLostReliable: a reliable datagram R lost a few times
// while its sender sends more than 2^15 unreliable datagrams. The receiver
// keeps the last 2^15 PacketIDs, so a datagram sent 2^15 or more after R
// would make R's resends (same PacketID) look like duplicates: acked,
// never delivered. No new datagram may go that far past R; unreliable ones
// wait until R is acked, and R is delivered.
func TestSpanHoldsBehindLostReliable(t *testing.T) {
	path := netsim.Params{Delay: 10 * time.Millisecond}
	p := newSimPair(t, nil, nil, path, path)
	p.connect()
	rpid, sends := lostReliable(p, 0, 200, func(n int) bool { return n <= 3 })
	var worst int32
	p.tap = func(from int, b []byte) {
		var h header
		if from != 0 || *sends == 0 || len(p.h[1].msgs) > 0 && p.h[1].msgs[0].ID == 200 {
			return
		}
		if _, err := parseHeader(b, &h); err == nil {
			worst = max(worst, seqDiff(*rpid, h.packetID))
		}
	}
	p.send(0, Message{ID: 200, Payload: []byte("R"), Reliable: true})
	p.flush()
	require.Equal(t, 1, *sends)
	const n = recvSpan + 100
	for i := range n {
		p.send(0, Message{ID: 300, Payload: []byte{byte(i)}})
		p.flush()
	}
	got := func() (r, u int) {
		for _, m := range p.h[1].msgs {
			if m.ID == 200 {
				r++
			} else {
				u++
			}
		}
		return r, u
	}
	require.True(t, p.run(time.Minute, func() bool { r, u := got(); return r == 1 && u == n }),
		"R sent %d times; delivered (R, unreliable): %v", *sends, fmt.Sprint(got()))
	assert.Less(t, worst, int32(recvSpan), "a datagram left 2^15 or more past R")
	assert.Equal(t, stateOK, p.client().state)
}

// TestSecureNoNonceReuseBehindLostReliable: the path drops a reliable
// datagram R of the server's every time while the server sends unreliable
// datagrams as fast as it may (600ms round trip, default Config). Every
// datagram is sealed under its packet number; R's resends keep R's. No
// datagram may leave 2^15 or more past R (so unreliable ones wait), and no
// packet number may seal two plaintexts: before, unreliable datagrams ran
// PacketIDs more than 2^21 past R, whose resend then took the number of
// the next cycle, and after a wrap a new datagram was sealed under it.
func TestSecureNoNonceReuseBehindLostReliable(t *testing.T) {
	t.Parallel()
	path := netsim.Params{Delay: 300 * time.Millisecond}
	p := newSecureSimPair(t, nil, nil, path, path)
	p.connect()
	rpid, sends := lostReliable(p, 1, 200, func(int) bool { return true })
	var worst int32
	newest := uint32(0)
	p.tap = func(from int, b []byte) {
		var h header
		if from != 1 || *sends == 0 {
			return
		}
		if _, err := parseHeader(b, &h); err == nil && seqLess(newest, h.packetID) {
			newest = h.packetID
			worst = max(worst, seqDiff(*rpid, h.packetID))
		}
	}
	p.send(1, Message{ID: 200, Payload: []byte("R"), Reliable: true})
	srv := p.server()
	payload := make([]byte, 1000)
	for range 200_000 {
		if srv.state == stateDone {
			break
		}
		// A sender with a bounded buffer: it keeps 64 queued.
		for srv.send.unrelQ.len() < 64 {
			p.send(1, Message{ID: 300, Payload: payload})
		}
		p.run(time.Millisecond, nil)
	}
	// R is never acked: the connection ends, the server at its
	// retransmission limit or hearing nothing from a client that heard
	// nothing new (only R's resends could go, all lost).
	require.Equal(t, stateDone, srv.state, "R is never acked")
	assert.Less(t, worst, int32(recvSpan), "a datagram left 2^15 or more past R")
	assert.Positive(t, *sends)
}

// delivered is the payloads side i's application got, as strings.
func (p *simPair) delivered(i int) []string {
	var out []string
	for _, m := range p.h[i].msgs {
		out = append(out, string(m.Payload))
	}
	return out
}

// Finding 1: once a secure server has sent its ConnectSynAck and until the
// client's first sealed datagram arrives, a clear datagram from the
// client's address holding a ConnectSyn was handed whole to the session:
// its ConnectAck opened the connection, its messages were delivered, and
// its PacketID, taken for seen, made the client's real datagram of that
// PacketID a duplicate, acked and never delivered. Now nothing in clear
// but the very ConnectSyn read reaches anything, and that only as "send
// the ConnectSynAck again".
func TestSecureSimClearDatagramInHandshake(t *testing.T) {
	for _, withSyn := range []bool{true, false} {
		t.Run(fmt.Sprint("syn=", withSyn), func(t *testing.T) {
			p := newSecureSimPair(t, nil, nil, perfect, perfect)
			srv, cl := p.server(), p.client()
			require.True(t, p.run(time.Second, func() bool { return srv.state == stateSynAck }))
			p.cut[0] = true // the client's sealed datagrams are late
			require.True(t, p.run(time.Second, func() bool { return cl.state == stateOK }))
			next := cl.send.nextPID
			var msgs []message
			if withSyn {
				// The genuine ConnectSyn's content, even: still in clear.
				var content []byte
				scanDatagram(clearDatagram(0, false, message{id: idConnectSyn, payload: appendSecureSyn(nil, nil, p.sec[1].msg1)}), new(header), func(m message) { content = m.payload })
				msgs = append(msgs, message{id: idConnectSyn, payload: content})
			}
			msgs = append(msgs, message{id: idConnectAck}, message{id: 100, payload: []byte("INJECTED")})
			for _, pid := range []uint32{next, next + 1} {
				p.inject(1, clearDatagram(pid, false, msgs...))
				p.inject(1, clearDatagram(pid, true, msgs...))
			}
			p.flush()
			assert.Equal(t, stateSynAck, srv.state, "a clear datagram opened the connection")
			assert.Empty(t, p.delivered(1))
			assert.NotZero(t, p.sec[1].invalid, "counted")
			// The client's real datagrams, PacketIDs next and on.
			p.send(0, Message{ID: 100, Payload: []byte("real"), Reliable: true})
			p.cut[0] = false
			require.True(t, p.run(10*time.Second, func() bool { return len(p.h[1].msgs) > 0 }))
			assert.Equal(t, []string{"real"}, p.delivered(1))
			assert.Equal(t, stateOK, srv.state)
		})
	}
}

// Finding 2 (the session's part; TestAttackReplayedConnectSyn is the
// connection's): a victim's ConnectSyn replayed to a server gets a
// ConnectSynAck only the victim can read; a clear ConnectAck and a message
// after it open nothing and deliver nothing.
func TestSecureSimReplayedSynOpensNothing(t *testing.T) {
	victim := newSecureSimPair(t, &Config{ConnectPayload: []byte("victim")}, nil, perfect, perfect)
	var syn []byte
	victim.tap = func(from int, b []byte) {
		if from == 0 && syn == nil {
			syn = bytes.Clone(b)
		}
	}
	victim.connect()
	require.NotNil(t, syn)
	// Another server with the same key (or the same, after the victim
	// left): the attacker's replay, and what it sends next.
	p := newSecureSimPairKeys(t, victim.priv, victim.pub, nil, nil, perfect, perfect)
	p.cut[0] = true // the attacker is no client session
	var admitted []string
	p.admit = func(b []byte) ([]byte, bool) { admitted = append(admitted, string(b)); return nil, true }
	p.inject(1, syn)
	p.flush()
	require.Equal(t, []string{"victim"}, admitted, "Admit sees the replay (it has no side effect until established)")
	require.Equal(t, stateSynAck, p.server().state)
	for pid := uint32(1); pid < 4; pid++ {
		for _, rel := range []bool{false, true} {
			p.inject(1, clearDatagram(pid, rel, message{id: idConnectAck}, message{id: 100, payload: []byte("as the victim")}))
		}
	}
	p.run(time.Second, nil)
	assert.False(t, p.h[1].est, "established")
	assert.Empty(t, p.delivered(1))
	// It ends at ConnectTimeout, never having opened.
	p.run(p.server().cfg.connectTimeout, nil)
	assert.Equal(t, stateDone, p.server().state)
	assert.False(t, p.server().handshake.wasOpen)
}

// Finding 3: the client read every block of the datagram that carried the
// server's genuine ConnectSynAck; an attacker on the path added messages to
// it and they were delivered. Now only a datagram holding the ConnectSynAck
// alone is read; the one with company is dropped, and the handshake
// completes with the next (the server answers the ConnectSyn the client
// sends again).
func TestSecureSimExtraBlocksBesideSynAck(t *testing.T) {
	extras := map[string][]message{
		"app message": {{id: 100, payload: []byte("INJECTED")}},
		"disconnect":  {{id: idDisconnect, payload: []byte("bye")}},
		"ping":        {{id: idPingRequest, payload: []byte{9}}},
		"ack":         {{id: idPacketAck, payload: appendPacketAck(nil, packetAck{base: 0})}},
		"padding":     {{id: idPadding}},
		"second":      {{id: idConnectSynAck, payload: []byte("x")}},
	}
	for name, extra := range extras {
		t.Run(name, func(t *testing.T) {
			p := newSecureSimPair(t, nil, nil, perfect, perfect)
			tampered := 0
			p.drop = func(from int, b []byte) bool {
				if from != 1 || tampered > 0 {
					return false
				}
				pid, content, ok := handshakeContent(b, idConnectSynAck)
				if !ok {
					return false
				}
				tampered++
				for _, order := range []bool{false, true} {
					msgs := append([]message{{id: idConnectSynAck, payload: content}}, extra...)
					if order {
						msgs = append(append([]message(nil), extra...), message{id: idConnectSynAck, payload: content})
					}
					p.inject(0, clearDatagram(pid, false, msgs...))
				}
				return true
			}
			p.connect()
			assert.Equal(t, 1, tampered)
			assert.Empty(t, p.delivered(0))
			assert.Equal(t, uint64(2), p.sec[0].invalid)
			assert.Equal(t, stateOK, p.client().state)
			p.send(1, Message{ID: 100, Payload: []byte("real"), Reliable: true})
			require.True(t, p.run(5*time.Second, func() bool { return len(p.h[0].msgs) > 0 }))
			assert.Equal(t, []string{"real"}, p.delivered(0))
		})
	}
}

// Finding 7: one forged ConnectSynAck from the server's address ended a
// secure Dial with ErrHandshakeFailed. Now it is dropped and counted; the
// genuine one still completes the handshake.
func TestSecureSimForgedSynAckIgnored(t *testing.T) {
	other := newSecureSimPair(t, nil, nil, perfect, perfect)
	var otherSynAck []byte
	other.tap = func(from int, b []byte) {
		if _, c, ok := handshakeContent(b, idConnectSynAck); from == 1 && ok && otherSynAck == nil {
			otherSynAck = bytes.Clone(c)
		}
	}
	other.connect()
	p := newSecureSimPair(t, nil, nil, netsim.Params{Delay: 10 * time.Millisecond}, netsim.Params{Delay: 10 * time.Millisecond})
	p.flush() // the ConnectSyn is on its way
	for _, content := range [][]byte{nil, make([]byte, 100), otherSynAck, bytes.Repeat([]byte{0xff}, noiseOverhead+cidSize)} {
		p.inject(0, clearDatagram(0, false, message{id: idConnectSynAck, payload: content}))
	}
	assert.Equal(t, stateSyn, p.client().state)
	p.connect()
	assert.Equal(t, 4, p.sec[0].badSynAcks)
	assert.Equal(t, uint64(4), p.sec[0].invalid)
	p.send(0, Message{ID: 100, Payload: []byte("works"), Reliable: true})
	require.True(t, p.run(time.Second, func() bool { return len(p.h[1].msgs) > 0 }))
}

// Finding 8: a replayed reliable sealed datagram was taken as life, so
// replaying one every 100ms kept a vanished client's connection open past
// ConnectionLostTimeout. Now only a fresh datagram proves the peer alive;
// the replays are still acked (they may be the peer's resends).
func TestSecureSimReplaysDoNotKeepAlive(t *testing.T) {
	cfg := &Config{ConnectionLostTimeout: 2 * time.Second, PingInterval: 500 * time.Millisecond}
	p := newSecureSimPair(t, cfg, cfg, perfect, perfect)
	var captured []byte
	p.tap = func(from int, b []byte) {
		if from == 0 && len(b) > 3 && b[2]&0x40 != 0 {
			captured = bytes.Clone(b) // a reliable datagram of the client's
		}
	}
	p.connect()
	p.send(0, Message{ID: 100, Payload: []byte("x"), Reliable: true})
	require.True(t, p.run(time.Second, func() bool { return len(p.h[1].msgs) == 1 }))
	require.NotNil(t, captured)
	p.cut[0] = true // the client vanishes
	gone := p.now
	acked := p.server().stats.DuplicateDatagrams
	for p.server().state != stateDone && p.now.Sub(gone) < 10*time.Second {
		p.inject(1, captured)
		p.run(100*time.Millisecond, nil)
	}
	assert.Equal(t, stateDone, p.server().state, "replays kept the connection")
	var te *TimeoutError
	assert.ErrorAs(t, p.server().err, &te)
	assert.Less(t, p.now.Sub(gone), 3*time.Second)
	assert.Greater(t, p.server().stats.DuplicateDatagrams, acked, "replays are taken as duplicates")
}

// FuzzSecureHandshake drives a secure handshake and the first messages
// with attacker datagrams mixed in, as the input says: clear handshake
// messages with and without extra blocks, copies, bit flips and
// truncations of the genuine datagrams, bytes of its own, from the peer's
// address and from others, to either side, at any moment. Whatever comes:
// nothing panics, nothing is delivered but the genuine messages and none
// twice, no nonce seals two plaintexts (the ledger), and the connection
// opens and every genuine reliable message arrives (a forged refusal
// cannot prove it answers the client's ConnectSyn: refusalProofSize).
func FuzzSecureHandshake(f *testing.F) {
	f.Add([]byte{1, 3, 0, 2, 2, 0, 0, 5, 1, 5, 0, 1, 4, 0})
	f.Add([]byte{0, 20, 1, 2, 1, 0, 5, 0, 2, 0, 1, 0, 30, 3, 1, 0})
	f.Add([]byte{2, 2, 0, 0, 10, 2, 1, 2, 0, 50, 1, 6, 7, 9, 1, 4, 0, 4, 5, 1, 0, 100})
	f.Add([]byte{1, 7, 4, 1, 2, 3, 4, 2, 7, 30, 0xff, 0, 5, 0, 0, 200})
	priv, pub, err := GenerateKey()
	require.NoError(f, err)
	f.Fuzz(func(t *testing.T, ops []byte) {
		path := netsim.Params{Delay: 5 * time.Millisecond}
		p := newSecureSimPairKeys(t, priv, pub, nil, nil, path, path)
		var wire [2][][]byte // genuine datagrams each side sent
		p.tap = func(from int, b []byte) {
			if len(wire[from]) < 64 {
				wire[from] = append(wire[from], bytes.Clone(b))
			}
		}
		in := ops
		next := func() byte {
			if len(in) == 0 {
				return 0
			}
			b := in[0]
			in = in[1:]
			return b
		}
		genuine := 0
		sendGenuine := func(side int) {
			p.send(side, Message{ID: 100, Payload: fmt.Appendf(nil, "genuine-%d-%d", side, genuine), Reliable: true})
			genuine++
		}
		// craft builds an attacker datagram for side to.
		craft := func(to int) []byte {
			kind := next() % 8
			arg := int(next())
			var copyOf []byte
			if w := wire[1-to]; len(w) > 0 {
				copyOf = bytes.Clone(w[arg%len(w)])
			}
			hs := uint32(idConnectSyn)
			var hsContent []byte
			if to == 0 {
				hs = idConnectSynAck
			}
			for _, w := range wire[1-to] {
				if _, c, ok := handshakeContent(w, hs); ok {
					hsContent = c
				}
			}
			attack := message{id: 100, payload: []byte("attack")}
			switch kind {
			case 0: // bytes of its own
				n := min(arg, len(in))
				b := bytes.Clone(in[:n])
				in = in[n:]
				return b
			case 1: // a copy
				return copyOf
			case 2: // a bit flipped
				if len(copyOf) > 0 {
					copyOf[arg%len(copyOf)] ^= 1 << (next() % 8)
				}
				return copyOf
			case 3: // truncated
				return copyOf[:min(arg, len(copyOf))]
			case 4: // the genuine handshake message with company
				return clearDatagram(uint32(arg), false, message{id: hs, payload: hsContent}, attack)
			case 5: // an opening in clear, with a message
				return clearDatagram(uint32(arg), arg%2 == 0, message{id: idConnectAck}, attack)
			case 6: // a handshake message of its own
				ids := []uint32{idConnectSyn, idConnectSynAck, idRetry, idDisconnect, idConnectAck}
				payload := make([]byte, arg)
				copy(payload, in)
				return clearDatagram(uint32(next()), false, message{id: ids[arg%len(ids)], payload: payload})
			default: // a refusal: ends a client still connecting
				return clearDatagram(0, false, message{id: idDisconnectAck, payload: []byte("forged")})
			}
		}
		for len(in) > 0 && p.now.Sub(timeZero) < 20*time.Second {
			switch op := next() % 6; op {
			case 0:
				p.run(time.Duration(next())*time.Millisecond, nil)
			case 1, 2:
				to := int(op - 1)
				if b := craft(to); b != nil {
					p.receiveSecure(to, b, true)
				}
			case 3, 4:
				to := int(op - 3)
				if b := craft(to); b != nil {
					p.receiveSecure(to, b, false)
				}
			case 5:
				sendGenuine(int(next() % 2))
			}
		}
		sendGenuine(0)
		sendGenuine(1)
		all := func() bool { return len(p.h[0].msgs)+len(p.h[1].msgs) == genuine }
		p.run(60*time.Second, func() bool { return all() || p.client().state == stateDone })
		seen := map[string]bool{}
		for i := range 2 {
			for _, m := range p.h[i].msgs {
				s := string(m.Payload)
				if !strings.HasPrefix(s, fmt.Sprintf("genuine-%d-", 1-i)) {
					t.Fatalf("side %d delivered %q", i, s)
				}
				if seen[s] {
					t.Fatalf("side %d delivered %q twice", i, s)
				}
				seen[s] = true
			}
		}
		if !all() {
			t.Fatalf("%d of %d genuine messages delivered; client %v %v, server %v %v", len(seen), genuine,
				p.client().state, p.client().err, p.server().state, p.server().err)
		}
	})
}

// The handshake's clear datagrams carry PacketIDs nothing authenticates
// (the Noise messages are their content, not their header). An attacker
// on the path who renumbers the genuine ConnectSyn or ConnectSynAck must
// not make the peer take a later sealed datagram of that PacketID for a
// duplicate (acked, never delivered): their PacketIDs stay out of the
// receive windows, which start at 0 with nothing received.
func TestSecureSimHandshakePacketIDsUntrusted(t *testing.T) {
	for _, shift := range []uint32{1, 2, 5, 63, 64, 100} {
		t.Run(fmt.Sprint(shift), func(t *testing.T) {
			p := newSecureSimPair(t, nil, nil, perfect, perfect)
			renumber := func(b []byte) []byte {
				var h header
				n, _ := parseHeader(b, &h)
				h.packetID = (h.packetID + shift) & packetIDMask
				return append(appendHeader(nil, &h), b[n:]...)
			}
			p.drop = func(from int, b []byte) bool {
				_, _, syn := handshakeContent(b, idConnectSyn)
				_, _, synAck := handshakeContent(b, idConnectSynAck)
				if syn || synAck {
					// The renumbered copy overtakes the genuine one.
					p.inject(1-from, renumber(b))
					p.inject(1-from, b)
					return true
				}
				return false
			}
			p.connect()
			p.drop = nil
			const n = 20
			for i := range n {
				p.send(0, numbered(100, i, 10))
				p.send(1, numbered(101, i, 10))
			}
			require.True(t, p.run(10*time.Second, func() bool { return len(p.h[0].msgs) == n && len(p.h[1].msgs) == n }),
				"delivered %d and %d of %d", len(p.h[0].msgs), len(p.h[1].msgs), n)
		})
	}
}

// An ICMP port unreachable is unauthenticated: anyone who knows the
// addresses can forge one. A secure connection, once open, does not let
// them end it (a peer that is gone is found by the lost timeout); a
// plaintext one, or one still connecting, fails fast as before.
func TestSecureOpenIgnoresICMP(t *testing.T) {
	p := newSecureSimPair(t, nil, nil, perfect, perfect)
	p.connect()
	for range 10 {
		p.client().checkReach(3)
		p.client().unreachable(errConnRefused)
	}
	p.client().checkReach(0)
	assert.Equal(t, stateOK, p.client().state)

	q := newSimPair(t, nil, nil, perfect, perfect)
	q.connect()
	q.client().checkReach(3)
	assert.Equal(t, stateDone, q.client().state)

	r := newSecureSimPair(t, nil, nil, perfect, perfect)
	r.client().checkReach(2)
	assert.Equal(t, stateDone, r.client().state, "connecting: fails fast")
}

// A refusal travels in clear, and a secure client takes one only if it
// proves it answers the client's ConnectSyn (the first bytes of its Noise
// message 1): a forged one from the server's address is dropped and
// counted; the server's own ends the Dial with its reason.
func TestSecureSimRefusalNeedsProof(t *testing.T) {
	p := newSecureSimPair(t, nil, nil, perfect, perfect)
	p.cut[1] = true // the server's answers are lost
	p.flush()
	msg1 := p.sec[0].msg1
	wrong := bytes.Clone(msg1)
	wrong[3] ^= 1
	for _, content := range [][]byte{nil, []byte("go away"), appendRefusalProof([]byte("go away"), wrong),
		append([]byte("go away"), msg1[:refusalProofSize]...)} {
		p.inject(0, clearDatagram(0, false, message{id: idDisconnectAck, payload: content}))
	}
	assert.Equal(t, stateSyn, p.client().state, "a refusal without its proof ended the Dial")
	assert.Equal(t, 4, p.sec[0].unprovenRefusals)
	p.inject(0, clearDatagram(0, false, message{id: idDisconnectAck, payload: appendRefusalProof([]byte("go away"), msg1)}))
	require.Equal(t, stateDone, p.client().state)
	var re *RefusedError
	require.ErrorAs(t, p.client().err, &re)
	assert.Equal(t, "go away", re.Reason)
}
