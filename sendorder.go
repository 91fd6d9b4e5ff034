package knet

import "time"

// The sender's side of ordering (spec "InOrder Datagrams and Messages",
// DECISIONS §5): the messages later ones may depend on (tracks), and what
// each queued message depends on through its channel, its DependsOn and
// its ContentID. session_deps.go names those dependencies on the wire.

// track follows a message that later messages may depend on: every InOrder
// message, every message sent with SendRef and every unreliable message with
// a ContentID. Tracks are recycled once resolved; a depOn whose ref no longer
// matches its track's names a message already resolved.
type track struct {
	ref      Ref
	reliable bool
	inOrder  bool
	channel  uint8
	hasKey   bool
	key      contentKey
	explicit bool // in byRef
	// relLatest marks a reliable latest-state version (latest.go): what
	// names it waits at the sender until it is acked, as its datagram
	// may never be resent.
	relLatest bool

	packed     bool   // its (first) message block has been placed
	at         msgRef // where
	wire       []msgRef
	lastPID    uint32 // datagram of its last fragment
	relLast    uint32 // reliable number of its last fragment (the reference dialect)
	complete   bool   // every fragment placed
	fragmented bool
	dropped    bool // superseded or dropped before sending
	sentAt     time.Time
	// deps are the messages it waits for at the receiver, as of its
	// packing; resolved records that it and all of them are known applied.
	deps     []depOn
	resolved bool
	prev     depOn // the previous version of its state (ContentID)
}

// depOn is a dependency of a queued message on a tracked one.
type depOn struct {
	t   *track
	ref Ref
	// hard marks an unreliable message's dependency on a reliable one
	// that it must never arrive before (one it names in DependsOn, or an
	// earlier version of its state sent fragmented): it is sent only once
	// that one is known applied, since a receiver gives up on a missing
	// dependency of an unreliable message after its reorder window.
	hard bool
}

// live returns the track if it still follows the message depended on.
func (d depOn) live() *track {
	if d.t != nil && d.t.ref == d.ref {
		return d.t
	}
	return nil
}

// contentBackRefs is how many earlier versions of its state, sent in one
// datagram each, a latest-state message may name (the sender leaves out
// those sent too long ago to be overtaken); maxContentWalk bounds the
// versions looked at for them.
const (
	contentBackRefs = 8
	maxContentWalk  = 16
)

type contentKey struct {
	id, content uint32
}

// sendOrder turns channels and explicit dependencies into dependencies on
// tracked messages (DECISIONS §5, sender).
type sendOrder struct {
	byRef  map[Ref]*track // messages sent with SendRef
	fifo   []*track       // in Ref order, for forgetting resolved ones
	fifoAt int
	chans  []chanTails // the channels with a live tail, few as a rule
	latest map[contentKey]depOn
	free   freeList[*track]
}

// chanTails are the last messages of one channel.
type chanTails struct {
	channel uint8
	rel     depOn // reliable InOrder
	any     depOn // InOrder of either kind
	unrel   depOn // unreliable InOrder
}

// tails returns the channel's tails, nil if it has none.
//
// A connection uses few channels at a time, and a channel's entry goes
// once its tails are all forgotten: a short list searched in order costs
// less than an array of all 256 (18 KiB per connection), even when many
// channels are busy.
func (o *sendOrder) tails(channel uint8) *chanTails {
	for i := range o.chans {
		if o.chans[i].channel == channel {
			return &o.chans[i]
		}
	}
	return nil
}

