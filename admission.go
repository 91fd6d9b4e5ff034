package knet

import (
	"bytes"
	"errors"
	"hash/maphash"
	"net/netip"
	"runtime"
	"sync/atomic"
	"time"
)

// A listener's admission: the one door through which the network reaches
// the application, whatever the transport. What someone who has not yet
// proven anything may make the listener do is decided here, and nowhere
// else:
//
//   - hold a place: every connection attempt, over UDP, TCP or WebSocket,
//     holds one of MaxPendingConnections places, at most
//     MaxPendingPerSource of them per source (an IPv4 address, an IPv6
//     /64), from its first datagram or stream until it is established or
//     ends (enterLocked, leaveLocked);
//   - cost a key exchange: a secure handshake message (Noise message 1),
//     whichever transport brings it, is read at most once while the
//     listener remembers it (one table, seenHandshakes), on a few workers,
//     within a rate per source (admitHandshakeLocked, handshakeWorker);
//   - hold a connection ID while unproven: a share of them per source
//     (takeCID);
//   - be established: a connection is offered to Accept or its Group, and
//     its connect token used, only once its client has proven itself
//     (establish, Conn.clientProven): in a secure session by its first
//     datagram or frame that opens under the session's keys, in plaintext
//     over UDP by answering what the server chose at random, over a
//     stream by TCP's handshake;
//   - hold a relay allocation (relay.go: a UDP socket and its reader) for
//     an introduction: at most RelayConfig.MaxAllocationsPerSource per
//     joiner's source, while the allocation lives (takeRelay), and a
//     joiner replaced before the host was told of it gives its allocation
//     back at once, unless both sides bound it;
//   - be answered without a connection: a server query (query.go) or an
//     address reflection's ask (reflect.go) gets an answer only if it
//     was padded to 1200 bytes, never with more bytes than it had, and
//     within one rate per source and one overall that both share
//     (answerUnconnected; mayAnswerUnconnected for a relay allocation's
//     socket): a spoofed source makes the listener send its victim no
//     more than it sent, at a bounded rate.
//
// The UDP path (listener.go: handleNew, admitSecure) and the streams'
// (stream_listen.go: takeStream; stream_door.go: the first frames) call
// these; neither has another way to hand a connection to the application.
//
// The socket's reader does only what is cheap: parsing, the padding rule,
// the listener's state, the cookie under load, whether the handshake
// message already cost a key exchange, the source's places and rate. The
// key exchange (reading the Noise message: an X25519, 70 to 170 µs on the
// 2-core test machine) and the token check run on a small pool of
// handshake workers; the reader, which every connection on the socket
// waits behind, never runs one. What the listener sends to an unproven
// address is never more bytes than the ConnectSyn's datagram. See
// SECURE.md ("Stateless cookies", "One door").

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
	// maxAttemptsPerMessage is how many attempts one handshake message
	// may make while none of them is established: the first, and copies
	// brought by another transport or stream, which the attempt holding
	// it cannot answer (a stream's answer goes down that stream only).
	// Each costs a key exchange; whichever client proves itself first
	// is established, and the others end. A copy beyond it is dropped.
	maxAttemptsPerMessage = 3
)

var errNotProven = errors.New("knet: the client has not proven itself")

// ticket is an attempt's place among the listener's pending attempts
// (enterLocked): its source, and what it holds there. Guarded by the
// Listener's mu.
type ticket struct {
	src     sourceKey
	pending bool // one of the pending places
	cid     bool // a connection ID, while unproven (takeCID)
}

// sourceUse is what a source's attempts hold: pending places, and
// connection IDs while unproven; and the relay allocations its
// introductions hold.
type sourceUse struct{ pending, cids, relays int32 }

// roomLocked reports whether an attempt from ip may take a place; l.mu is
// held.
func (l *Listener) roomLocked(ip netip.Addr) bool {
	return !l.closing && l.attempts < l.cfg.maxPending && int(l.sources[sourceOf(ip)].pending) < l.cfg.maxPendingPerSource
}

