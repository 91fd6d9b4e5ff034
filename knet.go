// Package knet implements the kNet transport over UDP: connections with
// reliable and unreliable messages, ordering expressed as dependencies
// between messages, fragmented transfers of large messages, and flow
// control, all on one UDP socket per listener.
//
// # Usage
//
// A server listens and accepts connections; a client dials one:
//
//	l, err := knet.Listen("udp", ":7000", nil)
//	...
//	c, err := l.AcceptConn(ctx)
//	m, err := c.Receive(ctx)
//	err = c.Send(knet.Message{ID: m.ID, Payload: m.Payload, Reliable: true})
//
//	c, err := knet.Dial(ctx, "udp", "server:7000", nil)
//
// A Conn speaks messages (Send, Receive) and is also a net.Conn whose
// Read and Write carry a byte stream as reliable in-order messages.
//
// # Concurrency
//
// Every method of Conn and Listener is safe for concurrent use. Each Conn
// has one goroutine that owns its protocol state; a Listener has one more
// that reads the shared socket and hands each datagram to its connection
// without ever waiting on it. Send copies the payload before it returns.
//
// # Deadlines
//
// Read and Receive honour the read deadline and Write and Send the write
// deadline, as net.Conn describes: past the deadline they fail with an error
// wrapping os.ErrDeadlineExceeded whose Timeout method reports true. Receive
// and SendContext also stop when their context is done.
package knet

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/knet-go/knet/internal/netsim"
)

