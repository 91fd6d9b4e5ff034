package knet

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"
)

// Listener accepts kNet connections on one UDP socket (or several sharing
// its address, with Config.Sockets). It is a net.Listener whose Accept
// returns *Conn values.
//
// A Listener is safe for concurrent use.
type Listener struct {
	eps       []*endpoint
	cfg       *config
	acceptq   chan *Conn
	closed    chan struct{} // Close was called
	closeOnce sync.Once
	closeDone chan struct{} // Close is done
	open      atomic.Bool
	loops     sync.WaitGroup

	// Admission closed by StopAdmitting or Drain (drain.go): the reason
	// refusals carry, and whether a Drain began (then for good).
	refuseReason atomic.Pointer[[]byte]
	draining     atomic.Bool

	// Secure listeners: connect tokens, if it takes them, and cookies.
	tokens  *tokenChecker
	cookies *cookieJar

	// mu may be held while an endpoint's mu is taken, never the reverse.
	mu      sync.Mutex
	pending map[*Conn]bool // connections not yet established, over any transport
	closing bool
	load    handshakeLoad // handshakes that failed lately
	hs      handshakes    // a secure listener's: key exchanges (admission.go)
	// The places of the attempts not yet established (admission.go):
	// how many, and what each source holds.
	attempts     int
	halfOpenCIDs int
	sources      map[sourceKey]sourceUse
	silent       []*Conn // streams that have said nothing yet, oldest first (lazily pruned)

	workers sync.WaitGroup // handshake workers
	// keyExchangeHook, if set, runs before each key exchange (tests).
	keyExchangeHook atomic.Pointer[func()]

	// Atomic.
	completed          atomic.Uint64 // ListenerStats.Established
	rejectedTokens     atomic.Uint64
	cookiesSent        atomic.Uint64
	keyExchanges       atomic.Uint64
	replayedHandshakes atomic.Uint64
	rateLimited        atomic.Uint64
	droppedHandshakes  atomic.Uint64
	// Bytes of the connection attempts a secure listener handled before
	// allocating anything, and of its answers to them.
	unprovenIn, unprovenOut atomic.Uint64

	// Server queries (query.go): the info they are answered with.
	query queryState
	// Address reflection (reflect.go): this Listener's own asks.
	reflect reflectState
	punch   punchState // hole punching and introductions (punch.go)
	// The relay it serves (ServeRelay), and the relays its Punch calls
	// bound to (relay.go).
	relay    relayServer
	relayUse relayUse

	// budget bounds what all the connections hold (budget.go).
	budget *receiveBudget

	// Secure connections by connection ID (migration.go), across sockets:
	// a client that moved may reach another of them.
	cidMu sync.Mutex
	cids  map[uint32]*Conn
	// The private keys handshakes are read under (serverkey.go).
	keys atomic.Pointer[serverKeys]

	// Config.TCP: the TCP socket on the same port, and the stream
	// connections (stream_listen.go), true once established (under mu).
	tcp           *net.TCPListener
	http          httpOn // Config.HTTP's server (stream_http.go)
	streams       map[*Conn]bool
	failedStreams atomic.Uint64
	simStreams    atomic.Uint64 // streams given a simulated path, each its own seed (streamsim.go)
}

