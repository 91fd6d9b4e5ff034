package main

import (
	"fmt"
	"io"
	"strings"
	"sync/atomic"
	"time"

	"github.com/knet-go/knet"
)

// statser is implemented by knet connections.
type statser interface {
	Stats() knet.Stats
}

func (k *knetConn) Stats() knet.Stats { return k.c.Stats() }

// tracer prints, every interval of a one-way stream, what the receiving
// application got and how knet's counters moved on both ends: the
// timeline behind a throughput figure (-trace).
type tracer struct {
	w        io.Writer
	label    string
	every    time.Duration
	client   msgConn
	server   *atomic.Pointer[msgConn]
	msgs     *atomic.Uint64
	size     int
	started  time.Time
	lastMsgs uint64
	lastS    knet.Stats // sender (client)
	lastR    knet.Stats // receiver (server)
}

// run samples until done is closed.
func (t *tracer) run(done <-chan struct{}) {
	cs, ok := t.client.(statser)
	if !ok {
		return
	}
	fmt.Fprintf(t.w, "trace %s: t, delivered MB/s | sender: send rate dgram/s, in flight, sent, retransmits (fast), spurious | receiver: recv, dropped (no room), dup, acks sent\n", t.label)
	tk := time.NewTicker(t.every)
	defer tk.Stop()
	for {
		select {
		case <-done:
			return
		case now := <-tk.C:
			var rs knet.Stats
			if p := t.server.Load(); p != nil {
				if s, ok := (*p).(statser); ok {
					rs = s.Stats()
				}
			}
			s := cs.Stats()
			m := t.msgs.Load()
			var b strings.Builder
			fmt.Fprintf(&b, "trace %s: %6.2fs %7.2f | %7.0f %5d %6d %5d (%5d) %4d | %6d %5d %4d %5d",
				t.label, now.Sub(t.started).Seconds(),
				float64(m-t.lastMsgs)*float64(t.size)/t.every.Seconds()/1e6,
				s.SendRate, s.InFlight,
				s.DatagramsSent-t.lastS.DatagramsSent, s.Retransmits-t.lastS.Retransmits,
				s.FastRetransmits-t.lastS.FastRetransmits, s.SpuriousLosses-t.lastS.SpuriousLosses,
				rs.DatagramsReceived-t.lastR.DatagramsReceived, rs.DroppedDatagrams-t.lastR.DroppedDatagrams,
				rs.DuplicateDatagrams-t.lastR.DuplicateDatagrams, rs.DatagramsSent-t.lastR.DatagramsSent)
			fmt.Fprintln(t.w, b.String())
			t.lastMsgs, t.lastS, t.lastR = m, s, rs
		}
	}
}
