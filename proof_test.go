package knet

import (
	"bytes"
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A plaintext server's connection starts only once the client has proven
// it is at its address (addressProven, takeProof; issue 31, finding 9):
// before that, a sender spoofing someone's address could have the server
// greet that address with whatever its application sends a new player.

// proofRig is a lone plaintext server session fed by hand, on a fixed
// clock: the client's side is whatever a test sends.
type proofRig struct {
	t       *testing.T
	now     time.Time
	s       *session
	h       *simHost
	dialect Dialect
	pid     uint32 // the client's next PacketID
	in, out int    // bytes from and to the client
	est     bool   // evEstablished came
}

func newProofRig(t *testing.T, dialect Dialect, cfg *Config) *proofRig {
	r := &proofRig{t: t, now: timeZero, h: new(simHost), dialect: dialect, pid: 1}
	r.s = newSession(cfg.resolve(), r.h, false, dialect, r.now)
	return r
}

// recv hands the server b from the client.
func (r *proofRig) recv(b []byte) {
	r.in += len(b)
	r.s.beginRound()
	r.s.handleDatagram(r.now, b)
	if r.s.takeEvents()&evEstablished != 0 {
		r.est = true
	}
}

// send hands the server a datagram of the client's holding msgs.
func (r *proofRig) send(reliable bool, msgs ...message) {
	r.recv(clearDatagram(r.pid, reliable, msgs...))
	r.pid++
}

// cppSend hands the server a reference-dialect datagram holding msgs.
func (r *proofRig) cppSend(msgs ...cppMessage) {
	r.recv(appendCppDatagram(nil, &cppDatagram{cppHeader: cppHeader{packetID: r.pid, inOrder: true}, msgs: msgs}))
	r.pid++
}

// open runs the opening up to the server's answer: a ConnectSyn datagram
// of size bytes (the spec's wire) or the 8-byte opening (the reference's),
// admitted with reply. It returns the server's answer.
func (r *proofRig) open(size int, reply []byte) []byte {
	if r.dialect == DialectReference {
		r.recv(cppOpening[:])
	} else {
		r.recv(appendPadding(clearDatagram(0, false, message{id: idConnectSyn}), size))
	}
	require.True(r.t, r.s.handshake.admitWaiting, "the opening waits for Admit")
	r.s.admitted(r.now, reply, true)
	got := r.poll()
	require.Len(r.t, got, 1, "one answer")
	return got[0]
}

// poll returns what the server sends now.
func (r *proofRig) poll() [][]byte {
	var got [][]byte
	for range 100 {
		b := r.s.poll(r.now, make([]byte, 0, 65536))
		if b == nil {
			return got
		}
		r.out += len(b)
		got = append(got, bytes.Clone(b))
	}
	r.t.Fatal("poll does not stop")
	return nil
}

// wait advances the clock by d, running the timers due, and returns what
// the server sent meanwhile, and when.
func (r *proofRig) wait(d time.Duration) (sent [][]byte, at []time.Duration) {
	end := r.now.Add(d)
	for range 1000 {
		next := r.s.nextDeadline(r.now)
		if r.s.done() || next.After(end) {
			r.now = end
			return sent, at
		}
		if next.After(r.now) {
			r.now = next
		}
		r.s.advance(r.now)
		for _, b := range r.poll() {
			sent = append(sent, b)
			at = append(at, r.now.Sub(timeZero))
		}
	}
	r.t.Fatal("the timers do not settle")
	return nil, nil
}

// ackOf is a PacketAck message acking a.
func ackOf(a packetAck) message {
	return message{id: idPacketAck, payload: appendPacketAck(nil, a)}
}

func TestPacketAckNames(t *testing.T) {
	for _, tt := range []struct {
		a    packetAck
		id   uint32
		want bool
	}{
		{packetAck{base: 7}, 7, true},
		{packetAck{base: 7}, 8, false},
		{packetAck{base: 7}, 6, false},
		{packetAck{base: 7, more: 1}, 8, true},
		{packetAck{base: 7, more: 1 << 33}, 7 + 34, true},
		{packetAck{base: 7, more: 1<<34 - 1}, 7 + 35, false},
		{packetAck{base: packetIDMask - 1, more: 1 << 2}, 1, true}, // across the wrap
		{packetAck{base: packetIDMask - 1, more: 1 << 2}, 0, false},
		{packetAck{base: 2, more: 1<<34 - 1}, 1, false},
	} {
		assert.Equal(t, tt.want, tt.a.names(tt.id), "%+v names %d", tt.a, tt.id)
	}
}

// The spec's wire: the ConnectSynAck goes in a reliable datagram under a
// random PacketID, and only a PacketAck naming it establishes the server's
// connection; one naming anything else ends the attempt, silently.
func TestProofSpec(t *testing.T) {
	type step struct {
		reliable bool
		msgs     func(synAck uint32) []message
	}
	connectAck := func(uint32) []message { return []message{{id: idConnectAck}} }
	acking := func(a func(r uint32) packetAck, more ...message) func(uint32) []message {
		return func(r uint32) []message { return append(more, ackOf(a(r))) }
	}
	exact := func(r uint32) packetAck { return packetAck{base: r} }
	for _, tt := range []struct {
		name  string
		steps []step
		// est is the step after which the connection is established (-1:
		// never); ended, whether the attempt ends at the last.
		est   int
		ended bool
	}{
		{"ack in the ConnectAck datagram", []step{{true, acking(exact, message{id: idConnectAck})}}, 0, false},
		{"ack in a later datagram", []step{
			{true, func(uint32) []message { return []message{{id: idConnectAck}, {id: 6, payload: []byte("early")}} }},
			{false, acking(exact)},
		}, 1, false},
		{"ack among 35", []step{{true, acking(func(r uint32) packetAck {
			return packetAck{base: (r - 34) & packetIDMask, more: 1<<34 - 1}
		}, message{id: idConnectAck})}}, 0, false},
		{"ack before the ConnectAck", []step{{false, acking(exact)}, {true, connectAck}}, 1, false},
		{"ack alone", []step{{false, acking(exact)}}, -1, false},
		{"blind ConnectAck", []step{{true, connectAck}}, -1, false},
		{"application message alone", []step{{true, func(uint32) []message { return []message{{id: 6, payload: []byte("hi")}} }}}, -1, false},
		{"wrong ack", []step{{true, acking(func(r uint32) packetAck { return packetAck{base: r + 1} }, message{id: idConnectAck})}}, -1, true},
		{"wrong guess of 35", []step{{true, acking(func(r uint32) packetAck {
			return packetAck{base: (r + 1) & packetIDMask, more: 1<<34 - 1}
		}, message{id: idConnectAck})}}, -1, true},
		{"the right ack naming one never sent", []step{{true, acking(func(r uint32) packetAck {
			return packetAck{base: r, more: 1}
		}, message{id: idConnectAck})}}, -1, true},
		{"wrong ack after a ConnectAck", []step{{true, connectAck}, {false, acking(func(r uint32) packetAck { return packetAck{base: r - 1} })}}, -1, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r := newProofRig(t, DialectSpec, nil)
			answer := r.open(1200, []byte("welcome"))
			d, _, err := parseDatagram(answer)
			require.NoError(t, err)
			require.True(t, d.reliable, "the ConnectSynAck's datagram is reliable")
			require.Equal(t, uint32(idConnectSynAck), d.msgs[0].id)
			synAck := d.packetID
			require.Equal(t, synAck, r.s.handshake.challenge)
			for i, st := range tt.steps {
				r.send(st.reliable, st.msgs(synAck)...)
				assert.Equal(t, tt.est >= 0 && i >= tt.est, r.est, "established after step %d", i)
			}
			if tt.ended {
				assert.ErrorIs(t, r.s.err, errWrongProof)
				assert.Equal(t, uint64(1), r.s.stats.InvalidDatagrams)
				assert.Empty(t, r.poll(), "ended silently")
				assert.True(t, r.s.done())
				return
			}
			if tt.est < 0 {
				assert.Equal(t, stateSynAck, r.s.state)
				assert.Empty(t, r.poll(), "nothing but the ConnectSynAck before the proof")
				return
			}
			assert.Equal(t, stateOK, r.s.state)
			// Once established, what came before the proof is the
			// application's, and acked.
			acked := 0
			sent, _ := r.wait(50 * time.Millisecond) // MaxAckDelay
			for _, b := range sent {
				d, _, err := parseDatagram(b)
				require.NoError(t, err)
				for _, m := range d.msgs {
					if m.id == idPacketAck {
						a, _ := parsePacketAck(m.payload)
						a.each(func(uint32) { acked++ })
					}
				}
			}
			assert.Positive(t, acked, "the client's reliable datagrams are acked")
			for _, m := range r.h.msgs {
				assert.Equal(t, "early", string(m.Payload))
			}
		})
	}
}

