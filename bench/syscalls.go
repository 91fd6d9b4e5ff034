package main

// System calls of the game server process over its measurement window,
// counted by perf(1) from the kernel's syscall tracepoints: the same count
// for every library, with no change to how it does its I/O. Without perf
// (or without permission to trace) the counts are absent and the table
// says n/a.

import (
	"bytes"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
)

// Send and receive system calls a UDP server may make.
var (
	sendSyscalls = []string{"sendto", "sendmsg", "sendmmsg", "write", "writev"}
	recvSyscalls = []string{"recvfrom", "recvmsg", "recvmmsg", "read", "readv"}
)

// syscallCounter is a running perf stat attached to this process.
type syscallCounter struct {
	cmd *exec.Cmd
	out bytes.Buffer
}

// countSyscalls starts counting this process's system calls, or returns
// nil if perf cannot.
func countSyscalls() *syscallCounter {
	path, err := exec.LookPath("perf")
	if err != nil {
		return nil
	}
	var events []string
	for _, s := range append(append([]string{}, sendSyscalls...), recvSyscalls...) {
		events = append(events, "syscalls:sys_enter_"+s)
	}
	c := &syscallCounter{}
	c.cmd = exec.Command(path, "stat", "-x", ",", "-e", strings.Join(events, ","), "-p", strconv.Itoa(os.Getpid()))
	c.cmd.Stderr = &c.out
	c.cmd.SysProcAttr = childAttr()
	if err := c.cmd.Start(); err != nil {
		return nil
	}
	return c
}

// stop ends the count and returns the send and receive system calls;
// ok is false if perf counted nothing usable.
func (c *syscallCounter) stop() (send, recv uint64, ok bool) {
	if c == nil {
		return 0, 0, false
	}
	c.cmd.Process.Signal(syscall.SIGINT)
	c.cmd.Wait()
	// Lines: count,unit,event,... ("<not supported>" when it cannot).
	for _, line := range strings.Split(c.out.String(), "\n") {
		f := strings.Split(line, ",")
		if len(f) < 3 {
			continue
		}
		n, err := strconv.ParseUint(f[0], 10, 64)
		if err != nil {
			continue
		}
		name, found := strings.CutPrefix(f[2], "syscalls:sys_enter_")
		if !found {
			continue
		}
		ok = true
		for _, s := range sendSyscalls {
			if name == s {
				send += n
			}
		}
		for _, s := range recvSyscalls {
			if name == s {
				recv += n
			}
		}
	}
	return send, recv, ok
}
