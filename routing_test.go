package knet

import (
	"bytes"
	"encoding/binary"
	"math/bits"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestServerIDFromLiveDatagrams: every datagram a secure client sends to
// a server with a ServerID names that server, as a balancer reads it from
// the wire, before and after the client's NAT rebinds (the connection
// migrates, its ID stays); the ConnectSyn names none.
func TestServerIDFromLiveDatagrams(t *testing.T) {
	scfg, ccfg := secureConfigs(t)
	scfg.ServerID = []byte{0xab, 0xcd}
	_, r, c, sc := behindNAT(t, scfg, ccfg)
	for i := range 5 {
		echoBoth(t, c, byte(i))
	}
	r.rebind()
	second := r.outerAddr()
	before := len(r.recorded())
	for i := range 5 {
		echoBoth(t, c, byte(10+i))
	}
	require.Equal(t, second, sc.RemoteAddr().String(), "the server did not follow the client")
	require.Equal(t, uint64(1), sc.Stats().Migrations)

	var cid [cidSize]byte
	binary.LittleEndian.PutUint32(cid[:], sc.sec.cid)
	assert.Equal(t, []byte{0xab, 0xcd}, cid[:2], "the connection ID starts with the ServerID")
	syns, routed, after := 0, 0, 0
	for i, b := range r.recorded() {
		id, ok := ServerIDFromDatagram(b, 2)
		if syn, _ := isConnectSyn(b); syn {
			syns++
			assert.False(t, ok, "datagram %d: a ConnectSyn carries no connection ID", i)
			continue
		}
		routed++
		if i >= before {
			after++
		}
		if assert.True(t, ok, "datagram %d (%d bytes) not routable", i, len(b)) {
			assert.Equal(t, uint32(0xabcd), id, "datagram %d", i)
		}
		one, ok := ServerIDFromDatagram(b, 1)
		assert.True(t, ok)
		assert.Equal(t, uint32(0xab), one, "datagram %d, one byte", i)
	}
	assert.Positive(t, syns)
	assert.Positive(t, after, "no datagram after the rebinding")
	t.Logf("%d ConnectSyns, %d sealed datagrams (%d after the rebinding) all naming 0xabcd", syns, routed, after)
}

// TestConnectionIDsUnpredictable: the random part of the IDs a listener
// gives differs across 1000 connections (no two equal, no counter), and
// each of its bits is set about half the time.
func TestConnectionIDsUnpredictable(t *testing.T) {
	for _, sid := range [][]byte{nil, {7}, {7, 8}} {
		l := &Listener{cfg: &config{serverID: sid}}
		k := len(sid)
		randBits := 8 * (cidSize - k)
		const n = 1000
		seen := make(map[uint32]bool)
		var ones [32]int
		steps := 0
		var last uint32
		for i := range n {
			id, err := l.newCID(&Conn{})
			require.NoError(t, err)
			var b [cidSize]byte
			binary.LittleEndian.PutUint32(b[:], id)
			require.True(t, bytes.Equal(sid, b[:k]), "sid %x: the prefix of %08x", sid, id)
			assert.False(t, seen[id], "sid %x: id %08x given twice", sid, id)
			seen[id] = true
			rest := randomPart(b, k)
			if i > 0 && rest == last+1 {
				steps++
			}
			last = rest
			for j := range randBits {
				ones[j] += int(rest >> j & 1)
			}
		}
		assert.Less(t, steps, 5, "sid %x: %d IDs one above the one before", sid, steps)
		for j := range randBits {
			assert.InDelta(t, n/2, ones[j], n/10, "sid %x: random bit %d set %d times in %d", sid, j, ones[j], n)
		}
		assert.Len(t, l.cids, n)
	}
}

// randomPart is the bytes of a connection ID after the server ID's k,
// as a number.
func randomPart(b [cidSize]byte, k int) uint32 {
	var v uint32
	for _, c := range b[k:] {
		v = v<<8 | uint32(c)
	}
	return v
}

// TestConnectionIDsExhausted: with a 3-byte ServerID one byte is random:
// a listener gives 256 different IDs, then refuses, and gives one again
// when a connection goes.
func TestConnectionIDsExhausted(t *testing.T) {
	l := &Listener{cfg: &config{serverID: []byte{1, 2, 3}}}
	conns := make([]*Conn, 256)
	for i := range conns {
		conns[i] = &Conn{sec: &secureState{}}
		id, err := l.newCID(conns[i])
		require.NoError(t, err, "id %d", i)
		conns[i].sec.cid = id
	}
	_, err := l.newCID(&Conn{})
	require.ErrorIs(t, err, errNoCID)
	l.dropCID(conns[100])
	id, err := l.newCID(&Conn{})
	require.NoError(t, err)
	assert.Equal(t, conns[100].sec.cid, id)

	// A zero ID is never given, even when the ServerID is zeros.
	l = &Listener{cfg: &config{serverID: []byte{0, 0, 0}}}
	for range 255 {
		id, err := l.newCID(&Conn{})
		require.NoError(t, err)
		require.NotZero(t, id)
	}
	_, err = l.newCID(&Conn{})
	require.ErrorIs(t, err, errNoCID)
}

func TestServerIDConfigErrors(t *testing.T) {
	scfg, _ := secureConfigs(t)
	scfg.ServerID = []byte{1, 2, 3, 4}
	_, err := Listen("udp", "127.0.0.1:0", scfg)
	require.ErrorContains(t, err, "Config.ServerID of 4 bytes, at most 3")

	plain := testConfig()
	plain.ServerID = []byte{1}
	_, err = Listen("udp", "127.0.0.1:0", plain)
	require.ErrorContains(t, err, "needs Config.PrivateKey")

	scfg.ServerID = []byte{1, 2, 3}
	l, err := Listen("udp", "127.0.0.1:0", scfg)
	require.NoError(t, err)
	require.NoError(t, l.Close())
}

// routingSamples are datagrams for ServerIDFromDatagram: sealed ones of a
// client whose ID is 01 02 03 04 on the wire, and ones that carry none.
func routingSamples(t testing.TB) (sealed, none [][]byte) {
	c, _ := securePair(t)
	c.cid = binary.LittleEndian.Uint32([]byte{1, 2, 3, 4})
	for i, d := range [][]byte{
		plainDatagram(0, true, []byte("x")),
		appendHeader(nil, &header{packetID: 1, inOrder: true, deltas: []uint16{200}, indices: []uint16{1}}),
		appendHeader(nil, &header{packetID: 2}),
	} {
		b, err := c.seal(nil, d, uint64(i), true)
		require.NoError(t, err)
		sealed = append(sealed, b)
	}
	_, syn, err := newClientSecure(c.serverKey, nil, []byte("hello"))
	require.NoError(t, err)
	synDg := appendHeader(nil, &header{})
	synDg = appendMessage(synDg, &message{id: idConnectSyn, payload: syn})
	synDg = appendMessage(synDg, &message{id: idPadding, payload: make([]byte, 1200-len(synDg)-4)})
	var nonce [queryNonceSize]byte
	query := appendQueryDatagram(nil, queryKindQuery, &nonce, nil, 1200)
	zero := appendHeader(nil, &header{packetID: 9})
	zero = append(zero, make([]byte, cidSize+sealOverhead+3)...)
	none = [][]byte{nil, {0, 0}, sealed[2][:len(sealed[2])-1], synDg, query, zero}
	return sealed, none
}

func TestServerIDFromDatagram(t *testing.T) {
	sealed, none := routingSamples(t)
	for i, b := range sealed {
		for k, want := range []uint32{0, 0x01, 0x0102, 0x010203, 0} {
			id, ok := ServerIDFromDatagram(b, k)
			valid := k >= 1 && k <= MaxServerIDSize
			assert.Equal(t, valid, ok, "datagram %d, idLen %d", i, k)
			assert.Equal(t, want, id, "datagram %d, idLen %d", i, k)
		}
	}
	for i, b := range none {
		_, ok := ServerIDFromDatagram(b, 2)
		assert.False(t, ok, "datagram %d carries no connection ID", i)
	}
	syn := none[3]
	require.Zero(t, testing.AllocsPerRun(100, func() { ServerIDFromDatagram(sealed[1], 2) }))
	require.Zero(t, testing.AllocsPerRun(100, func() { ServerIDFromDatagram(syn, 2) }))
}

// FuzzServerIDFromDatagram: the balancer's reader never panics, and what
// it reads is the leading bytes of the connection ID the server would
// route on (sealedCID).
func FuzzServerIDFromDatagram(f *testing.F) {
	sealed, none := routingSamples(f)
	for _, b := range append(sealed, none...) {
		f.Add(b, 2)
	}
	f.Fuzz(func(t *testing.T, b []byte, idLen int) {
		id, ok := ServerIDFromDatagram(b, idLen)
		if !ok {
			if id != 0 {
				t.Fatal("an ID with ok false")
			}
			return
		}
		cid, found := sealedCID(b)
		if !found || idLen < 1 || idLen > MaxServerIDSize {
			t.Fatalf("ok for idLen %d, a datagram the server finds no ID in", idLen)
		}
		var w [cidSize]byte
		binary.BigEndian.PutUint32(w[:], bits.ReverseBytes32(cid)) // the wire's order
		if want := randomPart(w, 0) >> (8 * (cidSize - idLen)); id != want {
			t.Fatalf("id %x, the ID's first %d bytes are %x", id, idLen, want)
		}
	})
}
