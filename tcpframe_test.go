package knet

import (
	"bufio"
	"bytes"
	"encoding/hex"
	"errors"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// tcpSeqPayload is a payload of n bytes starting with a u32 sequence number,
// as ref-client's are (the rest is filler here).
func tcpSeqPayload(seq uint32, n int) []byte {
	p := make([]byte, n)
	p[0], p[1], p[2], p[3] = byte(seq), byte(seq>>8), byte(seq>>16), byte(seq>>24)
	for i := 4; i < n; i++ {
		p[i] = byte(i)
	}
	return p
}

// tcpFrameExamples are frames of the README's worked examples and VLE
// table (testdata/reference/tcp/README.md §2), by their leading bytes.
var tcpFrameExamples = []struct {
	name    string
	id      uint32
	payload []byte
	prefix  string // the frame's first bytes
}{
	{"PingRequest 1", idPingRequest, []byte{1}, "020101"},
	{"PingReply 0x77", idPingReply, []byte{0x77}, "020277"},
	{"id 10 seq 0", 10, tcpUnhex("000000002ac3ffdb"), "090a000000002ac3ffdb"},
	{"id 11 seq 1", 11, tcpUnhex("010000001dae6ad7"), "090b010000001dae6ad7"},
	{"size 131", 11, tcpSeqPayload(5, 130), "83010b05000000"},
	{"id 127", 127, tcpSeqPayload(200, 24), "197fc8000000"},
	{"id 128", 128, tcpSeqPayload(201, 24), "1a8001c9000000"},
	{"id 16383", 16383, tcpSeqPayload(202, 24), "1aff7fca000000"},
	{"id 16384", 16384, tcpSeqPayload(203, 24), "1c80800100cb000000"},
	{"id 0x3FFFFFFA", 0x3FFFFFFA, tcpSeqPayload(204, 24), "1cfaffffffcc000000"},
	{"id 0x3FFFFFFF", 0x3FFFFFFF, nil, "04ffffffff"},
	{"empty message", 14, nil, "010e"},
	{"empty payload, empty slice", 14, []byte{}, "010e"},
	{"1368 bytes", 15, tcpSeqPayload(206, 1368), "d90a0fce000000"},
	{"1369 bytes", 15, tcpSeqPayload(207, 1369), "da0a0fcf000000"},
	{"size 646", 11, tcpSeqPayload(87, 645), "86050b57000000"},
	{"100000 bytes", 13, tcpSeqPayload(408, 100000), "a18d06000d98010000"},
}

func tcpUnhex(s string) []byte {
	b, err := hex.DecodeString(s)
	if err != nil {
		panic(err)
	}
	return b
}

func TestAppendTCPFrame(t *testing.T) {
	for _, tt := range tcpFrameExamples {
		b := appendTCPFrame([]byte{0xee}, tt.id, tt.payload)
		require.Equal(t, byte(0xee), b[0], tt.name)
		b = b[1:]
		assert.Equal(t, tt.prefix, hex.EncodeToString(b[:min(len(b), len(tt.prefix)/2)]), tt.name)
		assert.Len(t, b, sizeTCPFrame(tt.id, len(tt.payload)), tt.name)
		assert.True(t, bytes.HasSuffix(b, tt.payload), tt.name)
	}
}

func TestParseTCPFrame(t *testing.T) {
	for _, tt := range tcpFrameExamples {
		frame := appendTCPFrame(nil, tt.id, tt.payload)
		// Whole, and with the next frame's first bytes behind it.
		for _, b := range [][]byte{frame, append(append([]byte(nil), frame...), 0x81, 0x80)} {
			id, payload, n, err := parseTCPFrame(b, cppTCPMaxFrame)
			require.NoError(t, err, tt.name)
			assert.Equal(t, len(frame), n, tt.name)
			assert.Equal(t, tt.id, id, tt.name)
			assert.Equal(t, len(tt.payload), len(payload), tt.name)
			assert.True(t, bytes.Equal(tt.payload, payload), tt.name)
			assert.Equal(t, len(payload), cap(payload), "%s: the payload ends with its frame", tt.name)
		}
		// Truncated at every byte: more is needed, no error.
		for i := range len(frame) {
			id, payload, n, err := parseTCPFrame(frame[:i], cppTCPMaxFrame)
			if !assert.NoError(t, err, "%s[:%d]", tt.name, i) ||
				!assert.Zero(t, n, "%s[:%d]", tt.name, i) {
				break
			}
			assert.Zero(t, id)
			assert.Nil(t, payload)
		}
	}
}

func TestParseTCPFrameForms(t *testing.T) {
	// Every VLE-1.7/1.7/16 form of the size and of the MessageID,
	// shortest and longer than needed (the reference accepts these:
	// README §2, `83 00 0a 41 42`).
	for _, tt := range []struct {
		in, payload string
		id          uint32
		canonical   string // re-encoded, if not in
	}{
		{"020101", "01", 1, ""},
		{"03 0a 4142", "4142", 10, ""},
		{"8300 0a 4142", "4142", 10, "030a4142"},
		{"83800000 0a 4142", "4142", 10, "030a4142"},
		{"8100 0e", "", 14, "010e"},
		{"81800000 0e", "", 14, "010e"},
		{"02 8a00", "", 10, "010a"},
		{"04 8a800000", "", 10, "010a"},
		{"06 80800100 4142", "4142", 16384, ""},
		{"03 ff7f 41", "41", 16383, ""},
		{"05 ffffffff 41", "41", maxVLE32, ""},
		{"ff7f 01" + strings.Repeat("00", 16382), strings.Repeat("00", 16382), 1, ""},
		{"80800100 01" + strings.Repeat("00", 16383), strings.Repeat("00", 16383), 1, ""},
	} {
		in := unhex(t, tt.in)
		id, payload, n, err := parseTCPFrame(in, cppTCPMaxFrame)
		require.NoError(t, err, tt.in)
		assert.Equal(t, len(in), n, tt.in)
		assert.Equal(t, tt.id, id, tt.in)
		assert.Equal(t, tt.payload, hex.EncodeToString(payload), tt.in)
		want := tt.canonical
		if want == "" {
			want = hex.EncodeToString(in)
		}
		assert.Equal(t, want, hex.EncodeToString(appendTCPFrame(nil, id, payload)), tt.in)
		for i := range len(in) {
			_, _, n, err := parseTCPFrame(in[:i], cppTCPMaxFrame)
			if !assert.NoError(t, err, "%s[:%d]", tt.in, i) || !assert.Zero(t, n, "%s[:%d]", tt.in, i) {
				break
			}
		}
	}
}

func TestParseTCPFrameErrors(t *testing.T) {
	for _, tt := range []struct {
		in    string
		limit int
		want  error
		msg   string
	}{
		{"00", cppTCPMaxFrame, errTCPFrameSize0, ""},
		{"00 0101", cppTCPMaxFrame, errTCPFrameSize0, ""},
		{"8000", cppTCPMaxFrame, errTCPFrameSize0, ""},
		{"80800000", cppTCPMaxFrame, errTCPFrameSize0, ""},
		// README §5: 10 MiB + 1 closes as soon as the size field is
		// read, before the rest of the frame.
		{"81808002", cppTCPMaxFrame, errTCPFrameTooLarge, "size 10485761, the limit 10485760"},
		{"81808002 0a", cppTCPMaxFrame, errTCPFrameTooLarge, ""},
		{"ffffffff", cppTCPMaxFrame, errTCPFrameTooLarge, "size 1073741823"},
		{"04 0a414243", 3, errTCPFrameTooLarge, "size 4, the limit 3"},
		{"01 0a", 0, errTCPFrameTooLarge, ""},
		{"01 0a", -1, errTCPFrameTooLarge, ""},
		// A MessageID field longer than the frame.
		{"01 80", cppTCPMaxFrame, errTCPFrameID, "size 1"},
		{"01 8001", cppTCPMaxFrame, errTCPFrameID, ""},
		{"02 8080", cppTCPMaxFrame, errTCPFrameID, ""},
		{"03 808001 00", cppTCPMaxFrame, errTCPFrameID, "size 3"},
	} {
		id, payload, n, err := parseTCPFrame(unhex(t, tt.in), tt.limit)
		require.Error(t, err, tt.in)
		for _, e := range []error{errTCPFrameSize0, errTCPFrameTooLarge, errTCPFrameID} {
			assert.Equal(t, e == tt.want, errors.Is(err, e), "%s: %v is %v", tt.in, err, e)
		}
		assert.Contains(t, err.Error(), tt.msg, tt.in)
		assert.True(t, strings.HasPrefix(err.Error(), "knet: tcp frame"), err.Error())
		assert.Zero(t, id)
		assert.Nil(t, payload)
		assert.Zero(t, n)
	}
	// At the limit: only more bytes are needed.
	for _, in := range []string{"80808002", "80808002 0a"} {
		_, _, n, err := parseTCPFrame(unhex(t, in), cppTCPMaxFrame)
		assert.NoError(t, err, in)
		assert.Zero(t, n, in)
	}
	b := appendTCPFrame(nil, 7, make([]byte, 99))
	_, _, n, err := parseTCPFrame(b, 100)
	require.NoError(t, err)
	assert.Equal(t, len(b), n)
}

func TestTCPMaxFrame(t *testing.T) {
	assert.Equal(t, defaultMaxMessageSize+4, newTCPFramer(defaultMaxMessageSize).maxFrame)
	assert.Equal(t, 4, newTCPFramer(0).maxFrame)
	assert.Equal(t, 4, newTCPFramer(-1).maxFrame)
	assert.Equal(t, maxVLE32, newTCPFramer(math.MaxInt).maxFrame)
	assert.Equal(t, maxVLE32, newTCPFramer(maxVLE32-4).maxFrame)
	assert.Equal(t, maxVLE32-1, newTCPFramer(maxVLE32-5).maxFrame)
	// A message of MaxMessageSize passes behind the longest MessageID;
	// one byte more does not.
	const max = 1000
	for _, tt := range []struct {
		n  int
		ok bool
	}{{max, true}, {max + 1, false}} {
		f := newTCPFramer(max)
		f.feed(appendTCPFrame(nil, MaxMessageID, make([]byte, tt.n)))
		_, p, ok, err := f.next()
		assert.Equal(t, tt.ok, ok, "payload %d", tt.n)
		assert.Equal(t, tt.ok, err == nil, "payload %d", tt.n)
		if tt.ok {
			assert.Len(t, p, tt.n)
		}
	}
}

// tcpFrame is one frame out of a framer, copied.
type tcpFrame struct {
	id      uint32
	payload []byte
}

// drainTCPFramer returns the framer's whole frames and its error, copying
// the payloads.
func drainTCPFramer(t testing.TB, f *tcpFramer) (frames []tcpFrame, err error) {
	for {
		id, p, ok, err := f.next()
		if err != nil || !ok {
			return frames, err
		}
		frames = append(frames, tcpFrame{id, append([]byte{}, p...)})
	}
}

func TestTCPFramer(t *testing.T) {
	var stream []byte
	var want []tcpFrame
	for _, tt := range tcpFrameExamples {
		stream = appendTCPFrame(stream, tt.id, tt.payload)
		want = append(want, tcpFrame{tt.id, append([]byte{}, tt.payload...)})
	}
	for _, piece := range []int{1, 2, 3, 7, 1000, 65536, len(stream)} {
		f := newTCPFramer(cppTCPMaxFrame)
		var got []tcpFrame
		for s := stream; len(s) > 0; {
			k := min(piece, len(s))
			f.feed(s[:k])
			s = s[k:]
			frames, err := drainTCPFramer(t, f)
			require.NoError(t, err)
			got = append(got, frames...)
		}
		require.Equal(t, want, got, "pieces of %d", piece)
		assert.Zero(t, f.buffered())
	}
	// A stream that stops inside a frame leaves bytes behind.
	f := newTCPFramer(cppTCPMaxFrame)
	f.feed(stream[:len(stream)-1])
	frames, err := drainTCPFramer(t, f)
	require.NoError(t, err)
	assert.Len(t, frames, len(want)-1)
	assert.Equal(t, sizeTCPFrame(13, 100000)-1, f.buffered())
}

func TestTCPFramerPayloadAliases(t *testing.T) {
	f := newTCPFramer(100)
	f.feed(unhex(t, "030a4142 030b4344"))
	_, p1, ok, err := f.next()
	require.True(t, ok)
	require.NoError(t, err)
	// Appending to one payload does not write over the next frame.
	_ = append(p1, 'x')
	id, p2, ok, _ := f.next()
	require.True(t, ok)
	assert.Equal(t, uint32(11), id)
	assert.Equal(t, "CD", string(p2))
	assert.Equal(t, "AB", string(p1))
}

func TestTCPFramerErrorIsFinal(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want error
	}{{"070a6265666f7265 00 020101", errTCPFrameSize0}, {"070a6265666f7265 818080020a", errTCPFrameTooLarge}, {"070a6265666f7265 0180", errTCPFrameID}} {
		f := &tcpFramer{maxFrame: cppTCPMaxFrame}
		f.feed(unhex(t, tt.in))
		frames, err := drainTCPFramer(t, f)
		require.ErrorIs(t, err, tt.want)
		require.Equal(t, []tcpFrame{{10, []byte("before")}}, frames)
		f.feed(unhex(t, "020101"))
		_, _, ok, again := f.next()
		assert.False(t, ok)
		assert.Equal(t, err, again)
		assert.Zero(t, f.buffered())
		assert.Nil(t, f.buf, "the buffer is let go")
	}
}

