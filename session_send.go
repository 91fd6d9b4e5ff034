package knet

import (
	"fmt"
	"slices"
	"sync"
	"time"
)

// sendState is what goes out: the packet numbers, the queues
// (sendqueue.go), the dependencies tracked (inorder.go's sendOrder), the
// transfer being packed, and the free lists that keep steady traffic from
// allocating. Recovery (loss.go) and the rate (congestion.go, pacer.go)
// are components of their own.
type sendState struct {
	nextPID      uint32     // the low 22 bits of nextPN
	pacedOut     bool       // work waits for the pacer
	nextPN       uint64     // the packet number of the next new datagram
	skips        *skipState // PacketIDs skipped (skip.go), made with the first reliable datagram
	out          outInfo    // the datagram poll returned last (see lastOut)
	relQ         sendQueue  // reliable messages and fragmented transfers
	unrelQ       sendQueue
	latestQueued map[contentKey]*outMsg
	order        sendOrder
	tids         transferIDs
	fragSize     int       // each fragment's payload (config.fragSize, or the C++ wire's)
	bulk         *outMsg   // fragmented message whose fragments are being packed
	spanHold     int       // see holdLimit
	forgotAt     time.Time // see poll
	tidyAt       time.Time // see tidy
	freeMsgs     freeList[*outMsg]
	freeBufs     freeList[[]byte]
}

// sendDeadline adds an open connection's timers of sending: the acks
// owed, once their delay is up (unless held: no new datagram may go, see
// spanFull), the loss and probe timers (loss.go), and the pacer, when
// work waits for it.
func (s *session) sendDeadline(now time.Time, held bool, t *deadlines) {
	if s.acks.pending() > 0 && !held {
		t.at(s.acks.oldest.Add(s.ackDelay()))
	}
	if x, ok := s.loss.nextTimeout(s.closing.asked); ok {
		t.at(x)
	}
	t.at(s.loss.lossTime)
	s.receiptDeadline(t)
	if s.send.pacedOut {
		t.at(s.rc.nextSend(now, s.cfg.maxDatagram))
	}
	s.pmtuDeadline(t)
}

// advanceSend runs the loss and probe timers: what they find lost goes
// again. (Acks and paced work due go with the next poll.)
func (s *session) advanceSend(now time.Time) {
	if !s.loss.lossTime.IsZero() && !now.Before(s.loss.lossTime) {
		s.detectLoss(now)
		if s.state == stateDone {
			return
		}
	}
	if x, ok := s.loss.nextTimeout(s.closing.asked); ok && !now.Before(x) {
		s.onProbeTimeout(now)
	}
	s.expireReceipts(now)
	s.advancePMTU(now)
}

// onProbeTimeout runs when nothing was acked for a probe timeout (see
// lossState.onProbeTimeout).
func (s *session) onProbeTimeout(now time.Time) {
	probed, ok := s.loss.onProbeTimeout(now, s.versionsReplaced)
	if !ok {
		s.fail(ErrRetransmitLimit)
		return
	}
	if probed {
		s.rc.cc.OnTimeout(now)
	}
	if s.client && s.secure {
		// A secure client may have moved (a NAT rebinding) without
		// knowing: resends keep their packet numbers, which cannot start
		// the server's check of a new address, so a fresh datagram (a
		// ping) goes too (see Conn.checkPath).
		s.live.nextPing = now
	}
}

// ackDelay is how long we hold a lone ack hoping for company: a quarter of
// the round trip, within 1ms and MaxAckDelay.
func (s *session) ackDelay() time.Duration {
	return min(max(s.loss.rtt.srtt/4, time.Millisecond), s.cfg.maxAckDelay)
}

