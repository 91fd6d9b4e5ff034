package main

import (
	"encoding/binary"
	"errors"
	"hash/fnv"
	"slices"
)

// The game's messages. Each ID travels in one delivery mode.
const (
	// msgInput, client to server: unreliable sequenced (InOrder on
	// chanInput). A late input is worth nothing once a newer one arrived,
	// and a lost one is not resent: the next one, 33ms later, carries the
	// current state of the controls anyway.
	msgInput = 100
	// msgSnapshot, server to client: latest state (unreliable, ContentID
	// snapshotContent). Only the newest matters; an older one arriving
	// late is dropped, and a newer one replaces an older one still queued.
	// Each is a delta against one the client has (see snapshot).
	msgSnapshot = 101
	// msgEvent, server to client: reliable ordered on chanEvents (spawn,
	// despawn, score, round over): each one counts, in order.
	msgEvent = 102
	// msgChat, both ways: reliable ordered on chanChat, its own channel so
	// that a lost chat line never holds up a spawn, and the other way round.
	msgChat = 103
	// msgScore, server to client: reliable latest state (Reliable,
	// ContentID the player's id): each player's score must arrive, but
	// only its newest value; a score replaced before it left is not sent,
	// nor sent again when lost, and an older one never arrives after a
	// newer one. Payload: id uint16, score uint32.
	msgScore = 104
)

const (
	chanInput  = 1
	chanEvents = 2
	chanChat   = 3

	snapshotContent = 1
)

// Event kinds, the first byte of a msgEvent.
const (
	evSpawn     = 1 // id, x, y
	evDespawn   = 2 // id
	evRoundOver = 4
)

// input is one client tick's controls.
type input struct {
	seq    uint32 // the client's tick: each input has the next
	dx, dy int8   // direction, -1..1
}

func (in input) append(b []byte) []byte {
	b = binary.LittleEndian.AppendUint32(b, in.seq)
	return append(b, byte(in.dx), byte(in.dy))
}

func parseInput(b []byte) (input, error) {
	if len(b) != 6 {
		return input{}, errors.New("bad input")
	}
	return input{binary.LittleEndian.Uint32(b), int8(b[4]), int8(b[5])}, nil
}

// Positions are fixed-point: hundredths of a unit, so that a client
// rebuilds from deltas exactly the world the server has.
const (
	unit  = 100
	world = worldSize * unit // the torus, in position units
)

// entity is one player as a snapshot carries it.
type entity struct {
	id   uint16
	x, y int32
}

// A snapshot is the world as one player sees it at one server tick:
//
//	tick uint32 | sent int64 (ns since the server's epoch) | ack uint32 (the
//	player's last applied input) | base uint32 | n uint16 | sum uint32 |
//	the entities
//
// The player's own entity comes first, then the nearest others, as many
// as fit in one unreliable datagram (Conn.MaxUnreliablePayload). sum is
// FNV-1a of the full encoding of the entities: the client checks the world
// it rebuilt against it.
//
// A full snapshot (base 0) lists each entity as id uint16, x, y uint32.
// A delta lists them against the snapshot of tick base, one the client
// is known to have (its receipt said delivered): per entity, the index of
// the same player in the baseline's list and a byte of motion since then,
// 4 bits each way in steps of one tick's full-speed move; or 255 and the
// entity in full, for one not in the baseline or that moved otherwise.
const (
	snapHeader = 4 + 8 + 4 + 4 + 2 + 4
	snapEntity = 2 + 4 + 4
	newEntity  = 255
)

type snapshot struct {
	tick, base uint32
	sent       int64
	ack        uint32
	sum        uint32
	ents       []entity
}

// appendFull appends the full encoding of ents.
func appendFull(b []byte, ents []entity) []byte {
	for _, e := range ents {
		b = appendEntity(b, e)
	}
	return b
}

func appendEntity(b []byte, e entity) []byte {
	b = binary.LittleEndian.AppendUint16(b, e.id)
	b = binary.LittleEndian.AppendUint32(b, uint32(e.x))
	return binary.LittleEndian.AppendUint32(b, uint32(e.y))
}

