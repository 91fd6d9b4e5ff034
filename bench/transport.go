package main

import (
	"bufio"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/knet-go/knet"
	"github.com/quic-go/quic-go"
	kcp "github.com/xtaci/kcp-go/v5"
)

// A lib is one transport under test, seen through the same small
// message-oriented interface so that every scenario is written once.
type lib interface {
	Name() string
	Listen(addr string) (msgListener, error)
	Dial(ctx context.Context, addr string) (msgConn, error)
}

type msgListener interface {
	Addr() string
	Accept(ctx context.Context) (msgConn, error)
	Close() error
}

// msgConn carries whole reliable messages. Send blocks while the
// transport's buffers are full; Recv copies one message into buf and
// returns its length. Close makes pending Send and Recv calls return. A
// msgConn is used by at most one sending and one receiving goroutine.
type msgConn interface {
	Send(p []byte) error
	Recv(buf []byte) (int, error)
	Close() error
}

// noter is implemented by connections with counters worth printing.
type noter interface {
	Note() string
}

var errTooLarge = errors.New("message larger than receive buffer")

// ---------------------------------------------------------------- knet

// benchMsgID is the application message ID knet messages are sent with.
const benchMsgID = 100

// knetLib is knet with reliable messages on one channel: InOrder (knet's
// main column, the same service as a kcp-go session or a QUIC stream) or
// unordered (an extra column: what the application gets when it does not
// need the order); secure is the main column's service over a secure
// session (Noise NK handshake, AES-256-GCM on every datagram), to set
// beside the plain one and quic-go, which always encrypts.
//
// transport, when set, runs the main column's service over another
// transport than UDP: knetTransports lists them, and their rows sit in
// knet's column (the Listener takes them beside UDP, on the same port
// number).
type knetLib struct {
	unordered, secure bool
	transport         *knetTransport
}

// knetTransport is a transport knet's column is measured over beside UDP:
// a ping-pong row and a 1200 B throughput row each.
type knetTransport struct {
	name    string // in row labels and IDs
	network string // Dial's network
	listen  func(cfg *knet.Config)
	// For WebSocket: serve starts what takes the transport beside the
	// Listener (an HTTP server on the same port number over TCP), and
	// dial connects over it.
	serve func(l *knet.Listener) (io.Closer, error)
	dial  func(ctx context.Context, addr string, cfg *knet.Config) (*knet.Conn, error)
}

// knetTransports are the transports beside UDP.
var knetTransports = []*knetTransport{
	{name: "TCP", network: "tcp", listen: func(cfg *knet.Config) { cfg.TCP = true }},
	{name: "WebSocket", network: "websocket", listen: func(*knet.Config) {}, serve: serveWebSocket,
		dial: func(ctx context.Context, addr string, cfg *knet.Config) (*knet.Conn, error) {
			return knet.DialWebSocket(ctx, "ws://"+addr+"/knet", cfg)
		}},
}

// serveWebSocket serves l's WebSocket handler over HTTP on the TCP port
// of l's UDP port number.
func serveWebSocket(l *knet.Listener) (io.Closer, error) {
	ln, err := net.Listen("tcp", l.Addr().String())
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("/knet", l.WebSocketHandler())
	srv := &http.Server{Handler: mux}
	go srv.Serve(ln)
	return srv, nil
}

func (k knetLib) Name() string {
	switch {
	case k.unordered:
		return colKnetU
	case k.secure:
		return colKnetS
	}
	return colKnet
}

// knetConfig is knet's default configuration, except for a short
// DisconnectTimeout so that teardown between scenarios stays quick (it
// bounds graceful close only and plays no part in any measurement).
func knetConfig() *knet.Config {
	return &knet.Config{DisconnectTimeout: time.Second}
}

// benchKeys is the secure column's server key pair, one for the run.
var benchKeys = sync.OnceValues(func() ([2][]byte, error) {
	priv, pub, err := knet.GenerateKey()
	return [2][]byte{priv, pub}, err
})

