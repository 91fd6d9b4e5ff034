package knet_test

// An end-to-end check of the server against a hand-written client that
// speaks the bytes of knet-udp-spec.txt, as amended by DECISIONS.md. The
// client's encoder and strict decoder below are written from those two texts
// alone; nothing here uses the library's own codec, so the two can only agree
// by both following the spec.

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet"
)

// Message IDs, DECISIONS §2.
const (
	spPingRequest        uint32 = 1
	spPingReply          uint32 = 2
	spFlowControlRequest uint32 = 3
	spPacketAck          uint32 = 4
	spConnectAck         uint32 = 0x3FFFFFFB
	spConnectSynAck      uint32 = 0x3FFFFFFC
	spConnectSyn         uint32 = 0x3FFFFFFD
	spDisconnectAck      uint32 = 0x3FFFFFFE
	spDisconnect         uint32 = 0x3FFFFFFF
	spMinAppID           uint32 = 6
	spMaxAppID           uint32 = 0x3FFFFFFA
)

// Field limits, spec "Datagram Byte Format" and DECISIONS §3.
const (
	spPIDMask    = 1<<22 - 1 // PacketID: bits 0-21 of the u24 header
	spReliable   = 1 << 22   // header bit 22
	spInOrder    = 1 << 23   // header bit 23
	spMaxVLE8    = 1<<15 - 1 // VLE-1.7/8
	spMaxVLE32   = 1<<30 - 1 // VLE-1.7/1.7/16
	spMaxContent = 1<<11 - 1 // ContentLength: bits 0-10 of the block header
	spMaxFrag    = 470       // MaxUDPMessageFragmentSize, DECISIONS §6
)

// Timing of the run: the server's Config and the client's patience. Real
// sockets on a machine that may be busy with other work: waits for
// something to happen are guards against hanging (spPatience), and the
// one bound on how soon (acks within MaxAckDelay) leaves room for
// scheduling; the session tests check MaxAckDelay exactly on a fake clock.
const (
	spMaxAckDelay     = 33 * time.Millisecond
	spAckSlack        = 500 * time.Millisecond // scheduling, -race, a busy machine
	spAckBound        = spMaxAckDelay + spAckSlack
	spPatience        = 5 * time.Second
	spDatagramTimeout = 300 * time.Millisecond
	spPingInterval    = 200 * time.Millisecond
	spClientAckBatch  = 5 * time.Millisecond   // we ack within this
	spClientRTO       = 500 * time.Millisecond // we resend unacked reliable datagrams after this
	spResendGrace     = 100 * time.Millisecond // a resend may cross our ack on the way
	spRunBudget       = 20 * time.Second       // per subtest; they run in parallel
	spMaxDatagramSize = 1400                   // Config.MaxDatagramSize default
)

// ---- Encoder, straight from the spec ----

// spAppendVLE8 appends v as VLE-1.7/8 (DECISIONS §3).
func spAppendVLE8(b []byte, v int) []byte {
	switch {
	case v < 0 || v > spMaxVLE8:
		panic(fmt.Sprintf("specpeer: %d does not fit VLE-1.7/8", v))
	case v < 0x80:
		return append(b, byte(v))
	}
	return append(b, 0x80|byte(v&0x7f), byte(v>>7))
}

// spAppendVLE32 appends v as VLE-1.7/1.7/16 (DECISIONS §3).
func spAppendVLE32(b []byte, v uint32) []byte {
	switch {
	case v > spMaxVLE32:
		panic(fmt.Sprintf("specpeer: %d does not fit VLE-1.7/1.7/16", v))
	case v < 1<<7:
		return append(b, byte(v))
	case v < 1<<14:
		return append(b, 0x80|byte(v&0x7f), byte(v>>7))
	}
	return append(b, 0x80|byte(v&0x7f), 0x80|byte(v>>7&0x7f), byte(v>>14), byte(v>>22))
}

// spDep names a message: the PacketID of its datagram and its 0-based index
// among that datagram's message blocks.
type spDep struct {
	pid   uint32
	index int
}

// spOut is a message block to send: a whole message, or one fragment of a
// fragmented transfer (see spFragments).
type spOut struct {
	id      uint32 // not sent in a fragment other than the first
	payload []byte
	code    int   // InOrder code 0-7
	single  int   // SingleInOrderIndex, code 6
	multi   []int // MultiInOrderIndexArray, code 7

	// The wire's two flags, set as given: a first fragment has both.
	fragStart, frag bool
	fragCount       uint32 // with fragStart
	transferID      uint8  // with fragStart or frag
	fragNum         uint32 // with frag and not fragStart
}

// spFragments cuts the message (id, payload) into the fragments of one
// transfer, each with at most size Content bytes: the first carries the
// MessageID and FragmentCount, the others their FragmentNumber.
func spFragments(id uint32, payload []byte, tid uint8, size int) []spOut {
	first := size - len(spAppendVLE32(nil, id))
	if len(payload) <= first {
		panic("specpeer: message too short for a fragmented transfer")
	}
	chunks := [][]byte{payload[:first]}
	for rest := payload[first:]; len(rest) > 0; {
		n := min(size, len(rest))
		chunks, rest = append(chunks, rest[:n]), rest[n:]
	}
	out := make([]spOut, len(chunks))
	for i, c := range chunks {
		out[i] = spOut{payload: c, frag: true, transferID: tid, fragNum: uint32(i)}
	}
	out[0].fragStart, out[0].id, out[0].fragCount, out[0].fragNum = true, id, uint32(len(chunks)), 0
	return out
}

// spAppendDatagram appends a datagram. The InOrder flag is set when deps is
// not empty; deps become InOrderDeltaArray and InOrderDatagramIndexArray.
func spAppendDatagram(b []byte, pid uint32, reliable bool, deps []spDep, msgs []spOut) []byte {
	h := pid & spPIDMask
	if reliable {
		h |= spReliable
	}
	if len(deps) > 0 {
		h |= spInOrder
	}
	b = append(b, byte(h), byte(h>>8), byte(h>>16))
	if len(deps) > 0 {
		if len(deps) > 255 {
			panic("specpeer: InOrderDeltaCount is a u8")
		}
		b = append(b, byte(len(deps)))
		for _, d := range deps {
			// DependedPacketID = PacketID - delta - 1.
			b = spAppendVLE8(b, int((pid-d.pid-1)&spPIDMask))
		}
		for _, d := range deps {
			b = spAppendVLE8(b, d.index)
		}
	}
	for _, m := range msgs {
		var content []byte
		if m.fragStart || !m.frag { // Content: VLE MessageID, then the payload
			content = spAppendVLE32(nil, m.id)
		}
		content = append(content, m.payload...)
		if len(content) > spMaxContent {
			panic("specpeer: content too long for one block")
		}
		var entries []int
		switch {
		case m.code >= 1 && m.code <= 5:
			entries = []int{m.code - 1}
		case m.code == 6:
			entries = []int{m.single}
		case m.code == 7:
			entries = m.multi
		}
		for _, e := range entries {
			if e >= len(deps) {
				panic("specpeer: InOrder code names a missing dependency")
			}
		}
		hdr := uint16(m.code)<<11 | uint16(len(content))
		if m.fragStart {
			hdr |= 1 << 15
		}
		if m.frag {
			hdr |= 1 << 14
		}
		b = binary.LittleEndian.AppendUint16(b, hdr)
		switch m.code {
		case 6:
			b = append(b, byte(m.single))
		case 7:
			b = append(b, byte(len(m.multi)))
			for _, e := range m.multi {
				b = append(b, byte(e))
			}
		}
		if m.fragStart { // VLE-1.7/1.7/16 FragmentCount
			b = spAppendVLE32(b, m.fragCount)
		}
		if m.fragStart || m.frag { // u8 TransferID
			b = append(b, m.transferID)
		}
		if m.frag && !m.fragStart { // VLE-1.7/1.7/16 FragmentNumber
			b = spAppendVLE32(b, m.fragNum)
		}
		b = append(b, content...)
	}
	return b
}

// ---- Strict decoder ----

// spConsumeVLE8 decodes a VLE-1.7/8 at the start of b. It rejects truncated
// input and any form other than the one DECISIONS §3 gives for the value.
func spConsumeVLE8(b []byte) (v, n int, err error) {
	switch {
	case len(b) == 0:
		return 0, 0, errors.New("VLE-1.7/8: no bytes left")
	case b[0] < 0x80:
		return int(b[0]), 1, nil
	case len(b) < 2:
		return 0, 0, errors.New("VLE-1.7/8: truncated after 1 byte")
	case b[1] == 0:
		return 0, 0, fmt.Errorf("VLE-1.7/8: %x is not the shortest form", b[:2])
	}
	return int(b[0]&0x7f) | int(b[1])<<7, 2, nil
}

