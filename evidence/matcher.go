package evidence

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/metric"

	"github.com/opbroker/opbroker/brokermetrics"
	"github.com/opbroker/opbroker/crashpoint"
	"github.com/opbroker/opbroker/startstop"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/target"
)

// Config configures a Matcher. Zero values take the defaults noted.
type Config struct {
	Store         *store.Store
	Targets       *target.Targets
	Logger        *slog.Logger
	MeterProvider metric.MeterProvider
	// BodyRetention is how long an event's body is kept (DefaultBodyRetention): for
	// matching and for reviewing a quarantined event. It must not be shorter than any
	// target's match window.
	BodyRetention time.Duration
	// PollInterval between passes over the events waiting for a match (default 1s).
	PollInterval time.Duration
}

// DefaultBodyRetention is how long an event's body is kept when the configuration does
// not say.
const DefaultBodyRetention = 72 * time.Hour

// Matcher matches verified events to operations and records what they say, under the
// operations' revisions; its loop (Start) matches again the events whose operation was
// not found yet, and purges bodies past their retention. Start and Stop follow the
// project's lifecycle contract.
type Matcher struct {
	cfg     Config
	log     *slog.Logger
	metrics *brokermetrics.Evidence
	events  *brokermetrics.Events
	startstop.Base
}

// New returns a stopped matcher.
func New(cfg Config) (*Matcher, error) {
	if cfg.BodyRetention <= 0 {
		cfg.BodyRetention = DefaultBodyRetention
	}
	if cfg.PollInterval <= 0 {
		cfg.PollInterval = time.Second
	}
	for _, c := range cfg.Targets.All() {
		if c.Evidence != nil && c.Evidence.MatchWindow() > cfg.BodyRetention {
			return nil, fmt.Errorf("evidence: target %s matches events for %s, longer than the body retention of %s: a body must outlive its matching",
				c.Name, c.Evidence.MatchWindow(), cfg.BodyRetention)
		}
	}
	m := &Matcher{cfg: cfg, log: cfg.Logger.With("component", "evidence")}
	var err error
	if m.metrics, err = brokermetrics.NewEvidence(cfg.MeterProvider); err != nil {
		return nil, err
	}
	var withEvidence []string
	for _, c := range cfg.Targets.All() {
		if c.Evidence != nil {
			withEvidence = append(withEvidence, c.Name)
		}
	}
	m.metrics.StartQuarantineAtZero(withEvidence, Reasons)
	if m.events, err = brokermetrics.NewEvents(cfg.MeterProvider); err != nil {
		return nil, err
	}
	return m, nil
}

// Metrics returns the matcher's counters, which the webhook listener adds to.
func (m *Matcher) Metrics() *brokermetrics.Evidence { return m.metrics }

// Source says who delivered an event: a signed webhook, or a principal that reported it.
type Source struct {
	Reporter string // "" for a webhook
	Tenant   string // the tenant the reporter said the event is for
}

// ErrIgnored means the event's type is in none of the contract's lists: it says nothing
// of an effect, and is acknowledged without being kept.
var ErrIgnored = errors.New("an event type the contract does not list")

// Receive keeps a verified event durably and then matches it. It returns the event as
// it was kept (before its match), and fresh false when its sender had reported its id
// before (the repeat adds nothing). Once it returns without error the event is durable: a failure
// to match it now leaves it PENDING for the loop.
func (m *Matcher) Receive(ctx context.Context, contract *target.Contract, body []byte, from Source) (store.InboundEvidence, bool, error) {
	ev, err := contract.Evidence.Read(body)
	if err != nil {
		return store.InboundEvidence{}, false, err
	}
	if ev.Meaning == "" {
		m.metrics.Ignored(ctx, contract.Name)
		return store.InboundEvidence{}, false, ErrIgnored
	}
	e := store.InboundEvidence{Target: contract.Name, EventID: ev.ID, Source: store.SourceWebhook,
		EventType: ev.Type, Meaning: string(ev.Meaning), Reference: ev.Reference,
		ReferenceKind: contract.Evidence.ReferenceKind, RemoteRef: ev.RemoteRef, Body: body}
	if from.Reporter != "" {
		e.Source, e.Reporter, e.ClaimedTenant = store.SourceReported, from.Reporter, from.Tenant
	}
	kept, fresh, err := m.cfg.Store.AllTenants().ReceiveEvidence(ctx, e, m.cfg.BodyRetention, contract.Evidence.MatchWindow())
	if err != nil {
		return store.InboundEvidence{}, false, err
	}
	m.metrics.Received(ctx, contract.Name, e.Source, fresh)
	if !fresh {
		return kept, false, nil
	}
	if err := crashpoint.Hit(crashpoint.EvidenceAfterReceipt); err != nil {
		return kept, true, nil // kept, and matched by the loop
	}
	if err := m.match(ctx, contract, kept); err != nil {
		m.log.Warn("evidence kept, its match failed; it is matched again", "target", contract.Name, "error", err)
	}
	return kept, true, nil
}

// actor is the actor of the operation events an event records.
func actor(e store.InboundEvidence) string {
	if e.Source == store.SourceReported {
		return "evidence:" + e.Reporter
	}
	return "webhook:" + e.Target
}