// getBuf returns an empty buffer for a reliable datagram of n bytes, kept
// until acked. A small one (a game's event, an ack with a message) takes a
// buffer of its own size class from the shared pools: a full-size buffer
// for each, held until its ack, was most of a busy game server's memory per
// connection. Full datagrams (a transfer's) come from the session's own
// free list, which a bulk sender keeps warm.
func (s *session) getBuf(n int) []byte {
	if n > s.cfg.maxDatagram/2 {
		if b, ok := s.send.freeBufs.get(); ok {
			if cap(b) >= n {
				return b[:0]
			}
			putShared(b) // too small for a datagram past the base (pmtu.go)
		}
		n = max(n, s.cfg.maxDatagram)
	}
	p := getPayload(n)
	b := (*p)[:0]
	*p = nil
	bufBoxes.Put(p)
	return b
}

func (s *session) putBuf(b []byte) {
	if cap(b) >= s.cfg.maxDatagram && len(s.send.freeBufs.items) < maxFreeBufs {
		s.send.freeBufs.put(b, maxFreeBufs)
		return
	}
	putShared(b)
}

// bufBoxes keeps the boxes the payload pools hold datagram buffers in
// while the buffers are out, so that putting one back allocates nothing.
var bufBoxes sync.Pool

// putShared puts b in the payload pools.
func putShared(b []byte) {
	p, ok := bufBoxes.Get().(*[]byte)
	if !ok {
		p = new([]byte)
	}
	*p = b
	putPayload(p)
}

// wholeLimit is the largest payload sent as one message block; larger ones
// are fragmented. It leaves room in the content block for the MessageID,
// and in a datagram for the headers and up to MaxDependencies dependencies.
func (c *config) wholeLimit() int { return c.wholeLimitFor(c.maxDatagram) }

// wholeLimitFor is wholeLimit in datagrams of size bytes (as maxDatagram,
// sealing's overhead taken off): path MTU discovery's (pmtu.go).
func (c *config) wholeLimitFor(size int) int {
	return min(maxContentLength-maxVLE32Size, size-wholeRoom)
}

const (
	// maxVLE32Size is the longest VLE-1.7/1.7/16 (a MessageID, a
	// FragmentCount).
	maxVLE32Size = 4
	// wholeRoom is what a datagram keeps free beside a whole message's
	// payload: the datagram and message headers and MaxDependencies
	// dependency entries.
	wholeRoom = 96
	// startRoom is what a fragmented transfer's first block, or a
	// handshake message, keeps free below wholeLimit: a MessageID and a
	// FragmentCount at their longest.
	startRoom = 2 * maxVLE32Size
)

// placed records that m, tracked by t, had its (first) block placed at
// at. Only a reliable message's resolution waits for what it depends on
// (resolvedWithin), so only then are its dependencies kept (named says
// whether it has any on the wire); an unreliable one's is its age, and a
// latest-state update names up to 8 versions.
func (t *track) placed(now time.Time, at msgRef, m *outMsg, named bool) {
	t.packed = true
	t.at = at
	if named && t.reliable {
		t.deps = append(t.deps[:0], m.deps...)
	}
	t.lastPID = at.pid
	t.complete = !m.frag
	t.fragmented = m.frag
	t.sentAt = now
}

// fragSize is the payload of each fragment: at most MaxFragmentSize, and
// sized so that whole fragments fill a datagram with little left over.
func (c *config) fragSize() int { return c.fragSizeFor(c.maxDatagram) }

// fragSizeFor is fragSize in datagrams of size bytes: a transfer started
// once path MTU discovery found a larger size than the base fills those
// (pmtu.go). DECISIONS §6 bounds fragments by MaxFragmentSize only, and a
// receiver takes fragments of any size.
func (c *config) fragSizeFor(size int) int {
	const perFrag = 7 // header, TransferID, FragmentNumber at its longest
	avail := size - minHeaderSize - 16
	k := (avail + c.maxFragment + perFrag - 1) / (c.maxFragment + perFrag)
	// Below the whole-message limit, so that a fragmented message has at
	// least two fragments and its first leaves room for the MessageID.
	return min(c.maxFragment, avail/k-perFrag, c.wholeLimitFor(size)-startRoom)
}

