package brokermetrics

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/opbroker/opbroker/startstop"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/target"
)

// DefaultInterval is the broker's --metrics-interval: how often a Ledger reads the
// ledger.
const DefaultInterval = 15 * time.Second

// NoTarget is the target label of operations whose type no loaded contract serves (a
// contract's name cannot be spelled so).
const NoTarget = "(none)"

// openStates are the states the gauges report, for every target, zero included: an
// alert on a rise needs the series before it.
var openStates = []store.State{store.StatePrepared, store.StateInFlight, store.StateUnknown, store.StateEscalated}

// LedgerConfig configures a Ledger. Zero values take the defaults noted.
type LedgerConfig struct {
	Store         *store.Store
	Targets       *target.Targets
	MeterProvider metric.MeterProvider
	Logger        *slog.Logger
	// Interval between readings (DefaultInterval); a reading is abandoned after it.
	Interval time.Duration
	// ContradictedInterval is how often the contradicted operations are read
	// (DefaultContradictedInterval): at the first reading, and then at the first reading
	// this long after the last try. Their gauge reports a reading for three times this
	// long (or Interval, if longer), and nothing after.
	ContradictedInterval time.Duration
}

// DefaultContradictedInterval is how often a Ledger reads the contradicted operations
// (store.Scope.Contradicted): a statement that reads every stale outcome, which grows
// with the leases ever lost, for a count that changes rarely.
const DefaultContradictedInterval = 5 * time.Minute

// Ledger exports gauges of the ledger's open operations, and of its contradicted ones:
// every Interval it reads the open ones (store.Scope.OpenStats), every
// ContradictedInterval the contradicted (store.Scope.Contradicted), and keeps the
// results; the gauges report the last results at each scrape. It maps operation types
// to targets with the loaded contracts. Start and Stop follow package startstop.
//
// A failed reading of the open operations keeps the previous result (an alert on them
// that fires goes on firing) and sets opbroker_database_up to 0 until a reading
// succeeds. One of the contradicted is logged and tried again a ContradictedInterval
// later; its last result is reported for three of them, and then nothing (the
// alert on a rise then resolves; OpbrokerContradictionsUnread fires where the database
// can be read).
type Ledger struct {
	startstop.Base
	cfg      LedgerConfig
	log      *slog.Logger
	targetOf map[string]string // operation type → target name

	mu       sync.Mutex
	snap     *snapshot // the last successful reading; nil before the first
	readOnce bool      // a reading was attempted
	readOK   bool      // the last reading succeeded
	// contradicted is the last successful reading of the contradicted operations, by
	// state and target (nil before the first), read at contradictedRead; the last try
	// was at contradictedTried.
	contradicted                        map[stateTarget]int64
	contradictedRead, contradictedTried time.Time
	now                                 func() time.Time // time.Now; tests set it
}

// endStates are the states a contradicted operation may have ended in
// (store.ContradictedGroup): reported for every target, zero included.
var endStates = []store.State{store.StateFailedTerminal, store.StateSucceeded}

// snapshot is one reading, by target.
type snapshot struct {
	open   map[stateTarget]int64
	oldest map[stateTarget]time.Duration
	ready  map[string]int64
}

type stateTarget struct {
	state  store.State
	target string
}

// NewLedger returns a stopped Ledger whose gauges are registered with the
// MeterProvider; they report nothing until the first reading.
func NewLedger(cfg LedgerConfig) (*Ledger, error) {
	if cfg.Interval <= 0 {
		cfg.Interval = DefaultInterval
	}
	if cfg.ContradictedInterval <= 0 {
		cfg.ContradictedInterval = DefaultContradictedInterval
	}
	l := &Ledger{cfg: cfg, log: cfg.Logger.With("component", "metrics"), targetOf: map[string]string{}, now: time.Now}
	for _, c := range cfg.Targets.All() {
		for _, typ := range c.OperationTypes {
			l.targetOf[typ] = c.Name
		}
	}
	meter := cfg.MeterProvider.Meter(meterName)
	open, err := meter.Int64ObservableGauge("opbroker.operations.open", metric.WithUnit("{operation}"),
		metric.WithDescription("Operations in each open state (PREPARED, IN_FLIGHT, UNKNOWN, ESCALATED) by target, every tenant's, as of the last reading of the ledger"))
	if err != nil {
		return nil, err
	}
	ready, err := meter.Int64ObservableGauge("opbroker.operations.ready", metric.WithUnit("{operation}"),
		metric.WithDescription("PREPARED operations the dispatcher may claim now (not scheduled later, not waiting to be sent again), by target"))
	if err != nil {
		return nil, err
	}
	oldest, err := meter.Float64ObservableGauge("opbroker.operations.oldest_age", metric.WithUnit("s"),
		metric.WithDescription("How long the longest-waiting operation of each open state and target has waited: UNKNOWN and ESCALATED since entering the state, IN_FLIGHT since the claim, PREPARED since ready; 0 when there is none"))
	if err != nil {
		return nil, err
	}
	contradicted, err := meter.Int64ObservableGauge("opbroker.operations.contradicted", metric.WithUnit("{operation}"),
		metric.WithDescription("Operations the ledger ended FAILED_TERMINAL, or SUCCEEDED with another reference, while the target answered one of their sends with a verified success that came after the send's lease, by the state and target; every tenant's, as of the last reading of the ledger"))
	if err != nil {
		return nil, err
	}
	up, err := meter.Int64ObservableGauge("opbroker.database.up",
		metric.WithDescription("1 when this replica's last reading of the ledger succeeded, 0 when it failed"))
	if err != nil {
		return nil, err
	}
	_, err = meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		l.mu.Lock()
		defer l.mu.Unlock()
		if l.readOnce {
			o.ObserveInt64(up, boolInt(l.readOK))
		}
		if l.contradictedFresh(l.now()) {
			for k, n := range l.contradicted {
				o.ObserveInt64(contradicted, n, metric.WithAttributes(attribute.String("state", string(k.state)), attribute.String("target", k.target)))
			}
		}
		if l.snap == nil {
			return nil
		}
		for k, n := range l.snap.open {
			o.ObserveInt64(open, n, metric.WithAttributes(attribute.String("state", string(k.state)), attribute.String("target", k.target)))
		}
		for k, age := range l.snap.oldest {
			o.ObserveFloat64(oldest, age.Seconds(), metric.WithAttributes(attribute.String("state", string(k.state)), attribute.String("target", k.target)))
		}
		for name, n := range l.snap.ready {
			o.ObserveInt64(ready, n, metric.WithAttributes(attribute.String("target", name)))
		}
		return nil
	}, open, ready, oldest, contradicted, up)
	if err != nil {
		return nil, err
	}
	return l, nil
}

