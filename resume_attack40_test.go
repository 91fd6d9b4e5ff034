package knet

import (
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Attacks on resuming (issue 36) from someone without the keys or the
// 4-tuple's traffic.

// A suspended plaintext connection resumes on any datagram from its
// client's address, and then sends again everything in flight at once.
// Its client has been silent past the lost timeout: it may be gone, and
// its address (a NAT's mapping) someone else's. A stranger who spoofs
// that address with one small datagram (here one the client sent
// during the outage, which anyone can forge in plaintext) must not make the server send that address more than
// amplification times what came from it, before anything shows the
// client is there again.
func TestResumeAttackPlaintextSpoofAmplifies(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		scfg, ccfg, _ := resumeConfigs(t, false)
		_, nat, c, sc := resumeSetup(t, nw, scfg, ccfg)
		_ = seqReceiver(c)
		require.NoError(t, sc.Send(Message{ID: 100, Payload: []byte("hello"), Reliable: true}))
		synctest.Wait()
		heard := nat.recorded()
		require.NotEmpty(t, heard)
		nat.setDown(true)
		for i := range 30 {
			require.NoError(t, sc.Send(Message{ID: 100, Payload: make([]byte, 1000), Reliable: true}), "message %d", i)
		}
		time.Sleep(ccfg.ConnectionLostTimeout + 3*time.Second)
		require.True(t, sc.Stats().Suspended)

		nat.mu.Lock()
		own := nat.outer // the client's address, spoofed
		nat.mu.Unlock()
		// A datagram of the client's the server never had (a probe sent
		// during the outage): in plaintext anyone can make one.
		late := nat.recorded()
		require.Greater(t, len(late), len(heard))
		spoof := late[len(late)-1]
		before := nat.droppedBytes()[1]
		require.NoError(t, own.WriteTo(spoof, nat.server))
		time.Sleep(500 * time.Millisecond)
		synctest.Wait()
		sent := nat.droppedBytes()[1] - before
		assert.LessOrEqual(t, sent, amplification*len(spoof),
			"one spoofed datagram of %d bytes made the server send %d to the silent client's address (resumed %v)",
			len(spoof), sent, sc.Stats().Resumes)
	})
}

// The same with keys: a secure client's datagram that never reached the
// server (its probe during the outage, held by someone on the path) is
// sent later from a stranger's address. It authenticates and is new, so
// it wakes the suspended connection, which may check the stranger's
// address within the amplification limit. But the connection must not
// then send its old address (the silent client's, perhaps someone
// else's now) everything in flight at once: no more than amplification
// times what came, until the client shows it is there.
func TestResumeAttackUndeliveredDatagramAmplifies(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		scfg, ccfg, _ := resumeConfigs(t, true)
		l, nat, c, sc := resumeSetup(t, nw, scfg, ccfg)
		_ = seqReceiver(c)
		require.NoError(t, sc.Send(Message{ID: 100, Payload: []byte("hello"), Reliable: true}))
		synctest.Wait()
		heard := nat.recorded()
		nat.setDown(true)
		for i := range 30 {
			require.NoError(t, sc.Send(Message{ID: 100, Payload: make([]byte, 1000), Reliable: true}), "message %d", i)
		}
		time.Sleep(ccfg.ConnectionLostTimeout + 3*time.Second)
		require.True(t, sc.Stats().Suspended)
		late := nat.recorded()
		require.Greater(t, len(late), len(heard))
		held := late[len(late)-1]
		stranger := nw.rawSocket(t, l.Addr())
		before := nat.droppedBytes()[1]
		_, err := stranger.Write(held)
		require.NoError(t, err)
		time.Sleep(500 * time.Millisecond)
		synctest.Wait()
		sent := nat.droppedBytes()[1] - before
		assert.LessOrEqual(t, sent, amplification*len(held),
			"one held datagram of %d bytes made the server send %d to the old address (resumed %d)",
			len(held), sent, sc.Stats().Resumes)
		require.NoError(t, stranger.SetReadDeadline(time.Now().Add(time.Second)))
		got := 0
		buf := make([]byte, 2048)
		for {
			n, err := stranger.Read(buf)
			if err != nil {
				break
			}
			got += n
		}
		assert.LessOrEqual(t, got, amplification*len(held), "the stranger's address got more than the limit")
	})
}
