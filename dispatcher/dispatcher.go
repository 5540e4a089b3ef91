package dispatcher

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"github.com/opbroker/opbroker/brokermetrics"
	"github.com/opbroker/opbroker/crashpoint"
	"github.com/opbroker/opbroker/payload"
	"github.com/opbroker/opbroker/startstop"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/target"
	"github.com/opbroker/opbroker/tracing"
)

// Sender makes the one transmission of a claim. The broker's is the HTTP connector
// (*target.Connector); a benchmark's may do nothing, to measure the broker alone.
type Sender interface {
	Send(ctx context.Context, req target.Request) target.Result
	// CredentialVersion changes whenever the credential presented to the target
	// changes (see target.Connector.CredentialVersion).
	CredentialVersion(contract *target.Contract) string
}

// Config configures a dispatcher. Zero values take the defaults noted.
type Config struct {
	Store         *store.Store
	Targets       *target.Targets
	Connector     Sender
	Logger        *slog.Logger
	MeterProvider metric.MeterProvider
	// TracerProvider receives a span for each claim and each send (none when nil); a
	// send links to the trace of the call that prepared its operation, and carries its
	// own trace context to the target (package tracing).
	TracerProvider trace.TracerProvider

	// Worker names this dispatcher in leases and attempts; default host/pid/random.
	Worker string
	// PoolSize caps concurrent sends in this process (DefaultPoolSize); a target's
	// contract may cap its own lower. A send's slot is freed when its reply is in;
	// Unrecorded (default the larger of 4 × PoolSize and 2 × ClaimBatch) caps the claims
	// taken whose outcomes are not yet written: those waiting for a slot, those being
	// sent and those whose outcomes the store is writing together.
	PoolSize   int
	Unrecorded int
	// ClaimBatch caps one claim (DefaultClaimBatch). A claim takes what the target's free
	// slots can start now, and what its recent rate of sends will start within a quarter
	// of the lease: claims run ahead of the sends, but no lease is held long for work that
	// waits its turn. PerTenant caps one tenant's share of a claim (default ClaimBatch/4);
	// MaxTenantsPerClaim caps the tenants one claim visits (default 64).
	ClaimBatch         int
	PerTenant          int
	MaxTenantsPerClaim int
	// Lease is how long a claim is held before the sweeper may take it (DefaultLease); it
	// is extended while a call runs, and a call is cut when it cannot be.
	Lease time.Duration
	// PollInterval is the fallback when no wake-up arrives (default 1s).
	PollInterval time.Duration
	// ShutdownGrace is how long calls in progress may run after Stop
	// (DefaultShutdownGrace).
	ShutdownGrace time.Duration
	// RecordTimeout bounds writing one outcome, retries included (default 15s). An
	// outcome may take up to a hundredth of it longer: the outcomes that begin within
	// that hundredth share one deadline.
	RecordTimeout time.Duration
	// MaxResends caps how many answers documented as not executed one operation may get
	// (DefaultMaxResends): each is sent again after max(Retry-After, backoff with
	// jitter), and once the budget is spent it is FAILED_TERMINAL (nothing executed).
	MaxResends int
	// Clock reads the time (default time.Now). Every safety decision compares its
	// readings only with each other: a lease or a window the database measured becomes
	// a deadline on this clock, so a host whose clock is off by seconds decides the same.
	Clock func() time.Time
}

// Defaults of Config, which the broker's flags use too.
const (
	DefaultPoolSize      = 32
	DefaultClaimBatch    = 512
	DefaultLease         = 30 * time.Second
	DefaultShutdownGrace = 30 * time.Second
	DefaultMaxResends    = 10
)

