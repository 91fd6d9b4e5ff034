package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/knet-go/knet"
)

// The echo example's client over TCP against a stand-in for the C++
// reference's TCP echo server: no handshake, PingRequest 1 at once, every
// PingRequest answered, an unsolicited PingReply (knet's hello) dropped,
// every other frame echoed, and the client's FIN answered with its own.
// Its frame codec is its own, from testdata/reference/tcp/README.md.

// refVLE appends v as VLE-1.7/1.7/16.
func refVLE(b []byte, v uint32) []byte {
	switch {
	case v < 1<<7:
		return append(b, byte(v))
	case v < 1<<14:
		return append(b, 0x80|byte(v&0x7f), byte(v>>7))
	}
	b = append(b, 0x80|byte(v&0x7f), 0x80|byte(v>>7&0x7f))
	return binary.LittleEndian.AppendUint16(b, uint16(v>>14))
}

// refReadVLE reads a VLE-1.7/1.7/16.
func refReadVLE(r *bufio.Reader) (uint32, int, error) {
	b0, err := r.ReadByte()
	if err != nil || b0 < 0x80 {
		return uint32(b0), 1, err
	}
	b1, err := r.ReadByte()
	if err != nil {
		return 0, 0, io.ErrUnexpectedEOF
	}
	if b1 < 0x80 {
		return uint32(b0&0x7f) | uint32(b1)<<7, 2, nil
	}
	var hi [2]byte
	if _, err := io.ReadFull(r, hi[:]); err != nil {
		return 0, 0, io.ErrUnexpectedEOF
	}
	return uint32(b0&0x7f) | uint32(b1&0x7f)<<7 | uint32(binary.LittleEndian.Uint16(hi[:]))<<14, 4, nil
}

func refFrame(id uint32, payload []byte) []byte {
	idField := refVLE(nil, id)
	b := refVLE(nil, uint32(len(idField)+len(payload)))
	return append(append(b, idField...), payload...)
}

// refEchoServer serves one connection as the reference's TCP echo server
// does; it reports what it saw when the client's FIN came.
type refEchoServer struct {
	echoed, swallowed, pings int
	err                      error
}

func serveRefEcho(nc *net.TCPConn) (s refEchoServer) {
	var wmu sync.Mutex
	write := func(b []byte) {
		wmu.Lock()
		defer wmu.Unlock()
		nc.Write(b)
	}
	write(refFrame(1, []byte{1})) // its PingRequest 1, at once
	r := bufio.NewReader(nc)
	for {
		size, _, err := refReadVLE(r)
		if errors.Is(err, io.EOF) {
			nc.CloseWrite() // the echo program closes once the client has
			return s
		}
		if err != nil || size == 0 || size > 10<<20 {
			s.err = errors.New("bad frame")
			return s
		}
		body := make([]byte, size)
		if _, err := io.ReadFull(r, body); err != nil {
			s.err = err
			return s
		}
		br := bufio.NewReader(bytes.NewReader(body))
		id, n, err := refReadVLE(br)
		if err != nil || n > len(body) {
			s.err = errors.New("bad MessageID")
			return s
		}
		payload := body[n:]
		switch id {
		case 1:
			s.pings++
			write(refFrame(2, payload[:1]))
		case 2:
			if len(payload) != 1 || payload[0] != 1 {
				s.swallowed++ // no ping of ours asked for it
			}
		default:
			s.echoed++
			write(refFrame(id, payload))
		}
	}
}

// TestClientOverTCPAgainstReference: `-connect ADDR -tcp` in the default
// dialect reaches a reference TCP echo server: its hello is dropped, and
// every echo comes back.
func TestClientOverTCPAgainstReference(t *testing.T) {
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	served := make(chan refEchoServer, 1)
	go func() {
		nc, err := ln.AcceptTCP()
		if err != nil {
			served <- refEchoServer{err: err}
			return
		}
		defer nc.Close()
		served <- serveRefEcho(nc)
	}()
	if err := client("tcp", ln.Addr().String(), 200*time.Millisecond, 64, knet.DialectSpec); err != nil {
		t.Fatalf("client: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	select {
	case s := <-served:
		if s.err != nil {
			t.Fatalf("server: %v", s.err)
		}
		if s.echoed == 0 || s.swallowed != 1 || s.pings == 0 {
			t.Errorf("server echoed %d, swallowed %d unsolicited PingReplies (want 1, the hello), answered %d pings", s.echoed, s.swallowed, s.pings)
		}
		t.Logf("server echoed %d messages", s.echoed)
	case <-ctx.Done():
		t.Fatal("the server did not see the client's FIN")
	}
}
