package main

import (
	"bufio"
	"context"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/knet-go/knet"
)

// options are knetcat's flags.
type options struct {
	listen     string
	addr       string
	files      []string
	chunk      int
	id         uint64
	reliable   bool
	unreliable bool
	inOrder    bool
	channel    uint64
	priority   int
	dialect    knet.Dialect
	hex        bool
	verbose    bool
	echo       bool
	keep       bool
	count      int
	stats      bool
	statsEvery time.Duration
	trace      bool
	tcp        bool // connect over TCP; with -l, take TCP too
	// Secure sessions: a file holding the listener's private key, the
	// server's public key for connecting, or a file to write a new
	// private key to (-genkey).
	keyFile   string
	serverKey []byte
	genKey    string
	// Server queries: ask the server (-query) or a broadcast address
	// (-discover, for -wait) for its info instead of connecting; what a
	// listener answers them with (-info).
	query    bool
	discover bool
	wait     time.Duration
	info     string
}

// hexKey is -serverkey: a public key in hex.
type hexKey struct{ b *[]byte }

func (h hexKey) String() string {
	if h.b == nil {
		return ""
	}
	return hex.EncodeToString(*h.b)
}

func (h hexKey) Set(s string) error {
	b, err := hex.DecodeString(strings.TrimSpace(s))
	if err != nil || len(b) != knet.KeySize {
		return fmt.Errorf("want %d bytes in hex (as -genkey prints)", knet.KeySize)
	}
	*h.b = b
	return nil
}

// fileList is a repeatable -f.
type fileList []string

func (f *fileList) String() string     { return strings.Join(*f, ",") }
func (f *fileList) Set(s string) error { *f = append(*f, s); return nil }