// Config holds the characteristic values of the protocol and the
// connection's limits. A nil *Config, and any zero field, means the default
// named in the field's comment (the spec's "Characteristic Values" where it
// has one); so does a negative one, but for ReorderWindow (see there). A
// value outside a field's range is taken as the nearest bound: durations
// are at most 24h, and the comments name the other bounds. A Config may be
// shared; it must not change after use.
type Config struct {
	// PingInterval is how often a PingRequest goes out to measure the
	// round trip and keep the connection alive. Default 5s, at least 1ms.
	// It is shortened to a third of ConnectionLostTimeout if that is
	// smaller.
	PingInterval time.Duration
	// MaxAckDelay is the longest a received reliable datagram waits for
	// its PacketAck. Default 33ms. The peer's is taken to be the same: it
	// is also the least a datagram waits for its ack before it is sent
	// again on a timeout.
	MaxAckDelay time.Duration
	// DatagramTimeout is the longest a reliable datagram waits for its
	// ack before it is sent again; the timeout actually used follows the
	// measured round trip (RFC 6298) and is never longer. Default 2s, at
	// least 10ms.
	DatagramTimeout time.Duration
	// ConnectionLostTimeout is how long the peer may stay silent before
	// the connection is declared lost. Default 3*PingInterval, at least
	// 10ms.
	ConnectionLostTimeout time.Duration
	// ConnectTimeout bounds the handshake, on both sides. Default 10s.
	ConnectTimeout time.Duration
	// DisconnectTimeout bounds a graceful close: delivering what is
	// queued, then the Disconnect/DisconnectAck exchange, whose
	// Disconnect is resent with backoff. Default 5s.
	DisconnectTimeout time.Duration

	// InitialDatagramRate is the send rate, in datagrams per second, that
	// a new connection starts from before it measures the path.
	// Default 15.
	InitialDatagramRate int
	// MinDatagramRate is the rate, in datagrams per second, a connection
	// may always send at, whatever the flow control says. Default 5.
	MinDatagramRate int
	// MaxMessageSendCount is how many times a reliable datagram is sent
	// without an ack before the connection is declared lost. Default 50.
	MaxMessageSendCount int
	// MaxFragmentSize is the largest fragment of a fragmented transfer,
	// in bytes. Default 470 (the spec's MaxUDPMessageFragmentSize). It is
	// taken within 64..2039 (what one message block carries), and
	// fragments are never larger than a datagram allows.
	MaxFragmentSize int
	// MaxDatagramSize is the largest datagram sent, in bytes. Default 1400.
	// It is taken within 256..65507 (one UDP payload).
	MaxDatagramSize int
	// MaxMessageSize is the largest message, in bytes, that Send accepts
	// and that a peer may make us reassemble. Default 16 MiB.
	MaxMessageSize int

	// SendBuffer is how many payload bytes may be queued or unacked
	// before a reliable Send blocks (and an unreliable one is dropped and
	// counted). One message larger than the buffer is accepted when
	// nothing else is queued. Default 4 MiB.
	SendBuffer int
	// ReceiveBuffer is how many payload bytes may wait for the
	// application to read them, or for the messages they depend on. Past
	// it, reliable datagrams go unacked until there is room, so the peer
	// sends them again later. A sender keeps what its peer may have to
	// hold behind a loss within three quarters of its own ReceiveBuffer,
	// taken for the peer's: ordered streams need some round trips' worth
	// of data, so the same value on both ends serves best. It is a limit,
	// not an allocation: a server with many connections can set it lower,
	// an ordered stream then carrying at most about ReceiveBuffer per
	// two to three round trips under loss. Default 32 MiB.
	ReceiveBuffer int
	// ReassemblyBuffer is how many bytes of unfinished fragmented
	// transfers a peer may make us hold, beyond the one oldest transfer,
	// which may always grow to MaxMessageSize. Default 4 MiB.
	ReassemblyBuffer int
	// ReorderWindow is how long a received unreliable in-order message
	// waits for a missing predecessor before it is delivered without it
	// (the predecessor is then dropped if it comes). Default: derived from
	// the measured round trip variation, between 2ms and 250ms. Negative
	// means no wait: each message is delivered as it arrives, and an older
	// one arriving after a newer one is dropped. A sender takes its peer's
	// window for at most 250ms or its own, whichever is longer: set the
	// same on both ends when setting one longer than that.
	ReorderWindow time.Duration
	// ReorderWindows sets the wait by message ID, for a receiver whose
	// streams want different ones: say none for snapshots, where the
	// newest should go at once, and 30ms for inputs, where each counts.
	// An entry of 0 or less means no wait; IDs without an entry use
	// ReorderWindow. Latest-state messages (Message.ContentID) never wait.
	ReorderWindows map[uint32]time.Duration

	// ConnectPayload is the content of the client's ConnectSyn:
	// application data for the server's Admit hook, at most
	// MaxDatagramSize-104 bytes (1296 by default, never more than 2035).
	// Dial refuses a longer one with ErrHandshakeTooLarge. The reference
	// dialect has no handshake content: there it is not sent.
	ConnectPayload []byte
	// Admit decides, on the server, whether to accept a connection
	// attempt: it gets the client's ConnectPayload and returns the content
	// of the ConnectSynAck, or an error to refuse. Nil admits everyone
	// with an empty reply. It runs on the new connection's goroutine and
	// may block it, up to ConnectTimeout.
	//
	// The reply has the ConnectPayload's limit (MaxDatagramSize-104
	// bytes). A longer one cannot be sent whole and is never cut: the
	// attempt is refused as if Admit had returned ErrHandshakeTooLarge
	// (the client gets ErrRefused, or no answer with Stealth), and
	// ListenerStats.OversizedReplies counts it, so that the mistake shows
	// on the server rather than as a client that cannot connect. A
	// reference-dialect client sends no payload and gets no reply (and a
	// refused one no answer at all).
	Admit func(remote net.Addr, payload []byte) ([]byte, error)
	// AdmitConn is Admit with the connection itself, for a server that
	// decides who the player is while admitting it: it may call
	// SetUserData, which the game then finds on every event of the
	// connection. When set, it is used instead of Admit. The error's text
	// reaches a refused client as a *RefusedError (not with Stealth, nor
	// in the reference dialect).
	AdmitConn func(c *Conn, payload []byte) ([]byte, error)
	// Stealth makes a server ignore refused and malformed connection
	// attempts. Otherwise (responsive mode) a refused ConnectSyn gets one
	// DisconnectAck, which the client reports as ErrRefused, and so does a
	// Disconnect from an endpoint with no connection (one that closed and
	// was forgotten while its peer, not having heard our DisconnectAck,
	// still asks).
	Stealth bool
	// MaxPendingConnections bounds the connection attempts a Listener
	// holds before their handshake completes; more are ignored.
	// Default 1024.
	MaxPendingConnections int
	// AcceptBacklog bounds the established connections waiting for
	// Accept; attempts beyond it are refused (ignored, with Stealth) until
	// Accept catches up. Default 512, at most 65536.
	AcceptBacklog int

	// CongestionControl, when not nil, makes the congestion controller of
	// each connection. Default: NewDeliveryRateControl, also used when
	// the function returns nil. NewAIMDControl is the classic alternative.
	CongestionControl func(CongestionParams) CongestionControl

	// Sockets is how many sockets a Listener opens on its address, with
	// SO_REUSEPORT, each read by its own goroutine, so that one server uses
	// every core: the kernel spreads peers over them by address, and a
	// connection stays on the socket its peer reached. Linux only. Default
	// 1: one socket, and no other program may bind the port meanwhile
	// (with more, another SO_REUSEPORT socket of the same user could).
	// At most 256.
	Sockets int

	// PrivateKey is a server's static private key (GenerateKey). With it,
	// the Listener accepts only secure sessions: a Noise NK handshake in
	// the ConnectSyn and ConnectSynAck, then every datagram encrypted and
	// authenticated (see SECURE.md). A plaintext attempt is refused with
	// ErrHandshakeFailed's text (ignored, with Stealth); reference-dialect
	// peers are not served. The Admit reply's limit is 48 bytes lower,
	// the ConnectPayload's 75 (and a connect token's length), and
	// datagrams carry 16 bytes less payload. Key exchanges run on a few
	// goroutines of their own, at most one per handshake message and a
	// limited number per source address (see ListenerStats). See also
	// TokenKey and CookieThreshold.
	PrivateKey []byte
	// ServerKey is, for Dial, the server's public key. With it, Dial runs
	// the secure handshake and fails with ErrHandshakeFailed unless the
	// server proves it holds the matching private key; the ConnectPayload
	// and the Admit reply travel encrypted. Its ConnectSyn is padded to
	// 1200 bytes, whatever MaxDatagramSize (a secure Listener drops a
	// shorter one).
	ServerKey []byte

	// TokenKey is, for a secure Listener (PrivateKey), the secret of
	// TokenKeySize bytes it shares with the backend that issues connect
	// tokens (IssueToken). With it, the Listener admits only clients
	// whose handshake carries a token sealed under this key, not expired,
	// naming one of its PublicAddrs, and not used: a token is used when
	// the connection it admitted is established, and once only (another
	// attempt with it, admitted meanwhile, is refused when it completes).
	// Others are refused with ErrTokenRejected's text and why (ignored,
	// with Stealth) before anything is allocated for them, and counted in
	// ListenerStats.RejectedTokens. Config.AdmitConn finds the token in
	// Conn.Token.
	TokenKey []byte
	// PublicAddrs are the addresses clients reach a Listener at, one of
	// which a connect token must name (TokenKey). Default: the socket's
	// address, which must then be a specific one (Listen fails on
	// ":port" with a TokenKey and no PublicAddrs). Behind a NAT or a load
	// balancer, list the public addresses.
	PublicAddrs []netip.AddrPort
	// Token is, for Dial with ServerKey, the connect token the backend
	// issued (IssueToken): it travels encrypted in the handshake. Its
	// length comes off the ConnectPayload's limit. A refused token fails
	// Dial with ErrTokenRejected.
	Token []byte
	// CookieThreshold is, for a secure Listener, how many handshakes may
	// be under way before it answers connection attempts with a
	// stateless cookie that the client must echo (QUIC's Retry; Dial
	// does it by itself, at the cost of a round trip): proof that the
	// client receives at its address, before the listener does any key
	// exchange or keeps anything for it. Handshakes under way are the
	// pending connections, the attempts waiting for their key exchange,
	// and the attempts whose handshake failed within the last second or
	// two. Default 64; negative: always ask.
	CookieThreshold int

	// Simulate, when not nil, makes every datagram this Conn or Listener
	// sends cross a simulated bad network first: to test a game under
	// loss, latency, reordering and the rest without a real one. Give each
	// side its own to shape both directions.
	Simulate *Simulation

	// Dialect is the wire a connection speaks. Default DialectAuto: a
	// Listener serves both dialects, each peer in the one its first
	// datagram is in; Dial speaks the specification's. See Dialect for
	// what the reference dialect cannot carry.
	Dialect Dialect

	// Group, when not nil, takes the connections this Listener accepts
	// (instead of Accept) or this Dial makes: their arrival, messages and
	// end all come out of Group.Poll, for a game loop that serves every
	// connection from one goroutine.
	Group *Group

	// Logger, when not nil, hears of each connection's life: established
	// (Info), refused (Info, with the reason), ended (Info when graceful,
	// Warn when lost: a timeout, a protocol error, ...). Nothing is logged
	// per datagram or per message. Nil logs nothing.
	Logger *slog.Logger

	// sealTap, for tests, sees every datagram a secure connection seals
	// (see secureState.tap).
	sealTap sealTap
}