func (c *Config) setDefaults() {
	def := func(v *int, d int) {
		if *v <= 0 {
			*v = d
		}
	}
	defDur := func(v *time.Duration, d time.Duration) {
		if *v <= 0 {
			*v = d
		}
	}
	def(&c.PoolSize, DefaultPoolSize)
	def(&c.ClaimBatch, DefaultClaimBatch)
	def(&c.Unrecorded, max(4*c.PoolSize, 2*c.ClaimBatch))
	def(&c.PerTenant, max(1, c.ClaimBatch/4))
	def(&c.MaxTenantsPerClaim, 64)
	def(&c.MaxResends, DefaultMaxResends)
	defDur(&c.Lease, DefaultLease)
	defDur(&c.PollInterval, time.Second)
	defDur(&c.ShutdownGrace, DefaultShutdownGrace)
	defDur(&c.RecordTimeout, 15*time.Second)
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

// Dispatcher claims and sends. Start and Stop follow the project's lifecycle contract.
type Dispatcher struct {
	cfg     Config
	log     *slog.Logger
	global  chan struct{}   // send slots of the process
	held    chan struct{}   // claims taken and not yet recorded
	limiter *target.Limiter // each target's slots, shared with the reconciler's replays and lookups
	leases  leases          // of the claims held, waiting for a slot or being sent
	// queues holds, per target, the claims waiting for a slot and the rate at which its
	// sends start; the map and each queue's pace are owned by the claim loop.
	queues map[string]*queue

	sends metric.Int64Counter
	// sendsBy is sends' attributes: target, class.
	sendsBy *brokermetrics.Pairs
	events  *brokermetrics.Events // UNKNOWN entered; replays' resolutions
	tracer  trace.Tracer

	// refused holds, per target whose credential it refused, the credential's version
	// then and when: the target's operations wait until it changes, or the vendor may
	// have fixed its side (credentialRecheck).
	refusedMu sync.Mutex
	refused   map[string]refusal
	// passed holds, per target whose refusal a send ended, when that send began: a
	// refusal of a send begun earlier, answered late, does not start a new one.
	passed map[string]time.Time
	// refusing is whether refused holds any target, read without the lock by every
	// send that gets an answer.
	refusing atomic.Bool

	startstop.Base // the claim loop

	// life runs Start and Stop one at a time: a Start while a Stop waited for the calls in
	// progress kept their context, which that Stop then cancelled.
	life sync.Mutex

	mu          sync.Mutex
	sendCtx     context.Context    // calls; replaced when a stopped dispatcher starts again
	cancelSends context.CancelFunc // cuts calls in progress after the grace period
	inFlight    sync.WaitGroup
	freed       chan struct{} // a send or a record finished: capacity may be free

	actor     string // the outcomes' actor: "dispatcher:" and the worker
	recordMu  sync.Mutex
	recordCtx atomic.Pointer[sharedDeadline] // what outcomes are written on now (recordContext)
}

// New returns a stopped dispatcher.
func New(cfg Config) (*Dispatcher, error) {
	cfg.setDefaults()
	meter := cfg.MeterProvider.Meter("github.com/opbroker/opbroker/dispatcher")
	d := &Dispatcher{
		cfg:     cfg,
		log:     cfg.Logger.With("component", "dispatcher", "worker", cfg.Worker),
		global:  make(chan struct{}, cfg.PoolSize),
		held:    make(chan struct{}, cfg.Unrecorded),
		limiter: target.NewLimiter(cfg.Targets, cfg.PoolSize),
		queues:  map[string]*queue{},
		refused: map[string]refusal{},
		passed:  map[string]time.Time{},
		freed:   make(chan struct{}, 1),
		tracer:  cfg.TracerProvider.Tracer("github.com/opbroker/opbroker/dispatcher"),
		sendsBy: brokermetrics.NewPairs("target", "class"),
		actor:   "dispatcher:" + cfg.Worker,
	}
	var err error
	if d.sends, err = meter.Int64Counter("opbroker.dispatch.sends",
		metric.WithDescription("Sends to targets by target and outcome class"), metric.WithUnit("{send}")); err != nil {
		return nil, err
	}
	if d.events, err = brokermetrics.NewEvents(cfg.MeterProvider); err != nil {
		return nil, err
	}
	if _, err = meter.Int64ObservableGauge("opbroker.dispatch.credential_refused",
		metric.WithDescription("1 for each target whose credential it refused: its sends wait until the credential changes"),
		metric.WithInt64Callback(func(_ context.Context, o metric.Int64Observer) error {
			d.refusedMu.Lock()
			defer d.refusedMu.Unlock()
			for name := range d.refused {
				o.Observe(1, metric.WithAttributes(attribute.String("target", name)))
			}
			return nil
		})); err != nil {
		return nil, err
	}
	d.leases.d = d
	d.sendCtx, d.cancelSends = context.WithCancel(context.Background())
	return d, nil
}

// Start begins claiming and sending, and returns at once (package startstop:
// starting a running dispatcher does nothing; a stopped one starts again); during a
// Stop, it returns once that Stop is over.
func (d *Dispatcher) Start(ctx context.Context) error {
	d.life.Lock()
	defer d.life.Unlock()
	d.mu.Lock()
	if d.sendCtx.Err() != nil { // stopped before: its calls were cut
		d.sendCtx, d.cancelSends = context.WithCancel(context.Background())
	}
	d.mu.Unlock()
	d.leases.resume()
	d.Base.Start(ctx, func(ctx context.Context) {
		wake, unsubscribe := d.cfg.Store.Subscribe()
		defer unsubscribe()
		d.claimLoop(ctx, wake)
	})
	return nil
}

// StopClaiming stops claiming at once and returns; what was claimed, and what Deliver is
// handed meanwhile, is still sent and recorded, until Stop. A replica's shutdown calls it
// before it stops its reconciler, whose replays go through Deliver, so that nothing new
// is claimed while the reconciler finishes.
func (d *Dispatcher) StopClaiming() {
	d.life.Lock()
	defer d.life.Unlock()
	d.Base.Stop()
}

// Stop stops claiming at once, gives what was claimed the grace period to be sent and
// answered and records the outcomes, then cuts what is left: a cut call is recorded
// UNKNOWN, and a claim still waiting for its slot goes back to PREPARED, never sent
// (NOT_STARTED). It blocks until every outcome is recorded. It is idempotent and safe
// without Start.
func (d *Dispatcher) Stop() {
	d.life.Lock()
	defer d.life.Unlock()
	d.Base.Stop()
	done := make(chan struct{})
	go func() { d.inFlight.Wait(); close(done) }()
	timer := time.NewTimer(d.cfg.ShutdownGrace)
	defer timer.Stop()
	_, cancelSends := d.calls()
	select {
	case <-done:
	case <-timer.C:
		d.log.Warn("calls still in progress after the grace period; cutting them (they will be UNKNOWN)")
		cancelSends()
		<-done
	}
	cancelSends()
	d.leases.wait()
}

// calls returns the context of calls, and what cancels it.
func (d *Dispatcher) calls() (context.Context, context.CancelFunc) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.sendCtx, d.cancelSends
}

