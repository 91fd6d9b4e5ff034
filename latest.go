package knet

import "encoding/binary"

// Reliable latest state (Message.ContentID on a reliable message, the
// spec dialect): of the versions of one state (ID, ContentID), the newest
// is delivered exactly once unless a newer one replaces it, an older one is
// never delivered after a newer one, and a version a newer one replaced is
// not sent again.
//
// On the wire each version carries a tag just before it: a message of
// reserved ID 5 (idExt) whose content is extLatest, the ContentID
// (u32) and the version's number (u32), counted per state: a state's
// versions are numbered 1, 2, 3..., so that the receiver's comparison,
// of serial numbers (seqLess32), never sees two of one state 2^31 apart
// (with one counter per connection, a state left alone while 2^31
// versions of others went would have its next version read as older and
// dropped, though acked). knet's receiver keeps the newest number it took for each
// state and drops a version numbered no higher. A receiver that ignores ID
// 5 sees plain reliable messages: every version, perhaps twice, in any
// order.
//
// A version small enough for one datagram goes in a reliable datagram of
// versions only, which nothing names (the first message of such a
// datagram is no anchor, and a message that depends on a version waits at
// the sender until it is acked). When that datagram is found lost it is
// not resent as it was: it is dropped from the datagrams in flight, as if
// acked, and the versions in it that are still the newest of their state
// queue again, to go in a new datagram under a new PacketID (their tag
// keeps the number, so that the receiver drops a copy when the first one
// comes late); those replaced meanwhile go no more. A probe timeout
// passes over a datagram whose versions were all replaced (it would send
// nothing, and earn no ack) to the oldest that would send something: after
// a blackout, the datagrams of every version sent during it are in flight,
// and the newest goes again at the first probe. A version too large
// for one datagram travels as an ordinary fragmented transfer, its tag
// before its first fragment, and is resent until acked.

// Unreliable latest state (Message.ContentID on an unreliable message, not
// in order, naming nothing) takes its number from the same counter and
// goes after the same tag, in an unreliable datagram with the other
// unreliable messages; the receiver's check is the same. It names no
// earlier version, so the sender keeps no record of it once it has left.

// extLatest is the idExt kind of a latest-state tag.
const extLatest = 2

// maxLatestTag is the bytes a tag takes: the block header, the MessageID,
// the kind, the ContentID, the number.
const maxLatestTag = 2 + 1 + 1 + 4 + 4

// maxLatestStates bounds the states a receiver keeps the newest number
// of; past it, one is forgotten for each new one (and an older version of
// that state coming after could be taken).
const maxLatestStates = 4096

// extras is what few connections use, made on first use.
type extras struct {
	rcpt *receipts     // receipts owed (receipts.go)
	rl   *relLatest    // reliable latest state sent
	seen *latestSeen   // reliable latest state taken
	fair [2]fairQueue  // channel weights: the unreliable queue's, the reliable one's
	kept *unackedState // a dialed connection's reliable messages, until delivered (unacked.go)
}

func (s *session) ext() *extras {
	if s.x == nil {
		s.x = new(extras)
	}
	return s.x
}

func (s *session) rcptOf() *receipts {
	if s.x == nil {
		return nil
	}
	return s.x.rcpt
}

func (s *session) rlOf() *relLatest {
	if s.x == nil {
		return nil
	}
	return s.x.rl
}

// relLatest is a session's sending side of reliable latest state, made
// when the first version is sent.
type relLatest struct {
	q sendQueue // versions small enough for one datagram
	// Each state's newest version's number. Kept for every state ever
	// sent (numbering must go on where it stopped: see above), so it
	// grows with the distinct states the application uses, not with
	// anything the peer sends.
	newest map[contentKey]uint32
	queued map[contentKey]*outMsg // each state's version still queued, if any
	dead   int                    // versions replaced but left in q as done
}

// latestSent is a version in a datagram of versions.
type latestSent struct {
	ref       Ref
	t         *track
	priority  int8
	lostSends int // of the version before this datagram
}

// latestTag is a tag read from the wire.
type latestTag struct {
	content, ver uint32
}

func appendLatestTag(b []byte, content, ver uint32) []byte {
	c := [9]byte{extLatest, byte(content), byte(content >> 8), byte(content >> 16), byte(content >> 24),
		byte(ver), byte(ver >> 8), byte(ver >> 16), byte(ver >> 24)}
	return appendMessage(b, &message{id: idExt, payload: c[:]})
}

