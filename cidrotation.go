package knet

import (
	"encoding/binary"
	"errors"
	"math"
	"net/netip"
	"sync/atomic"
	"time"
)

// Connection ID rotation (SECURE.md, "Migration"; docs/PROTOCOL.md 7.7):
// a secure client that changes networks can make its next datagrams carry
// a connection ID that an observer cannot link to the one before.
//
// The server hands its client spare connection IDs, each numbered (its
// sequence number: 0 is the handshake's ID, spares count up from 1), each
// drawn as the first one was (pickCID: Config.ServerID, then random), so
// each is routable by a balancer, and registered for the connection in
// Listener.cids. The client asks for them (cidWant, a sealed path message,
// with the highest sequence number it holds) and the server answers with
// those it holds above it (cidNew), drawing new ones up to maxSpareCIDs
// beyond the one in use. Conn.RotateConnectionID makes the client's next
// datagram carry its lowest spare, never used before; the server, once a
// datagram under a spare authenticates, retires every ID numbered below
// it (they leave Listener.cids: a datagram still carrying one goes
// nowhere), and the client asks for more. A connection so holds at most
// 1+maxSpareCIDs IDs, whatever its client asks.
//
// The nonce: a datagram sealed under the ID numbered q has the AES-GCM
// nonce q (u32 big-endian) then its packet number (u64 big-endian), where
// it was 32 zero bits before (q = 0, the handshake's ID, is unchanged). A
// datagram sent again after a switch carries the new ID in its associated
// data: under the same nonce, two tags of one key and nonce over different
// associated data would give away GCM's authentication key. Each
// (sequence number, packet number) seals one plaintext under one ID.
//
// What still links the two paths: the packet numbers (the clear
// PacketIDs of both directions go on across the switch), and the timing.
// See SECURE.md.

const (
	// Path message kinds of rotation (session_path.go has 1 and 2).
	pathNewCIDs  = 3 // server: u32 first sequence, u8 count, count u32 IDs
	pathWantCIDs = 4 // client: u32 highest sequence number held
	// maxSpareCIDs is how many unused IDs a connection may hold beyond
	// the one in use.
	maxSpareCIDs = 2
	// maxCIDMessage is the longest rotation path message.
	maxCIDMessage = 1 + 4 + 1 + 4*maxSpareCIDs
	// maxUnansweredAsks bounds a client's asks to a server that never
	// answers (one without rotation, which ignores them): after this many
	// in a row it asks no more until it switches.
	maxUnansweredAsks = 5
)

// ErrNoSpareConnectionID is Conn.RotateConnectionID's error when the
// client holds no unused connection ID: the server has not handed any yet
// (one without connection ID rotation never does), or the client used
// them all and the server's next have not come.
var ErrNoSpareConnectionID = errors.New("knet: no spare connection ID: the server has handed none yet")

var errNoRotation = errors.New("knet: connection ID rotation is for a secure client over UDP (Config.ServerKey)")

// spareCID is a connection ID and its sequence number.
type spareCID struct{ seq, id uint32 }

// cidRotation is a secure connection's side of rotation, owned by its
// rounds but for want and held.
type cidRotation struct {
	seq    uint32     // the sequence number of secureState.cid, the ID in use
	spares []spareCID // unused, by rising sequence number
	// A server's: the next sequence number to draw; that of the ID the
	// datagram open authenticated last bears.
	next, opened uint32
	// A server's: an ask to answer once the client's new address is
	// checked (the answer goes to the connection's address only), and
	// the sequence number it held.
	owe     bool
	oweHeld uint32
	// A client's: when it last asked, and how many asks went unanswered.
	asked      time.Time
	unanswered int
	want       atomic.Bool  // Conn.RotateConnectionID asked for a switch
	held       atomic.Int32 // len(spares), for RotateConnectionID
	switches   atomic.Uint64
}

// RotateConnectionID makes a secure client's next datagrams carry a
// connection ID it never used, one of the spares the server handed it:
// nothing in the ID links it to the ones before (the server ID of
// Config.ServerID aside, which they share). Call it when the client
// changes networks (a phone leaving Wi-Fi), before it sends from there:
// the server follows the client to its new address as ever (Stats.Migrations)
// and retires the old ID once the new one comes. Calls before the next
// datagram goes count once. It fails with ErrNoSpareConnectionID when the
// client holds no spare (the server hands them out a round trip after the
// connection opened, and again a round trip after each switch), and for a
// server's connection, a plaintext one or a stream. The packet numbers in
// clear still link the datagrams before and after (see SECURE.md).
func (c *Conn) RotateConnectionID() error {
	if c.st != nil || c.sec == nil || !c.sec.initiator {
		return errNoRotation
	}
	if c.sec.rot.held.Load() == 0 {
		return ErrNoSpareConnectionID
	}
	c.sec.rot.want.Store(true)
	c.kick()
	return nil
}

