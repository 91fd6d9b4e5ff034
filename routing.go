package knet

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"time"
)

// Past one machine: routable connection IDs, and Dial over the servers a
// connect token names (at the end of the file).
//
// Routable connection IDs (Config.ServerID): a fleet of secure servers
// behind one address, and a stateless UDP load balancer in front that
// sends each datagram to the server its connection ID names, so that a
// client whose NAT rebinds still reaches its server. QUIC-LB's plaintext
// algorithm (draft-ietf-quic-load-balancers) in our 4 bytes: the server
// ID in the connection ID's first bytes on the wire, the rest random.
// QUIC-LB's first byte (the config rotation bits and the length) does not
// fit in 4 bytes: the balancer is told the ID's length instead.
//
// The connection ID, as it travels after a client datagram's header
// (docs/PROTOCOL.md 7.2, read there as a u32 LE), byte by byte:
//
//	0 .. k-1   the server ID, Config.ServerID, k = 0 to 3 bytes
//	k .. 3     random (crypto/rand), 32-8k bits
//
// It is never 0, and unique among the listener's live connections (the
// random part is drawn again while one holds it; see pickCID for when
// they run out).

const (
	// MaxServerIDSize is the most bytes of Config.ServerID: at least one
	// byte of the 4-byte connection ID stays random.
	MaxServerIDSize = cidSize - 1
	// cidDraws bounds the random draws for a connection ID that no live
	// connection holds; after them, a short random part is searched for
	// a free value, and a long one, being that full, refuses.
	cidDraws = 64
)

// errNoCID refuses a connection for which no connection ID is free: as
// many live connections as the random part of the ID can tell apart.
var errNoCID = errors.New("knet: server full: no connection ID free (Config.ServerID leaves too few random bits)")

// checkServerID checks a Listener's Config.ServerID.
func (c *config) checkServerID() error {
	switch {
	case len(c.serverID) > MaxServerIDSize:
		return fmt.Errorf("knet: Config.ServerID of %d bytes, at most %d: the rest of the 4-byte connection ID must stay random", len(c.serverID), MaxServerIDSize)
	case len(c.serverID) > 0 && c.privateKey == nil:
		return errors.New("knet: Config.ServerID needs Config.PrivateKey: only secure sessions carry a connection ID")
	}
	return nil
}

// pickCID returns a connection ID that starts with serverID, the rest
// from crypto/rand, which taken (the IDs of the live connections) does not
// hold. ok is false when every ID with that prefix is taken.
func pickCID(serverID []byte, taken func(uint32) bool) (id uint32, ok bool) {
	var b [cidSize]byte
	k := copy(b[:], serverID)
	for range cidDraws {
		rand.Read(b[k:])
		if id := binary.LittleEndian.Uint32(b[:]); id != 0 && !taken(id) {
			return id, true
		}
	}
	if cidSize-k > 2 {
		// 2^24 values or more, and 64 draws all taken: full for all
		// practical purposes (searching them would hold the listener).
		return 0, false
	}
	// 2^8 or 2^16 values: walk them from the last draw.
	n := 1 << (8 * (cidSize - k))
	start := 0
	for i := k; i < cidSize; i++ {
		start = start<<8 | int(b[i])
	}
	for j := range n {
		v := (start + j) % n
		for i := cidSize - 1; i >= k; i-- {
			b[i] = byte(v)
			v >>= 8
		}
		if id := binary.LittleEndian.Uint32(b[:]); id != 0 && !taken(id) {
			return id, true
		}
	}
	return 0, false
}

