package knet

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The cadence: the first skip within 2*skipFirstPeriod reliable
// datagrams, each gap within twice the period, which doubles up to
// skipMaxPeriod; never two skips in a row. From crypto/rand, and from a
// seed alike.
func TestSkipCadence(t *testing.T) {
	for _, seed := range []uint64{0, 1, 38} {
		k := newSkipState(seed)
		period := skipFirstPeriod
		var gaps []int
		gap := 0
		for range 200_000 {
			gap++
			if k.due() {
				gaps = append(gaps, gap)
				gap = 0
			}
		}
		require.NotEmpty(t, gaps)
		sum := 0
		for i, g := range gaps {
			assert.GreaterOrEqual(t, g, 1, "seed %d: gap %d", seed, i)
			assert.LessOrEqual(t, g, 2*period, "seed %d: gap %d", seed, i)
			if i >= 7 {
				sum += g
			}
			period = min(2*period, skipMaxPeriod)
		}
		// At the top period the gaps average about skipMaxPeriod.
		mean := float64(sum) / float64(len(gaps)-7)
		assert.InDelta(t, skipMaxPeriod, mean, skipMaxPeriod/4, "seed %d: mean gap at the top period", seed)
		assert.LessOrEqual(t, gaps[0], 2*skipFirstPeriod, "seed %d: the first skip comes early", seed)
	}
}

// The same seed, the same skips: a pair of sessions replays exactly.
func TestSkipSeeded(t *testing.T) {
	a, b := newSkipState(7), newSkipState(7)
	for i := range 10_000 {
		require.Equal(t, a.due(), b.due(), "datagram %d", i)
	}
}

// Skips are remembered while an ack of them could name what is in flight
// (within recvSpan of the next PacketID), across the 22-bit wrap, and at
// most skipMemory of them.
func TestSkipMemory(t *testing.T) {
	k := newSkipState(1)
	start := uint32(packetIDMask - 100)
	id := func(i int) uint32 { return (start + uint32(i)*50) & packetIDMask }
	for i := range 10 {
		k.add(id(i))
	}
	next := (id(9) + 2) & packetIDMask
	for i := range 10 {
		got, ok := k.named(packetAck{base: id(i)}, next)
		assert.True(t, ok, "skip %d (PacketID %d), across the wrap", i, id(i))
		assert.Equal(t, id(i), got)
		got, ok = k.named(packetAck{base: (id(i) - 3) & packetIDMask, more: 1<<2 | 1<<4}, next)
		assert.True(t, ok, "skip %d named in a PacketAck's bits", i)
		assert.Equal(t, id(i), got)
		_, ok = k.named(packetAck{base: (id(i) - 3) & packetIDMask, more: 1<<1 | 1<<3 | 1<<33}, next)
		assert.False(t, ok, "the PacketIDs around skip %d", i)
		_, ok = k.named(packetAck{base: (id(i) + 1) & packetIDMask, more: 1<<34 - 1}, next)
		assert.False(t, ok, "the 35 PacketIDs after skip %d", i)
	}
	// recvSpan later, the oldest are forgotten.
	later := (id(0) + recvSpan) & packetIDMask
	_, ok := k.named(packetAck{base: id(0)}, later)
	assert.False(t, ok, "forgotten: recvSpan before the next PacketID")
	_, ok = k.named(packetAck{base: id(1)}, later)
	assert.True(t, ok)
	assert.Equal(t, 9, k.n)

	// At most skipMemory: the oldest goes.
	k = newSkipState(1)
	for i := range skipMemory + 5 {
		k.add(uint32(10 + 4*i))
	}
	assert.Equal(t, skipMemory, k.n)
	next = uint32(10 + 4*(skipMemory+5))
	_, ok = k.named(packetAck{base: 10}, next)
	assert.False(t, ok)
	_, ok = k.named(packetAck{base: 10 + 4*5}, next)
	assert.True(t, ok)
}

