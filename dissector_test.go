package knet

import (
	"bytes"
	"encoding/binary"
	"encoding/xml"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"

	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/netsim"
	"github.com/knet-go/knet/internal/testtool"
)

// The Wireshark dissector (tools/wireshark/knet.lua) against the codec:
// datagrams the library builds, in both dialects, and every datagram of
// the reference captures are written to a pcap, run through tshark, and
// each decoded field must equal what the Go codec reads from the same
// bytes.

const dissectorScript = "tools/wireshark/knet.lua"

// tshark returns the path of tshark; without it, the test skips (fails
// with KNET_REQUIRE_TOOLS=1: internal/testtool).
func tshark(t *testing.T) string {
	t.Helper()
	return testtool.Need(t, "tshark", "apt-get install tshark")
}

// pcapWriter writes LINKTYPE_RAW (101) records, an IPv4 and UDP header
// before each payload.
type pcapWriter struct {
	buf bytes.Buffer
	at  time.Duration
}

func newPcap() *pcapWriter {
	w := &pcapWriter{}
	hdr := make([]byte, 24)
	binary.LittleEndian.PutUint32(hdr[0:], 0xa1b2c3d4)
	binary.LittleEndian.PutUint16(hdr[4:], 2)
	binary.LittleEndian.PutUint16(hdr[6:], 4)
	binary.LittleEndian.PutUint32(hdr[16:], 65535)
	binary.LittleEndian.PutUint32(hdr[20:], 101)
	w.buf.Write(hdr)
	return w
}

// add writes one UDP datagram from port src to port dst on 127.0.0.1.
func (w *pcapWriter) add(src, dst uint16, payload []byte) {
	w.at += time.Millisecond
	ip := make([]byte, 28, 28+len(payload))
	ip[0] = 0x45
	binary.BigEndian.PutUint16(ip[2:], uint16(28+len(payload)))
	ip[8] = 64
	ip[9] = 17 // UDP
	copy(ip[12:], []byte{127, 0, 0, 1})
	copy(ip[16:], []byte{127, 0, 0, 1})
	var sum uint32
	for i := 0; i < 20; i += 2 {
		sum += uint32(binary.BigEndian.Uint16(ip[i:]))
	}
	for sum > 0xffff {
		sum = sum&0xffff + sum>>16
	}
	binary.BigEndian.PutUint16(ip[10:], ^uint16(sum))
	binary.BigEndian.PutUint16(ip[20:], src)
	binary.BigEndian.PutUint16(ip[22:], dst)
	binary.BigEndian.PutUint16(ip[24:], uint16(8+len(payload))) // checksum 0: none
	rec := make([]byte, 16)
	binary.LittleEndian.PutUint32(rec[0:], uint32(w.at/time.Second))
	binary.LittleEndian.PutUint32(rec[4:], uint32(w.at%time.Second/time.Microsecond))
	binary.LittleEndian.PutUint32(rec[8:], uint32(len(ip)+len(payload)))
	binary.LittleEndian.PutUint32(rec[12:], uint32(len(ip)+len(payload)))
	w.buf.Write(rec)
	w.buf.Write(ip)
	w.buf.Write(payload)
}

// pdmlField is a field of tshark's PDML output, and a packet's protocols.
type pdmlField struct {
	Name     string      `xml:"name,attr"`
	Show     string      `xml:"show,attr"`
	ShowName string      `xml:"showname,attr"`
	Fields   []pdmlField `xml:"field"`
	Protos   []pdmlField `xml:"proto"`
}

// flat lists f's descendants in document order.
func (f *pdmlField) flat(dst []*pdmlField) []*pdmlField {
	for i := range f.Fields {
		dst = append(dst, &f.Fields[i])
		dst = f.Fields[i].flat(dst)
	}
	return dst
}

