package knet

import (
	"encoding/hex"
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestAppendVLE16(t *testing.T) {
	for _, tt := range []struct {
		v    uint16
		want string
	}{
		{0, "00"}, {5, "05"}, {127, "7f"}, {128, "8001"}, {200, "c801"},
		{300, "ac02"}, {16383, "ff7f"}, {16384, "8080"}, {32767, "ffff"},
	} {
		b := appendVLE16(nil, tt.v)
		assert.Equal(t, tt.want, hex.EncodeToString(b), "v=%d", tt.v)
		assert.Equal(t, len(b), sizeVLE16(tt.v), "size v=%d", tt.v)
		v, n := consumeVLE16(append(b, 0xee)) // trailing byte must be left alone
		assert.Equal(t, tt.v, v, "decode v=%d", tt.v)
		assert.Equal(t, len(b), n, "decoded length v=%d", tt.v)
	}
	assert.Panics(t, func() { appendVLE16(nil, 32768) })
}

func TestConsumeVLE16Short(t *testing.T) {
	for _, in := range []string{"", "80", "ff"} {
		b, _ := hex.DecodeString(in)
		_, n := consumeVLE16(b)
		assert.Negative(t, n, "input %q", in)
	}
}

func TestAppendVLE32(t *testing.T) {
	for _, tt := range []struct {
		v    uint32
		want string
	}{
		// DECISIONS §3 examples, then each width's boundaries.
		{5, "05"}, {300, "ac02"}, {100000, "a08d0600"},
		{0, "00"}, {127, "7f"}, {128, "8001"}, {16383, "ff7f"},
		{16384, "80800100"}, {70000, "f0a20400"}, {1000000, "c0843d00"},
		{0x3FFFFFFA, "faffffff"}, {0x3FFFFFFE, "feffffff"}, {0x3FFFFFFF, "ffffffff"},
	} {
		b := appendVLE32(nil, tt.v)
		assert.Equal(t, tt.want, hex.EncodeToString(b), "v=%d", tt.v)
		assert.Equal(t, len(b), sizeVLE32(tt.v), "size v=%d", tt.v)
		v, n := consumeVLE32(append(b, 0xee))
		assert.Equal(t, tt.v, v, "decode v=%d", tt.v)
		assert.Equal(t, len(b), n, "decoded length v=%d", tt.v)
	}
	assert.Panics(t, func() { appendVLE32(nil, 1<<30) })
}

func TestConsumeVLE32Short(t *testing.T) {
	for _, in := range []string{"", "80", "ff", "8080", "808001"} {
		b, _ := hex.DecodeString(in)
		_, n := consumeVLE32(b)
		assert.Negative(t, n, "input %q", in)
	}
}

func TestConsumeVLE32NonMinimal(t *testing.T) {
	// The spec does not require the shortest form; a longer one decodes.
	for _, tt := range []struct {
		in   string
		want uint32
		n    int
	}{{"8500", 5, 2}, {"85800000", 5, 4}, {"ac820000", 300, 4}} {
		b, _ := hex.DecodeString(tt.in)
		v, n := consumeVLE32(b)
		assert.Equal(t, tt.want, v, tt.in)
		assert.Equal(t, tt.n, n, tt.in)
	}
}