func TestTCPFramerMemory(t *testing.T) {
	// A frame announcing 10 MiB: the framer's buffer grows with the bytes
	// that arrive, not with the announced size.
	f := newTCPFramer(defaultMaxMessageSize)
	frame := appendTCPFrame(nil, 10, tcpSeqPayload(1, 10<<20-1))
	f.feed(frame[:5])
	_, _, ok, err := f.next()
	require.NoError(t, err)
	require.False(t, ok)
	assert.LessOrEqual(t, cap(f.buf), tcpFramerMinBuf)
	// Nor does looking at it allocate anything, even for a moment.
	assert.Zero(t, testing.AllocsPerRun(10, func() { parseTCPFrame(frame[:5], defaultMaxMessageSize) }))
	assert.Zero(t, testing.AllocsPerRun(10, func() { f.next() }))
	arrived := 5
	for arrived < len(frame) {
		k := min(64<<10, len(frame)-arrived)
		f.feed(frame[arrived : arrived+k])
		arrived += k
		assert.LessOrEqual(t, cap(f.buf), 2*arrived, "after %d bytes", arrived)
		if arrived < len(frame) {
			_, _, ok, err := f.next()
			require.NoError(t, err)
			require.False(t, ok)
		}
	}
	id, p, ok, err := f.next()
	require.NoError(t, err)
	require.True(t, ok)
	assert.Equal(t, uint32(10), id)
	assert.True(t, bytes.Equal(frame[5:], p))
	// The next small frame lets the large buffer go.
	f.feed(unhex(t, "020101"))
	_, _, ok, _ = f.next()
	require.True(t, ok)
	assert.LessOrEqual(t, cap(f.buf), tcpFramerKeep)

	// The buffer grows by doubling: a 1 MiB frame in 1 KiB pieces takes a
	// handful of allocations, not one a piece.
	frame = appendTCPFrame(frame[:0], 10, tcpSeqPayload(2, 1<<20))
	allocs := testing.AllocsPerRun(1, func() {
		f := newTCPFramer(defaultMaxMessageSize)
		frames := 0
		for s := frame; len(s) > 0; s = s[min(1024, len(s)):] {
			f.feed(s[:min(1024, len(s))])
			if _, _, ok, _ := f.next(); ok {
				frames++
			}
		}
		require.Equal(t, 1, frames)
	})
	assert.LessOrEqual(t, allocs, 12.0)

	// Never past the longest frame plus the piece being fed.
	f = &tcpFramer{maxFrame: 1000}
	f.feed(unhex(t, "e807"))
	for range 20 {
		f.feed(make([]byte, 50))
		assert.LessOrEqual(t, cap(f.buf), f.maxHeld()+50)
	}
	_, _, ok, err = f.next()
	require.NoError(t, err)
	require.True(t, ok)
}

