package knet

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// served is what serveAll saw.
type served struct {
	wg   sync.WaitGroup
	over atomic.Int32 // connections that ended with ErrOverBudget
}

// overBudget is how many connections ended with ErrOverBudget.
func (s *served) overBudget() int {
	s.wg.Wait()
	return int(s.over.Load())
}

// serveAll reads every connection l accepts until it ends, handing each
// message to got (which may be nil), until l is closed.
func serveAll(l *Listener, got func(c *Conn, m Message)) *served {
	s := new(served)
	s.wg.Go(func() {
		for {
			c, err := l.AcceptConn(context.Background())
			if err != nil {
				return
			}
			s.wg.Go(func() {
				for {
					m, err := c.Receive(context.Background())
					if err != nil {
						break
					}
					if got != nil {
						got(c, m)
					}
				}
				<-c.Done()
				if errors.Is(c.Err(), ErrOverBudget) {
					s.over.Add(1)
				}
			})
		}
	})
	return s
}

// The finding: six UDP clients that each keep one hole open in a reliable
// ordered stream (a relay loses one of their datagrams for good) make the
// server hold all they send behind it, up to heldCap ReceiveBuffers each,
// and nothing bounded the sum. With a receive budget, the sum stays within
// it (and a step and a datagram per connection: see budget.go), the six
// are refused once it is spent, then closed with the reason; an honest
// client's messages all arrive meanwhile, in order.
//
// Without the budget (the code before it, or ReceiveBudget 1<<40 here),
// the six held 181 MiB, 31 MiB each, and nobody was closed.
func TestBudgetHoleHolders(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const budget = 8 << 20
		nw := memNet(t)
		cfg := testConfig()
		cfg.ReceiveBudget = budget
		l := nw.listen(t, cfg)
		var honestGot []uint32
		var mu sync.Mutex
		var honestConn atomic.Pointer[Conn]
		srv := serveAll(l, func(c *Conn, m Message) {
			if m.ID == 7 {
				honestConn.Store(c)
				mu.Lock()
				honestGot = append(honestGot, binary.BigEndian.Uint32(m.Payload))
				mu.Unlock()
			}
		})

		const hostile = 6
		nw.wrapDial = func(s socket) socket { return newHoleSocket(s) }
		var holders []*Conn
		hcfg := testConfig()
		hcfg.MaxMessageSendCount = 1 << 30 // they never give up on the hole
		for range hostile {
			holders = append(holders, nw.dial(t, l.Addr().String(), hcfg))
		}
		nw.wrapDial = nil
		honest := nw.dial(t, l.Addr().String(), testConfig())

		ctx, stop := context.WithCancel(context.Background())
		var senders sync.WaitGroup
		for _, c := range holders {
			senders.Go(func() {
				p := make([]byte, 1000)
				for c.SendContext(ctx, Message{ID: 6, Payload: p, Reliable: true, InOrder: true}) == nil {
				}
			})
		}
		const honestMessages = 1000
		senders.Go(func() {
			p := make([]byte, 1000)
			for i := range honestMessages {
				binary.BigEndian.PutUint32(p, uint32(i))
				if honest.SendContext(ctx, Message{ID: 7, Payload: p, Reliable: true, InOrder: true}) != nil {
					return
				}
				time.Sleep(20 * time.Millisecond)
			}
		})

		peak := 0
		for range 300 { // 30s on the bubble's clock
			time.Sleep(100 * time.Millisecond)
			synctest.Wait()
			peak = max(peak, l.Stats().ReceiveHeld)
		}
		st := l.Stats()
		t.Logf("budget %d KiB: peak held %d KiB; closed over budget %d; honest got %d of %d",
			budget>>10, peak>>10, st.ClosedOverBudget, len(honestGot), honestMessages)
		// The budget, its eighth past which nobody takes more, and a
		// step and a datagram per connection (budget.go).
		slack := budget/8 + (hostile+1)*(maxBudgetStep+defaultMaxDatagramSize)
		assert.LessOrEqual(t, peak, budget+slack, "held past the budget")
		assert.Greater(t, peak, budget*7/8, "the six spent it")
		// Those holding the most are closed. One that held less than its
		// share when the budget ran out may be spared once the others are
		// gone and the budget is free again: whether one is depends on
		// how far apart the holders drifted (each sender skips PacketIDs
		// at random, skip.go), so at least five of the six are closed.
		assert.GreaterOrEqual(t, st.ClosedOverBudget, uint64(hostile-1), "the holders are closed")
		closed := 0
		for i, c := range holders {
			if c.Err() == nil {
				continue // spared (above)
			}
			closed++
			var de *DisconnectError
			if assert.ErrorAs(t, c.Err(), &de, "holder %d", i) {
				assert.Equal(t, budgetReason, de.Reason, "holder %d", i)
			}
		}
		assert.Equal(t, int(st.ClosedOverBudget), closed)
		assert.LessOrEqual(t, st.ReceiveHeld, budget+slack, "what is held at the end is within the budget")
		assert.NoError(t, honest.Err(), "the honest client goes on")
		if sc := honestConn.Load(); assert.NotNil(t, sc) {
			assert.NoError(t, sc.Err())
		}
		mu.Lock()
		assert.Len(t, honestGot, honestMessages, "every honest message arrives")
		for i, v := range honestGot {
			if uint32(i) != v {
				t.Fatalf("honest message %d arrived as %d", v, i)
			}
		}
		mu.Unlock()
		stop()
		senders.Wait()
		for _, c := range append(holders, honest) {
			c.Close()
		}
		l.Close()
		assert.Equal(t, closed, srv.overBudget(), "the server's side of each holder closed ends with ErrOverBudget")
	})
}

