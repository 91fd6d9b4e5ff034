package knet

import "slices"

// Ordering (spec "InOrder Datagrams and Messages", DECISIONS §5).
//
// The wire carries dependencies between messages, each named by the
// datagram it arrived in and its index there. The receiver applies a message
// once every message it depends on is applied (resolver.go); the sender
// turns channels and explicit dependencies into such references
// (sendorder.go). This file holds what both read: message references, the
// dependencies a message names, the latest-state marker.

// msgRef names a message on the wire: the PacketID of its datagram (of the
// FragmentStart, for a fragmented message) and its index among the message
// blocks there.
type msgRef struct {
	pid uint32
	idx uint16
}

// refFromEntry converts dependency entry x of a datagram header into the
// message it names.
func refFromEntry(h *header, x int) msgRef {
	return msgRef{pid: (h.packetID - uint32(h.deltas[x]) - 1) & packetIDMask, idx: h.indices[x]}
}

// refLess reports whether a was sent before b.
func refLess(a, b msgRef) bool {
	return seqLess(a.pid, b.pid) || a.pid == b.pid && a.idx < b.idx
}

// appendDeps appends the messages m depends on, per its InOrder code, each
// once: two entries, or one entry listed twice, may name the same message.
func appendDeps(dst []msgRef, h *header, m *message) []msgRef {
	switch m.order {
	case orderNone:
	case orderSingle:
		dst = append(dst, refFromEntry(h, int(m.orderIndex)))
	case orderMulti:
		start := len(dst)
		for _, x := range m.orderMulti {
			if r := refFromEntry(h, int(x)); !slices.Contains(dst[start:], r) {
				dst = append(dst, r)
			}
		}
	default:
		dst = append(dst, refFromEntry(h, int(m.order)-1))
	}
	return dst
}

// Latest-state marker. A message that supersedes the ones it names (a
// ContentID update naming earlier versions of its state) lists its entries
// with InOrder code 7 and repeats the first entry at the end. A receiver
// that reads the spec alone sees the same dependencies; ours applies such
// a message at once and drops the named ones if they arrive later
// (latest state wins), instead of waiting for them. Our encoder never
// repeats an entry otherwise.

// supersedes reports whether m carries the latest-state marker.
func supersedes(m *message) bool {
	k := len(m.orderMulti)
	return m.order == orderMulti && k >= 2 && m.orderMulti[0] == m.orderMulti[k-1]
}