func TestTCPFramerNoAlloc(t *testing.T) {
	f := newTCPFramer(defaultMaxMessageSize)
	stream := appendTCPFrame(nil, 10, tcpSeqPayload(1, 200))
	stream = appendTCPFrame(stream, 11, tcpSeqPayload(2, 300))
	stream = appendTCPFrame(stream, 1, []byte{1})
	piece := stream[:len(stream)-250] // ends inside the second frame
	rest := stream[len(stream)-250:]
	allocs := testing.AllocsPerRun(100, func() {
		f.feed(piece)
		for {
			if _, _, ok, _ := f.next(); !ok {
				break
			}
		}
		f.feed(rest)
		for {
			if _, _, ok, _ := f.next(); !ok {
				break
			}
		}
	})
	require.Zero(t, allocs)
	require.Zero(t, f.buffered())
}

// tcpCaptureLine is one line of a testdata/reference/tcp/*.frames.txt.
type tcpCaptureLine struct {
	file string
	line int
	dir  string // c2s or s2c
	b    []byte
}

// tcpCaptures reads every testdata/reference/tcp/*.frames.txt, by file.
func tcpCaptures(t testing.TB) map[string][]tcpCaptureLine {
	files, err := filepath.Glob(filepath.Join("testdata", "reference", "tcp", "*.frames.txt"))
	require.NoError(t, err)
	require.Len(t, files, 6)
	all := map[string][]tcpCaptureLine{}
	for _, name := range files {
		f, err := os.Open(name)
		require.NoError(t, err)
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		base := strings.TrimSuffix(filepath.Base(name), ".frames.txt")
		for line := 1; sc.Scan(); line++ {
			fields := strings.Fields(sc.Text())
			require.Len(t, fields, 2, "%s:%d", name, line)
			require.Contains(t, []string{"c2s", "s2c"}, fields[0], "%s:%d", name, line)
			b, err := hex.DecodeString(fields[1])
			require.NoError(t, err, "%s:%d", name, line)
			all[base] = append(all[base], tcpCaptureLine{file: base, line: line, dir: fields[0], b: b})
		}
		require.NoError(t, sc.Err())
		f.Close()
	}
	return all
}

