package reconciler

import (
	"context"
	"errors"
	"log/slog"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"github.com/google/uuid"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"github.com/opbroker/opbroker/brokermetrics"
	"github.com/opbroker/opbroker/startstop"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/target"
	"github.com/opbroker/opbroker/tracing"
)

// Looker asks a target for an operation's effect by the operation's reference
// (capability B). The broker's is the HTTP connector (*target.Connector).
type Looker interface {
	Lookup(ctx context.Context, contract *target.Contract, remoteKey uuid.UUID, approved []byte) target.LookupResult
}

// Deliverer sends a claim once and records its outcome (the dispatcher does); asOf is
// a reading of the shared Clock taken before the claim was asked for. Its Limiter holds
// the targets' concurrency slots, which the reconciler's lookups and replays share with
// the dispatcher's sends. AwaitingCredential reports that the target refused the
// credential the broker still has, so that nothing is sent to it for now.
type Deliverer interface {
	Deliver(contract *target.Contract, op store.Claimed, asOf time.Time)
	Limiter() *target.Limiter
	AwaitingCredential(contract *target.Contract) bool
}

// Config configures a reconciler. Zero values take the defaults noted.
type Config struct {
	Store         *store.Store
	Targets       *target.Targets
	Connector     Looker
	Deliverer     Deliverer
	Logger        *slog.Logger
	MeterProvider metric.MeterProvider
	// TracerProvider receives a span for each reconciliation and each lookup (none when
	// nil), linked to the trace of the call that prepared the operation.
	TracerProvider trace.TracerProvider

	Worker string
	// Batch caps one claim (default 32); PerTenant one tenant's share of it (default 8);
	// MaxTenants the tenants one claim visits (default 64).
	Batch, PerTenant, MaxTenants int
	// Concurrency caps the operations in hand at once (default 64): lookups and replays
	// wait on targets, and one slow target must not hold the others.
	Concurrency int
	// Lease of a reconciler's claim (default DefaultLease): another replica's reconciler
	// takes the operation over once it expires.
	Lease time.Duration
	// PollInterval between passes when nothing is due (default 1s).
	PollInterval time.Duration
	// MaxReplays (DefaultMaxReplays) and MaxLooks (DefaultMaxLooks) bound the effort
	// per operation; ResolutionDeadline (DefaultResolutionDeadline after the first
	// send) bounds its time. Past them the operation is escalated.
	MaxReplays, MaxLooks int
	ResolutionDeadline   time.Duration
	// Clock reads the time (default time.Now); the Deliverer must read the same one.
	// Times the database measured become deadlines on it, never compared with
	// timestamps the database wrote.
	Clock func() time.Time
}

// Defaults of Config, which the broker's flags use too.
const (
	DefaultMaxReplays         = 3
	DefaultMaxLooks           = 50
	DefaultResolutionDeadline = 72 * time.Hour
	DefaultLease              = 30 * time.Second
)

func (c *Config) setDefaults() {
	def := func(v *int, d int) {
		if *v <= 0 {
			*v = d
		}
	}
	def(&c.Batch, 32)
	def(&c.Concurrency, 64)
	def(&c.PerTenant, 8)
	def(&c.MaxTenants, 64)
	def(&c.MaxReplays, DefaultMaxReplays)
	def(&c.MaxLooks, DefaultMaxLooks)
	if c.Lease <= 0 {
		c.Lease = DefaultLease
	}
	if c.PollInterval <= 0 {
		c.PollInterval = time.Second
	}
	if c.ResolutionDeadline <= 0 {
		c.ResolutionDeadline = DefaultResolutionDeadline
	}
	if c.Clock == nil {
		c.Clock = time.Now
	}
	if c.TracerProvider == nil {
		c.TracerProvider = tracenoop.NewTracerProvider()
	}
	if c.Worker == "" {
		c.Worker = store.NewWorkerName()
	}
}

// Reconciler resolves UNKNOWN operations. Start and Stop follow the project's lifecycle
// contract.
type Reconciler struct {
	cfg     Config
	log     *slog.Logger
	types   []string
	actions metric.Int64Counter
	events  *brokermetrics.Events // resolutions
	tracer  trace.Tracer

	cursor string // the tenant the next claim starts after; owned by the loop

	startstop.Base
}

