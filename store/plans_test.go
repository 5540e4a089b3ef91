package store_test

import (
	"context"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/storetest"
)

// planLog holds the plans PostgreSQL's auto_explain reported for a pool's statements,
// including those run inside them (foreign-key checks, triggers).
type planLog struct {
	mu    sync.Mutex
	plans []string
}

// matching returns the plans whose query text contains query.
func (l *planLog) matching(query string) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, p := range l.plans {
		if text, _, _ := strings.Cut(p, "\n"); strings.Contains(text, query) {
			out = append(out, p)
		}
	}
	return out
}

// containing returns the plans whose text, query or plan, contains s.
func (l *planLog) containing(s string) []string {
	var out []string
	for _, p := range l.matching("") {
		if strings.Contains(p, s) {
			out = append(out, p)
		}
	}
	return out
}

// claimPlanMark is in the query text of every claim, and of nothing else.
const claimPlanMark = "state = 'IN_FLIGHT', revision = o.revision + 1"

// claimParts splits a claim's plan into the walk over the tenants and a tenant's share.
func claimParts(plan string) (walk, share string) {
	walk, rest, _ := strings.Cut(plan, "CTE picked")
	share, _, _ = strings.Cut(rest, "CTE claimed")
	return walk, share
}

func (l *planLog) reset() {
	l.mu.Lock()
	l.plans = nil
	l.mu.Unlock()
}

// explainingStore returns a store on url whose every statement's plan, as executed,
// lands in the returned log.
func explainingStore(t *testing.T, url string, settings ...string) (*store.Store, *planLog) {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	for k, v := range map[string]string{
		"session_preload_libraries":          "auto_explain",
		"auto_explain.log_min_duration":      "0",
		"auto_explain.log_nested_statements": "on",
		"auto_explain.log_level":             "notice",
	} {
		cfg.ConnConfig.RuntimeParams[k] = v
	}
	for i := 0; i+1 < len(settings); i += 2 {
		cfg.ConnConfig.RuntimeParams[settings[i]] = settings[i+1]
	}
	log := &planLog{}
	cfg.ConnConfig.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		if text, ok := strings.CutPrefix(n.Message, "duration: "); ok {
			if _, plan, ok := strings.Cut(text, "Query Text: "); ok {
				log.mu.Lock()
				log.plans = append(log.plans, plan)
				log.mu.Unlock()
			}
		}
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return store.New(pool), log
}

// The foreign-key checks that remain on operations (a refused payload's record, an
// amendment's reference to what it supersedes) look the operation up by the primary key,
// whatever the table's size when the connection planned them: an index that also led
// with the tenant once won that plan and read the tenant's every operation for each
// check. So do the checks that an event or stale outcome has its operation, and the
// search for an inserted operation's keys, even with statistics taken while
// operation_keys was empty.
func TestForeignKeyChecksUseThePrimaryKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := storetest.Schema(t)
	st, plans := explainingStore(t, url)
	admin := storetest.Pool(t, storetest.AdminURL(t, url))
	_, err := admin.Exec(ctx, `ANALYZE operation_keys`)
	require.NoError(t, err)

	prepare := func(n int, round string) {
		ps := make([]store.PrepareParams, n)
		for i := range ps {
			ps[i] = prepareParams("acme", fmt.Sprintf("%s-%d", round, i), `{"amount":1}`)
		}
		ops, _, errs := st.PrepareTogether(ctx, ps, false)
		for _, err := range errs {
			require.NoError(t, err)
		}
		amendment := prepareParams("acme", round+"-amended", `{"amount":2}`)
		amendment.SupersedesID = uuid.NullUUID{UUID: ops[0].ID, Valid: true}
		_, _, err := st.Tenant("acme").Prepare(ctx, amendment)
		require.NoError(t, err)
		_, _, err = st.Tenant("acme").Prepare(ctx, prepareParams("acme", ps[1].IntentRef, `{"amount":3}`))
		var mismatch *store.PayloadMismatchError
		require.ErrorAs(t, err, &mismatch)
	}
	for _, size := range []int{0, 40, 4000} {
		_, err = admin.Exec(ctx, `INSERT INTO operations (tenant_id, operation_id, operation_type, intent_ref,
				content_type, payload, payload_sha256)
			SELECT 'acme', gen_random_uuid(), 'demo.charge', 'loaded-' || gen_random_uuid(), 'application/json',
				'{}', sha256('{}')
			FROM generate_series(1, $1)`, size)
		require.NoError(t, err)
		plans.reset()
		for round := range 8 { // past the five custom plans a cached plan starts with
			prepare(8, fmt.Sprintf("size-%d-round-%d", size, round))
		}
		for _, query := range []string{
			`FOR KEY SHARE OF x`, // foreign-key checks
			`FROM new_rows n`,    // an event or stale outcome has its operation
		} {
			checks := plans.matching(query)
			require.NotEmpty(t, checks, "no %q was reported at %d operations", query, size)
			for _, p := range checks {
				require.Contains(t, p, "Scan using operations_pkey on operations", "at %d operations:\n%s", size, p)
				require.Regexp(t, byTheWholeKey, p, "at %d operations:\n%s", size, p)
			}
		}
		keys := plans.matching(`INSERT INTO operation_keys (tenant_id, operation_id, operation_type, intent_ref, remote_key)`)
		require.NotEmpty(t, keys, "no search for the keys was reported at %d operations", size)
		for _, p := range keys {
			require.Regexp(t, keysByAKey, p, "at %d operations:\n%s", size, p)
		}
	}
}