// parse reads the flags; flags may come after the address too.
func parse(args []string, stderr io.Writer) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("knetcat", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: knetcat [flags] host:port\n       knetcat -l addr [flags]\n")
		fs.PrintDefaults()
	}
	fs.StringVar(&o.listen, "l", "", "listen on this address instead of connecting")
	fs.Var((*fileList)(&o.files), "f", "send this file as one message instead of reading lines (repeatable; - is standard input)")
	fs.IntVar(&o.chunk, "chunk", 0, "with -f, send each file as messages of at most this many bytes, in order")
	fs.Uint64Var(&o.id, "id", 100, "message ID to send")
	fs.BoolVar(&o.reliable, "reliable", true, "send reliably")
	fs.BoolVar(&o.unreliable, "unreliable", false, "send unreliably")
	fs.BoolVar(&o.inOrder, "inorder", false, "deliver in order within -channel")
	fs.Uint64Var(&o.channel, "channel", 0, "ordering channel, 0..255")
	fs.IntVar(&o.priority, "priority", 0, "send priority, -128..127 (higher leaves first)")
	fs.TextVar(&o.dialect, "dialect", knet.DialectAuto, "wire: auto, spec or reference (the C++ kNet's)")
	fs.BoolVar(&o.hex, "hex", false, "print payloads in hex")
	fs.BoolVar(&o.verbose, "v", false, "prefix messages with peer, ID and flags; report connections")
	fs.BoolVar(&o.echo, "echo", false, "send every message received back to its sender (implies -keep)")
	fs.BoolVar(&o.keep, "keep", false, "at the end of the input, keep receiving until the peer closes or an interrupt")
	fs.IntVar(&o.count, "n", 0, "end after receiving this many messages")
	fs.BoolVar(&o.stats, "stats", false, "print connection statistics at the end")
	fs.DurationVar(&o.statsEvery, "stats-every", 0, "print connection statistics this often too")
	fs.BoolVar(&o.trace, "trace", false, "print every datagram, both ways, decoded")
	fs.BoolVar(&o.tcp, "tcp", false, "connect over TCP (kNet over TCP, as the C++ reference speaks it); with -l, take TCP connections too, on the same port number")
	fs.StringVar(&o.keyFile, "key", "", "with -l, serve secure sessions only, with the private key in this file (hex, as -genkey writes it)")
	fs.Var(hexKey{&o.serverKey}, "serverkey", "connect securely to the server with this public key (hex, as -genkey prints it)")
	fs.StringVar(&o.genKey, "genkey", "", "write a new private key to this file, print its public key, and exit")
	fs.BoolVar(&o.query, "query", false, "ask the server for its info (a server query) instead of connecting; print it with its address and round trip")
	fs.BoolVar(&o.discover, "discover", false, "send a server query to the address (a broadcast address: every server on the LAN at that port) and print each answer")
	fs.DurationVar(&o.wait, "wait", time.Second, "with -discover, how long to wait for answers")
	fs.StringVar(&o.info, "info", "", "with -l, answer server queries with this info")

	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		if fs.NArg() == 0 {
			break
		}
		pos = append(pos, fs.Arg(0))
		args = fs.Args()[1:]
	}
	if o.genKey != "" {
		if len(pos) != 0 || o.listen != "" {
			return nil, usageError(fs, "-genkey takes no address")
		}
		return o, nil
	}
	switch {
	case o.keyFile != "" && o.listen == "":
		return nil, usageError(fs, "-key goes with -l (a client gives the server's public key with -serverkey)")
	case o.serverKey != nil && o.listen != "":
		return nil, usageError(fs, "-serverkey is for connecting (a server gives its private key with -key)")
	case o.listen == "" && len(pos) != 1:
		return nil, usageError(fs, "give one address to connect to, or -l and an address to listen on")
	case o.listen != "" && len(pos) != 0:
		return nil, usageError(fs, "-l takes no other address")
	case o.id < knet.MinMessageID || o.id > knet.MaxMessageID:
		return nil, usageError(fs, fmt.Sprintf("-id %d: message IDs are %d..%d", o.id, knet.MinMessageID, knet.MaxMessageID))
	case o.channel > 255:
		return nil, usageError(fs, "-channel is 0..255")
	case o.priority < -128 || o.priority > 127:
		return nil, usageError(fs, "-priority is -128..127")
	case o.chunk < 0 || o.count < 0 || o.statsEvery < 0:
		return nil, usageError(fs, "-chunk, -n and -stats-every cannot be negative")
	case o.chunk > 0 && len(o.files) == 0:
		return nil, usageError(fs, "-chunk goes with -f")
	case (o.query || o.discover) && o.listen != "":
		return nil, usageError(fs, "-query and -discover ask servers: no -l")
	case o.query && o.discover:
		return nil, usageError(fs, "-query asks one server, -discover any at an address: not both")
	case o.info != "" && o.listen == "":
		return nil, usageError(fs, "-info goes with -l")
	case len(o.info) > knet.MaxQueryInfo:
		return nil, usageError(fs, fmt.Sprintf("-info is at most %d bytes", knet.MaxQueryInfo))
	case o.wait <= 0:
		return nil, usageError(fs, "-wait must be positive")
	case o.tcp && o.trace:
		return nil, usageError(fs, "-trace relays UDP datagrams: not with -tcp")
	case o.tcp && (o.query || o.discover):
		return nil, usageError(fs, "server queries go over UDP: not with -tcp")
	}
	if len(pos) == 1 {
		o.addr = pos[0]
	}
	if o.unreliable {
		o.reliable = false
	}
	if o.echo {
		o.keep = true
	}
	return o, nil
}

func usageError(fs *flag.FlagSet, msg string) error {
	fmt.Fprintf(fs.Output(), "knetcat: %s\n", msg)
	fs.Usage()
	return errors.New(msg)
}

// cat is one run of knetcat: its options and where it writes.
type cat struct {
	o            *options
	outMu, errMu sync.Mutex
	stdout       io.Writer
	stderr       io.Writer
	received     atomic.Int64
	countReached chan struct{}
	countOnce    sync.Once
}

