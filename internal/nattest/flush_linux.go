//go:build linux

package nattest

import (
	"encoding/binary"
	"fmt"
	"os/exec"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// Flush makes s's router forget every mapping at once, as a NAT does
// whose mappings expired or which restarted mid-game: its conntrack
// table is emptied, and so are a cone's learned ports and contacted
// addresses. What a private host sends next is mapped afresh: a cone
// keeps the private port when it is free (Linux's masquerade), a
// symmetric NAT draws a new random port per destination, and until then
// what comes in for the old mappings is dropped.
func (n *Net) Flush(t testing.TB, s *Site) {
	t.Helper()
	if s.Type == FullCone || s.Type == RestrictedCone {
		for _, set := range []string{"map ip nat mapped", "set ip nat contacted"} {
			args := append([]string{"netns", "exec", s.Router.Name, "nft", "flush"}, strings.Fields(set)...)
			if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
				t.Fatalf("nattest: flush %s in %s: %v: %s", set, s.Router.Name, err, out)
			}
		}
	}
	if err := s.Router.Run(flushConntrack); err != nil {
		t.Fatalf("nattest: flush conntrack in %s: %v", s.Router.Name, err)
	}
}

// flushConntrack empties the conntrack table of the namespace it runs in
// (what "conntrack -F" does): a ctnetlink delete naming no connection,
// which deletes them all, acknowledged by the kernel.
func flushConntrack() error {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_NETFILTER)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return err
	}
	const ipctnlMsgCtDelete = 2 // IPCTNL_MSG_CT_DELETE, linux/netfilter/nfnetlink_conntrack.h
	msg := make([]byte, unix.SizeofNlMsghdr+4)
	binary.NativeEndian.PutUint32(msg[0:], uint32(len(msg)))                                // nlmsg_len
	binary.NativeEndian.PutUint16(msg[4:], unix.NFNL_SUBSYS_CTNETLINK<<8|ipctnlMsgCtDelete) // nlmsg_type
	binary.NativeEndian.PutUint16(msg[6:], unix.NLM_F_REQUEST|unix.NLM_F_ACK)               // nlmsg_flags
	binary.NativeEndian.PutUint32(msg[8:], 1)                                               // nlmsg_seq
	msg[16] = unix.AF_INET                                                                  // nfgen_family
	msg[17] = unix.NFNETLINK_V0                                                             // version; res_id 0
	if err := unix.Sendto(fd, msg, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return err
	}
	buf := make([]byte, 4096)
	n, _, err := unix.Recvfrom(fd, buf, 0)
	if err != nil {
		return err
	}
	if n < unix.SizeofNlMsghdr+4 || binary.NativeEndian.Uint16(buf[4:]) != unix.NLMSG_ERROR {
		return fmt.Errorf("no acknowledgement from the kernel (%d bytes)", n)
	}
	if code := int32(binary.NativeEndian.Uint32(buf[unix.SizeofNlMsghdr:])); code != 0 {
		return fmt.Errorf("ctnetlink delete: %w", unix.Errno(-code))
	}
	return nil
}