// Simulation describes a bad network for Config.Simulate. The zero value
// is a perfect network; every choice is drawn from Seed, so a run can be
// replayed. Out-of-range values are clamped: probabilities to 0..1 (NaN is
// 0), durations to 0..1h, negative sizes to 0.
type Simulation struct {
	// Loss is the probability that a datagram is lost. With BurstLen
	// above 1, losses come in bursts of that mean length in datagrams (a
	// Gilbert-Elliott chain) and Loss is the long-run average.
	Loss     float64
	BurstLen float64
	// BurstDuration, when above 0, makes losses come in bursts of this
	// mean length in time instead, as on a real link: the path drops
	// everything during a burst, however many datagrams it catches, and
	// Loss is the long-run fraction of time in bursts. It takes
	// precedence over BurstLen.
	BurstDuration time.Duration
	// Delay is the one-way latency, plus a uniform random 0..Jitter drawn
	// for each datagram on its own, so that jitter reorders datagrams
	// sent closer together than it, as real paths do.
	Delay, Jitter time.Duration
	// JitterKeepsOrder makes jitter keep the send order, as one queue
	// would: a datagram then never arrives before the one sent before
	// it unless Reorder says so.
	JitterKeepsOrder bool
	// Duplicate is the probability that a datagram arrives twice.
	Duplicate float64
	// Reorder is the probability that a datagram is held back by
	// ReorderDelay (default 1ms), so that later ones overtake it.
	Reorder      float64
	ReorderDelay time.Duration
	// Corrupt is the probability that one byte of a datagram is flipped.
	Corrupt float64
	// Bandwidth caps the path in bytes per second (0: no cap); datagrams
	// beyond QueueBytes waiting at the cap are dropped (default: 50ms of
	// the cap).
	Bandwidth, QueueBytes int
	// Seed seeds the random choices.
	Seed uint64
}

