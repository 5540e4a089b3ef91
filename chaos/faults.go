package chaos

import (
	"context"
	"fmt"
	"slices"
	"syscall"
	"time"
)

// The process and database faults the run injects, by the names the report uses.
const (
	faultKill      = "kill -9 of a replica"
	faultPause     = "SIGSTOP of a replica past its lease"
	faultTerminate = "pg_terminate_backend of the replicas' connections"
	faultRestart   = "PostgreSQL immediate restart"
)

// injectFaults injects a process or database fault at random intervals until ctx ends:
// first every kind once, in a random order, then kinds at random; covered is closed
// once every kind was injected. PostgreSQL is restarted only when the run started it.
func (c *cluster) injectFaults(ctx context.Context, covered chan<- struct{}) {
	kinds := []string{faultKill, faultPause, faultTerminate}
	if c.pg != nil {
		kinds = append(kinds, faultRestart)
	}
	c.mu.Lock()
	schedule := slices.Clone(kinds)
	c.rng.Shuffle(len(schedule), func(i, j int) { schedule[i], schedule[j] = schedule[j], schedule[i] })
	c.mu.Unlock()
	for n := 0; ; {
		if n == len(schedule) {
			close(covered)
			n++ // and never again
		}
		c.mu.Lock()
		wait := c.cfg.FaultInterval/2 + time.Duration(c.rng.Int64N(int64(c.cfg.FaultInterval)))
		kind := kinds[c.rng.IntN(len(kinds))]
		if n < len(schedule) {
			kind = schedule[n]
		}
		c.mu.Unlock()
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		if err := c.inject(ctx, kind); err != nil {
			fmt.Fprintf(c.cfg.Log, "chaos: %s: %v\n", kind, err)
			continue // a scheduled kind is tried again
		}
		if n < len(schedule) {
			n++
		}
		c.mu.Lock()
		c.faults[kind]++
		c.mu.Unlock()
	}
}

func (c *cluster) inject(ctx context.Context, kind string) error {
	switch kind {
	case faultKill:
		r := c.pick()
		if r == nil {
			return fmt.Errorf("no replica to kill")
		}
		return r.cmd.Process.Kill() // the supervisor restarts it
	case faultPause:
		r := c.pick()
		if r == nil {
			return fmt.Errorf("no replica to pause")
		}
		if err := r.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
			return err
		}
		c.mu.Lock()
		r.paused = true
		c.mu.Unlock()
		// Past its lease, so that another replica's sweeper takes its claims; then it
		// wakes up holding stale fences.
		time.AfterFunc(c.cfg.Lease+c.cfg.Lease/2, func() {
			c.mu.Lock()
			defer c.mu.Unlock()
			if r.paused {
				_ = r.cmd.Process.Signal(syscall.SIGCONT)
				r.paused = false
			}
		})
		return nil
	case faultTerminate:
		_, err := c.admin.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
			WHERE application_name LIKE 'opbroker-chaos-%'`)
		return err
	case faultRestart:
		return c.pg.CrashRestart()
	}
	return fmt.Errorf("unknown fault %q", kind)
}

// pick returns a running, unpaused replica at random, or nil.
func (c *cluster) pick() *replica {
	c.mu.Lock()
	defer c.mu.Unlock()
	candidates := c.live(false)
	if len(candidates) == 0 {
		return nil
	}
	return candidates[c.rng.IntN(len(candidates))]
}