// A session skips PacketIDs after reliable datagrams only, in its
// numbering and its packet numbers alike (a secure session seals with
// them), remembers what it skipped, and an ack naming a skipped
// PacketID, or one not sent yet, is a lie (ackedUnsent); an ack of a
// PacketID sent, reliable or not, or older than any sent, is not.
func TestSessionSkipsPacketIDs(t *testing.T) {
	s := newSession(new(Config).resolve(), new(simHost), true, DialectSpec, timeZero)
	s.send.skips = newSkipState(5)
	s.startPIDAt(packetIDMask - 300) // across the wrap
	first := s.send.nextPID
	var sent, skipped []uint32
	for i := range 2000 {
		pid := s.send.nextPID
		reliable := i%3 != 0
		pn := s.send.nextPN
		s.numberNew(reliable)
		require.Equal(t, pn, s.lastOut().pn)
		require.Equal(t, pid, uint32(s.lastOut().pn)&packetIDMask)
		sent = append(sent, pid)
		if d := seqDiff(pid, s.send.nextPID); d != 1 {
			require.Equal(t, int32(2), d, "one PacketID skipped at a time")
			require.True(t, reliable, "skips follow reliable datagrams")
			skipped = append(skipped, (pid+1)&packetIDMask)
		}
		require.Equal(t, uint32(s.send.nextPN)&packetIDMask, s.send.nextPID)
	}
	require.GreaterOrEqual(t, len(skipped), 4, "the first skips come early")
	assert.Less(t, seqDiff(first, skipped[0]), int32(3*2*skipFirstPeriod/2+2))
	for _, id := range skipped {
		assert.Error(t, s.ackedUnsent(packetAck{base: id}), "skipped PacketID %d", id)
		assert.Error(t, s.ackedUnsent(packetAck{base: (id - 1) & packetIDMask, more: 1}), "skipped PacketID %d, in a PacketAck's bits", id)
	}
	for _, id := range sent {
		assert.NoError(t, s.ackedUnsent(packetAck{base: id}), "sent PacketID %d", id)
	}
	assert.NoError(t, s.ackedUnsent(packetAck{base: (first - 1000) & packetIDMask, more: 1<<34 - 1}), "before the first sent")
	next := s.send.nextPID
	assert.Error(t, s.ackedUnsent(packetAck{base: next}), "the next PacketID")
	assert.Error(t, s.ackedUnsent(packetAck{base: (next - 34) & packetIDMask, more: 1 << 33}), "the next, in a PacketAck's bits")
	assert.Error(t, s.ackedUnsent(packetAck{base: (next + 1<<21 - 1) & packetIDMask}), "half the PacketIDs are ahead")
	assert.NoError(t, s.ackedUnsent(packetAck{base: (next + 1<<21 + 1) & packetIDMask}), "the other half behind")
}

// In either dialect, a peer's ack of a PacketID the sender skipped, or of
// one it has not sent yet, ends the connection with a *ProtocolError; a
// transfer between honest peers, through the skips, goes as before.
func TestAckOfUnsentEndsConnection(t *testing.T) {
	for _, dialect := range []Dialect{DialectSpec, DialectReference} {
		for _, lie := range []string{"skipped", "next", "far"} {
			t.Run(fmt.Sprint(dialect, "/", lie), func(t *testing.T) {
				p := newSimPairIn(t, dialect, nil, nil, perfect, perfect)
				p.connect()
				for i := range 300 {
					p.send(0, numbered(100, i, 200))
				}
				c := p.client()
				require.True(t, p.run(10*time.Second, func() bool { return len(p.h[1].msgs) == 300 && c.loss.sent.count == 0 }))
				require.NoError(t, c.err)
				require.Positive(t, c.send.skips.n, "PacketIDs skipped")
				var id uint32
				switch lie {
				case "skipped":
					id = c.send.skips.at(c.send.skips.n - 1)
				case "next":
					id = c.send.nextPID
				case "far":
					id = (c.send.nextPID + 5000) & packetIDMask
				}
				// An ack again of what was acked is no lie: the reliable
				// datagram a skip follows, say.
				p.inject(0, ackDatagram(p.server(), packetAck{base: (c.send.skips.at(0) - 1) & packetIDMask}))
				require.NoError(t, c.err)
				p.inject(0, ackDatagram(p.server(), packetAck{base: id}))
				var pe *ProtocolError
				require.ErrorAs(t, c.err, &pe)
				assert.Equal(t, uint64(1), c.stats.ProtocolErrors)
				assert.Equal(t, stateDone, c.state)
			})
		}
	}
}

// ackDatagram is an unreliable datagram of s's, in its dialect, holding a
// PacketAck a.
func ackDatagram(s *session, a packetAck) []byte {
	var b []byte
	if _, ok := s.wire.(*cppWire); ok {
		b = appendCppHeader(nil, &cppHeader{packetID: s.send.nextPID})
	} else {
		b = appendHeader(nil, &header{packetID: s.send.nextPID})
	}
	s.numberNew(false)
	return s.wire.appendAck(b, a)
}
