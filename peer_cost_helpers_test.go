package knet

import (
	"net/netip"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Costly datagrams measured where a server pays for them (issue 38, finding
// 3): peerBench drives a session, which leaves out what a connection does
// around each datagram, so that an honest 1200-byte datagram cost 0.5-0.6µs
// there (plaintext), against 1.5-4.7µs from outside, and ten times it was
// less than parsing 465 message blocks takes. peerRoundBench hands the
// datagrams to a Listener's connection as its socket reader does (its
// inbox, in the endpoint's packets) and runs the connection's rounds on the
// measuring thread, one round per datagram: the inbox drained, the datagram
// opened if secure and handled, the timers due run, the acks built and
// written (to the network in memory), the results published. What it leaves
// out is the kernel's part, the same for every shape.

// peerCostMeter is a bench of one shape of datagram: peerBench (the session
// alone) or peerRoundBench (a connection's rounds).
type peerCostMeter interface {
	// perByte times a batch of n datagrams and returns the CPU per
	// byte, in nanoseconds.
	perByte(n int) float64
	// sizeOf is the mean size of the last batch's datagrams.
	sizeOf() int
	// ended is why the victim's session ended, if it did.
	ended() error
	shapeOf() peerShape
}

func (b *peerBench) sizeOf() int             { return b.size / len(b.batch) }
func (b *peerBench) ended() error            { return b.srv.err }
func (b *peerBench) shapeOf() peerShape      { return b.shape }
func (b *peerRoundBench) sizeOf() int        { return b.size / len(b.batch) }
func (b *peerRoundBench) ended() error       { return b.c.sess.err }
func (b *peerRoundBench) shapeOf() peerShape { return b.shape }

// peerRoundBench is a Listener's connection from the evil peer (over the
// network in memory), taking one shape of datagram in rounds run here.
type peerRoundBench struct {
	t     testing.TB
	shape peerShape
	l     *Listener
	c     *Conn
	e     *peerEvil
	from  netip.AddrPort
	gen   peerGen
	batch [][]byte
	size  int
}

// newPeerRoundBench connects the evil peer to a Listener, secure or not,
// and readies the shape (its setup, as the Listener's connection's: what
// the victim has in flight).
func newPeerRoundBench(t testing.TB, sh peerShape, secure bool) *peerRoundBench {
	t.Helper()
	nw := memNet(t)
	priv, pub := peerKeys(t, secure)
	l := nw.listen(t, &Config{PrivateKey: priv, DisconnectTimeout: 200 * time.Millisecond})
	server := addrOf(l.Addr())
	sock := peerEvilSocket(t, nw, server)
	e := peerDialEvil(t, sock, server, pub, 0)
	b := &peerRoundBench{t: t, shape: sh, l: l, c: serverConn(t, l), e: e, from: sock.Addr()}
	b.gen = peerGen{pid: e.skip(0), ahead: func() uint32 { return b.c.sess.send.nextPID }}
	if sh.setup != nil {
		b.setup()
	}
	return b
}

// setup puts what the shape's setup asks for in flight, as peerInFlight
// does: 3000 reliable datagrams of the victim's, which the evil peer never
// acks (sent past the congestion window, which would let a few dozen go).
func (b *peerRoundBench) setup() {
	require.True(b.t, b.take())
	defer b.c.release()
	s, now := b.c.sess, time.Now()
	spare := make([]byte, 0, 65536+wireOverhead)
	for range 3000 {
		d := appendDatagram(make([]byte, 0, 1200), &datagram{header: header{packetID: s.send.nextPID, reliable: true}, msgs: []message{{id: 6, payload: make([]byte, 1100)}}})
		s.sentReliable(now, s.send.nextPID, d, &packing{})
		if b.c.sec != nil {
			_, err := b.c.sec.sealOut(s, d, spare) // resends must have been sealed once
			require.NoError(b.t, err)
		}
	}
	require.Equal(b.t, 3000, s.loss.sent.count)
}

// take claims the connection: no one else runs its rounds until release.
// It reports false for a connection that ended (a shape that broke the
// protocol ends it, and an ended connection is claimed by no one).
func (b *peerRoundBench) take() bool {
	for !b.c.claim() {
		if b.c.ended() {
			return false
		}
		runtime.Gosched()
	}
	return true
}

// prepare builds the next n datagrams, sealed in a secure session, as the
// evil peer would send them.
func (b *peerRoundBench) prepare(n int) {
	b.batch = b.batch[:0]
	b.size = 0
	for range n {
		d := b.shape.next(&b.gen)
		b.gen.n++
		var h header
		_, err := parseHeader(d, &h)
		require.NoError(b.t, err)
		b.e.mu.Lock()
		if b.e.sec != nil {
			d, err = b.e.sec.seal(nil, d, uint64(h.packetID), true)
		}
		if !seqLess(h.packetID, b.e.next) {
			b.e.next = (h.packetID + 1) & packetIDMask
		}
		b.e.mu.Unlock()
		require.NoError(b.t, err)
		b.batch = append(b.batch, d)
		b.size += len(d)
	}
}

// handle has the connection take the batch, each datagram in a round of
// its own run here, then, settle later, the round that runs the timers
// due (held messages given up on). The connection is this goroutine's
// throughout: its timer, when it fires, only marks it kicked. A
// connection ended takes nothing (the endpoint drops what comes for it).
func (b *peerRoundBench) handle() {
	if !b.take() {
		return // ended: the datagrams cost nothing more
	}
	defer b.c.release()
	b.rounds()
	if b.shape.settle > 0 {
		time.Sleep(b.shape.settle)
		b.settleRound()
	}
}

// rounds runs a round for each datagram of the batch, handed over as the
// socket reader does; the caller holds the connection.
func (b *peerRoundBench) rounds() {
	c := b.c
	d := c.ep.sched.getDriver()
	defer c.ep.sched.putDriver(d)
	for _, dg := range b.batch {
		p := c.ep.getPacket()
		p.b = append(p.buf[:0], dg...)
		p.from = b.from
		c.inbox.mu.Lock()
		c.inbox.pkts = append(c.inbox.pkts, p)
		c.inbox.mu.Unlock()
		c.round(d)
		d.write()
	}
}

// settleRound runs a round for the timers due; the caller holds the
// connection.
func (b *peerRoundBench) settleRound() {
	d := b.c.ep.sched.getDriver()
	defer b.c.ep.sched.putDriver(d)
	b.c.round(d)
	d.write()
}

// tidy does what the application does between rounds, unmeasured: reads
// what was delivered.
func (b *peerRoundBench) tidy() {
	q := &b.c.recvq
	q.mu.Lock()
	for q.msgs.len() > 0 {
		q.msgs.pop()
	}
	q.mu.Unlock()
}

// perByte is peerBench.perByte for a connection's rounds.
func (b *peerRoundBench) perByte(n int) float64 {
	b.prepare(n)
	return timedPerByte(b.handle, b.tidy, b.size)
}

// peerRoundBenchmark is peerBenchmark through a Listener's connection
// (peerRoundBench): ns/op is per datagram, MB/s its bytes. Shapes that
// settle wait for it between batches, untimed.
func peerRoundBenchmark(b *testing.B, name string) {
	shapes := append(peerShapes(), peerVariantShapes()...)
	i := slices.IndexFunc(shapes, func(sh peerShape) bool { return sh.name == name })
	sh := shapes[i]
	for _, mode := range peerModes {
		b.Run(mode.name, func(b *testing.B) {
			pb := newPeerRoundBench(b, sh, mode.secure)
			pb.prepare(1)
			b.SetBytes(int64(pb.size))
			b.ReportAllocs()
			b.ResetTimer()
			for done := 0; done < b.N; {
				b.StopTimer()
				if isDone(pb.c) || pb.c.sess.state == stateDone {
					pb = newPeerRoundBench(b, sh, mode.secure)
				}
				n := min(peerBatch(sh), b.N-done)
				pb.prepare(n)
				if !pb.take() {
					pb = newPeerRoundBench(b, sh, mode.secure)
					continue
				}
				b.StartTimer()
				pb.rounds()
				b.StopTimer()
				if sh.settle > 0 {
					time.Sleep(sh.settle)
					b.StartTimer()
					pb.settleRound()
					b.StopTimer()
				}
				pb.c.release()
				pb.tidy()
				done += n
			}
		})
	}
}

func BenchmarkPeerCostlyRound_honest(b *testing.B)         { peerRoundBenchmark(b, "honest") }
func BenchmarkPeerCostlyRound_inOrder255(b *testing.B)     { peerRoundBenchmark(b, "inOrder255") }
func BenchmarkPeerCostlyRound_acksAhead(b *testing.B)      { peerRoundBenchmark(b, "acksAhead") }
func BenchmarkPeerCostlyRound_emptyFragments(b *testing.B) { peerRoundBenchmark(b, "emptyFragments") }
func BenchmarkPeerCostlyRound_emptyMessages(b *testing.B)  { peerRoundBenchmark(b, "emptyMessages") }

// peerVariantShapes are more shapes of finding 3, each the worst of its
// kind for the structures the fix chose: entries naming 255 datagrams
// never sent (a wait per PacketID); five messages naming all 255 entries
// (a mask bit per message and entry); 230 messages naming one entry each,
// of 255 (members beyond a mask's 64, given up one by one); fragments of
// one byte.
func peerVariantShapes() []peerShape {
	deltas, indices, multi := make([]uint16, maxDeps), make([]uint16, maxDeps), make([]byte, maxDeps)
	for i := range multi {
		deltas[i], multi[i] = uint16(i), byte(i)
	}
	idx := make([]uint16, maxDeps)
	for i := range idx {
		idx[i] = uint16(i)
	}
	return []peerShape{
		{name: "inOrder255pids", settle: 300 * time.Millisecond, next: func(g *peerGen) []byte {
			g.pid += 256 // the 255 before are never sent
			h := header{packetID: g.pid - 1, inOrder: true, deltas: deltas, indices: indices}
			m := message{id: 6, order: orderMulti, orderMulti: multi}
			return appendDatagram(nil, &datagram{header: h, msgs: []message{m, m}})
		}},
		{name: "inOrder255x5", settle: 300 * time.Millisecond, next: func(g *peerGen) []byte {
			g.pid += 2
			h := header{packetID: g.pid - 1, inOrder: true, deltas: make([]uint16, maxDeps), indices: idx}
			m := message{id: 6, order: orderMulti, orderMulti: multi[:160]}
			return appendDatagram(nil, &datagram{header: h, msgs: []message{m, m, m, m, m}})
		}},
		{name: "singles230", settle: 300 * time.Millisecond, next: func(g *peerGen) []byte {
			g.pid += 2
			h := header{packetID: g.pid - 1, inOrder: true, deltas: make([]uint16, 200), indices: idx[:200]}
			msgs := make([]message, 230)
			for i := range msgs {
				msgs[i] = message{id: 6, order: orderSingle, orderIndex: uint8(i % 200)}
			}
			return appendDatagram(nil, &datagram{header: h, msgs: msgs})
		}},
		{name: "singles230arrived", next: func(g *peerGen) []byte {
			// singles230 as a sender may make it: each message names one
			// of the previous datagram's, which arrived.
			g.pid++
			h := header{packetID: g.pid - 1, inOrder: true, deltas: make([]uint16, 200), indices: idx[:200]}
			msgs := make([]message, 230)
			for i := range msgs {
				msgs[i] = message{id: 6, order: orderSingle, orderIndex: uint8(i % 200)}
			}
			return appendDatagram(nil, &datagram{header: h, msgs: msgs})
		}},
		{name: "fragments1", next: func(g *peerGen) []byte {
			g.pid++
			const count = 240
			tid := uint8(g.n % 200)
			msgs := make([]message, count)
			msgs[0] = message{fragStart: true, fragment: true, id: 6, fragCount: count, transferID: tid, payload: []byte{0}}
			for i := 1; i < count; i++ {
				msgs[i] = message{fragment: true, transferID: tid, fragNumber: uint32(i), payload: []byte{byte(i)}}
			}
			return appendDatagram(nil, &datagram{header: header{packetID: g.pid - 1, reliable: true}, msgs: msgs})
		}},
	}
}

// peerOpenShapes are the variant shapes not yet within the bound, and
// why. TestPeerCostlyVariants logs their ratios and asserts the bound on
// the others only.
var peerOpenShapes = map[string]string{
	"singles230": "a held record per unreliable message waiting (made, indexed, grouped, timed, given up on, released and applied one by one, ~0.7us): 23-31x on a quiet machine (135-168us a datagram of 230), 45-52x before the deadline heap held groups; the same datagram whose dependencies arrived (singles230arrived) is 3.5-6.3x",
}

// More shapes than the issue's, each worst for one of the fix's choices,
// within the same bound (TestPeerCostlyDatagrams's) but for peerOpenShapes.
func TestPeerCostlyVariants(t *testing.T) {
	if raceEnabled {
		t.Skip(peerRaceSkip)
	}
	for _, mode := range peerModes {
		t.Run(mode.name, func(t *testing.T) {
			shapes := append(peerShapes()[:1], peerVariantShapes()...)
			ratios := peerBoundShapes(t, mode.secure, 7, shapes, peerOpenShapes)
			t.Logf("singles230: %.1fx singles230arrived", ratios["singles230"]/ratios["singles230arrived"])
		})
	}
}

func BenchmarkPeerCostlyRound_inOrder255pids(b *testing.B) { peerRoundBenchmark(b, "inOrder255pids") }
func BenchmarkPeerCostlyRound_inOrder255x5(b *testing.B)   { peerRoundBenchmark(b, "inOrder255x5") }
func BenchmarkPeerCostlyRound_singles230(b *testing.B)     { peerRoundBenchmark(b, "singles230") }
func BenchmarkPeerCostlyRound_fragments1(b *testing.B)     { peerRoundBenchmark(b, "fragments1") }

func BenchmarkPeerCostlyRound_singles230arrived(b *testing.B) {
	peerRoundBenchmark(b, "singles230arrived")
}
