package knet

import (
	"container/heap"
	"errors"
	"net"
	"slices"
	"time"
)

// session is the protocol state machine of one connection. It does no I/O
// and keeps no clock: the connection's goroutine feeds it datagrams and the
// time, and asks it for datagrams to send.

type sessState uint8

// Connection states (DECISIONS §1). stateAdmit is the server's wait for its
// application to decide on a ConnectSyn; stateLinger is a closed connection
// still answering its peer's Disconnect for a moment.
const (
	stateSyn sessState = iota + 1
	stateAdmit
	stateSynAck
	stateOK
	stateClosing
	stateLinger
	stateDone
)

// host is what the session needs from its connection.
type host interface {
	// deliver hands an application message to the receive queue, which
	// copies the payload. It reports false if there was no room.
	deliver(id uint32, payload []byte, reliable, inOrder bool) bool
	// recvUsed is how many payload bytes wait in the receive queue.
	recvUsed() int
	// sendDone returns n payload bytes to the send buffer.
	sendDone(n int)
	// established reports the handshake complete.
	established()
	// peerClosed reports the peer's Disconnect: the receive queue ends
	// after what it holds.
	peerClosed()
}

// outMsg is an application message queued for sending.
type outMsg struct {
	ref       Ref
	id        uint32
	payload   []byte
	pbuf      *[]byte // the pooled buffer behind payload
	reliable  bool
	inOrder   bool
	tracked   bool
	channel   uint8
	priority  int8
	contentID uint32
	after     []Ref
	deps      []depOn
	latest    bool // replaces what it depends on (ContentID)
	track     *track
	done      bool // fully packed
	off       int  // payload bytes packed so far

	// Fragmented transfer progress.
	frag      bool
	fragSize  int
	fragCount uint32
	fragNext  uint32 // next FragmentNumber to pack
	tid       uint8
}

// sendQueue holds queued messages by priority, then in send order.
type sendQueue struct {
	items []*outMsg
	head  int
}

func (q *sendQueue) len() int { return len(q.items) - q.head }

func (q *sendQueue) push(m *outMsg) {
	n := len(q.items)
	if n == q.head || q.items[n-1].priority >= m.priority {
		q.items = append(q.items, m)
		return
	}
	i := n
	for i > q.head && q.items[i-1].priority < m.priority {
		i--
	}
	q.items = slices.Insert(q.items, i, m)
}

// remove takes m out of the queue wherever it is.
func (q *sendQueue) remove(m *outMsg) {
	for i := q.head; i < len(q.items); i++ {
		if q.items[i] == m {
			q.items = slices.Delete(q.items, i, i+1)
			return
		}
	}
}

// compact drops packed messages from the front, and from anywhere once
// they are many.
func (q *sendQueue) compact(free func(*outMsg)) {
	for q.head < len(q.items) && q.items[q.head].done {
		free(q.items[q.head])
		q.items[q.head] = nil
		q.head++
	}
	if q.head == len(q.items) {
		q.items = q.items[:0]
		q.head = 0
		return
	}
	if q.head > 256 && q.head*2 > len(q.items) {
		n := copy(q.items, q.items[q.head:])
		clear(q.items[n:])
		q.items = q.items[:n]
		q.head = 0
	}
}

type pingRecord struct {
	id uint8
	at time.Time
}

type session struct {
	cfg    *config
	host   host
	client bool
	state  sessState
	err    error // why the connection ended

	syn, synAck  []byte
	admitWaiting bool // server: ConnectSyn in, Admit not yet run
	wasOpen      bool // the handshake completed

	// Timers.
	started       time.Time
	lastRecv      time.Time
	nextPing      time.Time
	synResend     time.Time
	synBackoff    time.Duration
	closeBy       time.Time
	discResend    time.Time
	discBackoff   time.Duration // between Disconnects, doubling
	discAckedAt   time.Time     // when we answered the peer's Disconnect
	lingerUntil   time.Time
	closeAsked    bool
	synAckSent    time.Time
	synSends      int
	preIn, preOut int           // server: bytes from and to the peer before the handshake completed
	newestAt      time.Time     // when the newest PacketID arrived
	reorderExt    time.Duration // how late reordered datagrams came
	reorderAt     time.Time
	synAckSends   int
	stopAccepting bool

	// Sending.
	nextPID      uint32
	relQ         sendQueue // reliable messages and fragmented transfers
	unrelQ       sendQueue
	latestQueued map[contentKey]*outMsg
	order        sendOrder
	tids         transferIDs
	bulk         *outMsg // fragmented message whose fragments are being packed
	sent         sentWindow
	lostQ        []lostRef
	rtt          rttEstimator
	rc           rateControl
	// Bytes of reliable datagrams in flight, probe timer and delivery
	// rate estimation.
	inflight         int
	spanHold         int // see holdLimit
	lastReliableSend time.Time
	ptoCount         int
	delivered        int64
	deliveredAt      time.Time
	firstSentAt      time.Time
	appLimitedUntil  int64
	sample           rateSample
	newlyAcked       int
	lossReorder      time.Duration // reordering tolerated by loss detection
	lossTime         time.Time     // the loss timer, zero if not set
	ackNow           bool          // ack without the usual delay
	lossReorderAt    time.Time
	// Receive-side flow control.
	arrivals    int
	arrivalsAt  time.Time
	arrivalRate float64 // datagrams/s
	askedRate   int     // the limit we asked the peer for, 0 if none
	askedAt     time.Time
	pings       [8]pingRecord
	pingCount   int
	nextPingID  uint8
	pingReplies []uint8
	needSyn     bool
	needSynAck  bool
	needAck     bool // ConnectAck
	needAnchor  bool // an in-order message has nothing applied to name
	needDisc    bool
	needDiscAck bool
	needFlow    bool
	flowRate    uint16
	freeMsgs    []*outMsg
	freeBufs    [][]byte
	lostHead    int
	pacedOut    bool // work waits for the pacer
	// Anchors for in-order messages that would carry no dependency, so
	// that the receiver still sees them in order (see wireDeps): the newest
	// reliable message known applied (the first of a datagram acked with
	// all before it, if it named nothing; or a tracked one resolved), and
	// the first message, naming nothing, of the newest reliable datagram
	// sent.
	anchor, lastWhole       msgRef
	hasAnchor, hasLastWhole bool
	tidBuf                  []byte

	// Receiving.
	win   recvWindow
	acks  ackQueue
	reasm reassembly
	res   resolver

	// Scratch, reused.
	rh      header
	rmsgs   []message
	deps    []msgRef
	ready   readyHeap
	woken   []*held
	dropped []*held
	expired []*held
	wh      header
	body    []byte
	ackBuf  []packetAck
	wdeps   []msgRef
	entries []byte

	stats Stats
}

type lostRef struct {
	s   *sent
	pid uint32
}

func newSession(cfg *config, h host, client bool, now time.Time) *session {
	s := &session{
		cfg:      cfg,
		host:     h,
		client:   client,
		started:  now,
		lastRecv: now,
		rc:       newRateControl(cfg),
	}
	s.reasm.budget = cfg.reassemblyBuffer
	s.reasm.maxMessage = cfg.maxMessage
	if client {
		s.state = stateSyn
		s.needSyn = true
		s.syn = cfg.connectPayload
		s.synBackoff = 200 * time.Millisecond
		s.synResend = now.Add(s.synBackoff)
	} else {
		s.state = stateAdmit
	}
	return s
}

// done reports whether the session has ended and has nothing more to send.
func (s *session) done() bool { return s.state == stateDone && !s.needDiscAck }

// established reports whether the handshake completed at some point.
func (s *session) open() bool { return s.state == stateOK }

// fail ends the session with err.
func (s *session) fail(err error) {
	if s.state == stateDone {
		return
	}
	if s.err == nil {
		s.err = err
	}
	s.state = stateDone
	s.dropSending()
}

// dropSending forgets everything queued or in flight.
func (s *session) dropSending() {
	released := 0
	for _, q := range [...]*sendQueue{&s.relQ, &s.unrelQ} {
		for i := q.head; i < len(q.items); i++ {
			if m := q.items[i]; !m.done {
				released += s.unsentBytes(m)
				putPayload(m.pbuf)
				m.pbuf = nil
			}
		}
		*q = sendQueue{}
	}
	s.bulk = nil
	for k := range s.sent.n {
		if d := s.sent.at(k); !d.acked {
			released += d.appBytes
		}
	}
	s.sent.clear(nil)
	s.spanHold = 0
	s.hasAnchor, s.hasLastWhole = false, false
	s.lostQ = nil
	s.order.reset()
	clear(s.latestQueued)
	s.tids = transferIDs{}
	if released > 0 {
		s.host.sendDone(released)
	}
}

// unsentBytes is how many payload bytes of m are not yet in a datagram.
func (s *session) unsentBytes(m *outMsg) int { return len(m.payload) - m.off }

// Timing helpers.

func (s *session) rto() time.Duration {
	return s.rtt.rto(time.Second, s.minRTO(), s.cfg.datagramTimeout)
}