// New returns a stopped reconciler.
func New(cfg Config) (*Reconciler, error) {
	cfg.setDefaults()
	r := &Reconciler{cfg: cfg, log: cfg.Logger.With("component", "reconciler", "worker", cfg.Worker),
		tracer: cfg.TracerProvider.Tracer("github.com/opbroker/opbroker/reconciler")}
	for _, c := range cfg.Targets.All() {
		r.types = append(r.types, c.OperationTypes...)
	}
	var err error
	r.actions, err = cfg.MeterProvider.Meter("github.com/opbroker/opbroker/reconciler").Int64Counter("opbroker.reconcile.actions",
		metric.WithDescription("Reconciler decisions by action (RECORD_SUCCESS, RECORD_FAILURE, REPLAY, WAIT, ESCALATE)"), metric.WithUnit("{decision}"))
	if err != nil {
		return nil, err
	}
	r.events, err = brokermetrics.NewEvents(cfg.MeterProvider)
	return r, err
}

// Start runs reconciliation until Stop, and returns at once (package startstop: Stop
// ends it and waits for the operations in hand; a stopped reconciler starts again). It
// claims what is due as long as it has room (Concurrency) and decides each operation as
// soon as it is claimed, without waiting for the rest of its claim.
func (r *Reconciler) Start(ctx context.Context) error {
	r.Base.Start(ctx, func(ctx context.Context) {
		room := make(chan struct{}, r.cfg.Concurrency)
		var inHand sync.WaitGroup
		defer inHand.Wait()
		for ctx.Err() == nil {
			select { // room for at least one
			case room <- struct{}{}:
				<-room
			case <-ctx.Done():
				return
			}
			if r.runOnce(ctx, room, &inHand) > 0 {
				continue
			}
			select {
			case <-ctx.Done():
			case <-time.After(r.cfg.PollInterval):
			}
		}
	})
	return nil
}

// runOnce claims as many due operations as there is room for and starts deciding each,
// holding a place in room until it is decided; it returns how many it claimed.
func (r *Reconciler) runOnce(ctx context.Context, room chan struct{}, inHand *sync.WaitGroup) int {
	asOf := r.cfg.Clock()
	ops, err := r.claim(ctx, min(r.cfg.Batch, cap(room)-len(room)))
	if err != nil && ctx.Err() == nil {
		r.log.Warn("reconcile claim failed", "error", err)
	}
	for _, op := range ops {
		room <- struct{}{}
		inHand.Go(func() {
			defer func() { <-room }()
			r.reconcile(ctx, op, asOf)
		})
	}
	return len(ops)
}

// claim takes up to limit due UNKNOWN operations, fairly across tenants. The tenant
// cursor is the loop's alone.
func (r *Reconciler) claim(ctx context.Context, limit int) ([]store.UnknownClaim, error) {
	if len(r.types) == 0 || limit <= 0 {
		return nil, nil
	}
	fair := store.FairClaim{
		OperationTypes: r.types, Worker: r.cfg.Worker, Lease: r.cfg.Lease,
		Limit: limit, PerTenant: min(r.cfg.PerTenant, limit), MaxTenants: r.cfg.MaxTenants, AfterTenant: r.cursor,
	}
	// Where this claim's walk over the tenants ends, read just before it: the next claim
	// starts there if this one is short (store.CursorAfter).
	walkEnd, err := r.cfg.Store.AllTenants().WalkEnd(ctx, store.StateUnknown, fair)
	if err != nil && ctx.Err() == nil {
		r.log.Warn("where a claim's walk over the tenants ends was not read", "error", err)
	}
	ops, err := r.cfg.Store.AllTenants().ClaimUnknown(ctx, fair)
	if err != nil {
		return nil, err
	}
	tenants := make([]string, len(ops))
	for i, op := range ops {
		tenants[i] = op.TenantID
	}
	r.cursor = store.CursorAfter(fair, walkEnd, tenants)
	return ops, nil
}

