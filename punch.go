package knet

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"
)

// Players host games (issue 35): a host behind a NAT registers its
// Listener under an ID the game chooses with an introducer, a joiner asks
// for that ID, and the introducer tells each the other's candidates (the
// address it saw them from, then their local addresses), a token and a
// time to start. At that time the host's Listener probes the joiner's
// candidates (Listener.Punch), so that its NAT lets the joiner in, while
// the joiner probes the host's and dials the first that answers
// (DialCandidates): a normal connection, admitted as any other. A knet
// extension on the server query's datagram (query.go); docs/PROTOCOL.md
// section 8.2 has the layout:
//
//	kind 5, probe:     the token; the joiner's padded to 1200 bytes
//	kind 6, answer:    the token: a Listener's answer to a joiner's probe
//	kind 7, register:  a host's or joiner's ask to an introducer, padded
//	kind 8, introduce: the introducer's answer, no larger than the ask
//
// Everything a Listener sends to an address with no connection here goes
// through answerUnconnected (admission.go), except the host's own probes,
// which its application asked for (Punch) and which go only to the
// candidates it was given, within a budget of rounds.

const (
	punchKindProbe  = 5
	punchKindAnswer = 6
	introKindAsk    = 7
	introKindAnswer = 8

	// The roles of an introduction ask.
	introRoleHost = 1
	introRoleJoin = 2
	// The statuses of an introducer's answer.
	introWaiting    = 0 // no host under the ID yet, or no joiner for a host
	introIntroduced = 1 // the other side's candidates follow
	introTaken      = 2 // another address holds the ID
	introProve      = 3 // echo the cookie that follows: nothing else is done for an address not proven

	// MaxIntroID is the longest ID a host registers under.
	MaxIntroID = 64
	// maxCandidates is the most candidates one side sends.
	maxCandidates = 8
	// introHostTTL is how long an introducer keeps a host that stopped
	// asking; introMaxHosts how many it keeps at most.
	introHostTTL  = 10 * time.Second
	introMaxHosts = 4096
	// introPoll is how often a registered host asks again (which keeps
	// its NAT's mapping toward the introducer), and introLead how far
	// ahead of a joiner's ask the introducer sets the start: a host's
	// poll and a round trip.
	introPoll = 100 * time.Millisecond
	introLead = 200 * time.Millisecond
	// introRetell is how long after the start an introducer still tells
	// a host of its joiner (the host's Host call asking again because the
	// answer was lost): the joiner probes that long.
	introRetell = punchRounds * punchInterval
	// introJoinResend is how often a joiner asks again.
	introJoinResend = 250 * time.Millisecond

	// Punching: a round of probes to every candidate each punchInterval,
	// punchRounds rounds at most (the budget: 2 s).
	punchInterval = 50 * time.Millisecond
	punchRounds   = 40
)

// ErrNoDirectPath is DialCandidates' error when no candidate of the host
// answered a probe within the budget: the NATs between (a symmetric NAT
// on both sides, or a symmetric one facing a port-restricted cone) let
// no datagram through either way.
var ErrNoDirectPath = errors.New("knet: no direct path to the host: no candidate answered a probe")

// ErrIntroIDTaken is Listener.Host's error when another address holds the
// ID at the introducer.
var ErrIntroIDTaken = errors.New("knet: the introducer has another host under that ID")

// ErrNoHost is Join's error when the introducer had no host under the ID
// before ctx ended.
var ErrNoHost = errors.New("knet: no host registered under that ID")

// Introduction is what one side of a game learns of the other, from an
// introducer (Listener.Host, Join) or from a game's own signalling: the
// other side's candidates (the address an introducer saw it from first,
// then its local addresses), the token that the probes of both carry,
// and when to start.
type Introduction struct {
	Peer  []netip.AddrPort
	Token [8]byte
	Start time.Time
	// Relay is where to connect through when no direct path is found: a
	// relay allocation (ServeRelay, AllocateRelay), which this side proves
	// itself to with RelayToken. The zero AddrPort: no relay offered; port
	// 0: the relay was full (DialCandidates fails with ErrRelayRefused).
	Relay      netip.AddrPort
	RelayToken [relayTokenSize]byte

	// relayFirst (tests): no direct probing before the relay, and the
	// retries while relayed start this much later.
	relayFirst time.Duration

	// Repunch is, in an introduction Listener.Host returns, the
	// connection whose joiner lost its path and asks to be punched
	// again (repunch.go); nil for a new joiner. Punch it as any.
	Repunch *Conn

	// Join's: the introducer and the ID, with which the Conn that
	// DialCandidates makes re-punches.
	introducer netip.AddrPort
	id         string

	// Hard says that this side's NAT maps each destination to a port of
	// its own (a symmetric NAT), and PeerHard that the other side's does
	// (birthday.go): when one side is hard and the other not, the hard
	// side opens many sockets toward the other's address and the easy
	// side probes random ports of the hard side's. Listener.HostWith and
	// JoinWith learn Hard with a second reflector, and the introducer
	// passes it on as the other side's PeerHard.
	Hard, PeerHard bool

	seed uint64 // the random ports' seed (tests); zero: random
}

