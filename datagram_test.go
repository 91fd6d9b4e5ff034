package knet

import (
	"encoding/hex"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func unhex(t testing.TB, s string) []byte {
	t.Helper()
	b, err := hex.DecodeString(strings.ReplaceAll(s, " ", ""))
	require.NoError(t, err)
	return b
}

// Vectors worked out by hand from the spec's layouts and DECISIONS §3.
func TestDatagramVectors(t *testing.T) {
	for _, tt := range []struct {
		name string
		d    datagram
		hex  string
	}{{
		name: "empty unreliable",
		d:    datagram{header: header{packetID: 0}},
		hex:  "000000",
	}, {
		// PacketID 1 | Reliable (bit 22) = 0x400001.
		name: "reliable, one message ID 10 payload hi",
		d:    datagram{header: header{packetID: 1, reliable: true}, msgs: []message{{id: 10, payload: []byte("hi")}}},
		hex:  "010040 0300 0a6869",
	}, {
		// 0x3FFFFF | Reliable | InOrder = 0xFFFFFF, no dependency entries.
		name: "highest PacketID, both flags, zero entries",
		d:    datagram{header: header{packetID: packetIDMask, reliable: true, inOrder: true}},
		hex:  "ffffff 00",
	}, {
		// InOrder datagram 5: entries (delta 0, index 3), (delta 200, index 1);
		// 200 in VLE-1.7/8 is c8 01. Messages: code 1 (entry 0), code 6
		// naming entry 1, code 7 naming entries 0 and 1.
		name: "InOrder codes 1, 6 and 7",
		d: datagram{
			header: header{packetID: 5, inOrder: true, deltas: []uint16{0, 200}, indices: []uint16{3, 1}},
			msgs: []message{
				{id: 6, order: 1},
				{id: 6, order: orderSingle, orderIndex: 1},
				{id: 6, order: orderMulti, orderMulti: []byte{0, 1}},
			},
		},
		hex: "050080 02 00c801 0301" +
			" 0108 06" + // u16 = 1 | 1<<11
			" 0130 01 06" + // u16 = 1 | 6<<11, SingleInOrderIndex 1
			" 0138 02 0001 06", // u16 = 1 | 7<<11, MIO 2, [0 1]
	}, {
		name: "every MessageID width",
		d: datagram{header: header{packetID: 2}, msgs: []message{
			{id: 127}, {id: 300}, {id: 100000, payload: []byte("x")},
		}},
		hex: "020000 0100 7f 0200 ac02 0500 a08d0600 78",
	}, {
		// FragmentStart: bits 15 and 14, ContentLength 3 (ID 6 + "ab"),
		// FragmentCount 3, TransferID 7. Then fragment 2 of the same
		// transfer: bit 14, ContentLength 2, TransferID 7, FragmentNumber 2.
		name: "fragments",
		d: datagram{header: header{packetID: 9, reliable: true}, msgs: []message{
			{id: 6, fragStart: true, fragment: true, fragCount: 3, transferID: 7, payload: []byte("ab")},
			{fragment: true, transferID: 7, fragNumber: 2, payload: []byte("cd")},
		}},
		hex: "090040 03c0 03 07 06 6162 0240 07 02 6364",
	}, {
		name: "connection control",
		d: datagram{header: header{packetID: 0x12345, inOrder: true}, msgs: []message{
			{id: idDisconnect}, {id: idDisconnectAck}, {id: idConnectSyn, payload: []byte{1}},
			{id: idConnectSynAck}, {id: idConnectAck},
		}},
		hex: "452381 00 0400ffffffff 0400feffffff 0500fdffffff01 0400fcffffff 0400fbffffff",
	}, {
		name: "ping, reply, flow control",
		d: datagram{header: header{packetID: 3}, msgs: []message{
			{id: idPingRequest, payload: []byte{7}},
			{id: idPingReply, payload: []byte{7}},
			{id: idFlowControlRequest, payload: []byte{0x2c, 0x01}}, // 300 datagrams/s
		}},
		hex: "030000 0200 0107 0200 0207 0300 032c01",
	}} {
		t.Run(tt.name, func(t *testing.T) {
			want := unhex(t, tt.hex)
			got := appendDatagram(nil, &tt.d)
			assert.Equal(t, hex.EncodeToString(want), hex.EncodeToString(got))
			d, n, err := parseDatagram(want)
			require.NoError(t, err)
			assert.Equal(t, len(want), n)
			assert.Equal(t, normalize(tt.d), normalize(d))
		})
	}
}

// normalize makes parsed and built datagrams comparable: nil and empty
// slices alike.
func normalize(d datagram) datagram {
	if len(d.deltas) == 0 {
		d.deltas, d.indices = nil, nil
	}
	for i := range d.msgs {
		m := &d.msgs[i]
		if len(m.payload) == 0 {
			m.payload = nil
		}
		if len(m.orderMulti) == 0 {
			m.orderMulti = nil
		}
	}
	if len(d.msgs) == 0 {
		d.msgs = nil
	}
	return d
}

func TestParseDatagramErrors(t *testing.T) {
	for _, tt := range []struct {
		name string
		hex  string
		err  error
	}{
		{"short header", "0000", errShortHeader},
		{"InOrder without count", "000080", errShortDeps},
		{"count beyond the bytes", "000080 03 0000", errShortDeps},
		{"delta cut short", "000080 01 80", errShortDeps},
		{"index cut short", "000080 01 00 80", errShortDeps},
		{"message of one byte", "000000 05", errShortMessage},
		{"ContentLength past the end", "000000 0500 0a", errContentOverflow},
		{"no MessageID in an empty content", "000000 0000", errMissingMessageID},
		{"MessageID cut by ContentLength", "000000 0200 8080 0000", errMissingMessageID},
		{"SingleInOrderIndex missing", "000080 01 00 00 0130", errShortMessage},
		{"MultiInOrder array cut", "000080 01 00 00 0138 03 00", errShortMessage},
		{"FragmentCount missing", "000040 01c0", errShortMessage},
		{"TransferID missing", "000040 0140", errShortMessage},
		{"FragmentNumber missing", "000040 0140 07", errShortMessage},
		{"code 3 with one entry", "000080 01 00 00 0118 06", errDepIndexRange},
		{"code 6 index beyond", "000080 01 00 00 0130 01 06", errDepIndexRange},
		{"code 7 index beyond", "000080 01 00 00 0138 02 0001 06", errDepIndexRange},
		{"InOrder code without the flag", "000000 0108 06", errDepNoInOrder},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, _, err := parseDatagram(unhex(t, tt.hex))
			assert.ErrorIs(t, err, tt.err)
		})
	}
}