// ledgerRows is how many finished operations TestPlansStayOnTheKeys loads beneath its
// workload: OPBROKER_TEST_LEDGER_ROWS when set (CI sets a million), else 20,000.
func ledgerRows(t *testing.T) int {
	v := os.Getenv("OPBROKER_TEST_LEDGER_ROWS")
	if v == "" {
		return 20_000
	}
	n, err := strconv.Atoi(v)
	require.NoError(t, err, "OPBROKER_TEST_LEDGER_ROWS")
	return n
}

var (
	byTheWholeKey = regexp.MustCompile(`Index Cond: \(\(tenant_id = [^)]*\) AND \(operation_id = `)
	// Either unique key of operation_keys, whole: its primary key or the intent key.
	keysByAKey = regexp.MustCompile(`Index Scan using operation_keys_(pkey|intent) on operation_keys k .*\n\s*Index Cond: ` +
		`\(\((remote_key = n.remote_key\) AND \(tenant_id = n.tenant_id|operation_type = n.operation_type\) AND ` +
		`\(intent_ref = n.intent_ref\) AND \(tenant_id = n.tenant_id)\)\)`)
	// A scan the plan never executed reads nothing: an update whose condition is false
	// for its arguments (an evidence settlement without a change) keeps its node.
	bigTableScan    = regexp.MustCompile(`Seq Scan on (operations|operation_keys|operation_events) [^\n]*\(actual`)
	removedByFilter = regexp.MustCompile(`Rows Removed by (?:Filter|Join Filter|Index Recheck): (\d+)`)
	thousandRows    = regexp.MustCompile(`actual rows=\d{4,}[. ]`) // PostgreSQL 18 prints rows=1.00
	// An operation found by its whole primary key.
	byThePrimaryKey = regexp.MustCompile(`(Index Scan using operations_pkey on operations|Bitmap Index Scan on operations_pkey) ` +
		`[^\n]*\n\s*Index Cond: \(\(tenant_id = [^)]*\) AND \(operation_id = `)
	// A scan of operations under the alias o, as statements name the table they change.
	scanOfTheChanged = regexp.MustCompile(`(\w+ Scan(?: using \w+)?) on operations o `)
)

// compiled is in the plan of a statement compiled just in time: no statement of the
// store reads enough rows for that to pay, and a scan that enable_seqscan off penalises
// makes any plan look costly enough for it.
const compiled = "JIT:"

// leftTheKeys reports whether plan p scans a ledger table or discards more than 1,000
// rows at a step.
func leftTheKeys(p string) bool {
	for _, m := range removedByFilter.FindAllStringSubmatch(p, -1) {
		if n, _ := strconv.Atoi(m[1]); n > 1000 {
			return true
		}
	}
	return bigTableScan.MatchString(p)
}

// Over a ledger of finished operations, analyzed when they were loaded (as autovacuum
// would) and then changed by the workload, every statement of the workload reads by a
// key: no sequential scan of a ledger table, and no node that reads and discards more
// than a batch's worth of rows. Only the statistics of GetStats read a period's events
// whole.
func TestPlansStayOnTheKeys(t *testing.T) {
	t.Parallel()
	url := storetest.Schema(t)
	admin := storetest.Pool(t, storetest.AdminURL(t, url))
	rows := ledgerRows(t)
	loadFinished(t, admin, rows)
	analyzeLedger(t, admin)

	st, plans := explainingStore(t, url, "auto_explain.log_analyze", "on", "auto_explain.log_timing", "off")
	workload(t, st)

	// A period's statistics read it whole, by a scan of the table, not by every entry of
	// a key.
	periods := plans.containing("o.created_at >= $")
	require.NotEmpty(t, periods)
	for _, p := range periods {
		require.Contains(t, p, "Seq Scan on operations o", p)
	}
	var violations []string
	for _, p := range plans.matching("") {
		query, _, _ := strings.Cut(p, "\n")
		if strings.Contains(p, "opbroker_schema_version") || strings.HasPrefix(strings.TrimSpace(query), "SELECT set_config") {
			continue
		}
		if strings.Contains(p, "percentile_cont") || strings.Contains(p, "count(DISTINCT e.operation_id)") ||
			strings.Contains(p, "FROM payload_mismatches m JOIN") || strings.Contains(p, "o.created_at >= $") {
			continue // GetStats' period statistics
		}
		if leftTheKeys(p) || strings.Contains(p, compiled) {
			violations = append(violations, p)
		}
	}
	require.Empty(t, violations, "statements that left the keys, or were compiled, over %d operations", rows)
}