func (d *Dispatcher) claimLoop(ctx context.Context, wake <-chan struct{}) {
	poll := time.NewTicker(d.cfg.PollInterval)
	defer poll.Stop()
	for ctx.Err() == nil {
		claimed, full, err := d.runOnce(ctx)
		if err != nil && ctx.Err() == nil {
			d.log.Warn("claim failed", "error", err)
		}
		if full && claimed > 0 && err == nil {
			continue // more may be waiting
		}
		select {
		case <-ctx.Done():
		case <-wake:
			d.undrain()
		case <-d.freed:
		case <-poll.C:
			d.undrain()
		}
	}
}

// undrain has the next claim loop claim for every target again, those whose last claim
// found nothing included: new work was prepared, or the poll interval passed (work that
// was waiting for its time, such as a send again after an answer documented as not
// executed, may be due).
func (d *Dispatcher) undrain() {
	for _, q := range d.queues {
		q.drained = false
	}
}

// queue is one target's claims that wait for a slot, and the pace of its sends.
type queue struct {
	cursor  string       // the tenant the next claim starts after
	drained bool         // its last claim found nothing: skipped until undrain
	waiting atomic.Int64 // claimed, not yet started (or given up)
	started atomic.Int64 // sends started (or given up) so far

	seen   int64     // started when the pace was last measured
	seenAt time.Time // then, by the dispatcher's clock
	pace   float64   // sends started per second over the last paceWindow or more
}

// claimTimeout bounds one claim: its statement, and the read of where its walk ends.
const claimTimeout = 10 * time.Second

// paceWindow is the shortest time a target's pace is measured over: claims come
// milliseconds apart, and a pace measured between two of them is noise.
const paceWindow = 100 * time.Millisecond

// claimable returns how many operations a claim for the target may take now: what its
// free slots start at once, and what its pace starts within a quarter of the lease,
// less the claims already waiting. Until its pace is measured, only the free slots.
func (d *Dispatcher) claimable(contract *target.Contract, q *queue) int {
	now, started := d.cfg.Clock(), q.started.Load()
	if q.seenAt.IsZero() {
		q.seen, q.seenAt = started, now
	} else if elapsed := now.Sub(q.seenAt); elapsed >= paceWindow {
		q.pace = float64(started-q.seen) / elapsed.Seconds()
		q.seen, q.seenAt = started, now
	}
	free := min(d.limiter.Free(contract.Name), cap(d.global)-len(d.global))
	ahead := int(q.pace * (d.cfg.Lease / 4).Seconds())
	return min(free+ahead-int(q.waiting.Load()), cap(d.held)-len(d.held), d.cfg.ClaimBatch)
}

// runOnce claims, for every target, what claimable allows, and starts sending it. It
// returns how many operations it claimed and whether any target's claim came back full
// (more work is likely waiting). Sends continue in the background after it returns.
func (d *Dispatcher) runOnce(ctx context.Context) (claimed int, full bool, err error) {
	for _, contract := range d.cfg.Targets.All() {
		if ctx.Err() != nil { // stopped: no new claim
			return claimed, false, err
		}
		q := d.queues[contract.Name]
		if q == nil {
			q = &queue{}
			d.queues[contract.Name] = q
		}
		// A target whose last claim found nothing is not claimed for again until new work
		// is prepared or the poll interval passes: each outcome recorded frees a slot and
		// wakes this loop, and a claim per wake-up for each idle target was a statement
		// for nothing (in a burn-down of one target's work, two of the three claims).
		if q.drained {
			continue
		}
		want := d.claimable(contract, q)
		if want <= 0 {
			continue
		}
		credential := d.credentialGate(contract)
		switch credential {
		case gateClosed:
			continue
		case gateProbe:
			want = 1 // one send tries the refused credential again, not a claim's worth
		}
		asOf := d.cfg.Clock()
		// A claim that commits must be worked, so Stop does not cut one short: cancelled
		// while PostgreSQL commits it, the claims would be lost to this process and wait
		// for their leases to expire (UNKNOWN). claimTimeout bounds it instead.
		claimCtx, cancelClaim := context.WithTimeout(context.WithoutCancel(ctx), claimTimeout)
		claimCtx, span := d.tracer.Start(claimCtx, "opbroker.dispatch.claim", trace.WithAttributes(
			attribute.String("opbroker.target", contract.Name), attribute.Int("opbroker.claim.limit", want)))
		fair := store.FairClaim{
			OperationTypes: contract.OperationTypes,
			Worker:         d.cfg.Worker,
			Lease:          d.cfg.Lease,
			Limit:          want,
			PerTenant:      min(d.cfg.PerTenant, want),
			MaxTenants:     d.cfg.MaxTenantsPerClaim,
			AfterTenant:    q.cursor,
		}
		// Where this claim's walk over the tenants ends, read just before it: the next
		// claim starts there if this one is short (store.CursorAfter).
		walkEnd, walkErr := d.cfg.Store.AllTenants().WalkEnd(claimCtx, store.StatePrepared, fair)
		ops, claimErr := d.cfg.Store.AllTenants().Claim(claimCtx, ClaimParams(contract, fair))
		cancelClaim()
		span.SetAttributes(attribute.Int("opbroker.claim.claimed", len(ops)))
		tracing.End(span, claimErr)
		if claimErr != nil {
			err = errors.Join(err, claimErr)
			continue
		}
		full, q.drained = full || len(ops) == want, len(ops) == 0
		if credential == gateProbe && len(ops) > 0 {
			// This claim's send is the one that tries the refused credential again (or, if
			// a replay took that chance meanwhile, the second).
			d.tryCredential(contract)
		}
		tenants := make([]string, len(ops))
		for i, op := range ops {
			tenants[i] = op.TenantID
		}
		q.cursor = store.CursorAfter(fair, walkEnd, tenants) // "" (the first tenant) when the end was not read
		if walkErr != nil && len(ops) < want {               // a full claim did not need it
			err = errors.Join(err, fmt.Errorf("where a claim's walk over the tenants ends was not read: %w", walkErr))
		}
		q.waiting.Add(int64(len(ops)))
		for _, op := range ops {
			d.held <- struct{}{}
			d.inFlight.Add(1)
			go func() {
				defer func() {
					<-d.held
					d.inFlight.Done()
					d.signalFreed()
				}()
				d.deliver(contract, op, asOf, func(ctx context.Context) (func(), error) {
					return d.slots(ctx, contract.Name, q)
				})
			}()
		}
		claimed += len(ops)
	}
	return claimed, full, err
}

