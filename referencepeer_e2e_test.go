package knet_test

// End-to-end runs of knet against a scripted reference peer: a client or
// server that speaks only the reference wire, with the codec of
// referencepeer_test.go (never the library's), over real loopback sockets.
//
// The peer behaves as testdata/reference/README.md says the reference
// does: it opens with 8 zero bytes (or, as a server, answers them with two
// PingRequests), numbers its reliable messages, acks reliable datagrams
// with PacketAcks (u24 base, u32 bitmap) 20ms after the first one pending
// or at once with 33 pending, resends unacked reliable messages in new
// datagrams under their old reliable numbers, drops duplicates by PacketID
// and by reliable number, splits messages above 1368 bytes into 318-byte
// fragments (TransferIDs from 1), packs datagrams on the reference's
// budget, paces them at one per millisecond, pings every 3.5s, delivers
// in arrival order and reassembles fragments in arrival order. Where the
// reference would break on what knet sends (a fragment before its
// FragmentStart or after a later one, a PacketID seen before), the test
// fails: knet must not make a reference peer trip.
//
// Deliberate differences from the reference, for speed and robustness of
// the test:
//   - unacked reliable messages go again after rpPeerRTO (200ms), not the
//     reference's fixed 5s (fact 12);
//   - the client resends its opening until a datagram comes back (the
//     captures never lost one; what the reference does then is not
//     recorded), and a server takes a repeated opening from a client that
//     sent nothing else for a new connection attempt;
//   - Disconnect, a reliable message, goes again like one until its
//     DisconnectAck comes, and a closed server still answers a repeated
//     Disconnect with a DisconnectAck (the captures never lost either).
//
// Loss sits in the peer: it drops rpLoss of the datagrams it sends and of
// those it receives, decided by a seeded math/rand/v2 source, so the
// decisions (not the timing) repeat run after run. knet's own socket is
// clean (no Config.Simulate).
//
// RPTRACE=1 in the environment logs every datagram the peer sends,
// receives or drops.

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/knet-go/knet"
)

const (
	// rpPeerRTO is how long the peer waits for an ack before resending.
	// The reference waits a fixed 5s (fact 12); 200ms keeps the lossy runs
	// short and is still well above knet's ack delay (MaxAckDelay 33ms).
	rpPeerRTO = 200 * time.Millisecond
	// rpPeerAckDelay: the reference acks 20-50ms after the datagram
	// (fact 10); the peer sends its pending acks 20ms after the first of
	// them, or with any datagram going out before.
	rpPeerAckDelay = 20 * time.Millisecond
	rpAckAtOnce    = 33                      // pending acks that go at once (fact 10)
	rpPingEvery    = 3500 * time.Millisecond // fact 20
	rpPaceGap      = time.Millisecond        // about 1000 datagrams/s (fact 21)
	rpMsgBudget    = 30                      // per message, against rpMaxDatagram (fact 17)
	rpHdrBudget    = 7                       // the datagram header, counted as 7 (fact 17)
	rpLoss         = 0.05
	rpRunTimeout   = 30 * time.Second
)

// ---- The workload ----

// rpWorkItem is one application message of the workload: its payload is
// rpWorkPayload(index, size).
type rpWorkItem struct {
	id                uint32
	reliable, inOrder bool
	size              int
}

// rpWorkload is what the application on the far side of knet, or the
// scripted client, sends: the interop client's script (README
// refclient_echo) in kinds and sizes. The last message is reliable and in
// order, so its echo comes after all the others' on a clean path.
func rpWorkload() []rpWorkItem {
	var w []rpWorkItem
	for range 20 {
		w = append(w, rpWorkItem{id: 10, size: 40})
	}
	for range 20 {
		w = append(w, rpWorkItem{id: 11, reliable: true, size: 19})
	}
	for range 200 {
		w = append(w, rpWorkItem{id: 12, reliable: true, inOrder: true, size: 16})
	}
	w = append(w, rpWorkItem{id: 70000, reliable: true, inOrder: true, size: 100000})
	for _, id := range []uint32{127, 128, 16383, 16384} {
		w = append(w, rpWorkItem{id: id, reliable: true, inOrder: true, size: 8})
	}
	w = append(w, rpWorkItem{id: 50, reliable: true, inOrder: true, size: 0})
	w = append(w, rpWorkItem{id: 13, reliable: true, inOrder: true, size: 8})
	return w
}

// rpWorkPayload is message i's payload: its index, then a pattern.
func rpWorkPayload(i, size int) []byte {
	p := make([]byte, size)
	if size >= 4 {
		binary.LittleEndian.PutUint32(p, uint32(i))
	}
	for k := 4; k < size; k++ {
		p[k] = byte(i*7 + k)
	}
	return p
}

// rpWorkIndex finds which workload message (id, payload) is, or -1.
func rpWorkIndex(w []rpWorkItem, id uint32, payload []byte) int {
	if len(payload) < 4 {
		for i, it := range w {
			if it.size == len(payload) && it.id == id {
				return i
			}
		}
		return -1
	}
	i := int(binary.LittleEndian.Uint32(payload))
	if i < 0 || i >= len(w) {
		return -1
	}
	return i
}

// rpEchoCheck checks the echoes of the workload, as they were delivered:
// content, ID and flags, exactly once for reliable messages, at most once
// for unreliable ones (all of them on a clean path). order is the order
// the in-order echoes must come in, as workload indices.
type rpEchoCheck struct {
	t       *testing.T
	who     string
	w       []rpWorkItem
	got     []int
	ordered []int // reliable in-order echoes, as delivered
}

