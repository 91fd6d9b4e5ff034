package knet

import (
	"encoding/hex"
	"strconv"
	"strings"
)

// DescribeDatagram returns a human-readable decode of one kNet datagram
// (a UDP payload) in dialect d, for tracing and debugging a peer: its
// header, then each message block, separated by "; ". For example
//
//	spec PacketID=109 reliable, 11 bytes: ID=6 len=5 "hello"
//	spec PacketID=3, 10 bytes: PacketAck acks=7-9,12
//	reference PacketID=4 reliable relbase=0, 12 bytes: ID=11 len=5 "hello" rel=0
//
// Dependencies are written PacketID#index: the datagram a message
// depends on and the message's index in it. Fragments name their
// TransferID and FragmentNumber (or FragmentCount for the first), and the
// protocol's reserved IDs are named (PingRequest, PacketAck, ConnectSyn...)
// with their fields decoded. A malformed datagram is described up to the
// block that breaks it, followed by "malformed: " and the reason, as the
// receiving knet would refuse it.
//
// DialectAuto guesses: 8 zero bytes are the reference dialect's
// connection opening, anything else is tried in the specification's
// dialect first, then in the reference's; the description starts with the
// dialect it was read in. DescribeDatagram never panics and does not keep
// or change b.
func DescribeDatagram(b []byte, d Dialect) string {
	switch d {
	case DialectSpec:
		s, _ := describeSpec(b)
		if isCppOpening(b) {
			s += " (8 zero bytes: the reference dialect's connection opening)"
		}
		return s
	case DialectReference:
		if isCppOpening(b) {
			return describeCppOpening
		}
		s, _ := describeCpp(b)
		return s
	}
	if isCppOpening(b) {
		return describeCppOpening
	}
	s, ok := describeSpec(b)
	if ok {
		return s
	}
	r, rok := describeCpp(b)
	if rok {
		return r
	}
	return "invalid in both dialects: " + s + " | " + r
}

const describeCppOpening = "reference opening, 8 bytes: a connection attempt (8 zero bytes)"

// describeSpec describes b in the specification's dialect and reports
// whether it is a valid datagram.
func describeSpec(b []byte) (string, bool) {
	var sb strings.Builder
	var h header
	sb.WriteString("spec")
	// The header alone first, so that a datagram whose first block is
	// malformed still shows it.
	if _, err := parseHeader(b, &h); err != nil {
		sb.WriteString(", " + strconv.Itoa(len(b)) + " bytes: malformed: " + err.Error())
		return sb.String(), false
	}
	sb.WriteString(" PacketID=" + strconv.FormatUint(uint64(h.packetID), 10))
	if h.reliable {
		sb.WriteString(" reliable")
	}
	if h.inOrder {
		sb.WriteString(" inorder deps=[")
		for i := range h.deltas {
			if i > 0 {
				sb.WriteByte(' ')
			}
			sb.WriteString(depName(&h, i))
		}
		sb.WriteByte(']')
	}
	sb.WriteString(", " + strconv.Itoa(len(b)) + " bytes:")
	n := 0
	err := scanDatagram(b, &h, func(m message) {
		if n > 0 {
			sb.WriteByte(';')
		}
		n++
		sb.WriteByte(' ')
		describeSpecMessage(&sb, &h, &m)
	})
	if n == 0 && err == nil {
		sb.WriteString(" no messages")
	}
	if err != nil {
		if n > 0 {
			sb.WriteByte(';')
		}
		sb.WriteString(" malformed: " + err.Error())
		return sb.String(), false
	}
	return sb.String(), true
}

// depName names dependency entry i of h as PacketID#index.
func depName(h *header, i int) string {
	if i < 0 || i >= len(h.deltas) || i >= len(h.indices) {
		return "?"
	}
	pid := (h.packetID - uint32(h.deltas[i]) - 1) & packetIDMask
	return strconv.FormatUint(uint64(pid), 10) + "#" + strconv.Itoa(int(h.indices[i]))
}

func describeSpecMessage(sb *strings.Builder, h *header, m *message) {
	describeFragment(sb, m.fragStart, m.fragment, m.transferID, m.fragCount, m.fragNumber)
	if m.hasID() {
		describeID(sb, m.id, m.payload, m.fragment, parsePacketAck)
	} else {
		sb.WriteString(" len=" + strconv.Itoa(len(m.payload)))
	}
	var entries []int
	switch m.order {
	case orderNone:
	case orderSingle:
		entries = append(entries, int(m.orderIndex))
	case orderMulti:
		for _, x := range m.orderMulti {
			entries = append(entries, int(x))
		}
	default:
		entries = append(entries, int(m.order)-1)
	}
	if m.order != orderNone {
		sb.WriteString(" after=[")
		for i, e := range entries {
			if i > 0 {
				sb.WriteByte(' ')
			}
			sb.WriteString(depName(h, e))
		}
		sb.WriteByte(']')
	}
}