// Before the proof, the server sends the ConnectSynAck again on its timer,
// the same datagram each time, as long as what the address sent allows:
// never more bytes than it received from there.
func TestProofSynAckResentWithinBudget(t *testing.T) {
	r := newProofRig(t, DialectSpec, nil)
	first := r.open(1200, make([]byte, 300)) // 309 bytes: three fit the ConnectSyn's 1200
	sends, at := r.wait(2 * time.Second)
	sends = append([][]byte{first}, sends...)
	at = append([]time.Duration{0}, at...)
	require.Len(t, sends, 3, "as many as the budget allows")
	for _, b := range sends {
		assert.Equal(t, first, b, "the same datagram, the same PacketID")
	}
	assert.Equal(t, []time.Duration{0, 200 * time.Millisecond, 600 * time.Millisecond}, at, "backing off")
	assert.LessOrEqual(t, r.out, r.in)

	// The client's ConnectSyn again (our answer was lost) earns another.
	r.recv(appendPadding(clearDatagram(r.pid, false, message{id: idConnectSyn}), 1200))
	r.pid++
	got := r.poll()
	require.Len(t, got, 1)
	assert.Equal(t, first, got[0])
	assert.LessOrEqual(t, r.out, r.in)

	// A client whose ack was lost (sent alone, after its ConnectAck)
	// acks the resent one.
	r.send(true, message{id: idConnectAck})
	assert.False(t, r.est)
	r.send(false, ackOf(packetAck{base: r.s.handshake.challenge}))
	assert.True(t, r.est)
}

