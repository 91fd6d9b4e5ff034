package knet

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/netsim"
)

func randomPayload(seed uint64, n int) []byte {
	rng := rand.New(rand.NewPCG(seed, 99))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
	return b
}

func TestFragmentSizes(t *testing.T) {
	c := (&Config{}).resolve()
	assert.Equal(t, 386, c.fragSize()) // 453 at the former 1400
	// Three fragments with their headers fit one default datagram.
	assert.LessOrEqual(t, minHeaderSize+3*(c.fragSize()+7), defaultMaxDatagramSize)
	for _, size := range []int{256, 300, 576, 1400, 9000, 65000} {
		c := (&Config{MaxDatagramSize: size}).resolve()
		assert.Less(t, c.fragSize(), c.wholeLimit(), "size %d", size)
		assert.LessOrEqual(t, c.fragSize(), c.maxFragment)
		assert.Positive(t, c.fragSize())
	}
}

func TestLargeMessagesLossy(t *testing.T) {
	t.Parallel()
	p := newSimPair(t, nil, nil, lossy(21, 0.05), lossy(22, 0.05))
	p.connect()
	sizes := []int{2 << 10, 70 << 10, 1 << 20, 3 << 20}
	for i, n := range sizes {
		p.send(0, Message{ID: 400 + uint32(i), Payload: randomPayload(uint64(i), n), Reliable: true})
		for j := range 20 { // small ones interleaved
			p.send(0, numbered(100, i*20+j, 30))
		}
	}
	require.True(t, p.run(5*time.Minute, func() bool { return len(p.h[1].msgs) == len(sizes)*21 }))
	small := 0
	for _, m := range p.h[1].msgs {
		if m.ID == 100 {
			small++
			continue
		}
		i := int(m.ID - 400)
		assert.Equal(t, sha256.Sum256(randomPayload(uint64(i), sizes[i])), sha256.Sum256(m.Payload), "message of %d bytes", sizes[i])
	}
	assert.Equal(t, 80, small)
	assert.Zero(t, p.server().recv.reasm.active)
	assert.Zero(t, p.server().recv.reasm.bytes)
}

func TestSmallMessagesOvertakeBulk(t *testing.T) {
	// Small messages queued behind a 1 MB message go out without waiting
	// for all of its fragments.
	p := newSimPair(t, nil, nil, netsim.Params{Delay: 10 * time.Millisecond}, netsim.Params{Delay: 10 * time.Millisecond})
	p.connect()
	p.send(0, Message{ID: 401, Payload: randomPayload(1, 1<<20), Reliable: true})
	p.send(0, Message{ID: 100, Payload: []byte("small"), Reliable: true})
	require.True(t, p.run(time.Minute, func() bool { return len(p.h[1].msgs) == 2 }))
	assert.Equal(t, uint32(100), p.h[1].msgs[0].ID)
}

func TestLargeInOrderMessageKeepsItsPlace(t *testing.T) {
	p := newSimPair(t, nil, nil, lossy(31, 0.05), lossy(32, 0.05))
	p.connect()
	for i := range 30 {
		size := 50
		if i%10 == 5 {
			size = 100 << 10
		}
		m := chanMsg(2, i, true, size)
		p.send(0, m)
	}
	require.True(t, p.run(time.Minute, func() bool { return len(p.h[1].msgs) == 30 }))
	for i, m := range p.h[1].msgs {
		_, seq := chanOf(m)
		require.Equal(t, i, seq)
	}
}

func TestUnreliableLargeMessageTravelsReliably(t *testing.T) {
	p := newSimPair(t, nil, nil, lossy(41, 0.1), lossy(42, 0.1))
	p.connect()
	payload := randomPayload(5, 50<<10)
	p.send(0, Message{ID: 402, Payload: payload}) // unreliable, yet must be fragmented
	require.True(t, p.run(time.Minute, func() bool { return len(p.h[1].msgs) == 1 }))
	assert.True(t, bytes.Equal(payload, p.h[1].msgs[0].Payload))
}