// describeFragment writes the fragment fields of a block, if it is one,
// followed by a space; otherwise nothing.
func describeFragment(sb *strings.Builder, start, frag bool, transfer uint8, count, number uint32) {
	switch {
	case start:
		sb.WriteString("fragment start transfer=" + strconv.Itoa(int(transfer)) +
			" count=" + strconv.FormatUint(uint64(count), 10) + " ")
	case frag:
		sb.WriteString("fragment transfer=" + strconv.Itoa(int(transfer)) +
			" number=" + strconv.FormatUint(uint64(number), 10))
	}
}

// describeID writes a message's ID, named if reserved, and its content:
// the fields of a reserved message, or the length and a preview of the
// payload. A fragment's payload is only part of the message: it is not
// decoded as a reserved message's content.
func describeID(sb *strings.Builder, id uint32, p []byte, fragment bool, ack func([]byte) (packetAck, bool)) {
	if q, ok := describeQuery(p); ok && id == idPadding && !fragment {
		sb.WriteString(reservedName(id) + q) // a server query (query.go)
		return
	}
	name := reservedName(id)
	if name == "" || fragment {
		sb.WriteString("ID=" + strconv.FormatUint(uint64(id), 10))
		if name != "" {
			sb.WriteString(" (" + name + ")")
		}
		sb.WriteString(" len=" + strconv.Itoa(len(p)))
		if !fragment {
			sb.WriteString(" " + preview(p))
		}
		return
	}
	sb.WriteString(name)
	switch id {
	case idPingRequest, idPingReply:
		if len(p) == 1 {
			sb.WriteString(" ping=" + strconv.Itoa(int(p[0])))
			return
		}
	case idFlowControlRequest:
		if len(p) == 2 {
			sb.WriteString(" rate=" + strconv.Itoa(int(p[0])|int(p[1])<<8))
			return
		}
	case idPacketAck:
		if a, ok := ack(p); ok {
			sb.WriteString(" acks=" + ackRanges(a))
			return
		}
		sb.WriteString(" (malformed)")
	case idPadding:
		if len(p) == 1 && p[0] == extAckRequest {
			sb.WriteString(" ack-request")
			return
		}
		if len(p) == 1 && p[0] == extDrain {
			sb.WriteString(" drain-notice")
			return
		}
		if code, ok := parseCloseCode(&message{id: idExt, payload: p}); ok {
			sb.WriteString(" close-code=" + strconv.FormatUint(uint64(code), 10))
			return
		}
		if len(p) > 0 {
			sb.WriteString(" len=" + strconv.Itoa(len(p)))
		}
		return
	default:
		if len(p) == 0 {
			return
		}
	}
	sb.WriteString(" len=" + strconv.Itoa(len(p)) + " " + preview(p))
}

// describeQuery describes the content of a message of ID 5 that is a
// server query or its answer (query.go): its kind, nonce and size, or
// info.
func describeQuery(p []byte) (string, bool) {
	if len(p) < len(queryMagic)+2+queryNonceSize || string(p[:len(queryMagic)]) != queryMagic || p[len(queryMagic)] != queryVersion {
		return "", false
	}
	nonce := hex.EncodeToString(p[len(queryMagic)+2 : len(queryMagic)+2+queryNonceSize])
	rest := p[len(queryMagic)+2+queryNonceSize:]
	switch p[len(queryMagic)+1] {
	case queryKindQuery:
		return " server query nonce=" + nonce + " padding=" + strconv.Itoa(len(rest)), true
	case queryKindAnswer:
		return " query answer nonce=" + nonce + " info len=" + strconv.Itoa(len(rest)) + " " + preview(rest), true
	case reflectKindAsk:
		return " reflection ask nonce=" + nonce + " padding=" + strconv.Itoa(len(rest)), true
	case reflectKindAnswer:
		return " reflection answer nonce=" + nonce + " len=" + strconv.Itoa(len(rest)), true
	case punchKindProbe:
		return " punch probe token=" + nonce + " padding=" + strconv.Itoa(len(rest)), true
	case punchKindAnswer:
		return " punch answer token=" + nonce, true
	case introKindAsk:
		return " introduction ask nonce=" + nonce + " len=" + strconv.Itoa(len(rest)), true
	case introKindAnswer:
		return " introduction nonce=" + nonce + " len=" + strconv.Itoa(len(rest)), true
	case relayKindBind:
		return " relay bind nonce=" + nonce + " len=" + strconv.Itoa(len(rest)), true
	case relayKindBound:
		return " relay answer nonce=" + nonce + " len=" + strconv.Itoa(len(rest)), true
	}
	return "", false
}

