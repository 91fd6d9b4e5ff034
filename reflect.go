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

// Address reflection (issue 35): a host behind a NAT learns the public
// address its socket is mapped to by asking any knet server, which
// answers with the address it saw the question come from, as a STUN
// server does. Every Listener answers (not with Stealth): a game's own
// servers are its players' reflectors, with no other service. A knet
// extension; docs/PROTOCOL.md (section 8.1) has the layout: the server
// query's datagram (query.go) with two new kinds,
//
//	kind 3, ask:    the nonce, then zeros up to 1200 bytes in all
//	kind 4, answer: the nonce, then u8 family (4 or 6), the address
//	                (4 or 16 bytes) and the port (u16, big-endian),
//	                those 7 or 19 bytes XORed with the nonce repeated
//
// An answer is 27 bytes for IPv4, 39 for IPv6: never more than the
// 1200-byte ask, and an ask shorter than that gets none
// (Listener.answerUnconnected, admission.go). The address goes XORed so
// that a NAT's application gateway that rewrites addresses it finds in
// payloads (which is why STUN has XOR-MAPPED-ADDRESS) leaves it alone.

const (
	reflectKindAsk    = 3
	reflectKindAnswer = 4
	// reflectMaxBody is the largest answer's body: family, an IPv6
	// address, port.
	reflectMaxBody = 1 + 16 + 2
)

// appendReflectBody appends the body of an answer telling addr, XORed
// with nonce.
func appendReflectBody(b []byte, nonce *[queryNonceSize]byte, addr netip.AddrPort) []byte {
	start := len(b)
	ip := addr.Addr().Unmap()
	if ip.Is4() {
		a := ip.As4()
		b = append(append(b, 4), a[:]...)
	} else {
		a := ip.As16()
		b = append(append(b, 6), a[:]...)
	}
	b = append(b, byte(addr.Port()>>8), byte(addr.Port()))
	xorNonce(b[start+1:], nonce)
	return b
}

// parseReflectBody reads an answer's body (see appendReflectBody): it
// must be exactly one address of its family.
func parseReflectBody(body []byte, nonce *[queryNonceSize]byte) (netip.AddrPort, bool) {
	var buf [reflectMaxBody]byte
	if len(body) < 1 || len(body) > len(buf) {
		return netip.AddrPort{}, false
	}
	b := buf[:copy(buf[:], body)]
	xorNonce(b[1:], nonce)
	var ip netip.Addr
	switch {
	case b[0] == 4 && len(b) == 1+4+2:
		ip = netip.AddrFrom4([4]byte(b[1:5]))
	case b[0] == 6 && len(b) == 1+16+2:
		ip = netip.AddrFrom16([16]byte(b[1:17]))
	default:
		return netip.AddrPort{}, false
	}
	n := len(b)
	return netip.AddrPortFrom(ip, uint16(b[n-2])<<8|uint16(b[n-1])), true
}

func xorNonce(b []byte, nonce *[queryNonceSize]byte) {
	for i := range b {
		b[i] ^= nonce[i%queryNonceSize]
	}
}

// reflectState is a Listener's: its own asks waiting for an answer
// (Listener.Reflect), and the counts of the asks it answered and did not.
type reflectState struct {
	waiting atomic.Int32 // len(waits): the reader looks no further while 0
	mu      sync.Mutex
	waits   map[[queryNonceSize]byte]*reflectWait

	answered, dropped atomic.Uint64
}

// reflectWait is one ask of Listener.Reflect: to whom, and where its
// answer goes.
type reflectWait struct {
	server netip.AddrPort
	got    chan netip.AddrPort // one answer, buffered
}

// answerReflect answers the ask p (its nonce), from addr, with the
// address it came from: not with Stealth, and within the rules for
// answering an address with no connection (answerUnconnected). It takes p.
func (l *Listener) answerReflect(ep *endpoint, addr netip.AddrPort, p *packet, nonce *[queryNonceSize]byte) {
	in := len(p.b)
	if l.cfg.stealth {
		l.reflect.dropped.Add(1)
		ep.putPacket(p)
		return
	}
	// Built in the ask's own buffer (at least 2 KiB): the nonce is
	// copied out already.
	var body [reflectMaxBody]byte
	d := appendQueryDatagram(p.buf[:0], reflectKindAnswer, nonce, appendReflectBody(body[:0], nonce, addr), 0)
	if !l.answerUnconnected(ep, addr, in, d, &l.reflect.answered) {
		l.reflect.dropped.Add(1)
	}
	ep.putPacket(p)
}

// takeReflection hands an answer (its nonce and body) from addr to the
// Reflect waiting for it, and reports whether one was: an answer to none
// of this Listener's asks, or from another address than the one asked,
// is not taken.
func (l *Listener) takeReflection(addr netip.AddrPort, nonce *[queryNonceSize]byte, body []byte) bool {
	if l.reflect.waiting.Load() == 0 {
		return false
	}
	l.reflect.mu.Lock()
	w := l.reflect.waits[*nonce]
	l.reflect.mu.Unlock()
	if w == nil || w.server != addr {
		return false
	}
	a, ok := parseReflectBody(body, nonce)
	if !ok {
		return false
	}
	select {
	case w.got <- a:
	default: // answered already
	}
	return true
}

