//go:build !js

package knet

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"flag"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/flynn/noise"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Shared test vectors (testdata/vectors/*.json) for the clients in other
// languages (clients/typescript checks the same files): the stream's
// frames and knet hellos, a secure handshake under fixed keys and the
// sealed frames that follow it, a connect token. They are made here by
// knet's own encoders. By default this test makes them again and fails
// unless the committed files say the same; -knet.vectors.update writes
// them instead. The token alone is not made again (IssueToken draws its
// nonce): the committed one is checked by opening it under the key.

var updateVectors = flag.Bool("knet.vectors.update", false, "write testdata/vectors/*.json from knet's encoders instead of checking them")

const vectorDir = "testdata/vectors"

type hexBytes []byte

func (h hexBytes) MarshalJSON() ([]byte, error) { return json.Marshal(hex.EncodeToString(h)) }
func (h *hexBytes) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return err
	}
	v, err := hex.DecodeString(s)
	*h = v
	return err
}

type vleVector struct {
	Value uint32   `json:"value"`
	Hex   hexBytes `json:"hex"`
}

type frameVector struct {
	Name    string   `json:"name"`
	ID      uint32   `json:"id"`
	Payload hexBytes `json:"payload"`
	Frame   hexBytes `json:"frame"`
}

type helloVector struct {
	Name    string   `json:"name"`
	Kind    byte     `json:"kind"`
	Content hexBytes `json:"content"`
	Frame   hexBytes `json:"frame"`
}

type closeVector struct {
	Code   uint32   `json:"code"`
	Reason string   `json:"reason"`
	Frame  hexBytes `json:"frame"`
}

type framesFile struct {
	Comment string        `json:"comment"`
	VLE     []vleVector   `json:"vle"`
	Frames  []frameVector `json:"frames"`
	Hellos  []helloVector `json:"hellos"`
	Closes  []closeVector `json:"closes"`
}

type sealedVector struct {
	Dir     string   `json:"dir"` // "toServer" or "toClient"
	N       uint64   `json:"n"`   // the frame's number in its direction: the nonce
	ID      uint32   `json:"id"`
	Payload hexBytes `json:"payload"`
	Frame   hexBytes `json:"frame"`
}

type secureFile struct {
	Comment         string         `json:"comment"`
	ServerPrivate   hexBytes       `json:"serverPrivate"`
	ServerPublic    hexBytes       `json:"serverPublic"`
	ClientEphemeral hexBytes       `json:"clientEphemeral"`
	ServerEphemeral hexBytes       `json:"serverEphemeral"`
	Token           hexBytes       `json:"token"`
	Payload         hexBytes       `json:"payload"`
	Reply           hexBytes       `json:"reply"`
	ClientHello     hexBytes       `json:"clientHello"` // the whole frame: kind 5
	ServerHello     hexBytes       `json:"serverHello"` // the whole frame: kind 6
	Sealed          []sealedVector `json:"sealed"`
}

type tokenFile struct {
	Comment  string   `json:"comment"`
	Key      hexBytes `json:"key"`
	Token    hexBytes `json:"token"`
	ClientID uint64   `json:"clientID"`
	UserData hexBytes `json:"userData"`
	Expires  int64    `json:"expires"` // Unix seconds
	Servers  []string `json:"servers"`
}

func seq(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*7 + 3)
	}
	return b
}

