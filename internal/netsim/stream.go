package netsim

import (
	"container/heap"
	"slices"
	"time"
)

// Stream simulates one direction of a TCP connection over a Link: what a
// byte stream's reader lives through when the path under it loses, delays
// and caps what its writer sends. TCP hides losses, duplicates and
// reordering from both ends, so that what shows is time: a lost segment
// arrives one retransmission timeout later, and everything behind it waits
// for it (head-of-line blocking).
//
// The model, for bytes written at now:
//
//   - Each write is cut into segments of at most MSS bytes (TCP_NODELAY: a
//     write's last segment goes short rather than wait for the next).
//   - Segments cross a bottleneck of Params.Bandwidth bytes a second in
//     write order; without a cap they leave at once.
//   - Each transmission of a segment is lost as a datagram of the Link is
//     (Loss, BurstLen, BurstDuration, drawn when it leaves the bottleneck),
//     or corrupted (Corrupt), which TCP's checksum turns into a loss.
//     Otherwise it arrives Delay plus a uniform 0..Jitter later, plus
//     ReorderDelay if Reorder draws it.
//   - A lost transmission is sent again as soon as the sender can tell it
//     was lost: when the acknowledgement of a transmission that left after
//     it comes back (a selective one: Delay + Jitter/2 after that one
//     arrives), plus a reordering window of a quarter of the RTT (RACK, RFC
//     8985, Linux's default: a stream that keeps writing recovers in about
//     an RTT). Failing that, when nothing was sent after it (a tail), one
//     retransmission timeout after it left, the timeout doubling for each
//     loss of the same segment (TCP's backoff, up to MaxRTO). After
//     MaxRetries losses the segment is given up and the stream stalls for
//     good, as a TCP connection that resets. The timeout is RTT +
//     max(4·RTTVAR, MinRTO) (RFC 6298 with Linux's floor), for RTT = 2·Delay
//   - Jitter plus the segment's wait at the bottleneck and RTTVAR =
//     Jitter/2: the path taken as symmetric. (Linux's tail loss probe,
//     which would resend a tail sooner, is left out: the model errs on the
//     slow side there.)
//   - Bytes are delivered in order: a segment arrives no earlier than the
//     one before it (so that jitter and Reorder never reorder, they only
//     hold back), and a lost one holds everything behind it.
//   - The sender's buffer holds what it wrote until the receiver's
//     acknowledgement would come back: the in-order arrival plus Delay +
//     Jitter/2. Write takes no more than the buffer has room for, so a
//     writer waits, as on a socket, rather than the bottleneck dropping
//     (TCP's congestion control, idealised, never overflows it).
//
// Duplicate and MaxSize have no effect (TCP drops duplicates, and sizes its
// segments to the path). Stream is not safe for concurrent use; its Link's
// draws are.
type Stream struct {
	link     *Link
	p        Params
	capacity int

	segs     []segment // written, not yet delivered and acknowledged, in order
	base     int64     // the number of segs[0]: segments before it are gone
	next     int       // index in segs of the first segment not yet delivered
	held     int       // bytes in segs: what the sender's buffer holds
	inOrder  time.Time // in-order arrival of the last segment delivered
	free     time.Time // when the bottleneck is free
	events   attempts
	eventSeq uint64
	waiting  []int64 // segments lost, their next transmission not yet left
	stats    StreamStats
}

// MSS is a simulated stream's segment size: TCP's over Ethernet, with
// timestamps (1500 - 20 - 20 - 12).
const MSS = 1448

// The retransmission timeout's bounds and the retries before a stream
// gives a segment up: Linux's TCP_RTO_MIN, TCP_RTO_MAX and tcp_retries2.
const (
	MinRTO     = 200 * time.Millisecond
	MaxRTO     = 120 * time.Second
	MaxRetries = 15
)

// StreamBuffer is a simulated stream's send buffer without a bandwidth cap:
// the largest Linux grows a TCP socket's to (tcp_wmem).
const StreamBuffer = 4 << 20

// StreamStats count what a Stream did.
type StreamStats struct {
	Written       uint64 // bytes taken by Write
	Delivered     uint64 // bytes delivered, in order
	Segments      uint64 // segments written (their first transmissions)
	Retransmitted uint64 // transmissions after a loss
	GivenUp       uint64 // segments lost MaxRetries+1 times: the stream stalls
}