func (s *Simulation) params() netsim.Params {
	prob := func(p float64) float64 {
		if !(p > 0) { // NaN too
			return 0
		}
		return min(p, 1)
	}
	dur := func(d time.Duration) time.Duration { return min(max(d, 0), time.Hour) }
	burst := s.BurstLen
	if !(burst > 1) {
		burst = 0
	}
	return netsim.Params{
		Loss: prob(s.Loss), BurstLen: burst, BurstDuration: dur(s.BurstDuration),
		Duplicate: prob(s.Duplicate), Reorder: prob(s.Reorder), ReorderDelay: dur(s.ReorderDelay),
		Delay: dur(s.Delay), Jitter: dur(s.Jitter), JitterKeepsOrder: s.JitterKeepsOrder,
		Corrupt: prob(s.Corrupt), Bandwidth: max(s.Bandwidth, 0), QueueBytes: max(s.QueueBytes, 0),
		Seed: s.Seed,
	}
}

// config is a Config with the defaults applied.
type config struct {
	pingInterval, maxAckDelay, datagramTimeout time.Duration
	lostTimeout, connectTimeout, disconnect    time.Duration
	reorderWindow                              time.Duration
	reorderWindows                             map[uint32]time.Duration
	initialRate, minRate                       float64
	maxSendCount                               int
	maxFragment, maxDatagram, maxMessage       int
	sendBuffer, recvBuffer, reassemblyBuffer   int
	maxPending, backlog, sockets               int
	connectPayload                             []byte
	admit                                      func(net.Addr, []byte) ([]byte, error)
	admitConn                                  func(*Conn, []byte) ([]byte, error)
	stealth                                    bool
	simulate                                   *Simulation
	congestion                                 func(CongestionParams) CongestionControl
	dialect                                    Dialect
	group                                      *Group
	logger                                     *slog.Logger
	// Secure sessions: a server's keys, or the key a client expects.
	privateKey, publicKey, serverKey []byte
	tokenKey, token                  []byte
	publicAddrs                      []netip.AddrPort
	cookieThreshold                  int
	sealTap                          sealTap
}

// Spec "Characteristic Values" and DECISIONS §7.
const (
	defaultPingInterval        = 5 * time.Second
	defaultMaxAckDelay         = 33 * time.Millisecond
	defaultDatagramTimeout     = 2 * time.Second
	defaultConnectTimeout      = 10 * time.Second
	defaultDisconnectTimeout   = 5 * time.Second
	defaultInitialDatagramRate = 15
	defaultMinDatagramRate     = 5
	defaultMaxMessageSendCount = 50
	defaultMaxFragmentSize     = 470
	defaultMaxDatagramSize     = 1400
	defaultMaxMessageSize      = 16 << 20
	defaultSendBuffer          = 4 << 20
	defaultReceiveBuffer       = 32 << 20
	defaultReassemblyBuffer    = 4 << 20
	defaultMaxPending          = 1024
	defaultBacklog             = 512

	// Bounds of the Config's values (see Config). Durations stay far from
	// overflowing when added to a time or multiplied.
	minTimeout  = 10 * time.Millisecond
	maxDuration = 24 * time.Hour
	maxBacklog  = 1 << 16
	maxSockets  = 256

	// minFragmentSize keeps fragments well above the 16-byte average a
	// receiver takes for an attack (minFragAverage).
	minFragmentSize = 64
	// minDatagramSize leaves room for the largest headers.
	minDatagramSize = 256
	// maxDatagramSizeLimit keeps a datagram within one UDP payload.
	maxDatagramSizeLimit = 65507
)

