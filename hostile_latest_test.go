package knet

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func isLatestDatagram(b []byte) bool {
	d, _, err := parseDatagram(b)
	if err != nil || !d.header.reliable || len(d.msgs) < 2 {
		return false
	}
	_, ok := parseLatestTag(d.msgs[0].payload)
	return d.msgs[0].id == idExt && !d.msgs[0].fragment && ok
}

func latestTagsIn(b []byte) (ids []uint32, tags []latestTag) {
	d, _, err := parseDatagram(b)
	if err != nil || !d.header.reliable {
		return nil, nil
	}
	for i := 0; i+1 < len(d.msgs); i++ {
		if m := &d.msgs[i]; m.id == idExt && !m.fragment {
			if tag, ok := parseLatestTag(m.payload); ok {
				ids = append(ids, d.msgs[i+1].id)
				tags = append(tags, tag)
			}
		}
	}
	return ids, tags
}

func TestHostileLatestPassedOverVersionsGoOnce(t *testing.T) {
	p := newSimPair(t, nil, nil, perfect, perfect)
	p.connect()
	p.run(100*time.Millisecond, nil)
	sends := map[uint32]int{}
	p.tap = func(from int, b []byte) {
		if from != 0 {
			return
		}
		ids, _ := latestTagsIn(b)
		for _, id := range ids {
			sends[id]++
		}
	}
	released := p.h[0].released
	total := 0
	for i, size := range []int{1000, 1000, 10} {
		m := Message{ID: uint32(120 + i), Payload: versionPayload(1, size), Reliable: true, ContentID: 1}
		total += len(m.Payload)
		p.send(0, m)
	}
	require.True(t, p.run(5*time.Second, func() bool {
		return len(p.h[1].msgs) == 3 && p.client().loss.sent.count == 0 && p.client().latestQueued() == 0
	}))
	p.run(time.Second, nil)
	assert.Equal(t, map[uint32]int{120: 1, 121: 1, 122: 1}, sends, "each version sent once")
	assert.Equal(t, total, p.h[0].released-released, "each version's bytes released once")
	assert.Zero(t, p.server().snapshot().ObsoleteMessages)
}

func TestHostileLatestNumbersCountedPerState(t *testing.T) {
	p := newSimPair(t, nil, nil, perfect, perfect)
	p.connect()
	p.run(100*time.Millisecond, nil)
	got := map[uint32][]uint32{}
	p.tap = func(from int, b []byte) {
		if from != 0 {
			return
		}
		ids, tags := latestTagsIn(b)
		for i, id := range ids {
			got[id] = append(got[id], tags[i].ver)
		}
	}
	p.send(0, Message{ID: 120, Payload: versionPayload(1, 8), Reliable: true, ContentID: 1})
	p.run(100*time.Millisecond, nil)
	for v := range 50 {
		p.send(0, Message{ID: 121, Payload: versionPayload(v, 8), Reliable: true, ContentID: 1})
		p.run(time.Millisecond, nil)
	}
	p.send(0, Message{ID: 120, Payload: versionPayload(2, 8), Reliable: true, ContentID: 1})
	p.run(100*time.Millisecond, nil)
	require.Len(t, got[120], 2)
	assert.Equal(t, got[120][0]+1, got[120][1], "state 120's numbers: %v", got[120])
}

func TestHostileLatestSerialNumberBound(t *testing.T) {
	p := newSimPair(t, nil, nil, perfect, perfect)
	s := p.server()
	k := contentKey{120, 1}
	require.True(t, s.takeVersion(k, 0xffff_fff0))
	assert.True(t, s.takeVersion(k, 5), "wraps")
	assert.False(t, s.takeVersion(k, 5), "a copy")
	assert.False(t, s.takeVersion(k, 5+1<<31), "2^31 ahead reads as older")
	assert.True(t, s.takeVersion(k, 4+1<<31))
}

func TestHostileLatestEvictionBound(t *testing.T) {
	p := newSimPair(t, nil, nil, perfect, perfect)
	s := p.server()
	old := contentKey{120, 1}
	require.True(t, s.takeVersion(old, 100))
	for c := range uint32(4 * maxLatestStates) {
		s.takeVersion(contentKey{121, c}, 1)
		require.LessOrEqual(t, len(s.x.seen.newest), maxLatestStates)
	}
	_, kept := s.x.seen.newest[old]
	if !kept {
		assert.True(t, s.takeVersion(old, 50), "forgotten: an older version is taken")
	}
}
