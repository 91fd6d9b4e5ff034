package knet

import "time"

// liveState is what tells whether the peer is still there: when it last
// proved alive, and the pings that keep it proving so (spec "Ping"),
// answered with PingReplies that also sample the round trip.
type liveState struct {
	// lastRecv is when the peer last proved alive: a new datagram, never
	// one received before (stale: the datagram being handled, in a secure
	// session, was).
	lastRecv   time.Time
	nextPing   time.Time // when a PingRequest goes, unless the span is full
	epoch      time.Time // the session's start, which ping times count from
	pings      [8]pingRecord
	pingCount  int
	stale      bool
	nextPingID uint8
	suspended  bool // the peer is silent past the lost timeout: resume.go
	// waking: a suspended connection heard a new datagram, and waits for
	// the answer to a ping sent since to resume (resume.go).
	waking      bool
	pingReplies []uint8 // PingReplies owed, by the requests' IDs
}

// liveDeadline adds an open connection's timers of liveness: the next
// ping, unless held (no new datagram may go, see spanFull), and the lost
// timeout.
func (s *session) liveDeadline(held bool, t *deadlines) {
	if s.live.suspended {
		s.suspendedDeadline(t)
		return
	}
	if !held {
		t.at(s.live.nextPing)
	}
	t.at(s.live.lastRecv.Add(s.cfg.lostTimeout))
}

// advanceLive ends an open connection whose peer was silent for the
// lost timeout. (A ping due goes with the next poll: see unreliableDue.)
func (s *session) advanceLive(now time.Time) {
	silent := now.Sub(s.live.lastRecv)
	switch {
	case s.live.suspended:
		s.advanceSuspended(now)
	case silent < s.cfg.lostTimeout:
	case s.resumable():
		s.suspend(now)
	default:
		s.fail(&TimeoutError{Silent: silent})
	}
}

// pingRecord is a PingRequest sent: its ID, when, as the time since the
// session began (live.epoch), and the low 32 bits of its datagram's
// packet number (every session holds eight).
type pingRecord struct {
	at       time.Duration
	pn       uint32
	id       uint8
	answered bool
}

// alive notes that the datagram being handled proves the peer alive,
// unless it is a copy of one received before.
func (s *session) alive(now time.Time) {
	if !s.live.stale {
		s.live.lastRecv = now
		if s.live.suspended {
			s.wakeSuspended(now)
		}
	}
}

// pingNow records a PingRequest going out now and returns its ID.
func (s *session) pingNow(now time.Time) uint8 {
	id := s.live.nextPingID
	// The PingRequest goes in the next new datagram, whatever it carries
	// besides: numbered nextPN (numberNew).
	s.live.pings[s.live.pingCount%len(s.live.pings)] = pingRecord{id: id, at: now.Sub(s.live.epoch), pn: uint32(s.send.nextPN)}
	s.live.pingCount++
	s.live.nextPingID++
	s.live.nextPing = now.Add(s.pingGap(now))
	if s.live.suspended {
		s.live.nextPing = s.resumeProbeDue(now)
	}
	return id
}

// pingForProof has a PingRequest go now, unless one went in a datagram
// numbered first or later and is not answered yet, or any went within a
// quarter of the keepalive: its answer proves the peer read a datagram
// from first on, as an ack would (a key update waits for that proof:
// keyupdate.go). A connection that sends only unreliable messages gets no
// ack, and would otherwise wait for its keepalive's ping. The quarter
// keeps two idle peers whose keys are due after every datagram from
// pinging each other for proof without end.
func (s *session) pingForProof(now time.Time, first uint64) {
	if s.live.suspended {
		return // its pings are resume.go's
	}
	if n := s.live.pingCount; n > 0 {
		p := s.live.pings[(n-1)%len(s.live.pings)]
		if s.pingPN(p) >= first && !p.answered || now.Sub(s.live.epoch)-p.at < s.cfg.keepalive()/4 {
			return
		}
	}
	s.live.nextPing = minTime(s.live.nextPing, now)
}

// pingPN is the packet number of p's datagram: the one within 2^32 below
// the next.
func (s *session) pingPN(p pingRecord) uint64 {
	return s.send.nextPN - uint64(uint32(s.send.nextPN)-p.pn)
}

// handlePing takes a PingRequest, PingReply or FlowControlRequest, the
// messages both dialects share, and reports whether m was one.
func (s *session) handlePing(now time.Time, id uint32, payload []byte) bool {
	switch id {
	case idPingRequest:
		if len(payload) == 1 && len(s.live.pingReplies) < maxPingReplies {
			s.live.pingReplies = append(s.live.pingReplies, payload[0])
		}
	case idPingReply:
		if len(payload) == 1 {
			s.handlePingReply(now, payload[0])
		}
	case idFlowControlRequest:
		if len(payload) == 2 {
			s.peerRateRequest(now, uint16(payload[0])|uint16(payload[1])<<8)
		}
	default:
		return false
	}
	return true
}

func (s *session) handlePingReply(now time.Time, id uint8) {
	s.pmtuPingReply(now, id)
	for i := range min(s.live.pingCount, len(s.live.pings)) {
		p := &s.live.pings[i]
		if p.id == id && !p.answered {
			s.loss.rtt.sample(now.Sub(s.live.epoch) - p.at)
			p.answered = true
			// The peer read the ping's datagram: as good as its ack for
			// a key update (keyupdate.go), which a connection sending
			// only unreliable messages otherwise never gets. Its packet
			// number is the one within 2^32 below the next.
			s.loss.ackedTop = max(s.loss.ackedTop, s.pingPN(*p)+1)
			if s.live.waking {
				s.resume(now) // resume.go
			}
			if s.handshake.pinging {
				s.handshake.pinging = false // the server holds us open (openPings)
				s.live.nextPing = now.Add(s.cfg.keepalive())
			}
			return
		}
	}
}

// maxPingReplies bounds the PingReplies owed: a peer pinging faster than we
// answer gets the first ones answered.
const maxPingReplies = 64
