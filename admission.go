package knet

import (
	"bytes"
	"errors"
	"hash/maphash"
	"net/netip"
	"runtime"
	"time"
)

// A secure listener's admission of a ConnectSyn, before it allocates
// anything for the attempt (handleNew). The socket's reader does only
// what is cheap: parsing, the padding rule, the listener's state, the
// cookie under load, whether the handshake message already cost a key
// exchange, the source's rate. The key exchange (reading the Noise
// message: an X25519, 70 to 170 µs on the 2-core test machine) and the
// token check run on a small pool of handshake workers, which make the
// connection; the reader, which every connection on the socket waits
// behind, never runs one. What the listener sends to an unproven address
// is never more bytes than the ConnectSyn's datagram. See SECURE.md
// ("Stateless cookies").

const (
	// maxHandshakeQueue bounds the attempts waiting for a handshake
	// worker (each holds its datagram's buffer, 2 KiB); more are dropped
	// and counted (ListenerStats.DroppedHandshakes). A full queue is
	// some tens of milliseconds of the workers' time.
	maxHandshakeQueue = 256
	// maxSeenHandshakes bounds the handshake messages a listener
	// remembers having key-exchanged (seenHandshakes): at most about
	// 4 MiB, allocated as used.
	maxSeenHandshakes = 1 << 16
	// sourceRate and sourceBurst are the key exchanges a source IP
	// address (an IPv6 /64) may cost a listener: sourceRate a second, in
	// bursts of sourceBurst. One address so gets at most a tenth of a
	// core or so; 256 clients behind one NAT may join at once, 1,000 a
	// second after that (a client over the limit sends its ConnectSyn
	// again on its timer, 200 ms later and then more slowly): the bench's
	// 5,000 secure clients dialing from 127.0.0.1, 32 at a time, take
	// 5 s at least (here the key exchanges are as slow anyway).
	sourceRate  = 1000
	sourceBurst = 256
	// sourceBuckets is the size of the table of rate limits (16 bytes
	// each): addresses share a bucket when their keyed hashes collide.
	sourceBuckets = 4096
)

// handshakeJob is an attempt waiting for its key exchange.
type handshakeJob struct {
	ep   *endpoint
	addr netip.AddrPort
	p    *packet
	msg1 []byte // the Noise message, in p
	h    uint64 // its hash (seenHandshakes)
}

// handshakes is a secure listener's admission state: the handshake queue
// and its workers, the handshake messages key-exchanged lately, the rate
// limits by source. Guarded by the Listener's mu, but seed.
type handshakes struct {
	seed       maphash.Seed
	queue      []handshakeJob
	busy       map[netip.AddrPort]bool // the addresses of the jobs queued or running
	active     int                     // jobs queued or running
	workers    int
	maxWorkers int
	maxQueue   int
	seen       seenHandshakes
	sources    sourceLimiter
	// conns are the connections made and not yet established, by the
	// hash of their handshake message: a copy of it from elsewhere goes
	// to its connection (repeated).
	conns map[uint64]*Conn
}

func newHandshakes(window time.Duration) handshakes {
	return handshakes{
		seed:       maphash.MakeSeed(),
		busy:       make(map[netip.AddrPort]bool),
		maxWorkers: runtime.GOMAXPROCS(0),
		maxQueue:   maxHandshakeQueue,
		seen:       newSeenHandshakes(maxSeenHandshakes, window, time.Now()),
		sources:    newSourceLimiter(sourceBuckets, sourceRate, sourceBurst, time.Now()),
	}
}

// seenWindow is how long a listener remembers a handshake message it
// key-exchanged: as long as a cookie for it is good, or the listener's
// ConnectTimeout if longer (how long its connection may wait).
func seenWindow(cfg *config) time.Duration {
	return max(cookieLifetime+2*time.Second, cfg.connectTimeout)
}

