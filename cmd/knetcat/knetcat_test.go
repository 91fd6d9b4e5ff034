package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/knet-go/knet"
)

// syncBuffer is an output knetcat writes from several goroutines, which a
// test waits on.
type syncBuffer struct {
	mu      sync.Mutex
	b       bytes.Buffer
	changed chan struct{} // closed and replaced at each write
}

func newSyncBuffer() *syncBuffer { return &syncBuffer{changed: make(chan struct{})} }

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	close(s.changed)
	s.changed = make(chan struct{})
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// waitFor waits until the output holds want, and returns the output.
func (s *syncBuffer) waitFor(t *testing.T, ctx context.Context, want string) string {
	t.Helper()
	for {
		s.mu.Lock()
		out, ch := s.b.String(), s.changed
		s.mu.Unlock()
		if strings.Contains(out, want) {
			return out
		}
		select {
		case <-ch:
		case <-ctx.Done():
			t.Fatalf("waiting for %q: %v; have %q", want, ctx.Err(), out)
		}
	}
}

// knetcat is one run of knetcat in the test.
type knetcat struct {
	stdout, stderr *syncBuffer
	done           chan int
	cancel         context.CancelFunc // an interrupt
}

func start(ctx context.Context, stdin io.Reader, args ...string) *knetcat {
	ctx, cancel := context.WithCancel(ctx)
	k := &knetcat{stdout: newSyncBuffer(), stderr: newSyncBuffer(), done: make(chan int, 1), cancel: cancel}
	go func() { k.done <- run(ctx, args, stdin, k.stdout, k.stderr) }()
	return k
}

// wait returns knetcat's exit status.
func (k *knetcat) wait(t *testing.T, ctx context.Context) int {
	t.Helper()
	select {
	case code := <-k.done:
		k.cancel()
		return code
	case <-ctx.Done():
		t.Fatalf("knetcat did not end: %v\nstdout: %q\nstderr: %q", ctx.Err(), k.stdout, k.stderr)
		return -1
	}
}

// listenAddr waits for a listening knetcat's address.
func (k *knetcat) listenAddr(t *testing.T, ctx context.Context) string {
	t.Helper()
	out := k.stderr.waitFor(t, ctx, "listening on ")
	rest := out[strings.Index(out, "listening on ")+len("listening on "):]
	return strings.TrimSpace(strings.SplitN(rest, "\n", 2)[0])
}

func testContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// echoServer is the echo example's server: it sends every message back.
// It records what it received, and each connection's dialect.
type echoServer struct {
	l          *knet.Listener
	got        chan knet.Message
	dialects   chan knet.Dialect
	transports chan knet.Transport
	wg         sync.WaitGroup
}

func startEcho(t *testing.T) *echoServer {
	l, err := knet.Listen("udp", "127.0.0.1:0", &knet.Config{TCP: true})
	if err != nil {
		t.Fatal(err)
	}
	s := &echoServer{l: l, got: make(chan knet.Message, 1000), dialects: make(chan knet.Dialect, 10), transports: make(chan knet.Transport, 10)}
	s.wg.Go(func() {
		for {
			c, err := l.AcceptConn(context.Background())
			if err != nil {
				return
			}
			s.dialects <- c.Dialect()
			s.transports <- c.Transport()
			s.wg.Go(func() {
				defer c.Close()
				for {
					m, err := c.Receive(context.Background())
					if err != nil {
						return
					}
					s.got <- m
					// Unlike the example, keep receiving when the echo
					// fails: a client that closed at once still had its
					// messages delivered, and the tests count them.
					c.Send(m)
				}
			})
		}
	})
	t.Cleanup(func() {
		l.Close()
		s.wg.Wait()
	})
	return s
}

func (s *echoServer) addr() string { return s.l.Addr().String() }

// take waits for the next n messages the server gets: knetcat ending
// means its peer acked them, not that the server's loop took them yet.
func (s *echoServer) take(t *testing.T, ctx context.Context, n int) []knet.Message {
	t.Helper()
	var ms []knet.Message
	for len(ms) < n {
		select {
		case m := <-s.got:
			ms = append(ms, m)
		case <-ctx.Done():
			t.Fatalf("server got %d messages, want %d", len(ms), n)
		}
	}
	return ms
}

