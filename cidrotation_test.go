package knet

import (
	"bytes"
	"encoding/binary"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// rotationServerID is the Config.ServerID of the rotation tests: every ID
// a listener hands out begins with it.
var rotationServerID = []byte{0xab, 0xcd}

// rotatingPair is a secure echo server with rotationServerID and a client
// behind a natRelay, once the client holds its spare connection IDs.
func rotatingPair(t *testing.T) (l *Listener, r *natRelay, c, sc *Conn) {
	t.Helper()
	scfg, ccfg := secureConfigs(t)
	scfg.ServerID = rotationServerID
	l, r, c, sc = behindNAT(t, scfg, ccfg)
	waitSpares(t, c)
	return l, r, c, sc
}

// waitSpares echoes until the client holds all the spares it may: each
// datagram from the server is a moment it asks, a round-trip timeout
// apart.
func waitSpares(t *testing.T, c *Conn) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); c.sec.rot.held.Load() < maxSpareCIDs; {
		require.True(t, time.Now().Before(deadline), "the client got %d spare IDs", c.sec.rot.held.Load())
		echoOnce(t, c, Message{ID: 6, Payload: []byte("spare?")})
	}
}

// pollUntil checks cond every millisecond until it holds, for at most 10
// seconds.
func pollUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	timeout := time.After(10 * time.Second)
	for !cond() {
		select {
		case <-tick.C:
		case <-timeout:
			t.Fatalf("never: %s", what)
		}
	}
}

// sealedOf returns the connection ID and header of b, a client datagram the
// relay recorded, if it is a sealed one.
func sealedOf(b []byte) (id uint32, h header, ok bool) {
	if isClearHandshake(b) {
		return 0, h, false
	}
	if _, err := parseHeader(b, &h); err != nil {
		return 0, h, false
	}
	id, ok = sealedCID(b)
	return id, h, ok
}

// idsOf returns the connection IDs of the datagrams recorded from index
// from on, in order, each once.
func idsOf(r *natRelay, from int) []uint32 {
	var ids []uint32
	for _, b := range r.recorded()[from:] {
		if id, _, ok := sealedOf(b); ok && (len(ids) == 0 || ids[len(ids)-1] != id) {
			ids = append(ids, id)
		}
	}
	return ids
}

// cidsOf returns the connection IDs l holds for c.
func cidsOf(l *Listener, c *Conn) []uint32 {
	l.cidMu.Lock()
	defer l.cidMu.Unlock()
	var ids []uint32
	for id, o := range l.cids {
		if o == c {
			ids = append(ids, id)
		}
	}
	return ids
}

func cidBytes(id uint32) []byte { return binary.LittleEndian.AppendUint32(nil, id) }

// TestCIDRotationMove: a client that changes networks switches to a spare
// connection ID and moves; the connection follows it, no reliable message
// is lost or reordered, the datagrams from the new address carry an ID
// that shares only the server ID with the old one, the old ID is retired,
// and the server holds no more IDs for the connection than its bound.
func TestCIDRotationMove(t *testing.T) {
	l, r, c, sc := rotatingPair(t)
	first := r.outerAddr()
	oldIDs := idsOf(r, 0)
	require.Len(t, oldIDs, 1, "one ID before the switch")
	old := oldIDs[0]
	assert.LessOrEqual(t, len(cidsOf(l, sc)), 1+maxSpareCIDs)

	before := len(r.recorded())
	require.NoError(t, c.RotateConnectionID())
	r.rebind()
	const n = 30
	for i := range n {
		require.NoError(t, c.Send(Message{ID: 7, Payload: []byte{byte(i)}, Reliable: true, InOrder: true}))
	}
	for i := range n {
		got, err := c.Receive(within(t, 10*time.Second))
		require.NoError(t, err)
		require.Equal(t, []byte{byte(i)}, got.Payload, "reliable messages lost or out of order")
	}
	echoBoth(t, c, 1)
	assert.NotEqual(t, first, sc.RemoteAddr().String())
	assert.Equal(t, r.outerAddr(), sc.RemoteAddr().String(), "the server followed the client")
	assert.Equal(t, uint64(1), sc.Stats().Migrations)

	ids := idsOf(r, before)
	require.NotEmpty(t, ids)
	cur := ids[len(ids)-1]
	require.NotEqual(t, old, cur, "the client switched")
	if len(ids) == 2 {
		assert.Equal(t, old, ids[0], "only datagrams sealed before the switch carry the old ID")
	} else {
		assert.Len(t, ids, 1, "the client went back to an ID it left: %x", ids)
	}
	oldB, curB := cidBytes(old), cidBytes(cur)
	assert.Equal(t, rotationServerID, oldB[:2], "the old ID's server ID")
	assert.Equal(t, rotationServerID, curB[:2], "the new ID is routable to the same server")
	assert.NotEqual(t, oldB[2:], curB[2:], "the random parts")
	sid, ok := ServerIDFromDatagram(r.recorded()[len(r.recorded())-1], 2)
	assert.True(t, ok)
	assert.Equal(t, uint32(0xabcd), sid, "a balancer routes the new ID")

	// The old ID is retired; the connection holds the new one and its
	// spares, no more.
	pollUntil(t, "the client holds its spares again", func() bool { return c.sec.rot.held.Load() == maxSpareCIDs })
	echoBoth(t, c, 2)
	held := cidsOf(l, sc)
	assert.NotContains(t, held, old)
	assert.Contains(t, held, cur)
	assert.Len(t, held, 1+maxSpareCIDs)
	assert.Zero(t, sc.Stats().InvalidDatagrams)
	assert.Equal(t, uint64(1), c.sec.rot.switches.Load())
	require.NoError(t, c.Close())
	waitDone(t, sc, 10*time.Second)
	assert.Empty(t, cidsOf(l, sc), "IDs outlived the connection")
}