// analyzeLedger takes statistics of the ledger's tables, as admin, as autovacuum would.
func analyzeLedger(t *testing.T, admin *pgxpool.Pool) {
	t.Helper()
	_, err := admin.Exec(context.Background(), `ANALYZE operations; ANALYZE operation_keys; ANALYZE operation_events`)
	require.NoError(t, err)
}

// loadFinished loads rows finished operations, as admin: one operation, its keys and
// its last event each, spread over 30 days and 54 tenants, half of it over the
// workload's four (their finished operations are what a claim must not step over). The
// triggers are not run for the load. It takes no statistics.
func loadFinished(t *testing.T, admin *pgxpool.Pool, rows int) {
	t.Helper()
	ctx := context.Background()
	start := time.Now()
	tx, err := admin.Begin(ctx)
	require.NoError(t, err)
	for _, sql := range []string{
		`SET LOCAL session_replication_role = replica`,
		`INSERT INTO operations (tenant_id, operation_id, operation_type, intent_ref, content_type, payload_sha256,
				state, revision, fence_token, attempt_count, remote_ref, first_sent_at, created_at, updated_at)
			SELECT CASE WHEN i % 2 = 0 THEN 'work-' || i / 2 % 4 ELSE 'load-' || i % 50 END, gen_random_uuid(), 'demo.charge',
				'loaded-' || i, 'application/json', sha256('{}'),
				'SUCCEEDED', 3, 1, 1, 'ch_' || i, t, t, t
			FROM generate_series(1, $1) i, LATERAL (SELECT now() - interval '30 days' * i / $1 AS t) x`,
		`INSERT INTO operation_events (tenant_id, operation_id, revision, from_state, to_state, fence_token, actor,
				remote_ref, attempt_count, created_at)
			SELECT tenant_id, operation_id, 3, 'IN_FLIGHT', 'SUCCEEDED', 1, 'dispatcher:load', remote_ref, 1, updated_at
			FROM operations WHERE intent_ref LIKE 'loaded-%'`,
		`INSERT INTO operation_keys (tenant_id, operation_id, operation_type, intent_ref, remote_key)
			SELECT tenant_id, operation_id, operation_type, intent_ref, remote_key
			FROM operations WHERE intent_ref LIKE 'loaded-%'`,
	} {
		var args []any
		if strings.Contains(sql, "$1") {
			args = append(args, rows)
		}
		_, err := tx.Exec(ctx, sql, args...)
		require.NoError(t, err)
	}
	require.NoError(t, tx.Commit(ctx))
	t.Logf("loaded %d finished operations in %s", rows, time.Since(start).Round(time.Millisecond))
}