// tcpCaptureBadInput is the capture whose last c2s line is not a frame but
// the probe's bad input (README, File formats), and the error it gives.
var tcpCaptureBadInput = map[string]error{
	"pyprobe_size0":    errTCPFrameSize0,
	"pyprobe_oversize": errTCPFrameTooLarge,
}

// isTCPBadInput reports whether l is a capture's bad input.
func isTCPBadInput(lines []tcpCaptureLine, l tcpCaptureLine) bool {
	if tcpCaptureBadInput[l.file] == nil || l.dir != "c2s" {
		return false
	}
	for _, m := range lines {
		if m.dir == "c2s" && m.line > l.line {
			return false
		}
	}
	return true
}

func TestTCPGoldenFrames(t *testing.T) {
	// Every frame of every capture parses to exactly its bytes and
	// re-encodes identically; the one non-canonical size (the probe's, in
	// pyprobe_reserved) re-encodes to the shortest form.
	frames, nonCanonical, largest := 0, 0, 0
	for name, lines := range tcpCaptures(t) {
		for _, l := range lines {
			id, payload, n, err := parseTCPFrame(l.b, cppTCPMaxFrame)
			if isTCPBadInput(lines, l) {
				require.ErrorIs(t, err, tcpCaptureBadInput[name], "%s:%d", name, l.line)
				continue
			}
			require.NoError(t, err, "%s:%d", name, l.line)
			require.Equal(t, len(l.b), n, "%s:%d", name, l.line)
			again := appendTCPFrame(nil, id, payload)
			if name == "pyprobe_reserved" && l.dir == "c2s" && hex.EncodeToString(l.b) == "83000a4142" {
				assert.Equal(t, "030a4142", hex.EncodeToString(again))
				nonCanonical++
			} else {
				require.Equal(t, hex.EncodeToString(l.b), hex.EncodeToString(again), "%s:%d", name, l.line)
			}
			frames++
			largest = max(largest, n)
		}
	}
	t.Logf("%d frames parsed and re-encoded", frames)
	assert.Equal(t, 1, nonCanonical)
	assert.Equal(t, 100005, largest)
	assert.Greater(t, frames, 850)
}

