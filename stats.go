package knet

import "time"

// Stats are a connection's counters.
type Stats struct {
	RTT    time.Duration // smoothed round-trip time
	RTTVar time.Duration // its mean deviation
	MinRTT time.Duration // the lowest seen
	RTO    time.Duration // the current retransmission timeout

	DatagramsSent     uint64 // as the system took them: retransmissions included
	DatagramsReceived uint64 // valid datagrams, duplicates included
	BytesSent         uint64 // UDP payload bytes
	BytesReceived     uint64
	MessagesSent      uint64 // application messages
	MessagesReceived  uint64 // application messages delivered
	Retransmits       uint64 // reliable datagrams sent again
	FastRetransmits   uint64 // datagrams taken for lost on ack gaps, before any timeout
	SpuriousLosses    uint64 // datagrams taken for lost, or resent on a timeout, that were only late

	InvalidDatagrams   uint64 // malformed datagrams dropped; over a secure stream, the sealed frame that did not authenticate (it ends the connection)
	DuplicateDatagrams uint64 // dropped as already received
	// DuplicateMessages counts reliable messages dropped as already
	// received: in the reference dialect a message is resent in a new
	// datagram, under its reliable message number.
	DuplicateMessages uint64
	DroppedDatagrams  uint64 // dropped for lack of room (inbox or buffers); reliable ones come again
	DroppedMessages   uint64 // unreliable messages dropped: send queue full, receive buffer full, or too late to be in order
	// ReplacedMessages counts latest-state messages (ContentID) that a
	// newer version of the same state replaced while they were still
	// queued, so that they never left: a sign that the path, the peer's
	// flow control or higher priorities keep them waiting.
	ReplacedMessages uint64
	// ObsoleteMessages counts reliable latest-state versions received
	// and dropped as no newer than one already taken: a copy of it, or
	// an older version, come late.
	ObsoleteMessages uint64
	// ReceiptsDelivered and ReceiptsLost count the receipts told
	// (Config.Receipts); ReceiptsDropped those the application did not
	// take before maxReceipts (4096) more came.
	ReceiptsDelivered, ReceiptsLost, ReceiptsDropped uint64
	ProtocolErrors                                   uint64 // well-formed datagrams breaking the protocol (the connection ends)
	// SendErrors counts datagrams the system refused to send (a full
	// buffer, no route, a port unreachable report...): they are not in
	// DatagramsSent and BytesSent, and a reliable one goes again later.
	// With Config.Simulate, a datagram is sent once it enters the
	// simulated network; failures to deliver it from there count here.
	SendErrors uint64
	// Migrations counts the moves of a secure connection to a new
	// address of its client (NAT rebinding, another network), each once
	// the client proved it receives there (see Conn.RemoteAddr). Only a
	// server's connections move; a client's count stays 0.
	Migrations uint64
	// Suspended is true while the connection waits for its silent peer
	// (Config.ResumeTimeout); Suspensions counts the times it started
	// to, Resumes the times the peer was heard again and it carried on.
	Suspended            bool
	Suspensions, Resumes uint64
	// KeyUpdates counts the key updates of a secure connection, both
	// ways: its own sending key replaced, and its peer's taken (see
	// Config.KeyUpdateInterval).
	KeyUpdates uint64

	// PathDatagramSize is the largest datagram the connection sends now,
	// in UDP payload bytes: MaxDatagramSize, or with path MTU discovery
	// (Config.MaxPathDatagramSize) the size found to be carried, which
	// fragmented transfers use. (It falls back to MaxDatagramSize when
	// the path stops carrying it.)
	PathDatagramSize int

	SendRate float64 // datagrams per second the rate control allows now
	InFlight int     // reliable datagrams unacked

	// UnreliableAsReliable counts unreliable messages too large for one
	// datagram (MaxUnreliablePayload), which went as reliable fragmented
	// transfers, as the protocol requires.
	UnreliableAsReliable uint64

	// Connection quality, over the last two seconds or so.

	// LossRate is the fraction of the peer's datagrams that did not
	// arrive, from the gaps in their PacketIDs (every datagram takes the
	// next one, reliable or not). A knet peer also skips one now and then
	// (docs/PROTOCOL.md 2.6), which counts here as a loss: about 1 in
	// 1024 of a download's datagrams, 5 in its first thousand.
	LossRate float64
	// Jitter is how much the round trip varies: RTTVar, the mean
	// deviation of its samples (RFC 6298).
	Jitter time.Duration
	// Rates, per second.
	SendBytesPerSecond, ReceiveBytesPerSecond       float64
	SendMessagesPerSecond, ReceiveMessagesPerSecond float64
	// QueuedBytes is the payload bytes sent but not yet acked, or still
	// queued: what a slow link or a slow peer holds up (SendBuffer bounds
	// it). ReceiveQueuedBytes is what arrived and the application has not
	// taken yet.
	QueuedBytes, ReceiveQueuedBytes int
	// Quality sums the path up for a game's display, from 1 (a clean
	// path, round trip under 80ms) to 0: it falls linearly with loss (0
	// at 25%) and with the round trip above 80ms (0 at 500ms), the two
	// multiplied.
	Quality float64
}

