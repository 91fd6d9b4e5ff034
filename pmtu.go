package knet

import (
	"slices"
	"time"
)

// Path MTU discovery (Config.MaxPathDatagramSize): datagram packetization
// layer PMTUD, RFC 8899, in the specification's dialect.
//
// What may grow. A reliable datagram is sent again as the same bytes under
// its PacketID until acked (DECISIONS §4), and other datagrams name its
// messages by PacketID and index: it can never be cut up. So every datagram
// stays within MaxDatagramSize (the base: RFC 8899's BASE_PLPMTU, which
// the path must carry), but for bulk datagrams, which hold nothing but
// fragments of the transfer under way past its FragmentStart (and acks).
// Those name nothing and nothing names them (a fragment is found by its
// TransferID and FragmentNumber), so they alone may go at the size the
// path is found to carry, and, after a black hole, be repacked: their
// fragments go again in new datagrams of the base size, under new
// PacketIDs, while the old one is never sent again (retire).
//
// Probes. A probe is an unreliable datagram holding a PingRequest padded
// with reserved messages of ID 5 (which receivers ignore, as for the
// ConnectSyn) to the size probed; its PingReply confirms the size. It is
// no reliable datagram: nothing resends it, it holds no PacketID anyone
// waits for, and its loss is no congestion signal (it is not in flight for
// the controller) and counts toward no send limit.
//
// Search. It starts with the first fragmented transfer: the largest size
// first (a path that carries it, loopback, is done in one round trip),
// then a binary search between the largest confirmed and the smallest
// failed, down to pmtuGranularity bytes. A size fails after pmtuMaxProbes
// probes lost in a row. The search runs again pmtuRaiseAfter later, as
// the path may have grown.
//
// Black holes. A bulk datagram larger than the base found lost starts a
// confirmation: probes of the current size, each lost one followed by
// probes of the base size until one is answered (the path is up, and a
// burst of loss counts once). After pmtuMaxProbes such losses, unless a
// bulk datagram larger than the base was acked meanwhile (random loss
// spares some; a path that stopped carrying the size spares none), the
// size is a black hole: it falls to the base and the search starts again
// from there. The bulk datagrams in flight larger than the base are sent
// as they are pmtuRetireSends more times (if one got through, its ack
// comes and ends it), then retired and repacked. Should one have arrived
// after all, its fragments reach the peer twice: a knet receiver drops a
// copy with the same bytes (reassembly.dropRepeats), and one that came
// after the transfer was complete when the TransferID is reused
// (reassembly.stale); a receiver that
// follows the specification alone may take it for a protocol error, which
// these rules make unlikely, not impossible. Guarantee: with the path
// still carrying the base size, a black hole costs resends and time, not
// the connection nor any message.
type pmtuState struct {
	base int // cfg.maxDatagram
	max  int // cfg.maxPathDatagram
	size int // the largest datagram confirmed: bulk datagrams' limit

	started   bool // the search began (with the first transfer)
	searching bool
	lo, hi    int       // the search's bounds: lo carried, above hi failed
	first     bool      // the search's first probe is hi itself
	raiseAt   time.Time // when the search runs again, once done

	// Confirmation, after a bulk datagram was lost: is size still
	// carried? Probes of the size, cfails of them lost in a row, each
	// loss followed by controls of the base size until one is answered
	// (needControl): proof that the path carries the base meanwhile.
	confirming  bool
	suspectAt   time.Time // when it began
	bulkAckedAt time.Time // when a bulk datagram larger than the base was last acked
	cfails      int
	needControl bool
	quietUntil  time.Time // no new confirmation before

	// The probe in flight: its size (0: none), ping ID, when it is taken
	// for lost, and what for; and how many search probes of its size
	// were lost in a row.
	probeSize   int
	probeID     uint8
	probeLostAt time.Time
	probeKind   uint8
	fails       int

	retired []*retiredDgram
	refrags []refrag // fragments of retired datagrams, to go again
	parsed  datagram

	probes, probesLost, blackHoles uint64
	retiredCount                   uint64 // datagrams retired (tests)
}

// retiredDgram is a bulk datagram too large for the path that will not be
// sent again: its fragments go in new datagrams (pids). It stays in the
// window, unacked and not in flight, so that no message is taken for
// delivered past it (specWire.acked), until those are all acked; then it
// counts as acked and its TransferIDs are released.
type retiredDgram struct {
	d    *sent
	gen  uint64
	tids []byte
	pids []uint32
	left int // fragments not yet sent again
}

// refrag is a fragment of a retired datagram waiting to go again; payload
// aliases the retired datagram's bytes, which live until it is trimmed.
type refrag struct {
	from    *retiredDgram
	tid     uint8
	number  uint32
	payload []byte
}

