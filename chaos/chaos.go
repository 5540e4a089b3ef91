// Package chaos runs the broker the way production will hurt it, and audits the promise
// afterwards: several replicas as separate processes, one PostgreSQL, simulated targets
// with a mix of provider profiles and every fault they know, that require credentials
// (one rotated mid-run), the broker's crash points, kill -9 and SIGSTOP of replicas,
// PostgreSQL restarted in immediate mode and its connections terminated, while clients
// prepare, retry, duplicate, amend and probe other tenants. Then everything heals, the
// run waits for the work to settle, and the audit checks invariants I1–I16
// (docs/testing.md#the-chaos-run) against the targets' ground truth, the ledger, the
// clients' history and the replicas' logs. A run is reproducible from its seed as far as
// the workload, the fault schedule and the targets' faults go; processes and the network
// add their own timing (the credentials are random in every run).
package chaos

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"
)

// Defaults of a run.
const (
	DefaultFaultInterval = time.Second
	DefaultFaultRate     = 0.3
	DefaultSettleBound   = 60 * time.Second
	// DefaultFailoverInterval is the mean time between failovers of Config.Failover.
	DefaultFailoverInterval = 30 * time.Second
)

// Config describes a run. Zero fields take the defaults of the short run.
type Config struct {
	Seed uint64
	// Broker is the opbroker binary the replicas run.
	Broker string
	// DatabaseURL is an administrator's connection string; empty starts an embedded
	// PostgreSQL (which the run also restarts as a fault).
	DatabaseURL string
	// Failover runs the ledger on a replicated PostgreSQL instead (package formation:
	// Patroni, etcd, three nodes in strict synchronous mode), whose primary the run
	// kills and stops, every FailoverInterval on average, while the replicas require
	// synchronous replication. DatabaseURL must be empty.
	Failover         bool
	FailoverInterval time.Duration // default 30s
	Replicas         int           // default 3
	Tenants          int           // default 4
	Intents          int           // default 150
	Clients          int           // concurrent clients, default 8
	// Duration keeps the faults going at least this long, the workload running in
	// rounds of Intents until it ends; 0 runs one round.
	Duration time.Duration
	// FaultInterval is the mean time between process and database faults (default 1s).
	FaultInterval time.Duration
	// FaultRate is the share of requests to the targets that get a fault (default 0.3).
	FaultRate float64
	// Lease is the replicas' dispatch and reconcile lease (default 2s): a paused replica
	// is held past it.
	Lease time.Duration
	// ResolutionDeadline is the replicas' --reconcile-deadline (default 30s): an UNKNOWN
	// operation nothing can resolve (a provider that replays a saved 5xx for its key) is
	// escalated after it, within the run.
	ResolutionDeadline time.Duration
	// SettleBound is how long the work may take to settle after healing (default 60s).
	SettleBound time.Duration
	// Log receives progress; ReplicaLogs, when set, every replica's log lines. Run
	// writes to them from several goroutines, one write at a time, so neither needs to be
	// safe for concurrent use (a bytes.Buffer will do).
	Log         io.Writer
	ReplicaLogs io.Writer
}

func (c *Config) setDefaults() {
	def := func(v *int, d int) {
		if *v <= 0 {
			*v = d
		}
	}
	def(&c.Replicas, 3)
	def(&c.Tenants, 4)
	def(&c.Intents, 150)
	def(&c.Clients, 8)
	if c.FaultInterval <= 0 {
		c.FaultInterval = DefaultFaultInterval
	}
	if c.FaultRate <= 0 {
		c.FaultRate = DefaultFaultRate
	}
	if c.Lease <= 0 {
		c.Lease = 2 * time.Second
	}
	if c.ResolutionDeadline <= 0 {
		c.ResolutionDeadline = 30 * time.Second
	}
	if c.SettleBound <= 0 {
		c.SettleBound = DefaultSettleBound
	}
	if c.FailoverInterval <= 0 {
		c.FailoverInterval = DefaultFailoverInterval
	}
	if c.Log == nil {
		c.Log = io.Discard
	}
	mu := new(sync.Mutex) // one for both: they may be the same writer
	c.Log = serialized{mu, c.Log}
	if c.ReplicaLogs != nil {
		c.ReplicaLogs = serialized{mu, c.ReplicaLogs}
	}
}

// serialized passes one write at a time to w.
type serialized struct {
	mu *sync.Mutex
	w  io.Writer
}

func (s serialized) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.Write(p)
}