func TestTCPGoldenStreams(t *testing.T) {
	// Each direction's whole stream, fed in random pieces, gives the same
	// frames as the capture's lines, then the bad input's error.
	for name, lines := range tcpCaptures(t) {
		for _, dir := range []string{"c2s", "s2c"} {
			var stream []byte
			var want []tcpFrame
			for _, l := range lines {
				if l.dir != dir {
					continue
				}
				stream = append(stream, l.b...)
				if !isTCPBadInput(lines, l) {
					id, p, _, err := parseTCPFrame(l.b, cppTCPMaxFrame)
					require.NoError(t, err)
					want = append(want, tcpFrame{id, append([]byte{}, p...)})
				}
			}
			wantErr := tcpCaptureBadInput[name]
			if dir == "s2c" {
				wantErr = nil
			}
			for seed := range uint64(4) {
				rng := rand.New(rand.NewPCG(seed, 23))
				f := &tcpFramer{maxFrame: cppTCPMaxFrame}
				var got []tcpFrame
				var err error
				for s := stream; len(s) > 0 && err == nil; {
					// Pieces from 1 byte to 64 KiB, most small.
					k := min(len(s), 1+rng.IntN(1<<rng.IntN(17)))
					f.feed(s[:k])
					s = s[k:]
					var frames []tcpFrame
					frames, err = drainTCPFramer(t, f)
					got = append(got, frames...)
				}
				require.Equal(t, len(want), len(got), "%s %s seed %d", name, dir, seed)
				for i := range want {
					require.Equal(t, want[i].id, got[i].id, "%s %s frame %d", name, dir, i)
					require.True(t, bytes.Equal(want[i].payload, got[i].payload), "%s %s frame %d", name, dir, i)
				}
				if wantErr != nil {
					require.ErrorIs(t, err, wantErr, "%s %s seed %d", name, dir, seed)
				} else {
					require.NoError(t, err, "%s %s seed %d", name, dir, seed)
					require.Zero(t, f.buffered(), "%s %s seed %d", name, dir, seed)
				}
			}
			if name == "refclient_echo" {
				assert.Len(t, want, 411, dir)
			}
		}
	}
}