func TestTransferIDsReusedOnlyWhenAcked(t *testing.T) {
	// More large messages than TransferIDs, over a lossy path.
	p := newSimPair(t, &Config{MaxDatagramSize: 300}, nil, lossy(51, 0.05), lossy(52, 0.05))
	p.connect()
	const n = 300
	for i := range n {
		p.send(0, Message{ID: 403, Payload: randomPayload(uint64(i), 600+i), Reliable: true})
	}
	require.True(t, p.run(5*time.Minute, func() bool { return len(p.h[1].msgs) == n }))
	got := map[int]bool{}
	for _, m := range p.h[1].msgs {
		i := len(m.Payload) - 600
		require.Equal(t, randomPayload(uint64(i), 600+i), m.Payload)
		got[i] = true
	}
	assert.Len(t, got, n)
	require.True(t, p.run(time.Minute, func() bool { return p.client().loss.sent.count == 0 }))
	assert.Zero(t, p.client().send.tids.inUse, "every TransferID free once all is acked")
}

// fragmentsOf cuts payload into fragment messages as a peer would.
func fragmentsOf(id uint32, tid uint8, payload []byte, size int) []message {
	count := (len(payload) + size - 1) / size
	var out []message
	for i := range count {
		part := payload[i*size : min(len(payload), (i+1)*size)]
		m := message{fragment: true, transferID: tid, fragNumber: uint32(i), payload: part}
		if i == 0 {
			m.fragStart, m.id, m.fragCount = true, id, uint32(count)
		}
		out = append(out, m)
	}
	return out
}

func TestReassemblyAnyOrder(t *testing.T) {
	r := reassembly{budget: 1 << 20, maxMessage: 1 << 20}
	payload := randomPayload(3, 5000)
	frags := fragmentsOf(6, 9, payload, 470)
	rng := rand.New(rand.NewPCG(4, 4))
	rng.Shuffle(len(frags), func(i, j int) { frags[i], frags[j] = frags[j], frags[i] })
	var got []byte
	for i := range frags {
		tr, whole, err := r.add(&frags[i], msgRef{pid: uint32(i)}, &startOrder{reliable: true})
		require.NoError(t, err)
		if whole != nil {
			got = whole
			r.finish(tr)
		}
	}
	assert.Equal(t, payload, got)
	assert.Zero(t, r.bytes)
	assert.Zero(t, r.active)
}

func TestReassemblyDropsRepeatedCopies(t *testing.T) {
	// A fragment that comes twice with the same bytes (a sender that
	// repacked a datagram it took for lost, pmtu.go) is dropped: the
	// message is whole and right, and its record given back.
	payload := randomPayload(7, 1000)
	frag := func(n int) message {
		return message{fragment: true, fragNumber: uint32(n), payload: payload[n*250 : (n+1)*250]}
	}
	start := message{fragStart: true, fragment: true, id: 6, fragCount: 4, payload: payload[:250]}
	for _, order := range [][]message{
		{start, frag(1), frag(1), frag(2), frag(3)},
		{frag(2), start, frag(2), frag(1), frag(2), frag(3)},
		{start, frag(1), frag(2), frag(3)}, // no copy: complete at once
	} {
		r := reassembly{budget: 1 << 20, maxMessage: 1 << 20}
		var got []byte
		for i := range order {
			tr, msg, err := r.add(&order[i], msgRef{pid: uint32(i)}, &startOrder{})
			require.NoError(t, err)
			if msg != nil {
				require.Nil(t, got, "completed once")
				got = append([]byte(nil), msg...)
				r.finish(tr)
			}
		}
		assert.Equal(t, payload, got)
		assert.Zero(t, r.bytes, "the copies' records given back")
	}
}

