package knet

import (
	"encoding/binary"
	"testing"
	"time"

	"github.com/knet-go/knet/internal/netsim"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// versionPayload is version v of a state, size bytes.
func versionPayload(v, size int) []byte {
	b := make([]byte, max(size, 4))
	binary.LittleEndian.PutUint32(b, uint32(v))
	return b
}

// checkVersions asserts what the reliable latest-state promise says of what
// h received of states 1..states (ID 120, ContentID k): versions of each
// in increasing order, none twice, and the last one sent (last[k]) among
// them.
func checkVersions(t *testing.T, h *simHost, last map[uint32]int) map[uint32]int {
	t.Helper()
	got := make(map[uint32]int) // versions taken per state
	prev := make(map[uint32]int)
	for _, m := range h.msgs {
		if m.ID < 120 || m.ID >= 130 {
			continue
		}
		v := int(binary.LittleEndian.Uint32(m.Payload))
		if p, ok := prev[m.ID]; ok {
			require.Greater(t, v, p, "state %d: version %d after %d", m.ID, v, p)
		}
		prev[m.ID] = v
		got[m.ID]++
	}
	for k, v := range last {
		assert.Equal(t, v, prev[k], "state %d: the newest version is delivered", k)
	}
	return got
}

// Three values changing faster than the path delivers them (200-byte
// versions every 2ms, 100 KB/s, on a 40 KB/s path with 5% loss): each
// state's versions arrive in order, the newest of each arrives, and far
// fewer bytes go, far sooner done, than as plain reliable messages, which
// all go and are all delivered.
func TestReliableLatestState(t *testing.T) {
	path := netsim.Params{Loss: 0.05, Delay: 40 * time.Millisecond, Jitter: 5 * time.Millisecond, Bandwidth: 40_000, QueueBytes: 8000, Seed: 5}
	run := func(latest bool) (sent uint64, delivered int, took time.Duration, st Stats) {
		p := newSimPair(t, nil, nil, path, path)
		p.connect()
		last := map[uint32]int{}
		for v := 1; v <= 600; v++ {
			id := uint32(120 + v%3)
			m := Message{ID: id, Payload: versionPayload(v, 200), Reliable: true}
			if latest {
				m.ContentID = 1
			}
			p.send(0, m)
			last[id] = v
			p.run(2*time.Millisecond, nil)
		}
		end := p.now
		require.True(t, p.run(60*time.Second, func() bool {
			return p.client().loss.sent.count == 0 && p.client().send.relQ.len() == 0 && (p.client().rlOf() == nil || p.client().rlOf().q.len() == 0)
		}))
		took = p.now.Sub(end)
		p.run(time.Second, nil)
		if latest {
			checkVersions(t, p.h[1], last)
		}
		return p.client().snapshot().BytesSent, len(p.h[1].msgs), took, p.client().snapshot()
	}
	plainBytes, plainGot, plainTook, _ := run(false)
	latestBytes, latestGot, latestTook, st := run(true)
	assert.Equal(t, 600, plainGot, "plain reliable: every message")
	t.Logf("plain reliable: %d bytes sent, 600 delivered, all acked %v after the last send; latest state: %d bytes sent (%.1fx fewer), %d versions delivered, %d replaced, acked %v after",
		plainBytes, plainTook, latestBytes, float64(plainBytes)/float64(latestBytes), latestGot, st.ReplacedMessages, latestTook)
	assert.Less(t, latestBytes*3, plainBytes*2, "latest state sends less")
	assert.Less(t, latestTook, plainTook)
	assert.Positive(t, st.ReplacedMessages)
}

// A version whose datagram is lost is not sent again once a newer one of
// its state is queued; one still the newest goes again in a new datagram,
// and a copy that comes late is dropped, not delivered twice.
func TestReliableLatestStateLostDatagram(t *testing.T) {
	p := newSimPair(t, &Config{Receipts: true}, nil, perfect, perfect)
	p.connect()
	p.run(100*time.Millisecond, nil)
	// Hold the first datagram of versions back, as a slow path would.
	var held []byte
	p.drop = func(from int, b []byte) bool {
		d, _, err := parseDatagram(b)
		if from == 0 && err == nil && held == nil && d.header.reliable && len(d.msgs) > 1 && d.msgs[0].id == idExt {
			held = append([]byte(nil), b...)
			return true
		}
		return false
	}
	a1 := p.send(0, Message{ID: 120, Payload: versionPayload(1, 8), Reliable: true, ContentID: 1})
	b1 := p.send(0, Message{ID: 121, Payload: versionPayload(1, 8), Reliable: true, ContentID: 1})
	p.run(time.Millisecond, nil)
	require.NotNil(t, held)
	a2 := p.send(0, Message{ID: 120, Payload: versionPayload(2, 8), Reliable: true, ContentID: 1})
	require.True(t, p.run(5*time.Second, func() bool { return len(p.h[1].msgs) == 2 }))
	p.run(time.Second, nil)
	// a1 was replaced by a2: not sent again. b1 was the newest: sent again.
	got := map[uint32][]int{}
	for _, m := range p.h[1].msgs {
		got[m.ID] = append(got[m.ID], int(binary.LittleEndian.Uint32(m.Payload)))
	}
	assert.Equal(t, map[uint32][]int{120: {2}, 121: {1}}, got)
	told := receiptsOf(p.h[0].receipts)
	assert.Equal(t, []bool{false}, told[a1], "replaced")
	assert.Equal(t, []bool{true}, told[b1])
	assert.Equal(t, []bool{true}, told[a2])
	// The first datagram comes at last: both its versions are old news.
	p.inject(1, held)
	p.run(100*time.Millisecond, nil)
	assert.Len(t, p.h[1].msgs, 2, "nothing delivered twice or out of date")
	assert.Equal(t, uint64(2), p.server().snapshot().ObsoleteMessages)
	assert.Zero(t, p.client().snapshot().Retransmits, "the lost datagram was not resent as it was")
}

// A version too large for one datagram travels as a fragmented transfer
// with its tag, and is never delivered after a newer small one.
func TestReliableLatestStateFragmented(t *testing.T) {
	p := newSimPair(t, nil, nil, perfect, perfect)
	p.connect()
	p.run(100*time.Millisecond, nil)
	var held [][]byte
	p.drop = func(from int, b []byte) bool {
		d, _, err := parseDatagram(b)
		if from == 0 && err == nil && d.header.reliable && len(d.msgs) > 0 && d.msgs[len(d.msgs)-1].fragment && len(held) < 100 {
			held = append(held, append([]byte(nil), b...))
			return true // the big version is late
		}
		return false
	}
	p.send(0, Message{ID: 120, Payload: versionPayload(1, 6000), Reliable: true, ContentID: 1})
	p.run(5*time.Millisecond, nil)
	require.NotEmpty(t, held)
	p.send(0, Message{ID: 120, Payload: versionPayload(2, 8), Reliable: true, ContentID: 1})
	require.True(t, p.run(time.Second, func() bool { return len(p.h[1].msgs) == 1 }))
	p.drop = nil
	for _, b := range held {
		p.inject(1, b)
	}
	p.run(5*time.Second, nil)
	checkVersions(t, p.h[1], map[uint32]int{120: 2})
	assert.Len(t, p.h[1].msgs, 1)
	assert.Equal(t, uint64(1), p.server().snapshot().ObsoleteMessages)
}

// Forged and hostile tags: a tag naming a message that is no version (in
// order, unreliable, reserved), one that is truncated, a flood of states:
// nothing is dropped that should not be, and the record stays bounded.
func TestReliableLatestStateHostileTags(t *testing.T) {
	p := newSimPair(t, nil, nil, perfect, perfect)
	p.connect()
	p.run(100*time.Millisecond, nil)
	send := func(reliable bool, msgs ...message) {
		pid := p.client().send.nextPID
		p.client().numberNew(reliable)
		h := header{packetID: pid, reliable: reliable}
		b := appendHeader(nil, &h)
		for i := range msgs {
			b = appendMessage(b, &msgs[i])
		}
		p.inject(1, b)
	}
	tag := func(c, v uint32) message {
		b := appendLatestTag(nil, c, v)
		m, _, err := parseMessage(b)
		require.NoError(t, err)
		return m
	}
	// An unreliable message after a tag is a version too (unreliable
	// latest state): a second with the same number is dropped.
	send(false, tag(1, 5), message{id: 120, payload: []byte("u1")})
	send(false, tag(1, 5), message{id: 120, payload: []byte("u2")})
	// A truncated tag tags nothing.
	bad := tag(1, 9)
	bad.payload = bad.payload[:len(bad.payload)-1]
	send(true, bad, message{id: 121, payload: []byte("r1")})
	send(true, bad, message{id: 121, payload: []byte("r2")})
	// Versions: a newer one taken, an older one dropped.
	send(true, tag(1, 10), message{id: 122, payload: []byte("v10")})
	send(true, tag(1, 9), message{id: 122, payload: []byte("v9")})
	p.run(100*time.Millisecond, nil)
	var got []string
	for _, m := range p.h[1].msgs {
		got = append(got, string(m.Payload))
	}
	assert.Equal(t, []string{"u1", "r1", "r2", "v10"}, got)
	// A flood of states stays within the bound.
	for c := range uint32(maxLatestStates + 500) {
		send(true, tag(c+100, 1), message{id: 123, payload: []byte{1}})
	}
	assert.LessOrEqual(t, len(p.server().x.seen.newest), maxLatestStates)
	assert.Equal(t, stateOK, p.server().state)
}

// In a secure session, versions whose datagrams were lost go again under
// new packet numbers: no packet number is ever sealed with two contents
// (newSecureSimPair's ledger), and the promise holds through the loss.
func TestReliableLatestStateSecure(t *testing.T) {
	lossy := netsim.Params{Loss: 0.2, Delay: 10 * time.Millisecond, Jitter: 5 * time.Millisecond, Seed: 9}
	p := newSecureSimPair(t, nil, nil, lossy, lossy)
	p.connect()
	last := map[uint32]int{}
	for v := 1; v <= 300; v++ {
		id := uint32(120 + v%4)
		p.send(0, Message{ID: id, Payload: versionPayload(v, 100), Reliable: true, ContentID: 7})
		last[id] = v
		p.run(3*time.Millisecond, nil)
	}
	require.True(t, p.run(30*time.Second, func() bool {
		return p.client().loss.sent.count == 0 && p.client().latestQueued() == 0
	}))
	p.run(time.Second, nil)
	checkVersions(t, p.h[1], last)
	st := p.client().snapshot()
	assert.Positive(t, st.ReplacedMessages)
}

// In the reference dialect a reliable message with a ContentID is replaced
// by a newer version while both wait in the queue, as the reference does;
// one packed goes as any reliable message.
func TestReliableLatestStateReferenceQueue(t *testing.T) {
	p := newSimPairIn(t, DialectReference, nil, nil, perfect, perfect)
	p.connect()
	p.run(100*time.Millisecond, nil)
	for v := 1; v <= 5; v++ {
		p.send(0, Message{ID: 120, Payload: versionPayload(v, 8), Reliable: true, ContentID: 1})
	}
	require.True(t, p.run(2*time.Second, func() bool { return len(p.h[1].msgs) >= 1 }))
	p.run(time.Second, nil)
	require.Len(t, p.h[1].msgs, 1)
	assert.Equal(t, versionPayload(5, 8), p.h[1].msgs[0].Payload)
	assert.Equal(t, uint64(4), p.client().snapshot().ReplacedMessages)
	// Sent one at a time, each goes.
	for v := 6; v <= 8; v++ {
		p.send(0, Message{ID: 120, Payload: versionPayload(v, 8), Reliable: true, ContentID: 1})
		p.run(200*time.Millisecond, nil)
	}
	assert.Len(t, p.h[1].msgs, 4)
}

// Replacing a queued version costs the same however many states are
// queued: with 20,000 states waiting (a peer that stopped acking), each new
// version of one of them replaces its queued one.
func BenchmarkReplaceQueuedVersion(b *testing.B) {
	p := newSimPair(b, nil, nil, perfect, perfect)
	p.connect()
	p.cut[0] = true // nothing leaves: every version stays queued
	const states = 20_000
	s := p.client()
	b.ReportAllocs()
	payload := make([]byte, 16)
	send := func(k int) {
		o := s.newMsg()
		pbuf := getPayload(len(payload))
		*o = outMsg{ref: Ref(k<<1 | 1), id: 120, payload: append((*pbuf)[:0], payload...), pbuf: pbuf, reliable: true,
			contentID: uint32(k%states + 1), deps: o.deps[:0], after: o.after[:0]}
		s.prepare(o)
		s.enqueue(o)
	}
	for k := range states {
		send(k)
	}
	b.ResetTimer()
	for i := range b.N {
		send(i)
	}
}

// Versions replaced in the queue leave it in sweeps, and only the newest of
// each state goes once the path is back.
func TestReliableLatestStateReplacedInQueue(t *testing.T) {
	p := newSimPair(t, nil, nil, perfect, perfect)
	p.connect()
	p.run(100*time.Millisecond, nil)
	const states, rounds = 200, 4
	// Hold everything at the sender: the window full of a transfer no ack
	// will come for yet.
	p.cut[0] = true
	p.send(0, Message{ID: 121, Payload: make([]byte, 200<<10), Reliable: true})
	p.run(50*time.Millisecond, nil)
	for r := range rounds {
		for k := range states {
			p.send(0, Message{ID: 120, Payload: versionPayload(r*states+k, 8), Reliable: true, ContentID: uint32(k + 1)})
		}
	}
	rl := p.client().rlOf()
	require.NotNil(t, rl)
	assert.LessOrEqual(t, rl.q.len(), 2*states, "swept as it went")
	p.cut[0] = false
	require.True(t, p.run(30*time.Second, func() bool { return p.client().latestQueued() == 0 && p.client().loss.sent.count == 0 }))
	p.run(time.Second, nil)
	got := 0
	for _, m := range p.h[1].msgs {
		if m.ID == 120 {
			got++
			assert.GreaterOrEqual(t, int(binary.LittleEndian.Uint32(m.Payload)), (rounds-1)*states, "only the newest round")
		}
	}
	assert.Equal(t, states, got)
}
