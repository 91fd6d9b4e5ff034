package knet_test

// An end-to-end check of the reference dialect against a scripted peer that
// speaks only the C++ reference implementation's wire, as
// testdata/reference/README.md describes it byte by byte and as its
// captures show it. The codec below and the peer in
// referencepeer_e2e_test.go are written from that README alone; nothing
// here uses the library's own codec (cppwire.go), so the two can only
// agree by both following the captures.
//
// The peer behaves like the reference, with one deliberate difference: it
// resends unacked reliable messages after a short fixed timeout instead of
// the reference's 5s, so that the tests run fast. It also takes the
// reference receiver's defects as test failures: a fragment that arrives
// before its transfer's FragmentStart, or out of FragmentNumber order, is
// what breaks a reference receiver (README facts 18), so knet must never
// make it happen.

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Message IDs of the reference wire (README facts 2, 4, 6).
const (
	rpPingRequest        uint32 = 1
	rpPingReply          uint32 = 2
	rpFlowControlRequest uint32 = 3
	rpPacketAck          uint32 = 4
	rpConnectAck         uint32 = 0x3FFFFFFB // never on this wire
	rpConnectSyn         uint32 = 0x3FFFFFFD // never on this wire
	rpDisconnectAck      uint32 = 0x3FFFFFFE
	rpDisconnect         uint32 = 0x3FFFFFFF
)

// Field limits and sizes of the reference wire.
const (
	rpPIDMask     = 1<<22 - 1 // PacketID: 6 bits in byte 0, 16 in bytes 1-2
	rpMaxVLE8     = 1<<15 - 1 // VLE-1.7/8
	rpMaxVLE16    = 1<<31 - 1 // VLE-1.15/16
	rpMaxVLE32    = 1<<30 - 1 // VLE-1.7/1.7/16
	rpMaxContent  = 1<<11 - 1 // ContentLength: bits 0-10 of the message header
	rpAckSpan     = 32        // a PacketAck's bitmap covers base+1..base+32
	rpFragSize    = 318       // payload bytes per fragment (fact 16)
	rpMaxWhole    = 1368      // larger messages are fragmented (fact 16)
	rpMaxDatagram = 1400      // the packing budget (fact 17)
	rpOpeningSize = 8         // the client's first datagram: 8 zero bytes (fact 1)
)

// Datagram header bits (byte 0) and message header bits (u16).
const (
	rpDgInOrder   = 1 << 7
	rpDgReliable  = 1 << 6
	rpFragStart   = 1 << 15
	rpFragment    = 1 << 14
	rpMsgInOrder  = 1 << 13
	rpMsgReliable = 1 << 12
	rpMsgReserved = 1 << 11 // always 0
)

// ---- Codec, from testdata/reference/README.md ----

// rpAppendVLE8 appends v as VLE-1.7/8: 1 byte below 128, else 2.
func rpAppendVLE8(b []byte, v uint32) []byte {
	switch {
	case v > rpMaxVLE8:
		panic(fmt.Sprintf("refpeer: %d does not fit VLE-1.7/8", v))
	case v < 0x80:
		return append(b, byte(v))
	}
	return append(b, 0x80|byte(v&0x7f), byte(v>>7))
}

// rpAppendVLE16 appends v as VLE-1.15/16: a u16 below 32768, else u16
// 0x8000|v&0x7fff and u16 v>>15.
func rpAppendVLE16(b []byte, v uint32) []byte {
	switch {
	case v > rpMaxVLE16:
		panic(fmt.Sprintf("refpeer: %d does not fit VLE-1.15/16", v))
	case v < 0x8000:
		return binary.LittleEndian.AppendUint16(b, uint16(v))
	}
	b = binary.LittleEndian.AppendUint16(b, 0x8000|uint16(v&0x7fff))
	return binary.LittleEndian.AppendUint16(b, uint16(v>>15))
}

