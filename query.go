package knet

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/knet-go/knet/internal/udp"
)

// Server queries (issue 22): a server browser or a LAN lobby asks a
// Listener for what its application set (Listener.SetQueryInfo: a name, a
// map, a player count) without connecting, as RakNet's ping data,
// LiteNetLib's unconnected messages and Source's server queries do. A
// knet extension; docs/PROTOCOL.md (section 8) has the layout:
//
//	u24  datagram header 00 00 00: PacketID 0, unreliable, no InOrder
//	u16  message block header: ContentLength (bits 0-10), no flags
//	     MessageID 5 (VLE, one byte: reserved by DECISIONS §2, ignored by receivers)
//	4    magic "kNet"
//	u8   version, 1
//	u8   kind: 1 query, 2 answer (3 and 4: address reflection, reflect.go)
//	8    nonce: random in a query, echoed by its answer
//	...  a query: padding (zeros) up to 1200 bytes in all;
//	     an answer: the info, at most MaxQueryInfo bytes
//
// knet's other messages of ID 5 are padding (zeros), anchors (empty) and,
// inside connections, extensions whose first content byte names their
// kind, a small number; a query's first is 'k' (0x6b), so that nothing
// takes one for another.
//
// The datagram is one message block filling it, so that it is nothing
// else: no ConnectSyn (a spec receiver drops it, DECISIONS §1), no
// connection state anywhere. The listener's reader answers a query from
// an address with no connection inline (a parse, two token buckets, one
// write of at most MaxQueryInfo+20 bytes), never with more bytes than the
// query had: a query shorter than 1200 bytes gets no answer.

const (
	queryMagic   = "kNet"
	queryVersion = 1
	// The kinds of query datagram.
	queryKindQuery  = 1
	queryKindAnswer = 2
	queryNonceSize  = 8
	// queryOverhead is a query datagram's size without its padding or
	// info: datagram header, message block header, MessageID, magic,
	// version, kind, nonce.
	queryOverhead = minHeaderSize + 2 + 1 + len(queryMagic) + 1 + 1 + queryNonceSize
	// queryPadTo is what a query is padded to, as a ConnectSyn is
	// (synPadTo); a listener answers no shorter one.
	queryPadTo = synPadTo
	// MaxQueryInfo is the most bytes of info a Listener answers queries
	// with (Listener.SetQueryInfo): what an answer no larger than the
	// 1200-byte query it answers can carry.
	MaxQueryInfo = queryPadTo - queryOverhead

	// A listener answers queryRate queries a second overall, in bursts
	// of queryBurst, and querySourceRate from one source IP address (an
	// IPv6 /64), in bursts of querySourceBurst; the others are dropped
	// (ListenerStats.QueriesDropped). At most about 1.2 MB/s of answers
	// however many send queries, and a browser refreshing its list, or a
	// LAN's few discovering clients behind one address, are answered.
	queryRate        = 1000
	queryBurst       = 1000
	querySourceRate  = 20
	querySourceBurst = 40
	// queryBuckets is the size of the per-source table (16 bytes each),
	// made at the first query.
	queryBuckets = 1024

	// A client sends its query again queryFirstResend after the first,
	// then at intervals doubling, queryMaxSends in all; Query gives up
	// queryTimeout after the first (sooner if its ctx says so).
	queryFirstResend = 250 * time.Millisecond
	queryMaxSends    = 5
	queryTimeout     = 5 * time.Second
	// discoverSends is how many times Discover sends its query, on the
	// same timer, and maxDiscovered how many servers it reports at most.
	discoverSends = 3
	maxDiscovered = 1024
)

// appendQueryDatagram appends a query datagram of the given kind: body (an
// answer's info) after the nonce, then zeros up to size bytes in all. The
// caller keeps body within MaxQueryInfo and size within queryPadTo.
func appendQueryDatagram(b []byte, kind byte, nonce *[queryNonceSize]byte, body []byte, size int) []byte {
	n := queryOverhead + len(body)
	pad := max(size-n, 0)
	content := n + pad - minHeaderSize - 2 // ContentLength: MessageID and payload
	b = appendHeader(b, &header{})
	b = append(b, byte(content), byte(content>>8)) // no flags, InOrder code 0
	b = append(b, idPadding)
	b = append(b, queryMagic...)
	b = append(b, queryVersion, kind)
	b = append(b, nonce[:]...)
	b = append(b, body...)
	for range pad {
		b = append(b, 0)
	}
	return b
}

