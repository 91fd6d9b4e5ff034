package knet

import "time"

// session is the protocol state machine of one connection. It does no I/O
// and keeps no clock: the connection's round feeds it datagrams
// (handleDatagram) and the time (advance), asks it for datagrams to send
// (poll) and acts on what it reports (takeEvents).
//
// Its fields are components, each owned by the file named beside it. A
// component with timers has a deadline method, which nextDeadline asks,
// and an advance step, which advance runs (session_timer.go).
type session struct {
	cfg    *config
	host   host
	client bool
	secure bool // a secure session (secure_layer.go): every datagram it is handed was authenticated
	state  sessState
	events sessEvent // what the connection has yet to act on
	owed   owed      // control messages the peer is owed, which poll sends
	err    error     // why the connection ended
	stats  Stats

	// The wire (session_wire.go): how datagrams are read and built, in
	// the spec's dialect (session_spec.go, session_specsend.go) or the
	// C++ implementation's (session_cpp.go, session_cppsend.go).
	wire wire

	// The connection's life.
	handshake handshakeState // session_handshake.go: ConnectSyn, ConnectSynAck, admission
	live      liveState      // session_live.go: the peer's last sign of life, pings
	closing   closeState     // session_close.go: Disconnect, DisconnectAck, linger
	reach     reachState     // session_reach.go: the system's reports that the peer is gone
	path      pathState      // session_path.go: a secure session's path checks

	// Sending.
	send    sendState   // session_send.go, sendqueue.go: packet numbers, queues, packing
	anchors anchors     // session_deps.go: what in-order messages name when nothing else
	loss    lossState   // loss.go: datagrams in flight, loss recovery, the round trip
	rc      rateControl // congestion.go, pacer.go: how fast
	acks    ackQueue    // ack.go: the acks owed the peer

	// Receiving.
	recv recvState // session_recv.go, session_apply.go: the window, reassembly, held messages
	flow flowState // flowcontrol.go: the rate we ask of the peer

	// scratch holds buffers reused from one datagram to the next: the
	// driver's running the round (one per worker, not one per
	// connection), or the session's own outside a round (see sc).
	scratch *scratchSpace

	// x holds what few connections use, made on first use: receipts
	// owed, reliable latest state sent and taken.
	x *extras

	// budget is a Listener's connection's share of its receive budget
	// (budget.go), a stream connection's too; nil on a dialed one.
	budget *budgetShare
}

// sessState is where a session is in the connection's life.
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

// sessEvent is something a session call did that its connection acts on
// once the call has returned (takeEvents): the session never calls back
// into the connection to change state.
type sessEvent uint8

const (
	evAdmit       sessEvent = 1 << iota // server: a ConnectSyn waits for the application's decision (admitted)
	evEstablished                       // the handshake completed
	evPeerClosed                        // the peer's Disconnect: the receive queue ends after what it holds
	evTidy                              // the session tidied up (see tidy): the connection's turn
)

// owed is the control messages a session owes its peer, a bit each: set
// when something calls for one, taken when a datagram carries it (poll),
// or when what called for it is over.
type owed uint16

const (
	oweSyn          owed = 1 << iota // client: a ConnectSyn (the first, or one resent)
	oweSynAck                        // server: a ConnectSynAck (the first, or ours was lost)
	oweAck                           // client: a ConnectAck, the first reliable message
	oweDisc                          // a Disconnect (the first, or one resent)
	oweDiscAck                       // a DisconnectAck, to the peer's Disconnect or refusing its ConnectSyn
	oweFlow                          // a FlowControlRequest asking for flow.rate
	oweAnchor                        // a reliable datagram whose first message names nothing (see wireDeps)
	owePathResponse                  // a secure client: the PathResponse to path.challenge
	oweAckNow                        // the acks owed, without the usual delay
)

// owe adds m to what is owed.
func (o *owed) owe(m owed) { *o |= m }

// owes reports whether any of m is owed.
func (o owed) owes(m owed) bool { return o&m != 0 }

