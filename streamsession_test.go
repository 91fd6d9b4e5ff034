package knet

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// streamPeer joins two stream sessions by hand, on a fake clock.
type streamPeer struct {
	now  time.Time
	s    [2]*streamSession
	h    [2]*simHost
	rng  *rand.Rand
	sent [2][]byte // everything each side wrote
}

func newStreamPeer() *streamPeer {
	p := &streamPeer{now: timeZero, rng: rand.New(rand.NewPCG(1, 2))}
	for i := range 2 {
		p.h[i] = new(simHost)
		p.s[i] = newStreamSession(p.h[i], defaultMaxMessageSize, 15*time.Second, p.now)
	}
	return p
}

// flush writes what each side has, in pieces of random sizes, and feeds
// them to the other side.
func (p *streamPeer) flush(t *testing.T) {
	for i, s := range p.s {
		for b := s.take(1 << 20); len(b) > 0; b = s.take(1 << 20) {
			n := min(len(b), 1+p.rng.IntN(3000))
			p.sent[i] = append(p.sent[i], b[:n]...)
			require.NoError(t, p.s[1-i].received(p.now, b[:n]))
			s.wrote(n)
		}
	}
}

func streamMsg(m Message) *outMsg {
	return &outMsg{id: m.ID, payload: append([]byte(nil), m.Payload...), reliable: m.Reliable,
		inOrder: m.InOrder, priority: m.Priority, contentID: m.ContentID}
}

// Messages cross as frames, in order, in pieces of any size; both sides
// ping at once and measure the round trip; what they get reads as
// unreliable and not in order, as the reference marks it.
func TestStreamSessionExchange(t *testing.T) {
	p := newStreamPeer()
	for i := range 2 {
		p.s[i].advance(p.now)
	}
	for k := range 200 {
		p.s[0].enqueue(streamMsg(Message{ID: 100 + uint32(k%3), Payload: seqPayload(k), Reliable: k%2 == 0}))
	}
	p.s[0].enqueue(streamMsg(Message{ID: 300, Payload: make([]byte, 100_000), Reliable: true}))
	p.flush(t)
	p.now = p.now.Add(20 * time.Millisecond)
	p.flush(t) // the ping replies
	require.Len(t, p.h[1].msgs, 201)
	for k, m := range p.h[1].msgs[:200] {
		assert.Equal(t, seqPayload(k), m.Payload)
		assert.Equal(t, 100+uint32(k%3), m.ID)
		assert.False(t, m.Reliable || m.InOrder)
	}
	assert.Len(t, p.h[1].msgs[200].Payload, 100_000)
	// Side 1 answered side 0's ping in the same flush; side 0 answered
	// side 1's 20ms later.
	assert.True(t, p.s[0].pingSent.IsZero(), "side 0's ping answered")
	assert.Equal(t, 20*time.Millisecond, p.s[1].rtt)
	// The reference's first bytes: PingRequest 1.
	assert.Equal(t, []byte{0x02, 0x01, 0x01}, p.sent[1][:3])
}

// Delivery modes on a stream: an unreliable message is dropped at the
// sender behind a long queue, latest state replaces the queued version,
// priority orders the queue.
func TestStreamSessionDeliveryModes(t *testing.T) {
	p := newStreamPeer()
	s := p.s[0]
	s.enqueue(streamMsg(Message{ID: 100, Payload: make([]byte, streamUnreliableLimit+1), Reliable: true}))
	s.enqueue(streamMsg(Message{ID: 101, Payload: []byte("late")})) // dropped
	s.enqueue(streamMsg(Message{ID: 102, Payload: []byte("v1"), ContentID: 1, Reliable: true}))
	s.enqueue(streamMsg(Message{ID: 102, Payload: []byte("v2"), ContentID: 1, Reliable: true})) // replaces v1
	s.enqueue(streamMsg(Message{ID: 103, Payload: []byte("urgent"), Reliable: true, Priority: 5}))
	p.flush(t)
	var got []string
	for _, m := range p.h[1].msgs {
		if m.ID != 100 {
			got = append(got, string(m.Payload))
		}
	}
	assert.Equal(t, []string{"urgent", "v2"}, got)
	assert.Equal(t, uint64(1), s.stats.DroppedMessages)
	assert.Equal(t, uint64(1), s.stats.ReplacedMessages)
}

// A peer that says nothing for the lost timeout is gone; one that pings
// is not. An unsolicited PingReply changes nothing.
func TestStreamSessionSilence(t *testing.T) {
	p := newStreamPeer()
	for range 10 {
		for i := range 2 {
			p.s[i].advance(p.now)
		}
		p.flush(t)
		p.now = p.now.Add(streamPingInterval)
	}
	require.NoError(t, p.s[0].err)
	require.NoError(t, p.s[0].received(p.now, []byte{0x02, 0x02, 0x55}))
	assert.NoError(t, p.s[0].err)
	p.now = p.now.Add(15 * time.Second)
	p.s[0].advance(p.now)
	var te *TimeoutError
	assert.ErrorAs(t, p.s[0].err, &te, "a peer silent for the lost timeout is gone")
}

// A frame of size 0 or over the limit ends the session with its error;
// reserved IDs other than the pings are the application's data.
func TestStreamSessionBadFrames(t *testing.T) {
	p := newStreamPeer()
	s := p.s[1]
	require.NoError(t, s.received(p.now, []byte{0x04, 0xff, 0xff, 0xff, 0xff})) // 0x3FFFFFFF, a Disconnect on UDP
	require.Len(t, p.h[1].msgs, 1)
	assert.Equal(t, uint32(idDisconnect), p.h[1].msgs[0].ID)
	err := s.received(p.now, []byte{0x00})
	assert.ErrorIs(t, err, errTCPFrameSize0)
	assert.ErrorIs(t, s.received(p.now, []byte{0x01, 0x06}), errTCPFrameSize0, "the first error stays")

	q := newStreamPeer()
	assert.ErrorIs(t, q.s[1].received(q.now, []byte{0x81, 0x80, 0x80, 0x7f}), errTCPFrameTooLarge)
	assert.Equal(t, uint64(1), q.s[1].stats.ProtocolErrors)
}

// A ping due while a frame is half written goes after it, never inside it.
func TestStreamSessionPingAfterPartialFrame(t *testing.T) {
	p := newStreamPeer()
	s := p.s[0]
	s.enqueue(streamMsg(Message{ID: 100, Payload: make([]byte, 5000), Reliable: true}))
	b := s.take(1 << 20)
	require.NoError(t, p.s[1].received(p.now, b[:1000]))
	s.wrote(1000)
	s.advance(p.now) // a ping is due
	p.flush(t)
	require.Len(t, p.h[1].msgs, 1)
	assert.Len(t, p.h[1].msgs[0].Payload, 5000)
	assert.NoError(t, p.s[1].err)
}