func TestReassemblyHostile(t *testing.T) {
	for _, tt := range []struct {
		name  string
		frags []message
		err   error
	}{
		{"count too large", []message{{fragStart: true, fragment: true, id: 6, fragCount: 1 << 29, payload: make([]byte, 400)}}, errFragTooLarge},
		{"count 1", []message{{fragStart: true, fragment: true, id: 6, fragCount: 1, payload: []byte{1}}}, errFragCount},
		{"number past count", []message{
			{fragStart: true, fragment: true, id: 6, fragCount: 2, payload: []byte{1}},
			{fragment: true, fragNumber: 5, payload: []byte{1}},
		}, errFragNumber},
		{"number past count, before the start", []message{
			{fragment: true, fragNumber: 5, payload: []byte{1}},
			{fragStart: true, fragment: true, id: 6, fragCount: 2, payload: []byte{1}},
		}, errFragNumber},
		{"second start", []message{
			{fragStart: true, fragment: true, id: 6, fragCount: 3, payload: []byte{1}},
			{fragStart: true, fragment: true, id: 6, fragCount: 3, payload: []byte{1}},
		}, errFragRestart},
		{"repeated number", []message{
			{fragStart: true, fragment: true, id: 6, fragCount: 3, payload: []byte{1}},
			{fragment: true, fragNumber: 1, payload: []byte{1}},
			{fragment: true, fragNumber: 1, payload: []byte{2}},
		}, errFragDuplicate},
		{"reserved ID", []message{{fragStart: true, fragment: true, id: idDisconnect, fragCount: 2, payload: []byte{1}}}, errFragControl},
		{"empty fragments without end", emptyFragments(3000/minFragAverage + 10), errFragTooMany},
		{"more bytes than a message", []message{
			{fragment: true, fragNumber: 1, payload: make([]byte, 2000)},
			{fragment: true, fragNumber: 2, payload: make([]byte, 2000)},
		}, errFragTooLarge},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r := reassembly{budget: 1 << 20, maxMessage: 3000}
			var err error
			for i := range tt.frags {
				if _, _, err = r.add(&tt.frags[i], msgRef{pid: uint32(i)}, &startOrder{}); err != nil {
					break
				}
			}
			assert.ErrorIs(t, err, tt.err)
		})
	}
}

func TestReassemblyBudget(t *testing.T) {
	r := reassembly{budget: 10000, maxMessage: 100000}
	// The oldest transfer may grow past the budget; others may not.
	oldest := fragmentsOf(6, 1, randomPayload(1, 50000), 1000)
	other := fragmentsOf(6, 2, randomPayload(2, 50000), 1000)
	_, _, err := r.add(&oldest[0], msgRef{pid: 1}, &startOrder{})
	require.NoError(t, err)
	_, _, err = r.add(&other[0], msgRef{pid: 2}, &startOrder{})
	require.NoError(t, err)
	admitted := 0
	for i := 1; i < len(other); i++ {
		if !r.admits(2, 1000) {
			break
		}
		_, _, err := r.add(&other[i], msgRef{pid: uint32(10 + i)}, &startOrder{})
		require.NoError(t, err)
		admitted++
	}
	assert.Less(t, admitted, 10)
	assert.False(t, r.admits(2, 1000), "transfer 2 started after 1: held to the budget")
	assert.True(t, r.admits(1, 1000), "transfer 1 is the oldest")
	for i := 1; i < len(oldest); i++ {
		require.True(t, r.admits(1, 1000))
		_, whole, err := r.add(&oldest[i], msgRef{pid: uint32(100 + i)}, &startOrder{})
		require.NoError(t, err)
		if i == len(oldest)-1 {
			assert.Len(t, whole, 50000)
		}
	}
}

