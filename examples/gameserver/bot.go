package main

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/knet-go/knet"
)

type botKind int

const (
	normalBot   botKind = iota
	spammerBot          // floods the chat: the server kicks it
	idleBot             // stops sending input: the server kicks it
	badTokenBot         // presents a forged join token: the server refuses it
)

// A bot is a client with its own connection and goroutines: one sends
// inputs at the tick rate, one receives.
type bot struct {
	name      string
	kind      botKind
	token     string
	transport knet.Transport // how it dials (UDP unless set)
	used      knet.Transport // what its connection runs over

	id         uint16
	refused    string     // the server's reason, when it refused us
	kickReason string     // the server's reason, when it closed on us
	kickCode   uint32     // and its code (server.go: closeRoundOver...)
	endErr     error      // how the connection ended otherwise
	stats      knet.Stats // its connection's, when the round ended
	sawEnd     bool       // it got the round-over event and left

	inputsSent int
	snaps      int             // snapshots received
	ages       []time.Duration // for each: receive time - the server tick's time
	// The worlds it rebuilt from snapshots, by tick, for the deltas
	// against them; how many it checked against the server's sum, how
	// many were wrong, and how many named a baseline it did not have
	// or did not parse.
	worlds              map[uint32][]entity
	checked, wrong, bad int
	events              int
	chats               int
	// The newest score of each player, and scores that came after a
	// newer one of the same player (reliable latest state: none).
	scores      map[uint16]uint32
	staleScores int
	scoresGot   int
}

// run plays until the server ends the round (a reliable event), kicks the
// bot, or ctx is done.
func (b *bot) run(ctx context.Context, addr string, tick time.Duration, sim *knet.Simulation, epoch time.Time) error {
	cfg := &knet.Config{
		ConnectPayload: []byte(b.token),
		Simulate:       sim,
		ReceiveBuffer:  256 << 10,
	}
	var c *knet.Conn
	var err error
	switch b.transport {
	case knet.TransportTCP:
		c, err = knet.Dial(ctx, "tcp", addr, cfg)
	case knet.TransportWebSocket:
		c, err = knet.DialWebSocket(ctx, addr, cfg) // addr is the server's ws:// URL
	default:
		c, err = knet.Dial(ctx, "udp", addr, cfg)
	}
	var re *knet.RefusedError
	if errors.As(err, &re) {
		b.refused = re.Reason
		return nil
	}
	if err != nil {
		return fmt.Errorf("%s: %w", b.name, err)
	}
	b.used = c.Transport()
	if _, reply := c.Handshake(); len(reply) == 2 {
		b.id = binary.LittleEndian.Uint16(reply)
	}

	roundOver := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() { b.receive(c, epoch, stepFor(tick), roundOver) })

	t := time.NewTicker(tick)
	defer t.Stop()
	var seq uint32
	var buf []byte
loop:
	for {
		select {
		case <-t.C:
		case <-roundOver:
			break loop
		case <-c.Done(): // kicked, or lost
			break loop
		case <-ctx.Done():
			break loop
		}
		seq++
		if b.kind != idleBot || seq < 15 {
			in := input{seq: seq, dx: int8(int(seq/20+uint32(b.id))%3 - 1), dy: int8(int(seq/30+uint32(b.id)*7)%3 - 1)}
			buf = in.append(buf[:0])
			// Unreliable sequenced: never an older input after a newer.
			if c.Send(knet.Message{ID: msgInput, Payload: buf, InOrder: true, Channel: chanInput}) == nil {
				b.inputsSent++
			}
		}
		chat := b.kind == spammerBot && seq > 10 ||
			b.kind == normalBot && (seq+uint32(b.id)*7)%60 == 0 // every 2s
		if chat {
			c.Send(knet.Message{ID: msgChat, Payload: fmt.Appendf(nil, "hello from tick %d", seq), Reliable: true, InOrder: true, Channel: chanChat})
		}
	}
	select {
	case <-roundOver:
		b.sawEnd = true
		b.stats = c.Stats()
	default:
	}
	if c.Err() == nil {
		c.Close()
	}
	wg.Wait()
	var de *knet.DisconnectError
	if errors.As(c.Err(), &de) {
		b.kickReason, b.kickCode = de.Reason, de.Code
	} else if e := c.Err(); e != nil && !errors.Is(e, net.ErrClosed) {
		b.endErr = e
	}
	return nil
}

// receive takes the server's messages until the connection ends.
func (b *bot) receive(c *knet.Conn, epoch time.Time, move int32, roundOver chan struct{}) {
	ended := false
	for {
		m, err := c.Receive(context.Background())
		if err != nil {
			return // io.EOF: the server closed; net.ErrClosed: we did
		}
		switch m.ID {
		case msgSnapshot:
			s, err := parseSnapshot(m.Payload, func(tick uint32) []entity { return b.worlds[tick] }, move)
			if err != nil {
				b.bad++
				continue
			}
			b.checked++
			if worldSum(s.ents) != s.sum {
				b.wrong++
				continue
			}
			if b.worlds == nil {
				b.worlds = make(map[uint32][]entity)
			}
			b.worlds[s.tick] = s.ents
			for t := range b.worlds {
				if d := s.tick - t; d > 2*maxBaseAge && d < 1<<31 {
					delete(b.worlds, t) // older than any baseline the server uses
				}
			}
			// Same process, same clock: the age is how long ago the
			// server's tick began.
			b.ages = append(b.ages, time.Since(epoch)-time.Duration(s.sent))
			b.snaps++
		case msgEvent:
			b.events++
			if len(m.Payload) > 0 && m.Payload[0] == evRoundOver && !ended {
				ended = true
				close(roundOver)
			}
		case msgChat:
			b.chats++
		case msgScore:
			if len(m.Payload) != 6 {
				continue
			}
			id, score := binary.LittleEndian.Uint16(m.Payload), binary.LittleEndian.Uint32(m.Payload[2:])
			if b.scores == nil {
				b.scores = make(map[uint16]uint32)
			}
			if old, ok := b.scores[id]; ok && score <= old {
				b.staleScores++ // never: an older version never follows a newer one
			}
			b.scores[id] = score
			b.scoresGot++
		}
	}
}
