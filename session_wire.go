package knet

import "time"

// wire is what differs between the two dialects (dialect.go) in a
// session: how datagrams are read and built. A session holds one
// (session.wire), chosen once by newSession:
//
//   - specWire, the specification's wire (DialectSpec): session_spec.go
//     reads, session_specsend.go builds, on the codec of datagram.go and
//     message.go;
//   - cppWire, the wire of the C++ reference implementation
//     (DialectReference): session_cpp.go reads, session_cppsend.go
//     builds, on the codec of cppwire.go.
//
// The rest of the session is shared by both: the states and their
// timers, the send queues and what orders them, loss recovery and rate
// control, the receive window, reassembly, acks and pings, applying
// messages. So is what building and reading datagrams does beyond
// encoding: the counts of a datagram being packed, a transfer started and
// its fragments placed, a reliable datagram recorded going out (packing,
// startTransfer, tookFragment, sentReliable in session_send.go); a
// fragment into reassembly and the whole message out of it, the end of a
// datagram's handling (reassemble, endTransfer, reclaimLent,
// datagramDone in session_recv.go).
//
// An implementation holds its session and calls into it; the session
// calls it only through these methods. They run on the connection's
// goroutine as the session's own do, and allocate nothing in steady
// traffic.
type wire interface {
	// read takes a datagram from the peer (handleDatagram): it parses
	// it, dropping a malformed one whole, and takes it as the session's
	// state calls for. b is not kept.
	read(now time.Time, b []byte)

	// control builds in buf a new unreliable datagram holding one
	// connection control message (idConnectSyn, idConnectSynAck,
	// idDisconnect, idDisconnectAck; idPath on a secure session, which
	// is always the spec's), carrying payload where the wire can, or
	// returns nil when it may not go now.
	control(buf []byte, id uint32, payload []byte) []byte
	// buildReliable packs reliable messages from the queue into a new
	// datagram, kept until acked, with whatever acks fit, or returns nil
	// when there is nothing to pack.
	buildReliable(now time.Time) []byte
	// pollUnreliable builds in buf an unreliable datagram when acks,
	// pings or unreliable messages are due, or returns nil.
	pollUnreliable(now time.Time, buf []byte) []byte
	// resend records d, found lost (loss.nextResend), going again, and
	// what its packet number is (send.out).
	resend(now time.Time, d *sent)
	// appendAck appends to b a PacketAck message acking a.
	appendAck(b []byte, a packetAck) []byte

	// freed takes what the acks of one datagram freed (afterAcks), for
	// the wire's own state.
	freed(a *ackResult)
	// acked reports whether the reliable message t, packed whole, is
	// known to have arrived; alone, that the receiver then holds it for
	// nothing it depends on (resolvedWithin).
	acked(t *track) (acked, alone bool)
	// dropSending forgets the wire's own state of what was queued or in
	// flight (session.dropSending).
	dropSending()
	// latestTags reports whether the wire tags reliable latest-state
	// versions (latest.go): the spec dialect's does.
	latestTags() bool

	// deadline is when the wire's own timer on an open connection runs
	// out (zero: it has none); advance runs it once due.
	deadline() time.Time
	advance(now time.Time)

	// What the wire has words for (see Dialect): a ConnectAck ending the
	// client's handshake, a refusal of a ConnectSyn, a FlowControlRequest
	// sent (the C++ wire has none of them).
	hasConnectAck() bool
	hasRefusal() bool
	sendsFlowControl() bool
}

var (
	_ wire = (*specWire)(nil)
	_ wire = (*cppWire)(nil)
)