// slots takes one of the target's slots and one of the process's, waiting until both
// are free or ctx ends, and counts the send as started; it returns what frees them.
func (d *Dispatcher) slots(ctx context.Context, name string, q *queue) (func(), error) {
	defer func() {
		q.waiting.Add(-1)
		q.started.Add(1)
	}()
	if err := d.limiter.Acquire(ctx, name); err != nil {
		return nil, err
	}
	select {
	case d.global <- struct{}{}:
	case <-ctx.Done():
		d.limiter.Release(name, 1)
		return nil, ctx.Err()
	}
	var once sync.Once
	return func() {
		once.Do(func() {
			d.limiter.Release(name, 1)
			<-d.global
			d.signalFreed()
		})
	}, nil
}

// ClaimParams returns what a claim of the contract's operations asks, as the claim loop
// asks it: fair's operations, with the key's retention and scope and the lookup's
// scope, which the claim records for the sends (store.ClaimParams).
func ClaimParams(contract *target.Contract, fair store.FairClaim) store.ClaimParams {
	return store.ClaimParams{KeyRetention: contract.KeyRetention(), KeyScope: contract.KeyScope(),
		LookupScope: contract.LookupScope(), FairClaim: fair}
}

// refusal is a target's refusal of the broker's credential.
type refusal struct {
	version string    // the credential's version it refused (Sender.CredentialVersion)
	sentAt  time.Time // when the refused send began, by the dispatcher's clock
	at      time.Time // when the refusal was recorded
	tried   time.Time // when a send was last let through to try it again (zero: none since)
}

const (
	// credentialRecheck is how long a target that refused a credential waits for it to
	// change before one send tries it again anyway: the vendor may have fixed its side
	// (a key re-enabled, a permission granted).
	credentialRecheck = 5 * time.Minute
	// credentialRetry is how soon after one send was let through to try a refused
	// credential another may be: the first may never have been sent (no slot, a lost
	// fence) or answered.
	credentialRetry = time.Minute
	// credentialLapse is how long a refusal that no send has tried stands: a replica
	// with nothing to send to the target would otherwise report it (and keep its alert
	// firing) long after the vendor fixed its side.
	credentialLapse = 2 * credentialRecheck
)

// gate is what credentialGate allows a target's sends.
type gate int

const (
	gateOpen   gate = iota // no refusal of the credential the broker has
	gateClosed             // refused: nothing is sent
	gateProbe              // refused a while ago: one send may try again (tryCredential)
)

// credentialGate says whether the target refused the credential it still has. Its
// sends then wait, rather than hammer it, until the credential changes; every
// credentialRecheck one send may try it again, and the refusal stands until the target
// answers a send with anything but a refusal (credentialAnswered). It only looks: the
// sender that takes the chance says so with tryCredential.
func (d *Dispatcher) credentialGate(contract *target.Contract) gate {
	if !d.refusing.Load() {
		return gateOpen
	}
	d.refusedMu.Lock()
	defer d.refusedMu.Unlock()
	return d.gateLocked(contract)
}

func (d *Dispatcher) gateLocked(contract *target.Contract) gate {
	r, ok := d.refused[contract.Name]
	now := d.cfg.Clock()
	switch {
	case !ok:
		return gateOpen
	case d.credentialChanged(contract, r):
		d.log.Info("the target's credential changed; sending to it again", "target", contract.Name)
		d.forgetLocked(contract.Name)
		return gateOpen
	case now.Sub(r.at) >= credentialLapse && now.Sub(r.tried) >= credentialLapse:
		d.log.Info("nothing tried the refused credential for a while; sending to the target again", "target", contract.Name)
		d.forgetLocked(contract.Name)
		return gateOpen
	case now.Sub(r.at) >= credentialRecheck && (r.tried.IsZero() || now.Sub(r.tried) >= credentialRetry):
		return gateProbe
	}
	return gateClosed
}

// forgetLocked ends the target's refusal; refusedMu is held.
func (d *Dispatcher) forgetLocked(name string) {
	delete(d.refused, name)
	d.refusing.Store(len(d.refused) > 0)
}

// credentialChanged reports whether the credential the target refused is no longer
// the one the broker has. One that cannot be read now (a secret being swapped) is not
// taken for a change: nothing is sent with it anyway.
func (d *Dispatcher) credentialChanged(contract *target.Contract, r refusal) bool {
	v := d.cfg.Connector.CredentialVersion(contract)
	return v != "" && v != r.version
}

// refusedSince reports whether the target refused the credential the broker still has
// after asOf, when a claim was taken: its sends, claimed before the refusal, would be
// refused too.
func (d *Dispatcher) refusedSince(contract *target.Contract, asOf time.Time) bool {
	if !d.refusing.Load() {
		return false
	}
	d.refusedMu.Lock()
	defer d.refusedMu.Unlock()
	r, ok := d.refused[contract.Name]
	return ok && r.at.After(asOf) && !d.credentialChanged(contract, r)
}