func TestParseHeaderDoesNotTrustCount(t *testing.T) {
	// A count of 255 with two bytes behind it must be refused before any
	// slice grows by it.
	var h header
	_, err := parseHeader(unhex(t, "000080 ff 0000"), &h)
	require.ErrorIs(t, err, errShortDeps)
	assert.Zero(t, cap(h.deltas))
}

func TestPacketAckVectors(t *testing.T) {
	for _, tt := range []struct {
		name string
		ids  []uint32
		hex  string
	}{
		{"base alone", []uint32{5}, "050000 00000000"},
		// base+1 and base+2 ride in bits 22 and 23 of the u24.
		{"base+1, base+2", []uint32{5, 6, 7}, "0500c0 00000000"},
		// base+3 is bit 0 of the u32; base+34 is bit 31.
		{"base+3 and base+34", []uint32{5, 8, 39}, "050000 01000080"},
		{"all 35", seqIDs(100, 35), "6400c0 ffffffff"},
		{"wraps past 2^22-1", []uint32{packetIDMask, 0, 1}, "ffffff 00000000"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var q ackQueue
			for _, id := range tt.ids {
				q.add(timeZero, id)
			}
			acks := q.take(nil, 10)
			require.Len(t, acks, 1)
			got := appendPacketAck(nil, acks[0])
			assert.Equal(t, strings.ReplaceAll(tt.hex, " ", ""), hex.EncodeToString(got))
			a, ok := parsePacketAck(got)
			require.True(t, ok)
			var back []uint32
			a.each(func(id uint32) { back = append(back, id) })
			assert.Equal(t, tt.ids, back)
		})
	}
	_, ok := parsePacketAck(make([]byte, 6))
	assert.False(t, ok)
	_, ok = parsePacketAck(make([]byte, 8))
	assert.False(t, ok)
}

func seqIDs(from uint32, n int) []uint32 {
	ids := make([]uint32, n)
	for i := range ids {
		ids[i] = (from + uint32(i)) & packetIDMask
	}
	return ids
}

func TestSeqArithmetic(t *testing.T) {
	assert.True(t, seqLess(1, 2))
	assert.False(t, seqLess(2, 1))
	assert.False(t, seqLess(5, 5))
	assert.True(t, seqLess(packetIDMask, 0), "wrap")
	assert.True(t, seqLess(packetIDMask-10, 20), "wrap")
	assert.Equal(t, int32(1), seqDiff(packetIDMask, 0))
	assert.Equal(t, int32(-1), seqDiff(0, packetIDMask))
	assert.Equal(t, int32(1<<21-1), seqDiff(0, 1<<21-1))
}

func sampleDatagram() datagram {
	return datagram{
		header: header{packetID: 77, reliable: true, inOrder: true, deltas: []uint16{0, 300}, indices: []uint16{1, 0}},
		msgs: []message{
			{id: 6, payload: []byte("hello"), order: 1},
			{id: 16384, payload: []byte("world"), order: orderMulti, orderMulti: []byte{0, 1}},
			{id: 9, fragStart: true, fragment: true, fragCount: 2, transferID: 3, payload: []byte("frag")},
			{fragment: true, transferID: 3, fragNumber: 1, payload: []byte("ment")},
			{id: idPacketAck, payload: appendPacketAck(nil, packetAck{base: 70, more: 5})},
		},
	}
}

func FuzzParseDatagram(f *testing.F) {
	d := sampleDatagram()
	f.Add(appendDatagram(nil, &d))
	f.Add(unhex(f, "050080 02 00c801 0301 0108 06 0130 01 06 0138 02 0001 06"))
	f.Add(unhex(f, "090040 03c0 03 07 06 6162 0240 07 02 6364"))
	f.Add(unhex(f, "452381 00 0400ffffffff"))
	f.Fuzz(func(t *testing.T, b []byte) {
		d, n, err := parseDatagram(b)
		if err != nil {
			return // refusing is fine; panicking is not
		}
		require.Equal(t, len(b), n)
		again, _, err := parseDatagram(appendDatagram(nil, &d))
		require.NoError(t, err)
		require.Equal(t, normalize(d), normalize(again))
	})
}