// ServerIDFromDatagram returns the server ID a load balancer routes the
// datagram b on: the first idLen bytes (1 to MaxServerIDSize, the length
// of the fleet's Config.ServerID) of the connection ID b carries, read as
// a big-endian number (Config.ServerID []byte{0x12, 0x34} is 0x1234). b
// is a datagram from a client to a secure server, as the balancer
// received it.
//
// ok is false, and the balancer should route b by its source address, for
// a datagram that carries no connection ID: one too short for a header,
// an ID and a tag, a ConnectSyn (the handshake, whose server is then
// the balancer's choice; its answer gives the client the ID), a server
// query, or a bad idLen. A datagram of a plaintext session carries no
// connection ID either, but nothing in its bytes says so: in front of
// plaintext servers, route by address only. ok does not mean the datagram
// is genuine: only the server it names can authenticate it, and a forged
// one costs that server a failed authentication, as it would the
// balancer's own choice.
//
// It reads b without keeping it, allocates nothing and never panics.
func ServerIDFromDatagram(b []byte, idLen int) (id uint32, ok bool) {
	if idLen < 1 || idLen > MaxServerIDSize {
		return 0, false
	}
	n := headerSize(b)
	if n < 0 || len(b)-n < cidSize+sealOverhead {
		return 0, false
	}
	cid := b[n : n+cidSize]
	if binary.LittleEndian.Uint32(cid) == 0 {
		return 0, false // never given
	}
	if clearSyn(b) {
		return 0, false
	}
	if _, _, _, query := parseQueryDatagram(b); query {
		return 0, false
	}
	for _, c := range cid[:idLen] {
		id = id<<8 | uint32(c)
	}
	return id, true
}

// clearSyn reports whether b looks like a client's ConnectSyn, the one
// datagram a secure client sends in clear: a header without InOrder, and a
// first message block, whole, holding a ConnectSyn. It allocates nothing
// (isConnectSyn parses the whole datagram, InOrder arrays and all).
func clearSyn(b []byte) bool {
	if len(b) < minHeaderSize || b[2]&(headerFlagInOrder>>16) != 0 {
		return false
	}
	m, _, err := parseMessage(b[minHeaderSize:])
	return err == nil && !m.fragment && !m.fragStart && m.id == idConnectSyn
}

// TokenDialError is Dial's error when it tried every server of its
// connect token (Dial with no address) and none admitted it: each
// attempt, in order, with why it failed. errors.Is and errors.As see
// through it to each attempt's error (ErrRefused, ErrTokenRejected, a
// *TimeoutError...).
type TokenDialError struct {
	Attempts []DialAttempt
}

// DialAttempt is one server's attempt in a TokenDialError.
type DialAttempt struct {
	Server netip.AddrPort
	Err    error
}

func (e *TokenDialError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "knet: none of the connect token's %d servers admitted the client", len(e.Attempts))
	for i, a := range e.Attempts {
		fmt.Fprintf(&b, "; %d. %v: %v", i+1, a.Server, a.Err)
	}
	return b.String()
}

// Unwrap returns each attempt's error.
func (e *TokenDialError) Unwrap() []error {
	errs := make([]error, len(e.Attempts))
	for i, a := range e.Attempts {
		errs[i] = a.Err
	}
	return errs
}

// errNotTried is the attempt of a server Dial had no time left for.
var errNotTried = errors.New("knet: not tried: ConnectTimeout spent on the servers before")

// dialServers tries the servers of rc's connect token in order, each
// attempt with an equal share of what is left of ConnectTimeout (or of
// ctx's deadline, if sooner), and returns the first connection made.
func dialServers(ctx context.Context, network string, rc *config, o *endpointOptions) (*Conn, error) {
	servers, err := TokenServers(rc.token)
	if err != nil {
		return nil, fmt.Errorf("knet: Dial with no address: Config.Token: %w", err)
	}
	if err := rc.checkSynPayload(); err != nil && !rc.fallbackTCP {
		return nil, err // the same for every server
	}
	end := time.Now().Add(rc.connectTimeout)
	if dl, ok := ctx.Deadline(); ok && dl.Before(end) {
		end = dl // shares of what ctx leaves, so that each server gets its turn
	}
	e := &TokenDialError{}
	for i, s := range servers {
		a := *rc // the attempt's own timeout; the rest is shared, read only
		a.connectTimeout = (time.Until(end) / time.Duration(len(servers)-i)).Truncate(time.Millisecond)
		if a.connectTimeout <= 0 {
			e.Attempts = append(e.Attempts, DialAttempt{s, errNotTried})
			continue
		}
		c, err := dialAddr(ctx, network, s.String(), &a, o)
		if err == nil {
			return c, nil
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		e.Attempts = append(e.Attempts, DialAttempt{s, err})
	}
	return nil, e
}