// TestCIDRotationRepeated: a client switching again and again uses a new
// ID each time, never one used before, and the server holds no more than
// 1+maxSpareCIDs IDs for it at any moment.
func TestCIDRotationRepeated(t *testing.T) {
	l, r, c, sc := rotatingPair(t)
	seen := map[uint32]bool{}
	for _, id := range idsOf(r, 0) {
		seen[id] = true
	}
	const switches = 8
	for i := range switches {
		waitSpares(t, c)
		from := len(r.recorded())
		require.NoError(t, c.RotateConnectionID())
		echoBoth(t, c, byte(i))
		ids := idsOf(r, from)
		cur := ids[len(ids)-1]
		assert.False(t, seen[cur], "switch %d: ID %08x used before", i, cur)
		for _, id := range ids[:len(ids)-1] {
			assert.True(t, seen[id], "switch %d: an ID between", i)
		}
		seen[cur] = true
		assert.LessOrEqual(t, len(cidsOf(l, sc)), 1+maxSpareCIDs, "switch %d", i)
	}
	assert.Len(t, seen, 1+switches)
	assert.Equal(t, uint64(switches), c.sec.rot.switches.Load())
	assert.Zero(t, sc.Stats().InvalidDatagrams)
}

// TestCIDRotationResendAfterSwitch: a reliable datagram sent under the old
// ID, whose ack is lost, goes again under the new ID after the switch:
// the server takes it (as a duplicate), and its ciphertext differs from
// the first send's, a fresh nonce (one nonce over two IDs, the associated
// data, would give away GCM's authentication key).
func TestCIDRotationResendAfterSwitch(t *testing.T) {
	_, r, c, sc := rotatingPair(t)
	old := idsOf(r, 0)[0]
	r.mu.Lock()
	r.dropIn = 1 << 20 // nothing from the server gets through
	r.mu.Unlock()
	from := len(r.recorded())
	require.NoError(t, c.Send(Message{ID: 6, Payload: []byte("resent"), Reliable: true}))
	var first []byte
	var pid uint32
	pollUntil(t, "the message went under the old ID", func() bool {
		for _, b := range r.recorded()[from:] {
			if id, h, ok := sealedOf(b); ok && id == old && h.reliable {
				first, pid = b, h.packetID
				return true
			}
		}
		return false
	})
	require.NoError(t, c.RotateConnectionID())
	var again []byte
	pollUntil(t, "the message went again under the new ID", func() bool {
		for _, b := range r.recorded()[from:] {
			if id, h, ok := sealedOf(b); ok && id != old && h.reliable && h.packetID == pid {
				again = b
				return true
			}
		}
		return false
	})
	r.mu.Lock()
	r.dropIn = 0
	r.mu.Unlock()
	got, err := c.Receive(within(t, 10*time.Second))
	require.NoError(t, err)
	assert.Equal(t, "resent", string(got.Payload))

	n := headerSize(first)
	require.Equal(t, len(first), len(again))
	assert.Equal(t, first[:n], again[:n], "the same datagram")
	assert.NotEqual(t, first[n+cidSize:len(first)-sealOverhead], again[n+cidSize:len(again)-sealOverhead],
		"the same plaintext sealed under the same nonce for two IDs")
	echoBoth(t, c, 1)
	st := sc.Stats()
	assert.Zero(t, st.InvalidDatagrams, "the resend under the new ID did not authenticate")
	assert.Positive(t, st.DuplicateDatagrams)
}

