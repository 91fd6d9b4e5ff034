package knet

import (
	"runtime"
	"testing"
	"testing/synctest"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Findings of a review as an attacker holding a connection: what a peer's
// messages may make the receiver hold is bounded by ReceiveBuffer, and a
// hard limit of heldCap ReceiveBuffers (see specWire.admits).

// Held messages that all wait on one message (a reliable one naming a
// datagram the peer never sends) give up in the order they came; each
// release took itself out of the waiters list by shifting all the others,
// so a reorder window's worth cost their square: with the default
// ReceiveBuffer, 174,761 empty messages from 440 datagrams took 4.2 s of
// CPU in one expire. The waiters are now a linked list of wait nodes: one
// leaves it without moving any other.
func TestPeerHeldBehindReliable(t *testing.T) {
	var r resolver
	var w recvWindow
	w.startAt(50)
	w.add(100)
	var tab depTable
	// a: reliable, held for good for a message that never comes.
	a := msgRef{pid: 100}
	ha := r.newHeld()
	ha.ref, ha.reliable = a, true
	all := tab.fromRefs(a.pid, []msgRef{{pid: 99}})
	r.hold(ha, timeZero, &tab, r.unresolved(&tab, all, &w, true))
	hs := make([]*held, 1000)
	for i := range hs {
		h := r.newHeld()
		h.ref = msgRef{pid: uint32(200 + i)}
		w.add(h.ref.pid)
		all := tab.fromRefs(h.ref.pid, []msgRef{a})
		lacks := r.unresolved(&tab, all, &w, false)
		require.False(t, lacks.empty())
		hs[i] = h
		r.hold(h, timeZero.Add(time.Duration(i)), &tab, lacks)
	}
	waiters := func() (n int, head *waitNode) {
		for k := ha.waiters; k != 0; k = r.nodes[k-1].next {
			n++
		}
		return n, &r.nodes[ha.waiters-1]
	}
	for i, h := range hs[:len(hs)-1] {
		_, head := waiters()
		ready := r.expire(timeZero.Add(time.Duration(i)), nil)
		require.Equal(t, []*held{h}, ready)
		n, after := waiters()
		require.Equal(t, len(hs)-i-1, n)
		require.Same(t, head, after, "release %d moved the waiters", i)
	}
}

// An application that does not read: empty unreliable messages are queued
// for it at no cost against ReceiveBuffer (recvQueue.used counts payload
// bytes only), each costing a recvEntry.
func TestPeerQueueingEmptyMessages(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		const buffer = 64 << 10
		l := nw.listen(t, &Config{ReceiveBuffer: buffer, DisconnectTimeout: 200 * time.Millisecond})
		p := nw.dialRaw(t, l.Addr())
		srv := serverConn(t, l)
		batch := make([]message, 450)
		for i := range batch {
			batch[i] = message{id: 6}
		}
		const datagrams = 400
		wire := 0
		for range datagrams {
			b := appendDatagram(nil, &datagram{header: header{packetID: p.next}, msgs: batch})
			wire += len(b)
			p.c.Write(b)
			p.next++
			if p.next%100 == 0 {
				synctest.Wait()
			}
		}
		synctest.Wait()
		srv.recvq.mu.Lock()
		n, c := srv.recvq.msgs.len(), cap(srv.recvq.msgs.entries)
		srv.recvq.mu.Unlock()
		entry := int(unsafe.Sizeof(recvEntry{}))
		t.Logf("%d datagrams, %d bytes on the wire: %d messages queued, entries cap %d (%d KiB); used %d; %+v", datagrams, wire, n, c, c*entry>>10, srv.recvUsed(), srv.Stats())
		assert.LessOrEqual(t, n*entry, buffer, "queued past ReceiveBuffer")
	})
}

