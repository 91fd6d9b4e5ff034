package knet

// Variable-length encodings of the spec (DECISIONS §3). All are little-endian.
//
//	vle16: VLE-1.7/8, one or two bytes, values 0..32767.
//	vle32: VLE-1.7/1.7/16, one, two or four bytes, values 0..2^30-1.

const (
	maxVLE16 = 1<<15 - 1
	maxVLE32 = 1<<30 - 1
)

// appendVLE16 appends v in VLE-1.7/8 form: 1 or 2 bytes, at most 32767.
func appendVLE16(b []byte, v uint16) []byte {
	if v < 0x80 {
		return append(b, byte(v))
	}
	if v > maxVLE16 {
		panic("knet: vle16 overflow") // callers check values first
	}
	return append(b, 0x80|byte(v&0x7f), byte(v>>7))
}

// sizeVLE16 is the encoded size of v in VLE-1.7/8 form.
func sizeVLE16(v uint16) int {
	if v < 0x80 {
		return 1
	}
	return 2
}

// consumeVLE16 decodes a VLE-1.7/8 at the start of b; n < 0 means too short.
func consumeVLE16(b []byte) (v uint16, n int) {
	if len(b) == 0 || (b[0] >= 0x80 && len(b) < 2) {
		return 0, -1
	}
	if b[0] < 0x80 {
		return uint16(b[0]), 1
	}
	return uint16(b[0]&0x7f) | uint16(b[1])<<7, 2
}

// appendVLE32 appends v in VLE-1.7/1.7/16 form: 1, 2 or 4 bytes, at most 2^30-1.
func appendVLE32(b []byte, v uint32) []byte {
	switch {
	case v < 1<<7:
		return append(b, byte(v))
	case v < 1<<14:
		return append(b, 0x80|byte(v&0x7f), byte(v>>7))
	case v <= maxVLE32:
		w := v >> 14
		return append(b, 0x80|byte(v&0x7f), 0x80|byte((v>>7)&0x7f), byte(w), byte(w>>8))
	}
	panic("knet: vle32 overflow") // callers check values first
}

// sizeVLE32 is the encoded size of v in VLE-1.7/1.7/16 form.
func sizeVLE32(v uint32) int {
	switch {
	case v < 1<<7:
		return 1
	case v < 1<<14:
		return 2
	}
	return 4
}

// consumeVLE32 decodes a VLE-1.7/1.7/16 at the start of b; n < 0 means too short.
// Non-minimal encodings are accepted: the spec does not forbid them.
func consumeVLE32(b []byte) (v uint32, n int) {
	if len(b) == 0 {
		return 0, -1
	}
	if b[0] < 0x80 {
		return uint32(b[0]), 1
	}
	if len(b) < 2 {
		return 0, -1
	}
	if b[1] < 0x80 {
		return uint32(b[0]&0x7f) | uint32(b[1])<<7, 2
	}
	if len(b) < 4 {
		return 0, -1
	}
	return uint32(b[0]&0x7f) | uint32(b[1]&0x7f)<<7 | (uint32(b[2])|uint32(b[3])<<8)<<14, 4
}
