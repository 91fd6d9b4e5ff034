package main

import (
	"cmp"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/knet-go/knet"
)

// Game rules.
const (
	worldSize   = 1000  // the world is a torus this wide
	speed       = 150.0 // units per second at full input
	chatLimit   = 5     // chat lines a player may send per chatWindow...
	chatWindow  = time.Second
	idleLimit   = time.Second // ...and how long it may go without input
	scoreEvery  = 30          // ticks: the player nearest the centre scores
	eventBuffer = 256         // events taken per Poll call
)

// player is what the server knows of one connection, attached to it as
// its user data by AdmitConn.
type player struct {
	id   uint16
	name string
	conn *knet.Conn

	x, y      int32 // position units (fixed-point, see unit)
	dx, dy    int8
	lastInput uint32    // seq of the last applied input
	lastHeard time.Time // when it last sent an input
	chat      []time.Time
	score     int
	kicked    string // why, once kicked

	inputsApplied int // inputs taken into the world
	snapsSent     int // snapshots handed to the connection
	// Delta snapshots: those sent lately, by the Ref of their message,
	// and the newest the client is known to have.
	history   []sentSnap
	baseTick  uint32 // 0: none
	fullBytes int    // what the snapshots sent would have taken in full
	sentBytes int    // what they took
	deltas    int    // snapshots sent as deltas
	// Of those sent as deltas: their bytes, and theirs in full.
	deltaBytes, deltaFull int
	snapsMissed           int // snapshots its full send buffer did not take
	final                 knet.Stats
	gone                  bool // its EventDisconnected came
	endErr                error
}

// sentSnap is a snapshot sent to a player: a baseline for later ones once
// its receipt says it arrived.
type sentSnap struct {
	ref  knet.Ref
	tick uint32
	ents []entity
}

// Delta snapshots are made against a baseline at most maxBaseAge ticks
// old (the client keeps twice that many), else sent in full.
const maxBaseAge = 32

// server is the authoritative game server: one goroutine (loop) owns the
// world and every player; AdmitConn, on the connections' goroutines,
// only touches the token table.
type server struct {
	l     *knet.Listener
	web   *http.Server // WebSocket players (browsers), on a port of its own
	webLn net.Listener
	group *knet.Group
	epoch time.Time // snapshot times are nanoseconds since it
	tick  time.Duration
	move  int32 // one tick's move at full speed, in position units
	delta bool  // send snapshots as deltas against what the client has

	mu     sync.Mutex
	tokens map[string]string // join token -> player name, single use
	nextID uint16

	players []*player // connected, in join order; the loop's alone
	all     []*player // every player that ever joined, for the report
	conns   []*knet.Conn
	events  []knet.Event
	snap    []byte
	order   []*player

	ticks    int
	tickWork time.Duration // summed wall time of the ticks' work
	maxTick  time.Duration
}

func newServer(addr string, tick time.Duration, sim *knet.Simulation, epoch time.Time, delta bool) (*server, error) {
	s := &server{
		group:  knet.NewGroup(),
		epoch:  epoch,
		tick:   tick,
		move:   stepFor(tick),
		delta:  delta,
		tokens: map[string]string{},
		events: make([]knet.Event, eventBuffer),
	}
	cfg := &knet.Config{
		Group:         s.group,   // connections come out of Poll, not Accept
		AdmitConn:     s.admit,   // join tokens
		Simulate:      sim,       // the server's side of a simulated network
		SendBuffer:    256 << 10, // a client that cannot take 256 KiB of events is not keeping up
		ReceiveBuffer: 256 << 10,
		// An input waits at most 30ms for a missing earlier one.
		ReorderWindows: map[uint32]time.Duration{msgInput: 30 * time.Millisecond},
		// Snapshots sent with SendRef are told delivered or lost
		// (EventDelivered, EventLost): the delivered ones are the
		// baselines of the deltas.
		Receipts: delta,
		// Players whose networks block UDP come over TCP, on the same
		// port number; the game loop does not tell them apart.
		TCP: true,
	}
	l, err := knet.Listen("udp", addr, cfg)
	if err != nil {
		return nil, err
	}
	s.l = l
	// Browsers have no UDP: the same listener takes them over WebSocket
	// on an HTTP path, here on a server of its own.
	mux := http.NewServeMux()
	mux.Handle("/knet", l.WebSocketHandler())
	s.webLn, err = net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		l.Close()
		return nil, err
	}
	s.web = &http.Server{Handler: mux}
	go s.web.Serve(s.webLn)
	s.setQueryInfo()
	return s, nil
}

