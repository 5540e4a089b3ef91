// Package clocktest provides a clock for tests: the real time, off by a fixed skew (a
// host whose clock is wrong) and moved forward at will (time passing without waiting).
package clocktest

import (
	"sync/atomic"
	"time"
)

// Clock reads the real time plus an offset. It is safe for concurrent use.
type Clock struct {
	offset atomic.Int64 // nanoseconds
}

// New returns a clock skew ahead of the real time (behind when negative).
func New(skew time.Duration) *Clock {
	c := &Clock{}
	c.offset.Store(int64(skew))
	return c
}

// Now returns the clock's time. It keeps the monotonic reading of time.Now, so
// durations between two readings are the real ones plus what Advance added.
func (c *Clock) Now() time.Time { return time.Now().Add(time.Duration(c.offset.Load())) }

// Advance moves the clock forward by d (back when d is negative).
func (c *Clock) Advance(d time.Duration) { c.offset.Add(int64(d)) }

// Skews are the offsets that safety tests run under: a host clock ten seconds behind
// the database's, in step with it, and ten seconds ahead.
var Skews = []time.Duration{-10 * time.Second, 0, 10 * time.Second}
