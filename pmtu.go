package knet

import (
	"slices"
	"time"
)

// Path MTU discovery (Config.MaxPathDatagramSize): datagram packetization
// layer PMTUD, RFC 8899, in the specification's dialect.
//
// What may grow. A reliable message is sized when it is placed
// (pathSize), for the size confirmed then: whole if it fits a datagram of
// that size, and the ordinary datagram grows past MaxDatagramSize (the
// base: RFC 8899's BASE_PLPMTU, which the path must carry) to take it
// (grow); else a transfer whose fragments fill such datagrams. Bulk
// datagrams, which hold nothing but fragments of the transfer under way
// past its FragmentStart (and acks), take the size too. Every other
// datagram stays within the base.
//
// After a black hole, a datagram too large for the path must go again
// smaller. Bulk datagrams name nothing and nothing names them (a fragment
// is found by its TransferID and FragmentNumber): they are retired, never
// sent again, and their fragments repacked in new datagrams under new
// PacketIDs (retire). Any other datagram's messages are named by PacketID
// and index (DECISIONS §4, §5): it goes again under its PacketID with its
// large messages made transfers, each FragmentStart in its message's place
// (convert), the one case where a resend is not the same bytes.
//
// Probes. A probe is an unreliable datagram holding a PingRequest padded
// with reserved messages of ID 5 (which receivers ignore, as for the
// ConnectSyn) to the size probed; its PingReply confirms the size. It is
// no reliable datagram: nothing resends it, it holds no PacketID anyone
// waits for, and its loss is no congestion signal (it is not in flight for
// the controller) and counts toward no send limit.
//
// Search. It starts with the first fragmented transfer, in rounds of
// probes sent together: the common path sizes between the largest
// confirmed and the smallest failed (1232, 1280, 1372, 1400, 1452, 1472,
// 8972), and pmtuSplit sizes evenly between, the largest first. A probe
// answered raises the size at once; a round ends when each of its probes
// is answered or lost, and the smallest lost above the largest answered
// bounds the next. It settles within pmtuGranularity bytes in a few round
// trips (a path of 1280 bytes or one of 4000 bytes under a 9000-byte
// limit: one to four rounds). The search runs again pmtuRaiseAfter later,
// as the path may have grown.
//
// Black holes. A bulk datagram larger than the base found lost starts a
// confirmation: probes of the current size, each lost one followed by
// probes of the base size until one is answered (the path is up, and a
// burst of loss counts once). After pmtuMaxProbes such losses, unless a
// bulk datagram larger than the base was acked meanwhile (random loss
// spares some; a path that stopped carrying the size spares none), the
// size is a black hole: it falls to the base and the search starts again
// from there. The bulk datagrams in flight larger than the base leave the
// flight (the path lost them, not congestion), are sent as they are
// pmtuRetireSends more times (if one got through, its ack comes and ends
// it), then retired and repacked. Should one have arrived
// after all, its fragments reach the peer twice: a knet receiver drops a
// copy with the same bytes (reassembly.dropRepeats), and one that came
// after the transfer was complete when the TransferID is reused
// (reassembly.stale); a receiver that
// follows the specification alone may take it for a protocol error, which
// these rules make unlikely, not impossible. Guarantee: with the path
// still carrying the base size, a black hole costs resends and time, not
// the connection nor any message.
//
// Below the base. A reliable datagram of more than half the base lost
// twice starts the same confirmation one level down: probes of the base
// size, each lost one followed by a bare PingRequest until one is
// answered. After pmtuBaseProbes such losses with no datagram of the
// base size acked meanwhile, the path no longer carries what every
// datagram needs: the connection ends with a *PathMTUError naming the
// sizes, rather than resending to MaxMessageSendCount in silence.
type pmtuState struct {
	base int // cfg.maxDatagram
	max  int // cfg.maxPathDatagram
	size int // the largest datagram confirmed: bulk datagrams' limit

	started   bool // the search began
	wanted    bool // a message too large for the base was queued (pathSize)
	searching bool
	lo, hi    int       // the search's bounds: lo carried, above hi failed
	round     []int     // the sizes of the search's round still to send
	roundLost int       // the smallest size of the round lost (0: none)
	raiseAt   time.Time // when the search runs again, once done

	// Confirmation, after a datagram was lost: is csize still carried?
	// Probes of it, cfails of them lost in a row, each loss followed by
	// controls of a smaller size (ctlSize: the base, or a bare ping
	// below it) until one is answered (needControl): proof that the path
	// carries that meanwhile.
	confirming  bool
	csize       int
	suspectAt   time.Time // when it began
	bulkAckedAt time.Time // when a datagram larger than the base was last acked
	baseAckedAt time.Time // when a datagram of the base size or more was last acked
	largestSeen int       // the largest datagram acked or answered since suspectAt
	cfails      int
	needControl bool
	quietUntil  time.Time // no new confirmation before

	inflight []pmtuProbe // probes sent, neither answered nor taken for lost

	retired []*retiredDgram
	refrags []refrag // fragments of retired datagrams, to go again
	parsed  datagram

	probes, probesLost, blackHoles uint64
	retiredCount                   uint64 // datagrams retired (tests)
	converted                      uint64 // datagrams converted (tests)
}

