package knet

import (
	"encoding/binary"
	"testing"
	"time"

	"github.com/knet-go/knet/internal/netsim"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Unreliable latest state (a ContentID, not in order, naming nothing) goes
// after a tag with its number, as reliable latest state does (latest.go):
// an older version is never taken after a newer one, however many versions
// lie between and whichever of them were lost.

// versionsOf returns the version numbers of ID id that h took, in order.
func versionsOf(h *simHost, id uint32) []int {
	var got []int
	for _, m := range h.msgs {
		if m.ID == id {
			got = append(got, int(binary.LittleEndian.Uint32(m.Payload)))
		}
	}
	return got
}

// Version 1 is held back on the path; versions 2-9, each of which would
// have named it, are lost; 10-20 arrive; then version 1 comes. Named by
// back-references (up to eight), the receiver could not know it for older.
func TestLatestStateTaggedOlderNeverAfterNewer(t *testing.T) {
	p := newSimPair(t, nil, nil, perfect, perfect)
	p.connect()
	p.run(100*time.Millisecond, nil)
	var held []byte
	p.tap = func(from int, b []byte) {
		p.cut[0] = false
		if from != 0 {
			return
		}
		d, _, err := parseDatagram(b)
		require.NoError(t, err)
		for _, m := range d.msgs {
			if m.fragment || m.id != 300 {
				continue
			}
			switch v := binary.LittleEndian.Uint32(m.payload); {
			case v == 1:
				held = append([]byte(nil), b...)
				p.cut[0] = true
			case v <= 9:
				p.cut[0] = true
			}
		}
	}
	for v := 1; v <= 20; v++ {
		p.send(0, Message{ID: 300, ContentID: 4, Payload: versionPayload(v, 40)})
		p.run(time.Millisecond, nil)
	}
	p.run(50*time.Millisecond, nil)
	require.NotNil(t, held)
	p.tap = nil
	p.inject(1, held)
	p.run(50*time.Millisecond, nil)
	want := []int{10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20}
	assert.Equal(t, want, versionsOf(p.h[1], 300))
	assert.Equal(t, uint64(1), p.server().snapshot().ObsoleteMessages)
}

// A snapshot datagram carries its 12-byte tag and no dependency entries:
// the eight back-references it replaces took up to 24 bytes of header, and
// the sender's bookkeeping of them most of a game server's ordering work.
func TestLatestStateTaggedNamesNothing(t *testing.T) {
	p := newSimPair(t, nil, nil, perfect, perfect)
	p.connect()
	p.run(100*time.Millisecond, nil)
	var sizes []int
	p.tap = func(from int, b []byte) {
		if from != 0 {
			return
		}
		d, _, err := parseDatagram(b)
		require.NoError(t, err)
		for i, m := range d.msgs {
			if m.fragment || m.id != 300 {
				continue
			}
			assert.Empty(t, d.header.deltas, "a tagged version names nothing")
			assert.EqualValues(t, orderNone, m.order)
			require.Positive(t, i)
			tag, ok := parseLatestTag(d.msgs[i-1].payload)
			require.True(t, ok, "a tag before it")
			assert.Equal(t, uint32(4), tag.content)
			assert.Equal(t, binary.LittleEndian.Uint32(m.payload), tag.ver)
			sizes = append(sizes, len(b))
		}
	}
	for v := 1; v <= 30; v++ {
		p.send(0, Message{ID: 300, ContentID: 4, Payload: versionPayload(v, 200)})
		p.run(2*time.Millisecond, nil)
	}
	p.run(50*time.Millisecond, nil)
	require.Len(t, sizes, 30)
	for _, n := range sizes {
		// Header (at most 10 bytes), tag (12), block header and ID (4),
		// payload (200).
		assert.LessOrEqual(t, n, 10+maxLatestTag+4+200)
	}
	o := &p.client().send.order
	for _, tr := range o.fifo[o.fifoAt:] {
		assert.False(t, tr.hasKey, "no track kept for a tagged version")
	}
	assert.Empty(t, o.latest)
	assert.Len(t, versionsOf(p.h[1], 300), 30)
}

// A version of MaxUnreliablePayload bytes still goes unreliable with its
// tag: the tag takes the room the dependency entries would have.
func TestLatestStateTaggedFullSize(t *testing.T) {
	p := newSimPair(t, nil, nil, perfect, perfect)
	p.connect()
	p.run(100*time.Millisecond, nil)
	n := p.client().cfg.wholeLimit()
	for v := 1; v <= 5; v++ {
		p.send(0, Message{ID: 300, ContentID: 4, Payload: versionPayload(v, n)})
		p.run(5*time.Millisecond, nil)
	}
	p.run(50*time.Millisecond, nil)
	st := p.client().snapshot()
	assert.Zero(t, st.UnreliableAsReliable)
	assert.Equal(t, []int{1, 2, 3, 4, 5}, versionsOf(p.h[1], 300))
}

// Seeded chaos: versions of several states over a path that loses,
// duplicates and reorders: each state's versions arrive in increasing
// order, and a path that holds some back for long sees them dropped.
func TestLatestStateTaggedChaos(t *testing.T) {
	for seed := uint64(1); seed <= 6; seed++ {
		path := netsim.Params{Loss: 0.1, Duplicate: 0.05, Delay: 5 * time.Millisecond, Jitter: 20 * time.Millisecond, Seed: seed}
		p := newSimPair(t, nil, nil, path, perfect)
		p.connect()
		p.run(200*time.Millisecond, nil)
		for v := 1; v <= 400; v++ {
			p.send(0, Message{ID: 300 + uint32(v%3), ContentID: 1, Payload: versionPayload(v, 60)})
			p.run(time.Millisecond, nil)
		}
		p.run(time.Second, nil)
		total := 0
		for id := uint32(300); id < 303; id++ {
			got := versionsOf(p.h[1], id)
			for i := 1; i < len(got); i++ {
				require.Greater(t, got[i], got[i-1], "seed %d, state %d: version %d after %d", seed, id, got[i], got[i-1])
			}
			total += len(got)
		}
		// A tenth is lost; of the rest, those overtaken (the jitter is
		// twenty sends long) are dropped as obsolete, the others taken.
		obsolete := int(p.server().snapshot().ObsoleteMessages)
		assert.Greater(t, total, 100, "seed %d", seed)
		assert.GreaterOrEqual(t, total+obsolete, 320, "seed %d: every version that arrived taken or dropped as older", seed)
	}
}
