//go:build !unix

package knet

import (
	"net"
	"testing"
	"time"
)

// recvNow reads a datagram queued at pc, if there is one, waiting 20ms at
// most. (A read deadline in the past fails before looking.)
func recvNow(t *testing.T, pc *net.UDPConn) ([]byte, bool) {
	pc.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
	buf := make([]byte, 2048)
	n, err := pc.Read(buf)
	return buf[:n], err == nil
}