// minRTO is the floor of the retransmission timeout: MaxAckDelay, as a
// peer may hold an ack that long (spec "Reliable Datagrams"; RFC 9002 adds
// it to the probe timeout too), and never under 5ms. A quarter of it, the
// floor before, was below the scheduling stalls of a loaded host: 200
// game clients on loopback had their probe timeouts fire at 8-12ms while
// the acks were on their way, 84 spurious resends in 6s against none.
func (s *session) minRTO() time.Duration {
	return max(5*time.Millisecond, s.cfg.maxAckDelay)
}

// ackDelay is how long we hold a lone ack hoping for company: a quarter of
// the round trip, within 1ms and MaxAckDelay.
func (s *session) ackDelay() time.Duration {
	return min(max(s.rtt.srtt/4, time.Millisecond), s.cfg.maxAckDelay)
}

// reorderWindowFor is how long an unreliable message with the given ID
// waits for a missing dependency: Config.ReorderWindows, else
// ReorderWindow. Zero means it does not wait.
func (s *session) reorderWindowFor(id uint32) time.Duration {
	if w, ok := s.cfg.reorderWindows[id]; ok {
		return max(w, 0)
	}
	return s.reorderWindow()
}

// reorderWindow is how long an unreliable in-order message waits for a
// missing predecessor, unless its ID has a window of its own.
func (s *session) reorderWindow() time.Duration {
	if s.cfg.reorderWindow != 0 {
		return max(s.cfg.reorderWindow, 0)
	}
	w := 20 * time.Millisecond
	if s.rtt.samples > 0 {
		w = s.rtt.srtt/4 + 2*s.rtt.rttvar
	}
	return min(max(w, s.reorderSeen(), 2*time.Millisecond), maxDerivedReorderWindow)
}

// maxDerivedReorderWindow caps the reorder window derived from the path.
const maxDerivedReorderWindow = 250 * time.Millisecond

// reorderSeen is how late out-of-order datagrams have been arriving
// lately, with a margin: the extent halves every five seconds.
func (s *session) reorderSeen() time.Duration {
	e := s.reorderExt
	for t := s.reorderAt; e > 0 && s.lastRecv.Sub(t) > 5*time.Second; t = t.Add(5 * time.Second) {
		e /= 2
	}
	return e * 5 / 4
}

// noteArrival measures reordering: a datagram older than the newest one
// seen arrives this long after it.
func (s *session) noteArrival(now time.Time, pid uint32) {
	if !s.win.started || seqLess(s.win.newest, pid) {
		s.newestAt = now
		return
	}
	if late := now.Sub(s.newestAt); late > 0 {
		s.reorderExt = max(s.reorderSeen()*4/5, late)
		s.reorderAt = now
	}
}

// Receiving.

// handleDatagram processes one datagram from the peer. b is not kept.
func (s *session) handleDatagram(now time.Time, b []byte) {
	if s.state == stateDone {
		return
	}
	// Parse everything first: a malformed datagram is dropped whole.
	h := &s.rh
	n, err := parseHeader(b, h)
	if err != nil {
		s.stats.InvalidDatagrams++
		return
	}
	msgs := s.rmsgs[:0]
	for off := n; off < len(b); {
		m, k, err := parseMessage(b[off:])
		if err == nil {
			err = checkOrder(h, &m)
		}
		if err == nil && m.fragment && !h.reliable {
			err = errUnreliableFragment
		}
		if err != nil {
			s.rmsgs = msgs
			s.stats.InvalidDatagrams++
			return
		}
		msgs = append(msgs, m)
		off += k
	}
	s.rmsgs = msgs
	s.stats.DatagramsReceived++
	s.stats.BytesReceived += uint64(len(b))
	if !s.client && !s.wasOpen {
		s.preIn += len(b)
	}

	switch s.state {
	case stateSyn:
		if !s.handleConnecting(now, msgs) {
			return
		}
	case stateAdmit:
		if s.admitWaiting {
			return
		}
		for i := range msgs {
			if msgs[i].id == idConnectSyn && !msgs[i].fragment {
				s.admitWaiting = true
				s.syn = append([]byte(nil), msgs[i].payload...)
				s.lastRecv = now
				s.win.add(h.packetID)
				return
			}
		}
		return
	case stateLinger:
		s.lastRecv = now
		for i := range msgs {
			if !msgs[i].fragment && msgs[i].id == idDisconnect {
				s.needDiscAck = true
			}
		}
		return
	case stateClosing:
		// The answer may come from a peer that has already forgotten us
		// (the listener answers statelessly, PacketID 0, when our first
		// DisconnectAck was lost): it ends the close whatever its
		// PacketID. Nothing the peer sends after it matters any more.
		for i := range msgs {
			if !msgs[i].fragment && msgs[i].id == idDisconnectAck {
				s.state = stateDone
				return
			}
		}
	}

	if !s.win.plausible(h.packetID) {
		s.stats.InvalidDatagrams++
		return
	}
	if s.win.contains(h.packetID) {
		s.stats.DuplicateDatagrams++
		if h.reliable {
			s.acks.add(now, h.packetID) // its ack may have been lost
		}
		s.lastRecv = now
		return
	}
	if h.reliable && !s.admits(msgs) {
		// No room: leave it unacked so it comes again, but take the
		// acks it carries.
		s.stats.DroppedDatagrams++
		s.lastRecv = now
		for i := range msgs {
			if !msgs[i].fragment && msgs[i].id == idPacketAck {
				s.handlePacketAck(now, msgs[i].payload)
			}
		}
		s.afterAcks(now)
		s.arrivals++
		s.flowControl(now)
		return
	}
	s.lastRecv = now
	s.noteArrival(now, h.packetID)
	// Every datagram takes the next PacketID, so a skipped one means
	// something went missing, and an older one arriving fills a gap:
	// either way the sender wants to hear at once (an immediate ack speeds
	// up its loss detection, as TCP does on out-of-order data).
	gap := s.win.started && (h.packetID != (s.win.newest+1)&packetIDMask)
	s.win.add(h.packetID)
	if h.reliable {
		s.acks.add(now, h.packetID)
		if gap {
			s.ackNow = true
		}
	}
	acked := false
	for i := range msgs {
		if s.state == stateDone {
			break
		}
		m := &msgs[i]
		if !m.fragment && m.id == idPacketAck {
			acked = true
		}
		s.handleMessage(now, h, msgRef{h.packetID, uint16(i)}, m)
	}
	if acked {
		s.afterAcks(now)
	}
	s.arrivals++
	s.flowControl(now)
}

// flowControl asks the peer to slow down when our application falls behind
// (spec "Flow Control"): past half of ReceiveBuffer, for a rate that shrinks
// as the buffer fills, at most once a round trip; once below a quarter, it
// lifts the limit (65535). The buffer itself is the hard limit.
//
// Only what the application has yet to read counts: messages held for a
// lost predecessor wait on the network, and slowing the peer down would
// only delay the retransmission they need (admits bounds them).
func (s *session) flowControl(now time.Time) {
	if s.state != stateOK {
		return
	}
	fill := float64(s.host.recvUsed()) / float64(s.cfg.recvBuffer)
	if dt := now.Sub(s.arrivalsAt); dt >= 10*time.Millisecond {
		rate := float64(s.arrivals) / dt.Seconds()
		s.arrivalRate = max(rate, s.arrivalRate*0.5) // quick to rise, slow to fall
		s.arrivals = 0
		s.arrivalsAt = now
	}
	switch {
	case fill >= 0.5:
		if s.askedRate > 0 && now.Sub(s.askedAt) < max(s.rtt.srtt, 10*time.Millisecond) {
			return
		}
		// Half full: the arrival rate; full: the minimum.
		want := int(max(s.cfg.minRate, s.arrivalRate*2*(1-min(fill, 1))))
		if s.askedRate > 0 && want >= s.askedRate {
			return
		}
		s.askedRate = max(want, 1)
		s.askedAt = now
		s.sendFlowControl(s.askedRate)
	case fill < 0.25 && s.askedRate > 0:
		s.askedRate = 0
		s.askedAt = now
		s.sendFlowControl(0xffff)
	}
}

var errUnreliableFragment = errors.New("knet: fragment in an unreliable datagram")

// handleConnecting handles a datagram while the client waits for
// ConnectSynAck. It reports whether the datagram should then be processed
// as usual (it completed the handshake).
func (s *session) handleConnecting(now time.Time, msgs []message) bool {
	for i := range msgs {
		m := &msgs[i]
		if m.fragment {
			continue
		}
		switch m.id {
		case idConnectSynAck:
			s.synAck = append([]byte(nil), m.payload...)
			s.state = stateOK
			s.wasOpen = true
			s.needSyn = false
			s.needAck = true
			if s.synSends == 1 {
				s.rtt.sample(now.Sub(s.started)) // Karn: only when unambiguous
			}
			s.nextPing = now.Add(s.cfg.keepalive())
			s.host.established()
			return true
		case idDisconnectAck:
			s.fail(ErrRefused)
			return false
		}
	}
	return false
}