func TestHostileFragmentCountCutsOffPeer(t *testing.T) {
	p := newSimPair(t, nil, &Config{MaxMessageSize: 1 << 20}, perfect, perfect)
	p.connect()
	d := datagram{header: header{packetID: p.client().send.nextPID, reliable: true}, msgs: []message{
		{fragStart: true, fragment: true, id: 6, fragCount: 1 << 28, transferID: 1, payload: make([]byte, 400)},
	}}
	p.inject(1, appendDatagram(nil, &d))
	assert.Equal(t, stateDone, p.server().state)
	var pe *ProtocolError
	assert.ErrorAs(t, p.server().err, &pe)
	assert.Equal(t, uint64(1), p.server().stats.ProtocolErrors)
	assert.Zero(t, p.server().recv.reasm.bytes)
}

func TestNeverFinishedTransfersStayBounded(t *testing.T) {
	// A peer opens transfer after transfer and never finishes one: what we
	// hold stays within the budget plus one message, and the overflow goes
	// unacked.
	cfg := &Config{ReassemblyBuffer: 64 << 10, MaxMessageSize: 256 << 10}
	p := newSimPair(t, nil, cfg, perfect, perfect)
	p.connect()
	pid := p.client().send.nextPID
	for tid := range 256 {
		for k := range 40 {
			m := message{fragment: true, transferID: uint8(tid), fragNumber: uint32(k + 1), payload: make([]byte, 1000)}
			if k == 0 {
				m = message{fragStart: true, fragment: true, id: 6, transferID: uint8(tid), fragCount: 200, payload: make([]byte, 1000)}
			}
			d := datagram{header: header{packetID: pid, reliable: true}, msgs: []message{m}}
			pid++
			p.inject(1, appendDatagram(nil, &d))
		}
	}
	assert.LessOrEqual(t, p.server().recv.reasm.bytes, 64<<10+256<<10+maxContentLength+fragRecordCost*(256<<10/minFragAverage+2))
	assert.Positive(t, p.server().stats.DroppedDatagrams)
	assert.Equal(t, stateOK, p.server().state)
}

func FuzzReassembly(f *testing.F) {
	f.Add([]byte{0, 1, 2, 3}, uint16(5000), uint16(470))
	f.Add([]byte{9, 9, 9, 9, 200, 13, 77}, uint16(20000), uint16(100))
	f.Add([]byte{}, uint16(1), uint16(1))
	f.Fuzz(func(t *testing.T, script []byte, size, fragSize uint16) {
		if fragSize == 0 || size < 2 || int(size) <= int(fragSize) {
			return
		}
		const maxMessage = 40000
		r := reassembly{budget: 8000, maxMessage: maxMessage}
		payloads := [][]byte{randomPayload(uint64(size), int(size)), randomPayload(uint64(fragSize), int(size)/2+int(fragSize)+1)}
		var frags []message
		for k, pl := range payloads {
			frags = append(frags, fragmentsOf(6+uint32(k), uint8(k), pl, int(fragSize))...)
		}
		// The script shuffles, repeats and corrupts the fragments.
		rng := rand.New(rand.NewPCG(uint64(len(script)), binary.LittleEndian.Uint64(append(append([]byte{}, script...), make([]byte, 8)...))))
		rng.Shuffle(len(frags), func(i, j int) { frags[i], frags[j] = frags[j], frags[i] })
		var got [2][]byte
		failed := false
		meddled := map[uint8]bool{}
		for i := range frags {
			if i < len(script) && script[i]%7 == 0 {
				frags[i].fragNumber += uint32(script[i]) // hostile number
				meddled[frags[i].transferID] = true
			}
			if i < len(script) && script[i]%11 == 0 {
				meddled[frags[i].transferID] = true
				frags[i].transferID = script[i] // foreign transfer
				meddled[script[i]] = true
			}
		}
		// A fragment the budget refuses comes again later, as the
		// sender's retransmission would.
		for i := 0; i < len(frags) && !failed; i++ {
			m := frags[i]
			if !r.admits(m.transferID, len(m.payload)) {
				if len(frags) < 100000 {
					frags = append(frags, m)
				}
				continue
			}
			tr, whole, err := r.add(&m, msgRef{pid: uint32(i)}, &startOrder{reliable: true})
			if err != nil {
				failed = true // the peer would be cut off
				break
			}
			require.LessOrEqual(t, r.bytes, 8000+maxMessage+maxContentLength+fragRecordCost*(maxMessage/minFragAverage+2))
			if whole != nil {
				if tr.id >= 6 && tr.id <= 7 && got[tr.id-6] == nil {
					got[tr.id-6] = append([]byte(nil), whole...)
				}
				r.finish(tr)
			}
		}
		if failed {
			return
		}
		// A transfer the script left alone is intact if it completes,
		// and with no meddling at all every transfer completes. (A
		// transfer that lost a fragment to meddling never ends and may
		// hold the budget against the other: a broken peer's problem.)
		for k := range got {
			if meddled[uint8(k)] {
				continue
			}
			if len(meddled) == 0 {
				require.NotNil(t, got[k], "transfer %d never completed", k)
			}
			if got[k] != nil {
				require.Equal(t, payloads[k], got[k])
			}
		}
	})
}