// rpAppendVLE32 appends v as VLE-1.7/1.7/16: 1 byte below 128, 2 below
// 16384, else 0x80|v&0x7f, 0x80|(v>>7)&0x7f and u16 v>>14.
func rpAppendVLE32(b []byte, v uint32) []byte {
	switch {
	case v > rpMaxVLE32:
		panic(fmt.Sprintf("refpeer: %d does not fit VLE-1.7/1.7/16", v))
	case v < 1<<7:
		return append(b, byte(v))
	case v < 1<<14:
		return append(b, 0x80|byte(v&0x7f), byte(v>>7))
	}
	b = append(b, 0x80|byte(v&0x7f), 0x80|byte(v>>7&0x7f))
	return binary.LittleEndian.AppendUint16(b, uint16(v>>14))
}

// rpConsumeVLE8 decodes a VLE-1.7/8 at the start of b. It takes only the
// shortest form, the one the reference writes, so that what it reads
// encodes back to the same bytes.
func rpConsumeVLE8(b []byte) (v uint32, n int, err error) {
	switch {
	case len(b) == 0:
		return 0, 0, errors.New("VLE-1.7/8: no bytes left")
	case b[0] < 0x80:
		return uint32(b[0]), 1, nil
	case len(b) < 2:
		return 0, 0, errors.New("VLE-1.7/8: truncated after 1 byte")
	case b[1] == 0:
		return 0, 0, fmt.Errorf("VLE-1.7/8: %x is not the shortest form", b[:2])
	}
	return uint32(b[0]&0x7f) | uint32(b[1])<<7, 2, nil
}

// rpConsumeVLE16 decodes a VLE-1.15/16 at the start of b, shortest form only.
func rpConsumeVLE16(b []byte) (v uint32, n int, err error) {
	if len(b) < 2 {
		return 0, 0, fmt.Errorf("VLE-1.15/16: %d bytes left, want 2", len(b))
	}
	lo := binary.LittleEndian.Uint16(b)
	if lo < 0x8000 {
		return uint32(lo), 2, nil
	}
	if len(b) < 4 {
		return 0, 0, fmt.Errorf("VLE-1.15/16: truncated after %d bytes", len(b))
	}
	hi := binary.LittleEndian.Uint16(b[2:])
	if hi == 0 {
		return 0, 0, fmt.Errorf("VLE-1.15/16: %x is not the shortest form", b[:4])
	}
	return uint32(lo&0x7fff) | uint32(hi)<<15, 4, nil
}

// rpConsumeVLE32 decodes a VLE-1.7/1.7/16 at the start of b, shortest form
// only.
func rpConsumeVLE32(b []byte) (v uint32, n int, err error) {
	switch {
	case len(b) == 0:
		return 0, 0, errors.New("VLE-1.7/1.7/16: no bytes left")
	case b[0] < 0x80:
		return uint32(b[0]), 1, nil
	case len(b) < 2:
		return 0, 0, errors.New("VLE-1.7/1.7/16: truncated after 1 byte")
	case b[1] < 0x80:
		if b[1] == 0 {
			return 0, 0, fmt.Errorf("VLE-1.7/1.7/16: %x is not the shortest form", b[:2])
		}
		return uint32(b[0]&0x7f) | uint32(b[1])<<7, 2, nil
	case len(b) < 4:
		return 0, 0, fmt.Errorf("VLE-1.7/1.7/16: truncated after %d bytes", len(b))
	}
	hi := binary.LittleEndian.Uint16(b[2:])
	if hi == 0 {
		return 0, 0, fmt.Errorf("VLE-1.7/1.7/16: %x is not the shortest form", b[:4])
	}
	return uint32(b[0]&0x7f) | uint32(b[1]&0x7f)<<7 | uint32(hi)<<14, 4, nil
}

