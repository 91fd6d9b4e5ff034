package knet

import (
	"container/heap"
	"math"
	"testing"
	"time"

	"github.com/knet-go/knet/internal/netsim"
)

// A simulated pair of sessions joined by netsim links, driven on a fake
// clock: the deterministic harness for session tests.

type simHost struct {
	msgs     []Message
	hold     bool // the application does not read: payloads pile up
	used     int
	released int
	est      bool
	eof      bool
	receipts []Receipt
	full     bool // no room: every message is refused
}

func (h *simHost) receipt(r Receipt) { h.receipts = append(h.receipts, r) }

func (h *simHost) deliver(ds []delivery) {
	for i := range ds {
		d := &ds[i]
		if !h.full {
			h.msgs = append(h.msgs, Message{ID: d.id, Payload: append([]byte{}, d.payload...), Reliable: d.reliable, InOrder: d.inOrder})
			if h.hold {
				h.used += len(d.payload)
			}
			d.taken = true
		}
		putPayload(d.buf) // the copy taken
	}
}
func (h *simHost) recvUsed() int  { return h.used }
func (h *simHost) sendDone(n int) { h.released += n }

// simPkt is a datagram in flight.
type simPkt struct {
	at  time.Time
	seq int
	to  int // 0: client, 1: server
	b   []byte
}

type simQueue []simPkt

func (q simQueue) Len() int { return len(q) }
func (q simQueue) Less(i, j int) bool {
	if !q[i].at.Equal(q[j].at) {
		return q[i].at.Before(q[j].at)
	}
	return q[i].seq < q[j].seq
}
func (q simQueue) Swap(i, j int) { q[i], q[j] = q[j], q[i] }
func (q *simQueue) Push(x any)   { *q = append(*q, x.(simPkt)) }
func (q *simQueue) Pop() any {
	old := *q
	p := old[len(old)-1]
	*q = old[:len(old)-1]
	return p
}

type simPair struct {
	t     testing.TB
	now   time.Time
	s     [2]*session // client, server
	h     [2]*simHost
	links [2]*netsim.Link // from client, from server
	q     simQueue
	seq   int
	buf   []byte
	// admit decides the server's admission; nil admits.
	admit func(payload []byte) ([]byte, bool)
	// tap sees every datagram sent, before the link.
	tap func(from int, b []byte)
	// cut drops everything from a side while set.
	cut [2]bool
	// drop, if set, drops the datagrams it picks, after tap (in a secure
	// pair, before tap: it sees the plaintext).
	drop func(from int, b []byte) bool
	// endpoints makes a side whose session is done answer as its socket
	// would: the server's, a listener's, answers a Disconnect
	// statelessly; the client's, a dialed one, only while it lingers.
	endpoints bool
	refs      [2]uint64
	// A secure pair (newSecureSimPair): each side's secure layer, the
	// server's made from the first ConnectSyn as a listener would; the
	// server's keys; spare, a buffer to seal into.
	secure    bool
	sec       [2]*secureState
	ledger    *nonceLedger
	priv, pub []byte
	spare     []byte
	// batch, when set, has the server take what comes at multiples of
	// it, all at once, as a loaded receiver's rounds take many
	// datagrams: its answers go together, once they are all handled.
	batch time.Duration
}

func newSimPair(t testing.TB, client, server *Config, up, down netsim.Params) *simPair {
	return newSimPairIn(t, DialectSpec, client, server, up, down)
}

// newSimPairIn is newSimPair in dialect (DialectSpec or DialectReference).
func newSimPairIn(t testing.TB, dialect Dialect, client, server *Config, up, down netsim.Params) *simPair {
	p := &simPair{t: t, now: timeZero, buf: make([]byte, 0, 65536)}
	p.h[0], p.h[1] = new(simHost), new(simHost)
	p.s[0] = newSession(client.resolve(), p.h[0], true, dialect, p.now)
	p.s[1] = newSession(server.resolve(), p.h[1], false, dialect, p.now)
	p.links[0], p.links[1] = netsim.NewLink(up), netsim.NewLink(down)
	p.seedSkips(up, down)
	return p
}

// noSkips has s skip no PacketID (skip.go), for a test that counts them.
func noSkips(s *session) { s.send.skips = &skipState{left: math.MaxInt} }

// seedSkips has the sides skip PacketIDs (skip.go) at gaps drawn from
// the links' seeds rather than crypto/rand, so that a pair replays
// exactly.
func (p *simPair) seedSkips(up, down netsim.Params) {
	for i, s := range p.s {
		s.send.skips = newSkipState(splitmix64(up.Seed*31 + down.Seed*7 + uint64(i) + 1))
	}
}

// client and server name the sides.
func (p *simPair) client() *session { return p.s[0] }
func (p *simPair) server() *session { return p.s[1] }

// send queues an application message on side i, as Conn.send does.
func (p *simPair) send(i int, m Message) Ref {
	s := p.s[i]
	p.refs[i]++
	ref := Ref(p.refs[i] << 1)
	if m.Reliable {
		ref |= 1
	}
	o := s.newMsg()
	*o = outMsg{ref: ref, id: m.ID, payload: append([]byte{}, m.Payload...), reliable: m.Reliable,
		inOrder: m.InOrder, channel: m.Channel, priority: m.Priority, contentID: m.ContentID,
		tracked: true, after: append([]Ref(nil), m.DependsOn...)}
	s.prepare(o)
	s.enqueue(o)
	return ref
}