// received returns what the server got so far.
func (s *echoServer) received() []knet.Message {
	var ms []knet.Message
	for {
		select {
		case m := <-s.got:
			ms = append(ms, m)
		default:
			return ms
		}
	}
}

// TestConnectToEchoServer: knetcat as a client of the echo example's
// server sends each line as a message and prints the echoes, in order,
// then ends with status 0 after -n of them.
func TestConnectToEchoServer(t *testing.T) {
	ctx := testContext(t)
	srv := startEcho(t)
	k := start(ctx, strings.NewReader("one\ntwo\n\nthree"), "-n", "4", "-inorder", srv.addr())
	if code := k.wait(t, ctx); code != 0 {
		t.Fatalf("status %d, stderr %q", code, k.stderr)
	}
	if got, want := k.stdout.String(), "one\ntwo\n\nthree\n"; got != want {
		t.Errorf("stdout %q, want %q", got, want)
	}
	for _, m := range srv.received() {
		if m.ID != 100 || !m.Reliable || !m.InOrder {
			t.Errorf("server got %+v, want ID 100, reliable, in order", m)
		}
	}
}

// TestConnectClosesAtEOF: without -n or -keep the end of the input closes
// the connection gracefully, and what was sent is delivered first.
func TestConnectClosesAtEOF(t *testing.T) {
	ctx := testContext(t)
	srv := startEcho(t)
	k := start(ctx, strings.NewReader("a\nb\nc\n"), "-id", "4242", srv.addr())
	if code := k.wait(t, ctx); code != 0 {
		t.Fatalf("status %d, stderr %q", code, k.stderr)
	}
	var got []string
	for _, m := range srv.take(t, ctx, 3) {
		if m.ID != 4242 {
			t.Errorf("ID %d, want 4242", m.ID)
		}
		got = append(got, string(m.Payload))
	}
	slices.Sort(got) // reliable, not in order
	if strings.Join(got, ",") != "a,b,c" {
		t.Errorf("server got %q, want a, b and c", got)
	}
}

// TestHexVerboseStats: -hex prints payloads in hex, -v prefixes the peer,
// ID and flags, -stats reports the connection's figures at the end.
func TestHexVerboseStats(t *testing.T) {
	ctx := testContext(t)
	srv := startEcho(t)
	k := start(ctx, strings.NewReader("hi\n"), "-hex", "-v", "-stats", "-unreliable", "-n", "1", srv.addr())
	if code := k.wait(t, ctx); code != 0 {
		t.Fatalf("status %d, stderr %q", code, k.stderr)
	}
	if got, want := k.stdout.String(), srv.addr()+" id=100 unreliable 2 bytes: 6869\n"; got != want {
		t.Errorf("stdout %q, want %q", got, want)
	}
	for _, want := range []string{"connected to " + srv.addr() + " (spec dialect)", "stats " + srv.addr() + ": rtt", "messages 1 sent / 1 received"} {
		if !strings.Contains(k.stderr.String(), want) {
			t.Errorf("stderr %q lacks %q", k.stderr, want)
		}
	}
}

// TestDialectReference: -dialect reference talks the C++ kNet's wire to
// a default Listener, which serves it.
func TestDialectReference(t *testing.T) {
	ctx := testContext(t)
	srv := startEcho(t)
	k := start(ctx, strings.NewReader("ref1\nref2\n"), "-dialect", "reference", "-inorder", "-n", "2", srv.addr())
	if code := k.wait(t, ctx); code != 0 {
		t.Fatalf("status %d, stderr %q", code, k.stderr)
	}
	if got, want := k.stdout.String(), "ref1\nref2\n"; got != want {
		t.Errorf("stdout %q, want %q", got, want)
	}
	if d := <-srv.dialects; d != knet.DialectReference {
		t.Errorf("server saw the %v dialect, want reference", d)
	}
}