// The reference dialect's wire keeps its own held messages (in-order
// ones behind a missing reliable number): two raw peers that never send
// their number 0 and send what follows hold within the budget together,
// and are closed over it.
func TestBudgetReferenceDialect(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		const budget = 256 << 10
		l := nw.listen(t, &Config{ReceiveBudget: budget, DatagramTimeout: 500 * time.Millisecond, DisconnectTimeout: 200 * time.Millisecond})
		var sends []func(d *cppDatagram)
		var srvs []*Conn
		for range 2 {
			c := nw.rawSocket(t, l.Addr())
			c.Write(cppOpening[:])
			buf := make([]byte, 2048)
			n, err := c.Read(buf)
			require.NoError(t, err)
			ping := cppPingOf(t, buf[:n])
			pid := uint32(1)
			send := func(d *cppDatagram) {
				d.packetID = pid
				pid++
				c.Write(appendCppDatagram(nil, d))
			}
			send(&cppDatagram{msgs: []cppMessage{{id: idPingReply, payload: []byte{ping}}}})
			sends = append(sends, send)
			srvs = append(srvs, serverConn(t, l))
		}
		require.Equal(t, DialectReference, srvs[0].Dialect())
		payload := make([]byte, 1000)
		peak := 0
		for rel := uint32(1); rel <= 300; rel++ { // 0 never comes
			for _, send := range sends {
				send(&cppDatagram{cppHeader: cppHeader{reliable: true, inOrder: true, relBase: rel},
					msgs: []cppMessage{{reliable: true, inOrder: true, relNum: rel, id: 6, payload: payload}}})
			}
			if rel%16 == 0 {
				synctest.Wait()
				peak = max(peak, l.Stats().ReceiveHeld)
			}
		}
		time.Sleep(5 * time.Second) // the grace, twice DatagramTimeout, and the close
		synctest.Wait()
		st := l.Stats()
		t.Logf("peak held %d KiB of %d; closed over budget %d", peak>>10, budget>>10, st.ClosedOverBudget)
		assert.LessOrEqual(t, peak, budget+budget/8+2*(budget/64+2048), "held past the budget")
		assert.Greater(t, peak, budget*7/8, "the two spent it")
		assert.Equal(t, uint64(2), st.ClosedOverBudget)
		for i, c := range srvs {
			<-c.Done()
			assert.ErrorIs(t, c.Err(), ErrOverBudget, "server's connection %d", i)
		}
	})
}