func worldSum(ents []entity) uint32 {
	h := fnv.New32a()
	var b [snapEntity]byte
	for _, e := range ents {
		h.Write(appendEntity(b[:0], e))
	}
	return h.Sum32()
}

// torus returns d, a difference of positions, as the shortest way round.
func torus(d int32) int32 {
	d %= world
	switch {
	case d > world/2:
		d -= world
	case d <= -world/2:
		d += world
	}
	return d
}

func wrap(v int32) int32 { return (v%world + world) % world }

// appendDelta appends the encoding of ents against base, step being one
// tick's full-speed move.
func appendDelta(b []byte, ents, base []entity, step int32) []byte {
	for _, e := range ents {
		i := slices.IndexFunc(base, func(o entity) bool { return o.id == e.id })
		if i >= 0 && i < newEntity {
			dx, dy := torus(e.x-base[i].x), torus(e.y-base[i].y)
			if dx%step == 0 && dy%step == 0 {
				if mx, my := dx/step, dy/step; mx >= -8 && mx < 8 && my >= -8 && my < 8 {
					b = append(b, byte(i), byte(mx+8)<<4|byte(my+8))
					continue
				}
			}
		}
		b = append(b, newEntity)
		b = appendEntity(b, e)
	}
	return b
}

// appendSnapshot appends s, ents in full if base is nil, else against it.
func appendSnapshot(b []byte, s *snapshot, base []entity, step int32) []byte {
	b = binary.LittleEndian.AppendUint32(b, s.tick)
	b = binary.LittleEndian.AppendUint64(b, uint64(s.sent))
	b = binary.LittleEndian.AppendUint32(b, s.ack)
	b = binary.LittleEndian.AppendUint32(b, s.base)
	b = binary.LittleEndian.AppendUint16(b, uint16(len(s.ents)))
	b = binary.LittleEndian.AppendUint32(b, worldSum(s.ents))
	if base == nil {
		return appendFull(b, s.ents)
	}
	return appendDelta(b, s.ents, base, step)
}

var errBaseline = errors.New("snapshot against a baseline the client does not have")

// parseSnapshot decodes b; baseline returns the entities of the snapshot
// of a tick the client has, or nil.
func parseSnapshot(b []byte, baseline func(tick uint32) []entity, step int32) (snapshot, error) {
	if len(b) < snapHeader {
		return snapshot{}, errors.New("short snapshot")
	}
	s := snapshot{
		tick: binary.LittleEndian.Uint32(b),
		sent: int64(binary.LittleEndian.Uint64(b[4:])),
		ack:  binary.LittleEndian.Uint32(b[12:]),
		base: binary.LittleEndian.Uint32(b[16:]),
		sum:  binary.LittleEndian.Uint32(b[22:]),
	}
	n := int(binary.LittleEndian.Uint16(b[20:]))
	b = b[snapHeader:]
	var base []entity
	if s.base != 0 {
		if base = baseline(s.base); base == nil {
			return s, errBaseline
		}
	}
	s.ents = make([]entity, 0, min(n, len(b)/2))
	full := func() bool {
		if len(b) < snapEntity {
			return false
		}
		s.ents = append(s.ents, entity{binary.LittleEndian.Uint16(b), int32(binary.LittleEndian.Uint32(b[2:])), int32(binary.LittleEndian.Uint32(b[6:]))})
		b = b[snapEntity:]
		return true
	}
	for range n {
		if base == nil {
			if !full() {
				return s, errors.New("short snapshot")
			}
			continue
		}
		if len(b) < 2 {
			return s, errors.New("short delta")
		}
		if b[0] == newEntity {
			b = b[1:]
			if !full() {
				return s, errors.New("short delta")
			}
			continue
		}
		i, m := int(b[0]), b[1]
		b = b[2:]
		if i >= len(base) {
			return s, errors.New("delta names no baseline entity")
		}
		e := base[i]
		e.x = wrap(e.x + (int32(m>>4)-8)*step)
		e.y = wrap(e.y + (int32(m&15)-8)*step)
		s.ents = append(s.ents, e)
	}
	if len(b) != 0 {
		return s, errors.New("bad snapshot length")
	}
	return s, nil
}