// tryCredential reports whether a send may go to the target now: none is refused, or
// this one is let through to try a refused credential again (and no other is for
// credentialRetry).
func (d *Dispatcher) tryCredential(contract *target.Contract) bool {
	if !d.refusing.Load() {
		return true
	}
	d.refusedMu.Lock()
	defer d.refusedMu.Unlock()
	switch d.gateLocked(contract) {
	case gateOpen:
		return true
	case gateProbe:
		d.log.Info("the target refused this credential a while ago; one send tries it again", "target", contract.Name)
		r := d.refused[contract.Name]
		r.tried = d.cfg.Clock()
		d.refused[contract.Name] = r
		return true
	}
	return false
}

// AwaitingCredential reports whether nothing may be sent to the target now because it
// refused the credential the broker still has. A reconciler asks before it sends a
// same-key replay, which may be the one send that tries the credential again.
func (d *Dispatcher) AwaitingCredential(contract *target.Contract) bool {
	return !d.tryCredential(contract)
}

// credentialRefused records that the target refused version, the credential a send
// begun at sentAt presented: its operations wait until the credential is no longer
// version. A refusal of a send begun before the one recorded (an earlier claim's
// sends, answered late; a credential since replaced) changes nothing: it would only
// put off the next try, or stand for a credential the broker no longer has.
func (d *Dispatcher) credentialRefused(contract *target.Contract, version string, sentAt time.Time) {
	d.refusedMu.Lock()
	defer d.refusedMu.Unlock()
	r, ok := d.refused[contract.Name]
	switch {
	case !ok && sentAt.Before(d.passed[contract.Name]):
		return // begun before the send that ended the last refusal
	case !ok:
		d.log.Error("the target refused the broker's credential; its sends wait until the credential changes",
			"target", contract.Name)
	case sentAt.Before(r.sentAt):
		return
	}
	d.refused[contract.Name] = refusal{version: version, sentAt: sentAt, at: d.cfg.Clock()}
	d.refusing.Store(true)
}

// credentialAnswered ends the target's refusal when a send begun no earlier than the
// refused one (at sentAt) got an answer that passed authentication (authenticated). A
// send begun before it says nothing of it.
func (d *Dispatcher) credentialAnswered(contract *target.Contract, sentAt time.Time) {
	if !d.refusing.Load() {
		return
	}
	d.refusedMu.Lock()
	defer d.refusedMu.Unlock()
	if r, ok := d.refused[contract.Name]; ok && !sentAt.Before(r.sentAt) {
		d.log.Info("the target accepted the broker's credential again", "target", contract.Name)
		d.passed[contract.Name] = sentAt
		d.forgetLocked(contract.Name)
	}
}

// credentialAnswer records what the answer to a send begun at sentAt, which presented
// the credential's version, says of the credential.
func (d *Dispatcher) credentialAnswer(contract *target.Contract, res target.Result, version string, sentAt time.Time) {
	switch {
	case res.Class == target.ClassCredentialRefused:
		d.credentialRefused(contract, version, sentAt)
	case authenticated(res.Class):
		d.credentialAnswered(contract, sentAt)
	}
}

// authenticated reports whether an answer's class says the request passed the target's
// authentication: the contract lists its status as a success, a rejection, a failed
// precondition or work in progress (or it is a 202). A documented not-executed answer
// (a 429, a 503), a redirect (a gateway's login page), a 5xx and an unlisted status (a
// proxy's 400 or 408) may come from in front of the authentication, and say nothing.
func authenticated(class string) bool {
	switch class {
	case target.ClassVerifiedSuccess, target.ClassSuccessWithoutRef, target.ClassPending, target.ClassDocumentedFailure,
		target.ClassNotConfirmed, target.ClassDocumentedRejection, target.ClassPreconditionFailed, target.ClassInProgress,
		target.ClassAccepted:
		return true
	}
	return false
}

func (d *Dispatcher) signalFreed() {
	select {
	case d.freed <- struct{}{}:
	default:
	}
}

// Limiter returns the targets' concurrency slots that the dispatcher's sends take: a
// caller of Deliver, and anyone else who sends to or looks up a target, takes one too.
func (d *Dispatcher) Limiter() *target.Limiter { return d.limiter }

// Deliver makes the one transmission of a claim (the dispatcher's, or a reconciler's
// same-key replay) and records its outcome under the claim's fence. asOf is a reading
// of the dispatcher's Clock taken before the claim was asked for: the claim's lease,
// window and deadline count from it. The caller holds a slot of the target's (Limiter)
// for the call. It blocks until the outcome is recorded. It works whether or not the
// dispatcher was started.
func (d *Dispatcher) Deliver(contract *target.Contract, op store.Claimed, asOf time.Time) {
	d.deliver(contract, op, asOf, func(context.Context) (func(), error) { return func() {}, nil })
}

