package knet

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"net/netip"
	"slices"
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
//
// Most fields are for both sides. Those a field's comment gives to Dial
// (ConnectPayload, ServerKey, Token, FallbackTCP) make Listen and
// ListenPacket fail, and those it gives to a Listener (ReceiveBudget,
// Admit, AdmitConn, Stealth, MaxPendingConnections, MaxPendingPerSource,
// AcceptBacklog, Sockets, PrivateKey, TokenKey, PublicAddrs, ServerID,
// CookieThreshold, TCP, HTTP) make Dial, DialPacket and DialWebSocket fail,
// with an error naming the field: a client and a server that share
// settings each take a copy with the other's fields cleared.
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
	// ResumeTimeout, when positive, makes an established UDP connection
	// whose peer was silent for ConnectionLostTimeout wait suspended
	// for this much longer instead of ending: it sends a small probe a
	// second, keeps what the application sends queued, and carries on
	// where it left off when the peer is heard again (a secure
	// connection's client from a new address too, once the path check
	// moves it there; a plaintext one only from the same address). See
	// Stats.Suspended and docs/secure-sessions.md, "Resuming". Set it on
	// both ends: a peer without it ends the connection at its own
	// ConnectionLostTimeout. Default 0: a connection ends at
	// ConnectionLostTimeout, as a peer without the setting expects, and a
	// server holds no silent connection longer. Stream connections (TCP,
	// WebSocket) ignore it.
	ResumeTimeout time.Duration
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
	// MaxDatagramSize is the largest datagram sent but for those of large
	// reliable messages (MaxPathDatagramSize), in bytes: the base size the
	// path must carry. Default 1200 in the specification's dialect, the
	// UDP payload every real path carries (RFC 9000 §14: IPv6's minimum
	// MTU less headers is 1232), and 1400 in the reference dialect, the
	// C++ kNet's. It is taken within 256..65507 (one UDP payload). Set,
	// it is the largest datagram sent unless MaxPathDatagramSize is set
	// too.
	MaxDatagramSize int
	// MaxPathDatagramSize, when above MaxDatagramSize, turns on path MTU
	// discovery (RFC 8899) in the specification's dialect: from the first
	// reliable message too large to go whole at MaxDatagramSize (or the
	// first transfer), the connection probes the path with padded
	// datagrams for the largest size it carries, up to this one, in
	// rounds of probes sent together (it settles within a few round
	// trips); a reliable message that fits a datagram of that size then
	// goes whole in one, and a larger one's fragments fill such
	// datagrams. A path that stops carrying it (a black hole) is
	// detected, and what is in flight goes again at MaxDatagramSize
	// (whole messages too large for it made fragmented transfers),
	// without the connection failing; a path that stops carrying even
	// MaxDatagramSize ends the connection with a *PathMTUError.
	// MaxDatagramSize stays the size of every other datagram. The
	// receiving end reads datagrams up to the larger of its two sizes
	// and 2048 bytes: set it on both ends above that. Default 1400 (the
	// former MaxDatagramSize: no peer gets a larger datagram than
	// before) when MaxDatagramSize is left at its default, else 0; a
	// negative value turns discovery off, and the reference dialect
	// never probes. At most 65507.
	MaxPathDatagramSize int
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
	// ReceiveBudget bounds, on a Listener, what all its connections
	// together hold of what their peers sent and the application has
	// not taken, in bytes: received messages waiting to be read,
	// messages held for those they depend on, unfinished fragmented
	// transfers, and over TCP and WebSocket the unfinished frame and
	// what was read ahead of it. ReceiveBuffer, ReassemblyBuffer and
	// MaxMessageSize bound each connection; this bounds their sum
	// (ListenerStats.ReceiveHeld). While it is spent, a connection
	// holding more than its share (the budget divided among the
	// Listener's connections) takes nothing more: reliable datagrams
	// that would add to what it holds go unacked, to come again later,
	// unreliable messages are dropped (Stats.DroppedDatagrams,
	// Stats.DroppedMessages), a stream is not read; the others go on,
	// unless the sum passes the budget by an eighth (then nobody takes
	// more until it is back under). A connection still over its share
	// of a spent budget after twice DatagramTimeout (4s by default, at
	// least 1s) is closed with a reason its peer hears (a knet peer's
	// Err is then a *DisconnectError), ends with ErrOverBudget, and
	// ListenerStats.ClosedOverBudget counts it. The budget stays spent
	// until the sum is back under seven eighths of it. Default 128 MiB:
	// a thousand players each holding 64 KiB at once (a round trip of
	// a reliable stream behind a loss, or what the game has yet to read
	// of a tick), and four messages of 16 MiB arriving. A Listener's
	// only.
	ReceiveBudget int
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
	// MaxDatagramSize-104 bytes (1096 by default, never more than 2035).
	// Dial refuses a longer one with ErrHandshakeTooLarge. The reference
	// dialect has no handshake content: there it is not sent.
	ConnectPayload []byte
	// Admit decides, on the server, whether to accept a connection
	// attempt: it gets the client's ConnectPayload and returns the content
	// of the ConnectSynAck, or an error to refuse. Nil admits everyone
	// with an empty reply. It runs on a goroutine of its own and may take
	// its time (the connection waits, up to ConnectTimeout; others go on).
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
	// connection. Set Admit or AdmitConn, not both. The error's text
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
	// holds before their handshake completes, over every transport
	// together; more are ignored. Default 1024.
	MaxPendingConnections int
	// MaxPendingPerSource bounds the connection attempts from one source
	// (an IPv4 address, or an IPv6 /64) that a Listener holds before
	// their handshake completes, over every transport together: one host
	// cannot take every place MaxPendingConnections gives. More from that
	// source are ignored (ListenerStats.IgnoredAttempts) until some
	// complete or end. Default MaxPendingConnections/16 (64), but at
	// least 16 (or MaxPendingConnections if smaller); at most
	// MaxPendingConnections. Raise it for many clients joining at
	// once from behind one address (a LAN event, a carrier's NAT, a load
	// test from one machine).
	MaxPendingPerSource int
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
	// NextPrivateKey is, for a secure Listener (PrivateKey), a second
	// static private key it accepts handshakes under, as it does under
	// PrivateKey: the key that comes next in a rotation, so that clients
	// given either public key connect while they learn the new one.
	// Listener.SetKeys changes both keys while the Listener runs. See
	// "Rotating the server's key" in docs/secure-sessions.md.
	NextPrivateKey []byte
	// ServerKey is, for Dial, the server's public key. With it, Dial runs
	// the secure handshake and fails with ErrHandshakeFailed unless the
	// server proves it holds the matching private key; the ConnectPayload
	// and the Admit reply travel encrypted. Its ConnectSyn is padded to
	// 1200 bytes, whatever MaxDatagramSize (a secure Listener drops a
	// shorter one).
	ServerKey []byte

	// KeyUpdateInterval is, on a secure connection, how many datagrams
	// (over a stream, frames) each direction seals under one key before
	// it replaces it with the next, derived one way from it: 0 means
	// 2^20, an eighth of AES-GCM's limit of 2^23 per key, also the most
	// taken. Lower values are taken (1 updates after every datagram whose
	// ack came); a negative one turns key updates off, as a peer of
	// before them. Keys
	// are replaced only when both ends take updates. See SECURE.md,
	// "Limits".
	KeyUpdateInterval int
	// KeyUpdateTime is the longest a key lives before the next replaces
	// it, whatever its count (over UDP, at the first ack after it): 0
	// means five minutes; negative, no time bound.
	KeyUpdateTime time.Duration

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
	// ServerID is, for a secure Listener (PrivateKey) in a fleet behind
	// a UDP load balancer, this server's ID among them: 1 to
	// MaxServerIDSize bytes that begin every connection ID the Listener
	// gives (the rest stays random), so that the balancer sends each
	// client datagram to the server its connection ID names, also after
	// the client's address changed (ServerIDFromDatagram; docs/PROTOCOL.md
	// 7.6). Each server of the fleet needs its own, of one length. Every
	// byte taken leaves fewer random ones: with 3, a Listener can tell
	// at most 256 live connections apart and refuses more ("server
	// full"). Default: none, all 4 bytes random.
	ServerID []byte
	// Token is, for Dial with ServerKey, the connect token the backend
	// issued (IssueToken): it travels encrypted in the handshake. Its
	// length comes off the ConnectPayload's limit. A refused token fails
	// Dial with ErrTokenRejected. Dial with an empty address tries the
	// servers the token names, in order (see Dial).
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

	// TCP makes a Listener accept kNet over TCP as well, on the same
	// port number as its UDP socket, for players whose networks block
	// UDP: the C++ reference's framing, with knet's hello between knet
	// peers (see docs/streams.md). Default: UDP only.
	// With PrivateKey, its streams are secure too, and take no plaintext
	// (docs/PROTOCOL.md §9.1).
	TCP bool
	// HTTP, with TCP, serves HTTP on the game's TCP port beside kNet over
	// TCP: a stream whose first bytes are an HTTP/1 request line (a
	// method, a space, then "/" or "*") goes to this handler instead of
	// becoming a connection, so that UDP, kNet over TCP and WebSocket
	// (WebSocketHandler mounted on it) share one port number. The stream
	// takes its place among the pending attempts like any other until
	// its first bytes tell (docs/streams.md); once handed over, it is an
	// http.Server's, with ReadHeaderTimeout at ConnectTimeout and
	// IdleTimeout at ConnectionLostTimeout. A knet hello, and the
	// reference's first ping, never look like one; a reference client
	// whose first frame spelled a request line would be taken for HTTP.
	HTTP http.Handler
	// FallbackTCP makes Dial over UDP try TCP to the same address too,
	// when UDP has no answer within 250 ms (or fails sooner); the first
	// connection established wins (Conn.Transport says which).
	FallbackTCP bool

	// Simulate, when not nil, makes what this Conn or Listener sends
	// cross a simulated bad network first: to test a game under loss,
	// latency, reordering and the rest without a real one. Give each side
	// its own to shape both directions. Over UDP it shapes each datagram.
	// Over TCP and WebSocket it shapes what the connection writes (a
	// Listener's, each stream it serves, on a path of its own; Dial's and
	// DialWebSocket's, their own) as TCP would show that network: delay,
	// jitter and bursts as delay, never out of order; Bandwidth as a cap,
	// behind which the writer waits; and a segment that Loss or Corrupt
	// loses as a stall of a retransmission timeout (at least 200ms), which
	// holds everything behind it. See Simulation.
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

	// ChannelWeights shares the sending among messages queued at one
	// Priority by their Channel's weight (default 1), counted in payload
	// bytes: two downloads on channels weighted 3 and 1 get three
	// quarters and a quarter of what the path and the peer allow them
	// (GameNetworkingSockets' lanes, in knet's terms). A channel's
	// messages keep their order; higher priorities still go first.
	// Channel is read for this on any message, InOrder or not. Nil: send
	// order within a priority.
	ChannelWeights map[uint8]int

	// Receipts, when true, has the connection tell what became of each
	// message sent with SendRef, once: delivered (the peer acked it) or
	// lost (see Receipt). They come out of Conn.Receipts, or of
	// Group.Poll as EventDelivered and EventLost. An unreliable message
	// that wants one carries 4 bytes more on the wire, and the peer's
	// acks name its datagram: a spec peer other than knet, or the
	// reference dialect, never acks unreliable messages, so they are
	// all reported lost.
	Receipts bool

	// Logger, when not nil, hears of each connection's life: established
	// (Info), refused (Info, with the reason), ended (Info when graceful,
	// Warn when lost: a timeout, a protocol error, ...). Nothing is logged
	// per datagram or per message. Nil logs nothing.
	Logger *slog.Logger

	// sealTap, for tests, sees every datagram a secure connection seals
	// (see secureState.tap).
	sealTap sealTap
}

