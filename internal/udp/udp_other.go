//go:build !linux

package udp

type sysConn struct{ c *Conn }

func (s *sysConn) init(c *Conn) { s.c = c }

type sysReader struct{}

func (r *sysReader) init(c *Conn) {}

func (r *sysReader) want(max int) int { return min(max, 1) }

type sysWriter struct{}

func (w *sysWriter) init(n int) {}

// readBatch reads one datagram: without recvmmsg a loop could block on the
// second.
func (s *sysConn) readBatch(r *sysReader, ps []Packet) (int, error) {
	if err := s.c.readOne(&ps[0]); err != nil {
		return 0, err
	}
	return 1, nil
}

func (s *sysConn) writeBatch(w *sysWriter, ps []Packet) (int, error) {
	sent := 0
	var first error
	for i := range ps {
		if err := s.c.writeOne(&ps[i]); err != nil {
			ps[i].Err = err
			if first == nil {
				first = err
			}
			continue
		}
		sent++
	}
	return sent, first
}
