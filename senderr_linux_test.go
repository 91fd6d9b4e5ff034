package knet

import (
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestSendErrorsAreNotCountedSent(t *testing.T) {
	// The client's socket stops sending (shutdown: every send fails with
	// EPIPE) while the connection is up: what the system refused is
	// counted in SendErrors, not in DatagramsSent and BytesSent, which
	// still match what crossed the socket; and a send error that is not
	// the peer's port being unreachable does not end the connection.
	cfg := testConfig()
	cfg.DisconnectTimeout = 200 * time.Millisecond
	r, c, _ := relayed(t, cfg)
	pingPong(t, c, 20, 64)
	rc, err := c.ep.sock.(*udpSocket).pc.SyscallConn()
	require.NoError(t, err)
	require.NoError(t, rc.Control(func(fd uintptr) { require.NoError(t, syscall.Shutdown(int(fd), syscall.SHUT_WR)) }))
	for range 5 {
		require.NoError(t, c.Send(Message{ID: 6, Payload: make([]byte, 100), Reliable: true}))
	}
	require.Eventually(t, func() bool {
		up, _ := r.Stats()
		st := c.Stats()
		return st.SendErrors >= 3 && st.DatagramsSent == up.Sent && st.BytesSent == up.Bytes
	}, 10*time.Second, time.Millisecond)
	assert.NoError(t, c.Err(), "send errors alone do not end it")
	up, _ := r.Stats()
	st := c.Stats()
	t.Logf("relay saw %d datagrams, %d bytes; client: %d sent, %d bytes, %d send errors, %d retransmits", up.Sent, up.Bytes, st.DatagramsSent, st.BytesSent, st.SendErrors, st.Retransmits)
}
