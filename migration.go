package knet

import (
	"crypto/rand"
	"net"
	"net/netip"
	"time"
)

// Migration (SECURE.md, "Migration"): a server's connection follows its
// client to a new address once the client proved it receives there.
//
// A sealed datagram from an address the listener does not know finds its
// connection by the connection ID it carries (Listener.routeByID). If it
// authenticates, its content is taken like any other; if it is also the
// newest (highest packet number yet), the connection checks the address:
// a PathChallenge, 8 random bytes in a sealed datagram, goes there, and
// the connection moves when a sealed PathResponse with those bytes comes
// back from there. Until then everything else still goes to the old
// address, and the new one gets no more than amplification times the
// bytes of authenticated datagrams it sent (QUIC's rule, RFC 9000 8.1).

// Checking a new address (the path messages themselves are in
// session_path.go).
const (
	// amplification bounds what an unproven address gets: this many times
	// what it sent.
	amplification = 3
	// A PathChallenge goes only when a datagram comes from the address
	// checked (the address is not chased on a timer), and waits for its
	// answer an RTO, then two, then four at most (challengeBackoff
	// doublings). There is no cap on their number: the amplification
	// limit bounds what the address gets, and a client whose challenges
	// were lost must not be stranded at an address its NAT forgot.
	challengeBackoff = 2
	// challengeSize is a sealed datagram holding a PathChallenge: header,
	// message block header, the MessageID, the content, the tag.
	challengeSize = minHeaderSize + 2 + 1 + 1 + pathDataSize + sealOverhead
)

// pathCheck is the check of one new address of the client.
type pathCheck struct {
	to        netip.AddrPort // the address being checked; zero if none
	challenge [pathDataSize]byte
	in, out   int // bytes received from it (authenticated) and sent to it
	sends     int
	sentAt    time.Time
}

// due reports whether a PathChallenge may go now: the last one long
// enough ago (an rto, doubling with each one up to challengeBackoff
// times), and the address sent enough to earn it.
func (pc *pathCheck) due(now time.Time, rto time.Duration) bool {
	if pc.sends > 0 && now.Sub(pc.sentAt) < rto<<min(pc.sends-1, challengeBackoff) {
		return false
	}
	return pc.out+challengeSize <= amplification*pc.in
}

// checkPath runs after a datagram of size bytes on the wire, from the
// address from, authenticated on a server's connection.
func (c *Conn) checkPath(now time.Time, from netip.AddrPort, size int) {
	s := c.sec
	pc := &s.path
	switch {
	case from == c.raddr:
		if s.newest {
			// The client is where it was (a copy of its datagram,
			// racing it from elsewhere, started the check).
			*pc = pathCheck{}
		}
		return
	case pc.to == from:
		pc.in += size
	case s.newest:
		*pc = pathCheck{to: from, in: size}
		rand.Read(pc.challenge[:])
	default:
		// Late from an old address, or a copy of an older datagram:
		// its content counts, the connection stays.
		return
	}
	c.challenge(now)
}

// challenge sends the address being checked a PathChallenge, when one is
// due and the amplification limit allows.
func (c *Conn) challenge(now time.Time) {
	pc := &c.sec.path
	if !pc.due(now, c.sess.rto()) {
		return
	}
	var content [1 + pathDataSize]byte
	content[0] = pathChallenge
	copy(content[1:], pc.challenge[:])
	buf := make([]byte, 0, challengeSize)
	b := c.sess.pathChallenge(buf, content[:])
	if b == nil {
		return // no new datagram may go now (session.spanFull)
	}
	out := c.sess.lastOut()
	b, err := c.sec.seal(b, b, out.pn, out.fresh)
	if err != nil {
		c.sess.fail(err)
		return
	}
	if len(b) != challengeSize {
		panic("knet: a PathChallenge of the wrong size")
	}
	c.ep.write(b, pc.to)
	pc.out += len(b)
	pc.sends++
	pc.sentAt = now
	c.sec.challenges.Add(1)
}

// pathAnswered takes the PathResponse the session heard in a datagram
// from the address from: the connection moves there if it answers the
// challenge sent there.
func (c *Conn) pathAnswered(from netip.AddrPort, data [pathDataSize]byte) {
	pc := &c.sec.path
	if pc.sends == 0 || from != pc.to || data != pc.challenge {
		return
	}
	c.moveTo(from)
	*pc = pathCheck{}
}

// moveTo makes to the connection's address: the endpoint routes it here
// and everything goes there.
func (c *Conn) moveTo(to netip.AddrPort) {
	c.takeAddr(to)
	if c.isEstablished() {
		c.sec.migrations++ // a move of a connection being made is no migration
	}
	c.sess.moved(time.Now())
	c.proven()
	if l := c.cfg.logger; l != nil {
		l.Info("knet: connection moved", "remote", to)
	}
}

// takeAddr makes to the connection's address: the endpoint routes it here
// and everything goes there. Another connection there is stale: the
// client proved it is here; one still being made (an attempt someone
// started from that address, which only the client could complete) ends.
func (c *Conn) takeAddr(to netip.AddrPort) {
	ep := c.ep
	ep.mu.Lock()
	if ep.conns[c.raddr] == c {
		delete(ep.conns, c.raddr)
	}
	old := ep.conns[to]
	ep.conns[to] = c
	c.raddr = to
	ep.mu.Unlock()
	c.remote.Store(net.UDPAddrFromAddrPort(to))
	if old != nil && old != c && old.sec != nil && !old.isEstablished() {
		old.shutdown()
	}
}

// Listener side.

// newCID registers c under a new connection ID and returns it: the
// listener's Config.ServerID, then random bytes (routing.go). It fails
// with errNoCID when every such ID is a live connection's.
func (l *Listener) newCID(c *Conn) (uint32, error) {
	l.cidMu.Lock()
	defer l.cidMu.Unlock()
	if l.cids == nil {
		l.cids = make(map[uint32]*Conn)
	}
	// Unpredictable (crypto/rand), though not a secret: it names the
	// connection whose keys a datagram must then authenticate under, and
	// a balancer routes on its leading bytes.
	id, ok := pickCID(l.cfg.serverID, func(id uint32) bool { return l.cids[id] != nil })
	if !ok {
		return 0, errNoCID
	}
	l.cids[id] = c
	return id, nil
}

// dropCID forgets c's connection ID.
func (l *Listener) dropCID(c *Conn) {
	if c.sec == nil || c.sec.cid == 0 {
		return
	}
	l.cidMu.Lock()
	if l.cids[c.sec.cid] == c {
		delete(l.cids, c.sec.cid)
	}
	l.cidMu.Unlock()
	l.dropSpares(c)
}

// routeByID hands a datagram from an address with no connection (or
// whose connection is not, unless nil) to the secure connection its
// connection ID names, and reports whether it did. The connection
// authenticates it; a clear ConnectSyn is never taken for one (it is a
// connection attempt).
func (l *Listener) routeByID(p *packet, not *Conn) bool {
	if l.cfg.privateKey == nil {
		return false
	}
	id, ok := sealedCID(p.b)
	if !ok {
		return false
	}
	l.cidMu.Lock()
	c := l.cids[id]
	l.cidMu.Unlock()
	if c == nil || c == not {
		return false
	}
	if syn, _ := isConnectSyn(p.b); syn {
		return false
	}
	c.push(p)
	return true
}