// spConsumeVLE32 decodes a VLE-1.7/1.7/16 at the start of b, as strictly as
// spConsumeVLE8.
func spConsumeVLE32(b []byte) (v uint32, n int, err error) {
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

// spBlock is a parsed message block; payload aliases the datagram.
type spBlock struct {
	fragStart, frag bool
	code            int
	entries         []int // dependency entries named by the InOrder code
	fragCount       uint32
	transferID      uint8
	fragNum         uint32
	hasID           bool
	id              uint32
	payload         []byte
}

// spDatagram is a parsed datagram.
type spDatagram struct {
	pid               uint32
	reliable, inOrder bool
	deltas, indices   []int
	blocks            []spBlock
}

// spParseDatagram parses a whole datagram, field by field as in the spec's
// "Datagram Byte Format", and fails on anything that does not parse.
func spParseDatagram(b []byte) (d spDatagram, err error) {
	// u24: bits 0-21 PacketID, bit 22 Reliable, bit 23 InOrder.
	if len(b) < 3 {
		return d, fmt.Errorf("header: %d bytes, want 3", len(b))
	}
	h := uint32(b[0]) | uint32(b[1])<<8 | uint32(b[2])<<16
	d.pid, d.reliable, d.inOrder = h&spPIDMask, h&spReliable != 0, h&spInOrder != 0
	off := 3
	if d.inOrder {
		// u8 InOrderDeltaCount, then the two VLE-1.7/8 arrays.
		if off >= len(b) {
			return d, errors.New("InOrder datagram without InOrderDeltaCount")
		}
		n := int(b[off])
		off++
		for _, arr := range []*[]int{&d.deltas, &d.indices} {
			for i := range n {
				v, k, err := spConsumeVLE8(b[off:])
				if err != nil {
					return d, fmt.Errorf("InOrder array entry %d at byte %d: %w", i, off, err)
				}
				*arr = append(*arr, v)
				off += k
			}
		}
	}
	// Message blocks until no bytes are left.
	for off < len(b) {
		at := len(d.blocks)
		if len(b)-off < 2 {
			return d, fmt.Errorf("block %d at byte %d: 1 byte left, want a u16 header", at, off)
		}
		// u16: bit 15 FragmentStart, bit 14 Fragment, bits 11-13 InOrder
		// code, bits 0-10 ContentLength.
		hdr := binary.LittleEndian.Uint16(b[off:])
		off += 2
		m := spBlock{fragStart: hdr&(1<<15) != 0, frag: hdr&(1<<14) != 0, code: int(hdr >> 11 & 7)}
		clen := int(hdr & spMaxContent)
		switch {
		case m.code >= 1 && m.code <= 5:
			m.entries = []int{m.code - 1}
		case m.code == 6: // u8 SingleInOrderIndex
			if off >= len(b) {
				return d, fmt.Errorf("block %d: SingleInOrderIndex missing", at)
			}
			m.entries = []int{int(b[off])}
			off++
		case m.code == 7: // u8 MultiInOrderIndexCount, then as many u8
			if off >= len(b) {
				return d, fmt.Errorf("block %d: MultiInOrderIndexCount missing", at)
			}
			n := int(b[off])
			off++
			if len(b)-off < n {
				return d, fmt.Errorf("block %d: MultiInOrderIndexArray of %d, %d bytes left", at, n, len(b)-off)
			}
			for _, e := range b[off : off+n] {
				m.entries = append(m.entries, int(e))
			}
			off += n
		}
		for _, e := range m.entries {
			if e >= len(d.deltas) {
				return d, fmt.Errorf("block %d: InOrder code %d names dependency entry %d, the datagram has %d", at, m.code, e, len(d.deltas))
			}
		}
		if m.fragStart { // VLE-1.7/1.7/16 FragmentCount
			v, k, err := spConsumeVLE32(b[off:])
			if err != nil {
				return d, fmt.Errorf("block %d FragmentCount: %w", at, err)
			}
			m.fragCount, off = v, off+k
		}
		if m.fragStart || m.frag { // u8 TransferID
			if off >= len(b) {
				return d, fmt.Errorf("block %d: TransferID missing", at)
			}
			m.transferID = b[off]
			off++
		}
		if m.frag && !m.fragStart { // VLE-1.7/1.7/16 FragmentNumber
			v, k, err := spConsumeVLE32(b[off:])
			if err != nil {
				return d, fmt.Errorf("block %d FragmentNumber: %w", at, err)
			}
			m.fragNum, off = v, off+k
		}
		if len(b)-off < clen {
			return d, fmt.Errorf("block %d: ContentLength %d, %d bytes left", at, clen, len(b)-off)
		}
		content := b[off : off+clen]
		off += clen
		if m.fragStart || !m.frag { // Content: VLE MessageID, then the payload
			v, k, err := spConsumeVLE32(content)
			if err != nil {
				return d, fmt.Errorf("block %d MessageID (ContentLength %d): %w", at, clen, err)
			}
			m.hasID, m.id, content = true, v, content[k:]
		}
		m.payload = content
		d.blocks = append(d.blocks, m)
	}
	return d, nil
}

// spSerialLess orders 22-bit PacketIDs modulo 2^22 (DECISIONS §4).
func spSerialLess(a, b uint32) bool {
	d := (b - a) & spPIDMask
	return d != 0 && d < 1<<21
}

// spAckPayloads encodes PacketAcks naming every PacketID in pids: a u24 base
// with bits 22/23 acking base+1/base+2, then a u32 whose bit i acks base+3+i
// (DECISIONS §3).
func spAckPayloads(pids []uint32) [][]byte {
	ps := slices.Clone(pids)
	sort.Slice(ps, func(i, j int) bool { return spSerialLess(ps[i], ps[j]) })
	ps = slices.Compact(ps)
	var out [][]byte
	for i := 0; i < len(ps); {
		base := ps[i]
		h, bits := base, uint32(0)
		j := i + 1
		for ; j < len(ps); j++ {
			off := (ps[j] - base) & spPIDMask
			if off > 34 {
				break
			}
			switch off {
			case 1:
				h |= 1 << 22
			case 2:
				h |= 1 << 23
			default:
				bits |= 1 << (off - 3)
			}
		}
		p := []byte{byte(h), byte(h >> 8), byte(h >> 16)}
		out = append(out, binary.LittleEndian.AppendUint32(p, bits))
		i = j
	}
	return out
}

// spParseAck decodes a PacketAck payload into the PacketIDs it acks.
func spParseAck(p []byte) ([]uint32, error) {
	if len(p) != 7 {
		return nil, fmt.Errorf("PacketAck payload of %d bytes, want 7", len(p))
	}
	h := uint32(p[0]) | uint32(p[1])<<8 | uint32(p[2])<<16
	base := h & spPIDMask
	pids := []uint32{base}
	if h&(1<<22) != 0 {
		pids = append(pids, (base+1)&spPIDMask)
	}
	if h&(1<<23) != 0 {
		pids = append(pids, (base+2)&spPIDMask)
	}
	bits := binary.LittleEndian.Uint32(p[3:])
	for i := range uint32(32) {
		if bits&(1<<i) != 0 {
			pids = append(pids, (base+3+i)&spPIDMask)
		}
	}
	return pids, nil
}

// spHex shows a datagram in hex, cut after 96 bytes.
func spHex(b []byte) string {
	if len(b) > 96 {
		return fmt.Sprintf("%x... (%d bytes)", b[:96], len(b))
	}
	return hex.EncodeToString(b)
}

func spIsApp(id uint32) bool { return id >= spMinAppID && id <= spMaxAppID }

func spIDName(id uint32) string {
	switch id {
	case spPingRequest:
		return "PingRequest"
	case spPingReply:
		return "PingReply"
	case spFlowControlRequest:
		return "FlowControlRequest"
	case spPacketAck:
		return "PacketAck"
	case spConnectAck:
		return "ConnectAck"
	case spConnectSynAck:
		return "ConnectSynAck"
	case spConnectSyn:
		return "ConnectSyn"
	case spDisconnectAck:
		return "DisconnectAck"
	case spDisconnect:
		return "Disconnect"
	}
	if spIsApp(id) {
		return "application"
	}
	return fmt.Sprintf("reserved(%d)", id)
}

// TestSpecPeerCodec pins the test's own codec to the vectors of DECISIONS §3,
// so that a disagreement with the server is not the test's fault.
func TestSpecPeerCodec(t *testing.T) {
	for _, tt := range []struct {
		v    uint32
		want string
	}{{5, "05"}, {300, "ac02"}, {100000, "a08d0600"}, {127, "7f"}, {128, "8001"}, {16383, "ff7f"}, {16384, "80800100"}, {spMaxVLE32, "ffffffff"}} {
		b := spAppendVLE32(nil, tt.v)
		assert.Equal(t, tt.want, hex.EncodeToString(b), "v=%d", tt.v)
		v, n, err := spConsumeVLE32(b)
		if assert.NoError(t, err, "v=%d", tt.v) {
			assert.Equal(t, tt.v, v)
			assert.Equal(t, len(b), n)
		}
	}
	for _, tt := range []struct {
		v    int
		want string
	}{{5, "05"}, {127, "7f"}, {128, "8001"}, {300, "ac02"}, {spMaxVLE8, "ffff"}} {
		b := spAppendVLE8(nil, tt.v)
		assert.Equal(t, tt.want, hex.EncodeToString(b), "v=%d", tt.v)
		v, n, err := spConsumeVLE8(b)
		if assert.NoError(t, err) {
			assert.Equal(t, tt.v, v)
			assert.Equal(t, len(b), n)
		}
	}

	// A datagram round trip: PacketID 5, reliable, in order, one entry
	// naming (PacketID 1, index 2), a message with code 1 and one without.
	b := spAppendDatagram(nil, 5, true, []spDep{{1, 2}}, []spOut{{id: 300, payload: []byte("x"), code: 1}, {id: 7}})
	assert.Equal(t, "0500c0"+"01"+"03"+"02"+"0308"+"ac0278"+"0100"+"07", hex.EncodeToString(b))
	d, err := spParseDatagram(b)
	require.NoError(t, err)
	assert.Equal(t, uint32(5), d.pid)
	assert.True(t, d.reliable)
	assert.True(t, d.inOrder)
	assert.Equal(t, []int{3}, d.deltas)
	assert.Equal(t, []int{2}, d.indices)
	require.Len(t, d.blocks, 2)
	assert.Equal(t, []int{0}, d.blocks[0].entries)
	assert.Equal(t, uint32(300), d.blocks[0].id)
	assert.Equal(t, "x", string(d.blocks[0].payload))
	assert.Equal(t, uint32(7), d.blocks[1].id)
	assert.Empty(t, d.blocks[1].payload)

	// Fragments: PacketID 9, reliable; a FragmentStart (FragmentCount 3,
	// TransferID 7, MessageID 300, "ab") and a fragment (TransferID 7,
	// FragmentNumber 300, "cd").
	b = spAppendDatagram(nil, 9, true, nil, []spOut{
		{id: 300, payload: []byte("ab"), fragStart: true, frag: true, fragCount: 3, transferID: 7},
		{payload: []byte("cd"), frag: true, transferID: 7, fragNum: 300},
	})
	assert.Equal(t, "090040"+"04c0"+"03"+"07"+"ac026162"+"0240"+"07"+"ac02"+"6364", hex.EncodeToString(b))
	d, err = spParseDatagram(b)
	require.NoError(t, err)
	require.Len(t, d.blocks, 2)
	f0, f1 := d.blocks[0], d.blocks[1]
	assert.True(t, f0.fragStart && f0.frag && f0.hasID)
	assert.Equal(t, []any{uint32(3), uint8(7), uint32(300), "ab"}, []any{f0.fragCount, f0.transferID, f0.id, string(f0.payload)})
	assert.True(t, !f1.fragStart && f1.frag && !f1.hasID)
	assert.Equal(t, []any{uint8(7), uint32(300), "cd"}, []any{f1.transferID, f1.fragNum, string(f1.payload)})
	fs := spFragments(300, bytes.Repeat([]byte{1}, 1400), 9, spMaxFrag)
	require.Len(t, fs, 3)
	// Content 2+468, 470, 462 bytes; datagrams 3+2+(1+1)+470 and so on.
	for i, want := range []struct{ payload, datagram int }{{468, 477}, {470, 477}, {462, 469}} {
		assert.Equal(t, uint32(i), fs[i].fragNum)
		assert.Equal(t, i == 0, fs[i].fragStart)
		assert.Len(t, fs[i].payload, want.payload, "fragment %d", i)
		assert.Len(t, spAppendDatagram(nil, 0, true, nil, fs[i:i+1]), want.datagram, "fragment %d", i)
	}

	for _, tt := range []struct {
		name, hex string
	}{
		{"short header", "0500"},
		{"fragment without TransferID", "090040" + "0040"},
		{"fragment without FragmentNumber", "090040" + "0040" + "07"},
		{"FragmentStart without FragmentCount", "090040" + "00c0"},
		{"FragmentStart without MessageID", "090040" + "00c0" + "03" + "07"},
		{"in order without count", "050080"},
		{"truncated delta", "05008001" + "80"},
		{"code beyond count", "050000" + "0308" + "077878"},
		{"code 6 beyond count", "050080" + "01" + "00" + "00" + "0230" + "01" + "07" + "78"},
		{"content beyond end", "050000" + "0500" + "0778"},
		{"empty content has no id", "050000" + "0000"},
		{"half a block header", "050000" + "01"},
		{"long form of a short id", "050000" + "0200" + "8500"},
		{"truncated 4-byte id", "050000" + "0300" + "808080"},
	} {
		raw, err := hex.DecodeString(tt.hex)
		require.NoError(t, err, tt.name)
		_, err = spParseDatagram(raw)
		assert.Error(t, err, tt.name)
	}

	// PacketAck: base, bits 22/23 for base+1/base+2, bit i for base+3+i,
	// across the 22-bit wrap.
	pids := []uint32{spPIDMask, 0, 1, 31, 40}
	ps := spAckPayloads(pids)
	require.Len(t, ps, 2)
	assert.Equal(t, "ffffff"+"00000020", hex.EncodeToString(ps[0]), "base 0x3fffff, +1, +2, +32")
	assert.Equal(t, "280000"+"00000000", hex.EncodeToString(ps[1]))
	var got []uint32
	for _, p := range ps {
		a, err := spParseAck(p)
		require.NoError(t, err)
		got = append(got, a...)
	}
	assert.ElementsMatch(t, pids, got)
}

// ---- The echo server, on the public API ----

type spServer struct {
	done   chan struct{}
	connCh chan *knet.Conn

	mu     sync.Mutex
	conn   *knet.Conn
	msgs   []knet.Message
	eof    bool
	eofAt  int // messages received before io.EOF
	err    error
	admits []string
}

func (s *spServer) run(ctx context.Context, l *knet.Listener) {
	defer close(s.done)
	c, err := l.AcceptConn(ctx)
	if err != nil {
		s.mu.Lock()
		s.err = fmt.Errorf("accept: %w", err)
		s.mu.Unlock()
		return
	}
	s.mu.Lock()
	s.conn = c
	s.mu.Unlock()
	s.connCh <- c
	for {
		m, err := c.Receive(ctx)
		s.mu.Lock()
		switch {
		case errors.Is(err, io.EOF):
			s.eof, s.eofAt = true, len(s.msgs)
		case err != nil:
			s.err = fmt.Errorf("receive: %w", err)
		default:
			s.msgs = append(s.msgs, m)
		}
		s.mu.Unlock()
		if err != nil {
			return
		}
		if err := c.Send(knet.Message{ID: m.ID, Payload: m.Payload, Reliable: m.Reliable}); err != nil {
			s.mu.Lock()
			s.err = fmt.Errorf("send: %w", err)
			s.mu.Unlock()
			return
		}
	}
}

// find returns the positions at which the server application received the
// message (id, payload).
func (s *spServer) find(id uint32, payload string) []int {
	s.mu.Lock()
	defer s.mu.Unlock()
	var at []int
	for i, m := range s.msgs {
		if m.ID == id && string(m.Payload) == payload {
			at = append(at, i)
		}
	}
	return at
}

func (s *spServer) got(id uint32, payload string) bool { return len(s.find(id, payload)) > 0 }

// ---- The hand-written client ----

type spSent struct {
	b         []byte
	reliable  bool
	firstSent time.Time
	lastSent  time.Time
	ackedAt   time.Time // first PacketAck naming it
	acks      int       // PacketAcks naming it
}

type spSeen struct {
	b              []byte
	reliable       bool
	blocks         int
	copies         int
	ackedAt        time.Time // when we first acked it
	resentAfterAck int
}

type spKey struct {
	id      uint32
	payload string
}

type spTransfer struct {
	started bool // FragmentStart seen
	count   uint32
	id      uint32
	parts   map[uint32][]byte
	pids    []uint32 // the datagrams carrying its fragments
}

type spPeer struct {
	t        *testing.T
	conn     *net.UDPConn
	deadline time.Time
	nextPID  uint32

	out      map[uint32]*spSent // our datagrams by PacketID
	expected map[spKey]bool     // our application messages: reliable?
	resends  int                // our retransmissions

	seen       map[uint32]*spSeen // the server's datagrams by PacketID
	lastNewPID uint32
	skipped    int // PacketIDs the server skipped (one at a time)
	anyNew     bool
	pending    []uint32 // server PacketIDs to ack
	ackDue     time.Time
	holding    bool
	held       []uint32
	closing    bool // we sent Disconnect: send nothing else

	echoes      map[spKey]int
	echoRel     map[spKey]bool // seen in a reliable datagram
	synAcks     []string
	pingReplies map[byte]int
	serverPings int
	flowReqs    []uint16
	discAcks    int
	frags       map[uint8]*spTransfer // transfers under reassembly
	fragsDone   map[uint8][]uint32    // datagrams of the last finished transfer of a TransferID
	fragEchoes  map[spKey]int         // echoes that came as fragmented transfers

	// For the summary.
	datagrams, reliableDgs, inOrderDgs, retransmits, bytesIn, maxBlocks int
	unreliableAcked, fragments, multiAcks                               int
	kinds                                                               map[string]int
	violations                                                          int
	probes                                                              int // path MTU probes seen
}

func (p *spPeer) violation(format string, args ...any) {
	p.t.Helper()
	p.violations++
	if p.violations <= 20 {
		p.t.Errorf("server: "+format, args...)
	}
}

func (p *spPeer) allocPID() uint32 {
	pid := p.nextPID
	p.nextPID = (pid + 1) & spPIDMask
	return pid
}

func (p *spPeer) send(reliable bool, deps []spDep, msgs ...spOut) uint32 {
	pid := p.allocPID()
	p.sendAs(pid, reliable, deps, msgs...)
	return pid
}

func (p *spPeer) sendAs(pid uint32, reliable bool, deps []spDep, msgs ...spOut) {
	b := spAppendDatagram(nil, pid, reliable, deps, msgs)
	now := time.Now()
	p.out[pid] = &spSent{b: b, reliable: reliable, firstSent: now, lastSent: now}
	for _, m := range msgs {
		if spIsApp(m.id) && !m.frag && !m.fragStart {
			p.expected[spKey{m.id, string(m.payload)}] = reliable
		}
	}
	p.write(b)
}

func (p *spPeer) write(b []byte) {
	if _, err := p.conn.Write(b); err != nil {
		p.t.Errorf("client write: %v", err)
	}
}

// queueAck schedules a PacketAck for a reliable server datagram, or holds
// it back while p.holding.
func (p *spPeer) queueAck(now time.Time, pid uint32) {
	if p.holding {
		if !slices.Contains(p.held, pid) {
			p.held = append(p.held, pid)
		}
		return
	}
	if len(p.pending) == 0 {
		p.ackDue = now.Add(spClientAckBatch)
	}
	p.pending = append(p.pending, pid)
}

// releaseAcks stops holding acks back and acks what was held.
func (p *spPeer) releaseAcks() []uint32 {
	held := p.held
	p.holding, p.held = false, nil
	now := time.Now()
	for _, pid := range held {
		p.queueAck(now, pid)
	}
	p.flushAcks(now)
	return held
}

func (p *spPeer) flushAcks(now time.Time) {
	if len(p.pending) == 0 {
		return
	}
	if p.closing {
		p.pending = nil // after Disconnect we may send nothing more
		return
	}
	var msgs []spOut
	for _, pl := range spAckPayloads(p.pending) {
		msgs = append(msgs, spOut{id: spPacketAck, payload: pl})
	}
	p.send(false, nil, msgs...)
	for _, pid := range p.pending {
		if s := p.seen[pid]; s != nil && s.ackedAt.IsZero() {
			s.ackedAt = now
		}
	}
	p.pending = nil
}

// timers acks what is due and resends our reliable datagrams left unacked.
func (p *spPeer) timers(now time.Time) time.Time {
	if len(p.pending) > 0 && !now.Before(p.ackDue) {
		p.flushAcks(now)
	}
	wake := p.deadline
	if len(p.pending) > 0 {
		wake = p.ackDue
	}
	if p.closing {
		return wake
	}
	for _, s := range p.out {
		if !s.reliable || !s.ackedAt.IsZero() {
			continue
		}
		if now.Sub(s.lastSent) >= spClientRTO {
			s.lastSent = now
			p.resends++
			p.write(s.b)
		}
		if w := s.lastSent.Add(spClientRTO); w.Before(wake) {
			wake = w
		}
	}
	return wake
}

// pump reads and handles the server's datagrams for up to d (never past the
// run's deadline), until cond holds. With a nil cond it runs for d and
// reports true.
func (p *spPeer) pump(d time.Duration, cond func() bool) bool {
	end := time.Now().Add(d)
	if end.After(p.deadline) {
		end = p.deadline
	}
	buf := make([]byte, 1<<16)
	for {
		now := time.Now()
		wake := p.timers(now)
		if cond != nil && cond() {
			p.flushAcks(now)
			return true
		}
		if !now.Before(end) {
			p.flushAcks(now)
			return cond == nil
		}
		if end.Before(wake) {
			wake = end
		}
		require.NoError(p.t, p.conn.SetReadDeadline(wake))
		n, err := p.conn.Read(buf)
		if err != nil {
			if !errors.Is(err, os.ErrDeadlineExceeded) {
				// An ICMP error on the connected socket: the server's
				// socket is gone. Nothing more will come.
				p.t.Logf("client read: %v", err)
				time.Sleep(time.Millisecond) // a real socket's error: do not spin on it
			}
			continue
		}
		p.handle(time.Now(), buf[:n])
	}
}

// handle checks one datagram from the server and reacts as a peer would.
func (p *spPeer) handle(now time.Time, raw []byte) {
	b := bytes.Clone(raw)
	p.datagrams++
	p.bytesIn += len(b)
	if len(b) > spMaxDatagramSize {
		p.violation("datagram of %d bytes, above MaxDatagramSize %d", len(b), spMaxDatagramSize)
	}
	d, err := spParseDatagram(b)
	if err != nil {
		p.violation("datagram does not parse: %v\n%s", err, spHex(b))
		return
	}
	if p.discAcks > 0 {
		for _, m := range d.blocks {
			if !m.hasID || m.id != spDisconnectAck {
				p.violation("datagram %d after DisconnectAck carries a %s message (spec: DisconnectAck means no more messages or datagrams)", d.pid, spIDName(m.id))
				break
			}
		}
	}
	if s := p.seen[d.pid]; s != nil {
		s.copies++
		p.retransmits++
		switch {
		case !s.reliable || !d.reliable:
			p.violation("PacketID %d used again by a datagram that is not a retransmission of a reliable one:\nfirst %s\nnow   %s", d.pid, spHex(s.b), spHex(b))
		case !bytes.Equal(s.b, b):
			p.violation("reliable datagram %d resent with other bytes (DECISIONS §4: the same bytes):\nfirst %s\nnow   %s", d.pid, spHex(s.b), spHex(b))
		case !s.ackedAt.IsZero() && now.Sub(s.ackedAt) > spResendGrace:
			s.resentAfterAck++
			p.violation("reliable datagram %d resent %v after we acked it", d.pid, now.Sub(s.ackedAt).Round(time.Millisecond))
		}
		// A duplicate is acked again (DECISIONS §4), but not one that
		// crossed our ack: the server has that ack, and acking again at
		// once would hide a server that misread it.
		if d.reliable && (s.ackedAt.IsZero() || now.Sub(s.ackedAt) > spResendGrace) {
			p.queueAck(now, d.pid)
		}
		return
	}
	// Spec: the PacketID "is incremented by one after sending a packet".
	// Loopback neither loses nor reorders here, so every new datagram
	// follows the previous one, or the one after it: knet skips a
	// PacketID now and then, never two in a row, to catch a peer that
	// acks what it never received (docs/PROTOCOL.md; RFC 9000 §21.4).
	// The send order, which the spec's rule gives the receiver, stays.
	if p.anyNew && d.pid != (p.lastNewPID+1)&spPIDMask {
		if d.pid == (p.lastNewPID+2)&spPIDMask {
			p.skipped++
		} else {
			p.violation("new datagram has PacketID %d after %d", d.pid, p.lastNewPID)
		}
	}
	p.lastNewPID, p.anyNew = d.pid, true
	p.seen[d.pid] = &spSeen{b: b, reliable: d.reliable, blocks: len(d.blocks), copies: 1}
	if d.reliable {
		p.reliableDgs++
	}
	if d.inOrder {
		p.inOrderDgs++
	}
	p.maxBlocks = max(p.maxBlocks, len(d.blocks))
	for i, m := range d.blocks {
		for _, e := range m.entries {
			target := (d.pid - uint32(d.deltas[e]) - 1) & spPIDMask
			t := p.seen[target]
			if t == nil {
				continue // not received (yet): nothing to check against
			}
			if d.indices[e] >= t.blocks {
				p.violation("datagram %d block %d depends on block %d of datagram %d, which has %d blocks", d.pid, i, d.indices[e], target, t.blocks)
			}
			if d.reliable && !t.reliable {
				p.violation("reliable datagram %d depends on unreliable datagram %d (spec: a reliable message can not depend on an unreliable datagram)", d.pid, target)
			}
		}
		p.handleBlock(now, d, m)
	}
	if d.reliable {
		p.queueAck(now, d.pid)
	}
}

func (p *spPeer) handleBlock(now time.Time, d spDatagram, m spBlock) {
	if m.frag || m.fragStart {
		p.fragments++
		if !d.reliable {
			p.violation("fragment in unreliable datagram %d (spec: fragments need reliable datagrams)", d.pid)
		}
		id, payload, done := p.reassemble(d.pid, m)
		if !done {
			return
		}
		if !spIsApp(id) {
			p.violation("%s message sent as a fragmented transfer (spec: connection control messages may not be)", spIDName(id))
		}
		m = spBlock{hasID: true, id: id, payload: payload}
		p.fragEchoes[spKey{id, string(payload)}]++
	}
	p.kinds[spIDName(m.id)]++
	switch id := m.id; {
	case id == spPingRequest:
		if len(m.payload) != 1 {
			p.violation("PingRequest payload %x, want 1 byte", m.payload)
			return
		}
		p.serverPings++
		if !p.closing {
			p.send(false, nil, spOut{id: spPingReply, payload: []byte{m.payload[0]}})
		}
	case id == spPingReply:
		if len(m.payload) != 1 {
			p.violation("PingReply payload %x, want 1 byte", m.payload)
			return
		}
		p.pingReplies[m.payload[0]]++
	case id == spFlowControlRequest:
		if len(m.payload) != 2 {
			p.violation("FlowControlRequest payload %x, want u16", m.payload)
			return
		}
		p.flowReqs = append(p.flowReqs, binary.LittleEndian.Uint16(m.payload))
	case id == spPacketAck:
		pids, err := spParseAck(m.payload)
		if err != nil {
			p.violation("%v: %x", err, m.payload)
			return
		}
		if len(pids) > 1 {
			p.multiAcks++
		}
		for _, pid := range pids {
			s := p.out[pid]
			switch {
			case s == nil:
				p.violation("PacketAck %x names PacketID %d, which we never sent", m.payload, pid)
			case !s.reliable:
				p.unreliableAcked++
			default:
				s.acks++
				if s.ackedAt.IsZero() {
					s.ackedAt = now
				}
			}
		}
	case id == spConnectSynAck:
		p.synAcks = append(p.synAcks, string(m.payload))
	case id == spDisconnectAck:
		if len(m.payload) != 0 {
			p.violation("DisconnectAck with payload %x, want none", m.payload)
		}
		p.discAcks++
	case spIsApp(id):
		k := spKey{id, string(m.payload)}
		if _, ok := p.expected[k]; !ok {
			p.violation("application message %d %q that we never sent", id, m.payload)
		}
		p.echoes[k]++
		if d.reliable {
			p.echoRel[k] = true
		}
	case id == spPadding && spIsProbe(d):
		// A path MTU probe (docs/configuration.md, "Path MTU"): an unreliable datagram
		// of reserved ID 5 blocks, which receivers ignore, and a
		// PingRequest last, so that a receiver that truncates it never
		// answers.
		p.probes++
	default:
		p.violation("message ID %#x (%s) is not one a server sends", id, spIDName(id))
	}
}

// spPadding is the reserved message ID 5 (DECISIONS §2).
const spPadding = 5

// spIsProbe reports whether d is a path MTU probe: unreliable, its last
// block a PingRequest, every other block padding.
func spIsProbe(d spDatagram) bool {
	n := len(d.blocks)
	if d.reliable || n < 2 || d.blocks[n-1].id != spPingRequest {
		return false
	}
	for _, b := range d.blocks[:n-1] {
		if b.id != spPadding || b.frag || b.fragStart {
			return false
		}
	}
	return true
}

// reassemble collects a fragment; it returns the message once complete. It
// checks the transfer against the spec's "Fragmented Transfers" and
// DECISIONS §6.
func (p *spPeer) reassemble(pid uint32, m spBlock) (uint32, []byte, bool) {
	tid := m.transferID
	x := p.frags[tid]
	if x == nil {
		// A new transfer. Its TransferID may be one used before only
		// once every datagram of that transfer has been acked.
		for _, old := range p.fragsDone[tid] {
			if s := p.seen[old]; s.ackedAt.IsZero() {
				p.violation("datagram %d starts a transfer with TransferID %d while datagram %d of its previous transfer is unacked (spec: reused only after all were acknowledged)", pid, tid, old)
				break
			}
		}
		delete(p.fragsDone, tid)
		x = &spTransfer{parts: make(map[uint32][]byte)}
		p.frags[tid] = x
	}
	if !slices.Contains(x.pids, pid) {
		x.pids = append(x.pids, pid)
	}
	if len(m.payload) > spMaxFrag {
		p.violation("datagram %d: fragment of TransferID %d with %d payload bytes, above MaxUDPMessageFragmentSize %d", pid, tid, len(m.payload), spMaxFrag)
	}
	num := m.fragNum
	if m.fragStart {
		if !m.frag {
			p.violation("datagram %d: FragmentStart without the Fragment flag (spec: the first fragment has both)", pid)
		}
		if x.started {
			p.violation("datagram %d: second FragmentStart for TransferID %d", pid, tid)
			return 0, nil, false
		}
		num, x.started, x.count, x.id = 0, true, m.fragCount, m.id
		if m.fragCount < 2 {
			p.violation("datagram %d: FragmentCount %d (DECISIONS §6: at least 2)", pid, m.fragCount)
		}
		for n := range x.parts {
			if n >= x.count {
				p.violation("TransferID %d: FragmentNumber %d came before a FragmentStart with FragmentCount %d", tid, n, x.count)
			}
		}
	} else {
		switch {
		case num == 0:
			p.violation("datagram %d: fragment of TransferID %d numbered 0, the FragmentStart's number", pid, tid)
			return 0, nil, false
		case x.started && num >= x.count:
			p.violation("datagram %d: FragmentNumber %d of TransferID %d, FragmentCount %d", pid, num, tid, x.count)
			return 0, nil, false
		}
	}
	if _, dup := x.parts[num]; dup {
		p.violation("datagram %d: fragment %d of TransferID %d repeated in a new datagram", pid, num, tid)
		return 0, nil, false
	}
	x.parts[num] = m.payload
	if !x.started || uint32(len(x.parts)) < x.count {
		return 0, nil, false
	}
	delete(p.frags, tid)
	p.fragsDone[tid] = x.pids
	var all []byte
	for i := range x.count {
		part, ok := x.parts[i]
		if !ok {
			p.violation("TransferID %d: fragment %d missing, others numbered beyond FragmentCount %d", tid, i, x.count)
			return 0, nil, false
		}
		all = append(all, part...)
	}
	return x.id, all, true
}

func (p *spPeer) acked(pid uint32) func() bool {
	return func() bool { return !p.out[pid].ackedAt.IsZero() }
}

// assertAckedInTime checks that the server acked our datagram pid within
// MaxAckDelay plus slack of its first send.
func (p *spPeer) assertAckedInTime(pid uint32, what string) {
	p.t.Helper()
	s := p.out[pid]
	if !assert.False(p.t, s.ackedAt.IsZero(), "%s (PacketID %d) never acked", what, pid) {
		return
	}
	delay := s.ackedAt.Sub(s.firstSent)
	assert.LessOrEqual(p.t, delay, spAckBound, "%s (PacketID %d) acked after %v; MaxAckDelay is %v", what, pid, delay, spMaxAckDelay)
}

func (p *spPeer) echoed(msgs []spOut) func() bool {
	return func() bool {
		for _, m := range msgs {
			if p.echoes[spKey{m.id, string(m.payload)}] == 0 {
				return false
			}
		}
		return true
	}
}

// quiet reports whether everything is acked both ways and every reliable
// message of ours has come back.
func (p *spPeer) quiet() bool {
	if len(p.pending) > 0 || len(p.held) > 0 {
		return false
	}
	for k, rel := range p.expected {
		if rel && p.echoes[k] == 0 {
			return false
		}
	}
	for _, s := range p.out {
		if s.reliable && s.ackedAt.IsZero() {
			return false
		}
	}
	for _, s := range p.seen {
		if s.reliable && s.ackedAt.IsZero() {
			return false
		}
	}
	return true
}

// disconnect waits until all is quiet, then sends Disconnect in an
// unreliable in-order datagram depending on the messages deps (spec:
// Disconnect is in-order, after every other message), and waits for the
// DisconnectAck and the end of the server application.
func (p *spPeer) disconnect(srv *spServer, deps []spDep) {
	p.t.Helper()
	assert.True(p.t, p.pump(spPatience, p.quiet), "not everything acked before Disconnect")
	entries := make([]int, len(deps))
	for i := range entries {
		entries[i] = i
	}
	p.send(false, deps, spOut{id: spDisconnect, code: 7, multi: entries})
	p.closing = true
	assert.True(p.t, p.pump(spPatience, func() bool { return p.discAcks > 0 }), "no DisconnectAck")
	select {
	case <-srv.done:
	case <-time.After(time.Until(p.deadline)):
	}
	p.pump(200*time.Millisecond, nil) // nothing but DisconnectAck may follow
}

func (p *spPeer) summary() string {
	var kinds []string
	for k, n := range p.kinds {
		kinds = append(kinds, fmt.Sprintf("%s=%d", k, n))
	}
	sort.Strings(kinds)
	return fmt.Sprintf("server sent %d datagrams, %d bytes (%d reliable, %d in-order, %d retransmissions, at most %d blocks in one, %d fragments, %d PacketIDs skipped); messages: %s; %d PacketAcks named several datagrams, FlowControlRequests %v; it pinged %d times, acked %d of our unreliable datagrams; we resent %d",
		p.datagrams, p.bytesIn, p.reliableDgs, p.inOrderDgs, p.retransmits, p.maxBlocks, p.fragments, p.skipped,
		strings.Join(kinds, " "), p.multiAcks, p.flowReqs, p.serverPings, p.unreliableAcked, p.resends)
}

func TestSpecPeer(t *testing.T) {
	for _, tt := range []struct {
		name     string
		firstPID uint32
	}{
		{"FirstPacketID0", 0},
		{"PacketIDWrap", spPIDMask - 2}, // our PacketIDs wrap to 0 during the run
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			spRun(t, tt.firstPID)
		})
	}
}