// Start reads the ledger at once and then every Interval until Stop, and returns at
// once.
func (l *Ledger) Start(ctx context.Context) error {
	l.Base.Start(ctx, func(ctx context.Context) {
		ticker := time.NewTicker(l.cfg.Interval)
		defer ticker.Stop()
		for {
			if err := l.Refresh(ctx); err != nil && ctx.Err() == nil {
				l.log.Debug("the ledger's metrics were not read", "error", err)
			}
			select {
			case <-ctx.Done():
				return
			case <-ticker.C:
			}
		}
	})
	return nil
}

// Refresh reads the ledger once and replaces what the gauges report; on failure it keeps
// the last reading and reports the database down. Start's loop calls it; tests call it
// directly.
func (l *Ledger) Refresh(ctx context.Context) error {
	l.refreshContradicted(ctx)
	readCtx, cancel := context.WithTimeout(ctx, l.cfg.Interval)
	defer cancel()
	groups, err := l.cfg.Store.AllTenants().OpenStats(readCtx, store.OpenStatsParams{})
	if err != nil && ctx.Err() != nil {
		return err // stopped: says nothing of the database
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	wasOK := !l.readOnce || l.readOK
	l.readOnce, l.readOK = true, err == nil
	switch {
	case err != nil && wasOK:
		l.log.Warn("the ledger cannot be read: opbroker_database_up is 0 and the gauges keep their last values", "error", err)
	case err == nil && !wasOK:
		l.log.Info("the ledger can be read again")
	}
	if err != nil {
		return err
	}
	l.snap = l.tally(groups)
	return nil
}

// refreshContradicted reads the contradicted operations when ContradictedInterval has
// passed since the last try (or there was none), abandoned after Interval, as a reading
// of the open ones is. A failure is logged and leaves the last reading; it says nothing
// of opbroker_database_up, which the open operations' reading reports.
func (l *Ledger) refreshContradicted(ctx context.Context) {
	l.mu.Lock()
	now := l.now()
	due := l.contradictedTried.IsZero() || now.Sub(l.contradictedTried) >= l.cfg.ContradictedInterval
	if due {
		l.contradictedTried = now
	}
	l.mu.Unlock()
	if !due {
		return
	}
	readCtx, cancel := context.WithTimeout(ctx, l.cfg.Interval)
	defer cancel()
	groups, err := l.cfg.Store.AllTenants().Contradicted(readCtx)
	if err != nil {
		if ctx.Err() == nil {
			l.log.Warn("the contradicted operations were not read: opbroker_operations_contradicted keeps its last values for a while", "error", err)
		}
		return
	}
	counts := map[stateTarget]int64{}
	for _, c := range l.cfg.Targets.All() {
		for _, state := range endStates {
			counts[stateTarget{state, c.Name}] = 0
		}
	}
	for _, g := range groups {
		counts[stateTarget{g.State, l.targetName(g.OperationType)}] += g.Count
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if now.After(l.contradictedRead) { // not older than a reading that began later and ended first
		l.contradicted, l.contradictedRead = counts, now
	}
}

// contradictedFresh reports whether the last reading of the contradicted operations is
// recent enough to report at now: within three of its intervals, or of Interval where
// that is longer (a reading is tried no more often).
func (l *Ledger) contradictedFresh(now time.Time) bool {
	return now.Sub(l.contradictedRead) < 3*max(l.cfg.ContradictedInterval, l.cfg.Interval)
}

// tally sums the groups by target, with a zero for every target and open state.
func (l *Ledger) tally(groups []store.OpenGroup) *snapshot {
	s := &snapshot{open: map[stateTarget]int64{}, oldest: map[stateTarget]time.Duration{}, ready: map[string]int64{}}
	for _, c := range l.cfg.Targets.All() {
		for _, state := range openStates {
			s.open[stateTarget{state, c.Name}] = 0
			s.oldest[stateTarget{state, c.Name}] = 0
		}
		s.ready[c.Name] = 0
	}
	for _, g := range groups {
		name := l.targetName(g.OperationType)
		k := stateTarget{g.State, name}
		s.open[k] += g.Count
		s.oldest[k] = max(s.oldest[k], g.OldestAge)
		if g.State == store.StatePrepared {
			s.ready[name] += g.Ready
		}
	}
	return s
}

// targetName is the target label of an operation type: its contract's name, or NoTarget.
func (l *Ledger) targetName(operationType string) string {
	if name, ok := l.targetOf[operationType]; ok {
		return name
	}
	return NoTarget
}

func boolInt(b bool) int64 {
	if b {
		return 1
	}
	return 0
}
