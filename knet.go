// Package knet implements the kNet transport over UDP: connections with
// reliable and unreliable messages, ordering expressed as dependencies
// between messages, fragmented transfers of large messages, and flow
// control, all on one UDP socket per listener.
//
// # Usage
//
// A server listens and accepts connections; a client dials one:
//
//	l, err := knet.Listen("udp", ":7000", nil)
//	...
//	c, err := l.AcceptConn(ctx)
//	m, err := c.Receive(ctx)
//	err = c.Send(knet.Message{ID: m.ID, Payload: m.Payload, Reliable: true})
//
//	c, err := knet.Dial(ctx, "udp", "server:7000", nil)
//
// A Conn speaks messages (Send, Receive) and is also a net.Conn whose
// Read and Write carry a byte stream as reliable in-order messages.
//
// # Concurrency
//
// Every method of Conn and Listener is safe for concurrent use. One
// goroutine at a time runs a Conn's protocol state: one of its socket's
// workers, which send many connections' datagrams in each system call,
// the socket's reader, or for a dialed Conn the caller of Send. Each
// socket has a reader that hands each datagram to its connection without
// ever waiting on it. Send copies the payload before it returns.
//
// # Deadlines
//
// Read and Receive honour the read deadline and Write and Send the write
// deadline, as net.Conn describes: past the deadline they fail with an error
// wrapping os.ErrDeadlineExceeded whose Timeout method reports true. Receive
// and SendContext also stop when their context is done.
package knet

import (
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
)

// Message is one application message.
type Message struct {
	// ID is the application's message ID, MinMessageID (6) to
	// MaxMessageID (0x3FFFFFFA); Send refuses the others, which the
	// protocol reserves.
	ID uint32
	// Payload is the message content. Send copies it; Receive returns a
	// slice the caller owns.
	Payload []byte
	// Reliable messages are delivered exactly once, resent until acked.
	// Unreliable ones are sent once and may be lost. An unreliable
	// message too large for one datagram travels as a reliable
	// fragmented transfer (the protocol requires it).
	Reliable bool
	// InOrder orders the message after the earlier InOrder messages of
	// the same Channel: a reliable one after the earlier reliable ones
	// (exactly once, in send order); an unreliable one after every earlier
	// one, which makes the channel sequenced (never an older message after
	// a newer one). Channels never hold each other up. On receipt,
	// InOrder reports whether the message carried a dependency on the wire.
	InOrder bool
	// Channel selects the ordering channel of an InOrder message, 0-255.
	// It is not sent on the wire, so a received message reports 0.
	Channel uint8
	// Priority lets a message leave the send queue before queued messages
	// of lower priority. Dependencies still hold: a message never leaves
	// before one it depends on, which is raised to its priority. Not
	// sent on the wire.
	Priority int8
	// ContentID, when not zero on an unreliable message, marks it as an
	// update of the state named by (ID, ContentID): latest state wins. It
	// replaces a queued, unsent message with the same pair; the receiver
	// delivers it as soon as it arrives, without waiting for an earlier
	// version still missing, and drops an earlier version that arrives
	// after it. Not sent on the wire as such: each update names the
	// earlier ones sent in the last quarter second or so, up to eight (3
	// bytes each). An earlier version held back on the path is dropped
	// when it comes unless it is later than that, or the eight versions
	// after it, which name it, all came later still or never. An update
	// too large for one datagram travels reliably, and the wire does not
	// let it name unreliable ones: an earlier small update delayed on
	// the path past the whole transfer can still arrive after it; a
	// small update after it leaves once it is acked.
	//
	// On a reliable message (not InOrder, no DependsOn), ContentID makes
	// it reliable latest state (in the reference dialect, only a newer
	// version replacing one still queued): the newest
	// version of the state is delivered exactly once unless a newer one
	// replaces it, an older version is never delivered after a newer
	// one, and a version replaced is not sent again, queued or lost on
	// the way. It is carried on the wire in a tag that knet reads and
	// other receivers ignore. See docs/delivery.md, "Reliable latest state".
	ContentID uint32
	// DependsOn lists earlier messages, sent with SendRef on the same
	// Conn, that must be applied before this one: a dependency graph
	// beyond channels. At most MaxDependencies entries. A reliable
	// message may not depend on an unreliable one. An unreliable message
	// that names a reliable one leaves once that one is acked, so that it
	// never arrives first (it may still be lost); one that names an
	// unreliable one arrives after it, or without it if that one is lost.
	DependsOn []Ref
}

// MaxDependencies is the most entries Message.DependsOn may hold.
const MaxDependencies = 16

// Ref names a message sent with SendRef, for later messages' DependsOn on
// the same Conn: it carries a tag of its connection, and a Ref of another
// connection fails Send with ErrBadDependency. The zero Ref names nothing.
type Ref uint64

