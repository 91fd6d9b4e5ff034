package knet

import (
	"context"
	"errors"
	"fmt"
	"net"
	"time"
)

// Sending: Send and its variants check a message, copy its payload into
// the send queue and kick the connection. A full send buffer makes a reliable
// message wait (until the write deadline or ctx) and drops an unreliable
// one.

// Send queues m for sending and returns once the payload is copied. A
// reliable message waits for room in the send buffer until the write
// deadline; an unreliable one is dropped and counted if there is none,
// and Send returns ErrSendBufferFull, as TrySend and SendRef do.
// Send fails after Close, once the connection is lost, and for messages
// the protocol cannot carry (see ErrReservedID, ErrMessageTooLarge,
// ErrBadDependency).
func (c *Conn) Send(m Message) error {
	_, err := c.send(context.Background(), &m, false)
	return dropIsFull(err)
}

// errSendDropped is send's report of an unreliable message dropped for
// lack of room (counted in Stats.DroppedMessages), which Send and friends
// report as ErrSendBufferFull.
var errSendDropped = errors.New("knet: unreliable message dropped: send buffer full")

func dropIsFull(err error) error {
	if err == errSendDropped {
		return ErrSendBufferFull
	}
	return err
}

// SendContext is Send that also gives up when ctx is done.
func (c *Conn) SendContext(ctx context.Context, m Message) error {
	if ctx == nil {
		return errNilContext
	}
	_, err := c.send(ctx, &m, false)
	return dropIsFull(err)
}

// TrySend is Send that never waits: when the send buffer has no room, it
// returns ErrSendBufferFull (the message is not sent; an unreliable one
// is counted dropped), for a game loop that must not stall on one slow
// client.
func (c *Conn) TrySend(m Message) error {
	return c.trySend(&m, nil)
}

// trySend is TrySend; with a kicks list, it leaves c's kick to its caller.
func (c *Conn) trySend(m *Message, k *kicks) error {
	_, err := c.queue(doneCtx, m, false, k)
	if err == errSendDropped || errors.Is(err, context.Canceled) {
		return ErrSendBufferFull
	}
	return err
}

// ErrSendBufferFull is what TrySend returns, and Broadcast reports for a
// connection, when the send buffer had no room for the message; Send,
// SendContext and SendRef return it for an unreliable message they
// dropped for lack of room.
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
// traffic, so its datagrams are that connection's. The connections are
// handed to their endpoints' workers together, once every copy is queued:
// their datagrams leave in batches of one system call each.
//
// A Ref names a message of one connection, so m may not have DependsOn:
// Broadcast then sends nothing, calls miss (if not nil) with
// ErrBadDependency for each connection, and returns 0.
func Broadcast(conns []*Conn, m Message, miss func(*Conn, error)) int {
	if len(m.DependsOn) > 0 {
		if miss != nil {
			for _, c := range conns {
				miss(c, ErrBadDependency)
			}
		}
		return 0
	}
	n := 0
	k := getKicks()
	for _, c := range conns {
		if err := c.trySend(&m, k); err == nil {
			n++
		} else if miss != nil {
			miss(c, err)
		}
	}
	k.run()
	putKicks(k)
	return n
}

// doneCtx is a context already done: a send with it never waits.
var doneCtx = func() context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return ctx
}()

// SendRef is Send that also returns a Ref naming the message, so that
// later messages on c can list it in DependsOn. An unreliable message
// dropped for lack of room returns the zero Ref and ErrSendBufferFull.
func (c *Conn) SendRef(m Message) (Ref, error) {
	ref, err := c.send(context.Background(), &m, true)
	if err == errSendDropped {
		return 0, ErrSendBufferFull
	}
	return ref, err
}

func (c *Conn) send(ctx context.Context, m *Message, tracked bool) (Ref, error) {
	return c.queue(ctx, m, tracked, nil)
}