// Report is what a run found.
type Report struct {
	Seed     uint64         `json:"seed"`
	Intents  int            `json:"intents"`
	Tenants  int            `json:"tenants"`
	Replicas int            `json:"replicas"`
	Elapsed  string         `json:"elapsed"`
	Faults   map[string]int `json:"faults"`
	Crashes  int            `json:"crashes"`
	Probes   int            `json:"cross_tenant_probes"`
	GaveUp   int            `json:"intents_never_acknowledged"`
	// Amendments recorded, and amendments the clients sent again after the broker refused
	// them while their original was unsettled.
	Amendments       int `json:"amendments"`
	AmendmentsWaited int `json:"amendments_waited"`
	// Pending counts operations a provider answered as accepted but still processing;
	// Resent, those sent again after an answer documented as not executed;
	// PreconditionRefusals, conditional resends the target refused because the object
	// existed.
	// ResolvedByHand counts escalations the run's operator resolved with
	// ResolveOperation after checking the target; EscalationsLeft says why it left
	// some, or may have (empty when it left none).
	ResolvedByHand       int    `json:"resolved_by_hand"`
	EscalationsLeft      string `json:"escalations_left,omitempty"`
	Pending              int    `json:"pending"`
	Resent               int    `json:"resent_after_not_executed"`
	PreconditionRefusals int    `json:"precondition_refusals"`
	// The four that must be zero.
	Lost        int `json:"lost"`
	Duplicated  int `json:"duplicated"`
	Unconfirmed int `json:"unconfirmed"`
	FalseFailed int `json:"false_failed"`

	Recovered           int            `json:"recovered"`
	Escalated           int            `json:"escalated"`
	Unresolved          int            `json:"unknown_at_the_end"`
	UnresolvedSamples   []string       `json:"unknown_samples,omitempty"` // the first 20, with their last observation
	ByState             map[string]int `json:"operations_by_state"`
	UnknownToResolution Durations      `json:"unknown_to_resolution"`
	Settled             bool           `json:"settled"`
	// Failovers are the formation's, with Config.Failover.
	Failovers []Failover `json:"failovers,omitempty"`
	// Evidence is what became of the charge target's webhooks.
	Evidence   EvidenceCounts `json:"evidence"`
	Invariants []Invariant    `json:"invariants"`
}

// EvidenceCounts count the events the ledger kept by what they did, and the deliveries
// signed with a wrong secret (never kept).
type EvidenceCounts struct {
	Kept        int            `json:"kept"`
	Applied     int            `json:"applied"`
	Observed    int            `json:"observed"`
	Quarantined map[string]int `json:"quarantined"` // by reason
	Forged      int            `json:"forged_deliveries"`
	// Reported: events the run's reporter reported (ReportEvidence), of which
	// ReportedForAnotherTenant named another tenant than the event's account.
	Reported                 int `json:"reported"`
	ReportedForAnotherTenant int `json:"reported_for_another_tenant"`
	// Settled: every delivery ended and every kept event was decided before the audit.
	Settled bool `json:"settled"`
}

// Durations summarises a distribution.
type Durations struct {
	Median time.Duration `json:"median_ns"`
	Worst  time.Duration `json:"worst_ns"`
}

// Invariant is one audited invariant and, when it failed, how (the first 20 cases).
type Invariant struct {
	ID         string   `json:"id"`
	Name       string   `json:"name"`
	Held       bool     `json:"held"`
	Violations []string `json:"violations,omitempty"`
}

// Passed reports whether every invariant held.
func (r *Report) Passed() bool {
	return !slices.ContainsFunc(r.Invariants, func(i Invariant) bool { return !i.Held })
}

