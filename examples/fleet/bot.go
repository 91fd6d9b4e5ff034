package main

import (
	"context"
	"encoding/binary"
	"errors"
	"slices"
	"time"

	"github.com/knet-go/knet"
)

// A bot is a player: it asks the backend for a token, connects to the
// server the token names first, and plays (a reliable message every
// interval, which the server echoes) until the round ends. When its
// server drains, it goes back to the backend for a new token and moves;
// the messages the old server never echoed it sends again there.

type bot struct {
	id       int
	servers  []int         // the servers it played on, in order
	moves    int           // times it moved after a drain
	offline  time.Duration // without a server, between a drain and the next connection
	sent     int           // messages sent, the resent ones not counted again
	resent   int           // sent again on another server after a move
	lost     int           // never echoed by the end
	dialErrs int
	err      error
}

// play runs the bot until play is done, then waits (within settle) for
// the last echoes and leaves.
func (b *bot) play(play, settle context.Context, mm *matchmaker, serverKey []byte, every time.Duration) {
	pending := map[uint32]bool{} // sent, not yet echoed
	var next uint32
	var lostAt time.Time
	for play.Err() == nil || len(pending) > 0 && settle.Err() == nil {
		tok, err := mm.token(b.id)
		if err != nil {
			b.err = err
			break
		}
		ctx := play
		if play.Err() != nil {
			ctx = settle
		}
		c, err := knet.Dial(ctx, "udp", "", &knet.Config{ServerKey: serverKey, Token: tok, DisconnectTimeout: 3 * time.Second})
		if err != nil {
			b.dialErrs++
			if ctx.Err() != nil {
				break
			}
			continue
		}
		if !lostAt.IsZero() {
			b.offline += time.Since(lostAt)
			lostAt = time.Time{}
		}
		b.servers = append(b.servers, mm.serverAt(c.RemoteAddr().String()))
		// What the last server never echoed goes again, in order.
		var again []uint32
		for seq := range pending {
			again = append(again, seq)
		}
		slices.Sort(again)
		for _, seq := range again {
			if c.Send(seqMessage(seq)) == nil {
				b.resent++
			}
		}
		drained := b.connected(play, settle, c, pending, &next, every)
		if drained {
			b.moves++
			lostAt = time.Now()
			continue
		}
		break
	}
	b.lost = len(pending)
}

// connected plays on c; it reports whether the server drained.
func (b *bot) connected(play, settle context.Context, c *knet.Conn, pending map[uint32]bool, next *uint32, every time.Duration) (drained bool) {
	echoes := make(chan uint32, 64)
	go func() {
		defer close(echoes)
		for {
			m, err := c.Receive(context.Background())
			if err != nil {
				return
			}
			if len(m.Payload) == 4 {
				echoes <- binary.LittleEndian.Uint32(m.Payload)
			}
		}
	}()
	t := time.NewTicker(every)
	defer t.Stop()
	playing := play.Done()
	for {
		select {
		case <-t.C:
			if c.Send(seqMessage(*next)) == nil {
				pending[*next] = true
				*next++
				b.sent++
			}
		case seq, ok := <-echoes:
			if !ok {
				<-c.Done()
				var de *knet.DisconnectError
				if errors.As(c.Err(), &de) && de.Reason == drainReason {
					return true
				}
				if play.Err() == nil {
					b.err = c.Err()
				}
				return false
			}
			delete(pending, seq)
			if playing == nil && len(pending) == 0 {
				c.Close()
				return false
			}
		case <-playing:
			// The round is over: no more messages; wait for the echoes.
			playing = nil
			t.Stop()
			if len(pending) == 0 {
				c.Close()
				return false
			}
		case <-settle.Done():
			c.Close()
			return false
		}
	}
}

func seqMessage(seq uint32) knet.Message {
	return knet.Message{ID: msgPlay, Payload: binary.LittleEndian.AppendUint32(nil, seq), Reliable: true, InOrder: true}
}