// reservedName names a reserved message ID, or returns "" for an
// application's.
func reservedName(id uint32) string {
	switch id {
	case 0:
		return "reserved"
	case idPadding:
		return "Padding"
	case idPingRequest:
		return "PingRequest"
	case idPingReply:
		return "PingReply"
	case idFlowControlRequest:
		return "FlowControlRequest"
	case idPacketAck:
		return "PacketAck"
	case idConnectAck:
		return "ConnectAck"
	case idConnectSynAck:
		return "ConnectSynAck"
	case idConnectSyn:
		return "ConnectSyn"
	case idDisconnectAck:
		return "DisconnectAck"
	case idDisconnect:
		return "Disconnect"
	}
	if id > MaxMessageID {
		return "reserved"
	}
	return ""
}

// ackRanges lists the PacketIDs a acks, runs written first-last.
func ackRanges(a packetAck) string {
	var sb strings.Builder
	first, last, have := uint32(0), uint32(0), false
	flush := func() {
		if !have {
			return
		}
		if sb.Len() > 0 {
			sb.WriteByte(',')
		}
		sb.WriteString(strconv.FormatUint(uint64(first), 10))
		if last != first {
			sb.WriteString("-" + strconv.FormatUint(uint64(last), 10))
		}
	}
	a.each(func(id uint32) {
		if have && id == (last+1)&packetIDMask {
			last = id
			return
		}
		flush()
		first, last, have = id, id, true
	})
	flush()
	return sb.String()
}

// previewLen is how many payload bytes a description shows.
const previewLen = 24

// preview shows the start of a payload: quoted when it is printable
// text, in hex otherwise.
func preview(p []byte) string {
	if len(p) == 0 {
		return `""`
	}
	cut := p[:min(len(p), previewLen)]
	more := ""
	if len(p) > len(cut) {
		more = "..."
	}
	for _, c := range cut {
		if c < 0x20 && c != '\t' && c != '\n' && c != '\r' || c >= 0x7f {
			return "hex:" + hex.EncodeToString(cut) + more
		}
	}
	return strconv.Quote(string(cut)) + more
}

// describeCpp describes b in the reference dialect and reports whether it
// is a valid datagram.
func describeCpp(b []byte) (string, bool) {
	var sb strings.Builder
	sb.WriteString("reference")
	var d cppDatagram
	if _, err := parseCppHeader(b, &d.cppHeader); err != nil {
		sb.WriteString(", " + strconv.Itoa(len(b)) + " bytes: malformed: " + err.Error())
		return sb.String(), false
	}
	err := parseCppInto(b, &d)
	sb.WriteString(" PacketID=" + strconv.FormatUint(uint64(d.packetID), 10))
	if d.reliable {
		sb.WriteString(" reliable")
	}
	if d.inOrder {
		sb.WriteString(" inorder")
	}
	if d.reliable {
		sb.WriteString(" relbase=" + strconv.FormatUint(uint64(d.relBase), 10))
	}
	sb.WriteString(", " + strconv.Itoa(len(b)) + " bytes:")
	for i := range d.msgs {
		m := &d.msgs[i]
		if i > 0 {
			sb.WriteByte(';')
		}
		sb.WriteByte(' ')
		describeFragment(&sb, m.fragStart, m.fragment, m.transferID, m.fragCount, m.fragNumber)
		if m.hasID() {
			describeID(&sb, m.id, m.payload, m.fragment, parseCppPacketAck)
		} else {
			sb.WriteString(" len=" + strconv.Itoa(len(m.payload)))
		}
		if m.reliable {
			sb.WriteString(" rel=" + strconv.FormatUint(uint64(m.relNum), 10))
		}
		if m.inOrder {
			sb.WriteString(" inorder")
		}
	}
	if len(d.msgs) == 0 && err == nil {
		sb.WriteString(" no messages")
	}
	if err != nil {
		if len(d.msgs) > 0 {
			sb.WriteByte(';')
		}
		sb.WriteString(" malformed: " + err.Error())
		return sb.String(), false
	}
	return sb.String(), true
}