func emptyFragments(n int) []message {
	out := []message{{fragStart: true, fragment: true, id: 6, fragCount: 1 << 29}}
	for i := 1; i < n; i++ {
		out = append(out, message{fragment: true, fragNumber: uint32(i)})
	}
	return out
}

func TestReassemblyEmptyStart(t *testing.T) {
	// The first fragment may carry the MessageID alone.
	r := reassembly{budget: 1 << 20, maxMessage: 1 << 20}
	frags := []message{
		{fragStart: true, fragment: true, id: 6, fragCount: 3},
		{fragment: true, fragNumber: 2, payload: []byte("lo")},
		{fragment: true, fragNumber: 1, payload: []byte("hel")},
	}
	var whole []byte
	for i := range frags {
		_, w, err := r.add(&frags[i], msgRef{pid: uint32(i)}, &startOrder{})
		require.NoError(t, err)
		if w != nil {
			whole = w
		}
	}
	assert.Equal(t, "hello", string(whole))
}

// A large transfer's arena follows the bytes received, never the size its
// FragmentStart announces (a hostile peer could announce MaxMessageSize in
// one datagram): it grows in pooled buffers, at most four times what came; in
// order, the arena is the message, lent without a copy.
func TestReassemblyGrowsWithTheBytes(t *testing.T) {
	r := reassembly{budget: 200 << 10, maxMessage: 1 << 20}
	payload := randomPayload(5, 300<<10)
	frags := fragmentsOf(6, 1, payload, 470)
	_, _, err := r.add(&frags[0], msgRef{pid: 1}, &startOrder{reliable: true})
	require.NoError(t, err)
	assert.Less(t, cap(r.get(1).arena), 300<<10, "nothing reserved from the announced size")
	var whole []byte
	var tr *transfer
	for i := 1; i < len(frags); i++ {
		tr, whole, err = r.add(&frags[i], msgRef{pid: uint32(10 + i)}, &startOrder{})
		require.NoError(t, err)
		if whole == nil {
			got := len(r.get(1).arena)
			assert.LessOrEqual(t, cap(r.get(1).arena), max(4*got, 2*smallArena), "at most four times the bytes received (doubling, in power-of-two buffers)")
		}
	}
	require.Equal(t, payload, whole)
	b := r.lend(tr, whole)
	require.NotNil(t, b)
	assert.Same(t, &(*b)[0], &whole[0])
	assert.Zero(t, r.reserved)
	r.finish(tr)
	assert.Equal(t, payload, whole, "finish leaves a lent arena alone")
	putPayload(b)
}