// admits reports whether a reliable datagram fits our buffers, or makes
// progress: it carries a message that can be applied now and either held
// messages wait for it or the application has room for it, or a fragment
// the reassembly takes.
//
// Held messages alone may fill the buffer while the application has read
// everything; what fills the hole they wait behind must still get in, even
// when it is several datagrams back from the first held one.
func (s *session) admits(msgs []message) bool {
	used := s.host.recvUsed()
	over := used+s.res.bytes >= s.cfg.recvBuffer
	appContent := false
	for i := range msgs {
		m := &msgs[i]
		if m.fragment {
			if !s.reasm.admits(m.transferID, len(m.payload)) {
				return false
			}
			appContent = true
			continue
		}
		if m.id >= MinMessageID && m.id <= MaxMessageID {
			appContent = true
		}
	}
	if !over || !appContent {
		return true
	}
	h := &s.rh
	appRoom := used < s.cfg.recvBuffer
	for i := range msgs {
		ref := msgRef{h.packetID, uint16(i)}
		if !appRoom && !s.res.waitedOn(ref) {
			continue
		}
		deps := appendDeps(s.deps[:0], h, &msgs[i])
		if len(s.res.pendingDeps(&s.win, deps, h.reliable)) == 0 {
			return true
		}
	}
	return false
}

// handleMessage processes one message block of an accepted datagram.
func (s *session) handleMessage(now time.Time, h *header, ref msgRef, m *message) {
	if m.fragment {
		s.handleFragment(now, h, ref, m)
		return
	}
	switch m.id {
	case idPingRequest:
		if len(m.payload) == 1 && len(s.pingReplies) < 64 {
			s.pingReplies = append(s.pingReplies, m.payload[0])
		}
	case idPingReply:
		if len(m.payload) == 1 {
			s.handlePingReply(now, m.payload[0])
		}
	case idFlowControlRequest:
		if len(m.payload) == 2 {
			s.peerRateRequest(now, uint16(m.payload[0])|uint16(m.payload[1])<<8)
		}
	case idPacketAck:
		s.handlePacketAck(now, m.payload)
	case idConnectSyn:
		if s.state == stateSynAck {
			s.needSynAck = true // ours was lost
		}
	case idConnectSynAck:
		// A copy of one we already had; our ConnectAck is reliable
		// and takes care of itself.
	case idConnectAck:
		s.establishServer(now)
	case idDisconnect, idDisconnectAck:
		s.handleOrdered(now, h, ref, m.id, m.payload, heldKindOf(m.id))
		return
	default:
		if m.id >= MinMessageID && m.id <= MaxMessageID {
			s.establishServer(now)
			s.handleOrdered(now, h, ref, m.id, m.payload, heldApp)
			return
		}
		// Reserved and unknown: ignored, which applies it.
	}
	// A connection control message is applied as it arrives, and may be
	// named by later messages (the first in-order message of a connection
	// names the ConnectAck): release what waits for it.
	s.cascade(now, ref)
}

func heldKindOf(id uint32) heldKind {
	switch id {
	case idDisconnect:
		return heldDisconnect
	case idDisconnectAck:
		return heldDisconnectAck
	}
	return heldApp
}

// establishServer completes the server side of the handshake: a ConnectAck
// or any application message does it.
func (s *session) establishServer(now time.Time) {
	if s.client || s.state != stateSynAck {
		return
	}
	s.state = stateOK
	s.wasOpen = true
	s.needSynAck = false
	if s.synAckSends == 1 {
		s.rtt.sample(now.Sub(s.synAckSent))
	}
	s.nextPing = now.Add(s.cfg.keepalive())
	s.host.established()
}

// handleOrdered applies a message now, or holds it until its dependencies
// are applied.
func (s *session) handleOrdered(now time.Time, h *header, ref msgRef, id uint32, payload []byte, kind heldKind) {
	m := &s.rmsgs[ref.idx]
	s.deps = appendDeps(s.deps[:0], h, m)
	s.handleOrderedDeps(now, ref, id, payload, kind, h.reliable, m.order != orderNone, supersedes(m), s.deps)
}

// handleOrderedDeps applies a message whose dependencies are deps, or holds
// it. An unreliable message marked latest (see supersedes), or whose ID has
// no reorder window, does not wait: it replaces what it names.
func (s *session) handleOrderedDeps(now time.Time, ref msgRef, id uint32, payload []byte, kind heldKind, reliable, inOrder, latest bool, deps []msgRef) {
	if s.res.lateDrop(ref, reliable) || !reliable && len(deps) > 0 && s.res.overtaken(ref, s.win.newest) {
		s.stats.DroppedMessages++
		// What it waited for is older still: drop that too if it comes.
		s.supersede(now, s.res.pendingDeps(&s.win, deps, false))
		s.cascade(now, ref)
		return
	}
	deps = s.res.pendingDeps(&s.win, deps, reliable)
	var wait time.Duration
	if len(deps) > 0 && !reliable {
		wait = s.reorderWindowFor(id)
		if kind == heldApp && (latest || wait == 0) {
			s.supersede(now, deps)
			deps = deps[:0]
		}
	}
	if len(deps) == 0 {
		s.apply(now, kind, id, payload, reliable, inOrder)
		s.cascade(now, ref)
		return
	}
	hm := s.res.newHeld()
	hm.ref = ref
	hm.kind = kind
	hm.id = id
	hm.payload = append(hm.payload[:0], payload...)
	hm.reliable = reliable
	hm.inOrder = inOrder
	hm.deps = append(hm.deps[:0], deps...)
	s.res.hold(hm, now.Add(wait))
}

// supersede gives up on deps (see resolver.supersede), dropping the held
// messages among them.
func (s *session) supersede(now time.Time, deps []msgRef) {
	if len(deps) == 0 {
		return
	}
	s.dropped = s.res.supersede(&s.win, deps, s.dropped[:0])
	for i, hm := range s.dropped {
		s.stats.DroppedMessages++
		s.wake(hm.ref)
		s.res.recycle(hm)
		s.dropped[i] = nil
	}
	s.dropped = s.dropped[:0]
}

// cascade applies the held messages that ref's application released, and
// those theirs released, oldest first.
func (s *session) cascade(now time.Time, ref msgRef) {
	s.wake(ref)
	s.runReady(now)
}

// wake moves the messages waiting only on ref to the ready queue.
func (s *session) wake(ref msgRef) {
	s.woken = s.res.applied(ref, s.woken[:0])
	for i, hm := range s.woken {
		heap.Push(&s.ready, hm)
		s.woken[i] = nil
	}
}

// runReady applies the ready messages, oldest first, waking their
// dependents into the same queue.
func (s *session) runReady(now time.Time) {
	for s.ready.Len() > 0 {
		hm := heap.Pop(&s.ready).(*held)
		s.applyHeld(now, hm)
		s.wake(hm.ref)
		s.res.recycle(hm)
	}
}

// applyHeld applies a held message now ready, unless it is unreliable and
// was overtaken while it waited.
func (s *session) applyHeld(now time.Time, hm *held) {
	if !hm.reliable && hm.kind == heldApp && s.res.overtaken(hm.ref, s.win.newest) {
		s.stats.DroppedMessages++
		return
	}
	s.apply(now, hm.kind, hm.id, hm.payload, hm.reliable, hm.inOrder)
}

// apply hands a message whose dependencies are satisfied to where it goes.
func (s *session) apply(now time.Time, kind heldKind, id uint32, payload []byte, reliable, inOrder bool) {
	switch kind {
	case heldApp:
		if s.state != stateOK && s.state != stateClosing {
			return
		}
		if s.host.deliver(id, payload, reliable, inOrder) {
			s.stats.MessagesReceived++
		} else {
			s.stats.DroppedMessages++
		}
	case heldDisconnect:
		s.needDiscAck = true
		switch s.state {
		case stateOK:
			if s.closeAsked {
				// Both sides closing at once: our answer ends it.
				s.state = stateDone
				s.dropSending()
				return
			}
			s.host.peerClosed()
			s.dropSending()
			s.state = stateLinger
			s.lingerUntil = now.Add(s.lingerTime())
		case stateClosing:
			s.state = stateDone
		}
	case heldDisconnectAck:
		switch s.state {
		case stateClosing:
			s.state = stateDone
		case stateOK:
			// The peer says it is gone without our asking.
			s.host.peerClosed()
			s.fail(ErrPeerClosed)
		case stateSynAck:
			s.fail(ErrPeerClosed)
		}
	}
}

// handleFragment feeds a fragment to reassembly and, once a message is
// whole, applies or holds it in its FragmentStart's place.
func (s *session) handleFragment(now time.Time, h *header, ref msgRef, m *message) {
	var order startOrder
	if m.fragStart {
		order.reliable = h.reliable
		order.inOrder = m.order != orderNone
		s.deps = appendDeps(s.deps[:0], h, m)
		order.deps = s.deps
	}
	t, whole, err := s.reasm.add(m, ref, order)
	if err != nil {
		s.protocolError(err)
		return
	}
	if whole == nil {
		if m.fragStart {
			// Hold a place so that dependents wait for the whole.
			hm := s.res.newHeld()
			hm.ref = ref
			hm.kind = heldFragments
			s.res.hold(hm, time.Time{})
		}
		return
	}
	start := t.start
	if !m.fragStart {
		if hm, ok := s.res.held[start]; ok && hm.kind == heldFragments {
			s.res.release(hm)
			s.res.recycle(hm)
		}
	}
	s.establishServer(now)
	deps := append(s.wdeps[:0], t.order.deps...)
	s.wdeps = deps
	reliable, inOrder, id := t.order.reliable, t.order.inOrder, t.id
	s.reasm.finish(t)
	s.handleOrderedDeps(now, start, id, whole, heldApp, reliable, inOrder, false, deps)
}