// config is knetConfig with the keys of a secure session when k is the
// secure column: the server's private key, the client's copy of its
// public key.
func (k knetLib) config(server bool) (*knet.Config, error) {
	cfg := knetConfig()
	if server && k.transport != nil {
		k.transport.listen(cfg)
	}
	if !k.secure {
		return cfg, nil
	}
	keys, err := benchKeys()
	if err != nil {
		return nil, err
	}
	if server {
		cfg.PrivateKey = keys[0]
	} else {
		cfg.ServerKey = keys[1]
	}
	return cfg, nil
}

func (k knetLib) Listen(addr string) (msgListener, error) {
	cfg, err := k.config(true)
	if err != nil {
		return nil, err
	}
	l, err := knet.Listen("udp", addr, cfg)
	if err != nil {
		return nil, err
	}
	kl := &knetListener{l: l, inOrder: !k.unordered}
	if k.transport != nil && k.transport.serve != nil {
		if kl.web, err = k.transport.serve(l); err != nil {
			l.Close()
			return nil, err
		}
	}
	return kl, nil
}

func (k knetLib) Dial(ctx context.Context, addr string) (msgConn, error) {
	cfg, err := k.config(false)
	if err != nil {
		return nil, err
	}
	network := "udp"
	if k.transport != nil {
		network = k.transport.network
	}
	var c *knet.Conn
	if k.transport != nil && k.transport.dial != nil {
		c, err = k.transport.dial(ctx, addr, cfg)
	} else {
		c, err = knet.Dial(ctx, network, addr, cfg)
	}
	if err != nil {
		return nil, err
	}
	if k.secure && !c.Secure() {
		c.Close()
		return nil, errors.New("knet: the secure column's connection is not secure")
	}
	return newKnetConn(c, !k.unordered), nil
}

type knetListener struct {
	l       *knet.Listener
	web     io.Closer // the WebSocket transport's HTTP server, if any
	inOrder bool
}

func (k *knetListener) Addr() string { return k.l.Addr().String() }
func (k *knetListener) Close() error {
	if k.web != nil {
		k.web.Close()
	}
	return k.l.Close()
}

func (k *knetListener) Accept(ctx context.Context) (msgConn, error) {
	c, err := k.l.AcceptConn(ctx)
	if err != nil {
		return nil, err
	}
	return newKnetConn(c, k.inOrder), nil
}

type knetConn struct {
	c       *knet.Conn
	inOrder bool
	ctx     context.Context
	cancel  context.CancelFunc
}

func newKnetConn(c *knet.Conn, inOrder bool) *knetConn {
	ctx, cancel := context.WithCancel(context.Background())
	return &knetConn{c: c, inOrder: inOrder, ctx: ctx, cancel: cancel}
}

// Send sends p as one reliable message, on channel 0 when in order.
func (k *knetConn) Send(p []byte) error {
	return k.c.SendContext(k.ctx, knet.Message{ID: benchMsgID, Payload: p, Reliable: true, InOrder: k.inOrder})
}

func (k *knetConn) Recv(buf []byte) (int, error) {
	_, n, err := k.c.ReceiveInto(k.ctx, buf)
	if err != nil {
		return 0, err
	}
	if n > len(buf) {
		return 0, errTooLarge
	}
	return n, nil
}

func (k *knetConn) Close() error {
	k.cancel()
	return k.c.Close()
}

