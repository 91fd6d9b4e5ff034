package knet

import (
	"encoding/hex"
	"strings"
	"testing"
)

func mustHex(t testing.TB, s string) []byte {
	t.Helper()
	b, err := hex.DecodeString(s)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestDescribeDatagram decodes hand-encoded datagrams of both dialects
// and checks that the description names their fields.
func TestDescribeDatagram(t *testing.T) {
	// A spec datagram with dependencies: PacketID 20, reliable and
	// in order, two entries (20-0-1 = 19 message 0, 20-2-1 = 17 message 3),
	// then a message depending on entry 1 (code 2), ID 100, "hi".
	deps := appendDatagram(nil, &datagram{
		header: header{packetID: 20, reliable: true, inOrder: true, deltas: []uint16{0, 2}, indices: []uint16{0, 3}},
		msgs:   []message{{id: 100, payload: []byte("hi"), order: 2}},
	})
	frags := appendDatagram(nil, &datagram{
		header: header{packetID: 7, reliable: true},
		msgs: []message{
			{id: 300, fragStart: true, fragment: true, fragCount: 4, transferID: 9, payload: []byte("abc")},
			{fragment: true, transferID: 9, fragNumber: 2, payload: []byte("defg")},
		},
	})
	tests := []struct {
		name string
		b    []byte
		d    Dialect
		want []string
	}{
		{"spec message", []byte("m\x00@\x06\x00\x06hello"), DialectSpec,
			// 0x40006d: PacketID 0x6d, Reliable; block 0x0006: ContentLength 6; ID 6.
			[]string{"spec PacketID=109 reliable", "11 bytes", `ID=6 len=5 "hello"`}},
		{"spec auto", []byte("m\x00@\x06\x00\x06hello"), DialectAuto,
			[]string{"spec PacketID=109 reliable", `ID=6 len=5 "hello"`}},
		{"spec PacketAck", []byte{
			0x03, 0x00, 0x00, // PacketID 3, unreliable
			0x08, 0x00, 0x04, // ContentLength 8, ID 4 (PacketAck)
			0x07, 0x00, 0x80, 0x02, 0x00, 0x00, 0x00, // base 7, bit 23: base+2; u32 bit 1: base+3+1
		}, DialectSpec, []string{"spec PacketID=3,", "PacketAck acks=7,9,11"}},
		{"spec PacketAck run", appendDatagram(nil, &datagram{msgs: []message{
			{id: idPacketAck, payload: appendPacketAck(nil, packetAck{base: 10, more: 0b1011})}}}),
			DialectSpec, []string{"PacketAck acks=10-12,14"}},
		{"spec ping and ConnectSyn", appendDatagram(nil, &datagram{
			header: header{packetID: 1, reliable: true},
			msgs: []message{
				{id: idConnectSyn, payload: []byte("echo client")},
				{id: idPingRequest, payload: []byte{5}},
				{id: idFlowControlRequest, payload: []byte{0x2c, 0x01}},
			}}), DialectSpec,
			[]string{"PacketID=1 reliable", `ConnectSyn len=11 "echo client"`, "PingRequest ping=5", "FlowControlRequest rate=300"}},
		{"spec dependencies", deps, DialectSpec,
			[]string{"PacketID=20 reliable inorder deps=[19#0 17#3]", `ID=100 len=2 "hi" after=[17#3]`}},
		{"spec fragments", frags, DialectSpec,
			[]string{"fragment start transfer=9 count=4 ID=300 len=3", "fragment transfer=9 number=2 len=4"}},
		{"spec padded ConnectSyn", appendPadding(appendDatagram(nil, &datagram{msgs: []message{{id: idConnectSyn}}}), 100),
			DialectSpec, []string{"spec PacketID=0, 100 bytes: ConnectSyn; Padding len=88"}},
		{"spec ack request", appendDatagram(nil, &datagram{header: header{packetID: 9}, msgs: []message{{id: 100, payload: []byte{1}}, {id: idExt, payload: ackRequest[:]}}}),
			DialectSpec, []string{"ack-request"}},
		{"spec drain notice", appendDatagram(nil, &datagram{header: header{packetID: 9, inOrder: true}, msgs: []message{{id: idExt, payload: drainNotice[:]}, {id: idDisconnect, payload: []byte("bye")}}}),
			DialectSpec, []string{"drain-notice", `Disconnect len=3 "bye"`}},
		{"spec close code", appendMessage(appendCloseCode(appendHeader(nil, &header{packetID: 9, inOrder: true}), 4003), &message{id: idDisconnect, payload: []byte("bye")}),
			DialectSpec, []string{"close-code=4003", `Disconnect len=3 "bye"`}},
		{"spec binary payload", appendDatagram(nil, &datagram{msgs: []message{{id: 200, payload: []byte{0, 1, 0xff}}}}),
			DialectSpec, []string{"ID=200 len=3 hex:0001ff"}},
		{"spec truncated", []byte{0x01, 0x00, 0x00, 0x09, 0x00, 0x64}, DialectSpec,
			[]string{"spec PacketID=1", "malformed: knet: ContentLength runs past the datagram"}},
		{"spec short", []byte{0x01}, DialectSpec, []string{"spec, 1 bytes: malformed"}},
		{"server query", appendQueryDatagram(nil, queryKindQuery, testNonce(1), nil, queryPadTo),
			DialectSpec, []string{"spec PacketID=0, 1200 bytes: Padding server query nonce=0102030405060708 padding=1180"}},
		{"query answer", appendQueryDatagram(nil, queryKindAnswer, testNonce(1), []byte("map=e1m1"), 0),
			DialectSpec, []string{`spec PacketID=0, 28 bytes: Padding query answer nonce=0102030405060708 info len=8 "map=e1m1"`}},
		{"reference opening", make([]byte, 8), DialectAuto, []string{"reference opening"}},
		{"reference opening as spec", make([]byte, 8), DialectSpec, []string{"malformed", "reference dialect's connection opening"}},
		// refclient_echo #1: two PingRequests, InOrder.
		{"reference pings", mustHex(t, "8100000220010102200102"), DialectReference,
			[]string{"reference PacketID=1 inorder, 11 bytes", "PingRequest ping=1 inorder; PingRequest ping=2 inorder"}},
		{"reference pings auto", mustHex(t, "8100000220010102200102"), DialectAuto,
			[]string{"reference PacketID=1 inorder", "PingRequest ping=1"}},
		// refclient_echo #7, its first two messages: reliable, base 0.
		{"reference reliable", mustHex(t, "44000000001410000b52322d302d72656c6961626c652d736d616c6c1410010b52322d312d72656c6961626c652d736d616c6c"),
			DialectReference,
			[]string{"reference PacketID=4 reliable relbase=0", `ID=11 len=19 "R2-0-reliable-small" rel=0`, `rel=1`}},
		// A reference PacketAck: base 5, u32 bit 0 and 2: 6 and 8.
		{"reference PacketAck", []byte{0x82, 0x00, 0x00, 0x08, 0x20, 0x04, 0x05, 0x00, 0x00, 0x05, 0x00, 0x00, 0x00},
			DialectReference, []string{"reference PacketID=2 inorder", "PacketAck acks=5-6,8 inorder"}},
		{"reference reserved bit", []byte{0x01, 0x00, 0x00, 0x01, 0x08, 0x0a}, DialectReference,
			[]string{"reference PacketID=1", "malformed: knet: reference message block with its reserved bit set"}},
		{"invalid both", []byte{0x01, 0x00, 0x00, 0x01, 0x08}, DialectAuto, []string{"invalid in both dialects", "spec", "reference"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			orig := append([]byte(nil), tt.b...)
			got := DescribeDatagram(tt.b, tt.d)
			t.Log(got)
			for _, w := range tt.want {
				if !strings.Contains(got, w) {
					t.Errorf("DescribeDatagram(%x, %v) = %q, want it to contain %q", tt.b, tt.d, got, w)
				}
			}
			if string(orig) != string(tt.b) {
				t.Errorf("DescribeDatagram changed its input")
			}
		})
	}
}

// FuzzDescribeDatagram checks that any bytes in any dialect, even one out
// of range, give a description and no panic.
func FuzzDescribeDatagram(f *testing.F) {
	f.Add([]byte("m\x00@\x06\x00\x06hello"), uint8(DialectAuto))
	f.Add(make([]byte, 8), uint8(DialectAuto))
	f.Add([]byte{0x81, 0x00, 0x00, 0x02, 0x20, 0x01, 0x01}, uint8(DialectReference))
	f.Add(appendDatagram(nil, &datagram{
		header: header{packetID: 20, reliable: true, inOrder: true, deltas: []uint16{0, 2}, indices: []uint16{0, 3}},
		msgs:   []message{{id: 100, payload: []byte("hi"), order: orderMulti, orderMulti: []byte{0, 1, 7}}},
	}), uint8(DialectSpec))
	f.Fuzz(func(t *testing.T, b []byte, d uint8) {
		s := DescribeDatagram(b, Dialect(d))
		if s == "" {
			t.Fatal("empty description")
		}
	})
}