// workload runs every kind of statement the broker's hot paths run, for one target:
// intents prepared together, an amendment, claims, outcomes of each kind, lease
// extension, both sweeps, the reconciler's claim, check and resolution, reads, the feed
// and the purge.
func workload(t *testing.T, st *store.Store) {
	ctx := context.Background()
	all := st.AllTenants()
	var ps []store.PrepareParams
	for i := range 400 {
		p := prepareParams(fmt.Sprintf("work-%d", i%4), fmt.Sprintf("work-%d", i), `{"amount":1}`)
		if i%10 == 0 {
			deadline := time.Now().Add(time.Minute)
			p.DispatchDeadline = &deadline
		}
		ps = append(ps, p)
	}
	_, _, errs := st.PrepareTogether(ctx, ps, true)
	for _, err := range errs {
		require.NoError(t, err)
	}
	one, _, err := all.Prepare(ctx, prepareParams("work-0", "work-alone", `{"amount":2}`))
	require.NoError(t, err)
	_, err = all.Get(ctx, one.TenantID, one.ID)
	require.NoError(t, err)
	amended := prepareParams("work-0", "work-alone-amended", `{"amount":3}`) // cancels the first
	amended.SupersedesID = uuid.NullUUID{UUID: one.ID, Valid: true}
	_, _, err = all.Prepare(ctx, amended)
	require.NoError(t, err)
	for _, again := range []store.PrepareParams{ps[1], prepareParams("work-1", "loaded-2", `{}`)} {
		_, created, err := all.Prepare(ctx, again) // answered from the intent key
		require.NoError(t, err)
		require.False(t, created, again.IntentRef)
	}
	_, _, err = all.List(ctx, store.ListParams{TenantID: "load-7", Limit: 50})
	require.NoError(t, err)
	listed, _, err := all.List(ctx, store.ListParams{TenantID: "load-7", IntentRef: "loaded-7",
		OperationTypes: []string{"demo.charge", "demo.notify"}, Limit: 50})
	require.NoError(t, err)
	require.Len(t, listed, 1)
	_, err = all.Events(ctx, one.TenantID, one.ID, 0, 100)
	require.NoError(t, err)

	var claimed []store.Claimed
	for range 8 { // past the five custom plans a cached plan starts with
		c, err := all.Claim(ctx, claimParams(40))
		require.NoError(t, err)
		claimed = append(claimed, c...)
	}
	require.Len(t, claimed, 320)
	for range 6 { // where a claim's walk ends, read before a claim that may come back short
		_, err := all.WalkEnd(ctx, store.StatePrepared, claimParams(40).FairClaim)
		require.NoError(t, err)
	}
	for range 6 { // a target of two types: each type's share picked on its own, then merged
		p := claimParams(10)
		p.OperationTypes = []string{"demo.charge", "demo.notify"}
		c, err := all.Claim(ctx, p)
		require.NoError(t, err)
		claimed = append(claimed, c...)
	}
	held := make([]store.HeldLease, len(claimed))
	for i, c := range claimed {
		held[i] = store.HeldLease{OperationKey: store.OperationKey{TenantID: c.TenantID, ID: c.ID}, Fence: c.FenceToken}
	}
	_, err = all.ExtendLeases(ctx, held, time.Minute)
	require.NoError(t, err)
	keys := make([]store.OperationKey, len(held))
	for i, h := range held {
		keys[i] = h.OperationKey
	}
	_, err = all.Revisions(ctx, keys)
	require.NoError(t, err)
	obs := store.Observation{ObservedAt: time.Now(), Source: "DISPATCH", Outcome: "VERIFIED_SUCCESS", HTTPStatus: 200}
	var wg sync.WaitGroup
	for i, c := range claimed[:200] {
		p := store.OutcomeParams{TenantID: c.TenantID, ID: c.ID, Fence: c.FenceToken, State: store.StateSucceeded,
			RemoteRef: "ch_" + c.ID.String(), Observation: obs, Actor: "dispatcher:test"}
		switch i % 4 {
		case 1:
			p.State, p.RemoteRef = store.StateUnknown, ""
		case 2:
			p.State, p.RemoteRef, p.NotExecuted, p.SendAgainAfter = store.StatePrepared, "", true, time.Second
		}
		wg.Go(func() {
			_, err := all.RecordOutcome(ctx, p)
			require.NoError(t, err)
		})
	}
	wg.Wait()
	_, err = all.SweepExpiredLeases(ctx, store.SweepParams{Now: time.Now().Add(time.Hour), Limit: 500})
	require.NoError(t, err)
	for _, c := range claimed[200:240] { // swept: what their senders record late is kept as stale
		_, err := all.RecordOutcome(ctx, store.OutcomeParams{TenantID: c.TenantID, ID: c.ID, Fence: c.FenceToken,
			State: store.StateUnknown, Observation: obs, Actor: "dispatcher:test"})
		require.ErrorIs(t, err, store.ErrFenceLost)
	}
	_, err = all.ExpireDeadlines(ctx, store.SweepParams{Now: time.Now().Add(time.Hour), Limit: 500})
	require.NoError(t, err)

	unknown, err := all.ClaimUnknown(ctx, store.FairClaim{OperationTypes: []string{"demo.charge"}, Worker: "test-reconciler",
		Lease: time.Minute, Limit: 100, PerTenant: 100, MaxTenants: 100})
	require.NoError(t, err)
	require.NotEmpty(t, unknown)
	_, err = all.WalkEnd(ctx, store.StateUnknown, store.FairClaim{MaxTenants: 2})
	require.NoError(t, err)
	for i, u := range unknown {
		look := store.Observation{ObservedAt: time.Now(), Source: "LOOKUP", Outcome: "NOT_FOUND"}
		if i%2 == 0 {
			_, err = all.RecordCheck(ctx, store.CheckParams{TenantID: u.TenantID, ID: u.ID, Fence: u.FenceToken,
				Observation: look, CheckAfter: time.Second, Actor: "reconciler:test"})
		} else {
			look.Outcome = "FOUND"
			_, err = all.ResolveUnknown(ctx, store.ResolveParams{TenantID: u.TenantID, ID: u.ID, Fence: u.FenceToken,
				State: store.StateSucceeded, RemoteRef: "ch_found", Observation: look, Actor: "reconciler:test"})
		}
		require.NoError(t, err)
		_, _, err = all.StaleSuccess(ctx, u.TenantID, u.ID)
		require.NoError(t, err)
	}
	head, err := all.FeedHead(ctx)
	require.NoError(t, err)
	_, err = all.ReadFeed(ctx, store.FeedParams{TenantID: "work-1", Limit: 100}, head)
	require.NoError(t, err)
	_, err = all.PurgePayloads(ctx, store.PurgeParams{Default: time.Nanosecond, Limit: 100})
	require.NoError(t, err)
	_, err = all.PeriodStats(ctx, store.PeriodParams{From: time.Now().Add(-7 * 24 * time.Hour), To: time.Now()})
	require.NoError(t, err)
	_, _, err = all.Escalations(ctx, store.EscalationsParams{Limit: 50})
	require.NoError(t, err)
	_, err = all.OpenStats(ctx, store.OpenStatsParams{})
	require.NoError(t, err)
	evidenceWorkload(t, all, claimed[:4])
}