// Signal carries introductions between a host and a joiner by other means
// than knet's introducer: a game's matchmaker or lobby service. Each side
// gives its own candidates (its Listener.Reflect or Reflect answer and its
// local addresses); the service pairs them under id, makes one random
// token and a start time a little ahead, and returns the other side's.
// knet's introducer is one such service reached over UDP
// (Listener.Host, Join).
type Signal interface {
	Host(ctx context.Context, id string, self []netip.AddrPort) (Introduction, error)
	Join(ctx context.Context, id string, self []netip.AddrPort) (Introduction, error)
}

// punchState is a Listener's: the tokens of its Punch calls running, the
// asks of its Host calls waiting, and, when it serves introductions, its
// hosts.
type punchState struct {
	active atomic.Int32 // len(tokens)+len(waits): the reader looks no further while 0
	serve  atomic.Bool  // ServeIntroductions
	jar    atomic.Pointer[cookieJar]

	mu     sync.Mutex
	tokens map[[8]byte]chan struct{} // Punch: signalled when a probe or answer comes
	waits  map[[queryNonceSize]byte]*introWait
	hosts  map[string]*introHost
	// The sockets of hard hosts' birthday probing that the Listener
	// serves, each for one joiner's connection (birthday.go).
	adopted map[*endpoint]struct{}

	answered, dropped atomic.Uint64

	re repunchHost // re-punching a connection whose NAT mapping expired (repunch.go)
}

type introWait struct {
	server netip.AddrPort
	got    chan []byte // answers' bodies, status first; buffered
}

// introHost is a host an introducer keeps: where it asked from, its
// local addresses, when it last asked, and the joiner waiting to be
// told to it.
type introHost struct {
	observed netip.AddrPort
	locals   []netip.AddrPort
	flags    byte // introFlagHard
	seen     time.Time
	joiner   *introJoiner
	nonce    [queryNonceSize]byte // of its last ask: its Host call's
}

type introJoiner struct {
	relay    *relayAlloc // nil: no relay, or (relayFull) it was full
	relayOn  bool
	observed netip.AddrPort
	locals   []netip.AddrPort
	flags    byte // introFlagHard
	token    [8]byte
	start    time.Time
	told     bool                 // to a host's ask of nonce toldTo
	toldTo   [queryNonceSize]byte // each Host call asks with a nonce of its own
	tie      *[8]byte             // a re-punch's: the token of the connection's first punch
}

func (s *punchState) recount() {
	s.active.Store(int32(len(s.tokens) + len(s.waits)))
}

// ServeIntroductions makes the Listener an introducer: it answers
// hosts' and joiners' asks (Listener.Host, Join) from then on. Its
// answers follow the rules of every answer to an address without a
// connection (padded asks, no larger answers, per-source rates).
func (l *Listener) ServeIntroductions() {
	l.punch.jar.CompareAndSwap(nil, newCookieJar())
	l.punch.serve.Store(true)
}

// introCookieAD is what an introducer's cookies are made for (the
// cookie jar's msg1): an address that echoes one is proven.
var introCookieAD = []byte("knet introduction")

// handlePunch handles a datagram of kinds 5 to 8 from addr, which has no
// connection, and reports whether it took p.
func (l *Listener) handlePunch(ep *endpoint, addr netip.AddrPort, p *packet, kind byte, nonce *[queryNonceSize]byte, body []byte) bool {
	switch kind {
	case punchKindProbe, punchKindAnswer:
		if l.punch.active.Load() == 0 {
			return false
		}
		l.punch.mu.Lock()
		seen, ok := l.punch.tokens[*nonce]
		l.punch.mu.Unlock()
		if !ok {
			return false
		}
		l.punch.re.heardFrom(*nonce, addr, time.Now())
		if kind == punchKindAnswer {
			// The joiner's word that it found a path.
			select {
			case seen <- struct{}{}:
			default:
			}
		}
		if kind == punchKindProbe {
			// The one answer a probe gets: 20 bytes for a 1200-byte
			// probe carrying the token of a Punch running.
			d := appendQueryDatagram(p.buf[:0], punchKindAnswer, nonce, nil, 0)
			if !l.answerUnconnected(ep, addr, len(p.b), d, &l.punch.answered) {
				l.punch.dropped.Add(1)
			}
		}
		ep.putPacket(p)
		return true
	case introKindAnswer, repunchKindAnswer:
		if l.punch.active.Load() == 0 {
			return false
		}
		l.punch.mu.Lock()
		w := l.punch.waits[*nonce]
		l.punch.mu.Unlock()
		if w == nil || w.server != addr || len(body) < 1 {
			return false
		}
		select {
		case w.got <- append([]byte{kind}, body...):
		default:
		}
		ep.putPacket(p)
		return true
	case introKindAsk:
		if !l.punch.serve.Load() {
			return false
		}
		l.answerIntro(ep, addr, p, nonce, body, nil)
		return true
	case repunchKindAsk:
		if !l.punch.serve.Load() {
			return false
		}
		if len(body) < tieSize {
			l.punch.dropped.Add(1)
			ep.putPacket(p)
			return true
		}
		l.answerIntro(ep, addr, p, nonce, body[tieSize:], (*[8]byte)(body[:tieSize]))
		return true
	}
	return false
}