// reconcile gathers evidence for one claimed operation, decides, and acts. asOf is a
// reading of the clock taken before the claim was asked for. It gives up when ctx ends
// (Stop) or the claim's lease does: what it leaves undone is decided again, by whoever
// claims the operation next, and a fenced write never lands twice.
func (r *Reconciler) reconcile(ctx context.Context, op store.UnknownClaim, asOf time.Time) {
	// The fenced writes may run until the lease's end. What waits on the target (a slot
	// of its, the lookup) ends recordMargin before it, so that what it found, or that it
	// found nothing, can still be recorded: cut at the lease's end, a lookup that hangs
	// would leave no look counted and no escalation, and be made again at every claim.
	leaseLeft := asOf.Add(op.LeaseLeft).Sub(r.cfg.Clock())
	ctx, cancel := context.WithTimeout(ctx, leaseLeft)
	defer cancel()
	ctx, span := r.tracer.Start(ctx, "opbroker.reconcile", append(tracing.LinkTo(op.TraceParent),
		trace.WithAttributes(attribute.String("opbroker.operation", op.ID.String()), attribute.Int64("opbroker.fence", op.FenceToken)))...)
	waitCtx, cancelWait := context.WithTimeout(ctx, leaseLeft-r.recordMargin())
	defer cancelWait()
	var err error
	defer func() { tracing.End(span, err) }()
	log := r.log.With("tenant", op.TenantID, "operation", op.ID, "fence", op.FenceToken)
	contract, ok := r.cfg.Targets.ForType(op.OperationType)
	if !ok {
		r.escalate(ctx, log, op, nil, "no recorded contract serves this operation type any more")
		return
	}
	accepted := answeredAccepted(op, contract)
	staleRef, verified := r.staleSuccess(ctx, log, op)
	evidence, obs := r.evidence(waitCtx, contract, op, accepted, staleRef, verified)
	caps := contract.Capabilities()
	in := Input{
		Evidence:              evidence,
		Replay:                caps.Replay,
		Lookup:                caps.Lookup,
		Conditional:           caps.Conditional,
		KeyCoversEveryAttempt: contract.Idempotency.CoversEveryAttempt(),
		MayHaveExecuted:       op.MayHaveExecuted,
		SinceLastSend:         op.SinceLastSend,
		Replays:               int(op.Replays),
		MaxReplays:            r.cfg.MaxReplays,
		Looks:                 int(op.Checks),
		MaxLooks:              r.cfg.MaxLooks,
		AcceptedBefore:        op.AcceptedUnfinished || evidence.Kind == InProgress || accepted,
		VerifiedSuccess:       verified,
		EffectExists:          op.EffectExists,
		RetryAfter:            retryAfterOf(op.LastObservation),
		Jitter:                rand.Float64(),
	}
	if contract.Evidence != nil {
		in.EventsWithin = contract.Evidence.ExpectedWithin.D()
	}
	if contract.Lookup != nil {
		in.VisibilityDelay = contract.Lookup.VisibilityDelay.D()
		in.AbsenceFinalAfter = contract.Lookup.AbsenceFinalAfter.D()
	}
	// The database measured these at the claim; what passed since is added by this
	// clock, from a reading taken before the claim, so each errs towards the later
	// time. (SinceLastSend is not advanced: it must not overstate how long a lookup
	// waited.)
	sinceClaim := r.cfg.Clock().Sub(asOf)
	in.ResolutionLeft = r.cfg.ResolutionDeadline - (op.SinceFirstSend + sinceClaim)
	// What this look records keeps the last send's Retry-After for the next look.
	obs.RetryAfterSeconds = int64(in.RetryAfter / time.Second)
	in.BusinessDeadlinePassed = op.DeadlineLeft != nil && *op.DeadlineLeft <= sinceClaim
	// The key's window and scope, and the lookup's scope, are the ones the ledger
	// recorded for the sends, not what the contract says now.
	if op.KeyWindowLeft != nil {
		in.KeyWindowLeft = *op.KeyWindowLeft - sinceClaim
	}
	in.KeyScopeChanged = op.KeyScope != contract.KeyScope()
	in.LookupScopeChanged = op.LookupScope != contract.LookupScope()

	d := Decide(in)
	span.SetAttributes(attribute.String("opbroker.target", contract.Name), attribute.String("opbroker.evidence", obs.Outcome),
		attribute.String("opbroker.action", d.Action.String()), attribute.String("opbroker.reason", d.Reason))
	r.actions.Add(ctx, 1, metric.WithAttributes(attribute.String("action", d.Action.String())))
	log = log.With("action", d.Action.String(), "reason", d.Reason)
	obs.Summary = d.Reason
	var resolved store.Operation // by RECORD_SUCCESS or RECORD_FAILURE
	switch d.Action {
	case RecordSuccess:
		resolved, err = r.cfg.Store.AllTenants().ResolveUnknown(ctx, store.ResolveParams{TenantID: op.TenantID, ID: op.ID, Fence: op.FenceToken,
			State: store.StateSucceeded, RemoteRef: d.RemoteRef, Observation: obs, Actor: r.actor()})
	case RecordFailure:
		resolved, err = r.cfg.Store.AllTenants().ResolveUnknown(ctx, store.ResolveParams{TenantID: op.TenantID, ID: op.ID, Fence: op.FenceToken,
			State: store.StateFailedTerminal, Observation: obs, Actor: r.actor()})
	case Escalate:
		r.escalate(ctx, log, op, contract, d.Reason)
		return
	case Replay:
		// Sending again: Decide allowed it only where no earlier attempt can execute
		// again (the key covers every attempt, none was sent, or a lookup proved
		// absence); the dispatcher checks the lease and the key's window at the send.
		heldUp := ""
		if r.cfg.Deliverer.AwaitingCredential(contract) {
			// Sent now, the replay would be refused like the dispatcher's sends, and
			// spend the replay budget while the credential is being fixed.
			heldUp = "a replay was decided, but the target refused the broker's credential, and nothing is sent to it until the credential changes"
		} else if err = r.replay(ctx, waitCtx, contract, op); errors.Is(err, errNoSlot) {
			heldUp = "a replay was decided, but no slot of the target's came free in time"
		}
		if heldUp != "" {
			// Recorded as a look, so that what held it up is on the operation and it is
			// decided again after a wait, rather than claimed again when the lease ends;
			// escalated once the looks or the time to resolve it are spent, since the
			// same replay may be decided at every claim while it stays held up.
			if in.BudgetSpent() {
				r.escalate(ctx, log, op, contract, heldUp+", and the budget for looking is spent: "+d.Reason)
				return
			}
			obs.Summary = heldUp + ": " + d.Reason
			err = r.check(ctx, op, obs, in.backoff(in.Looks, 0), in.AcceptedBefore)
		}
	case Wait:
		err = r.check(ctx, op, obs, d.After, in.AcceptedBefore)
	}
	switch {
	case errors.Is(err, store.ErrFenceLost):
		log.Warn("fence lost; another actor moved the operation on (or, for a replay, the target said meanwhile that it accepted the request)")
	case err != nil:
		log.Error("decision not applied; the claim's lease will expire and it is decided again", "error", err)
	default:
		r.events.Resolved(ctx, contract, resolved) // a zero Operation (WAIT, REPLAY) records nothing
		log.Info("reconciled")
	}
}