// rpBlock is one message block. A parsed block's payload aliases the
// datagram.
type rpBlock struct {
	fragStart, frag   bool
	inOrder, reliable bool
	relDelta          uint32 // wire field, with reliable
	relNum            uint32 // ReliableMsgNumBase + relDelta, filled in by the parser
	fragCount         uint32 // with fragStart
	transferID        uint8  // with fragStart or frag
	fragNum           uint32 // with frag and not fragStart
	id                uint32 // with hasID
	payload           []byte // the content after the MessageID
}

// hasID reports whether the content starts with a MessageID: every block
// but a fragment other than the first.
func (m *rpBlock) hasID() bool { return m.fragStart || !m.frag }

// contentLength is the block's ContentLength: the MessageID and the payload.
func (m *rpBlock) contentLength() int {
	n := len(m.payload)
	if m.hasID() {
		n += len(rpAppendVLE32(nil, m.id))
	}
	return n
}

// rpDatagram is one datagram of the reference wire.
type rpDatagram struct {
	pid               uint32
	inOrder, reliable bool
	relBase           uint32 // ReliableMsgNumBase, with reliable
	blocks            []rpBlock
}

// rpAppendDatagram appends d as written, flags and fields taken as given:
//
//	byte 0      bit 7 InOrder, bit 6 Reliable, bits 0-5 PacketID bits 0-5
//	bytes 1-2   u16 PacketID bits 6-21
//	[Reliable]  VLE-1.15/16 ReliableMsgNumBase
//	messages    until the end
func rpAppendDatagram(b []byte, d *rpDatagram) []byte {
	if d.pid > rpPIDMask {
		panic(fmt.Sprintf("refpeer: PacketID %d beyond 22 bits", d.pid))
	}
	b0 := byte(d.pid & 0x3f)
	if d.inOrder {
		b0 |= rpDgInOrder
	}
	if d.reliable {
		b0 |= rpDgReliable
	}
	b = append(b, b0)
	b = binary.LittleEndian.AppendUint16(b, uint16(d.pid>>6))
	if d.reliable {
		b = rpAppendVLE16(b, d.relBase)
	}
	for i := range d.blocks {
		b = rpAppendBlock(b, &d.blocks[i])
	}
	return b
}

// rpAppendBlock appends one message block:
//
//	u16         bit 15 FragmentStart, bit 14 Fragment, bit 13 InOrder,
//	            bit 12 Reliable, bit 11 0, bits 0-10 ContentLength
//	[Reliable]  VLE-1.7/8 delta from ReliableMsgNumBase
//	[FS]        VLE-1.7/1.7/16 FragmentCount
//	[FS or F]   u8 TransferID
//	[F, not FS] VLE-1.7/1.7/16 FragmentNumber
//	Content     [VLE-1.7/1.7/16 MessageID] payload
func rpAppendBlock(b []byte, m *rpBlock) []byte {
	n := m.contentLength()
	if n > rpMaxContent {
		panic(fmt.Sprintf("refpeer: content of %d bytes does not fit ContentLength", n))
	}
	h := uint16(n)
	if m.fragStart {
		h |= rpFragStart
	}
	if m.frag {
		h |= rpFragment
	}
	if m.inOrder {
		h |= rpMsgInOrder
	}
	if m.reliable {
		h |= rpMsgReliable
	}
	b = binary.LittleEndian.AppendUint16(b, h)
	if m.reliable {
		b = rpAppendVLE8(b, m.relDelta)
	}
	if m.fragStart {
		b = rpAppendVLE32(b, m.fragCount)
	}
	if m.fragStart || m.frag {
		b = append(b, m.transferID)
	}
	if m.frag && !m.fragStart {
		b = rpAppendVLE32(b, m.fragNum)
	}
	if m.hasID() {
		b = rpAppendVLE32(b, m.id)
	}
	return append(b, m.payload...)
}