// enterLocked takes a place for an attempt from ip into t, if there is
// room (roomLocked); l.mu is held.
func (l *Listener) enterLocked(ip netip.Addr, t *ticket) bool {
	if !l.roomLocked(ip) {
		return false
	}
	k := sourceOf(ip)
	u := l.sources[k]
	u.pending++
	l.sources[k] = u
	l.attempts++
	*t = ticket{src: k, pending: true}
	return true
}

// leaveLocked gives back what t holds; l.mu is held. It may be called
// again.
func (l *Listener) leaveLocked(t *ticket) {
	if !t.pending && !t.cid {
		return
	}
	u := l.sources[t.src]
	if t.pending {
		u.pending--
		l.attempts--
	}
	if t.cid {
		u.cids--
		l.halfOpenCIDs--
	}
	l.putSourceLocked(t.src, u)
	t.pending, t.cid = false, false
}

// putSourceLocked stores what source k holds, forgetting it when it
// holds nothing; l.mu is held.
func (l *Listener) putSourceLocked(k sourceKey, u sourceUse) {
	if u == (sourceUse{}) {
		delete(l.sources, k)
	} else {
		l.sources[k] = u
	}
}

// relayPlace is a relay allocation's place among those of its joiner's
// source (takeRelay). Guarded by the Listener's mu.
type relayPlace struct {
	src  sourceKey
	held bool
}

// takeRelay takes, into p, one of the relay allocations that the
// introductions of ip's joiners may hold at once (limit), if one is
// left. leaveRelay gives it back.
func (l *Listener) takeRelay(ip netip.Addr, limit int, p *relayPlace) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	k := sourceOf(ip)
	u := l.sources[k]
	if int(u.relays) >= limit {
		return false
	}
	u.relays++
	l.sources[k] = u
	*p = relayPlace{src: k, held: true}
	return true
}

// leaveRelay gives back the place p holds, if any; it may be called
// again.
func (l *Listener) leaveRelay(p *relayPlace) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !p.held {
		return
	}
	u := l.sources[p.src]
	u.relays--
	l.putSourceLocked(p.src, u)
	p.held = false
}

// A stream that has said nothing yet (silent: no first frame) holds a
// place it may lose: when its source, or the listener, has no place left
// for a new stream, the oldest silent stream there gives way to it
// (evictSilentLocked). Streams that never speak (a host opening hundreds
// and renewing them) so cannot keep a client out, from their own address
// either: the client's hello comes right behind its connection, and once
// it spoke its place is kept. Guarded by the Listener's mu.

// silentLocked records c, a stream just taken, as silent; l.mu is held.
// Those that spoke or ended are pruned as the list doubles past the
// attempts pending: amortised, a constant per stream.
func (l *Listener) silentLocked(c *Conn) {
	if len(l.silent) > 2*l.attempts+16 {
		kept := l.silent[:0]
		for _, o := range l.silent {
			if o.silent {
				kept = append(kept, o)
			}
		}
		clear(l.silent[len(kept):])
		l.silent = kept
	}
	c.silent = true
	l.silent = append(l.silent, c)
}

// spoke records that c, a stream, has said its first frame (or ended).
func (l *Listener) spoke(c *Conn) {
	l.mu.Lock()
	c.silent = false
	l.mu.Unlock()
}

// evictSilentLocked ends the oldest silent stream of source k (of any
// source if any), giving back its place at once, and reports whether
// there was one; l.mu is held.
func (l *Listener) evictSilentLocked(k sourceKey, any bool) bool {
	now := time.Now()
	kept := l.silent[:0]
	evicted := false
	for _, c := range l.silent {
		switch {
		case !c.silent:
			continue // spoke, or ended: forgotten here
		case !evicted && (any || c.ticket.src == k) && c.st.evictable(now):
			evicted = true
			c.silent = false
			l.leaveLocked(&c.ticket)
			c.abandon()
			continue
		}
		kept = append(kept, c)
	}
	clear(l.silent[len(kept):])
	l.silent = kept
	return evicted
}

