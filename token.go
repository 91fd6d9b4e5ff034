package knet

import (
	"container/heap"
	"crypto/cipher"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"time"

	"golang.org/x/crypto/chacha20poly1305"
)

// Connect tokens (Config.TokenKey, Config.Token): netcode.io's idea. A
// backend that shares a secret key with its game servers issues a client a
// short-lived token binding who the client is (ClientID, UserData), until
// when, and for which servers. The servers are in clear (authenticated,
// not encrypted), so that the client knows where to go (TokenServers; Dial
// with no address tries them in order); the rest is sealed. The client
// sends the token inside its encrypted handshake; a secure listener with
// the key checks it before it allocates anything for the attempt. See
// SECURE.md ("Connect tokens") for the layout and the limits.

const (
	// TokenKeySize is the size of the key shared by the backend that
	// issues connect tokens and the servers that check them.
	TokenKeySize = chacha20poly1305.KeySize
	// MaxTokenUserData is the most bytes of Token.UserData.
	MaxTokenUserData = 256
	// MaxTokenServers is the most addresses a token names.
	MaxTokenServers = 8
	// MaxTokenLifetime is the longest a token may be valid: IssueToken
	// refuses an expiry further ahead, and a server one further ahead of
	// its own clock than this plus a minute (for the clocks' skew).
	MaxTokenLifetime = time.Hour

	tokenVersion   = 2
	tokenNonceSize = chacha20poly1305.NonceSizeX
	// tokenHeadSize is the fixed start of the head: version, expiry,
	// nonce. The server count and the servers follow; all of it is in
	// clear and authenticated.
	tokenHeadSize = 1 + 8 + tokenNonceSize
	tokenAddrSize = 16 + 2
	// maxTokenHead is the head at its longest.
	maxTokenHead = tokenHeadSize + 1 + MaxTokenServers*tokenAddrSize
	tokenSkew    = time.Minute
	// maxTokenSize is the longest sealed token: the head, the body at its
	// longest, the tag.
	maxTokenSize = maxTokenHead + 8 + 2 + MaxTokenUserData + chacha20poly1305.Overhead
	// maxTokenCache bounds the replay cache: the tokens used and not yet
	// expired that a listener remembers (about 100 bytes each).
	maxTokenCache = 1 << 16
)

// tokenAD is the start of a token's associated data, before its head: it
// keeps a token's key from being mistaken for any other use of it.
const tokenAD = "knet connect token v2"

// Token is what a connect token binds: the client's identity and the
// servers it may join until it expires. The backend seals one with
// IssueToken; a server with the key hands it to Config.AdmitConn as
// Conn.Token.
type Token struct {
	// ClientID identifies the client, as the backend knows it.
	ClientID uint64
	// UserData is anything else the backend tells the server about the
	// client (a session, a team, rights), at most MaxTokenUserData bytes.
	UserData []byte
	// Expires is when the token stops being accepted, to the second. It
	// may be at most MaxTokenLifetime ahead.
	Expires time.Time
	// Servers are the addresses the token may be used at (1 to
	// MaxTokenServers): a server's Config.PublicAddrs, or its socket's
	// address. They are readable by the client (TokenServers), which
	// tries them in this order when it dials with no address.
	Servers []netip.AddrPort
}

// ErrTokenRejected is Dial's error (with ErrRefused) when the server
// refused the connect token of Config.Token, or required one it did not
// get: the *RefusedError's reason says why (missing, invalid, expired,
// already used, not for this server, or the server's replay cache full).
var ErrTokenRejected = errors.New("knet: connect token rejected")

// The reasons a token is rejected. Each is an ErrTokenRejected.
var (
	errTokenMissing  = tokenErr("missing")
	errTokenInvalid  = tokenErr("invalid") // malformed, forged, or another key's
	errTokenExpired  = tokenErr("expired")
	errTokenAhead    = tokenErr("expires too far ahead")
	errTokenReplayed = tokenErr("already used")
	errTokenServer   = tokenErr("not for this server")
	errTokenBusy     = tokenErr("too many tokens in use")
)

