package knet

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The dissector's kNet over TCP (knetgo_tcp in tools/wireshark/knet.lua)
// against the reference's TCP captures: the frames tshark finds, per
// direction and in order, must be those of each capture's .frames.txt.
// The small captures are read as captured; every capture is also rebuilt
// from its .frames.txt as a TCP stream cut into segments at arbitrary
// bytes (inside size fields, inside the 100005-byte frame), so that the
// dissector must reassemble.

const tcpServerPort = 42000

// tcpPcap writes LINKTYPE_RAW records of one TCP connection on 127.0.0.1.
type tcpPcap struct {
	buf  bytes.Buffer
	at   time.Duration
	seq  [2]uint32 // next sequence number, client's and server's
	port [2]uint16
}

func newTCPPcap(clientPort, serverPort uint16) *tcpPcap {
	w := &tcpPcap{seq: [2]uint32{1000, 5000}, port: [2]uint16{clientPort, serverPort}}
	hdr := make([]byte, 24)
	binary.LittleEndian.PutUint32(hdr[0:], 0xa1b2c3d4)
	binary.LittleEndian.PutUint16(hdr[4:], 2)
	binary.LittleEndian.PutUint16(hdr[6:], 4)
	binary.LittleEndian.PutUint32(hdr[16:], 262144)
	binary.LittleEndian.PutUint32(hdr[20:], 101)
	w.buf.Write(hdr)
	// The handshake: a SYN counts one sequence number each way.
	w.segment(0, 0x02, nil)
	w.seq[0]++
	w.segment(1, 0x12, nil)
	w.seq[1]++
	w.segment(0, 0x10, nil)
	return w
}

// segment writes one TCP segment from side (0 client, 1 server).
func (w *tcpPcap) segment(side int, flags byte, payload []byte) {
	w.at += time.Millisecond
	ip := make([]byte, 40, 40+len(payload))
	ip[0] = 0x45
	binary.BigEndian.PutUint16(ip[2:], uint16(40+len(payload)))
	ip[8] = 64
	ip[9] = 6 // TCP
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
	binary.BigEndian.PutUint16(ip[20:], w.port[side])
	binary.BigEndian.PutUint16(ip[22:], w.port[1-side])
	binary.BigEndian.PutUint32(ip[24:], w.seq[side])
	if flags != 0x02 {
		binary.BigEndian.PutUint32(ip[28:], w.seq[1-side])
		flags |= 0x10 // ACK
	}
	ip[32] = 5 << 4
	ip[33] = flags
	binary.BigEndian.PutUint16(ip[34:], 65535)
	w.seq[side] += uint32(len(payload))
	rec := make([]byte, 16)
	binary.LittleEndian.PutUint32(rec[0:], uint32(w.at/time.Second))
	binary.LittleEndian.PutUint32(rec[4:], uint32(w.at%time.Second/time.Microsecond))
	binary.LittleEndian.PutUint32(rec[8:], uint32(len(ip)+len(payload)))
	binary.LittleEndian.PutUint32(rec[12:], uint32(len(ip)+len(payload)))
	w.buf.Write(rec)
	w.buf.Write(ip)
	w.buf.Write(payload)
}

// tcpCuts are the segment sizes the rebuilt streams are cut into, in turn:
// some cut size fields and MessageIDs, the largest is loopback's.
var tcpCuts = []int{9, 1, 2, 3, 517, 1460, 4000, 65483, 7, 33000}

// tcpPcapOf rebuilds a capture from its frames: each direction's bytes in
// the order of the lines, cut by tcpCuts, a direction's pending bytes
// going out when the other one speaks.
func tcpPcapOf(lines []tcpCaptureLine) *tcpPcap {
	w := newTCPPcap(40000, tcpServerPort)
	var pending [2][]byte
	cut := [2]int{}
	flush := func(side int, all bool) {
		for len(pending[side]) > 0 {
			n := tcpCuts[cut[side]%len(tcpCuts)]
			if n > len(pending[side]) {
				if !all {
					return
				}
				n = len(pending[side])
			}
			w.segment(side, 0x08, pending[side][:n])
			pending[side] = pending[side][n:]
			cut[side]++
		}
	}
	last := -1
	for _, ln := range lines {
		side := 0
		if ln.dir == "s2c" {
			side = 1
		}
		if last >= 0 && last != side {
			flush(last, true)
		}
		pending[side] = append(pending[side], ln.b...)
		flush(side, false)
		last = side
	}
	flush(0, true)
	flush(1, true)
	return w
}