// pmtuProbe is a probe in flight: its size, ping ID, when it is taken for
// lost, and what for.
type pmtuProbe struct {
	size   int
	id     uint8
	kind   uint8
	lostAt time.Time
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
	// converted: d was not retired but goes again smaller, its large
	// messages made transfers whose fragments past the first are
	// these (convert); old holds the bytes they alias.
	converted bool
	old       []byte
}

// refrag is a fragment of a retired datagram waiting to go again; payload
// aliases the retired datagram's bytes, which live until it is trimmed.
type refrag struct {
	from    *retiredDgram
	tid     uint8
	number  uint32
	payload []byte
	// For a converted message's last fragment: the message's track,
	// complete once it is packed (see convert).
	last  bool
	track depOn
}

// What a probe is for.
const (
	probeSearch  = iota // a size above the one found
	probeConfirm        // the size found (or the base), after a datagram was lost
	probeControl        // a smaller size, during a confirmation
)

const (
	// pmtuMaxProbes is how many probes of the size found are lost in a
	// row, each after a smaller one got through, before the size is
	// taken as not carried (RFC 8899 MAX_PROBES).
	pmtuMaxProbes = 3
	// pmtuBaseProbes is that count for the base size, whose failure
	// ends the connection: 0.3 loss takes it by chance once in a
	// thousand confirmations, and only with no datagram of the base
	// size acked meanwhile.
	pmtuBaseProbes = 6
	// pmtuGranularity ends the search once the largest confirmed size
	// and the smallest failed one are this close.
	pmtuGranularity = 32
	// pmtuSplit is how many evenly spaced sizes a round of the search
	// probes, beside the common ones (pmtuCommon).
	pmtuSplit = 4
	// pmtuRoundMost bounds a round's probes.
	pmtuRoundMost = 8
	// pmtuRetireSends is how many more times a bulk datagram too large
	// for the path after a black hole is sent as it is before it is
	// retired: once, so that a peer that has it acks it again (DECISIONS
	// §4) before its fragments go in other datagrams. The black hole was
	// confirmed over several round trips, so its first ack would have
	// come by then; more sends only hold the transfer (issue 32).
	pmtuRetireSends = 1
	// pmtuRaiseAfter is how long after a search ends the path is
	// searched again (RFC 8899 PMTU_RAISE_TIMER).
	pmtuRaiseAfter = 10 * time.Minute
)

// pmtuCommon are UDP payload sizes real paths often carry and no more:
// IPv6's minimum MTU, a WireGuard tunnel over IPv6, the former default,
// PPPoE and Ethernet over IPv6 and IPv4, a 9000-byte jumbo frame.
var pmtuCommon = [...]int{1232, 1280, 1372, 1400, 1452, 1472, 8952, 8972}

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

