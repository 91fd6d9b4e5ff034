package knet

import (
	"context"
	"errors"
	"time"
)

// rateRing keeps a connection's counters every rateStep over the last
// rateSpan, for the rates and loss in Stats.
type rateRing struct {
	ring [rateSamples]countSample
	n    int // samples held
	head int // oldest
	last countSample
}

type countSample struct {
	at                                 time.Time
	bytesOut, bytesIn, msgsOut, msgsIn uint64
	pidAdvance, uniqueIn               uint64
}

const (
	rateStep    = 250 * time.Millisecond
	rateSamples = 9 // two seconds of steps
)

// note records the counters at now, every rateStep at most.
func (r *rateRing) note(now time.Time, st *Stats, pidAdvance, uniqueIn uint64) {
	r.last = countSample{at: now, bytesOut: st.BytesSent, bytesIn: st.BytesReceived,
		msgsOut: st.MessagesSent, msgsIn: st.MessagesReceived, pidAdvance: pidAdvance, uniqueIn: uniqueIn}
	if r.n > 0 && now.Sub(r.ring[(r.head+r.n-1)%rateSamples].at) < rateStep {
		return
	}
	if r.n == rateSamples {
		r.head = (r.head + 1) % rateSamples
		r.n--
	}
	r.ring[(r.head+r.n)%rateSamples] = r.last
	r.n++
}

// fill sets st's rates and loss from the oldest sample to the latest
// counters, over the time to now (so they fall when traffic stops).
func (r *rateRing) fill(now time.Time, st *Stats) {
	if r.n == 0 {
		return
	}
	old := &r.ring[r.head]
	dt := now.Sub(old.at).Seconds()
	if dt <= 0 {
		return
	}
	l := &r.last
	st.SendBytesPerSecond = float64(l.bytesOut-old.bytesOut) / dt
	st.ReceiveBytesPerSecond = float64(l.bytesIn-old.bytesIn) / dt
	st.SendMessagesPerSecond = float64(l.msgsOut-old.msgsOut) / dt
	st.ReceiveMessagesPerSecond = float64(l.msgsIn-old.msgsIn) / dt
	if adv := l.pidAdvance - old.pidAdvance; adv > 0 {
		got := l.uniqueIn - old.uniqueIn
		st.LossRate = max(0, 1-float64(got)/float64(adv))
	}
}

// quality is Stats.Quality.
func quality(loss float64, rtt time.Duration) float64 {
	q := max(0, 1-loss/0.25)
	if over := rtt - 80*time.Millisecond; over > 0 {
		q *= max(0, 1-float64(over)/float64(420*time.Millisecond))
	}
	return q
}

// MaxUnreliablePayload is the largest payload an unreliable message can
// have and still travel as one unreliable datagram with this
// configuration (1304 bytes at the default MaxDatagramSize). A larger one
// goes as a reliable fragmented transfer, as the protocol requires:
// retransmitted, and counted in Stats.UnreliableAsReliable.
func (c *Config) MaxUnreliablePayload() int { return c.resolve().wholeLimit() }

// MaxUnreliablePayload is Config.MaxUnreliablePayload for this
// connection.
func (c *Conn) MaxUnreliablePayload() int { return c.cfg.wholeLimit() }

// Conns returns the listener's established connections that have not
// ended, accepted or not yet.
func (l *Listener) Conns() []*Conn {
	var cs []*Conn
	for _, ep := range l.eps {
		ep.mu.Lock()
		for _, c := range ep.conns {
			select {
			case <-c.estab:
				if !c.ended() {
					cs = append(cs, c)
				}
			default:
			}
		}
		ep.mu.Unlock()
	}
	return cs
}

// ErrSendBufferFull is what Broadcast reports for a connection whose send
// buffer had no room for the message.
var ErrSendBufferFull = errors.New("knet: send buffer full")

// Broadcast sends m to every connection in conns without ever waiting,
// so that one slow client cannot hold up a game's tick, and returns how
// many took it. A connection whose SendBuffer is full does not get m:
// miss, if not nil, is called with it and ErrSendBufferFull (for an
// unreliable m the connection's Stats.DroppedMessages counts it too), and
// likewise with the error of a connection that has ended. A client that
// keeps missing reliable messages cannot keep up: a server usually drops
// it (CloseWithReason).
//
// The payload is copied once per connection into its send queue (no
// allocation in steady state); each connection then packs it with its own
// traffic, so its datagrams are that connection's.
func Broadcast(conns []*Conn, m Message, miss func(*Conn, error)) int {
	n := 0
	for _, c := range conns {
		if err := c.TrySend(m); err == nil {
			n++
		} else if miss != nil {
			miss(c, err)
		}
	}
	return n
}

// doneCtx is a context already done: a send with it never waits.
var doneCtx = func() context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return ctx
}()
