package main

import (
	"context"
	"fmt"
	"io"
	"slices"
	"sync"
	"time"
)

// env is the life of one measurement: a context that ends on timeout, on
// the first failure or when the measurement is over, and the things to
// close then. Closing everything is what unblocks a goroutine stuck in
// Send or Recv, so a measurement never outlives its time bound.
type env struct {
	ctx    context.Context
	cancel context.CancelFunc

	mu      sync.Mutex
	closing bool
	closers []namedCloser
	err     error
	notes   []string

	closeOnce sync.Once
	closed    chan struct{}
}

type namedCloser struct {
	name string
	c    io.Closer
}

// closeLimit bounds how long teardown may take before it is reported
// as hung and abandoned.
const closeLimit = 4 * time.Second

func newEnv(parent context.Context) *env {
	ctx, cancel := context.WithCancel(parent)
	e := &env{ctx: ctx, cancel: cancel, closed: make(chan struct{})}
	go func() {
		<-ctx.Done()
		e.closeAll()
	}()
	return e
}

// add registers c to be closed at the end. After the end it closes c at once.
func (e *env) add(name string, c io.Closer) {
	e.mu.Lock()
	if e.closing {
		e.mu.Unlock()
		go c.Close()
		return
	}
	e.closers = append(e.closers, namedCloser{name, c})
	e.mu.Unlock()
}

// fail records the first error and ends the measurement.
func (e *env) fail(err error) {
	if err == nil {
		return
	}
	e.mu.Lock()
	if e.err == nil && e.ctx.Err() == nil {
		e.err = err
	}
	e.mu.Unlock()
	e.cancel()
}

func (e *env) note(format string, args ...any) {
	e.mu.Lock()
	e.notes = append(e.notes, fmt.Sprintf(format, args...))
	e.mu.Unlock()
}

// closeAll closes everything in parallel and waits at most closeLimit.
func (e *env) closeAll() {
	e.closeOnce.Do(func() {
		e.mu.Lock()
		e.closing = true
		cs := slices.Clone(e.closers)
		e.mu.Unlock()
		var wg sync.WaitGroup
		pending := make(map[string]int)
		var pmu sync.Mutex
		for _, c := range cs {
			pmu.Lock()
			pending[c.name]++
			pmu.Unlock()
			wg.Go(func() {
				c.c.Close()
				pmu.Lock()
				pending[c.name]--
				pmu.Unlock()
			})
		}
		done := make(chan struct{})
		go func() { wg.Wait(); close(done) }()
		start := time.Now()
		select {
		case <-done:
			if d := time.Since(start); d > 1500*time.Millisecond {
				e.note("teardown took %v", d.Round(time.Millisecond))
			}
		case <-time.After(closeLimit):
			pmu.Lock()
			var stuck []string
			for n, k := range pending {
				if k > 0 {
					stuck = append(stuck, fmt.Sprintf("%s×%d", n, k))
				}
			}
			pmu.Unlock()
			slices.Sort(stuck)
			e.note("teardown: Close did not return within %v: %v (abandoned)", closeLimit, stuck)
		}
		close(e.closed)
	})
}

// finish ends the measurement and returns the first failure.
func (e *env) finish() error {
	e.cancel()
	<-e.closed
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.err
}

// running reports whether the measurement goes on.
func (e *env) running() bool { return e.ctx.Err() == nil }

// sleep waits d or until the measurement ends; it reports whether it
// slept the whole time.
func (e *env) sleep(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-e.ctx.Done():
		return false
	}
}

// closerFunc adapts a function to io.Closer.
type closerFunc func() error

func (f closerFunc) Close() error { return f() }
