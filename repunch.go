package knet

import (
	"context"
	"crypto/rand"
	"errors"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"
)

// Re-punching (issue 35): a NAT mapping that expires mid-game. A
// connection's pings hold the mappings of both NATs while they come more
// often than the NATs forget (Config.PingInterval, 5 s by default, under
// the 30 s of the shortest common UDP timeouts). When a mapping goes
// anyway (a router restarted, or forgot sooner), what one side sends
// next leaves from a new public port (a symmetric NAT's), or is dropped
// by a NAT that no longer knows the flow, and the path goes silent.
//
// The joiner's Conn, made by DialCandidates from Join's introduction,
// remembers the introducer, the ID and the token of its first punch (the
// tie). When nothing new came from the host for two keepalive intervals,
// it asks the introducer again, naming the tie (kind 15); the introducer
// tells the host, at its next poll (its Host loop, which a host keeps
// running while it hosts), with a new token and the joiner's candidates
// (kind 16), and both punch as they did the first time (the host with
// Listener.Punch, given Introduction.Repunch: the connection the tie
// names). The connection then goes on over the new path, the same Conn
// on both sides:
//
//   - The joiner moves to the address a probe or answer carrying the new
//     token came from (the host's new port), as DialCandidates dials the
//     first time.
//   - The host moves a plaintext connection to the address the joiner's
//     probe carrying the new token came from. A secure one is moved only
//     by migration (migration.go): a sealed datagram from the new address
//     and a path check.
//
// The token is the proof of a new address: 64 random bits that only the
// introducer, the host and the joiner know (an on-path observer of a
// plaintext game sees it, as it sees everything else). A host re-punches
// only for a tie one of its connections was punched with, toward the
// candidates the introducer gave.

const (
	repunchKindAsk    = 15 // a joiner's re-punch ask to an introducer
	repunchKindAnswer = 16 // an introducer's answer to it, and its word to the host

	// repunchSilence is how many keepalive intervals a joiner hears
	// nothing new from the host before it re-punches.
	repunchSilence = 2
)

// The tie is the token of the first punch: the first 8 bytes of a kind
// 15 ask's body and of a kind 16 answer's introduced body.
const tieSize = 8

// repunchHost is a Listener's side: which of its connections came by
// which punch, and the re-punches running.
type repunchHost struct {
	n atomic.Int32 // len(heard)+len(moving): the reader looks no further while 0

	mu     sync.Mutex
	heard  map[netip.AddrPort]heardProbe // a joiner's address, by the token of its punch
	ties   map[[8]byte]*Conn             // established connections, by the token of their punch
	moving map[[8]byte]*Conn             // a re-punch's token: the connection it is for
	moveTo map[*Conn]netip.AddrPort      // plaintext connections a re-punch moves, for their rounds
	toMove atomic.Int32                  // len(moveTo): a round looks no further while 0

	unknown atomic.Uint64 // re-punch introductions naming no connection of ours
	moves   atomic.Uint64 // plaintext connections moved by a re-punch
}

type heardProbe struct {
	token [8]byte
	at    time.Time
}

func (r *repunchHost) recount() {
	r.n.Store(int32(len(r.heard) + len(r.moving)))
}

// heardFrom notes a probe or answer carrying token, of one of the
// Listener's Punch calls running, from addr, which has no connection
// here: the connection that comes from addr next was punched with token
// (tie), and a plaintext connection being re-punched with token moves to
// addr.
func (r *repunchHost) heardFrom(token [8]byte, addr netip.AddrPort, now time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if c, ok := r.moving[token]; ok {
		if c.sec == nil {
			if r.moveTo == nil {
				r.moveTo = make(map[*Conn]netip.AddrPort)
			}
			r.moveTo[c] = addr
			r.toMove.Store(int32(len(r.moveTo)))
			c.kick()
		}
		return // a re-punch's: no new connection comes by it
	}
	if r.heard == nil {
		r.heard = make(map[netip.AddrPort]heardProbe)
	}
	for a, h := range r.heard {
		if now.Sub(h.at) > introHostTTL {
			delete(r.heard, a) // no connection came
		}
	}
	r.heard[addr] = heardProbe{token: token, at: now}
	r.recount()
}