// Unreliable messages to an application that does not read are dropped
// once the budget is spent, for a connection over its share: each peer's
// receive queue would otherwise grow to ReceiveBuffer.
func TestBudgetUnreliable(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		const budget = 256 << 10
		l := nw.listen(t, &Config{ReceiveBudget: budget, DatagramTimeout: 500 * time.Millisecond, DisconnectTimeout: 200 * time.Millisecond})
		var peers []*rawPeer
		var srvs []*Conn
		for range 2 {
			peers = append(peers, nw.dialRaw(t, l.Addr()))
			srvs = append(srvs, serverConn(t, l))
		}
		payload := make([]byte, 1000)
		peak := 0
		for k := range 300 {
			for _, p := range peers {
				p.send(false, message{id: 6, payload: payload})
			}
			if k%16 == 0 {
				synctest.Wait()
				peak = max(peak, l.Stats().ReceiveHeld)
			}
		}
		synctest.Wait()
		peak = max(peak, l.Stats().ReceiveHeld)
		t.Logf("peak held %d KiB of %d; dropped %d and %d", peak>>10, budget>>10, srvs[0].Stats().DroppedMessages, srvs[1].Stats().DroppedMessages)
		assert.LessOrEqual(t, peak, budget+budget/8+2*(budget/64+2048), "held past the budget")
		for i, c := range srvs {
			assert.Positive(t, c.Stats().DroppedMessages, "connection %d", i)
		}
		time.Sleep(5 * time.Second)
		synctest.Wait()
		assert.Equal(t, uint64(2), l.Stats().ClosedOverBudget)
	})
}

// The accounting and the selection, on their own: what each connection
// reports makes the sum and the level (spent at the budget until back
// under seven eighths of it, full past an eighth more), the share is the
// budget divided among the connections, only those over it are refused
// while it is spent, everyone once it is full, and one over it for the
// grace is to be closed.
func TestBudgetSelection(t *testing.T) {
	cfg := (&Config{ReceiveBudget: 800 << 10, DatagramTimeout: time.Second}).resolve()
	b := newReceiveBudget(cfg)
	require.Equal(t, 2*time.Second, b.grace)
	shares := make([]*budgetShare, 4)
	for i := range shares {
		shares[i] = &budgetShare{b: b}
		b.conns.Add(1)
	}
	require.EqualValues(t, 200<<10, b.share())
	a, c, d := shares[0], shares[1], shares[2]

	a.report(500 << 10)
	c.report(100 << 10)
	assert.EqualValues(t, 600<<10, b.held.Load())
	assert.Equal(t, budgetUnder, b.level.Load())
	assert.False(t, a.refuses(500<<10), "under the budget, nobody is refused")

	d.report(200 << 10) // 800 KiB: spent
	assert.Equal(t, budgetSpent, b.level.Load())
	assert.True(t, a.refuses(500<<10), "over its share")
	assert.False(t, c.refuses(100<<10), "under its share")
	assert.False(t, d.refuses(200<<10), "at its share")

	// Growth within a round is reported once it reaches a step.
	require.Equal(t, 800<<10/64, b.step, "a 64th of the budget")
	assert.False(t, c.refuses(100<<10+b.step-1))
	assert.EqualValues(t, 800<<10, b.held.Load(), "less than a step: not yet")
	assert.False(t, c.refuses(100<<10+b.step))
	assert.EqualValues(t, 800<<10+b.step, b.held.Load(), "a step: reported")

	c.report(200 << 10) // 900 KiB: an eighth past the budget, full
	assert.Equal(t, budgetFull, b.level.Load())
	assert.True(t, c.refuses(200<<10), "full: everyone is refused")
	assert.True(t, shares[3].refuses(0), "even one holding nothing")

	c.report(100 << 10) // 800 KiB
	assert.Equal(t, budgetSpent, b.level.Load(), "under the ceiling: spent again")
	c.report(0) // 700 KiB: seven eighths, still spent
	assert.Equal(t, budgetSpent, b.level.Load(), "spent until under seven eighths")
	d.report(100 << 10) // 600 KiB
	assert.Equal(t, budgetUnder, b.level.Load())
	assert.False(t, a.refuses(500<<10))

	// The grace: over its share of a spent budget for b.grace.
	d.report(300 << 10) // 800 KiB: spent
	now := timeZero
	wait, expired := a.watch(500<<10, now)
	assert.Equal(t, b.grace, wait)
	assert.False(t, expired)
	wait, expired = a.watch(500<<10, now.Add(b.grace/2))
	assert.Equal(t, b.grace/2, wait)
	assert.False(t, expired)
	_, expired = d.watch(300<<10, now)
	assert.False(t, expired, "d is over too, its clock starting now")
	_, expired = a.watch(500<<10, now.Add(b.grace))
	assert.True(t, expired, "over for the grace")
	// Under its share again, the clock starts anew.
	wait, expired = d.watch(100<<10, now.Add(b.grace))
	assert.Zero(t, wait)
	assert.False(t, expired)
	assert.True(t, d.overSince.IsZero())

	// A connection closed over the budget takes nothing more, whatever
	// the level; its end lets go of what it held.
	a.closing = true
	d.report(0) // 500 KiB: under
	assert.True(t, a.refuses(500<<10))
	a.report(0)
	assert.Zero(t, b.held.Load())
}