// parseQueryDatagram decodes a query datagram: its kind, its nonce and
// what follows the nonce (a query's padding, an answer's info), which
// aliases b. ok is false for anything else, including a later version.
func parseQueryDatagram(b []byte) (kind byte, nonce [queryNonceSize]byte, body []byte, ok bool) {
	// The datagram header: PacketID 0, neither Reliable nor InOrder.
	if len(b) < queryOverhead || b[0] != 0 || b[1] != 0 || b[2] != 0 {
		return 0, nonce, nil, false
	}
	// One message block, which fills the datagram: whole, no InOrder
	// code, MessageID 5.
	m, n, err := parseMessage(b[minHeaderSize:])
	if err != nil || minHeaderSize+n != len(b) || m.fragment || m.fragStart || m.order != orderNone || m.id != idPadding {
		return 0, nonce, nil, false
	}
	p := m.payload
	// Magic, version, kind, nonce.
	if len(p) < len(queryMagic)+2+queryNonceSize || string(p[:len(queryMagic)]) != queryMagic || p[len(queryMagic)] != queryVersion {
		return 0, nonce, nil, false
	}
	kind = p[len(queryMagic)+1]
	if kind == repunchKindAsk || kind == repunchKindAnswer { // 15, 16: re-punching (repunch.go)
		p = p[len(queryMagic)+2:]
		copy(nonce[:], p)
		return kind, nonce, p[queryNonceSize:], true
	}
	if kind < queryKindQuery || kind > relayKindBound && kind != birthdayKindOpen { // 3 and 4: address reflection (reflect.go); 5 to 8: punching (punch.go); 9 and 10: relay (relay.go); 13: birthday.go
		return 0, nonce, nil, false
	}
	p = p[len(queryMagic)+2:]
	copy(nonce[:], p)
	return kind, nonce, p[queryNonceSize:], true
}

// queryState is a Listener's: the info it answers queries with, and
// their rate limits.
type queryState struct {
	info atomic.Pointer[[]byte] // nil: queries go unanswered

	mu      sync.Mutex
	sources sourceLimiter // per source address; made at the first query
	all     sourceLimiter // one bucket for everyone

	// Atomic.
	answered, dropped atomic.Uint64
}

// allow reports whether a query from ip may be answered at now, and if
// so takes it from the buckets.
func (q *queryState) allow(ip netip.Addr, now time.Time) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.all.buckets == nil {
		q.sources = newSourceLimiter(queryBuckets, querySourceRate, querySourceBurst, now)
		q.all = newSourceLimiter(1, queryRate, queryBurst, now)
	}
	// The source's first: a flood from one address does not use up
	// everyone's share.
	return q.sources.allow(ip, now) && q.all.allow(ip, now)
}

// SetQueryInfo sets what the Listener answers server queries (Query,
// Discover) with: application bytes, at most MaxQueryInfo, such as the
// server's name, map and player count. It may be called at any time, from
// any goroutine; info is copied. A nil info, as at the start, leaves
// queries unanswered (a Listener that never sets any does not reveal that
// it answers queries); an empty one answers with no info.
//
// Queries are answered whatever the Listener's Dialect, Stealth and
// listen-open mode, by a secure Listener too (in clear: the answer holds
// nothing but info), from addresses that have no connection to it. Each
// answer is no larger than its query, and answers are rate-limited, by
// source address and overall; the queries not answered are counted in
// ListenerStats.QueriesDropped.
func (l *Listener) SetQueryInfo(info []byte) error {
	if len(info) > MaxQueryInfo {
		return fmt.Errorf("knet: query info of %d bytes, at most %d (MaxQueryInfo) fit an answer", len(info), MaxQueryInfo)
	}
	if info == nil {
		l.query.info.Store(nil)
		return nil
	}
	c := bytes.Clone(info)
	l.query.info.Store(&c)
	return nil
}

// answerQuery answers p, from addr, if it is a query or an address
// reflection's ask (reflect.go), or hands it to the Listener's Reflect
// waiting for it if it is the answer to one, and then reports true,
// having taken p. The socket's reader calls it, for addresses with no
// connection: what it does is bounded (no allocation, one write).
func (l *Listener) answerQuery(ep *endpoint, addr netip.AddrPort, p *packet) bool {
	kind, nonce, body, ok := parseQueryDatagram(p.b)
	switch {
	case !ok:
		return false
	case kind == reflectKindAsk:
		l.answerReflect(ep, addr, p, &nonce)
		return true
	case kind == reflectKindAnswer && l.takeReflection(addr, &nonce, body):
		ep.putPacket(p)
		return true
	case kind >= punchKindProbe && kind <= introKindAnswer:
		return l.handlePunch(ep, addr, p, kind, &nonce, body)
	case kind == relayKindBound && l.takeRelayAnswer(addr, &nonce, body):
		ep.putPacket(p)
		return true
	case kind == repunchKindAsk || kind == repunchKindAnswer:
		return l.handlePunch(ep, addr, p, kind, &nonce, body) // repunch.go
	case kind != queryKindQuery:
		return false // an answer to no ask of ours, say: stray as before
	}
	in := len(p.b)
	info := l.query.info.Load()
	if info == nil {
		l.query.dropped.Add(1)
		ep.putPacket(p)
		return true
	}
	// Built in the query's own buffer (at least 2 KiB): the nonce is
	// copied out already.
	d := appendQueryDatagram(p.buf[:0], queryKindAnswer, &nonce, *info, 0)
	if !l.answerUnconnected(ep, addr, in, d, &l.query.answered) {
		l.query.dropped.Add(1)
	}
	ep.putPacket(p)
	return true
}