// takeCID gives c, a secure attempt being admitted, its connection ID, if
// its source may hold one more before its client proves itself: with a
// short connection ID (Config.ServerID) the IDs are few, and half-open
// attempts must not take them all. Unproven attempts together hold at
// most half the IDs, those of one source at most a sixteenth (at least
// one); established connections, any number.
func (l *Listener) takeCID(c *Conn) (uint32, error) {
	l.mu.Lock()
	if c.ticket.pending && l.cidsSpentLocked(c.ticket.src) {
		l.mu.Unlock()
		return 0, errNoCID
	}
	l.mu.Unlock()
	id, err := l.newCID(c)
	if err != nil {
		return 0, err
	}
	l.mu.Lock()
	if c.ticket.pending {
		u := l.sources[c.ticket.src]
		u.cids++
		l.sources[c.ticket.src] = u
		l.halfOpenCIDs++
		c.ticket.cid = true
	}
	l.mu.Unlock()
	return id, nil
}

// cidsSpentLocked reports whether unproven attempts, or those of src, hold
// all the connection IDs they may (takeCID); l.mu is held. An attempt
// from such a source is dropped before its key exchange (admitSecure).
func (l *Listener) cidsSpentLocked(src sourceKey) bool {
	space := cidSpace(l.cfg.serverID)
	return int64(l.halfOpenCIDs) >= max(1, space/2) || int64(l.sources[src].cids) >= max(1, space/16)
}

// cidSpace is how many connection IDs a listener with serverID can tell
// apart.
func cidSpace(serverID []byte) int64 { return 1 << (8 * (cidSize - len(serverID))) }

// handshakeJob is an attempt waiting for its key exchange: a UDP
// ConnectSyn (ep, addr, p, holding the place t), or a stream's secure
// hello (c, which holds its place).
type handshakeJob struct {
	ep   *endpoint
	addr netip.AddrPort
	p    *packet
	c    *Conn
	msg1 []byte // the Noise message, in p or the stream's hello
	h    uint64 // its hash (seenHandshakes)
	t    ticket
}

// handshakes is a secure listener's admission state: the handshake queue
// and its workers, the handshake messages key-exchanged lately, the rate
// limits by source. Guarded by the Listener's mu, but seed.
type handshakes struct {
	seed       maphash.Seed
	queue      []handshakeJob
	busy       map[netip.AddrPort]bool // the addresses of the UDP jobs queued or running
	workers    int
	maxWorkers int
	maxQueue   int
	seen       seenHandshakes
	sources    sourceLimiter
	// conns are the attempts made and not yet established, by the hash
	// of their handshake message: a copy of it from elsewhere goes to a
	// UDP one (repeated), and once one is established the others end.
	conns map[uint64][]*Conn
}

func newHandshakes(window time.Duration) handshakes {
	return handshakes{
		seed:       maphash.MakeSeed(),
		busy:       make(map[netip.AddrPort]bool),
		maxWorkers: runtime.GOMAXPROCS(0),
		maxQueue:   maxHandshakeQueue,
		seen:       newSeenHandshakes(maxSeenHandshakes, window, time.Now()),
		sources:    newSourceLimiter(sourceBuckets, sourceRate, sourceBurst, time.Now()),
		conns:      make(map[uint64][]*Conn),
	}
}

// seenWindow is how long a listener remembers a handshake message it
// key-exchanged: as long as a cookie for it is good, or the listener's
// ConnectTimeout if longer (how long its connection may wait).
func seenWindow(cfg *config) time.Duration {
	return max(cookieLifetime+2*time.Second, cfg.connectTimeout)
}

// A copy's fate (copyOfLocked): what to do with a handshake message that
// already cost a key exchange lately.
type copyFate uint8

const (
	copyDrop    copyFate = iota // dropped: its connection is made, or it made enough attempts
	copyRefuse                  // refused again, without a key exchange: the first failed
	copyToConn                  // handed to the UDP attempt holding it, which answers it where it came from
	copyAttempt                 // an attempt of its own (a key exchange): the attempts holding it cannot answer it
)

