package main

import (
	"encoding/binary"
	"errors"
	"math"
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
	msgSnapshot = 101
	// msgEvent, server to client: reliable ordered on chanEvents (spawn,
	// despawn, score, round over): each one counts, in order.
	msgEvent = 102
	// msgChat, both ways: reliable ordered on chanChat, its own channel so
	// that a lost chat line never holds up a spawn, and the other way round.
	msgChat = 103
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
	evScore     = 3 // id, score
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

// A snapshot is the world as one player sees it at one server tick:
//
//	tick uint32 | sent int64 (ns since the server's epoch) | ack uint32 (the
//	player's last applied input) | n uint16 | n × (id uint16, x, y float32)
//
// The player's own entity comes first, then the nearest others, as many as
// fit in one unreliable datagram (Conn.MaxUnreliablePayload).
const (
	snapHeader = 4 + 8 + 4 + 2
	snapEntity = 2 + 4 + 4
)

type snapshot struct {
	tick uint32
	sent int64
	ack  uint32
	n    int
}

func parseSnapshot(b []byte) (snapshot, error) {
	if len(b) < snapHeader {
		return snapshot{}, errors.New("short snapshot")
	}
	s := snapshot{
		tick: binary.LittleEndian.Uint32(b),
		sent: int64(binary.LittleEndian.Uint64(b[4:])),
		ack:  binary.LittleEndian.Uint32(b[12:]),
		n:    int(binary.LittleEndian.Uint16(b[16:])),
	}
	if len(b) != snapHeader+s.n*snapEntity {
		return snapshot{}, errors.New("bad snapshot length")
	}
	return s, nil
}

func appendEntity(b []byte, id uint16, x, y float32) []byte {
	b = binary.LittleEndian.AppendUint16(b, id)
	b = binary.LittleEndian.AppendUint32(b, math.Float32bits(x))
	return binary.LittleEndian.AppendUint32(b, math.Float32bits(y))
}