// tsharkTCP runs tshark with the dissector over file and returns, per
// direction (0 client, 1 server), the MessageIDs of the frames it found,
// and the malformed reports.
func tsharkTCP(t *testing.T, file string, serverPort uint16, decodeAs bool) (ids [2][]uint32, malformed []string) {
	t.Helper()
	args := []string{"-n", "-X", "lua_script:" + dissectorScript, "-r", file, "-T", "fields", "-E", "separator=|",
		"-e", "tcp.srcport", "-e", "knetgo_tcp.id", "-e", "_ws.expert.message"}
	if decodeAs {
		args = append(args, "-d", fmt.Sprintf("tcp.port==%d,knetgo_tcp", serverPort))
	}
	cmd := exec.Command(tshark(t), args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	require.NoError(t, err, "tshark: %s", stderr.String())
	require.NotContains(t, stderr.String(), "Lua", "tshark: %s", stderr.String())
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Split(line, "|")
		require.Len(t, f, 3, "%q", line)
		require.NotContains(t, f[2], "Lua Error")
		side := 0
		if f[0] == strconv.Itoa(int(serverPort)) {
			side = 1
		}
		if f[1] != "" {
			for _, s := range strings.Split(f[1], ",") {
				id, err := strconv.ParseUint(s, 10, 32)
				require.NoError(t, err)
				ids[side] = append(ids[side], uint32(id))
			}
		}
		for _, m := range strings.Split(f[2], ",") {
			if strings.Contains(m, "frame size") || strings.Contains(m, "MessageID runs") {
				malformed = append(malformed, m)
			}
		}
	}
	return ids, malformed
}

// captureIDs lists each direction's MessageIDs in a capture's frames, and
// whether it ends with the probe's bad input (size 0, oversize).
func captureIDs(t *testing.T, name string, lines []tcpCaptureLine) (ids [2][]uint32, bad bool) {
	for i, ln := range lines {
		id, _, n, err := parseTCPFrame(ln.b, cppTCPMaxFrame)
		if err != nil {
			require.ErrorIs(t, err, tcpCaptureBadInput[name], "line %d", i+1)
			bad = true
			continue
		}
		require.Equal(t, len(ln.b), n)
		side := 0
		if ln.dir == "s2c" {
			side = 1
		}
		ids[side] = append(ids[side], id)
	}
	return ids, bad
}

func TestDissectorTCP(t *testing.T) {
	t.Parallel()
	tshark(t)
	caps := tcpCaptures(t)
	require.NotEmpty(t, caps)
	for name, lines := range caps {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			want, bad := captureIDs(t, name, lines)
			// Rebuilt from the frames, cut anywhere: by Decode As, and
			// by the heuristic alone (the stream opens with a ping).
			file := filepath.Join(t.TempDir(), name+".pcap")
			require.NoError(t, os.WriteFile(file, tcpPcapOf(lines).buf.Bytes(), 0o644))
			got, malformed := tsharkTCP(t, file, tcpServerPort, true)
			assert.Equal(t, want, got, "frames by direction, rebuilt capture")
			assert.Equal(t, bad, len(malformed) == 1, "malformed reports %q", malformed)
			if !bad {
				// The probes' c2s may open with data the heuristic
				// does not claim; the others open with a ping.
				got, _ := tsharkTCP(t, file, tcpServerPort, false)
				assert.Equal(t, want, got, "frames by direction, by the heuristic")
			}

			// The capture itself, when the repository holds it.
			real := filepath.Join("testdata", "reference", "tcp", name+".pcap")
			if _, err := os.Stat(real); err != nil {
				t.Logf("%s not in the repository (only its frames)", real)
				return
			}
			got, malformed = tsharkTCP(t, real, tcpCapturePort(t, name), true)
			assert.Equal(t, want, got, "frames by direction, %s", real)
			assert.Equal(t, bad, len(malformed) == 1, "malformed reports %q", malformed)
			t.Logf("%s: %d + %d frames", name, len(got[0]), len(got[1]))
		})
	}
}

// tcpCapturePort is the server port of a capture (the README's table).
func tcpCapturePort(t *testing.T, name string) uint16 {
	ports := map[string]uint16{"refclient_echo": 42001, "silence_idle": 42002, "opening_serverfirst": 42003,
		"pyprobe_reserved": 42004, "pyprobe_size0": 42005, "pyprobe_oversize": 42006}
	p, ok := ports[name]
	require.True(t, ok, name)
	return p
}

// The hello is shown as what it is.
func TestDissectorTCPHello(t *testing.T) {
	tshark(t)
	w := newTCPPcap(40001, tcpServerPort)
	hello := appendTCPFrame(nil, idPingReply, appendStreamHello(nil, helloClient, []byte("let me in")))
	w.segment(0, 0x08, append(hello, appendTCPFrame(nil, idPingRequest, []byte{1})...))
	w.segment(1, 0x08, appendTCPFrame(nil, idPingReply, appendStreamHello(nil, helloAccept, nil)))
	file := filepath.Join(t.TempDir(), "hello.pcap")
	require.NoError(t, os.WriteFile(file, w.buf.Bytes(), 0o644))
	cmd := exec.Command(tshark(t), "-n", "-X", "lua_script:"+dissectorScript, "-r", file, "-T", "fields", "-E", "separator=|",
		"-e", "knetgo_tcp.hello", "-e", "knetgo_tcp.hello.content", "-e", "_ws.col.Info")
	out, err := cmd.Output()
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	require.Len(t, lines, 5, "%s", out) // the handshake's three, then two
	assert.Equal(t, "1|"+hex.EncodeToString([]byte("let me in"))+"|knet hello 1, PingRequest", strings.ReplaceAll(lines[3], ":", ""))
	assert.Equal(t, "2||knet hello 2", lines[4])
}
