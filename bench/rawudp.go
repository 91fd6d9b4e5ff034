package main

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"slices"
	"sync/atomic"
	"time"
)

// Raw UDP is the reference: plain sockets, no reliability. A lost
// datagram is simply not counted (ping-pong resends after a timeout).

func udpListen(e *env) (*net.UDPConn, error) {
	c, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		return nil, err
	}
	c.SetReadBuffer(4 << 20)
	c.SetWriteBuffer(4 << 20)
	e.add("socket", c)
	return c, nil
}

func udpDial(e *env, to net.Addr) (*net.UDPConn, error) {
	c, err := net.DialUDP("udp", nil, to.(*net.UDPAddr))
	if err != nil {
		return nil, err
	}
	c.SetReadBuffer(4 << 20)
	c.SetWriteBuffer(4 << 20)
	e.add("socket", c)
	return c, nil
}

// udpEcho sends every datagram back where it came from.
func udpEcho(e *env, s *net.UDPConn) {
	buf := make([]byte, 64<<10)
	for {
		n, from, err := s.ReadFromUDPAddrPort(buf)
		if err != nil {
			if e.running() && !errors.Is(err, net.ErrClosed) {
				continue
			}
			return
		}
		s.WriteToUDPAddrPort(buf[:n], from)
	}
}

// udpRoundTrip sends seq and waits for its echo, resending after 100 ms.
func udpRoundTrip(c *net.UDPConn, msg, buf []byte, seq uint64, lost *atomic.Uint64) error {
	binary.LittleEndian.PutUint64(msg, seq)
	for {
		if _, err := c.Write(msg); err != nil {
			return err
		}
		c.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
		for {
			n, err := c.Read(buf)
			if err != nil {
				var ne net.Error
				if errors.As(err, &ne) && ne.Timeout() {
					lost.Add(1)
					break // resend
				}
				return err
			}
			if n == len(msg) && binary.LittleEndian.Uint64(buf) == seq {
				return nil
			}
			// a late echo of an earlier resend: keep waiting
		}
	}
}

func udpPingPong(e *env, size int, warm, dur time.Duration) ([]time.Duration, error) {
	s, err := udpListen(e)
	if err != nil {
		return nil, err
	}
	go udpEcho(e, s)
	c, err := udpDial(e, s.LocalAddr())
	if err != nil {
		return nil, err
	}
	msg, buf := make([]byte, size), make([]byte, 64<<10)
	var lost atomic.Uint64
	rtts := make([]time.Duration, 0, 1<<16)
	measureFrom := time.Now().Add(warm)
	end := measureFrom.Add(dur)
	for seq := uint64(0); e.running(); seq++ {
		t0 := time.Now()
		if t0.After(end) {
			break
		}
		if err := udpRoundTrip(c, msg, buf, seq, &lost); err != nil {
			return nil, err
		}
		if t0.After(measureFrom) {
			rtts = append(rtts, time.Since(t0))
		}
	}
	if k := lost.Load(); k > 0 {
		e.note("raw UDP ping-pong: %d timeouts (resent)", k)
	}
	slices.Sort(rtts)
	return rtts, nil
}

// udpBlast sends datagrams of size bytes as fast as the socket takes them
// and counts those received during dur after warm.
func udpBlast(e *env, size int, warm, dur time.Duration) (dgramsPerSec float64, lossPct float64, err error) {
	s, err := udpListen(e)
	if err != nil {
		return 0, 0, err
	}
	c, err := udpDial(e, s.LocalAddr())
	if err != nil {
		return 0, 0, err
	}
	var got, sent atomic.Uint64
	go func() {
		buf := make([]byte, 64<<10)
		for {
			if _, err := s.Read(buf); err != nil {
				if !e.running() || errors.Is(err, net.ErrClosed) {
					return
				}
				continue
			}
			got.Add(1)
		}
	}()
	go func() {
		msg := make([]byte, size)
		for e.running() {
			if _, err := c.Write(msg); err == nil {
				sent.Add(1)
			} else if errors.Is(err, net.ErrClosed) {
				return
			}
		}
	}()
	if !e.sleep(warm) {
		return 0, 0, nil
	}
	g0, s0, t0 := got.Load(), sent.Load(), time.Now()
	if !e.sleep(dur) {
		return 0, 0, nil
	}
	g1, s1, t1 := got.Load(), sent.Load(), time.Now()
	g, sn := g1-g0, s1-s0
	if sn > 0 && sn > g {
		lossPct = 100 * float64(sn-g) / float64(sn)
	}
	return float64(g) / t1.Sub(t0).Seconds(), lossPct, nil
}

// udpConcurrent runs n client sockets against one echoing socket.
func udpConcurrent(e *env, n, size int, warm, dur time.Duration) (float64, error) {
	s, err := udpListen(e)
	if err != nil {
		return 0, err
	}
	go udpEcho(e, s)
	var trips, lost atomic.Uint64
	for range n {
		c, err := udpDial(e, s.LocalAddr())
		if err != nil {
			return 0, err
		}
		go func() {
			msg, buf := make([]byte, size), make([]byte, 64<<10)
			for seq := uint64(0); e.running(); seq++ {
				if err := udpRoundTrip(c, msg, buf, seq, &lost); err != nil {
					if e.running() {
						e.fail(fmt.Errorf("client: %w", err))
					}
					return
				}
				trips.Add(1)
			}
		}()
	}
	if !e.sleep(warm) {
		return 0, nil
	}
	n0, t0 := trips.Load(), time.Now()
	if !e.sleep(dur) {
		return 0, nil
	}
	n1, t1 := trips.Load(), time.Now()
	if k := lost.Load(); k > 0 {
		e.note("raw UDP %d sessions: %d timeouts (resent)", n, k)
	}
	return float64(n1-n0) / t1.Sub(t0).Seconds(), nil
}