// What a probe is for.
const (
	probeSearch  = iota // a size above the one found
	probeConfirm        // the size found, after a bulk datagram was lost
	probeControl        // the base size, during a confirmation
)

const (
	// pmtuMaxProbes is how many probes of a size are lost in a row
	// before the size is taken as not carried (RFC 8899 MAX_PROBES).
	pmtuMaxProbes = 3
	// pmtuGranularity ends the search once the largest confirmed size
	// and the smallest failed one are this close.
	pmtuGranularity = 32
	// pmtuRetireSends is how many more times a bulk datagram too large
	// for the path after a black hole is sent as it is before it is
	// retired.
	pmtuRetireSends = 4
	// pmtuRaiseAfter is how long after a search ends the path is
	// searched again (RFC 8899 PMTU_RAISE_TIMER).
	pmtuRaiseAfter = 10 * time.Minute
)

// initPMTU turns discovery on (specWire.pmtu) for a session of the
// specification's dialect whose Config asks for it.
func (s *session) initPMTU() {
	if w, spec := s.wire.(*specWire); spec && s.cfg.pathExtra > 0 {
		w.pmtu = &pmtuState{base: s.cfg.maxDatagram, size: s.cfg.maxDatagram, max: s.cfg.maxPathDatagram()}
	}
}

// mtu returns the session's path MTU discovery, or nil when it is off.
func (s *session) mtu() *pmtuState {
	if w, spec := s.wire.(*specWire); spec {
		return w.pmtu
	}
	return nil
}

// datagramLimit is the largest datagram the session may send now: the
// size its bulk datagrams may take.
func (s *session) datagramLimit() int {
	if s.mtu() != nil {
		return s.mtu().size
	}
	return s.cfg.maxDatagram
}

// pmtuDeadline adds the probe's timer and the search's next run.
func (s *session) pmtuDeadline(t *deadlines) {
	p := s.mtu()
	if p == nil {
		return
	}
	if p.probeSize > 0 {
		t.at(p.probeLostAt)
	}
	if !p.raiseAt.IsZero() {
		t.at(p.raiseAt)
	}
}

// advancePMTU takes the probe in flight for lost once its time is up, and
// starts the search again when due.
func (s *session) advancePMTU(now time.Time) {
	p := s.mtu()
	if p == nil {
		return
	}
	if p.probeSize > 0 && !now.Before(p.probeLostAt) {
		s.probeLost(now)
	}
	if !p.raiseAt.IsZero() && !now.Before(p.raiseAt) && !p.searching {
		p.raiseAt = time.Time{}
		p.searching, p.first = true, true
		p.lo, p.hi = p.size, p.max
	}
}

// pollProbe returns a probe when one is due, or nil.
func (s *session) pollProbe(now time.Time, buf []byte) []byte {
	p := s.mtu()
	if p == nil || p.probeSize > 0 || s.spanFull() {
		return nil
	}
	if !p.started && s.send.bulk != nil {
		p.started, p.searching, p.first = true, true, true
		p.lo, p.hi = p.base, p.max
	}
	size, kind := 0, uint8(probeSearch)
	switch {
	case p.confirming && p.needControl:
		size, kind = p.base, probeControl
	case p.confirming:
		size, kind = p.size, probeConfirm
	case p.searching:
		size = (p.lo + p.hi + 1) / 2
		if p.first {
			size = p.hi
		}
	default:
		return nil
	}
	if cap(buf) < size {
		buf = make([]byte, 0, size)
	}
	h := header{packetID: s.send.nextPID}
	b := appendHeader(buf[:0], &h)
	id := s.pingNow(now)
	b = appendMessage(b, &message{id: idPingRequest, payload: []byte{id}})
	b = padTo(b, size)
	p.probeSize, p.probeID, p.probeKind = size, id, kind
	// A PingReply goes at once: a round trip, with the variation and
	// the peer's scheduling (the RTO's floor covers an ack delay).
	p.probeLostAt = now.Add(s.loss.rto())
	p.probes++
	s.sentUnreliable(b)
	return b
}

// padTo fills the datagram b up to size bytes with padding messages (ID 5),
// each holding at most what one message block carries.
func padTo(b []byte, size int) []byte {
	const most = 3 + maxContentLength - 1 // appendPadding's largest
	for rem := size - len(b); rem >= 3; rem = size - len(b) {
		n := min(rem, most)
		if r := rem - n; r > 0 && r < 3 {
			n -= 3 // leave room for a last message header
		}
		b = appendPadding(b, len(b)+n)
	}
	return b
}

