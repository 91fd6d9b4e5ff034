//go:build !plan9

package knet

import "syscall"

// errConnRefused is how the system reports an ICMP port unreachable on a
// connected UDP socket.
var errConnRefused error = syscall.ECONNREFUSED
