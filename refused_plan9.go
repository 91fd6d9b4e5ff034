package knet

import "errors"

// errConnRefused stands in for ECONNREFUSED, which Plan 9 does not have;
// nothing reports it there.
var errConnRefused = errors.New("connection refused")

// isRefusal reports whether err is the system's word that nothing listens
// at the peer's port.
func isRefusal(err error) bool { return errors.Is(err, errConnRefused) }