// take removes m from what is owed and reports whether any of it was.
func (o *owed) take(m owed) bool {
	had := *o&m != 0
	*o &^= m
	return had
}

// takeEvents returns what happened since it was last called.
func (s *session) takeEvents() sessEvent {
	e := s.events
	s.events = 0
	return e
}

// host is what the session needs from its connection.
type host interface {
	// deliver hands application messages to the receive queue, in
	// order, under one lock: the queue copies each payload, or, if buf
	// is not nil, takes buf, the pooled buffer payload aliases: it keeps
	// it or puts it back. It sets taken for each message it queued, and
	// leaves it false if there was no room.
	deliver(ds []delivery)
	// recvUsed is what the receive queue counts against ReceiveBuffer:
	// its payload bytes, and a cost for each message.
	recvUsed() int
	// sendDone returns n payload bytes to the send buffer.
	sendDone(n int)
	// receipt hands the application a message's receipt
	// (Config.Receipts).
	receipt(r Receipt)
}

// delivery is an application message handed to the receive queue.
type delivery struct {
	id       uint32
	payload  []byte
	buf      *[]byte // the pooled buffer payload aliases, or nil
	reliable bool
	inOrder  bool
	taken    bool // set by host.deliver: queued
}

// scratchSpace is the buffers a session reuses from one datagram to the
// next, received or built, so that steady traffic allocates nothing.
type scratchSpace struct {
	rd      datagram  // the one being handled
	acked   ackResult // what its acks freed (see afterAcks)
	deps    []msgRef
	ready   readyHeap
	woken   []*held
	dropped []*held
	expired []*held
	wh      header // the one being built
	body    []byte
	ackBuf  []packetAck
	wdeps   []msgRef
	entries []byte
	tidBuf  []byte
	lsent   []latestSent
	// ltag is the latest-state tag of the FragmentStart being handled.
	ltag   latestTag
	ltagOK bool
	// The dependency tables of the datagram being handled and of a
	// reassembled message, made when first needed.
	deps1, deps2 *depTable
	// dq is the application messages of the datagram being handled,
	// handed to the receive queue together at its end (session.deliver);
	// dqCharge is what they will count against ReceiveBuffer.
	dq       []delivery
	dqCharge int
}

// depTable returns the dependency table of the datagram being handled.
func (sc *scratchSpace) depTable() *depTable {
	if sc.deps1 == nil {
		sc.deps1 = new(depTable)
	}
	return sc.deps1
}

// fragTable returns the dependency table of a reassembled message.
func (sc *scratchSpace) fragTable() *depTable {
	if sc.deps2 == nil {
		sc.deps2 = new(depTable)
	}
	return sc.deps2
}

// release readies a driver's scratch space for the next connection's round:
// what one round leaves in it (an ack result not taken, held messages)
// must never reach another connection's session. The rounds take all of it
// as they go; this makes sure.
func (sc *scratchSpace) release() {
	sc.acked = ackResult{tids: sc.acked.tids[:0], rels: sc.acked.rels[:0]}
	clear(sc.ready)
	sc.ready = sc.ready[:0]
	clear(sc.woken[:cap(sc.woken)])
	clear(sc.dropped[:cap(sc.dropped)])
	clear(sc.expired[:cap(sc.expired)])
	sc.woken, sc.dropped, sc.expired = sc.woken[:0], sc.dropped[:0], sc.expired[:0]
	clear(sc.dq[:cap(sc.dq)])
	sc.dq, sc.dqCharge = sc.dq[:0], 0
	for _, t := range [...]*depTable{sc.deps1, sc.deps2} {
		if t != nil {
			t.reset(0)
		}
	}
}

// sc returns the scratch space: the round's driver's, or else one of the
// session's own, made when first needed.
func (s *session) sc() *scratchSpace {
	if s.scratch == nil {
		s.scratch = new(scratchSpace)
	}
	return s.scratch
}

