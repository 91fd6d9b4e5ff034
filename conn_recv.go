package knet

import (
	"context"
	"io"
	"net"
)

// Receiving: the messages the rounds delivered wait in the receive queue
// for Receive and ReceiveInto (and Read, conn_netconn.go).

// Receive returns the next message, of any ID (Write's StreamMessageID
// too). It waits until one arrives, the read deadline passes or ctx is
// done; a message already waiting is returned whatever the deadline or
// ctx. After the peer closed gracefully and every earlier message has been
// received, it returns io.EOF. While c is in a Group it returns
// ErrInGroup: its messages go to the group's Poll.
func (c *Conn) Receive(ctx context.Context) (Message, error) {
	var m Message
	if ctx == nil {
		return m, errNilContext
	}
	err := c.waitRecv(ctx, false, func(q *recvQueue) {
		e := q.peek()
		m = Message{ID: e.id, Payload: q.take(e), Reliable: e.reliable, InOrder: e.inOrder}
	})
	return m, err
}

// ReceiveInto is Receive without allocating: it copies the payload into
// buf and returns the message with Payload aliasing buf. If buf is too
// short the payload is cut to fit and n reports the full length.
func (c *Conn) ReceiveInto(ctx context.Context, buf []byte) (m Message, n int, err error) {
	if ctx == nil {
		return m, 0, errNilContext
	}
	err = c.waitRecv(ctx, false, func(q *recvQueue) {
		e := q.peek()
		n = e.n
		k := copy(buf, q.bytes(e))
		m = Message{ID: e.id, Payload: buf[:k], Reliable: e.reliable, InOrder: e.inOrder}
		q.pop()
	})
	return m, n, err
}

// waitRecv waits for a message and calls take with the queue locked:
// any message, or with stream (Read) one of ID StreamMessageID.
func (c *Conn) waitRecv(ctx context.Context, stream bool, take func(q *recvQueue)) error {
	ready := c.recvq.ready
	if stream {
		ready = c.recvq.streamReady
	}
	has := func(q *recvQueue) bool {
		if stream {
			return q.has(StreamMessageID)
		}
		return q.len() > 0
	}
	for {
		if c.group.Load() != nil {
			return ErrInGroup
		}
		c.recvq.mu.Lock()
		if c.isClosed() && !c.readsOn() {
			c.recvq.mu.Unlock()
			c.recvq.wake() // pass the news to the next waiting reader
			return net.ErrClosed
		}
		if has(&c.recvq.msgs) {
			before := c.recvq.msgs.used()
			take(&c.recvq.msgs)
			more := c.recvq.msgs.len() > 0
			after := c.recvq.msgs.used()
			c.recvq.mu.Unlock()
			c.recvq.took.Store(true)
			if more {
				c.recvq.wake()
			}
			// Reading freed what the peer may be waiting for: let the
			// loop tell it (flow control) and take what it resends.
			if q := c.cfg.recvBuffer / 4; before >= q && after < q {
				c.kick()
			}
			return nil
		}
		eof := c.recvq.eof
		c.recvq.mu.Unlock()
		if eof {
			c.recvq.wake()
			return io.EOF
		}
		select {
		case <-c.done:
			c.recvq.mu.Lock()
			n, eof := has(&c.recvq.msgs), c.recvq.eof
			c.recvq.mu.Unlock()
			if n {
				continue
			}
			c.recvq.wake()
			if eof {
				return io.EOF
			}
			return c.Err()
		default:
		}
		if c.readDL.passed() {
			return errDeadline
		}
		if err := waitSignal(ctx, ready, c.readDL.wait()); err != nil {
			return err
		}
	}
}

// readsOn reports whether a closed connection still hands its
// application what arrives: one a Listener's Drain closed, until the
// application closes it too.
func (c *Conn) readsOn() bool { return c.readOn.Load() && !c.userClosed.Load() }
