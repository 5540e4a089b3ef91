package store

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// PeriodParams select what PeriodStats reads: the period [From, To), and the target
// each operation type belongs to (Targets; a type not in it is counted under "").
type PeriodParams struct {
	From, To time.Time
	Targets  map[string]string
}

// PeriodRow is what the ledger says of one tenant's operations of one target.
type PeriodRow struct {
	TenantID string
	Target   string
	// UnknownEntered counts, by UTC day (YYYY-MM-DD), the operations that became UNKNOWN
	// within the period, each once a day (a look that resolves nothing, or a replay whose
	// answer is unclear again, does not count it again).
	UnknownEntered map[string]int64
	// Resolved counts the operations that had been UNKNOWN and became terminal within the
	// period (a same-key replay's success included); MedianToResolution and
	// WorstToResolution are the time from each one's first UNKNOWN to that.
	Resolved                              int64
	MedianToResolution, WorstToResolution time.Duration
	// OpenEscalated is how many are ESCALATED now, and OldestEscalation how long the
	// oldest of them has waited.
	OpenEscalated    int64
	OldestEscalation time.Duration
	// PayloadMismatches counts the intents refused within the period because they were
	// recorded with another payload.
	PayloadMismatches int64
	// ByState counts the operations created within the period by their state now.
	ByState map[State]int64
}

// PeriodStats computes, from the ledger, per tenant and target, what PeriodRow holds,
// in one read-only snapshot. It reads the events and the operations created within the
// period (the events by a scan: it is an operator's occasional question, not a gauge).
func (q Scope) PeriodStats(ctx context.Context, p PeriodParams) ([]PeriodRow, error) {
	types, targets := make([]string, 0, len(p.Targets)), make([]string, 0, len(p.Targets))
	for typ, target := range p.Targets {
		types, targets = append(types, typ), append(targets, target)
	}
	rows := map[[2]string]*PeriodRow{}
	row := func(tenant, target string) *PeriodRow {
		k := [2]string{tenant, target}
		if rows[k] == nil {
			rows[k] = &PeriodRow{TenantID: tenant, Target: target, UnknownEntered: map[string]int64{}, ByState: map[State]int64{}}
		}
		return rows[k]
	}
	args := pgx.NamedArgs{"from": p.From, "to": p.To, "types": types, "targets": targets}
	// target maps the operation type of o to its target.
	const target = `coalesce((SELECT t.target FROM unnest(@types::text[], @targets::text[]) AS t (operation_type, target)
		WHERE t.operation_type = o.operation_type), '')`
	err := q.inTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		// These read a period's events and operations whole: with sequential scans
		// discouraged (setScope), the planner read the primary keys whole instead, in
		// the order of the keys.
		if _, err := tx.Exec(ctx, serverScans); err != nil {
			return err
		}
		var tenant, tgt, day string
		var n int64
		var median, worst float64
		var state State
		for _, s := range []struct {
			sql  string
			dest []any
			use  func()
		}{{
			`SELECT o.tenant_id, ` + target + `, to_char(e.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD'), count(DISTINCT e.operation_id)
			FROM operation_events e JOIN operations o USING (tenant_id, operation_id)
			WHERE e.to_state = 'UNKNOWN' AND e.from_state IS DISTINCT FROM 'UNKNOWN'
				AND e.created_at >= @from AND e.created_at < @to
			GROUP BY 1, 2, 3`,
			[]any{&tenant, &tgt, &day, &n}, func() { row(tenant, tgt).UnknownEntered[day] += n },
		}, {
			`SELECT o.tenant_id, ` + target + `, count(*),
				percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM r.created_at - u.entered)),
				max(extract(epoch FROM r.created_at - u.entered))::float8
			FROM operation_events r JOIN operations o USING (tenant_id, operation_id)
			CROSS JOIN LATERAL (SELECT min(e.created_at) AS entered FROM operation_events e
				WHERE e.tenant_id = r.tenant_id AND e.operation_id = r.operation_id AND e.to_state = 'UNKNOWN'
					AND e.revision < r.revision) u
			WHERE r.to_state IN ('SUCCEEDED', 'FAILED_TERMINAL') AND u.entered IS NOT NULL
				AND r.created_at >= @from AND r.created_at < @to
			GROUP BY 1, 2`,
			[]any{&tenant, &tgt, &n, &median, &worst}, func() {
				r := row(tenant, tgt)
				r.Resolved, r.MedianToResolution, r.WorstToResolution = n, seconds(median), seconds(worst)
			},
		}, {
			`SELECT o.tenant_id, ` + target + `, count(*),
				coalesce(extract(epoch FROM max(now() - (o.escalation->>'escalated_at')::timestamptz)), 0)::float8
			FROM operations o WHERE o.state = 'ESCALATED'
			GROUP BY 1, 2`,
			[]any{&tenant, &tgt, &n, &worst}, func() {
				r := row(tenant, tgt)
				r.OpenEscalated, r.OldestEscalation = n, seconds(worst)
			},
		}, {
			`SELECT o.tenant_id, ` + target + `, count(*)
			FROM payload_mismatches m JOIN operations o USING (tenant_id, operation_id)
			WHERE m.refused_at >= @from AND m.refused_at < @to
			GROUP BY 1, 2`,
			[]any{&tenant, &tgt, &n}, func() { row(tenant, tgt).PayloadMismatches += n },
		}, {
			`SELECT o.tenant_id, ` + target + `, o.state, count(*)
			FROM operations o WHERE o.created_at >= @from AND o.created_at < @to
			GROUP BY 1, 2, 3`,
			[]any{&tenant, &tgt, &state, &n}, func() { row(tenant, tgt).ByState[state] += n },
		}} {
			r, _ := tx.Query(ctx, s.sql, args)
			if _, err := pgx.ForEachRow(r, s.dest, func() error { s.use(); return nil }); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("store: period stats: %w", translate(err))
	}
	out := make([]PeriodRow, 0, len(rows))
	for _, r := range rows {
		out = append(out, *r)
	}
	slices.SortFunc(out, func(a, b PeriodRow) int {
		return cmp.Or(strings.Compare(a.TenantID, b.TenantID), strings.Compare(a.Target, b.Target))
	})
	return out, nil
}

// seconds converts seconds the database measured to a duration.
func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }
