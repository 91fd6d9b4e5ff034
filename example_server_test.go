package knet_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"time"

	"github.com/knet-go/knet"
)

// A game loop serves every connection from one goroutine: the Listener
// hands its connections to a Group, and Poll returns, without blocking,
// each arrival, each message and each end. A real loop calls Poll once a
// tick; this one waits for news with Wait.
func ExampleGroup() {
	g := knet.NewGroup()
	l, err := knet.Listen("udp", "127.0.0.1:0", &knet.Config{Group: g})
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	c, err := knet.Dial(ctx, "udp", l.Addr().String(), nil)
	if err != nil {
		log.Fatal(err)
	}
	c.Send(knet.Message{ID: 100, Payload: []byte("hello"), Reliable: true, InOrder: true})
	c.Send(knet.Message{ID: 100, Payload: []byte("bye"), Reliable: true, InOrder: true})
	c.Close() // delivers both, then disconnects

	events := make([]knet.Event, 16)
	for done := false; !done; {
		if err := g.Wait(ctx); err != nil {
			log.Fatal(err)
		}
		n := g.Poll(events)
		for _, e := range events[:n] {
			switch e.Kind {
			case knet.EventConnected:
				fmt.Println("connected")
			case knet.EventMessage:
				// The payload is good until the next Poll: copy what you keep.
				fmt.Printf("message %d: %s\n", e.Message.ID, e.Message.Payload)
			case knet.EventDisconnected:
				fmt.Println("disconnected, the peer closed:", errors.Is(e.Err, knet.ErrPeerClosed))
				done = true
			}
		}
	}
	// Output:
	// connected
	// message 100: hello
	// message 100: bye
	// disconnected, the peer closed: true
}

// Broadcast sends one message to many connections without ever waiting:
// a connection that cannot take it (its send buffer full, or ended) is
// reported to the miss function instead, and the others get it.
func ExampleBroadcast() {
	g := knet.NewGroup()
	l, err := knet.Listen("udp", "127.0.0.1:0", &knet.Config{Group: g})
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	var clients []*knet.Conn
	for range 3 {
		c, err := knet.Dial(ctx, "udp", l.Addr().String(), nil)
		if err != nil {
			log.Fatal(err)
		}
		defer c.Close()
		clients = append(clients, c)
	}
	clients[2].Close() // one leaves

	// The server's side: three joined, one left.
	var conns []*knet.Conn
	events := make([]knet.Event, 16)
	for left := false; !left || len(conns) < 3; {
		if err := g.Wait(ctx); err != nil {
			log.Fatal(err)
		}
		for _, e := range events[:g.Poll(events)] {
			switch e.Kind {
			case knet.EventConnected:
				conns = append(conns, e.Conn)
			case knet.EventDisconnected:
				left = true
			}
		}
	}
	n := knet.Broadcast(conns, knet.Message{ID: 100, Payload: []byte("round starts"), Reliable: true},
		func(c *knet.Conn, err error) {
			fmt.Println("missed one, it has left:", errors.Is(err, knet.ErrPeerClosed))
		})
	fmt.Println("sent to", n)
	for i, c := range clients[:2] {
		m, err := c.Receive(ctx)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("client %d: %s\n", i+1, m.Payload)
	}
	// Output:
	// missed one, it has left: true
	// sent to 2
	// client 1: round starts
	// client 2: round starts
}

// AdmitConn checks a join token while the connection is being made: a
// refusal's text reaches the client as a *RefusedError, and the player an
// admitted connection is rides on it as its user data.
func ExampleConfig_admitConn() {
	type player struct{ name string }
	tokens := map[string]string{"s3cret": "alice"} // from the lobby
	g := knet.NewGroup()
	l, err := knet.Listen("udp", "127.0.0.1:0", &knet.Config{
		Group: g,
		AdmitConn: func(c *knet.Conn, token []byte) ([]byte, error) {
			name, ok := tokens[string(token)]
			if !ok {
				return nil, errors.New("bad join token")
			}
			c.SetUserData(&player{name: name})
			return []byte("welcome, " + name), nil // the ConnectSynAck's content
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	_, err = knet.Dial(ctx, "udp", l.Addr().String(), &knet.Config{ConnectPayload: []byte("guess")})
	var re *knet.RefusedError
	if errors.As(err, &re) {
		fmt.Println("refused:", re.Reason, errors.Is(err, knet.ErrRefused))
	}

	c, err := knet.Dial(ctx, "udp", l.Addr().String(), &knet.Config{ConnectPayload: []byte("s3cret")})
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	_, reply := c.Handshake()
	fmt.Printf("client: %s\n", reply)

	events := make([]knet.Event, 4)
	if err := g.Wait(ctx); err != nil {
		log.Fatal(err)
	}
	for _, e := range events[:g.Poll(events)] {
		if e.Kind == knet.EventConnected {
			fmt.Println("server: connected", e.Conn.UserData().(*player).name)
		}
	}
	// Output:
	// refused: bad join token true
	// client: welcome, alice
	// server: connected alice
}

// A kick tells the client why: CloseWithReason's text ends its connection
// as a *DisconnectError. Close waits for the peer's answer, so a game loop
// runs it on its own goroutine.
func ExampleConn_CloseWithReason() {
	g := knet.NewGroup()
	l, err := knet.Listen("udp", "127.0.0.1:0", &knet.Config{Group: g})
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := knet.Dial(ctx, "udp", l.Addr().String(), nil)
	if err != nil {
		log.Fatal(err)
	}

	events := make([]knet.Event, 4)
	if err := g.Wait(ctx); err != nil {
		log.Fatal(err)
	}
	for _, e := range events[:g.Poll(events)] {
		if e.Kind == knet.EventConnected {
			e.Conn.StartClose("kicked: idle for 60s") // returns at once
		}
	}

	select {
	case <-c.Done():
	case <-ctx.Done():
		log.Fatal("not kicked")
	}
	var de *knet.DisconnectError
	if errors.As(c.Err(), &de) {
		fmt.Println("server said:", de.Reason)
	}
	fmt.Println("closed by the peer:", errors.Is(c.Err(), knet.ErrPeerClosed))
	// Output:
	// server said: kicked: idle for 60s
	// closed by the peer: true
}

// A server browser asks a server for its name, map and player count
// without connecting: the Listener answers with what its application set,
// and Query returns that and the round trip.
func ExampleQuery() {
	l, err := knet.Listen("udp", "127.0.0.1:0", nil)
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()
	// Settable at any time: say, from the tick loop as players join.
	if err := l.SetQueryInfo([]byte("name=Frag Fest;map=e1m1;players=12/16")); err != nil {
		log.Fatal(err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	info, rtt, err := knet.Query(ctx, "udp", l.Addr().String())
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%s (answered within a second: %v)\n", info, rtt < time.Second)
	fmt.Println("connections:", l.Stats().Connections)
	// Output:
	// name=Frag Fest;map=e1m1;players=12/16 (answered within a second: true)
	// connections: 0
}