// pmtuPingReply takes a PingReply: a probe's confirms its size.
func (s *session) pmtuPingReply(now time.Time, id uint8) {
	p := s.mtu()
	if p == nil || p.probeSize == 0 || id != p.probeID {
		return
	}
	size := p.probeSize
	p.probeSize = 0
	switch p.probeKind {
	case probeConfirm:
		p.confirming = false
		p.quietUntil = now.Add(4 * s.loss.rto())
	case probeControl:
		p.needControl = false
		if p.cfails >= pmtuMaxProbes {
			s.confirmFailed(now)
		}
	default:
		p.fails = 0
		p.size = max(p.size, size)
		p.lo = max(p.lo, size)
		p.first = false
		s.searchStep(now)
	}
}

// probeLost takes the probe in flight for lost.
func (s *session) probeLost(now time.Time) {
	p := s.mtu()
	size := p.probeSize
	p.probeSize = 0
	p.probesLost++
	switch p.probeKind {
	case probeConfirm:
		// A control goes next: each loss counts only once the path
		// is seen to carry the base size after it, so that a burst
		// of loss counts once.
		p.cfails++
		p.needControl = true
	case probeControl:
		// Sent again: the path's failing for every size is no
		// matter of size.
	default:
		if p.fails++; p.fails < pmtuMaxProbes {
			return // the same size again
		}
		p.fails = 0
		p.hi = size - 1
		p.first = false
		s.searchStep(now)
	}
}

// confirmFailed ends a confirmation whose probes of the current size were
// all lost while a smaller datagram got through: unless a bulk datagram of
// more than the base was acked meanwhile (random loss spares some), the
// size is a black hole.
func (s *session) confirmFailed(now time.Time) {
	p := s.mtu()
	p.confirming = false
	if p.bulkAckedAt.After(p.suspectAt) {
		p.quietUntil = now.Add(4 * s.loss.rto())
		return
	}
	s.blackHole(now)
}

// searchStep ends the search once its bounds meet.
func (s *session) searchStep(now time.Time) {
	p := s.mtu()
	if p.searching && p.hi-p.lo < pmtuGranularity {
		p.searching = false
		p.raiseAt = now.Add(pmtuRaiseAfter)
	}
}

// suspectBulk hears that the bulk datagram d was found lost: if it was
// larger than the base, the current size is confirmed again.
func (s *session) suspectBulk(now time.Time, d *sent) {
	p := s.mtu()
	if p == nil || p.confirming || len(d.b) <= p.base || now.Before(p.quietUntil) {
		return
	}
	p.confirming = true
	p.suspectAt = now
	p.cfails, p.needControl = 0, false
}

// blackHole drops the size to the base: the path stopped carrying it, and
// the search starts again. The bulk datagrams in flight that are larger
// go on being sent as they are, pmtuRetireSends times more, before they
// are retired (pollReliable): their fragments must not reach the peer
// twice (a repeated fragment is a protocol error), so one is repacked
// only once it has had every chance to be acked if it got through.
func (s *session) blackHole(now time.Time) {
	p := s.mtu()
	p.blackHoles++
	p.confirming = false
	p.size = p.base
	p.searching, p.first = true, false
	p.lo, p.hi = p.base, p.max
	p.raiseAt = time.Time{}
	l := &s.loss
	for k := range l.sent.n {
		if d := l.sent.at(k); !d.acked && d.bulk && len(d.b) > p.size && d.retireAt == 0 {
			d.retireAt = d.sends + pmtuRetireSends
		}
	}
}

// tooLarge reports whether d, found lost, may not go again as it is: a bulk
// datagram larger than the path now carries.
func (s *session) tooLarge(d *sent) bool {
	return s.mtu() != nil && d.bulk && len(d.b) > s.mtu().size && d.retireAt > 0 && d.sends >= d.retireAt
}

// retire takes d, from nextResend, out of the resends: its fragments are
// queued to go again in new datagrams (refrags), and d stays in the
// window, unacked, until they are all acked (see retiredDgram).
func (s *session) retire(d *sent) {
	p := s.mtu()
	s.loss.popLost()
	r := &retiredDgram{d: d, gen: d.gen, tids: append([]byte(nil), d.transfers...)}
	d.transfers = d.transfers[:0]
	// The fragments' bytes move to the new datagrams, and with them
	// what acks release.
	s.send.spanHold -= d.hold
	d.hold, d.appBytes = 0, 0
	if parseInto(d.b, &p.parsed) == nil {
		for i := range p.parsed.msgs {
			m := &p.parsed.msgs[i]
			if !m.fragment || m.fragStart {
				continue // acks: the new datagrams carry their own
			}
			p.refrags = append(p.refrags, refrag{from: r, tid: m.transferID, number: m.fragNumber, payload: m.payload})
			r.left++
		}
	}
	p.retired = append(p.retired, r)
	p.retiredCount++
}

