package knet

import (
	"net"
	"sync"
	"time"

	"github.com/knet-go/knet/internal/netsim"
)

// Config.Simulate on a stream connection (TCP, WebSocket). TCP hides a
// lost segment from both ends and shows it as time: the segment comes
// once the sender learns of its loss (about a round trip later, or a
// retransmission timeout for a tail), and everything behind it waits. So what
// the connection writes goes through a netsim.Stream, which says when
// each byte reaches the peer, before it goes to the socket: a loss is a
// stall, a delay is a delay, a bandwidth cap makes the writer wait for
// the send buffer as a socket's does. What the peer writes is the peer's
// Simulate to shape.

// simulateStream returns nc with cfg's simulated network on what is
// written to it, or nc itself without one. The seed is salted as over
// UDP (endpoint.simulate): a dialed stream as a dialed UDP connection, a
// listener's streams each as one of its sockets, in the order it takes
// them, so that each has a path of its own and a run replays.
func simulateStream(ep *endpoint, nc net.Conn, cfg *config, client bool) net.Conn {
	if cfg.simulate == nil {
		return nc
	}
	p := cfg.simulate.params()
	salt := uint64(2)
	if l := ep.l; l != nil && !client {
		salt = 1 + 2*(l.simStreams.Add(1)-1)
	}
	p.Seed = p.Seed*0x9e3779b97f4a7c15 + salt
	s := &simConn{
		Conn:      nc,
		closeWait: cfg.disconnect,
		model:     netsim.NewStream(netsim.NewLink(p)),
		kick:      make(chan struct{}, 1),
		room:      make(chan struct{}, 1),
		shut:      make(chan struct{}),
		done:      make(chan struct{}),
	}
	go s.deliver()
	if _, ok := nc.(interface{ CloseWrite() error }); ok {
		return simTCPConn{s}
	}
	return s
}

// simConn is a stream whose writes cross a simulated network: Write
// hands the bytes to the model, as a socket takes them into its send
// buffer, and deliver writes them to the stream when the model says they
// arrive. Reads go straight to the stream.
type simConn struct {
	net.Conn
	closeWait time.Duration // how long Close lets the path deliver what it holds

	mu      sync.Mutex
	model   *netsim.Stream
	pend    []byte // pend[off:]: written, not yet arrived
	off     int
	handed  int64 // bytes written to the stream
	fin     bool  // CloseWrite: after every byte written before it
	closed  bool
	closeBy time.Time
	cut     *time.Timer // closes the stream at closeBy, should a write hang
	err     error       // the stream's write failed: the path is gone

	kick chan struct{} // to deliver: something changed
	room chan struct{} // to Write: the buffer may have room
	shut chan struct{} // closed by Close
	once sync.Once
	done chan struct{} // deliver returned
}

// simTCPConn is a simConn over a stream with a half-close (TCP's).
type simTCPConn struct{ *simConn }

// CloseWrite ends the stream's writing once every byte written before it
// has arrived: the FIN goes last.
func (s simTCPConn) CloseWrite() error {
	s.mu.Lock()
	s.fin = true
	s.mu.Unlock()
	signal(s.kick)
	return nil
}

// Write takes b into the simulated send buffer, waiting for room as a
// socket's writer does, and returns once all of it is taken.
func (s *simConn) Write(b []byte) (int, error) {
	n := 0
	for {
		s.mu.Lock()
		switch {
		case s.err != nil:
			err := s.err
			s.mu.Unlock()
			return n, err
		case s.closed || s.fin:
			s.mu.Unlock()
			return n, net.ErrClosed
		}
		k := 0
		if room := s.model.Capacity() - (len(s.pend) - s.off); room > 0 && n < len(b) {
			k = s.model.Write(time.Now(), min(len(b)-n, room))
			s.pend = append(s.pend, b[n:n+k]...)
			n += k
		}
		s.mu.Unlock()
		if k > 0 {
			signal(s.kick)
		}
		if n == len(b) {
			return n, nil
		}
		select {
		case <-s.room:
		case <-s.shut:
		}
	}
}

// Close lets the path deliver what it holds, for up to closeWait, then
// closes the stream; it returns at once (the connection's round calls
// it). A FIN goes after the last byte, as a socket's close sends it.
func (s *simConn) Close() error {
	s.mu.Lock()
	if !s.closed {
		s.closed = true
		s.closeBy = time.Now().Add(s.closeWait)
		s.cut = time.AfterFunc(s.closeWait, func() { s.Conn.Close() })
	}
	s.mu.Unlock()
	s.once.Do(func() { close(s.shut) })
	signal(s.kick)
	return nil
}

// deliver writes to the stream what the model says has arrived, in
// order, at most streamWriteMax at a time (a WebSocket message each);
// then the FIN, once CloseWrite asked for it; then, once closed, the
// stream's close.
func (s *simConn) deliver() {
	defer close(s.done)
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	buf := make([]byte, 0, streamWriteMax)
	finSent := false
	for {
		s.mu.Lock()
		now := time.Now()
		s.model.Advance(now)
		due := int(min(s.model.Delivered()-s.handed, streamWriteMax))
		buf = append(buf[:0], s.pend[s.off:s.off+due]...)
		s.off += due
		s.handed += int64(due)
		if s.off == len(s.pend) {
			s.pend, s.off = s.pend[:0], 0
		} else if s.off >= 64<<10 && s.off >= len(s.pend)/2 {
			s.pend = s.pend[:copy(s.pend, s.pend[s.off:])]
			s.off = 0
		}
		empty := s.off == len(s.pend)
		fin := s.fin && empty && !finSent
		failed, closed, closeBy := s.err != nil, s.closed, s.closeBy
		next := s.model.Next()
		s.mu.Unlock()
		signal(s.room)
		if len(buf) > 0 && !failed {
			if _, err := s.Conn.Write(buf); err != nil {
				s.mu.Lock()
				s.err = err
				s.mu.Unlock()
				signal(s.room)
				failed = true
			}
		}
		if fin && !failed {
			finSent = true
			s.Conn.(interface{ CloseWrite() error }).CloseWrite()
		}
		if closed && (empty || failed || !now.Before(closeBy)) {
			s.mu.Lock()
			s.cut.Stop()
			s.mu.Unlock()
			s.Conn.Close()
			return
		}
		if due == streamWriteMax && !failed {
			continue // more has arrived
		}
		wait := time.Hour
		if !next.IsZero() && !failed {
			wait = time.Until(next)
		}
		if closed {
			wait = min(wait, time.Until(closeBy))
		}
		t.Reset(max(wait, 0))
		select {
		case <-t.C:
		case <-s.kick:
		}
	}
}
