package knet

import (
	"encoding/binary"
	"slices"
	"time"
)

// The protocol state of one kNet connection over a byte stream (TCP, as
// the C++ reference speaks it: docs/PROTOCOL.md §9), in the manner of
// session: a plain struct driven with the current time, no goroutines,
// no locks. What arrives is fed in as it comes (received); what is to be
// written is taken out (take) and reported written (wrote). A Conn over
// TCP or WebSocket runs one (stream.go).
//
// The stream carries frames and nothing else: no handshake, no acks, no
// flags. The only control messages are PingRequest and PingReply, every
// streamPingInterval from each side; a peer silent for the lost timeout is
// gone. Order and reliability are the stream's, so the delivery modes
// come down to what the sender queues:
//   - reliable messages, in order or not, are queued and all go;
//   - an unreliable message is dropped at the sender when what waits to be
//     written is over streamUnreliableLimit: behind a slow stream it
//     would come late anyway;
//   - a latest-state message (ContentID) replaces the version of its state
//     still queued;
//   - Priority orders the queue, as on UDP.
//
// Every message received reads as unreliable and not in order: the wire
// says nothing of how it was sent (the reference marks them so too).
//
// knet peers say so to each other in their first frame (a knet hello,
// streamHello): a PingReply that no ping asked for, which the reference
// drops unread. Between knet peers the same form carries the Admit reply,
// a refusal and the reason of a close.

// streamPingInterval is the reference's ping period over TCP.
const streamPingInterval = 3500 * time.Millisecond

// streamCtrlLimit bounds the control frames (ping replies) waiting to be
// written: a peer that pings faster than it reads gets no more replies
// until they go, instead of making us hold a reply for each ping.
const streamCtrlLimit = 1 << 10

// streamFrameProgress is how much of a frame must come within each lost
// timeout while it is not whole (partialSince): 4 KiB, some 270 bytes a
// second with the default timeout.
const streamFrameProgress = 4 << 10

// streamUnreliableLimit is how many bytes may wait to be written before
// unreliable messages are dropped at the sender.
const streamUnreliableLimit = 64 << 10

type streamSession struct {
	host      host
	one       [1]delivery // a message being handed to host.deliver
	lostTime  time.Duration
	pingEvery time.Duration
	fr        *tcpFramer
	stats     Stats

	q        []*outMsg // messages not yet framed, by priority then send order
	qBytes   int
	out      []byte // framed, not yet written
	ctrl     []byte // pings, written before out
	pingID   uint8
	pingSent time.Time
	nextPing time.Time
	lastRecv time.Time
	rtt      time.Duration
	err      error

	// gate holds back everything after the peer's first frame, which
	// is kept in first, until open is called: the connection's
	// admission reads it.
	gate      bool
	sawFirst  bool
	firstID   uint32
	first     []byte
	quiet     bool      // no pings yet: a server waits for the client's first frame
	knet      bool      // the peer said it is knet (its hello)
	free      []*outMsg // messages let go, for newMsg
	closeWhy  []byte    // a knet peer's reason for closing, once it gave one
	closeCode uint32    // a knet peer's code for closing (helloCloseCode), or 0
	peerClose bool      // a knet peer's close hello came

	// seal seals and opens frames once a secure session has its keys
	// (stream_secure.go); nil in clear.
	seal *streamSeal
	// partialSince is when the frame not yet whole (zero between
	// frames) began, or last gained streamFrameProgress bytes; partialAt
	// how many of it had come then. A frame must come whole, or gain
	// that much, within each lost timeout: a peer sending a byte now and
	// then cannot hold a frame open, while a large frame on a slow link
	// goes on.
	partialSince time.Time
	partialAt    int
}

func newStreamSession(h host, maxMessage int, lostTime time.Duration, now time.Time) *streamSession {
	return &streamSession{host: h, lostTime: lostTime, pingEvery: streamPingInterval, fr: newTCPFramer(maxMessage), nextPing: now, lastRecv: now}
}

// received takes bytes read from the stream. An error (a frame of size 0
// or over the limit) ends the connection: the stream cannot be cut into
// frames any more.
func (s *streamSession) received(now time.Time, p []byte) error {
	if s.err != nil {
		return s.err
	}
	if len(p) > 0 {
		s.lastRecv = now
		s.stats.BytesReceived += uint64(len(p))
		s.fr.feed(p)
	}
	got := false
	for {
		if s.gate && s.sawFirst {
			// The admission has not read the first frame yet; what
			// follows waits, unless it can never be taken.
			if err := s.fr.peek(); err != nil {
				s.err = &ProtocolError{Err: err}
				s.stats.ProtocolErrors++
				return s.err
			}
			return nil
		}
		id, payload, ok, err := s.fr.next()
		if err != nil {
			s.err = &ProtocolError{Err: err}
			s.stats.ProtocolErrors++
			return s.err
		}
		if !ok {
			switch n := s.fr.buffered(); {
			case n == 0:
				s.partialSince = time.Time{}
			case got || s.partialSince.IsZero() || n-s.partialAt >= streamFrameProgress:
				s.partialSince, s.partialAt = now, n
			}
			return nil
		}
		got = true
		if s.fr.sealed {
			if id, payload, err = s.seal.open(payload); err != nil {
				// A stream cannot skip a frame: the connection ends.
				s.stats.InvalidDatagrams++
				s.err = &ProtocolError{Err: err}
				return s.err
			}
		}
		if s.gate {
			s.sawFirst, s.firstID = true, id
			s.first = append(s.first[:0], payload...)
			continue // to the check of what follows it
		}
		s.dispatch(now, id, payload)
	}
}