// queue is send; with a kicks list, it leaves c's kick to its caller.
func (c *Conn) queue(ctx context.Context, m *Message, tracked bool, k *kicks) (Ref, error) {
	if m.ID < MinMessageID || m.ID > MaxMessageID {
		return 0, ErrReservedID
	}
	if len(m.Payload) > c.cfg.maxMessage {
		return 0, fmt.Errorf("%w: %d bytes, the limit %d (Config.MaxMessageSize, which the receiver needs at least as large)",
			ErrMessageTooLarge, len(m.Payload), c.cfg.maxMessage)
	}
	if len(m.DependsOn) > MaxDependencies {
		return 0, ErrBadDependency
	}
	// The copy is made before taking the send lock, which a TrySend or a
	// Broadcast to this connection may be waiting for: a large message's
	// copy under it held them up (one of 64 KiB per chunk, many chunks).
	n := len(m.Payload)
	pbuf := getPayload(n)
	payload := append((*pbuf)[:0], m.Payload...)
	if err := c.waitRoom(ctx, m, n); err != nil {
		putPayload(pbuf)
		return 0, err
	}
	c.sendq.lastRef++ // the count, below the tag
	ref := Ref(c.sendq.lastRef << 1)
	if m.Reliable {
		ref |= 1
	}
	o := appMsg{
		ref:       ref,
		id:        m.ID,
		pbuf:      pbuf,
		payload:   payload,
		reliable:  m.Reliable,
		inOrder:   m.InOrder,
		tracked:   tracked,
		channel:   m.Channel,
		priority:  m.Priority,
		contentID: m.ContentID,
	}
	if len(m.DependsOn) > 0 {
		o.after = append([]Ref(nil), m.DependsOn...)
	}
	c.sendq.msgs = append(c.sendq.msgs, o)
	c.sendq.used += n
	room := c.sendq.used < c.cfg.sendBuffer
	light := c.sendq.used <= inlineSendBytes
	c.sendq.mu.Unlock()
	// TrySend leaves its round to the workers, a reply's and a dialed
	// connection's alike: the write may wait for room in the socket, and
	// TrySend never waits (TestTrySendNeverWaitsForTheSocket).
	try := ctx == doneCtx
	reply := k == nil && !try && c.recvq.took.Load() && c.recvq.took.Swap(false)
	switch {
	case k != nil:
		k.add(c)
	case light && !try && (reply || c.ep.connected) && c.claim():
		// The round runs here, with no hand-off, for a reply (the first
		// Send after Receive or Read took a message: an echo, a response,
		// a client's next request), and on a dialed connection, whose
		// socket is its own so that there is no batch to join, for a
		// message after a pause with little queued (a game client's
		// input). Messages in a burst go to the worker, which packs
		// those that queue meanwhile into shared datagrams, and a bulk
		// sender keeps it packing and sending while it copies the next
		// message in. A server's tick loop (TrySend to every connection,
		// messages taken by a Group's Poll) leaves its rounds to the
		// workers, which batch their datagrams.
		if now := time.Now(); reply || now.Sub(c.sched.sentHere) >= inlineGap {
			c.sched.sentHere = now
			c.ep.sched.runHere(c)
		} else {
			c.release()
			c.kick()
		}
	default:
		c.kick()
	}
	if room {
		signal(c.sendq.space) // let another waiting sender look
	}
	return ref, nil
}

// smallReserve: messages too large for one datagram leave 1/smallReserve
// of the send buffer to those that fit one (see waitRoom).
const smallReserve = 8

// waitRoom waits until the send buffer has room for m's n bytes, or
// reports why m cannot queue; it returns nil with the send lock held.
func (c *Conn) waitRoom(ctx context.Context, m *Message, n int) error {
	c.sendq.mu.Lock()
	for {
		if err := c.sendErrLocked(); err != nil {
			c.sendq.mu.Unlock()
			signal(c.sendq.space) // pass the news to the next waiting sender
			return err
		}
		if c.writeDL.passed() {
			c.sendq.mu.Unlock()
			return errDeadline
		}
		limit := c.cfg.sendBuffer
		if n > c.cfg.wholeLimit() {
			// A message that needs several datagrams (a download's
			// chunk) leaves an eighth of the buffer to those that fit
			// one (snapshots, events): bulk traffic filling the buffer
			// refused every TrySend and Broadcast to the connection.
			limit -= c.cfg.sendBuffer / smallReserve
		}
		if c.sendq.used == 0 || c.sendq.used+n <= limit {
			break
		}
		if !m.Reliable {
			c.sendq.drops++
			c.sendq.mu.Unlock()
			return errSendDropped
		}
		c.sendq.mu.Unlock()
		if err := waitSignal(ctx, c.sendq.space, c.writeDL.wait()); err != nil {
			return err
		}
		c.sendq.mu.Lock()
	}
	for _, r := range m.DependsOn {
		last := Ref(c.sendq.lastRef << 1)
		if r.tag() != last.tag() || r.seq() == 0 || r.seq() > last.seq() || m.Reliable && !r.reliable() {
			c.sendq.mu.Unlock()
			return ErrBadDependency
		}
	}
	return nil
}

// sendErrLocked is why Send cannot queue, or nil.
func (c *Conn) sendErrLocked() error {
	if c.sendq.closing {
		return net.ErrClosed
	}
	if c.sendq.peerGone {
		return ErrPeerClosed
	}
	select {
	case <-c.done:
		return c.Err()
	default:
		return nil
	}
}

// FlowControl asks the peer to send at most rate datagrams a second (a
// FlowControlRequest); the peer may always send MinDatagramRate.
func (c *Conn) FlowControl(rate int) {
	c.sendq.mu.Lock()
	c.sendq.flowReq = max(rate, 1)
	c.sendq.mu.Unlock()
	c.kick()
}