func (c *rpEchoCheck) add(id uint32, payload []byte, reliable, inOrder bool) {
	c.t.Helper()
	i := rpWorkIndex(c.w, id, payload)
	if i < 0 {
		c.t.Errorf("%s: echo of no message sent: ID %d, %d bytes", c.who, id, len(payload))
		return
	}
	it := c.w[i]
	if c.got[i] > 0 {
		c.t.Errorf("%s: message %d (ID %d, reliable %v) echoed again", c.who, i, it.id, it.reliable)
	}
	c.got[i]++
	assert.Equal(c.t, it.id, id, "%s: echo of message %d: ID", c.who, i)
	assert.Equal(c.t, it.reliable, reliable, "%s: echo of message %d: Reliable", c.who, i)
	assert.Equal(c.t, it.inOrder, inOrder, "%s: echo of message %d: InOrder", c.who, i)
	assert.True(c.t, bytes.Equal(rpWorkPayload(i, it.size), payload), "%s: echo of message %d: content (%d bytes)", c.who, i, len(payload))
	if it.inOrder && it.reliable {
		c.ordered = append(c.ordered, i)
	}
}

// allReliable reports whether every reliable message has been echoed.
func (c *rpEchoCheck) allReliable() bool {
	for i, it := range c.w {
		if it.reliable && c.got[i] == 0 {
			return false
		}
	}
	return true
}

// finish checks that everything reliable came (and everything, on a
// clean path) and that ordered, the reliable in-order echoes in the order
// that counts, is want.
func (c *rpEchoCheck) finish(clean bool, ordered, want []int) {
	c.t.Helper()
	unrel := 0
	for i, it := range c.w {
		switch {
		case it.reliable:
			assert.Equal(c.t, 1, c.got[i], "%s: echoes of reliable message %d (ID %d)", c.who, i, it.id)
		case c.got[i] > 0:
			unrel++
		case clean:
			c.t.Errorf("%s: unreliable message %d not echoed on a clean path", c.who, i)
		}
	}
	assert.Equal(c.t, want, ordered, "%s: order of the in-order echoes", c.who)
	c.t.Logf("%s: %d of %d messages echoed (%d unreliable)", c.who, len(c.w)-rpCount(c.got, 0), len(c.w), unrel)
}

func rpCount[T comparable](s []T, v T) int {
	n := 0
	for _, e := range s {
		if e == v {
			n++
		}
	}
	return n
}

// rpInOrderIndices lists the reliable in-order messages of w in send order.
func rpInOrderIndices(w []rpWorkItem) []int {
	var r []int
	for i, it := range w {
		if it.reliable && it.inOrder {
			r = append(r, i)
		}
	}
	return r
}

// ---- The scripted peer ----

// rpMsg is a message the peer sends: whole, or one fragment.
type rpMsg struct {
	id                uint32
	payload           []byte
	reliable, inOrder bool
	frag, fragStart   bool
	fragCount         uint32
	tid               uint8
	fragNum           uint32
	rel               uint32 // once numbered
	numbered, acked   bool
}

func (m *rpMsg) block(base uint32) rpBlock {
	b := rpBlock{fragStart: m.fragStart, frag: m.frag, inOrder: m.inOrder, reliable: m.reliable,
		fragCount: m.fragCount, transferID: m.tid, fragNum: m.fragNum, id: m.id, payload: m.payload}
	if m.reliable {
		b.relDelta = m.rel - base
	}
	return b
}

// cost is what the reference's packing budget charges for m (fact 17).
func (m *rpMsg) cost() int {
	b := m.block(0)
	return rpMsgBudget + b.contentLength()
}

// rpFlight is a reliable datagram of the peer's, unacked.
type rpFlight struct {
	sentAt time.Time
	msgs   []*rpMsg // its reliable messages
}

// rpArrival is an application message the peer received (after
// reassembly), in arrival order.
type rpArrival struct {
	id                uint32
	payload           []byte
	reliable, inOrder bool
	rel               uint32 // its reliable number (the FragmentStart's for a transfer)
}

// rpRecvTransfer is a fragmented message under reassembly, as the
// reference does it: fragments appended in arrival order.
type rpRecvTransfer struct {
	count, next uint32
	id          uint32
	inOrder     bool
	rel         uint32
	data        []byte
}

type rpDgIn struct {
	b    []byte
	from *net.UDPAddr
}

// rpPeer is the scripted reference peer. Everything but the channels is
// owned by its loop goroutine; the test reads it through query.
type rpPeer struct {
	t      *testing.T
	who    string // "client" or "server", for messages
	server bool
	conn   *net.UDPConn
	remote *net.UDPAddr
	loss   float64
	rng    *rand.Rand

	in      chan rpDgIn
	cmds    chan func(*rpPeer)
	changed chan struct{}
	done    chan struct{}

	// Connection.
	open       bool // client: a datagram came; server: the opening was answered
	gotOther   bool // server: a datagram other than the opening came
	openingDue time.Time
	nextPID    uint32
	nextRel    uint32
	nextPingID uint8
	pingAt     time.Time
	nextSendAt time.Time

	queue       []*rpMsg // application messages not yet sent
	ctrl        []*rpMsg // library messages for the next datagram
	flights     map[uint32]*rpFlight
	retired     map[uint32][]*rpMsg // PacketIDs of resent datagrams, for late acks
	sentPIDs    map[uint32]bool     // reliable?
	tidUnacked  map[uint8]int
	pendingAcks []uint32
	ackDue      time.Time

	seenPID   map[uint32]bool
	relSeen   map[uint32]bool
	transfers map[uint8]*rpRecvTransfer
	arrivals  []rpArrival
	echoOrder []rpArrival // server: in-order reliable echoes, in the order queued (their reliable numbers' order)

	closing       bool // client: Disconnect sent; only it goes again
	discMsg       *rpMsg
	gotDisconnect int
	sentDiscAck   int
	gotDiscAck    bool
	closed        bool // the connection is over: nothing more but DisconnectAck answers

	// Counters for the log.
	dgIn, dgOut, dropIn, dropOut, resends, dupPID, dupRel, openings, pings, pingReplies, afterClose int
	fragsIn, violations                                                                             int
	errorf                                                                                          func(format string, args ...any) // t.Errorf; a recorder in TestReferencePeerReassemblyDefects
}