// repackedOut records that the datagram with PacketID pid carries
// fragments of r.
func (r *retiredDgram) repackedOut(pid uint32) {
	if n := len(r.pids); n == 0 || r.pids[n-1] != pid {
		r.pids = append(r.pids, pid)
	}
}

// settleRetired counts as acked each retired datagram whose fragments
// were all sent again and acked (or which was acked itself, late).
func (s *session) settleRetired() {
	p := s.mtu()
	w := &s.loss.sent
	kept := p.retired[:0]
	for _, r := range p.retired {
		done := r.d.gen != r.gen || r.d.acked
		if !done && r.left == 0 {
			done = true
			for _, pid := range r.pids {
				if d, _ := w.find(pid); d != nil {
					done = false
					break
				}
			}
			if done {
				w.ack(r.d, true)
			}
		}
		if !done {
			kept = append(kept, r)
			continue
		}
		if r.left > 0 {
			// Acked itself after all: its fragments arrived, and the
			// bytes the queued ones alias go with it.
			p.refrags = slices.DeleteFunc(p.refrags, func(f refrag) bool { return f.from == r })
		}
		for _, tid := range r.tids {
			s.send.tids.release(tid)
		}
	}
	clear(p.retired[len(kept):])
	p.retired = kept
}

// buildBulk packs a bulk datagram, up to the size the path carries: the
// fragments of retired datagrams first, else those of the transfer under
// way when nothing else waits to be packed (a whole message, versions of
// latest state due). It returns nil when it has nothing to pack, for the
// ordinary datagram.
func (w *specWire) buildBulk(now time.Time) []byte {
	s := w.s
	p := s.mtu()
	if p == nil {
		return nil
	}
	repack := len(p.refrags) > 0
	if !repack && (p.size <= p.base || s.send.bulk == nil || s.owed.owes(oweAck|oweAnchor|oweFlow) || w.wholeWaits() || s.latestDue()) {
		return nil
	}
	h := &s.sc().wh
	*h = header{packetID: s.send.nextPID, reliable: true, deltas: h.deltas[:0], indices: h.indices[:0]}
	pk := specPacking{packing: packing{body: s.sc().body[:0], limit: p.size, tids: s.sc().tidBuf[:0]}, h: h}
	if repack {
		n := 0
		for _, f := range p.refrags {
			msg := message{fragment: true, transferID: f.tid, fragNumber: f.number, payload: f.payload}
			if sizeMessage(&msg) > pk.room() || pk.count >= maxPerDatagram {
				break
			}
			pk.body = appendMessage(pk.body, &msg)
			pk.count++
			pk.appBytes += len(f.payload)
			pk.holds = true
			if !containsByte(pk.tids, f.tid) {
				s.send.tids.carried(f.tid)
				pk.tids = append(pk.tids, f.tid)
			}
			f.from.repackedOut(h.packetID)
			f.from.left--
			n++
		}
		clear(p.refrags[:n])
		p.refrags = p.refrags[n:]
		if len(p.refrags) == 0 {
			p.refrags = nil
		}
	} else {
		for s.send.bulk != nil && pk.room() >= 16 && pk.count < maxPerDatagram {
			if !w.placeFragment(&pk, s.send.bulk) {
				break
			}
		}
	}
	s.sc().body, s.sc().tidBuf = pk.body, pk.tids
	if pk.count == 0 {
		return nil
	}
	b, d := w.finishReliable(now, &pk)
	d.bulk = true
	return b
}

// wholeWaits reports whether a whole reliable message waits in the queue:
// it goes in an ordinary datagram, with fragments around it.
func (w *specWire) wholeWaits() bool {
	q := &w.s.send.relQ
	for i, n := q.head, 0; i < len(q.items) && n < maxSkipped; i, n = i+1, n+1 {
		if m := q.items[i]; !m.done && !m.frag {
			return true
		}
	}
	return false
}

func containsByte(b []byte, c byte) bool {
	for _, x := range b {
		if x == c {
			return true
		}
	}
	return false
}

// dropRetired forgets the retired datagrams and the fragments waiting to
// go again (session.dropSending), before the window releases the bytes
// they alias, and returns the application bytes those held.
func (s *session) dropRetired() (released int) {
	p := s.mtu()
	if p == nil {
		return 0
	}
	for _, f := range p.refrags {
		released += len(f.payload)
	}
	p.refrags, p.retired = nil, nil
	return released
}

// repacking reports whether fragments of retired datagrams wait to go
// again.
func (s *session) repacking() bool { return s.mtu() != nil && len(s.mtu().refrags) > 0 }