// recordMargin is the part of a claim's lease kept for recording what the reconciler
// decided.
func (r *Reconciler) recordMargin() time.Duration { return r.cfg.Lease / 4 }

// errNoSlot: no slot of the target's came free while the reconciler could wait.
var errNoSlot = errors.New("reconciler: no slot of the target's came free in time")

// replay sends the operation again with the same key, holding a slot of the target's,
// which it waits for while waitCtx lasts (errNoSlot after that).
func (r *Reconciler) replay(ctx, waitCtx context.Context, contract *target.Contract, op store.UnknownClaim) error {
	limiter := r.cfg.Deliverer.Limiter()
	// A slot free now is taken even when waitCtx is over (a lookup may have used it up):
	// Acquire, with both ready, could take either.
	if !limiter.TryAcquire(contract.Name) {
		if err := limiter.Acquire(waitCtx, contract.Name); err != nil {
			if ctx.Err() == nil {
				return errNoSlot
			}
			return err
		}
	}
	defer limiter.Release(contract.Name, 1)
	asOf := r.cfg.Clock()
	claim, err := r.cfg.Store.AllTenants().BeginReplay(ctx, store.BeginReplayParams{TenantID: op.TenantID, ID: op.ID, Fence: op.FenceToken,
		Worker: r.cfg.Worker, Lease: r.cfg.Lease, AcceptedClasses: acceptedClassesOf(contract)})
	if err != nil {
		return err
	}
	r.cfg.Deliverer.Deliver(contract, claim, asOf)
	return nil
}

