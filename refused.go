//go:build !plan9

package knet

import (
	"errors"
	"syscall"
)

// errConnRefused is how the system reports an ICMP port unreachable on a
// connected UDP socket.
var errConnRefused error = syscall.ECONNREFUSED

// isRefusal reports whether err is the system's word that nothing listens
// at the peer's port.
func isRefusal(err error) bool { return errors.Is(err, errConnRefused) }
