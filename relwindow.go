package knet

// Reliable message numbers (the reference dialect) run from 0 up to
// maxRelNum and wrap; relDiff compares them serially.

// relDiff is b minus a, serially: positive if b comes after a.
func relDiff(a, b uint32) int32 { return int32((b-a)<<1) >> 1 }

// relNextNum is the number after n.
func relNextNum(n uint32) uint32 { return (n + 1) & maxRelNum }

// relWindow is a set of reliable message numbers: every one below next,
// and those at or after it marked in a bitmap that grows, up to
// maxRelWindow numbers, only while there are holes that far back. Word k
// of the ring holds the numbers whose n>>6 is k modulo the ring's length.
type relWindow struct {
	next uint32
	ring []uint64 // length a power of two, or zero
}

// maxRelWindow bounds how far past the oldest missing number a relWindow
// takes numbers (4M numbers, a 512 KiB bitmap at most); farther ones are
// refused. The sender resends what is missing long before that.
const maxRelWindow = 1 << 22

const relWords = (maxRelNum >> 6) + 1 // words in the number space

// has reports whether n is in the set: below next, or marked.
func (w *relWindow) has(n uint32) bool {
	d := relDiff(w.next, n)
	if d < 0 {
		return true
	}
	k := w.wordAhead(n)
	if k >= len(w.ring) {
		return false
	}
	return w.ring[w.slot(n)]&(1<<(n&63)) != 0
}

// wordAhead is how many words n's word is after next's.
func (w *relWindow) wordAhead(n uint32) int {
	return int((n>>6 - w.next>>6) & (relWords - 1))
}

func (w *relWindow) slot(n uint32) int { return int(n>>6) & (len(w.ring) - 1) }

// fits reports whether add can take n: it is not more than maxRelWindow
// after next.
func (w *relWindow) fits(n uint32) bool {
	d := relDiff(w.next, n)
	return d < 0 || d < maxRelWindow
}

// add puts n into the set, if it fits.
func (w *relWindow) add(n uint32) {
	d := relDiff(w.next, n)
	if d < 0 || d >= maxRelWindow {
		return
	}
	if d == 0 && len(w.ring) == 0 {
		// In order, nothing ever after it: the common case.
		w.next = relNextNum(n)
		return
	}
	for w.wordAhead(n) >= len(w.ring) {
		w.grow()
	}
	w.ring[w.slot(n)] |= 1 << (n & 63)
	for {
		s, b := w.slot(w.next), uint64(1)<<(w.next&63)
		if w.ring[s]&b == 0 {
			return
		}
		w.ring[s] &^= b
		w.next = relNextNum(w.next)
	}
}

// grow doubles the ring, keeping the words from next's on.
func (w *relWindow) grow() {
	r := make([]uint64, max(4, 2*len(w.ring)))
	for k := range len(w.ring) {
		word := (w.next>>6 + uint32(k)) & (relWords - 1)
		r[int(word)&(len(r)-1)] = w.ring[int(word)&(len(w.ring)-1)]
	}
	w.ring = r
}

// addRange puts n and the count-1 numbers after it into the set.
func (w *relWindow) addRange(n uint32, count int) {
	for range count {
		w.add(n)
		n = relNextNum(n)
	}
}