// poll returns the next datagram to send, or nil when there is none now. A
// reliable datagram's bytes stay the session's (they are kept for
// retransmission); other datagrams are built in buf.
func (s *session) poll(now time.Time, buf []byte) []byte {
	s.send.pacedOut = false
	switch s.state {
	case stateSyn:
		if s.owed.take(oweSyn) {
			s.handshake.synSends++
			return s.wire.control(buf, idConnectSyn, s.handshake.syn)
		}
		return nil
	case stateSynAck:
		if s.owed.take(oweSynAck) {
			b := s.wire.control(buf, idConnectSynAck, s.handshake.synAck)
			if b != nil {
				s.synAckWent(now)
			}
			return b
		}
		return nil
	case stateClosing:
		if s.owed.take(oweDisc) {
			return s.wire.control(buf, idDisconnect, s.closing.reason)
		}
		return s.pollClosing(now, buf) // session_close.go
	case stateLinger, stateDone:
		if s.owed.take(oweDiscAck) {
			if s.handshake.wasOpen {
				s.closing.discAckedAt = now
				return s.wire.control(buf, idDisconnectAck, nil)
			}
			if b := s.wire.control(buf, idDisconnectAck, s.closing.refuseReason); b != nil || len(s.closing.refuseReason) == 0 {
				return b
			}
			// A ConnectSyn too short to earn the reason's bytes (the
			// anti-amplification rule) gets the bare refusal.
			return s.wire.control(buf, idDisconnectAck, nil)
		}
		return nil
	case stateOK:
	default:
		return nil
	}
	if s.owed.take(oweDiscAck) {
		s.closing.discAckedAt = now
		return s.wire.control(buf, idDisconnectAck, nil)
	}
	if now != s.send.forgotAt && s.send.order.tracking() {
		// Acks forget resolved tracks too, but a connection that sends
		// only unreliable messages hears none: their tracks resolve with
		// age, and went only when a reliable one was acked, 60 of them
		// kept between a game server's reliable events 2s apart. Done
		// at the first poll of a flush only: its polls share their now.
		s.send.forgotAt = now
		s.send.order.forget(func(t *track) bool { return s.forgettable(now, t) })
	}
	if s.live.suspended {
		// Probes, acks and answers only (resume.go).
		return s.wire.pollUnreliable(now, buf)
	}
	if s.unreliableFirst() {
		// Unreliable messages of higher priority than any reliable one
		// queued go first: every datagram takes room under the peer's
		// flow control, and reliable ones taking it all left them to be
		// replaced in the queue, tick after tick.
		if b := s.wire.pollUnreliable(now, buf); b != nil {
			return b
		}
	}
	if b := s.pollProbe(now, buf); b != nil {
		return b
	}
	if b := s.pollReliable(now); b != nil {
		return b
	}
	if b := s.wire.pollUnreliable(now, buf); b != nil {
		return b
	}
	if s.owed.owes(oweAnchor) {
		// An unreliable in-order message waits for one.
		if b := s.pollReliable(now); b != nil {
			return b
		}
	}
	if s.closing.flushing {
		// The peer closed: our answer goes once what Send took is
		// delivered (session_close.go), never a Disconnect of ours.
		return s.pollFlushed(now, buf)
	}
	if s.closing.asked && s.sendIdle() && s.acks.pending() == 0 {
		// Everything is delivered: Disconnect, in order after it all
		// (every dependency is resolved, so none is named). Unreliable
		// messages waiting for their acks (receipts) wait too, at most
		// receiptWait: the peer sends no acks once it has our
		// Disconnect.
		s.state = stateClosing
		s.closing.discBackoff = min(s.loss.rto(), firstDiscResend)
		s.closing.discResend = now.Add(s.closing.discBackoff)
		return s.wire.control(buf, idDisconnect, s.closing.reason)
	}
	return nil
}