// setQueryInfo sets what the server answers server queries with
// (knet.Query, knet.Discover: a server browser's, a LAN lobby's), without
// a connection: its name, map and player count, here as key=value pairs.
// The loop calls it as players come and go; the listener's reader
// answers from it at any time.
func (s *server) setQueryInfo() {
	info := fmt.Appendf(nil, "name=knet example;map=torus %d;players=%d", worldSize, len(s.players))
	if err := s.l.SetQueryInfo(info); err != nil {
		panic(err) // at most knet.MaxQueryInfo bytes: far more than this
	}
}

// issueToken is what a lobby or matchmaker would do: a single-use token
// the player presents when it connects.
func (s *server) issueToken(name string) string {
	b := make([]byte, 16)
	rand.Read(b)
	t := hex.EncodeToString(b)
	s.mu.Lock()
	s.tokens[t] = name
	s.mu.Unlock()
	return t
}

// admit runs on a goroutine of its own, during the handshake: a
// bad token refuses it with a reason the client sees (*knet.RefusedError),
// a good one makes the player, attached as user data, and the reply tells
// the client its entity id.
func (s *server) admit(c *knet.Conn, token []byte) ([]byte, error) {
	s.mu.Lock()
	name, ok := s.tokens[string(token)]
	delete(s.tokens, string(token))
	s.nextID++
	id := s.nextID
	s.mu.Unlock()
	if !ok {
		return nil, errors.New("bad join token")
	}
	c.SetUserData(&player{id: id, name: name, conn: c})
	return binary.LittleEndian.AppendUint16(nil, id), nil
}

// sendNow sends m to c without ever blocking the tick: a reliable Send
// waits when the send buffer is full, TrySend never does.
func (s *server) sendNow(c *knet.Conn, m knet.Message) bool {
	return c.TrySend(m) == nil
}

// Why a player is sent away: the code its client reads in its
// *knet.DisconnectError, to branch on (the reason is for people).
const (
	closeRoundOver uint32 = 1 + iota
	closeTooSlow
	closeMalformed
	closeChatSpam
	closeIdle
)

// kick closes p's connection with a code and a reason its client reads in
// its *knet.DisconnectError. StartCloseWithError returns at once (the
// close goes on: what was queued delivered, the Disconnect acked) and the
// end comes out of Poll as EventDisconnected: the tick never waits for a
// client.
func (s *server) kick(p *player, code uint32, why string) {
	if p.kicked != "" {
		return
	}
	p.kicked = why
	p.final = p.conn.Stats()
	p.conn.StartCloseWithError(code, why)
}

// broadcastEvent sends a reliable ordered event to every player. One
// whose send buffer is full cannot keep up with reliable traffic: it is
// kicked rather than allowed to hold anyone up.
func (s *server) broadcastEvent(payload []byte) {
	knet.Broadcast(s.conns, knet.Message{ID: msgEvent, Payload: payload, Reliable: true, InOrder: true, Channel: chanEvents},
		func(c *knet.Conn, err error) {
			if p, _ := c.UserData().(*player); p != nil && errors.Is(err, knet.ErrSendBufferFull) {
				s.kick(p, closeTooSlow, "kicked: too slow, missed a reliable event")
			}
		})
}

func spawnEvent(p *player) []byte {
	return appendEntity([]byte{evSpawn}, entity{p.id, p.x, p.y})
}

// stepFor is one tick's move at full speed, in position units.
func stepFor(tick time.Duration) int32 { return int32(math.Round(speed * unit * tick.Seconds())) }

// step runs one tick: take every event, apply inputs, simulate, send
// snapshots. It returns how long the work took.
func (s *server) step(now time.Time, live bool) time.Duration {
	start := time.Now()
	s.drain(now, live)
	if live {
		s.simulate(now)
		s.sendSnapshots(now)
	}
	s.ticks++
	d := time.Since(start)
	if live {
		s.tickWork += d
		s.maxTick = max(s.maxTick, d)
	}
	return d
}