// answerIntro answers an introduction ask p from addr, or a joiner's
// re-punch ask naming tie (kind 15, repunch.go), answered in kind 16. It
// takes p.
func (l *Listener) answerIntro(ep *endpoint, addr netip.AddrPort, p *packet, nonce *[queryNonceSize]byte, body []byte, tie *[8]byte) {
	in := len(p.b)
	defer ep.putPacket(p)
	role, cookie, id, locals, flags, ok := parseIntroAsk(body)
	answer := byte(introKindAnswer)
	if tie != nil {
		answer = repunchKindAnswer
		t := *tie // body is p's, which goes back to the pool
		tie = &t
	}
	if !ok || in < queryPadTo || (tie != nil && role != introRoleJoin) {
		l.punch.dropped.Add(1)
		return
	}
	now := time.Now()
	jar := l.punch.jar.Load()
	if !jar.check(cookie, addr, introCookieAD, now) {
		// Not proven: a cookie to echo, and nothing else. Every other
		// answer goes to an address that received one, so that a
		// spoofed ask neither registers a victim as a host nor
		// introduces it as a joiner (whose host would then probe it).
		b := jar.appendCookie([]byte{introProve}, addr, introCookieAD, now)
		d := appendQueryDatagram(p.buf[:0], answer, nonce, b, 0)
		if !l.answerUnconnected(ep, addr, in, d, &l.punch.answered) {
			l.punch.dropped.Add(1)
		}
		return
	}
	var status, peerFlags byte = introWaiting, 0
	var token [8]byte
	var start time.Time
	var peer []netip.AddrPort
	var relayPort uint16
	var relayToken *[relayTokenSize]byte
	relayOn := false
	l.punch.mu.Lock()
	h := l.punch.hosts[id]
	if h != nil && now.Sub(h.seen) > introHostTTL {
		delete(l.punch.hosts, id)
		h = nil
	}
	switch role {
	case introRoleHost:
		switch {
		case h != nil && h.observed != addr && h.nonce != *nonce:
			status = introTaken
		case h == nil && len(l.punch.hosts) >= introMaxHosts:
			// Full: the host hears nothing new and asks again.
		default:
			if h == nil {
				if l.punch.hosts == nil {
					l.punch.hosts = make(map[string]*introHost)
				}
				h = &introHost{observed: addr}
				l.punch.hosts[id] = h
			}
			// The same Host call from a new address (its NAT mapped
			// it afresh, repunch.go) keeps the ID: its nonce, which
			// only the host and we know, says it is the same.
			h.observed, h.locals, h.seen, h.nonce, h.flags = addr, locals, now, *nonce, flags
			j := h.joiner
			if j != nil && (j.told && j.toldTo != *nonce || now.After(j.start.Add(introRetell))) {
				// Told to an earlier Host call (this one is for the
				// next joiner), or too late to punch: gone.
				h.joiner, j = nil, nil
			}
			if j != nil {
				// Told again to the ask of the same Host call, whose
				// answer may have been lost.
				status, token, start, peerFlags = introIntroduced, j.token, j.start, j.flags
				peer = introPeer(j.observed, j.locals, h.observed)
				j.told, j.toldTo = true, *nonce
				relayOn, relayPort, relayToken = j.relayTicket(0)
				if j.tie != nil {
					answer, tie = repunchKindAnswer, j.tie
				}
			}
		}
	case introRoleJoin:
		if h != nil {
			j := h.joiner
			if j == nil || j.observed != addr || !sameTie(j.tie, tie) {
				// A new joiner takes the place of one the host was not
				// told of yet.
				j = &introJoiner{observed: addr, locals: locals, flags: flags, start: now.Add(introLead), tie: tie}
				rand.Read(j.token[:])
				if old := h.joiner; old != nil && old.relay != nil && !old.told {
					// Never told to the host: its allocation will not
					// be used (unless both sides bound it anyway).
					old.relay.release()
				}
				if l.relay.on.Load() {
					// An allocation for the pair, in case no probe gets
					// through (relay.go); a full relay is said as port 0.
					j.relayOn = true
					j.relay, _ = l.allocate(addr.Addr())
				}
				h.joiner = j
			}
			status, token, start, peerFlags = introIntroduced, j.token, j.start, h.flags
			peer = introPeer(h.observed, h.locals, addr)
			relayOn, relayPort, relayToken = j.relayTicket(1)
		}
	}
	l.punch.mu.Unlock()
	b := make([]byte, 0, 1+8+8+2+1+maxCandidates*2*reflectMaxBody+1+2+relayTokenSize)
	b = append(b, status)
	if status == introIntroduced && answer == repunchKindAnswer {
		b = append(b, tie[:]...)
	}
	if status == introIntroduced {
		wait := max(start.Sub(now), 0).Milliseconds()
		b = append(b, token[:]...)
		b = append(b, byte(wait>>8), byte(wait), byte(len(peer)))
		for _, c := range peer {
			b = appendReflectBody(b, nonce, c)
		}
		b = append(b, peerFlags) // the other side's: an asker from before the flags takes it for padding
		if relayOn {
			b = appendIntroRelay(b, relayPort, relayToken)
		}
	}
	d := appendQueryDatagram(p.buf[:0], answer, nonce, b, 0)
	if !l.answerUnconnected(ep, addr, in, d, &l.punch.answered) {
		l.punch.dropped.Add(1)
	}
}