// admitSecure decides on a ConnectSyn p from addr, a new address, for a
// secure listener, and takes p: it answers (a cookie, a refusal), drops
// or ignores the attempt, having kept nothing, or queues it for a
// handshake worker (handshake), which makes the connection.
func (l *Listener) admitSecure(ep *endpoint, addr netip.AddrPort, p *packet) {
	b := p.b
	l.unprovenIn.Add(uint64(len(b)))
	var content []byte
	var hd header
	scanDatagram(b, &hd, func(m message) {
		if content == nil && !m.fragment && m.id == idConnectSyn {
			content = m.payload
		}
	})
	cookie, msg1, ok := splitSecureSyn(content)
	switch {
	case !ok:
		l.refuseUnproven(ep, addr, b, ErrHandshakeFailed.Error(), true)
		ep.putPacket(p)
		return
	case len(b) < synPadTo:
		// A secure client pads its ConnectSyn to synPadTo: a shorter
		// one gets neither a key exchange nor an answer.
		ep.invalid.Add(1)
		ep.putPacket(p)
		return
	}
	h := maphash.Bytes(l.hs.seed, msg1)
	now := time.Now()
	l.mu.Lock()
	if l.closing || len(l.pending)+l.hs.active >= l.cfg.maxPending {
		l.mu.Unlock()
		ep.ignored.Add(1)
		ep.putPacket(p)
		return
	}
	if l.hs.busy[addr] {
		// Sent again while its handshake is under way: the worker
		// answers the first.
		l.mu.Unlock()
		ep.putPacket(p)
		return
	}
	prev, seen := l.hs.seen.find(h, now)
	load := len(l.pending) + l.hs.active + l.load.recent(now)
	l.mu.Unlock()
	if seen {
		if !l.repeated(ep, addr, p, prev, h) {
			ep.putPacket(p)
		}
		return
	}
	if load >= l.cfg.cookieThreshold && !(len(cookie) > 0 && l.cookies.check(cookie, addr, msg1, now)) {
		var c [cookieSize]byte
		var buf [64]byte
		l.sendUnproven(ep, addr, b, appendRetry(buf[:0], l.cookies.appendCookie(c[:0], addr, msg1, now)))
		l.cookiesSent.Add(1)
		ep.putPacket(p)
		return
	}
	l.mu.Lock()
	switch {
	case l.closing:
		ep.ignored.Add(1)
	case l.hs.busy[addr]:
	case l.hs.seen.has(h, now):
		// The same message from another socket's reader, meanwhile.
		l.replayedHandshakes.Add(1)
	case len(l.hs.queue) >= l.hs.maxQueue:
		l.droppedHandshakes.Add(1)
	case !l.hs.sources.allow(addr.Addr(), now):
		l.rateLimited.Add(1)
	default:
		l.hs.seen.add(h, now)
		l.hs.busy[addr] = true
		l.hs.active++
		l.hs.queue = append(l.hs.queue, handshakeJob{ep: ep, addr: addr, p: p, msg1: msg1, h: h})
		if l.hs.workers < l.hs.maxWorkers {
			l.hs.workers++
			l.startHandshakeWorker()
		}
		l.mu.Unlock()
		return
	}
	l.mu.Unlock()
	ep.putPacket(p)
}

// repeated answers an attempt whose handshake message already cost a key
// exchange lately (prev), and reports whether it took p: never another
// key exchange. If that one failed (the message was not for our key, the
// token was bad, the connection was refused), the refusal goes again,
// statelessly. If its connection is still being made, from another
// address, p goes to it (Conn.answerSynElsewhere): whoever got the
// message there first, a replay or the client itself, the client's copy
// is answered where it is, and the client can open the connection (a move
// follows, by a path check). Otherwise (made, or gone) it is dropped.
func (l *Listener) repeated(ep *endpoint, addr netip.AddrPort, p *packet, prev seenHandshake, h uint64) bool {
	l.replayedHandshakes.Add(1)
	if prev.failed {
		l.refuseUnproven(ep, addr, p.b, prev.reason, false)
		return false
	}
	l.mu.Lock()
	c := l.hs.conns[h]
	l.mu.Unlock()
	if c == nil {
		return false
	}
	c.push(p)
	return true
}

// handshakeWorker runs queued key exchanges until the queue is empty or
// the listener closes (Listener.startHandshakeWorker starts it).
func (l *Listener) handshakeWorker() {
	defer l.workers.Done()
	for {
		l.mu.Lock()
		if len(l.hs.queue) == 0 || l.closing {
			l.hs.workers--
			l.mu.Unlock()
			return
		}
		j := l.hs.queue[0]
		l.hs.queue[0] = handshakeJob{}
		l.hs.queue = l.hs.queue[1:]
		l.mu.Unlock()
		l.handshake(j)
	}
}

// handshake reads an attempt's Noise message (the key exchange) and
// checks its token, then makes its connection, or refuses it.
func (l *Listener) handshake(j handshakeJob) {
	if hook := l.keyExchangeHook.Load(); hook != nil {
		(*hook)()
	}
	now := time.Now()
	sec, err := newServerSecure(l.cfg.privateKey, l.cfg.publicKey)
	if err == nil {
		sec.tap = l.cfg.sealTap
		var inner []byte
		inner, err = sec.readSyn(j.msg1)
		l.keyExchanges.Add(1)
		if err == nil {
			err = l.checkSynPayload(sec, inner, now)
		}
	}
	if err != nil {
		if errors.Is(err, ErrTokenRejected) {
			l.rejectedTokens.Add(1)
		}
		l.mu.Lock()
		l.hs.active--
		l.load.failed(now)
		l.hs.seen.fail(j.h, err.Error())
		delete(l.hs.busy, j.addr)
		l.mu.Unlock()
		l.refuseUnproven(j.ep, j.addr, j.p.b, err.Error(), true)
		j.ep.putPacket(j.p)
		return
	}
	// Kept, so that the connection knows the client's ConnectSyn when it
	// comes again.
	sec.msg1 = bytes.Clone(j.msg1)
	l.startSecure(j, sec)
}