// drain takes everything the Group has, without blocking: a full buffer
// of events means there may be more.
func (s *server) drain(now time.Time, live bool) {
	for {
		n := s.group.Poll(s.events)
		for i := range s.events[:n] {
			s.handle(&s.events[i], now, live)
		}
		if n < len(s.events) {
			return
		}
	}
}

func (s *server) handle(e *knet.Event, now time.Time, live bool) {
	p, _ := e.Conn.UserData().(*player)
	if p == nil {
		return // AdmitConn admits no one without a player
	}
	switch e.Kind {
	case knet.EventConnected:
		p.x = int32(int(p.id)*97%worldSize)*unit + unit/2
		p.y = int32(int(p.id)*389%worldSize)*unit + unit/2
		p.lastHeard = now
		// The newcomer learns who is there, then everyone (itself
		// included) learns of it.
		for _, o := range s.players {
			s.sendNow(p.conn, knet.Message{ID: msgEvent, Payload: spawnEvent(o), Reliable: true, InOrder: true, Channel: chanEvents})
		}
		s.players = append(s.players, p)
		s.all = append(s.all, p)
		s.conns = append(s.conns, p.conn)
		s.setQueryInfo()
		s.broadcastEvent(spawnEvent(p))
		if !live {
			s.kick(p, closeRoundOver, "round over")
		}
	case knet.EventMessage:
		switch e.Message.ID {
		case msgInput:
			in, err := parseInput(e.Message.Payload)
			if err != nil {
				s.kick(p, closeMalformed, "kicked: malformed input")
				return
			}
			// The channel is sequenced: an input never arrives after a
			// newer one. Gaps are lost inputs.
			p.lastInput = in.seq
			p.dx, p.dy = max(-1, min(1, in.dx)), max(-1, min(1, in.dy))
			p.inputsApplied++
			p.lastHeard = now
		case msgChat:
			p.chat = append(p.chat, now)
			for len(p.chat) > 0 && now.Sub(p.chat[0]) > chatWindow {
				p.chat = p.chat[1:]
			}
			if len(p.chat) > chatLimit {
				s.kick(p, closeChatSpam, fmt.Sprintf("kicked: more than %d chat lines in %v", chatLimit, chatWindow))
				return
			}
			line := fmt.Appendf(nil, "%s: %s", p.name, e.Message.Payload) // copy: the payload is only good until the next Poll
			knet.Broadcast(s.conns, knet.Message{ID: msgChat, Payload: line, Reliable: true, InOrder: true, Channel: chanChat}, nil)
		}
	case knet.EventDisconnected:
		p.gone, p.endErr = true, e.Err
		i := slices.Index(s.players, p)
		if i >= 0 {
			s.players = slices.Delete(s.players, i, i+1)
			s.conns = slices.Delete(s.conns, i, i+1)
			s.setQueryInfo()
		}
		s.broadcastEvent(binary.LittleEndian.AppendUint16([]byte{evDespawn}, p.id))
	case knet.EventDelivered:
		// The client has this snapshot: the newest such is the
		// baseline of the next deltas.
		for _, h := range p.history {
			if h.ref == e.Ref && h.tick > p.baseTick {
				p.baseTick = h.tick
			}
		}
	case knet.EventLost:
		// Not a baseline: nothing to do. (Its entry goes with age.)
	}
}

func (s *server) simulate(now time.Time) {
	best, bestD := (*player)(nil), int64(math.MaxInt64)
	for _, p := range s.players {
		if p.kicked != "" {
			continue
		}
		if now.Sub(p.lastHeard) > idleLimit {
			s.kick(p, closeIdle, fmt.Sprintf("kicked: no input for %v", idleLimit))
			continue
		}
		p.x = wrap(p.x + int32(p.dx)*s.move)
		p.y = wrap(p.y + int32(p.dy)*s.move)
		cx, cy := int64(p.x-world/2), int64(p.y-world/2)
		if d := cx*cx + cy*cy; d < bestD {
			best, bestD = p, d
		}
	}
	if best != nil && s.ticks%scoreEvery == 0 {
		best.score++
		b := binary.LittleEndian.AppendUint16(nil, best.id)
		b = binary.LittleEndian.AppendUint32(b, uint32(best.score))
		knet.Broadcast(s.conns, knet.Message{ID: msgScore, ContentID: uint32(best.id), Reliable: true, Payload: b}, nil)
	}
}