func pick[T int | time.Duration](v, def T) T {
	if v > 0 {
		return v
	}
	return def
}

// clampDur keeps a duration between lo and maxDuration.
func clampDur(d, lo time.Duration) time.Duration { return min(max(d, lo), maxDuration) }

func (c *Config) resolve() *config {
	if c == nil {
		c = &Config{}
	}
	r := &config{
		pingInterval:     clampDur(pick(c.PingInterval, defaultPingInterval), time.Millisecond),
		maxAckDelay:      clampDur(pick(c.MaxAckDelay, defaultMaxAckDelay), 0),
		datagramTimeout:  clampDur(pick(c.DatagramTimeout, defaultDatagramTimeout), minTimeout),
		connectTimeout:   clampDur(pick(c.ConnectTimeout, defaultConnectTimeout), 0),
		disconnect:       clampDur(pick(c.DisconnectTimeout, defaultDisconnectTimeout), 0),
		reorderWindow:    max(min(c.ReorderWindow, maxDuration), -1), // negative: no wait
		reorderWindows:   maps.Clone(c.ReorderWindows),
		initialRate:      float64(pick(c.InitialDatagramRate, defaultInitialDatagramRate)),
		minRate:          float64(pick(c.MinDatagramRate, defaultMinDatagramRate)),
		maxSendCount:     pick(c.MaxMessageSendCount, defaultMaxMessageSendCount),
		maxFragment:      pick(c.MaxFragmentSize, defaultMaxFragmentSize),
		maxDatagram:      min(max(pick(c.MaxDatagramSize, defaultMaxDatagramSize), minDatagramSize), maxDatagramSizeLimit),
		maxMessage:       pick(c.MaxMessageSize, defaultMaxMessageSize),
		sendBuffer:       pick(c.SendBuffer, defaultSendBuffer),
		recvBuffer:       pick(c.ReceiveBuffer, defaultReceiveBuffer),
		reassemblyBuffer: pick(c.ReassemblyBuffer, defaultReassemblyBuffer),
		maxPending:       pick(c.MaxPendingConnections, defaultMaxPending),
		backlog:          min(pick(c.AcceptBacklog, defaultBacklog), maxBacklog),
		sockets:          min(pick(c.Sockets, 1), maxSockets),
		connectPayload:   c.ConnectPayload,
		admit:            c.Admit,
		admitConn:        c.AdmitConn,
		stealth:          c.Stealth,
		simulate:         c.Simulate,
		sealTap:          c.sealTap,
		congestion:       c.CongestionControl,
		dialect:          c.Dialect,
		group:            c.Group,
		logger:           c.Logger,
	}
	r.privateKey = bytes.Clone(c.PrivateKey)
	r.serverKey = bytes.Clone(c.ServerKey)
	r.tokenKey = bytes.Clone(c.TokenKey)
	r.token = bytes.Clone(c.Token)
	r.publicAddrs = slices.Clone(c.PublicAddrs)
	r.cookieThreshold = max(pick(c.CookieThreshold, defaultCookieThreshold), 0)
	if c.CookieThreshold < 0 {
		r.cookieThreshold = 0 // every attempt is asked for a cookie
	}
	if r.privateKey != nil || r.serverKey != nil {
		// The tag takes room from every datagram.
		r.maxDatagram -= sealOverhead
	}
	if r.dialect > DialectReference {
		r.dialect = DialectAuto
	}
	for id, w := range r.reorderWindows {
		r.reorderWindows[id] = clampDur(w, 0)
	}
	r.lostTimeout = clampDur(pick(c.ConnectionLostTimeout, 3*r.pingInterval), minTimeout)
	r.maxFragment = min(max(r.maxFragment, minFragmentSize), maxContentLength-8)
	return r
}

// longestReorderWindow is the longest reorder window configured.
func (c *config) longestReorderWindow() time.Duration {
	w := c.reorderWindow
	for _, v := range c.reorderWindows {
		w = max(w, v)
	}
	return w
}

