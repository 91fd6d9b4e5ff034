package knet_test

import (
	"context"
	"fmt"
	"log"
	"slices"
	"strconv"
	"time"

	"github.com/knet-go/knet"
)

// pair returns both ends of a loopback connection, and a function that
// closes them and the listener.
func pair(ctx context.Context) (client, server *knet.Conn, closeAll func()) {
	l, err := knet.Listen("udp", "127.0.0.1:0", nil)
	if err != nil {
		log.Fatal(err)
	}
	c, err := knet.Dial(ctx, "udp", l.Addr().String(), nil)
	if err != nil {
		log.Fatal(err)
	}
	s, err := l.AcceptConn(ctx)
	if err != nil {
		log.Fatal(err)
	}
	return c, s, func() { c.Close(); l.Close() }
}

// Unreliable: sent once, at most once delivered, in any order. For state
// sent every tick anyway, where a lost copy is not worth resending.
func ExampleMessage_unreliable() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, s, closeAll := pair(ctx)
	defer closeAll()

	c.Send(knet.Message{ID: 100, Payload: []byte("aim 12.5 -3")})
	m, err := s.Receive(ctx)
	if err != nil {
		log.Fatal(err) // on a real network it may never come: a game does not wait for it
	}
	fmt.Printf("%s reliable=%v\n", m.Payload, m.Reliable)
	// Output:
	// aim 12.5 -3 reliable=false
}

// Unreliable sequenced: InOrder on a channel, unreliable. A message may be
// lost, but the receiver never gets an older one after a newer one: an
// input stream, each input carrying its tick.
func ExampleMessage_sequenced() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, s, closeAll := pair(ctx)
	defer closeAll()

	for tick := 1; tick <= 20; tick++ {
		c.Send(knet.Message{ID: 100, Payload: []byte(strconv.Itoa(tick)), InOrder: true, Channel: 1})
	}
	// The last one may be lost on a real network; here on loopback it is not.
	var got []int
	for len(got) == 0 || got[len(got)-1] < 20 {
		m, err := s.Receive(ctx)
		if err != nil {
			log.Fatal(err)
		}
		tick, _ := strconv.Atoi(string(m.Payload))
		got = append(got, tick)
	}
	fmt.Println("last input:", got[len(got)-1], "never went back:", slices.IsSorted(got))
	// Output:
	// last input: 20 never went back: true
}

// Latest state: an unreliable message with a ContentID is one version of
// the state (ID, ContentID). A newer version replaces an older one still
// queued at the sender, and the receiver drops a version older than one
// it has: it may skip versions, it never goes back. For snapshots, a
// health bar, a door.
func ExampleMessage_latestState() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, s, closeAll := pair(ctx)
	defer closeAll()

	const healthOfPlayer7 = 7 // the ContentID: which state this is
	for hp := 100; hp >= 50; hp -= 10 {
		c.Send(knet.Message{ID: 101, ContentID: healthOfPlayer7, Payload: []byte(strconv.Itoa(hp))})
	}
	var got []int
	for len(got) == 0 || got[len(got)-1] > 50 {
		m, err := s.Receive(ctx)
		if err != nil {
			log.Fatal(err)
		}
		hp, _ := strconv.Atoi(string(m.Payload))
		got = append(got, hp)
	}
	slices.Reverse(got)
	fmt.Println("health now:", got[0], "never went back:", slices.IsSorted(got))
	// Output:
	// health now: 50 never went back: true
}

// Reliable: delivered exactly once, resent until acked, in whatever
// order they arrive. For independent events: pickups, achievements.
func ExampleMessage_reliable() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, s, closeAll := pair(ctx)
	defer closeAll()

	for _, e := range []string{"picked up key", "achievement: explorer", "picked up coin"} {
		c.Send(knet.Message{ID: 102, Payload: []byte(e), Reliable: true})
	}
	var got []string
	for len(got) < 3 {
		m, err := s.Receive(ctx)
		if err != nil {
			log.Fatal(err)
		}
		got = append(got, string(m.Payload))
	}
	slices.Sort(got) // any order: sort to print
	for _, e := range got {
		fmt.Println(e)
	}
	// Output:
	// achievement: explorer
	// picked up coin
	// picked up key
}

// Reliable ordered: exactly once, in send order within the channel; a
// loss on one channel never holds up another. For command streams and
// inventory changes, one channel per subsystem.
func ExampleMessage_reliableOrdered() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, s, closeAll := pair(ctx)
	defer closeAll()

	const inventory = 4
	for _, e := range []string{"add sword", "equip sword", "drop sword"} {
		c.Send(knet.Message{ID: 103, Payload: []byte(e), Reliable: true, InOrder: true, Channel: inventory})
	}
	for range 3 {
		m, err := s.Receive(ctx)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("%s\n", m.Payload)
	}
	// Output:
	// add sword
	// equip sword
	// drop sword
}
