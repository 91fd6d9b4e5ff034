package knet

import (
	"errors"
	"math/bits"
)

// Message block (spec "Message Block Format"):
//
//	u16  bit 15 FragmentStart, bit 14 Fragment, bits 11-13 InOrder code,
//	     bits 0-10 ContentLength
//	[InOrder=6] u8 SingleInOrderIndex
//	[InOrder=7] u8 MultiInOrderIndexCount (MIO), MIO x u8 MultiInOrderIndexArray
//	[FragmentStart] VLE-1.7/1.7/16 FragmentCount
//	[FragmentStart or Fragment] u8 TransferID
//	[Fragment, not FragmentStart] VLE-1.7/1.7/16 FragmentNumber
//	Content: ContentLength bytes
//
// Content block (spec "Content Block Format"):
//
//	[FragmentStart or not Fragment] VLE-1.7/1.7/16 MessageID
//	payload

// Reserved message IDs (DECISIONS §2).
const (
	idPath               = 0 // knet's extensions, in secure sessions only: path messages (migration.go), Retry (cookie.go)
	idPingRequest        = 1
	idPingReply          = 2
	idFlowControlRequest = 3
	idPacketAck          = 4
	idConnectAck         = 0x3FFFFFFB
	idConnectSynAck      = 0x3FFFFFFC
	idConnectSyn         = 0x3FFFFFFD
	idDisconnectAck      = 0x3FFFFFFE
	idDisconnect         = 0x3FFFFFFF
)

// MinMessageID and MaxMessageID bound the IDs an application may send;
// the others are reserved by the protocol.
const (
	MinMessageID = 6
	MaxMessageID = 0x3FFFFFFA
)

const (
	flagFragmentStart = 1 << 15
	flagFragment      = 1 << 14
	// maxContentLength is the largest Content block one message block can
	// carry (11 bits, DECISIONS §3).
	maxContentLength = 1<<11 - 1
	minMessageSize   = 2
)

// InOrder codes (spec "InOrderCode field interpretation").
const (
	orderNone   = 0 // no dependency
	orderSingle = 6 // one entry named by SingleInOrderIndex
	orderMulti  = 7 // entries named by MultiInOrderIndexArray
	// Codes 1-5 name entry code-1.
)

var (
	errShortMessage     = errors.New("knet: message block truncated")
	errContentOverflow  = errors.New("knet: ContentLength runs past the datagram")
	errMissingMessageID = errors.New("knet: content block too short for its MessageID")
)

// message is one message block. Payload and orderMulti alias the parsed
// bytes.
type message struct {
	id         uint32 // present when fragStart || !fragment
	payload    []byte
	order      uint8 // InOrder code, 0..7
	orderIndex uint8 // SingleInOrderIndex, for order 6
	orderMulti []byte
	fragStart  bool
	fragment   bool
	fragCount  uint32 // with fragStart
	transferID uint8  // with fragStart or fragment
	fragNumber uint32 // with fragment and not fragStart
}

// hasID reports whether the content block starts with a MessageID.
func (m *message) hasID() bool { return m.fragStart || !m.fragment }

// contentLength is the ContentLength field m encodes to.
func (m *message) contentLength() int {
	n := len(m.payload)
	if m.hasID() {
		n += sizeVLE32(m.id)
	}
	return n
}

// sizeMessageHeader is the encoded size of m less its payload.
func sizeMessageHeader(m *message) int {
	n := 2
	switch m.order {
	case orderSingle:
		n++
	case orderMulti:
		n += 1 + len(m.orderMulti)
	}
	if m.fragStart {
		n += sizeVLE32(m.fragCount)
	}
	if m.fragStart || m.fragment {
		n++
	}
	if m.fragment && !m.fragStart {
		n += sizeVLE32(m.fragNumber)
	}
	if m.hasID() {
		n += sizeVLE32(m.id)
	}
	return n
}

// sizeMessage is the encoded size of m.
func sizeMessage(m *message) int { return sizeMessageHeader(m) + len(m.payload) }