func (s *session) protocolError(err error) {
	s.stats.ProtocolErrors++
	s.fail(&ProtocolError{Err: err})
}

func (s *session) handlePingReply(now time.Time, id uint8) {
	for i := range min(s.pingCount, len(s.pings)) {
		p := &s.pings[i]
		if p.id == id && !p.at.IsZero() {
			s.rtt.sample(now.Sub(p.at))
			p.at = time.Time{}
			return
		}
	}
}

func (s *session) handlePacketAck(now time.Time, p []byte) {
	a, ok := parsePacketAck(p)
	if !ok {
		return
	}
	s.ackOne(now, a.base)
	for m, k := a.more, uint32(1); m != 0; m, k = m>>1, k+1 {
		if m&1 != 0 {
			s.ackOne(now, (a.base+k)&packetIDMask)
		}
	}
}

func (s *session) ackOne(now time.Time, id uint32) {
	d := s.sent.find(id)
	if d == nil {
		return
	}
	s.sent.ack(d, d.sends > 1 && now.Sub(d.sentAt) < s.rtt.min)
	if !d.lost {
		s.inflight -= len(d.b)
	} else {
		// Acked while it waited to go again: it was late, not lost.
		// Tolerate that much reordering from now on (RACK).
		s.spuriousLoss(now)
	}
	s.newlyAcked += len(d.b)
	// Delivery rate (draft-cheng-iccrg-delivery-rate-estimation): the
	// sample comes from the most recently sent datagram acked.
	s.delivered += int64(len(d.b))
	s.deliveredAt = now
	if !s.sample.ok || d.delivered >= s.sample.delivered {
		s.sample = rateSample{ok: true, delivered: d.delivered, deliveredAt: d.deliveredAt,
			firstSentAt: d.firstSentAt, sentAt: d.sentAt, appLimited: d.appLimited, once: d.sends == 1}
	}
	if d.appBytes > 0 {
		s.host.sendDone(d.appBytes)
	}
	for _, tid := range d.transfers {
		s.tids.release(tid)
	}
}

// rateSample is the newest datagram acked by one incoming datagram, for the
// RTT and delivery rate samples.
type rateSample struct {
	ok                               bool
	delivered                        int64
	deliveredAt, firstSentAt, sentAt time.Time
	appLimited, once                 bool
}

// afterAcks takes one RTT and delivery-rate sample from what an incoming
// datagram acked, drops acked datagrams, finds those the acks show lost,
// and forgets dependencies now resolved.
func (s *session) afterAcks(now time.Time) {
	if sm := s.sample; sm.ok {
		s.sample = rateSample{}
		// One RTT sample per ack, from the newest datagram it names, if
		// sent once (Karn): samples from a batch acked at once would
		// shrink RTTVAR to nothing.
		rtt := now.Sub(sm.sentAt)
		if sm.once {
			s.rtt.sample(rtt)
		}
		s.firstSentAt = sm.sentAt
		var rate float64
		if interval := max(sm.sentAt.Sub(sm.firstSentAt), now.Sub(sm.deliveredAt)); interval > 0 {
			rate = float64(s.delivered-sm.delivered) / interval.Seconds()
		}
		if s.appLimitedUntil > 0 && s.delivered > s.appLimitedUntil {
			s.appLimitedUntil = 0
		}
		s.ptoCount = 0
		s.rc.cc.OnAck(now, AckEvent{AckedBytes: s.newlyAcked, InFlight: s.inflight, DeliveryRate: rate,
			AppLimited: sm.appLimited, RTT: rtt, SRTT: s.rtt.srtt, MinRTT: s.rtt.min})
		s.newlyAcked = 0
	}
	s.sent.trim(s.trimmed)
	s.detectLoss(now)
	s.order.forget(func(t *track) bool { return s.forgettable(now, t) })
}

// forgettable reports whether a tracked message can be forgotten: later
// messages need not name it. A reliable one that is becomes an anchor.
func (s *session) forgettable(now time.Time, t *track) bool {
	if !s.resolvedAtSender(now, t) {
		return false
	}
	if t.reliable && t.packed {
		s.newAnchor(t.at)
	}
	return true
}

// trimmed takes a datagram acked along with every one before it: its
// first message, if it named nothing, is applied at the receiver, an anchor
// for in-order messages with nothing else to depend on.
func (s *session) trimmed(d *sent) {
	s.spanHold -= d.hold
	if d.whole0 {
		s.newAnchor(msgRef{d.packetID, 0})
	}
	s.putBuf(d.b)
}

func (s *session) newAnchor(r msgRef) {
	if !s.hasAnchor || refLess(s.anchor, r) {
		s.anchor = r
		s.hasAnchor = true
	}
}

// detectLoss marks as lost the datagrams sent before one acked that are
// three PacketIDs older than the newest acked, or were sent more than 9/8
// of a round trip ago (RFC 9002's thresholds; the time one by send time, as
// RACK does, RFC 8985, since a resent datagram keeps its PacketID): fast
// retransmit without waiting for the timeout. For the others it sets the
// loss timer.
func (s *session) detectLoss(now time.Time) {
	if !s.sent.anyAcked {
		return
	}
	reo := s.reorderTolerance(now)
	thresh := max(s.rtt.srtt, s.rtt.latest)*9/8 + reo
	lost := 0
	s.lossTime = time.Time{}
	for d := s.sent.oldest; d != nil && s.sent.sentBefore(d); {
		next := d.next
		if reo == 0 && d.sends == 1 && seqLess(d.packetID, s.sent.largestAcked) && seqDiff(d.packetID, s.sent.largestAcked) >= 3 ||
			now.Sub(d.sentAt) >= thresh {
			lost += len(d.b)
			s.markLost(now, d, true)
			if s.state == stateDone {
				return
			}
		} else if at := d.sentAt.Add(thresh); s.lossTime.IsZero() || at.Before(s.lossTime) {
			// Later datagrams got through: this one is lost if its ack
			// does not come within the threshold (the loss timer of RFC
			// 9002).
			s.lossTime = at
		}
		d = next
	}
	if lost > 0 {
		s.rc.cc.OnLoss(now, lost)
	}
}

// spuriousLoss widens the reordering the loss detection tolerates, after a
// datagram taken for lost turned out late: the packet threshold is dropped
// and the time threshold extended (RACK, RFC 8985), up to a round trip.
func (s *session) spuriousLoss(now time.Time) {
	s.stats.SpuriousLosses++
	reo := max(2*s.reorderTolerance(now), time.Millisecond, s.rtt.srtt/4)
	s.lossReorder = min(reo, max(s.rtt.srtt, 4*time.Millisecond))
	s.lossReorderAt = now
}

// reorderTolerance is the extra time the loss detection waits for a late
// datagram: zero until reordering was seen, halving every four seconds
// without more.
func (s *session) reorderTolerance(now time.Time) time.Duration {
	r := s.lossReorder
	for t := s.lossReorderAt.Add(4 * time.Second); r > 0 && !now.Before(t); t = t.Add(4 * time.Second) {
		r /= 2
		if r < 100*time.Microsecond {
			r = 0
		}
	}
	return r
}

func (s *session) markLost(now time.Time, d *sent, fast bool) {
	if d.sends >= s.cfg.maxSendCount {
		s.fail(ErrRetransmitLimit)
		return
	}
	d.lost = true
	s.inflight -= len(d.b)
	s.sent.unlink(d) // no timeout runs while it waits to go again
	s.lostQ = append(s.lostQ, lostRef{d, d.packetID})
	if fast {
		s.stats.FastRetransmits++
	}
}

// resolvedAtSender reports whether a tracked message is known to be applied
// at the receiver, so that dependencies on it can be left out (DECISIONS
// §5): a reliable one once every datagram up to its last fragment is acked
// and the same holds for everything it waits for (arrived is not applied: a
// message may wait at the receiver for a fragmented one still coming); an
// unreliable one once it is older than any reorder window could be.
func (s *session) resolvedAtSender(now time.Time, t *track) bool {
	return s.resolvedWithin(now, t, 0)
}

// reorderHorizon is how much earlier a datagram may have been sent and
// still arrive after one sent now: half a round trip and four times its
// variation, at least 5ms; 50ms before the round trip is measured.
func (s *session) reorderHorizon() time.Duration {
	if s.rtt.samples == 0 {
		return 50 * time.Millisecond
	}
	return max(s.rtt.srtt/2+4*s.rtt.rttvar, 5*time.Millisecond)
}

// unreliableHorizon is how long after it was sent an unreliable message
// may still wait at the receiver for what it depends on: a one-way trip,
// within a retransmission timeout, then the receiver's reorder window, at
// most 250ms unless configured longer (ours is taken for the peer's).
func (s *session) unreliableHorizon() time.Duration {
	return max(maxDerivedReorderWindow, s.cfg.longestReorderWindow()) + s.rto()
}

