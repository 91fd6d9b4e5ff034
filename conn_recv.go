package knet

import (
	"context"
	"io"
	"net"
)

// Receiving: the messages the rounds delivered wait in the receive queue
// for Receive and ReceiveInto (and Read, conn_netconn.go).

// Receive returns the next message. It waits until one arrives, the read
// deadline passes or ctx is done; a message already waiting is returned
// whatever the deadline or ctx. After the peer closed gracefully and every
// earlier message has been received, it returns io.EOF.
func (c *Conn) Receive(ctx context.Context) (Message, error) {
	var m Message
	if ctx == nil {
		return m, errNilContext
	}
	err := c.waitRecv(ctx, func(q *recvQueue) {
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
	err = c.waitRecv(ctx, func(q *recvQueue) {
		e := q.peek()
		n = e.n
		k := copy(buf, q.bytes(e))
		m = Message{ID: e.id, Payload: buf[:k], Reliable: e.reliable, InOrder: e.inOrder}
		q.pop()
	})
	return m, n, err
}

// waitRecv waits for a message and calls take with the queue locked.
func (c *Conn) waitRecv(ctx context.Context, take func(q *recvQueue)) error {
	for {
		c.recvq.mu.Lock()
		if c.isClosed() && !c.readsOn() {
			c.recvq.mu.Unlock()
			signal(c.recvq.ready) // pass the news to the next waiting reader
			return net.ErrClosed
		}
		if c.recvq.msgs.len() > 0 {
			before := c.recvq.msgs.used()
			take(&c.recvq.msgs)
			more := c.recvq.msgs.len() > 0
			after := c.recvq.msgs.used()
			c.recvq.mu.Unlock()
			c.recvq.took.Store(true)
			if more {
				signal(c.recvq.ready)
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
			signal(c.recvq.ready)
			return io.EOF
		}
		select {
		case <-c.done:
			c.recvq.mu.Lock()
			n, eof := c.recvq.msgs.len(), c.recvq.eof
			c.recvq.mu.Unlock()
			if n > 0 {
				continue
			}
			signal(c.recvq.ready)
			if eof {
				return io.EOF
			}
			return c.Err()
		default:
		}
		if c.readDL.passed() {
			return errDeadline
		}
		if err := waitSignal(ctx, c.recvq.ready, c.readDL.wait()); err != nil {
			return err
		}
	}
}

// readsOn reports whether a closed connection still hands its
// application what arrives: one a Listener's Drain closed, until the
// application closes it too.
func (c *Conn) readsOn() bool { return c.readOn.Load() && !c.userClosed.Load() }