// appendMessage appends the encoding of m. It panics if the content block is
// longer than 2047 bytes, a field does not fit its encoding, or the InOrder
// code is out of range: the session builds messages within those limits.
func appendMessage(b []byte, m *message) []byte {
	cl := m.contentLength()
	if cl > maxContentLength || m.order > 7 || len(m.orderMulti) > 255 {
		panic("knet: message block does not fit its encoding")
	}
	h := uint16(cl) | uint16(m.order)<<11
	if m.fragStart {
		h |= flagFragmentStart | flagFragment
	} else if m.fragment {
		h |= flagFragment
	}
	b = append(b, byte(h), byte(h>>8))
	switch m.order {
	case orderSingle:
		b = append(b, m.orderIndex)
	case orderMulti:
		b = append(b, byte(len(m.orderMulti)))
		b = append(b, m.orderMulti...)
	}
	if m.fragStart {
		b = appendVLE32(b, m.fragCount)
	}
	if m.fragStart || m.fragment {
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

// parseMessage decodes the message block at the start of b. The payload and
// the MultiInOrderIndexArray alias b.
func parseMessage(b []byte) (m message, n int, err error) {
	if n, err = parseMessageInto(b, &m); err != nil {
		return message{}, 0, err
	}
	return m, n, nil
}

// parseMessageInto is parseMessage into m, which must be zero; on an error
// m is left part filled.
func parseMessageInto(b []byte, m *message) (n int, err error) {
	if len(b) < minMessageSize {
		return 0, errShortMessage
	}
	// u16: bit 15 FragmentStart, bit 14 Fragment, bits 11-13 InOrder, bits 0-10 ContentLength.
	h := uint16(b[0]) | uint16(b[1])<<8
	if cl := int(h); h&^maxContentLength == 0 && cl > 0 && len(b)-2 >= cl && b[2] < 0x80 {
		// Most blocks: no flag, no InOrder code, a one-byte MessageID.
		m.id = uint32(b[2])
		m.payload = b[3 : 2+cl : 2+cl]
		return 2 + cl, nil
	}
	m.fragStart = h&flagFragmentStart != 0
	// A FragmentStart is the first fragment, so it is a fragment too,
	// whether or not the sender set bit 14.
	m.fragment = h&flagFragment != 0 || m.fragStart
	m.order = uint8(h>>11) & 7
	cl := int(h & maxContentLength)
	n = 2
	switch m.order {
	case orderSingle:
		// u8 SingleInOrderIndex.
		if len(b) < n+1 {
			return 0, errShortMessage
		}
		m.orderIndex = b[n]
		n++
	case orderMulti:
		// u8 MultiInOrderIndexCount, then that many u8 indices.
		if len(b) < n+1 {
			return 0, errShortMessage
		}
		k := int(b[n])
		n++
		if len(b) < n+k {
			return 0, errShortMessage
		}
		m.orderMulti = b[n : n+k : n+k]
		n += k
	}
	if m.fragStart {
		// VLE-1.7/1.7/16 FragmentCount.
		v, k := consumeVLE32(b[n:])
		if k < 0 {
			return 0, errShortMessage
		}
		m.fragCount = v
		n += k
	}
	if m.fragment {
		// u8 TransferID.
		if len(b) < n+1 {
			return 0, errShortMessage
		}
		m.transferID = b[n]
		n++
	}
	if m.fragment && !m.fragStart {
		// VLE-1.7/1.7/16 FragmentNumber.
		v, k := consumeVLE32(b[n:])
		if k < 0 {
			return 0, errShortMessage
		}
		m.fragNumber = v
		n += k
	}
	// Content: ContentLength bytes.
	if len(b)-n < cl {
		return 0, errContentOverflow
	}
	content := b[n : n+cl : n+cl]
	n += cl
	if m.hasID() {
		// VLE-1.7/1.7/16 MessageID at the start of the content block.
		v, k := consumeVLE32(content)
		if k < 0 {
			return 0, errMissingMessageID
		}
		m.id = v
		content = content[k:]
	}
	m.payload = content
	return n, nil
}

// Reserved message contents.

// packetAck is the content of a PacketAck (DECISIONS §3): it acks base and,
// for each set bit k of more (k < 34), base+1+k.
type packetAck struct {
	base uint32
	more uint64
}

const (
	packetAckSize = 7
	packetAckSpan = 35 // datagrams one PacketAck can name
	packetAckBits = packetAckSpan - 1
)

// appendPacketAck appends the 7-byte PacketAck content: u24 whose bits 0-21
// are the base PacketID, bit 22 acks base+1 and bit 23 base+2; then a u32
// whose bit i acks base+3+i.
func appendPacketAck(b []byte, a packetAck) []byte {
	v := a.base&packetIDMask | uint32(a.more&3)<<22
	w := uint32(a.more >> 2)
	return append(b, byte(v), byte(v>>8), byte(v>>16), byte(w), byte(w>>8), byte(w>>16), byte(w>>24))
}

// parsePacketAck decodes a PacketAck content; it must be exactly 7 bytes.
func parsePacketAck(p []byte) (a packetAck, ok bool) {
	if len(p) != packetAckSize {
		return packetAck{}, false
	}
	v := uint32(p[0]) | uint32(p[1])<<8 | uint32(p[2])<<16
	w := uint32(p[3]) | uint32(p[4])<<8 | uint32(p[5])<<16 | uint32(p[6])<<24
	return packetAck{base: v & packetIDMask, more: uint64(v>>22) | uint64(w)<<2}, true
}

// names reports whether a acks id.
func (a packetAck) names(id uint32) bool {
	k := (id - a.base) & packetIDMask
	return k == 0 || k <= packetAckBits && a.more>>(k-1)&1 != 0
}

// last returns the newest PacketID a names.
func (a packetAck) last() uint32 {
	return (a.base + uint32(bits.Len64(a.more))) & packetIDMask
}

// each calls f for every PacketID a names, in increasing order.
func (a packetAck) each(f func(id uint32)) {
	f(a.base)
	for m, k := a.more, uint32(1); m != 0; m, k = m>>1, k+1 {
		if m&1 != 0 {
			f((a.base + k) & packetIDMask)
		}
	}
}