// TestCIDRotationAttackStaleAndUnknownIDs: a client datagram replayed with
// the retired ID, or with an ID the server never handed out, goes nowhere
// from another address (no path check, no answer); with a live spare ID
// put in by an attacker, it fails authentication and retires nothing.
func TestCIDRotationAttackStaleAndUnknownIDs(t *testing.T) {
	l, r, c, sc := rotatingPair(t)
	old := idsOf(r, 0)[0]
	require.NoError(t, c.RotateConnectionID())
	echoBoth(t, c, 1)
	echoBoth(t, c, 2)
	rec := r.recorded()
	var withOld []byte
	for _, b := range rec {
		if id, h, ok := sealedOf(b); ok && id == old && !h.reliable {
			withOld = b
		}
	}
	require.NotNil(t, withOld)
	require.NotContains(t, cidsOf(l, sc), old, "retired")

	// An ID never handed out: the old datagram under another ID with
	// the same server ID.
	unknown := bytes.Clone(withOld)
	n := headerSize(unknown)
	unknown[n+2] ^= 0x5a
	unknown[n+3] ^= 0xa5

	pc := loopbackSocket(t)
	mig, chal := sc.Stats().Migrations, sc.sec.challenges.Load()
	nowhere := func() uint64 { st := l.Stats(); return st.StrayDatagrams + st.InvalidDatagrams }
	before := nowhere()
	for _, d := range [][]byte{withOld, unknown} {
		_, err := pc.WriteToUDPAddrPort(d, r.server)
		require.NoError(t, err)
	}
	pollUntil(t, "both were dropped", func() bool { return nowhere()-before >= 2 })
	mustNotReceive(t, pc)
	assert.Equal(t, mig, sc.Stats().Migrations)
	assert.Equal(t, chal, sc.sec.challenges.Load())

	// A live spare, put into a datagram of the client's: routed to the
	// connection, which cannot authenticate it and keeps its IDs.
	held := cidsOf(l, sc)
	cur := idsOf(r, 0)[len(idsOf(r, 0))-1]
	var spare uint32
	for _, id := range held {
		if id != cur {
			spare = id
		}
	}
	require.NotZero(t, spare)
	// A packet number never received, so that it is not dropped as a
	// replay before its authentication.
	var h header
	_, err := parseHeader(withOld, &h)
	require.NoError(t, err)
	h.packetID = (h.packetID + 1000) & packetIDMask
	forged := append(appendHeader(nil, &h), withOld[n:]...)
	require.Len(t, forged, len(withOld))
	binary.LittleEndian.PutUint32(forged[n:], spare)
	inv := sc.Stats().InvalidDatagrams
	_, err = pc.WriteToUDPAddrPort(forged, r.server)
	require.NoError(t, err)
	pollUntil(t, "the forged datagram was counted", func() bool { return sc.Stats().InvalidDatagrams > inv })
	echoBoth(t, c, 3)
	assert.ElementsMatch(t, held, cidsOf(l, sc), "a forged datagram retired or added IDs")
	assert.Equal(t, mig, sc.Stats().Migrations)
	mustNotReceive(t, pc)
}

// TestCIDRotationAttackInClear: rotation messages in clear are no one's:
// a NewConnectionIDs made up and sent to the client as from the server,
// and an ask sent to the server from the client's address, are dropped
// and counted, and change nothing.
func TestCIDRotationAttackInClear(t *testing.T) {
	l, r, c, sc := rotatingPair(t)
	before := cidsOf(l, sc)

	forgedNew := []byte{pathNewCIDs}
	forgedNew = binary.LittleEndian.AppendUint32(forgedNew, 1000)
	forgedNew = append(forgedNew, 2)
	forgedNew = binary.LittleEndian.AppendUint32(forgedNew, 0xdeadbeef)
	forgedNew = binary.LittleEndian.AppendUint32(forgedNew, 0xfeedface)
	d := appendHeader(nil, &header{packetID: 4000})
	d = appendMessage(d, &message{id: idPath, payload: forgedNew})
	toClient := loopbackSocket(t)
	cInv := c.Stats().InvalidDatagrams
	_, err := toClient.WriteToUDPAddrPort(d, addrPort(t, net.Addr(r.outer.LocalAddr())))
	require.NoError(t, err)
	pollUntil(t, "the client counted the forgery", func() bool { return c.Stats().InvalidDatagrams > cInv })

	ask := binary.LittleEndian.AppendUint32([]byte{pathWantCIDs}, 0)
	d = appendHeader(nil, &header{packetID: 4001})
	d = appendMessage(d, &message{id: idPath, payload: ask})
	sInv := sc.Stats().InvalidDatagrams
	r.mu.Lock()
	_, err = r.outer.WriteToUDPAddrPort(d, r.server) // from the client's address
	r.mu.Unlock()
	require.NoError(t, err)
	pollUntil(t, "the server counted the forgery", func() bool { return sc.Stats().InvalidDatagrams > sInv })

	echoBoth(t, c, 1)
	assert.Equal(t, int32(maxSpareCIDs), c.sec.rot.held.Load())
	assert.ElementsMatch(t, before, cidsOf(l, sc))
	require.NoError(t, c.RotateConnectionID())
	echoBoth(t, c, 2)
	ids := idsOf(r, 0)
	cur := ids[len(ids)-1]
	assert.NotEqual(t, uint32(0xdeadbeef), cur)
	assert.Contains(t, before, cur, "the client switched to a spare the server handed out")
}

