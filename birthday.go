package knet

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"net"
	"net/netip"
	"sync"
	"time"
)

// Birthday probing (issue 35): a NAT that maps each destination to a
// port of its own (a symmetric NAT, "hard") gives the socket that probes
// a peer a port no one can predict, and a port-restricted cone on the
// other side ("easy") lets in only the exact address and port its own
// socket sent to. Punching as punch.go does then never meets. Instead
// the hard side opens birthdaySockets extra sockets, each of which sends
// one probe to the easy side's public address, so that its NAT holds
// that many mappings toward it, and the easy side sends probes to random
// ports of the hard side's public address. Each probe hits one of the
// mappings with a chance of birthdaySockets/64512, and a hit passes both
// NATs: the hard NAT takes it for the reply to its mapping's flow, and
// the easy NAT, having sent to that port, lets the hard socket's next
// datagrams in. With 256 sockets and 2048 probes a path is found with a
// chance of 1-(1-256/64512)^2048, about 99.97 %, in half a second on
// average (Tailscale's NAT traversal does the same with its numbers).
//
// Who is hard each side learns by reflecting its socket off two knet
// servers (IntroOptions.Reflector): two ports mean a NAT that maps per
// destination. It tells the introducer, which passes it on in a flags
// byte after the candidates (docs/PROTOCOL.md, 8.2); a peer without the
// flags byte reads as easy.
//
// Either side may be the hard one. A hard joiner's extra sockets send,
// the host's Punch sprays, and the joiner dials from the extra socket the
// host's probe came in on (probeBirthday). A hard host's Punch opens the
// extra sockets (hostFan), the joiner's probing sprays, and the Listener
// adopts the extra socket the joiner's probe came in on (adopt): it
// serves it beside its own until the joiner's connection, admitted there
// as any other, ends. Two hard sides are left to a relay.

const (
	// birthdaySockets is how many extra sockets a hard joiner opens, and
	// birthdayResend how many punch rounds apart each sends its probe
	// again (in case the first was lost before its NAT): at most
	// punchRounds/birthdayResend probes of 20 bytes each.
	birthdaySockets = 256
	birthdayResend  = 20
	// birthdayProbes is the most probes an easy side sends to random
	// ports of a hard peer's address, birthdayPerRound of them in each
	// punch round (50 ms): about 1000 a second, for 2 s at most.
	birthdayProbes   = 2048
	birthdayPerRound = (birthdayProbes + punchRounds - 1) / punchRounds
	// The ports a NAT maps to: Linux's masquerade picks them from 1024
	// to 65535 (nf_nat's default range for a source port above 1023),
	// and so do most home routers.
	birthdayMinPort = 1024
	birthdayPorts   = 65536 - birthdayMinPort

	// birthdayKindOpen is the server query datagram kind (section 8) of
	// what a hard side's extra sockets send to open their NAT's
	// mappings: the token in the nonce field, 20 bytes. No one takes or
	// answers it (a Listener drops it as a stray datagram), so that a
	// peer that reads one, its NAT having let it in by chance, never
	// takes for a path a socket that did not hear the peer.
	birthdayKindOpen = 13

	// introFlagHard, in an introduction's flags byte: the side's NAT
	// maps each destination to a port of its own. Other bits are
	// ignored.
	introFlagHard = 1
)

// IntroOptions are the options of Listener.HostWith and JoinWith.
type IntroOptions struct {
	// Reflector is a second knet server, at another address or port
	// than the introducer: with it, the side first asks both which
	// address they see its socket at (address reflection), and, if the
	// two differ, its NAT maps each destination to a port of its own.
	// It says so to the introducer, which tells the other side
	// (Introduction.PeerHard), and sets Introduction.Hard: a hard joiner
	// facing an easy host then opens many sockets and the host probes
	// many ports (birthday probing). Empty, or a reflection unanswered
	// (loss, a reflector down): the side counts as easy, as before.
	Reflector string
}

// hard learns whether the socket that reflect asks from is behind a NAT
// that maps per destination, by reflecting off the introducer and
// o.Reflector; false with no Reflector.
func (o *IntroOptions) hard(ctx context.Context, reflect func(ctx context.Context, at string) (netip.AddrPort, error), introducer string) (bool, error) {
	if o == nil || o.Reflector == "" {
		return false, nil
	}
	// A reflection that goes unanswered (loss, a reflector down) leaves
	// the side easy: it punches as every side did before, and the relay
	// takes what that does not reach. Only ctx's end is an error.
	a, err := reflect(ctx, introducer)
	if err != nil {
		return false, ctx.Err()
	}
	b, err := reflect(ctx, o.Reflector)
	if err != nil {
		return false, ctx.Err()
	}
	return a != b, nil
}