// spStart starts an echo server on loopback, and a client whose datagrams
// are numbered from firstPID and which gives up at start plus spRunBudget;
// it runs the handshake and returns once the server's Conn is established.
// Closing everything is left to t.Cleanup.
func spStart(t *testing.T, start time.Time, firstPID uint32) (*spPeer, *spServer, *knet.Conn, *knet.Listener) {
	srv := &spServer{done: make(chan struct{}), connCh: make(chan *knet.Conn, 1)}
	cfg := &knet.Config{
		Admit: func(remote net.Addr, payload []byte) ([]byte, error) {
			srv.mu.Lock()
			srv.admits = append(srv.admits, string(payload))
			srv.mu.Unlock()
			return []byte("welcome"), nil
		},
		PingInterval:          spPingInterval,
		MaxAckDelay:           spMaxAckDelay,
		DatagramTimeout:       spDatagramTimeout,
		ConnectionLostTimeout: 5 * time.Second,
		ConnectTimeout:        3 * time.Second,
		DisconnectTimeout:     2 * time.Second,
	}
	l, err := knet.Listen("udp", "127.0.0.1:0", cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), spRunBudget+time.Second)
	go srv.run(ctx, l)

	conn, err := net.DialUDP("udp", nil, l.Addr().(*net.UDPAddr))
	require.NoError(t, err)
	t.Cleanup(func() {
		cancel()
		conn.Close()
		closed := make(chan struct{})
		go func() {
			defer close(closed)
			srv.mu.Lock()
			c := srv.conn
			srv.mu.Unlock()
			if c != nil {
				c.Close()
			}
			l.Close()
		}()
		select {
		case <-closed:
		case <-time.After(2 * time.Second):
			t.Error("closing the server's Conn and Listener took over 2s")
		}
		select {
		case <-srv.done:
		case <-time.After(500 * time.Millisecond):
			t.Error("echo server goroutine still running")
		}
	})

	p := &spPeer{
		t: t, conn: conn, deadline: start.Add(spRunBudget), nextPID: firstPID,
		out: map[uint32]*spSent{}, expected: map[spKey]bool{}, seen: map[uint32]*spSeen{},
		echoes: map[spKey]int{}, echoRel: map[spKey]bool{}, pingReplies: map[byte]int{},
		frags: map[uint8]*spTransfer{}, fragsDone: map[uint8][]uint32{}, fragEchoes: map[spKey]int{},
		kinds: map[string]int{},
	}
	t.Cleanup(func() { t.Log(p.summary()) })

	// 1. Handshake: ConnectSyn with content, ConnectSynAck with the Admit
	// hook's reply, ConnectAck in a reliable datagram.
	p.send(false, nil, spOut{id: spConnectSyn, payload: []byte("hello")})
	// "welcome" is longer than "hello": the server must not answer an
	// endpoint it has not heard back from with more bytes than it received
	// (no reflection amplification), so the answer waits for the ConnectSyn
	// to come again, as a client resends it when no answer comes.
	assert.False(t, p.pump(300*time.Millisecond, func() bool { return len(p.synAcks) > 0 }), "ConnectSynAck larger than the ConnectSyn")
	p.send(false, nil, spOut{id: spConnectSyn, payload: []byte("hello")})
	require.True(t, p.pump(spPatience, func() bool { return len(p.synAcks) > 0 }), "no ConnectSynAck")
	assert.Equal(t, "welcome", p.synAcks[0], "ConnectSynAck content")
	ackPID := p.send(true, nil, spOut{id: spConnectAck})
	var c *knet.Conn
	require.True(t, p.pump(spPatience, func() bool {
		select {
		case c = <-srv.connCh:
			return true
		default:
			return false
		}
	}), "server never accepted the connection")
	syn, synAck := c.Handshake()
	assert.Equal(t, "hello", string(syn), "Handshake syn")
	assert.Equal(t, "welcome", string(synAck), "Handshake synAck")
	require.True(t, p.pump(spPatience, p.acked(ackPID)), "ConnectAck datagram never acked")
	p.assertAckedInTime(ackPID, "ConnectAck datagram")
	return p, srv, c, l
}