// endAttempt forgets c, a connection that ended (why: err), from the
// pending ones. The handshake message of a secure attempt that was
// refused is left failed, with the refusal's reason (none with Stealth),
// so that the client's ConnectSyn, if it comes again, is refused again;
// one that timed out is forgotten: it may come again, at the cost of a
// new key exchange, as a new one would.
func (l *Listener) endAttempt(c *Conn, err error, reason []byte) {
	l.mu.Lock()
	if l.pending[c] {
		delete(l.pending, c)
		l.dropAttempt(c)
		if errors.Is(err, errWrongProof) {
			c.ep.invalid.Add(1) // its proof named nothing sent to its address
		}
		if c.sec != nil && c.sec.msg1 != nil {
			h := maphash.Bytes(l.hs.seed, c.sec.msg1)
			if errors.Is(err, ErrRefused) {
				if r, ok := splitRefusalProof(reason, c.sec.msg1); ok {
					reason = r // refuseUnproven proves each refusal again
				}
				l.hs.seen.fail(h, string(reason))
			} else {
				l.hs.seen.forget(h)
			}
		}
	}
	l.mu.Unlock()
}

// dropAttempt forgets c as a connection being made (handshakes.conns);
// l.mu is held.
func (l *Listener) dropAttempt(c *Conn) {
	if c.sec == nil || c.sec.msg1 == nil {
		return
	}
	if h := maphash.Bytes(l.hs.seed, c.sec.msg1); l.hs.conns[h] == c {
		delete(l.hs.conns, h)
	}
}

// checkSynPayload splits the payload of the client's Noise message into
// the token, which it checks when the listener takes tokens, and the
// ConnectPayload.
func (l *Listener) checkSynPayload(sec *secureState, inner []byte, now time.Time) error {
	token, payload, ok := splitSynPayload(inner)
	if !ok {
		return ErrHandshakeFailed
	}
	sec.payload = payload
	if l.tokens == nil {
		return nil // a token is ignored where none is asked for
	}
	t, id, err := l.tokens.check(token, now)
	sec.token, sec.tokenID = t, id
	return err
}

// useToken marks the connect token of c, a server's connection being
// established, as used, and reports whether it may be: a token is checked
// at admission but used only here, once the client proved it holds the
// session's keys, so that an attempt that never completes does not burn
// it. Another attempt with the same token may have completed first: c is
// then refused, counted as a rejected token.
func (l *Listener) useToken(c *Conn) bool {
	if l.tokens == nil || c.sec == nil || c.sec.token == nil {
		return true
	}
	err := l.tokens.use(c.sec.tokenID, c.sec.token.Expires.Unix(), time.Now().Unix())
	if err == nil {
		return true
	}
	l.rejectedTokens.Add(1)
	c.ep.refused.Add(1)
	if lg := l.cfg.logger; lg != nil {
		lg.Info("knet: connection refused", "remote", c.remote.Load(), "reason", err)
	}
	return false
}

// refuseUnproven refuses an attempt from an address not proven to be the
// sender, keeping nothing: a DisconnectAck saying why, or without the
// reason if that would make it larger than what came (it cannot with a
// ConnectSyn padded to 1200 bytes), or nothing with Stealth. log says
// whether the Logger hears of it (not of refusals sent again).
func (l *Listener) refuseUnproven(ep *endpoint, addr netip.AddrPort, in []byte, why string, log bool) {
	ep.refused.Add(1)
	if lg := l.cfg.logger; lg != nil && log {
		lg.Info("knet: connection refused", "remote", addr, "reason", why)
	}
	if l.cfg.stealth {
		return
	}
	// A secure ConnectSyn's refusal proves it answers it (appendRefusalProof, splitRefusalProof).
	msg1 := secureSynMsg1(in)
	var buf [16 + MaxReasonLength + refusalProofSize]byte
	d := appendHeader(buf[:0], &header{})
	d = appendMessage(d, &message{id: idDisconnectAck, payload: appendRefusalProof(reasonBytes(why), msg1)})
	if len(d) > len(in) {
		d = appendMessage(appendHeader(buf[:0], &header{}), &message{id: idDisconnectAck, payload: appendRefusalProof(nil, msg1)})
	}
	l.sendUnproven(ep, addr, in, d)
}