// dissect runs tshark with the dissector over the pcap and returns each
// packet's knetgo protocol tree, nil for a packet it did not claim.
func dissect(t *testing.T, w *pcapWriter, args ...string) []*pdmlField {
	t.Helper()
	bin := tshark(t)
	file := filepath.Join(t.TempDir(), "knet.pcap")
	require.NoError(t, os.WriteFile(file, w.buf.Bytes(), 0o644))
	if d := os.Getenv("KNET_PCAP_DIR"); d != "" {
		os.WriteFile(filepath.Join(d, t.Name()+".pcap"), w.buf.Bytes(), 0o644)
	}
	cmd := exec.Command(bin, append([]string{"-n", "-X", "lua_script:" + dissectorScript, "-r", file, "-T", "pdml"}, args...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	require.NoError(t, err, "tshark: %s", stderr.String())
	// tshark reports a script that does not load on stderr, and goes on.
	require.NotContains(t, stderr.String(), "Lua", "tshark: %s", stderr.String())
	var doc struct {
		Packets []pdmlField `xml:"packet"`
	}
	require.NoError(t, xml.Unmarshal(out, &doc))
	var trees []*pdmlField
	for i := range doc.Packets {
		var knet *pdmlField
		for j := range doc.Packets[i].Protos {
			p := &doc.Packets[i].Protos[j]
			// A Lua error in the dissector shows as an item of its own.
			require.NotContains(t, p.Name, "_ws.lua", "frame %d: Lua error", i+1)
			for _, f := range p.flat(nil) {
				require.NotContains(t, f.ShowName, "Lua Error", "frame %d", i+1)
			}
			if p.Name == "knetgo" {
				knet = p
			}
		}
		trees = append(trees, knet)
	}
	return trees
}

// wireView is what the dissector shows of one datagram, and what the Go
// codec reads from it, in one shape for comparing.
type wireView struct {
	Dialect   string // spec, reference, or opening
	Malformed bool
	PacketID  uint32
	Reliable  bool
	InOrder   bool
	Deltas    []uint16 // spec InOrderDeltaArray
	DepPIDs   []uint32 // the PacketIDs Deltas name
	Indices   []uint16 // spec InOrderDatagramIndexArray
	RelBase   uint32   // reference ReliableMsgNumBase
	Msgs      []msgView
}

type msgView struct {
	FragStart, Fragment bool
	Order               uint8 // spec InOrder code
	Single              uint8
	Multi               []uint8
	Latest              bool
	CppInOrder          bool // reference per-message flags
	CppReliable         bool
	RelNum              uint32
	FragCount           uint32
	TransferID          uint8
	FragNumber          uint32
	ID                  uint32
	Name                string
	PayloadLen          int
	PingID              int // -1 unless a ping
	Rate                int // FlowControlRequest
	Acked               []uint32
	// knet's extensions in ID 5: 1 an ack request, 2 a latest-state
	// tag and what it says, 3 the drain notice, 4 a close code.
	ExtKind                      int
	CloseCode                    uint32
	LatestContent, LatestVersion uint32
}

var reservedNames = map[uint32]string{
	0: "Reserved0", idPingRequest: "PingRequest", idPingReply: "PingReply",
	idFlowControlRequest: "FlowControlRequest", idPacketAck: "PacketAck", 5: "Reserved5",
	idConnectAck: "ConnectAck", idConnectSynAck: "ConnectSynAck", idConnectSyn: "ConnectSyn",
	idDisconnectAck: "DisconnectAck", idDisconnect: "Disconnect",
}

// reservedView fills in the decoded content of a whole reserved message;
// it reports false for a content the codec refuses.
func reservedView(v *msgView, payload []byte, cpp bool) bool {
	v.Name = reservedNames[v.ID]
	switch v.ID {
	case idPingRequest, idPingReply:
		if len(payload) > 0 {
			v.PingID = int(payload[0])
		}
	case idFlowControlRequest:
		if len(payload) >= 2 {
			v.Rate = int(binary.LittleEndian.Uint16(payload))
		}
	case idExt:
		if cpp {
			break
		}
		if len(payload) == 1 && (payload[0] == extAckRequest || payload[0] == extDrain) {
			v.ExtKind = int(payload[0])
		} else if code, ok := parseCloseCode(&message{id: idExt, payload: payload}); ok {
			v.ExtKind, v.CloseCode = extCloseCode, code
		} else if tag, ok := parseLatestTag(payload); ok {
			v.ExtKind, v.LatestContent, v.LatestVersion = extLatest, tag.content, tag.ver
		}
	case idPacketAck:
		parse := parsePacketAck
		if cpp {
			parse = parseCppPacketAck
		}
		a, ok := parse(payload)
		if !ok {
			return false
		}
		a.each(func(id uint32) { v.Acked = append(v.Acked, id) })
	}
	return true
}

// specView is the Go codec's reading of b as a spec datagram.
func specView(b []byte) wireView {
	var d datagram
	if err := parseInto(b, &d); err != nil {
		return wireView{Dialect: "spec", Malformed: true}
	}
	w := wireView{Dialect: "spec", PacketID: d.packetID, Reliable: d.reliable, InOrder: d.inOrder,
		Deltas: d.deltas, Indices: d.indices}
	for x := range d.deltas {
		w.DepPIDs = append(w.DepPIDs, refFromEntry(&d.header, x).pid)
	}
	for _, m := range d.msgs {
		v := msgView{FragStart: m.fragStart, Fragment: m.fragment, Order: m.order, Single: m.orderIndex,
			Multi: m.orderMulti, Latest: supersedes(&m), FragCount: m.fragCount, TransferID: m.transferID,
			FragNumber: m.fragNumber, ID: m.id, PayloadLen: len(m.payload), PingID: -1}
		if m.hasID() {
			v.Name = reservedNames[m.id]
		}
		if !m.fragment && !reservedView(&v, m.payload, false) {
			return wireView{Dialect: "spec", Malformed: true}
		}
		w.Msgs = append(w.Msgs, v)
	}
	return w
}

// cppView is the Go codec's reading of b as a reference datagram.
func cppView(b []byte) wireView {
	if isCppOpening(b) {
		return wireView{Dialect: "opening"}
	}
	var d cppDatagram
	if err := parseCppInto(b, &d); err != nil {
		return wireView{Dialect: "reference", Malformed: true}
	}
	w := wireView{Dialect: "reference", PacketID: d.packetID, Reliable: d.reliable, InOrder: d.inOrder, RelBase: d.relBase}
	for _, m := range d.msgs {
		v := msgView{FragStart: m.fragStart, Fragment: m.fragment, CppInOrder: m.inOrder, CppReliable: m.reliable,
			RelNum: m.relNum, FragCount: m.fragCount, TransferID: m.transferID, FragNumber: m.fragNumber,
			ID: m.id, PayloadLen: len(m.payload), PingID: -1}
		if m.hasID() {
			v.Name = reservedNames[m.id]
		}
		if !m.fragment && !reservedView(&v, m.payload, true) {
			return wireView{Dialect: "reference", Malformed: true}
		}
		w.Msgs = append(w.Msgs, v)
	}
	return w
}

// pdmlView is the dissector's reading of one datagram.
func pdmlView(t *testing.T, tree *pdmlField) wireView {
	var w wireView
	var m *msgView
	num := func(f *pdmlField) uint64 {
		v, err := strconv.ParseUint(f.Show, 0, 64)
		require.NoError(t, err, "%s = %q", f.Name, f.Show)
		return v
	}
	flag := func(f *pdmlField) bool { return f.Show == "1" || f.Show == "True" }
	for _, f := range tree.flat(nil) {
		switch f.Name {
		case "knetgo.dialect":
			w.Dialect = f.Show
		case "knetgo.opening":
			w.Dialect = "opening"
		case "knetgo.packetid":
			w.PacketID = uint32(num(f))
		case "knetgo.reliable", "knetgo.ref.reliable":
			w.Reliable = flag(f)
		case "knetgo.inorder", "knetgo.ref.inorder":
			w.InOrder = flag(f)
		case "knetgo.inorder.delta":
			w.Deltas = append(w.Deltas, uint16(num(f)))
		case "knetgo.inorder.dep_packetid":
			w.DepPIDs = append(w.DepPIDs, uint32(num(f)))
		case "knetgo.inorder.index":
			w.Indices = append(w.Indices, uint16(num(f)))
		case "knetgo.ref.relbase":
			w.RelBase = uint32(num(f))
		case "knetgo.msg":
			w.Msgs = append(w.Msgs, msgView{PingID: -1})
			m = &w.Msgs[len(w.Msgs)-1]
		case "knetgo.msg.fragstart":
			m.FragStart = flag(f)
		case "knetgo.msg.fragment":
			// Bit 14; a FragmentStart is a fragment whatever it says.
			m.Fragment = flag(f) || m.FragStart
		case "knetgo.msg.inorder_code":
			m.Order = uint8(num(f))
		case "knetgo.msg.single_index":
			m.Single = uint8(num(f))
		case "knetgo.msg.multi_count":
			m.Multi = []uint8{}
		case "knetgo.msg.multi_index":
			m.Multi = append(m.Multi, uint8(num(f)))
		case "knetgo.msg.latest_state":
			m.Latest = flag(f)
		case "knetgo.msg.ref.inorder":
			m.CppInOrder = flag(f)
		case "knetgo.msg.ref.reliable":
			m.CppReliable = flag(f)
		case "knetgo.msg.relnum":
			m.RelNum = uint32(num(f))
		case "knetgo.msg.frag_count":
			m.FragCount = uint32(num(f))
		case "knetgo.msg.transfer_id":
			m.TransferID = uint8(num(f))
		case "knetgo.msg.frag_number":
			m.FragNumber = uint32(num(f))
		case "knetgo.msg.id":
			m.ID = uint32(num(f))
		case "knetgo.msg.name":
			m.Name = f.Show
		case "knetgo.msg.payload_len":
			m.PayloadLen = int(num(f))
		case "knetgo.ping.id":
			m.PingID = int(num(f))
		case "knetgo.flow.rate":
			m.Rate = int(num(f))
		case "knetgo.ack.id":
			m.Acked = append(m.Acked, uint32(num(f)))
		case "knetgo.ext.kind":
			m.ExtKind = int(num(f))
		case "knetgo.close.code":
			m.CloseCode = uint32(num(f))
		case "knetgo.latest.content_id":
			m.LatestContent = uint32(num(f))
		case "knetgo.latest.version":
			m.LatestVersion = uint32(num(f))
		case "knetgo.malformed":
			w.Malformed = true
		}
	}
	if w.Malformed {
		return wireView{Dialect: w.Dialect, Malformed: true}
	}
	return w
}

// pcapEntry is a datagram written to the pcap, with what the codec reads.
type pcapEntry struct {
	what string
	want wireView
}

// trace collects datagrams of several conversations into one pcap.
type trace struct {
	w       *pcapWriter
	entries []pcapEntry
}

func (tr *trace) add(what string, src, dst uint16, b []byte, want wireView) {
	tr.w.add(src, dst, b)
	tr.entries = append(tr.entries, pcapEntry{what: what, want: want})
}

// simulate runs a session pair through handshake, reliable, unreliable,
// in-order and latest-state messages, a fragmented message, pings and a
// close (in the spec dialect, the server's, as a drain), and returns every
// datagram sent, client's first.
func simulate(t *testing.T, dialect Dialect) (sent [][2][]byte) {
	link := netsim.Params{Delay: 20 * time.Millisecond}
	p := newSimPairIn(t, dialect, &Config{ConnectPayload: []byte("let me in"), Receipts: true}, nil, link, link)
	p.tap = func(from int, b []byte) {
		var pair [2][]byte
		pair[from] = append([]byte(nil), b...)
		sent = append(sent, pair)
	}
	if dialect == DialectSpec {
		// PacketIDs about to wrap, and above 16 bits on the other side.
		// (A reference peer always starts at 1.)
		p.client().startPIDAt(packetIDMask - 20)
		p.server().startPIDAt(3_000_000)
	}
	p.connect()
	for i := range 10 {
		p.send(0, chanMsg(1, i, true, 20))        // reliable in-order
		p.send(1, chanMsg(2, i, false, 10))       // unreliable in-order
		p.send(0, numbered(300+uint32(i), i, 40)) // reliable, no order
		p.send(0, Message{ID: 400, Payload: []byte{byte(i)}})
		p.send(0, Message{ID: 500, ContentID: 7, Payload: []byte{byte(i)}})
		p.send(0, Message{ID: 600, ContentID: 70000, Reliable: true, Payload: []byte{byte(i)}}) // reliable latest state
		p.run(2*time.Millisecond, nil)
	}
	if dialect == DialectSpec {
		// knet no longer sends latest state as back-references (a
		// version follows its tag), but its receiver still reads the
		// marker older knet peers send: code 7 naming two earlier
		// updates, its first entry repeated.
		h := header{packetID: p.client().send.nextPID, inOrder: true, deltas: []uint16{0, 3}, indices: []uint16{0, 0}}
		b := appendHeader(nil, &h)
		b = appendMessage(b, &message{id: 500, order: orderMulti, orderMulti: []byte{0, 1, 0}, payload: []byte{99}})
		sent = append(sent, [2][]byte{b, nil})
	}
	big := make([]byte, 5000)
	for i := range big {
		big[i] = byte(i)
	}
	p.send(0, Message{ID: 70000, Payload: big, Reliable: true, InOrder: true, Channel: 1})
	// Past PingInterval, so that both sides ping.
	require.True(t, p.run(7*time.Second, func() bool { return len(p.h[1].msgs) >= 41 && p.now.Sub(timeZero) > 6*time.Second }), "delivered %d %d, now %v, states %v %v, %+v", len(p.h[1].msgs), len(p.h[0].msgs), p.now.Sub(timeZero), p.client().state, p.server().state, p.server().snapshot())
	if dialect == DialectSpec {
		// The server drains: its Disconnect comes with the drain notice
		// and a close code (DrainWithError).
		p.server().closing.readOn = true
		p.server().closing.code = 0xfeedf00d
		p.server().requestClose(p.now)
	} else {
		p.client().requestClose(p.now)
	}
	require.True(t, p.run(10*time.Second, func() bool { return p.client().done() && p.server().done() }))
	return sent
}

func TestDissector(t *testing.T) {
	tshark(t)
	tr := &trace{w: newPcap()}
	covered := map[string]bool{}

	// Conversation 1, port 7000 (the dissector's default): the spec
	// dialect, from a simulated pair.
	for _, pair := range simulate(t, DialectSpec) {
		if pair[0] != nil {
			tr.add("spec c2s", 50001, 7000, pair[0], specView(pair[0]))
		} else {
			tr.add("spec s2c", 7000, 50001, pair[1], specView(pair[1]))
		}
	}
	// Conversation 2, port 7000: the reference dialect, from a simulated
	// pair; told from the spec by its opening.
	for _, pair := range simulate(t, DialectReference) {
		if pair[0] != nil {
			tr.add("reference c2s", 50002, 7000, pair[0], cppView(pair[0]))
		} else {
			tr.add("reference s2c", 7000, 50002, pair[1], cppView(pair[1]))
		}
	}
	// Conversation 3: malformed datagrams in both dialects, after a
	// reference opening, and Conversation 4 in the spec dialect, after
	// a ConnectSyn.
	syn := appendDatagram(nil, &datagram{header: header{packetID: 1}, msgs: []message{{id: idConnectSyn, payload: []byte("hi")}}})
	tr.add("spec syn", 50004, 7000, syn, specView(syn))
	for _, b := range malformedSpec() {
		tr.add("spec malformed", 50004, 7000, b, specView(b))
	}
	tr.add("reference opening", 50003, 7000, cppOpening[:], cppView(cppOpening[:]))
	for _, b := range handmadeCpp() {
		tr.add("reference handmade", 50003, 7000, b, cppView(b))
	}
	for _, b := range malformedCpp() {
		tr.add("reference malformed", 50003, 7000, b, cppView(b))
	}
	// Conversation 5: the datagrams so far cut short or with a byte
	// changed, which no codec must choke on. With no opening or
	// handshake, the dissector guesses the dialect; checked below.
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range len(tr.entries) {
		b := append([]byte(nil), datagramOf(tr.w, i)...)
		if rng.IntN(2) == 0 {
			b = b[:rng.IntN(len(b))]
		} else {
			b[rng.IntN(len(b))] ^= byte(1 + rng.IntN(255))
		}
		if len(b) > 0 {
			tr.add("mutant", 50005, 7000, b, wireView{})
		}
	}
	// Every datagram of the reference captures, on their own ports.
	all := captures(t)
	lines := map[string]int{}
	for _, c := range all {
		lines[c.file] = max(lines[c.file], c.line)
	}
	for _, c := range all {
		// The 33000 one-byte messages of relnum32k would make tshark's
		// output 80 MB: its start and its end (past reliable number
		// 32767) are enough.
		if c.file == "speedtest_relnum32k.txt" && c.line > 40 && c.line <= lines[c.file]-30 {
			continue
		}
		port := capturePorts[c.file]
		require.NotZero(t, port, c.file)
		client := uint16(40000 + len(c.file)) // one conversation per file
		want := cppView(c.b)
		if c.file == "trashtalk_garbage.txt" {
			want = wireView{} // no opening: the dissector guesses; checked below
		}
		what := fmt.Sprintf("%s:%d", c.file, c.line)
		if c.dir == "c2s" {
			tr.add(what, client, port, c.b, want)
		} else {
			tr.add(what, port, client, c.b, want)
		}
	}

	// Decode As for one port, the preference for the others.
	trees := dissect(t, tr.w, "-o", "knetgo.ports:7000,41001-41012", "-d", "udp.port==1234,knetgo")
	require.Len(t, trees, len(tr.entries))
	for i, e := range tr.entries {
		require.NotNil(t, trees[i], "frame %d (%s) not decoded as kNet", i+1, e.what)
		got := pdmlView(t, trees[i])
		want := e.want
		if want.Dialect == "" {
			// Where the dialect is a guess, the dissector must agree with
			// the codec of the dialect it chose.
			b := datagramOf(tr.w, i)
			if got.Dialect == "spec" {
				want = specView(b)
			} else {
				want = cppView(b)
			}
		}
		if !assert.Equal(t, want, got, "frame %d (%s)", i+1, e.what) {
			t.FailNow()
		}
		for _, m := range got.Msgs {
			covered[got.Dialect+" "+m.Name] = true
			if m.FragStart {
				covered[got.Dialect+" FragmentStart"] = true
			} else if m.Fragment {
				covered[got.Dialect+" FragmentNumber"] = true
			}
			if m.Latest {
				covered["latest state"] = true
			}
			if m.Order == orderMulti {
				covered["code 7"] = true
			}
			if m.Order >= 1 && m.Order <= 5 {
				covered["code 1-5"] = true
			}
			if m.RelNum > 1<<15 {
				covered["reliable number above 32767"] = true
			}
		}
		if len(got.Deltas) > 0 {
			covered["InOrder arrays"] = true
		}
		if got.PacketID > 3_000_000 {
			covered[got.Dialect+" PacketID above 16 bits"] = true
		}
		if got.PacketID < 100 && e.what == "spec c2s" && got.PacketID > 0 {
			covered["PacketID wrap"] = true
		}
		if got.Malformed {
			covered[got.Dialect+" malformed"] = true
		}
		for _, m := range got.Msgs {
			switch m.ExtKind {
			case extAckRequest:
				covered["ack request"] = true
			case extLatest:
				covered["latest-state tag"] = true
			case extDrain:
				covered["drain notice"] = true
			case extCloseCode:
				covered["close code"] = true
			}
		}
	}
	for _, k := range []string{
		"spec ConnectSyn", "spec ConnectSynAck", "spec ConnectAck", "spec PacketAck", "spec PingRequest",
		"spec PingReply", "spec Disconnect", "spec DisconnectAck", "spec FragmentStart", "spec FragmentNumber",
		"spec Reserved5", "spec malformed", "InOrder arrays", "code 1-5", "code 7", "latest state",
		"reference PacketAck", "reference PingRequest", "reference PingReply", "reference Disconnect",
		"reference DisconnectAck", "reference FragmentStart", "reference FragmentNumber", "reference malformed",
		"reliable number above 32767", "reference FlowControlRequest", "spec PacketID above 16 bits", "reference PacketID above 16 bits",
		"PacketID wrap", "ack request", "latest-state tag", "drain notice", "close code",
	} {
		assert.True(t, covered[k], "no datagram exercised %q", k)
	}

	// One datagram checked by hand against the capture's notes
	// (testdata/reference/README.md fact 9): 6 was lost.
	for i, e := range tr.entries {
		if e.what == "refclient_loss5.txt:22" {
			got := pdmlView(t, trees[i])
			var acked []uint32
			for _, m := range got.Msgs {
				acked = append(acked, m.Acked...)
			}
			assert.Equal(t, []uint32{4, 5, 7, 8, 9, 10, 11}, acked)
		}
	}
}

// TestDissectorDialectPreference: with knetgo.dialect set, a reference
// conversation whose opening was not captured still decodes as such.
func TestDissectorDialectPreference(t *testing.T) {
	tshark(t)
	w := newPcap()
	var want []wireView
	for _, pair := range simulate(t, DialectReference)[1:] {
		b, src, dst := pair[0], uint16(50002), uint16(7000)
		if b == nil {
			b, src, dst = pair[1], dst, src
		}
		w.add(src, dst, b)
		want = append(want, cppView(b))
	}
	trees := dissect(t, w, "-o", "knetgo.dialect:reference")
	require.Len(t, trees, len(want))
	for i := range want {
		require.NotNil(t, trees[i])
		require.Equal(t, want[i], pdmlView(t, trees[i]), "frame %d", i+1)
	}
}

// capturePorts are the server ports of the reference captures
// (testdata/reference/README.md).
var capturePorts = map[string]uint16{
	"refclient_echo.txt": 41001, "refclient_loss5.txt": 41008, "silence_idle.txt": 41002,
	"hello_unacked.txt": 1234, "speedtest_reliable.txt": 41004, "speedtest_unreliable.txt": 41005,
	"speedtest_relnum32k.txt": 41012, "inordertest_dup.txt": 41006, "latencytest.txt": 41007,
	"pyprobe_handcrafted.txt": 41010, "trashtalk_garbage.txt": 41009, "pyprobe_speclayout.txt": 41011,
}

// datagramOf returns the UDP payload of record i of w.
func datagramOf(w *pcapWriter, i int) []byte {
	b := w.buf.Bytes()[24:]
	for {
		n := int(binary.LittleEndian.Uint32(b[8:]))
		if i == 0 {
			return b[16+28 : 16+n]
		}
		b = b[16+n:]
		i--
	}
}

// malformedSpec are spec datagrams the codec refuses, each for another
// reason.
func malformedSpec() [][]byte {
	ok := appendDatagram(nil, &datagram{header: header{packetID: 9, reliable: true},
		msgs: []message{{id: 600, payload: []byte("abcdef")}}})
	return [][]byte{
		{0x01, 0x00},                         // shorter than the header
		{0x02, 0x00, 0x80, 0x03, 0x01},       // InOrder arrays cut short
		ok[:len(ok)-2],                       // ContentLength past the end
		{0x03, 0x00, 0x00, 0x00, 0x08, 0x06}, // InOrder code 1 without the InOrder flag
		appendDatagram(nil, &datagram{header: header{packetID: 4, inOrder: true, deltas: []uint16{0}, indices: []uint16{0}},
			msgs: []message{{id: 600, order: 2}}}), // names entry 1 of 1
		appendDatagram(nil, &datagram{header: header{packetID: 5}, msgs: []message{{fragStart: true, fragment: true, fragCount: 2, transferID: 1, id: 600}}}), // unreliable fragment
		appendDatagram(nil, &datagram{header: header{packetID: 6}, msgs: []message{{id: idPacketAck, payload: []byte{1, 2, 3}}}}),                             // short PacketAck
		{0x07, 0x00, 0x00, 0x00, 0x00}, // content too short for its MessageID
	}
}

// handmadeCpp are valid reference datagrams no capture has: high
// PacketIDs, an ack across the wrap, a large reliable number.
func handmadeCpp() [][]byte {
	return [][]byte{
		appendCppDatagram(nil, &cppDatagram{cppHeader: cppHeader{packetID: 3_000_123, inOrder: true},
			msgs: []cppMessage{{inOrder: true, id: idPacketAck, payload: appendCppPacketAck(nil, packetAck{base: packetIDMask - 2, more: 0x8000_0007})}}}),
		appendCppDatagram(nil, &cppDatagram{cppHeader: cppHeader{packetID: packetIDMask, reliable: true, relBase: 1 << 30},
			msgs: []cppMessage{{reliable: true, relNum: 1<<30 + 300, id: 1 << 20, payload: []byte("x")},
				{reliable: true, relNum: 1<<30 + 1, fragment: true, transferID: 200, fragNumber: 20000, payload: []byte("frag")}}}),
		appendCppDatagram(nil, &cppDatagram{cppHeader: cppHeader{packetID: 77},
			msgs: []cppMessage{{id: idFlowControlRequest, payload: []byte{0x2c, 0x01}}}}),
	}
}

// malformedCpp are reference datagrams the codec refuses.
func malformedCpp() [][]byte {
	return [][]byte{
		{0x41, 0x00, 0x00, 0x05},                               // ReliableMsgNumBase cut short
		{0x02, 0x00, 0x00, 0x03, 0x08, 0x06, 1, 2},             // reserved bit 11
		{0x03, 0x00, 0x00, 0x03, 0x10, 0x00, 0x06, 1},          // reliable message, unreliable datagram
		{0x44, 0x00, 0x00, 0x00, 0x00, 0x09, 0x10, 0x00, 0x06}, // content past the end
		appendCppDatagram(nil, &cppDatagram{cppHeader: cppHeader{packetID: 5, inOrder: true},
			msgs: []cppMessage{{inOrder: true, id: idPacketAck, payload: []byte{1, 0, 0}}}}), // short PacketAck
	}
}