// logf writes a line to standard error.
func (k *cat) logf(format string, args ...any) {
	k.errMu.Lock()
	defer k.errMu.Unlock()
	fmt.Fprintf(k.stderr, "knetcat: "+format+"\n", args...)
}

// print writes a received message to standard output.
func (k *cat) print(peer string, prefixPeer bool, m knet.Message) {
	var b []byte
	switch {
	case k.o.verbose:
		b = fmt.Appendf(b, "%s id=%d", peer, m.ID)
		if m.Reliable {
			b = append(b, " reliable"...)
		} else {
			b = append(b, " unreliable"...)
		}
		if m.InOrder {
			b = append(b, " inorder"...)
		}
		b = fmt.Appendf(b, " %d bytes: ", len(m.Payload))
	case prefixPeer:
		b = append(b, peer...)
		b = append(b, ": "...)
	}
	if k.o.hex {
		b = hex.AppendEncode(b, m.Payload)
	} else {
		b = append(b, m.Payload...)
	}
	b = append(b, '\n')
	k.outMu.Lock()
	k.stdout.Write(b)
	k.outMu.Unlock()
}

// got counts a received message against -n.
func (k *cat) got() {
	if n := k.received.Add(1); k.o.count > 0 && n >= int64(k.o.count) {
		k.countOnce.Do(func() { close(k.countReached) })
	}
}

// endsAtEOF reports whether the end of the input ends the run.
func (k *cat) endsAtEOF() bool { return !k.o.keep && k.o.count == 0 }

func (k *cat) printStats(peer string, c *knet.Conn) {
	st := c.Stats()
	k.logf("stats %s: rtt %v (min %v), datagrams %d sent / %d received, bytes %d sent / %d received, "+
		"messages %d sent / %d received, %d retransmits, %d invalid, %d duplicate, %d dropped datagrams, %d dropped messages, %d send errors",
		peer, st.RTT.Round(time.Microsecond), st.MinRTT.Round(time.Microsecond), st.DatagramsSent, st.DatagramsReceived,
		st.BytesSent, st.BytesReceived, st.MessagesSent, st.MessagesReceived, st.Retransmits, st.InvalidDatagrams,
		st.DuplicateDatagrams, st.DroppedDatagrams, st.DroppedMessages, st.SendErrors)
}

// run is knetcat: it parses args, runs until the end and returns the exit
// status. Cancelling ctx is an interrupt: a graceful end.
func run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	o, err := parse(args, stderr)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	k := &cat{o: o, stdout: stdout, stderr: stderr, countReached: make(chan struct{})}
	if o.genKey != "" {
		return k.generateKey()
	}
	if o.listen != "" {
		return k.serve(ctx, stdin)
	}
	if o.query || o.discover {
		return k.queryServers(ctx)
	}
	return k.connect(ctx, stdin)
}

// queryServers is -query and -discover: it prints each answer as the
// server's address, the round trip and the info (in hex with -hex).
func (k *cat) queryServers(ctx context.Context) int {
	show := func(from string, info []byte, rtt time.Duration) {
		b := fmt.Appendf(nil, "%s %v ", from, rtt.Round(time.Microsecond))
		if k.o.hex {
			b = hex.AppendEncode(b, info)
		} else {
			b = append(b, info...)
		}
		k.outMu.Lock()
		k.stdout.Write(append(b, '\n'))
		k.outMu.Unlock()
	}
	if k.o.query {
		info, rtt, err := knet.Query(ctx, "udp", k.o.addr)
		if err != nil {
			k.logf("query %s: %v", k.o.addr, err)
			return 1
		}
		show(k.o.addr, info, rtt)
		return 0
	}
	ctx, cancel := context.WithTimeout(ctx, k.o.wait)
	defer cancel()
	n := 0
	err := knet.Discover(ctx, "udp", k.o.addr, func(from netip.AddrPort, info []byte, rtt time.Duration) {
		n++
		show(from.String(), info, rtt)
	})
	if err != nil {
		k.logf("discover %s: %v", k.o.addr, err)
		return 1
	}
	if k.o.verbose {
		k.logf("%d servers answered within %v", n, k.o.wait)
	}
	return 0
}