// maxResolveDepth bounds the walk through unresolved dependencies; past it
// a message counts as unresolved for now, which only costs a dependency
// named without need.
const maxResolveDepth = 32

func (s *session) resolvedWithin(now time.Time, t *track, depth int) bool {
	if t.dropped || t.resolved {
		return true
	}
	if !t.packed || !t.complete {
		return false
	}
	if !t.reliable {
		return now.Sub(t.sentAt) > s.unreliableHorizon()
	}
	// Every datagram up to its last one sent (not the one being built)
	// and acked.
	if !seqLess(t.lastPID, s.nextPID) {
		return false
	}
	if first := s.sent.firstUnacked(); first != nil && !seqLess(t.lastPID, first.packetID) {
		return false
	}
	if depth == maxResolveDepth {
		return false
	}
	for _, d := range t.deps {
		if dt := d.live(); dt != nil && !s.resolvedWithin(now, dt, depth+1) {
			return false
		}
	}
	t.resolved = true
	clear(t.deps)
	t.deps = t.deps[:0]
	return true
}

// Queueing.

// enqueue takes an application message for sending. The payload is already
// a private copy.
func (s *session) enqueue(m *outMsg) {
	if s.state == stateDone || s.state == stateLinger || s.stopAccepting {
		s.host.sendDone(len(m.payload))
		s.stats.DroppedMessages++
		s.putMsg(m)
		return
	}
	if m.contentID != 0 && !m.reliable {
		k := contentKey{m.id, m.contentID}
		if old := s.latestQueued[k]; old != nil && !old.track.packed {
			// Latest state wins: the newer content replaces the older
			// one still queued.
			s.host.sendDone(len(old.payload))
			if !old.frag && !m.frag && !m.tracked {
				old.payload, m.payload = m.payload, old.payload
				old.pbuf, m.pbuf = m.pbuf, old.pbuf
				s.putMsg(m)
				return
			}
			// A fragmented transfer, sized for its payload and perhaps in
			// the other queue, or a message later ones may name by its
			// Ref: the older one goes, the newer one queues.
			s.queueFor(old).remove(old)
			old.track.dropped = true
			delete(s.latestQueued, k)
			s.putMsg(old)
		}
	}
	s.order.add(m)
	if m.contentID != 0 && !m.reliable {
		if s.latestQueued == nil {
			s.latestQueued = make(map[contentKey]*outMsg)
		}
		s.latestQueued[contentKey{m.id, m.contentID}] = m
	}
	s.raise(m)
	s.queueFor(m).push(m)
	s.stats.MessagesSent++
}

// raise lifts the messages m depends on to m's priority, so that none is
// left behind it in the queue.
func (s *session) raise(m *outMsg) {
	if m.priority == 0 {
		return
	}
	for _, d := range m.deps {
		t := d.live()
		if t == nil || t.packed {
			continue
		}
		for _, q := range [...]*sendQueue{&s.relQ, &s.unrelQ} {
			for i := q.head; i < len(q.items); i++ {
				o := q.items[i]
				if o.track == t && o.priority < m.priority {
					q.remove(o)
					o.priority = m.priority
					s.raise(o)
					q.push(o)
					break
				}
			}
		}
	}
}

// queueFor is the queue m waits in: fragmented transfers travel in
// reliable datagrams whatever the message's own kind (spec "Fragmented
// Transfers", 3).
func (s *session) queueFor(m *outMsg) *sendQueue {
	if m.reliable || m.frag {
		return &s.relQ
	}
	return &s.unrelQ
}

func (s *session) newMsg() *outMsg {
	if k := len(s.freeMsgs); k > 0 {
		m := s.freeMsgs[k-1]
		s.freeMsgs = s.freeMsgs[:k-1]
		return m
	}
	return new(outMsg)
}

func (s *session) putMsg(m *outMsg) {
	putPayload(m.pbuf)
	*m = outMsg{deps: m.deps[:0], after: m.after[:0]}
	if len(s.freeMsgs) < 1024 {
		s.freeMsgs = append(s.freeMsgs, m)
	}
}

func (s *session) freeQueued(m *outMsg) {
	if m.contentID != 0 {
		k := contentKey{m.id, m.contentID}
		if s.latestQueued[k] == m {
			delete(s.latestQueued, k)
		}
	}
	s.putMsg(m)
}

// getBuf returns an empty buffer for a reliable datagram, kept until acked.
func (s *session) getBuf() []byte {
	if k := len(s.freeBufs); k > 0 {
		b := s.freeBufs[k-1]
		s.freeBufs = s.freeBufs[:k-1]
		return b[:0]
	}
	return make([]byte, 0, s.cfg.maxDatagram)
}

func (s *session) putBuf(b []byte) {
	if cap(b) >= s.cfg.maxDatagram && len(s.freeBufs) < 256 {
		s.freeBufs = append(s.freeBufs, b)
	}
}

// requestClose starts a graceful close: what is queued goes out and is
// acked, then Disconnect, all within DisconnectTimeout.
func (s *session) requestClose(now time.Time) {
	switch s.state {
	case stateSyn, stateAdmit, stateSynAck:
		s.fail(net.ErrClosed)
	case stateLinger:
		s.state = stateDone
	case stateOK:
		if !s.closeAsked {
			s.closeAsked = true
			s.stopAccepting = true
			s.closeBy = now.Add(s.cfg.disconnect)
		}
	}
}

// lingerTime is how long a connection that answered its peer's Disconnect
// stays to answer it again, in case the DisconnectAck was lost: a few of
// the peer's backed-off resends.
func (s *session) lingerTime() time.Duration {
	return min(max(4*s.rto(), 50*time.Millisecond), s.cfg.disconnect)
}

// socketLinger is how much longer, at now, the socket of a dialed
// connection that has ended should stay open to answer its peer's resent
// Disconnects statelessly (see disconnectAnswer): the rest of the linger
// time after our DisconnectAck, or zero if we sent none.
func (s *session) socketLinger(now time.Time) time.Duration {
	if s.discAckedAt.IsZero() {
		return 0
	}
	return max(s.discAckedAt.Add(s.lingerTime()).Sub(now), 0)
}

// A Disconnect goes again after the RTO, but no later than
// firstDiscResend (as the ConnectSyn: before the first RTT sample the RTO
// is a full second, a long wait for a lost 10-byte datagram when the whole
// close has DisconnectTimeout), then at doubling intervals up to
// maxDiscBackoff: a peer that forgot us and answers statelessly gets many
// chances within DisconnectTimeout, one that is gone a few datagrams a
// second at most.
const (
	firstDiscResend = 200 * time.Millisecond
	maxDiscBackoff  = 250 * time.Millisecond
)

// admitted records the application's decision on the ConnectSyn.
func (s *session) admitted(now time.Time, reply []byte, ok bool) {
	if s.state != stateAdmit {
		return
	}
	if !ok {
		s.state = stateDone
		s.err = ErrRefused
		s.needDiscAck = !s.cfg.stealth
		return
	}
	s.synAck = reply
	s.state = stateSynAck
	s.needSynAck = true
	s.started = now
}

// peerRateRequest applies the peer's FlowControlRequest: the most datagrams
// a second it wants to receive; 65535 lifts the limit. When the limit goes
// up, what waited for it goes at once instead of after backed-off timeouts:
// the oldest datagram unacked is resent and the probe timer starts afresh.
// That says nothing about congestion, so the controller hears nothing.
func (s *session) peerRateRequest(now time.Time, rate uint16) {
	old := s.rc.maxRate
	if rate == 0xffff {
		s.rc.maxRate = 0
	} else {
		s.rc.maxRate = max(float64(rate), s.cfg.minRate)
	}
	if old > 0 && (s.rc.maxRate == 0 || s.rc.maxRate > old) && s.ptoCount > 0 {
		s.ptoCount = 0
		if d := s.sent.oldestUnlost(); d != nil {
			s.lastReliableSend = now
			s.markLost(now, d, false)
		}
	}
}

// sendFlowControl asks the peer to send at most rate datagrams a second.
func (s *session) sendFlowControl(rate int) {
	s.flowRate = uint16(min(max(rate, 1), 0xffff))
	s.needFlow = true
}

// Sending.

// wholeLimit is the largest payload sent as one message block; larger ones
// are fragmented. It leaves room in a datagram for the headers and up to
// MaxDependencies dependencies.
func (c *config) wholeLimit() int {
	return min(maxContentLength-4, c.maxDatagram-96)
}

// fragSize is the payload of each fragment: at most MaxFragmentSize, and
// sized so that whole fragments fill a datagram with little left over.
func (c *config) fragSize() int {
	const perFrag = 7 // header, TransferID, FragmentNumber at its longest
	avail := c.maxDatagram - minHeaderSize - 16
	k := (avail + c.maxFragment + perFrag - 1) / (c.maxFragment + perFrag)
	// Below the whole-message limit, so that a fragmented message has at
	// least two fragments and its first leaves room for the MessageID.
	return min(c.maxFragment, avail/k-perFrag, c.wholeLimit()-8)
}

