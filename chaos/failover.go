package chaos

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
)

// The formation's faults (Config.Failover), by the names the report uses.
const (
	faultKillPrimary = "kill -9 of the PostgreSQL primary"
	faultStopPrimary = "SIGSTOP of the PostgreSQL primary (a partition)"
)

// Failover is one of the formation's failovers, as the report gives it.
type Failover struct {
	Fault string    `json:"fault"`
	At    time.Time `json:"at"`
	// NewPrimary is how long after the fault another node held the leader lock.
	NewPrimary time.Duration `json:"new_primary_after_ns"`
	// Unavailable runs from the first of the availability prober's PrepareOperation
	// calls that failed after the fault to the first one acknowledged after that failure
	// (0 when none failed; to the last failed call when none was acknowledged);
	// Refusals counts the failed calls by gRPC code and reason.
	Unavailable time.Duration  `json:"unavailable_ns"`
	Refusals    map[string]int `json:"refusals,omitempty"`
	// Recovered is false when calls failed after the fault and none was acknowledged
	// before the next failover or the run's end.
	Recovered bool `json:"recovered"`
	// Error is what went wrong with the failover itself (no new primary, the old one
	// not back), if anything; the formation was healed before the next.
	Error string `json:"error,omitempty"`
}

// call is one of the availability prober's calls: acknowledged, or failed.
type call struct {
	at     time.Time
	failed string // "" when acknowledged; else the code and reason
}

// callLog keeps the availability prober's calls, for the failovers' unavailability
// windows.
type callLog struct {
	mu    sync.Mutex
	calls []call
}

func (l *callLog) add(c call) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.calls = append(l.calls, c)
}

// windows fills in each failover's Unavailable, Recovered and Refusals from the calls,
// looking only at calls before the next failover. A failover after which calls failed
// and none was acknowledged again is unavailable until the last call it saw, and not
// recovered.
func (l *callLog) windows(failovers []Failover) {
	l.mu.Lock()
	calls := slices.Clone(l.calls)
	l.mu.Unlock()
	slices.SortFunc(calls, func(a, b call) int { return a.at.Compare(b.at) })
	for i := range failovers {
		f := &failovers[i]
		f.Recovered = true
		end := time.Time{}
		if i+1 < len(failovers) {
			end = failovers[i+1].At
		}
		var firstFailed time.Time
		for _, c := range calls {
			if c.at.Before(f.At) || (!end.IsZero() && !c.at.Before(end)) {
				continue
			}
			if c.failed == "" {
				if !firstFailed.IsZero() {
					f.Unavailable, f.Recovered = c.at.Sub(firstFailed), true
					break
				}
				continue
			}
			if firstFailed.IsZero() {
				firstFailed = c.at
			}
			f.Unavailable, f.Recovered = c.at.Sub(firstFailed), false
			if f.Refusals == nil {
				f.Refusals = map[string]int{}
			}
			f.Refusals[c.failed]++
		}
	}
}

// failoverFault kills or stops the formation's primary, waits for another node to take
// the leader lock, and brings the old primary back as a standby: restarted after a
// kill, continued after a stop (its Patroni then finds the lock lost and demotes it).
// It returns once the formation is whole again, so that a sync standby is there for the
// next failover. The failover it returns has a zero At when no fault was injected; with
// an error, the formation may be left broken.
func (c *cluster) failoverFault(ctx context.Context, kind string) (Failover, error) {
	old, err := c.ha.Primary(ctx)
	if err != nil {
		return Failover{}, err
	}
	f := Failover{Fault: kind, At: time.Now()}
	if kind == faultKillPrimary {
		err = c.ha.Kill(old)
	} else {
		err = c.ha.Stop(old)
	}
	if err != nil {
		return f, err
	}
	fmt.Fprintf(c.cfg.Log, "chaos: %s: node %d\n", kind, old)
	for deadline := time.Now().Add(2 * time.Minute); ; {
		if now, err := c.ha.Primary(ctx); err == nil && now != old {
			f.NewPrimary = time.Since(f.At)
			fmt.Fprintf(c.cfg.Log, "chaos: node %d is primary after %s\n", now, f.NewPrimary.Round(100*time.Millisecond))
			break
		}
		if time.Now().After(deadline) {
			return f, errors.New("no other node became primary within 2 minutes")
		}
		if err := sleep(ctx, 100*time.Millisecond); err != nil {
			return f, err
		}
	}
	// Down a moment longer, as a machine that reboots.
	if err := sleep(ctx, time.Second); err != nil {
		return f, err
	}
	if kind == faultKillPrimary {
		err = c.ha.Restart(old)
	} else {
		err = c.ha.Resume(old)
	}
	if err != nil {
		return f, err
	}
	return f, c.ha.WaitWhole(ctx, 2*time.Minute)
}