// TestTCP: -tcp connects over TCP, to the same port number as UDP, and
// -l -tcp takes TCP clients too.
func TestTCP(t *testing.T) {
	ctx := testContext(t)
	srv := startEcho(t)
	k := start(ctx, strings.NewReader("tcp1\ntcp2\n"), "-tcp", "-v", "-n", "2", srv.addr())
	if code := k.wait(t, ctx); code != 0 {
		t.Fatalf("status %d, stderr %q", code, k.stderr)
	}
	if got, want := k.stdout.String(), srv.addr()+" id=100 unreliable 4 bytes: tcp1\n"+srv.addr()+" id=100 unreliable 4 bytes: tcp2\n"; got != want {
		t.Errorf("stdout %q, want %q (over TCP every message reads as unreliable)", got, want)
	}
	if !strings.Contains(k.stderr.String(), "(spec dialect, over tcp)") {
		t.Errorf("stderr %q does not say the connection is over TCP", k.stderr)
	}
	if tr := <-srv.transports; tr != knet.TransportTCP {
		t.Errorf("server saw a connection over %v, want tcp", tr)
	}

	l := start(ctx, strings.NewReader(""), "-l", "127.0.0.1:0", "-tcp", "-echo")
	c, err := knet.Dial(ctx, "tcp", l.listenAddr(t, ctx), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for i := range 3 {
		p := fmt.Appendf(nil, "over tcp %d", i)
		if err := c.Send(knet.Message{ID: 100, Payload: p, Reliable: true}); err != nil {
			t.Fatal(err)
		}
		m, err := c.Receive(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(m.Payload, p) {
			t.Errorf("echo %q, want %q", m.Payload, p)
		}
	}
	l.cancel()
	if code := l.wait(t, ctx); code != 0 {
		t.Fatalf("listener status %d, stderr %q", code, l.stderr)
	}
	if _, err := c.Receive(ctx); err != io.EOF {
		t.Errorf("client Receive after the interrupt: %v, want io.EOF", err)
	}
}

// TestFiles: -f sends a file as one message, which knet fragments;
// -chunk as messages of that size, in order.
func TestFiles(t *testing.T) {
	ctx := testContext(t)
	srv := startEcho(t)
	data := make([]byte, 5000)
	rand.Read(data)
	path := filepath.Join(t.TempDir(), "data")
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}

	k := start(ctx, strings.NewReader(""), "-f", path, "-hex", "-n", "1", srv.addr())
	if code := k.wait(t, ctx); code != 0 {
		t.Fatalf("status %d, stderr %q", code, k.stderr)
	}
	ms := srv.take(t, ctx, 1)
	if len(ms) != 1 || !bytes.Equal(ms[0].Payload, data) {
		t.Fatalf("server got %d messages, want the file as one", len(ms))
	}

	k = start(ctx, strings.NewReader(""), "-f", path, "-chunk", "1500", srv.addr())
	if code := k.wait(t, ctx); code != 0 {
		t.Fatalf("status %d, stderr %q", code, k.stderr)
	}
	ms = srv.take(t, ctx, 4)
	var joined []byte
	for _, m := range ms {
		if !m.InOrder || len(m.Payload) > 1500 {
			t.Errorf("chunk of %d bytes, in order %v", len(m.Payload), m.InOrder)
		}
		joined = append(joined, m.Payload...)
	}
	if ms = append(ms, srv.received()...); len(ms) != 4 || !bytes.Equal(joined, data) {
		t.Errorf("server got %d chunks, %d bytes; want 4 making the file", len(ms), len(joined))
	}
}

// TestListenPrints: knetcat listening prints what a knet client sends,
// and ends with status 0 after -n messages.
func TestListenPrints(t *testing.T) {
	ctx := testContext(t)
	k := start(ctx, strings.NewReader(""), "-l", "127.0.0.1:0", "-n", "3")
	c, err := knet.Dial(ctx, "udp", k.listenAddr(t, ctx), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for _, s := range []string{"first", "second", "third"} {
		if err := c.Send(knet.Message{ID: 100, Payload: []byte(s), Reliable: true, InOrder: true}); err != nil {
			t.Fatal(err)
		}
	}
	if code := k.wait(t, ctx); code != 0 {
		t.Fatalf("status %d, stderr %q", code, k.stderr)
	}
	if got, want := k.stdout.String(), "first\nsecond\nthird\n"; got != want {
		t.Errorf("stdout %q, want %q", got, want)
	}
	// knetcat closed gracefully: the client hears it.
	if _, err := c.Receive(ctx); err != io.EOF {
		t.Errorf("client Receive: %v, want io.EOF", err)
	}
}

// TestListenPeersAndInput: with more than one client, each line names its
// peer; input lines go to every client; the end of the input closes them
// all gracefully.
func TestListenPeersAndInput(t *testing.T) {
	ctx := testContext(t)
	stdin, input := io.Pipe()
	defer input.Close()
	k := start(ctx, stdin, "-l", "127.0.0.1:0")
	addr := k.listenAddr(t, ctx)
	dial := func() *knet.Conn {
		c, err := knet.Dial(ctx, "udp", addr, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	send := func(c *knet.Conn, s string) {
		if err := c.Send(knet.Message{ID: 7, Payload: []byte(s), Reliable: true}); err != nil {
			t.Fatal(err)
		}
	}
	a := dial()
	send(a, "a1")
	k.stdout.waitFor(t, ctx, "a1\n") // one client: no prefix
	b := dial()
	send(b, "b1")
	k.stdout.waitFor(t, ctx, b.LocalAddr().String()+": b1\n")
	send(a, "a2")
	k.stdout.waitFor(t, ctx, a.LocalAddr().String()+": a2\n")

	if _, err := io.WriteString(input, "to all\n"); err != nil {
		t.Fatal(err)
	}
	for _, c := range []*knet.Conn{a, b} {
		m, err := c.Receive(ctx)
		if err != nil || string(m.Payload) != "to all" || m.ID != 100 {
			t.Fatalf("client got %+v, %v; want \"to all\"", m, err)
		}
	}
	input.Close()
	if code := k.wait(t, ctx); code != 0 {
		t.Fatalf("status %d, stderr %q", code, k.stderr)
	}
	for _, c := range []*knet.Conn{a, b} {
		if _, err := c.Receive(ctx); err != io.EOF {
			t.Errorf("client Receive after knetcat's end: %v, want io.EOF", err)
		}
	}
}

// TestListenEcho: knetcat -l -echo serves the echo example's client (its
// logic here: numbered messages with a timestamp, reliable and unreliable
// in turn, one at a time), and an interrupt ends it with status 0.
func TestListenEcho(t *testing.T) {
	ctx := testContext(t)
	k := start(ctx, strings.NewReader(""), "-l", "127.0.0.1:0", "-echo")
	c, err := knet.Dial(ctx, "udp", k.listenAddr(t, ctx), &knet.Config{ConnectPayload: []byte("echo client")})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	payload := make([]byte, 64)
	echoed := 0
	for i := range uint32(20) {
		rel := i%2 == 0
		binary.LittleEndian.PutUint32(payload, i)
		binary.LittleEndian.PutUint64(payload[4:], uint64(time.Now().UnixNano()))
		if err := c.Send(knet.Message{ID: 100, Payload: payload, Reliable: rel}); err != nil {
			t.Fatal(err)
		}
		limit := 10 * time.Second
		if !rel {
			limit = 2 * time.Second // an unreliable one may be lost, as the example allows
		}
		wait, cancel := context.WithTimeout(ctx, limit)
		m, err := c.Receive(wait)
		cancel()
		if errors.Is(err, context.DeadlineExceeded) && !rel {
			continue
		}
		if err != nil {
			t.Fatalf("echo %d: %v", i, err)
		}
		if !bytes.Equal(m.Payload, payload) || m.ID != 100 || m.Reliable != rel {
			t.Fatalf("echo %d: %+v, want the message sent", i, m)
		}
		echoed++
	}
	if echoed < 10 {
		t.Errorf("%d echoes, want at least the 10 reliable ones", echoed)
	}
	k.cancel()
	if code := k.wait(t, ctx); code != 0 {
		t.Fatalf("status %d, stderr %q", code, k.stderr)
	}
	if _, err := c.Receive(ctx); err != io.EOF {
		t.Errorf("client Receive after the interrupt: %v, want io.EOF", err)
	}
}

// TestTraceConnect: -trace prints every datagram both ways, decoded.
func TestTraceConnect(t *testing.T) {
	ctx := testContext(t)
	srv := startEcho(t)
	k := start(ctx, strings.NewReader("hello\n"), "-trace", "-id", "321", "-n", "1", srv.addr())
	if code := k.wait(t, ctx); code != 0 {
		t.Fatalf("status %d, stderr %q", code, k.stderr)
	}
	if got := k.stdout.String(); got != "hello\n" {
		t.Errorf("stdout %q, want hello", got)
	}
	errOut := k.stderr.String()
	for _, want := range []string{
		"trace out to " + srv.addr() + ": spec PacketID=0, 1200 bytes: ConnectSyn",
		// A plaintext server's ConnectSynAck is reliable, under a random
		// PacketID (the proof of the client's address is its ack).
		" reliable, 9 bytes: ConnectSynAck",
		"bytes: ConnectAck; PacketAck acks=",
		`reliable, 12 bytes: ID=321 len=5 "hello"`,
		"PacketAck acks=",
		"Disconnect",
	} {
		if !strings.Contains(errOut, want) {
			t.Errorf("stderr lacks %q:\n%s", want, errOut)
		}
	}
}

// TestTraceListen: in listen mode the relay keeps each client's own
// address, for the trace and for the messages printed, and -trace shows a
// reference client's traffic in its dialect.
func TestTraceListen(t *testing.T) {
	ctx := testContext(t)
	k := start(ctx, strings.NewReader(""), "-l", "127.0.0.1:0", "-trace", "-v", "-n", "2")
	addr := k.listenAddr(t, ctx)
	spec, err := knet.Dial(ctx, "udp", addr, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer spec.Close()
	ref, err := knet.Dial(ctx, "udp", addr, &knet.Config{Dialect: knet.DialectReference})
	if err != nil {
		t.Fatal(err)
	}
	defer ref.Close()
	spec.Send(knet.Message{ID: 77, Payload: []byte("x"), Reliable: true})
	ref.Send(knet.Message{ID: 78, Payload: []byte("y"), Reliable: true})
	if code := k.wait(t, ctx); code != 0 {
		t.Fatalf("status %d, stderr %q", code, k.stderr)
	}
	out, errOut := k.stdout.String(), k.stderr.String()
	for _, want := range []string{
		spec.LocalAddr().String() + " id=77 reliable 1 bytes: x\n",
		ref.LocalAddr().String() + " id=78 reliable 1 bytes: y\n",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("stdout lacks %q:\n%s", want, out)
		}
	}
	for _, want := range []string{
		"trace in from " + spec.LocalAddr().String() + ": spec PacketID=",
		`ID=77 len=1 "x"`,
		"trace in from " + ref.LocalAddr().String() + ": reference opening",
		"trace in from " + ref.LocalAddr().String() + ": reference PacketID=",
		`ID=78 len=1 "y" rel=0`,
		"trace out to " + spec.LocalAddr().String() + ": spec PacketID=",
	} {
		if !strings.Contains(errOut, want) {
			t.Errorf("stderr lacks %q:\n%s", want, errOut)
		}
	}
}

// TestErrors: a peer that is not there, a missing file and bad usage.
func TestErrors(t *testing.T) {
	ctx := testContext(t)
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := pc.LocalAddr().String()
	pc.Close()
	k := start(ctx, strings.NewReader("x\n"), dead)
	if code := k.wait(t, ctx); code != 1 {
		t.Errorf("nothing listening: status %d, want 1; stderr %q", code, k.stderr)
	}

	srv := startEcho(t)
	k = start(ctx, strings.NewReader(""), "-f", filepath.Join(t.TempDir(), "missing"), srv.addr())
	if code := k.wait(t, ctx); code != 1 {
		t.Errorf("missing file: status %d, want 1; stderr %q", code, k.stderr)
	}

	for _, args := range [][]string{
		{},
		{"-l", "127.0.0.1:0", "127.0.0.1:1"},
		{"-id", "4", "127.0.0.1:1"},
		{"-dialect", "klingon", "127.0.0.1:1"},
		{"-chunk", "10", "127.0.0.1:1"},
		{"-tcp", "-trace", "127.0.0.1:1"},
		{"-tcp", "-query", "127.0.0.1:1"},
	} {
		k = start(ctx, strings.NewReader(""), args...)
		if code := k.wait(t, ctx); code != 2 {
			t.Errorf("%q: status %d, want 2", args, code)
		}
	}
}

// TestSecure: -genkey makes a key pair, -l -key serves secure sessions
// only, -serverkey connects securely; a client with another key, or none,
// is refused.
func TestSecure(t *testing.T) {
	ctx := testContext(t)
	keyFile := filepath.Join(t.TempDir(), "server.key")
	g := start(ctx, strings.NewReader(""), "-genkey", keyFile)
	if code := g.wait(t, ctx); code != 0 {
		t.Fatalf("-genkey: status %d, stderr %q", code, g.stderr)
	}
	pub := strings.TrimSpace(g.stdout.String())
	if len(pub) != 2*knet.KeySize {
		t.Fatalf("-genkey printed %q, want a public key in hex", pub)
	}
	if fi, err := os.Stat(keyFile); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("key file: %v, %v; want mode 0600", fi, err)
	}

	srv := start(ctx, strings.NewReader(""), "-l", "127.0.0.1:0", "-key", keyFile, "-echo", "-v")
	addr := srv.listenAddr(t, ctx)
	k := start(ctx, strings.NewReader("secret one\nsecret two\n"), "-serverkey", pub, "-inorder", "-n", "2", "-v", addr)
	if code := k.wait(t, ctx); code != 0 {
		t.Fatalf("status %d, stderr %q", code, k.stderr)
	}
	if got, want := k.stdout.String(), addr+" id=100 reliable inorder 10 bytes: secret one\n"+addr+" id=100 reliable inorder 10 bytes: secret two\n"; got != want {
		t.Errorf("stdout %q, want %q", got, want)
	}
	if !strings.Contains(k.stderr.String(), "dialect, secure)") {
		t.Errorf("stderr %q does not report a secure connection", k.stderr)
	}

	_, otherPub, err := knet.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{"-serverkey", hex.EncodeToString(otherPub), addr}, // another server's key
		{addr}, // plaintext
	} {
		k := start(ctx, strings.NewReader("x\n"), append([]string{"-n", "1"}, args...)...)
		if code := k.wait(t, ctx); code != 1 {
			t.Errorf("%v: status %d, want 1; stderr %q", args, code, k.stderr)
		}
		if !strings.Contains(k.stderr.String(), "secure handshake failed") {
			t.Errorf("%v: stderr %q does not say the handshake failed", args, k.stderr)
		}
	}
	srv.cancel()
	if code := srv.wait(t, ctx); code != 0 {
		t.Fatalf("server status %d, stderr %q", code, srv.stderr)
	}
}

// TestQuery: -l with -info answers server queries; -query asks one server
// and -discover an address, each printing the address, the round trip and
// the info.
func TestQuery(t *testing.T) {
	ctx := testContext(t)
	srv := start(ctx, strings.NewReader(""), "-l", "127.0.0.1:0", "-info", "name=den;players=0", "-keep")
	addr := srv.listenAddr(t, ctx)
	for _, flag := range []string{"-query", "-discover"} {
		k := start(ctx, strings.NewReader(""), flag, addr, "-wait", "300ms")
		if code := k.wait(t, ctx); code != 0 {
			t.Fatalf("%s: status %d, stderr %q", flag, code, k.stderr)
		}
		f := strings.Fields(k.stdout.String())
		if len(f) != 3 || f[0] != addr || f[2] != "name=den;players=0" {
			t.Errorf("%s printed %q, want %q, a round trip, %q", flag, k.stdout, addr, "name=den;players=0")
		} else if _, err := time.ParseDuration(f[1]); err != nil {
			t.Errorf("%s: round trip %q: %v", flag, f[1], err)
		}
	}
	srv.cancel()
	if code := srv.wait(t, ctx); code != 0 {
		t.Fatalf("listener: status %d, stderr %q", code, srv.stderr)
	}
}