// Fragments longer than the FragmentStart announced go past its bound;
// the message is still whole.
func TestReassemblyOutgrowsAnnounced(t *testing.T) {
	r := reassembly{budget: 1 << 20, maxMessage: 1 << 20}
	payload := randomPayload(7, 200<<10)
	const first = 80 << 10 // announcing 160 KiB, 200 KiB to come
	frags := []message{
		{fragStart: true, fragment: true, id: 6, transferID: 3, fragCount: 2, payload: payload[:first]},
		{fragment: true, transferID: 3, fragNumber: 1, payload: payload[first:]},
	}
	_, _, err := r.add(&frags[0], msgRef{pid: 1}, &startOrder{})
	require.NoError(t, err)
	tr, whole, err := r.add(&frags[1], msgRef{pid: 2}, &startOrder{})
	require.NoError(t, err)
	require.Equal(t, payload, whole)
	if b := r.lend(tr, whole); b != nil {
		putPayload(b)
	}
	r.finish(tr)
	assert.Zero(t, r.bytes)
	assert.Zero(t, r.reserved)
}

// A message add returned stays the caller's after finish when it was not
// lent: finish does not put its arena back in the pool.
func TestReassemblyFinishWithoutLend(t *testing.T) {
	r := reassembly{budget: 1 << 20, maxMessage: 1 << 20}
	payload := randomPayload(8, 100<<10)
	frags := fragmentsOf(6, 4, payload, 470)
	var whole []byte
	var tr *transfer
	for i := range frags {
		var err error
		tr, whole, err = r.add(&frags[i], msgRef{pid: uint32(i)}, &startOrder{reliable: true})
		require.NoError(t, err)
	}
	r.finish(tr)
	assert.Zero(t, r.reserved)
	for range 4 {
		b := getPayload(len(payload))
		assert.NotSame(t, &(*b)[:1][0], &whole[0], "the message's arena was pooled")
		*b = append((*b)[:0], make([]byte, len(payload))...)
		putPayload(b)
	}
	assert.Equal(t, payload, whole)
}

// A transfer whose fragments are all empty is an empty message: add
// returned the transfer's nil arena, which read as incomplete, so the
// message never came and the next FragmentStart on the TransferID was a
// second start, a *ProtocolError (issue 38).
func TestReassemblyAllEmpty(t *testing.T) {
	r := reassembly{budget: 1 << 20, maxMessage: 1 << 20}
	for round := range 4 {
		// In order, then out of order (the message is then a copy).
		frags := []message{{fragStart: true, fragment: true, id: 6, fragCount: 3}, {fragment: true, fragNumber: 1}, {fragment: true, fragNumber: 2}}
		if round%2 == 1 {
			frags[1], frags[2] = frags[2], frags[1]
		}
		var whole []byte
		var done *transfer
		for i := range frags {
			tr, w, err := r.add(&frags[i], msgRef{pid: uint32(10*round + i)}, &startOrder{})
			require.NoError(t, err, "round %d", round)
			if w != nil {
				whole, done = w, tr
			}
		}
		require.NotNil(t, whole, "round %d: the transfer never completed", round)
		assert.Empty(t, whole)
		r.finish(done)
	}
	assert.Zero(t, r.active)
	assert.Zero(t, r.bytes)
}

// The same over a session: the empty message is delivered, and the
// TransferID is free for the next transfer.
func TestEmptyFragmentedMessageDelivered(t *testing.T) {
	p := newSimPair(t, nil, nil, perfect, perfect)
	p.connect()
	pid := p.client().send.nextPID
	for round := range 2 {
		d := datagram{header: header{packetID: pid, reliable: true}, msgs: []message{
			{fragStart: true, fragment: true, id: 6, fragCount: 3, transferID: 9},
			{fragment: true, transferID: 9, fragNumber: 1},
			{fragment: true, transferID: 9, fragNumber: 2},
		}}
		pid++
		p.inject(1, appendDatagram(nil, &d))
		require.Equal(t, stateOK, p.server().state, "round %d: %v", round, p.server().err)
		require.Len(t, p.h[1].msgs, round+1)
		assert.Empty(t, p.h[1].msgs[round].Payload)
	}
}