func newRPPeer(t *testing.T, server bool, conn *net.UDPConn, remote *net.UDPAddr, loss float64, seed uint64) *rpPeer {
	who := "client"
	if server {
		who = "server"
	}
	return &rpPeer{
		t: t, who: who, server: server, conn: conn, remote: remote, loss: loss,
		rng:     rand.New(rand.NewPCG(seed, 0x5eed)),
		in:      make(chan rpDgIn, 256),
		cmds:    make(chan func(*rpPeer)),
		changed: make(chan struct{}, 1),
		done:    make(chan struct{}),
		nextPID: 1, nextPingID: 1,
		flights: map[uint32]*rpFlight{}, retired: map[uint32][]*rpMsg{}, sentPIDs: map[uint32]bool{},
		tidUnacked: map[uint8]int{}, seenPID: map[uint32]bool{}, relSeen: map[uint32]bool{},
		transfers: map[uint8]*rpRecvTransfer{},
		errorf:    t.Errorf,
	}
}

// start runs the peer until ctx ends: a reader goroutine on the socket
// (read deadlines, so that it notices ctx) and the loop. The test's
// cleanup stops both before the test ends.
func (p *rpPeer) start(ctx context.Context) {
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		buf := make([]byte, 1<<16)
		for ctx.Err() == nil {
			if err := p.conn.SetReadDeadline(time.Now().Add(50 * time.Millisecond)); err != nil {
				p.t.Errorf("%s: set read deadline: %v", p.who, err)
				return
			}
			n, from, err := p.conn.ReadFromUDP(buf)
			if err != nil {
				if errors.Is(err, os.ErrDeadlineExceeded) || ctx.Err() != nil {
					continue
				}
				p.t.Errorf("%s: read: %v", p.who, err)
				return
			}
			select {
			case p.in <- rpDgIn{bytes.Clone(buf[:n]), from}:
			case <-ctx.Done():
			}
		}
	}()
	go func() {
		defer wg.Done()
		defer close(p.done)
		p.loop(ctx)
	}()
	p.t.Cleanup(func() {
		cancel()
		wg.Wait()
	})
}

func (p *rpPeer) loop(ctx context.Context) {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		now := time.Now()
		p.tick(now)
		timer.Reset(max(p.wake(now).Sub(now), 0))
		select {
		case <-ctx.Done():
			return
		case d := <-p.in:
			p.handle(time.Now(), d)
		case f := <-p.cmds:
			f(p)
		case <-timer.C:
		}
		select {
		case p.changed <- struct{}{}:
		default:
		}
	}
}

// query runs f on the peer's goroutine and returns its result; false if
// the peer stopped.
func rpQuery[T any](ctx context.Context, p *rpPeer, f func(*rpPeer) T) (T, bool) {
	res := make(chan T, 1)
	select {
	case p.cmds <- func(p *rpPeer) { res <- f(p) }:
		return <-res, true
	case <-p.done:
	case <-ctx.Done():
	}
	var zero T
	return zero, false
}

// do runs f on the peer's goroutine.
func (p *rpPeer) do(ctx context.Context, f func(*rpPeer)) {
	rpQuery(ctx, p, func(p *rpPeer) struct{} { f(p); return struct{}{} })
}

// await waits until cond holds on the peer, or fails the test on ctx's
// end.
func (p *rpPeer) await(ctx context.Context, what string, cond func(*rpPeer) bool) bool {
	p.t.Helper()
	for {
		if ok, _ := rpQuery(ctx, p, cond); ok {
			return true
		}
		select {
		case <-p.changed:
		case <-ctx.Done():
			summary, _ := rpQuery(context.Background(), p, (*rpPeer).summary)
			p.t.Errorf("%s: gave up waiting for %s: %s", p.who, what, summary)
			return false
		case <-p.done:
			p.t.Errorf("%s: stopped while waiting for %s", p.who, what)
			return false
		}
	}
}

func (p *rpPeer) violation(format string, args ...any) {
	p.violations++
	if p.violations <= 20 {
		p.errorf(p.who+": "+format, args...)
	}
}

func (p *rpPeer) summary() string {
	return fmt.Sprintf("datagrams in %d (dropped %d, PacketID repeats %d), out %d (dropped %d, resends %d); "+
		"duplicate reliable messages %d; fragments in %d; openings %d; pings sent %d, replies %d; "+
		"arrivals %d; Disconnect in %d, DisconnectAck out %d, DisconnectAck in %v; "+
		"datagrams after close %d; unacked flights %d",
		p.dgIn, p.dropIn, p.dupPID, p.dgOut, p.dropOut, p.resends, p.dupRel, p.fragsIn, p.openings, p.pings,
		p.pingReplies, len(p.arrivals), p.gotDisconnect, p.sentDiscAck, p.gotDiscAck, p.afterClose, len(p.flights))
}

// write sends b to the remote, or drops it (rpLoss).
func (p *rpPeer) write(b []byte) {
	p.dgOut++
	if p.loss > 0 && p.rng.Float64() < p.loss {
		p.dropOut++
		if rpTrace {
			p.t.Logf("%s %v DROP OUT %s", p.who, time.Now().Format("05.000"), rpHex(b))
		}
		return
	}
	if _, err := p.conn.WriteToUDP(b, p.remote); err != nil {
		p.t.Errorf("%s: write: %v", p.who, err)
	}
}

