// Command chat is a small multi-client chat over kNet: one goroutine
// serves every client through a knet.Group, and each line goes to all of
// them with knet.Broadcast.
//
//	go run ./examples/chat -listen :7001
//	go run ./examples/chat -connect 127.0.0.1:7001 -name alice
//
// The client sends each line of its standard input and prints what the
// others say; end it with Ctrl-D.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"os"
	"slices"

	"github.com/knet-go/knet"
)

const msgLine = 100 // a chat line: reliable, in order

func main() {
	listen := flag.String("listen", "", "serve on this address")
	connect := flag.String("connect", "", "join the server at this address")
	name := flag.String("name", os.Getenv("USER"), "your name in the chat")
	flag.Parse()
	log.SetFlags(0)
	var err error
	switch {
	case *listen != "":
		err = serve(*listen)
	case *connect != "":
		err = client(*connect, *name)
	default:
		flag.Usage()
		os.Exit(2)
	}
	if err != nil {
		log.Fatal(err)
	}
}

func line(s string) knet.Message {
	return knet.Message{ID: msgLine, Payload: []byte(s), Reliable: true, InOrder: true}
}

func serve(addr string) error {
	g := knet.NewGroup()
	l, err := knet.Listen("udp", addr, &knet.Config{
		Group: g,
		// The name comes with the connection attempt; the refusal's text
		// reaches the client.
		AdmitConn: func(c *knet.Conn, name []byte) ([]byte, error) {
			if len(name) == 0 || len(name) > 32 {
				return nil, errors.New("a name of 1 to 32 bytes, please")
			}
			c.SetUserData(string(name))
			return nil, nil
		},
	})
	if err != nil {
		return err
	}
	log.Printf("chat server on %v", l.Addr())
	var conns []*knet.Conn
	// Broadcast never waits: a client too slow to take a line is dropped
	// (StartClose does not wait for the close to end either).
	slow := func(c *knet.Conn, err error) {
		if errors.Is(err, knet.ErrSendBufferFull) {
			c.StartClose("too slow to keep up")
		}
	}
	say := func(s string) { log.Print(s); knet.Broadcast(conns, line(s), slow) }
	events := make([]knet.Event, 64)
	for {
		if err := g.Wait(context.Background()); err != nil {
			return err
		}
		n := g.Poll(events)
		for _, e := range events[:n] {
			name, _ := e.Conn.UserData().(string)
			switch e.Kind {
			case knet.EventConnected:
				conns = append(conns, e.Conn)
				say(fmt.Sprintf("* %s joined (%d here)", name, len(conns)))
			case knet.EventMessage:
				say(fmt.Sprintf("%s: %s", name, e.Message.Payload))
			case knet.EventDisconnected:
				conns = slices.DeleteFunc(conns, func(c *knet.Conn) bool { return c == e.Conn })
				say(fmt.Sprintf("* %s left", name))
			}
		}
	}
}

func client(addr, name string) error {
	ctx := context.Background()
	c, err := knet.Dial(ctx, "udp", addr, &knet.Config{ConnectPayload: []byte(name)})
	var re *knet.RefusedError
	if errors.As(err, &re) {
		return fmt.Errorf("the server refused: %s", re.Reason)
	}
	if err != nil {
		return err
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			m, err := c.Receive(ctx)
			if err != nil {
				return // io.EOF: the server closed; net.ErrClosed: we did
			}
			fmt.Printf("%s\n", m.Payload)
		}
	}()
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		if err := c.Send(line(in.Text())); err != nil {
			break
		}
	}
	select {
	case <-done: // the server ended it
	default:
		c.Close()
		<-done
	}
	var de *knet.DisconnectError
	if errors.As(c.Err(), &de) {
		return fmt.Errorf("the server closed the connection: %s", de.Reason)
	}
	return nil
}