// evidenceWorkload runs the statements of a target's events: their receipt, the search
// for their operation by either kind of reference (the loaded operations have the
// target's references), their settlement, the matcher's queue, the quarantine and the
// purge of bodies.
func evidenceWorkload(t *testing.T, all store.Scope, claimed []store.Claimed) {
	ctx := context.Background()
	types := []string{"demo.charge"}
	for i, c := range claimed {
		e := store.InboundEvidence{Target: "demo-payments", EventID: fmt.Sprintf("evt_%d", i), Source: store.SourceWebhook,
			EventType: "charge.succeeded", Meaning: "SUCCEEDED", Reference: c.RemoteKey.String(), ReferenceKind: "remote_key",
			RemoteRef: "ch_" + c.ID.String(), Body: []byte(`{}`)}
		_, _, err := all.ReceiveEvidence(ctx, e, time.Hour, time.Minute)
		require.NoError(t, err)
		found, err := all.EvidenceCandidates(ctx, types, "remote_key", e.Reference)
		require.NoError(t, err)
		require.Len(t, found, 1)
		_, err = all.EvidenceCandidates(ctx, types, "remote_ref", fmt.Sprintf("ch_%d", 1+i))
		require.NoError(t, err)
		s := store.EvidenceSettlement{EvidenceKey: e.Key(), From: store.EvidencePending,
			To: store.EvidenceQuarantined, Reason: "PAYLOAD_MISMATCH", Detail: "test", TenantID: c.TenantID, ID: c.ID}
		if i%2 == 0 {
			op := found[0].Operation
			s.To, s.Reason, s.Detail, s.Revision = store.EvidenceObserved, "", "", op.Revision
			if op.State == store.StateUnknown || op.State == store.StateInFlight {
				s.To = store.EvidenceApplied
				s.Change = &store.EvidenceChange{Revision: op.Revision, From: op.State, To: store.StateSucceeded,
					RemoteRef: e.RemoteRef, Observation: store.Observation{Source: "EVIDENCE", Outcome: "EVIDENCE_SUCCEEDED"},
					Actor: "webhook:demo-payments", Reason: "EVIDENCE_SUCCEEDED"}
			}
		}
		require.NoError(t, all.SettleEvidence(ctx, s))
	}
	_, _, err := all.ReceiveEvidence(ctx, store.InboundEvidence{Target: "demo-payments", EventID: "evt_unmatched",
		Source: store.SourceWebhook, EventType: "charge.succeeded", Meaning: "SUCCEEDED", Reference: "nothing",
		ReferenceKind: "remote_ref", Body: []byte(`{}`)}, time.Hour, time.Minute)
	require.NoError(t, err)
	_, err = all.DueEvidence(ctx, 64)
	require.NoError(t, err)
	_, err = all.MatchLater(ctx, store.EvidenceKey{Target: "demo-payments", EventID: "evt_unmatched"}, "UNMATCHED", "none")
	require.NoError(t, err)
	_, _, err = all.Quarantine(ctx, store.QuarantineParams{Limit: 50})
	require.NoError(t, err)
	_, err = all.PurgeEvidenceBodies(ctx, 100)
	require.NoError(t, err)
}