// staleSuccess reads the reference of a verified success that a worker received after
// losing its fence, if there is one. Not read, it counts as none: the ledger refuses a
// failure while one is on record anyway.
func (r *Reconciler) staleSuccess(ctx context.Context, log *slog.Logger, op store.UnknownClaim) (string, bool) {
	ref, ok, err := r.cfg.Store.AllTenants().StaleSuccess(ctx, op.TenantID, op.ID)
	if err != nil {
		log.Warn("stale evidence not read", "error", err)
		return "", false
	}
	return ref, ok
}

// evidence looks the operation up (capability B) or falls back on what is known; a
// stale worker's verified success (staleRef, when verified) counts, checked like any
// other observation, and so does accepted: an answer said the target accepted the
// request (answeredAccepted).
func (r *Reconciler) evidence(ctx context.Context, contract *target.Contract, op store.UnknownClaim, accepted bool, staleRef string, verified bool) (Evidence, store.Observation) {
	obs := store.Observation{ObservedAt: r.cfg.Clock(), Source: "LOOKUP"}
	if contract.Lookup != nil {
		limiter := r.cfg.Deliverer.Limiter()
		if err := limiter.Acquire(ctx, contract.Name); err != nil {
			obs.Outcome = "LOOKUP_FAILED"
			return Evidence{Kind: LookupFailed}, obs
		}
		lookupCtx, span := r.tracer.Start(ctx, "opbroker.reconcile.lookup", trace.WithSpanKind(trace.SpanKindClient),
			trace.WithAttributes(attribute.String("opbroker.target", contract.Name)))
		res := r.cfg.Connector.Lookup(lookupCtx, contract, op.RemoteKey, op.Payload)
		span.SetAttributes(attribute.Int("http.response.status_code", res.HTTPStatus))
		span.End()
		limiter.Release(contract.Name, 1)
		obs.HTTPStatus = res.HTTPStatus
		switch res.Outcome {
		case target.LookupFound:
			switch {
			case !res.Matches:
				obs.Outcome = "FOUND_MISMATCH"
				return Evidence{Kind: Found, RemoteRef: res.RemoteRef, Why: res.Summary}, obs
			case res.Settlement == target.Pending:
				obs.Outcome = "FOUND_PENDING"
				return Evidence{Kind: InProgress}, obs
			case res.Settlement == target.Unsettled:
				obs.Outcome = "FOUND_NOT_CONFIRMED"
				return Evidence{Kind: InProgress}, obs
			case res.Settlement == target.FailedFinal:
				obs.Outcome = "FOUND_FAILED"
				return Evidence{Kind: FoundFailed, RemoteRef: res.RemoteRef, Matches: true}, obs
			default:
				obs.Outcome = "FOUND"
			}
			return Evidence{Kind: Found, RemoteRef: res.RemoteRef, Matches: res.Matches}, obs
		case target.LookupNotFound:
			obs.Outcome = "NOT_FOUND"
			return Evidence{Kind: NotFound}, obs
		default:
			obs.Outcome = "LOOKUP_FAILED"
			return Evidence{Kind: LookupFailed}, obs
		}
	}
	obs.Source = "BROKER"
	if verified {
		// A verified answer of the target to this operation's own request, with its
		// reference, that arrived after the sender lost its fence.
		obs.Outcome = "STALE_VERIFIED_SUCCESS"
		return Evidence{Kind: Found, RemoteRef: staleRef, Matches: true}, obs
	}
	if op.EffectExists {
		obs.Outcome = "EFFECT_EXISTS"
		return Evidence{Kind: Exists}, obs
	}
	if last := op.LastObservation; last != nil && last.Outcome == target.ClassInProgress && contract.Idempotency.CoversEveryAttempt() {
		obs.Outcome = "KEY_IN_USE"
		return Evidence{Kind: KeyInUse}, obs
	}
	if accepted {
		obs.Outcome = "ACCEPTED_UNFINISHED"
		return Evidence{Kind: InProgress}, obs
	}
	obs.Outcome = "NO_EVIDENCE"
	return Evidence{Kind: NoEvidence}, obs
}

