package knet

import (
	"errors"
	"fmt"
)

// kNet over TCP (issue 23): the stream framing of the C++ reference's TCP
// transport, as its captures show it (testdata/reference/tcp/README.md,
// "The wire" §2). Codec only; no transport uses it yet.
//
// A stream is frames back to back, in each direction independently, with
// nothing before the first:
//
//	size       VLE-1.7/1.7/16  bytes after this field: MessageID field + payload
//	MessageID  VLE-1.7/1.7/16
//	payload    size - (length of the MessageID field) bytes
//
// There are no flags, packet or message numbers, acks or fragments. A size
// of 0, or a size over the receiver's limit, makes the reference close the
// connection at once (README §5); longer than necessary VLE forms are
// accepted (README §2: `83 00 0a 41 42` is size 3).

// cppTCPMaxFrame is the reference's limit on a frame's size field, 10 MiB
// (README §5: 10485760 is allowed, 10485761 closes the connection).
const cppTCPMaxFrame = 10 << 20

// tcpSizeFieldMax and tcpIDFieldMax are the longest size and MessageID
// fields: the 4-byte VLE-1.7/1.7/16 form.
const (
	tcpSizeFieldMax = 4
	tcpIDFieldMax   = 4
)

var (
	errTCPFrameSize0    = errors.New("knet: tcp frame of size 0 (a frame holds at least its MessageID)")
	errTCPFrameTooLarge = errors.New("knet: tcp frame larger than the limit")
	errTCPFrameID       = errors.New("knet: tcp frame's MessageID runs past the frame's size")
)

// appendTCPFrame appends a frame carrying message id with payload, in the
// shortest VLE forms (as the reference writes them). id is at most 2^30-1
// and the size (MessageID field plus payload) likewise; callers check.
func appendTCPFrame(b []byte, id uint32, payload []byte) []byte {
	size := sizeVLE32(id) + len(payload)
	if size > maxVLE32 {
		panic("knet: tcp frame overflow") // callers check sizes first
	}
	b = appendVLE32(b, uint32(size))
	b = appendVLE32(b, id)
	return append(b, payload...)
}

// sizeTCPFrame is the encoded size of a frame carrying id with an n-byte
// payload.
func sizeTCPFrame(id uint32, n int) int {
	size := sizeVLE32(id) + n
	return sizeVLE32(uint32(size)) + size
}

// parseTCPFrame parses the frame at the start of b, whose size field may
// be at most maxSize. n is the frame's length in b; n == 0 with a nil error
// means b holds no whole frame yet. A size of 0 or over maxSize is an error
// as soon as the size field is complete, before the frame's other bytes
// arrive. payload aliases b (its capacity ends with the frame).
func parseTCPFrame(b []byte, maxSize int) (id uint32, payload []byte, n int, err error) {
	// size: VLE-1.7/1.7/16, the bytes after this field (README §2).
	size, k := consumeVLE32(b)
	if k < 0 {
		return 0, nil, 0, nil
	}
	if size == 0 {
		return 0, nil, 0, errTCPFrameSize0
	}
	if int64(size) > int64(maxSize) {
		return 0, nil, 0, fmt.Errorf("%w: size %d, the limit %d", errTCPFrameTooLarge, size, maxSize)
	}
	end := k + int(size)
	if len(b) < end {
		return 0, nil, 0, nil
	}
	body := b[k:end:end]
	// MessageID: VLE-1.7/1.7/16, inside the size (README §2: `01 0e`).
	id, m := consumeVLE32(body)
	if m < 0 {
		return 0, nil, 0, fmt.Errorf("%w: size %d", errTCPFrameID, size)
	}
	// payload: the rest of the frame.
	return id, body[m:], end, nil
}

// tcpFramerKeep is the buffer a framer keeps between frames; after a larger
// frame it lets the larger buffer go.
const tcpFramerKeep = 64 << 10

// tcpFramerMinBuf is the smallest buffer a framer allocates.
const tcpFramerMinBuf = 4 << 10

// tcpFramer cuts frames out of a byte stream that arrives in pieces of any
// size: feed it each piece as it is read, then call next until it reports
// no frame. It holds at most one incomplete frame between feeds, so with
// that pattern it never holds more than maxFrame+4 bytes plus one piece,
// and it grows its buffer with the bytes that arrived, never with the
// size a peer announces. The first error is final: the stream cannot be
// resynchronised, and the connection closes (README §5).
//
// The zero value is not usable: set maxFrame (newTCPFramer). A tcpFramer
// is not safe for concurrent use.
type tcpFramer struct {
	maxFrame int    // largest size field accepted
	buf      []byte // buf[off:] is received and not yet returned
	off      int
	err      error // the first error, returned by every later next
	// sealed: the frames from here on are a secure stream's, their
	// MessageID sealed in the body (parseSealedFrame); next returns the
	// body whole, with id 0.
	sealed bool
	// peekMax, when not 0, is the limit peek holds a size field to
	// instead of maxFrame: a server's stream reads its client's first
	// frame under the hello's limit, and the frames behind it, held until
	// the admission decides, under the established connection's.
	peekMax int
}

