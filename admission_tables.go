package knet

import (
	"hash/maphash"
	"net/netip"
	"time"
)

// The tables behind a listener's admission (admission.go): the handshake
// messages it key-exchanged lately, and the budgets it keeps per source.

// seenHandshakes remembers the handshake messages (Noise message 1, by a
// keyed 64-bit hash) a listener key-exchanged in the last window, and
// whether that failed and why: a message costs at most one key exchange
// in that time, however often it comes, from wherever (a cookie, which
// binds it, is so good for one handshake). A message whose connection was
// established is remembered past the window: a copy of it, however late,
// is a replay (its client never sends it again). Entries are kept in the
// order they came, in a ring of at most max; when it is full the oldest
// goes, live or not: a message so forgotten may cost one more key
// exchange, but only after max newer ones did. Not safe for concurrent
// use.
type seenHandshakes struct {
	index  map[uint64]int32 // hash -> its entry in ring
	ring   []seenHandshake
	next   int // the oldest entry, once the ring is full
	max    int
	window time.Duration
	base   time.Time // what entries' times count from
}

// seenHandshake is an entry of seenHandshakes: 40 bytes.
type seenHandshake struct {
	h           uint64
	at          time.Duration // since base
	failed      bool
	established bool   // its connection was established: remembered past the window
	attempts    uint8  // attempts made with it (maxAttemptsPerMessage)
	reason      string // the refusal's, if failed (empty: none)
}

func newSeenHandshakes(max int, window time.Duration, now time.Time) seenHandshakes {
	return seenHandshakes{index: make(map[uint64]int32), max: max, window: window, base: now}
}

// find returns the entry of the message whose hash is h, if it came in the
// window before now, or was established.
func (s *seenHandshakes) find(h uint64, now time.Time) (seenHandshake, bool) {
	i, ok := s.index[h]
	if !ok || !s.ring[i].established && now.Sub(s.base)-s.ring[i].at > s.window {
		return seenHandshake{}, false
	}
	return s.ring[i], true
}

func (s *seenHandshakes) has(h uint64, now time.Time) bool {
	_, ok := s.find(h, now)
	return ok
}

// add records the message whose hash is h, key-exchanged from now.
func (s *seenHandshakes) add(h uint64, now time.Time) {
	e := seenHandshake{h: h, at: now.Sub(s.base), attempts: 1}
	if len(s.ring) < s.max {
		s.ring = append(s.ring, e)
		s.index[h] = int32(len(s.ring) - 1)
		return
	}
	if old := s.ring[s.next].h; s.index[old] == int32(s.next) {
		delete(s.index, old)
	}
	s.ring[s.next] = e
	s.index[h] = int32(s.next)
	s.next = (s.next + 1) % s.max
}

// again records another attempt with the message whose hash is h.
func (s *seenHandshakes) again(h uint64) {
	if i, ok := s.index[h]; ok && s.ring[i].attempts < 255 {
		s.ring[i].attempts++
	}
}

// established records that the connection of the message whose hash is h
// was established.
func (s *seenHandshakes) established(h uint64) {
	if i, ok := s.index[h]; ok {
		s.ring[i].established = true
	}
}

// fail records that the key exchange of the message whose hash is h, or
// its connection, failed, and the reason a refusal gives.
func (s *seenHandshakes) fail(h uint64, reason string) {
	if i, ok := s.index[h]; ok {
		s.ring[i].failed = true
		s.ring[i].reason = reason
	}
}

// forget forgets the message whose hash is h: it may be key-exchanged
// again.
func (s *seenHandshakes) forget(h uint64) { delete(s.index, h) }

// sourceLimiter limits the key exchanges each source costs: a token
// bucket per IP address (IPv6: per /64, what one host usually has),
// sourceRate a second up to sourceBurst at once. The buckets are a fixed
// table indexed by a keyed hash of the address, so that nothing is
// allocated for an attacker's addresses; two addresses whose hashes
// collide share one (with a random seed, an attacker cannot aim at
// another's). Not safe for concurrent use.
type sourceLimiter struct {
	seed        maphash.Seed
	rate, burst float64
	base        time.Time
	buckets     []sourceBucket
}

// sourceBucket holds what an address owes: key exchanges not yet paid
// back by the rate, at a time (since the limiter's base). The zero value
// is a full bucket.
type sourceBucket struct {
	debt float64
	at   time.Duration
}

// newSourceLimiter makes a limiter of n buckets (a power of two).
func newSourceLimiter(n int, rate, burst float64, now time.Time) sourceLimiter {
	return sourceLimiter{seed: maphash.MakeSeed(), rate: rate, burst: burst, base: now, buckets: make([]sourceBucket, n)}
}

// allow reports whether ip may cost a key exchange at now, and if so
// takes it from its bucket.
func (s *sourceLimiter) allow(ip netip.Addr, now time.Time) bool {
	k := sourceOf(ip)
	b := &s.buckets[maphash.Bytes(s.seed, k[:])&uint64(len(s.buckets)-1)]
	t := now.Sub(s.base)
	b.debt = max(0, b.debt-s.rate*max(0, t-b.at).Seconds())
	b.at = max(b.at, t)
	if b.debt+1 > s.burst {
		return false
	}
	b.debt++
	return true
}

// sourceKey is what the per-source budgets count by: an IPv4 address, or
// the /64 of an IPv6 one (what one host usually has).
type sourceKey [9]byte

func sourceOf(ip netip.Addr) sourceKey {
	var k sourceKey
	if ip.Is4() || ip.Is4In6() {
		a := ip.Unmap().As4()
		k[0] = 4
		copy(k[1:], a[:])
	} else {
		a := ip.As16()
		k[0] = 6
		copy(k[1:], a[:8])
	}
	return k
}
