package knet

// recvQueue holds received messages until the application takes them.
// Payloads sit back to back in one arena, except those handed over in a
// pooled buffer of their own (a reassembled large message), which the queue
// keeps rather than copy.
type recvQueue struct {
	entries []recvEntry
	head    int
	arena   []byte
	start   int // arena bytes before start are consumed
	owned   int // unread bytes of the entries with their own buffer
	// bufs holds those buffers (made with the first), so that entries
	// keep no pointer: queueing one is a plain copy.
	bufs *recvBufs
	// The most entries and arena bytes in use since the last trim.
	peakEntries, peakBytes int32
}

// recvBufs is the buffers of the queue's entries that have their own, in
// the order of their entries; those before done are read.
type recvBufs struct {
	b    []*[]byte
	done int
}

type recvEntry struct {
	id       uint32
	reliable bool
	inOrder  bool
	own      int32 // the payload's own pooled buffer, bufs.b[own-1]; 0: in arena
	off, n   int
}

func (q *recvQueue) len() int { return len(q.entries) - q.head }

func (q *recvQueue) used() int { return len(q.arena) - q.start + q.owned }

// recvEntryCost is what each queued message costs beyond its payload.
const recvEntryCost = 48

// charged is what the queue counts against ReceiveBuffer: its payload
// bytes and recvEntryCost for each message. A peer's empty messages, to an
// application that does not read, were queued at no cost: 900,000 of them
// from 2,000 datagrams, 42 MiB with a 64 KiB ReceiveBuffer
// (TestPeerQueueingEmptyMessages).
func (q *recvQueue) charged() int { return q.used() + q.len()*recvEntryCost }

// pushOwned queues payload, which is (*buf)[:len(payload)], keeping buf:
// the queue puts it back in the pool once the message is read, unless
// take gives it to the application.
func (q *recvQueue) pushOwned(id uint32, payload []byte, buf *[]byte, reliable, inOrder bool) {
	if q.bufs == nil {
		q.bufs = new(recvBufs)
	}
	bs := q.bufs
	if bs.done > 64 && bs.done > len(bs.b)/2 {
		// Forget the buffers read.
		n := copy(bs.b, bs.b[bs.done:])
		clear(bs.b[n:])
		bs.b = bs.b[:n]
		for i := q.head; i < len(q.entries); i++ {
			if q.entries[i].own != 0 {
				q.entries[i].own -= int32(bs.done)
			}
		}
		bs.done = 0
	}
	bs.b = append(bs.b, buf)
	q.entries = append(q.entries, recvEntry{id: id, n: len(payload), own: int32(len(bs.b)), reliable: reliable, inOrder: inOrder})
	q.owned += len(payload)
}

func (q *recvQueue) push(id uint32, payload []byte, reliable, inOrder bool) {
	q.compact()
	q.add(id, payload, reliable, inOrder)
	q.peaks()
}

// compact moves the arena's unread bytes to its start once most of it is
// read; add queues a message in the arena, and peaks notes the most used,
// once a batch is added.
func (q *recvQueue) compact() {
	if q.start > 64<<10 && q.start > len(q.arena)/2 {
		n := copy(q.arena, q.arena[q.start:])
		q.arena = q.arena[:n]
		for i := q.head; i < len(q.entries); i++ {
			if q.entries[i].own == 0 {
				q.entries[i].off -= q.start
			}
		}
		q.start = 0
	}
}

func (q *recvQueue) add(id uint32, payload []byte, reliable, inOrder bool) {
	q.entries = append(q.entries, recvEntry{id: id, off: len(q.arena), n: len(payload), reliable: reliable, inOrder: inOrder})
	if len(payload) > 0 {
		q.arena = append(q.arena, payload...)
	}
}

func (q *recvQueue) peaks() {
	q.peakEntries = max(q.peakEntries, int32(min(len(q.entries), 1<<31-1)))
	q.peakBytes = max(q.peakBytes, int32(min(len(q.arena), 1<<31-1)))
}