// pmtuDeadline adds the probes' timers and the search's next run.
func (s *session) pmtuDeadline(t *deadlines) {
	p := s.mtu()
	if p == nil {
		return
	}
	for i := range p.inflight {
		t.at(p.inflight[i].lostAt)
	}
	if !p.raiseAt.IsZero() {
		t.at(p.raiseAt)
	}
}

// advancePMTU takes the probes in flight for lost once their time is up,
// and starts the search again when due.
func (s *session) advancePMTU(now time.Time) {
	p := s.mtu()
	if p == nil {
		return
	}
	for i := 0; i < len(p.inflight); {
		if pr := p.inflight[i]; !now.Before(pr.lostAt) {
			p.inflight = slices.Delete(p.inflight, i, i+1)
			s.probeLost(now, pr)
			continue
		}
		i++
	}
	if !p.raiseAt.IsZero() && !now.Before(p.raiseAt) && !p.searching {
		p.raiseAt = time.Time{}
		p.startSearch(p.size, p.max)
	}
}

// startSearch searches the sizes above lo, up to hi.
func (p *pmtuState) startSearch(lo, hi int) {
	p.searching = true
	p.lo, p.hi = lo, hi
	p.round, p.roundLost = p.round[:0], 0
}

// pending reports whether a probe of kind is in flight.
func (p *pmtuState) pending(kinds ...uint8) bool {
	for _, pr := range p.inflight {
		if slices.Contains(kinds, pr.kind) {
			return true
		}
	}
	return false
}

// planRound fills the search's next round: the common sizes between its
// bounds and pmtuSplit evenly spaced, the largest first; it ends the
// search once the bounds are within pmtuGranularity.
func (p *pmtuState) planRound(now time.Time) {
	if p.hi-p.lo < pmtuGranularity {
		p.searching = false
		p.raiseAt = now.Add(pmtuRaiseAfter)
		return
	}
	r := p.round[:0]
	for i := pmtuSplit; i >= 1; i-- {
		r = append(r, p.lo+(p.hi-p.lo)*i/pmtuSplit)
	}
	for _, c := range pmtuCommon {
		if c > p.lo && c < p.hi {
			r = append(r, c)
		}
	}
	slices.Sort(r)
	r = slices.Compact(r)
	slices.Reverse(r)
	if len(r) > pmtuRoundMost {
		// The largest, and the smallest ones: a round that finds
		// nothing above them still settles near the bottom.
		r = append(r[:1], r[len(r)-pmtuRoundMost+1:]...)
	}
	p.round, p.roundLost = r, 0
}

// nextProbe returns the size and kind of the probe to send now, 0 if none.
func (p *pmtuState) nextProbe(now time.Time) (int, uint8) {
	switch {
	case p.confirming:
		if p.pending(probeConfirm, probeControl) {
			return 0, 0
		}
		if p.needControl {
			return p.ctlSize(), probeControl
		}
		return p.csize, probeConfirm
	case p.searching:
		if len(p.round) == 0 {
			if p.pending(probeSearch) {
				return 0, 0
			}
			p.planRound(now)
			if len(p.round) == 0 {
				return 0, 0
			}
		}
		size := p.round[0]
		p.round = p.round[1:]
		return size, probeSearch
	}
	return 0, 0
}

// ctlSize is the size of a confirmation's controls: the base, or when the
// base is in doubt, a bare PingRequest (0).
func (p *pmtuState) ctlSize() int {
	if p.csize > p.base {
		return p.base
	}
	return 0
}