// relayTicket is side's (0 host, 1 joiner) part of the pair's relay
// allocation, if the introducer offers one: its port (0 if the relay was
// full) and the side's token.
func (j *introJoiner) relayTicket(side int) (on bool, port uint16, token *[relayTokenSize]byte) {
	if !j.relayOn {
		return false, 0, nil
	}
	if j.relay == nil {
		return true, 0, new([relayTokenSize]byte)
	}
	return true, j.relay.port, &j.relay.tokens[side]
}

// introPeer is the candidates an introducer tells of a side seen at
// observed, with local addresses locals, to the other side, seen at
// other: its local addresses only when both are behind the same public
// address (the same NAT, where they may reach each other inside), so
// that what one side names as its local addresses can make the other
// probe nothing but its own network.
func introPeer(observed netip.AddrPort, locals []netip.AddrPort, other netip.AddrPort) []netip.AddrPort {
	peer := []netip.AddrPort{observed}
	if observed.Addr() == other.Addr() {
		peer = append(peer, locals...)
	}
	return peer[:min(len(peer), maxCandidates)]
}

// appendIntroAsk appends an ask's body: role, the cookie (none at first),
// the ID, the candidates, the flags (introFlagHard; an introducer from
// before the flags takes them for padding).
func appendIntroAsk(b []byte, role byte, cookie []byte, id string, self []netip.AddrPort, flags byte) []byte {
	var zero [queryNonceSize]byte
	b = append(b, role, byte(len(cookie)))
	b = append(b, cookie...)
	b = append(b, byte(len(id)))
	b = append(b, id...)
	b = append(b, byte(len(self)))
	for _, c := range self {
		b = appendReflectBody(b, &zero, c) // not XORed: the nonce is zeros
	}
	return append(b, flags)
}

func parseIntroAsk(b []byte) (role byte, cookie []byte, id string, self []netip.AddrPort, flags byte, ok bool) {
	if len(b) < 2 || (b[0] != introRoleHost && b[0] != introRoleJoin) || (b[1] != 0 && b[1] != cookieSize) {
		return 0, nil, "", nil, 0, false
	}
	role, cookie, b = b[0], b[2:min(len(b), 2+int(b[1]))], b[min(len(b), 2+int(b[1])):]
	if len(cookie) == 0 {
		cookie = nil
	}
	if len(b) < 2 || b[0] == 0 || int(b[0]) > MaxIntroID || len(b) < 2+int(b[0]) {
		return 0, nil, "", nil, 0, false
	}
	id = string(b[1 : 1+b[0]])
	var zero [queryNonceSize]byte
	self, rest, ok := parseCandidates(b[1+b[0]:], &zero)
	return role, cookie, id, self, introFlags(rest), ok
}

// parseCandidates reads a count and that many addresses (appendReflectBody's
// form, XORed with nonce); rest is what follows (flags, padding).
func parseCandidates(b []byte, nonce *[queryNonceSize]byte) (_ []netip.AddrPort, rest []byte, ok bool) {
	if len(b) < 1 || b[0] > maxCandidates {
		return nil, nil, false
	}
	n := int(b[0])
	b = b[1:]
	out := make([]netip.AddrPort, 0, n)
	for range n {
		if len(b) < 1 {
			return nil, nil, false
		}
		size := 1 + 4 + 2
		if b[0] == 6 {
			size = 1 + 16 + 2
		}
		if len(b) < size {
			return nil, nil, false
		}
		a, ok := parseReflectBody(b[:size], nonce)
		if !ok {
			return nil, nil, false
		}
		out = append(out, a)
		b = b[size:]
	}
	return out, b, true
}