// retryAfterOf is the wait the last send's answer asked for (its Retry-After), from the
// last observation: that answer's, or a look's since, which keeps it (the wait is
// measured from the last send, so it holds until the next send's answer replaces it).
func retryAfterOf(last *store.Observation) time.Duration {
	if last == nil {
		return 0
	}
	return time.Duration(last.RetryAfterSeconds) * time.Second
}

// acceptedClasses are the answers that say the target accepted the request without
// finishing it: a replay is never sent after one (it may still finish).
var acceptedClasses = []string{target.ClassInProgress, target.ClassAccepted, target.ClassPending, target.ClassNotConfirmed}

// answeredAccepted reports whether an answer of the target to one of the operation's
// sends said it accepted the request without finishing it: the last answer, or one that
// a worker received after losing its fence (a 202 that came after the lease expired).
// It holds whatever a lookup finds now: a request accepted and queued may not be
// visible to lookups yet, so a "not found" does not prove it absent. A 409 for a key
// that saves every answer is not one: it says the key is in use, and a same-key replay
// returns that request's answer (KeyInUse).
func answeredAccepted(op store.UnknownClaim, contract *target.Contract) bool {
	classes := acceptedClassesOf(contract)
	return (op.LastObservation != nil && slices.Contains(classes, op.LastObservation.Outcome)) ||
		slices.ContainsFunc(op.StaleAnswers, func(class string) bool { return slices.Contains(classes, class) })
}

// acceptedClassesOf are the acceptedClasses that mean so at the contract's target.
func acceptedClassesOf(contract *target.Contract) []string {
	if !contract.Idempotency.CoversEveryAttempt() {
		return acceptedClasses
	}
	return slices.DeleteFunc(slices.Clone(acceptedClasses), func(class string) bool { return class == target.ClassInProgress })
}

func (r *Reconciler) check(ctx context.Context, op store.UnknownClaim, obs store.Observation, after time.Duration, accepted bool) error {
	_, err := r.cfg.Store.AllTenants().RecordCheck(ctx, store.CheckParams{TenantID: op.TenantID, ID: op.ID, Fence: op.FenceToken,
		Observation: obs, CheckAfter: after, AcceptedUnfinished: accepted, Actor: r.actor()})
	return err
}

func (r *Reconciler) escalate(ctx context.Context, log *slog.Logger, op store.UnknownClaim, contract *target.Contract, reason string) {
	owner := "unassigned: no contract"
	if contract != nil {
		owner = contract.Owner.Team
		if contract.Owner.Escalation != "" {
			owner += " (" + contract.Owner.Escalation + ")"
		}
	}
	escalated, err := r.cfg.Store.AllTenants().ResolveUnknown(ctx, store.ResolveParams{TenantID: op.TenantID, ID: op.ID, Fence: op.FenceToken,
		State: store.StateEscalated, Observation: store.Observation{ObservedAt: r.cfg.Clock(), Source: "BROKER", Outcome: "ESCALATED", Summary: reason},
		Escalation: &store.Escalation{Owner: owner, Reason: reason, EscalatedAt: r.cfg.Clock()}, Actor: r.actor()})
	if err != nil {
		log.Error("escalation not recorded; it is decided again when the lease expires", "error", err)
		return
	}
	r.events.Resolved(ctx, contract, escalated)
	// Once, with what the owner needs to find it: the operation's name, and the reason
	// under a key of its own (the decision's logger may carry "reason" already).
	log.Warn("escalated", "name", "tenants/"+op.TenantID+"/operations/"+op.ID.String(), "owner", owner, "escalated_because", reason)
}

func (r *Reconciler) actor() string { return "reconciler:" + r.cfg.Worker }
