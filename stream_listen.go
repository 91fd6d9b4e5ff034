package knet

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"time"
)

// Streams on a Listener (Config.TCP) and from Dial: kNet over TCP beside
// UDP, on the same port number.

// startTCP takes streams from ln, the listener's TCP socket on the port
// number of its UDP socket(s).
func (l *Listener) startTCP(ln *net.TCPListener) {
	l.tcp = ln
	go l.acceptTCP(ln)
}

// tcpNetwork is the TCP network of a UDP one.
func tcpNetwork(udp string) string {
	switch udp {
	case "udp4":
		return "tcp4"
	case "udp6":
		return "tcp6"
	}
	return "tcp"
}

// acceptTCP takes the TCP connections until the listener closes.
func (l *Listener) acceptTCP(ln *net.TCPListener) {
	var pause time.Duration
	for {
		nc, err := ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// Out of file descriptors, say: wait a moment, as
			// net/http does, rather than spin.
			pause = min(max(2*pause, 5*time.Millisecond), time.Second)
			select {
			case <-time.After(pause):
			case <-l.closed:
				return
			}
			continue
		}
		pause = 0
		nc.(*net.TCPConn).SetNoDelay(true)
		l.takeStream(nc, TransportTCP)
	}
}

// takeStream starts a connection over nc, a stream a client opened (TCP,
// or a WebSocket), if it may take a place among the pending attempts
// (Listener.enterLocked): others are closed at once, and counted ignored.
func (l *Listener) takeStream(nc net.Conn, tr Transport) {
	src := unmap(streamAddr(nc.RemoteAddr()))
	l.mu.Lock()
	// A closed listener (SetListenOpen, StopAdmitting, Drain) still
	// takes the stream, to tell a knet client why it refuses it.
	var t ticket
	ok := l.streams != nil && l.enterLocked(src.Addr(), &t)
	if !ok && l.streams != nil && !l.closing {
		// The oldest stream that has said nothing, of this source or
		// (the listener full) of any, gives way (evictSilentLocked).
		full := l.attempts >= l.cfg.maxPending
		if l.evictSilentLocked(sourceOf(src.Addr()), full) {
			l.eps[0].ignored.Add(1)
			ok = l.enterLocked(src.Addr(), &t)
		}
	}
	if !ok {
		l.mu.Unlock()
		l.eps[0].ignored.Add(1)
		nc.Close()
		return
	}
	c := newStreamConn(l.eps[0], nc, tr, l.cfg, false)
	c.ticket = t
	l.silentLocked(c)
	if l.draining.Load() {
		// Only to be told why: it need not wait for long.
		c.st.deadline = time.Now().Add(min(l.cfg.connectTimeout, l.cfg.disconnect))
	}
	l.pending[c] = true
	l.streams[c] = false
	l.loops.Add(1) // Done in Conn.end
	l.mu.Unlock()
	c.startStream()
}

// streamEnded forgets c, a stream connection that ended.
func (l *Listener) streamEnded(c *Conn) {
	l.mu.Lock()
	delete(l.streams, c)
	l.mu.Unlock()
}

// streamConns returns the listener's stream connections, established
// ones only if est.
func (l *Listener) streamConns(est bool) []*Conn {
	l.mu.Lock()
	defer l.mu.Unlock()
	var cs []*Conn
	for c, e := range l.streams {
		if e || !est {
			cs = append(cs, c)
		}
	}
	return cs
}

// closeTCP stops accepting streams.
func (l *Listener) closeTCP() {
	if l.tcp != nil {
		l.tcp.Close()
	}
}

// newStreamEndpoint is a dialed stream connection's endpoint: no socket,
// only the scheduler that runs its rounds.
func newStreamEndpoint(cfg *config, o *endpointOptions) *endpoint {
	ep := &endpoint{
		connected:  true,
		cfg:        cfg,
		parkAfter:  o.parkAfter,
		parkHook:   o.parkHook,
		conns:      make(map[netip.AddrPort]*Conn),
		readerDone: make(chan struct{}),
	}
	close(ep.readerDone)
	if ep.parkAfter <= 0 {
		ep.parkAfter = defaultParkAfter
	}
	ep.sched.init(ep, workersFor(false))
	ep.pool = packetPool(max(cfg.readSize(), 2048) + 1)
	return ep
}

// dialTCP connects to a kNet server over TCP.
func dialTCP(ctx context.Context, network, address string, rc *config, o *endpointOptions) (*Conn, error) {
	var d net.Dialer
	nc, err := d.DialContext(ctx, network, address)
	if err != nil {
		return nil, err
	}
	nc.(*net.TCPConn).SetNoDelay(true)
	return dialStream(ctx, nc, TransportTCP, rc, o)
}

// dialStream runs a client connection over nc, and returns it once it is
// established.
func dialStream(ctx context.Context, nc net.Conn, tr Transport, rc *config, o *endpointOptions) (*Conn, error) {
	ep := newStreamEndpoint(rc, o)
	c := newStreamConn(ep, nc, tr, rc, true)
	c.startStream()
	return awaitDialed(ctx, c, rc)
}

// fallbackDelay is how long Dial with Config.FallbackTCP waits for an
// answer over UDP before it tries TCP as well: RFC 8305's Connection
// Attempt Delay. A server that answers UDP does so within a round trip,
// under 250 ms on nearly every path; a network that blocks UDP never
// does, and then TCP's own handshake and knet's hello follow.
const fallbackDelay = 250 * time.Millisecond

// dialFallback races UDP and, from fallbackDelay on (or at once if UDP
// fails first), TCP to the same address; the first connection
// established wins and the other attempt is abandoned.
func dialFallback(ctx context.Context, network, address string, rc *config, o *endpointOptions) (*Conn, error) {
	ctx, cancel := context.WithCancel(ctx)
	type result struct {
		c   *Conn
		err error
	}
	results := make(chan result, 2)
	attempts := 1
	go func() {
		c, err := dialUDP(ctx, network, address, rc, o)
		results <- result{c, err}
	}()
	tcpStarted := false
	startTCP := func() {
		tcpStarted = true
		attempts++
		go func() {
			c, err := dialTCP(ctx, tcpNetwork(network), address, rc, o)
			results <- result{c, err}
		}()
	}
	timer := time.NewTimer(fallbackDelay)
	defer timer.Stop()
	var errs []error
	for attempts > 0 {
		select {
		case <-timer.C:
			if !tcpStarted {
				startTCP()
			}
		case r := <-results:
			attempts--
			if r.err == nil {
				cancel()
				if attempts > 0 {
					go func() {
						// The other attempt, should it win too.
						if r := <-results; r.c != nil {
							r.c.Close()
						}
					}()
				}
				return r.c, nil
			}
			errs = append(errs, r.err)
			if !tcpStarted && ctx.Err() == nil {
				startTCP()
			}
		}
	}
	cancel()
	return nil, fmt.Errorf("knet: dial %s %q over UDP and TCP: %w", network, address, errors.Join(errs...))
}