// MaxUnreliablePayload is the largest payload an unreliable message can
// have and still travel as one unreliable datagram with this
// configuration (1104 bytes at the default MaxDatagramSize, 1304 in the
// reference dialect), whatever size path MTU discovery finds: an
// unreliable datagram is never resent, so it stays within the base the
// path must carry. A larger one goes as a reliable fragmented transfer,
// as the protocol requires: retransmitted, and counted in
// Stats.UnreliableAsReliable.
func (c *Config) MaxUnreliablePayload() int { return c.resolve().wholeLimit() }

// Simulation describes a bad network for Config.Simulate. The zero value
// is a perfect network; every choice is drawn from Seed, so a run can be
// replayed. Out-of-range values are clamped: probabilities to 0..1 (NaN is
// 0), durations to 0..1h, negative sizes to 0.
//
// Over TCP and WebSocket, the datagrams are TCP's segments: what the
// connection writes is cut into segments of 1448 bytes at most, each
// takes Delay and its Jitter, in order (a segment never arrives before
// the one written before it), and crosses the Bandwidth cap behind the
// others. A segment that Loss or its bursts, or Corrupt (for TCP's
// checksum), would lose arrives one retransmission timeout later, and
// everything behind it waits for it: the timeout is RTT + max(4·RTTVAR,
// 200ms) for RTT = 2·Delay + Jitter (the path taken as symmetric) plus
// the segment's wait at the cap, and RTTVAR = Jitter/2, doubling each
// time the same segment is lost again, as TCP's backoff does; a burst
// holds everything until a retransmission after its end gets through.
// The send buffer holds what was written until its acknowledgement would
// come back, Delay + Jitter/2 after it arrived: with a cap, the
// bandwidth-delay product and QueueBytes; without, 4 MiB. A writer waits
// for room in it, as on a socket, and nothing is dropped at the cap.
// Reorder holds a segment, and those behind it, ReorderDelay longer;
// Duplicate, JitterKeepsOrder and MaxSize do nothing (TCP drops
// duplicates, keeps order, and sizes its segments to the path).
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
	// MaxSize drops every datagram larger than it, in bytes (0: none), as
	// a path with that MTU and no ICMP does: to try MaxPathDatagramSize.
	MaxSize int
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
		MaxSize: max(s.MaxSize, 0), Seed: s.Seed,
	}
}