// tcpFrameSeeds are FuzzTCPFrameStream's seeds (see TestWriteFuzzCorpus):
// short capture streams, the README's forms, and the bad inputs.
func tcpFrameSeeds(t testing.TB) map[string]struct {
	stream, pieces []byte
	limit          uint16
} {
	type seed = struct {
		stream, pieces []byte
		limit          uint16
	}
	seeds := map[string]seed{}
	caps := tcpCaptures(t)
	for _, name := range []string{"pyprobe_reserved", "pyprobe_size0", "pyprobe_oversize", "silence_idle"} {
		for _, dir := range []string{"c2s", "s2c"} {
			var s []byte
			for _, l := range caps[name] {
				if l.dir == dir {
					s = append(s, l.b...)
				}
			}
			seeds[name+"-"+dir] = seed{s, []byte{7, 0, 41, 2}, 1000}
		}
	}
	var s []byte
	for _, l := range caps["refclient_echo"][:12] {
		s = append(s, l.b...)
	}
	seeds["refclient_echo-start"] = seed{s, []byte{3, 200, 1, 255}, 200}
	seeds["forms"] = seed{unhex(t, "8300 0a 4142 81800000 0e 04 8a800000 06 80800100 4142 03 ff7f 41"), nil, 10}
	seeds["limit"] = seed{unhex(t, "0a 0a 000102030405060708 0b 0a"), []byte{1}, 10}
	seeds["id-overrun"] = seed{unhex(t, "020101 01 80"), []byte{2}, 10}
	return seeds
}

