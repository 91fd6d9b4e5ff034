package knet

import (
	"encoding/binary"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Fuzz targets for the receive path. Their seed corpora in
// testdata/fuzz/Fuzz*/ come from our encoders (see TestWriteFuzzCorpus) and
// run as ordinary tests; `go test -fuzz` explores from them.

// fuzzScript is a sequence of steps: a control byte (the low six bits are a
// pause in milliseconds of fake time), a u16 length, then that many bytes,
// a datagram delivered to the server.
func fuzzScript(steps ...[]byte) []byte {
	var out []byte
	for i, s := range steps {
		out = append(out, byte(i%7))
		out = binary.LittleEndian.AppendUint16(out, uint16(len(s)))
		out = append(out, s...)
	}
	return out
}

// established returns a connected pair with some traffic behind it: the
// client's next PacketID is then known to seeds.
func establishedForFuzz(t testing.TB) *simPair {
	p := newSimPair(t, nil, &Config{ReceiveBuffer: 64 << 10, ReassemblyBuffer: 64 << 10, MaxMessageSize: 256 << 10}, perfect, perfect)
	p.client().startPIDAt(100)
	p.connect()
	for i := range 5 {
		p.send(0, chanMsg(1, i, true, 30))
	}
	p.run(100*time.Millisecond, nil)
	return p
}

// fuzzSeeds are well-formed and malformed datagrams a peer could send.
func fuzzSeeds(next uint32) [][]byte {
	d := func(h header, msgs ...message) []byte {
		return appendDatagram(nil, &datagram{header: h, msgs: msgs})
	}
	ack := appendPacketAck(nil, packetAck{base: 1, more: 0xff})
	return [][]byte{
		d(header{packetID: next, reliable: true}, message{id: 6, payload: []byte("hello")}),
		d(header{packetID: next + 1, reliable: true, inOrder: true, deltas: []uint16{0}, indices: []uint16{0}},
			message{id: 7, order: 1, payload: []byte("after")}),
		d(header{packetID: next + 2}, message{id: idPingRequest, payload: []byte{9}}, message{id: idPacketAck, payload: ack}),
		d(header{packetID: next + 3, reliable: true},
			message{id: 8, fragStart: true, fragment: true, fragCount: 3, transferID: 4, payload: []byte("abc")}),
		d(header{packetID: next + 5, reliable: true}, message{fragment: true, transferID: 4, fragNumber: 2, payload: []byte("ghi")}),
		d(header{packetID: next + 4, reliable: true}, message{fragment: true, transferID: 4, fragNumber: 1, payload: []byte("def")}),
		d(header{packetID: next + 6, inOrder: true, deltas: []uint16{3}, indices: []uint16{0}}, message{id: 9, order: 1}),
		d(header{packetID: next + 7}, message{id: idFlowControlRequest, payload: []byte{100, 0}}),
		d(header{packetID: next + 8, inOrder: true}, message{id: idDisconnect}),
		{0x00, 0x00},
		{0x05, 0x00, 0x80, 0xff, 0x01},
		d(header{packetID: next + 9, reliable: true}, message{id: 6, payload: []byte("cut")})[:6:6],
	}
}

func FuzzSessionReceive(f *testing.F) {
	seeds := fuzzSeeds(109)
	f.Add(fuzzScript(seeds...))
	f.Add(fuzzScript(seeds[9], seeds[10], seeds[11]))
	for _, s := range seeds {
		f.Add(fuzzScript(s))
	}
	f.Fuzz(func(t *testing.T, script []byte) {
		p := establishedForFuzz(t)
		runFuzzScript(t, p, script, func(b []byte) bool {
			_, _, err := parseDatagram(b)
			return err != nil
		}, nil)
	})
}

// runFuzzScript delivers the script's datagrams to p's server, checking
// after each that what the peer can make it hold stays within the
// documented bounds (and whatever more bounds checks). If every datagram
// was malformed (as malformed tells), each was counted and the connection
// still delivers exactly once; otherwise time only has to go on.
func runFuzzScript(t *testing.T, p *simPair, script []byte, malformed func([]byte) bool, bounds func()) {
	srv := p.server()
	bad, steps := 0, 0
	for len(script) >= 3 && steps < 200 {
		pause := time.Duration(script[0]&63) * time.Millisecond
		n := int(binary.LittleEndian.Uint16(script[1:3]))
		script = script[3:]
		n = min(n, len(script))
		b := script[:n]
		script = script[n:]
		steps++
		if malformed(b) {
			bad++
		}
		p.inject(1, append([]byte(nil), b...))
		p.run(pause, nil)
		require.LessOrEqual(t, srv.recv.res.bytes, 64<<10+2*maxDatagramSizeLimit)
		require.LessOrEqual(t, srv.recv.reasm.bytes, 64<<10+256<<10+maxContentLength+fragRecordCost*(256<<10/minFragAverage+2))
		require.LessOrEqual(t, srv.acks.pending(), 4*maxInbox)
		if bounds != nil {
			bounds()
		}
	}
	if steps == 0 || bad < steps {
		// A well-formed datagram from the peer's address may change
		// anything the peer could; only check that time goes on.
		p.run(time.Minute, nil)
		return
	}
	// Only malformed datagrams: every one counted, and the connection
	// unharmed, delivering exactly once.
	assert.Equal(t, uint64(bad), srv.stats.InvalidDatagrams)
	require.Equal(t, stateOK, srv.state)
	before := len(p.h[1].msgs)
	for i := range 20 {
		p.send(0, numbered(300, i, 10))
	}
	require.True(t, p.run(10*time.Second, func() bool { return len(p.h[1].msgs) == before+20 }))
	seen := map[uint32]bool{}
	for _, m := range p.h[1].msgs[before:] {
		i := binary.LittleEndian.Uint32(m.Payload)
		require.False(t, seen[i])
		seen[i] = true
	}
}

// FuzzPacketAck applies fuzzed PacketAcks to a sender with reliable
// datagrams in flight and checks the bookkeeping against a model: what an
// ack names in flight is freed; one naming a PacketID the sender never
// sent (skipped, or not reached yet) ends the connection.
func FuzzPacketAck(f *testing.F) {
	f.Add([]byte{})
	f.Add(append(appendPacketAck(nil, packetAck{base: 1000, more: 0x3ffffffff}), appendPacketAck(nil, packetAck{base: 1010, more: 5})...))
	f.Add(appendPacketAck(nil, packetAck{base: packetIDMask, more: 7}))
	f.Add([]byte{0xe8, 0x03, 0xc0, 0xff, 0xff, 0xff, 0xff, 0x00})
	f.Fuzz(func(t *testing.T, acks []byte) {
		p := newSimPair(t, nil, nil, perfect, perfect)
		p.client().startPIDAt(1000)
		if len(acks)%packetAckSize == 0 {
			// Whole PacketAcks only: a sender that skips nothing, so
			// that the seeds' runs of PacketIDs reach the bookkeeping.
			noSkips(p.client())
		}
		sentIDs := map[uint32]bool{} // the PacketIDs the client sent; the others from 1000 on it skipped
		p.tap = func(from int, b []byte) {
			if d, _, err := parseDatagram(b); from == 0 && err == nil {
				sentIDs[d.packetID] = true
			}
		}
		p.connect()
		// The server hears nothing: 40 reliable datagrams stay in flight.
		p.cut[0] = true
		for i := range 40 {
			p.send(0, numbered(100, i, 1300))
		}
		p.client().rc.forceRate = 1e6
		p.run(time.Millisecond, nil)
		c := p.client()
		inFlight := map[uint32]int{}
		for k := range c.loss.sent.n {
			d := c.loss.sent.at(k)
			if !d.acked {
				inFlight[d.packetID] = d.appBytes
			}
		}
		require.NotEmpty(t, inFlight)
		released := p.h[0].released
		for len(acks) >= packetAckSize {
			payload := acks[:packetAckSize]
			acks = acks[packetAckSize:]
			a, ok := parsePacketAck(payload)
			require.True(t, ok)
			lie := false
			a.each(func(id uint32) {
				lie = lie || !seqLess(id, c.send.nextPID) || !seqLess(id, 1000) && !sentIDs[id]
			})
			if lie {
				c.wire.(*specWire).handlePacketAck(p.now, payload)
				var pe *ProtocolError
				require.ErrorAs(t, c.err, &pe, "an ack of a PacketID never sent")
				require.Equal(t, uint64(1), c.stats.ProtocolErrors)
				return
			}
			a.each(func(id uint32) {
				if n, ok := inFlight[id]; ok {
					released += n
					delete(inFlight, id)
				}
			})
			c.wire.(*specWire).handlePacketAck(p.now, payload)
			c.afterAcks(p.now)
			require.Equal(t, len(inFlight), c.loss.sent.count)
			require.Equal(t, released, p.h[0].released, "payload bytes returned to the send buffer")
			if first := c.loss.sent.firstUnacked(); first != nil {
				_, ok := inFlight[first.packetID]
				require.True(t, ok, "the front is unacked")
				for id := range inFlight {
					require.False(t, seqLess(id, first.packetID))
				}
			} else {
				require.Empty(t, inFlight)
			}
		}
		// Timeouts and retransmissions still work on what is left.
		p.cut[0] = false
		require.True(t, p.run(time.Minute, func() bool { return c.loss.sent.count == 0 }))
	})
}

// TestWriteFuzzCorpus writes the seed corpora above into testdata, from our
// encoders; run with KNET_WRITE_CORPUS=1 after changing them.
func TestWriteFuzzCorpus(t *testing.T) {
	if os.Getenv("KNET_WRITE_CORPUS") == "" {
		t.Skip("set KNET_WRITE_CORPUS=1 to rewrite testdata/fuzz seeds")
	}
	write := func(target, name string, values ...string) {
		dir := filepath.Join("testdata", "fuzz", target)
		require.NoError(t, os.MkdirAll(dir, 0o755))
		body := "go test fuzz v1\n"
		for _, v := range values {
			body += v + "\n"
		}
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644))
	}
	bytesLit := func(b []byte) string { return fmt.Sprintf("[]byte(%q)", b) }
	seeds := fuzzSeeds(109)
	write("FuzzSessionReceive", "seed-all", bytesLit(fuzzScript(seeds...)))
	for i, s := range seeds {
		write("FuzzSessionReceive", fmt.Sprintf("seed-%02d", i), bytesLit(fuzzScript(s)))
	}
	rp := establishedCppForFuzz(t)
	cppSeeds := fuzzCppSeeds(rp.client().send.nextPID, rp.client().wire.(*cppWire).relOut)
	write("FuzzCppSessionReceive", "seed-all", bytesLit(fuzzScript(cppSeeds...)))
	for i, s := range cppSeeds {
		write("FuzzCppSessionReceive", fmt.Sprintf("seed-%02d", i), bytesLit(fuzzScript(s)))
		write("FuzzParseCppDatagram", fmt.Sprintf("seed-%02d", i), bytesLit(s))
	}
	d := sampleDatagram()
	write("FuzzParseDatagram", "seed-sample", bytesLit(appendDatagram(nil, &d)))
	for i, s := range seeds {
		write("FuzzParseDatagram", fmt.Sprintf("seed-%02d", i), bytesLit(s))
	}
	write("FuzzPacketAck", "seed-runs", bytesLit(append(appendPacketAck(nil, packetAck{base: 1000, more: 0x3ffffffff}), appendPacketAck(nil, packetAck{base: 1010, more: 5})...)))
	write("FuzzReassembly", "seed-clean", bytesLit(nil), "uint16(5000)", "uint16(470)")
	// A client's sealed datagrams: their structure, not their keys, is
	// what the listener reads (the bytes after the header stand for the
	// connection ID and the ciphertext).
	for i, h := range []header{{packetID: 3, reliable: true}, {packetID: 9, inOrder: true, deltas: []uint16{1, 300}, indices: []uint16{0, 200}}} {
		b := appendHeader(nil, &h)
		b = binary.LittleEndian.AppendUint32(b, 0x04030201)
		b = append(b, make([]byte, 5+sealOverhead)...)
		write("FuzzSealedCID", fmt.Sprintf("seed-%02d", i), bytesLit(b))
		write("FuzzSealedCID", fmt.Sprintf("seed-%02d-short", i), bytesLit(b[:len(b)-6-sealOverhead]))
	}
	write("FuzzQueryDatagram", "seed-query", bytesLit(appendQueryDatagram(nil, queryKindQuery, testNonce(1), nil, queryPadTo)))
	write("FuzzQueryDatagram", "seed-query-short", bytesLit(appendQueryDatagram(nil, queryKindQuery, testNonce(1), nil, 0)))
	write("FuzzQueryDatagram", "seed-answer", bytesLit(appendQueryDatagram(nil, queryKindAnswer, testNonce(7), []byte("name=knet;map=e1m1;players=3/16"), 0)))
	write("FuzzQueryDatagram", "seed-answer-full", bytesLit(appendQueryDatagram(nil, queryKindAnswer, testNonce(7), make([]byte, MaxQueryInfo), 0)))
	for name, s := range tcpFrameSeeds(t) {
		write("FuzzTCPFrameStream", "seed-"+name, bytesLit(s.stream), bytesLit(s.pieces), fmt.Sprintf("uint16(%d)", s.limit))
	}
	write("FuzzInOrder", "seed-mixed", "uint64(5)", "byte('d')", "byte('\\n')", "byte('\\x14')")
	for i, c := range fuzzConfigSeeds {
		f := fmt.Sprintf("float64(%v)", c.loss)
		if math.IsNaN(c.loss) {
			f = fmt.Sprintf("math.Float64frombits(%#x)", math.Float64bits(c.loss))
		}
		write("FuzzConfig", fmt.Sprintf("seed-%02d", i),
			fmt.Sprintf("int(%d)", c.datagram), fmt.Sprintf("int(%d)", c.fragment), fmt.Sprintf("int(%d)", c.message),
			fmt.Sprintf("int(%d)", c.buffer), fmt.Sprintf("int(%d)", c.rate), fmt.Sprintf("int64(%d)", c.ping),
			fmt.Sprintf("int64(%d)", c.timeout), fmt.Sprintf("int64(%d)", c.window), f, fmt.Sprintf("int64(%d)", c.jitter),
			fmt.Sprintf("uint16(%d)", c.synLen), fmt.Sprintf("uint32(%d)", c.payload))
	}
}

