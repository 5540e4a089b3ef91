// Package sweeper moves operations whose time ran out, on its own:
//
//   - an IN_FLIGHT operation whose sender's lease expired becomes UNKNOWN, never
//     PREPARED again, because its sender may have sent it;
//   - a PREPARED operation whose dispatch deadline passed before any send becomes
//     FAILED_TERMINAL (nothing was sent, so nothing happened);
//   - a terminal operation's payload bytes are purged once it has been terminal for the
//     data.retention of the contract that serves its operation type, or for the default
//     payload retention when no contract gives one (its hash and its events stay).
//
// Every move is one conditional statement of the store, judged by the database's clock,
// so any number of sweepers (one per replica) may run at once.
package sweeper

import (
	"context"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/metric"

	"github.com/opbroker/opbroker/brokermetrics"
	"github.com/opbroker/opbroker/startstop"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/target"
)

// Defaults of Config, which the broker's flags use too.
const (
	DefaultInterval = time.Second
	// DefaultPayloadRetention is the broker's --payload-retention: the retention of the
	// operation types no contract gives one.
	DefaultPayloadRetention = 30 * 24 * time.Hour
)

// Config configures a sweeper.
type Config struct {
	Store         *store.Store
	Logger        *slog.Logger
	MeterProvider metric.MeterProvider
	// Interval between sweeps (DefaultInterval).
	Interval time.Duration
	// Targets, optional, give each operation type they serve its contract's
	// data.retention: how long its terminal operations keep their payload bytes. A
	// contract cannot keep them forever: go/no-go control 10 requires a retention.
	Targets *target.Targets
	// PayloadRetention is the retention of the other operation types: those no contract
	// serves (any more), and those of a contract without data.retention, which only a
	// contract built in code can be (target.New does not judge the controls). 0 keeps
	// their payloads.
	PayloadRetention time.Duration
}

// batch bounds one statement.
const batch = 500

// Sweeper runs the sweeps every Interval. Start and Stop follow package startstop.
type Sweeper struct {
	startstop.Base
	cfg                    Config
	retentions             map[string]time.Duration // operation type → its contract's data.retention
	log                    *slog.Logger
	swept, expired, purged metric.Int64Counter
	events                 *brokermetrics.Events // UNKNOWN entered, cause LEASE_EXPIRED
}

// New returns a stopped sweeper.
func New(cfg Config) (*Sweeper, error) {
	if cfg.Interval <= 0 {
		cfg.Interval = DefaultInterval
	}
	s := &Sweeper{cfg: cfg, retentions: map[string]time.Duration{}, log: cfg.Logger.With("component", "sweeper")}
	if cfg.Targets != nil {
		for _, c := range cfg.Targets.All() {
			if c.Data.Retention <= 0 {
				continue // PayloadRetention applies
			}
			for _, typ := range c.OperationTypes {
				s.retentions[typ] = c.Data.Retention.D()
			}
		}
	}
	meter := cfg.MeterProvider.Meter("github.com/opbroker/opbroker/sweeper")
	var err error
	if s.swept, err = meter.Int64Counter("opbroker.leases.expired",
		metric.WithDescription("IN_FLIGHT operations moved to UNKNOWN because their lease expired"), metric.WithUnit("{operation}")); err != nil {
		return nil, err
	}
	// From zero, so that an alert on its increase sees the first sweep, which it misses
	// when the series first appears at the number swept.
	s.swept.Add(context.Background(), 0)
	if s.expired, err = meter.Int64Counter("opbroker.dispatch.deadlines_passed",
		metric.WithDescription("PREPARED operations failed because their dispatch deadline passed before any send"), metric.WithUnit("{operation}")); err != nil {
		return nil, err
	}
	if s.purged, err = meter.Int64Counter("opbroker.payloads.purged",
		metric.WithDescription("Payloads whose bytes were removed after the retention (hash and events kept)"), metric.WithUnit("{operation}")); err != nil {
		return nil, err
	}
	if s.events, err = brokermetrics.NewEvents(cfg.MeterProvider); err != nil {
		return nil, err
	}
	return s, nil
}

// Start sweeps every Interval until Stop, and returns at once.
func (s *Sweeper) Start(ctx context.Context) error {
	s.Base.Start(ctx, func(ctx context.Context) {
		ticker := time.NewTicker(s.cfg.Interval)
		defer ticker.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-ticker.C:
			}
			// A pass that takes ten intervals is stuck (a database that stopped answering,
			// say): it is given up and reported, and the next one tries again.
			passCtx, cancel := context.WithTimeout(ctx, 10*s.cfg.Interval)
			if err := s.Sweep(passCtx, time.Time{}); err != nil && ctx.Err() == nil {
				s.log.Warn("sweep failed", "error", err)
			}
			cancel()
		}
	})
	return nil
}

// Sweep makes one pass: it moves every IN_FLIGHT operation whose lease expired before now
// to UNKNOWN, fails every PREPARED one whose dispatch deadline passed (a zero now means
// the database's clock), and purges the payload bytes of operations terminal for longer
// than their type's retention (always by the database's clock).
func (s *Sweeper) Sweep(ctx context.Context, now time.Time) error {
	type step struct {
		run     func() (int, error)
		counter metric.Int64Counter
	}
	steps := []step{
		{func() (int, error) {
			swept, err := s.cfg.Store.AllTenants().SweepExpiredLeases(ctx, store.SweepParams{Now: now, Limit: batch})
			for typ, n := range swept {
				s.events.UnknownEntered(ctx, s.contract(typ), store.OutcomeLeaseExpired, n)
			}
			return swept.Total(), err
		}, s.swept},
		{func() (int, error) {
			expired, err := s.cfg.Store.AllTenants().ExpireDeadlines(ctx, store.SweepParams{Now: now, Limit: batch})
			return expired.Total(), err
		}, s.expired},
	}
	if len(s.retentions) > 0 || s.cfg.PayloadRetention > 0 {
		steps = append(steps, step{func() (int, error) {
			return s.cfg.Store.AllTenants().PurgePayloads(ctx, store.PurgeParams{
				Retentions: s.retentions, Default: s.cfg.PayloadRetention, Limit: batch})
		}, s.purged})
	}
	for _, step := range steps {
		for {
			n, err := step.run()
			if err != nil {
				return err
			}
			step.counter.Add(ctx, int64(n))
			if n < batch {
				break
			}
		}
	}
	return nil
}

// contract returns the contract that serves an operation type, or nil (no Targets, or
// none serves it any more).
func (s *Sweeper) contract(operationType string) *target.Contract {
	if s.cfg.Targets == nil {
		return nil
	}
	c, _ := s.cfg.Targets.ForType(operationType)
	return c
}