// TestCIDRotationParseSpares: the client keeps only well-formed handed IDs
// numbered above what it holds, at most maxSpareCIDs, whatever the count
// says.
func TestCIDRotationParseSpares(t *testing.T) {
	msg := func(first uint32, count byte, ids ...uint32) []byte {
		m := binary.LittleEndian.AppendUint32([]byte{pathNewCIDs}, first)
		m = append(m, count)
		for _, id := range ids {
			m = binary.LittleEndian.AppendUint32(m, id)
		}
		return m
	}
	for _, tc := range []struct {
		name string
		m    []byte
		want []spareCID
	}{
		{"two", msg(1, 2, 10, 11), []spareCID{{1, 10}, {2, 11}}},
		{"count above the IDs", msg(1, 3, 10, 11), nil},
		{"count below the IDs", msg(1, 1, 10, 11), nil},
		{"too many", msg(1, 3, 10, 11, 12), nil},
		{"none", msg(1, 0), nil},
		{"sequence 0", msg(0, 1, 10), nil},
		{"sequence wraps", msg(0xffffffff, 1, 10), nil},
		{"ID 0 skipped", msg(1, 2, 0, 11), []spareCID{{2, 11}}},
		{"truncated", msg(1, 2, 10, 11)[:8], nil},
	} {
		s := &secureState{initiator: true, cid: 5}
		s.takeSpares(tc.m)
		assert.Equal(t, tc.want, nilIfEmpty(s.rot.spares), tc.name)
	}
	// Numbered at or below what it holds: kept once.
	s := &secureState{initiator: true, cid: 5}
	s.takeSpares(msg(1, 2, 10, 11))
	s.takeSpares(msg(2, 2, 11, 12))
	assert.Equal(t, []spareCID{{1, 10}, {2, 11}}, s.rot.spares, "at most maxSpareCIDs")
	s.rot.spares = s.rot.spares[1:]
	s.takeSpares(msg(1, 2, 10, 11))
	s.takeSpares(msg(2, 2, 11, 12))
	assert.Equal(t, []spareCID{{2, 11}, {3, 12}}, s.rot.spares)
}

func nilIfEmpty(s []spareCID) []spareCID {
	if len(s) == 0 {
		return nil
	}
	return s
}

// TestCIDRotationUnavailable: RotateConnectionID says why it cannot: no
// spare yet, a server's connection, a plaintext one.
func TestCIDRotationUnavailable(t *testing.T) {
	scfg, ccfg := secureConfigs(t)
	scfg.ServerID = []byte{1, 2, 3} // 256 IDs: none to spare
	l := listen(t, scfg)
	serveEcho(t, l)
	c := dial(t, l.Addr().String(), ccfg)
	for range 5 {
		echoOnce(t, c, Message{ID: 6, Payload: []byte("x")})
	}
	assert.ErrorIs(t, c.RotateConnectionID(), ErrNoSpareConnectionID)
	assert.Equal(t, 1, len(func() []uint32 {
		l.cidMu.Lock()
		defer l.cidMu.Unlock()
		var ids []uint32
		for id := range l.cids {
			ids = append(ids, id)
		}
		return ids
	}()), "a 3-byte server ID leaves no IDs to spare")

	plain := listen(t, testConfig())
	serveEcho(t, plain)
	pc := dial(t, plain.Addr().String(), testConfig())
	assert.ErrorIs(t, pc.RotateConnectionID(), errNoRotation)
}