// match decides a PENDING event and records the verdict. When the operation moves
// between the read and the record, it decides again, a few times, then leaves the event
// PENDING for the loop.
func (m *Matcher) match(ctx context.Context, contract *target.Contract, e store.InboundEvidence) error {
	scope := m.cfg.Store.AllTenants()
	for range 3 {
		found, err := scope.EvidenceCandidates(ctx, contract.OperationTypes, e.ReferenceKind, e.Reference)
		if err != nil {
			return err
		}
		v := decide(contract, e, found, actor(e))
		if v.later {
			disposition, err := scope.MatchLater(ctx, e.Key(), v.reason, v.detail)
			if err == nil && disposition == store.EvidenceQuarantined {
				m.quarantined(ctx, contract, e, v)
			}
			if errors.Is(err, store.ErrEvidenceChanged) {
				return nil // decided by another matcher
			}
			return err
		}
		s := store.EvidenceSettlement{EvidenceKey: e.Key(), From: store.EvidencePending,
			To: v.disposition, Reason: v.reason, Detail: v.detail, Change: v.change}
		if v.candidate != nil {
			s.TenantID, s.ID = v.candidate.TenantID, v.candidate.ID
			if v.disposition == store.EvidenceObserved {
				s.Revision = v.candidate.Revision // what it observed must still hold
			}
		}
		err = scope.SettleEvidence(ctx, s)
		if errors.Is(err, store.ErrEvidenceChanged) {
			if e, err = scope.Evidence(ctx, e.Key()); err != nil || e.Disposition != store.EvidencePending {
				return err
			}
			continue
		}
		if err != nil {
			return err
		}
		m.recorded(ctx, contract, e, v)
		return nil
	}
	m.log.Info("evidence: its operation kept moving; it is matched again", "target", e.Target, "event_id", e.EventID)
	return nil
}

// recorded counts and logs a verdict that was recorded.
func (m *Matcher) recorded(ctx context.Context, contract *target.Contract, e store.InboundEvidence, v verdict) {
	switch v.disposition {
	case store.EvidenceQuarantined:
		m.quarantined(ctx, contract, e, v)
		return
	case store.EvidenceApplied:
		c := v.change
		m.log.Info("evidence applied", "target", e.Target, "event_id", e.EventID, "event_type", e.EventType,
			"tenant", v.candidate.TenantID, "operation", v.candidate.ID, "from", c.From, "to", c.To)
		if c.From == store.StateUnknown && c.To != store.StateUnknown {
			if op, err := m.cfg.Store.AllTenants().Get(ctx, v.candidate.TenantID, v.candidate.ID); err == nil {
				m.events.Resolved(ctx, contract, op)
			}
		}
	}
	m.metrics.Decided(ctx, e.Target, v.disposition, "")
}

func (m *Matcher) quarantined(ctx context.Context, contract *target.Contract, e store.InboundEvidence, v verdict) {
	m.log.Warn("evidence quarantined", "target", contract.Name, "event_id", e.EventID, "event_type", e.EventType,
		"reason", v.reason, "detail", v.detail)
	m.metrics.Decided(ctx, contract.Name, store.EvidenceQuarantined, v.reason)
}

// Start matches the events that wait for their operation, and purges bodies past their
// retention, until Stop.
func (m *Matcher) Start(ctx context.Context) error {
	m.Base.Start(ctx, func(ctx context.Context) {
		lastPurge := time.Time{}
		for ctx.Err() == nil {
			busy := m.runOnce(ctx)
			if time.Since(lastPurge) > time.Minute {
				if _, err := m.cfg.Store.AllTenants().PurgeEvidenceBodies(ctx, 1000); err != nil && ctx.Err() == nil {
					m.log.Warn("evidence body purge failed", "error", err)
				}
				lastPurge = time.Now()
			}
			if busy {
				continue
			}
			select {
			case <-ctx.Done():
			case <-time.After(m.cfg.PollInterval):
			}
		}
	})
	return nil
}

// matchBatch is how many waiting events one pass takes.
const matchBatch = 64

// runOnce matches the events whose next match is due; it reports whether a full batch
// was due (more may be).
func (m *Matcher) runOnce(ctx context.Context) bool {
	due, err := m.cfg.Store.AllTenants().DueEvidence(ctx, matchBatch)
	if err != nil {
		if ctx.Err() == nil {
			m.log.Warn("evidence: reading the events to match failed", "error", err)
		}
		return false
	}
	for _, e := range due {
		contract, ok := m.cfg.Targets.ByName(e.Target)
		if !ok || contract.Evidence == nil {
			// The contract no longer reads this target's events: a person decides.
			v := verdict{disposition: store.EvidenceQuarantined, reason: ReasonUnmatched,
				detail: "the targets file no longer has target " + e.Target + " with evidence"}
			err = m.cfg.Store.AllTenants().SettleEvidence(ctx, store.EvidenceSettlement{EvidenceKey: e.Key(),
				From: store.EvidencePending, To: v.disposition, Reason: v.reason, Detail: v.detail})
			if err == nil {
				m.metrics.Decided(ctx, e.Target, v.disposition, v.reason)
			}
		} else {
			err = m.match(ctx, contract, e)
		}
		if err != nil && ctx.Err() == nil {
			// Whatever failed, the event must not hold the queue: it waits its turn again.
			m.log.Warn("evidence match failed; it is matched again after a wait", "target", e.Target, "event_id", e.EventID, "error", err)
			if err := m.cfg.Store.AllTenants().PostponeEvidence(ctx, e.Key()); err != nil && ctx.Err() == nil {
				m.log.Warn("evidence: postponing a failed match failed", "error", err)
			}
		}
	}
	return len(due) == matchBatch
}