// tie notes that c, being established, came from an address a punch was
// heard from, under that punch's token.
func (r *repunchHost) tie(c *Conn) {
	if r.n.Load() == 0 {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	h, ok := r.heard[c.raddr]
	if !ok {
		return
	}
	delete(r.heard, c.raddr)
	if r.ties == nil {
		r.ties = make(map[[8]byte]*Conn)
	}
	for t, o := range r.ties {
		if o.isClosed() {
			delete(r.ties, t)
		}
	}
	r.ties[h.token] = c
	r.recount()
}

// tied is the live connection punched with tie, or nil.
func (r *repunchHost) tied(tie [8]byte) *Conn {
	r.mu.Lock()
	defer r.mu.Unlock()
	c := r.ties[tie]
	if c != nil && c.isClosed() {
		delete(r.ties, tie)
		return nil
	}
	return c
}

// expect makes a probe or answer carrying token, a re-punch's, move c to
// where it came from if c is plaintext (migration moves a secure one),
// until the returned func is called.
func (r *repunchHost) expect(token [8]byte, c *Conn) func() {
	r.mu.Lock()
	if r.moving == nil {
		r.moving = make(map[[8]byte]*Conn)
	}
	r.moving[token] = c
	r.recount()
	r.mu.Unlock()
	return func() {
		r.mu.Lock()
		delete(r.moving, token)
		r.recount()
		r.mu.Unlock()
	}
}

// repunchIntroduced reads an introducer's kind 16 answer to a Host
// call's ask (status first): an introduction for a connection of ours to
// re-punch. It is false, and counted, for a tie that names none.
func (l *Listener) repunchIntroduced(b []byte, nonce *[queryNonceSize]byte, introducer netip.AddrPort) (Introduction, bool) {
	if len(b) < 1+tieSize || b[0] != introIntroduced {
		return Introduction{}, false
	}
	in, ok := parseIntroduced(b[1+tieSize:], nonce, time.Now(), introducer)
	if !ok {
		return Introduction{}, false
	}
	c := l.punch.re.tied([8]byte(b[1 : 1+tieSize]))
	if c == nil {
		l.punch.re.unknown.Add(1)
		return Introduction{}, false
	}
	in.Repunch = c
	return in, true
}

// takeMove moves the connection where a re-punch found its peer, if
// one did: a joiner's re-punch, or the host's for a plaintext
// connection. The round calls it.
func (c *Conn) takeMove(now time.Time) {
	var p *netip.AddrPort
	if rp := c.ep.repunch.Load(); rp != nil {
		p = rp.move.Swap(nil)
	} else if l := c.ep.l; l != nil && l.punch.re.toMove.Load() > 0 {
		r := &l.punch.re
		r.mu.Lock()
		if to, ok := r.moveTo[c]; ok {
			p = &to
			delete(r.moveTo, c)
			r.toMove.Store(int32(len(r.moveTo)))
		}
		r.mu.Unlock()
	}
	if p == nil || *p == c.raddr || c.isClosed() {
		return
	}
	c.takeAddr(*p)
	c.sess.moved(now)
	if c.ep.l != nil {
		c.ep.l.punch.re.moves.Add(1)
	} else if rp := c.ep.repunch.Load(); rp != nil {
		rp.moves.Add(1)
	}
	if l := c.cfg.logger; l != nil {
		l.Info("knet: connection re-punched", "remote", *p)
	}
}

// joinRepunch is a joiner's connection's re-punching: what it needs to
// ask the introducer again, and what the socket's reader hands it.
type joinRepunch struct {
	c          *Conn
	introducer netip.AddrPort
	id         string
	tie        [8]byte

	heard atomic.Int64                   // the session's lastRecv, UnixNano, as each round publishes it
	move  atomic.Pointer[netip.AddrPort] // where the host was found, for the round

	// While a re-punch runs (active): the nonce of its asks, the token
	// of its probes once introduced, and where the reader hands what
	// carries them.
	active  atomic.Bool
	mu      sync.Mutex
	nonce   [queryNonceSize]byte
	token   [8]byte
	probing bool
	answers chan []byte         // the introducer's kind 16 bodies
	found   chan netip.AddrPort // where a probe or answer with the token came from

	attempts, moves atomic.Uint64
}

// armRepunch makes c, a joiner's connection from DialCandidates,
// re-punch through the introducer that introduced it when its path goes
// silent.
func (c *Conn) armRepunch(in Introduction) {
	rp := &joinRepunch{
		c:          c,
		introducer: in.introducer,
		id:         in.id,
		tie:        in.Token,
		answers:    make(chan []byte, 4),
		found:      make(chan netip.AddrPort, 1),
	}
	rp.heard.Store(time.Now().UnixNano())
	c.ep.repunch.Store(rp)
	go rp.watch()
}

// take is the socket reader's: it takes, while a re-punch runs, the
// introducer's answers to it and the probes and answers carrying its
// token, from any address, and reports whether it took b.
func (rp *joinRepunch) take(from netip.AddrPort, b []byte) bool {
	if !rp.active.Load() {
		return false
	}
	kind, nonce, body, ok := parseQueryDatagram(b)
	if !ok {
		return false
	}
	rp.mu.Lock()
	defer rp.mu.Unlock()
	switch kind {
	case repunchKindAnswer:
		if from != rp.introducer || nonce != rp.nonce || len(body) < 1 {
			return false
		}
		select {
		case rp.answers <- append([]byte(nil), body...):
		default:
		}
		return true
	case punchKindProbe, punchKindAnswer:
		if !rp.probing || [8]byte(nonce) != rp.token {
			return false
		}
		select {
		case rp.found <- from:
		default:
		}
		return true
	}
	return false
}

// watch re-punches whenever the host has been silent for repunchSilence
// keepalive intervals, until the connection ends.
func (rp *joinRepunch) watch() {
	c := rp.c
	every := c.cfg.keepalive()
	t := time.NewTicker(max(every/2, 10*time.Millisecond))
	defer t.Stop()
	var ended time.Time
	for {
		select {
		case <-c.done:
			return
		case <-t.C:
		}
		// Silent since the host was last heard, or since the last
		// re-punch ended (the path it found needs a moment to carry).
		quiet := time.Unix(0, rp.heard.Load())
		if ended.After(quiet) {
			quiet = ended
		}
		if !c.isEstablished() || time.Since(quiet) < repunchSilence*every {
			continue
		}
		// Within what is left of the connection's life: it ends at the
		// lost timeout, and the re-punch with it.
		ctx, cancel := context.WithTimeout(context.Background(), c.cfg.lostTimeout)
		go func() {
			select {
			case <-c.done:
				cancel()
			case <-ctx.Done():
			}
		}()
		rp.repunch(ctx)
		cancel()
		ended = time.Now()
	}
}

// errRepunchAnswer is a re-punch ask the introducer did not answer in
// time.
var errRepunchAnswer = errors.New("knet: re-punch: no introduction")

// repunch asks the introducer for a new introduction to the host and
// probes as DialCandidates does, then moves the connection where the
// host was found. It returns once found, or ctx ends, or the probing
// budget is spent.
func (rp *joinRepunch) repunch(ctx context.Context) error {
	c := rp.c
	rp.attempts.Add(1)
	var nonce [queryNonceSize]byte
	rand.Read(nonce[:])
	rp.mu.Lock()
	rp.nonce, rp.probing = nonce, false
	rp.mu.Unlock()
	rp.active.Store(true)
	defer rp.active.Store(false)

	laddr, _ := addrPortOf(c.ep.sock.LocalAddr())
	locals := localCandidates(laddr)
	ask := func(cookie []byte) []byte {
		body := append(rp.tie[:len(rp.tie):len(rp.tie)], appendIntroAsk(nil, introRoleJoin, cookie, rp.id, locals, 0)...)
		return appendQueryDatagram(nil, repunchKindAsk, &nonce, body, queryPadTo)
	}
	d := ask(nil)
	t := time.NewTicker(introJoinResend)
	defer t.Stop()
	var in Introduction
asking:
	for {
		c.ep.write(d, rp.introducer)
	wait:
		select {
		case b := <-rp.answers:
			switch b[0] {
			case introProve:
				d = ask(b[1:])
				continue asking
			case introIntroduced:
				var ok bool
				if len(b) >= 1+tieSize {
					in, ok = parseIntroduced(b[1+tieSize:], &nonce, time.Now(), rp.introducer)
				}
				if ok {
					break asking
				}
			}
			goto wait
		case <-t.C:
		case <-ctx.Done():
			return errRepunchAnswer
		}
	}

	// Probe the host's candidates and where it was, from the start.
	rp.mu.Lock()
	rp.token, rp.probing = in.Token, true
	rp.mu.Unlock()
	if r := c.remote.Load(); r != nil {
		in.Peer = append(in.Peer, unmap(r.AddrPort()))
	}
	probe := appendQueryDatagram(nil, punchKindProbe, &in.Token, nil, queryPadTo)
	timer := time.NewTimer(time.Until(in.Start))
	defer timer.Stop()
	for round := 0; ; round++ {
		select {
		case <-timer.C:
		case to := <-rp.found:
			found := appendQueryDatagram(nil, punchKindAnswer, &in.Token, nil, 0)
			for range 2 {
				c.ep.write(found, to)
			}
			rp.move.Store(&to)
			c.kick()
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
		if round == punchRounds {
			return ErrNoDirectPath // the last round's answers had their time
		}
		for _, p := range in.Peer {
			c.ep.write(probe, p)
		}
		timer.Reset(punchInterval)
	}
}

// heardNow publishes when the session last heard the host, for watch.
// The round calls it.
func (rp *joinRepunch) heardNow(last time.Time) {
	rp.heard.Store(last.UnixNano())
}

func sameTie(a, b *[8]byte) bool {
	return a == nil && b == nil || a != nil && b != nil && *a == *b
}