// introFlags is the flags byte at the start of rest (what follows an
// ask's or an answer's candidates), known bits only; none if rest is
// empty (an introducer or asker from before the flags).
func introFlags(rest []byte) byte {
	if len(rest) == 0 {
		return 0
	}
	return rest[0] & introFlagHard
}

func introFlagsOf(hard bool) byte {
	if hard {
		return introFlagHard
	}
	return 0
}

// seedOf is in's seed for the random ports: its own (tests), or random.
func seedOf(in Introduction) uint64 {
	if in.seed != 0 {
		return in.seed
	}
	var b [8]byte
	rand.Read(b[:])
	return binary.LittleEndian.Uint64(b[:])
}

// birthdaySpray is an easy side's probing of a hard peer: random ports
// of its address, each at most once, birthdayProbes in all.
type birthdaySpray struct {
	ip    netip.Addr
	rng   *mrand.Rand
	sent  int
	tried [65536 / 64]uint64 // a bit per port
}

// newBirthdaySpray is the spray an easy side adds to its probing rounds
// (Punch, DialCandidates) when the other side alone is hard, toward the
// address the introducer saw it at (in.Peer[0]); nil otherwise.
func newBirthdaySpray(in Introduction) *birthdaySpray {
	if in.Hard || !in.PeerHard || len(in.Peer) == 0 {
		return nil
	}
	seed := seedOf(in)
	s := &birthdaySpray{ip: in.Peer[0].Addr().Unmap(), rng: mrand.New(mrand.NewPCG(seed, seed^0x35))}
	p := in.Peer[0].Port()
	s.tried[p/64] |= 1 << (p % 64) // probed anyway, each round
	return s
}

// round sends one round's probes (birthdayPerRound, within the budget)
// with send; nothing for a nil spray.
func (s *birthdaySpray) round(send func(netip.AddrPort)) {
	if s == nil {
		return
	}
	for i := 0; i < birthdayPerRound && s.sent < birthdayProbes; i++ {
		p := uint16(birthdayMinPort + s.rng.IntN(birthdayPorts))
		for s.tried[p/64]&(1<<(p%64)) != 0 {
			// Taken: the next one up, wrapping within the range (at
			// most birthdayProbes+1 of 64512 are taken).
			if p++; p == 0 {
				p = birthdayMinPort
			}
		}
		s.tried[p/64] |= 1 << (p % 64)
		s.sent++
		send(netip.AddrPortFrom(s.ip, p))
	}
}

// openBeside opens extra sockets for a hard joiner beside pc: UDP, on
// pc's local address (any port), on the calling goroutine (and so in
// its network namespace).
func openBeside(pc net.PacketConn) func() (net.PacketConn, error) {
	laddr, _ := addrPortOf(pc.LocalAddr())
	network := "udp"
	if laddr.Addr().Unmap().Is4() {
		network = "udp4"
	}
	return func() (net.PacketConn, error) {
		return net.ListenUDP(network, &net.UDPAddr{IP: laddr.Addr().Unmap().AsSlice()})
	}
}

// birthdayHit is a datagram carrying the token, on one of a hard
// side's sockets.
type birthdayHit struct {
	pc   net.PacketConn
	from netip.AddrPort
}

// birthdayFan is a hard side's extra sockets, each read by a goroutine
// of its own until a datagram carrying the token comes (hits) or stop.
type birthdayFan struct {
	socks   []net.PacketConn // the extra sockets, then the caller's (more of them)
	more    int
	hits    chan birthdayHit
	readers sync.WaitGroup
	stopped bool
}

// openFan opens birthdaySockets sockets with open (fewer if it fails:
// out of descriptors, say) and starts their readers, and those of more,
// sockets of the caller's that it reads but does not own.
func openFan(open func() (net.PacketConn, error), token [8]byte, more ...net.PacketConn) *birthdayFan {
	f := &birthdayFan{hits: make(chan birthdayHit, 1)}
	for range birthdaySockets {
		s, err := open()
		if err != nil {
			break
		}
		f.socks = append(f.socks, s)
	}
	for _, s := range append(more, f.socks...) {
		f.readers.Go(func() { readToken(s, token, f.hits) })
	}
	f.socks = append(f.socks, more...) // read and stopped, never closed: last
	f.more = len(more)
	return f
}

// send sends b from each extra socket to to.
func (f *birthdayFan) send(b []byte, to *net.UDPAddr) {
	for _, s := range f.socks[:len(f.socks)-f.more] {
		s.WriteTo(b, to)
	}
}

