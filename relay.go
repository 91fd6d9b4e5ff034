package knet

import (
	"cmp"
	"context"
	"crypto/rand"
	"crypto/subtle"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"
)

// The relay (issue 35): when no probe gets through (two symmetric NATs,
// say), the joiner connects through a knet relay, and both sides keep
// trying direct paths; a secure connection moves to one that works, in
// place, by the migration machinery (migration.go).
//
// Each pairing gets an allocation: a UDP port of its own on the relay,
// that both sides send to. The relay forwards what comes from one side's
// proven address to the other's, as it came: a sealed datagram stays
// sealed, since the relay holds no key. A port per allocation, rather
// than an envelope around each datagram, keeps the host's connection a
// normal knet connection: its Listener sees the joiner at the relay's
// port, a peer like any other (admitted, routed by address or connection
// ID, migrated), datagrams keep their size (no envelope eats into the
// path's MTU), and plaintext sessions, which carry no connection ID,
// are relayed as well as secure ones. The price is a socket (and a
// reading goroutine) per allocation, bounded by RelayConfig.MaxAllocations
// and by expiry.
//
// A side proves its address on the allocation's port before anything is
// forwarded to it or from it: it sends a bind with its side's token
// (which the introducer told it alone), the relay answers with a cookie
// bound to the address it came from (no larger than the bind), and the
// side echoes the cookie. Two more kinds of the server query's datagram
// (query.go); docs/PROTOCOL.md section 8.3 has the layout:
//
//	kind 9, bind:   u8 cookie length (0 or 24), the cookie, the 16-byte
//	                side token; padded to 1200 bytes
//	kind 10, bound: u8 status (0 bound, 1 prove: the cookie follows,
//	                2 refused)
//
// Every answer of the relay goes through the rules of every answer to an
// address without a connection (Listener.mayAnswerUnconnected).

const (
	relayKindBind  = 9
	relayKindBound = 10

	// The statuses of a bind's answer.
	relayBound   = 0
	relayProve   = 1
	relayRefused = 2

	// relayTokenSize is a side's token: 128 random bits.
	relayTokenSize = 16

	// relayBindTTL is how long an allocation waits for its sides to
	// bind, and relayBindResend how often a side asks again.
	relayBindTTL    = 10 * time.Second
	relayBindResend = 100 * time.Millisecond
	// relayBindTimeout is how long a joiner waits for the relay's answer.
	relayBindTimeout = 3 * time.Second

	// While relayed, both sides keep probing the direct path: a round
	// every relayRetryInterval, relayRetryRounds rounds (a minute).
	relayRetryInterval = 500 * time.Millisecond
	relayRetryRounds   = 120

	// relayMaxDatagram is the largest datagram a relay forwards (a
	// larger one is dropped and counted): knet's datagrams are at most
	// MaxPathDatagramSize, 1400 bytes unless raised.
	relayMaxDatagram = 8192
)

// ErrRelayRefused is DialCandidates' error when no direct path was found
// and the relay offered refused the connection: it had no room for
// another allocation, or the allocation had expired or was another
// address's.
var ErrRelayRefused = errors.New("knet: the relay refused the connection")

// ErrNoIntroducer is Listener.Host's and Join's error when the introducer
// never answered (nothing listens there, or it does not serve
// introductions, or the path to it drops everything).
var ErrNoIntroducer = errors.New("knet: the introducer did not answer")

// RelayConfig is what a relay allows (Listener.ServeRelay). Zero fields
// take the defaults.
type RelayConfig struct {
	// MaxAllocations is how many allocations (each a pairing of a host
	// and a joiner, and a UDP socket) the relay holds at once; an
	// introduction past it tells both sides the relay is full. Default 256.
	MaxAllocations int
	// MaxAllocationsPerSource is how many of them the introductions of
	// one joiner's source (an IPv4 address, an IPv6 /64) hold at once;
	// an introduction past it tells both sides the relay is full, so
	// that a few addresses cannot take every allocation. Those of
	// AllocateRelay, the application's own, are not counted. Default 16.
	MaxAllocationsPerSource int
	// ConnBytesPerSecond is what one allocation forwards, both ways
	// together, in bursts of a second's worth. Default 256 KiB/s.
	ConnBytesPerSecond int
	// BytesPerSecond is what the relay forwards in all, in bursts of a
	// second's worth. Default 16 MiB/s.
	BytesPerSecond int
	// IdleTimeout is how long an allocation lives with nothing to
	// forward. Default 30 s. One whose sides did not both bind within
	// 10 s ends then. A side silent this long gets nothing more: one
	// side's datagrams alone neither reach a side that left nor keep the
	// allocation alive.
	IdleTimeout time.Duration
}