// handshakeLimit is the most bytes of application data a ConnectSyn or
// ConnectSynAck carries: one message block (no fragmented transfer before
// the connection is open), in a datagram of at most MaxDatagramSize, and
// below the 2048 bytes a peer with the default MaxDatagramSize reads.
func (c *config) handshakeLimit() int { return c.wholeLimit() - startRoom }

// payloadLimit is the most bytes of ConnectPayload or Admit reply: the
// handshake's room, less the Noise message's own in a secure session.
func (c *config) payloadLimit() int {
	if c.privateKey != nil {
		// The reply follows the connection ID (secure.go).
		return c.handshakeLimit() - noiseOverhead - cidSize
	}
	if c.serverKey != nil {
		// A client's maxDatagram lost cidSize already (its datagrams
		// carry the ID), so that both ends' limits agree.
		return c.handshakeLimit() - noiseOverhead
	}
	return c.handshakeLimit()
}

// synPayloadLimit is the most bytes of ConnectPayload a client sends:
// payloadLimit, less, in a secure session, what its ConnectSyn carries
// besides (room for a cookie, the connect token).
func (c *config) synPayloadLimit() int {
	if c.serverKey != nil {
		return c.payloadLimit() - secureSynExtra - len(c.token)
	}
	return c.payloadLimit()
}

// keepalive is how often a PingRequest goes out: PingInterval, or more often
// if ConnectionLostTimeout would otherwise expire between two pings.
func (c *config) keepalive() time.Duration {
	return min(c.pingInterval, c.lostTimeout/3)
}

// Message is one application message.
type Message struct {
	// ID is the application's message ID, MinMessageID (6) to
	// MaxMessageID (0x3FFFFFFA); Send refuses the others, which the
	// protocol reserves.
	ID uint32
	// Payload is the message content. Send copies it; Receive returns a
	// slice the caller owns.
	Payload []byte
	// Reliable messages are delivered exactly once, resent until acked.
	// Unreliable ones are sent once and may be lost. An unreliable
	// message too large for one datagram travels as a reliable
	// fragmented transfer (the protocol requires it).
	Reliable bool
	// InOrder orders the message after the earlier InOrder messages of
	// the same Channel: a reliable one after the earlier reliable ones
	// (exactly once, in send order); an unreliable one after every earlier
	// one, which makes the channel sequenced (never an older message after
	// a newer one). Channels never hold each other up. On receipt,
	// InOrder reports whether the message carried a dependency on the wire.
	InOrder bool
	// Channel selects the ordering channel of an InOrder message, 0-255.
	// It is not sent on the wire, so a received message reports 0.
	Channel uint8
	// Priority lets a message leave the send queue before queued messages
	// of lower priority. Dependencies still hold: a message never leaves
	// before one it depends on, which is raised to its priority. Not
	// sent on the wire.
	Priority int8
	// ContentID, when not zero on an unreliable message, marks it as an
	// update of the state named by (ID, ContentID): latest state wins. It
	// replaces a queued, unsent message with the same pair; the receiver
	// delivers it as soon as it arrives, without waiting for an earlier
	// version still missing, and drops an earlier version that arrives
	// after it. Not sent on the wire as such: each update names the
	// earlier ones sent in the last quarter second or so, up to eight (3
	// bytes each). An earlier version held back on the path is dropped
	// when it comes unless it is later than that, or the eight versions
	// after it, which name it, all came later still or never. An update
	// too large for one datagram travels reliably, and the wire does not
	// let it name unreliable ones: an earlier small update delayed on
	// the path past the whole transfer can still arrive after it; a
	// small update after it leaves once it is acked.
	ContentID uint32
	// DependsOn lists earlier messages, sent with SendRef on the same
	// Conn, that must be applied before this one: a dependency graph
	// beyond channels. At most MaxDependencies entries. A reliable
	// message may not depend on an unreliable one. An unreliable message
	// that names a reliable one leaves once that one is acked, so that it
	// never arrives first (it may still be lost); one that names an
	// unreliable one arrives after it, or without it if that one is lost.
	DependsOn []Ref
}

// MaxDependencies is the most entries Message.DependsOn may hold.
const MaxDependencies = 16

// Ref names a message sent with SendRef, for later messages' DependsOn.
// The zero Ref names nothing.
type Ref uint64

// reliable reports whether r names a reliable message.
func (r Ref) reliable() bool { return r&1 != 0 }

// StreamMessageID is the message ID that Write sends with. Read returns the
// payloads of received messages of any ID.
const StreamMessageID = MaxMessageID

