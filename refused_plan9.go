package knet

import "errors"

// errConnRefused stands in for ECONNREFUSED, which Plan 9 does not have;
// nothing reports it there.
var errConnRefused = errors.New("connection refused")