// emit sends msgs as one new datagram, numbering the reliable ones not yet
// numbered; a reliable datagram is kept until acked.
func (p *rpPeer) emit(now time.Time, msgs []*rpMsg) uint32 {
	d := rpDatagram{pid: p.nextPID}
	p.nextPID = (p.nextPID + 1) & rpPIDMask
	var rels []*rpMsg
	for _, m := range msgs {
		if !m.reliable {
			continue
		}
		if !m.numbered {
			m.rel, m.numbered = p.nextRel, true
			p.nextRel++
		}
		if !d.reliable || m.rel < d.relBase {
			d.relBase = m.rel
		}
		d.reliable = true
		rels = append(rels, m)
	}
	for _, m := range msgs {
		d.inOrder = d.inOrder || m.inOrder
		d.blocks = append(d.blocks, m.block(d.relBase))
	}
	b := rpAppendDatagram(nil, &d)
	if rpTrace {
		p.t.Logf("%s %v OUT %s", p.who, now.Format("05.000"), rpHex(b))
	}
	p.sentPIDs[d.pid] = d.reliable
	if d.reliable {
		p.flights[d.pid] = &rpFlight{sentAt: now, msgs: rels}
	}
	p.write(b)
	return d.pid
}

// library builds a library message: unreliable, with the InOrder bit
// (fact 7).
func rpLibrary(id uint32, payload []byte) *rpMsg {
	return &rpMsg{id: id, payload: payload, inOrder: true}
}

// sendApp queues an application message, split into fragments above
// rpMaxWhole bytes (fact 16): 318 bytes each, always reliable, keeping
// the InOrder bit, under the lowest TransferID from 1 not in use.
func (p *rpPeer) sendApp(id uint32, payload []byte, reliable, inOrder bool) {
	if len(payload) <= rpMaxWhole {
		p.queue = append(p.queue, &rpMsg{id: id, payload: payload, reliable: reliable, inOrder: inOrder})
		return
	}
	tid := uint8(1)
	for p.tidUnacked[tid] > 0 {
		tid++
	}
	count := uint32((len(payload) + rpFragSize - 1) / rpFragSize)
	for n := range count {
		m := &rpMsg{payload: payload[n*rpFragSize : min(int(n+1)*rpFragSize, len(payload))],
			reliable: true, inOrder: inOrder, frag: true, tid: tid, fragNum: n}
		if n == 0 {
			m.fragStart, m.fragCount, m.id = true, count, id
		}
		p.queue = append(p.queue, m)
	}
	p.tidUnacked[tid] += int(count)
}

// disconnect sends Disconnect (fact 4) in a datagram of its own, after
// which the client sends nothing else but the Disconnect again.
func (p *rpPeer) disconnect(now time.Time) {
	p.discMsg = &rpMsg{id: rpDisconnect, reliable: true, inOrder: true}
	p.emit(now, []*rpMsg{p.discMsg})
	p.closing = true
	p.queue, p.ctrl, p.pendingAcks = nil, nil, nil
	for pid, f := range p.flights {
		if !slices.Contains(f.msgs, p.discMsg) {
			delete(p.flights, pid)
		}
	}
}

// tick does what is due at now: the opening, resends, pings, acks and the
// next paced datagram.
func (p *rpPeer) tick(now time.Time) {
	if p.closed {
		if len(p.ctrl) > 0 { // a DisconnectAck answer
			p.emit(now, p.ctrl)
			p.ctrl = nil
		}
		return
	}
	if !p.server && !p.open {
		if !now.Before(p.openingDue) {
			p.openings++
			p.write(make([]byte, rpOpeningSize))
			p.openingDue = now.Add(rpPeerRTO)
		}
		return
	}
	if !p.open {
		return
	}
	// Resends: the unacked reliable messages of a datagram go again in a
	// new datagram, under a new PacketID and their old reliable numbers
	// (fact 12).
	for pid, f := range p.flights {
		if now.Sub(f.sentAt) < rpPeerRTO {
			continue
		}
		delete(p.flights, pid)
		p.retired[pid] = f.msgs
		var left []*rpMsg
		for _, m := range f.msgs {
			if !m.acked {
				left = append(left, m)
			}
		}
		if len(left) > 0 {
			p.resends++
			p.emit(now, left)
		}
	}
	if p.closing {
		return
	}
	if !now.Before(p.pingAt) {
		p.ctrl = append(p.ctrl, rpLibrary(rpPingRequest, []byte{p.nextPingID}))
		p.nextPingID++
		p.pings++
		p.pingAt = now.Add(rpPingEvery)
	}
	for now.Compare(p.nextSendAt) >= 0 {
		acksDue := len(p.pendingAcks) > 0 && (len(p.pendingAcks) >= rpAckAtOnce || !now.Before(p.ackDue))
		if len(p.ctrl) == 0 && len(p.queue) == 0 && !acksDue {
			return
		}
		msgs := p.ctrl
		p.ctrl = nil
		if len(p.pendingAcks) > 0 {
			for _, pl := range rpAckPayloads(p.pendingAcks) {
				msgs = append(msgs, rpLibrary(rpPacketAck, pl))
			}
			p.pendingAcks = nil
		}
		budget := rpHdrBudget
		for _, m := range msgs {
			budget += m.cost()
		}
		k := 0
		for ; k < len(p.queue); k++ {
			c := p.queue[k].cost()
			if budget+c > rpMaxDatagram && len(msgs) > 0 {
				break
			}
			budget += c
			msgs = append(msgs, p.queue[k])
		}
		p.queue = p.queue[k:]
		p.emit(now, msgs)
		p.nextSendAt = now.Add(rpPaceGap)
	}
}