// pollProbe returns a probe when one is due, or nil.
func (s *session) pollProbe(now time.Time, buf []byte) []byte {
	p := s.mtu()
	if p == nil || s.spanFull() {
		return nil
	}
	if !p.started && (s.send.bulk != nil || p.wanted) {
		// With the first message the base does not carry whole: one
		// that fits the size found goes whole (pathSize), so the
		// search settles in the round trips after it. A connection of
		// small messages never probes.
		p.started = true
		p.startSearch(p.base, p.max)
	}
	size, kind := p.nextProbe(now)
	if size == 0 && kind != probeControl {
		return nil
	}
	if cap(buf) < size {
		buf = make([]byte, 0, size)
	}
	h := header{packetID: s.send.nextPID}
	b := appendHeader(buf[:0], &h)
	id := s.pingNow(now)
	ping := message{id: idPingRequest, payload: []byte{id}}
	// The PingRequest goes last: a receiver that reads a truncated
	// probe (its buffer smaller than the probe) finds it cut, and does
	// not answer a size it did not get.
	b = padTo(b, size-sizeMessage(&ping))
	b = appendMessage(b, &ping)
	// A PingReply goes at once: a round trip, with the variation and
	// the peer's scheduling (the RTO's floor covers an ack delay).
	p.inflight = append(p.inflight, pmtuProbe{size: len(b), id: id, kind: kind, lostAt: now.Add(s.loss.rto())})
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
	if p == nil {
		return
	}
	i := slices.IndexFunc(p.inflight, func(pr pmtuProbe) bool { return pr.id == id })
	if i < 0 {
		return
	}
	pr := p.inflight[i]
	p.inflight = slices.Delete(p.inflight, i, i+1)
	p.carried(now, pr.size)
	switch pr.kind {
	case probeConfirm:
		p.confirming = false
		p.quietUntil = now.Add(4 * s.loss.rto())
	case probeControl:
		p.needControl = false
		if p.cfails >= p.confirmProbes() {
			s.confirmFailed(now)
		}
	default:
		if pr.size > p.size {
			p.size = pr.size
		}
		p.lo = max(p.lo, pr.size)
		s.roundStep(now)
	}
}

// carried hears that the path carried a datagram of size bytes (acked or
// answered).
func (p *pmtuState) carried(now time.Time, size int) {
	if size > p.base {
		p.bulkAckedAt = now
	}
	if size >= p.base {
		p.baseAckedAt = now
	}
	if p.confirming {
		p.largestSeen = max(p.largestSeen, size)
	}
}

// confirmProbes is how many probes of the size in doubt are lost before a
// confirmation fails.
func (p *pmtuState) confirmProbes() int {
	if p.csize > p.base {
		return pmtuMaxProbes
	}
	return pmtuBaseProbes
}

// probeLost takes the probe pr for lost.
func (s *session) probeLost(now time.Time, pr pmtuProbe) {
	p := s.mtu()
	p.probesLost++
	switch pr.kind {
	case probeConfirm:
		// A control goes next: each loss counts only once the path
		// is seen to carry a smaller size after it, so that a burst
		// of loss counts once.
		p.cfails++
		p.needControl = true
	case probeControl:
		// Sent again: the path's failing for every size is no
		// matter of size.
	default:
		if pr.size > p.lo && (p.roundLost == 0 || pr.size < p.roundLost) {
			p.roundLost = pr.size
		}
		s.roundStep(now)
	}
}

// roundStep ends the search's round once none of its probes is left to
// send or in flight: the smallest size lost bounds the next.
func (s *session) roundStep(now time.Time) {
	p := s.mtu()
	if !p.searching || len(p.round) > 0 || p.pending(probeSearch) {
		return
	}
	if p.roundLost > p.lo {
		p.hi = min(p.hi, p.roundLost-1)
	}
	p.roundLost = 0
	if p.hi-p.lo < pmtuGranularity {
		p.searching = false
		p.raiseAt = now.Add(pmtuRaiseAfter)
	}
}

