package knet

// Channel weights (Config.ChannelWeights): messages queued at one priority
// leave in proportion to their channel's weight, counted in payload
// bytes, by weighted fair queuing. Each message gets a share: where its
// channel's previous message ends, or where sending has got to if that
// is later, plus its bytes over the weight. The queue keeps a priority's
// messages in share order (sendQueue.push), and sending moves on to each
// packed message's share (sent). One channel's messages keep their order,
// as their shares grow.

// shareUnit scales bytes over weights into shares.
const shareUnit = 1 << 16

// fairQueue is a session's weighted fair queuing state, per queue.
type fairQueue struct {
	now  uint64           // the share of the last message packed
	ends map[uint8]uint64 // where each channel's last queued message ends
}

// weighShare gives m its share in queue q, when weights are set.
func (s *session) weighShare(m *outMsg) {
	w := s.cfg.channelWeights
	if w == nil {
		return
	}
	fq := s.fairFor(m)
	weight := uint64(max(w[m.channel], 1))
	start := max(fq.now, fq.ends[m.channel])
	m.share = start + (uint64(len(m.payload))+1)*shareUnit/weight
	fq.ends[m.channel] = m.share
}

// sentShare moves the queue's sending on to m, just packed.
func (s *session) sentShare(m *outMsg) {
	if s.cfg.channelWeights == nil || m.share == 0 {
		return
	}
	fq := s.fairFor(m)
	fq.now = max(fq.now, m.share)
}

func (s *session) fairFor(m *outMsg) *fairQueue {
	x := s.ext()
	i := 0
	if m.reliable || m.frag {
		i = 1
	}
	if x.fair[i].ends == nil {
		x.fair[i].ends = make(map[uint8]uint64)
	}
	return &x.fair[i]
}