// feed sends the input: the -f files, or standard input line by line.
func (k *cat) feed(ctx context.Context, stdin io.Reader, send func(knet.Message) error) error {
	o := k.o
	base := knet.Message{ID: uint32(o.id), Reliable: o.reliable, InOrder: o.inOrder,
		Channel: uint8(o.channel), Priority: int8(o.priority)}
	if len(o.files) == 0 {
		r := bufio.NewReaderSize(stdin, 64<<10)
		for {
			line, err := r.ReadBytes('\n')
			if len(line) > 0 {
				m := base
				m.Payload = line[:len(line)-1]
				if line[len(line)-1] != '\n' {
					m.Payload = line
				}
				if err := send(m); err != nil {
					return err
				}
			}
			if err == io.EOF {
				return nil
			}
			if err != nil {
				return err
			}
		}
	}
	for _, path := range o.files {
		var f io.Reader = stdin
		if path != "-" {
			file, err := os.Open(path)
			if err != nil {
				return err
			}
			defer file.Close()
			f = file
		}
		if o.chunk == 0 {
			data, err := io.ReadAll(f)
			if err != nil {
				return err
			}
			m := base
			m.Payload = data
			if err := send(m); err != nil {
				if errors.Is(err, knet.ErrMessageTooLarge) {
					return fmt.Errorf("%s: %w (send it with -chunk)", path, err)
				}
				return fmt.Errorf("%s: %w", path, err)
			}
			continue
		}
		buf := make([]byte, o.chunk)
		for first := true; ; first = false {
			n, err := io.ReadFull(f, buf)
			if n > 0 || first && err == io.EOF {
				m := base
				m.InOrder = true // a stream of chunks is only a file in order
				m.Payload = buf[:n]
				if err := send(m); err != nil {
					return fmt.Errorf("%s: %w", path, err)
				}
			}
			if err == io.EOF || err == io.ErrUnexpectedEOF {
				break
			}
			if err != nil {
				return err
			}
		}
	}
	return ctx.Err()
}

// connect runs knetcat as a client.
func (k *cat) connect(ctx context.Context, stdin io.Reader) int {
	o := k.o
	cfg := &knet.Config{Dialect: o.dialect, ServerKey: o.serverKey}
	addr := o.addr
	var rl *relay
	if o.trace {
		target, err := net.ResolveUDPAddr("udp", o.addr)
		if err != nil {
			k.logf("%v", err)
			return 1
		}
		rl, err = newRelay("127.0.0.1:0", target, true, o.dialect, k.logf)
		if err != nil {
			k.logf("trace relay: %v", err)
			return 1
		}
		defer rl.Close()
		addr = rl.Addr().String()
	}
	network := "udp"
	if o.tcp {
		network = "tcp"
	}
	c, err := knet.Dial(ctx, network, addr, cfg)
	if err != nil {
		if ctx.Err() != nil {
			return 0
		}
		k.logf("connecting to %s: %v", o.addr, err)
		return 1
	}
	peer := o.addr
	if rl == nil {
		peer = c.RemoteAddr().String()
	}
	if o.verbose {
		k.logf("connected to %s (%v dialect%s%s)", peer, c.Dialect(), tcpNote(c), secureNote(c))
	}

	recvDone := make(chan error, 1)
	go func() {
		for {
			m, err := c.Receive(context.Background()) // Close ends it
			if err != nil {
				recvDone <- err
				return
			}
			k.print(peer, false, m)
			if o.echo {
				if err := c.SendContext(ctx, m); err != nil {
					recvDone <- err
					return
				}
			}
			k.got()
		}
	}()
	inputDone := make(chan error, 1)
	go func() { inputDone <- k.feed(ctx, stdin, func(m knet.Message) error { return c.SendContext(ctx, m) }) }()
	stopStats := k.statsEvery(func() { k.printStats(peer, c) })

	code := 0
	var recvErr error
loop:
	for {
		select {
		case err := <-inputDone:
			inputDone = nil
			if err != nil && ctx.Err() == nil && c.Err() == nil {
				k.logf("%v", err)
				code = 1
				break loop
			}
			if k.endsAtEOF() {
				break loop
			}
		case recvErr = <-recvDone:
			recvDone = nil
			if recvErr == io.EOF {
				if o.verbose {
					k.logf("%s closed the connection", peer)
				}
			} else {
				k.logf("%s: %v", peer, recvErr)
				code = 1
			}
			break loop
		case <-k.countReached:
			break loop
		case <-ctx.Done():
			break loop
		}
	}
	err = c.Close()
	stopStats()
	if recvDone != nil {
		<-recvDone
	}
	if err != nil && code == 0 {
		k.logf("%s: %v", peer, err)
		code = 1
	}
	if o.stats {
		k.printStats(peer, c)
	}
	return code
}

