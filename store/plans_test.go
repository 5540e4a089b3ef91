package store_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"

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

func (l *planLog) reset() {
	l.mu.Lock()
	l.plans = nil
	l.mu.Unlock()
}

// explainingStore returns a store on url whose every statement's plan, as executed,
// lands in the returned log.
func explainingStore(t *testing.T, url string) (*store.Store, *planLog) {
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

// The foreign-key checks of every event, attempt and refusal look the operation up by
// the primary key, whatever the table's size when the connection planned them: an index
// that also leads with the tenant once won that plan and read the tenant's every
// operation for each check.
func TestForeignKeyChecksUseThePrimaryKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := storetest.Schema(t)
	st, plans := explainingStore(t, url)
	admin := storetest.Pool(t, storetest.AdminURL(t, url))

	prepare := func(n int, round string) {
		ps := make([]store.PrepareParams, n)
		for i := range ps {
			ps[i] = prepareParams("acme", fmt.Sprintf("%s-%d", round, i), `{"amount":1}`)
		}
		_, _, errs := st.PrepareTogether(ctx, ps, false)
		for _, err := range errs {
			require.NoError(t, err)
		}
	}
	for _, size := range []int{0, 40, 4000} {
		_, err := admin.Exec(ctx, `INSERT INTO operations (tenant_id, operation_id, operation_type, intent_ref,
				content_type, payload, payload_sha256)
			SELECT 'acme', gen_random_uuid(), 'demo.charge', 'loaded-' || gen_random_uuid(), 'application/json',
				'{}', sha256('{}')
			FROM generate_series(1, $1)`, size)
		require.NoError(t, err)
		plans.reset()
		for round := range 8 { // past the five custom plans a cached plan starts with
			prepare(8, fmt.Sprintf("size-%d-round-%d", size, round))
		}
		checks := plans.matching(`FOR KEY SHARE OF x`)
		require.NotEmpty(t, checks, "no foreign-key check was reported at %d operations", size)
		for _, p := range checks {
			require.Contains(t, p, "Index Scan using operations_pkey", "at %d operations:\n%s", size, p)
			require.NotContains(t, p, "Filter:", "at %d operations:\n%s", size, p)
		}
	}
}
