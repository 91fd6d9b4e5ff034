//go:build unix

package knet

import (
	"net"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
)

// recvNow reads a datagram queued at pc, if there is one, without
// waiting. (A read deadline in the past fails before looking.)
func recvNow(t *testing.T, pc *net.UDPConn) ([]byte, bool) {
	rc, err := pc.SyscallConn()
	require.NoError(t, err)
	buf := make([]byte, 2048)
	n := -1
	require.NoError(t, rc.Read(func(fd uintptr) bool {
		n, _, err = syscall.Recvfrom(int(fd), buf, syscall.MSG_DONTWAIT)
		return true
	}))
	if err != nil {
		require.ErrorIs(t, err, syscall.EAGAIN)
		return nil, false
	}
	return buf[:n], true
}