// statsEvery calls f every -stats-every until the returned function is
// called.
func (k *cat) statsEvery(f func()) (stop func()) {
	if k.o.statsEvery <= 0 {
		return func() {}
	}
	done := make(chan struct{})
	ended := make(chan struct{})
	go func() {
		defer close(ended)
		t := time.NewTicker(k.o.statsEvery)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				f()
			case <-done:
				return
			}
		}
	}()
	return func() {
		close(done)
		<-ended
	}
}

// server is knetcat's listen mode: its clients.
type server struct {
	*cat
	rl     *relay
	mu     sync.Mutex
	conns  map[*knet.Conn]string // by connection, its peer's name
	ever   int                   // clients connected so far
	first  chan struct{}         // closed when the first client connects
	failed atomic.Bool           // a connection ended in error
	wg     sync.WaitGroup
}

// name is how a connection's peer is shown: its address, or through the
// trace relay the client's own address.
func (s *server) name(c *knet.Conn) string {
	if s.rl != nil {
		if a, ok := s.rl.ClientOf(c.RemoteAddr()); ok {
			return a.String()
		}
	}
	return c.RemoteAddr().String()
}

// serve runs knetcat as a server.
func (k *cat) serve(ctx context.Context, stdin io.Reader) int {
	o := k.o
	s := &server{cat: k, conns: map[*knet.Conn]string{}, first: make(chan struct{})}
	addr := o.listen
	if o.trace {
		addr = "127.0.0.1:0"
	}
	cfg := &knet.Config{Dialect: o.dialect, TCP: o.tcp}
	if o.keyFile != "" {
		key, err := readKey(o.keyFile)
		if err != nil {
			k.logf("-key: %v", err)
			return 1
		}
		cfg.PrivateKey = key
		if o.dialect == knet.DialectAuto {
			cfg.Dialect = knet.DialectSpec // the reference dialect has no secure mode
		}
	}
	l, err := knet.Listen("udp", addr, cfg)
	if err != nil {
		k.logf("%v", err)
		return 1
	}
	if o.info != "" {
		l.SetQueryInfo([]byte(o.info)) // its length is checked already
	}
	shown := l.Addr()
	if o.trace {
		s.rl, err = newRelay(o.listen, l.Addr().(*net.UDPAddr), false, o.dialect, k.logf)
		if err != nil {
			l.Close()
			k.logf("trace relay: %v", err)
			return 1
		}
		defer s.rl.Close() // after the listener's close: the Disconnects pass through it
		shown = s.rl.Addr()
	}
	k.logf("listening on %v", shown)

	acceptDone := make(chan struct{})
	go func() {
		defer close(acceptDone)
		for {
			c, err := l.AcceptConn(context.Background()) // Close ends it
			if err != nil {
				return
			}
			s.add(c)
		}
	}()
	inputDone := make(chan error, 1)
	go func() {
		select {
		case <-s.first:
		case <-ctx.Done():
			inputDone <- nil
			return
		}
		inputDone <- k.feed(ctx, stdin, s.broadcast)
	}()
	stopStats := k.statsEvery(func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		for c, name := range s.conns {
			k.printStats(name, c)
		}
	})

	code := 0