// A Ref is, from the top, the 24-bit tag of its connection (never 0), the
// 39-bit count of the connection's messages sent before it plus one, and
// the reliable bit. The tags come from one counter, so that two
// connections share one only after 2^24-1 connections made in between.
const (
	refTagShift = 40
	refSeqMask  = 1<<(refTagShift-1) - 1
)

// connTags numbers connections for their Refs (newRefTag).
var connTags atomic.Uint32

// newRefTag is the tag of a new connection's Refs: 1..2^24-1.
func newRefTag() uint64 {
	for {
		if t := uint64(connTags.Add(1)) & (1<<(64-refTagShift) - 1); t != 0 {
			return t
		}
	}
}

// reliable reports whether r names a reliable message.
func (r Ref) reliable() bool { return r&1 != 0 }

// tag is the tag of r's connection.
func (r Ref) tag() uint64 { return uint64(r) >> refTagShift }

// seq is r's count among its connection's messages (from 1).
func (r Ref) seq() uint64 { return uint64(r) >> 1 & refSeqMask }

// StreamMessageID is the message ID that Write sends with, and the only
// one whose payloads Read returns; Receive returns messages of every ID.
const StreamMessageID = MaxMessageID

// A RefusedError is Dial's error when the server refused the connection
// and said why: the text of the error its Admit hook returned. It matches
// ErrRefused with errors.Is.
type RefusedError struct {
	Reason string
}

func (e *RefusedError) Error() string     { return ErrRefused.Error() + ": " + e.Reason }
func (e *RefusedError) Is(err error) bool { return err == ErrRefused }

// A DisconnectError is how a connection ended when the peer closed it
// with a reason or a code (CloseWithReason, CloseWithError): Err, and
// Send once the peer closed, return it; it matches ErrPeerClosed and
// net.ErrClosed with errors.Is.
type DisconnectError struct {
	// Code is the peer's CloseWithError code: the application's, for a
	// program to branch on (a kick, a ban, a drain, a full server). It is
	// 0 after CloseWithReason, and from a peer that cannot send one (one
	// that speaks only the specification, or the reference dialect).
	Code   uint32
	Reason string
}

func (e *DisconnectError) Error() string {
	if e.Code != 0 {
		return ErrPeerClosed.Error() + ": code " + strconv.FormatUint(uint64(e.Code), 10) + ": " + e.Reason
	}
	return ErrPeerClosed.Error() + ": " + e.Reason
}
func (e *DisconnectError) Is(err error) bool {
	return err == ErrPeerClosed || err == net.ErrClosed
}

// errServerFull refuses a connection the accept backlog has no room for.
var errServerFull = errors.New("knet: server full")

// MaxReasonLength is the longest refusal or close reason sent, in bytes;
// a longer one is cut.
const MaxReasonLength = 256

// reasonBytes is r as sent on the wire: at most MaxReasonLength bytes, cut at
// a rune boundary.
func reasonBytes(r string) []byte {
	if len(r) > MaxReasonLength {
		r = strings.ToValidUTF8(r[:MaxReasonLength], "")
	}
	return []byte(r)
}

// refusedErr is the error of a refusal that said reason (empty: none).
func refusedErr(reason []byte) error {
	if len(reason) == 0 {
		return ErrRefused
	}
	return &RefusedError{Reason: string(reason)}
}

var (
	// ErrRefused is returned by Dial when the server refused the
	// connection (responsive mode).
	ErrRefused = errors.New("knet: connection refused")
	// ErrPeerClosed is returned by Send once the peer has closed the
	// connection.
	ErrPeerClosed = fmt.Errorf("knet: connection closed by peer: %w", net.ErrClosed)
	// ErrMessageTooLarge is returned by Send for a payload above
	// MaxMessageSize.
	ErrMessageTooLarge = errors.New("knet: message larger than MaxMessageSize")
	// ErrReservedID is returned by Send for an ID outside
	// MinMessageID..MaxMessageID.
	ErrReservedID = errors.New("knet: message ID reserved by the protocol")
	// ErrBadDependency is returned by Send for a DependsOn that names a
	// message not sent before on this Conn (a Ref of another Conn
	// included), names an unreliable message from a reliable one, or has
	// more than MaxDependencies entries, and reported by Broadcast for a
	// message with any DependsOn.
	ErrBadDependency = errors.New("knet: bad message dependency")
	// ErrHandshakeTooLarge is returned by Dial for a
	// Config.ConnectPayload longer than a ConnectSyn carries
	// (MaxDatagramSize-104 bytes, at most 2035). A server whose Admit
	// replies with that much refuses the attempt instead.
	ErrHandshakeTooLarge = errors.New("knet: handshake payload too large")
	// ErrPortUnreachable fails Dial, and ends a dialed connection, when
	// the system keeps reporting that nothing listens at the peer's
	// address: an ICMP port unreachable, which a connected UDP socket
	// reads as ECONNREFUSED. errors.Is(err, syscall.ECONNREFUSED) holds
	// as well. Dial fails with it after two refused ConnectSyns in a row
	// (about 200ms) instead of waiting out ConnectTimeout; an open
	// connection ends after three reports with nothing heard from the
	// peer in between, and then also matches net.ErrClosed. Systems that
	// do not report it (Windows) leave it to the timeouts.
	ErrPortUnreachable = fmt.Errorf("knet: nothing listening at the peer's port: %w", errConnRefused)
	// ErrRetransmitLimit ends a connection whose reliable datagram went
	// unacked after MaxMessageSendCount sends.
	ErrRetransmitLimit = fmt.Errorf("knet: reliable datagram unacked after MaxMessageSendCount sends: %w", net.ErrClosed)
)

