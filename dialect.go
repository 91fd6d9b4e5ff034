package knet

import (
	"fmt"
	"strconv"
)

// Dialect is a kNet wire format. The specification's (DECISIONS.md) is
// what knet speaks by default; the C++ reference implementation, which
// existing kNet deployments run, speaks another (testdata/reference): a
// different datagram header, reliable message numbers instead of
// dependency arrays, a connection opened by 8 zero bytes instead of a
// handshake. knet speaks both, and serves both on one Listener.
//
// The reference wire cannot carry everything the API offers. Over it:
//
//   - Handshake payloads do not exist: Config.ConnectPayload is not sent,
//     Admit sees an empty payload and its reply is not sent, and
//     Handshake returns empty slices. A refused reference peer gets no
//     answer at all (there is no refusal message), so a Dial in the
//     reference dialect never fails with ErrRefused: it times out.
//   - In-order is a flag, not a dependency. A knet receiver delivers the
//     reliable in-order messages in the order they were sent (their
//     reliable message numbers), across all channels: what
//     Message.Channel and DependsOn ask for holds, and more. A message
//     with DependsOn goes with the InOrder bit. An unreliable message is
//     dropped if it comes from a datagram older than the last one that
//     brought an unreliable in-order message (which may name it: the wire
//     does not say), so an unreliable dependency never arrives after its
//     dependent. Received messages report Channel 0.
//   - DependsOn naming a reliable message the receiver may still hold (an
//     unreliable message naming a reliable one, or anything naming a
//     fragmented message sent without InOrder) is kept by the sender:
//     the message waits until what it names is acked.
//   - ContentID replaces a queued older state at the sender; on the wire
//     the states carry the InOrder bit, so an older unreliable state
//     arriving after a newer one is dropped and reliable ones come in
//     order. They arrive with InOrder set.
//   - FlowControlRequest is never sent (the reference does not send one,
//     and ignores it); one received is honoured.
//   - A fragmented message goes to the peer one datagram at a time, each
//     sent after the previous one is acked: the reference reassembles
//     fragments in the order they arrive, so any reordering or loss in
//     a window of them would corrupt its copy. That costs a round trip
//     per datagram of fragments; see docs/cpp-knet.md for measurements.
type Dialect uint8

const (
	DialectAuto      Dialect = iota // Listen: accept both, detected per peer from its first datagram; Dial: the spec's
	DialectSpec                     // the specification's wire (DECISIONS.md)
	DialectReference                // the C++ reference implementation's wire
)

func (d Dialect) String() string {
	switch d {
	case DialectAuto:
		return "auto"
	case DialectSpec:
		return "spec"
	case DialectReference:
		return "reference"
	}
	return "Dialect(" + strconv.Itoa(int(d)) + ")"
}

// MarshalText returns the dialect's name, as String does.
func (d Dialect) MarshalText() ([]byte, error) { return []byte(d.String()), nil }

// UnmarshalText reads a dialect's name: auto, spec or reference (ref
// too). With it a Dialect is a flag (flag.TextVar) or a configuration
// field in JSON or TOML.
func (d *Dialect) UnmarshalText(b []byte) error {
	switch string(b) {
	case "auto", "":
		*d = DialectAuto
	case "spec":
		*d = DialectSpec
	case "reference", "ref":
		*d = DialectReference
	default:
		return fmt.Errorf("knet: unknown dialect %q (auto, spec or reference)", b)
	}
	return nil
}