// deliver is Deliver, first waiting for the slots the send needs (acquire); what
// acquire returns frees them once the call is over (or was never made), before the
// outcome is recorded. The claim's lease is kept while it waits and while it is sent.
func (d *Dispatcher) deliver(contract *target.Contract, op store.Claimed, asOf time.Time, acquire func(context.Context) (func(), error)) {
	sendCtx, _ := d.calls()
	callCtx, cut := context.WithCancel(sendCtx)
	defer cut()
	// The claim's times as deadlines on this clock: asOf precedes the database's
	// measurement, so each falls no later than the database's.
	lease := d.leases.hold(op, contract.Name, asOf.Add(op.LeaseLeft), cut)
	defer d.leases.drop(lease)
	log := func() *slog.Logger { return d.opLog(contract.Name, lease.op) }

	replied, err := acquire(callCtx)
	if err != nil {
		// Cut while it waited. Its lease is given back before its outcome is written, as
		// release does (it holds no slot).
		d.leases.drop(lease)
		d.cutBeforeSend(contract, op, sendCtx)
		return
	}
	defer replied()
	// release gives back the claim's slot and its lease before its outcome is written:
	// after its call, or when it will not be sent. Its lease is no longer kept (as before
	// any call, the outcome must be written within what is left of it), so the keeper's
	// statement never contends with the outcome's for the row (it would find the row
	// busy, then the fence lost, and say so).
	release := func() {
		replied()
		d.leases.drop(lease)
	}
	if !payload.Matches(op.ContentType, op.Payload, op.PayloadSHA256) {
		log().Error("payload does not match its recorded hash; not sending")
		release()
		d.refuse(contract, op, "PAYLOAD_INTEGRITY", "the stored payload does not match its recorded hash; nothing was sent")
		return
	}
	if err := crashpoint.Hit(crashpoint.DispatchAfterClaim); err != nil {
		log().Warn("abandoning the claim", "error", err) // the lease will expire: UNKNOWN
		return
	}
	// The call is bounded by the contract's timeout and the dispatch deadline here, and
	// by the lease through d.leases, which cuts it when the lease cannot be kept.
	var timeout time.Duration
	if op.DeadlineLeft != nil {
		timeout = asOf.Add(*op.DeadlineLeft).Sub(d.cfg.Clock())
		if timeout <= 0 {
			release()
			d.refuse(contract, op, "DISPATCH_DEADLINE_PASSED", "the dispatch deadline passed before the send; nothing was sent")
			return
		}
	}

	// Sending again? A claim of the dispatcher's own is the operation's first send, or a
	// send after answers the target documents as not executed: only PREPARED operations
	// are claimed, and the schema lets an operation be PREPARED again only while every
	// attempt was answered that way. A claim from BeginReplay is a same-key replay that
	// the reconciler allowed only where no earlier attempt can execute again (see
	// reconciler.Decide); the two checks below hold the claim and the key's window to
	// the moment of the send.
	//
	// A claim whose lease is over, or nearly, may belong to someone else already: the
	// sweeper may have made it UNKNOWN and a reconciler be replaying it under a new
	// fence. A send now would be a second one under an old fence, which a provider that
	// saves only successes executes again. (A process paused between this check and the
	// write is caught only by a target that checks the fence header.)
	margin := d.margin()
	if d.leases.end(lease).Sub(d.cfg.Clock()) < margin {
		log().Warn("the lease is over or nearly before the send; not sending (the sweeper makes it UNKNOWN)")
		return
	}
	// A replay is safe only while the target still knows the key, and the key still
	// means what it meant when it was first sent: the reconciler decided inside the
	// window, but the send happens now, and a target that has forgotten the key executes
	// it again. The window and the scope are the ones the ledger recorded for the sends,
	// not what the contract says now.
	// A conditional target's precondition protects a resend whatever the key's window.
	if mayHaveExecuted(op) && (contract.Idempotency != nil || contract.Conditional != nil) {
		switch {
		case contract.Conditional == nil && (op.KeyWindowLeft == nil || asOf.Add(*op.KeyWindowLeft).Sub(d.cfg.Clock()) < margin):
			log().Warn("the key's retention window closed before the replay was sent; not sending")
			release()
			d.record(contract, op, target.Result{Outcome: target.Unknown, Class: "REPLAY_WINDOW_CLOSED",
				Summary: "the key's retention window, as the ledger recorded it for the sends, closed before the replay was sent; nothing was sent"})
			return
		case op.KeyScope != contract.KeyScope():
			log().Warn("the contract changed since the key was first sent; not sending the replay")
			release()
			d.record(contract, op, target.Result{Outcome: target.Unknown, Class: "KEY_SCOPE_CHANGED",
				Summary: "the contract changed since the key was first sent (endpoint, headers, key scope or credential); nothing was sent"})
			return
		}
	}
	// Cut before the send, although its wait ended with a slot? When the grace period
	// ends, the cut of a call in progress frees its slot while the claims waiting for one
	// may not be cut yet (a context cancels its children one at a time, after its own
	// Err is set), and a wait whose slot and cut are both ready takes either. Sent on a
	// cut context, the request would not leave, yet be recorded UNKNOWN as one that may
	// have: a claim never sent is given back instead.
	if sendCtx.Err() != nil || callCtx.Err() != nil {
		release()
		d.cutBeforeSend(contract, op, sendCtx)
		return
	}
	// Claimed before the target refused the credential it would present: every such
	// send would be refused too, and a burst of failed logins can get the account
	// locked. Given back unsent, to go when the credential is fixed. (A replay was let
	// through by the reconciler's own check.)
	if !mayHaveExecuted(op) && d.refusedSince(contract, asOf) {
		release()
		d.record(contract, op, target.Result{Outcome: target.NotExecuted, Class: "NOT_STARTED",
			Summary: "the target refused the broker's credential after this claim was taken; nothing was sent"})
		return
	}
	credential, sentAt := d.cfg.Connector.CredentialVersion(contract), d.cfg.Clock()
	var sentErr atomic.Pointer[error] // set on the transport's goroutine
	// The link goes in at the start, where a sampler can see it; the attributes only
	// when the span is recorded: built for every send, they cost allocations with
	// tracing off too.
	callCtx, span := d.tracer.Start(callCtx, "opbroker.dispatch.send", append(tracing.LinkTo(op.TraceParent), sendSpanKind)...)
	if span.IsRecording() {
		span.SetAttributes(attribute.String("opbroker.target", contract.Name),
			attribute.String("opbroker.operation", op.ID.String()), attribute.Int64("opbroker.fence", op.FenceToken),
			attribute.Int("opbroker.attempt", int(op.AttemptCount)))
	}
	res := d.cfg.Connector.Send(callCtx, target.Request{
		Contract: contract, Payload: op.Payload, ContentType: op.ContentType,
		RemoteKey: op.RemoteKey, Fence: op.FenceToken, Timeout: timeout,
		OnSent: func() {
			if err := crashpoint.Hit(crashpoint.DispatchAfterSend); err != nil {
				hit := err // a copy: taking err's address put every send's err on the heap
				sentErr.Store(&hit)
			}
		},
	})
	release() // the call is over
	if span.IsRecording() {
		span.SetAttributes(attribute.String("opbroker.outcome", res.Class), attribute.Bool("opbroker.sent", res.Sent))
		if res.HTTPStatus != 0 {
			span.SetAttributes(attribute.Int("http.response.status_code", res.HTTPStatus))
		}
	}
	span.End()
	var hitErr error
	if p := sentErr.Load(); p != nil {
		hitErr = *p
	} else {
		hitErr = crashpoint.Hit(crashpoint.DispatchAfterReply)
	}
	if hitErr != nil {
		log().Warn("not recording the outcome", "error", hitErr) // the lease will expire: UNKNOWN
		return
	}
	d.sends.Add(context.Background(), 1, d.sendsBy.Of(contract.Name, res.Class))
	d.credentialAnswer(contract, res, credential, sentAt)
	d.record(contract, op, res)
	_ = crashpoint.Hit(crashpoint.DispatchAfterRecord)
}

