package knet

import (
	"bytes"
	"crypto/rand"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func newTokenKey(t testing.TB) []byte {
	k := make([]byte, TokenKeySize)
	_, err := rand.Read(k)
	require.NoError(t, err)
	return k
}

func sampleToken(servers ...netip.AddrPort) Token {
	if len(servers) == 0 {
		servers = []netip.AddrPort{netip.MustParseAddrPort("192.0.2.1:7000"), netip.MustParseAddrPort("[2001:db8::1]:7000")}
	}
	return Token{
		ClientID: 0x0102030405060708,
		UserData: []byte("team=red;rank=gold"),
		Expires:  time.Now().Add(time.Minute).Truncate(time.Second),
		Servers:  servers,
	}
}

func TestTokenRoundTrip(t *testing.T) {
	key := newTokenKey(t)
	want := sampleToken()
	b, err := IssueToken(key, want)
	require.NoError(t, err)
	assert.LessOrEqual(t, len(b), maxTokenSize)
	aead, err := tokenAEAD(key)
	require.NoError(t, err)
	got, nonce, err := openToken(aead, bytes.Clone(b), time.Now())
	require.NoError(t, err)
	assert.Equal(t, want.ClientID, got.ClientID)
	assert.Equal(t, want.UserData, got.UserData)
	assert.True(t, want.Expires.Equal(got.Expires))
	assert.Equal(t, want.Servers, got.Servers)
	assert.Equal(t, b[9:tokenHeadSize], nonce[:])

	// The largest token fits its bound, and two tokens for the same
	// content differ (random nonces).
	big := sampleToken(make([]netip.AddrPort, MaxTokenServers)...)
	big.UserData = make([]byte, MaxTokenUserData)
	b1, err := IssueToken(key, big)
	require.NoError(t, err)
	assert.Len(t, b1, maxTokenSize)
	b2, err := IssueToken(key, big)
	require.NoError(t, err)
	assert.NotEqual(t, b1, b2)
}

func TestIssueTokenLimits(t *testing.T) {
	key := newTokenKey(t)
	for name, mod := range map[string]func(*Token){
		"no server":        func(t *Token) { t.Servers = nil },
		"too many servers": func(t *Token) { t.Servers = make([]netip.AddrPort, MaxTokenServers+1) },
		"user data":        func(t *Token) { t.UserData = make([]byte, MaxTokenUserData+1) },
		"no expiry":        func(t *Token) { t.Expires = time.Time{} },
		"too long":         func(t *Token) { t.Expires = time.Now().Add(MaxTokenLifetime + time.Minute) },
	} {
		tok := sampleToken()
		mod(&tok)
		_, err := IssueToken(key, tok)
		assert.Error(t, err, name)
	}
	_, err := IssueToken(key[:16], sampleToken())
	assert.Error(t, err, "short key")
}

func TestOpenTokenRejects(t *testing.T) {
	key := newTokenKey(t)
	aead, _ := tokenAEAD(key)
	now := time.Now()
	b, err := IssueToken(key, sampleToken())
	require.NoError(t, err)
	open := func(b []byte, now time.Time) error {
		_, _, err := openToken(aead, bytes.Clone(b), now)
		return err
	}
	require.NoError(t, open(b, now))

	// The clock: expired at Expires, to the second; too far ahead for a
	// server whose clock is behind the backend's by more than the skew.
	exp := sampleToken().Expires
	assert.ErrorIs(t, open(b, exp), errTokenExpired)
	assert.ErrorIs(t, open(b, exp.Add(time.Hour)), errTokenExpired)
	assert.NoError(t, open(b, exp.Add(-time.Second)))
	assert.ErrorIs(t, open(b, now.Add(-2*MaxTokenLifetime)), errTokenAhead)
	assert.ErrorIs(t, open(b, now.Add(-2*MaxTokenLifetime)), ErrTokenRejected)

	// Another key: invalid, as is any changed or truncated byte.
	other, _ := tokenAEAD(newTokenKey(t))
	_, _, err = openToken(other, bytes.Clone(b), now)
	assert.ErrorIs(t, err, errTokenInvalid)
	for i := range b {
		c := bytes.Clone(b)
		c[i] ^= 0x40
		assert.ErrorIs(t, open(c, now), errTokenInvalid, "byte %d", i)
	}
	for n := range len(b) {
		assert.ErrorIs(t, open(b[:n], now), errTokenInvalid, "%d bytes", n)
	}
	assert.ErrorIs(t, open(append(bytes.Clone(b), 0), now), errTokenInvalid)
}

func TestTokenChecker(t *testing.T) {
	key := newTokenKey(t)
	us := netip.MustParseAddrPort("192.0.2.1:7000")
	tc, err := newTokenChecker(key, []netip.AddrPort{us})
	require.NoError(t, err)
	now := time.Now()

	_, _, err = tc.check(nil, now)
	assert.ErrorIs(t, err, errTokenMissing)
	b, err := IssueToken(key, sampleToken(netip.MustParseAddrPort("192.0.2.2:7000"), netip.MustParseAddrPort("192.0.2.1:7001")))
	require.NoError(t, err)
	_, _, err = tc.check(bytes.Clone(b), now)
	assert.ErrorIs(t, err, errTokenServer, "another server")

	b, err = IssueToken(key, sampleToken(netip.MustParseAddrPort("192.0.2.2:7000"), us))
	require.NoError(t, err)
	tok, id, err := tc.check(bytes.Clone(b), now)
	require.NoError(t, err)
	assert.Equal(t, uint64(0x0102030405060708), tok.ClientID)
	assert.Equal(t, b[9:tokenHeadSize], id[:])
	// Checking changes nothing: only use, at establishment, does.
	_, _, err = tc.check(bytes.Clone(b), now)
	require.NoError(t, err, "a check used the token")
	assert.Empty(t, tc.seen)
	require.NoError(t, tc.use(id, tok.Expires.Unix(), now.Unix()))
	assert.ErrorIs(t, tc.use(id, tok.Expires.Unix(), now.Unix()), errTokenReplayed)
	_, _, err = tc.check(bytes.Clone(b), now)
	assert.ErrorIs(t, err, errTokenReplayed)
	// Once expired, it is forgotten, and refused as expired.
	later := sampleToken().Expires.Add(time.Second)
	_, _, err = tc.check(bytes.Clone(b), later)
	assert.ErrorIs(t, err, errTokenExpired)
	err = tc.use([tokenNonceSize]byte{1}, later.Unix()+10, later.Unix())
	assert.NoError(t, err)
	assert.Len(t, tc.seen, 1, "the expired entry stayed")
}

func TestTokenReplayCacheBound(t *testing.T) {
	tc, err := newTokenChecker(newTokenKey(t), nil)
	require.NoError(t, err)
	const now = 1_000_000
	var n [tokenNonceSize]byte
	for i := range maxTokenCache {
		n[0], n[1], n[2] = byte(i), byte(i>>8), byte(i>>16)
		require.NoError(t, tc.use(n, now+10+int64(i%7), now))
	}
	// Full of live tokens: a new one is refused (fail closed), an old
	// one still as a replay.
	n = [tokenNonceSize]byte{0xff, 0xff, 0xff}
	assert.ErrorIs(t, tc.use(n, now+10, now), errTokenBusy)
	assert.ErrorIs(t, tc.use([tokenNonceSize]byte{}, now+10, now+1), errTokenReplayed)
	// Some expire: room again, and the expired ones are gone.
	assert.NoError(t, tc.use(n, now+20, now+11))
	assert.Less(t, len(tc.seen), maxTokenCache)
	assert.Equal(t, len(tc.seen), tc.byExp.Len())
}

// fuzzTokenKey and fuzzNow fix what FuzzOpenToken's seeds were made with
// (testdata/fuzz/FuzzOpenToken: valid, largest, expired, another key's,
// cut short; those named v2-* are of the token's version 2, whose
// servers are in clear, the others of version 1).
var (
	fuzzTokenKey = bytes.Repeat([]byte{0x6b}, TokenKeySize)
	fuzzNow      = time.Unix(1_700_000_000, 0)
)

// FuzzOpenToken feeds the token check anything: it never panics, and
// what it accepts is within the limits a token has.
func FuzzOpenToken(f *testing.F) {
	aead, err := tokenAEAD(fuzzTokenKey)
	require.NoError(f, err)
	tok := sampleToken()
	tok.Expires = fuzzNow.Add(time.Minute)
	b, err := IssueToken(fuzzTokenKey, tok)
	require.NoError(f, err)
	f.Add(b)
	f.Fuzz(func(t *testing.T, b []byte) {
		orig := bytes.Clone(b)
		servers, serr := TokenServers(b) // what a client reads, without the key
		tok, nonce, err := openToken(aead, b, fuzzNow)
		if err != nil {
			require.ErrorIs(t, err, ErrTokenRejected)
			return
		}
		require.True(t, tok.Expires.After(fuzzNow))
		require.False(t, tok.Expires.After(fuzzNow.Add(MaxTokenLifetime+tokenSkew)))
		require.NotEmpty(t, tok.Servers)
		require.LessOrEqual(t, len(tok.Servers), MaxTokenServers)
		require.LessOrEqual(t, len(tok.UserData), MaxTokenUserData)
		require.Equal(t, orig[9:tokenHeadSize], nonce[:])
		require.NoError(t, serr, "a token the server takes, the client cannot read")
		require.Equal(t, servers, tok.Servers)
		// Opened in place, but the token does not alias the buffer.
		ud := bytes.Clone(tok.UserData)
		clear(b)
		require.Equal(t, ud, tok.UserData)
	})
}