// parseIntroduced reads an introduced answer's body after its status.
func parseIntroduced(b []byte, nonce *[queryNonceSize]byte, now time.Time, introducer netip.AddrPort) (Introduction, bool) {
	if len(b) < 8+2+1 {
		return Introduction{}, false
	}
	var in Introduction
	copy(in.Token[:], b)
	wait := time.Duration(uint16(b[8])<<8|uint16(b[9])) * time.Millisecond
	in.Start = now.Add(wait)
	peer, rest, ok := parseCandidates(b[10:], nonce)
	if !ok || len(peer) == 0 {
		return Introduction{}, false
	}
	in.Peer = peer
	in.PeerHard = introFlags(rest)&introFlagHard != 0
	if len(rest) > 0 {
		parseIntroRelay(rest[1:], introducer, &in) // after the flags
	}
	return in, true
}

// localCandidates is the addresses a socket bound to laddr is reached at
// on its own networks: laddr, or with an unspecified address each of the
// host's own of that family (not loopback), with laddr's port.
func localCandidates(laddr netip.AddrPort) []netip.AddrPort {
	if !laddr.Addr().IsUnspecified() {
		return []netip.AddrPort{laddr}
	}
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil
	}
	var out []netip.AddrPort
	for _, a := range addrs {
		ipn, ok := a.(*net.IPNet)
		if !ok {
			continue
		}
		ip, ok := netip.AddrFromSlice(ipn.IP)
		ip = ip.Unmap()
		// A socket on IPv4's unspecified address takes IPv4 only; one on
		// IPv6's takes both (dual stack) unless told otherwise.
		if !ok || ip.IsLoopback() || ip.IsLinkLocalUnicast() || (laddr.Addr().Is4() && !ip.Is4()) {
			continue
		}
		out = append(out, netip.AddrPortFrom(ip, laddr.Port()))
		if len(out) == maxCandidates-1 {
			break
		}
	}
	return out
}

// Host registers the Listener under id with the introducer at
// introducer (a knet Listener that ServeIntroductions), from the
// Listener's own socket, so that the address the introducer sees is the
// one its NAT maps the Listener to, and waits for a joiner: it returns
// the joiner's introduction, to give to Punch. It asks again every 100ms
// while it waits, which keeps the NAT's mapping; it fails with
// ErrIntroIDTaken if another address holds id, or with ctx's error.
// Call it again for the next joiner, and keep calling it while hosting:
// it also returns the introduction of a joiner whose connection lost its
// path (a NAT forgot the mapping), with Repunch set, to Punch as any.
func (l *Listener) Host(ctx context.Context, introducer, id string) (Introduction, error) {
	return l.HostWith(ctx, introducer, id, nil)
}

// HostWith is Host with options (o may be nil): with o.Reflector, the
// Listener first learns whether its NAT maps each destination to a port
// of its own and tells the introducer (birthday.go).
func (l *Listener) HostWith(ctx context.Context, introducer, id string, o *IntroOptions) (Introduction, error) {
	if ctx == nil {
		return Introduction{}, errNilContext
	}
	if len(id) == 0 || len(id) > MaxIntroID {
		return Introduction{}, fmt.Errorf("knet: host ID of %d bytes: 1 to %d", len(id), MaxIntroID)
	}
	server, err := resolveReflector(l.Addr().Network(), introducer)
	if err != nil {
		return Introduction{}, err
	}
	hard, err := o.hard(ctx, func(ctx context.Context, at string) (netip.AddrPort, error) { return l.Reflect(ctx, at) }, introducer)
	if err != nil {
		return Introduction{}, err
	}
	flags := introFlagsOf(hard)
	var nonce [queryNonceSize]byte
	rand.Read(nonce[:])
	w := &introWait{server: server, got: make(chan []byte, 4)}
	l.punch.mu.Lock()
	if l.punch.waits == nil {
		l.punch.waits = make(map[[queryNonceSize]byte]*introWait)
	}
	l.punch.waits[nonce] = w
	l.punch.recount()
	l.punch.mu.Unlock()
	defer func() {
		l.punch.mu.Lock()
		delete(l.punch.waits, nonce)
		l.punch.recount()
		l.punch.mu.Unlock()
	}()
	laddr, _ := addrPortOf(l.Addr())
	locals := localCandidates(laddr)
	ask := appendQueryDatagram(nil, introKindAsk, &nonce, appendIntroAsk(nil, introRoleHost, nil, id, locals, flags), queryPadTo)
	t := time.NewTicker(introPoll)
	defer t.Stop()
	heard := false
	for {
		l.eps[0].write(ask, server)
	wait:
		select {
		case b := <-w.got:
			heard = true
			kind, b := b[0], b[1:]
			if kind == repunchKindAnswer {
				if in, ok := l.repunchIntroduced(b, &nonce, server); ok {
					return in, nil
				}
				goto wait
			}
			switch b[0] {
			case introIntroduced:
				if in, ok := parseIntroduced(b[1:], &nonce, time.Now(), server); ok {
					in.Hard = hard
					return in, nil
				}
			case introTaken:
				return Introduction{}, fmt.Errorf("knet: host %q via %v: %w", id, server, ErrIntroIDTaken)
			case introProve:
				ask = appendQueryDatagram(ask[:0], introKindAsk, &nonce, appendIntroAsk(nil, introRoleHost, b[1:], id, locals, flags), queryPadTo)
				continue // at once
			}
			goto wait
		case <-l.closed:
			return Introduction{}, fmt.Errorf("knet: host %q via %v: %w", id, server, net.ErrClosed)
		case <-ctx.Done():
			if !heard {
				return Introduction{}, fmt.Errorf("knet: host %q via %v: %w (%w)", id, server, ErrNoIntroducer, ctx.Err())
			}
			return Introduction{}, ctx.Err()
		case <-t.C:
		}
	}
}