// newTCPFramer returns a framer accepting messages of up to maxMessage
// payload bytes (Config.MaxMessageSize) behind any MessageID.
func newTCPFramer(maxMessage int) *tcpFramer {
	return &tcpFramer{maxFrame: tcpMaxFrame(maxMessage)}
}

// tcpMaxFrame is the largest size field of a frame carrying up to
// maxMessage payload bytes: the payload plus the longest MessageID field,
// at most what the size field can hold.
func tcpMaxFrame(maxMessage int) int {
	if maxMessage > maxVLE32-tcpIDFieldMax {
		return maxVLE32
	}
	return max(maxMessage, 0) + tcpIDFieldMax
}

// setLimit changes the largest size field accepted, for the frames from
// the next one on.
func (f *tcpFramer) setLimit(maxFrame int) { f.maxFrame = maxFrame }

// maxHeld bounds an incomplete frame: the longest size field and the
// largest size.
func (f *tcpFramer) maxHeld() int { return tcpSizeFieldMax + f.maxFrame + sealOverhead }

// feed adds p, the next bytes of the stream, copying them: p may be
// reused once feed returns. It invalidates the payloads next returned
// before. After an error, feed drops p.
//
// Each byte is copied in at most once, moved to the front of the buffer
// at most once (only behind frames already returned), and copied along
// when the buffer grows, which it does by doubling: linear in the stream
// whatever the pieces.
func (f *tcpFramer) feed(p []byte) {
	if f.err != nil || len(p) == 0 {
		return
	}
	if f.off == len(f.buf) {
		f.buf, f.off = f.buf[:0], 0
	}
	unread := f.buf[f.off:]
	need := len(unread) + len(p)
	switch c := cap(f.buf); {
	case c > tcpFramerKeep && need <= tcpFramerKeep/2:
		// A large frame has gone: let its buffer go too.
		f.realloc(max(need, tcpFramerMinBuf))
	case len(f.buf)+len(p) <= c:
		// Room behind the unread bytes.
	case need <= c:
		// Room in front, where frames already returned were.
		f.buf, f.off = f.buf[:copy(f.buf, unread)], 0
	default:
		// Grow with what arrived: at most double, never past the
		// longest frame unless this piece needs it.
		f.realloc(max(need, min(2*c, f.maxHeld()), min(tcpFramerMinBuf, f.maxHeld())))
	}
	f.buf = append(f.buf, p...)
}

// realloc moves the unread bytes to the front of a new buffer of capacity c.
func (f *tcpFramer) realloc(c int) {
	nb := make([]byte, len(f.buf)-f.off, c)
	copy(nb, f.buf[f.off:])
	f.buf, f.off = nb, 0
}

// next returns the next whole frame, ok false when none has arrived yet.
// payload aliases the framer's buffer: it stays valid until the next
// feed. err wraps errTCPFrameSize0, errTCPFrameTooLarge or errTCPFrameID;
// the framer then drops its buffer and returns the same error for good.
func (f *tcpFramer) next() (id uint32, payload []byte, ok bool, err error) {
	if f.err != nil {
		return 0, nil, false, f.err
	}
	var n int
	if f.sealed {
		payload, n, err = parseSealedFrame(f.buf[f.off:], f.maxFrame)
	} else {
		id, payload, n, err = parseTCPFrame(f.buf[f.off:], f.maxFrame)
	}
	if err != nil {
		f.err = err
		f.buf, f.off = nil, 0
		return 0, nil, false, err
	}
	if n == 0 {
		return 0, nil, false, nil
	}
	f.off += n
	return id, payload, true, nil
}

// peek checks the size field of the next frame, if it has come, without
// taking the frame: an error (a size of 0, or over the limit, a sealed
// frame's tag allowed for) is final, as next's. It lets a stream held
// back (streamSession.gate) end at once on a frame it could never take.
func (f *tcpFramer) peek() error {
	if f.err != nil {
		return f.err
	}
	limit := f.maxFrame
	if f.peekMax > 0 {
		limit = f.peekMax
	}
	size, k := consumeVLE32(f.buf[f.off:])
	switch {
	case k < 0:
		return nil
	case size == 0:
		f.err = errTCPFrameSize0
	case int64(size) > int64(limit)+sealOverhead:
		f.err = fmt.Errorf("%w: size %d, the limit %d", errTCPFrameTooLarge, size, limit)
	default:
		return nil
	}
	f.buf, f.off = nil, 0
	return f.err
}

// buffered is how many received bytes next has not returned: at the end
// of the stream, more than 0 means the peer stopped inside a frame.
func (f *tcpFramer) buffered() int { return len(f.buf) - f.off }
