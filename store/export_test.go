package store

import (
	"context"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/tern/v2/migrate"
)

// PrepareTogether records intents as one combined statement would, as if they had
// arrived at the same time, and returns each one's answer: for tests of what a batch
// does that concurrency alone cannot force. Each call is in its own tenant's scope, or
// with allTenants in every tenant's.
func (s *Store) PrepareTogether(ctx context.Context, ps []PrepareParams, allTenants bool) (ops []Operation, created []bool, errs []error) {
	calls := make([]prepareCall, len(ps))
	for i, p := range ps {
		calls[i] = prepareCall{PrepareParams: p, id: uuid.Must(uuid.NewV7()), scope: p.TenantID}
		if allTenants {
			calls[i].scope = "*"
		}
	}
	results, err := s.insertEach(ctx, calls)
	ops, created, errs = make([]Operation, len(ps)), make([]bool, len(ps)), make([]error, len(ps))
	var wg sync.WaitGroup
	for i := range ps {
		if err != nil {
			errs[i] = err
			continue
		}
		wg.Go(func() {
			r := results[i]
			if r.alone { // as each caller would, at once
				r = s.prepareAlone(ctx, calls[i])
			}
			ops[i], created[i], errs[i] = r.op, r.created, r.err
		})
	}
	wg.Wait()
	return ops, created, errs
}

// CombinedLockWait is how long a combined insert waits for a lock.
const CombinedLockWait = combinedLockWait

// SetAloneTimeout sets how long an intent recorded on its own may take, until the test
// ends.
func SetAloneTimeout(t interface{ Cleanup(func()) }, d time.Duration) {
	old := aloneTimeout
	aloneTimeout = d
	t.Cleanup(func() { aloneTimeout = old })
}

// RecordedOutcomeOf is RecordOutcome's answer for an outcome that left the operation as
// op is.
var RecordedOutcomeOf = recordedOutcomeOf

// RecordOutcomesTogether records outcomes as one combined statement would, as if they
// had arrived at the same time, and returns each one's answer, as RecordOutcome would.
func (q Scope) RecordOutcomesTogether(ctx context.Context, ps []OutcomeParams) (ops []RecordedOutcome, errs []error) {
	recorded, err := q.recordOutcomes(ctx, ps)
	ops, errs = make([]RecordedOutcome, len(ps)), make([]error, len(ps))
	for i, p := range ps {
		if err != nil {
			errs[i] = err
			continue
		}
		ops[i], errs[i] = recorded.answer(i, p)
	}
	return ops, errs
}

// MigrateTo brings the schema to version, as an older binary's `opbroker migrate` did:
// for tests that populate a ledger at an earlier version and migrate it forward.
func MigrateTo(ctx context.Context, pool *pgxpool.Pool, version int32) error {
	return migrateWith(ctx, pool, func(m *migrate.Migrator) error { return m.MigrateTo(ctx, version) })
}

// MigrationConn is migrationConn.
var MigrationConn = migrationConn

// SetListenCheck sets how long a listening connection waits in silence before it checks
// its server, and how long the check may take, until the test ends.
func SetListenCheck(t interface{ Cleanup(func()) }, every, timeout time.Duration) {
	oldEvery, oldTimeout := listenCheckEvery, listenCheckTimeout
	listenCheckEvery, listenCheckTimeout = every, timeout
	t.Cleanup(func() { listenCheckEvery, listenCheckTimeout = oldEvery, oldTimeout })
}