// Stats are a connection's counters.
type Stats struct {
	RTT    time.Duration // smoothed round-trip time
	RTTVar time.Duration // its mean deviation
	MinRTT time.Duration // the lowest seen
	RTO    time.Duration // the current retransmission timeout

	DatagramsSent     uint64 // as the system took them: retransmissions included
	DatagramsReceived uint64 // valid datagrams, duplicates included
	BytesSent         uint64 // UDP payload bytes
	BytesReceived     uint64
	MessagesSent      uint64 // application messages
	MessagesReceived  uint64 // application messages delivered
	Retransmits       uint64 // reliable datagrams sent again
	FastRetransmits   uint64 // datagrams taken for lost on ack gaps, before any timeout
	SpuriousLosses    uint64 // datagrams taken for lost, or resent on a timeout, that were only late

	InvalidDatagrams   uint64 // malformed datagrams dropped
	DuplicateDatagrams uint64 // dropped as already received
	// DuplicateMessages counts reliable messages dropped as already
	// received: in the reference dialect a message is resent in a new
	// datagram, under its reliable message number.
	DuplicateMessages uint64
	DroppedDatagrams  uint64 // dropped for lack of room (inbox or buffers); reliable ones come again
	DroppedMessages   uint64 // unreliable messages dropped: send queue full, receive buffer full, or too late to be in order
	ProtocolErrors    uint64 // well-formed datagrams breaking the protocol (the connection ends)
	// SendErrors counts datagrams the system refused to send (a full
	// buffer, no route, a port unreachable report...): they are not in
	// DatagramsSent and BytesSent, and a reliable one goes again later.
	// With Config.Simulate, a datagram is sent once it enters the
	// simulated network; failures to deliver it from there count here.
	SendErrors uint64
	// Migrations counts the moves of a secure connection to a new
	// address of its client (NAT rebinding, another network), each once
	// the client proved it receives there (see Conn.RemoteAddr). Only a
	// server's connections move; a client's count stays 0.
	Migrations uint64

	SendRate float64 // datagrams per second the rate control allows now
	InFlight int     // reliable datagrams unacked

	// UnreliableAsReliable counts unreliable messages too large for one
	// datagram (MaxUnreliablePayload), which went as reliable fragmented
	// transfers, as the protocol requires.
	UnreliableAsReliable uint64

	// Connection quality, over the last two seconds or so.

	// LossRate is the fraction of the peer's datagrams that did not
	// arrive, from the gaps in their PacketIDs (every datagram takes the
	// next one, reliable or not).
	LossRate float64
	// Jitter is how much the round trip varies: RTTVar, the mean
	// deviation of its samples (RFC 6298).
	Jitter time.Duration
	// Rates, per second.
	SendBytesPerSecond, ReceiveBytesPerSecond       float64
	SendMessagesPerSecond, ReceiveMessagesPerSecond float64
	// QueuedBytes is the payload bytes sent but not yet acked, or still
	// queued: what a slow link or a slow peer holds up (SendBuffer bounds
	// it). ReceiveQueuedBytes is what arrived and the application has not
	// taken yet.
	QueuedBytes, ReceiveQueuedBytes int
	// Quality sums the path up for a game's display, from 1 (a clean
	// path, round trip under 80ms) to 0: it falls linearly with loss (0
	// at 25%) and with the round trip above 80ms (0 at 500ms), the two
	// multiplied.
	Quality float64
}

// A RefusedError is Dial's error when the server refused the connection
// and said why: the text of the error its Admit hook returned. It matches
// ErrRefused with errors.Is.
type RefusedError struct {
	Reason string
}

func (e *RefusedError) Error() string     { return ErrRefused.Error() + ": " + e.Reason }
func (e *RefusedError) Is(err error) bool { return err == ErrRefused }

// A DisconnectError is how a connection ended when the peer closed it
// with a reason (CloseWithReason): Err, and Send once the peer closed,
// return it; it matches ErrPeerClosed and net.ErrClosed with errors.Is.
type DisconnectError struct {
	Reason string
}

func (e *DisconnectError) Error() string { return ErrPeerClosed.Error() + ": " + e.Reason }
func (e *DisconnectError) Is(err error) bool {
	return err == ErrPeerClosed || err == net.ErrClosed
}

// errServerFull refuses a connection the accept backlog has no room for.
var errServerFull = errors.New("knet: server full")

// MaxReasonLength is the longest refusal or close reason sent, in bytes;
// a longer one is cut.
const MaxReasonLength = 256