// stop ends the readers, and closes every extra socket but keep; each
// socket still open is left with no read deadline. It may be called
// again (nothing more is done).
func (f *birthdayFan) stop(keep net.PacketConn) {
	if f == nil || f.stopped {
		return
	}
	f.stopped = true
	for _, s := range f.socks {
		s.SetReadDeadline(time.Unix(1, 0))
	}
	f.readers.Wait()
	for i, s := range f.socks {
		if s == keep || i >= len(f.socks)-f.more {
			s.SetReadDeadline(time.Time{})
		} else {
			s.Close()
		}
	}
}

// probeBirthday is DialCandidates' probing for a hard joiner facing an
// easy host: pc probes the host's candidates as probeCandidates does,
// and birthdaySockets extra sockets, opened with open, each send a probe
// to the host's public address (in.Peer[0]) while the host probes random
// ports of the joiner's. It returns the socket a probe or an answer
// carrying the token came in on and the address it came from; every
// other socket it opened is closed by then, and pc too if another
// socket won. On failure pc is returned open, with the error.
func probeBirthday(ctx context.Context, pc net.PacketConn, in Introduction, open func() (net.PacketConn, error)) (net.PacketConn, netip.AddrPort, error) {
	if len(in.Peer) == 0 {
		return pc, netip.AddrPort{}, fmt.Errorf("knet: dial candidates: none given: %w", ErrNoDirectPath)
	}
	if d := time.Until(in.Start); d > 0 {
		select {
		case <-time.After(d):
		case <-ctx.Done():
			return pc, netip.AddrPort{}, ctx.Err()
		}
	}
	fan := openFan(open, in.Token, pc)
	padded := appendQueryDatagram(nil, punchKindProbe, &in.Token, nil, queryPadTo)
	small := appendQueryDatagram(nil, birthdayKindOpen, &in.Token, nil, 0)
	host := net.UDPAddrFromAddrPort(in.Peer[0])
	t := time.NewTimer(0)
	defer t.Stop()
	<-t.C
	for round := 0; round < punchRounds; round++ {
		for _, c := range in.Peer {
			pc.WriteTo(padded, net.UDPAddrFromAddrPort(c)) // an unreachable candidate is no error
		}
		if round%birthdayResend == 0 {
			fan.send(small, host)
		}
		t.Reset(punchInterval)
		select {
		case h := <-fan.hits:
			fan.stop(h.pc)
			tellFound(h.pc, h.from, &in.Token)
			if h.pc != pc {
				pc.Close()
			}
			return h.pc, h.from, nil
		case <-t.C:
		case <-ctx.Done():
			fan.stop(nil)
			return pc, netip.AddrPort{}, ctx.Err()
		}
	}
	fan.stop(nil)
	return pc, netip.AddrPort{}, fmt.Errorf("knet: dial %d candidates from %d sockets for %v: %w", len(in.Peer), len(fan.socks), time.Duration(punchRounds)*punchInterval, ErrNoDirectPath)
}

// hostFan is a hard host's probing beside its Punch: extra sockets, each
// sending a probe to the joiner's public address (in.Peer[0]) at the
// start and once more a second later, while the joiner probes random
// ports of the host's. The first socket a probe carrying the token comes
// in on is adopted by the Listener (adopt), and probes the joiner's
// candidates each round from then on, as the Listener's own socket does;
// the others are closed. Nil unless the host alone is hard.
type hostFan struct {
	l       *Listener
	in      Introduction
	fan     *birthdayFan
	adopted *endpoint
	open    []byte // the extra sockets' (birthdayKindOpen)
	probe   []byte // the adopted socket's
}

// openHostFan opens a hard host's extra sockets beside the Listener's
// on the calling goroutine (and so in its network namespace).
func (l *Listener) openHostFan(in Introduction) *hostFan {
	if !in.Hard || in.PeerHard || len(in.Peer) == 0 {
		return nil
	}
	laddr, _ := addrPortOf(l.Addr())
	network := "udp"
	if laddr.Addr().Unmap().Is4() {
		network = "udp4"
	}
	open := func() (net.PacketConn, error) {
		return net.ListenUDP(network, &net.UDPAddr{IP: laddr.Addr().Unmap().AsSlice()})
	}
	return &hostFan{
		l: l, in: in, fan: openFan(open, in.Token),
		open:  appendQueryDatagram(nil, birthdayKindOpen, &in.Token, nil, 0),
		probe: appendQueryDatagram(nil, punchKindProbe, &in.Token, nil, 0),
	}
}

// hits is where the fan's first hit comes; nil (never) for no fan or
// once one came.
func (h *hostFan) hits() <-chan birthdayHit {
	if h == nil || h.adopted != nil || h.fan.stopped {
		return nil
	}
	return h.fan.hits
}