// trim lets go of the storage of an empty queue when it is much more than
// the queue used since trim last ran, or the queue was not used: steady
// traffic keeps what it uses, a burst's storage goes once the burst is
// over, an idle connection's altogether.
func (q *recvQueue) trim() {
	if q.len() == 0 {
		if q.peakEntries == 0 || cap(q.arena) > 2*int(q.peakBytes)+256 {
			q.arena, q.start = nil, 0
		}
		if q.peakEntries == 0 || cap(q.entries) > 2*int(q.peakEntries)+8 {
			q.entries, q.head = nil, 0
		}
	}
	q.peakEntries, q.peakBytes = 0, 0
}

func (q *recvQueue) peek() *recvEntry { return &q.entries[q.head] }

func (q *recvQueue) bytes(e *recvEntry) []byte {
	if e.own != 0 {
		return (*q.bufs.b[e.own-1])[e.off : e.off+e.n]
	}
	return q.arena[e.off : e.off+e.n]
}

// take pops the head entry, returning a copy of its payload, or the
// payload's own buffer, which is then the application's.
func (q *recvQueue) take(e *recvEntry) []byte {
	if e.own != 0 {
		p := q.bytes(e)
		q.owned -= e.n
		q.bufs.b[e.own-1] = nil
		q.bufs.done++
		e.own = 0
		q.advance()
		return p
	}
	p := append([]byte(nil), q.bytes(e)...)
	if p == nil {
		p = []byte{}
	}
	q.pop()
	return p
}

func (q *recvQueue) pop() {
	e := &q.entries[q.head]
	if e.own != 0 {
		q.owned -= e.n
		putPayload(q.bufs.b[e.own-1])
		q.bufs.b[e.own-1] = nil
		q.bufs.done++
		e.own = 0
	} else {
		q.start = e.off + e.n
	}
	q.advance()
}

// advance drops the head entry, whose bytes are accounted for.
func (q *recvQueue) advance() {
	q.head++
	if q.head == len(q.entries) {
		q.entries = q.entries[:0]
		q.head = 0
		q.arena = q.arena[:0]
		q.start = 0
		if q.bufs != nil {
			q.bufs.b, q.bufs.done = q.bufs.b[:0], 0 // all read, nil
		}
		if cap(q.arena) > 1<<20 {
			q.arena = nil // give a burst's memory back
		}
	}
}

// has reports whether a message of ID id waits.
func (q *recvQueue) has(id uint32) bool {
	for i := q.head; i < len(q.entries); i++ {
		if q.entries[i].id == id {
			return true
		}
	}
	return false
}

// read copies the payload bytes of the messages of ID id into p, across
// messages, skipping empty ones; messages of other IDs stay in their place.
func (q *recvQueue) read(p []byte, id uint32) int {
	n := 0
	for n < len(p) && q.len() > 0 {
		e := q.peek()
		if e.id != id {
			k := q.readBehind(p[n:], id)
			if k < 0 {
				break
			}
			n += k
			continue
		}
		k := copy(p[n:], q.bytes(e))
		n += k
		if k == e.n {
			q.pop()
		} else {
			e.off += k
			e.n -= k
			if e.own != 0 {
				q.owned -= k
			} else {
				q.start = e.off
			}
		}
	}
	return n
}

// readBehind is read from the first message of ID id behind the head, or -1
// if there is none. It is for a Read that finds messages of other IDs
// ahead (the peer sent them for Receive), so it may take its time: a
// message read out is cut from the entries; its bytes in the arena count
// until the head passes them.
func (q *recvQueue) readBehind(p []byte, id uint32) int {
	i := q.head + 1
	for i < len(q.entries) && q.entries[i].id != id {
		i++
	}
	if i == len(q.entries) {
		return -1
	}
	e := &q.entries[i]
	k := copy(p, q.bytes(e))
	if k < e.n {
		e.off += k
		e.n -= k
		if e.own != 0 {
			q.owned -= k
		}
		return k
	}
	if e.own != 0 {
		// Its slot in bufs stays, empty, until the queue empties: bufs.done
		// counts the slots read from the front.
		q.owned -= e.n
		putPayload(q.bufs.b[e.own-1])
		q.bufs.b[e.own-1] = nil
	}
	copy(q.entries[i:], q.entries[i+1:])
	q.entries = q.entries[:len(q.entries)-1]
	return k
}