// sendSpanKind is the send span's kind, made once.
var sendSpanKind = trace.WithSpanKind(trace.SpanKindClient)

// cutBeforeSend ends a claim cut before its send, which was never made. If the broker
// stopped (sendCtx, the calls' context, is cancelled when the grace period is over), it
// goes back to PREPARED for the next dispatcher (NOT_STARTED); otherwise its fence was
// lost or its lease could not be kept, and the sweeper makes it UNKNOWN.
func (d *Dispatcher) cutBeforeSend(contract *target.Contract, op store.Claimed, sendCtx context.Context) {
	if sendCtx.Err() != nil {
		d.record(contract, op, target.Result{Outcome: target.NotExecuted, Class: "NOT_STARTED",
			Summary: "the broker stopped before the claim's turn to be sent came; nothing was sent"})
	}
}

// opLog returns the dispatcher's logger for one claim; it is made only when something
// is logged.
func (d *Dispatcher) opLog(target string, op store.HeldLease) *slog.Logger {
	return d.log.With("tenant", op.TenantID, "operation", op.ID, "fence", op.Fence, "target", target)
}

// margin is how long before its lease ends a claim stops being sent: a send that
// starts later, and a call still running then, may overlap another holder's.
func (d *Dispatcher) margin() time.Duration { return max(d.cfg.Lease/10, 100*time.Millisecond) }

// mayHaveExecuted reports whether an earlier attempt of the claim's operation may have
// taken effect: one was made that the target did not answer as not executed.
func mayHaveExecuted(op store.Claimed) bool { return op.AttemptCount-1 > op.NotExecuted }

// refuse records a claim the dispatcher will not send (class and summary say why):
// FAILED_TERMINAL when no attempt can have executed, else UNKNOWN. A same-key replay
// refused here says nothing of the attempts before it, which may have executed: it goes
// back to the reconciler, as a replay's answer documented as not executed does.
func (d *Dispatcher) refuse(contract *target.Contract, op store.Claimed, class, summary string) {
	outcome := target.Rejected
	if mayHaveExecuted(op) {
		outcome, summary = target.Unknown, summary+" this time, but an earlier attempt may have executed"
	}
	d.record(contract, op, target.Result{Outcome: outcome, Class: class, Summary: summary})
}

// Resends after answers documented as not executed wait max(Retry-After, backoff), the
// backoff doubling from minResendWait to maxResendWait with jitter; a Retry-After is
// obeyed up to maxRetryAfter.
const (
	minResendWait = time.Second
	maxResendWait = 5 * time.Minute
	maxRetryAfter = time.Hour
)

// notExecuted turns an answer documented as not executed into the outcome to record:
// PREPARED, to be sent again after the wait, while every attempt so far was answered
// that way and the budget allows; FAILED_TERMINAL once the budget is spent (nothing
// was executed); UNKNOWN when an earlier attempt may have executed (a replay's answer
// says nothing of the attempts before it: the reconciler goes on). A claim never sent
// goes back to PREPARED at once; it counts among the attempts not executed.
func (d *Dispatcher) notExecuted(op store.Claimed, res target.Result, params *store.OutcomeParams) {
	params.NotExecuted = true
	answers := int(op.NotExecuted) + 1
	switch {
	case mayHaveExecuted(op):
		params.State = store.StateUnknown
		params.Observation.Summary += "; an earlier attempt may have executed, so the reconciler resolves it"
	case !res.Sent: // never sent (NOT_STARTED): back to PREPARED at once
		params.State = store.StatePrepared
	case answers >= d.cfg.MaxResends:
		params.State = store.StateFailedTerminal
		params.Observation.Summary += fmt.Sprintf("; %d answers documented as not executed, the resend budget: nothing was executed", answers)
	default:
		wait := min(minResendWait<<min(answers-1, 16), maxResendWait)
		wait = time.Duration(float64(wait) * (0.8 + 0.4*rand.Float64())) // +-20%: resends of a burst spread out
		wait = max(wait, min(res.RetryAfter, maxRetryAfter))
		params.State, params.SendAgainAfter = store.StatePrepared, wait
		params.Observation.Summary += fmt.Sprintf("; sent again in %s", wait.Round(time.Millisecond))
	}
}