// sleep waits for d, or until ctx ends.
func sleep(ctx context.Context, d time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}

// failoverLoop injects the formation's faults, one at a time, every interval on
// average, until ctx ends: first each kind once, then kinds at random; covered is
// closed once each kind struck. A failover that went wrong is reported with its error,
// and the formation healed before the next.
func (c *cluster) failoverLoop(ctx context.Context, interval time.Duration, covered chan<- struct{}) {
	kinds := []string{faultKillPrimary, faultStopPrimary}
	struck := map[string]bool{}
	for {
		c.mu.Lock()
		wait := interval/2 + time.Duration(c.rng.Int64N(int64(interval)))
		kind := kinds[c.rng.IntN(len(kinds))]
		c.mu.Unlock()
		if i := slices.IndexFunc(kinds, func(k string) bool { return !struck[k] }); i >= 0 {
			kind = kinds[i]
		}
		if sleep(ctx, wait) != nil {
			return
		}
		f, err := c.failoverFault(ctx, kind)
		if ctx.Err() != nil {
			return // the run's end, not the failover's fault: Run heals the formation
		}
		if err != nil {
			fmt.Fprintf(c.cfg.Log, "chaos: %s: %v\n", kind, err)
			f.Error = err.Error()
			if err := errors.Join(c.ha.Heal(), c.ha.WaitWhole(ctx, 2*time.Minute)); err != nil {
				fmt.Fprintf(c.cfg.Log, "chaos: healing the formation: %v\n", err)
			}
		}
		if f.At.IsZero() {
			continue
		}
		c.mu.Lock()
		c.failovers = append(c.failovers, f)
		c.faults[kind]++
		c.mu.Unlock()
		if !struck[kind] {
			struck[kind] = true
			if len(struck) == len(kinds) {
				close(covered)
			}
		}
	}
}

// probeAvailability measures what a client sees of the failovers: every 100 ms, until
// ctx ends, it sends the PrepareOperation of one intent of its own (the same request
// every time, as a client's retry: an answer needs the primary, creates nothing after
// the first, and must always name the same operation, which I2 and I7 check), with a
// 2-second deadline, to a running replica at random that is not paused (a paused
// replica is not the database's outage; one that reports NOT_SERVING is still asked, so
// the window is the client's, not a health-checking balancer's), and logs each call.
func (c *cluster) probeAvailability(ctx context.Context, h *history) {
	in := &intent{req: &opbrokerv1.PrepareOperationRequest{Tenant: "tenant-0", OperationType: typeCharge,
		IntentRef: "availability-probe", ContentType: "application/json",
		Payload: []byte(`{"account":"tenant-0","amount":1,"order":-1}`)}}
	h.add(in)
	rng := rand.New(rand.NewPCG(c.cfg.Seed, 23))
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(100 * time.Millisecond):
		}
		conn, err := c.connect(rng, false)
		if err != nil {
			c.probes.add(call{at: time.Now(), failed: "no replica running"})
			continue
		}
		callCtx, cancel := context.WithTimeout(c.as(ctx, in.req.GetTenant()), 2*time.Second)
		resp, err := opbrokerv1.NewOperationServiceClient(conn).PrepareOperation(callCtx, in.req)
		cancel()
		if ctx.Err() != nil {
			return
		}
		if err == nil {
			in.ack(resp.GetOperation().GetName())
		}
		c.probes.add(call{at: time.Now(), failed: outcomeOf(err)})
	}
}