// flush sends what both sides have ready.
func (p *simPair) flush() {
	for i, s := range p.s {
		// What the sessions' calls did, as Conn.handleEvents acts on it.
		ev := s.takeEvents()
		if ev&evAdmit != 0 {
			reply, ok := []byte("ok"), true
			syn := s.handshake.syn
			if p.sec[i] != nil {
				syn = p.sec[i].payload
			}
			if p.admit != nil {
				reply, ok = p.admit(syn)
			}
			if ok && p.sec[i] != nil {
				p.sec[i].cid = 0x01020304
				var err error
				reply, err = p.sec[i].writeSynAck(reply)
				if err != nil {
					p.t.Fatal(err)
				}
			}
			s.admitted(p.now, reply, ok)
		}
		if ev&evEstablished != 0 {
			p.h[i].est = true
		}
		if ev&evPeerClosed != 0 {
			p.h[i].eof = true
			// The application queues nothing more, as a Conn's next
			// round tells its session (drainSendQueue).
			s.closing.sealed = true
		}
		for {
			b := s.poll(p.now, p.buf)
			if b == nil {
				break
			}
			if p.sec[i] != nil {
				plain := b
				var err error
				if b, err = p.sec[i].sealOut(s, b, p.spare); err != nil {
					p.t.Fatalf("side %d: %v", i, err)
				}
				if p.drop != nil && p.drop(i, plain) {
					continue // a secure pair's drop sees the plaintext
				}
			}
			p.transmit(i, b)
		}
	}
}

// transmit puts b, sent by side from, on the link to the other side.
func (p *simPair) transmit(from int, b []byte) {
	if p.tap != nil {
		p.tap(from, b)
	}
	if p.cut[from] || !p.secure && p.drop != nil && p.drop(from, b) {
		return
	}
	f := p.links[from].Decide(p.now, len(b))
	for _, d := range f.After {
		c := append([]byte(nil), b...)
		if f.Flip >= 0 {
			c[f.Flip] ^= 0xff
		}
		p.seq++
		at := p.now.Add(d)
		if p.batch > 0 && from == 0 {
			at = timeZero.Add((at.Sub(timeZero)/p.batch + 1) * p.batch)
		}
		heap.Push(&p.q, simPkt{at: at, seq: p.seq, to: 1 - from, b: c})
	}
}

// receive hands a datagram to side to: its session, or once that is done
// and endpoints is set, its socket.
func (p *simPair) receive(to int, b []byte) {
	s := p.s[to]
	if p.secure && !s.done() {
		p.receiveSecure(to, b, true)
		return
	}
	if !p.endpoints || !s.done() {
		s.beginRound() // each datagram a round of its own
		s.handleDatagram(p.now, b)
		return
	}
	if to == 0 && s.socketLinger(p.now) == 0 {
		return // the dialed socket is closed
	}
	if a := disconnectAnswer(nil, b); a != nil {
		p.transmit(to, a)
	}
}

// inject delivers b to side to now, as if from its peer.
func (p *simPair) inject(to int, b []byte) {
	if p.secure {
		p.receiveSecure(to, b, true)
		return
	}
	p.s[to].beginRound()
	p.s[to].handleDatagram(p.now, b)
}

// run advances the simulation until cond holds or d of simulated time has
// passed; it reports whether cond held.
func (p *simPair) run(d time.Duration, cond func() bool) bool {
	end := p.now.Add(d)
	for range 10_000_000 {
		p.flush()
		if cond != nil && cond() {
			return true
		}
		next := end
		if p.q.Len() > 0 && p.q[0].at.Before(next) {
			next = p.q[0].at
		}
		for _, s := range p.s {
			if s.done() {
				continue
			}
			if t := s.nextDeadline(p.now); t.Before(next) {
				next = t
			}
		}
		if !next.Before(end) {
			if !p.now.Before(end) {
				return cond != nil && cond()
			}
			next = end
		}
		if next.After(p.now) {
			p.now = next
		}
		for p.q.Len() > 0 && !p.q[0].at.After(p.now) {
			pk := heap.Pop(&p.q).(simPkt)
			p.receive(pk.to, pk.b)
		}
		for _, s := range p.s {
			if !s.done() && !s.nextDeadline(p.now).After(p.now) {
				s.advance(p.now)
			}
		}
	}
	for i, s := range p.s {
		p.t.Logf("side %d state %v deadline %v now %v paced %v ackPending %d nextPing %v lastRecv %v timed %d", i, s.state, s.nextDeadline(p.now).Sub(p.now), p.now, s.send.pacedOut, s.acks.pending(), s.live.nextPing.Sub(p.now), s.live.lastRecv.Sub(p.now), s.recv.res.timed.Len())
	}
	p.t.Fatal("simulation did not settle")
	return false
}

// connect runs the handshake and fails the test if it does not complete.
func (p *simPair) connect() {
	p.t.Helper()
	if !p.run(30*time.Second, func() bool { return p.h[0].est && p.h[1].est }) {
		p.t.Fatalf("handshake did not complete: client %v server %v", p.s[0].state, p.s[1].state)
	}
}