func makeFrames() framesFile {
	f := framesFile{Comment: "kNet over a stream (docs/PROTOCOL.md §9): VLE-1.7/1.7/16 values, frames in clear, knet hellos (a PingReply, pingID 0, kNT, version 1, kind, content) and close hellos (kind 4, or 7 with a u32 little-endian code). Made by knet's encoders: go test -run TestVectors -knet.vectors.update"}
	for _, v := range []uint32{0, 1, 0x7f, 0x80, 0x3fff, 0x4000, 0x12345, 1<<30 - 1} {
		f.VLE = append(f.VLE, vleVector{v, appendVLE32(nil, v)})
	}
	for _, fv := range []struct {
		name string
		id   uint32
		p    []byte
	}{
		{"ping request", idPingRequest, []byte{1}},
		{"ping reply", idPingReply, []byte{7}},
		{"empty message", 14, nil},
		{"one-byte ID", 10, []byte("AB")},
		{"two-byte ID", 0x80, []byte("hello")},
		{"four-byte ID", MaxMessageID, []byte{0xff}},
		{"two-byte size", 200, seq(300)},
		{"four-byte size", 13, seq(20000)},
	} {
		f.Frames = append(f.Frames, frameVector{fv.name, fv.id, fv.p, appendTCPFrame(nil, fv.id, fv.p)})
	}
	for _, h := range []struct {
		name    string
		kind    byte
		content []byte
	}{
		{"client hello, no payload", helloClient, nil},
		{"client hello", helloClient, []byte("player one")},
		{"accept", helloAccept, []byte("welcome")},
		{"refuse", helloRefuse, []byte("knet: connection refused: full")},
		{"close", helloClose, []byte("bye")},
	} {
		var s streamSession
		s.sendHello(h.kind, h.content)
		f.Hellos = append(f.Hellos, helloVector{h.name, h.kind, h.content, s.ctrl})
	}
	for _, c := range []struct {
		code   uint32
		reason string
	}{{0, ""}, {0, "going home"}, {4001, "kicked"}, {0xffffffff, ""}} {
		var s streamSession
		s.sendClose(c.code, []byte(c.reason))
		f.Closes = append(f.Closes, closeVector{c.code, c.reason, s.ctrl})
	}
	return f
}

func makeSecure(t *testing.T, token []byte) secureFile {
	f := secureFile{
		Comment:         "A secure session over a stream (docs/PROTOCOL.md §9.7): Noise_NK_25519_AESGCM_SHA256 under fixed static and ephemeral keys, the client's hello (kind 5: no cookie, message 1 carrying the token and the payload), the server's (kind 6: message 2 carrying connection ID 0 and the reply), then sealed frames, each direction's nonce its frame number. Made by knet's encoders: go test -run TestVectors -knet.vectors.update",
		ServerPrivate:   bytes.Repeat([]byte{0x11}, KeySize),
		ClientEphemeral: bytes.Repeat([]byte{0x22}, KeySize),
		ServerEphemeral: bytes.Repeat([]byte{0x33}, KeySize),
		Token:           token,
		Payload:         []byte("player one"),
		Reply:           []byte("welcome, player one"),
	}
	var err error
	f.ServerPublic, err = publicKeyOf(f.ServerPrivate)
	require.NoError(t, err)
	cli := &secureState{initiator: true, serverKey: f.ServerPublic, eph: bytes.Clone(f.ClientEphemeral),
		synInner: appendSynPayload(nil, token, f.Payload)}
	msg1, err := cli.writeSyn()
	require.NoError(t, err)
	f.ClientHello = appendTCPFrame(nil, idPingReply, appendStreamHello(nil, helloSecure, appendSecureSyn(nil, nil, msg1)))

	hs, err := noise.NewHandshakeState(noise.Config{
		CipherSuite: noiseSuite, Pattern: noise.HandshakeNK, Prologue: noisePrologue,
		StaticKeypair: noise.DHKey{Private: f.ServerPrivate, Public: f.ServerPublic},
		Random:        bytes.NewReader(f.ServerEphemeral),
	})
	require.NoError(t, err)
	srv := &secureState{hs: hs}
	inner, err := srv.readSyn(msg1)
	require.NoError(t, err)
	gotToken, gotPayload, ok := splitSynPayload(inner)
	require.True(t, ok)
	require.Equal(t, string(token), string(gotToken))
	require.Equal(t, string(f.Payload), string(gotPayload))
	msg2, err := srv.writeSynAck(f.Reply)
	require.NoError(t, err)
	f.ServerHello = appendTCPFrame(nil, idPingReply, appendStreamHello(nil, helloSecureAccept, msg2))
	reply, err := cli.readSynAck(msg2)
	require.NoError(t, err)
	require.Equal(t, string(f.Reply), string(reply))

	for _, v := range []struct {
		dir string
		n   uint64
		id  uint32
		p   []byte
	}{
		{"toServer", 0, idPingRequest, []byte{1}},
		{"toServer", 1, 10, []byte("hello")},
		{"toClient", 0, idPingReply, []byte{1}},
		{"toClient", 1, 10, []byte("hello")},
		{"toClient", 2, idPingReply, appendStreamHello(nil, helloClose, []byte("bye"))},
		{"toServer", 1 << 32, 300, seq(1000)},
		{"toClient", 7, 20000, nil},
	} {
		from, to := cli, srv
		if v.dir == "toClient" {
			from, to = srv, cli
		}
		z := &streamSeal{sec: from, sendN: v.n}
		frame, err := z.appendFrame(nil, v.id, v.p)
		require.NoError(t, err)
		// The other end opens it, at the same number only.
		body, n, err := parseSealedFrame(frame, 1<<20)
		require.NoError(t, err)
		require.Equal(t, len(frame), n)
		open := &streamSeal{sec: to, recvN: v.n}
		id, p, err := open.open(bytes.Clone(body))
		require.NoError(t, err)
		require.Equal(t, v.id, id)
		require.Equal(t, string(v.p), string(p))
		_, _, err = (&streamSeal{sec: to, recvN: v.n + 1}).open(bytes.Clone(body))
		require.ErrorIs(t, err, errStreamOpen, "another number does not open it")
		f.Sealed = append(f.Sealed, sealedVector{v.dir, v.n, v.id, v.p, frame})
	}
	return f
}

