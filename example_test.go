package knet_test

import (
	"context"
	"crypto/rand"
	"fmt"
	"log"
	"net"
	"net/netip"
	"time"

	"github.com/knet-go/knet"
)

// Messages can depend on any earlier messages, not just on the previous one
// of a channel: here the entities wait for the level they live in, the start
// signal waits for both entities, and the chat line waits for nothing.
func ExampleConn_SendRef() {
	l, err := knet.Listen("udp", "127.0.0.1:0", nil)
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()
	done := make(chan struct{})
	go func() {
		defer close(done)
		c, err := l.AcceptConn(context.Background())
		if err != nil {
			return
		}
		for range 5 {
			m, err := c.Receive(context.Background())
			if err != nil {
				return
			}
			fmt.Printf("%s\n", m.Payload)
		}
	}()

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := knet.Dial(ctx, "udp", l.Addr().String(), nil)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	level, _ := c.SendRef(knet.Message{ID: 10, Payload: []byte("load level 3"), Reliable: true})
	a, _ := c.SendRef(knet.Message{ID: 11, Payload: []byte("spawn door"), Reliable: true, DependsOn: []knet.Ref{level}})
	b, _ := c.SendRef(knet.Message{ID: 11, Payload: []byte("spawn guard"), Reliable: true, DependsOn: []knet.Ref{level}})
	c.Send(knet.Message{ID: 12, Payload: []byte("start"), Reliable: true, DependsOn: []knet.Ref{a, b}})
	c.Send(knet.Message{ID: 13, Payload: []byte("chat: hi"), Reliable: true})
	<-done
	// Output:
	// load level 3
	// spawn door
	// spawn guard
	// start
	// chat: hi
}