// amplifies reports whether a server may send b before the peer proved
// its address (addressProven), and counts it: an address not yet proven
// to be the sender's gets no more bytes than it sent (every datagram from
// it adds credit: a resent ConnectSyn or opening, a ConnectAck). Nothing
// but the ConnectSynAck (or a refusal) goes before the proof anyway.
func (s *session) amplifies(b []byte) bool {
	if s.addressProven() {
		return true
	}
	if s.handshake.preOut+len(b) > s.handshake.preIn {
		return false
	}
	s.handshake.preOut += len(b)
	return true
}

func (s *session) sentUnreliable(b []byte) {
	s.numberNew(false)
	s.stats.DatagramsSent++
	s.stats.BytesSent += uint64(len(b))
}

// outInfo is what the connection needs to know of the datagram poll
// returned last, to seal it: its packet number, and whether it is a new
// datagram (the number never used before) or one sent again.
type outInfo struct {
	pn    uint64
	fresh bool
}

// numberNew gives the datagram being sent the next packet number, whose
// low 22 bits are its PacketID (nextPID): packet numbers only grow, and a
// reliable datagram (the spec's wire) keeps its number for every resend
// (sent.pn). A secure connection seals with it as the nonce. Now and then
// the number after a reliable datagram is skipped, never sent (skip.go).
func (s *session) numberNew(reliable bool) {
	s.send.out = outInfo{pn: s.send.nextPN, fresh: true}
	s.send.nextPN++
	if reliable && s.skipDue() {
		s.send.skips.add(uint32(s.send.nextPN) & packetIDMask)
		s.send.nextPN++
	}
	s.send.nextPID = uint32(s.send.nextPN) & packetIDMask
}

// skipDue counts a reliable datagram numbered and reports whether the
// packet number after it is to be skipped.
func (s *session) skipDue() bool {
	if s.send.skips == nil {
		s.send.skips = newSkipState(0)
	}
	return s.send.skips.due()
}

// startPIDAt has the next new datagram take PacketID pid (tests start near
// a wrap with it).
func (s *session) startPIDAt(pid uint32) {
	s.send.nextPID = pid & packetIDMask
	s.send.nextPN = uint64(s.send.nextPID)
}

// ackedUnsent returns why a, a PacketAck from the peer, is a lie, if it
// names a PacketID never sent: one skipped (skip.go), or one not reached
// yet (from nextPID on, in serial arithmetic: half the PacketIDs are
// ahead). No honest peer can have received either. PacketIDs behind are
// not checked further: an ack of one sent long ago, or of one before the
// first sent, names nothing in flight, and is passed over (loss.go).
func (s *session) ackedUnsent(a packetAck) error {
	if last := a.last(); !seqLess(last, s.send.nextPID) {
		return fmt.Errorf("it acked PacketID %d, never sent (the next is %d)", last, s.send.nextPID)
	}
	if s.send.skips != nil {
		if id, ok := s.send.skips.named(a, s.send.nextPID); ok {
			return fmt.Errorf("it acked PacketID %d, skipped, never sent", id)
		}
	}
	return nil
}

// takeAck takes a PacketAck from the peer, what it acks in flight freed
// (loss.go); one naming a PacketID never sent (ackedUnsent) ends the
// connection with a *ProtocolError instead, or, from a peer that has not
// proven its address, silently (takeProof), and takeAck reports false.
func (s *session) takeAck(now time.Time, a packetAck) bool {
	if err := s.ackedUnsent(a); err != nil {
		if s.awaitsProof() {
			s.takeProof(now, false)
		} else {
			s.protocolError(err)
		}
		return false
	}
	s.loss.onPacketAck(now, a, &s.sc().acked)
	return true
}

// spanFull reports whether one more datagram would put the newest PacketID
// 2^15 or more after the oldest unacked one (DECISIONS §4). Then no new
// datagram may go, whatever it carries: the receiver keeps the last 2^15
// PacketIDs, and the unacked one's resends, which keep their PacketID,
// would fall behind them and be taken for duplicates, acked and never
// delivered. Unreliable messages, acks and pings wait; resends go.
func (s *session) spanFull() bool {
	first := s.loss.sent.firstUnacked()
	return first != nil && seqDiff(first.packetID, s.send.nextPID) >= recvSpan-1
}