// A spent budget costs the connections under their share no allocation:
// each datagram measures what its connection holds and reads the budget's
// level and share, each round reports.
func TestBudgetSpentNoAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts are meaningless under -race; .ci/run runs this test without it")
	}
	cfg := &Config{DisconnectTimeout: time.Second, ReceiveBudget: 1 << 20, DatagramTimeout: time.Minute}
	l := listen(t, cfg)
	ctx := context.Background()
	accept := func() *Conn {
		c, err := l.AcceptConn(within(t, 5*time.Second))
		require.NoError(t, err)
		t.Cleanup(func() { c.Close() })
		return c
	}
	// The holder's messages wait for an application that never reads:
	// 1,000 of 1,072 bytes as the receive queue counts them, past the
	// budget, within its ceiling.
	holder := dial(t, l.Addr().String(), forDial(cfg))
	accept()
	for range 1000 {
		require.NoError(t, holder.Send(Message{ID: 6, Payload: make([]byte, 1024), Reliable: true}))
	}
	client := dial(t, l.Addr().String(), forDial(cfg))
	server := accept()
	require.Eventually(t, func() bool { return l.budget.spent() }, 5*time.Second, time.Millisecond, "the holder spends the budget")

	buf := make([]byte, 2048)
	small := make([]byte, 32)
	for _, m := range []Message{
		{ID: 6, Payload: small, Reliable: true},
		{ID: 7, Payload: small},
		{ID: 8, Payload: small, Reliable: true, InOrder: true, Channel: 3},
	} {
		run := func() {
			require.NoError(t, client.Send(m))
			_, _, err := server.ReceiveInto(ctx, buf)
			require.NoError(t, err)
		}
		for range 2000 {
			run()
		}
		assert.Zero(t, steadyAllocs(2000, run), "message %d", m.ID)
	}
	assert.True(t, l.budget.spent(), "spent all along")
	assert.Zero(t, l.Stats().ClosedOverBudget)
}

func init() {
	budgetHeld = func(l *Listener) string {
		st := l.Stats()
		return fmt.Sprintf(", held %d MiB, closed over budget %d", st.ReceiveHeld>>20, st.ClosedOverBudget)
	}
}

// BenchmarkBudgetAdmit is what the budget adds to each reliable datagram
// of application data (specWire.admits): measuring what the connection
// holds and reading the budget's level, and its share once spent.
func BenchmarkBudgetAdmit(b *testing.B) {
	for _, spent := range []bool{false, true} {
		b.Run(fmt.Sprintf("spent=%v", spent), func(b *testing.B) {
			cfg := (&Config{ReceiveBudget: 1 << 20}).resolve()
			s := newSession(cfg, new(simHost), false, DialectSpec, timeZero)
			s.budget = &budgetShare{b: newReceiveBudget(cfg)}
			s.budget.b.conns.Add(2)
			if spent {
				(&budgetShare{b: s.budget.b}).report(1 << 20)
			}
			b.ReportAllocs()
			for b.Loop() {
				if s.overBudget(1000) {
					b.Fatal("refused")
				}
			}
		})
	}
}
