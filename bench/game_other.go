//go:build !linux

package main

import "syscall"

// cpuTime is not measured here: the game scenario's CPU figures need
// Linux (getrusage through the syscall package).
func cpuTime() float64 { return 0 }

func ctxSwitches() (vol, invol uint64) { return 0, 0 }

func raiseNoFile() {}

func childAttr() *syscall.SysProcAttr { return nil }
