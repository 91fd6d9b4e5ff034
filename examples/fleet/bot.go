package main

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	"github.com/knet-go/knet"
)

// A bot is a player: it asks the backend for a token, connects to the
// server the token names first, and plays (a reliable message every
// interval, numbered, which the server echoes) until the round ends,
// when it closes its connection. When its server drains, it goes back to
// the backend for a new token and moves, numbering on. It keeps no
// record of what it sent: the drain delivers what its Send accepted
// before the bot learned of it, and the servers count what arrived.

type bot struct {
	id      int
	servers []int         // the servers it played on, in order
	moves   int           // times it moved after a drain
	offline time.Duration // without a server: from the news of a drain to the next connection
	sent    uint32        // messages its Send accepted, numbered 0, 1, 2...
	// unacked counts what its connections left unacknowledged as they
	// ended (Conn.Unacknowledged): none, when every end was a drain or
	// its own close.
	unacked  int
	dialErrs int
	err      error
}

// play runs the bot until play is done, then closes its connection
// (which delivers what is in flight) and leaves. A bot whose server
// drained moves on even if the round ended meanwhile: it connects to its
// next server, then leaves at once.
func (b *bot) play(play context.Context, mm *matchmaker, serverKey []byte, every time.Duration, sim *knet.Simulation) {
	var lostAt time.Time
	for play.Err() == nil || !lostAt.IsZero() {
		tok, err := mm.token(b.id)
		if err != nil {
			b.err = err
			break
		}
		dial, stop := play, context.CancelFunc(func() {})
		if play.Err() != nil {
			dial, stop = context.WithTimeout(context.Background(), 10*time.Second)
		}
		c, err := knet.Dial(dial, "udp", "", &knet.Config{ServerKey: serverKey, Token: tok, DisconnectTimeout: 3 * time.Second, Simulate: sim})
		stop()
		if err != nil {
			b.dialErrs++
			if play.Err() != nil && !lostAt.IsZero() {
				b.err = fmt.Errorf("moving after the round: %w", err)
				break
			}
			continue
		}
		if !lostAt.IsZero() {
			b.offline += time.Since(lostAt)
			lostAt = time.Time{}
		}
		b.servers = append(b.servers, mm.serverAt(c.RemoteAddr().String()))
		drained, at := b.connected(play, c, every)
		b.unacked += len(c.Unacknowledged())
		if !drained {
			break
		}
		b.moves++
		lostAt = at
	}
}

// connected plays on c until the round ends or the server drains; it
// reports whether the server drained, and when the bot heard of it.
func (b *bot) connected(play context.Context, c *knet.Conn, every time.Duration) (drained bool, at time.Time) {
	gone := make(chan struct{})
	go func() {
		// The server's echoes, until io.EOF: the server closed.
		defer close(gone)
		for {
			if _, err := c.Receive(context.Background()); err != nil {
				return
			}
		}
	}()
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			if c.Send(seqMessage(b.sent)) == nil {
				b.sent++
			}
		case <-gone:
			// The server closed: Send fails from now on, and the
			// connection ends once what Send accepted is delivered.
			at = time.Now()
			<-c.Done()
			var de *knet.DisconnectError
			if errors.As(c.Err(), &de) && de.Code == closeDrain {
				return true, at
			}
			if play.Err() == nil {
				b.err = c.Err()
			}
			return false, at
		case <-play.Done():
			// The round is over: what is in flight is delivered, then
			// the Disconnect goes.
			if err := c.Close(); err != nil {
				b.err = err
			}
			return false, time.Time{}
		}
	}
}

// seqMessage is a bot's message number seq (the server knows the bot
// by its token).
func seqMessage(seq uint32) knet.Message {
	return knet.Message{ID: msgPlay, Payload: binary.LittleEndian.AppendUint32(nil, seq), Reliable: true, InOrder: true}
}