// newSession makes a session speaking dialect's wire (DialectSpec or
// DialectReference).
func newSession(cfg *config, h host, client bool, dialect Dialect, now time.Time) *session {
	cfg = cfg.forDialect(dialect)
	s := &session{
		cfg:    cfg,
		host:   h,
		client: client,
		rc:     newRateControl(cfg),
	}
	s.handshake.started = now
	s.live.epoch = now
	s.live.lastRecv = now
	s.loss.cfg = cfg
	s.send.fragSize = cfg.fragSize()
	if dialect == DialectReference {
		s.wire = newCppWire(s)
	} else {
		s.wire = &specWire{s: s}
	}
	s.initPMTU()
	s.secure = client && cfg.serverKey != nil || !client && cfg.privateKey != nil
	if s.secure {
		// Both ends number from 0; the handshake's datagrams, in clear,
		// are no part of the window (recvWindow.startAt).
		s.recv.win.startAt(0)
	} else if !client && dialect != DialectReference {
		// A plaintext server numbers from a random PacketID: its
		// ConnectSynAck's, which the client's ack must name (takeProof).
		s.startPIDAt(randomBits(packetIDMask))
	}
	s.recv.reasm.budget = cfg.reassemblyBuffer
	s.recv.reasm.maxMessage = cfg.maxMessage
	if client {
		s.state = stateSyn
		s.owed.owe(oweSyn)
		s.handshake.syn = cfg.connectPayload
		s.handshake.synBackoff = firstSynResend
		s.handshake.synResend = now.Add(s.handshake.synBackoff)
	} else {
		s.state = stateAdmit
	}
	return s
}

// done reports whether the session has ended and has nothing more to send.
func (s *session) done() bool { return s.state == stateDone && !s.owed.owes(oweDiscAck) }

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
	s.endKept() // unacked.go: what it was sending, for Unacknowledged
	s.endReceipts()
	released := 0
	var latestQ *sendQueue
	if s.rlOf() != nil {
		latestQ = &s.rlOf().q
		clear(s.rlOf().queued)
	}
	for _, q := range [...]*sendQueue{&s.send.relQ, &s.send.unrelQ, latestQ} {
		if q == nil {
			continue
		}
		for i := q.head; i < len(q.items); i++ {
			if m := q.items[i]; !m.done {
				released += s.unsentBytes(m)
				putPayload(m.pbuf)
				m.pbuf = nil
			}
		}
		*q = sendQueue{}
	}
	s.send.bulk = nil
	released += s.dropRetired()
	released += s.loss.drop()
	s.send.spanHold = 0
	s.anchors.hasApplied, s.anchors.hasLastWhole = false, false
	s.send.order.reset()
	clear(s.send.latestQueued)
	s.send.tids = transferIDs{noZero: s.send.tids.noZero}
	s.wire.dropSending()
	if released > 0 {
		s.host.sendDone(released)
	}
}

// snapshot returns the counters with the current estimates.
func (s *session) snapshot() Stats {
	st := s.stats
	st.RTT = s.loss.rtt.srtt
	st.RTTVar = s.loss.rtt.rttvar
	st.MinRTT = s.loss.rtt.min
	st.RTO = s.loss.rto()
	st.SendRate = s.rc.datagramRate()
	st.InFlight = s.loss.sent.count
	st.FastRetransmits = s.loss.fastRetransmits
	st.SpuriousLosses = s.loss.spuriousLosses
	st.PathDatagramSize = s.cfg.maxDatagram
	if p := s.mtu(); p != nil {
		st.PathDatagramSize = p.size
	}
	// In the Config's terms: a whole UDP payload, sealed or not.
	st.PathDatagramSize += s.cfg.sizeOverhead()
	return st
}

// refuse refuses a connection after all, its handshake done: the server's
// accept backlog filled up since admission. A DisconnectAck tells the
// client so if answer (DECISIONS §1: a stealthy listener answers nothing).
func (s *session) refuse(answer bool) {
	s.fail(ErrRefused)
	if answer {
		s.owed.owe(oweDiscAck)
	} else {
		s.owed.take(oweDiscAck)
	}
}