type segment struct {
	size   int
	tries  int       // transmissions lost so far
	arrive time.Time // when a transmission arrives, once one does
	ack    time.Time // when its acknowledgement reaches the sender, once delivered
	lost   bool      // given up
	left   time.Time // when its last transmission left, while it waits to go again
	due    time.Time // its next transmission, while it waits: other attempts are stale
}

// attempt is a segment's transmission, due at at.
type attempt struct {
	at  time.Time
	n   uint64 // ties in the order of scheduling
	seg int64
}

type attempts []attempt

func (q attempts) Len() int { return len(q) }
func (q attempts) Less(i, j int) bool {
	if !q[i].at.Equal(q[j].at) {
		return q[i].at.Before(q[j].at)
	}
	return q[i].n < q[j].n
}
func (q attempts) Swap(i, j int) { q[i], q[j] = q[j], q[i] }
func (q *attempts) Push(x any)   { *q = append(*q, x.(attempt)) }
func (q *attempts) Pop() any {
	old := *q
	a := old[len(old)-1]
	*q = old[:len(old)-1]
	return a
}

// NewStream returns a Stream whose segments cross l.
func NewStream(l *Link) *Stream {
	return &Stream{link: l, p: l.Params(), capacity: streamCapacity(l.Params())}
}

// streamCapacity is the sender's buffer for p: with a bandwidth cap, the
// bandwidth-delay product and QueueBytes (default 50ms at the cap) waiting
// at the bottleneck; without, StreamBuffer. At least 4 segments.
func streamCapacity(p Params) int {
	if p.Bandwidth <= 0 {
		if p.QueueBytes > 0 {
			return max(p.QueueBytes, 4*MSS)
		}
		return StreamBuffer
	}
	q := p.QueueBytes
	if q == 0 {
		q = p.Bandwidth / 20
	}
	rtt := 2*p.Delay + p.Jitter
	return max(q+int(float64(p.Bandwidth)*rtt.Seconds()), 4*MSS)
}

// Link returns the stream's link.
func (s *Stream) Link() *Link { return s.link }

// Capacity returns the size of the sender's buffer, in bytes.
func (s *Stream) Capacity() int { return s.capacity }

// Stats returns what the stream has done so far.
func (s *Stream) Stats() StreamStats { return s.stats }

// Write takes up to n bytes written at now, as much as the sender's buffer
// has room for, and returns how many it took; 0 means the buffer is full
// until Next. It moves the stream to now first (Advance).
func (s *Stream) Write(now time.Time, n int) int {
	s.Advance(now)
	took := 0
	for took < n && s.held < s.capacity {
		size := min(n-took, MSS, s.capacity-s.held)
		s.segs = append(s.segs, segment{size: size})
		s.held += size
		s.eventSeq++
		heap.Push(&s.events, attempt{at: now, n: s.eventSeq, seg: s.base + int64(len(s.segs)-1)})
		s.stats.Segments++
		took += size
	}
	s.stats.Written += uint64(took)
	s.Advance(now)
	return took
}

// Advance moves the stream to now: the transmissions due by then leave,
// the bytes that arrived in order by then are delivered, and the buffer
// lets go of what was acknowledged. now must not go backwards.
func (s *Stream) Advance(now time.Time) {
	for len(s.events) > 0 && !s.events[0].at.After(now) {
		a := heap.Pop(&s.events).(attempt)
		if a.seg < s.base {
			continue // superseded by an earlier one, and long gone
		}
		g := &s.segs[a.seg-s.base]
		if g.tries > 0 && (!a.at.Equal(g.due) || !g.arrive.IsZero() || g.lost) {
			continue // superseded by an earlier one
		}
		s.transmit(a.at, g, a.seg)
	}
	for s.next < len(s.segs) {
		g := &s.segs[s.next]
		if g.arrive.IsZero() {
			break // not arrived yet, or given up
		}
		at := g.arrive
		if at.Before(s.inOrder) {
			at = s.inOrder
		}
		if at.After(now) {
			break
		}
		s.inOrder = at
		g.ack = at.Add(s.p.Delay + s.p.Jitter/2)
		s.stats.Delivered += uint64(g.size)
		s.next++
	}
	drop := 0
	for drop < s.next && !s.segs[drop].ack.After(now) {
		s.held -= s.segs[drop].size
		drop++
	}
	if drop > 0 {
		s.segs = s.segs[drop:]
		s.base += int64(drop)
		s.next -= drop
	}
}

