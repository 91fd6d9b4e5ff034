//go:build !linux

package knet

import "time"

var clockStart = time.Now()

// threadCPU is the wall clock where the thread's CPU clock is not at hand
// (see the Linux one).
func threadCPU() time.Duration { return time.Since(clockStart) }