func (k *knetConn) Note() string {
	s := k.c.Stats()
	if tr := k.c.Transport(); tr != knet.TransportUDP {
		return fmt.Sprintf("over %v: rtt %v, bytes sent %d / recv %d, messages sent %d / recv %d, dropped %d",
			tr, s.RTT.Round(time.Microsecond), s.BytesSent, s.BytesReceived, s.MessagesSent, s.MessagesReceived, s.DroppedMessages)
	}
	return fmt.Sprintf("rtt %v (min %v, rto %v), dgrams sent %d / recv %d, retransmits %d (fast %d, spurious %d), duplicates recv %d, dropped dgrams %d, rate %.0f dgram/s, in flight %d",
		s.RTT.Round(time.Microsecond), s.MinRTT.Round(time.Microsecond), s.RTO.Round(time.Millisecond), s.DatagramsSent, s.DatagramsReceived,
		s.Retransmits, s.FastRetransmits, s.SpuriousLosses, s.DuplicateDatagrams, s.DroppedDatagrams, s.SendRate, s.InFlight)
}

// ---------------------------------------------------------------- kcp-go

type kcpLib struct{}

func (kcpLib) Name() string { return "kcp-go" }

// Tuning a kcp-go user would apply for low latency and throughput: the
// "fast" mode from kcp's documentation (nodelay, 10 ms internal clock, fast
// resend after 2 skipped acks, no congestion window) and large windows.
// Stream framing is ours: a 4-byte length prefix per message.
const kcpWindow = 1024

func tuneKCP(s *kcp.UDPSession) {
	s.SetNoDelay(1, 10, 2, 1)
	s.SetWindowSize(kcpWindow, kcpWindow)
	s.SetReadBuffer(4 << 20) // dialed sessions only; the listener's socket is set below
	s.SetWriteBuffer(4 << 20)
}

func (kcpLib) Listen(addr string) (msgListener, error) {
	l, err := kcp.ListenWithOptions(addr, nil, 0, 0)
	if err != nil {
		return nil, err
	}
	l.SetReadBuffer(4 << 20)
	l.SetWriteBuffer(4 << 20)
	return &kcpListener{l: l}, nil
}

func (kcpLib) Dial(ctx context.Context, addr string) (msgConn, error) {
	s, err := kcp.DialWithOptions(addr, nil, 0, 0)
	if err != nil {
		return nil, err
	}
	tuneKCP(s)
	return newStreamConn(s, s.Close), nil
}

type kcpListener struct{ l *kcp.Listener }

func (k *kcpListener) Addr() string { return k.l.Addr().String() }
func (k *kcpListener) Close() error { return k.l.Close() }

func (k *kcpListener) Accept(ctx context.Context) (msgConn, error) {
	for {
		k.l.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
		s, err := k.l.AcceptKCP()
		if err == nil {
			tuneKCP(s)
			return newStreamConn(s, s.Close), nil
		}
		var ne net.Error
		if !errors.As(err, &ne) || !ne.Timeout() {
			return nil, err
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
	}
}

// streamConn frames messages on a reliable byte stream (kcp-go session,
// QUIC stream) with a 4-byte little-endian length prefix. Each message is
// one Write call, as an application sending messages would do.
type streamConn struct {
	w      io.Writer
	r      *bufio.Reader
	wbuf   []byte
	hdr    [4]byte
	close  func() error
	lazy   func() (io.ReadWriter, error) // opens the stream on first use
	mu     sync.Mutex
	inited bool
}

func newStreamConn(rw io.ReadWriter, close func() error) *streamConn {
	return &streamConn{w: rw, r: bufio.NewReaderSize(rw, 64<<10), close: close, inited: true}
}

func (s *streamConn) init() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.inited {
		return nil
	}
	rw, err := s.lazy()
	if err != nil {
		return err
	}
	s.w, s.r, s.inited = rw, bufio.NewReaderSize(rw, 64<<10), true
	return nil
}

func (s *streamConn) Send(p []byte) error {
	if err := s.init(); err != nil {
		return err
	}
	s.wbuf = binary.LittleEndian.AppendUint32(s.wbuf[:0], uint32(len(p)))
	s.wbuf = append(s.wbuf, p...)
	_, err := s.w.Write(s.wbuf)
	return err
}