// parseLatestTag reads the content of an idExt message as a tag.
func parseLatestTag(p []byte) (latestTag, bool) {
	if len(p) != 9 || p[0] != extLatest {
		return latestTag{}, false
	}
	return latestTag{content: binary.LittleEndian.Uint32(p[1:]), ver: binary.LittleEndian.Uint32(p[5:])}, true
}

func (s *session) relLatestState() *relLatest {
	x := s.ext()
	if x.rl == nil {
		x.rl = &relLatest{newest: make(map[contentKey]uint32), queued: make(map[contentKey]*outMsg)}
	}
	return x.rl
}

// queueLatest queues m, a reliable latest-state version: it takes its
// state's next number, and replaces the version of its state still queued. It reports
// false if m is not one (the reference dialect keeps the reference's
// meaning: none).
func (s *session) queueLatest(m *outMsg) bool {
	if m.contentID == 0 || m.inOrder || len(m.after) > 0 {
		return false
	}
	tags := s.wire.latestTags()
	if !m.reliable {
		if tags {
			// Unreliable latest state: numbered from the same
			// counter, tagged, and queued with the other unreliable
			// messages (or as a transfer, if too large).
			m.version = s.relLatestState().next(contentKey{m.id, m.contentID})
		}
		return false
	}
	rl := s.relLatestState()
	k := contentKey{m.id, m.contentID}
	if tags {
		m.version = rl.next(k)
		m.relLatest = true
	}
	if old := rl.queued[k]; old != nil && old.off == 0 && !old.done && s.send.bulk != old {
		// The state's datagrams given up so far count for the newer
		// version: a path that loses them all ends the connection
		// (MaxMessageSendCount) however often the state changes.
		m.lostSends = old.lostSends
		s.stats.ReplacedMessages++
		s.host.sendDone(len(old.payload))
		s.replacedVersion(old.ref, old.track)
		old.receipted = true // told lost just now
		if old.relLatest && !old.frag {
			// It stays in the queue of versions as done, which packing
			// passes over, until half the queue is such: taking each out
			// meant a scan of the queue, 2.8µs a version with 20,000
			// states queued behind a peer that stopped acking
			// (BenchmarkReplaceQueuedVersion).
			putPayload(old.pbuf)
			old.pbuf, old.payload, old.track = nil, nil, nil
			old.done = true
			rl.dead++
			if rl.dead > 64 && rl.dead*2 > rl.q.len() {
				rl.sweep(s)
			}
		} else {
			s.queueFor(old).remove(old)
			s.putMsg(old)
		}
	}
	rl.queued[k] = m
	// The reference dialect's wire has no tag: a version is a plain
	// reliable message, replaced only while it waits in the queue (its
	// reliable number is taken when it is packed, so no number goes
	// missing), as the reference itself does.
	return tags
}

// next takes state k's next version number. 0 is skipped: a message
// numbered 0 is untagged (outMsg.version).
func (rl *relLatest) next(k contentKey) uint32 {
	v := rl.newest[k] + 1
	if v == 0 {
		v = 1
	}
	rl.newest[k] = v
	return v
}

// sweep lets go of the replaced versions left in the queue.
func (rl *relLatest) sweep(s *session) {
	q := &rl.q
	live := q.items[:q.head]
	for _, m := range q.items[q.head:] {
		if m.done {
			s.freeQueued(m)
			continue
		}
		live = append(live, m)
	}
	clear(q.items[len(live):])
	q.items = live
	rl.dead = 0
}

// latestQueued is how many versions small enough for one datagram wait
// to go.
func (s *session) latestQueued() int {
	if s.rlOf() == nil {
		return 0
	}
	return s.rlOf().q.len()
}

// latestQ is the queue of versions, nil if none was sent.
func (s *session) latestQ() *sendQueue {
	if rl := s.rlOf(); rl != nil {
		return &rl.q
	}
	return nil
}

// queueForLatest is the queue version m waits in.
func (s *session) queueForLatest(m *outMsg) *sendQueue {
	if m.frag {
		return &s.send.relQ
	}
	return &s.rlOf().q
}

// replacedVersion lets go of a version a newer one replaced before it
// went (again): what depends on it no longer waits, and its receipt says
// lost.
func (s *session) replacedVersion(ref Ref, t *track) {
	if t != nil && t.ref == ref {
		t.dropped = true
	}
	if s.cfg.receipts && t != nil {
		s.relReceiptLost(ref)
	}
}

// packedLatest records that version m left the queue.
func (s *session) packedLatest(m *outMsg) {
	rl := s.rlOf()
	k := contentKey{m.id, m.contentID}
	if rl.queued[k] == m {
		delete(rl.queued, k)
	}
}