// confirmFailed ends a confirmation whose probes of the size in doubt were
// all lost while a smaller datagram got through: unless a datagram of that
// size was acked meanwhile (random loss spares some), the size is a black
// hole; the base's ends the connection.
func (s *session) confirmFailed(now time.Time) {
	p := s.mtu()
	p.confirming = false
	if p.csize > p.base && p.bulkAckedAt.After(p.suspectAt) || p.csize <= p.base && p.baseAckedAt.After(p.suspectAt) {
		p.quietUntil = now.Add(4 * s.loss.rto())
		return
	}
	if p.csize > p.base {
		s.blackHole(now)
		return
	}
	o := s.cfg.sizeOverhead()
	largest := p.largestSeen
	if largest > 0 {
		largest += o
	}
	s.fail(&PathMTUError{Size: p.base + o, Largest: largest, Probes: p.cfails})
}

// suspectLost hears that the reliable datagram d was found lost: if it was
// a bulk datagram larger than the base, the current size is confirmed
// again; if it was larger than half the base and lost again, the base.
func (s *session) suspectLost(now time.Time, d *sent) {
	p := s.mtu()
	if p == nil || p.confirming || now.Before(p.quietUntil) {
		return
	}
	switch {
	case len(d.b) > p.base:
		p.csize = p.size
	case len(d.b) > p.base/2 && d.sends >= 2:
		p.csize = p.base
	default:
		return
	}
	p.confirming = true
	p.suspectAt = now
	p.cfails, p.needControl, p.largestSeen = 0, false, 0
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
	p.startSearch(p.base, p.max)
	p.raiseAt = time.Time{}
	l := &s.loss
	for k := range l.sent.n {
		if d := l.sent.at(k); !d.acked && len(d.latest) == 0 && len(d.b) > p.size && d.retireAt == 0 {
			d.retireAt = d.sends + pmtuRetireSends
			if !d.lost && d.b != nil {
				// Lost to the path, not to congestion: out of flight
				// now, so that the window lets their fragments and
				// everything after them go, and no timeout of theirs
				// holds the transfer.
				l.queueLost(d)
			}
		}
	}
}