// Run runs the chaos described by cfg and returns its report. An error means the run
// itself could not be carried out; a broken promise is a report that did not pass.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	cfg.setDefaults()
	if cfg.Broker == "" {
		return nil, errors.New("chaos: no broker binary")
	}
	if cfg.Failover && cfg.DatabaseURL != "" {
		return nil, errors.New("chaos: a failover run starts its own formation: give no database")
	}
	start := time.Now()
	fmt.Fprintf(cfg.Log, "chaos: seed %d: starting PostgreSQL, targets and %d replicas\n", cfg.Seed, cfg.Replicas)
	c, err := newCluster(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("chaos: %w", err)
	}
	defer c.close()

	faultCtx, stopFaults := context.WithCancel(ctx)
	superviseCtx, stopSupervising := context.WithCancel(ctx)
	defer stopSupervising()
	go c.supervise(superviseCtx)
	faultsDone, covered := make(chan struct{}), make(chan struct{})
	go func() { defer close(faultsDone); c.injectFaults(faultCtx, covered) }()
	failoversDone, failoversCovered := make(chan struct{}), make(chan struct{})
	h := &history{}
	if cfg.Failover {
		go func() {
			defer close(failoversDone)
			var wg sync.WaitGroup
			wg.Go(func() { c.probeAvailability(faultCtx, h) })
			c.failoverLoop(faultCtx, cfg.FailoverInterval, failoversCovered)
			wg.Wait()
		}()
	} else {
		close(failoversDone)
		close(failoversCovered)
	}
	reportsDone := make(chan []report, 1)
	go func() { reportsDone <- c.reportEvidence(faultCtx, rand.New(rand.NewPCG(cfg.Seed, 17))) }()

	// Rounds of the workload until every kind of fault has struck at least once and the
	// duration has passed.
	enough := func() bool {
		select {
		case <-covered:
		default:
			return false
		}
		select {
		case <-failoversCovered:
			return time.Since(start) >= cfg.Duration
		default:
			return false
		}
	}
	for round := 0; ctx.Err() == nil && (round == 0 || !enough()); round++ {
		fmt.Fprintf(cfg.Log, "chaos: round %d: %d intents over %d tenants\n", round+1, cfg.Intents, cfg.Tenants)
		c.drive(ctx, h, round)
	}
	stopFaults()
	<-faultsDone
	<-failoversDone
	if c.ha != nil { // a failover that failed half-way may have left a node down
		if err := errors.Join(c.ha.Heal(), c.ha.WaitWhole(ctx, 2*time.Minute)); err != nil {
			fmt.Fprintf(cfg.Log, "chaos: healing the formation: %v\n", err)
		}
	}
	reports := <-reportsDone

	fmt.Fprintln(cfg.Log, "chaos: healing; waiting for the work to settle")
	c.heal()
	c.restartArmed()
	settled := c.settle(ctx, cfg.SettleBound)
	evidenceSettled := c.settleEvidence(ctx, cfg.SettleBound)
	// The owners of the escalations check their targets and record what they found.
	resolvedByHand, resolveErr := c.resolveEscalations(ctx, rand.New(rand.NewPCG(cfg.Seed, 13)))
	if resolveErr != nil {
		fmt.Fprintf(cfg.Log, "chaos: resolving escalations: %v\n", resolveErr)
	}
	stopSupervising()
	c.stopReplicas()

	ops, err := c.readLedger(ctx)
	if err != nil {
		return nil, fmt.Errorf("chaos: audit: %w", err)
	}
	leaks, err := c.credentialLeaks(ctx, ops)
	if err != nil {
		return nil, fmt.Errorf("chaos: audit: %w", err)
	}
	kept, err := c.readEvidence(ctx)
	if err != nil {
		return nil, fmt.Errorf("chaos: audit: %w", err)
	}
	truth := c.truth()
	r := &Report{Seed: cfg.Seed, Intents: len(h.intents), Tenants: cfg.Tenants, Replicas: cfg.Replicas,
		Faults: maps.Clone(c.faults), Crashes: c.crashes, Probes: h.probes, GaveUp: h.gaveUp,
		ByState: map[string]int{}, Settled: settled,
		Evidence: EvidenceCounts{Quarantined: map[string]int{}, Settled: evidenceSettled}}
	for _, s := range c.sims {
		r.PreconditionRefusals += s.Snapshot().PreconditionFailed
		for f, n := range s.Snapshot().Faults {
			if f != "" {
				r.Faults["target: "+string(f)] += n
			}
		}
	}
	r.ResolvedByHand = resolvedByHand
	if resolveErr != nil {
		r.EscalationsLeft = resolveErr.Error()
	}
	r.Failovers = slices.Clone(c.failovers)
	c.probes.windows(r.Failovers)
	audit(r, ops, truth, h, leaks, evidenceAudit{sent: c.charge.Snapshot().Webhooks, kept: kept, reports: reports})
	r.Elapsed = time.Since(start).Round(time.Second).String()
	return r, nil
}

