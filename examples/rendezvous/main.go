// Command rendezvous shows a player hosting a game behind a NAT: an
// introducer, a host and a joiner, which find each other by an ID the
// game chooses and connect directly (knet's hole punching), or through
// the introducer's relay when no direct path is found.
//
//	go run ./examples/rendezvous                                 # all three, in one process, on loopback
//	go run ./examples/rendezvous -introducer 0.0.0.0:7000         # a public server
//	go run ./examples/rendezvous -host game-1 -via 198.51.100.7:7000
//	go run ./examples/rendezvous -join game-1 -via 198.51.100.7:7000
//
// The introducer is any knet Listener that serves introductions; it also
// reflects addresses, as every knet Listener does, and here relays. The host registers its
// Listener under the ID from the Listener's own socket, so the introducer
// sees the address its NAT maps the Listener to; when a joiner asks for
// the ID, both learn the other's addresses and a start time, and at that
// time the host's Listener probes the joiner (opening its NAT toward it)
// while the joiner probes the host and dials the first address that
// answers. The connection is an ordinary knet connection, accepted by the
// host's Listener; the joiner sends a greeting and the host answers.
//
// Behind a symmetric NAT facing a port-restricted cone, no probe of the
// above gets through; with -reflector (a second address that the
// introducer also listens on, which tells each side whether its NAT is
// symmetric) the two connect directly by birthday probing: the symmetric
// side opens 256 mappings and the other probes random ports. Behind two
// symmetric NATs, or without -reflector, the joiner connects through the
// introducer's relay (ServeRelay), which forwards the connection's
// datagrams as they are, and both go on probing; a secure connection moves
// to a direct path in place when one opens. Each side prints its route.
// Without a relay (-relay=false) the joiner fails with knet.ErrNoDirectPath.
//
// The joiner ends with a line naming the route: "route: direct" or
// "route: relayed" and the host's address as it sees it, or "route:
// none" and why; the host, whose joiner never connected, says so after
// -punchwait and exits with status 1 too.
//
// The three processes behind real NATs on one machine (as root: network
// namespaces, iproute2 and nftables), the host behind a symmetric NAT
// and the joiner behind a port-restricted cone:
//
//	sudo go test -run TestNATExample -v ./examples/rendezvous
//
// builds the NATs with internal/nattest and runs this program three
// times, with "ip netns exec", in the public network and in each private
// one (nat_linux_test.go).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"time"

	"github.com/knet-go/knet"
)

func main() {
	introducer := flag.String("introducer", "", "run only the introducer, on this address")
	host := flag.String("host", "", "run only a host, registered under this ID")
	join := flag.String("join", "", "run only a joiner, of the host under this ID")
	via := flag.String("via", "", "the introducer's address, for -host and -join")
	wait := flag.Duration("wait", time.Minute, "how long the host waits for a joiner and the joiner for the host")
	relay := flag.Bool("relay", true, "the introducer relays when no direct path is found")
	reflector := flag.String("reflector", "", "a second knet server's address: the introducer listens there too; a host and a joiner ask it whether their NAT maps each destination to a port of its own (symmetric), for birthday probing")
	flag.DurationVar(&punchWait, "punchwait", punchWait, "how long the host waits for its joiner's connection once it punched")
	flag.Parse()
	log.SetFlags(0)
	ctx, cancel := context.WithTimeout(context.Background(), *wait)
	defer cancel()
	var err error
	switch {
	case *introducer != "":
		var l *knet.Listener
		if l, err = serveIntroducer(*introducer, *relay); err == nil && *reflector != "" {
			// Any knet Listener reflects: this one is only that.
			_, err = knet.Listen("udp", *reflector, nil)
		}
		if err == nil {
			log.Printf("introducer on %v", l.Addr())
			select {} // until killed
		}
	case *host != "":
		err = runHost(ctx, *via, *host, introOptions(*reflector), log.Printf)
	case *join != "":
		err = runJoiner(ctx, *via, *join, introOptions(*reflector), log.Printf)
	default:
		err = runAll(ctx, log.Printf)
	}
	if err != nil {
		log.Fatal(err)
	}
}

// introOptions is the host's and joiner's options: with a second
// reflector, each learns whether its NAT is symmetric, and a symmetric
// NAT facing a port-restricted cone connects by birthday probing.
func introOptions(reflector string) *knet.IntroOptions {
	if reflector == "" {
		return nil
	}
	return &knet.IntroOptions{Reflector: reflector}
}