func (c RelayConfig) withDefaults() RelayConfig {
	if c.MaxAllocations <= 0 {
		c.MaxAllocations = 256
	}
	if c.MaxAllocationsPerSource <= 0 {
		c.MaxAllocationsPerSource = 16
	}
	if c.ConnBytesPerSecond <= 0 {
		c.ConnBytesPerSecond = 256 << 10
	}
	if c.BytesPerSecond <= 0 {
		c.BytesPerSecond = 16 << 20
	}
	if c.IdleTimeout <= 0 {
		c.IdleTimeout = 30 * time.Second
	}
	return c
}

// Route is the path a connection's datagrams take: straight to the peer
// (through its NAT), or through a relay.
type Route uint8

const (
	RouteDirect Route = iota
	RouteRelayed
)

func (r Route) String() string {
	if r == RouteRelayed {
		return "relayed"
	}
	return "direct"
}

// Route reports whether the connection runs through a relay now: one the
// joiner dialed through (DialCandidates) or, on the host's Listener, one
// its Punch bound to. A secure connection that moved to a direct path
// reports RouteDirect from then on.
func (c *Conn) Route() Route {
	remote := c.remote.Load()
	if remote == nil {
		return RouteDirect
	}
	at := unmap(remote.AddrPort())
	if r := c.ep.relay.Load(); r != nil && r.via == at {
		return RouteRelayed
	}
	if l := c.ep.l; l != nil && l.relayUse.isRelay(at) {
		return RouteRelayed
	}
	return RouteDirect
}

// relayRoute is a relayed joiner's connection's (on its endpoint): the
// relay's address, and, while
// the joiner tries direct paths, the token of its probes and the
// address a probe's answer came from (set by the socket's reader, taken
// by the round).
type relayRoute struct {
	via   netip.AddrPort
	token [8]byte
	peers []netip.AddrPort // the host's candidates: an answer counts from their addresses only
	retry bool             // the joiner's probes run: the reader looks for answers (ep.mu)
	found atomic.Pointer[netip.AddrPort]
	// The round's: the joiner sends to a probe's answerer and waits for
	// an authenticated datagram from there since triedAt (takeDirect).
	trying  bool
	triedAt time.Time
}

// relayServer is a Listener's relay role (ServeRelay).
type relayServer struct {
	on      atomic.Bool
	listen  func(network string, laddr *net.UDPAddr) (*net.UDPConn, error) // tests: a socket in a namespace
	bindTTL time.Duration                                                  // tests: relayBindTTL if 0

	mu     sync.Mutex
	cfg    RelayConfig
	allocs map[*relayAlloc]struct{}
	global tokenBucket

	allocated, refused, forwarded, forwardedBytes, limited, dropped, answered atomic.Uint64
}

// relayUse is a host Listener's: the relays its Punch calls bound to,
// while they wait for the joiner, and the binds waiting for an answer.
type relayUse struct {
	mu    sync.Mutex
	peers map[netip.AddrPort]int // a count of the Punch calls bound there
	binds map[[queryNonceSize]byte]*relayWaitBind
}

type relayWaitBind struct {
	relay netip.AddrPort
	got   chan []byte
}

func (u *relayUse) isRelay(a netip.AddrPort) bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.peers[a] > 0
}

// tokenBucket counts bytes: rate a second, in bursts of a second's worth.
type tokenBucket struct {
	rate   float64
	tokens float64
	last   time.Time
}

