package knet

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/net/nettest"
)

func TestStreamOverNetConn(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		l := nw.listen(t, testConfig())
		go func() {
			nc, err := l.Accept()
			if err != nil {
				return
			}
			io.Copy(nc, nc) // echo the byte stream
			nc.Close()
		}()
		c := nw.dial(t, l.Addr().String(), testConfig())

		// Lines through bufio.
		w := bufio.NewWriter(c)
		rd := bufio.NewReader(c)
		for i := range 100 {
			fmt.Fprintf(w, "line %d %s\n", i, bytes.Repeat([]byte("x"), i))
		}
		require.NoError(t, w.Flush())
		for i := range 100 {
			line, err := rd.ReadString('\n')
			require.NoError(t, err)
			assert.Equal(t, fmt.Sprintf("line %d %s\n", i, bytes.Repeat([]byte("x"), i)), line)
		}

		// A large random blob through io.Copy both ways.
		blob := make([]byte, 3<<20)
		rng := rand.New(rand.NewPCG(3, 3))
		for i := range blob {
			blob[i] = byte(rng.Uint32())
		}
		go func() {
			_, err := io.Copy(c, bytes.NewReader(blob))
			assert.NoError(t, err)
		}()
		h := sha256.New()
		_, err := io.CopyN(h, rd, int64(len(blob)))
		require.NoError(t, err)
		want := sha256.Sum256(blob)
		assert.Equal(t, want[:], h.Sum(nil))
	})
}

func TestReadWriteDeadlines(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		// The server never reads and its buffer is small: it stops acking, so
		// the client's send buffer fills.
		l := nw.listen(t, &Config{ReceiveBuffer: 16 << 10, DisconnectTimeout: 500 * time.Millisecond})
		c := nw.dial(t, l.Addr().String(), &Config{SendBuffer: 64 << 10, DisconnectTimeout: 500 * time.Millisecond})
		// Nobody reads on the server: the send buffer fills and Write blocks
		// until its deadline.
		start := time.Now()
		c.SetWriteDeadline(start.Add(300 * time.Millisecond))
		var err error
		for i := 0; err == nil && i < 100000; i++ {
			_, err = c.Write(make([]byte, 1000))
		}
		var ne net.Error
		require.ErrorAs(t, err, &ne)
		assert.True(t, ne.Timeout())
		assert.ErrorIs(t, err, os.ErrDeadlineExceeded)
		assert.Equal(t, 300*time.Millisecond, time.Since(start), "at the deadline, on the bubble's clock")

		start = time.Now()
		c.SetReadDeadline(start.Add(50 * time.Millisecond))
		_, err = c.Read(make([]byte, 10))
		require.ErrorAs(t, err, &ne)
		assert.True(t, ne.Timeout())
		assert.Equal(t, 50*time.Millisecond, time.Since(start))
		_, err = c.Receive(context.Background())
		assert.ErrorIs(t, err, os.ErrDeadlineExceeded)

		// Unreliable messages are dropped, not blocked on, when the buffer
		// is full, and Send says so.
		c.SetWriteDeadline(time.Time{})
		before := c.Stats().DroppedMessages
		require.ErrorIs(t, c.Send(Message{ID: 6, Payload: make([]byte, 2000)}), ErrSendBufferFull)
		assert.Equal(t, before+1, c.Stats().DroppedMessages)
	})
}

// A deadline set while a Read or a Write is already waiting applies to it,
// as net.Conn requires of pending I/O.
func TestDeadlineSetWhileWaiting(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		c, _ := rawServer(t, nw, &Config{SendBuffer: 16 << 10, DisconnectTimeout: 200 * time.Millisecond})

		readErr := make(chan error, 1)
		go func() { _, err := c.Read(make([]byte, 10)); readErr <- err }()
		synctest.Wait() // the Read waits, with no deadline
		require.Empty(t, readErr, "a Read with nothing to read returned")
		start := time.Now()
		c.SetReadDeadline(start.Add(30 * time.Millisecond))
		assert.ErrorIs(t, <-readErr, os.ErrDeadlineExceeded)
		assert.Equal(t, 30*time.Millisecond, time.Since(start), "ended at the deadline set")

		// Nothing is ever acked: Write ends up waiting for room.
		writeErr := make(chan error, 1)
		go func() {
			var err error
			for err == nil {
				_, err = c.Write(make([]byte, 1000))
			}
			writeErr <- err
		}()
		synctest.Wait() // the Write waits for room
		require.Empty(t, writeErr, "a Write with no room returned")
		start = time.Now()
		c.SetWriteDeadline(start.Add(30 * time.Millisecond))
		assert.ErrorIs(t, <-writeErr, os.ErrDeadlineExceeded)
		assert.Equal(t, 30*time.Millisecond, time.Since(start), "ended at the deadline set")
		assert.NoError(t, c.Err(), "a deadline does not end the connection")
	})
}

func TestNetConnContract(t *testing.T) {
	nettest.TestConn(t, func() (c1, c2 net.Conn, stop func(), err error) {
		cfg := &Config{DisconnectTimeout: 500 * time.Millisecond, SendBuffer: 256 << 10, ReceiveBuffer: 256 << 10}
		l, err := sysNet().Listen(cfg)
		if err != nil {
			return nil, nil, nil, err
		}
		accepted := make(chan net.Conn, 1)
		go func() {
			c, err := l.Accept()
			if err == nil {
				accepted <- c
			}
			close(accepted)
		}()
		d, err := sysNet().Dial(context.Background(), l.Addr().String(), cfg)
		if err != nil {
			l.Close()
			return nil, nil, nil, err
		}
		// A server connection is accepted once the client speaks.
		d.Send(Message{ID: 6, Reliable: true})
		s := <-accepted
		if _, err := s.(*Conn).Receive(context.Background()); err != nil {
			return nil, nil, nil, err
		}
		stop = func() {
			var wg sync.WaitGroup
			wg.Go(func() { d.Close() })
			wg.Go(func() { s.Close() })
			wg.Wait()
			l.Close()
		}
		return d, s, stop, nil
	})
}