// Query asks the kNet server at address for the info its application set
// (Listener.SetQueryInfo), without connecting, and returns it with the
// round trip of the query answered. The network is "udp", "udp4" or
// "udp6". The query is sent again if no answer comes (after 250ms, then
// at intervals doubling, five times in all); Query gives up with a
// *TimeoutError after 5s, or with ctx's error when ctx is done first.
// It fails with ErrPortUnreachable if the system reports that nothing
// listens there.
//
// A server that does not answer queries (a knet Listener that set no
// info, another kNet implementation) looks the same as one that is not
// there: Query times out. The C++ reference takes any datagram from a new
// address for a connection attempt: a query costs it a connection that
// it drops after its silence timeout (about 15s). Only an answer from
// address that echoes the random nonce of one of its queries is taken, so
// a host off the path cannot forge one.
func Query(ctx context.Context, network, address string) (info []byte, rtt time.Duration, err error) {
	return queryWith(ctx, network, address, &endpointOptions{})
}

// queryWith is Query with the endpoint's options (tests).
func queryWith(ctx context.Context, network, address string, o *endpointOptions) (info []byte, rtt time.Duration, err error) {
	if ctx == nil {
		return nil, 0, errNilContext
	}
	if err := checkNetwork(network); err != nil {
		return nil, 0, err
	}
	raddr, err := net.ResolveUDPAddr(network, address)
	if err != nil {
		return nil, 0, err
	}
	if raddr.Port == 0 {
		return nil, 0, fmt.Errorf("knet: query %s %q: no port to send to", network, address)
	}
	sock, err := o.dialSocket(network, raddr)
	if err != nil {
		return nil, 0, err
	}
	ctx, cancel := context.WithTimeoutCause(ctx, queryTimeout, errQueryTimeout)
	defer cancel()
	found := false
	err = exchangeQueries(ctx, sock, unmap(raddr.AddrPort()), queryMaxSends, queryKindQuery, func(_ netip.AddrPort, _ *[queryNonceSize]byte, i []byte, r time.Duration) bool {
		info, rtt, found = bytes.Clone(i), r, true
		return true
	})
	switch {
	case found:
		return info, rtt, nil
	case errors.Is(err, context.DeadlineExceeded) && context.Cause(ctx) == errQueryTimeout:
		return nil, 0, &TimeoutError{Silent: queryTimeout, Op: "query"}
	}
	return nil, 0, err
}

// errQueryTimeout is the cause of a Query's own timeout, as opposed to its
// caller's.
var errQueryTimeout = errors.New("knet: query timeout")

// Discover sends a server query (see Query) to address, a broadcast
// address such as 192.168.1.255:7000 or 255.255.255.255:7000 to find the
// servers on a LAN listening at that port, or any one server's, and calls
// found for each server that answers, once per server address, from
// Discover's goroutine, with the info its application set and the round
// trip. It sends the query three times (after 250ms and 750ms again), in
// case one is lost, and returns nil once ctx is done: pass a ctx with a
// deadline (a second is plenty on a LAN). It returns an error if the
// query cannot be sent (for one, IPv6 has no broadcast). At most 1024
// servers are reported.
//
// Answers are taken only if they echo one of its queries' random nonces;
// on a LAN, where every host sees a broadcast query, that proves little.
func Discover(ctx context.Context, network, address string, found func(from netip.AddrPort, info []byte, rtt time.Duration)) error {
	return discoverWith(ctx, network, address, found, &endpointOptions{})
}