func (b *tokenBucket) init(rate int, now time.Time) {
	b.rate, b.tokens, b.last = float64(rate), float64(rate), now
}

// take reports whether n bytes may go now, and takes them if so.
func (b *tokenBucket) take(n int, now time.Time) bool {
	if d := now.Sub(b.last); d > 0 {
		b.tokens = min(b.rate, b.tokens+b.rate*d.Seconds())
		b.last = now
	}
	if b.tokens < float64(n) {
		return false
	}
	b.tokens -= float64(n)
	return true
}

// ServeRelay makes the Listener a relay: the introductions it serves
// (ServeIntroductions) offer both sides an allocation on it, which the
// joiner connects through if no direct path is found. It forwards only
// between two addresses that proved themselves with their side's token,
// within cfg's limits, and cannot read what it forwards.
func (l *Listener) ServeRelay(cfg RelayConfig) {
	r := &l.relay
	r.mu.Lock()
	r.cfg = cfg.withDefaults()
	r.global.init(r.cfg.BytesPerSecond, time.Now())
	r.mu.Unlock()
	l.punch.jar.CompareAndSwap(nil, newCookieJar())
	r.on.Store(true)
}

// RelayTicket is one side's part of a relay allocation: where to send,
// and the token that proves the side.
type RelayTicket struct {
	Relay netip.AddrPort
	Token [relayTokenSize]byte
}

// AllocateRelay makes a relay allocation for a pairing that a game's own
// signalling (Signal) makes: the host's ticket and the joiner's, to put
// in their Introductions (Relay, RelayToken). at is the relay's address
// as the sides reach it (its port is replaced by the allocation's). It
// fails with ErrRelayRefused when the relay is full or not serving.
func (l *Listener) AllocateRelay(at netip.Addr) (host, join RelayTicket, err error) {
	a, err := l.allocate(netip.Addr{})
	if err != nil {
		return host, join, err
	}
	to := netip.AddrPortFrom(at, a.port)
	return RelayTicket{to, a.tokens[0]}, RelayTicket{to, a.tokens[1]}, nil
}

// relayAlloc is one allocation: its socket, the two sides' tokens (0
// host, 1 joiner) and proven addresses, and its own bucket. The fields
// after tokens are its reader's.
type relayAlloc struct {
	l      *Listener
	pc     *net.UDPConn
	port   uint16
	tokens [2][relayTokenSize]byte

	// src holds the place of the joiner's source (takeRelay), for an
	// introduction's allocation; paired: both sides bound.
	src    relayPlace
	paired atomic.Bool

	addrs  [2]netip.AddrPort
	heard  [2]time.Time // when each side last sent (its bind or a datagram)
	bucket tokenBucket
}

// allocate opens an allocation, or fails with ErrRelayRefused: for an
// introduction whose joiner is at src, or for the application (src not
// valid).
func (l *Listener) allocate(src netip.Addr) (*relayAlloc, error) {
	r := &l.relay
	if !r.on.Load() {
		return nil, fmt.Errorf("knet: not a relay: %w", ErrRelayRefused)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.allocs) >= r.cfg.MaxAllocations {
		r.refused.Add(1)
		return nil, fmt.Errorf("knet: the relay holds %d allocations: %w", len(r.allocs), ErrRelayRefused)
	}
	var place relayPlace
	if src.IsValid() && !l.takeRelay(src, r.cfg.MaxAllocationsPerSource, &place) {
		r.refused.Add(1)
		return nil, fmt.Errorf("knet: the relay holds %d allocations for %v: %w", r.cfg.MaxAllocationsPerSource, src, ErrRelayRefused)
	}
	laddr, _ := addrPortOf(l.Addr())
	network := "udp"
	if laddr.Addr().Unmap().Is4() {
		network = "udp4"
	}
	listen := r.listen
	if listen == nil {
		listen = net.ListenUDP
	}
	pc, err := listen(network, net.UDPAddrFromAddrPort(netip.AddrPortFrom(laddr.Addr(), 0)))
	if err != nil {
		l.leaveRelay(&place)
		r.refused.Add(1)
		return nil, fmt.Errorf("knet: relay socket: %v: %w", err, ErrRelayRefused)
	}
	a := &relayAlloc{l: l, pc: pc, port: uint16(pc.LocalAddr().(*net.UDPAddr).Port), src: place}
	rand.Read(a.tokens[0][:])
	rand.Read(a.tokens[1][:])
	a.bucket.init(r.cfg.ConnBytesPerSecond, time.Now())
	if r.allocs == nil {
		r.allocs = make(map[*relayAlloc]struct{})
	}
	r.allocs[a] = struct{}{}
	r.allocated.Add(1)
	go a.run(cmp.Or(r.bindTTL, relayBindTTL), r.cfg.IdleTimeout)
	return a, nil
}