// punchWait is how long a host waits for its joiner's connection once
// its Punch is over: the joiner's probing and handshake are done well
// within it when there is a path.
var punchWait = 10 * time.Second

// errNoJoiner is the host's error when its joiner did not connect.
var errNoJoiner = errors.New("the joiner did not connect after punching (no direct path between the two NATs?)")

// serveIntroducer listens at addr and serves introductions, and relays
// if relay.
func serveIntroducer(addr string, relay bool) (*knet.Listener, error) {
	l, err := knet.Listen("udp", addr, nil)
	if err != nil {
		return nil, err
	}
	l.ServeIntroductions()
	if relay {
		// The defaults: 256 allocations, 256 KiB/s each, 16 MiB/s in all.
		l.ServeRelay(knet.RelayConfig{})
	}
	return l, nil
}

// runHost hosts one game under id: it registers, punches toward the first
// joiner, accepts its connection and answers its greeting.
func runHost(ctx context.Context, via, id string, o *knet.IntroOptions, logf func(string, ...any)) error {
	l, err := knet.Listen("udp", ":0", nil)
	if err != nil {
		return err
	}
	defer l.Close()
	logf("host: listening on %v, registering %q with %s", l.Addr(), id, via)
	in, err := l.HostWith(ctx, via, id, o)
	if err != nil {
		return err
	}
	logf("host: a joiner at %v; punching", in.Peer)
	accepted := make(chan *knet.Conn, 1)
	acceptErr := make(chan error, 1)
	go func() {
		c, err := l.AcceptConn(ctx)
		if err != nil {
			acceptErr <- err
			return
		}
		accepted <- c
	}()
	if err := l.Punch(ctx, in); err != nil {
		return err
	}
	var c *knet.Conn
	select {
	case c = <-accepted:
	case err := <-acceptErr:
		return err
	case <-time.After(punchWait):
		return fmt.Errorf("host: %w", errNoJoiner)
	}
	defer c.Close()
	m, err := c.Receive(ctx)
	if err != nil {
		return err
	}
	logf("host: %v says %q (%v)", c.RemoteAddr(), m.Payload, c.Route())
	if err := c.Send(knet.Message{ID: 100, Payload: []byte("welcome to " + id), Reliable: true}); err != nil {
		return err
	}
	// Until the joiner has the answer and leaves.
	for {
		if _, err := c.Receive(ctx); err != nil {
			return nil
		}
	}
}

// runJoiner joins the game under id and greets its host.
func runJoiner(ctx context.Context, via, id string, o *knet.IntroOptions, logf func(string, ...any)) error {
	pc, err := net.ListenUDP("udp", nil)
	if err != nil {
		return err
	}
	logf("joiner: asking %s for %q", via, id)
	in, err := knet.JoinWith(ctx, pc, via, id, o)
	if err != nil {
		pc.Close()
		return err
	}
	logf("joiner: the host at %v; punching", in.Peer)
	start := time.Now()
	c, err := knet.DialCandidates(ctx, pc, in, nil)
	if err != nil {
		if errors.Is(err, knet.ErrNoDirectPath) {
			logf("joiner: route: none: no probe got through either NAT (knet.ErrNoDirectPath)")
		}
		return err
	}
	defer c.Close()
	logf("joiner: route: %s to %v in %v", c.Route(), c.RemoteAddr(), time.Since(start).Round(time.Millisecond))
	if err := c.Send(knet.Message{ID: 100, Payload: []byte("hello from the joiner"), Reliable: true}); err != nil {
		return err
	}
	m, err := c.Receive(ctx)
	if err != nil {
		return err
	}
	logf("joiner: the host says %q", m.Payload)
	return c.Close()
}

// runAll runs the three on loopback.
func runAll(ctx context.Context, logf func(string, ...any)) error {
	intro, err := serveIntroducer("127.0.0.1:0", true)
	if err != nil {
		return err
	}
	defer intro.Close()
	via := intro.Addr().String()
	hosted := make(chan error, 1)
	go func() { hosted <- runHost(ctx, via, "game-1", nil, logf) }()
	if err := runJoiner(ctx, via, "game-1", nil, logf); err != nil {
		return fmt.Errorf("joiner: %w", err)
	}
	if err := <-hosted; err != nil {
		return fmt.Errorf("host: %w", err)
	}
	return nil
}