// ListenerStats are a Listener's counters.
type ListenerStats struct {
	Connections         int    // connections on the socket(s) that have not ended, pending ones included: what a Drain waits for
	Pending             int    // connections whose handshake is not complete
	Established         uint64 // connections whose handshake completed and that were handed to Accept (or the Group), since Listen
	InvalidDatagrams    uint64 // malformed datagrams from unknown endpoints, dropped; and plaintext attempts ended because their proof of address (an ack or a PingReply) named nothing sent to them
	StrayDatagrams      uint64 // datagrams from unknown endpoints that were not connection attempts (a Disconnect among them is answered, unless Stealth)
	IgnoredAttempts     uint64 // connection attempts ignored (too many pending, listener closed)
	RefusedAttempts     uint64 // connection attempts refused by Admit or a full backlog, or by a secure listener for their handshake or token
	SendErrors          uint64 // datagrams the system refused to send that were no connection's: refusals, and deliveries of Config.Simulate
	OversizedReplies    uint64 // Admit replies longer than a ConnectSynAck carries: those attempts were refused (see Config.Admit)
	RejectedTokens      uint64 // secure attempts refused for their connect token (Config.TokenKey): missing, invalid, expired, already used, for another server; also in RefusedAttempts
	CookiesSent         uint64 // secure attempts answered with a cookie to echo instead of a handshake (Config.CookieThreshold)
	QueriesAnswered     uint64 // server queries answered (SetQueryInfo)
	QueriesDropped      uint64 // server queries not answered: no info set, shorter than the 1200 bytes a query is padded to, or over the rate limits
	ReflectionsAnswered uint64 // address reflections (Reflect, Listener.Reflect) answered with the address they came from
	ReflectionsDropped  uint64 // address reflections not answered: Stealth, shorter than 1200 bytes, or over the rate limits (shared with queries)
	PunchAnswered       uint64 // introductions (ServeIntroductions) and punch probes (Punch) answered
	PunchDropped        uint64 // introduction asks and punch probes with a token of a running Punch not answered: malformed, shorter than 1200 bytes, or over the rate limits (shared with queries)
	// A relay's (ServeRelay, relay.go).
	RelayAllocations    int    // allocations held now (each a socket)
	RelayAllocated      uint64 // allocations made
	RelayRefused        uint64 // allocations refused (full, or the joiner's source holds RelayConfig.MaxAllocationsPerSource), and binds refused (a token of no side, or of a side proven at another address)
	RelayForwarded      uint64 // datagrams forwarded between the proven sides of an allocation
	RelayForwardedBytes uint64 // their bytes
	RelayLimited        uint64 // datagrams not forwarded: over the allocation's or the relay's bandwidth (RelayConfig)
	RelayDropped        uint64 // datagrams not forwarded nor answered: from an address not proven, before the other side was, malformed, too large, or binds over the rates of answers without a connection
	Sockets             int    // sockets sharing the address (Config.Sockets)
	// Writes to the socket(s): each a system call on Linux as a rule
	// (sendmmsg for a batch of datagrams, sendto for one), whatever the
	// connections. DatagramsWritten / Writes is how many datagrams a
	// system call carried on average.
	Writes           uint64
	DatagramsWritten uint64

	// A secure listener's key exchanges (reading a client's handshake
	// message, an X25519 each), which run on a few handshake workers, off
	// the socket's reader, and what it dropped before them. See
	// SECURE.md, "Stateless cookies".
	KeyExchanges          uint64 // secure attempts whose handshake was read, whatever came of it
	ReplayedHandshakes    uint64 // secure attempts whose handshake message had already cost a key exchange lately: dropped, or refused again (without one) if that failed
	RateLimitedHandshakes uint64 // secure attempts dropped before their key exchange: their source IP address had cost 256 at once, or 1,000 a second, already
	DroppedHandshakes     uint64 // secure attempts dropped before their key exchange: too many were waiting for one

	// Streams (Config.TCP, WebSocket) that ended before they were
	// established, other than by a refusal (RefusedAttempts): garbage or
	// a cut in their first frame, a frame over MaxMessageSize, no first
	// frame within ConnectTimeout, the client's close.
	FailedStreams uint64

	// The receive budget (Config.ReceiveBudget): what the connections
	// hold of what their peers sent, as they last counted it, and how
	// many were closed for holding more than their share of it while it
	// was spent (each also ended with ErrOverBudget).
	ReceiveHeld      int
	ClosedOverBudget uint64
}

// Listen opens a UDP socket on address and accepts kNet connections on it.
// The network is "udp", "udp4" or "udp6". With Config.Sockets above 1 it
// opens that many on the same address (SO_REUSEPORT, Linux), each read by
// its own goroutine; the kernel spreads peers over them by address, and a
// connection stays on the socket its peer reached.
func Listen(network, address string, cfg *Config) (*Listener, error) {
	return listenWith(network, address, cfg, &endpointOptions{})
}