// closeRelay ends every allocation (Listener.Close).
func (l *Listener) closeRelay() {
	r := &l.relay
	r.mu.Lock()
	for a := range r.allocs {
		a.pc.Close()
	}
	r.mu.Unlock()
}

// relayAllocations is how many allocations the relay holds.
func (l *Listener) relayAllocations() int {
	l.relay.mu.Lock()
	defer l.relay.mu.Unlock()
	return len(l.relay.allocs)
}

// run reads the allocation's socket until it is idle too long (or its
// sides did not bind within bindTTL) or closed.
func (a *relayAlloc) run(bindTTL, idle time.Duration) {
	r := &a.l.relay
	defer func() {
		a.pc.Close()
		r.mu.Lock()
		delete(r.allocs, a)
		r.mu.Unlock()
		a.l.leaveRelay(&a.src)
	}()
	buf := make([]byte, relayMaxDatagram+1)
	deadline := time.Now().Add(bindTTL)
	for {
		a.pc.SetReadDeadline(deadline)
		n, from, err := a.pc.ReadFromUDPAddrPort(buf)
		if err != nil {
			var ne net.Error
			if errors.Is(err, net.ErrClosed) || errors.As(err, &ne) && ne.Timeout() {
				return
			}
			continue // an ICMP error of a side gone
		}
		from = unmap(from)
		if n > relayMaxDatagram {
			r.dropped.Add(1) // larger than any knet datagram: cut short
			continue
		}
		b := buf[:n]
		now := time.Now()
		if kind, nonce, body, ok := parseQueryDatagram(b); ok && kind == relayKindBind {
			// A bind keeps the allocation alive only while both sides
			// are heard: one side alone does not hold it.
			if a.bind(from, n, &nonce, body, now) && a.addrs[0].IsValid() && a.addrs[1].IsValid() {
				a.paired.Store(true)
				if now.Sub(a.heard[0]) < idle && now.Sub(a.heard[1]) < idle {
					deadline = now.Add(idle)
				}
			}
			continue
		}
		side := a.sideOf(from)
		if side < 0 || !a.addrs[1-side].IsValid() {
			// From an address not proven, or before the other side is:
			// nothing goes anywhere.
			r.dropped.Add(1)
			continue
		}
		a.heard[side] = now
		if now.Sub(a.heard[1-side]) >= idle {
			// The other side fell silent: it consents to nothing more
			// (it left, and its address may be someone else's now), and
			// one side alone does not keep the allocation alive.
			r.dropped.Add(1)
			continue
		}
		if !a.bucket.take(n, now) || !r.takeGlobal(n, now) {
			r.limited.Add(1)
			continue
		}
		// Counted before it goes, so that whoever reads it finds it
		// counted.
		r.forwarded.Add(1)
		r.forwardedBytes.Add(uint64(n))
		a.pc.WriteToUDPAddrPort(b, a.addrs[1-side])
		deadline = now.Add(idle)
	}
}

// release ends an introduction's allocation whose sides have not both
// bound, when the introducer replaced its joiner: nothing will use it.
// Its places are given back at once (run gives them back again on its
// way out, which does nothing more).
func (a *relayAlloc) release() {
	if a.paired.Load() {
		return
	}
	a.pc.Close()
	r := &a.l.relay
	r.mu.Lock()
	delete(r.allocs, a)
	r.mu.Unlock()
	a.l.leaveRelay(&a.src)
}