// Held messages each naming 255 dependencies: a held record is charged
// heldRecordCost whatever its dependencies cost (its deps slice, and an
// entry in waiters, a map of slices, for each).
func TestPeerHoldingManyDependencies(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		const buffer = 1 << 20
		l := nw.listen(t, &Config{ReceiveBuffer: buffer, DisconnectTimeout: 200 * time.Millisecond})
		p := nw.dialRaw(t, l.Addr())
		srv := serverConn(t, l)
		multi := make([]byte, 255)
		deltas, indices := make([]uint16, 255), make([]uint16, 255)
		for i := range multi {
			multi[i] = byte(i)
			indices[i] = uint16(i)
		}
		msgs := []message{{id: 6, order: orderMulti, orderMulti: multi}, {id: 6, order: orderMulti, orderMulti: multi}}
		runtime.GC()
		runtime.GC()
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		const datagrams = 300
		wire := 0
		for range datagrams {
			p.next++ // Z: never sent; the entries name messages 0-254 of it
			b := appendDatagram(nil, &datagram{header: header{packetID: p.next, reliable: true, inOrder: true, deltas: deltas, indices: indices}, msgs: msgs})
			wire += len(b)
			p.c.Write(b)
			p.next++
			if p.next%64 == 0 {
				synctest.Wait()
			}
		}
		synctest.Wait()
		runtime.GC()
		runtime.GC() // pools keep what they held for one collection
		runtime.ReadMemStats(&after)
		st := srv.Stats()
		held := len(srv.sess.recv.res.held)
		grew := int64(after.HeapAlloc) - int64(before.HeapAlloc)
		t.Logf("%d datagrams (%d bytes each): %d held (charged %d), %d wait nodes; heap grew %d KiB; dropped datagrams %d",
			datagrams, wire/datagrams, held, srv.sess.recv.res.bytes, srv.sess.recv.res.usedNodes, grew>>10, st.DroppedDatagrams)
		// Held state may reach heldCap ReceiveBuffers, charged by an
		// estimate of its bookkeeping (heldDepCost); the heap it takes
		// stays within twice that. Before the dependencies were charged,
		// it took 60-64 MiB here.
		assert.LessOrEqual(t, grew, int64(2*heldCap*buffer), "held state past ReceiveBuffer")
	})
}

// Reliable fragmented messages naming a datagram never sent: each is
// reassembled (a transfer at a time, the oldest always may grow), then held
// whole, reliable, with no room check (handleOrderedDeps checks only
// unreliable ones). admits lets the FragmentStart's datagram in past a full
// buffer because another message in it (a reserved ID, ignored) has no
// dependencies and the application's queue has room; the other fragments
// have no dependencies at all.
func TestPeerHoldingReassembledMessages(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		const buffer = 64 << 10
		const size = 200 << 10
		l := nw.listen(t, &Config{ReceiveBuffer: buffer, MaxMessageSize: 256 << 10, DisconnectTimeout: 200 * time.Millisecond})
		p := nw.dialRaw(t, l.Addr())
		srv := serverConn(t, l)
		p.next++
		z := p.next // never sent
		p.next++
		const frag = 1200
		count := uint32(size / frag)
		payload := make([]byte, frag)
		const transfers = 6
		for k := range transfers {
			tid := uint8(k)
			start := &datagram{header: header{packetID: p.next, reliable: true, inOrder: true, deltas: []uint16{uint16(p.next - z - 1)}, indices: []uint16{0}},
				msgs: []message{{fragStart: true, fragment: true, id: 6, fragCount: count, transferID: tid, order: 1, payload: payload}, {id: 5}}}
			p.c.Write(appendDatagram(nil, start))
			p.next++
			for n := uint32(1); n < count; n++ {
				p.send(true, message{fragment: true, transferID: tid, fragNumber: n, payload: payload})
			}
			synctest.Wait()
		}
		st := srv.Stats()
		res := &srv.sess.recv.res
		t.Logf("%d transfers of %d bytes: %d held, %d bytes held (ReceiveBuffer %d); dropped datagrams %d, protocol errors %d",
			transfers, int(count)*frag, len(res.held), res.bytes, buffer, st.DroppedDatagrams, st.ProtocolErrors)
		require.NoError(t, srv.Err())
		assert.LessOrEqual(t, res.bytes, buffer+256<<10+2048, "held past ReceiveBuffer (plus one message)")
	})
}

// The reliable form of TestPeerHoldingEmptyMessages: reliable messages
// never give up and are held with no room check; admits lets each datagram
// in past a full buffer because one message in it (a reserved ID, ignored)
// has no dependencies.
func TestPeerHoldingReliableEmptyMessages(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		const buffer = 64 << 10
		l := nw.listen(t, &Config{ReceiveBuffer: buffer, DisconnectTimeout: 200 * time.Millisecond})
		p := nw.dialRaw(t, l.Addr())
		srv := serverConn(t, l)
		msgs := make([]message, 400)
		for i := range msgs {
			msgs[i] = message{id: 6, order: 1}
		}
		msgs = append(msgs, message{id: 5})
		const datagrams = 200
		wire := 0
		for range datagrams {
			p.next++ // the one named, never sent
			b := appendDatagram(nil, &datagram{header: header{packetID: p.next, reliable: true, inOrder: true, deltas: []uint16{0}, indices: []uint16{0}}, msgs: msgs})
			wire += len(b)
			p.c.Write(b)
			p.next++
			if p.next%64 == 0 {
				synctest.Wait()
			}
		}
		synctest.Wait()
		res := &srv.sess.recv.res
		t.Logf("%d datagrams, %d bytes: %d held, charged %d (ReceiveBuffer %d); dropped datagrams %d", datagrams, wire, len(res.held), res.bytes, buffer, srv.Stats().DroppedDatagrams)
		assert.LessOrEqual(t, res.bytes, buffer+2048*heldRecordCost, "held past ReceiveBuffer (plus one datagram)")
	})
}