// Ordering channels: each InOrder channel is delivered in send order, and a
// loss on one never holds up another.
func ExampleMessage_channels() {
	l, err := knet.Listen("udp", "127.0.0.1:0", nil)
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()
	done := make(chan struct{})
	go func() {
		defer close(done)
		c, err := l.AcceptConn(context.Background())
		if err != nil {
			return
		}
		moves := 0
		for moves < 3 {
			m, err := c.Receive(context.Background())
			if err != nil {
				return
			}
			if m.ID == 20 {
				moves++
				fmt.Printf("move %s\n", m.Payload)
			}
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := knet.Dial(ctx, "udp", l.Addr().String(), nil)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	for _, step := range []string{"1", "2", "3"} {
		// Moves on channel 1, reliable and in order.
		c.Send(knet.Message{ID: 20, Payload: []byte(step), Reliable: true, InOrder: true, Channel: 1})
		// Position updates on channel 2: unreliable, sequenced.
		c.Send(knet.Message{ID: 21, Payload: []byte("pos"), InOrder: true, Channel: 2})
	}
	<-done
	// Output:
	// move 1
	// move 2
	// move 3
}

// Testing a game under a bad network, without one: each side's Simulate
// shapes what it sends. Here the client's uplink loses one datagram in five,
// in bursts, with 30ms of latency and jitter; the server's downlink is slow
// and reorders. Reliable messages still arrive, each once; an unreliable
// position update may not. A failing run replays with the same seeds.
func ExampleSimulation() {
	server := &knet.Config{Simulate: &knet.Simulation{
		Delay: 40 * time.Millisecond, Reorder: 0.1, Seed: 1,
	}}
	l, err := knet.Listen("udp", "127.0.0.1:0", server)
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()
	got := make(chan int)
	go func() {
		c, err := l.AcceptConn(context.Background())
		if err != nil {
			return
		}
		n := 0
		for n < 100 {
			m, err := c.Receive(context.Background())
			if err != nil {
				break
			}
			if m.Reliable {
				n++
			}
		}
		got <- n
	}()

	client := &knet.Config{Simulate: &knet.Simulation{
		Loss: 0.2, BurstLen: 3, Delay: 30 * time.Millisecond, Jitter: 10 * time.Millisecond, Seed: 2,
	}}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := knet.Dial(ctx, "udp", l.Addr().String(), client)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	for i := range 100 {
		c.Send(knet.Message{ID: 20, Payload: []byte(fmt.Sprint("order ", i)), Reliable: true})
		c.Send(knet.Message{ID: 21, Payload: []byte("position")}) // may be lost
	}
	fmt.Println("reliable messages received:", <-got)
	// Output:
	// reliable messages received: 100
}

// A backend that shares tokenKey with its game servers issues a client a
// connect token; the game server admits only clients holding one, and
// learns from it who they are.
func ExampleIssueToken() {
	priv, pub, err := knet.GenerateKey()
	if err != nil {
		log.Fatal(err)
	}
	tokenKey := make([]byte, knet.TokenKeySize)
	rand.Read(tokenKey)

	// The game server.
	l, err := knet.Listen("udp", "127.0.0.1:0", &knet.Config{
		PrivateKey: priv,
		TokenKey:   tokenKey,
		AdmitConn: func(c *knet.Conn, _ []byte) ([]byte, error) {
			t := c.Token()
			fmt.Printf("player %d (%s) joins\n", t.ClientID, t.UserData)
			return nil, nil
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()
	server := netip.MustParseAddrPort(l.Addr().String())

	// The backend, once the player logged in.
	token, err := knet.IssueToken(tokenKey, knet.Token{
		ClientID: 42,
		UserData: []byte("team=red"),
		Expires:  time.Now().Add(30 * time.Second),
		Servers:  []netip.AddrPort{server},
	})
	if err != nil {
		log.Fatal(err)
	}

	// The player.
	c, err := knet.Dial(context.Background(), "udp", server.String(), &knet.Config{ServerKey: pub, Token: token})
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	fmt.Println("secure:", c.Secure())
	// Output:
	// player 42 (team=red) joins
	// secure: true
}

// A stateless UDP load balancer in front of a fleet of secure servers,
// each with its own Config.ServerID of two bytes, routes a client's
// datagrams by the server ID their connection ID starts with; what
// carries none (a ConnectSyn) it routes by the client's address.
func ExampleServerIDFromDatagram() {
	priv, pub, err := knet.GenerateKey()
	if err != nil {
		log.Fatal(err)
	}
	l, err := knet.Listen("udp", "127.0.0.1:0", &knet.Config{PrivateKey: priv, ServerID: []byte{0x00, 0x07}})
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			if _, err := l.Accept(); err != nil {
				return // closed: l.Close closed its connections
			}
		}
	}()

	// The balancer's socket, relaying one client to the server.
	lb, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		log.Fatal(err)
	}
	defer lb.Close()
	routed := make(chan uint32, 1)
	go func() {
		buf := make([]byte, 2048)
		n, client, err := lb.ReadFromUDPAddrPort(buf) // the ConnectSyn
		if err != nil {
			return
		}
		_, ok := knet.ServerIDFromDatagram(buf[:n], 2)
		fmt.Println("ConnectSyn routable:", ok)
		up, err := net.DialUDP("udp", nil, l.Addr().(*net.UDPAddr))
		if err != nil {
			return
		}
		defer up.Close()
		go func() { // the server's answers, back to the client
			b := make([]byte, 2048)
			for {
				n, err := up.Read(b)
				if err != nil {
					return
				}
				lb.WriteToUDPAddrPort(b[:n], client)
			}
		}()
		up.Write(buf[:n])
		for {
			n, _, err := lb.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			if id, ok := knet.ServerIDFromDatagram(buf[:n], 2); ok {
				select {
				case routed <- id:
				default:
				}
			}
			up.Write(buf[:n])
		}
	}()

	c, err := knet.Dial(context.Background(), "udp", lb.LocalAddr().String(), &knet.Config{ServerKey: pub})
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	fmt.Printf("server ID %#04x\n", <-routed)
	// Output:
	// ConnectSyn routable: false
	// server ID 0x0007
}