func (r *relayServer) takeGlobal(n int, now time.Time) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.global.take(n, now)
}

func (a *relayAlloc) sideOf(from netip.AddrPort) int {
	for i, at := range a.addrs {
		if at == from {
			return i
		}
	}
	return -1
}

// relayCookieAD is what a relay's cookies are made for.
var relayCookieAD = []byte("knet relay bind")

// bind answers a bind from from (in bytes on the wire), and reports
// whether it bound a side (or found it bound there already).
func (a *relayAlloc) bind(from netip.AddrPort, in int, nonce *[queryNonceSize]byte, body []byte, now time.Time) bool {
	r := &a.l.relay
	cookie, token, ok := parseRelayBind(body)
	if !ok || in < queryPadTo {
		r.dropped.Add(1)
		return false
	}
	jar := a.l.punch.jar.Load()
	var status byte
	var ans []byte
	bound := false
	switch {
	case !jar.check(cookie, from, relayCookieAD, now):
		// Not proven: a cookie to echo, whatever the token, and nothing
		// else.
		ans = jar.appendCookie([]byte{relayProve}, from, relayCookieAD, now)
	default:
		status = relayRefused
		for i := range a.tokens {
			if subtle.ConstantTimeCompare(token, a.tokens[i][:]) != 1 {
				continue
			}
			if !a.addrs[i].IsValid() || a.addrs[i] == from {
				// The first proven address of a side keeps it: a token
				// replayed from elsewhere is refused, so that no one
				// who learned it can take the side's traffic.
				a.addrs[i], status, bound = from, relayBound, true
				a.heard[i] = now
			}
		}
		if status == relayRefused {
			r.refused.Add(1)
		}
		ans = []byte{status}
	}
	d := appendQueryDatagram(nil, relayKindBound, nonce, ans, 0)
	if a.l.mayAnswerUnconnected(from, in, len(d)) {
		r.answered.Add(1) // before it goes, as forwarded datagrams
		a.pc.WriteToUDPAddrPort(d, from)
	} else {
		r.dropped.Add(1)
	}
	return bound
}

func appendRelayBind(b, cookie, token []byte) []byte {
	b = append(b, byte(len(cookie)))
	b = append(b, cookie...)
	return append(b, token...)
}

func parseRelayBind(b []byte) (cookie, token []byte, ok bool) {
	if len(b) < 1 || (b[0] != 0 && b[0] != cookieSize) || len(b) < 1+int(b[0])+relayTokenSize {
		return nil, nil, false
	}
	cookie = b[1 : 1+b[0]]
	return cookie, b[1+b[0] : 1+int(b[0])+relayTokenSize], true
}

// The relay's part of an introduction (kind 8, status 1): after the
// candidates, u16 the allocation's port (0: the relay is full), then the
// side's token. The relay is at the introducer's address.
func appendIntroRelay(b []byte, port uint16, token *[relayTokenSize]byte) []byte {
	b = append(b, byte(port>>8), byte(port))
	return append(b, token[:]...)
}

// parseIntroRelay reads the relay's part after an introduction's
// candidates, if any, into in.
func parseIntroRelay(rest []byte, introducer netip.AddrPort, in *Introduction) {
	if len(rest) < 2+relayTokenSize {
		return
	}
	in.Relay = netip.AddrPortFrom(introducer.Addr(), uint16(rest[0])<<8|uint16(rest[1]))
	copy(in.RelayToken[:], rest[2:])
}

// candidatesLen is the size of the candidates parseCandidates read from b.
func candidatesLen(b []byte) int {
	if len(b) < 1 {
		return 0
	}
	n, off := int(b[0]), 1
	for range n {
		if off >= len(b) {
			return len(b)
		}
		if b[off] == 6 {
			off += 1 + 16 + 2
		} else {
			off += 1 + 4 + 2
		}
	}
	return min(off, len(b))
}