// wake is when tick has something to do next.
func (p *rpPeer) wake(now time.Time) time.Time {
	w := now.Add(time.Second)
	at := func(t time.Time) {
		if t.Before(w) {
			w = t
		}
	}
	switch {
	case p.closed:
		if len(p.ctrl) > 0 {
			at(now)
		}
		return w
	case !p.server && !p.open:
		at(p.openingDue)
		return w
	case !p.open:
		return w
	}
	for _, f := range p.flights {
		at(f.sentAt.Add(rpPeerRTO))
	}
	if p.closing {
		return w
	}
	at(p.pingAt)
	if len(p.ctrl) > 0 || len(p.queue) > 0 || len(p.pendingAcks) >= rpAckAtOnce {
		at(p.nextSendAt)
	}
	if len(p.pendingAcks) > 0 {
		at(p.ackDue)
	}
	return w
}

// answerOpening answers a client's opening as the reference does (fact 2):
// PacketID 1, two PingRequests, pingIDs 1 and 2.
func (p *rpPeer) answerOpening(now time.Time, from *net.UDPAddr) {
	p.remote, p.open, p.gotOther = from, true, false
	p.nextPID, p.nextPingID, p.nextRel = 1, 1, 0
	p.flights, p.retired, p.sentPIDs = map[uint32]*rpFlight{}, map[uint32][]*rpMsg{}, map[uint32]bool{}
	p.ctrl = nil
	p.openings++
	p.emit(now, []*rpMsg{rpLibrary(rpPingRequest, []byte{1}), rpLibrary(rpPingRequest, []byte{2})})
	p.nextPingID = 3
	p.pingAt = now.Add(rpPingEvery)
	p.nextSendAt = now.Add(rpPaceGap)
}

func rpSameAddr(a, b *net.UDPAddr) bool {
	return a != nil && b != nil && a.IP.Equal(b.IP) && a.Port == b.Port
}

// handle takes one datagram from the socket.
func (p *rpPeer) handle(now time.Time, in rpDgIn) {
	if p.loss > 0 && p.rng.Float64() < p.loss {
		p.dropIn++
		if rpTrace {
			p.t.Logf("%s %v DROP IN %s", p.who, now.Format("05.000"), rpHex(in.b))
		}
		return
	}
	b := in.b
	if rpTrace {
		p.t.Logf("%s %v IN  %s", p.who, now.Format("05.000"), rpHex(b))
	}
	if p.server && rpIsOpening(b) {
		switch {
		case p.remote == nil:
			p.answerOpening(now, in.from)
		case rpSameAddr(in.from, p.remote) && !p.gotOther:
			// Our answer was lost: a new connection attempt (fact 22).
			p.answerOpening(now, in.from)
		default:
			p.violation("opening from %v after the connection was up", in.from)
		}
		return
	}
	if !rpSameAddr(in.from, p.remote) {
		p.violation("datagram from %v, not from the peer %v: %s", in.from, p.remote, rpHex(b))
		return
	}
	if rpIsOpening(b) {
		p.violation("an opening from the server")
		return
	}
	p.dgIn++
	if len(b) > rpMaxDatagram {
		p.violation("datagram of %d bytes, above the reference's %d", len(b), rpMaxDatagram)
	}
	d, err := rpParseDatagram(b)
	if err != nil {
		p.violation("datagram does not parse as the reference's: %v: %s", err, rpHex(b))
		return
	}
	if d.pid == 0 {
		p.violation("PacketID 0: both sides count from 1 (fact 3)")
	}
	if p.seenPID[d.pid] {
		// The reference drops it (fact 13): a resend must take a new
		// PacketID. Loopback does not duplicate datagrams.
		p.dupPID++
		p.violation("PacketID %d came again, which the reference drops: %s", d.pid, rpHex(b))
		return
	}
	p.seenPID[d.pid] = true
	p.open, p.gotOther = true, true
	if p.closed {
		p.afterClose++
		for _, m := range d.blocks {
			if p.server && m.hasID() && m.id == rpDisconnect {
				p.gotDisconnect++
				p.ctrl = append(p.ctrl, rpLibrary(rpDisconnectAck, nil))
				p.sentDiscAck++
			}
		}
		return
	}
	ackIt := d.reliable
	for i := range d.blocks {
		m := &d.blocks[i]
		if m.hasID() && m.id == rpDisconnect {
			ackIt = false // the reference never acks it (fact 4)
		}
		p.block(now, &d, m)
	}
	if ackIt && !p.closing && !p.closed {
		if len(p.pendingAcks) == 0 {
			p.ackDue = now.Add(rpPeerAckDelay)
		}
		p.pendingAcks = append(p.pendingAcks, d.pid)
	}
}

// block takes one message block of a new datagram.
func (p *rpPeer) block(now time.Time, d *rpDatagram, m *rpBlock) {
	if m.reliable {
		if p.relSeen[m.relNum] {
			p.dupRel++ // fact 13
			return
		}
		p.relSeen[m.relNum] = true
	}
	if m.frag {
		p.fragsIn++
		if !m.reliable {
			p.violation("unreliable fragment in datagram %d: fragments are always reliable (fact 16)", d.pid)
		}
		p.fragment(d.pid, m)
		return
	}
	switch m.id {
	case rpPingRequest:
		if len(m.payload) != 1 {
			p.violation("PingRequest with payload %x, want 1 byte", m.payload)
			return
		}
		p.ctrl = append(p.ctrl, rpLibrary(rpPingReply, []byte{m.payload[0]}))
	case rpPingReply:
		p.pingReplies++
	case rpPacketAck:
		p.onAck(d.pid, m.payload)
	case rpDisconnect:
		p.gotDisconnect++
		p.ctrl = append(p.ctrl, rpLibrary(rpDisconnectAck, nil))
		p.sentDiscAck++
		p.closed = true
		p.queue, p.pendingAcks, p.flights = nil, nil, map[uint32]*rpFlight{}
	case rpDisconnectAck:
		if p.closing {
			p.gotDiscAck = true
			p.closed = true
			p.flights = map[uint32]*rpFlight{}
		} else {
			p.violation("DisconnectAck with no Disconnect sent")
		}
	case rpFlowControlRequest:
		p.violation("FlowControlRequest, which the reference never sends and ignores (fact 6)")
	default:
		if !rpIsApp(m.id) {
			p.violation("message with reserved ID %#x", m.id)
			return
		}
		p.deliver(m.id, m.payload, m.reliable, m.inOrder, m.relNum)
	}
}

