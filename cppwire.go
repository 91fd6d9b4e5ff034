package knet

import "errors"

// The C++ reference implementation's wire (DialectReference), as its
// captures show it (testdata/reference/README.md): a second dialect beside
// the specification's. Little-endian throughout. Its names say cpp (the
// wire of the C++ kNet), as the spec's say nothing: "ref" in this package
// is a reference to a message (Ref, msgRef).
//
// Datagram:
//
//	byte 0      bit 7 InOrder, bit 6 Reliable, bits 0-5 PacketID bits 0-5
//	bytes 1-2   u16 PacketID bits 6-21
//	[Reliable]  VLE-1.15/16 ReliableMsgNumBase
//	messages    until the end of the datagram
//
// Message block:
//
//	u16         bit 15 FragmentStart, bit 14 Fragment (set on the first
//	            fragment too), bit 13 InOrder, bit 12 Reliable, bit 11
//	            zero, bits 0-10 ContentLength
//	[Reliable]  VLE-1.7/8 reliable number minus ReliableMsgNumBase
//	[FS]        VLE-1.7/1.7/16 FragmentCount
//	[FS or F]   u8 TransferID
//	[F, not FS] VLE-1.7/1.7/16 FragmentNumber
//	content     ContentLength bytes: [VLE-1.7/1.7/16 MessageID unless a
//	            fragment after the first] payload
//
// There are no dependency arrays: in-order is a flag. A client opens a
// connection with 8 zero bytes, which are no datagram (cppOpening).

const (
	cppFlagInOrder  = 0x80 // byte 0
	cppFlagReliable = 0x40
	cppHeaderSize   = 3

	cppMsgFragStart = 1 << 15
	cppMsgFragment  = 1 << 14
	cppMsgInOrder   = 1 << 13
	cppMsgReliable  = 1 << 12
	cppMsgReserved  = 1 << 11

	// maxRelNum is the largest reliable number VLE-1.15/16 carries.
	maxRelNum = 1<<31 - 1
	// cppAckBits is how many datagrams after its base one reference
	// PacketAck acks: u32, bit i acking base+1+i.
	cppAckBits = 32
)

// cppOpening is what a reference client sends first: 8 zero bytes, no
// kNet datagram, which a server takes for a connection attempt.
var cppOpening = [8]byte{}

// cppFragSize is the fragment payload the reference sends (README fact
// 16): knet sends no larger fragments to a reference peer.
const cppFragSize = 318

// isCppOpening reports whether b is the reference's connection opening.
func isCppOpening(b []byte) bool { return len(b) == len(cppOpening) && [8]byte(b) == cppOpening }

var (
	errCppShort     = errors.New("knet: reference datagram truncated")
	errCppReserved  = errors.New("knet: reference message block with its reserved bit set")
	errCppRelBase   = errors.New("knet: reliable message in a datagram without ReliableMsgNumBase")
	errCppRelNumber = errors.New("knet: reliable number out of range")
)

// cppHeader is a reference datagram header.
type cppHeader struct {
	packetID uint32
	reliable bool
	inOrder  bool
	relBase  uint32 // ReliableMsgNumBase, when reliable
}

// cppMessage is one reference message block. payload aliases the parsed
// bytes.
type cppMessage struct {
	inOrder, reliable   bool
	fragStart, fragment bool
	relNum              uint32 // when reliable
	fragCount           uint32 // with fragStart
	transferID          uint8  // with fragment
	fragNumber          uint32 // with fragment and not fragStart
	id                  uint32 // unless a fragment after the first
	payload             []byte
}

// hasID reports whether the content block starts with a MessageID.
func (m *cppMessage) hasID() bool { return m.fragStart || !m.fragment }

// appendVLE1516 appends v in VLE-1.15/16 form: a u16 below 32768, else
// u16 0x8000|v&0x7fff then u16 v>>15.
func appendVLE1516(b []byte, v uint32) []byte {
	if v < 1<<15 {
		return append(b, byte(v), byte(v>>8))
	}
	if v > maxRelNum {
		panic("knet: vle1516 overflow") // callers keep reliable numbers within range
	}
	lo := 0x8000 | v&0x7fff
	hi := v >> 15
	return append(b, byte(lo), byte(lo>>8), byte(hi), byte(hi>>8))
}

