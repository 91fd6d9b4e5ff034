package knet

import (
	"context"
	"os"
	"sync"
	"time"
)

// errDeadline is what a passed deadline gives: a net.Error whose Timeout
// method reports true.
var errDeadline error = os.ErrDeadlineExceeded

// waitSignal waits for ch, a deadline channel (nil if none is set) or
// ctx. Close, the end of the connection and a deadline being set all
// signal ch, so that the common case is a plain receive.
func waitSignal(ctx context.Context, ch, deadline <-chan struct{}) error {
	done := ctx.Done()
	if deadline == nil && done == nil {
		<-ch
		return nil
	}
	select {
	case <-ch:
	case <-deadline:
	case <-done:
		return ctx.Err()
	}
	return nil
}

// deadline is a settable point in time with a channel closed once it
// passes.
type deadline struct {
	mu      sync.Mutex
	timer   *time.Timer
	gen     uint64
	ch      chan struct{}
	done    bool // ch is closed
	stopped bool
	notify  chan struct{} // signalled on every change, for waiters to look again
}

// init sets the channel signalled on changes. The deadline's own channel
// is made when a deadline is first set: most connections never set one.
func (d *deadline) init(notify chan struct{}) {
	d.notify = notify
}

func (d *deadline) set(t time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	defer signal(d.notify)
	d.gen++
	if d.timer != nil {
		d.timer.Stop()
		d.timer = nil
	}
	if d.stopped {
		return // the connection is gone: no timer may outlive it
	}
	if t.IsZero() {
		if d.done {
			d.ch = nil // made again when needed
			d.done = false
		}
		return
	}
	dur := time.Until(t)
	if dur <= 0 {
		if !d.done {
			if d.ch == nil {
				d.ch = make(chan struct{})
			}
			close(d.ch)
			d.done = true
		}
		return
	}
	if d.done || d.ch == nil {
		d.ch = make(chan struct{})
		d.done = false
	}
	gen := d.gen
	d.timer = time.AfterFunc(dur, func() {
		d.mu.Lock()
		defer d.mu.Unlock()
		if d.gen == gen && !d.done {
			close(d.ch)
			d.done = true
		}
	})
}

// stop stops the timer for good.
func (d *deadline) stop() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.stopped = true
	if d.timer != nil {
		d.timer.Stop()
		d.timer = nil
	}
}

// wait returns a channel closed when the deadline passes, or nil if none
// is set.
func (d *deadline) wait() <-chan struct{} {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.timer == nil && !d.done {
		return nil
	}
	return d.ch
}

func (d *deadline) passed() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.done
}
