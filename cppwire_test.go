package knet

import (
	"bufio"
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// captured is one datagram of a reference capture.
type captured struct {
	file string
	line int
	dir  string // c2s or s2c
	b    []byte
}

// captures reads every datagram of testdata/reference/*.txt: lines of
// "<seconds> <c2s|s2c> <hex>".
func captures(t testing.TB) []captured {
	files, err := filepath.Glob(filepath.Join("testdata", "reference", "*.txt"))
	require.NoError(t, err)
	var all []captured
	for _, name := range files {
		if strings.HasSuffix(name, ".decoded.txt") {
			continue
		}
		f, err := os.Open(name)
		require.NoError(t, err)
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for line := 1; sc.Scan(); line++ {
			fields := strings.Fields(sc.Text())
			require.Len(t, fields, 3, "%s:%d", name, line)
			b, err := hex.DecodeString(fields[2])
			require.NoError(t, err, "%s:%d", name, line)
			all = append(all, captured{file: filepath.Base(name), line: line, dir: fields[1], b: b})
		}
		require.NoError(t, sc.Err())
		f.Close()
	}
	require.NotEmpty(t, all)
	return all
}

// notReference reports the captured datagrams that are not the reference's
// wire by design: random bytes thrown at it, and one datagram written in
// the spec text's layout (testdata/reference/README.md).
func notReference(c captured) bool {
	return c.file == "trashtalk_garbage.txt" && c.dir == "c2s" || c.file == "pyprobe_speclayout.txt" && c.dir == "c2s"
}

func TestReferenceGoldenCaptures(t *testing.T) {
	// Every datagram the reference sent (and the hand-made ones it
	// accepted) decodes, and encodes back to the same bytes.
	var d cppDatagram
	decoded, openings := 0, 0
	for _, c := range captures(t) {
		if isCppOpening(c.b) {
			openings++
			continue
		}
		if notReference(c) {
			continue
		}
		require.NoError(t, parseCppInto(c.b, &d), "%s:%d %x", c.file, c.line, c.b)
		again := appendCppDatagram(nil, &d)
		require.Equal(t, hex.EncodeToString(c.b), hex.EncodeToString(again), "%s:%d", c.file, c.line)
		decoded++
	}
	t.Logf("%d datagrams decoded and re-encoded, %d openings", decoded, openings)
	assert.Greater(t, decoded, 1500)
	assert.Positive(t, openings)
}

func TestVLE1516(t *testing.T) {
	for _, tt := range []struct {
		v    uint32
		want string
	}{{0, "0000"}, {211, "d300"}, {526, "0e02"}, {32767, "ff7f"}, {32768, "00800100"}, {32944, "b0800100"}} {
		got := hex.EncodeToString(appendVLE1516(nil, tt.v))
		assert.Equal(t, tt.want, got, "v=%d", tt.v)
		b, _ := hex.DecodeString(tt.want)
		v, n := consumeVLE1516(b)
		assert.Equal(t, tt.v, v)
		assert.Equal(t, len(b), n)
		assert.Equal(t, len(b), sizeVLE1516(tt.v))
	}
	_, n := consumeVLE1516([]byte{0x00, 0x80, 0x01})
	assert.Negative(t, n, "the long form needs four bytes")
}

func TestCppHeader(t *testing.T) {
	// Examples from the captures (testdata/reference/README.md).
	for _, tt := range []struct {
		hex               string
		pid               uint32
		inOrder, reliable bool
	}{
		{"c10000", 1, true, true},
		{"810000", 1, true, false},
		{"030000", 3, false, false},
		{"6a0100", 106, false, true},
		{"f20b00", 754, true, true},
	} {
		b, _ := hex.DecodeString(tt.hex)
		if tt.reliable {
			b = append(b, 0, 0) // ReliableMsgNumBase 0
		}
		var h cppHeader
		n, err := parseCppHeader(b, &h)
		require.NoError(t, err, tt.hex)
		assert.Equal(t, len(b), n)
		assert.Equal(t, cppHeader{packetID: tt.pid, inOrder: tt.inOrder, reliable: tt.reliable}, h, tt.hex)
		assert.Equal(t, hex.EncodeToString(b), hex.EncodeToString(appendCppHeader(nil, &h)))
	}
}

func TestCppMessage(t *testing.T) {
	// 14 10 00 0b ...: Reliable, ContentLength 20, delta 0, MessageID 11,
	// 19 payload bytes.
	b, _ := hex.DecodeString("1410000b52322d302d72656c6961626c652d736d616c6c")
	h := cppHeader{reliable: true, relBase: 7}
	m, n, err := parseCppMessage(b, &h)
	require.NoError(t, err)
	assert.Equal(t, len(b), n)
	assert.True(t, m.reliable)
	assert.False(t, m.inOrder)
	assert.Equal(t, uint32(7), m.relNum)
	assert.Equal(t, uint32(11), m.id)
	assert.Equal(t, "R2-0-reliable-small", string(m.payload))
	// A fragment start: FS and F both set.
	fs := cppMessage{fragStart: true, fragment: true, reliable: true, relNum: 9, fragCount: 315, transferID: 1, id: 70000, payload: make([]byte, 318)}
	enc := appendCppMessage(nil, &fs, 9)
	assert.Equal(t, "42d1", hex.EncodeToString(enc[:2]), "header 0xd142")
	back, _, err := parseCppMessage(enc, &cppHeader{reliable: true, relBase: 9})
	require.NoError(t, err)
	assert.Equal(t, fs.fragCount, back.fragCount)
	assert.Equal(t, fs.id, back.id)
	// Malformed: the reserved bit, a reliable block in an unreliable
	// datagram, content past the end, too short.
	for _, bad := range []string{"0108", "01100a", "0a000b", "01"} {
		b, _ := hex.DecodeString(bad)
		_, _, err := parseCppMessage(b, &cppHeader{})
		assert.Error(t, err, bad)
	}
}

func TestCppPacketAck(t *testing.T) {
	for _, tt := range []struct {
		hex   string
		first uint32
		ids   []uint32
	}{
		{"040000ffffffff", 4, nil}, // 4-36
		{"2500001f000000", 37, []uint32{38, 39, 40, 41, 42}},
		{"0400007d000000", 4, []uint32{5, 7, 8, 9, 10, 11}}, // 6 lost
	} {
		b, _ := hex.DecodeString(tt.hex)
		a, ok := parseCppPacketAck(b)
		require.True(t, ok)
		assert.Equal(t, tt.first, a.base)
		var got []uint32
		for m, k := a.more, uint32(1); m != 0; m, k = m>>1, k+1 {
			if m&1 != 0 {
				got = append(got, a.base+k)
			}
		}
		if tt.ids != nil {
			assert.Equal(t, tt.ids, got, tt.hex)
		} else {
			assert.Len(t, got, 32)
		}
		assert.Equal(t, tt.hex, hex.EncodeToString(appendCppPacketAck(nil, a)))
	}
}

func FuzzParseCppDatagram(f *testing.F) {
	for _, c := range captures(f) {
		if !isCppOpening(c.b) && !notReference(c) && len(c.b) < 400 {
			f.Add(c.b)
		}
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var d cppDatagram
		if parseCppInto(b, &d) != nil {
			return // refusing is fine; panicking is not
		}
		for i := range d.msgs {
			m := &d.msgs[i]
			if m.reliable && m.relNum-d.relBase > maxVLE16 || cppContentLength(m) > maxContentLength {
				return // decodable but not what an encoder makes (non-minimal VLE)
			}
		}
		var again cppDatagram
		require.NoError(t, parseCppInto(appendCppDatagram(nil, &d), &again))
		require.Equal(t, len(d.msgs), len(again.msgs))
		for i := range d.msgs {
			a, b := d.msgs[i], again.msgs[i]
			a.payload, b.payload = nil, nil
			require.Equal(t, a, b)
			require.Equal(t, d.msgs[i].payload, again.msgs[i].payload)
		}
	})
}