func (s *streamConn) Recv(buf []byte) (int, error) {
	if err := s.init(); err != nil {
		return 0, err
	}
	if _, err := io.ReadFull(s.r, s.hdr[:]); err != nil {
		return 0, err
	}
	n := int(binary.LittleEndian.Uint32(s.hdr[:]))
	if n > len(buf) {
		return 0, errTooLarge
	}
	if _, err := io.ReadFull(s.r, buf[:n]); err != nil {
		return 0, err
	}
	return n, nil
}

func (s *streamConn) Close() error { return s.close() }

// ---------------------------------------------------------------- quic-go

type quicLib struct{}

func (quicLib) Name() string { return "quic-go" }

func quicConfig() *quic.Config {
	return &quic.Config{
		HandshakeIdleTimeout: 5 * time.Second,
		MaxIdleTimeout:       30 * time.Second,
	}
}

func (quicLib) Listen(addr string) (msgListener, error) {
	srv, _, err := tlsConfigs()
	if err != nil {
		return nil, err
	}
	l, err := quic.ListenAddr(addr, srv, quicConfig())
	if err != nil {
		return nil, err
	}
	return &quicListener{l: l}, nil
}

func (quicLib) Dial(ctx context.Context, addr string) (msgConn, error) {
	_, cli, err := tlsConfigs()
	if err != nil {
		return nil, err
	}
	c, err := quic.DialAddr(ctx, addr, cli, quicConfig())
	if err != nil {
		return nil, err
	}
	st, err := c.OpenStreamSync(ctx)
	if err != nil {
		c.CloseWithError(0, "")
		return nil, err
	}
	return newStreamConn(st, func() error { return c.CloseWithError(0, "") }), nil
}

type quicListener struct{ l *quic.Listener }

func (q *quicListener) Addr() string { return q.l.Addr().String() }
func (q *quicListener) Close() error { return q.l.Close() }

// Accept returns once the connection is accepted; its stream is accepted
// on first use, so that a client slow to send never holds up the others.
func (q *quicListener) Accept(ctx context.Context) (msgConn, error) {
	c, err := q.l.Accept(ctx)
	if err != nil {
		return nil, err
	}
	sctx, cancel := context.WithCancel(context.Background())
	s := &streamConn{close: func() error {
		cancel()
		return c.CloseWithError(0, "")
	}}
	s.lazy = func() (io.ReadWriter, error) { return c.AcceptStream(sctx) }
	return s, nil
}

var (
	tlsOnce        sync.Once
	tlsSrv, tlsCli *tls.Config
	tlsErr         error
)

const quicALPN = "knet-bench"

// tlsConfigs makes a throwaway self-signed certificate for 127.0.0.1 and
// a client configuration that trusts exactly it.
func tlsConfigs() (*tls.Config, *tls.Config, error) {
	tlsOnce.Do(func() {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			tlsErr = err
			return
		}
		tmpl := &x509.Certificate{
			SerialNumber:          big.NewInt(1),
			Subject:               pkix.Name{CommonName: "knet-bench"},
			NotBefore:             time.Now().Add(-time.Hour),
			NotAfter:              time.Now().Add(24 * time.Hour),
			KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
			ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
			BasicConstraintsValid: true,
			IsCA:                  true,
			IPAddresses:           []net.IP{net.IPv4(127, 0, 0, 1)},
			DNSNames:              []string{"localhost"},
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
		if err != nil {
			tlsErr = err
			return
		}
		cert, err := x509.ParseCertificate(der)
		if err != nil {
			tlsErr = err
			return
		}
		pool := x509.NewCertPool()
		pool.AddCert(cert)
		tlsSrv = &tls.Config{
			Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}},
			NextProtos:   []string{quicALPN},
		}
		tlsCli = &tls.Config{RootCAs: pool, NextProtos: []string{quicALPN}}
	})
	return tlsSrv, tlsCli, tlsErr
}
