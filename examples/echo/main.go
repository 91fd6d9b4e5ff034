// Command echo runs a kNet echo server and client.
//
//	go run ./examples/echo                       # both, in one process, on loopback
//	go run ./examples/echo -listen 127.0.0.1:7000
//	go run ./examples/echo -connect 127.0.0.1:7000
//	go run ./examples/echo -loss 0.05 -delay 20ms    # over a simulated bad network
//	go run ./examples/echo -dialect reference        # the client speaks the C++ kNet's wire
//	go run ./examples/echo -tcp                      # the client runs over TCP
//	go run ./examples/echo -connect 127.0.0.1:7000 -tcp
//
// The server serves both dialects, the specification's and the C++
// reference implementation's, telling them apart by each client's first
// datagram; -dialect chooses what the client speaks, so it reaches a
// reference server too. It takes kNet over TCP as well, on the same port
// number (Config.TCP), for clients without UDP; -tcp makes the client one
// of those. Over TCP the client's default dialect reaches both a knet
// server and the reference's TCP echo server: its hello is a PingReply no
// ping asked for, which the reference drops, and the server's first frame
// then tells it which it reached.
//
// The client sends numbered messages, reliable and unreliable in turn, and
// measures the round trip of each echo; it prints progress twice a second
// and a summary with the connection's statistics at the end.
package main

import (
	"context"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"os"
	"slices"
	"time"

	"github.com/knet-go/knet"
)

func main() {
	listen := flag.String("listen", "", "run only the server, on this address")
	connect := flag.String("connect", "", "run only the client, against this address")
	duration := flag.Duration("duration", 3*time.Second, "how long the client runs")
	size := flag.Int("size", 64, "payload size in bytes (at least 12)")
	dialect := knet.DialectSpec
	flag.TextVar(&dialect, "dialect", knet.DialectSpec, "the client's wire: spec or reference (the C++ kNet's)")
	overTCP := flag.Bool("tcp", false, "run the client over TCP (kNet over TCP, the C++ reference's framing) instead of UDP. It implies no dialect: "+
		"by default the client says knet's hello, which a reference server drops (the client then speaks to it as one); -dialect reference sends none. "+
		"The server always takes TCP too, on the same port number")
	var sim knet.Simulation
	flag.Float64Var(&sim.Loss, "loss", 0, "simulate this datagram loss (0..1) on everything sent")
	flag.DurationVar(&sim.Delay, "delay", 0, "simulate this one-way delay on everything sent")
	flag.DurationVar(&sim.Jitter, "jitter", 0, "add up to this much random delay")
	flag.Float64Var(&sim.Reorder, "reorder", 0, "simulate this probability of reordering")
	flag.Float64Var(&sim.Duplicate, "dup", 0, "simulate this probability of duplication")
	flag.Parse()
	log.SetFlags(0)
	if sim != (knet.Simulation{}) {
		cfg.Simulate = &sim
		log.Printf("simulating loss %.0f%%, delay %v±%v, reorder %.0f%%, duplicates %.0f%% on each side's sends",
			100*sim.Loss, sim.Delay, sim.Jitter, 100*sim.Reorder, 100*sim.Duplicate)
		if *overTCP {
			log.Printf("(the simulation is of UDP datagrams: the client's TCP connection does not go through it)")
		}
	}

	// The server takes TCP too. TCP is a Listener's field, which Dial
	// refuses: the client's copy of cfg leaves it out.
	lcfg := *cfg
	lcfg.TCP = true
	network := "udp"
	if *overTCP {
		network = "tcp"
	}

	switch {
	case *listen != "":
		l, err := knet.Listen("udp", *listen, &lcfg)
		if err != nil {
			log.Fatal(err)
		}
		log.Printf("echo server on %v (UDP, and TCP on the same port)", l.Addr())
		serve(l)
	case *connect != "":
		if err := client(network, *connect, *duration, *size, dialect); err != nil {
			log.Fatal(err)
		}
	default:
		l, err := knet.Listen("udp", "127.0.0.1:0", &lcfg)
		if err != nil {
			log.Fatal(err)
		}
		log.Printf("echo server on %v (UDP, and TCP on the same port)", l.Addr())
		done := make(chan struct{})
		go func() {
			serve(l)
			close(done)
		}()
		err = client(network, l.Addr().String(), *duration, *size, dialect)
		l.Close()
		<-done
		if err != nil {
			log.Fatal(err)
		}
	}
}