// add registers a newly queued message, in send order, and fills m.deps with
// what it depends on: its channel predecessor, the messages it names, and the
// previous unreliable messages with its ID and ContentID.
//
// A message too large for one datagram travels reliably (spec "Fragmented
// Transfers", 3) and is ordered as a reliable one: on the wire a reliable
// message cannot depend on an unreliable one, which may never arrive, so
// it does not name unreliable messages, and those naming it wait at the
// sender until it is applied.
func (o *sendOrder) add(m *outMsg) {
	m.deps = m.deps[:0]
	reliable := m.reliable || m.frag
	var ch *chanTails
	if m.inOrder {
		if ch = o.tails(m.channel); ch == nil {
			o.chans = append(o.chans, chanTails{channel: m.channel})
			ch = &o.chans[len(o.chans)-1]
		}
		if reliable {
			m.deps = appendLive(m.deps, ch.rel)
		} else {
			// After the channel's last message of either kind, and its
			// last unreliable one, so that the unreliable messages form
			// a chain the receiver can keep in sequence.
			m.deps = appendLive(m.deps, ch.any)
			if ch.unrel != ch.any {
				m.deps = appendLive(m.deps, ch.unrel)
			}
		}
	}
	for _, r := range m.after {
		if t := o.byRef[r]; t != nil && (t.reliable || !reliable) {
			m.deps = append(m.deps, depOn{t: t, ref: r, hard: !reliable && t.reliable || t.relLatest})
		}
	}
	// Untagged latest state (in order or naming others, or the
	// reference dialect's): named back-references. A tagged version
	// (m.version, latest.go) names nothing: its number orders it.
	hasKey := m.contentID != 0 && !m.reliable && m.version == 0
	var key contentKey
	var prev depOn
	if hasKey {
		// Latest state: name the last few versions, so that the
		// receiver knows an older one for older even when the one just
		// before was lost, and marks it as replacing them. One that
		// travelled reliably (fragmented) must be applied first.
		key = contentKey{m.id, m.contentID}
		prev = o.latest[key]
		for t := prev.live(); t != nil && t.dropped; t = prev.live() {
			prev = t.prev // replaced before it went: not a version sent
		}
		// The newest version that travelled reliably, and unless this
		// one does too, the last few that did not.
		named, seenReliable := 0, false
		for d, k := prev, 0; k < maxContentWalk && named < contentBackRefs; k++ {
			t := d.live()
			if t == nil {
				break
			}
			switch {
			case t.reliable && !seenReliable:
				seenReliable = true
				d.hard = !reliable
				m.deps = append(m.deps, d)
			case !t.reliable && !reliable:
				m.deps = append(m.deps, d)
				named++
			}
			if reliable && seenReliable {
				break
			}
			d = t.prev
		}
		m.latest = !m.inOrder && len(m.after) == 0 && !reliable
	}
	if !m.tracked && !m.inOrder && !hasKey && !m.keep { // a kept message's tells when it is delivered (unacked.go)
		m.track = nil
		return
	}
	t, ok := o.free.get()
	if !ok {
		t = new(track)
	}
	*t = track{ref: m.ref, reliable: reliable, inOrder: m.inOrder, channel: m.channel,
		hasKey: hasKey, key: key, explicit: m.tracked, relLatest: m.relLatest, wire: t.wire[:0], deps: t.deps[:0], prev: prev}
	m.track = t
	o.fifo = append(o.fifo, t)
	if m.tracked {
		if o.byRef == nil {
			o.byRef = make(map[Ref]*track)
		}
		o.byRef[m.ref] = t
	}
	d := depOn{t: t, ref: m.ref}
	if ch != nil {
		if reliable {
			ch.rel = d
		} else {
			ch.unrel = d
		}
		ch.any = d
	}
	if hasKey {
		if o.latest == nil {
			o.latest = make(map[contentKey]depOn)
		}
		o.latest[key] = d
	}
}

func appendLive(deps []depOn, d depOn) []depOn {
	if d.live() != nil {
		deps = append(deps, d)
	}
	return deps
}

// tracking reports whether any track is live.
func (o *sendOrder) tracking() bool { return o.fifoAt < len(o.fifo) }

// forget recycles tracks that no later message needs: resolved ones, in
// order.
func (o *sendOrder) forget(resolved func(t *track) bool) {
	for o.fifoAt < len(o.fifo) {
		t := o.fifo[o.fifoAt]
		if !t.dropped && !resolved(t) {
			break
		}
		o.fifo[o.fifoAt] = nil
		o.fifoAt++
		o.drop(t)
	}
	if o.fifoAt > 64 && o.fifoAt*2 > len(o.fifo) {
		n := copy(o.fifo, o.fifo[o.fifoAt:])
		clear(o.fifo[n:])
		o.fifo = o.fifo[:n]
		o.fifoAt = 0
	}
}

func (o *sendOrder) drop(t *track) {
	if t.explicit {
		delete(o.byRef, t.ref)
	}
	if t.inOrder {
		o.dropTail(t)
	}
	if t.hasKey && o.latest[t.key].t == t {
		delete(o.latest, t.key)
	}
	t.ref = 0 // any depOn still naming it now reads as resolved
	o.free.put(t, 0)
}

// dropTail clears t from its channel's tails.
func (o *sendOrder) dropTail(t *track) {
	ch := o.tails(t.channel)
	if ch == nil {
		return
	}
	for _, d := range [...]*depOn{&ch.rel, &ch.any, &ch.unrel} {
		if d.t == t {
			*d = depOn{}
		}
	}
	if ch.rel.t == nil && ch.any.t == nil && ch.unrel.t == nil {
		// Nothing left to order after: the entry goes, as good as
		// tails all resolved.
		last := len(o.chans) - 1
		*ch = o.chans[last]
		o.chans[last] = chanTails{}
		o.chans = o.chans[:last]
	}
}

// trim lets go of storage unused since it last ran (see session.tidy).
func (o *sendOrder) trim() {
	o.free.trim()
	if o.fifoAt == len(o.fifo) {
		o.fifo, o.fifoAt = nil, 0
	}
	if len(o.chans) == 0 {
		o.chans = nil
	}
	// Emptied maps keep their buckets.
	if len(o.byRef) == 0 {
		o.byRef = nil
	}
	if len(o.latest) == 0 {
		o.latest = nil
	}
}

// reset forgets everything.
func (o *sendOrder) reset() {
	for _, t := range o.fifo[o.fifoAt:] {
		if t != nil {
			t.ref = 0
		}
	}
	o.fifo, o.fifoAt, o.free = nil, 0, freeList[*track]{}
	o.chans = nil
	clear(o.byRef)
	clear(o.latest)
}