// Join asks the introducer at introducer for the host registered under
// id, over pc (the socket the joiner then dials from, DialCandidates), and
// returns the host's introduction. It asks again every 250ms until the
// introducer knows the host; it fails with ErrNoHost once ctx ends before
// that.
func Join(ctx context.Context, pc net.PacketConn, introducer, id string) (Introduction, error) {
	return JoinWith(ctx, pc, introducer, id, nil)
}

// JoinWith is Join with options (o may be nil): with o.Reflector, the
// joiner first learns whether pc's NAT maps each destination to a port
// of its own and tells the introducer (birthday.go).
func JoinWith(ctx context.Context, pc net.PacketConn, introducer, id string, o *IntroOptions) (Introduction, error) {
	if ctx == nil {
		return Introduction{}, errNilContext
	}
	if len(id) == 0 || len(id) > MaxIntroID {
		return Introduction{}, fmt.Errorf("knet: host ID of %d bytes: 1 to %d", len(id), MaxIntroID)
	}
	laddr, server, err := packetPeer(pc, introducer)
	if err != nil {
		return Introduction{}, err
	}
	hard, err := o.hard(ctx, func(ctx context.Context, at string) (netip.AddrPort, error) { return packetReflect(ctx, pc, at) }, introducer)
	if err != nil {
		return Introduction{}, err
	}
	flags := introFlagsOf(hard)
	var nonce [queryNonceSize]byte
	rand.Read(nonce[:])
	locals := localCandidates(laddr)
	ask := appendQueryDatagram(nil, introKindAsk, &nonce, appendIntroAsk(nil, introRoleJoin, nil, id, locals, flags), queryPadTo)
	var in Introduction
	heard := false
	err = askOver(ctx, pc, server, &ask, func(kind byte, got *[queryNonceSize]byte, body []byte) int {
		if kind != introKindAnswer || *got != nonce || len(body) < 1 {
			return askIgnore
		}
		heard = true
		switch body[0] {
		case introProve:
			ask = appendQueryDatagram(ask[:0], introKindAsk, &nonce, appendIntroAsk(nil, introRoleJoin, body[1:], id, locals, flags), queryPadTo)
			return askAgain
		case introIntroduced:
			var ok bool
			if in, ok = parseIntroduced(body[1:], &nonce, time.Now(), server); ok {
				in.introducer, in.id = server, id
				return askDone
			}
		}
		return askIgnore
	})
	if err != nil {
		if ctx.Err() != nil && !heard {
			err = fmt.Errorf("%w (%w)", ErrNoIntroducer, err)
		} else if ctx.Err() != nil {
			err = fmt.Errorf("%w (%w)", ErrNoHost, err)
		}
		return Introduction{}, fmt.Errorf("knet: join %q via %v: %w", id, server, err)
	}
	in.Hard = hard
	return in, nil
}

// Candidates returns the Listener's candidates for a game's own
// signalling (Signal): the address the knet server at reflector sees its
// socket as (Reflect), then its local addresses.
func (l *Listener) Candidates(ctx context.Context, reflector string) ([]netip.AddrPort, error) {
	seen, err := l.Reflect(ctx, reflector)
	if err != nil {
		return nil, err
	}
	laddr, _ := addrPortOf(l.Addr())
	return append([]netip.AddrPort{seen}, localCandidates(laddr)...), nil
}

// PacketCandidates returns a joiner's candidates for a game's own
// signalling (Signal), for pc, the socket it will dial from
// (DialCandidates): the address the knet server at reflector sees pc as
// (asked as Listener.Reflect asks, every 250ms until ctx ends), then its
// local addresses.
func PacketCandidates(ctx context.Context, pc net.PacketConn, reflector string) ([]netip.AddrPort, error) {
	if ctx == nil {
		return nil, errNilContext
	}
	seen, err := packetReflect(ctx, pc, reflector)
	if err != nil {
		return nil, err
	}
	laddr, _ := addrPortOf(pc.LocalAddr())
	return append([]netip.AddrPort{seen}, localCandidates(laddr)...), nil
}