// prepare sets up fragmentation for a queued message.
func (s *session) prepare(m *outMsg) {
	if len(m.payload) <= s.cfg.wholeLimit() {
		return
	}
	m.frag = true
	m.fragSize = s.cfg.fragSize()
	m.fragCount = uint32((len(m.payload) + m.fragSize - 1) / m.fragSize)
}

// poll returns the next datagram to send, or nil when there is none now. A
// reliable datagram's bytes stay the session's (they are kept for
// retransmission); other datagrams are built in buf.
func (s *session) poll(now time.Time, buf []byte) []byte {
	s.pacedOut = false
	switch s.state {
	case stateSyn:
		if s.needSyn {
			s.needSyn = false
			s.synSends++
			return s.control(buf, idConnectSyn, s.syn)
		}
		return nil
	case stateSynAck:
		if s.needSynAck {
			s.needSynAck = false
			b := s.control(buf, idConnectSynAck, s.synAck)
			if b != nil {
				s.synAckSent = now
				s.synAckSends++
			}
			return b
		}
		return nil
	case stateClosing:
		if s.needDisc {
			s.needDisc = false
			return s.control(buf, idDisconnect, nil)
		}
		return nil
	case stateLinger, stateDone:
		if s.needDiscAck {
			s.needDiscAck = false
			if s.wasOpen {
				s.discAckedAt = now
			}
			return s.control(buf, idDisconnectAck, nil)
		}
		return nil
	case stateOK:
	default:
		return nil
	}
	if s.needDiscAck {
		s.needDiscAck = false
		s.discAckedAt = now
		return s.control(buf, idDisconnectAck, nil)
	}
	if b := s.pollReliable(now); b != nil {
		return b
	}
	if b := s.pollUnreliable(now, buf); b != nil {
		return b
	}
	if s.needAnchor {
		// An unreliable in-order message waits for one.
		if b := s.pollReliable(now); b != nil {
			return b
		}
	}
	if s.closeAsked && s.relQ.len() == 0 && s.unrelQ.len() == 0 && s.sent.count == 0 && s.acks.pending() == 0 {
		// Everything is delivered: Disconnect, in order after it all
		// (every dependency is resolved, so none is named).
		s.state = stateClosing
		s.discBackoff = min(s.rto(), firstDiscResend)
		s.discResend = now.Add(s.discBackoff)
		return s.control(buf, idDisconnect, nil)
	}
	return nil
}

// control builds an unreliable datagram holding one connection control
// message. Disconnect and DisconnectAck are in-order messages: their
// datagram has the InOrder flag, with no dependency left to name.
func (s *session) control(buf []byte, id uint32, payload []byte) []byte {
	// Before the connection opened (a refusal) there is nothing to be in
	// order after, and the flag's count byte would make the answer larger
	// than the smallest ConnectSyn.
	h := header{packetID: s.nextPID, inOrder: s.wasOpen && (id == idDisconnect || id == idDisconnectAck)}
	b := appendHeader(buf[:0], &h)
	b = appendMessage(b, &message{id: id, payload: payload})
	if id == idConnectSyn {
		b = appendPadding(b, min(synPadTo, s.cfg.maxDatagram))
	}
	if !s.client && !s.wasOpen {
		// Anti-amplification: an endpoint not yet proven to be the
		// sender gets no more bytes than it sent. A resent ConnectSyn
		// adds credit.
		if s.preOut+len(b) > s.preIn {
			return nil
		}
		s.preOut += len(b)
	}
	s.sentUnreliable(b)
	return b
}

// synPadTo is the size a client pads its ConnectSyn datagram to, so that
// the server may answer with a ConnectSynAck of about that size at once.
const synPadTo = 1200

// idPadding is the reserved MessageID 5, which receivers ignore: the
// ConnectSyn's padding.
const idPadding = 5

// appendPadding fills the datagram b up to size bytes with one padding
// message, when there is room for one.
func appendPadding(b []byte, size int) []byte {
	room := size - len(b) - 3 // message header and the 1-byte MessageID
	if room < 0 {
		return b
	}
	room = min(room, maxContentLength-1)
	b = appendMessage(b, &message{id: idPadding})
	b[len(b)-3] = byte(1 + room) // ContentLength, u16 little-endian
	b[len(b)-2] = byte((1 + room) >> 8)
	return append(b, make([]byte, room)...)
}

func (s *session) sentUnreliable(b []byte) {
	s.nextPID = (s.nextPID + 1) & packetIDMask
	s.stats.DatagramsSent++
	s.stats.BytesSent += uint64(len(b))
}

// spanFull reports whether one more datagram would put the newest PacketID
// 2^15 or more after the oldest unacked one (DECISIONS §4).
func (s *session) spanFull() bool {
	first := s.sent.firstUnacked()
	return first != nil && seqDiff(first.packetID, s.nextPID) >= recvSpan-1
}