// sendSnapshots sends each player its own view: itself first, then the
// others nearest to it, as many as fit in one unreliable datagram, as
// the latest state (ContentID): a newer snapshot replaces an older one
// still queued, and a receiver drops one older than what it has. With
// delta on, a snapshot is encoded against the newest one its client is
// known to have (see the snapshot format in protocol.go), or in full when
// there is none, or that is no smaller.
func (s *server) sendSnapshots(now time.Time) {
	sent := now.Sub(s.epoch).Nanoseconds()
	tick := uint32(s.ticks + 1) // base 0 means full
	for _, p := range s.players {
		if p.kicked != "" {
			continue
		}
		room := (p.conn.MaxUnreliablePayload()-snapHeader)/snapEntity - 1 // others that fit
		s.order = s.order[:0]
		for _, o := range s.players {
			if o != p {
				s.order = append(s.order, o)
			}
		}
		if len(s.order) > room {
			dist := func(o *player) int64 {
				dx, dy := int64(torus(o.x-p.x)), int64(torus(o.y-p.y))
				return dx*dx + dy*dy
			}
			slices.SortFunc(s.order, func(a, b *player) int { return cmp.Compare(dist(a), dist(b)) })
			s.order = s.order[:room]
		}
		ents := make([]entity, 0, 1+len(s.order))
		ents = append(ents, entity{p.id, p.x, p.y})
		for _, o := range s.order {
			ents = append(ents, entity{o.id, o.x, o.y})
		}
		snap := snapshot{tick: tick, sent: sent, ack: p.lastInput, ents: ents}
		b := appendSnapshot(s.snap[:0], &snap, nil, s.move)
		full := len(b)
		if base := p.sentAt(p.baseTick); s.delta && base != nil {
			snap.base = base.tick
			if d := appendSnapshot(b[len(b):], &snap, base.ents, s.move); len(d) < full {
				b = d
			}
		}
		s.snap = b
		if len(b) < full {
			p.deltas++
		}
		m := knet.Message{ID: msgSnapshot, ContentID: snapshotContent, Payload: b}
		if !s.delta {
			if s.sendNow(p.conn, m) {
				p.snapsSent++
				p.fullBytes += full
				p.sentBytes += len(b)
			} else {
				p.snapsMissed++
			}
			continue
		}
		// SendRef never waits for an unreliable message: with no room, it
		// is dropped (ErrSendBufferFull).
		ref, err := p.conn.SendRef(m)
		if err != nil {
			p.snapsMissed++
			continue
		}
		p.snapsSent++
		p.fullBytes += full
		p.sentBytes += len(b)
		if len(b) < full {
			p.deltaBytes += len(b)
			p.deltaFull += full
		}
		p.remember(sentSnap{ref: ref, tick: tick, ents: ents})
	}
}

// remember keeps s as a possible baseline, dropping those too old to be
// one.
func (p *player) remember(s sentSnap) {
	p.history = slices.DeleteFunc(p.history, func(h sentSnap) bool { return s.tick-h.tick >= maxBaseAge })
	p.history = append(p.history, s)
}

// sentAt returns the snapshot of tick sent to p, if still kept.
func (p *player) sentAt(tick uint32) *sentSnap {
	for i := range p.history {
		if p.history[i].tick == tick {
			return &p.history[i]
		}
	}
	return nil
}

// endRound freezes the world: each player's connection figures are taken
// as they stand, and a reliable event tells the clients to leave.
func (s *server) endRound() {
	for _, p := range s.players {
		p.final = p.conn.Stats()
	}
	s.broadcastEvent([]byte{evRoundOver})
}

// close closes the listener, and with it any connection left, kicks
// under way included.
// webURL is where WebSocket players connect.
func (s *server) webURL() string { return "ws://" + s.webLn.Addr().String() + "/knet" }

func (s *server) close() error {
	s.web.Close()
	err := s.l.Close()
	if errors.Is(err, io.EOF) {
		err = nil
	}
	return err
}