// listenWith is Listen with the endpoints' options (tests).
func listenWith(network, address string, cfg *Config, o *endpointOptions) (*Listener, error) {
	if errNoSockets != nil {
		return nil, errNoSockets
	}
	if err := checkNetwork(network); err != nil {
		return nil, err
	}
	laddr, err := net.ResolveUDPAddr(network, address)
	if err != nil {
		return nil, err
	}
	rc, err := cfg.resolveListener()
	if err != nil {
		return nil, err
	}
	if err := rc.checkServerID(); err != nil {
		return nil, err
	}
	if rc.http != nil && !rc.tcp {
		return nil, errors.New("knet: Config.HTTP is served on the TCP port: it needs Config.TCP")
	}
	var socks []socket
	var tcp *net.TCPListener
	fail := func(err error) (*Listener, error) {
		for _, s := range socks {
			s.Close()
		}
		if tcp != nil {
			tcp.Close()
		}
		return nil, err
	}
	anyPort := laddr.Port == 0
	for attempt := 1; ; attempt++ {
		for i := range rc.sockets {
			s, err := o.listenSocket(network, laddr, rc.sockets > 1)
			if err != nil {
				return fail(err)
			}
			socks = append(socks, s)
			if i == 0 {
				laddr = s.LocalAddr().(*net.UDPAddr) // the others take the same port
			}
		}
		if !rc.tcp {
			break
		}
		tcp, err = net.ListenTCP(tcpNetwork(network), &net.TCPAddr{IP: laddr.IP, Port: laddr.Port, Zone: laddr.Zone})
		if err == nil {
			break
		}
		if !anyPort || attempt == 10 || !errors.Is(err, syscall.EADDRINUSE) {
			return fail(fmt.Errorf("knet: listen on TCP beside UDP (Config.TCP): %w", err))
		}
		// The port the system gave UDP is taken on TCP: another.
		for _, s := range socks {
			s.Close()
		}
		socks = socks[:0]
		laddr.Port = 0
	}
	l, err := startListener(rc, laddr, socks, o)
	if err != nil {
		if tcp != nil {
			tcp.Close()
		}
		return nil, err
	}
	if tcp != nil {
		l.startTCP(tcp)
	}
	return l, nil
}

// startListener makes a Listener serving socks, bound to laddr, and
// starts their readers. On failure it closes socks.
func startListener(rc *config, laddr *net.UDPAddr, socks []socket, o *endpointOptions) (*Listener, error) {
	fail := func(err error) (*Listener, error) {
		for _, s := range socks {
			s.Close()
		}
		return nil, err
	}
	var err error
	l := &Listener{
		cfg:       rc,
		acceptq:   make(chan *Conn, rc.backlog),
		closed:    make(chan struct{}),
		closeDone: make(chan struct{}),
		pending:   make(map[*Conn]bool),
		streams:   make(map[*Conn]bool),
		sources:   make(map[sourceKey]sourceUse),
		budget:    newReceiveBudget(rc),
	}
	l.open.Store(true)
	if rc.privateKey != nil {
		if err := l.SetKeys(rc.privateKey, rc.nextPrivateKey); err != nil {
			return fail(err)
		}
		l.cookies = newCookieJar()
		l.hs = newHandshakes(seenWindow(rc))
		if rc.tokenKey != nil {
			addrs := rc.publicAddrs
			if len(addrs) == 0 {
				a := unmap(laddr.AddrPort())
				if a.Addr().IsUnspecified() {
					return fail(errTokenAddrs)
				}
				addrs = []netip.AddrPort{a}
			}
			if l.tokens, err = newTokenChecker(rc.tokenKey, addrs); err != nil {
				return fail(err)
			}
		}
	}
	for i, s := range socks {
		ep := newEndpoint(s, false, rc, o)
		ep.simulate(1 + uint64(i)*2)
		ep.l = l
		l.eps = append(l.eps, ep)
	}
	for _, ep := range l.eps {
		go ep.readLoop()
	}
	return l, nil
}

func checkNetwork(network string) error {
	switch network {
	case "udp", "udp4", "udp6":
		return nil
	}
	return fmt.Errorf("knet: network %q not one of udp, udp4, udp6", network)
}

// Addr returns the address of the socket.
func (l *Listener) Addr() net.Addr { return l.eps[0].sock.LocalAddr() }

// Accept waits for the next established connection and returns it, a
// *Conn, as a net.Conn.
func (l *Listener) Accept() (net.Conn, error) {
	c, err := l.AcceptConn(context.Background())
	if err != nil {
		return nil, err
	}
	return c, nil
}