func spRun(t *testing.T, firstPID uint32) {
	start := time.Now()
	p, srv, c, l := spStart(t, start, firstPID)

	// 2. One reliable datagram, IDs of every VLE-1.7/1.7/16 width, then
	// fillers so that it holds 130 blocks (an index >= 128 below needs
	// the 2-byte VLE-1.7/8 form).
	aMsgs := []spOut{
		{id: 6, payload: []byte("a-id6")},
		{id: 127, payload: []byte("a-id127")},
		{id: 128, payload: []byte("a-id128")},
		{id: 16383, payload: []byte("a-id16383")},
		{id: 16384, payload: []byte("a-id16384")},
		{id: 100000, payload: []byte("a-id100000")},
		{id: spMaxAppID, payload: []byte("a-idmax")},
	}
	for i := len(aMsgs); i < 130; i++ {
		aMsgs = append(aMsgs, spOut{id: 1000 + uint32(i), payload: fmt.Appendf(nil, "a%03d", i)})
	}
	// 3. Hold our acks back until the server resends one of its reliable
	// datagrams, then ack and check that the resending stops.
	p.holding = true
	aPID := p.send(true, nil, aMsgs...)
	require.LessOrEqual(t, len(p.out[aPID].b), spMaxDatagramSize)
	require.True(t, p.pump(spPatience, p.acked(aPID)), "coalesced datagram never acked")
	p.assertAckedInTime(aPID, "coalesced datagram")
	require.True(t, p.pump(spPatience, p.echoed(aMsgs)), "not every message of the coalesced datagram came back")

	// Still holding our acks: reliable datagrams 15ms apart, each message
	// depending on the one before (a reliable in-order channel), so that
	// the server has several reliable echo datagrams unacked at once and
	// our PacketAck for them uses the base+1/base+2 and u32 bits.
	var chain []spOut
	var chainPIDs []uint32
	prev := spDep{aPID, 7}
	for i := range 6 {
		m := spOut{id: 8100 + uint32(i), payload: fmt.Appendf(nil, "chain%d", i), code: 1}
		pid := p.send(true, []spDep{prev}, m)
		chain, chainPIDs, prev = append(chain, m), append(chainPIDs, pid), spDep{pid, 0}
		p.pump(15*time.Millisecond, nil)
	}
	assert.True(t, p.pump(spPatience, func() bool {
		for _, pid := range chainPIDs {
			if p.out[pid].ackedAt.IsZero() {
				return false
			}
		}
		return true
	}), "chain datagrams not acked")
	for _, pid := range chainPIDs {
		p.assertAckedInTime(pid, "chain datagram")
	}
	require.NotEmpty(t, p.held, "echoes came in no reliable datagram")
	resent := func() bool {
		for _, pid := range p.held {
			if p.seen[pid].copies > 1 {
				return true
			}
		}
		return false
	}
	require.True(t, p.pump(spPatience, resent), "server never resent an unacked reliable datagram (DatagramTimeout %v)", spDatagramTimeout)
	held := p.releaseAcks()
	t.Logf("acked %d held server datagrams %v in %d PacketAcks", len(held), held, len(spAckPayloads(held)))
	p.pump(2*spDatagramTimeout+spResendGrace, nil)
	for _, pid := range held {
		assert.Zero(t, p.seen[pid].resentAfterAck, "server resent datagram %d after our PacketAck", pid)
	}
	// Without acks the server may hold new data back (its rate falls to
	// MinDatagramRate and resends go first), so the chain's echoes are
	// awaited only now.
	assert.True(t, p.pump(spPatience, p.echoed(chain)), "not every message of the chain came back")

	// A duplicate is dropped, but acked again (DECISIONS §4).
	acks := p.out[aPID].acks
	p.write(p.out[aPID].b)
	assert.True(t, p.pump(spPatience, func() bool { return p.out[aPID].acks > acks }), "duplicate of datagram %d not acked again", aPID)

	// 4. PingRequest -> PingReply with the same pingID.
	p.send(false, nil, spOut{id: spPingRequest, payload: []byte{0x5a}})
	assert.True(t, p.pump(spPatience, func() bool { return p.pingReplies[0x5a] > 0 }), "no PingReply for pingID 0x5a")

	// 5. In-order messages naming messages of earlier datagrams. Skip 200
	// PacketIDs first (as if 200 unreliable datagrams were lost), so that
	// the deltas need the 2-byte VLE-1.7/8 form.
	p.nextPID = (p.nextPID + 200) & spPIDMask
	bDeps := []spDep{{aPID, 0}, {aPID, 1}, {aPID, 2}, {aPID, 3}, {aPID, 4}, {aPID, 129}, {aPID, 128}}
	bMsgs := []spOut{
		{id: 8000, payload: []byte("b-code1"), code: 1},
		{id: 8001, payload: []byte("b-code2"), code: 2},
		{id: 8002, payload: []byte("b-code3"), code: 3},
		{id: 8003, payload: []byte("b-code4"), code: 4},
		{id: 8004, payload: []byte("b-code5"), code: 5},
		{id: 8005, payload: []byte("b-code6"), code: 6, single: 5},
		{id: 8006, payload: []byte("b-code7"), code: 7, multi: []int{6, 0}},
		{id: 8007, payload: []byte("b-free")},
		{id: 8008, payload: []byte("b-code7-one"), code: 7, multi: []int{5}},
	}
	bPID := p.send(true, bDeps, bMsgs...)
	require.GreaterOrEqual(t, (bPID-aPID-1)&spPIDMask, uint32(128))
	require.True(t, p.pump(spPatience, p.acked(bPID)), "in-order datagram never acked")
	p.assertAckedInTime(bPID, "in-order datagram")
	assert.True(t, p.pump(spPatience, p.echoed(bMsgs)), "not every in-order message came back")

	// Reordering: D2 depends on D1, which we send after D2. What D2 holds
	// without a dependency on D1 is delivered at once; the rest waits.
	d1PID, d2PID := p.allocPID(), p.allocPID()
	d1Msgs := []spOut{{id: 9100, payload: []byte("d1-a")}, {id: 9101, payload: []byte("d1-b")}}
	d2Msgs := []spOut{
		{id: 9000, payload: []byte("d2-free")},
		{id: 9001, payload: []byte("d2-after-d1a"), code: 1},
		{id: 9002, payload: []byte("d2-after-d1ab"), code: 7, multi: []int{0, 1}},
		{id: 9003, payload: []byte("d2-after-b"), code: 6, single: 2},
	}
	p.sendAs(d2PID, true, []spDep{{d1PID, 0}, {d1PID, 1}, {bPID, 3}}, d2Msgs...)
	require.True(t, p.pump(spPatience, p.acked(d2PID)), "datagram D2 never acked")
	p.assertAckedInTime(d2PID, "datagram D2")
	assert.True(t, p.pump(spPatience, func() bool { return srv.got(9000, "d2-free") && srv.got(9003, "d2-after-b") }),
		"messages of D2 whose dependencies are met were not delivered while D1 was missing")
	p.pump(150*time.Millisecond, nil)
	assert.False(t, srv.got(9001, "d2-after-d1a"), "delivered before the message it depends on")
	assert.False(t, srv.got(9002, "d2-after-d1ab"), "delivered before the messages it depends on")
	p.sendAs(d1PID, true, nil, d1Msgs...)
	require.True(t, p.pump(spPatience, p.acked(d1PID)), "datagram D1 never acked")
	p.assertAckedInTime(d1PID, "datagram D1")
	assert.True(t, p.pump(spPatience, p.echoed(append(slices.Clone(d1Msgs), d2Msgs...))), "not every message of D1 and D2 came back")

	// An unreliable message depending on a reliable one.
	e := spOut{id: 7000, payload: []byte("e-unreliable"), code: 1}
	ePID := p.send(false, []spDep{{d2PID, 2}}, e)
	assert.True(t, p.pump(spPatience, func() bool { return srv.got(e.id, string(e.payload)) }), "unreliable in-order message not delivered")
	p.pump(100*time.Millisecond, func() bool { return p.echoes[spKey{e.id, string(e.payload)}] > 0 })

	// 6. Close once everything is acked both ways: Disconnect in an
	// in-order datagram, after our last messages.
	p.disconnect(srv, []spDep{{d2PID, 2}, {ePID, 0}})

	// The server application's view.
	srv.mu.Lock()
	got, eof, eofAt, srvErr, admits := slices.Clone(srv.msgs), srv.eof, srv.eofAt, srv.err, slices.Clone(srv.admits)
	srv.mu.Unlock()
	assert.Equal(t, []string{"hello"}, admits, "Admit hook calls")
	assert.NoError(t, srvErr, "server application")
	assert.True(t, eof, "server application never saw io.EOF")
	assert.Equal(t, len(p.expected), eofAt, "messages received before io.EOF")
	inOrder := map[spKey]bool{}
	for _, ms := range [][]spOut{bMsgs, chain, d1Msgs, d2Msgs, {e}} {
		for _, m := range ms {
			inOrder[spKey{m.id, string(m.payload)}] = m.code != 0
		}
	}
	for k, rel := range p.expected {
		at := srv.find(k.id, k.payload)
		if !assert.Len(t, at, 1, "server deliveries of %d %q", k.id, k.payload) {
			continue
		}
		m := got[at[0]]
		assert.Equal(t, rel, m.Reliable, "Reliable of %d %q", k.id, k.payload)
		assert.Equal(t, inOrder[k], m.InOrder, "InOrder of %d %q", k.id, k.payload)
		if rel {
			assert.Equal(t, 1, p.echoes[k], "echoes of %d %q", k.id, k.payload)
			assert.True(t, p.echoRel[k], "echo of reliable %d %q not in a reliable datagram", k.id, k.payload)
		} else {
			assert.LessOrEqual(t, p.echoes[k], 1, "echoes of %d %q", k.id, k.payload)
		}
	}
	// Blocks of one datagram are processed in order; dependencies hold.
	pos := func(m spOut) int {
		at := srv.find(m.id, string(m.payload))
		if len(at) == 0 {
			return -1
		}
		return at[0]
	}
	for i := 1; i < len(aMsgs); i++ {
		if !assert.Less(t, pos(aMsgs[i-1]), pos(aMsgs[i]), "coalesced messages %d and %d delivered out of order", i-1, i) {
			break
		}
	}
	for i := 1; i < len(chain); i++ {
		assert.Less(t, pos(chain[i-1]), pos(chain[i]), "in-order chain")
	}
	assert.Less(t, pos(d1Msgs[0]), pos(d2Msgs[1]))
	assert.Less(t, pos(d1Msgs[0]), pos(d2Msgs[2]))
	assert.Less(t, pos(d1Msgs[1]), pos(d2Msgs[2]))
	assert.Less(t, pos(d2Msgs[2]), pos(e))

	assert.Equal(t, 1, p.discAcks, "DisconnectAcks")
	assert.Positive(t, p.serverPings, "server sent no PingRequest in %v with PingInterval %v", time.Since(start), spPingInterval)
	assert.Len(t, p.synAcks, 1, "ConnectSynAcks")
	assert.Zero(t, p.violations, "spec violations by the server")
	st := c.Stats()
	assert.Zero(t, st.InvalidDatagrams, "server found our datagrams invalid")
	assert.Zero(t, st.ProtocolErrors, "server found protocol errors in our datagrams")
	assert.Positive(t, st.DuplicateDatagrams, "server counted no duplicate")
	assert.Zero(t, l.Stats().InvalidDatagrams, "listener found our datagrams invalid")
	t.Logf("run took %v; server stats %+v", time.Since(start).Round(time.Millisecond), st)
}

