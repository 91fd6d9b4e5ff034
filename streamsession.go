package knet

import (
	"errors"
	"slices"
	"time"
)

// The protocol state of one kNet connection over a byte stream (TCP, as
// the C++ reference speaks it: docs/PROTOCOL.md §9), in the manner of
// session: a plain struct driven with the current time, no goroutines,
// no locks. What arrives is fed in as it comes (received); what is to be
// written is taken out (take) and reported written (wrote). Groundwork
// of issue 23: no Conn uses it yet.
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

// streamPingInterval is the reference's ping period over TCP.
const streamPingInterval = 3500 * time.Millisecond

// streamUnreliableLimit is how many bytes may wait to be written before
// unreliable messages are dropped at the sender.
const streamUnreliableLimit = 64 << 10

var errStreamSilent = errors.New("knet: the stream's peer fell silent")

type streamSession struct {
	host     host
	lostTime time.Duration
	fr       *tcpFramer
	stats    Stats

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
}

func newStreamSession(h host, maxMessage int, lostTime time.Duration, now time.Time) *streamSession {
	return &streamSession{host: h, lostTime: lostTime, fr: newTCPFramer(maxMessage), nextPing: now, lastRecv: now}
}

// received takes bytes read from the stream. An error (a frame of size 0
// or over the limit) ends the connection: the stream cannot be cut into
// frames any more.
func (s *streamSession) received(now time.Time, p []byte) error {
	if s.err != nil {
		return s.err
	}
	s.lastRecv = now
	s.stats.BytesReceived += uint64(len(p))
	s.fr.feed(p)
	for {
		id, payload, ok, err := s.fr.next()
		if err != nil {
			s.err = err
			s.stats.ProtocolErrors++
			return err
		}
		if !ok {
			return nil
		}
		switch id {
		case idPingRequest:
			if len(payload) >= 1 {
				s.ctrl = appendTCPFrame(s.ctrl, idPingReply, payload[:1])
			}
		case idPingReply:
			// Only the reply to our last request counts; an unsolicited
			// one is dropped, as the reference does.
			if len(payload) >= 1 && payload[0] == s.pingID && !s.pingSent.IsZero() {
				s.rtt = now.Sub(s.pingSent)
				s.pingSent = time.Time{}
			}
		default:
			// Every other ID is the application's, reserved ones
			// included: on this wire they carry nothing else.
			if s.host.deliver(id, payload, nil, false, false) {
				s.stats.MessagesReceived++
			} else {
				s.stats.DroppedMessages++
			}
		}
	}
}

// enqueue queues m (its payload a private copy) to be written.
func (s *streamSession) enqueue(m *outMsg) {
	if s.err != nil {
		s.host.sendDone(len(m.payload))
		s.stats.DroppedMessages++
		return
	}
	if !m.reliable && s.qBytes+len(s.out) > streamUnreliableLimit {
		s.host.sendDone(len(m.payload))
		s.stats.DroppedMessages++
		return
	}
	if m.contentID != 0 && !m.inOrder {
		for i, o := range s.q {
			if o.id == m.id && o.contentID == m.contentID && o.reliable == m.reliable {
				// Latest state: the newer replaces the one still queued.
				s.stats.ReplacedMessages++
				s.host.sendDone(len(o.payload))
				s.qBytes -= len(o.payload)
				s.q = slices.Delete(s.q, i, i+1)
				break
			}
		}
	}
	i := len(s.q)
	for i > 0 && s.q[i-1].priority < m.priority {
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
	if now.Sub(s.lastRecv) >= s.lostTime {
		s.err = errStreamSilent
		return
	}
	if !now.Before(s.nextPing) {
		s.pingID++
		s.pingSent = now
		s.ctrl = appendTCPFrame(s.ctrl, idPingRequest, []byte{s.pingID})
		s.nextPing = now.Add(streamPingInterval)
	}
}

// deadline is when advance must next run.
func (s *streamSession) deadline() time.Time {
	if lost := s.lastRecv.Add(s.lostTime); lost.Before(s.nextPing) {
		return lost
	}
	return s.nextPing
}

// take frames queued messages, up to about max bytes in all, and returns
// the bytes to write: what is framed already (perhaps the rest of a frame
// partly written), then pings, then the queue. The caller writes them,
// then calls wrote with how many went.
func (s *streamSession) take(max int) []byte {
	if len(s.ctrl) > 0 {
		s.out = append(s.out, s.ctrl...)
		s.ctrl = s.ctrl[:0]
	}
	for len(s.q) > 0 && len(s.out) < max {
		m := s.q[0]
		s.q[0] = nil
		s.q = s.q[1:]
		s.qBytes -= len(m.payload)
		s.out = appendTCPFrame(s.out, m.id, m.payload)
		s.host.sendDone(len(m.payload))
	}
	return s.out
}

// wrote records that the first n bytes of what take returned went.
func (s *streamSession) wrote(n int) {
	s.stats.BytesSent += uint64(n)
	rest := copy(s.out, s.out[n:])
	s.out = s.out[:rest]
}