// AcceptConn waits for the next established connection, until ctx is done
// or the listener is closed.
func (l *Listener) AcceptConn(ctx context.Context) (*Conn, error) {
	if ctx == nil {
		return nil, errNilContext
	}
	select {
	case c := <-l.acceptq:
		return c, nil
	default:
	}
	select {
	case c := <-l.acceptq:
		return c, nil
	case <-l.closed:
		return nil, net.ErrClosed
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// Conns returns the listener's established connections that have not
// ended, accepted or not yet.
func (l *Listener) Conns() []*Conn {
	var cs []*Conn
	for _, ep := range l.endpoints() {
		ep.mu.Lock()
		for _, c := range ep.conns {
			select {
			case <-c.estab:
				if !c.ended() {
					cs = append(cs, c)
				}
			default:
			}
		}
		ep.mu.Unlock()
	}
	for _, c := range l.streamConns(true) {
		if !c.ended() {
			cs = append(cs, c)
		}
	}
	return cs
}

// SetListenOpen opens or closes the listener for new connections (the
// spec's listen-open mode). Closed, it serves only the connections it has;
// connection attempts are refused (or ignored, with Config.Stealth).
// A Listener starts open. It forgets StopAdmitting's reason; it cannot
// reopen a listener that began to Drain.
func (l *Listener) SetListenOpen(open bool) {
	if !l.draining.Load() {
		l.refuseReason.Store(nil)
	}
	l.open.Store(open)
}

// Stats returns the listener's counters.
func (l *Listener) Stats() ListenerStats {
	st := ListenerStats{Sockets: len(l.eps)}
	for _, ep := range l.endpoints() {
		ep.mu.Lock()
		st.Connections += len(ep.conns)
		ep.mu.Unlock()
		st.InvalidDatagrams += ep.invalid.Load() + ep.sockInvalid()
		st.StrayDatagrams += ep.stray.Load()
		st.IgnoredAttempts += ep.ignored.Load()
		st.RefusedAttempts += ep.refused.Load()
		st.SendErrors += ep.sendErrs.Load()
		st.OversizedReplies += ep.oversized.Load()
		st.Writes += ep.writes.Load()
		st.DatagramsWritten += ep.written.Load()
	}
	st.Established = l.completed.Load()
	st.RejectedTokens = l.rejectedTokens.Load()
	st.CookiesSent = l.cookiesSent.Load()
	st.QueriesAnswered = l.query.answered.Load()
	st.QueriesDropped = l.query.dropped.Load()
	st.ReflectionsAnswered = l.reflect.answered.Load()
	st.ReflectionsDropped = l.reflect.dropped.Load()
	st.PunchAnswered = l.punch.answered.Load()
	st.PunchDropped = l.punch.dropped.Load()
	st.RelayAllocations = l.relayAllocations()
	st.RelayAllocated = l.relay.allocated.Load()
	st.RelayRefused = l.relay.refused.Load()
	st.RelayForwarded = l.relay.forwarded.Load()
	st.RelayForwardedBytes = l.relay.forwardedBytes.Load()
	st.RelayLimited = l.relay.limited.Load()
	st.RelayDropped = l.relay.dropped.Load()
	st.KeyExchanges = l.keyExchanges.Load()
	st.ReplayedHandshakes = l.replayedHandshakes.Load()
	st.FailedStreams = l.failedStreams.Load()
	st.RateLimitedHandshakes = l.rateLimited.Load()
	st.DroppedHandshakes = l.droppedHandshakes.Load()
	l.budget.fill(&st)
	l.mu.Lock()
	st.Pending = len(l.pending)
	st.Connections += len(l.streams)
	l.mu.Unlock()
	return st
}

// errListenerClosed is a second Listener.Close's error.
var errListenerClosed = fmt.Errorf("knet: listener already closed: %w", net.ErrClosed)

// Close stops accepting, closes every connection gracefully (in parallel,
// within DisconnectTimeout) and then the sockets. A later call closes
// nothing more: once the first is done, it returns an error wrapping
// net.ErrClosed, as a net.Listener's does.
func (l *Listener) Close() error {
	// Later calls wait for the first on a channel, not in the Once: a
	// goroutine blocked on a mutex is not durably blocked in a
	// testing/synctest bubble, whose clock, which the connections'
	// closes need, would then stop.
	first := false
	l.closeOnce.Do(func() { first = true })
	if !first {
		<-l.closeDone
		return errListenerClosed
	}
	defer close(l.closeDone)
	close(l.closed)
	l.closeTCP()
	l.closeHTTP()
	l.closeRelay()
	l.mu.Lock()
	l.closing = true
	for i, j := range l.hs.queue {
		if j.c == nil {
			j.ep.putPacket(j.p)
			l.leaveLocked(&j.t)
		}
		// A stream's connection is closed below, with the others.
		l.hs.queue[i] = handshakeJob{}
	}
	l.hs.queue = nil
	clear(l.hs.busy)
	l.mu.Unlock()
	// A worker's connection, if it makes one, is among those
	// closed below.
	l.workers.Wait()
	var conns []*Conn
	for _, ep := range l.endpoints() {
		ep.mu.Lock()
		for _, c := range ep.conns {
			conns = append(conns, c)
		}
		ep.mu.Unlock()
	}
	conns = append(conns, l.streamConns(false)...)
	var wg sync.WaitGroup
	for _, c := range conns {
		wg.Go(func() {
			c.shutdown()
			<-c.done
		})
	}
	wg.Wait()
	l.loops.Wait()
	for _, ep := range l.endpoints() {
		ep.close()
	}
	return nil
}

// handleNew handles a datagram from an address with no connection on ep: a
// connection attempt if it is a well-formed datagram with a ConnectSyn
// (DECISIONS §1), otherwise dropped.
//
// A reference peer's attempt is its 8 zero bytes (cppOpening); which
// dialects are accepted is the Config's Dialect.
func (l *Listener) handleNew(ep *endpoint, addr netip.AddrPort, p *packet) {
	dialect := DialectSpec
	if isCppOpening(p.b) {
		dialect = DialectReference
	}
	if l.cfg.dialect != DialectAuto && l.cfg.dialect != dialect {
		ep.invalid.Add(1)
		ep.putPacket(p)
		return
	}
	if ok, valid := isConnectSyn(p.b); dialect == DialectSpec && !ok {
		if !valid && l.cfg.dialect != DialectSpec {
			// A reference peer's datagram, late from a connection that
			// ended (its Disconnect is answered too).
			valid = parseCppInto(p.b, &ep.rd) == nil
		}
		if valid {
			ep.stray.Add(1) // say, late from a connection that ended
			if !l.cfg.stealth {
				ep.answerDisconnect(addr, p.b)
			}
		} else {
			ep.invalid.Add(1)
		}
		ep.putPacket(p)
		return
	}
	if !l.open.Load() || l.draining.Load() {
		why := l.refusal()
		switch {
		case l.cfg.privateKey != nil:
			l.refuseUnproven(ep, addr, p.b, string(why), true) // with its proof
		default:
			ep.refused.Add(1)
			if !l.cfg.stealth && dialect == DialectSpec {
				refuseWith(ep, addr, p.b, why)
			}
		}
		ep.putPacket(p)
		return
	}
	if l.cfg.privateKey != nil {
		// Before anything is allocated: cookie, handshake, token; the
		// handshake on a worker, which makes the connection.
		l.admitSecure(ep, addr, p)
		return
	}
	l.mu.Lock()
	var t ticket
	if l.draining.Load() || !l.enterLocked(addr.Addr(), &t) {
		l.mu.Unlock()
		ep.ignored.Add(1)
		ep.putPacket(p)
		return
	}
	c := newConn(ep, addr, l.cfg, false, dialect)
	c.ticket = t
	l.pending[c] = true
	l.loops.Add(1)
	l.mu.Unlock()
	startConn(ep, addr, c, p)
}

// startSecure makes the connection of a secure attempt whose handshake a
// worker read (j, sec), as handleNew makes a plaintext one.
func (l *Listener) startSecure(j handshakeJob, sec *secureState) {
	l.mu.Lock()
	if l.closing || l.draining.Load() {
		// It may come again: the key exchange it cost is forgotten.
		if len(l.hs.conns[j.h]) == 0 {
			l.hs.seen.forget(j.h)
		}
		l.leaveLocked(&j.t)
		delete(l.hs.busy, j.addr)
		l.mu.Unlock()
		j.ep.ignored.Add(1)
		j.ep.putPacket(j.p)
		return
	}
	c := newConn(j.ep, j.addr, l.cfg, false, DialectSpec)
	c.sec = sec
	c.ticket = j.t // its place, taken when it was queued
	l.pending[c] = true
	l.hs.conns[j.h] = append(l.hs.conns[j.h], c)
	l.loops.Add(1)
	// The address is routed to the connection and no longer marked busy
	// at once: a datagram from it finds one or the other.
	j.ep.mu.Lock()
	j.ep.conns[j.addr] = c
	j.ep.mu.Unlock()
	delete(l.hs.busy, j.addr)
	l.mu.Unlock()
	c.push(j.p) // its first round; its last calls l.loops.Done (Conn.end)
}

// startConn routes addr's datagrams to c, a server's new connection,
// hands it its first, p, and starts it.
func startConn(ep *endpoint, addr netip.AddrPort, c *Conn, p *packet) {
	ep.mu.Lock()
	ep.conns[addr] = c
	ep.mu.Unlock()
	c.push(p) // its first round; its last calls l.loops.Done (Conn.end)
}

// startHandshakeWorker starts a handshake worker (admission.go), which
// ends when the queue is empty; l.mu is held.
func (l *Listener) startHandshakeWorker() {
	l.workers.Add(1)
	go l.handshakeWorker()
}

// isConnectSyn reports whether b is a well-formed datagram holding a
// ConnectSyn, and whether it is well-formed at all.
func isConnectSyn(b []byte) (syn, valid bool) { return holds(b, idConnectSyn) }

// refuseWith answers a connection attempt, the datagram in, with a
// DisconnectAck carrying why (may be empty), or a bare one (nine bytes,
// never larger than a ConnectSyn's datagram) if the reason would make the
// answer larger than in: a plaintext client pads its ConnectSyn to 1200
// bytes as a rule, but one with a small MaxDatagramSize may not.
func refuseWith(ep *endpoint, addr netip.AddrPort, in, why []byte) {
	var b [16 + MaxReasonLength]byte
	d := appendHeader(b[:0], &header{})
	d = appendMessage(d, &message{id: idDisconnectAck, payload: why})
	if len(d) > len(in) {
		d = appendMessage(appendHeader(b[:0], &header{}), &message{id: idDisconnectAck})
	}
	ep.write(d, addr)
}

// roomToAccept reports whether the accept backlog has room.
func (l *Listener) roomToAccept() bool { return len(l.acceptq) < cap(l.acceptq) }

// Dial connects to a kNet server at address. The network is "udp",
// "udp4" or "udp6" for kNet over its own UDP socket (with
// Config.FallbackTCP, over TCP too if UDP has no answer), or "tcp", "tcp4"
// or "tcp6" for kNet over TCP, to a Listener with Config.TCP (see
// DialWebSocket for WebSocket). It returns once the handshake is
// complete, or fails with ErrRefused, a *TimeoutError after
// ConnectTimeout, or ctx's error.
//
// With an empty address and a connect token (Config.Token), Dial tries the
// servers the token names (TokenServers) in order, as netcode.io's clients
// do, until one admits it: each attempt gets an equal share of what is
// left of ConnectTimeout, or of ctx's deadline if that comes sooner (the
// first ConnectTimeout/n of n servers; one refused at once leaves its
// share to the next), and one that refuses,
// fails the handshake or does not answer within its share gives way to
// the next. Conn.RemoteAddr tells which server it reached. When every
// attempt failed, the error is a *TokenDialError naming each; ctx's end
// stops the attempts with ctx's error.
func Dial(ctx context.Context, network, address string, cfg *Config) (*Conn, error) {
	return dialWith(ctx, network, address, cfg, &endpointOptions{})
}

// dialWith is Dial with the endpoint's options (tests).
func dialWith(ctx context.Context, network, address string, cfg *Config, o *endpointOptions) (*Conn, error) {
	if ctx == nil {
		return nil, errNilContext
	}
	if errNoSockets != nil {
		return nil, errNoSockets
	}
	switch network {
	case "tcp", "tcp4", "tcp6":
		rc, err := cfg.resolveDialer()
		if err != nil {
			return nil, err
		}
		return dialTCP(ctx, network, address, rc, o)
	}
	if err := checkNetwork(network); err != nil {
		return nil, err
	}
	rc, err := cfg.resolveDialer()
	if err != nil {
		return nil, err
	}
	if address == "" && rc.token != nil {
		return dialServers(ctx, network, rc, o)
	}
	return dialAddr(ctx, network, address, rc, o)
}

// dialAddr is Dial to address over UDP, or with Config.FallbackTCP over
// UDP and TCP.
func dialAddr(ctx context.Context, network, address string, rc *config, o *endpointOptions) (*Conn, error) {
	if rc.fallbackTCP {
		return dialFallback(ctx, network, address, rc, o)
	}
	return dialUDP(ctx, network, address, rc, o)
}

// checkSynPayload checks that the ConnectPayload fits a ConnectSyn.
func (rc *config) checkSynPayload() error {
	if n := len(rc.connectPayload); n > rc.synPayloadLimit() && rc.dialect != DialectReference {
		return fmt.Errorf("%w: ConnectPayload of %d bytes, at most %d fit a ConnectSyn", ErrHandshakeTooLarge, n, rc.synPayloadLimit())
	}
	return nil
}

// dialUDP is Dial over UDP.
func dialUDP(ctx context.Context, network, address string, rc *config, o *endpointOptions) (*Conn, error) {
	if err := rc.checkSynPayload(); err != nil {
		return nil, err
	}
	raddr, err := resolveDialAddr(network, address)
	if err != nil {
		return nil, err
	}
	sock, err := o.dialSocket(network, raddr)
	if err != nil {
		return nil, err
	}
	return dialOn(ctx, sock, raddr, rc, o)
}

// dialTarget resolves a Dial's Config, which it checks, and the server's
// address.
func dialTarget(network, address string, cfg *Config) (*config, *net.UDPAddr, error) {
	rc, err := cfg.resolveDialer()
	if err != nil {
		return nil, nil, err
	}
	if err := rc.checkSynPayload(); err != nil {
		return nil, nil, err
	}
	raddr, err := resolveDialAddr(network, address)
	if err != nil {
		return nil, nil, err
	}
	return rc, raddr, nil
}

// resolveDialAddr resolves the address Dial is to reach, which must name
// a port.
func resolveDialAddr(network, address string) (*net.UDPAddr, error) {
	raddr, err := net.ResolveUDPAddr(network, address)
	if err != nil {
		return nil, err
	}
	if raddr.Port == 0 {
		// The system would take it, and the attempt would only time out.
		return nil, fmt.Errorf("knet: dial %s %q: no port to connect to", network, address)
	}
	return raddr, nil
}

// dialOn connects to raddr over sock, which the connection then owns: it
// is closed when the connection ends, or here on failure.
func dialOn(ctx context.Context, sock socket, raddr *net.UDPAddr, rc *config, o *endpointOptions) (*Conn, error) {
	ep := newEndpoint(sock, true, rc, o)
	ep.simulate(2)
	dialect := DialectSpec
	if rc.dialect == DialectReference {
		dialect = DialectReference
	}
	c := newConn(ep, unmap(raddr.AddrPort()), rc, true, dialect)
	if rc.serverKey != nil {
		sec, syn, err := newClientSecure(rc.serverKey, rc.token, rc.connectPayload)
		if err != nil {
			sock.Close()
			return nil, err
		}
		sec.tap = rc.sealTap
		sec.ku = newKeyUpdates(rc)
		c.sec = sec
		c.sess.setSyn(syn, false)
	}
	ep.conns[c.raddr] = c
	go ep.readLoop()
	c.kick()
	return awaitDialed(ctx, c, rc)
}

// awaitDialed waits for a dialed connection, over any transport, to be
// established (and joins it to Config.Group), to fail, or for ctx's end,
// which abandons it.
func awaitDialed(ctx context.Context, c *Conn, rc *config) (*Conn, error) {
	select {
	case <-c.estab:
		if rc.group != nil {
			rc.group.Add(c)
		}
		return c, nil
	case <-c.done:
		if c.sec != nil {
			return nil, c.sec.dialErr(c.Err())
		}
		return nil, c.Err()
	case <-ctx.Done():
		c.shutdown()
		<-c.done
		return nil, ctx.Err()
	}
}
