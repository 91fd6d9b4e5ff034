package knet

import (
	"context"
	"io"
	"net"
	"time"
)

// Conn as a net.Conn: Read and Write carry a byte stream as reliable
// in-order messages; the addresses; the deadlines.

// Read reads the payloads of received messages of ID StreamMessageID (what
// Write sends) as one byte stream, in the order they are received; a long
// payload takes several Reads. Messages of other IDs stay, in their order,
// for Receive. Read returns io.EOF once the peer has closed and every
// StreamMessageID payload is read, and ErrInGroup while c is in a Group.
func (c *Conn) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	var n int
	for n == 0 {
		err := c.waitRecv(context.Background(), true, func(q *recvQueue) {
			n = q.read(p, StreamMessageID)
		})
		if err != nil {
			if err == io.EOF {
				return 0, io.EOF
			}
			return 0, c.opError("read", err)
		}
	}
	return n, nil
}

// Write sends b as one reliable in-order message on channel 0 with ID
// StreamMessageID (several, if b is larger than MaxMessageSize).
func (c *Conn) Write(b []byte) (int, error) {
	n := 0
	for {
		k := min(len(b)-n, c.cfg.maxMessage)
		m := Message{ID: StreamMessageID, Payload: b[n : n+k], Reliable: true, InOrder: true}
		if _, err := c.send(context.Background(), &m, false); err != nil {
			return n, c.opError("write", err)
		}
		n += k
		if n == len(b) {
			return n, nil
		}
	}
}

func (c *Conn) opError(op string, err error) error {
	return &net.OpError{Op: op, Net: "knet", Source: c.LocalAddr(), Addr: c.RemoteAddr(), Err: err}
}

// LocalAddr returns the local address of the socket.
func (c *Conn) LocalAddr() net.Addr {
	if c.st != nil {
		return c.st.nc.LocalAddr()
	}
	return c.ep.sock.LocalAddr()
}

// RemoteAddr returns the peer's address. A secure connection's client may
// move (NAT rebinding, another network): on the server, the address
// changes once the client proved it receives at the new one (see
// Stats.Migrations).
func (c *Conn) RemoteAddr() net.Addr {
	if c.st != nil {
		return c.st.nc.RemoteAddr()
	}
	return c.remote.Load()
}

// SetDeadline sets the read and write deadlines.
func (c *Conn) SetDeadline(t time.Time) error {
	c.readDL.set(t)
	signal(c.recvq.streamReady) // a Read waiting looks again (readDL signals Receive's)
	c.writeDL.set(t)
	return nil
}

// SetReadDeadline sets the deadline for Read and Receive.
func (c *Conn) SetReadDeadline(t time.Time) error {
	c.readDL.set(t)
	signal(c.recvq.streamReady) // a Read waiting looks again (readDL signals Receive's)
	return nil
}

// SetWriteDeadline sets the deadline for Write and Send.
func (c *Conn) SetWriteDeadline(t time.Time) error {
	c.writeDL.set(t)
	return nil
}