// packetReflect is the address the knet server at reflector sees pc as.
func packetReflect(ctx context.Context, pc net.PacketConn, reflector string) (netip.AddrPort, error) {
	_, server, err := packetPeer(pc, reflector)
	if err != nil {
		return netip.AddrPort{}, err
	}
	ctx, cancel := context.WithTimeoutCause(ctx, queryTimeout, errQueryTimeout)
	defer cancel()
	var nonce [queryNonceSize]byte
	rand.Read(nonce[:])
	ask := appendQueryDatagram(nil, reflectKindAsk, &nonce, nil, queryPadTo)
	var seen netip.AddrPort
	err = askOver(ctx, pc, server, &ask, func(kind byte, got *[queryNonceSize]byte, body []byte) int {
		if kind != reflectKindAnswer || *got != nonce {
			return askIgnore
		}
		var ok bool
		if seen, ok = parseReflectBody(body, &nonce); ok {
			return askDone
		}
		return askIgnore
	})
	if err != nil {
		if ctx.Err() != nil {
			return netip.AddrPort{}, reflectError(ctx, server)
		}
		return netip.AddrPort{}, err
	}
	return seen, nil
}

// packetPeer is pc's own address and the server's at address, of pc's
// family.
func packetPeer(pc net.PacketConn, address string) (laddr, server netip.AddrPort, err error) {
	network := "udp"
	laddr, _ = addrPortOf(pc.LocalAddr())
	if laddr.Addr().Unmap().Is4() {
		network = "udp4"
	}
	server, err = resolveReflector(network, address)
	return laddr, server, err
}

// What askOver's take says of a datagram.
const (
	askIgnore = iota // not the answer
	askDone          // the answer: stop
	askAgain         // send the ask (changed) again at once
)

// askOver sends *ask to server over pc every 250ms until take accepts a
// query datagram from server (its kind, nonce and body), or ctx ends. It
// leaves pc with no read deadline.
func askOver(ctx context.Context, pc net.PacketConn, server netip.AddrPort, ask *[]byte, take func(kind byte, nonce *[queryNonceSize]byte, body []byte) int) error {
	defer pc.SetReadDeadline(time.Time{})
	buf := make([]byte, 2048)
	to := net.UDPAddrFromAddrPort(server)
asking:
	for {
		if _, err := pc.WriteTo(*ask, to); err != nil {
			return err
		}
		pc.SetReadDeadline(time.Now().Add(introJoinResend))
		for {
			if err := ctx.Err(); err != nil {
				return err
			}
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				var ne net.Error
				if errors.As(err, &ne) && ne.Timeout() {
					break
				}
				return err
			}
			f, _ := addrPortOf(from)
			kind, nonce, body, ok := parseQueryDatagram(buf[:n])
			if !ok || unmap(f) != server {
				continue
			}
			switch take(kind, &nonce, body) {
			case askDone:
				return nil
			case askAgain:
				continue asking
			}
		}
	}
}