// cppRawPeer opens a reference-dialect connection from a raw socket to a
// listener with the given ReceiveBuffer, and returns the server's Conn and
// a function that sends a datagram under the next PacketID (its size).
func cppRawPeer(t *testing.T, nw *testNet, buffer int) (*Conn, func(d *cppDatagram) int) {
	t.Helper()
	l := nw.listen(t, &Config{ReceiveBuffer: buffer, DisconnectTimeout: 200 * time.Millisecond, Dialect: DialectReference})
	c := nw.rawSocket(t, l.Addr())
	c.Write(cppOpening[:])
	buf := make([]byte, 2048)
	n, err := c.Read(buf)
	require.NoError(t, err)
	ping := cppPingOf(t, buf[:n])
	pid := uint32(1)
	send := func(d *cppDatagram) int {
		d.packetID = pid
		pid++
		b := appendCppDatagram(nil, d)
		c.Write(b)
		return len(b)
	}
	send(&cppDatagram{msgs: []cppMessage{{id: idPingReply, payload: []byte{ping}}}})
	return serverConn(t, l), send
}

// The reference dialect: a reliable datagram carrying the next reliable
// number expected (fills) is admitted whatever the buffer holds, with every
// other in-order message in it held for the numbers before it.
func TestCppPeerHoldingAheadOfNext(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		const buffer = 64 << 10
		srv, send := cppRawPeer(t, nw, buffer)
		payload := make([]byte, 120)
		next := uint32(0)
		const datagrams = 300
		wire := 0
		for k := range datagrams {
			d := &cppDatagram{cppHeader: cppHeader{reliable: true, inOrder: true, relBase: next}}
			d.msgs = append(d.msgs, cppMessage{reliable: true, inOrder: true, relNum: next, id: 6})
			for j := range 10 {
				d.msgs = append(d.msgs, cppMessage{reliable: true, inOrder: true, relNum: next + 16000 + uint32(k*10+j)%16000, id: 6, payload: payload})
			}
			wire += send(d)
			next++
			if k%64 == 0 {
				synctest.Wait()
			}
		}
		synctest.Wait()
		w := srv.sess.wire.(*cppWire)
		st := srv.Stats()
		t.Logf("%d datagrams, %d bytes: %d held, relHeldBytes %d (ReceiveBuffer %d); delivered %d, dropped datagrams %d, dup msgs %d",
			datagrams, wire, len(w.relHeld), w.relHeldBytes, buffer, st.MessagesReceived, st.DroppedDatagrams, st.DuplicateMessages)
		require.NoError(t, srv.Err())
		// At most heldCap ReceiveBuffers and one datagram: 2.76 MB were
		// held here before the limit.
		assert.LessOrEqual(t, w.relHeldBytes, heldCap*buffer+2048, "held past ReceiveBuffer")
	})
}

// The reference dialect: a reliable datagram carrying the next reliable
// number is admitted however full the receive queue is, so a peer sending
// in order without waiting for acks fills the queue of an application that
// does not read without bound.
func TestCppPeerFillingReceiveQueue(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		const buffer = 64 << 10
		srv, send := cppRawPeer(t, nw, buffer)
		payload := make([]byte, 1300)
		// 400 datagrams of 1,300 bytes: eight times the buffer. (With
		// -knet.park=1ms each one lets the bubble's clock run and the
		// workers park, which makes thousands slow under -race.)
		const datagrams = 400
		wire := 0
		for k := range datagrams {
			rel := uint32(k)
			wire += send(&cppDatagram{cppHeader: cppHeader{reliable: true, relBase: rel}, msgs: []cppMessage{{reliable: true, inOrder: k%2 == 0, relNum: rel, id: 6, payload: payload}}})
			if k%64 == 0 {
				synctest.Wait()
			}
		}
		synctest.Wait()
		st := srv.Stats()
		t.Logf("%d datagrams, %d bytes: receive queue %d bytes (ReceiveBuffer %d); delivered %d, dropped datagrams %d",
			datagrams, wire, srv.recvUsed(), buffer, st.MessagesReceived, st.DroppedDatagrams)
		assert.LessOrEqual(t, srv.recvUsed(), buffer+2048, "queued past ReceiveBuffer (plus one datagram)")
	})
}