// Reflect asks the knet server at serverAddr which address it sees the
// Listener's socket as, and returns it: behind a NAT, the public address
// and port the NAT maps the socket to for that server, where others may
// reach the Listener (for a NAT that maps every destination alike). It
// asks from the Listener's own socket (the first, with Config.Sockets),
// so that the mapping learned is the one the Listener hosts on.
//
// The ask is sent again if no answer comes (after 250ms, then at
// intervals doubling, five times in all); Reflect gives up after 5s with
// an error wrapping a *TimeoutError that names the server, or with ctx's
// error if ctx is done first, or net.ErrClosed once the Listener closes.
// A server that does not reflect (a Stealth knet Listener, a knet from
// before reflection, another kNet implementation) looks the same as one
// that is not there: Reflect times out.
//
// Only an answer from serverAddr that echoes the random nonce of one of
// the asks is taken, so a host off the path cannot forge one. The server
// must have no connection from this socket: its connection would take
// the ask for its own datagram and ignore it.
func (l *Listener) Reflect(ctx context.Context, serverAddr string) (netip.AddrPort, error) {
	if ctx == nil {
		return netip.AddrPort{}, errNilContext
	}
	server, err := resolveReflector(l.Addr().Network(), serverAddr)
	if err != nil {
		return netip.AddrPort{}, err
	}
	select {
	case <-l.closed:
		return netip.AddrPort{}, fmt.Errorf("knet: reflect via %v: %w", server, net.ErrClosed)
	default:
	}
	ctx, cancel := context.WithTimeoutCause(ctx, queryTimeout, errQueryTimeout)
	defer cancel()
	got := make(chan netip.AddrPort, 1)
	var nonces [][queryNonceSize]byte
	defer func() {
		l.reflect.mu.Lock()
		for _, n := range nonces {
			delete(l.reflect.waits, n)
		}
		l.reflect.waiting.Store(int32(len(l.reflect.waits)))
		l.reflect.mu.Unlock()
	}()
	ep := l.eps[0]
	buf := make([]byte, 0, queryPadTo)
	send := func() {
		var n [queryNonceSize]byte
		rand.Read(n[:]) // never fails (crypto/rand)
		l.reflect.mu.Lock()
		if l.reflect.waits == nil {
			l.reflect.waits = make(map[[queryNonceSize]byte]*reflectWait)
		}
		l.reflect.waits[n] = &reflectWait{server: server, got: got}
		l.reflect.waiting.Store(int32(len(l.reflect.waits)))
		l.reflect.mu.Unlock()
		nonces = append(nonces, n)
		buf = appendQueryDatagram(buf[:0], reflectKindAsk, &n, nil, queryPadTo)
		ep.write(buf, server)
	}
	send()
	resend := queryFirstResend
	t := time.NewTimer(resend)
	defer t.Stop()
	for {
		select {
		case a := <-got:
			return a, nil
		case <-l.closed:
			return netip.AddrPort{}, fmt.Errorf("knet: reflect via %v: %w", server, net.ErrClosed)
		case <-ctx.Done():
			return netip.AddrPort{}, reflectError(ctx, server)
		case <-t.C:
			if len(nonces) < queryMaxSends {
				send()
				resend *= 2
				t.Reset(resend)
			}
		}
	}
}

// Reflect asks the knet server at serverAddr which address it sees a
// new UDP socket of this host as, as Listener.Reflect does for a
// Listener's socket; the socket is closed on return. The network is
// "udp", "udp4" or "udp6". It tells a host its public address, and,
// asked of two servers, whether its NAT maps each destination to a port
// of its own (the two answers differ): not the mapping of any socket
// that stays open, which Listener.Reflect tells. It fails with
// ErrPortUnreachable if the system reports that nothing listens there.
func Reflect(ctx context.Context, network, serverAddr string) (netip.AddrPort, error) {
	return reflectWith(ctx, network, serverAddr, &endpointOptions{})
}

// reflectWith is Reflect with the endpoint's options (tests).
func reflectWith(ctx context.Context, network, serverAddr string, o *endpointOptions) (netip.AddrPort, error) {
	if ctx == nil {
		return netip.AddrPort{}, errNilContext
	}
	if err := checkNetwork(network); err != nil {
		return netip.AddrPort{}, err
	}
	server, err := resolveReflector(network, serverAddr)
	if err != nil {
		return netip.AddrPort{}, err
	}
	sock, err := o.dialSocket(network, net.UDPAddrFromAddrPort(server))
	if err != nil {
		return netip.AddrPort{}, err
	}
	ctx, cancel := context.WithTimeoutCause(ctx, queryTimeout, errQueryTimeout)
	defer cancel()
	var seen netip.AddrPort
	err = exchangeQueries(ctx, sock, server, queryMaxSends, reflectKindAsk, func(from netip.AddrPort, nonce *[queryNonceSize]byte, body []byte, _ time.Duration) bool {
		a, ok := parseReflectBody(body, nonce)
		if ok && from == server {
			seen = a
		}
		return ok && from == server
	})
	switch {
	case seen.IsValid():
		return seen, nil
	case ctx.Err() != nil && errors.Is(err, ctx.Err()):
		return netip.AddrPort{}, reflectError(ctx, server)
	}
	return netip.AddrPort{}, err
}

// resolveReflector resolves a reflector's address for network.
func resolveReflector(network, serverAddr string) (netip.AddrPort, error) {
	raddr, err := net.ResolveUDPAddr(network, serverAddr)
	if err != nil {
		return netip.AddrPort{}, err
	}
	if raddr.Port == 0 {
		return netip.AddrPort{}, fmt.Errorf("knet: reflect %s %q: no port to send to", network, serverAddr)
	}
	return unmap(raddr.AddrPort()), nil
}

// reflectError is a Reflect's error once ctx is done: its own timeout,
// naming the server, or the caller's ctx's error.
func reflectError(ctx context.Context, server netip.AddrPort) error {
	if context.Cause(ctx) == errQueryTimeout {
		return fmt.Errorf("knet: reflect via %v: %w", server, &TimeoutError{Silent: queryTimeout, Op: "reflect"})
	}
	return ctx.Err()
}