// rotateIfAsked switches a client to its next spare ID if the application
// asked (RotateConnectionID), before a datagram is sealed.
func (c *Conn) rotateIfAsked() {
	s := c.sec
	if s == nil || !s.initiator || !s.rot.want.Load() || !s.ready.Load() {
		return
	}
	s.rot.want.Store(false)
	r := &s.rot
	if len(r.spares) == 0 {
		return
	}
	next := r.spares[0]
	r.spares = append(r.spares[:0], r.spares[1:]...)
	r.held.Store(int32(len(r.spares)))
	s.cid, r.seq = next.id, next.seq
	binary.BigEndian.PutUint32(s.sendNonce[:4], next.seq)
	r.asked, r.unanswered = time.Time{}, 0 // ask for more at once
	r.switches.Add(1)
}

// openCID reports whether id, the connection ID of a datagram to a
// server's connection, is one of the connection's live IDs, and sets the
// nonce's first bytes to its sequence number for the datagram's opening.
func (s *secureState) openCID(id uint32) bool {
	r := &s.rot
	seq, ok := r.seq, id == s.cid
	for _, sp := range r.spares {
		if !ok && sp.id == id {
			seq, ok = sp.seq, true
		}
	}
	if !ok {
		return false
	}
	r.opened = seq
	binary.BigEndian.PutUint32(s.recvNonce[:4], seq)
	return true
}

// cidSeen runs on a server's connection after a datagram authenticated:
// if it bore a spare, the client switched to it, and the IDs numbered
// below it are retired.
func (c *Conn) cidSeen() {
	s := c.sec
	r := &s.rot
	if r.opened <= r.seq {
		return
	}
	var retired [1 + maxSpareCIDs]uint32
	n := 0
	retired[n], n = s.cid, n+1
	kept := r.spares[:0]
	for _, sp := range r.spares {
		switch {
		case sp.seq < r.opened:
			retired[n], n = sp.id, n+1
		case sp.seq == r.opened:
			s.cid, r.seq = sp.id, sp.seq
		default:
			kept = append(kept, sp)
		}
	}
	r.spares = kept
	r.switches.Add(1)
	if l := c.ep.l; l != nil {
		l.retireCIDs(c, retired[:n])
	}
}

// cidMessages takes the rotation message the datagram just handled
// carried, if any (a server answers an ask, once no new address of its
// client is being checked; a client keeps the IDs handed), then has a
// client ask for spares when it lacks them.
func (c *Conn) cidMessages(now time.Time) {
	if c.st != nil || !c.isEstablished() {
		return
	}
	m := c.sess.cidMessage()
	switch {
	case m == nil:
	case c.sec.initiator && m[0] == pathNewCIDs:
		c.sec.takeSpares(m)
	case !c.sec.initiator && m[0] == pathWantCIDs && len(m) == 5:
		c.sec.rot.owe, c.sec.rot.oweHeld = true, binary.LittleEndian.Uint32(m[1:])
	}
	if r := &c.sec.rot; r.owe && !c.sec.path.to.IsValid() {
		// Not while a new address is checked: the ask likely came
		// from there, and the answer would go to the one it left.
		r.owe = false
		c.answerWant(r.oweHeld)
	}
	if c.sec.initiator {
		c.askSpares(now)
	}
}

// takeSpares keeps the IDs of a cidNew message m from the server, those
// numbered above every ID the client holds, up to maxSpareCIDs. A
// malformed message changes nothing.
func (s *secureState) takeSpares(m []byte) {
	if len(m) < 6 {
		return
	}
	first, count := binary.LittleEndian.Uint32(m[1:]), int(m[5])
	if count < 1 || count > maxSpareCIDs || len(m) != 6+4*count || first == 0 || first > math.MaxUint32-uint32(count) {
		return
	}
	r := &s.rot
	r.unanswered = 0
	for i := range count {
		seq, id := first+uint32(i), binary.LittleEndian.Uint32(m[6+4*i:])
		if id == 0 || seq <= r.highest() || len(r.spares) >= maxSpareCIDs {
			continue
		}
		r.spares = append(r.spares, spareCID{seq, id})
	}
	r.held.Store(int32(len(r.spares)))
}