// A knet client acks the ConnectSynAck in the datagram of its ConnectAck,
// and again whenever the ConnectSynAck comes again; a lost ConnectAck
// datagram delays the connection by a resend, not a timeout.
func TestProofKnetClient(t *testing.T) {
	t.Run("in the ConnectAck's datagram", func(t *testing.T) {
		p := newSimPair(t, nil, nil, perfect, perfect)
		var synAck uint32
		proofIn := -1 // the client's datagram that carried the ack
		n := 0
		p.tap = func(from int, b []byte) {
			d, _, err := parseDatagram(b)
			require.NoError(t, err)
			if from == 1 && len(d.msgs) > 0 && d.msgs[0].id == idConnectSynAck {
				require.True(t, d.reliable)
				synAck = d.packetID
			}
			if from == 0 {
				n++
				for _, m := range d.msgs {
					if a, ok := parsePacketAck(m.payload); ok && m.id == idPacketAck && a.names(synAck) && proofIn < 0 {
						proofIn = n
						assert.Equal(t, uint32(idConnectAck), d.msgs[0].id, "the ack rides with the ConnectAck")
					}
				}
			}
		}
		p.connect()
		assert.Equal(t, 2, proofIn, "the datagram after the ConnectSyn")
		assert.True(t, p.server().addressProven())
	})
	t.Run("ConnectAck lost", func(t *testing.T) {
		p := newSimPair(t, nil, nil, perfect, perfect)
		dropped := 0
		p.drop = func(from int, b []byte) bool {
			d, _, _ := parseDatagram(b)
			if from == 0 && dropped < 2 && len(d.msgs) > 0 && d.msgs[0].id == idConnectAck {
				dropped++
				return true
			}
			return false
		}
		start := p.now
		p.connect()
		assert.Equal(t, 2, dropped)
		assert.Less(t, p.now.Sub(start), 2*time.Second, "connected by a resend")
	})
	t.Run("every datagram of the client lost after the ConnectSyn for a while", func(t *testing.T) {
		p := newSimPair(t, nil, nil, perfect, perfect)
		p.drop = func(from int, b []byte) bool {
			d, _, _ := parseDatagram(b)
			return from == 0 && p.now.Sub(timeZero) < 700*time.Millisecond && !(len(d.msgs) > 0 && d.msgs[0].id == idConnectSyn)
		}
		p.connect()
		assert.True(t, p.server().addressProven())
	})
}