// fragment reassembles as the reference does (fact 18): fragments in the
// order they arrive, none before the FragmentStart. knet must send them
// so that this comes out right.
func (p *rpPeer) fragment(pid uint32, m *rpBlock) {
	t := p.transfers[m.transferID]
	if m.fragStart {
		if t != nil {
			p.violation("FragmentStart of transfer %d in datagram %d while that transfer has %d of %d fragments", m.transferID, pid, t.next, t.count)
		}
		if m.fragCount < 2 {
			p.violation("FragmentStart in datagram %d with FragmentCount %d", pid, m.fragCount)
		}
		p.transfers[m.transferID] = &rpRecvTransfer{count: m.fragCount, next: 1, id: m.id, inOrder: m.inOrder,
			rel: m.relNum, data: bytes.Clone(m.payload)}
		return
	}
	if t == nil {
		p.violation("fragment %d of transfer %d in datagram %d before its FragmentStart: the reference drops it (fact 18)", m.fragNum, m.transferID, pid)
		return
	}
	if m.fragNum != t.next {
		p.violation("fragment %d of transfer %d in datagram %d where fragment %d was due: the reference appends fragments in arrival order (fact 18) and corrupts the message", m.fragNum, m.transferID, pid, t.next)
	}
	if m.inOrder != t.inOrder {
		p.violation("fragment %d of transfer %d: InOrder %v, its FragmentStart's %v", m.fragNum, m.transferID, m.inOrder, t.inOrder)
	}
	t.data = append(t.data, m.payload...)
	t.next++
	if t.next == t.count {
		delete(p.transfers, m.transferID)
		p.deliver(t.id, t.data, true, t.inOrder, t.rel)
	}
}

// deliver hands an application message over in arrival order (fact 15); the
// server echoes it.
func (p *rpPeer) deliver(id uint32, payload []byte, reliable, inOrder bool, rel uint32) {
	a := rpArrival{id: id, payload: bytes.Clone(payload), reliable: reliable, inOrder: inOrder, rel: rel}
	p.arrivals = append(p.arrivals, a)
	if !p.server {
		return
	}
	p.sendApp(id, a.payload, reliable, inOrder)
	if reliable && inOrder {
		p.echoOrder = append(p.echoOrder, a)
	}
}

// onAck takes a PacketAck: the PacketIDs it names must be reliable
// datagrams of ours (fact 11).
func (p *rpPeer) onAck(pid uint32, payload []byte) {
	pids, err := rpParseAck(payload)
	if err != nil {
		p.violation("PacketAck in datagram %d: %v", pid, err)
		return
	}
	for _, a := range pids {
		rel, sent := p.sentPIDs[a]
		switch {
		case !sent:
			p.violation("PacketAck in datagram %d names PacketID %d, which we never sent", pid, a)
			continue
		case !rel:
			p.violation("PacketAck in datagram %d names PacketID %d, an unreliable datagram (fact 11: only reliable ones are acked)", pid, a)
			continue
		}
		msgs := p.retired[a]
		if f := p.flights[a]; f != nil {
			msgs = f.msgs
			delete(p.flights, a)
		}
		for _, m := range msgs {
			if !m.acked {
				m.acked = true
				if m.frag {
					p.tidUnacked[m.tid]--
				}
			}
		}
	}
}

// ---- The runs ----

var rpTrace = os.Getenv("RPTRACE") != ""

var rpPaths = []struct {
	name string
	loss float64
	seed uint64
}{
	{"clean", 0, 0},
	{"loss5", rpLoss, 1},
}

// TestReferencePeerClientAgainstListener: the scripted reference client
// against a knet Listener with the default Config (DialectAuto), whose echo
// server sends every message back as it came.
func TestReferencePeerClientAgainstListener(t *testing.T) {
	t.Parallel()
	for _, path := range rpPaths {
		t.Run(path.name, func(t *testing.T) {
			t.Parallel()
			rpRunClient(t, path.loss, path.seed)
		})
	}
}

