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
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/net/nettest"
)

func TestStreamOverNetConn(t *testing.T) {
	l := listen(t, testConfig())
	go func() {
		nc, err := l.Accept()
		if err != nil {
			return
		}
		io.Copy(nc, nc) // echo the byte stream
		nc.Close()
	}()
	c := dial(t, l.Addr().String(), testConfig())

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
}

func TestReadWriteDeadlines(t *testing.T) {
	// The server never reads and its buffer is small: it stops acking, so
	// the client's send buffer fills.
	l := listen(t, &Config{ReceiveBuffer: 16 << 10, DisconnectTimeout: 500 * time.Millisecond})
	c := dial(t, l.Addr().String(), &Config{SendBuffer: 64 << 10, DisconnectTimeout: 500 * time.Millisecond})
	// Nobody reads on the server: the send buffer fills and Write blocks
	// until its deadline.
	c.SetWriteDeadline(time.Now().Add(300 * time.Millisecond))
	var err error
	for i := 0; err == nil && i < 100000; i++ {
		_, err = c.Write(make([]byte, 1000))
	}
	var ne net.Error
	require.ErrorAs(t, err, &ne)
	assert.True(t, ne.Timeout())
	assert.ErrorIs(t, err, os.ErrDeadlineExceeded)

	c.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	_, err = c.Read(make([]byte, 10))
	require.ErrorAs(t, err, &ne)
	assert.True(t, ne.Timeout())
	_, err = c.Receive(context.Background())
	assert.ErrorIs(t, err, os.ErrDeadlineExceeded)

	// Unreliable messages are dropped, not blocked on, when the buffer is full.
	c.SetWriteDeadline(time.Time{})
	before := c.Stats().DroppedMessages
	require.NoError(t, c.Send(Message{ID: 6, Payload: make([]byte, 2000)}))
	assert.Equal(t, before+1, c.Stats().DroppedMessages)
}

// A deadline set while a Read or a Write is already waiting applies to it,
// as net.Conn requires of pending I/O.
func TestDeadlineSetWhileWaiting(t *testing.T) {
	c, _ := rawServer(t, &Config{SendBuffer: 16 << 10, DisconnectTimeout: 200 * time.Millisecond})

	readErr := make(chan error, 1)
	go func() { _, err := c.Read(make([]byte, 10)); readErr <- err }()
	waitParked(t, "(*Conn).Read") // waiting, with no deadline
	c.SetReadDeadline(time.Now().Add(30 * time.Millisecond))
	select {
	case err := <-readErr:
		assert.ErrorIs(t, err, os.ErrDeadlineExceeded)
	case <-time.After(10 * time.Second):
		t.Fatal("a deadline set during Read did not end it")
	}

	// Nothing is ever acked: Write ends up waiting for room.
	writeErr := make(chan error, 1)
	go func() {
		var err error
		for err == nil {
			_, err = c.Write(make([]byte, 1000))
		}
		writeErr <- err
	}()
	waitParked(t, "(*Conn).Write")
	c.SetWriteDeadline(time.Now().Add(30 * time.Millisecond))
	select {
	case err := <-writeErr:
		assert.ErrorIs(t, err, os.ErrDeadlineExceeded)
	case <-time.After(10 * time.Second):
		t.Fatal("a deadline set during Write did not end it")
	}
	assert.NoError(t, c.Err(), "a deadline does not end the connection")
}

func TestNetConnContract(t *testing.T) {
	nettest.TestConn(t, func() (c1, c2 net.Conn, stop func(), err error) {
		cfg := &Config{DisconnectTimeout: 500 * time.Millisecond, SendBuffer: 256 << 10, ReceiveBuffer: 256 << 10}
		l, err := Listen("udp", "127.0.0.1:0", cfg)
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
		d, err := Dial(context.Background(), "udp", l.Addr().String(), cfg)
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