// consumeVLE1516 decodes a VLE-1.15/16 at the start of b; n < 0 means too
// short.
func consumeVLE1516(b []byte) (v uint32, n int) {
	if len(b) < 2 {
		return 0, -1
	}
	lo := uint32(b[0]) | uint32(b[1])<<8
	if lo < 0x8000 {
		return lo, 2
	}
	if len(b) < 4 {
		return 0, -1
	}
	return lo&0x7fff | (uint32(b[2])|uint32(b[3])<<8)<<15, 4
}

func sizeVLE1516(v uint32) int {
	if v < 1<<15 {
		return 2
	}
	return 4
}

// appendCppHeader appends the encoding of h.
func appendCppHeader(b []byte, h *cppHeader) []byte {
	b0 := byte(h.packetID & 0x3f)
	if h.inOrder {
		b0 |= cppFlagInOrder
	}
	if h.reliable {
		b0 |= cppFlagReliable
	}
	hi := (h.packetID & packetIDMask) >> 6
	b = append(b, b0, byte(hi), byte(hi>>8))
	if h.reliable {
		b = appendVLE1516(b, h.relBase)
	}
	return b
}

// parseCppHeader decodes a reference datagram header into h and returns
// its size.
func parseCppHeader(b []byte, h *cppHeader) (int, error) {
	if len(b) < cppHeaderSize {
		return 0, errCppShort
	}
	*h = cppHeader{
		packetID: uint32(b[0]&0x3f) | (uint32(b[1])|uint32(b[2])<<8)<<6,
		inOrder:  b[0]&cppFlagInOrder != 0,
		reliable: b[0]&cppFlagReliable != 0,
	}
	n := cppHeaderSize
	if h.reliable {
		v, k := consumeVLE1516(b[n:])
		if k < 0 {
			return 0, errCppShort
		}
		h.relBase = v
		n += k
	}
	return n, nil
}

// cppContentLength is the ContentLength m encodes to: the MessageID, when
// present, and the payload.
func cppContentLength(m *cppMessage) int {
	n := len(m.payload)
	if m.hasID() {
		n += sizeVLE32(m.id)
	}
	return n
}

// sizeCppMessage is the encoded size of m in a datagram whose
// ReliableMsgNumBase is base.
func sizeCppMessage(m *cppMessage, base uint32) int {
	n := 2 + cppContentLength(m)
	if m.reliable {
		n += sizeVLE16(uint16(min(m.relNum-base, maxVLE16)))
	}
	if m.fragStart {
		n += sizeVLE32(m.fragCount)
	}
	if m.fragment {
		n++
	}
	if m.fragment && !m.fragStart {
		n += sizeVLE32(m.fragNumber)
	}
	return n
}

// appendCppMessage appends the encoding of m in a datagram whose
// ReliableMsgNumBase is base. It panics if the content is longer than 2047
// bytes or the reliable number is not within 32767 above base: the
// session builds messages within those limits.
func appendCppMessage(b []byte, m *cppMessage, base uint32) []byte {
	cl := cppContentLength(m)
	if cl > maxContentLength || m.reliable && (m.relNum < base || m.relNum-base > maxVLE16) {
		panic("knet: reference message block does not fit its encoding")
	}
	h := uint16(cl)
	if m.fragStart {
		h |= cppMsgFragStart | cppMsgFragment
	} else if m.fragment {
		h |= cppMsgFragment
	}
	if m.inOrder {
		h |= cppMsgInOrder
	}
	if m.reliable {
		h |= cppMsgReliable
	}
	b = append(b, byte(h), byte(h>>8))
	if m.reliable {
		b = appendVLE16(b, uint16(m.relNum-base))
	}
	if m.fragStart {
		b = appendVLE32(b, m.fragCount)
	}
	if m.fragment {
		b = append(b, m.transferID)
	}
	if m.fragment && !m.fragStart {
		b = appendVLE32(b, m.fragNumber)
	}
	if m.hasID() {
		b = appendVLE32(b, m.id)
	}
	return append(b, m.payload...)
}