// rateRing keeps a connection's counters every rateStep over the last
// rateSamples steps, for the rates and loss in Stats. It lives in every
// Conn, so its samples are small: times on the ring's own clock, and the
// counters that cannot pass 2^32 in two seconds in their low 32 bits
// (differences are taken modulo 2^32).
type rateRing struct {
	base time.Time // the ring's clock starts here (the first note)
	ring [rateSamples]countSample
	last countSample
	n    int32 // samples held
	head int32 // oldest
}

type countSample struct {
	at                                    time.Duration // since base
	bytesOut, bytesIn                     uint64
	msgsOut, msgsIn, pidAdvance, uniqueIn uint32
}

const (
	rateStep    = 250 * time.Millisecond
	rateSamples = 9 // two seconds of steps
)

// note records the counters at now, every rateStep at most.
func (r *rateRing) note(now time.Time, st *Stats, pidAdvance, uniqueIn uint64) {
	if r.base.IsZero() {
		r.base = now
	}
	r.last = countSample{at: now.Sub(r.base), bytesOut: st.BytesSent, bytesIn: st.BytesReceived,
		msgsOut: uint32(st.MessagesSent), msgsIn: uint32(st.MessagesReceived),
		pidAdvance: uint32(pidAdvance), uniqueIn: uint32(uniqueIn)}
	if r.n > 0 && r.last.at-r.ring[(r.head+r.n-1)%rateSamples].at < rateStep {
		return
	}
	if r.n == rateSamples {
		r.head = (r.head + 1) % rateSamples
		r.n--
	}
	r.ring[(r.head+r.n)%rateSamples] = r.last
	r.n++
}

// fill sets st's rates and loss from the oldest sample to the latest
// counters, over the time to now (so they fall when traffic stops).
func (r *rateRing) fill(now time.Time, st *Stats) {
	if r.n == 0 {
		return
	}
	old := &r.ring[r.head]
	dt := (now.Sub(r.base) - old.at).Seconds()
	if dt <= 0 {
		return
	}
	l := &r.last
	st.SendBytesPerSecond = float64(l.bytesOut-old.bytesOut) / dt
	st.ReceiveBytesPerSecond = float64(l.bytesIn-old.bytesIn) / dt
	st.SendMessagesPerSecond = float64(l.msgsOut-old.msgsOut) / dt
	st.ReceiveMessagesPerSecond = float64(l.msgsIn-old.msgsIn) / dt
	if adv := l.pidAdvance - old.pidAdvance; adv > 0 {
		got := l.uniqueIn - old.uniqueIn
		st.LossRate = max(0, 1-float64(got)/float64(adv))
	}
}

// quality is Stats.Quality.
func quality(loss float64, rtt time.Duration) float64 {
	q := max(0, 1-loss/0.25)
	if over := rtt - 80*time.Millisecond; over > 0 {
		q *= max(0, 1-float64(over)/float64(420*time.Millisecond))
	}
	return q
}