func tokenErr(why string) error { return fmt.Errorf("%w: %s", ErrTokenRejected, why) }

// errNotToken is TokenServers' error for bytes that are no connect token.
var errNotToken = errors.New("knet: not a connect token (of this version)")

// IssueToken seals t under key (TokenKeySize bytes, shared with the
// servers' Config.TokenKey) into a connect token for a client's
// Config.Token. It fails when t does not fit the limits: no server or more
// than MaxTokenServers, more than MaxTokenUserData bytes of user data, an
// expiry more than MaxTokenLifetime ahead. Each token has a random nonce,
// so two tokens for the same t differ, and each is accepted once. The
// expiry and the servers are in clear, authenticated (a client reads the
// servers with TokenServers; a server refuses a token whose list was
// changed); the client ID and the user data are encrypted.
func IssueToken(key []byte, t Token) ([]byte, error) {
	aead, err := tokenAEAD(key)
	if err != nil {
		return nil, err
	}
	switch {
	case len(t.Servers) == 0 || len(t.Servers) > MaxTokenServers:
		return nil, fmt.Errorf("knet: a token names 1 to %d servers, not %d", MaxTokenServers, len(t.Servers))
	case len(t.UserData) > MaxTokenUserData:
		return nil, fmt.Errorf("knet: token user data of %d bytes, at most %d", len(t.UserData), MaxTokenUserData)
	case t.Expires.Unix() <= 0:
		return nil, errors.New("knet: a token needs an expiry")
	case t.Expires.After(time.Now().Add(MaxTokenLifetime)):
		return nil, fmt.Errorf("knet: a token expires at most %v ahead", MaxTokenLifetime)
	}
	// Head, in clear: version, expiry (Unix seconds), nonce, servers.
	b := make([]byte, tokenHeadSize, maxTokenSize)
	b[0] = tokenVersion
	binary.LittleEndian.PutUint64(b[1:], uint64(t.Expires.Unix()))
	if _, err := rand.Read(b[9:tokenHeadSize]); err != nil {
		return nil, err
	}
	b = append(b, byte(len(t.Servers)))
	for _, s := range t.Servers {
		ip := s.Addr().As16() // an IPv4 address as ::ffff:a.b.c.d
		b = append(b, ip[:]...)
		b = binary.LittleEndian.AppendUint16(b, s.Port())
	}
	head := len(b)
	// Body, sealed: client ID, user data.
	body := make([]byte, 0, maxTokenSize)
	body = binary.LittleEndian.AppendUint64(body, t.ClientID)
	body = binary.LittleEndian.AppendUint16(body, uint16(len(t.UserData)))
	body = append(body, t.UserData...)
	var ad [len(tokenAD) + maxTokenHead]byte
	return aead.Seal(b, b[9:tokenHeadSize], body, tokenADFor(&ad, b[:head])), nil
}

func tokenAEAD(key []byte) (cipher.AEAD, error) {
	if len(key) != TokenKeySize {
		return nil, fmt.Errorf("knet: a token key must be %d bytes", TokenKeySize)
	}
	return chacha20poly1305.NewX(key)
}

// tokenADFor writes the associated data of a token whose head is head
// into ad.
func tokenADFor(ad *[len(tokenAD) + maxTokenHead]byte, head []byte) []byte {
	copy(ad[:], tokenAD)
	n := copy(ad[len(tokenAD):], head)
	return ad[:len(tokenAD)+n]
}