// rpParseDatagram parses a whole datagram, field by field as the README
// lays it out, and fails on anything that does not parse or that the
// reference never writes (a non-shortest VLE, header bit 11, a reliable
// message in an unreliable datagram, a FragmentStart without Fragment).
// Payloads alias b.
func rpParseDatagram(b []byte) (d rpDatagram, err error) {
	if len(b) < 3 {
		return d, fmt.Errorf("header: %d bytes, want 3", len(b))
	}
	// byte 0: InOrder, Reliable, PacketID bits 0-5; u16: PacketID bits 6-21.
	d.inOrder, d.reliable = b[0]&rpDgInOrder != 0, b[0]&rpDgReliable != 0
	d.pid = uint32(b[0]&0x3f) | uint32(binary.LittleEndian.Uint16(b[1:]))<<6
	off := 3
	if d.reliable { // VLE-1.15/16 ReliableMsgNumBase
		v, n, err := rpConsumeVLE16(b[off:])
		if err != nil {
			return d, fmt.Errorf("ReliableMsgNumBase: %w", err)
		}
		d.relBase, off = v, off+n
	}
	for off < len(b) {
		at := len(d.blocks)
		if len(b)-off < 2 {
			return d, fmt.Errorf("block %d at byte %d: 1 byte left, want a u16 header", at, off)
		}
		h := binary.LittleEndian.Uint16(b[off:])
		off += 2
		m := rpBlock{
			fragStart: h&rpFragStart != 0, frag: h&rpFragment != 0,
			inOrder: h&rpMsgInOrder != 0, reliable: h&rpMsgReliable != 0,
		}
		clen := int(h & rpMaxContent)
		switch {
		case h&rpMsgReserved != 0:
			return d, fmt.Errorf("block %d: header %#04x has bit 11 set", at, h)
		case m.fragStart && !m.frag:
			return d, fmt.Errorf("block %d: FragmentStart without Fragment (header %#04x)", at, h)
		case m.reliable && !d.reliable:
			return d, fmt.Errorf("block %d: reliable message in an unreliable datagram, which has no ReliableMsgNumBase", at)
		}
		if m.reliable { // VLE-1.7/8 delta
			v, n, err := rpConsumeVLE8(b[off:])
			if err != nil {
				return d, fmt.Errorf("block %d reliable delta: %w", at, err)
			}
			m.relDelta, m.relNum, off = v, d.relBase+v, off+n
		}
		if m.fragStart { // VLE-1.7/1.7/16 FragmentCount
			v, n, err := rpConsumeVLE32(b[off:])
			if err != nil {
				return d, fmt.Errorf("block %d FragmentCount: %w", at, err)
			}
			m.fragCount, off = v, off+n
		}
		if m.fragStart || m.frag { // u8 TransferID
			if off >= len(b) {
				return d, fmt.Errorf("block %d: TransferID missing", at)
			}
			m.transferID = b[off]
			off++
		}
		if m.frag && !m.fragStart { // VLE-1.7/1.7/16 FragmentNumber
			v, n, err := rpConsumeVLE32(b[off:])
			if err != nil {
				return d, fmt.Errorf("block %d FragmentNumber: %w", at, err)
			}
			m.fragNum, off = v, off+n
		}
		if len(b)-off < clen {
			return d, fmt.Errorf("block %d: ContentLength %d, %d bytes left", at, clen, len(b)-off)
		}
		content := b[off : off+clen : off+clen]
		off += clen
		if m.hasID() { // VLE-1.7/1.7/16 MessageID, counted in ContentLength
			v, n, err := rpConsumeVLE32(content)
			if err != nil {
				return d, fmt.Errorf("block %d MessageID (ContentLength %d): %w", at, clen, err)
			}
			m.id, content = v, content[n:]
		}
		m.payload = content
		d.blocks = append(d.blocks, m)
	}
	return d, nil
}

// rpAppendAck appends a PacketAck's 7 content bytes after the MessageID:
// the base PacketID as a u24 (bits 22-23 zero), then a u32 whose bit i
// acknowledges base+1+i (fact 9).
func rpAppendAck(b []byte, base, bits uint32) []byte {
	b = append(b, byte(base), byte(base>>8), byte(base>>16))
	return binary.LittleEndian.AppendUint32(b, bits)
}