// TestSpecPeerFragments sends the server fragmented transfers the way the
// spec allows them to arrive (spec "Fragmented Transfers", DECISIONS §6):
// fragments before their FragmentStart, and a fragment datagram twice.
func TestSpecPeerFragments(t *testing.T) {
	for _, tt := range []struct {
		name     string
		firstPID uint32
	}{
		{"FirstPacketID0", 0},
		{"PacketIDWrap", spPIDMask - 3}, // the fragments' PacketIDs wrap to 0
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			spRunFragments(t, tt.firstPID)
		})
	}
}

func spRunFragments(t *testing.T, firstPID uint32) {
	start := time.Now()
	seed := uint64(start.UnixNano())
	t.Logf("payload seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0x6b4e6574))
	random := func(n int) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		return b
	}
	p, srv, c, l := spStart(t, start, firstPID)

	// 1. One message in three fragments, each in its own reliable
	// datagram, sent last fragment first. The PacketIDs follow the
	// fragments, as if the path had reordered the datagrams. Its echo,
	// 3+2+2+1400 bytes as one block, does not fit a datagram of
	// MaxDatagramSize: the server must fragment it too.
	big := spOut{id: 300, payload: random(1400)}
	const bigTID = 7
	bigFrags := spFragments(big.id, big.payload, bigTID, spMaxFrag)
	require.Len(t, bigFrags, 3)
	bigKey := spKey{big.id, string(big.payload)}
	p.expected[bigKey] = true
	bigPIDs := []uint32{p.allocPID(), p.allocPID(), p.allocPID()}
	for _, i := range []int{2, 1} {
		p.sendAs(bigPIDs[i], true, nil, bigFrags[i])
		require.True(t, p.pump(spPatience, p.acked(bigPIDs[i])), "datagram %d with fragment %d never acked", bigPIDs[i], i)
		p.assertAckedInTime(bigPIDs[i], fmt.Sprintf("datagram with fragment %d", i))
	}
	p.pump(50*time.Millisecond, nil)
	assert.False(t, srv.got(big.id, string(big.payload)), "message delivered before its FragmentStart arrived")
	p.sendAs(bigPIDs[0], true, nil, bigFrags[0])
	require.True(t, p.pump(spPatience, p.acked(bigPIDs[0])), "datagram %d with the FragmentStart never acked", bigPIDs[0])
	p.assertAckedInTime(bigPIDs[0], "datagram with the FragmentStart")
	require.True(t, p.pump(spPatience, p.echoed([]spOut{big})), "the 3-fragment message of %d bytes never came back", len(big.payload))
	assert.Equal(t, 1, p.fragEchoes[bigKey], "echo of the %d-byte message as a fragmented transfer", len(big.payload))

	// 2. A second transfer, reusing the TransferID now that every datagram
	// of the first is acked (spec: reuse only after that). Its middle
	// fragment's datagram comes twice with the same PacketID while the
	// transfer is incomplete, and its FragmentStart's datagram again once
	// the message is delivered. Both duplicates are dropped and acked
	// again (DECISIONS §4); the message is delivered exactly once.
	dup := spOut{id: 301, payload: random(1100)}
	dupFrags := spFragments(dup.id, dup.payload, bigTID, spMaxFrag)
	require.Len(t, dupFrags, 3)
	dupKey := spKey{dup.id, string(dup.payload)}
	p.expected[dupKey] = true
	var dupPIDs []uint32
	for i, f := range dupFrags {
		pid := p.send(true, nil, f)
		dupPIDs = append(dupPIDs, pid)
		require.True(t, p.pump(spPatience, p.acked(pid)), "datagram %d with fragment %d never acked", pid, i)
		p.assertAckedInTime(pid, fmt.Sprintf("datagram with fragment %d", i))
		if i == 1 {
			acks := p.out[pid].acks
			p.write(p.out[pid].b)
			assert.True(t, p.pump(spPatience, func() bool { return p.out[pid].acks > acks }), "duplicate of datagram %d (fragment 1) not acked again", pid)
		}
	}
	require.True(t, p.pump(spPatience, p.echoed([]spOut{dup})), "the message with a duplicated fragment never came back")
	acks := p.out[dupPIDs[0]].acks
	p.write(p.out[dupPIDs[0]].b)
	assert.True(t, p.pump(spPatience, func() bool { return p.out[dupPIDs[0]].acks > acks }), "late duplicate of datagram %d (FragmentStart) not acked again", dupPIDs[0])

	// 3. Disconnect, depending on both messages: the index of a
	// fragmented message is that of its FragmentStart block (DECISIONS §5).
	p.disconnect(srv, []spDep{{bigPIDs[0], 0}, {dupPIDs[0], 0}})

	srv.mu.Lock()
	got, eof, eofAt, srvErr := slices.Clone(srv.msgs), srv.eof, srv.eofAt, srv.err
	srv.mu.Unlock()
	assert.NoError(t, srvErr, "server application")
	assert.True(t, eof, "server application never saw io.EOF")
	assert.Equal(t, 2, eofAt, "messages received before io.EOF")
	for _, m := range []spOut{big, dup} {
		at := srv.find(m.id, string(m.payload))
		if assert.Len(t, at, 1, "server deliveries of message %d (%d bytes)", m.id, len(m.payload)) {
			assert.True(t, got[at[0]].Reliable, "a fragmented transfer is reliable: message %d", m.id)
			assert.False(t, got[at[0]].InOrder, "message %d had no dependency", m.id)
		}
		k := spKey{m.id, string(m.payload)}
		assert.Equal(t, 1, p.echoes[k], "echoes of message %d", m.id)
		assert.True(t, p.echoRel[k], "echo of message %d not in a reliable datagram", m.id)
	}
	for i, m := range got {
		if m.ID != big.id && m.ID != dup.id {
			t.Errorf("server delivered message %d: ID %d, %d bytes, which we never sent", i, m.ID, len(m.Payload))
		}
	}
	assert.Empty(t, p.frags, "server transfers left unfinished")
	assert.Zero(t, p.violations, "spec violations by the server")
	assert.Equal(t, 1, p.discAcks, "DisconnectAcks")
	st := c.Stats()
	assert.Zero(t, st.InvalidDatagrams, "server found our datagrams invalid")
	assert.Zero(t, st.ProtocolErrors, "server found protocol errors in our datagrams")
	assert.GreaterOrEqual(t, st.DuplicateDatagrams, uint64(2), "server counted fewer duplicates than the two we sent")
	assert.Zero(t, l.Stats().InvalidDatagrams, "listener found our datagrams invalid")
	t.Logf("run took %v; server stats %+v", time.Since(start).Round(time.Millisecond), st)
}