// tooLarge reports whether d, found lost, may not go again as it is: a
// datagram larger than the path now carries.
func (s *session) tooLarge(d *sent) bool {
	return s.mtu() != nil && len(d.b) > s.mtu().size && d.retireAt > 0 && d.sends >= d.retireAt
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

// convert makes d, an ordinary reliable datagram larger than the path
// carries after a black hole, small enough to go again under its
// PacketID: its largest application messages, each whole in it, become
// fragmented transfers whose FragmentStart takes the message's place (the
// same index, MessageID and InOrder fields) and whose other fragments
// are repacked (refrags). What names the message, (PacketID, index),
// names the FragmentStart now, and a dependency on a fragmented message
// resolves once it is reassembled and delivered (DECISIONS §5): nothing
// that depends on it waits in vain. As with a retired bulk datagram,
// it was sent as it was once more after the black hole was found
// (pmtuRetireSends), so that a peer that had it acked it again; should
// it have arrived anyway, the receiver drops the converted copy as a
// duplicate and holds fragments of a transfer that never starts until
// the TransferID is reused (reassembly.stale). It returns false, and d
// goes as it is, when no TransferIDs are free or nothing converts.
func (s *session) convert(d *sent) bool {
	p := s.mtu()
	dg := &p.parsed
	if parseInto(d.b, dg) != nil {
		return false
	}
	fs := s.cfg.fragSizeFor(p.size)
	size := len(d.b)
	var picked [maxPerDatagram]bool
	var tids []byte
	for size > p.size {
		k := -1
		for i := range dg.msgs {
			m := &dg.msgs[i]
			if picked[i] || m.fragment || m.id < MinMessageID || m.id > MaxMessageID || len(m.payload) <= fs {
				continue
			}
			if k < 0 || len(m.payload) > len(dg.msgs[k].payload) {
				k = i
			}
		}
		if k < 0 {
			break
		}
		tid, ok := s.send.tids.alloc()
		if !ok {
			break
		}
		m := &dg.msgs[k]
		before := sizeMessage(m)
		picked[k] = true
		tids = append(tids, tid)
		rest := len(m.payload) - fs
		m.fragStart, m.fragment, m.transferID = true, true, tid
		m.fragCount = 1 + uint32((rest+fs-1)/fs)
		size += sizeMessage(&message{id: m.id, fragStart: true, fragment: true, fragCount: m.fragCount, transferID: tid, payload: m.payload[:fs], order: m.order, orderIndex: m.orderIndex, orderMulti: m.orderMulti}) - before
	}
	if size > p.size {
		for _, tid := range tids {
			s.send.tids.release(tid)
		}
		return false
	}
	r := &retiredDgram{d: d, gen: d.gen, converted: true, old: d.b}
	n := 0
	for i := range dg.msgs {
		m := &dg.msgs[i]
		if !picked[i] {
			continue
		}
		whole := m.payload
		m.payload = whole[:fs]
		tid := tids[n]
		n++
		t := s.trackAt(msgRef{d.packetID, uint16(i)})
		for num, off := uint32(1), fs; off < len(whole); num, off = num+1, off+fs {
			end := min(off+fs, len(whole))
			f := refrag{from: r, tid: tid, number: num, payload: whole[off:end], last: end == len(whole)}
			if f.last && t != nil {
				f.track = depOn{t: t, ref: t.ref}
			}
			p.refrags = append(p.refrags, f)
			r.left++
		}
		if t != nil {
			t.complete, t.fragmented = false, true
		}
		s.send.tids.carried(tid) // d carries its FragmentStart
		d.transfers = append(d.transfers, tid)
	}
	if picked[0] {
		d.whole0 = false // its first block waits for the transfer now
	}
	b := s.getBuf(size)
	d.b = appendDatagram(b, dg)
	p.retired = append(p.retired, r)
	p.converted++
	return true
}

// trackAt returns the track of the message placed at ref, or nil.
func (s *session) trackAt(ref msgRef) *track {
	o := &s.send.order
	for _, t := range o.fifo[o.fifoAt:] {
		if t != nil && t.packed && t.at == ref {
			return t
		}
	}
	return nil
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
		if r.converted {
			if r.left > 0 {
				kept = append(kept, r) // its ack releases the rest
			}
			continue
		}
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
			if !f.from.converted {
				pk.appBytes += len(f.payload) // a converted datagram's acks count them
			}
			pk.holds = true
			if !containsByte(pk.tids, f.tid) {
				s.send.tids.carried(f.tid)
				pk.tids = append(pk.tids, f.tid)
			}
			if f.last {
				// The transfer is packed (as tookFragment).
				if t := f.track.live(); t != nil {
					t.lastPID, t.complete = h.packetID, true
				}
				s.send.tids.release(f.tid)
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

// pathSize sizes m, a reliable message about to be placed (or queued), for
// the datagram size in use now: whole if it fits one (grow), else a
// transfer with fragments that fill one. Versions of latest state keep
// the base's sizes: their datagrams are never resent (latest.go).
func (s *session) pathSize(m *outMsg) {
	p := s.mtu()
	if p == nil || m.off > 0 || !m.reliable || m.contentID != 0 {
		return
	}
	if len(m.payload) > s.cfg.wholeLimit() {
		p.wanted = true
	}
	if len(m.payload) <= s.cfg.wholeLimitFor(p.size) {
		m.frag, m.fragSize, m.fragCount = false, 0, 0
		return
	}
	m.frag = true
	m.fragSize = s.cfg.fragSizeFor(p.size)
	m.fragCount = uint32((len(m.payload) + m.fragSize - 1) / m.fragSize)
}

// grow lets the datagram p, limited to the base, take m, a whole message
// of need bytes too large for the base, up to the size path MTU discovery
// found; it reports whether it did. After a black hole such a datagram
// goes again converted (convert).
func (p *specPacking) grow(s *session, m *outMsg, need int) bool {
	if m.frag || p.path <= p.limit || len(m.payload) <= s.cfg.wholeLimit() || need > p.path-sizeHeader(p.h)-len(p.body) {
		return false
	}
	p.limit = p.path
	return true
}