// rpParseAck decodes a PacketAck payload into the PacketIDs it names, base
// first.
func rpParseAck(p []byte) ([]uint32, error) {
	if len(p) != 7 {
		return nil, fmt.Errorf("PacketAck payload of %d bytes, want 7", len(p))
	}
	base := uint32(p[0]) | uint32(p[1])<<8 | uint32(p[2])<<16
	if base > rpPIDMask {
		return nil, fmt.Errorf("PacketAck base %#06x has bits 22-23 set", base)
	}
	pids := []uint32{base}
	bits := binary.LittleEndian.Uint32(p[3:])
	for i := range uint32(rpAckSpan) {
		if bits&(1<<i) != 0 {
			pids = append(pids, (base+1+i)&rpPIDMask)
		}
	}
	return pids, nil
}

// rpSerialLess orders 22-bit PacketIDs modulo 2^22.
func rpSerialLess(a, b uint32) bool {
	d := (b - a) & rpPIDMask
	return d != 0 && d < 1<<21
}

// rpAckPayloads encodes PacketAcks naming every PacketID in pids, each
// covering at most base..base+32.
func rpAckPayloads(pids []uint32) [][]byte {
	ps := slices.Clone(pids)
	slices.SortFunc(ps, func(a, b uint32) int {
		switch {
		case a == b:
			return 0
		case rpSerialLess(a, b):
			return -1
		}
		return 1
	})
	ps = slices.Compact(ps)
	var out [][]byte
	for i := 0; i < len(ps); {
		base, bits := ps[i], uint32(0)
		j := i + 1
		for ; j < len(ps); j++ {
			off := (ps[j] - base) & rpPIDMask
			if off > rpAckSpan {
				break
			}
			bits |= 1 << (off - 1)
		}
		out = append(out, rpAppendAck(nil, base, bits))
		i = j
	}
	return out
}

// rpHex shows a datagram in hex, cut after 64 bytes.
func rpHex(b []byte) string {
	if len(b) > 64 {
		return fmt.Sprintf("%x... (%d bytes)", b[:64], len(b))
	}
	return hex.EncodeToString(b)
}

// rpIsOpening reports whether b is a reference client's opening.
func rpIsOpening(b []byte) bool {
	return len(b) == rpOpeningSize && bytes.Count(b, []byte{0}) == rpOpeningSize
}

func rpIDName(id uint32) string {
	switch id {
	case rpPingRequest:
		return "PingRequest"
	case rpPingReply:
		return "PingReply"
	case rpFlowControlRequest:
		return "FlowControlRequest"
	case rpPacketAck:
		return "PacketAck"
	case rpDisconnectAck:
		return "DisconnectAck"
	case rpDisconnect:
		return "Disconnect"
	}
	if rpIsApp(id) {
		return "application"
	}
	return fmt.Sprintf("reserved(%#x)", id)
}

// rpIsApp reports whether id is one an application sends (knet's Send
// takes 6..0x3FFFFFFA; 0, 5 and 0x3FFFFFFB..0x3FFFFFFD are reserved).
func rpIsApp(id uint32) bool { return id >= 6 && id < rpConnectAck }