// bindRelay proves the joiner's socket pc to the relay in in (its side's
// token), and returns once the relay bound it.
func bindRelay(ctx context.Context, pc net.PacketConn, in Introduction) error {
	if in.Relay.Port() == 0 {
		return fmt.Errorf("knet: relay %v had no room: %w", in.Relay.Addr(), ErrRelayRefused)
	}
	ctx, cancel := context.WithTimeout(ctx, relayBindTimeout)
	defer cancel()
	var nonce [queryNonceSize]byte
	rand.Read(nonce[:])
	ask := appendQueryDatagram(nil, relayKindBind, &nonce, appendRelayBind(nil, nil, in.RelayToken[:]), queryPadTo)
	refused := false
	err := askOver(ctx, pc, in.Relay, &ask, func(kind byte, got *[queryNonceSize]byte, body []byte) int {
		if kind != relayKindBound || *got != nonce || len(body) < 1 {
			return askIgnore
		}
		switch body[0] {
		case relayProve:
			ask = appendQueryDatagram(ask[:0], relayKindBind, &nonce, appendRelayBind(nil, body[1:min(len(body), 1+cookieSize)], in.RelayToken[:]), queryPadTo)
			return askAgain
		case relayBound:
			return askDone
		case relayRefused:
			refused = true
			return askDone
		}
		return askIgnore
	})
	switch {
	case refused:
		return fmt.Errorf("knet: relay %v: %w", in.Relay, ErrRelayRefused)
	case err != nil && ctx.Err() != nil:
		return fmt.Errorf("knet: relay %v: %w", in.Relay, &TimeoutError{Silent: relayBindTimeout, Op: "relay"})
	}
	return err
}

// dialRelayed connects over pc through the relay in in, after no direct
// path was found, and for a secure connection keeps probing the host's
// candidates from the connection's socket: the first that answers
// becomes the connection's path (takeDirect).
func dialRelayed(ctx context.Context, pc net.PacketConn, in Introduction, cfg *Config) (*Conn, error) {
	if err := bindRelay(ctx, pc, in); err != nil {
		pc.Close()
		return nil, err
	}
	c, err := DialPacket(ctx, pc, in.Relay.String(), cfg)
	if err != nil {
		return nil, err
	}
	r := &relayRoute{via: in.Relay, token: in.Token, peers: in.Peer, retry: c.sec != nil}
	c.ep.relay.Store(r)
	if r.retry {
		go c.retryDirect(in)
	}
	return c, nil
}

// retryDirect sends the host's candidates a padded probe every
// relayRetryInterval, while the connection runs through the relay, for
// relayRetryRounds rounds at most.
func (c *Conn) retryDirect(in Introduction) {
	probe := appendQueryDatagram(nil, punchKindProbe, &in.Token, nil, queryPadTo)
	t := time.NewTimer(relayRetryInterval + in.relayFirst)
	defer t.Stop()
	for range relayRetryRounds {
		select {
		case <-t.C:
		case <-c.closed:
			return
		case <-c.done:
			return
		}
		if c.Route() == RouteDirect {
			return
		}
		for _, p := range in.Peer {
			c.ep.write(probe, p)
		}
		t.Reset(relayRetryInterval)
	}
}

// directAnswer is the dialed endpoint's reader's: a datagram from an
// address with no connection, which may be the host's answer to a
// relayed connection's probe. It reports whether it was (ep.mu held).
func (ep *endpoint) directAnswer(from netip.AddrPort, b []byte) bool {
	r := ep.relay.Load()
	if r == nil || !r.retry {
		return false
	}
	c := ep.conns[r.via]
	if c == nil {
		return false
	}
	kind, token, _, ok := parseQueryDatagram(b)
	if !ok || (kind != punchKindAnswer && kind != punchKindProbe) || token != r.token || !r.fromHost(from) {
		return false
	}
	if r.found.CompareAndSwap(nil, &from) {
		c.kick()
	}
	return true
}

// fromHost reports whether from is at one of the host's candidates'
// addresses (its port may be another, which the host's NAT chose).
func (r *relayRoute) fromHost(from netip.AddrPort) bool {
	for _, p := range r.peers {
		if p.Addr() == from.Addr() {
			return true
		}
	}
	return false
}