// TestClaimsWalkTheTenantsByTheClaimIndex: statistics taken while every operation was
// PREPARED make the primary key look as good as the claim index for finding the next
// tenant with PREPARED operations, and for a tenant's share of them; once most are
// claimed, either steps over them all. Both order by what only the claim index gives, so
// they read that index whatever the statistics say, for a target of one type and of
// two.
func TestClaimsWalkTheTenantsByTheClaimIndex(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := storetest.Schema(t)
	st, plans := explainingStore(t, url, "auto_explain.log_analyze", "on", "auto_explain.log_timing", "off")
	admin := storetest.Pool(t, storetest.AdminURL(t, url))
	for _, tenant := range []string{"acme", "globex", "initech"} {
		ps := make([]store.PrepareParams, 600)
		for i := range ps {
			ps[i] = prepareParams(tenant, fmt.Sprintf("%s-%d", tenant, i), `{"amount":1}`)
		}
		_, _, errs := st.PrepareTogether(ctx, ps, false)
		for _, err := range errs {
			require.NoError(t, err)
		}
	}
	// The statistics stay those of the load: an automatic ANALYZE after the claims below
	// would let even a plan that reads the primary key pass.
	_, err := admin.Exec(ctx, `ALTER TABLE operations SET (autovacuum_enabled = off); ANALYZE operations`)
	require.NoError(t, err)
	all := st.AllTenants()
	for range 15 {
		claimed, err := all.Claim(ctx, claimParams(100))
		require.NoError(t, err)
		require.Len(t, claimed, 100)
	}
	plans.reset()
	for _, types := range [][]string{{"demo.charge"}, {"demo.charge", "demo.notify"}, {"demo.charge"}} {
		p := claimParams(60)
		p.OperationTypes = types
		claimed, err := all.Claim(ctx, p)
		require.NoError(t, err)
		require.Len(t, claimed, 60)
	}
	claims := plans.containing(claimPlanMark)
	require.Len(t, claims, 3)
	for _, p := range claims {
		walk, share := claimParts(p)
		require.Contains(t, walk, "CTE tenants", p)
		for _, part := range []string{walk, share} {
			requireReadsTheClaimIndex(t, part, p)
		}
	}
}

// TestDispatchStaysOnTheKeysAsTheLedgerGrows: a connection keeps a statement's plan once
// it finds a plan for any arguments (a generic plan) as good as those it made for each
// call's; the test has it keep that plan from the start (oneConnection). Made while the
// ledger was small, where reading a whole index costs least, such a plan would step
// over every operation in flight for each outcome (by the lease index) and over every
// claimed operation of a tenant for each claim, once the ledger has grown (without an
// ANALYZE since, which would have the statement planned again), and an amendment's
// Prepare would read the whole ledger to find the operation it supersedes. So outcomes
// are planned for each call's arguments, and a claim's share and an amendment's lookup
// are written so that only an index serves them (the claim index, the primary key),
// whichever plan the connection keeps.
func TestDispatchStaysOnTheKeysAsTheLedgerGrows(t *testing.T) {
	t.Parallel()
	admin, all, plans := oneConnection(t)
	dispatchRound(t, all, "small", 8) // the plans are made and kept on this ledger
	loadFinished(t, admin, ledgerRows(t))
	plans.reset()
	dispatchRound(t, all, "grown", 2)
	requireDispatchOnTheKeys(t, plans, 2)
	outcomes := plans.containing("last_observation = u.observation")
	require.Len(t, outcomes, 2)
	for _, p := range outcomes {
		require.Regexp(t, byThePrimaryKey, p, p)
	}
}

// TestDispatchStaysOnTheKeysAfterStatisticsOfASmallLedger: autovacuum takes statistics
// of a new ledger once it has a few dozen rows, all on one page. A plan made from them
// reads a page instead of looking up an operation by its key, or reads a partial index
// of a state whole (it holds a row or two), and a connection that keeps it (no ANALYZE
// since) would read the whole ledger, or every operation in that state, in every
// statement once the ledger has grown: the cancellation of a superseded operation
// joined every operation, the amendment's lookup scanned them all, a claim scanned the
// ledger three times, a lease extension twice. So these statements run without
// sequential scans, and find what they change by keys only an index of the key, or a
// TID scan, can serve. (An outcome, planned for each call, reads the operations in
// flight by the lease index here, as it does at work, where that is the cheaper plan;
// the operations in flight, and the lease index's entries not yet vacuumed, bound it,
// not the ledger.)
func TestDispatchStaysOnTheKeysAfterStatisticsOfASmallLedger(t *testing.T) {
	t.Parallel()
	admin, all, plans := oneConnection(t)
	dispatchRound(t, all, "first", 2)
	analyzeLedger(t, admin)
	dispatchRound(t, all, "small", 8) // the plans are made and kept on this ledger
	loadFinished(t, admin, ledgerRows(t))
	plans.reset()
	dispatchRound(t, all, "grown", 2)
	requireDispatchOnTheKeys(t, plans, 2)
}

