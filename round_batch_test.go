package knet

import (
	"bytes"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet/internal/udp"
)

// A round that runs again, its timers due, writes its batch first: the
// batch holds the session's own buffers, which the next pass may change.
//
// CI once saw a client on the reference wire send PacketID 63 twice (the
// reference drops the second): its round stalled longer than the probe
// timeout between putting a reliable datagram in the batch and writing
// the batch, the next pass resent that datagram by renumbering it in
// place, and the batch then held the one buffer twice, both under the new
// PacketID. Here the round's hook stalls it so, on the bubble's clock.
func TestRoundStallWritesBatchFirst(t *testing.T) {
	for _, dialect := range []Dialect{DialectReference, DialectSpec} {
		t.Run(dialect.String(), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				nw := memNet(t)
				var rec *pidRecorder
				nw.wrapDial = func(s socket) socket {
					rec = &pidRecorder{socket: s, dialect: dialect}
					return rec
				}
				var client atomic.Pointer[Conn]
				var stalled, probeDue atomic.Bool
				nw.roundHook = func(c *Conn) {
					// The client's first pass that leaves a reliable
					// datagram of its own in the batch stalls past the
					// probe timeout (a second before any RTT sample).
					// The datagram may carry the ack that proves the
					// client's address to the server (an ack waits up
					// to MaxAckDelay): the server's handshake outlasts
					// the stall.
					if c == client.Load() && c.sess.loss.sent.count > 0 && stalled.CompareAndSwap(false, true) {
						time.Sleep(1500 * time.Millisecond)
						at, ok := c.sess.loss.nextTimeout(false)
						probeDue.Store(ok && !at.After(time.Now()))
					}
				}
				lcfg := testConfig()
				lcfg.ConnectTimeout = 10 * time.Second
				l := nw.listen(t, lcfg)
				serveEcho(t, l)
				cfg := testConfig()
				cfg.Dialect = dialect
				cfg.ConnectTimeout = 10 * time.Second
				c := nw.dial(t, l.Addr().String(), cfg)
				// Whatever the handshake left in flight is acked first,
				// so that the stalled datagram is the only one (an ack of
				// another, during the stall, puts the probe off).
				time.Sleep(time.Second)
				synctest.Wait()
				client.Store(c)
				require.NoError(t, c.Send(Message{ID: 9, Reliable: true, Payload: []byte("stalled")}))
				m, err := c.Receive(within(t, 30*time.Second))
				require.NoError(t, err, "client %+v", c.Stats())
				assert.Equal(t, "stalled", string(m.Payload))
				require.True(t, stalled.Load(), "the round never stalled")
				// Whether the datagram went again depends on whether the
				// ack came first; without the batch written first, it
				// always went again, in the same batch.
				require.True(t, probeDue.Load(), "the probe timer was not due after the stall: the test shows nothing")
				rec.mu.Lock()
				defer rec.mu.Unlock()
				assert.Empty(t, rec.repeated, "PacketIDs sent twice on the reference wire (the reference drops them)")
				assert.Empty(t, rec.sameBatch, "a batch that carried one buffer twice")
			})
		})
	}
}

// pidRecorder is a dialed socket that notes, on the reference wire, the
// PacketIDs written more than once (a resend there takes a new one; on
// the spec wire it keeps its own), and on either wire the batches that
// named one buffer twice.
type pidRecorder struct {
	socket
	dialect   Dialect
	mu        sync.Mutex
	seen      map[uint32]bool
	repeated  []uint32
	sameBatch []int
}

func (r *pidRecorder) note(b []byte) {
	if r.dialect != DialectReference || bytes.Equal(b, cppOpening[:]) {
		return
	}
	var h cppHeader
	if _, err := parseCppHeader(b, &h); err != nil {
		return
	}
	if r.seen == nil {
		r.seen = map[uint32]bool{}
	}
	if r.seen[h.packetID] {
		r.repeated = append(r.repeated, h.packetID)
	}
	r.seen[h.packetID] = true
}

func (r *pidRecorder) WriteTo(b []byte, to netip.AddrPort) error {
	r.mu.Lock()
	r.note(b)
	r.mu.Unlock()
	return r.socket.WriteTo(b, to)
}

func (r *pidRecorder) WriteBatch(w *udp.Writer, ps []udp.Packet) error {
	r.mu.Lock()
	for i := range ps {
		r.note(ps[i].Buf)
		for j := range i {
			if len(ps[i].Buf) > 0 && len(ps[j].Buf) > 0 && &ps[i].Buf[0] == &ps[j].Buf[0] {
				r.sameBatch = append(r.sameBatch, len(ps))
			}
		}
	}
	r.mu.Unlock()
	return r.socket.WriteBatch(w, ps)
}