// establishedCppForFuzz is establishedForFuzz in the reference dialect.
func establishedCppForFuzz(t testing.TB) *simPair {
	p := newSimPairIn(t, DialectReference, nil, &Config{ReceiveBuffer: 64 << 10, ReassemblyBuffer: 64 << 10, MaxMessageSize: 256 << 10}, perfect, perfect)
	p.connect()
	for i := range 5 {
		p.send(0, chanMsg(1, i, true, 30))
	}
	p.run(100*time.Millisecond, nil)
	return p
}

// fuzzCppSeeds are reference datagrams a peer could send next, given its
// next PacketID and reliable number, and malformed ones.
func fuzzCppSeeds(pid, rel uint32) [][]byte {
	d := func(h cppHeader, msgs ...cppMessage) []byte {
		return appendCppDatagram(nil, &cppDatagram{cppHeader: h, msgs: msgs})
	}
	ack := appendCppPacketAck(nil, packetAck{base: 1, more: 0xff})
	return [][]byte{
		d(cppHeader{packetID: pid, reliable: true, relBase: rel}, cppMessage{reliable: true, relNum: rel, id: 6, payload: []byte("hello")}),
		d(cppHeader{packetID: pid + 1, reliable: true, inOrder: true, relBase: rel + 2},
			cppMessage{reliable: true, inOrder: true, relNum: rel + 2, id: 7, payload: []byte("after")}),
		d(cppHeader{packetID: pid + 2, inOrder: true}, cppMessage{inOrder: true, id: idPingRequest, payload: []byte{9}},
			cppMessage{inOrder: true, id: idPacketAck, payload: ack}),
		d(cppHeader{packetID: pid + 3, reliable: true, relBase: rel + 3},
			cppMessage{reliable: true, inOrder: true, relNum: rel + 3, fragStart: true, fragment: true, fragCount: 3, transferID: 1, id: 8, payload: []byte("abc")}),
		d(cppHeader{packetID: pid + 5, reliable: true, relBase: rel + 5},
			cppMessage{reliable: true, inOrder: true, relNum: rel + 5, fragment: true, transferID: 1, fragNumber: 2, payload: []byte("ghi")}),
		d(cppHeader{packetID: pid + 4, reliable: true, relBase: rel + 4},
			cppMessage{reliable: true, inOrder: true, relNum: rel + 4, fragment: true, transferID: 1, fragNumber: 1, payload: []byte("def")}),
		d(cppHeader{packetID: pid + 6, reliable: true, relBase: rel + 1},
			cppMessage{reliable: true, inOrder: true, relNum: rel + 1, id: 9, payload: []byte("fills the hole")}),
		d(cppHeader{packetID: pid + 7, inOrder: true}, cppMessage{inOrder: true, id: idFlowControlRequest, payload: []byte{100, 0}}),
		d(cppHeader{packetID: pid + 8, reliable: true, inOrder: true, relBase: rel + 6},
			cppMessage{reliable: true, inOrder: true, relNum: rel + 6, id: idDisconnect}),
		cppOpening[:],
		{0x00, 0x00},
		{0xc5, 0x00, 0x80, 0xff, 0x01},
		d(cppHeader{packetID: pid + 9, reliable: true, relBase: rel + 7}, cppMessage{reliable: true, relNum: rel + 7, id: 6, payload: []byte("cut")})[:6:6],
	}
}

// FuzzCppSessionReceive is FuzzSessionReceive for a server talking the
// reference dialect.
func FuzzCppSessionReceive(f *testing.F) {
	p := establishedCppForFuzz(f)
	seeds := fuzzCppSeeds(p.client().send.nextPID, p.client().wire.(*cppWire).relOut)
	f.Add(fuzzScript(seeds...))
	f.Add(fuzzScript(seeds[10], seeds[11], seeds[12]))
	for _, s := range seeds {
		f.Add(fuzzScript(s))
	}
	f.Fuzz(func(t *testing.T, script []byte) {
		p := establishedCppForFuzz(t)
		srv := p.server()
		var d cppDatagram
		runFuzzScript(t, p, script, func(b []byte) bool {
			return !isCppOpening(b) && parseCppInto(b, &d) != nil
		}, func() {
			require.LessOrEqual(t, srv.wire.(*cppWire).relHeldBytes, 64<<10+2*maxDatagramSizeLimit*cppHeldCost)
			require.LessOrEqual(t, len(srv.wire.(*cppWire).relIn.ring), maxRelWindow/64)
		})
	})
}