// pollReliable returns a retransmission or a new reliable datagram.
func (s *session) pollReliable(now time.Time) []byte {
	d := s.loss.nextResend()
	for d != nil {
		if len(d.latest) > 0 {
			// Versions of latest state: what is still the newest goes
			// in a new datagram, the rest no more (latest.go).
			s.abandonLatest(d)
		} else if s.mtu() != nil {
			s.suspectLost(now, d)
			if !s.tooLarge(d) {
				break
			}
			if !d.bulk {
				// Its large messages become transfers, and it goes
				// again smaller, under its PacketID (pmtu.go).
				s.convert(d)
				break
			}
			s.retire(d) // its fragments go in smaller datagrams (pmtu.go)
		} else {
			break
		}
		d = s.loss.nextResend()
	}
	if d != nil {
		if !s.rc.canSend(now, len(d.b)) {
			s.send.pacedOut = true
			return nil
		}
		s.wire.resend(now, d)
		s.rc.sent(len(d.b))
		s.stats.Retransmits++
		s.stats.DatagramsSent++
		s.stats.BytesSent += uint64(len(d.b))
		return d.b
	}
	if !s.owed.owes(oweAck|oweFlow|oweAnchor) && s.send.relQ.len() == 0 && s.latestQueued() == 0 && !s.repacking() {
		if s.loss.inflight < s.rc.window() {
			// Nothing to send though the window has room.
			s.loss.appLimited()
		}
		return nil
	}
	if s.loss.inflight >= s.rc.window() || s.loss.sent.count >= maxWindow || s.spanFull() {
		return nil
	}
	if s.send.spanHold >= s.holdLimit() {
		// Held back by the receiver's room, not by the path.
		s.loss.appLimited()
		return nil
	}
	if !s.rc.canSend(now, s.datagramLimit()) {
		s.send.pacedOut = true
		return nil
	}
	return s.wire.buildReliable(now)
}

// unreliableFirst reports whether the unreliable message first in its
// queue has a higher priority than every reliable one queued: the queues
// keep their highest priority first. A resend waiting is a reliable
// datagram of its own priority, taken as the reliable queue's.
func (s *session) unreliableFirst() bool {
	u := &s.send.unrelQ
	if u.len() == 0 {
		return false
	}
	top := u.items[u.head].priority
	if top <= 0 && s.loss.nextResend() != nil {
		return false
	}
	for _, q := range [...]*sendQueue{&s.send.relQ, s.latestQ()} {
		if q != nil && q.len() > 0 && q.items[q.head].priority >= top {
			return false
		}
	}
	return true
}

// holdLimit bounds spanHold: the payload bytes sent, since the oldest
// datagram unacked, that the receiver may have to hold until it arrives
// (messages that wait for others, and fragments). A receiver holds them
// within its ReceiveBuffer and refuses what does not fit, which costs
// resends; so ordered data runs ahead of a loss by at most three quarters
// of the buffer, ours taken for the peer's.
func (s *session) holdLimit() int { return s.cfg.recvBuffer * 3 / 4 }

// maxWindow bounds the reliable datagrams in flight, well within the span
// the protocol allows (2^15).
const maxWindow = 8192

// ackBlock is a PacketAck's size in a datagram, in either dialect.
const ackBlock = 2 + 1 + packetAckSize