func rpRunClient(t *testing.T, loss float64, seed uint64) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), rpRunTimeout)
	defer cancel()

	l, err := knet.Listen("udp", "127.0.0.1:0", &knet.Config{})
	require.NoError(t, err)
	srvCtx, srvCancel := context.WithCancel(ctx)
	srvDone := make(chan struct{})
	srvConn := make(chan *knet.Conn, 1)
	srvEnd := make(chan error, 1) // how the server's Receive ended
	go func() {
		defer close(srvDone)
		c, err := l.AcceptConn(srvCtx)
		if err != nil {
			srvEnd <- fmt.Errorf("accept: %w", err)
			return
		}
		defer c.Close()
		srvConn <- c
		for {
			m, err := c.Receive(srvCtx)
			if err != nil {
				srvEnd <- err
				return
			}
			if err := c.Send(knet.Message{ID: m.ID, Payload: m.Payload, Reliable: m.Reliable, InOrder: m.InOrder}); err != nil {
				srvEnd <- fmt.Errorf("send: %w", err)
				return
			}
		}
	}()
	t.Cleanup(func() {
		srvCancel()
		<-srvDone
		l.Close()
	})

	pc, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	t.Cleanup(func() { pc.Close() })
	p := newRPPeer(t, false, pc, l.Addr().(*net.UDPAddr), loss, seed)
	p.start(ctx)

	// The reference client sends as soon as a datagram came back; the
	// server's side is open once one of the client's arrives.
	require.True(t, p.await(ctx, "the connection to open", func(p *rpPeer) bool { return p.open }))
	w := rpWorkload()
	p.do(ctx, func(p *rpPeer) {
		for i, it := range w {
			p.sendApp(it.id, rpWorkPayload(i, it.size), it.reliable, it.inOrder)
		}
	})
	var sc *knet.Conn
	select {
	case sc = <-srvConn:
	case err := <-srvEnd:
		t.Fatalf("the listener accepted nothing: %v", err)
	case <-ctx.Done():
		t.Fatal("the listener accepted nothing")
	}
	assert.Equal(t, knet.DialectReference, sc.Dialect(), "the listener took the 8 zero bytes for a reference client")
	check := &rpEchoCheck{t: t, who: "client", w: w, got: make([]int, len(w))}
	seen := 0
	allIn := func() bool {
		arr, ok := rpQuery(ctx, p, func(p *rpPeer) []rpArrival { return slices.Clone(p.arrivals) })
		if !ok {
			return false
		}
		for _, a := range arr[seen:] {
			check.add(a.id, a.payload, a.reliable, a.inOrder)
		}
		seen = len(arr)
		return check.allReliable()
	}
	for !allIn() {
		select {
		case <-p.changed:
		case <-ctx.Done():
			summary, _ := rpQuery(context.Background(), p, (*rpPeer).summary)
			t.Fatalf("not all reliable echoes came: %d arrivals; %s", seen, summary)
		case <-p.done:
			t.Fatal("the peer stopped")
		}
	}
	echoed := time.Now()

	p.do(ctx, func(p *rpPeer) { p.disconnect(time.Now()) })
	assert.True(t, p.await(ctx, "DisconnectAck", func(p *rpPeer) bool { return p.gotDiscAck }))
	select {
	case err := <-srvEnd:
		assert.ErrorIs(t, err, io.EOF, "the server's Receive after the client's Disconnect")
	case <-ctx.Done():
		t.Error("the server's Receive did not end after the client's Disconnect")
	}

	arr, _ := rpQuery(ctx, p, func(p *rpPeer) []rpArrival { return slices.Clone(p.arrivals) })
	// In-order echoes: the knet server delivered them in order and echoed
	// them in that order, so their reliable numbers (knet's numbering) go
	// up in send order.
	relOf := map[int]uint32{}
	for _, a := range arr {
		if i := rpWorkIndex(w, a.id, a.payload); i >= 0 && a.reliable && a.inOrder {
			relOf[i] = a.rel
		}
	}
	want := rpInOrderIndices(w)
	byRel := slices.Clone(want)
	slices.SortStableFunc(byRel, func(a, b int) int { return int(relOf[a]) - int(relOf[b]) })
	check.finish(loss == 0, byRel, want)
	// The reference delivers in arrival order (fact 15). On a clean path
	// that must be send order: what a reference application sees.
	if loss == 0 {
		assert.Equal(t, want, check.ordered, "client: in-order echoes in arrival order (the reference delivers them so) on a clean path")
	}
	summary, _ := rpQuery(ctx, p, (*rpPeer).summary)
	st := sc.Stats()
	t.Logf("echoes in after %v, closed after %v; peer: %s", echoed.Sub(start).Round(time.Millisecond), time.Since(start).Round(time.Millisecond), summary)
	t.Logf("knet server: sent %d datagrams, %d retransmits, RTT %v, RTO %v; received %d, duplicate messages %d, invalid %d",
		st.DatagramsSent, st.Retransmits, st.RTT, st.RTO, st.DatagramsReceived, st.DuplicateMessages, st.InvalidDatagrams)
}

// TestReferencePeerServerForDial: a knet Dial in the reference dialect against
// the scripted reference server, which echoes every message.
func TestReferencePeerServerForDial(t *testing.T) {
	t.Parallel()
	for _, path := range rpPaths {
		t.Run(path.name, func(t *testing.T) {
			t.Parallel()
			rpRunServer(t, path.loss, path.seed)
		})
	}
}

