package store

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// OpenStatsParams bound one reading of OpenStats.
type OpenStatsParams struct {
	// Now is the time ages are measured at; zero means the database's clock.
	Now time.Time
}

// OpenGroup is what the ledger holds of one operation type in one open state.
type OpenGroup struct {
	State         State
	OperationType string
	// Count is how many operations of the type are in the state.
	Count int64
	// Ready, for PREPARED, is how many of them the dispatcher may claim now: not
	// scheduled for later, not waiting to be sent again after an answer documented as
	// not executed, dispatch deadline not passed. Zero for the other states.
	Ready int64
	// OldestAge is how long the operation that has waited longest has been waiting, by
	// the database's clock (or Now): for UNKNOWN, since its first send (the reconciler's
	// resolution deadline counts from it too; a look that resolves nothing does not
	// make it younger); for ESCALATED, since it was escalated; for IN_FLIGHT, since it
	// was claimed; for PREPARED, since the oldest ready one became ready (zero when none
	// is).
	OldestAge time.Duration
}

// OpenStats counts the operations in the open states (PREPARED, IN_FLIGHT, UNKNOWN,
// ESCALATED) by state and operation type, with the age of the longest-waiting one of
// each group, in one statement; groups with no operation are left out. In the scope of
// Store.AllTenants it counts every tenant's.
//
// It reads PREPARED, IN_FLIGHT and UNKNOWN operations through their partial indexes,
// never terminal rows, and looks up one event per ESCALATED operation (the one that
// escalated it, by the events' primary key). ESCALATED operations have their own partial
// index (migration 012): row-level security keeps the state out of an index's conditions
// (enum equality is not leakproof), so only a partial index on the state serves them.
func (q Scope) OpenStats(ctx context.Context, p OpenStatsParams) ([]OpenGroup, error) {
	var now *time.Time // NULL: the database's clock
	if !p.Now.IsZero() {
		now = &p.Now
	}
	var groups []OpenGroup
	err := q.inTx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		rows, _ := tx.Query(ctx, openStats, pgx.NamedArgs{"now": now})
		var err error
		groups, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (OpenGroup, error) {
			var g OpenGroup
			var oldest int64
			err := row.Scan(&g.State, &g.OperationType, &g.Count, &g.Ready, &oldest)
			g.OldestAge = max(0, duration(oldest))
			return g, err
		})
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("store: open stats: %w", translate(err))
	}
	return groups, nil
}

// ContradictedGroup counts the operations of one type that the ledger ended in State
// (FAILED_TERMINAL, or SUCCEEDED with another reference) while a verified success of the
// target's is on record for them: an answer to a send that came after its lease
// (ContradictionError), kept before or after the operation ended.
type ContradictedGroup struct {
	State         State
	OperationType string
	Count         int64
}

// Contradicted counts the operations whose end a verified success contradicts, by state
// and operation type, every tenant's in the scope of Store.AllTenants; groups with none
// are left out. It reads every stale outcome (one per fence lost while a send's answer
// was still to come, most often a success) and looks up the operation of each verified
// success by its key: it finds every such operation, however it ended and in whichever
// order the two were recorded, at a cost that grows with the leases ever lost.
func (q Scope) Contradicted(ctx context.Context) ([]ContradictedGroup, error) {
	rows := q.query(ctx, `SELECT o.state, o.operation_type, count(DISTINCT (o.tenant_id, o.operation_id))
		FROM stale_outcomes s JOIN operations o USING (tenant_id, operation_id)
		WHERE `+contradicts("s", "o")+`
		GROUP BY o.state, o.operation_type`)
	groups, err := pgx.CollectRows(rows, pgx.RowToStructByPos[ContradictedGroup])
	if err != nil {
		return nil, fmt.Errorf("store: contradicted: %w", translate(err))
	}
	return groups, nil
}

// readyToClaim is the condition, on a PREPARED operation o at time at.t, under which the
// dispatcher's claim takes it.
const readyToClaim = `(o.next_check_at IS NULL OR o.next_check_at <= at.t) AND (o.dispatch_deadline IS NULL OR o.dispatch_deadline > at.t)`

// enteredState selects when the operation o entered its current state: its last event
// that changed the state.
const enteredState = `SELECT e.created_at AS at FROM operation_events e
		WHERE e.tenant_id = o.tenant_id AND e.operation_id = o.operation_id AND e.from_state IS DISTINCT FROM e.to_state
		ORDER BY e.revision DESC LIMIT 1`

// openStats is the statement of OpenStats; @now is NULL for the database's clock.
//
// A PREPARED operation is ready on the dispatcher's claim condition (see claimFrom);
// it has been ready since its creation or since the next_check_at it waited for.
// An ESCALATED operation entered its state with its last event that changed the state:
// every later one is a self-loop (a note).
var openStats = `
	WITH at AS (SELECT coalesce(@now::timestamptz, now()) AS t)
	SELECT 'PREPARED'::operation_state, o.operation_type, count(*),
		count(*) FILTER (WHERE ` + readyToClaim + `),
		coalesce(` + micros(`max(at.t - greatest(o.created_at, o.next_check_at)) FILTER (WHERE `+readyToClaim+`)`) + `, 0)
	FROM operations o, at WHERE o.state = 'PREPARED' GROUP BY o.operation_type
	UNION ALL
	SELECT 'IN_FLIGHT', o.operation_type, count(*), 0, ` + micros(`max(at.t - o.updated_at)`) + `
	FROM operations o, at WHERE o.state = 'IN_FLIGHT' GROUP BY o.operation_type
	UNION ALL
	SELECT 'UNKNOWN', o.operation_type, count(*), 0, ` + micros(`max(at.t - o.first_sent_at)`) + `
	FROM operations o, at WHERE o.state = 'UNKNOWN' GROUP BY o.operation_type
	UNION ALL
	SELECT 'ESCALATED', o.operation_type, count(*), 0, ` + micros(`max(at.t - coalesce(entered.at, o.updated_at))`) + `
	FROM operations o CROSS JOIN at LEFT JOIN LATERAL (` + enteredState + `) entered ON true
	WHERE o.state = 'ESCALATED' GROUP BY o.operation_type`