// transmit sends segment number seq, g, into the bottleneck at t.
func (s *Stream) transmit(t time.Time, g *segment, seq int64) {
	start := t
	if s.free.After(start) {
		start = s.free
	}
	left := start
	if s.p.Bandwidth > 0 {
		left = start.Add(time.Duration(float64(g.size) / float64(s.p.Bandwidth) * float64(time.Second)))
		s.free = left
	}
	if g.tries > 0 {
		s.waiting = slices.DeleteFunc(s.waiting, func(w int64) bool { return w == seq })
	}
	lost, d := s.link.decideSegment(start, g.size)
	if !lost {
		g.arrive = left.Add(d)
		s.detect(left, g.arrive)
		return
	}
	g.tries++
	if g.tries > MaxRetries {
		g.lost = true
		s.stats.GivenUp++
		return
	}
	s.stats.Retransmitted++
	rto := s.rto(left.Sub(t))
	for range g.tries - 1 {
		rto = min(2*rto, MaxRTO)
	}
	g.left, g.due = left, left.Add(rto)
	s.waiting = append(s.waiting, seq)
	s.schedule(g.due, seq)
}

// detect brings forward the next transmission of each lost segment that
// left before a transmission that left at left and arrives at arrive:
// the sender learns of the loss from that one's acknowledgement, a
// reordering window later (RACK).
func (s *Stream) detect(left, arrive time.Time) {
	rtt := 2*s.p.Delay + s.p.Jitter
	at := arrive.Add(s.p.Delay + s.p.Jitter/2 + rtt/4)
	for _, w := range s.waiting {
		g := &s.segs[w-s.base]
		if g.left.Before(left) && at.Before(g.due) {
			g.due = at
			s.schedule(at, w)
		}
	}
}

// schedule queues a transmission of segment seq at at.
func (s *Stream) schedule(at time.Time, seq int64) {
	s.eventSeq++
	heap.Push(&s.events, attempt{at: at, n: s.eventSeq, seg: seq})
}

// rto is the retransmission timeout of a segment that waited wait at the
// bottleneck: RTT + max(4·RTTVAR, MinRTO), for RTT = 2·Delay + Jitter +
// wait and RTTVAR = Jitter/2.
func (s *Stream) rto(wait time.Duration) time.Duration {
	rtt := 2*s.p.Delay + s.p.Jitter + wait
	return min(rtt+max(2*s.p.Jitter, MinRTO), MaxRTO)
}

// Next returns when the stream next has something to do (a transmission,
// a delivery, room in the buffer): the time to call Advance or Write again.
// It is zero when nothing is pending.
func (s *Stream) Next() time.Time {
	var next time.Time
	earlier := func(t time.Time) {
		if !t.IsZero() && (next.IsZero() || t.Before(next)) {
			next = t
		}
	}
	if len(s.events) > 0 {
		earlier(s.events[0].at)
	}
	if s.next < len(s.segs) {
		if at := s.segs[s.next].arrive; !at.IsZero() {
			if at.Before(s.inOrder) {
				at = s.inOrder
			}
			earlier(at)
		}
	}
	if s.next > 0 {
		earlier(s.segs[0].ack)
	}
	return next
}

// Delivered returns how many bytes have been delivered, in order, so far.
func (s *Stream) Delivered() int64 { return int64(s.stats.Delivered) }

// decideSegment draws the fate of a transmission of a stream's segment of
// size bytes that leaves at at: lost (to Loss, or to Corrupt, which TCP's
// checksum drops), or delivered after d (Delay, Jitter, Reorder).
func (l *Link) decideSegment(at time.Time, size int) (lost bool, d time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.stats.Sent++
	l.stats.Bytes += uint64(size)
	if l.lost(at) {
		l.stats.Lost++
		return true, 0
	}
	if l.p.Corrupt > 0 && l.rng.Float64() < l.p.Corrupt {
		l.stats.Corrupted++
		return true, 0
	}
	d = l.p.Delay
	if l.p.Jitter > 0 {
		d += time.Duration(l.rng.Int64N(int64(l.p.Jitter) + 1))
	}
	if l.p.Reorder > 0 && l.rng.Float64() < l.p.Reorder {
		d += l.p.ReorderDelay
		l.stats.Reordered++
	}
	l.stats.Delivered++
	return false, d
}