// takeDirect runs in the round: once a probe's answer came from the
// host's address from, the connection sends there, and the host's
// Listener, which hears a sealed datagram of the connection from a new
// address, checks the path and moves the connection too (migration.go).
// The relay's address stays the connection's on the endpoint, so that
// what the host sent before it moved is taken as it arrives.
//
// The answer is clear, and its token is in every probe: anyone who saw
// one can send it from the host's address. So the move holds only once
// an authenticated datagram came from the new address (directConfirmed:
// the host's PathChallenge, say); if none came within keyDropPTOs
// retransmission timeouts (at least relayRetryInterval), the connection
// goes back to the relay for good (directFailed).
func (c *Conn) takeDirect(now time.Time) {
	r := c.ep.relay.Load()
	if r == nil || !r.retry {
		return
	}
	if r.trying {
		if now.Sub(r.triedAt) >= max(keyDropPTOs*c.sess.rto(), relayRetryInterval) {
			c.directFailed(now, r)
		}
		return
	}
	to := r.found.Swap(nil)
	if to == nil || *to == c.raddr {
		return
	}
	ep := c.ep
	ep.mu.Lock()
	ep.conns[*to] = c
	c.raddr = *to
	ep.mu.Unlock()
	c.remote.Store(net.UDPAddrFromAddrPort(*to))
	// The host's retries may stop: the joiner's word, as in probing.
	found := appendQueryDatagram(nil, punchKindAnswer, &r.token, nil, 0)
	for range 2 {
		ep.write(found, *to)
	}
	c.sess.moved(now)
	// A fresh datagram (a ping) goes now, whatever else is to send: it
	// starts the host's check of the new path; resends, which keep their
	// packet numbers, cannot (Conn.checkPath).
	c.sess.live.nextPing = now
	r.trying, r.triedAt = true, now
}

// directConfirmed takes an authenticated datagram from the joiner's peer
// address: the direct path being tried, if one is, holds.
func (c *Conn) directConfirmed() {
	r := c.ep.relay.Load()
	if r == nil || !r.trying {
		return
	}
	r.trying = false
	c.sec.migrations++
	if l := c.cfg.logger; l != nil {
		l.Info("knet: relayed connection went direct", "remote", c.raddr)
	}
}

// directFailed sends through the relay again, when nothing authenticated
// came from the direct path tried, and takes no more answers.
func (c *Conn) directFailed(now time.Time, r *relayRoute) {
	ep := c.ep
	ep.mu.Lock()
	if ep.conns[c.raddr] == c {
		delete(ep.conns, c.raddr)
	}
	ep.conns[r.via] = c
	c.raddr = r.via
	r.retry, r.trying = false, false
	ep.mu.Unlock()
	c.remote.Store(net.UDPAddrFromAddrPort(r.via))
	c.sess.moved(now)
	c.sess.live.nextPing = now
	if l := c.cfg.logger; l != nil {
		l.Info("knet: relayed connection's direct path never answered: relayed again", "relay", r.via)
	}
}