// recordContext returns the context an outcome is written on: shutdown does not cancel
// it, and it ends RecordTimeout from now, or up to a hundredth of that later. The
// outcomes that begin within that hundredth share one context and its timer, rather than
// each making its own (a burn-down records thousands a second).
func (d *Dispatcher) recordContext() context.Context {
	if ctx := d.sharedRecordContext(time.Now()); ctx != nil {
		return ctx
	}
	d.recordMu.Lock()
	defer d.recordMu.Unlock()
	now := time.Now() // read after the lock: the wait for it is not to shorten the deadline
	if ctx := d.sharedRecordContext(now); ctx != nil {
		return ctx
	}
	r := &sharedDeadline{}
	r.ctx, r.cancel = context.WithDeadline(context.Background(), now.Add(d.cfg.RecordTimeout+d.cfg.RecordTimeout/100))
	d.recordCtx.Store(r)
	return r.ctx
}

// sharedRecordContext returns the shared context of outcomes if it leaves an outcome
// that begins at now the whole RecordTimeout, or nil.
func (d *Dispatcher) sharedRecordContext(now time.Time) context.Context {
	r := d.recordCtx.Load()
	if r == nil {
		return nil
	}
	if deadline, _ := r.ctx.Deadline(); deadline.Sub(now) < d.cfg.RecordTimeout {
		return nil
	}
	return r.ctx
}

// sharedDeadline is the context outcomes are written on, shared by those that begin
// while it leaves them the whole RecordTimeout.
type sharedDeadline struct {
	ctx context.Context
	// cancel is kept, not called: outcomes may still be written on ctx after another
	// replaced it, and its deadline ends it and frees its timer. (Dropped, it would fail
	// go vet's check that a context's cancel function is used.)
	cancel context.CancelFunc
}

// record writes a send's outcome on a context that shutdown does not cancel, retrying
// while the database is unreachable. If it cannot, the lease expires and the sweeper
// makes the operation UNKNOWN: never a wrong state, only a slower one.
func (d *Dispatcher) record(contract *target.Contract, op store.Claimed, res target.Result) {
	state := store.StateUnknown
	switch res.Outcome {
	case target.Succeeded:
		state = store.StateSucceeded
	case target.Rejected:
		state = store.StateFailedTerminal
	}
	ctx := d.recordContext()
	params := store.OutcomeParams{
		TenantID: op.TenantID, ID: op.ID, Fence: op.FenceToken, State: state, RemoteRef: res.RemoteRef, NotSent: !res.Sent,
		Observation: store.Observation{ObservedAt: d.cfg.Clock(), Source: "DISPATCH", Outcome: res.Class,
			HTTPStatus: res.HTTPStatus, Summary: res.Summary, RetryAfterSeconds: int64(min(res.RetryAfter, maxRetryAfter) / time.Second)},
		Actor: d.actor,
	}
	if res.Outcome == target.NotExecuted {
		d.notExecuted(op, res, &params)
	}
	log := func() *slog.Logger {
		return d.opLog(contract.Name, store.HeldLease{OperationKey: store.OperationKey{TenantID: op.TenantID, ID: op.ID}, Fence: op.FenceToken})
	}
	var contradiction *store.ContradictionError
	for backoff := 50 * time.Millisecond; ; backoff = min(2*backoff, time.Second) {
		moved, err := d.cfg.Store.AllTenants().RecordOutcome(ctx, params)
		switch {
		case err == nil:
			d.events.Sent(ctx, contract, moved, params.Observation.Outcome)
			return
		case errors.Is(err, store.ErrRecordedBefore):
			// An earlier try was applied and its answer lost; the operation has moved on
			// since. What it entered is known; a replay's resolution time is not counted.
			log().Info("outcome recorded by an earlier try, whose answer was lost; the operation has moved on since", "class", res.Class)
			if params.State == store.StateUnknown {
				d.events.UnknownEntered(ctx, contract, params.Observation.Outcome, 1)
			}
			return
		case errors.As(err, &contradiction):
			// The target made an effect the ledger does not record: a person must
			// reconcile the two (the ledger's gauge opbroker_operations_contradicted
			// raises it, docs/operations.md#opbrokersuccesscontradictsledger).
			log().Error("the target's verified success came after the lease and contradicts the ledger, which keeps its state; a person must reconcile them",
				"class", res.Class, "ledger_state", contradiction.State)
			return
		case errors.Is(err, store.ErrFenceLost):
			log().Warn("fence lost before the outcome was recorded; kept as evidence only", "class", res.Class, "error", err)
			return
		case !errors.Is(err, store.ErrUnavailable):
			log().Error("outcome not recorded; the lease will expire and the operation become UNKNOWN", "error", err)
			return
		}
		select {
		case <-ctx.Done():
			log().Error("outcome not recorded before the timeout; the lease will expire and the operation become UNKNOWN", "error", err)
			return
		case <-time.After(backoff):
		}
	}
}