// TestReferencePeerCodec pins the test's codec to the README's examples.
func TestReferencePeerCodec(t *testing.T) {
	for _, tt := range []struct {
		v    uint32
		want string
	}{
		{10, "0a"}, {127, "7f"}, {128, "8001"}, {300, "ac02"}, {16383, "ff7f"},
		{16384, "80800100"}, {70000, "f0a20400"}, {1000000, "c0843d00"},
		{rpDisconnect, "ffffffff"}, {rpDisconnectAck, "feffffff"},
	} {
		b := rpAppendVLE32(nil, tt.v)
		assert.Equal(t, tt.want, hex.EncodeToString(b), "VLE-1.7/1.7/16 %d", tt.v)
		v, n, err := rpConsumeVLE32(b)
		if assert.NoError(t, err, "VLE-1.7/1.7/16 %d", tt.v) {
			assert.Equal(t, []any{tt.v, len(b)}, []any{v, n})
		}
	}
	for _, tt := range []struct {
		v    uint32
		want string
	}{{0, "0000"}, {211, "d300"}, {526, "0e02"}, {32767, "ff7f"}, {32768, "00800100"}, {32944, "b0800100"}} {
		b := rpAppendVLE16(nil, tt.v)
		assert.Equal(t, tt.want, hex.EncodeToString(b), "VLE-1.15/16 %d", tt.v)
		v, n, err := rpConsumeVLE16(b)
		if assert.NoError(t, err, "VLE-1.15/16 %d", tt.v) {
			assert.Equal(t, []any{tt.v, len(b)}, []any{v, n})
		}
	}
	for _, tt := range []struct {
		v    uint32
		want string
	}{{0, "00"}, {29, "1d"}, {127, "7f"}, {128, "8001"}, {rpMaxVLE8, "ffff"}} {
		b := rpAppendVLE8(nil, tt.v)
		assert.Equal(t, tt.want, hex.EncodeToString(b), "VLE-1.7/8 %d", tt.v)
		v, n, err := rpConsumeVLE8(b)
		if assert.NoError(t, err, "VLE-1.7/8 %d", tt.v) {
			assert.Equal(t, []any{tt.v, len(b)}, []any{v, n})
		}
	}

	// Datagram headers from the README.
	for _, tt := range []struct {
		hex               string
		pid               uint32
		inOrder, reliable bool
	}{
		{"c10000" + "0000", 1, true, true},
		{"810000", 1, true, false},
		{"030000", 3, false, false},
		{"6a0100" + "0000", 106, false, true},
		{"f20b00" + "0000", 754, true, true},
	} {
		raw, err := hex.DecodeString(tt.hex)
		require.NoError(t, err)
		d, err := rpParseDatagram(raw)
		if assert.NoError(t, err, tt.hex) {
			assert.Equal(t, []any{tt.pid, tt.inOrder, tt.reliable}, []any{d.pid, d.inOrder, d.reliable}, tt.hex)
			assert.Equal(t, tt.hex, hex.EncodeToString(rpAppendDatagram(nil, &d)))
		}
	}

	// A reliable message: header 0x1014, delta 0, MessageID 11, 19 bytes.
	raw, err := hex.DecodeString("440000" + "0000" + "1410000b52322d302d72656c6961626c652d736d616c6c")
	require.NoError(t, err)
	d, err := rpParseDatagram(raw)
	require.NoError(t, err)
	require.Len(t, d.blocks, 1)
	m := d.blocks[0]
	assert.True(t, m.reliable && !m.inOrder && !m.frag)
	assert.Equal(t, []any{uint32(0), uint32(11), "R2-0-reliable-small"}, []any{m.relNum, m.id, string(m.payload)})

	// The FragmentStart of a 100000-byte message: header 0xd142, delta,
	// FragmentCount 315 (bb 02), TransferID 1, MessageID 70000, 318 bytes;
	// then a fragment with FragmentNumber 1.
	big := bytes.Repeat([]byte{0xa5}, rpFragSize)
	d = rpDatagram{pid: 13, reliable: true, relBase: 211, blocks: []rpBlock{
		{fragStart: true, frag: true, reliable: true, fragCount: 315, transferID: 1, id: 70000, payload: big},
		{frag: true, reliable: true, relDelta: 1, transferID: 1, fragNum: 1, payload: big},
	}}
	raw = rpAppendDatagram(nil, &d)
	assert.Equal(t, "4d0000"+"d300"+"42d1"+"00"+"bb02"+"01"+"f0a20400", hex.EncodeToString(raw[:15]))
	assert.Equal(t, "3e51"+"01"+"01"+"01", hex.EncodeToString(raw[15+rpFragSize:15+rpFragSize+5]))
	back, err := rpParseDatagram(raw)
	require.NoError(t, err)
	require.Len(t, back.blocks, 2)
	assert.Equal(t, []uint32{211, 212}, []uint32{back.blocks[0].relNum, back.blocks[1].relNum})

	// PacketAcks (fact 9).
	for _, tt := range []struct {
		hex  string
		pids []uint32
	}{
		{"040000ffffffff", rpRange(4, 36)},
		{"2500001f000000", rpRange(37, 42)},
		{"0400007d000000", append([]uint32{4, 5}, rpRange(7, 11)...)},
		{"e40200ffff0700", rpRange(740, 759)},
	} {
		raw, err := hex.DecodeString(tt.hex)
		require.NoError(t, err)
		pids, err := rpParseAck(raw)
		if assert.NoError(t, err, tt.hex) {
			assert.Equal(t, tt.pids, pids, tt.hex)
		}
		ps := rpAckPayloads(tt.pids)
		if assert.Len(t, ps, 1, tt.hex) {
			assert.Equal(t, tt.hex, hex.EncodeToString(ps[0]))
		}
	}
	ps := rpAckPayloads(rpRange(4, 42))
	require.Len(t, ps, 2)
	assert.Equal(t, "040000ffffffff", hex.EncodeToString(ps[0]))
	assert.Equal(t, "2500001f000000", hex.EncodeToString(ps[1]))
	_, err = rpParseAck([]byte{1, 0, 0x40, 0, 0, 0, 0})
	assert.Error(t, err, "base with bit 22 set")

	for _, tt := range []struct{ name, hex string }{
		{"short header", "0100"},
		{"truncated base", "410000" + "00"},
		{"half a block header", "010000" + "01"},
		{"reserved bit 11", "010000" + "0108" + "07"},
		{"reliable message in an unreliable datagram", "010000" + "0110" + "00" + "07"},
		{"FragmentStart without Fragment", "410000" + "0000" + "0190" + "00" + "02" + "01" + "07"},
		{"fragment without TransferID", "410000" + "0000" + "0050" + "00"},
		{"fragment without FragmentNumber", "410000" + "0000" + "0050" + "00" + "01"},
		{"content beyond end", "010000" + "0500" + "0778"},
		{"empty content has no MessageID", "010000" + "0000"},
		{"long form of a short MessageID", "010000" + "0200" + "8500"},
		{"long form of a short delta", "410000" + "0000" + "0110" + "8000" + "07"},
		{"long form of a short base", "410000" + "05800000" + "0110" + "00" + "07"},
		{"opening", "0000000000000000"},
	} {
		raw, err := hex.DecodeString(tt.hex)
		require.NoError(t, err, tt.name)
		_, err = rpParseDatagram(raw)
		assert.Error(t, err, tt.name)
	}
}