// relayHost is a host's part in a relayed connection: from its Punch's
// start it binds its Listener's socket to the relay in in, again every
// relayBindResend until bound, then every second while no connection is
// at the relay's address, for relayBindTTL at most, and no more once the
// joiner said it found a direct path (punched); the relay counts as
// such for Route until the connection there ends or moves. A secure
// Listener then keeps the token of in (answering the joiner's probes)
// and probes the joiner's candidates every relayRetryInterval, for
// relayRetryRounds rounds, until the joiner says it found a path (an
// answer with the token) or the connection is gone from the relay.
func (l *Listener) relayHost(in Introduction, punched <-chan bool) {
	u := &l.relayUse
	var nonce [queryNonceSize]byte
	rand.Read(nonce[:])
	w := &relayWaitBind{relay: in.Relay, got: make(chan []byte, 4)}
	u.mu.Lock()
	if u.binds == nil {
		u.binds = make(map[[queryNonceSize]byte]*relayWaitBind)
		u.peers = make(map[netip.AddrPort]int)
	}
	u.binds[nonce] = w
	u.peers[in.Relay]++
	u.mu.Unlock()
	defer func() {
		u.mu.Lock()
		delete(u.binds, nonce)
		if u.peers[in.Relay]--; u.peers[in.Relay] <= 0 {
			delete(u.peers, in.Relay)
		}
		u.mu.Unlock()
	}()
	ep := l.eps[0]
	ask := appendQueryDatagram(nil, relayKindBind, &nonce, appendRelayBind(nil, nil, in.RelayToken[:]), queryPadTo)
	t := time.NewTimer(0)
	defer t.Stop()
	bound, over := false, false
	end := time.Now().Add(relayBindTTL)
	// Binding, until a connection is at the relay, or the joiner found a
	// direct path.
	for l.connAt(in.Relay) == nil {
		if time.Now().After(end) {
			return
		}
		select {
		case direct := <-punched:
			if direct {
				return
			}
			over = true
			punched = nil // Punch is over: keep binding for the joiner's connection
		case b := <-w.got:
			switch b[0] {
			case relayProve:
				ask = appendQueryDatagram(ask[:0], relayKindBind, &nonce, appendRelayBind(nil, b[1:min(len(b), 1+cookieSize)], in.RelayToken[:]), queryPadTo)
				ep.write(ask, in.Relay)
			case relayBound:
				bound = true
			case relayRefused:
				return
			}
		case <-t.C:
			ep.write(ask, in.Relay)
			if bound {
				t.Reset(time.Second)
			} else {
				t.Reset(relayBindResend)
			}
		case <-l.closed:
			return
		}
	}
	c := l.connAt(in.Relay)
	// The relay counts as such for Route while the connection lives
	// (the deferred removal from peers waits for this one).
	defer func() {
		select {
		case <-c.done:
		case <-l.closed:
		}
	}()
	if l.cfg.privateKey == nil {
		return // a plaintext connection stays relayed: it cannot move
	}
	// Punch is over (the joiner's word stops it), then the retries.
	if !over {
		select {
		case direct := <-punched:
			if direct {
				return
			}
		case <-l.closed:
			return
		}
	}
	seen := make(chan struct{}, 1)
	l.punch.mu.Lock()
	if l.punch.tokens == nil {
		l.punch.tokens = make(map[[8]byte]chan struct{})
	}
	l.punch.tokens[in.Token] = seen
	l.punch.recount()
	l.punch.mu.Unlock()
	defer func() {
		l.punch.mu.Lock()
		if l.punch.tokens[in.Token] == seen {
			delete(l.punch.tokens, in.Token)
		}
		l.punch.recount()
		l.punch.mu.Unlock()
	}()
	probe := appendQueryDatagram(nil, punchKindProbe, &in.Token, nil, 0)
	t.Reset(in.relayFirst)
	for range relayRetryRounds {
		select {
		case <-t.C:
		case <-seen:
			return
		case <-c.done:
			return
		case <-l.closed:
			return
		}
		if c.Route() == RouteDirect {
			return
		}
		for _, p := range in.Peer {
			ep.write(probe, p)
		}
		t.Reset(relayRetryInterval)
	}
}

// connAt is the connection at addr on the Listener's first socket.
func (l *Listener) connAt(addr netip.AddrPort) *Conn {
	ep := l.eps[0]
	ep.mu.Lock()
	defer ep.mu.Unlock()
	return ep.conns[addr]
}

// takeRelayAnswer takes a relay's answer to a host's bind.
func (l *Listener) takeRelayAnswer(addr netip.AddrPort, nonce *[queryNonceSize]byte, body []byte) bool {
	u := &l.relayUse
	u.mu.Lock()
	w := u.binds[*nonce]
	u.mu.Unlock()
	if w == nil || w.relay != addr || len(body) < 1 {
		return false
	}
	select {
	case w.got <- append([]byte(nil), body...):
	default:
	}
	return true
}