loop:
	for {
		select {
		case err := <-inputDone:
			inputDone = nil
			if err != nil && ctx.Err() == nil {
				k.logf("%v", err)
				code = 1
				break loop
			}
			if k.endsAtEOF() {
				break loop
			}
		case <-k.countReached:
			break loop
		case <-ctx.Done():
			break loop
		}
	}
	stopStats()
	l.Close() // closes every connection gracefully
	<-acceptDone
	s.wg.Wait()
	if s.failed.Load() {
		code = 1
	}
	return code
}

// add takes a new client.
func (s *server) add(c *knet.Conn) {
	name := s.name(c)
	s.mu.Lock()
	s.conns[c] = name
	s.ever++
	if s.ever == 1 {
		close(s.first)
	}
	s.mu.Unlock()
	if s.o.verbose {
		s.logf("%s connected (%v dialect%s%s)", name, c.Dialect(), tcpNote(c), secureNote(c))
	}
	s.wg.Go(func() { s.handle(c, name) })
}

// handle receives from one client until it or the listener closes.
func (s *server) handle(c *knet.Conn, name string) {
	var rerr error
	for {
		m, err := c.Receive(context.Background()) // the Listener's Close ends it
		if err != nil {
			rerr = err
			break
		}
		s.mu.Lock()
		multi := s.ever > 1
		s.mu.Unlock()
		s.print(name, multi, m)
		if s.o.echo {
			c.Send(m) // fails only once the connection ends, which Receive reports
		}
		s.got()
	}
	s.mu.Lock()
	delete(s.conns, c)
	s.mu.Unlock()
	err := c.Close()
	switch {
	case err != nil:
		s.logf("%s: %v", name, err)
		s.failed.Store(true)
	case rerr == io.EOF && s.o.verbose:
		s.logf("%s closed the connection", name)
	}
	if s.o.stats {
		s.printStats(name, c)
	}
}

// broadcast sends m to every client connected now.
func (s *server) broadcast(m knet.Message) error {
	s.mu.Lock()
	conns := make([]*knet.Conn, 0, len(s.conns))
	for c := range s.conns {
		conns = append(conns, c)
	}
	s.mu.Unlock()
	if len(conns) == 0 && s.o.verbose {
		s.logf("no client connected: a message of %s bytes not sent", strconv.Itoa(len(m.Payload)))
	}
	for _, c := range conns {
		// A client that is going away fails; its handler reports why.
		if err := c.Send(m); errors.Is(err, knet.ErrMessageTooLarge) || errors.Is(err, knet.ErrReservedID) {
			return err
		}
	}
	return nil
}

// generateKey is -genkey: a new key pair, the private key written to the
// file (hex, readable by its owner only), the public key printed.
func (k *cat) generateKey() int {
	priv, pub, err := knet.GenerateKey()
	if err == nil {
		err = os.WriteFile(k.o.genKey, []byte(hex.EncodeToString(priv)+"\n"), 0o600)
	}
	if err != nil {
		k.logf("-genkey: %v", err)
		return 1
	}
	fmt.Fprintln(k.stdout, hex.EncodeToString(pub))
	return 0
}

// readKey reads a private key written by -genkey.
func readKey(path string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	key, err := hex.DecodeString(strings.TrimSpace(string(b)))
	if err != nil || len(key) != knet.KeySize {
		return nil, fmt.Errorf("%s: want %d bytes in hex (as -genkey writes)", path, knet.KeySize)
	}
	return key, nil
}

// secureNote is what -v adds about a secure connection.
func secureNote(c *knet.Conn) string {
	if c.Secure() {
		return ", secure"
	}
	return ""
}

// tcpNote says ", over tcp" for a connection over a stream.
func tcpNote(c *knet.Conn) string {
	if tr := c.Transport(); tr != knet.TransportUDP {
		return ", over " + tr.String()
	}
	return ""
}