// Punch opens the Listener's NAT toward a joiner: from in.Start, it sends
// a probe (20 bytes, carrying in.Token) to each of in.Peer every 50ms, for
// at most 2s, and stops sooner once the answer by which the joiner says
// it found a path reaches it (not at the joiner's first probe: the
// joiner may be waiting for the answer to it, which may be lost).
// While it runs, the Listener answers the joiner's probes carrying the
// token (each no larger than the probe, at the rates of every answer to
// an address without a connection), so that the joiner learns which
// candidate of the host's gets through. The joiner's connection is then
// accepted as any other (AcceptConn). If in offers a relay (Relay), the
// Listener also binds to it from the start, so that a joiner who finds no
// direct path connects through it, and, if secure, goes on probing the
// joiner while relayed (relay.go). It returns nil once its probes are
// sent, or ctx's error, or net.ErrClosed.
func (l *Listener) Punch(ctx context.Context, in Introduction) error {
	if ctx == nil {
		return errNilContext
	}
	direct := false // the joiner's word that it found a path came
	if in.Relay.IsValid() && in.Relay.Port() != 0 {
		// Bound to the relay from now, in case no probe gets through
		// (relay.go); told at the end whether one did.
		punched := make(chan bool, 1)
		defer func() { punched <- direct }()
		go l.relayHost(in, punched)
	}
	if in.relayFirst > 0 {
		return nil
	}
	seen := make(chan struct{}, 1)
	l.punch.mu.Lock()
	if l.punch.tokens == nil {
		l.punch.tokens = make(map[[8]byte]chan struct{})
	}
	l.punch.tokens[in.Token] = seen
	l.punch.recount()
	l.punch.mu.Unlock()
	if in.Repunch != nil {
		defer l.punch.re.expect(in.Token, in.Repunch)()
	}
	defer func() {
		l.punch.mu.Lock()
		if l.punch.tokens[in.Token] == seen {
			delete(l.punch.tokens, in.Token)
		}
		l.punch.recount()
		l.punch.mu.Unlock()
	}()
	probe := appendQueryDatagram(nil, punchKindProbe, &in.Token, nil, 0)
	t := time.NewTimer(time.Until(in.Start))
	defer t.Stop()
	sent, heard := false, false
	spray := newBirthdaySpray(in) // nil unless the joiner alone is hard
	fan := l.openHostFan(in)      // nil unless the host alone is hard
	defer fan.close()
	for round := 0; round < punchRounds; {
		select {
		case <-t.C:
			for _, c := range in.Peer {
				l.eps[0].write(probe, c)
			}
			spray.round(func(to netip.AddrPort) { l.eps[0].write(probe, to) })
			fan.round(round)
			sent = true
			round++
			if heard {
				direct = true
				return nil
			}
			t.Reset(punchInterval)
		case hit := <-fan.hits():
			fan.take(hit)
		case <-seen:
			if sent {
				direct = true
				return nil // the joiner found a path after our probes went out
			}
			heard = true
		case <-l.closed:
			return net.ErrClosed
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// DialCandidates connects over pc to a host whose candidates (and the
// token of its Punch) in tells: from in.Start it probes each candidate
// every 50ms, for at most 2s, and dials (DialPacket) the first address a
// probe or an answer carrying the token comes from: the host's
// candidate that answered, or the address a host's probe came from (the
// port its NAT chose for this joiner). pc should be the socket Join
// asked from. If nothing came in time and in offers a relay (Relay), it
// connects through the relay instead (relay.go: Conn.Route says
// RouteRelayed), and a secure connection keeps probing and moves to a
// direct path when one opens; it fails with ErrRelayRefused if the relay
// refused. Without a relay it fails with ErrNoDirectPath. As with
// DialPacket, the Conn owns pc, which is closed if DialCandidates fails.
//
// A Conn made from Join's introduction re-punches through the same
// introducer when nothing came from the host for two keepalive
// intervals (a NAT forgot the mapping), and moves to where the host is
// found (repunch.go). Its pings hold the NATs' mappings while they come
// more often than the NATs forget: set Config.PingInterval below the
// shortest NAT timeout on the path (5 s by default).
func DialCandidates(ctx context.Context, pc net.PacketConn, in Introduction, cfg *Config) (*Conn, error) {
	if ctx == nil {
		return nil, errNilContext
	}
	var to netip.AddrPort
	var err error
	if in.Hard && !in.PeerHard {
		pc, to, err = probeBirthday(ctx, pc, in, openBeside(pc))
	} else {
		to, err = probeCandidates(ctx, pc, in)
	}
	if errors.Is(err, ErrNoDirectPath) && in.Relay.IsValid() {
		return dialRelayed(ctx, pc, in, cfg) // relay.go
	}
	if err != nil {
		pc.Close()
		return nil, err
	}
	c, err := DialPacket(ctx, pc, to.String(), cfg)
	if err == nil && in.introducer.IsValid() {
		c.armRepunch(in) // repunch.go
	}
	return c, err
}

// probeCandidates is DialCandidates' probing: the address to dial.
func probeCandidates(ctx context.Context, pc net.PacketConn, in Introduction) (netip.AddrPort, error) {
	if len(in.Peer) == 0 {
		return netip.AddrPort{}, fmt.Errorf("knet: dial candidates: none given: %w", ErrNoDirectPath)
	}
	if in.relayFirst > 0 {
		return netip.AddrPort{}, fmt.Errorf("knet: dial candidates: relayed first (a test's): %w", ErrNoDirectPath)
	}
	defer pc.SetReadDeadline(time.Time{})
	probe := appendQueryDatagram(nil, punchKindProbe, &in.Token, nil, queryPadTo)
	buf := make([]byte, 2048)
	if d := time.Until(in.Start); d > 0 {
		select {
		case <-time.After(d):
		case <-ctx.Done():
			return netip.AddrPort{}, ctx.Err()
		}
	}
	spray := newBirthdaySpray(in) // nil unless the host alone is hard
	small := appendQueryDatagram(nil, punchKindProbe, &in.Token, nil, 0)
	for range punchRounds {
		for _, c := range in.Peer {
			pc.WriteTo(probe, net.UDPAddrFromAddrPort(c)) // an unreachable candidate is no error
		}
		spray.round(func(to netip.AddrPort) { pc.WriteTo(small, net.UDPAddrFromAddrPort(to)) })
		pc.SetReadDeadline(time.Now().Add(punchInterval))
		for {
			if err := ctx.Err(); err != nil {
				return netip.AddrPort{}, err
			}
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				var ne net.Error
				if errors.As(err, &ne) && ne.Timeout() {
					break
				}
				if errors.Is(err, net.ErrClosed) {
					return netip.AddrPort{}, err
				}
				continue // an ICMP error of an unreachable candidate, say
			}
			kind, token, _, ok := parseQueryDatagram(buf[:n])
			if ok && (kind == punchKindProbe || kind == punchKindAnswer) && token == in.Token {
				f, ok := addrPortOf(from)
				if ok {
					to := unmap(f)
					tellFound(pc, to, &in.Token)
					return to, nil
				}
			}
		}
	}
	return netip.AddrPort{}, fmt.Errorf("knet: dial %d candidates for %v: %w", len(in.Peer), time.Duration(punchRounds)*punchInterval, ErrNoDirectPath)
}