// The reference's wire: the PingRequest answering the opening carries a
// random ID, and only the PingReply echoing it establishes the server's
// connection.
func TestProofReference(t *testing.T) {
	reply := func(id byte) cppMessage { return cppMessage{inOrder: true, id: idPingReply, payload: []byte{id}} }
	app := cppMessage{inOrder: true, id: 6, payload: []byte("early")}
	for _, tt := range []struct {
		name  string
		steps func(ping byte) [][]cppMessage
		est   int
		ended bool
	}{
		{"PingReply", func(p byte) [][]cppMessage { return [][]cppMessage{{reply(p)}} }, 0, false},
		{"PingReply after a message", func(p byte) [][]cppMessage { return [][]cppMessage{{app}, {reply(p), app}} }, 1, false},
		{"no PingReply", func(byte) [][]cppMessage { return [][]cppMessage{{app}} }, -1, false},
		{"wrong PingReply", func(p byte) [][]cppMessage { return [][]cppMessage{{reply(p + 1)}} }, -1, true},
		{"an ack of a PacketID never sent", func(byte) [][]cppMessage {
			return [][]cppMessage{{{inOrder: true, id: idPacketAck, payload: appendCppPacketAck(nil, packetAck{base: 5})}}}
		}, -1, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r := newProofRig(t, DialectReference, nil)
			answer := r.open(0, nil)
			assert.LessOrEqual(t, len(answer), len(cppOpening), "no larger than the opening")
			ping := cppPingOf(t, answer)
			require.Equal(t, uint32(ping), r.s.handshake.challenge)
			for i, msgs := range tt.steps(ping) {
				r.cppSend(msgs...)
				assert.Equal(t, tt.est >= 0 && i >= tt.est, r.est, "established after step %d", i)
			}
			switch {
			case tt.ended:
				assert.ErrorIs(t, r.s.err, errWrongProof)
				assert.Equal(t, uint64(1), r.s.stats.InvalidDatagrams)
				assert.Empty(t, r.poll())
			case tt.est < 0:
				assert.Equal(t, stateSynAck, r.s.state)
			default:
				assert.Equal(t, stateOK, r.s.state)
				assert.True(t, r.s.addressProven())
			}
		})
	}
	t.Run("resent within the budget, the same ID", func(t *testing.T) {
		r := newProofRig(t, DialectReference, nil)
		first := r.open(0, nil)
		ping := cppPingOf(t, first)
		got, _ := r.wait(time.Second)
		assert.Empty(t, got, "7 of the opening's 8 bytes are spent")
		r.cppSend(app) // 7 + 3 bytes more credit
		got = r.poll()
		require.Len(t, got, 1, "at once, not on the timer: the datagram may say our PingRequest or its PingReply was lost")
		assert.Equal(t, ping, cppPingOf(t, got[0]))
		assert.LessOrEqual(t, r.out, r.in)
		r.cppSend(reply(ping))
		assert.True(t, r.est)
		require.Len(t, r.h.msgs, 1, "what came before the proof is delivered")
	})
}

// The first PacketID of a plaintext server is random, the reference's
// ping ID too; a secure server's numbering and handshake are unchanged.
func TestProofRandomChallenge(t *testing.T) {
	pids, pings := map[uint32]bool{}, map[uint32]bool{}
	for range 64 {
		r := newProofRig(t, DialectSpec, nil)
		r.open(1200, nil)
		pids[r.s.handshake.challenge] = true
		r = newProofRig(t, DialectReference, nil)
		r.open(0, nil)
		pings[r.s.handshake.challenge] = true
	}
	assert.Greater(t, len(pids), 60, "22 random bits")
	assert.Greater(t, len(pings), 20, "8 random bits")

	t.Run("at the wrap", func(t *testing.T) {
		for _, start := range []uint32{packetIDMask, packetIDMask - 1, 0} {
			r := newProofRig(t, DialectSpec, nil)
			r.s.startPIDAt(start)
			r.open(1200, nil)
			require.Equal(t, start, r.s.handshake.challenge)
			r.send(true, message{id: idConnectAck}, ackOf(packetAck{base: (start - 3) & packetIDMask, more: 1 << 2}))
			require.True(t, r.est, "start %d", start)
		}
		p := newSimPair(t, nil, nil, lossy(9, 0.1), lossy(10, 0.1))
		p.server().startPIDAt(packetIDMask - 1)
		p.connect()
		for i := range 300 {
			p.send(1, numbered(100, i, 100))
		}
		require.True(t, p.run(60*time.Second, func() bool { return len(p.h[0].msgs) == 300 }))
		assert.Less(t, p.server().send.nextPID, uint32(1000), "the server's PacketIDs wrapped")
	})

	t.Run("secure", func(t *testing.T) {
		p := newSecureSimPair(t, nil, nil, perfect, perfect)
		first := true
		p.tap = func(from int, b []byte) {
			if from == 1 && first {
				first = false
				assert.False(t, isReliableDg(b), "a secure ConnectSynAck is unreliable, as before")
				assert.Zero(t, uint32(b[0])|uint32(b[1])<<8|uint32(b[2]&0x3f)<<16, "and numbered from 0")
			}
		}
		p.connect()
		assert.True(t, p.server().addressProven())
		assert.True(t, p.client().addressProven())
	})
}