// What held messages wait for gets in past a full buffer whatever its ID:
// an in-order message may name an empty message of ID 5 (an anchor), and a
// datagram carrying it must be taken even when another message in it must
// wait, or the held messages wait behind it for ever. The peer here sends
// the anchor's datagram last.
func TestHeldWaitOnAnchorPastFullBuffer(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memNet(t)
		const buffer = 64 << 10
		l := nw.listen(t, &Config{ReceiveBuffer: buffer, DisconnectTimeout: 200 * time.Millisecond})
		p := nw.dialRaw(t, l.Addr())
		srv := serverConn(t, l)
		z := p.next // never sent
		p.next++
		a := p.next // the anchor's datagram, sent after the others
		p.next++
		payload := make([]byte, 1000)
		const datagrams = 100 // 100 KB held: past the buffer
		for range datagrams {
			d := &datagram{header: header{packetID: p.next, reliable: true, inOrder: true, deltas: []uint16{uint16(p.next - a - 1)}, indices: []uint16{0}},
				msgs: []message{{id: 6, order: 1, payload: payload}}}
			p.c.Write(appendDatagram(nil, d))
			p.next++
		}
		synctest.Wait()
		require.Positive(t, srv.Stats().DroppedDatagrams, "the buffer did not fill")
		// The anchor comes with a message of its own that waits for a
		// datagram never sent: alone, a datagram with nothing for the
		// application always gets in.
		p.c.Write(appendDatagram(nil, &datagram{header: header{packetID: a, reliable: true, inOrder: true, deltas: []uint16{uint16(a - z - 1)}, indices: []uint16{0}},
			msgs: []message{{id: idPadding}, {id: 6, order: 1, payload: payload}}}))
		ctx := within(t, 5*time.Second)
		m, err := srv.Receive(ctx)
		require.NoError(t, err, "the held messages never came out")
		assert.Equal(t, uint32(6), m.ID)
	})
}

// cppPingOf returns the ID of the PingRequest in b, a reference-dialect
// server's answer to the opening: what the client's PingReply must echo
// (takeProof).
func cppPingOf(t testing.TB, b []byte) byte {
	t.Helper()
	var d cppDatagram
	require.NoError(t, parseCppInto(b, &d))
	for _, m := range d.msgs {
		if !m.fragment && m.id == idPingRequest && len(m.payload) == 1 {
			return m.payload[0]
		}
	}
	t.Fatalf("no PingRequest in the answer % x", b)
	return 0
}

// An unreliable message whose datagram names more than maxAbsentPIDs
// datagrams not arrived gives up on them at once (no record each, issue 38);
// one naming maxAbsentPIDs waits its reorder window for them, as before.
func TestPeerNamingManyAbsentDatagrams(t *testing.T) {
	for _, absent := range []int{maxAbsentPIDs, maxAbsentPIDs + 1} {
		synctest.Test(t, func(t *testing.T) {
			nw := memNet(t)
			l := nw.listen(t, &Config{ReorderWindow: 100 * time.Millisecond, DisconnectTimeout: 200 * time.Millisecond})
			p := nw.dialRaw(t, l.Addr())
			srv := serverConn(t, l)
			p.next += uint32(absent) // never sent
			deltas, indices, multi := make([]uint16, absent), make([]uint16, absent), make([]byte, absent)
			for i := range deltas {
				deltas[i], multi[i] = uint16(i), byte(i)
			}
			b := appendDatagram(nil, &datagram{header: header{packetID: p.next, inOrder: true, deltas: deltas, indices: indices}, msgs: []message{{id: 6, order: orderMulti, orderMulti: multi}}})
			p.next++
			p.c.Write(b)
			synctest.Wait()
			queued := func() int {
				srv.recvq.mu.Lock()
				defer srv.recvq.mu.Unlock()
				return srv.recvq.msgs.len()
			}
			if absent > maxAbsentPIDs {
				assert.Equal(t, 1, queued(), "%d datagrams not arrived: given up on at once", absent)
				if ds := srv.sess.recv.res.depState; ds != nil {
					assert.Empty(t, ds.pids, "records made")
				}
				return
			}
			assert.Equal(t, 0, queued(), "%d datagrams not arrived: waits", absent)
			time.Sleep(150 * time.Millisecond)
			synctest.Wait()
			assert.Equal(t, 1, queued(), "%d datagrams not arrived: given up on after the reorder window", absent)
		})
	}
}
