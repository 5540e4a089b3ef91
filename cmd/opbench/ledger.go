package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/urfave/cli/v3"

	"github.com/opbroker/opbroker/payload"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/store"
)

// benchLedger measures Prepare and claim latency on an empty ledger, then again as it
// grows to --operations finished operations, to show they do not degrade with its size.
func benchLedger(ctx context.Context, cmd *cli.Command) error {
	pool, cleanup, err := openDatabase(ctx, cmd, true)
	if err != nil {
		return err
	}
	defer cleanup()
	st := store.New(pool)
	total, tenants, period := cmd.Int("operations"), max(1, cmd.Int("tenants")), cmd.Duration("period")
	backlog := cmd.Int("backlog")
	if backlog < 64 {
		return errors.New("--backlog must be at least 64, one claim")
	}
	out := cmd.Root().Writer
	fmt.Fprintf(out, "the ledger as it grows: Prepare at concurrency 8 for %s, then claims of 64 (each with its events) through a fresh backlog of %d\n", period, backlog)
	fmt.Fprintf(out, "%-12s  %-30s  %-22s  %s\n", "operations", "Prepare ops/s p50 p99", "claim of 64: p50 p99", "their 64 outcomes: p50 p99")
	// Warm up first (connections, their prepared statements, caches), so that the
	// empty ledger is not measured cold.
	if _, _, err := claimThrough(ctx, st, -1, tenants, backlog/5); err != nil {
		return err
	}
	grown := 0
	for _, size := range []int{0, total / 10, total} {
		for grown < size {
			n := min(50_000, size-grown)
			fmt.Fprintf(cmd.Root().ErrWriter, "growing the ledger: %d of %d finished operations ...\n", grown+n, total)
			if err := grow(ctx, pool, n, tenants); err != nil {
				return err
			}
			grown += n
		}
		if err := analyze(ctx, pool); err != nil {
			return err
		}
		var seq int
		var mu sync.Mutex
		prepare := measure(ctx, 8, period, func(ctx context.Context, _ int) error {
			mu.Lock()
			seq++
			intent := fmt.Sprintf("ledger-%d-%d", size, seq)
			mu.Unlock()
			_, err := prepareIntent(ctx, st, "tenant-0", intent, benchBody)
			return err
		})
		if prepare.err != nil {
			return prepare.err
		}
		// The intents just prepared are dispatched too, so the claims start from a
		// backlog of the fresh ones plus those.
		claims, outcomes, err := claimThrough(ctx, st, size, tenants, backlog)
		if err != nil {
			return err
		}
		fmt.Fprintf(out, "%-12d  %-30s  %6.2fms %6.2fms        %6.2fms %6.2fms\n", size, prepare,
			ms(claims[len(claims)/2]), ms(claims[len(claims)*99/100]), ms(outcomes[len(outcomes)/2]), ms(outcomes[len(outcomes)*99/100]))
	}
	fmt.Fprintf(out, "  the ledger grows by finished operations as the broker writes them (3 events, 1 attempt each), bulk-inserted between measurements and analysed\n")
	fmt.Fprintf(out, "  %s\n", machine(ctx, pool))
	return nil
}

// grow adds n SUCCEEDED operations, spread over the tenants, each with the rows the
// broker writes for one (three events, one finished attempt), in one transaction.
func grow(ctx context.Context, pool *pgxpool.Pool, n, tenants int) error {
	ids := make([]uuid.UUID, n)
	for i := range ids {
		ids[i] = uuid.Must(uuid.NewV7())
	}
	digest, err := payload.Hash("application/json", benchBody)
	if err != nil {
		return err
	}
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT set_config('opbroker.tenant', '*', true)`); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `
			WITH ops AS (
				INSERT INTO operations (tenant_id, operation_id, operation_type, intent_ref, content_type, payload,
					payload_sha256, state, revision, fence_token, attempt_count, remote_ref, first_sent_at, last_observation)
				SELECT 'tenant-' || (ord % $2), id, $5, 'grown-' || id, 'application/json', $3, $4,
					'SUCCEEDED', 3, 1, 1, 'ref_' || id, now(), '{"source":"DISPATCH","outcome":"CREATED"}'
				FROM unnest($1::uuid[]) WITH ORDINALITY AS u (id, ord)
				RETURNING tenant_id, operation_id, remote_ref
			)
			INSERT INTO operation_events (tenant_id, operation_id, revision, from_state, to_state, fence_token, actor,
				remote_ref, attempt_count)
			SELECT tenant_id, operation_id, v.revision, v.from_state::operation_state, v.to_state::operation_state,
				v.fence, 'opbench', CASE WHEN v.revision = 3 THEN remote_ref END, v.attempts
			FROM ops, (VALUES (1, NULL, 'PREPARED', 0, 0), (2, 'PREPARED', 'IN_FLIGHT', 1, 1),
				(3, 'IN_FLIGHT', 'SUCCEEDED', 1, 1)) AS v (revision, from_state, to_state, fence, attempts)`,
			ids, tenants, benchBody, digest[:], simtarget.DemoCharge)
		return err
	})
}

// claimThrough prepares a backlog of n over the tenants, then claims it 64 at a time,
// recording each claimed operation SUCCEEDED (the 64 at once, as a dispatcher's sends
// finishing together), and returns the latencies of each claim and of each claim's
// outcomes, sorted.
func claimThrough(ctx context.Context, st *store.Store, size, tenants, n int) (claims, outcomes []time.Duration, err error) {
	for i := range n {
		if _, err := prepareIntent(ctx, st, fmt.Sprintf("tenant-%d", i%tenants), fmt.Sprintf("backlog-%d-%d", size, i), benchBody); err != nil {
			return nil, nil, err
		}
	}
	cursor := ""
	for {
		start := time.Now()
		claimed, err := st.AllTenants().Claim(ctx, store.ClaimParams{FairClaim: store.FairClaim{
			OperationTypes: []string{simtarget.DemoCharge}, Worker: "opbench", Lease: time.Minute,
			Limit: 64, PerTenant: 16, MaxTenants: 64, AfterTenant: cursor}})
		if err != nil {
			return nil, nil, err
		}
		if len(claimed) == 0 {
			break
		}
		claims = append(claims, time.Since(start))
		cursor = claimed[len(claimed)-1].TenantID
		start = time.Now()
		var wg sync.WaitGroup
		errs := make([]error, len(claimed))
		for i, c := range claimed {
			wg.Go(func() {
				_, errs[i] = st.AllTenants().RecordOutcome(ctx, store.OutcomeParams{TenantID: c.TenantID, ID: c.ID, Fence: c.FenceToken,
					State: store.StateSucceeded, RemoteRef: "ref_" + c.ID.String(), Observation: store.Observation{Outcome: "CREATED"}, Actor: "opbench"})
			})
		}
		wg.Wait()
		outcomes = append(outcomes, time.Since(start))
		if err := errors.Join(errs...); err != nil {
			return nil, nil, err
		}
	}
	if len(claims) == 0 {
		return nil, nil, fmt.Errorf("nothing was claimed")
	}
	slices.Sort(claims)
	slices.Sort(outcomes)
	return claims, outcomes, nil
}