// parseTokenHead reads the clear head of the token b: its length, and the
// servers it names (appended to servers, which may be nil). ok is false
// for anything but a token of this version whose head is whole and
// leaves room for the body and the tag. Nothing is authenticated here.
func parseTokenHead(b []byte, servers []netip.AddrPort) (n int, _ []netip.AddrPort, ok bool) {
	// Version, expiry, nonce, u8 server count k, k times (16-byte IP,
	// u16 port).
	if len(b) < tokenHeadSize+1 || len(b) > maxTokenSize || b[0] != tokenVersion {
		return 0, servers, false
	}
	k := int(b[tokenHeadSize])
	n = tokenHeadSize + 1 + k*tokenAddrSize
	if k == 0 || k > MaxTokenServers || len(b) < n+8+2+chacha20poly1305.Overhead {
		return 0, servers, false
	}
	for p := b[tokenHeadSize+1 : n]; len(p) > 0; p = p[tokenAddrSize:] {
		ip := netip.AddrFrom16([16]byte(p[:16])).Unmap()
		servers = append(servers, netip.AddrPortFrom(ip, binary.LittleEndian.Uint16(p[16:])))
	}
	return n, servers, true
}

// TokenServers returns the servers a connect token names, in the
// backend's order: where a client with it may connect (Dial with no
// address tries them in this order). It reads the token's clear head
// without the key, so it does not authenticate it: a server refuses a
// token whose list was changed. It fails for bytes that are no token of
// this version.
func TokenServers(token []byte) ([]netip.AddrPort, error) {
	_, servers, ok := parseTokenHead(token, nil)
	if !ok {
		return nil, errNotToken
	}
	return servers, nil
}

// openToken authenticates the token b, in place, and decodes it: it fails
// with errTokenInvalid unless b was sealed by IssueToken under aead's key,
// and with errTokenExpired or errTokenAhead for an expiry outside what the
// server takes at now. It returns the nonce, the key of the replay cache.
// The token's fields do not alias b.
func openToken(aead cipher.AEAD, b []byte, now time.Time) (t Token, nonce [tokenNonceSize]byte, err error) {
	head, servers, ok := parseTokenHead(b, make([]netip.AddrPort, 0, MaxTokenServers))
	if !ok {
		return t, nonce, errTokenInvalid
	}
	var ad [len(tokenAD) + maxTokenHead]byte
	body, err := aead.Open(b[head:head], b[9:tokenHeadSize], b[head:], tokenADFor(&ad, b[:head]))
	if err != nil {
		return t, nonce, errTokenInvalid
	}
	copy(nonce[:], b[9:tokenHeadSize])
	// Authenticated from here: the backend wrote it, but we check it as
	// carefully as anything else.
	exp := int64(binary.LittleEndian.Uint64(b[1:]))
	switch {
	case exp <= now.Unix():
		return t, nonce, errTokenExpired
	case exp > now.Add(MaxTokenLifetime+tokenSkew).Unix():
		return t, nonce, errTokenAhead
	}
	t.Expires = time.Unix(exp, 0)
	t.Servers = servers
	// u64 client ID, u16 user data length, user data; nothing after.
	if len(body) < 8+2 {
		return t, nonce, errTokenInvalid
	}
	t.ClientID = binary.LittleEndian.Uint64(body)
	m := int(binary.LittleEndian.Uint16(body[8:]))
	body = body[10:]
	if m > MaxTokenUserData || len(body) != m {
		return t, nonce, errTokenInvalid
	}
	if m > 0 {
		t.UserData = append([]byte(nil), body...)
	}
	return t, nonce, nil
}

// tokenChecker is a secure Listener's half of connect tokens: the key, the
// addresses tokens must name, and the replay cache. Safe for concurrent
// use (the readers of a listener's sockets share it).
type tokenChecker struct {
	aead  cipher.AEAD
	addrs []netip.AddrPort // unmapped

	mu    sync.Mutex
	seen  map[[tokenNonceSize]byte]struct{}
	byExp tokenHeap
}

