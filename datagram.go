package knet

import (
	"errors"
)

// Datagram header (spec "Datagram Byte Format", DECISIONS §3):
//
//	u24  bits 0-21 PacketID, bit 22 Reliable, bit 23 InOrder
//	[InOrder] u8 InOrderDeltaCount (IOD)
//	[InOrder] IOD x VLE-1.7/8 InOrderDeltaArray
//	[InOrder] IOD x VLE-1.7/8 InOrderDatagramIndexArray
//	message blocks until the end of the datagram

const (
	packetIDMask       = 1<<22 - 1
	headerFlagReliable = 1 << 22
	headerFlagInOrder  = 1 << 23
	minHeaderSize      = 3
	// maxDeps is the most dependency entries one datagram can carry: the
	// count is a u8 (spec "Sending ordered messages has the following
	// limitations", 1).
	maxDeps = 255
	// maxDepDelta is the largest PacketID delta a dependency can name (VLE-1.7/8).
	maxDepDelta = maxVLE16
)

var (
	errShortHeader   = errors.New("knet: datagram shorter than its header")
	errShortDeps     = errors.New("knet: datagram truncated in its InOrder arrays")
	errDepIndexRange = errors.New("knet: InOrder code names an entry beyond InOrderDeltaCount")
	errDepNoInOrder  = errors.New("knet: message has an InOrder code in a datagram without the InOrder flag")
)

// header is a parsed datagram header. When parsed, deltas and indices are
// stored in the header's own slices, reused from call to call.
type header struct {
	packetID uint32
	reliable bool
	inOrder  bool
	deltas   []uint16 // InOrderDeltaArray: depended datagram = packetID - delta - 1
	indices  []uint16 // InOrderDatagramIndexArray: message index in that datagram
}

// sizeHeader is the encoded size of h.
func sizeHeader(h *header) int {
	n := minHeaderSize
	if h.inOrder {
		n++
		for i := range h.deltas {
			n += sizeVLE16(h.deltas[i]) + sizeVLE16(h.indices[i])
		}
	}
	return n
}

// appendHeader appends the encoding of h. It panics if the dependency arrays
// are longer than maxDeps or of different lengths; callers build them so.
func appendHeader(b []byte, h *header) []byte {
	v := h.packetID & packetIDMask
	if h.reliable {
		v |= headerFlagReliable
	}
	if h.inOrder {
		v |= headerFlagInOrder
	}
	b = append(b, byte(v), byte(v>>8), byte(v>>16))
	if !h.inOrder {
		return b
	}
	if len(h.deltas) > maxDeps || len(h.deltas) != len(h.indices) {
		panic("knet: bad dependency arrays")
	}
	b = append(b, byte(len(h.deltas)))
	for _, d := range h.deltas {
		b = appendVLE16(b, d)
	}
	for _, x := range h.indices {
		b = appendVLE16(b, x)
	}
	return b
}

// parseHeader decodes the datagram header at the start of b into h, reusing
// h's slices, and returns its length. Nothing aliases b.
func parseHeader(b []byte, h *header) (n int, err error) {
	if len(b) < minHeaderSize {
		return 0, errShortHeader
	}
	// u24: bits 0-21 PacketID, bit 22 Reliable, bit 23 InOrder.
	v := uint32(b[0]) | uint32(b[1])<<8 | uint32(b[2])<<16
	h.packetID = v & packetIDMask
	h.reliable = v&headerFlagReliable != 0
	h.inOrder = v&headerFlagInOrder != 0
	h.deltas = h.deltas[:0]
	h.indices = h.indices[:0]
	n = minHeaderSize
	if !h.inOrder {
		return n, nil
	}
	// u8 InOrderDeltaCount.
	if len(b) < n+1 {
		return 0, errShortDeps
	}
	count := int(b[n])
	n++
	// Each entry takes at least two bytes; refuse a count the datagram
	// cannot hold before growing anything by it.
	if 2*count > len(b)-n {
		return 0, errShortDeps
	}
	// IOD x VLE-1.7/8 InOrderDeltaArray.
	for range count {
		d, k := consumeVLE16(b[n:])
		if k < 0 {
			return 0, errShortDeps
		}
		h.deltas = append(h.deltas, d)
		n += k
	}
	// IOD x VLE-1.7/8 InOrderDatagramIndexArray.
	for range count {
		x, k := consumeVLE16(b[n:])
		if k < 0 {
			return 0, errShortDeps
		}
		h.indices = append(h.indices, x)
		n += k
	}
	return n, nil
}