// config is a Config with the defaults applied.
type config struct {
	pingInterval, maxAckDelay, datagramTimeout time.Duration
	lostTimeout, connectTimeout, disconnect    time.Duration
	resumeTimeout                              time.Duration
	reorderWindow                              time.Duration
	reorderWindows                             map[uint32]time.Duration
	initialRate, minRate                       float64
	maxSendCount                               int
	maxFragment, maxDatagram, maxMessage       int
	sendBuffer, recvBuffer, reassemblyBuffer   int
	receiveBudget                              int
	maxPending, backlog, sockets               int
	maxPendingPerSource                        int
	connectPayload                             []byte
	tcp, fallbackTCP                           bool
	admit                                      func(net.Addr, []byte) ([]byte, error)
	admitConn                                  func(*Conn, []byte) ([]byte, error)
	stealth                                    bool
	http                                       http.Handler // Config.HTTP
	receipts                                   bool
	channelWeights                             map[uint8]int
	simulate                                   *Simulation
	congestion                                 func(CongestionParams) CongestionControl
	dialect                                    Dialect
	group                                      *Group
	logger                                     *slog.Logger
	// Secure sessions: a server's keys, or the key a client expects.
	privateKey, publicKey, serverKey []byte
	nextPrivateKey                   []byte // a Listener's, during a key rotation (serverkey.go)
	tokenKey, token                  []byte
	serverID                         []byte
	publicAddrs                      []netip.AddrPort
	cookieThreshold                  int
	sealTap                          sealTap
	// Key updates (keyupdate.go): datagrams per key, 0 when off; the
	// longest a key lives, 0 for no bound.
	keyUpdatePackets uint64
	keyUpdateTime    time.Duration
	// pathExtra is how much larger than maxDatagram path MTU discovery
	// may make a datagram (Config.MaxPathDatagramSize); 0: off.
	pathExtra int
	// datagramSize is MaxDatagramSize as resolved, before sealing's
	// overhead comes off maxDatagram.
	datagramSize int
	// reference is this configuration for a session of the reference
	// dialect on a listener that serves both (forDialect); nil when it is
	// the same.
	reference *config
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
	defaultMaxDatagramSize     = 1200 // RFC 9000 §14's base: every real path carries it
	defaultMaxPathDatagramSize = 1400 // the former MaxDatagramSize: no peer gets larger datagrams than it did
	referenceDatagramSize      = 1400 // the C++ reference's (its default maxSendSize)
	defaultMaxMessageSize      = 16 << 20
	defaultSendBuffer          = 4 << 20
	defaultReceiveBuffer       = 32 << 20
	defaultReassemblyBuffer    = 4 << 20
	defaultReceiveBudget       = 128 << 20
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

// A Config's fields are for both sides but these: Listen (and
// ListenPacket) refuses a Config that sets a field only Dial reads, and
// Dial (DialPacket, DialWebSocket) one that sets a field only a Listener
// reads, naming the field, rather than ignore it. A program whose client
// and server share settings copies the Config and clears the other
// side's fields.
var (
	// dialFields are read by Dial only.
	dialFields = []string{"ConnectPayload", "ServerKey", "Token", "FallbackTCP"}
	// listenFields are read by a Listener only.
	listenFields = []string{"ReceiveBudget", "Admit", "AdmitConn", "Stealth", "MaxPendingConnections",
		"MaxPendingPerSource", "AcceptBacklog", "Sockets", "PrivateKey", "NextPrivateKey", "TokenKey", "PublicAddrs",
		"ServerID", "CookieThreshold", "TCP", "HTTP"}
)

// set reports whether c sets the field of that name (dialFields,
// listenFields).
func (c *Config) set(field string) bool {
	switch field {
	case "ConnectPayload":
		return c.ConnectPayload != nil
	case "ServerKey":
		return c.ServerKey != nil
	case "Token":
		return c.Token != nil
	case "FallbackTCP":
		return c.FallbackTCP
	case "ReceiveBudget":
		return c.ReceiveBudget != 0
	case "Admit":
		return c.Admit != nil
	case "AdmitConn":
		return c.AdmitConn != nil
	case "Stealth":
		return c.Stealth
	case "MaxPendingConnections":
		return c.MaxPendingConnections != 0
	case "MaxPendingPerSource":
		return c.MaxPendingPerSource != 0
	case "AcceptBacklog":
		return c.AcceptBacklog != 0
	case "Sockets":
		return c.Sockets != 0
	case "PrivateKey":
		return c.PrivateKey != nil
	case "NextPrivateKey":
		return c.NextPrivateKey != nil
	case "TokenKey":
		return c.TokenKey != nil
	case "PublicAddrs":
		return c.PublicAddrs != nil
	case "ServerID":
		return c.ServerID != nil
	case "CookieThreshold":
		return c.CookieThreshold != 0
	case "TCP":
		return c.TCP
	case "HTTP":
		return c.HTTP != nil
	}
	panic("knet: no Config field " + field)
}

// checkSide reports the first field of c that the other side's calls
// read, and Admit set with AdmitConn; listener tells which side c is for.
func (c *Config) checkSide(listener bool) error {
	if c == nil {
		return nil
	}
	other, side, mine := listenFields, "a Listener's", "Dial"
	if listener {
		other, side, mine = dialFields, "Dial's", "Listen"
	}
	for _, f := range other {
		if c.set(f) {
			return fmt.Errorf("knet: Config.%s is %s, not %s's: %w", f, side, mine, errConfigSide)
		}
	}
	if listener && c.Admit != nil && c.AdmitConn != nil {
		return errors.New("knet: Config.Admit and Config.AdmitConn both set: set one")
	}
	return nil
}

// errConfigSide is wrapped in checkSide's error.
var errConfigSide = errors.New("a Config field of the other side")

// resolveListener is resolve for Listen and ListenPacket: c checked
// (checkSide) and its keys too (secureListener).
func (c *Config) resolveListener() (*config, error) {
	if err := c.checkSide(true); err != nil {
		return nil, err
	}
	rc := c.resolve()
	if err := rc.secureListener(); err != nil {
		return nil, err
	}
	return rc, nil
}

// resolveDialer is resolve for Dial and its variants: c checked
// (checkSide) and its key too (secureDialer).
func (c *Config) resolveDialer() (*config, error) {
	if err := c.checkSide(false); err != nil {
		return nil, err
	}
	rc := c.resolve()
	if err := rc.secureDialer(); err != nil {
		return nil, err
	}
	return rc, nil
}

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
		receiveBudget:    pick(c.ReceiveBudget, defaultReceiveBudget),
		maxPending:       pick(c.MaxPendingConnections, defaultMaxPending),
		backlog:          min(pick(c.AcceptBacklog, defaultBacklog), maxBacklog),
		sockets:          min(pick(c.Sockets, 1), maxSockets),
		connectPayload:   c.ConnectPayload,
		tcp:              c.TCP,
		http:             c.HTTP,
		fallbackTCP:      c.FallbackTCP,
		admit:            c.Admit,
		admitConn:        c.AdmitConn,
		stealth:          c.Stealth,
		receipts:         c.Receipts,
		channelWeights:   maps.Clone(c.ChannelWeights),
		simulate:         c.Simulate,
		sealTap:          c.sealTap,
		congestion:       c.CongestionControl,
		dialect:          c.Dialect,
		group:            c.Group,
		logger:           c.Logger,
	}
	r.keyUpdatePackets, r.keyUpdateTime = c.keyUpdates()
	r.maxPendingPerSource = min(pick(c.MaxPendingPerSource, max(min(r.maxPending, 16), r.maxPending/16)), r.maxPending)
	if c.MaxDatagramSize <= 0 && r.dialect == DialectReference {
		r.maxDatagram = referenceDatagramSize
	}
	r.datagramSize = r.maxDatagram
	path := c.MaxPathDatagramSize
	if path == 0 && c.MaxDatagramSize <= 0 {
		path = defaultMaxPathDatagramSize // a MaxDatagramSize set is the largest sent
	}
	if path > r.maxDatagram && r.dialect != DialectReference {
		r.pathExtra = min(path, maxDatagramSizeLimit) - r.maxDatagram
	}
	r.privateKey = bytes.Clone(c.PrivateKey)
	r.nextPrivateKey = bytes.Clone(c.NextPrivateKey)
	r.serverKey = bytes.Clone(c.ServerKey)
	r.tokenKey = bytes.Clone(c.TokenKey)
	r.token = bytes.Clone(c.Token)
	r.publicAddrs = slices.Clone(c.PublicAddrs)
	r.serverID = bytes.Clone(c.ServerID)
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
	r.resumeTimeout = clampDur(c.ResumeTimeout, 0)
	r.maxFragment = min(max(r.maxFragment, minFragmentSize), maxContentLength-8)
	if c.MaxDatagramSize <= 0 && r.dialect == DialectAuto {
		// A listener's peers of the reference dialect get its size.
		ref := *r
		ref.maxDatagram += referenceDatagramSize - r.datagramSize
		ref.datagramSize = referenceDatagramSize
		ref.pathExtra = 0
		r.reference = &ref
	}
	return r
}

// forDialect returns the configuration of a session speaking dialect: the
// reference dialect keeps the reference's datagram size (1400 bytes)
// unless MaxDatagramSize says otherwise, and never probes the path.
func (c *config) forDialect(d Dialect) *config {
	if d == DialectReference && c.reference != nil {
		return c.reference
	}
	return c
}

// maxPathDatagram is the largest datagram path MTU discovery may send, in
// the session's terms (as maxDatagram, sealing's overhead taken off).
func (c *config) maxPathDatagram() int { return c.maxDatagram + c.pathExtra }

// sizeOverhead is what sealing adds to the session's datagrams on the
// wire (0 in clear).
func (c *config) sizeOverhead() int { return c.datagramSize - c.maxDatagram }

// readSize is the largest datagram, on the wire, an endpoint with this
// configuration sends or reads: a larger one is dropped as truncated.
func (c *config) readSize() int {
	size := c.maxPathDatagram()
	if c.privateKey != nil || c.serverKey != nil {
		size += wireOverhead // what maxDatagram leaves for sealing
	}
	return size
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
		// The reply follows the connection ID (cidSize, secure.go).
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
