// Command quickstart is the README's quick start: an echo server and a
// client in one program, on loopback.
package main

import (
	"context"
	"fmt"
	"log"

	"github.com/knet-go/knet"
)

func main() {
	ctx := context.Background()

	// Server: echo every message.
	l, err := knet.Listen("udp", "127.0.0.1:0", nil) // a real server: ":7000"
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.AcceptConn(ctx)
			if err != nil {
				return // the listener closed
			}
			go func() {
				defer c.Close()
				for {
					m, err := c.Receive(ctx) // io.EOF once the peer closed
					if err != nil {
						return
					}
					c.Send(m)
				}
			}()
		}
	}()

	// Client.
	c, err := knet.Dial(ctx, "udp", l.Addr().String(), nil)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close() // delivers what was sent, then disconnects
	c.Send(knet.Message{ID: 100, Payload: []byte("hello"), Reliable: true})
	m, err := c.Receive(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%s\n", m.Payload)
}