// highest is the highest sequence number the connection holds.
func (r *cidRotation) highest() uint32 {
	if n := len(r.spares); n > 0 {
		return r.spares[n-1].seq
	}
	return r.seq
}

// askSpares sends the server a cidWant when the client lacks spares: at
// most one a round-trip timeout, and no more than maxUnansweredAsks in a
// row that bring nothing.
func (c *Conn) askSpares(now time.Time) {
	r := &c.sec.rot
	if len(r.spares) >= maxSpareCIDs || r.unanswered >= maxUnansweredAsks ||
		!r.asked.IsZero() && now.Sub(r.asked) < c.sess.rto() {
		return
	}
	var content [5]byte
	content[0] = pathWantCIDs
	binary.LittleEndian.PutUint32(content[1:], r.highest())
	if c.sendPath(content[:], c.raddr) {
		r.asked = now
		r.unanswered++
	}
}

// answerWant answers a client's cidWant: the server draws spares up to
// maxSpareCIDs beyond the ID in use and sends those numbered above held,
// to the connection's address (never to one being checked).
func (c *Conn) answerWant(held uint32) {
	s := c.sec
	r := &s.rot
	l := c.ep.l
	if l == nil {
		return
	}
	for len(r.spares) < maxSpareCIDs {
		id, ok := l.spareCID(c)
		if !ok {
			break
		}
		if r.next == 0 {
			r.next = 1
		}
		r.spares = append(r.spares, spareCID{r.next, id})
		r.next++
	}
	var content [maxCIDMessage]byte
	content[0] = pathNewCIDs
	m := content[:6]
	count := 0
	for _, sp := range r.spares {
		if sp.seq <= held {
			continue
		}
		if count == 0 {
			binary.LittleEndian.PutUint32(m[1:], sp.seq)
		}
		m = binary.LittleEndian.AppendUint32(m, sp.id)
		count++
	}
	if count == 0 {
		return
	}
	m[5] = byte(count)
	c.sendPath(m, c.raddr)
}

// sendPath sends a path message with content to the address to, in a
// new sealed datagram of its own, and reports whether it went (not when no
// new datagram may go now: session.spanFull).
func (c *Conn) sendPath(content []byte, to netip.AddrPort) bool {
	buf := make([]byte, 0, minHeaderSize+4+len(content)+wireOverhead)
	b := c.sess.pathChallenge(buf, content)
	if b == nil {
		return false
	}
	out := c.sess.lastOut()
	b, err := c.sec.seal(b, b, out.pn, out.fresh)
	if err != nil {
		c.sess.fail(err)
		return false
	}
	c.ep.write(b, to)
	return true
}

// Listener side.

// spareCID draws a spare connection ID for c and registers it, as newCID
// does the first. ok is false when the IDs are few: a Config.ServerID of
// 3 bytes leaves 256, which stay for connections; with 2 bytes, spares
// are drawn while fewer than a quarter of the IDs are taken, so that they
// cost new connections little of the space.
func (l *Listener) spareCID(c *Conn) (id uint32, ok bool) {
	l.cidMu.Lock()
	defer l.cidMu.Unlock()
	if space := cidSpace(l.cfg.serverID); space < 1<<16 || int64(len(l.cids)) >= space/4 {
		return 0, false
	}
	id, ok = pickCID(l.cfg.serverID, func(id uint32) bool { return l.cids[id] != nil })
	if ok {
		l.cids[id] = c
	}
	return id, ok
}

// retireCIDs forgets ids, connection IDs of c.
func (l *Listener) retireCIDs(c *Conn, ids []uint32) {
	l.cidMu.Lock()
	for _, id := range ids {
		if l.cids[id] == c {
			delete(l.cids, id)
		}
	}
	l.cidMu.Unlock()
}

// dropSpares forgets c's spare connection IDs, as it ends (dropCID).
func (l *Listener) dropSpares(c *Conn) {
	var ids [maxSpareCIDs]uint32
	n := 0
	for _, sp := range c.sec.rot.spares {
		ids[n], n = sp.id, n+1
	}
	l.retireCIDs(c, ids[:n])
}