func rpRunServer(t *testing.T, loss float64, seed uint64) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), rpRunTimeout)
	defer cancel()

	pc, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	t.Cleanup(func() { pc.Close() })
	p := newRPPeer(t, true, pc, nil, loss, seed+100)
	p.start(ctx)

	cfg := &knet.Config{Dialect: knet.DialectReference, ConnectTimeout: 5 * time.Second, DisconnectTimeout: 3 * time.Second}
	c, err := knet.Dial(ctx, "udp", pc.LocalAddr().String(), cfg)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	assert.Equal(t, knet.DialectReference, c.Dialect())

	w := rpWorkload()
	for i, it := range w {
		require.NoError(t, c.Send(knet.Message{ID: it.id, Payload: rpWorkPayload(i, it.size), Reliable: it.reliable, InOrder: it.inOrder}))
	}
	check := &rpEchoCheck{t: t, who: "knet client", w: w, got: make([]int, len(w))}
	for !check.allReliable() {
		m, err := c.Receive(ctx)
		if err != nil {
			summary, _ := rpQuery(context.Background(), p, (*rpPeer).summary)
			t.Fatalf("receive: %v; peer: %s", err, summary)
		}
		check.add(m.ID, m.Payload, m.Reliable, m.InOrder)
	}
	echoed := time.Now()

	// knet orders in-order messages by the server's reliable numbers: the
	// order the server echoed them in, which is the order they arrived
	// there (the reference delivers in arrival order, fact 15).
	echoOrder, _ := rpQuery(ctx, p, func(p *rpPeer) []rpArrival { return slices.Clone(p.echoOrder) })
	var want []int
	for _, a := range echoOrder {
		want = append(want, rpWorkIndex(w, a.id, a.payload))
	}
	check.finish(loss == 0, check.ordered, want)
	if loss == 0 {
		assert.Equal(t, rpInOrderIndices(w), want, "server: in-order messages in arrival order (the reference delivers them so) on a clean path")
	}

	closeStart := time.Now()
	assert.NoError(t, c.Close(), "Close: a graceful end needs the DisconnectAck")
	closeTook := time.Since(closeStart)
	assert.Less(t, closeTook, cfg.DisconnectTimeout, "Close took its whole DisconnectTimeout")
	p.await(ctx, "the Disconnect answered", func(p *rpPeer) bool { return p.gotDisconnect > 0 && p.sentDiscAck > 0 })

	// Everything the server received is the workload, once per reliable
	// message.
	arr, _ := rpQuery(ctx, p, func(p *rpPeer) []rpArrival { return slices.Clone(p.arrivals) })
	got := make([]int, len(w))
	for _, a := range arr {
		i := rpWorkIndex(w, a.id, a.payload)
		if !assert.GreaterOrEqual(t, i, 0, "server: message of ID %d, %d bytes, not sent", a.id, len(a.payload)) {
			continue
		}
		got[i]++
		assert.True(t, bytes.Equal(rpWorkPayload(i, w[i].size), a.payload), "server: message %d content", i)
	}
	for i, it := range w {
		if it.reliable {
			assert.Equal(t, 1, got[i], "server: deliveries of reliable message %d (ID %d)", i, it.id)
		} else {
			assert.LessOrEqual(t, got[i], 1, "server: deliveries of unreliable message %d", i)
		}
	}

	summary, _ := rpQuery(ctx, p, (*rpPeer).summary)
	st := c.Stats()
	t.Logf("echoes in after %v, Close took %v; peer: %s", echoed.Sub(start).Round(time.Millisecond), closeTook.Round(time.Millisecond), summary)
	t.Logf("knet client: sent %d datagrams, %d retransmits, RTT %v, RTO %v; received %d, duplicate messages %d, invalid %d",
		st.DatagramsSent, st.Retransmits, st.RTT, st.RTO, st.DatagramsReceived, st.DuplicateMessages, st.InvalidDatagrams)
}

// TestReferencePeerReassemblyDefects shows that the scripted peer's receiver
// catches what would break the reference's (fact 18): a fragment before
// its FragmentStart, fragments out of FragmentNumber order; and that a
// duplicate (same reliable number) is dropped before it is checked.
func TestReferencePeerReassemblyDefects(t *testing.T) {
	frag := func(rel, n uint32, payload string) rpBlock {
		b := rpBlock{frag: true, reliable: true, inOrder: true, relNum: rel, transferID: 1, fragNum: n, payload: []byte(payload)}
		if n == 0 {
			b.fragStart, b.fragCount, b.id = true, 3, 70000
		}
		return b
	}
	for _, tc := range []struct {
		name      string
		blocks    []rpBlock
		errs      []string // substrings of the violations, in order
		delivered string   // "" if nothing
		dups      int
	}{
		{"in order", []rpBlock{frag(0, 0, "aa"), frag(1, 1, "bb"), frag(2, 2, "cc")}, nil, "aabbcc", 0},
		{"duplicate", []rpBlock{frag(0, 0, "aa"), frag(1, 1, "bb"), frag(1, 1, "bb"), frag(0, 0, "aa"), frag(2, 2, "cc")}, nil, "aabbcc", 2},
		{"before FragmentStart", []rpBlock{frag(1, 1, "bb"), frag(0, 0, "aa"), frag(2, 2, "cc")},
			[]string{"fragment 1 of transfer 1 in datagram 7 before its FragmentStart", "fragment 2 of transfer 1 in datagram 7 where fragment 1 was due"}, "", 0},
		{"out of order", []rpBlock{frag(0, 0, "aa"), frag(2, 2, "cc"), frag(1, 1, "bb")},
			[]string{"fragment 2 of transfer 1 in datagram 7 where fragment 1 was due", "fragment 1 of transfer 1 in datagram 7 where fragment 2 was due"}, "aaccbb", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newRPPeer(t, false, nil, nil, 0, 0)
			var errs []string
			p.errorf = func(format string, args ...any) { errs = append(errs, fmt.Sprintf(format, args...)) }
			d := rpDatagram{pid: 7, reliable: true}
			for i := range tc.blocks {
				p.block(time.Now(), &d, &tc.blocks[i])
			}
			require.Len(t, errs, len(tc.errs), "violations: %q", errs)
			for i, e := range tc.errs {
				assert.Contains(t, errs[i], e)
			}
			if tc.delivered == "" {
				assert.Empty(t, p.arrivals)
			} else if assert.Len(t, p.arrivals, 1) {
				a := p.arrivals[0]
				assert.Equal(t, tc.delivered, string(a.payload), "reassembled in arrival order, as the reference does")
				assert.Equal(t, []any{uint32(70000), true, true, uint32(0)}, []any{a.id, a.reliable, a.inOrder, a.rel})
			}
			assert.Equal(t, tc.dups, p.dupRel)
		})
	}
}