// parseCppMessage decodes one message block at the start of b, in a
// datagram with header h. The payload aliases b.
func parseCppMessage(b []byte, h *cppHeader) (m cppMessage, n int, err error) {
	if len(b) < 2 {
		return m, 0, errCppShort
	}
	hdr := uint16(b[0]) | uint16(b[1])<<8
	if hdr&cppMsgReserved != 0 {
		return m, 0, errCppReserved
	}
	m.fragStart = hdr&cppMsgFragStart != 0
	m.fragment = hdr&cppMsgFragment != 0 || m.fragStart
	m.inOrder = hdr&cppMsgInOrder != 0
	m.reliable = hdr&cppMsgReliable != 0
	cl := int(hdr & maxContentLength)
	n = 2
	if m.reliable {
		if !h.reliable {
			return m, 0, errCppRelBase
		}
		d, k := consumeVLE16(b[n:])
		if k < 0 {
			return m, 0, errCppShort
		}
		if uint64(h.relBase)+uint64(d) > maxRelNum {
			return m, 0, errCppRelNumber
		}
		m.relNum = h.relBase + uint32(d)
		n += k
	}
	if m.fragStart {
		v, k := consumeVLE32(b[n:])
		if k < 0 {
			return m, 0, errCppShort
		}
		m.fragCount = v
		n += k
	}
	if m.fragment {
		if n >= len(b) {
			return m, 0, errCppShort
		}
		m.transferID = b[n]
		n++
	}
	if m.fragment && !m.fragStart {
		v, k := consumeVLE32(b[n:])
		if k < 0 {
			return m, 0, errCppShort
		}
		m.fragNumber = v
		n += k
	}
	if len(b)-n < cl {
		return m, 0, errContentOverflow
	}
	content := b[n : n+cl]
	n += cl
	if m.hasID() {
		id, k := consumeVLE32(content)
		if k < 0 {
			return m, 0, errMissingMessageID
		}
		m.id = id
		content = content[k:]
	}
	m.payload = content
	return m, n, nil
}

// cppDatagram is a whole parsed reference datagram.
type cppDatagram struct {
	cppHeader
	msgs []cppMessage
}

// parseCppInto decodes a whole reference datagram into d, reusing its
// storage; a malformed block makes it an error as a whole. Payloads alias
// b; the message list grows with the bytes present, never with a count the
// peer announced.
func parseCppInto(b []byte, d *cppDatagram) error {
	d.msgs = d.msgs[:0]
	n, err := parseCppHeader(b, &d.cppHeader)
	if err != nil {
		return err
	}
	for n < len(b) {
		m, k, err := parseCppMessage(b[n:], &d.cppHeader)
		if err != nil {
			return err
		}
		d.msgs = append(d.msgs, m)
		n += k
	}
	return nil
}

// has reports whether the datagram holds a whole message with ID id.
func (d *cppDatagram) has(id uint32) bool {
	for i := range d.msgs {
		if m := &d.msgs[i]; !m.fragment && m.id == id {
			return true
		}
	}
	return false
}

// appendCppDatagram appends the encoding of d.
func appendCppDatagram(b []byte, d *cppDatagram) []byte {
	b = appendCppHeader(b, &d.cppHeader)
	for i := range d.msgs {
		b = appendCppMessage(b, &d.msgs[i], d.relBase)
	}
	return b
}

// The reference PacketAck (MessageID 4), 7 bytes: a u24 base PacketID
// (bits 22-23 zero) and a u32 whose bit i acks base+1+i: 33 datagrams.

// appendCppPacketAck appends the payload of a reference PacketAck.
func appendCppPacketAck(b []byte, a packetAck) []byte {
	base := a.base & packetIDMask
	m := uint32(a.more)
	return append(b, byte(base), byte(base>>8), byte(base>>16),
		byte(m), byte(m>>8), byte(m>>16), byte(m>>24))
}

// parseCppPacketAck decodes a reference PacketAck payload.
func parseCppPacketAck(p []byte) (packetAck, bool) {
	if len(p) != packetAckSize {
		return packetAck{}, false
	}
	base := (uint32(p[0]) | uint32(p[1])<<8 | uint32(p[2])<<16) & packetIDMask
	more := uint64(p[3]) | uint64(p[4])<<8 | uint64(p[5])<<16 | uint64(p[6])<<24
	return packetAck{base: base, more: more}, true
}