// reasonBytes is r as sent on the wire: at most MaxReasonLength bytes, cut at
// a rune boundary.
func reasonBytes(r string) []byte {
	if len(r) > MaxReasonLength {
		r = strings.ToValidUTF8(r[:MaxReasonLength], "")
	}
	return []byte(r)
}

// refusedErr is the error of a refusal that said reason (empty: none).
func refusedErr(reason []byte) error {
	if len(reason) == 0 {
		return ErrRefused
	}
	return &RefusedError{Reason: string(reason)}
}

var (
	// ErrRefused is returned by Dial when the server refused the
	// connection (responsive mode).
	ErrRefused = errors.New("knet: connection refused")
	// ErrPeerClosed is returned by Send once the peer has closed the
	// connection.
	ErrPeerClosed = fmt.Errorf("knet: connection closed by peer: %w", net.ErrClosed)
	// ErrMessageTooLarge is returned by Send for a payload above
	// MaxMessageSize.
	ErrMessageTooLarge = errors.New("knet: message larger than MaxMessageSize")
	// ErrReservedID is returned by Send for an ID outside
	// MinMessageID..MaxMessageID.
	ErrReservedID = errors.New("knet: message ID reserved by the protocol")
	// ErrBadDependency is returned by Send for a DependsOn that names a
	// message not sent before on this Conn, names an unreliable message
	// from a reliable one, or has more than MaxDependencies entries.
	ErrBadDependency = errors.New("knet: bad message dependency")
	// ErrHandshakeTooLarge is returned by Dial for a
	// Config.ConnectPayload longer than a ConnectSyn carries
	// (MaxDatagramSize-104 bytes, at most 2035). A server whose Admit
	// replies with that much refuses the attempt instead.
	ErrHandshakeTooLarge = errors.New("knet: handshake payload too large")
	// ErrPortUnreachable fails Dial, and ends a dialed connection, when
	// the system keeps reporting that nothing listens at the peer's
	// address: an ICMP port unreachable, which a connected UDP socket
	// reads as ECONNREFUSED. errors.Is(err, syscall.ECONNREFUSED) holds
	// as well. Dial fails with it after two refused ConnectSyns in a row
	// (about 200ms) instead of waiting out ConnectTimeout; an open
	// connection ends after three reports with nothing heard from the
	// peer in between, and then also matches net.ErrClosed. Systems that
	// do not report it (Windows) leave it to the timeouts.
	ErrPortUnreachable = fmt.Errorf("knet: nothing listening at the peer's port: %w", errConnRefused)
	// ErrRetransmitLimit ends a connection whose reliable datagram went
	// unacked after MaxMessageSendCount sends.
	ErrRetransmitLimit = fmt.Errorf("knet: reliable datagram unacked after MaxMessageSendCount sends: %w", net.ErrClosed)
)

// errUnreachableClosed ends an open connection for ErrPortUnreachable.
var errUnreachableClosed = fmt.Errorf("%w: %w", ErrPortUnreachable, net.ErrClosed)

// errNilContext is what the methods taking a context return for a nil one.
var errNilContext = errors.New("knet: nil context")

// TimeoutError ends a connection whose peer stayed silent for
// ConnectionLostTimeout, a handshake that took longer than ConnectTimeout,
// or a graceful close that got no DisconnectAck within DisconnectTimeout
// (Close still returns nil; Err says so).
type TimeoutError struct {
	Silent time.Duration
	Op     string // "connect", "disconnect" or "" for an established connection
}

func (e *TimeoutError) Error() string {
	switch e.Op {
	case "connect":
		return "knet: no answer to the connection attempt within " + e.Silent.String()
	case "disconnect":
		return "knet: no DisconnectAck within " + e.Silent.String()
	}
	return "knet: peer silent for " + e.Silent.String()
}
func (e *TimeoutError) Timeout() bool   { return true }
func (e *TimeoutError) Temporary() bool { return false }

// Unwrap makes errors.Is(err, net.ErrClosed) hold for a lost connection,
// and errors.Is(err, os.ErrDeadlineExceeded) for a handshake timeout.
func (e *TimeoutError) Unwrap() error {
	if e.Op == "connect" {
		return errDeadline
	}
	return net.ErrClosed
}

// ProtocolError ends a connection whose peer broke the protocol in a way
// that could make us hold unbounded state, such as a fragmented transfer
// announcing more than MaxMessageSize.
type ProtocolError struct{ Err error }

func (e *ProtocolError) Error() string { return "knet: peer broke the protocol: " + e.Err.Error() }
func (e *ProtocolError) Unwrap() error { return e.Err }