// pollReliable returns a retransmission or a new reliable datagram.
func (s *session) pollReliable(now time.Time) []byte {
	for s.lostHead < len(s.lostQ) {
		l := s.lostQ[s.lostHead]
		d := l.s
		if d.packetID != l.pid || d.acked || !d.lost || d.b == nil {
			s.popLost()
			continue
		}
		if !s.rc.canSend(now, len(d.b)) {
			s.pacedOut = true
			return nil
		}
		s.popLost()
		s.sent.resent(now, d)
		s.onReliableSent(now, d)
		s.stats.Retransmits++
		s.stats.DatagramsSent++
		s.stats.BytesSent += uint64(len(d.b))
		return d.b
	}
	if !s.needAck && !s.needFlow && !s.needAnchor && s.relQ.len() == 0 {
		if s.inflight < s.rc.window() {
			// Nothing to send though the window has room: rate samples
			// until this is delivered say more about us than the path.
			s.appLimitedUntil = max(s.delivered+int64(s.inflight), 1)
		}
		return nil
	}
	if s.inflight >= s.rc.window() || s.sent.count >= maxWindow || s.spanFull() {
		return nil
	}
	if s.spanHold >= s.holdLimit() {
		// Held back by the receiver's room, not by the path: rate samples
		// until this is delivered say little about the path.
		s.appLimitedUntil = max(s.delivered+int64(s.inflight), 1)
		return nil
	}
	if !s.rc.canSend(now, s.cfg.maxDatagram) {
		s.pacedOut = true
		return nil
	}
	return s.buildReliable(now)
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

// onReliableSent does the bookkeeping of a reliable datagram going out,
// new or resent: pacing, bytes in flight, the probe timer and delivery rate
// state.
func (s *session) onReliableSent(now time.Time, d *sent) {
	if s.inflight == 0 {
		s.firstSentAt = now
		s.deliveredAt = now
	}
	d.delivered = s.delivered
	d.deliveredAt = s.deliveredAt
	d.firstSentAt = s.firstSentAt
	d.appLimited = s.appLimitedUntil > 0
	s.inflight += len(d.b)
	s.lastReliableSend = now
	s.rc.sent(len(d.b))
}

func (s *session) popLost() {
	s.lostQ[s.lostHead] = lostRef{}
	s.lostHead++
	if s.lostHead == len(s.lostQ) {
		s.lostQ = s.lostQ[:0]
		s.lostHead = 0
	}
}

// buildReliable packs reliable messages into a new datagram, followed by
// whatever acks fit.
func (s *session) buildReliable(now time.Time) []byte {
	h := &s.wh
	*h = header{packetID: s.nextPID, reliable: true, deltas: h.deltas[:0], indices: h.indices[:0]}
	p := packing{body: s.body[:0], limit: s.cfg.maxDatagram, tids: s.tidBuf[:0]}
	if s.needAck {
		p.body = appendMessage(p.body, &message{id: idConnectAck})
		p.count++
		p.whole0 = true
		s.needAck = false
	} else if s.needAnchor {
		// An empty reserved message, applied as it arrives (a receiver
		// ignores it), for in-order messages to name: see wireDeps.
		p.body = appendMessage(p.body, &message{id: idPadding})
		p.count++
		p.whole0 = true
	}
	s.needAnchor = false
	if s.needFlow {
		p.body = appendMessage(p.body, &message{id: idFlowControlRequest, payload: []byte{byte(s.flowRate), byte(s.flowRate >> 8)}})
		if p.count == 0 {
			p.whole0 = true
		}
		p.count++
		s.needFlow = false
	}
	s.pack(now, h, &p, &s.relQ)
	s.body, s.tidBuf = p.body, p.tids
	if p.count == 0 {
		return nil
	}
	p.body = s.appendAcks(now, h, p.body, p.count, false)
	s.body = p.body
	b := s.getBuf()
	b = appendHeader(b, h)
	b = append(b, p.body...)
	d := s.sent.push(now, h.packetID, b)
	s.onReliableSent(now, d)
	d.appBytes = p.appBytes
	if p.holds {
		d.hold = p.appBytes
		s.spanHold += d.hold
	}
	d.whole0 = p.whole0
	if p.whole0 {
		s.lastWhole = msgRef{h.packetID, 0}
		s.hasLastWhole = true
	}
	d.transfers = append(d.transfers, p.tids...)
	s.nextPID = (s.nextPID + 1) & packetIDMask
	s.stats.DatagramsSent++
	s.stats.BytesSent += uint64(len(b))
	return b
}

// appendAcks adds PacketAcks for as many pending acks as fit. count is the
// number of message blocks already in the datagram.
func (s *session) appendAcks(now time.Time, h *header, body []byte, count int, repeat bool) []byte {
	const ackBlock = 2 + 1 + packetAckSize
	room := s.cfg.maxDatagram - sizeHeader(h) - len(body)
	if s.acks.pending() == 0 || room < ackBlock {
		return body
	}
	s.ackBuf = s.acks.take(s.ackBuf[:0], room/ackBlock)
	fresh := len(s.ackBuf)
	if repeat {
		// Acks sent in the last half round trip go again in the room
		// left, so that a lost ack does not cost the peer a needless
		// resend. (Not in reliable datagrams: those are kept and resent.)
		s.ackBuf = s.acks.repeats(s.ackBuf, now.Add(-s.ackRepeatWindow()), room/ackBlock-fresh)
	}
	s.acks.remember(now, s.ackBuf[:fresh], s.ackRepeatWindow())
	if repeat {
		s.ackBuf = s.acks.merge(s.ackBuf)
	}
	var p [packetAckSize]byte
	for _, a := range s.ackBuf {
		body = appendMessage(body, &message{id: idPacketAck, payload: appendPacketAck(p[:0], a)})
	}
	return body
}

// ackRepeatWindow is how far back acks are sent again.
func (s *session) ackRepeatWindow() time.Duration { return max(s.rtt.srtt/2, time.Millisecond) }

// pollUnreliable builds an unreliable datagram when acks, pings or
// unreliable messages are due.
func (s *session) pollUnreliable(now time.Time, buf []byte) []byte {
	acksDue := s.acks.pending() >= 2 || s.acks.pending() > 0 && (s.ackNow || now.Sub(s.acks.oldest) >= s.ackDelay())
	pingDue := !now.Before(s.nextPing)
	// Unreliable messages are not held to the congestion controller's
	// rate: nothing acks them, so it could never learn to raise it. The
	// application sets their pace, and the peer can still cap it with a
	// FlowControlRequest.
	data := s.unrelQ.len() > 0
	if data && !s.rc.peerAllows(now) {
		s.pacedOut = true
		data = false
	}
	if !acksDue && !pingDue && len(s.pingReplies) == 0 && !data {
		return nil
	}
	h := &s.wh
	*h = header{packetID: s.nextPID, deltas: h.deltas[:0], indices: h.indices[:0]}
	p := packing{body: s.body[:0], limit: s.cfg.maxDatagram}
	var one [1]byte
	for _, id := range s.pingReplies {
		one[0] = id
		p.body = appendMessage(p.body, &message{id: idPingReply, payload: one[:]})
		p.count++
	}
	s.pingReplies = s.pingReplies[:0]
	if pingDue {
		one[0] = s.nextPingID
		s.pings[s.pingCount%len(s.pings)] = pingRecord{id: s.nextPingID, at: now}
		s.pingCount++
		s.nextPingID++
		p.body = appendMessage(p.body, &message{id: idPingRequest, payload: one[:]})
		p.count++
		s.nextPing = now.Add(s.cfg.keepalive())
	}
	if s.acks.pending() > 0 {
		p.body = s.appendAcks(now, h, p.body, p.count, true)
		p.count += len(s.ackBuf)
	}
	s.ackNow = s.acks.pending() > 0 && s.ackNow
	if data {
		before := p.count
		s.pack(now, h, &p, &s.unrelQ)
		if p.count > before {
			s.rc.sentUnpaced()
		}
	}
	s.body = p.body
	if p.count == 0 {
		return nil
	}
	b := appendHeader(buf[:0], h)
	b = append(b, p.body...)
	if p.appBytes > 0 {
		s.host.sendDone(p.appBytes)
	}
	s.sentUnreliable(b)
	return b
}

// packing is a datagram being filled.
type packing struct {
	body     []byte
	limit    int
	count    int    // message blocks so far
	appBytes int    // application payload bytes
	holds    bool   // a message in it may wait at the receiver
	tids     []byte // TransferIDs of the fragments in it
	skipped  int
	whole0   bool // the first block is a whole message
}

// room is how many bytes the datagram can still take.
func (p *packing) room(h *header) int { return p.limit - sizeHeader(h) - len(p.body) }

// pack fills the datagram from q: whole messages and the first fragments of
// transfers in queue order, then further fragments of the transfer under way
// in the space left.
func (s *session) pack(now time.Time, h *header, p *packing, q *sendQueue) {
	for i := q.head; i < len(q.items) && p.room(h) >= 4 && p.count < maxPerDatagram; i++ {
		m := q.items[i]
		if m.done || (m.frag && m.off > 0) {
			continue
		}
		if !s.place(now, h, p, m) {
			p.skipped++
			if p.skipped > 64 {
				break
			}
		}
	}
	if q == &s.relQ {
		for s.bulk != nil && p.room(h) >= 16 && p.count < maxPerDatagram {
			if !s.placeFragment(now, h, p, s.bulk) {
				break
			}
		}
	}
	q.compact(s.freeQueued)
}

// maxPerDatagram bounds the message blocks in one datagram, so that an
// index into them fits InOrderDatagramIndexArray with room to spare.
const maxPerDatagram = 1024

// place tries to put m (whole, or its first fragment) into the datagram.
func (s *session) place(now time.Time, h *header, p *packing, m *outMsg) bool {
	if m.frag && s.bulk != nil {
		return false // one transfer at a time keeps the receiver's reassembly small
	}
	refs, ok := s.wireDeps(now, m, h.packetID)
	if !ok {
		return false
	}
	mark := len(h.deltas)
	wasInOrder := h.inOrder
	msg := message{id: m.id}
	if !s.encodeDeps(h, &msg, refs, m.latest) {
		return false
	}
	if m.frag {
		msg.fragStart = true
		msg.fragment = true
		msg.fragCount = m.fragCount
		msg.payload = m.payload[:m.fragSize]
	} else {
		msg.payload = m.payload
	}
	if sizeMessage(&msg) > p.room(h) {
		h.deltas, h.indices, h.inOrder = h.deltas[:mark], h.indices[:mark], wasInOrder
		return false
	}
	if m.frag {
		tid, ok := s.tids.alloc()
		if !ok {
			h.deltas, h.indices, h.inOrder = h.deltas[:mark], h.indices[:mark], wasInOrder
			return false
		}
		m.tid = tid
		msg.transferID = tid
		s.tids.carried(tid)
		p.tids = append(p.tids, tid)
		m.fragNext = 1
		s.bulk = m
	}
	p.body = appendMessage(p.body, &msg)
	p.holds = p.holds || len(refs) > 0 || m.frag
	at := msgRef{h.packetID, uint16(p.count)}
	if p.count == 0 && !m.frag && len(refs) == 0 {
		p.whole0 = true // applied as it arrives: an anchor
	}
	p.count++
	p.appBytes += len(msg.payload)
	m.off = len(msg.payload)
	if t := m.track; t != nil {
		t.packed = true
		t.at = at
		t.wire = append(t.wire[:0], refs...)
		if len(refs) > 0 {
			t.deps = append(t.deps[:0], m.deps...)
		}
		t.lastPID = h.packetID
		t.complete = !m.frag
		t.fragmented = m.frag
		t.sentAt = now
	}
	if !m.frag {
		m.done = true
	}
	return true
}

// placeFragment puts the next fragment of the transfer under way into the
// datagram.
func (s *session) placeFragment(now time.Time, h *header, p *packing, m *outMsg) bool {
	end := min(m.off+m.fragSize, len(m.payload))
	msg := message{fragment: true, transferID: m.tid, fragNumber: m.fragNext, payload: m.payload[m.off:end]}
	if sizeMessage(&msg) > p.room(h) {
		return false
	}
	p.body = appendMessage(p.body, &msg)
	p.count++
	p.appBytes += len(msg.payload)
	p.holds = true
	if !slices.Contains(p.tids, m.tid) {
		s.tids.carried(m.tid)
		p.tids = append(p.tids, m.tid)
	}
	m.off = end
	m.fragNext++
	if t := m.track; t != nil {
		t.lastPID = h.packetID
	}
	if m.fragNext == m.fragCount {
		if t := m.track; t != nil {
			t.complete = true
		}
		s.tids.release(m.tid) // packing is over; acks release the rest
		m.done = true
		s.bulk = nil
	}
	return true
}

// wireDeps turns m's dependencies into wire references from datagram pid,
// leaving out those known resolved. It reports false when m cannot go in
// this datagram yet: a dependency is unsent, too far back to name, or a
// fragmented message in this same datagram.
func (s *session) wireDeps(now time.Time, m *outMsg, pid uint32) ([]msgRef, bool) {
	refs := s.wdeps[:0]
	versions := 0
	for _, d := range m.deps {
		t := d.live()
		if t == nil || t.dropped {
			continue
		}
		if !t.packed {
			return nil, false
		}
		if s.resolvedAtSender(now, t) {
			continue
		}
		if m.latest {
			// Earlier versions of its state: the last two, and those
			// recent enough to be overtaken on the path.
			if versions++; versions > 2 && now.Sub(t.sentAt) > s.reorderHorizon() {
				continue
			}
		}
		if d.hard {
			return nil, false // goes once t is applied: see depOn
		}
		if t.at.pid == pid {
			// A message in this datagram: processed before m, so m
			// waits for what it waits for (DECISIONS §5).
			if t.fragmented {
				return nil, false
			}
			refs = append(refs, t.wire...)
			continue
		}
		if seqDiff(t.at.pid, pid)-1 > maxDepDelta {
			if !t.reliable {
				continue // long since applied or given up on
			}
			return nil, false // wait for its ack
		}
		refs = append(refs, t.at)
	}
	if m.inOrder && len(refs) == 0 {
		// Nothing left to name, yet the receiver should see that the
		// message was sent in order (an application that forwards what it
		// receives keeps the order), and a sequenced one must be
		// droppable when it comes late: depend on a message known
		// applied, or the first, naming nothing, of the newest reliable
		// datagram sent. With neither (at the start, or after long
		// silence), wait for a datagram that starts with one.
		found := false
		for _, a := range [...]struct {
			ref msgRef
			ok  bool
		}{{s.anchor, s.hasAnchor}, {s.lastWhole, s.hasLastWhole}} {
			if a.ok && a.ref.pid != pid && seqDiff(a.ref.pid, pid)-1 <= maxDepDelta && seqLess(a.ref.pid, pid) {
				refs = append(refs, a.ref)
				found = true
				break
			}
		}
		if !found {
			s.needAnchor = true
			return nil, false
		}
	}
	// Few entries: drop repeats in place.
	k := 0
	for _, r := range refs {
		if !slices.Contains(refs[:k], r) {
			refs[k] = r
			k++
		}
	}
	s.wdeps = refs[:k]
	return s.wdeps, true
}

// encodeDeps adds the entries refs need to the datagram header and sets
// msg's InOrder code, with the latest-state marker if latest (see
// supersedes). It reports false if the header would need more than maxDeps
// entries.
func (s *session) encodeDeps(h *header, msg *message, refs []msgRef, latest bool) bool {
	if len(refs) == 0 {
		return true
	}
	idx := s.entries[:0]
	for _, r := range refs {
		delta := uint16(seqDiff(r.pid, h.packetID) - 1)
		e := -1
		for x := range h.deltas {
			if h.deltas[x] == delta && h.indices[x] == r.idx {
				e = x
				break
			}
		}
		if e < 0 {
			if len(h.deltas) == maxDeps {
				return false
			}
			e = len(h.deltas)
			h.deltas = append(h.deltas, delta)
			h.indices = append(h.indices, r.idx)
		}
		idx = append(idx, byte(e))
	}
	if latest {
		idx = append(idx, idx[0])
	}
	s.entries = idx
	h.inOrder = true
	switch {
	case len(idx) > 1:
		msg.order = orderMulti
		msg.orderMulti = idx
	case idx[0] < 5:
		msg.order = idx[0] + 1
	default:
		msg.order = orderSingle
		msg.orderIndex = idx[0]
	}
	return true
}

// Timers.

// probeTimeout is how long after the last reliable send, with nothing
// acked, a probe goes out: the RTO, doubled for each probe since the last
// ack, at most DatagramTimeout. While closing, at most an eighth of
// DisconnectTimeout: what is left has to be acked within it, and a lost
// ack or two must not take all of it (before the first RTT sample the RTO
// is a full second, and doubles).
func (s *session) probeTimeout() time.Duration {
	t := s.rto()
	limit := min(s.cfg.datagramTimeout, max(4*t, 500*time.Millisecond))
	for i := 0; i < s.ptoCount && t < limit; i++ {
		t *= 2
	}
	t = min(t, limit)
	if s.closeAsked {
		t = min(t, max(s.cfg.disconnect/8, s.minRTO()))
	}
	return t
}

// nextTimeout is when the probe timer fires, if anything is in flight.
func (s *session) nextTimeout() (time.Time, bool) {
	if s.sent.oldest == nil {
		return time.Time{}, false
	}
	return s.lastReliableSend.Add(s.probeTimeout()), true
}

// onProbeTimeout runs when nothing was acked for a timeout: the two oldest
// datagrams in flight go again (RFC 9002's probes, resending data rather
// than declaring everything lost; two, so that one lost probe does not cost
// another timeout), and the timer backs off.
func (s *session) onProbeTimeout(now time.Time) {
	d := s.sent.oldestUnlost()
	if d == nil {
		return
	}
	s.ptoCount++
	s.lastReliableSend = now // re-arms the timer, even while the probe waits for the pacer
	s.markLost(now, d, false)
	if s.state != stateDone {
		if d := s.sent.oldestUnlost(); d != nil {
			s.markLost(now, d, false)
		}
	}
	s.rc.cc.OnTimeout(now)
}

// nextDeadline is when advance must next run.
func (s *session) nextDeadline(now time.Time) time.Time {
	t := now.Add(time.Hour)
	at := func(x time.Time) {
		if !x.IsZero() && x.Before(t) {
			t = x
		}
	}
	switch s.state {
	case stateSyn:
		at(s.synResend)
		at(s.started.Add(s.cfg.connectTimeout))
	case stateAdmit, stateSynAck:
		at(s.started.Add(s.cfg.connectTimeout))
	case stateLinger:
		at(s.lingerUntil)
	case stateClosing:
		at(s.discResend)
		at(s.closeBy)
	case stateDone:
		return now
	case stateOK:
		if s.acks.pending() > 0 {
			at(s.acks.oldest.Add(s.ackDelay()))
		}
		if x, ok := s.nextTimeout(); ok {
			at(x)
		}
		at(s.lossTime)
		at(s.nextPing)
		at(s.lastRecv.Add(s.cfg.lostTimeout))
		if s.closeAsked {
			at(s.closeBy)
		}
		if x, ok := s.res.nextDeadline(); ok {
			at(x)
		}
		if s.pacedOut {
			at(s.rc.nextSend(now, s.cfg.maxDatagram))
		}
	}
	return t
}

// advance runs the timers due at now.
func (s *session) advance(now time.Time) {
	switch s.state {
	case stateSyn:
		if !now.Before(s.started.Add(s.cfg.connectTimeout)) {
			s.fail(&TimeoutError{Op: "connect", Silent: s.cfg.connectTimeout})
		} else if !now.Before(s.synResend) {
			s.needSyn = true
			s.synBackoff = min(2*s.synBackoff, time.Second)
			s.synResend = now.Add(s.synBackoff)
		}
	case stateAdmit, stateSynAck:
		if !now.Before(s.started.Add(s.cfg.connectTimeout)) {
			s.fail(&TimeoutError{Op: "connect", Silent: s.cfg.connectTimeout})
		}
	case stateLinger:
		if !now.Before(s.lingerUntil) {
			s.state = stateDone
		}
	case stateClosing:
		if s.needDisc {
			return // goes out before the end
		}
		if !now.Before(s.closeBy) {
			// No DisconnectAck: the peer is declared lost (spec
			// "DisconnectTimeOut").
			s.fail(&TimeoutError{Op: "disconnect", Silent: s.cfg.disconnect})
		} else if !now.Before(s.discResend) {
			// Resent with backoff: a peer that does not answer is gone
			// or far, and DisconnectTimeout bounds the wait anyway.
			s.needDisc = true
			s.discBackoff = min(2*max(s.discBackoff, s.minRTO()), maxDiscBackoff)
			s.discResend = now.Add(s.discBackoff)
		}
	case stateOK:
		if silent := now.Sub(s.lastRecv); silent >= s.cfg.lostTimeout {
			s.fail(&TimeoutError{Silent: silent})
			return
		}
		if s.closeAsked && !now.Before(s.closeBy) {
			// Gave up delivering what was queued; still tell the
			// peer, so that it does not wait for a lost timeout.
			s.dropSending()
			s.state = stateClosing
			s.needDisc = true
			return
		}
		if !s.lossTime.IsZero() && !now.Before(s.lossTime) {
			s.detectLoss(now)
			if s.state == stateDone {
				return
			}
		}
		if x, ok := s.nextTimeout(); ok && !now.Before(x) {
			s.onProbeTimeout(now)
			if s.state == stateDone {
				return
			}
		}
		s.expireHeld(now)
	}
}

// expireHeld delivers the unreliable in-order messages that waited their
// reorder window out, dropping those they overtook.
func (s *session) expireHeld(now time.Time) {
	ready, dropped := s.res.expire(now, &s.win, s.expired[:0], s.dropped[:0])
	for _, hm := range dropped {
		s.stats.DroppedMessages++
		s.res.recycle(hm)
	}
	s.dropped = dropped[:0]
	for i, hm := range ready {
		heap.Push(&s.ready, hm)
		ready[i] = nil
	}
	s.expired = ready[:0]
	s.runReady(now)
}

// snapshot returns the counters with the current estimates.
func (s *session) snapshot() Stats {
	st := s.stats
	st.RTT = s.rtt.srtt
	st.RTTVar = s.rtt.rttvar
	st.MinRTT = s.rtt.min
	st.RTO = s.rto()
	st.SendRate = s.rc.datagramRate()
	st.InFlight = s.sent.count
	return st
}