func rpRange(from, to uint32) []uint32 {
	var r []uint32
	for v := from; v <= to; v++ {
		r = append(r, v)
	}
	return r
}

// rpCaptureLine is one line of a testdata/reference/*.txt capture.
type rpCaptureLine struct {
	n   int // line number
	c2s bool
	b   []byte
}

func rpReadCapture(t *testing.T, path string) []rpCaptureLine {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	var lines []rpCaptureLine
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for n := 1; sc.Scan(); n++ {
		fields := strings.Fields(sc.Text())
		require.Len(t, fields, 3, "%s:%d", path, n)
		_, err := strconv.ParseFloat(fields[0], 64)
		require.NoError(t, err, "%s:%d: time", path, n)
		require.Contains(t, []string{"c2s", "s2c"}, fields[1], "%s:%d: direction", path, n)
		b, err := hex.DecodeString(fields[2])
		require.NoError(t, err, "%s:%d: hex", path, n)
		lines = append(lines, rpCaptureLine{n: n, c2s: fields[1] == "c2s", b: b})
	}
	require.NoError(t, sc.Err())
	return lines
}

// TestReferencePeerGolden decodes every datagram of every reference
// capture with the test's codec and encodes it back to the same bytes. The
// trashtalk capture's client sends random bytes, and every other capture's
// client opens with 8 zero bytes, which are not a datagram.
//
// It also checks the README's facts that the peer below relies on, where
// the traffic is the reference's own (the pyprobe captures' clients are
// hand-written).
func TestReferencePeerGolden(t *testing.T) {
	paths, err := filepath.Glob(filepath.Join("testdata", "reference", "*.txt"))
	require.NoError(t, err)
	var captures []string
	for _, p := range paths {
		if !strings.HasSuffix(p, ".decoded.txt") {
			captures = append(captures, p)
		}
	}
	require.Len(t, captures, 12, "captures in testdata/reference")
	total := 0
	for _, path := range captures {
		name := strings.TrimSuffix(filepath.Base(path), ".txt")
		t.Run(name, func(t *testing.T) {
			lines := rpReadCapture(t, path)
			require.NotEmpty(t, lines)
			garbage := name == "trashtalk_garbage"
			handmade := strings.HasPrefix(name, "pyprobe_")
			if !garbage {
				assert.True(t, lines[0].c2s && rpIsOpening(lines[0].b), "first line is the client's opening")
			}
			// Per direction: the PacketIDs seen, for the ack check.
			sent := map[bool]map[uint32]bool{true: {}, false: {}}
			decoded := 0
			for _, l := range lines {
				if garbage && l.c2s {
					continue
				}
				if rpIsOpening(l.b) {
					assert.True(t, l.c2s, "line %d: an opening from the server", l.n)
					continue
				}
				d, err := rpParseDatagram(l.b)
				if !assert.NoError(t, err, "line %d: %s", l.n, rpHex(l.b)) {
					continue
				}
				decoded++
				if !assert.Equal(t, hex.EncodeToString(l.b), hex.EncodeToString(rpAppendDatagram(nil, &d)), "line %d re-encoded", l.n) {
					continue
				}
				sent[l.c2s][d.pid] = true
				if handmade && l.c2s {
					continue
				}
				// Facts 7 and 8: the datagram flags say whether any message
				// has them.
				anyInOrder, anyReliable := false, false
				minDelta := uint32(rpMaxVLE8 + 1)
				for _, m := range d.blocks {
					anyInOrder = anyInOrder || m.inOrder
					anyReliable = anyReliable || m.reliable
					if m.reliable {
						minDelta = min(minDelta, m.relDelta)
					}
					if !rpIsApp(m.id) && m.hasID() {
						assert.True(t, m.inOrder, "line %d: library message %s without the InOrder bit", l.n, rpIDName(m.id))
					}
					if m.frag {
						assert.True(t, m.reliable, "line %d: unreliable fragment", l.n)
					}
					if m.hasID() && m.id == rpPacketAck {
						pids, err := rpParseAck(m.payload)
						if assert.NoError(t, err, "line %d", l.n) {
							for _, pid := range pids {
								assert.True(t, sent[!l.c2s][pid], "line %d acks PacketID %d, not sent (yet) the other way", l.n, pid)
							}
						}
					}
				}
				assert.Equal(t, anyInOrder, d.inOrder, "line %d: datagram InOrder bit", l.n)
				assert.Equal(t, anyReliable, d.reliable, "line %d: datagram Reliable bit", l.n)
				if d.reliable {
					assert.Zero(t, minDelta, "line %d: ReliableMsgNumBase is the lowest reliable number", l.n)
				}
			}
			if garbage {
				assert.Zero(t, decoded, "the server never answers garbage")
			} else {
				assert.Positive(t, decoded)
			}
			total += decoded
		})
	}
	t.Logf("%d datagrams decoded and re-encoded", total)
}