// errUnreachableClosed ends an open connection for ErrPortUnreachable.
var errUnreachableClosed = fmt.Errorf("%w: %w", ErrPortUnreachable, net.ErrClosed)

// errNilContext is what the methods taking a context return for a nil one.
var errNilContext = errors.New("knet: nil context")

// TimeoutError ends a connection whose peer stayed silent for
// ConnectionLostTimeout, a handshake that took longer than ConnectTimeout,
// or a graceful close that got no DisconnectAck within DisconnectTimeout
// (Close and CloseWithReason then return it, as Err does; Op is
// "disconnect"); Query and Reflect return one (Reflect's wrapped, naming
// the server) when no answer came.
type TimeoutError struct {
	Silent time.Duration
	Op     string // "connect", "disconnect", "query" (Query), "reflect" (Reflect, Listener.Reflect), "relay" (DialCandidates: the relay never answered), "frame" (a stream's frame neither whole nor 4 KiB further within the lost timeout), "resume" (an established connection suspended for ResumeTimeout without hearing its peer) or "" for an established connection
}

func (e *TimeoutError) Error() string {
	switch e.Op {
	case "connect":
		return "knet: no answer to the connection attempt within " + e.Silent.String()
	case "disconnect":
		return "knet: no DisconnectAck within " + e.Silent.String()
	case "query":
		return "knet: no answer to the server query within " + e.Silent.String()
	case "reflect":
		return "knet: no answer from the reflector (address discovery) within " + e.Silent.String()
	case "resume":
		return "knet: peer silent for " + e.Silent.String() + ", not back within ResumeTimeout"
	case "relay":
		return "knet: no answer from the relay within " + e.Silent.String()
	case "frame":
		return "knet: a frame neither whole nor 4 KiB further after " + e.Silent.String() + " (ConnectionLostTimeout)"
	}
	return "knet: peer silent for " + e.Silent.String()
}
func (e *TimeoutError) Timeout() bool   { return true }
func (e *TimeoutError) Temporary() bool { return false }

// Unwrap makes errors.Is(err, net.ErrClosed) hold for a lost connection,
// and errors.Is(err, os.ErrDeadlineExceeded) for a handshake, query or
// reflection timeout.
func (e *TimeoutError) Unwrap() error {
	if e.Op == "connect" || e.Op == "query" || e.Op == "reflect" || e.Op == "relay" {
		return errDeadline
	}
	return net.ErrClosed
}

// PathMTUError ends a connection whose path stopped carrying datagrams of
// MaxDatagramSize (the base size, 1200 bytes by default in the
// specification's dialect: every real path carries it, RFC 9000 §14) while
// smaller ones still got through: Probes padded probes of Size bytes were
// lost in a row, each followed by a smaller datagram that was answered, and
// no datagram of Size bytes or more was acknowledged meanwhile. Largest is
// the largest datagram the peer acknowledged or answered since (0: none).
// Sizes are UDP payloads, sealing included. A connection over such a path
// needs a smaller MaxDatagramSize on both ends.
type PathMTUError struct {
	Size    int // the base datagram size the path no longer carries
	Largest int // the largest datagram that got through since
	Probes  int // probes of Size lost
}

func (e *PathMTUError) Error() string {
	return fmt.Sprintf("knet: the path does not carry %d-byte datagrams (MaxDatagramSize): %d probes of %d bytes lost while datagrams of up to %d bytes got through",
		e.Size, e.Probes, e.Size, e.Largest)
}

// Unwrap makes errors.Is(err, net.ErrClosed) hold.
func (e *PathMTUError) Unwrap() error { return net.ErrClosed }

// ProtocolError ends a connection whose peer broke the protocol in a way
// that could make us hold unbounded state, such as a fragmented transfer
// announcing more than MaxMessageSize, or send more than the path
// carries: an ack of a PacketID never sent, which only a peer acking
// what it did not receive sends (knet skips a PacketID now and then, at
// random, to catch one).
type ProtocolError struct{ Err error }

func (e *ProtocolError) Error() string { return "knet: peer broke the protocol: " + e.Err.Error() }
func (e *ProtocolError) Unwrap() error { return e.Err }