// dispatchRound takes n intents through dispatch in the tenant work-0, one at a time:
// each prepared and amended (which cancels it), the amendment claimed, its lease
// extended, its revision read and its outcome recorded, SUCCEEDED or, for every other
// one, UNKNOWN, which the reconciler claims, checks, claims again and resolves; and
// each sweep moves one operation (sweepOne).
func dispatchRound(t *testing.T, all store.Scope, round string, n int) {
	t.Helper()
	ctx := context.Background()
	obs := store.Observation{ObservedAt: time.Now(), Source: "DISPATCH", Outcome: "VERIFIED_SUCCESS"}
	for i := range n {
		intent := fmt.Sprintf("dispatch-%s-%d", round, i)
		prepareAndAmend(t, all, intent)
		claimed, err := all.Claim(ctx, claimParams(1))
		require.NoError(t, err)
		require.Len(t, claimed, 1)
		c := claimed[0]
		held := store.HeldLease{OperationKey: store.OperationKey{TenantID: c.TenantID, ID: c.ID}, Fence: c.FenceToken}
		got, err := all.ExtendLeases(ctx, []store.HeldLease{held}, time.Minute)
		require.NoError(t, err)
		require.Len(t, got.Left, 1)
		revisions, err := all.Revisions(ctx, []store.OperationKey{held.OperationKey})
		require.NoError(t, err)
		require.Len(t, revisions, 1)
		outcome := store.OutcomeParams{TenantID: c.TenantID, ID: c.ID, Fence: c.FenceToken,
			State: store.StateSucceeded, RemoteRef: "ch_" + intent, Actor: "dispatcher:test", Observation: obs}
		if i%2 == 1 {
			outcome.State, outcome.RemoteRef = store.StateUnknown, ""
		}
		_, err = all.RecordOutcome(ctx, outcome)
		require.NoError(t, err)
		if outcome.State == store.StateUnknown {
			reconcile(t, all)
		}
		sweepOne(t, all, intent)
	}
}

// sweepOne makes one operation due for each sweep, in the tenant work-0, and runs them:
// intent's late one passes its dispatch deadline, its lost one is claimed and its lease
// expires.
func sweepOne(t *testing.T, all store.Scope, intent string) {
	t.Helper()
	ctx := context.Background()
	late := prepareParams("work-0", intent+"-late", `{"amount":4}`)
	deadline := time.Now().Add(time.Minute)
	late.DispatchDeadline = &deadline
	_, _, err := all.Prepare(ctx, late)
	require.NoError(t, err)
	sweep := store.SweepParams{Now: time.Now().Add(time.Hour), Limit: 10}
	swept, err := all.ExpireDeadlines(ctx, sweep)
	require.NoError(t, err)
	require.Equal(t, store.Swept{"demo.charge": 1}, swept)
	_, _, err = all.Prepare(ctx, prepareParams("work-0", intent+"-lost", `{"amount":5}`))
	require.NoError(t, err)
	claimed, err := all.Claim(ctx, claimParams(1))
	require.NoError(t, err)
	require.Len(t, claimed, 1)
	swept, err = all.SweepExpiredLeases(ctx, sweep)
	require.NoError(t, err)
	require.Equal(t, store.Swept{"demo.charge": 1}, swept)
}

// reconcile claims the UNKNOWN operation of dispatchRound, records a check of it and
// resolves it.
func reconcile(t *testing.T, all store.Scope) {
	t.Helper()
	ctx := context.Background()
	claim := func() store.UnknownClaim {
		unknown, err := all.ClaimUnknown(ctx, store.FairClaim{OperationTypes: []string{"demo.charge"},
			Worker: "test-reconciler", Lease: time.Minute, Limit: 1, PerTenant: 1, MaxTenants: 10})
		require.NoError(t, err)
		require.Len(t, unknown, 1)
		return unknown[0]
	}
	look := store.Observation{ObservedAt: time.Now(), Source: "LOOKUP", Outcome: "NOT_FOUND"}
	u := claim()
	_, err := all.RecordCheck(ctx, store.CheckParams{TenantID: u.TenantID, ID: u.ID, Fence: u.FenceToken,
		Observation: look, Actor: "reconciler:test"})
	require.NoError(t, err)
	u = claim()
	look.Outcome = "FOUND"
	_, err = all.ResolveUnknown(ctx, store.ResolveParams{TenantID: u.TenantID, ID: u.ID, Fence: u.FenceToken,
		State: store.StateSucceeded, RemoteRef: "ch_found", Observation: look, Actor: "reconciler:test"})
	require.NoError(t, err)
}