// FuzzTCPFrameStream feeds any bytes in any pieces (each byte of pieces is
// the next piece's length, 0 meaning 256; the last one repeats) to a
// framer whose size limit is limit: it never panics, holds no more than
// the longest frame plus one piece, gives the frames and the error that
// parsing the whole stream at once gives, and every frame it returns
// re-encodes to bytes that parse back to the same frame.
func FuzzTCPFrameStream(f *testing.F) {
	for _, s := range tcpFrameSeeds(f) {
		f.Add(s.stream, s.pieces, s.limit)
	}
	f.Fuzz(func(t *testing.T, stream, pieces []byte, limit uint16) {
		maxFrame := int(limit)
		// What parsing the whole stream at once gives.
		var want []tcpFrame
		var wantErr error
		wantLeft := 0
		for b := stream; ; {
			id, p, n, err := parseTCPFrame(b, maxFrame)
			if err != nil || n == 0 {
				wantErr, wantLeft = err, len(b)
				break
			}
			require.Positive(t, n)
			want = append(want, tcpFrame{id, p})
			b = b[n:]
		}

		fr := &tcpFramer{maxFrame: maxFrame}
		var got []tcpFrame
		var err error
		largest := 0
		for i, s := 0, stream; len(s) > 0; i++ {
			k := 256
			if len(pieces) > 0 {
				k = int(pieces[min(i, len(pieces)-1)])
			}
			if k == 0 {
				k = 256
			}
			k = min(k, len(s))
			held := fr.buffered()
			fr.feed(s[:k])
			s = s[k:]
			largest = max(largest, k)
			if err == nil {
				require.Equal(t, held+k, fr.buffered())
				require.Less(t, fr.buffered(), fr.maxHeld()+k)
				require.LessOrEqual(t, cap(fr.buf), fr.maxHeld()+largest)
			}
			for {
				id, p, ok, e := fr.next()
				if e != nil {
					if err != nil {
						require.Equal(t, err, e, "errors are final")
					}
					err = e
					require.Zero(t, fr.buffered())
					break
				}
				if !ok {
					break
				}
				require.False(t, err != nil, "a frame after an error")
				require.LessOrEqual(t, sizeVLE32(id)+len(p), maxFrame)
				// Re-encoded, it parses back to the same frame.
				again := appendTCPFrame(nil, id, p)
				require.Equal(t, sizeTCPFrame(id, len(p)), len(again))
				id2, p2, n, e := parseTCPFrame(again, maxFrame)
				require.NoError(t, e)
				require.Equal(t, len(again), n)
				require.Equal(t, id, id2)
				require.True(t, bytes.Equal(p, p2))
				got = append(got, tcpFrame{id, append([]byte{}, p...)})
			}
		}
		require.Equal(t, len(want), len(got))
		for i := range want {
			require.Equal(t, want[i].id, got[i].id)
			require.True(t, bytes.Equal(want[i].payload, got[i].payload))
		}
		if wantErr == nil {
			require.NoError(t, err)
			require.Equal(t, wantLeft, fr.buffered())
		} else {
			require.Error(t, err)
			require.Equal(t, wantErr.Error(), err.Error())
		}
	})
}