func newTokenChecker(key []byte, addrs []netip.AddrPort) (*tokenChecker, error) {
	aead, err := tokenAEAD(key)
	if err != nil {
		return nil, fmt.Errorf("knet: Config.TokenKey: %w", err)
	}
	tc := &tokenChecker{aead: aead, seen: make(map[[tokenNonceSize]byte]struct{})}
	for _, a := range addrs {
		tc.addrs = append(tc.addrs, unmap(a))
	}
	return tc, nil
}

// check takes the token a client sent (empty: none) at now: it returns
// the token and its nonce if it is valid, for this server, and not used
// before. It changes nothing: the token is used (use) only once the
// connection it admits is established, so that an attempt that never
// completes (a replay of the client's ConnectSyn from another address,
// say) cannot burn it.
func (tc *tokenChecker) check(b []byte, now time.Time) (*Token, [tokenNonceSize]byte, error) {
	if len(b) == 0 {
		return nil, [tokenNonceSize]byte{}, errTokenMissing
	}
	t, nonce, err := openToken(tc.aead, b, now)
	if err != nil {
		return nil, nonce, err
	}
	if !tc.forUs(t.Servers) {
		return nil, nonce, errTokenServer
	}
	if err := tc.usable(nonce, now.Unix()); err != nil {
		return nil, nonce, err
	}
	return &t, nonce, nil
}

// forUs reports whether one of servers is one of the listener's addresses.
func (tc *tokenChecker) forUs(servers []netip.AddrPort) bool {
	for _, s := range servers {
		for _, a := range tc.addrs {
			if s == a {
				return true
			}
		}
	}
	return false
}

// usable reports, as use would, whether a token's nonce may be used at
// now (Unix seconds), without recording it.
func (tc *tokenChecker) usable(nonce [tokenNonceSize]byte, now int64) error {
	tc.mu.Lock()
	defer tc.mu.Unlock()
	return tc.usableLocked(nonce, now)
}

func (tc *tokenChecker) usableLocked(nonce [tokenNonceSize]byte, now int64) error {
	for len(tc.byExp) > 0 && tc.byExp[0].exp <= now {
		delete(tc.seen, heap.Pop(&tc.byExp).(tokenUse).nonce)
	}
	if _, ok := tc.seen[nonce]; ok {
		return errTokenReplayed
	}
	if len(tc.seen) >= maxTokenCache {
		return errTokenBusy
	}
	return nil
}

// use records a token's nonce as used until exp (Unix seconds), or fails
// if it was used before, or if maxTokenCache tokens in use fill the cache
// (fail closed: a replay must never pass for want of memory). Tokens that
// expired by now are forgotten first: they are refused as expired anyway.
func (tc *tokenChecker) use(nonce [tokenNonceSize]byte, exp, now int64) error {
	tc.mu.Lock()
	defer tc.mu.Unlock()
	if err := tc.usableLocked(nonce, now); err != nil {
		return err
	}
	tc.seen[nonce] = struct{}{}
	heap.Push(&tc.byExp, tokenUse{exp: exp, nonce: nonce})
	return nil
}

// tokenHeap is a min-heap of used tokens by expiry.
type tokenUse struct {
	exp   int64
	nonce [tokenNonceSize]byte
}

type tokenHeap []tokenUse

func (h tokenHeap) Len() int           { return len(h) }
func (h tokenHeap) Less(i, j int) bool { return h[i].exp < h[j].exp }
func (h tokenHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *tokenHeap) Push(x any)        { *h = append(*h, x.(tokenUse)) }
func (h *tokenHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

// Token returns the connect token a secure server checked for this
// connection (Config.TokenKey): who the backend says the client is. Nil on
// a client, or when the server takes no tokens. It is set before
// Config.AdmitConn runs, and the caller may keep and change the copy it
// gets.
func (c *Conn) Token() *Token {
	if c.sec == nil || c.sec.token == nil {
		return nil
	}
	t := *c.sec.token
	t.UserData = append([]byte(nil), t.UserData...)
	t.Servers = append([]netip.AddrPort(nil), t.Servers...)
	return &t
}