// settle waits until no operation is PREPARED, IN_FLIGHT or UNKNOWN, or the bound
// passes; it reports whether the work settled.
func (c *cluster) settle(ctx context.Context, bound time.Duration) bool {
	deadline := time.Now().Add(bound)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		var open int
		err := c.admin.QueryRow(ctx, `SELECT count(*) FROM operations WHERE state IN ('PREPARED', 'IN_FLIGHT', 'UNKNOWN')`).Scan(&open)
		if err == nil && open == 0 {
			return true
		}
		time.Sleep(250 * time.Millisecond)
	}
	return false
}

// WriteText writes the report for people.
func (r *Report) WriteText(w io.Writer) {
	verdict := "PASSED: every invariant held"
	if !r.Passed() {
		verdict = "FAILED: an invariant was broken"
	}
	fmt.Fprintf(w, "chaos run, seed %d: %s\n", r.Seed, verdict)
	fmt.Fprintf(w, "  %d intents over %d tenants, %d replicas, %s; %d never acknowledged by the clients' retries\n",
		r.Intents, r.Tenants, r.Replicas, r.Elapsed, r.GaveUp)
	fmt.Fprintf(w, "  faults:")
	for _, k := range slices.Sorted(maps.Keys(r.Faults)) {
		fmt.Fprintf(w, " %s %d;", k, r.Faults[k])
	}
	fmt.Fprintf(w, "\n  replica crashes %d, cross-tenant probes %d, amendments %d (%d sent again once their original settled)\n",
		r.Crashes, r.Probes, r.Amendments, r.AmendmentsWaited)
	fmt.Fprintf(w, "  answered pending %d, sent again after an answer documented as not executed %d, conditional resends refused %d\n",
		r.Pending, r.Resent, r.PreconditionRefusals)
	fmt.Fprintf(w, "  escalations resolved by the operator after checking the target %d\n", r.ResolvedByHand)
	if r.EscalationsLeft != "" {
		fmt.Fprintf(w, "    and left: %s\n", r.EscalationsLeft)
	}
	if len(r.Failovers) > 0 {
		fmt.Fprintf(w, "  failovers %d (new primary after; unavailable from the first failed PrepareOperation to the first acknowledged one):\n", len(r.Failovers))
		for _, f := range r.Failovers {
			fmt.Fprintf(w, "    %s: %s; %s", f.Fault, f.NewPrimary.Round(100*time.Millisecond), f.Unavailable.Round(100*time.Millisecond))
			if !f.Recovered {
				fmt.Fprint(w, " and not recovered")
			}
			for _, k := range slices.Sorted(maps.Keys(f.Refusals)) {
				fmt.Fprintf(w, "; %s %d", k, f.Refusals[k])
			}
			if f.Error != "" {
				fmt.Fprintf(w, "; went wrong: %s", f.Error)
			}
			fmt.Fprintln(w)
		}
	}
	fmt.Fprintf(w, "  lost %d, duplicated %d, unconfirmed %d, false-failed %d\n", r.Lost, r.Duplicated, r.Unconfirmed, r.FalseFailed)
	fmt.Fprintf(w, "  recovered from UNKNOWN %d, escalated %d, still UNKNOWN %d (settled: %v)\n", r.Recovered, r.Escalated, r.Unresolved, r.Settled)
	for _, u := range r.UnresolvedSamples {
		fmt.Fprintf(w, "    %s\n", u)
	}
	fmt.Fprintf(w, "  UNKNOWN to resolution: median %s, worst %s\n", r.UnknownToResolution.Median, r.UnknownToResolution.Worst)
	e := r.Evidence
	fmt.Fprintf(w, "  webhooks: %d events kept, %d applied, %d observed, quarantined %v; %d deliveries with a wrong signature refused (settled: %v)\n",
		e.Kept, e.Applied, e.Observed, e.Quarantined, e.Forged, e.Settled)
	fmt.Fprintf(w, "  reported by a service (ReportEvidence): %d, %d of them for another tenant\n", e.Reported, e.ReportedForAnotherTenant)
	var states []string
	for _, k := range slices.Sorted(maps.Keys(r.ByState)) {
		states = append(states, fmt.Sprintf("%s %d", k, r.ByState[k]))
	}
	fmt.Fprintf(w, "  operations: %s\n", strings.Join(states, ", "))
	for _, inv := range r.Invariants {
		mark := "ok  "
		if !inv.Held {
			mark = "FAIL"
		}
		fmt.Fprintf(w, "  %s %-3s %s\n", mark, inv.ID, inv.Name)
		for _, v := range inv.Violations {
			fmt.Fprintf(w, "         %s\n", v)
		}
	}
}

// WriteJSON writes the report as JSON.
func (r *Report) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}