// sendUnproven sends d to addr in answer to the datagram in, unless d is
// larger (anti-amplification: an address that never answered gets no more
// bytes than it sent).
func (l *Listener) sendUnproven(ep *endpoint, addr netip.AddrPort, in, d []byte) {
	if len(d) > len(in) {
		return
	}
	l.unprovenOut.Add(uint64(len(d)))
	ep.write(d, addr)
}

// seenHandshakes remembers the handshake messages (Noise message 1, by a
// keyed 64-bit hash) a listener key-exchanged in the last window, and
// whether that failed and why: a message costs at most one key exchange
// in that time, however often it comes, from wherever (a cookie, which
// binds it, is so good for one handshake). Entries are kept in the order
// they came, in a ring of at most max; when it is full the oldest goes,
// live or not: a message so forgotten may cost one more key exchange, but
// only after max newer ones did. Not safe for concurrent use.
type seenHandshakes struct {
	index  map[uint64]int32 // hash -> its entry in ring
	ring   []seenHandshake
	next   int // the oldest entry, once the ring is full
	max    int
	window time.Duration
	base   time.Time // what entries' times count from
}

// seenHandshake is an entry of seenHandshakes: 40 bytes.
type seenHandshake struct {
	h      uint64
	at     time.Duration // since base
	failed bool
	reason string // the refusal's, if failed (empty: none)
}

func newSeenHandshakes(max int, window time.Duration, now time.Time) seenHandshakes {
	return seenHandshakes{index: make(map[uint64]int32), max: max, window: window, base: now}
}

// find returns the entry of the message whose hash is h, if it came in the
// window before now.
func (s *seenHandshakes) find(h uint64, now time.Time) (seenHandshake, bool) {
	i, ok := s.index[h]
	if !ok || now.Sub(s.base)-s.ring[i].at > s.window {
		return seenHandshake{}, false
	}
	return s.ring[i], true
}

func (s *seenHandshakes) has(h uint64, now time.Time) bool {
	_, ok := s.find(h, now)
	return ok
}

// add records the message whose hash is h, key-exchanged from now.
func (s *seenHandshakes) add(h uint64, now time.Time) {
	e := seenHandshake{h: h, at: now.Sub(s.base)}
	if len(s.ring) < s.max {
		s.ring = append(s.ring, e)
		s.index[h] = int32(len(s.ring) - 1)
		return
	}
	if old := s.ring[s.next].h; s.index[old] == int32(s.next) {
		delete(s.index, old)
	}
	s.ring[s.next] = e
	s.index[h] = int32(s.next)
	s.next = (s.next + 1) % s.max
}

// fail records that the key exchange of the message whose hash is h, or
// its connection, failed, and the reason a refusal gives.
func (s *seenHandshakes) fail(h uint64, reason string) {
	if i, ok := s.index[h]; ok {
		s.ring[i].failed = true
		s.ring[i].reason = reason
	}
}

// forget forgets the message whose hash is h: it may be key-exchanged
// again.
func (s *seenHandshakes) forget(h uint64) { delete(s.index, h) }

// sourceLimiter limits the key exchanges each source costs: a token
// bucket per IP address (IPv6: per /64, what one host usually has),
// sourceRate a second up to sourceBurst at once. The buckets are a fixed
// table indexed by a keyed hash of the address, so that nothing is
// allocated for an attacker's addresses; two addresses whose hashes
// collide share one (with a random seed, an attacker cannot aim at
// another's). Not safe for concurrent use.
type sourceLimiter struct {
	seed        maphash.Seed
	rate, burst float64
	base        time.Time
	buckets     []sourceBucket
}

// sourceBucket holds what an address owes: key exchanges not yet paid
// back by the rate, at a time (since the limiter's base). The zero value
// is a full bucket.
type sourceBucket struct {
	debt float64
	at   time.Duration
}

// newSourceLimiter makes a limiter of n buckets (a power of two).
func newSourceLimiter(n int, rate, burst float64, now time.Time) sourceLimiter {
	return sourceLimiter{seed: maphash.MakeSeed(), rate: rate, burst: burst, base: now, buckets: make([]sourceBucket, n)}
}

// allow reports whether ip may cost a key exchange at now, and if so
// takes it from its bucket.
func (s *sourceLimiter) allow(ip netip.Addr, now time.Time) bool {
	var k [9]byte
	if ip.Is4() || ip.Is4In6() {
		a := ip.Unmap().As4()
		k[0] = 4
		copy(k[1:], a[:])
	} else {
		a := ip.As16()
		k[0] = 6
		copy(k[1:], a[:8])
	}
	b := &s.buckets[maphash.Bytes(s.seed, k[:])&uint64(len(s.buckets)-1)]
	t := now.Sub(s.base)
	b.debt = max(0, b.debt-s.rate*max(0, t-b.at).Seconds())
	b.at = max(b.at, t)
	if b.debt+1 > s.burst {
		return false
	}
	b.debt++
	return true
}
