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
	faultRotate    = "credential rotation"
)

// injectFaults injects a process or database fault at random intervals until ctx ends:
// first every kind once, in a random order, then kinds at random; covered is closed
// once every kind was injected. PostgreSQL is restarted only when the run started it.
func (c *cluster) injectFaults(ctx context.Context, covered chan<- struct{}) {
	kinds := []string{faultKill, faultPause, faultTerminate, faultRotate}
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
	case faultRotate:
		return c.rotateCredential(ctx)
	}
	return fmt.Errorf("unknown fault %q", kind)
}

// rotateCredential rotates the charge target's bearer token as an operator does after
// the vendor rolled the key and stopped accepting the old one: the target takes a new
// token, and a moment later (100 to 600 ms, the operator's reaction) a complete file
// holding it is renamed over the one the replicas read, which they read again at their
// next request, without a restart. Back to back, the two leave too short a gap for any
// request to be refused; the moment lets some be, as a real rotation does.
//
// The target goes first. Either order refuses, with a 401 that executed nothing, the
// requests that carry the token the target does not take: the old one after the
// target's switch, or the new one before it. Target first is the order that needs no
// refusal at all from a target that honours the old token for a grace period after a
// rotation, as vendors' "roll with expiry" does; and a replica refused the token it
// still holds finds a new one in its file soon after, whereas one refused the new token
// (broker first) has nothing to wait for but a later rotation.
func (c *cluster) rotateCredential(ctx context.Context) error {
	c.mu.Lock()
	n := c.faults[faultRotate] + 1
	lag := 100*time.Millisecond + time.Duration(c.rng.Int64N(int64(500*time.Millisecond)))
	c.mu.Unlock()
	token := c.newSecret(fmt.Sprintf("the charge target's bearer token of rotation %d", n))
	install, err := stageSecretFile(c.chargeToken, token)
	if err != nil {
		return err
	}
	c.charge.SetCredential(token)
	// The end of the run cuts the wait short, never the rename: the replicas must get
	// the token the target takes.
	select {
	case <-time.After(lag):
	case <-ctx.Done():
	}
	return install()
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