func makeToken(t *testing.T) tokenFile {
	f := tokenFile{
		Comment:  "A connect token (IssueToken) under a fixed key; its nonce is random, so it is checked by opening it, not made again. Expires is in the past by now: open it at an earlier time. Made by: go test -run TestVectors -knet.vectors.update",
		Key:      bytes.Repeat([]byte{0x44}, TokenKeySize),
		ClientID: 42,
		UserData: []byte("team blue"),
		Expires:  time.Now().Add(30 * time.Minute).Unix(),
		Servers:  []string{"127.0.0.1:7000", "[2001:db8::1]:7001"},
	}
	tok := Token{ClientID: f.ClientID, UserData: f.UserData, Expires: time.Unix(f.Expires, 0)}
	for _, s := range f.Servers {
		tok.Servers = append(tok.Servers, netip.MustParseAddrPort(s))
	}
	var err error
	f.Token, err = IssueToken(f.Key, tok)
	require.NoError(t, err)
	return f
}

func TestVectors(t *testing.T) {
	var tf tokenFile
	path := filepath.Join(vectorDir, "token.json")
	if *updateVectors {
		tf = makeToken(t)
		writeVectors(t, path, tf)
	} else {
		readVectors(t, path, &tf)
	}
	t.Run("token", func(t *testing.T) {
		aead, err := tokenAEAD(tf.Key)
		require.NoError(t, err)
		got, _, err := openToken(aead, bytes.Clone(tf.Token), time.Unix(tf.Expires-60, 0))
		require.NoError(t, err)
		assert.Equal(t, tf.ClientID, got.ClientID)
		assert.Equal(t, string(tf.UserData), string(got.UserData))
		assert.Equal(t, tf.Expires, got.Expires.Unix())
		var servers []string
		for _, s := range got.Servers {
			servers = append(servers, s.String())
		}
		assert.Equal(t, tf.Servers, servers)
		tampered := bytes.Clone(tf.Token)
		tampered[len(tampered)-1] ^= 1
		_, _, err = openToken(aead, tampered, time.Unix(tf.Expires-60, 0))
		assert.ErrorIs(t, err, errTokenInvalid)
	})
	for _, v := range []struct {
		name string
		make func(*testing.T) any
	}{
		{"frames.json", func(*testing.T) any { return makeFrames() }},
		{"secure.json", func(t *testing.T) any { return makeSecure(t, tf.Token) }},
	} {
		t.Run(v.name, func(t *testing.T) {
			path := filepath.Join(vectorDir, v.name)
			if *updateVectors {
				writeVectors(t, path, v.make(t))
				return
			}
			want, err := json.MarshalIndent(v.make(t), "", "  ")
			require.NoError(t, err)
			got, err := os.ReadFile(path)
			require.NoError(t, err, "make them with: go test -run TestVectors -knet.vectors.update")
			assert.Equal(t, string(want)+"\n", string(got), "%s differs from what knet's encoders make: a wire change? (-knet.vectors.update writes them)", path)
		})
	}
}

func writeVectors(t *testing.T, path string, v any) {
	b, err := json.MarshalIndent(v, "", "  ")
	require.NoError(t, err)
	require.NoError(t, os.MkdirAll(filepath.Dir(path), 0o755))
	require.NoError(t, os.WriteFile(path, append(b, '\n'), 0o644))
}

func readVectors(t *testing.T, path string, v any) {
	b, err := os.ReadFile(path)
	require.NoError(t, err, "make them with: go test -run TestVectors -knet.vectors.update")
	require.NoError(t, json.Unmarshal(b, v))
}