// open lets frames through the gate: the first one, unless the admission
// took it (consumed), then those behind it.
func (s *streamSession) open(now time.Time, consumed bool) {
	s.gate, s.quiet = false, false
	if s.sawFirst && !consumed {
		s.dispatch(now, s.firstID, s.first)
	}
	s.first = nil
	if s.err == nil {
		s.received(now, nil)
	}
}

// dispatch acts on one frame.
func (s *streamSession) dispatch(now time.Time, id uint32, payload []byte) {
	switch id {
	case idPingRequest:
		switch {
		case len(payload) < 1:
		case len(s.ctrl) >= streamCtrlLimit:
			s.stats.DroppedDatagrams++
		default:
			s.ctrl = appendTCPFrame(s.ctrl, idPingReply, payload[:1])
		}
	case idPingReply:
		// Only the reply to our last request counts; an unsolicited
		// one is dropped, as the reference does.
		if kind, content, ok := parseStreamHello(payload); ok {
			s.hello(kind, content)
		} else if len(payload) >= 1 && payload[0] == s.pingID && !s.pingSent.IsZero() {
			s.rtt = now.Sub(s.pingSent)
			s.pingSent = time.Time{}
		}
	default:
		// Every other ID is the application's, reserved ones
		// included: on this wire they carry nothing else.
		s.one[0] = delivery{id: id, payload: payload}
		s.host.deliver(s.one[:])
		if s.one[0].taken {
			s.stats.MessagesReceived++
		} else {
			s.stats.DroppedMessages++
		}
		s.one[0] = delivery{}
	}
}

// enqueue queues m (its payload a private copy) to be written.
func (s *streamSession) enqueue(m *outMsg) {
	if s.err != nil || !m.reliable && s.qBytes+len(s.out) > streamUnreliableLimit {
		s.stats.DroppedMessages++
		s.drop(m, false)
		return
	}
	if m.contentID != 0 && !m.inOrder && len(m.after) == 0 {
		for i, o := range s.q {
			if o.id == m.id && o.contentID == m.contentID && o.reliable == m.reliable && !o.inOrder && len(o.after) == 0 {
				// Latest state: the newer replaces the one still queued.
				s.stats.ReplacedMessages++
				s.qBytes -= len(o.payload)
				s.q = slices.Delete(s.q, i, i+1)
				s.drop(o, false)
				break
			}
		}
	}
	// Priority moves m ahead of queued messages of lower priority, but
	// never ahead of one it depends on: an earlier one of its channel
	// when it is in order, or one it names.
	i := len(s.q)
	for i > 0 && s.q[i-1].priority < m.priority && !dependsOn(m, s.q[i-1]) {
		i--
	}
	s.q = slices.Insert(s.q, i, m)
	s.qBytes += len(m.payload)
	s.stats.MessagesSent++
}

// advance runs the ping timer and the silence check.
func (s *streamSession) advance(now time.Time) {
	if s.err != nil {
		return
	}
	if s.seal != nil {
		s.seal.tick(now)
	}
	if silent := now.Sub(s.lastRecv); silent >= s.lostTime {
		s.err = &TimeoutError{Silent: silent}
		return
	}
	if !s.partialSince.IsZero() && now.Sub(s.partialSince) >= s.lostTime {
		s.err = &TimeoutError{Op: "frame", Silent: now.Sub(s.partialSince)}
		return
	}
	if !s.quiet && !now.Before(s.nextPing) {
		s.pingID++
		s.pingSent = now
		s.ctrl = appendTCPFrame(s.ctrl, idPingRequest, []byte{s.pingID})
		s.nextPing = now.Add(s.pingEvery)
	}
}

// deadline is when advance must next run. A quiet session (a server's
// before its client's first frame) has no ping to send: an idle stream
// costs no round until its deadline.
func (s *streamSession) deadline() time.Time {
	next := s.lastRecv.Add(s.lostTime)
	if !s.quiet {
		next = minTime(next, s.nextPing)
	}
	if !s.partialSince.IsZero() {
		next = minTime(next, s.partialSince.Add(s.lostTime))
	}
	return next
}