// discoverWith is Discover with the endpoint's options (tests).
func discoverWith(ctx context.Context, network, address string, found func(netip.AddrPort, []byte, time.Duration), o *endpointOptions) error {
	if ctx == nil {
		return errNilContext
	}
	if err := checkNetwork(network); err != nil {
		return err
	}
	raddr, err := net.ResolveUDPAddr(network, address)
	if err != nil {
		return err
	}
	if raddr.Port == 0 {
		return fmt.Errorf("knet: discover %s %q: no port to send to", network, address)
	}
	lnet := network
	if raddr.IP.To4() != nil {
		lnet = "udp4" // a broadcast is IPv4's
	}
	// Go's UDP sockets are made with SO_BROADCAST.
	sock, err := o.listenSocket(lnet, &net.UDPAddr{}, false)
	if err != nil {
		return err
	}
	seen := make(map[netip.AddrPort]bool)
	err = exchangeQueries(ctx, sock, unmap(raddr.AddrPort()), discoverSends, queryKindQuery, func(from netip.AddrPort, _ *[queryNonceSize]byte, info []byte, rtt time.Duration) bool {
		if !seen[from] && len(seen) < maxDiscovered {
			seen[from] = true
			found(from, info, rtt)
		}
		return false
	})
	if ctx.Err() != nil && errors.Is(err, ctx.Err()) {
		return nil
	}
	return err
}

// queryIn is what exchangeQueries' reader hands on: a datagram and when
// it came, or the socket's error.
type queryIn struct {
	b     []byte
	from  netip.AddrPort
	at    time.Time
	err   error // a refusal, or (fatal) the socket failing
	fatal bool
}

// exchangeQueries sends queries of the kind ask (a server query, an
// address reflection's ask) to `to` on sock, sends times at most
// (queryFirstResend apart, then doubling), and hands each answer to one
// of them (its kind ask+1, the nonce it echoes, its body) to found, until
// found reports true (done), ctx is done or a send fails; it closes sock. A connected socket's refusals (ICMP port
// unreachable) end it after handshakeStrikes in a row with
// ErrPortUnreachable.
func exchangeQueries(ctx context.Context, sock socket, to netip.AddrPort, sends int, ask byte, found func(from netip.AddrPort, nonce *[queryNonceSize]byte, body []byte, rtt time.Duration) bool) error {
	in := make(chan queryIn)
	stop := make(chan struct{})
	readerDone := make(chan struct{})
	go queryReader(sock, in, stop, readerDone)
	defer func() {
		close(stop)
		sock.Close()
		<-readerDone
	}()

	type sent struct {
		nonce [queryNonceSize]byte
		at    time.Time
	}
	var out []sent
	buf := make([]byte, 0, queryPadTo)
	send := func() error {
		var s sent
		rand.Read(s.nonce[:]) // never fails (crypto/rand)
		buf = appendQueryDatagram(buf[:0], ask, &s.nonce, nil, queryPadTo)
		s.at = time.Now()
		out = append(out, s)
		if err := sock.WriteTo(buf, to); err != nil {
			if isRefusal(err) {
				return ErrPortUnreachable
			}
			return fmt.Errorf("knet: query to %v: %w", to, err)
		}
		return nil
	}
	if err := send(); err != nil {
		return err
	}
	resend := queryFirstResend
	t := time.NewTimer(resend)
	defer t.Stop()
	refusals := 0
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
			if len(out) >= sends {
				continue // the timer is not set again: ctx ends it
			}
			if err := send(); err != nil {
				return err
			}
			resend *= 2
			t.Reset(resend)
		case r := <-in:
			if r.fatal {
				return fmt.Errorf("knet: query to %v: %w", to, r.err)
			}
			if r.err != nil {
				if refusals++; refusals >= handshakeStrikes {
					return ErrPortUnreachable
				}
				continue
			}
			kind, nonce, info, ok := parseQueryDatagram(r.b)
			if !ok || kind != ask+1 || len(r.b) > queryPadTo {
				continue // not an answer; or one larger than any query we send
			}
			for _, s := range out {
				if s.nonce == nonce {
					if found(r.from, &nonce, info, r.at.Sub(s.at)) {
						return nil
					}
					break
				}
			}
		}
	}
}

// queryReader reads sock for exchangeQueries until it is closed, handing
// on each datagram (a copy) and each refusal, until stop.
func queryReader(sock socket, in chan<- queryIn, stop <-chan struct{}, done chan<- struct{}) {
	defer close(done)
	ps := make([]udp.Packet, 1)
	ps[0].Buf = make([]byte, queryPadTo+1)
	fails := 0
	for {
		n, err := sock.ReadBatch(ps)
		var r queryIn
		switch {
		case errors.Is(err, net.ErrClosed):
			return
		case err != nil && isRefusal(err):
			r.err = err
		case err != nil:
			if fails++; fails <= 8 {
				continue
			}
			r = queryIn{err: err, fatal: true} // a socket that keeps failing
		case n == 0 || ps[0].Trunc:
			continue // larger than any answer
		default:
			fails = 0
			r = queryIn{b: bytes.Clone(ps[0].Buf[:ps[0].N]), from: unmap(ps[0].Addr), at: time.Now()}
		}
		select {
		case in <- r:
		case <-stop:
			return
		}
		if r.fatal {
			return
		}
	}
}
