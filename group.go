package knet

import (
	"context"
	"errors"
	"sync"
)

// A Group gathers many connections so that one goroutine serves them all:
// a game loop calls Poll once a tick to take, without blocking, every
// connection that arrived, every message received, every receipt
// (Config.Receipts) and every connection that ended, in one stream of
// Events; Wait blocks until there is one. A connection's receipts come
// before its messages of the same Poll.
// Connections join with Add, or through Config.Group, which hands a
// Listener's new connections (and a Dial's) to the group instead of to
// Accept.
//
// While a connection is in a group its messages go to Poll: Receive,
// ReceiveInto and Read return ErrInGroup. Flow control works as with Receive: what Poll has not
// taken yet counts against ReceiveBuffer, so a loop that falls behind
// slows its peers down rather than losing reliable messages.
//
// Poll allocates nothing once its buffers have grown to a tick's worth of
// traffic. A Group is safe for concurrent use, but is meant for one
// reader. The zero Group is an empty group ready to use.
type Group struct {
	mu    sync.Mutex
	ready []*Conn // connections with news, each once, in the order it came
	spare []*Conn
	arena []byte        // payloads of the events of the last Poll
	conns int           // connections added and not yet reported ended
	wake  chan struct{} // capacity 1, made by wakeLocked
}

// NewGroup returns an empty group.
func NewGroup() *Group { return &Group{wake: make(chan struct{}, 1)} }

// ErrInGroup is returned by Receive, ReceiveInto and Read on a connection
// in a Group, whose messages go to the group's Poll.
var ErrInGroup = errors.New("knet: connection in a group: its messages go to Poll")

// wakeLocked is the channel that wakes Wait, made on first use so that
// the zero Group works; the caller holds g.mu.
func (g *Group) wakeLocked() chan struct{} {
	if g.wake == nil {
		g.wake = make(chan struct{}, 1)
	}
	return g.wake
}

// EventKind says what an Event reports.
type EventKind uint8

const (
	// EventConnected: Conn joined the group (a new connection, or one
	// added). It comes before any of the connection's messages.
	EventConnected EventKind = iota + 1
	// EventMessage: Message arrived on Conn.
	EventMessage
	// EventDisconnected: Conn ended, after its last message; Err says
	// why, as Conn.Err does (ErrPeerClosed, or a *DisconnectError with
	// the peer's reason, when the peer closed; net.ErrClosed when this
	// side did; a *TimeoutError, ErrRetransmitLimit, ... when it was
	// lost). It is the connection's last event: the group forgets it.
	EventDisconnected
	// EventDelivered: the message Ref names, sent with SendRef on Conn
	// (with Config.Receipts), was acked by the peer. See Receipt.
	EventDelivered
	// EventLost: the message Ref names was lost. See Receipt.
	EventLost
)

func (k EventKind) String() string {
	switch k {
	case EventConnected:
		return "connected"
	case EventMessage:
		return "message"
	case EventDisconnected:
		return "disconnected"
	case EventDelivered:
		return "delivered"
	case EventLost:
		return "lost"
	}
	return "EventKind(?)"
}

// An Event is one thing that happened on one of a group's connections.
type Event struct {
	Kind EventKind
	Conn *Conn
	// Message is the received message, for EventMessage. Its Payload
	// stays valid until the next Poll: copy what you keep.
	Message Message
	// Err is why the connection ended, for EventDisconnected.
	Err error
	// Ref names the message of an EventDelivered or EventLost.
	Ref Ref
}

// Add puts c in the group: its arrival (EventConnected), its messages
// from now on, including those already waiting, and its end come out of
// Poll. A connection is in one group at most; Add moves it.
func (g *Group) Add(c *Conn) {
	if old := c.group.Swap(g); old != nil && old != g {
		old.remove(c)
	}
	g.mu.Lock()
	if !c.inGroup.noticed {
		c.inGroup.noticed = true
		c.inGroup.joined, c.inGroup.ended = false, false
		g.conns++
	}
	g.mu.Unlock()
	c.recvq.wake() // a Receive waiting returns ErrInGroup
	g.notify(c)
}

// Remove takes c out of the group: its messages go to Receive again. No
// EventDisconnected is reported for it.
func (g *Group) Remove(c *Conn) {
	if c.group.CompareAndSwap(g, nil) {
		g.remove(c)
		c.recvq.wake()
	}
}