// take frames queued messages, up to about max bytes in all, and returns
// the bytes to write: what is framed already (perhaps the rest of a frame
// partly written), then pings, then the queue. The caller writes them,
// then calls wrote with how many went.
func (s *streamSession) take(max int) []byte {
	if len(s.ctrl) > 0 {
		if s.seal != nil {
			var err error
			if s.out, err = s.seal.reseal(s.out, s.ctrl); err != nil && s.err == nil {
				s.err = err
			}
		} else {
			s.out = append(s.out, s.ctrl...)
		}
		s.ctrl = s.ctrl[:0]
	}
	for len(s.q) > 0 && len(s.out) < max && s.err == nil {
		m := s.q[0]
		s.q[0] = nil
		s.q = s.q[1:]
		s.qBytes -= len(m.payload)
		if s.seal != nil {
			var err error
			if s.out, err = s.seal.appendFrame(s.out, m.id, m.payload); err != nil {
				s.err = err
				s.drop(m, false)
				break
			}
		} else {
			s.out = appendTCPFrame(s.out, m.id, m.payload)
		}
		s.drop(m, true)
	}
	return s.out
}

// drop lets m go, framed (sent) or not: its send buffer bytes, its
// payload buffer and its receipt. Over a stream, a message framed is
// delivered unless the connection fails first; the receipt says so then.
func (s *streamSession) drop(m *outMsg, sent bool) {
	s.host.sendDone(len(m.payload))
	if m.tracked {
		s.host.receipt(Receipt{Ref: m.ref, Delivered: sent})
	}
	putPayload(m.pbuf)
	*m = outMsg{}
	if len(s.free) < streamFreeMsgs {
		s.free = append(s.free, m)
	}
}

// streamFreeMsgs is how many let-go messages a session keeps for the
// next ones (newMsg): a steady sender allocates none.
const streamFreeMsgs = 64

// newMsg returns an empty message, one let go before if there is one.
func (s *streamSession) newMsg() *outMsg {
	if n := len(s.free); n > 0 {
		m := s.free[n-1]
		s.free = s.free[:n-1]
		return m
	}
	return new(outMsg)
}

// dependsOn reports whether m must not leave before o.
func dependsOn(m, o *outMsg) bool {
	if m.inOrder && o.inOrder && m.channel == o.channel {
		return true
	}
	return slices.Contains(m.after, o.ref)
}

// failQueue drops what is still queued, as the connection ends.
func (s *streamSession) failQueue() {
	for _, m := range s.q {
		s.drop(m, false)
	}
	s.q, s.qBytes = nil, 0
}

// queued reports whether anything waits to be framed or written.
func (s *streamSession) queued() bool { return len(s.q) > 0 || len(s.out) > 0 || len(s.ctrl) > 0 }

// sendHello queues a knet hello of kind with content, before anything
// else still to be framed.
func (s *streamSession) sendHello(kind byte, content []byte) {
	s.ctrl = appendTCPFrame(s.ctrl, idPingReply, appendStreamHello(nil, kind, content))
}

// hello acts on a knet peer's hello.
func (s *streamSession) hello(kind byte, content []byte) {
	s.knet = true
	if kind == helloPath {
		s.pathHello(content)
		return
	}
	if kind == helloCloseCode {
		if len(content) < 4 {
			content = nil // no code: a close without one
		} else {
			s.closeCode = binary.LittleEndian.Uint32(content)
			content = content[4:]
		}
		kind = helloClose
	}
	if kind == helloClose || kind == helloRefuse {
		s.peerClose = true
		s.closeWhy = append([]byte(nil), content[:min(len(content), MaxReasonLength)]...)
	}
}

// sendClose queues the close hello: kind 4 with the reason, as ever, or,
// for a code other than 0 (CloseWithError), kind 7 with the code (u32
// little-endian) before the reason.
func (s *streamSession) sendClose(code uint32, reason []byte) {
	if code == 0 {
		s.sendHello(helloClose, reason)
		return
	}
	p := binary.LittleEndian.AppendUint32(make([]byte, 0, 4+len(reason)), code)
	s.sendHello(helloCloseCode, append(p, reason...))
}

// The knet hello: a PingReply whose payload is pingID 0 (the reference
// counts its pings from 1, and drops a reply to none), the magic, the
// version and a kind, then the kind's content.
const (
	helloClient = 1 // the client's first frame; content: ConnectPayload
	helloAccept = 2 // the server's answer; content: the Admit reply
	helloRefuse = 3 // the server's refusal; content: the reason
	helloClose  = 4 // a close with a reason; content: the reason
	// helloCloseCode (7) is a close with a code (CloseWithError); content:
	// the code, u32 little-endian, then the reason. Kinds 5 and 6 are
	// stream_secure.go's.
	helloCloseCode = 7
)

var streamHelloMagic = [...]byte{0, 'k', 'N', 'T', 1}

func appendStreamHello(b []byte, kind byte, content []byte) []byte {
	b = append(b, streamHelloMagic[:]...)
	b = append(b, kind)
	return append(b, content...)
}

func parseStreamHello(p []byte) (kind byte, content []byte, ok bool) {
	n := len(streamHelloMagic)
	if len(p) <= n || [5]byte(p[:n]) != streamHelloMagic || p[n] < helloClient || p[n] > helloPath {
		return 0, nil, false
	}
	return p[n], p[n+1:], true
}

// wrote records that the first n bytes of what take returned went.
func (s *streamSession) wrote(n int) {
	s.stats.BytesSent += uint64(n)
	rest := copy(s.out, s.out[n:])
	s.out = s.out[:rest]
}