// TestDoorPlaintextNoReflection: from a spoofed address (a victim's
// socket that never reads), a ConnectSyn padded to 1200 bytes and a blind
// answer (a ConnectAck, or a guessed ack; the reference's opening and a
// datagram) make no player of that address: Accept never sees it, and
// what the listener sends there, however it greets its players (1 MiB
// each), stays within 3x what the address sent. Before the proof, it
// was a player after 9 bytes and got the greeting (92 KB in 15 s).
func TestDoorPlaintextNoReflection(t *testing.T) {
	specSyn := appendPadding(clearDatagram(0, false, message{id: idConnectSyn}), synPadTo)
	for _, tt := range []struct {
		name  string
		cfg   Config
		sends [][]byte
	}{
		{"blind ConnectAck", Config{}, [][]byte{specSyn, clearDatagram(1, true, message{id: idConnectAck})}},
		{"guessed ack", Config{}, [][]byte{specSyn, clearDatagram(1, true, message{id: idConnectAck},
			ackOf(packetAck{base: 0, more: 1<<34 - 1}))}},
		{"MaxPathDatagramSize 9000", Config{MaxPathDatagramSize: 9000}, [][]byte{specSyn, clearDatagram(1, true, message{id: idConnectAck})}},
		{"reference", Config{Dialect: DialectReference}, [][]byte{cppOpening[:], appendCppDatagram(nil, &cppDatagram{
			cppHeader: cppHeader{packetID: 1, inOrder: true},
			msgs:      []cppMessage{{inOrder: true, id: 6, payload: []byte("hi")}}})}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			cfg := tt.cfg
			cfg.ConnectTimeout = 2 * time.Second
			l, err := Listen("udp", "127.0.0.1:0", &cfg)
			require.NoError(t, err)
			defer l.Close()
			victim, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
			require.NoError(t, err)
			defer victim.Close()
			victim.SetReadBuffer(4 << 20)

			// The server greets each player with 1 MiB.
			accepted := make(chan error, 1)
			go func() {
				ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
				defer cancel()
				c, err := l.AcceptConn(ctx)
				if err != nil {
					accepted <- err
					return
				}
				accepted <- nil
				c.Send(Message{ID: 6, Payload: make([]byte, 1<<20), Reliable: true})
			}()
			dst := l.Addr().(*net.UDPAddr)
			sent := 0
			for _, b := range tt.sends {
				_, err := victim.WriteToUDP(b, dst)
				require.NoError(t, err)
				sent += len(b)
				time.Sleep(20 * time.Millisecond) // a round trip, for the blind sender
			}
			assert.ErrorIs(t, <-accepted, context.DeadlineExceeded, "the spoofed address is no player")
			time.Sleep(time.Second) // what the listener would have sent meanwhile

			got := 0
			buf := make([]byte, 65536)
			for {
				victim.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
				n, _, err := victim.ReadFromUDP(buf)
				if err != nil {
					var ne net.Error
					require.True(t, errors.As(err, &ne) && ne.Timeout(), "%v", err)
					break
				}
				got += n
			}
			t.Logf("the victim's address sent %d bytes, got %d (%.2fx)", sent, got, float64(got)/float64(sent))
			assert.LessOrEqual(t, got, 3*sent, "reflected past 3x")
			assert.Eventually(t, func() bool { return l.Stats().Pending == 0 }, 3*time.Second, 10*time.Millisecond,
				"the attempt ends (ConnectTimeout)")
			st := l.Stats()
			assert.Zero(t, st.Established)
			if tt.name == "guessed ack" {
				assert.Equal(t, uint64(1), st.InvalidDatagrams, "the wrong guess is counted")
			}
		})
	}
}
