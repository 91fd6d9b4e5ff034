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