// round sends round's probes: the extra sockets' (rounds 0, 20), or the
// adopted socket's.
func (h *hostFan) round(round int) {
	switch {
	case h == nil:
	case h.adopted != nil:
		for _, c := range h.in.Peer {
			h.adopted.write(h.probe, c)
		}
	case !h.fan.stopped && round%birthdayResend == 0:
		h.fan.send(h.open, net.UDPAddrFromAddrPort(h.in.Peer[0]))
	}
}

// take adopts the socket of a hit and probes the joiner from it at
// once: the joiner's probe opened its NAT to that socket's mapping.
func (h *hostFan) take(hit birthdayHit) {
	h.fan.stop(hit.pc)
	uc, ok := hit.pc.(*net.UDPConn)
	if !ok {
		hit.pc.Close()
		return
	}
	if h.adopted = h.l.adopt(uc); h.adopted != nil {
		h.round(0)
	}
}

// close closes the extra sockets not adopted.
func (h *hostFan) close() {
	if h != nil {
		h.fan.stop(nil)
	}
}

// adoptGrace is how long an adopted socket waits for its connection: a
// joiner that found it dials at once, and a handshake is done within a
// few seconds.
const adoptGrace = 10 * time.Second

// adopt makes the Listener serve uc beside its own sockets, for the
// connection of the joiner whose probe came in on it: a connection
// attempt there is admitted as any other (AcceptConn), under the same
// rules as on the Listener's own sockets, and the socket is closed once
// an established connection there ended and none is left, when none
// came within adoptGrace, or with the Listener. It returns nil, closing
// uc, if the Listener is closed.
func (l *Listener) adopt(uc *net.UDPConn) *endpoint {
	ep := newEndpoint(newUDPSocket(uc, false), false, l.cfg, &endpointOptions{})
	ep.l = l
	var once sync.Once
	release := func() {
		once.Do(func() {
			l.punch.mu.Lock()
			delete(l.punch.adopted, ep)
			l.punch.mu.Unlock()
			ep.close()
		})
	}
	ep.release = func(c *Conn) {
		// Only an established connection's end: an attempt that failed
		// there (a stranger's, say) leaves the socket to the joiner's.
		select {
		case <-c.estab:
		default:
			return
		}
		ep.mu.Lock()
		idle := len(ep.conns) == 0
		ep.mu.Unlock()
		if idle {
			go release() // never on the goroutine of the connection's end
		}
	}
	l.punch.mu.Lock()
	select {
	case <-l.closed:
		l.punch.mu.Unlock()
		uc.Close()
		return nil
	default:
	}
	if l.punch.adopted == nil {
		l.punch.adopted = make(map[*endpoint]struct{})
	}
	l.punch.adopted[ep] = struct{}{}
	l.punch.mu.Unlock()
	go ep.readLoop()
	time.AfterFunc(adoptGrace, func() {
		ep.mu.Lock()
		idle := len(ep.conns) == 0
		ep.mu.Unlock()
		if idle {
			release()
		}
	})
	return ep
}

// endpoints is the Listener's sockets: its own, then those it adopted
// (birthday probing) and still serves.
func (l *Listener) endpoints() []*endpoint {
	l.punch.mu.Lock()
	defer l.punch.mu.Unlock()
	if len(l.punch.adopted) == 0 {
		return l.eps
	}
	eps := append([]*endpoint(nil), l.eps...)
	for ep := range l.punch.adopted {
		eps = append(eps, ep)
	}
	return eps
}

// readToken reads s until a probe or an answer carrying token comes, and
// hands it to hits (unless another socket's came first), or until s
// fails for good or its read deadline passes. It answers nothing.
func readToken(s net.PacketConn, token [8]byte, hits chan<- birthdayHit) {
	buf := make([]byte, 2048)
	for {
		n, from, err := s.ReadFrom(buf)
		if err != nil {
			var ne net.Error
			if errors.Is(err, net.ErrClosed) || errors.As(err, &ne) && ne.Timeout() {
				return
			}
			continue // an ICMP error, say
		}
		kind, got, _, ok := parseQueryDatagram(buf[:n])
		if !ok || (kind != punchKindProbe && kind != punchKindAnswer) || got != token {
			continue
		}
		if f, ok := addrPortOf(from); ok {
			select {
			case hits <- birthdayHit{pc: s, from: unmap(f)}:
			default:
			}
			return
		}
	}
}

// tellFound tells the host at to, over pc, that the joiner found a path
// and its probes may stop: an answer carrying the token, which a
// listener does not answer, sent twice (one lost leaves the host
// probing for the rest of its 2 s).
func tellFound(pc net.PacketConn, to netip.AddrPort, token *[8]byte) {
	found := appendQueryDatagram(nil, punchKindAnswer, token, nil, 0)
	for range 2 {
		pc.WriteTo(found, net.UDPAddrFromAddrPort(to))
	}
}