// datagram is a whole parsed datagram.
type datagram struct {
	header
	msgs []message
}

// appendDatagram appends the encoding of d.
func appendDatagram(b []byte, d *datagram) []byte {
	b = appendHeader(b, &d.header)
	for i := range d.msgs {
		b = appendMessage(b, &d.msgs[i])
	}
	return b
}

// parseDatagram decodes a whole datagram. Message payloads alias b.
func parseDatagram(b []byte) (d datagram, n int, err error) {
	if err := parseInto(b, &d); err != nil {
		return datagram{}, 0, err
	}
	return d, len(b), nil
}

// scanDatagram decodes the datagram b, its header into h, and hands each
// message block in turn to each, which must not keep it. A malformed block,
// a dependency the header does not carry, or a fragment in a datagram not
// reliable (spec "Fragmented Transfers", 3) makes the datagram an error as
// a whole, after each has seen the blocks before. Payloads alias b. This is
// the one parse loop: the session's, the listener's and the tests'.
func scanDatagram(b []byte, h *header, each func(m message)) error {
	n, err := parseHeader(b, h)
	if err != nil {
		return err
	}
	for n < len(b) {
		m, k, err := parseMessage(b[n:])
		if err == nil {
			err = checkOrder(h, &m)
		}
		if err == nil && m.fragment && !h.reliable {
			err = errUnreliableFragment
		}
		if err != nil {
			return err
		}
		each(m)
		n += k
	}
	return nil
}

// parseInto decodes a whole datagram into d, reusing its storage, as
// scanDatagram does (the same checks), each message parsed in its place in
// d.msgs. The message list grows in proportion to the bytes present (every
// block takes at least three), never to a count the peer announced.
func parseInto(b []byte, d *datagram) error {
	d.msgs = d.msgs[:0]
	h := &d.header
	n, err := parseHeader(b, h)
	if err != nil {
		return err
	}
	for n < len(b) {
		d.msgs = append(d.msgs, message{})
		m := &d.msgs[len(d.msgs)-1]
		k, err := parseMessageInto(b[n:], m)
		if err == nil && m.order != orderNone {
			err = checkOrder(h, m)
		}
		if err == nil && m.fragment && !h.reliable {
			err = errUnreliableFragment
		}
		if err != nil {
			return err
		}
		n += k
	}
	return nil
}

// has reports whether d holds a whole message with the given ID.
func (d *datagram) has(id uint32) bool {
	for i := range d.msgs {
		if m := &d.msgs[i]; !m.fragment && m.id == id {
			return true
		}
	}
	return false
}

// holds reports whether b is a valid datagram, and whether it holds a whole
// message with the given ID, without keeping its messages.
func holds(b []byte, id uint32) (found, valid bool) {
	var h header
	err := scanDatagram(b, &h, func(m message) { found = found || !m.fragment && m.id == id })
	return found && err == nil, err == nil
}

var errUnreliableFragment = errors.New("knet: fragment in an unreliable datagram")

// checkOrder reports whether m's InOrder code names only entries that the
// datagram header carries (spec "InOrderCode field interpretation").
func checkOrder(h *header, m *message) error {
	if m.order == orderNone {
		return nil
	}
	if !h.inOrder {
		return errDepNoInOrder
	}
	count := len(h.deltas)
	switch m.order {
	case orderSingle:
		if int(m.orderIndex) >= count {
			return errDepIndexRange
		}
	case orderMulti:
		for _, x := range m.orderMulti {
			if int(x) >= count {
				return errDepIndexRange
			}
		}
	default: // codes 1-5 name entry code-1
		if int(m.order)-1 >= count {
			return errDepIndexRange
		}
	}
	return nil
}

// seqLess reports whether PacketID a comes before b in 22-bit serial-number
// arithmetic (DECISIONS §4).
func seqLess(a, b uint32) bool {
	d := (b - a) & packetIDMask
	return d != 0 && d < 1<<21
}

// seqDiff is b - a in 22-bit serial-number arithmetic, in -2^21 .. 2^21-1.
func seqDiff(a, b uint32) int32 {
	d := int32((b - a) & packetIDMask)
	if d >= 1<<21 {
		d -= 1 << 22
	}
	return d
}