// serve echoes every message on every connection until the listener closes.
func serve(l *knet.Listener) {
	for {
		c, err := l.AcceptConn(context.Background())
		if err != nil {
			return
		}
		log.Printf("server: %v connected over %v (%v dialect)", c.RemoteAddr(), c.Transport(), c.Dialect())
		go func() {
			defer c.Close()
			for {
				m, err := c.Receive(context.Background())
				if err != nil {
					if err != io.EOF && !errors.Is(err, net.ErrClosed) {
						log.Printf("server: %v: %v", c.RemoteAddr(), err)
					}
					return
				}
				// An unreliable echo with no room in the send
				// buffer is dropped, as the network may drop it.
				if err := c.Send(m); err != nil && !errors.Is(err, knet.ErrSendBufferFull) {
					return
				}
			}
		}()
	}
}

const msgID = 100

// cfg is what server and client share (each takes a copy with its own
// fields added); the simulation flags fill it in.
var cfg = &knet.Config{}

// client sends numbered messages for d over network ("udp" or "tcp") and
// reports the echoes' round trips.
func client(network, addr string, d time.Duration, size int, dialect knet.Dialect) error {
	size = max(size, 12)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ccfg := *cfg
	ccfg.Dialect = dialect
	if network == "udp" {
		// Not sent in the reference dialect: its wire has no handshake
		// payload. Over TCP a client with a ConnectPayload insists on a
		// knet server, so this one sends none: it reaches the
		// reference's too.
		ccfg.ConnectPayload = []byte("echo client")
	}
	c, err := knet.Dial(ctx, network, addr, &ccfg)
	if err != nil {
		return err
	}
	defer c.Close()
	log.Printf("client: connected to %v over %v (%v dialect)", c.RemoteAddr(), c.Transport(), c.Dialect())

	start := time.Now()
	var rtts []time.Duration
	var reliable, unreliable, lost int
	next := start.Add(500 * time.Millisecond)
	payload := make([]byte, size)
	for i := uint32(0); time.Since(start) < d; i++ {
		rel := i%2 == 0
		binary.LittleEndian.PutUint32(payload, i)
		binary.LittleEndian.PutUint64(payload[4:], uint64(time.Now().UnixNano()))
		if err := c.Send(knet.Message{ID: msgID, Payload: payload, Reliable: rel}); err != nil && !errors.Is(err, knet.ErrSendBufferFull) {
			return err // an unreliable one dropped counts as lost below
		}
		// One message in flight at a time: wait for its echo. An
		// unreliable one may be lost; give up on it after a while. A
		// reliable one comes, resent if need be, and so does one too
		// large for a datagram, which travels reliably.
		limit := 10 * time.Second
		if !rel && size <= 1200 {
			limit = max(200*time.Millisecond, 4*c.Stats().RTT)
		}
		wait, cancel := context.WithTimeout(context.Background(), limit)
		m, err := c.Receive(wait)
		cancel()
		switch {
		case errors.Is(err, context.DeadlineExceeded) && !rel:
			lost++
			continue
		case err != nil:
			return fmt.Errorf("waiting for echo %d: %w (connection %+v)", i, err, c.Stats())
		}
		sent := time.Unix(0, int64(binary.LittleEndian.Uint64(m.Payload[4:])))
		rtts = append(rtts, time.Since(sent))
		if binary.LittleEndian.Uint32(m.Payload)%2 == 0 {
			// Sent reliable (an echo over TCP reads as unreliable
			// whatever it was sent as).
			reliable++
		} else {
			unreliable++
		}
		if now := time.Now(); now.After(next) {
			next = now.Add(500 * time.Millisecond)
			log.Printf("client: %6d round trips, last %v, connection RTT %v", len(rtts), rtts[len(rtts)-1].Round(time.Microsecond), c.Stats().RTT.Round(time.Microsecond))
		}
	}
	elapsed := time.Since(start)
	st := c.Stats()
	slices.Sort(rtts)
	q := func(p float64) time.Duration {
		if len(rtts) == 0 {
			return 0
		}
		return rtts[min(len(rtts)-1, int(p*float64(len(rtts))))].Round(time.Microsecond)
	}
	fmt.Fprintf(os.Stdout, "\n%d round trips in %v (%.0f/s): %d reliable, %d unreliable, %d unreliable lost\n",
		len(rtts), elapsed.Round(time.Millisecond), float64(len(rtts))/elapsed.Seconds(), reliable, unreliable, lost)
	fmt.Fprintf(os.Stdout, "round trip: p50 %v, p99 %v, max %v\n", q(0.50), q(0.99), q(1))
	fmt.Fprintf(os.Stdout, "connection: RTT %v (min %v), %d datagrams sent / %d received, %d bytes sent / %d received,\n"+
		"            %d messages sent / %d received, %d retransmits, %d invalid datagrams\n",
		st.RTT.Round(time.Microsecond), st.MinRTT.Round(time.Microsecond), st.DatagramsSent, st.DatagramsReceived,
		st.BytesSent, st.BytesReceived, st.MessagesSent, st.MessagesReceived, st.Retransmits, st.InvalidDatagrams)
	if len(rtts) == 0 {
		return errors.New("no echo came back")
	}
	return nil
}