// appendAcks adds to body PacketAcks for as many pending acks as fit in
// room bytes. repeat says the datagram is unreliable: then acks sent
// lately go again in the room left, as many as ack.go's bounds and the
// ack credit allow.
func (s *session) appendAcks(now time.Time, room int, body []byte, repeat bool) []byte {
	if s.acks.pending() == 0 || room < ackBlock {
		s.sc().ackBuf = s.sc().ackBuf[:0]
		return body
	}
	s.sc().ackBuf = s.acks.take(s.sc().ackBuf[:0], room/ackBlock)
	fresh := len(s.sc().ackBuf)
	if repeat {
		// Acks sent in the last half round trip go again, so that a
		// lost ack does not cost the peer a needless resend. (Not in
		// reliable datagrams: those are kept and resent.) The credit
		// pays for them once the datagram as it would go is paid for
		// (its size so far is what the room left says).
		used := s.cfg.maxDatagram - room + fresh*ackBlock
		n := min(room/ackBlock-fresh, s.acks.affords(used, ackBlock))
		s.sc().ackBuf = s.acks.repeats(s.sc().ackBuf, now.Add(-s.ackRepeatWindow()), n)
	}
	s.acks.remember(now, s.sc().ackBuf[:fresh], s.ackRepeatWindow())
	if repeat {
		s.sc().ackBuf = s.acks.merge(s.sc().ackBuf)
	}
	for _, a := range s.sc().ackBuf {
		body = s.wire.appendAck(body, a)
	}
	return body
}

// ackRepeatWindow is how far back acks are sent again.
func (s *session) ackRepeatWindow() time.Duration { return max(s.loss.rtt.srtt/2, time.Millisecond) }

// spendAckCredit debits the ack credit for b, an unreliable datagram
// going out that carries acks (acks bytes of it): the whole of it if it
// carries no application message, else what the acks add.
func (s *session) spendAckCredit(b []byte, acks int, data bool) {
	switch {
	case acks == 0:
	case data:
		s.acks.spend(acks, s.cfg.maxDatagram)
	default:
		s.acks.spend(len(b)+ackWireOverhead, s.cfg.maxDatagram)
	}
}

// unreliableDue reports what an unreliable datagram would carry now: acks
// owed, a ping, unreliable messages.
func (s *session) unreliableDue(now time.Time) (acksDue, pingDue, data bool) {
	acksDue = s.acks.pending() >= 2 || s.acks.pending() > 0 && (s.owed.owes(oweAckNow) || now.Sub(s.acks.oldest) >= s.ackDelay())
	pingDue = !now.Before(s.live.nextPing)
	// Unreliable messages are not held to the congestion controller's
	// rate: nothing acks them, so it could never learn to raise it. The
	// application sets their pace, and the peer can still cap it with a
	// FlowControlRequest.
	data = s.send.unrelQ.len() > 0 && !s.live.suspended
	if data && !s.rc.peerAllows(now) {
		s.send.pacedOut = true
		data = false
	}
	return acksDue, pingDue, data
}

// packing is a datagram being filled, in either wire (specPacking,
// cppPacking): what both count.
type packing struct {
	body     []byte
	limit    int
	count    int    // message blocks so far
	appBytes int    // application payload bytes
	holds    bool   // a message in it may wait at the receiver
	tids     []byte // TransferIDs of the fragments in it
	skipped  int
}

// took records m's block (m whole, or its first fragment) of n payload
// bytes placed in the datagram; waits says whether the receiver may hold
// it for others. It returns the block's index in the datagram.
func (p *packing) took(m *outMsg, n int, waits bool) uint16 {
	idx := uint16(p.count)
	p.holds = p.holds || waits || m.frag
	p.count++
	p.appBytes += n
	m.off = n
	if !m.frag {
		m.done = true
	}
	return idx
}

// startTransfer makes m, whose first fragment is being placed in p, the
// transfer under way (send.bulk) under a new TransferID, which it
// returns; ok is false when none is free. One transfer at a time keeps
// the receiver's reassembly small.
func (s *session) startTransfer(p *packing, m *outMsg) (tid uint8, ok bool) {
	tid, ok = s.send.tids.alloc()
	if !ok {
		return 0, false
	}
	m.tid = tid
	s.send.tids.carried(tid)
	p.tids = append(p.tids, tid)
	m.fragNext = 1
	s.send.bulk = m
	return tid, true
}

