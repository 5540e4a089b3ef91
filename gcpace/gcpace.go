// Package gcpace sets how often the Go collector runs in the broker's process, and the
// heap it keeps under.
//
// The broker shares its machine's cores with PostgreSQL, and its own heap is small: what
// it holds is a few thousand claims and outcomes in flight, and the watch streams. At Go's
// default pace (GOGC=100, a collection each time the heap doubles), Percent, which
// collects about half as often for a heap up to three times what is live, took 17-20%
// off the broker's CPU per operation in a burn-down; 400 left idle watch streams at or
// over their memory budget (docs/benchmarks.md). So that the larger heap stays inside a container's memory limit,
// the soft memory limit (GOMEMLIMIT) is set to MemoryRatio of the cgroup's limit where
// there is one: near it, the collector runs as often as it must. GOGC and GOMEMLIMIT in
// the environment win over both.
package gcpace

import (
	"errors"
	"math"
	"os"
	"runtime/debug"
	"runtime/metrics"
	"strconv"

	"github.com/KimMachineGun/automemlimit/memlimit"
)

// Percent is the broker's pace when the environment sets no GOGC: a collection each time
// the heap grows by this percentage of what the last one left live.
const Percent = 200

// MemoryRatio is the share of the cgroup's memory limit the broker sets as its soft
// memory limit when the environment sets no GOMEMLIMIT. The soft limit covers what the Go
// runtime holds (heap, stacks, its own); the rest is for what it does not count (the
// binary's pages, the page cache charged to the cgroup) and for overshooting a soft
// limit.
const MemoryRatio = 0.9

// Default sets the pace to Percent unless the environment sets GOGC, which the Go runtime
// has applied already, and the soft memory limit to MemoryRatio of the cgroup's memory
// limit unless the environment sets GOMEMLIMIT or there is no limit (no cgroup is no
// limit). The error says why no soft limit was set (the cgroup's limit could not be
// read, AUTOMEMLIMIT is malformed); the pace is set whatever it is.
func Default() error {
	return set(memlimit.FromCgroup)
}

// set is Default with the memory limit read from limit.
func set(limit memlimit.Provider) error {
	if os.Getenv("GOGC") == "" {
		debug.SetGCPercent(Percent)
	}
	_, err := memlimit.Set(memlimit.WithProvider(limit), memlimit.WithRatio(MemoryRatio))
	if errors.Is(err, memlimit.ErrNoCgroup) || errors.Is(err, memlimit.ErrCgroupsNotSupported) {
		return nil
	}
	return err
}

// Current returns the pace in effect, as GOGC's percentage (-1: collection is off), and
// the soft memory limit in bytes (math.MaxInt64: none).
func Current() (percent int, memoryLimit int64) {
	s := []metrics.Sample{{Name: "/gc/gogc:percent"}}
	metrics.Read(s)
	percent = -1 // off reads as the largest uint64
	if s[0].Value.Kind() == metrics.KindUint64 && s[0].Value.Uint64() <= math.MaxInt32 {
		percent = int(s[0].Value.Uint64())
	}
	return percent, debug.SetMemoryLimit(-1) // a negative limit reads it without a change
}

// Describe returns Current as the broker reports it: GOGC's percentage or "off", and
// the soft memory limit in bytes or "none".
func Describe() (gogc, memoryLimit string) {
	percent, limit := Current()
	gogc, memoryLimit = "off", "none"
	if percent >= 0 {
		gogc = strconv.Itoa(percent)
	}
	if limit < math.MaxInt64 {
		memoryLimit = strconv.FormatInt(limit, 10)
	}
	return gogc, memoryLimit
}
