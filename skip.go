package knet

// Skipped PacketIDs (issue 38): the sender's test of the peer's acks. A
// peer that acks what it never received (an optimistic acker) has the
// sender take the datagrams the path dropped for delivered, and pour
// more into the path than it carries. Now and then, at random, a
// PacketID is left out, never sent; an ack naming one is a lie that no
// honest peer can tell, and ends the connection (session.ackedUnsent), as
// QUIC's endpoints do (RFC 9000 §21.4). A plain struct; the session
// numbers its datagrams with it (numberNew).
//
// The cadence: the skips follow reliable datagrams, the only ones an ack
// can make the sender send faster (the congestion controller holds them;
// unreliable ones go at the application's pace). The first comes within
// the first 2*skipFirstPeriod reliable datagrams, so that a connection
// that lies from the start is caught within a round trip or two of its
// first download; each gap is drawn anew, uniformly between 1 and twice
// the period, which doubles after each skip up to skipMaxPeriod: a liar
// that begins later is caught within 2*skipMaxPeriod reliable datagrams.
// Two skips are never adjacent.
//
// What it costs an honest peer: a knet receiver counts a skipped PacketID
// as a datagram lost (Stats.LossRate: 1 in about skipMaxPeriod of a
// download's datagrams once the period is at its top, 5 in its first
// 1,000) and acks the datagram after it at once, as it does after any
// gap (session.arrived); the reference's and the specification's
// receivers see a gap, which their acks leave out.
const (
	skipFirstPeriod = 16
	skipMaxPeriod   = 1024
	// skipMemory bounds the skipped PacketIDs remembered. At the top
	// period, recvSpan PacketIDs hold about 32 skips.
	skipMemory = 64
)

// skipState is when the next PacketID is skipped, and the PacketIDs
// skipped within the last recvSpan: as far back as a peer's ack can
// name what is in flight (spanFull).
type skipState struct {
	left   int    // reliable datagrams to number before the next skip
	period int    // half the most the next gap may be
	seed   uint64 // non-zero: gaps from a reproducible sequence (tests), not crypto/rand
	ids    []uint32
	head   int // ids is a ring: the oldest at head
	n      int
}

// newSkipState starts the cadence; seed is for tests (0: crypto/rand).
func newSkipState(seed uint64) *skipState {
	k := &skipState{period: skipFirstPeriod, seed: seed}
	k.draw()
	return k
}

// draw sets the next gap, 1 to 2*period reliable datagrams, and doubles
// the period.
func (k *skipState) draw() {
	span := uint32(2 * k.period) // a power of two
	var r uint32
	if k.seed != 0 {
		k.seed = splitmix64(k.seed)
		r = uint32(k.seed>>32) & (span - 1)
	} else {
		r = randomBits(span - 1)
	}
	k.left = 1 + int(r)
	k.period = min(2*k.period, skipMaxPeriod)
}

// splitmix64 is the next state of a SplitMix64 sequence, mixed.
func splitmix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ x>>30) * 0xbf58476d1ce4e5b9
	x = (x ^ x>>27) * 0x94d049bb133111eb
	return x ^ x>>31
}

// due counts a reliable datagram numbered, and reports whether the
// PacketID after it is to be skipped.
func (k *skipState) due() bool {
	k.left--
	if k.left > 0 {
		return false
	}
	k.draw()
	return true
}

func (k *skipState) at(i int) uint32 { return k.ids[(k.head+i)&(len(k.ids)-1)] }

// add remembers id, skipped, newer than every one remembered; the oldest
// goes if skipMemory are remembered already.
func (k *skipState) add(id uint32) {
	k.forget(id)
	if k.n == len(k.ids) {
		if k.n == skipMemory {
			k.head = (k.head + 1) & (len(k.ids) - 1)
			k.n--
		} else {
			r := make([]uint32, max(8, 2*len(k.ids)))
			for i := range k.n {
				r[i] = k.at(i)
			}
			k.ids, k.head = r, 0
		}
	}
	k.ids[(k.head+k.n)&(len(k.ids)-1)] = id
	k.n++
}

// forget drops the skips recvSpan or more before next: an ack of one of
// those can name nothing in flight, and in time its PacketID comes round
// again, sent.
func (k *skipState) forget(next uint32) {
	for k.n > 0 && seqDiff(k.at(0), next) >= recvSpan {
		k.head = (k.head + 1) & (len(k.ids) - 1)
		k.n--
	}
}

// named returns a PacketID skipped that a acks, if any; next is the
// PacketID the next new datagram takes.
func (k *skipState) named(a packetAck, next uint32) (id uint32, ok bool) {
	k.forget(next)
	// The first skip at or after a's base, then those a's span covers:
	// a few at most.
	lo, hi := 0, k.n
	for lo < hi {
		m := (lo + hi) / 2
		if seqLess(k.at(m), a.base) {
			lo = m + 1
		} else {
			hi = m
		}
	}
	for i := lo; i < k.n; i++ {
		id := k.at(i)
		if seqDiff(a.base, id) > packetAckBits {
			break
		}
		if a.names(id) {
			return id, true
		}
	}
	return 0, false
}