// latestDue reports whether a datagram of versions should go before the
// other reliable messages: it has versions, and none of the others is of
// higher priority.
func (s *session) latestDue() bool {
	rl := s.rlOf()
	if rl == nil || rl.q.len() == 0 {
		return false
	}
	if s.send.relQ.len() == 0 {
		return true
	}
	return rl.q.items[rl.q.head].priority >= s.send.relQ.items[s.send.relQ.head].priority
}

// abandonLatest takes a datagram of versions found lost: it goes no more,
// and the versions in it that are still the newest of their state queue
// again.
func (s *session) abandonLatest(d *sent) {
	rl := s.rlOf()
	s.loss.abandon(d)
	requeued := 0
	k := 0
	eachVersion(d, func(tag latestTag, m *message) bool {
		if k >= len(d.latest) {
			return false
		}
		e := d.latest[k]
		k++
		key := contentKey{m.id, tag.content}
		if rl.newest[key] != tag.ver || rl.queued[key] != nil {
			// Replaced since: it goes no more. A newer version still
			// queued carries on its count.
			if q := rl.queued[key]; q != nil {
				q.lostSends = max(q.lostSends, e.lostSends+1)
			}
			s.stats.ReplacedMessages++
			s.replacedVersion(e.ref, e.t)
			return true
		}
		o := s.newMsg()
		pbuf := getPayload(len(m.payload))
		*o = outMsg{ref: e.ref, id: m.id, payload: append((*pbuf)[:0], m.payload...), pbuf: pbuf,
			reliable: true, tracked: e.t != nil, priority: e.priority, contentID: tag.content,
			relLatest: true, version: tag.ver, receipted: true, lostSends: e.lostSends + 1, deps: o.deps[:0], after: o.after[:0]}
		if t := e.t; t != nil && t.ref == e.ref {
			t.packed = false
			o.track = t
		}
		rl.queued[key] = o
		rl.q.push(o)
		requeued += len(m.payload)
		return true
	})
	if r := d.appBytes - requeued; r > 0 {
		s.host.sendDone(r)
	}
	// Its bytes count again when they go again.
	d.appBytes = 0
	// Off the front of the window now if it is the oldest: left there
	// until the next ack, it would still count as the oldest unacked
	// (spanFull), and with the span full no datagram could go to earn
	// that ack.
	s.loss.sent.trim(s.trimmed)
}

// versionsReplaced reports whether d is a datagram of versions of which
// every one was replaced since (a newer version of its state was queued):
// found lost, nothing of it would go again (abandonLatest). A probe passes
// over it (lossState.onProbeTimeout).
func (s *session) versionsReplaced(d *sent) bool {
	rl := s.rlOf()
	if len(d.latest) == 0 || rl == nil {
		return false
	}
	replaced := true
	parsed := eachVersion(d, func(tag latestTag, m *message) bool {
		key := contentKey{m.id, tag.content}
		if rl.newest[key] == tag.ver && rl.queued[key] == nil {
			replaced = false // still the newest: it would go again
		}
		return replaced
	})
	return parsed && replaced
}

// eachVersion calls f with each version in d, a datagram of versions, and
// its tag, in the datagram's order, until f returns false. It reports
// whether d parsed.
func eachVersion(d *sent, f func(tag latestTag, m *message) bool) bool {
	dg, _, err := parseDatagram(d.b)
	if err != nil {
		return false
	}
	for i := 0; i+1 < len(dg.msgs); i++ {
		tm := &dg.msgs[i]
		if tm.fragment || tm.id != idExt {
			continue
		}
		tag, ok := parseLatestTag(tm.payload)
		if !ok {
			continue
		}
		i++
		if !f(tag, &dg.msgs[i]) {
			break
		}
	}
	return true
}

// latestSeen is a receiver's record of the newest version taken of each
// state.
type latestSeen struct {
	newest map[contentKey]uint32
}

// takeVersion reports whether version ver of state k is newer than any
// taken, and records it if so.
func (s *session) takeVersion(k contentKey, ver uint32) bool {
	x := s.ext()
	ls := x.seen
	if ls == nil {
		ls = &latestSeen{newest: make(map[contentKey]uint32)}
		x.seen = ls
	}
	if old, ok := ls.newest[k]; ok {
		if !seqLess32(old, ver) {
			return false
		}
	} else if len(ls.newest) >= maxLatestStates {
		for x := range ls.newest {
			delete(ls.newest, x)
			break
		}
	}
	ls.newest[k] = ver
	return true
}

// seqLess32 compares 32-bit serial numbers (RFC 1982).
func seqLess32(a, b uint32) bool { return a != b && b-a < 1<<31 }