// requireDispatchOnTheKeys checks the plans of n rounds of dispatchRound of one intent
// each: no statement scans a table of the ledger, or returns or discards a thousand
// rows at a step; an amendment finds what it supersedes by the whole primary key; a
// claim reads the claim index for its share and changes what it picked by a TID scan,
// as the sweeps and the reconciler's claim change what they picked, the lease extension
// changes, and the read of revisions reads, what they find.
func requireDispatchOnTheKeys(t *testing.T, plans *planLog, n int) {
	t.Helper()
	for _, p := range plans.matching("") {
		require.False(t, leftTheKeys(p), p)
		require.NotRegexp(t, thousandRows, p)
		require.NotContains(t, p, compiled, p)
	}
	prepares := plans.containing("CTE sup")
	require.Len(t, prepares, 4*n) // the round's two and sweepOne's two
	for _, p := range prepares {
		_, sup, _ := strings.Cut(p, "CTE sup")
		sup, _, _ = strings.Cut(sup, "CTE refused")
		require.Regexp(t, byThePrimaryKey, sup, p)
	}
	claims := plans.containing(claimPlanMark)
	extensions := plans.containing("SET lease_expires_at = now() + $4::interval")
	revisions := plans.containing("SELECT o.tenant_id, o.operation_id, o.revision")
	sweeps := plans.containing("WITH due AS")
	unknown := plans.containing("SET fence_token = o.fence_token + 1, lease_owner = $6")
	require.Len(t, claims, 2*n) // the round's and sweepOne's
	require.Len(t, extensions, n)
	require.Len(t, revisions, n)
	require.Len(t, sweeps, 2*n)
	require.Len(t, unknown, 2*(n/2))
	for _, p := range claims {
		_, share := claimParts(p)
		requireReadsTheClaimIndex(t, share, p)
		requireChangedByTIDs(t, p)
	}
	for _, p := range slices.Concat(extensions, revisions, sweeps, unknown) {
		requireChangedByTIDs(t, p)
	}
}

// requireReadsTheClaimIndex checks that part, of a claim's plan p, reads the claim
// index and not the primary key.
func requireReadsTheClaimIndex(t *testing.T, part, p string) {
	t.Helper()
	require.NotContains(t, part, "using operations_pkey", p)
	require.Contains(t, part, "using operations_claim_idx", p)
}

// requireChangedByTIDs checks that plan p finds the rows it changes or reads by key
// (operations o) by their ctids, and by nothing else.
func requireChangedByTIDs(t *testing.T, p string) {
	t.Helper()
	scans := scanOfTheChanged.FindAllStringSubmatch(p, -1)
	require.NotEmpty(t, scans, p)
	for _, m := range scans {
		require.Equal(t, "Tid Scan", m[1], p)
	}
}

// oneConnection returns a new schema's administrator pool and a store on it with one
// connection, so that its statements are the ones planned on the small ledger, whose
// plans are logged as executed; autovacuum never analyzes the ledger, the test does.
// The connection keeps the plan it makes for any arguments from the start (PostgreSQL
// would, after five, when it finds that plan as cheap as the ones made for each call),
// except where a statement asks to be planned for its arguments: the worst it could keep.
func oneConnection(t *testing.T) (*pgxpool.Pool, store.Scope, *planLog) {
	t.Helper()
	url := storetest.Schema(t)
	admin := storetest.Pool(t, storetest.AdminURL(t, url))
	// An ANALYZE of any table the statements read would have them planned again.
	for _, table := range []string{"operations", "operation_keys", "operation_events"} {
		_, err := admin.Exec(context.Background(), `ALTER TABLE `+table+` SET (autovacuum_enabled = off)`)
		require.NoError(t, err)
	}
	st, plans := explainingStore(t, url+"&pool_max_conns=1", "auto_explain.log_analyze", "on", "auto_explain.log_timing", "off",
		"plan_cache_mode", "force_generic_plan")
	return admin, st.AllTenants(), plans
}

// prepareAndAmend prepares intent in the tenant work-0, then an amendment of it, which
// cancels it.
func prepareAndAmend(t *testing.T, all store.Scope, intent string) {
	t.Helper()
	ctx := context.Background()
	first, _, err := all.Prepare(ctx, prepareParams("work-0", intent, `{"amount":1}`))
	require.NoError(t, err)
	amended := prepareParams("work-0", intent+"-amended", `{"amount":2}`)
	amended.SupersedesID = uuid.NullUUID{UUID: first.ID, Valid: true}
	_, _, err = all.Prepare(ctx, amended)
	require.NoError(t, err)
}