func (g *Group) remove(c *Conn) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if c.inGroup.noticed && !c.inGroup.ended {
		g.conns--
	}
	c.inGroup.noticed = false
	if c.inGroup.queued {
		c.inGroup.queued = false
		for i, r := range g.ready {
			if r == c {
				copy(g.ready[i:], g.ready[i+1:])
				g.ready[len(g.ready)-1] = nil
				g.ready = g.ready[:len(g.ready)-1]
				break
			}
		}
	}
}

// Len returns how many connections are in the group.
func (g *Group) Len() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.conns
}

// notify lists c as having news, once.
func (g *Group) notify(c *Conn) {
	g.mu.Lock()
	if c.inGroup.noticed && !c.inGroup.queued && !c.inGroup.ended {
		c.inGroup.queued = true
		g.ready = append(g.ready, c)
	}
	wake := g.wakeLocked()
	g.mu.Unlock()
	signal(wake)
}

// Wait blocks until an event waits for Poll, or ctx is done.
func (g *Group) Wait(ctx context.Context) error {
	if ctx == nil {
		return errNilContext
	}
	for {
		g.mu.Lock()
		n := len(g.ready)
		wake := g.wakeLocked()
		g.mu.Unlock()
		if n > 0 {
			return nil
		}
		select {
		case <-wake:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// Poll fills events with what happened since the last call, without
// blocking, and returns how many it filled: at most len(events). What
// does not fit stays for the next call. Payloads of the events handed
// out by the previous call are reused: copy what you keep before calling
// Poll again.
func (g *Group) Poll(events []Event) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	clear(events)
	g.arena = g.arena[:0]
	n := 0
	work := g.ready
	g.ready = g.spare[:0]
	for i, c := range work {
		work[i] = nil
		if n == len(events) {
			g.ready = append(g.ready, c) // its turn next time
			continue
		}
		c.inGroup.queued = false
		n += g.drain(c, events[n:])
		if !c.inGroup.ended && !c.inGroup.queued && c.hasNews() {
			c.inGroup.queued = true
			g.ready = append(g.ready, c)
		}
	}
	g.spare = work[:0]
	return n
}

// drain fills events from c: its arrival, its waiting messages, its end.
func (g *Group) drain(c *Conn, events []Event) int {
	n := 0
	if !c.inGroup.joined {
		c.inGroup.joined = true
		events[n] = Event{Kind: EventConnected, Conn: c}
		n++
	}
	c.recvq.mu.Lock()
	k := 0
	for ; k < len(c.recvq.receipts) && n < len(events); k++ {
		r := c.recvq.receipts[k]
		kind := EventLost
		if r.Delivered {
			kind = EventDelivered
		}
		events[n] = Event{Kind: kind, Conn: c, Ref: r.Ref}
		n++
	}
	if k > 0 {
		rest := copy(c.recvq.receipts, c.recvq.receipts[k:])
		clear(c.recvq.receipts[rest:])
		c.recvq.receipts = c.recvq.receipts[:rest]
	}
	before := c.recvq.msgs.used()
	for n < len(events) && c.recvq.msgs.len() > 0 {
		e := c.recvq.msgs.peek()
		off := len(g.arena)
		g.arena = append(g.arena, c.recvq.msgs.bytes(e)...)
		events[n] = Event{Kind: EventMessage, Conn: c, Message: Message{ID: e.id,
			Payload: g.arena[off:len(g.arena):len(g.arena)], Reliable: e.reliable, InOrder: e.inOrder}}
		n++
		c.recvq.msgs.pop()
	}
	empty, after := c.recvq.msgs.len() == 0 && len(c.recvq.receipts) == 0, c.recvq.msgs.used()
	c.recvq.mu.Unlock()
	// Taking messages freed what the peer may be waiting for, as in
	// Receive.
	if q := c.cfg.recvBuffer / 4; before >= q && after < q {
		c.kick()
	}
	if n < len(events) && empty && c.ended() {
		c.inGroup.ended = true
		g.conns--
		events[n] = Event{Kind: EventDisconnected, Conn: c, Err: c.Err()}
		n++
		c.group.CompareAndSwap(g, nil)
		c.inGroup.noticed = false
	}
	return n
}

// hasNews reports whether c has messages waiting, or has ended.
func (c *Conn) hasNews() bool {
	c.recvq.mu.Lock()
	n := c.recvq.msgs.len() + len(c.recvq.receipts)
	c.recvq.mu.Unlock()
	return n > 0 || c.ended()
}

func (c *Conn) ended() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}