// tookFragment records the next fragment of the transfer under way, m's
// payload up to end, placed in the datagram p fills, PacketID pid. With
// its last fragment the transfer is packed: its TransferID is released
// from packing (acks release the rest) and the next one may start.
func (s *session) tookFragment(p *packing, m *outMsg, end int, pid uint32) {
	p.count++
	p.appBytes += end - m.off
	p.holds = true
	if !slices.Contains(p.tids, m.tid) {
		s.send.tids.carried(m.tid)
		p.tids = append(p.tids, m.tid)
	}
	m.off = end
	m.fragNext++
	if t := m.track; t != nil {
		t.lastPID = pid
	}
	if m.fragNext == m.fragCount {
		if t := m.track; t != nil {
			t.complete = true
		}
		s.send.tids.release(m.tid)
		m.done = true
		s.send.bulk = nil
	}
}

// sentReliable records b, a new reliable datagram with PacketID pid that
// p packed, going out: kept until acked (loss.go) with what its acks will
// free, counted against the window, the span held (holdLimit) and the
// stats. It returns the record, for the wire to add its own.
func (s *session) sentReliable(now time.Time, pid uint32, b []byte, p *packing) *sent {
	d := s.loss.sendNew(now, pid, b)
	s.rc.sent(len(b))
	d.appBytes = p.appBytes
	if p.holds {
		d.hold = p.appBytes
		s.send.spanHold += d.hold
	}
	d.transfers = append(d.transfers, p.tids...)
	d.pn = s.send.nextPN
	s.numberNew(true)
	s.stats.DatagramsSent++
	s.stats.BytesSent += uint64(len(b))
	return d
}

// maxPerDatagram bounds the message blocks in one datagram, so that an
// index into them fits InOrderDatagramIndexArray with room to spare.
const maxPerDatagram = 1024

// maxSkipped is how many queued messages that cannot go yet (waiting for a
// dependency, or a transfer under way) pack passes over before it stops
// looking further down the queue.
const maxSkipped = 64

// afterAcks ends the handling of the acks one datagram carried: the
// controller hears of them, what they freed is released, acked datagrams
// are dropped, those the acks show lost queued again, and dependencies now
// resolved forgotten.
func (s *session) afterAcks(now time.Time) {
	if ev, ok := s.loss.takeSample(now); ok {
		s.rc.cc.OnAck(now, ev)
	}
	if a := &s.sc().acked; a.largest > 0 {
		if p := s.mtu(); p != nil {
			p.carried(now, a.largest)
		}
		a.largest = 0
	}
	if a := &s.sc().acked; a.appBytes > 0 || len(a.tids) > 0 || len(a.rels) > 0 {
		if a.appBytes > 0 {
			s.host.sendDone(a.appBytes)
		}
		for _, tid := range a.tids {
			s.send.tids.release(tid)
		}
		s.wire.freed(a)
		*a = ackResult{tids: a.tids[:0], rels: a.rels[:0]}
	}
	if s.mtu() != nil {
		s.settleRetired()
	}
	s.loss.sent.trim(s.trimmed)
	s.detectLoss(now)
	s.settleKept() // unacked.go
	s.checkReliableReceipts()
	s.send.order.forget(func(t *track) bool { return s.forgettable(now, t) })
}

// trimmed takes a datagram acked along with every one before it: its
// first message, if it named nothing, is applied at the receiver, an anchor
// for in-order messages with nothing else to depend on.
func (s *session) trimmed(d *sent) {
	s.send.spanHold -= d.hold
	if d.whole0 {
		s.newAnchor(msgRef{d.packetID, 0})
	}
	s.putBuf(d.b)
}

// detectLoss queues again what the acks show lost, and tells the
// controller.
func (s *session) detectLoss(now time.Time) {
	lost, ok := s.loss.detectLoss(now)
	if !ok {
		s.fail(ErrRetransmitLimit)
		return
	}
	if lost > 0 {
		s.rc.cc.OnLoss(now, lost)
	}
}