// copyOfLocked decides on a copy of a handshake message (prev, its hash
// h) that came over UDP (udp) or a stream; l.mu is held. The copy's own
// attempt, if it gets one, counts against maxAttemptsPerMessage.
func (l *Listener) copyOfLocked(prev seenHandshake, h uint64, udp bool) (copyFate, *Conn) {
	if prev.failed {
		return copyRefuse, nil
	}
	cs := l.hs.conns[h]
	if udp {
		for _, c := range cs {
			if c.st == nil {
				return copyToConn, c
			}
		}
	}
	if len(cs) > 0 && prev.attempts < maxAttemptsPerMessage {
		return copyAttempt, nil
	}
	return copyDrop, nil
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
	if !l.roomLocked(addr.Addr()) || l.cidsSpentLocked(sourceOf(addr.Addr())) {
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
	fate, to := copyAttempt, (*Conn)(nil)
	if seen {
		fate, to = l.copyOfLocked(prev, h, true)
	}
	load := l.attempts + l.load.recent(now)
	l.mu.Unlock()
	if seen {
		l.replayedHandshakes.Add(1)
		switch fate {
		case copyRefuse:
			l.refuseUnproven(ep, addr, b, prev.reason, false)
			ep.putPacket(p)
			return
		case copyToConn:
			to.push(p)
			return
		case copyDrop:
			ep.putPacket(p)
			return
		}
	}
	if load >= l.cfg.cookieThreshold && !(len(cookie) > 0 && l.cookies.check(cookie, addr, msg1, now)) {
		var c [cookieSize]byte
		var buf [64]byte
		l.sendUnproven(ep, addr, b, appendRetry(buf[:0], l.cookies.appendCookie(c[:0], addr, msg1, now)))
		l.cookiesSent.Add(1)
		ep.putPacket(p)
		return
	}
	j := handshakeJob{ep: ep, addr: addr, p: p, msg1: msg1, h: h}
	l.mu.Lock()
	switch {
	case l.hs.busy[addr]:
	case !l.admitHandshakeLocked(&j, now, seen):
	case !l.enterLocked(addr.Addr(), &j.t):
		ep.ignored.Add(1)
	default:
		l.hs.busy[addr] = true
		l.queueLocked(j, now)
		l.mu.Unlock()
		return
	}
	l.mu.Unlock()
	ep.putPacket(p)
}

// admitStreamHello decides on a secure client's hello over the stream of
// c (its content, a secure ConnectSyn's without a cookie), under the same
// rules as a UDP ConnectSyn's (admitSecure) and with the same table: it
// queues it for a handshake worker, which hands c the result (Conn.keyed),
// or fails, telling whether the client is refused with the error's text
// (a message that failed before, a malformed one) or dropped unanswered
// (a copy of a message seen already, a source over its rate, a full
// queue). A TCP peer cannot spoof its address: no cookie is asked.
func (l *Listener) admitStreamHello(c *Conn, content []byte) (refuse bool, err error) {
	cookie, msg1, ok := splitSecureSyn(content)
	if !ok || len(cookie) != 0 {
		return true, ErrHandshakeFailed
	}
	j := handshakeJob{c: c, msg1: msg1, h: maphash.Bytes(l.hs.seed, msg1)}
	now := time.Now()
	l.mu.Lock()
	defer l.mu.Unlock()
	prev, seen := l.hs.seen.find(j.h, now)
	if seen {
		l.replayedHandshakes.Add(1)
		switch fate, _ := l.copyOfLocked(prev, j.h, false); fate {
		case copyRefuse:
			return true, errors.New(prev.reason)
		case copyDrop:
			return false, errStreamReplay
		}
	}
	if !l.admitHandshakeLocked(&j, now, seen) {
		return false, errKeyExchangeLimited
	}
	l.queueLocked(j, now)
	return false, nil
}

// admitHandshakeLocked reports whether the handshake message of j may cost
// a key exchange now, over any transport: not while the listener closes,
// not one key-exchanged meanwhile (unless copy: a copy given an attempt of
// its own), within the queue's bound and its source's rate; l.mu is held.
// Refusals are counted.
func (l *Listener) admitHandshakeLocked(j *handshakeJob, now time.Time, copy bool) bool {
	src := j.addr.Addr()
	if j.c != nil {
		src = j.c.raddr.Addr()
	}
	switch {
	case l.closing:
		return false
	case !copy && l.hs.seen.has(j.h, now):
		// The same message from another socket's reader, or stream,
		// meanwhile.
		l.replayedHandshakes.Add(1)
		return false
	case len(l.hs.queue) >= l.hs.maxQueue:
		l.droppedHandshakes.Add(1)
		return false
	case !l.hs.sources.allow(src, now):
		l.rateLimited.Add(1)
		return false
	}
	return true
}

// queueLocked queues j for a handshake worker, and records its message as
// key-exchanged; l.mu is held.
func (l *Listener) queueLocked(j handshakeJob, now time.Time) {
	if l.hs.seen.has(j.h, now) {
		l.hs.seen.again(j.h)
	} else {
		l.hs.seen.add(j.h, now)
	}
	l.hs.queue = append(l.hs.queue, j)
	if l.hs.workers < l.hs.maxWorkers {
		l.hs.workers++
		l.startHandshakeWorker()
	}
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
// checks its token, then makes its connection, or refuses it; a stream's
// connection is handed the result (Conn.keyed).
func (l *Listener) handshake(j handshakeJob) {
	if hook := l.keyExchangeHook.Load(); hook != nil {
		(*hook)()
	}
	now := time.Now()
	sec, inner, err := l.readSyn(j.msg1)
	if sec != nil {
		sec.tap = l.cfg.sealTap
		sec.ku = newKeyUpdates(l.cfg)
		l.keyExchanges.Add(1)
		if err == nil {
			err = l.checkSynPayload(sec, inner, now)
		}
	}
	if err == nil {
		// Kept, so that the connection knows the client's ConnectSyn
		// when it comes again.
		sec.msg1 = bytes.Clone(j.msg1)
	}
	if err != nil {
		if errors.Is(err, ErrTokenRejected) {
			l.rejectedTokens.Add(1)
		}
		l.mu.Lock()
		l.load.failed(now)
		l.hs.seen.fail(j.h, err.Error())
		if j.c == nil {
			l.leaveLocked(&j.t)
			delete(l.hs.busy, j.addr)
		}
		l.mu.Unlock()
		if j.c == nil {
			l.refuseUnproven(j.ep, j.addr, j.p.b, err.Error(), true)
			j.ep.putPacket(j.p)
		}
	}
	if j.c != nil {
		if err == nil {
			l.mu.Lock()
			l.hs.conns[j.h] = append(l.hs.conns[j.h], j.c)
			l.mu.Unlock()
		}
		j.c.keyed(sec, err)
		return
	}
	if err == nil {
		l.startSecure(j, sec)
	}
}

// endAttempt forgets c, a connection that ended (why: err) before it was
// established, from the pending ones, and gives back its place. The
// handshake message of a secure attempt that was refused is left failed,
// with the refusal's reason (none with Stealth), so that the client's
// ConnectSyn, if it comes again, is refused again; one that timed out is
// forgotten: it may come again, at the cost of a new key exchange, as a
// new one would.
func (l *Listener) endAttempt(c *Conn, err error, reason []byte) {
	l.mu.Lock()
	c.silent = false
	if l.pending[c] {
		delete(l.pending, c)
		l.leaveLocked(&c.ticket)
		if errors.Is(err, errWrongProof) {
			c.ep.invalid.Add(1) // its proof named nothing sent to its address
		}
		if others := l.dropAttemptLocked(c); others == 0 && c.sec != nil && c.sec.msg1 != nil {
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

// dropAttemptLocked forgets c as an attempt being made (handshakes.conns),
// and returns how many other attempts hold its handshake message; l.mu is
// held.
func (l *Listener) dropAttemptLocked(c *Conn) int {
	if c.sec == nil || c.sec.msg1 == nil {
		return 0
	}
	h := maphash.Bytes(l.hs.seed, c.sec.msg1)
	cs := l.hs.conns[h]
	for i, o := range cs {
		if o == c {
			cs = append(cs[:i:i], cs[i+1:]...)
			break
		}
	}
	if len(cs) == 0 {
		delete(l.hs.conns, h)
	} else {
		l.hs.conns[h] = cs
	}
	return len(cs)
}

// clientProven reports whether c's client has proven itself, which its
// establishment (Listener.establish) requires: a secure connection by a
// datagram or frame that opened under the session's keys, from the
// connection's address over UDP; a plaintext one over UDP by answering
// what the server chose at random (session.addressProven); a plaintext
// stream by TCP's own handshake, which it took to exist.
func (c *Conn) clientProven() bool {
	switch {
	case c.st != nil && c.sec != nil:
		return c.st.sealedIn
	case c.st != nil:
		return true
	case c.sec != nil:
		return c.sec.proven
	}
	return c.sess.addressProven()
}

// establish hands c, a connection of the listener whose client has proven
// itself, to the application: its connect token is used, the other
// attempts carrying its handshake message end, and it goes to its Group
// or the accept backlog. It is the only way a connection the listener
// made reaches the application, over any transport. It fails when the
// client has not proven itself, the backlog is full or the token was
// used meanwhile: the caller then refuses c.
func (l *Listener) establish(c *Conn) error {
	if !c.clientProven() {
		return errNotProven
	}
	g := c.cfg.group
	if g == nil && !l.roomToAccept() {
		c.ep.refused.Add(1)
		return errServerFull
	}
	if err := l.useToken(c); err != nil {
		return err
	}
	l.punch.re.tie(c) // came by a punch? (repunch.go)
	l.mu.Lock()
	delete(l.pending, c)
	l.leaveLocked(&c.ticket)
	var others []*Conn
	if c.sec != nil && c.sec.msg1 != nil {
		h := maphash.Bytes(l.hs.seed, c.sec.msg1)
		l.hs.seen.established(h)
		for _, o := range l.hs.conns[h] {
			if o != c {
				others = append(others, o)
			}
		}
		delete(l.hs.conns, h)
	}
	if _, ok := l.streams[c]; ok {
		l.streams[c] = true
	}
	l.mu.Unlock()
	for _, o := range others {
		o.abandon()
	}
	if g != nil {
		l.completed.Add(1)
		c.estOnce.Do(func() { close(c.estab) }) // established before the group hears of it
		g.Add(c)
		return nil
	}
	select {
	case l.acceptq <- c:
		l.completed.Add(1)
		return nil
	default:
		c.ep.refused.Add(1)
		return errServerFull
	}
}

// abandon ends c, an attempt whose handshake message another attempt
// established (a copy raced it from elsewhere): its next round ends it,
// unless it was established meanwhile.
func (c *Conn) abandon() {
	c.abandoned.Store(true)
	c.kick()
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
// established, as used: a token is checked at admission but used only
// here, once the client proved it holds the session's keys, so that an
// attempt that never completes does not burn it. Another attempt with the
// same token may have completed first: c is then refused, counted as a
// rejected token.
func (l *Listener) useToken(c *Conn) error {
	if l.tokens == nil || c.sec == nil || c.sec.token == nil {
		return nil
	}
	err := l.tokens.use(c.sec.tokenID, c.sec.token.Expires.Unix(), time.Now().Unix())
	if err == nil {
		return nil
	}
	l.rejectedTokens.Add(1)
	c.ep.refused.Add(1)
	if lg := l.cfg.logger; lg != nil {
		lg.Info("knet: connection refused", "remote", c.remote.Load(), "reason", err)
	}
	return err
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

// answerUnconnected sends d to addr in answer to a datagram of in bytes
// from that address, which has no connection: a server query's answer
// (query.go), an address reflection's (reflect.go). It is the one rule
// for them: the datagram asked must have been padded to queryPadTo, d
// must be no larger, and the source (an IPv4 address, an IPv6 /64) and
// the listener as a whole must be within their rates (queryState.allow:
// querySourceRate, queryRate), which queries and reflections share. It
// reports whether d was sent, counted in answered before it goes (so
// that whoever reads the answer finds it counted).
func (l *Listener) answerUnconnected(ep *endpoint, addr netip.AddrPort, in int, d []byte, answered *atomic.Uint64) bool {
	if !l.mayAnswerUnconnected(addr, in, len(d)) {
		return false
	}
	answered.Add(1)
	ep.write(d, addr)
	return true
}

// mayAnswerUnconnected is answerUnconnected's rule, for an answer of out
// bytes that leaves by another socket than the Listener's own: a relay
// allocation's (relay.go). It takes the answer's place in the rates.
func (l *Listener) mayAnswerUnconnected(addr netip.AddrPort, in, out int) bool {
	return in >= queryPadTo && out <= in && l.query.allow(addr.Addr(), time.Now())
}
