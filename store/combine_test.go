package store_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/store"
)

// TestConcurrentPreparesShareStatements: intents prepared at the same time by four
// tenants' callers, each in its own tenant's scope, are written by fewer statements
// than there are intents (each statement is one transaction, so its events share a
// transaction id), and each caller still gets its own operation in its own tenant.
func TestConcurrentPreparesShareStatements(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const callers = 64
	ids := make([]uuid.UUID, callers)
	errs := make([]error, callers)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range callers {
		tenant := fmt.Sprint("tenant-", i%4)
		wg.Go(func() {
			<-start
			op, created, err := b.store.Tenant(tenant).Prepare(b.ctx,
				prepareParams(tenant, fmt.Sprint("order-", i), fmt.Sprintf(`{"n":%d}`, i)))
			ids[i], errs[i] = op.ID, err
			if err == nil && !created {
				errs[i] = fmt.Errorf("intent %d: not created", i)
			}
		})
	}
	close(start)
	wg.Wait()
	for i := range callers {
		require.NoError(t, errs[i])
		got, err := b.all.Get(b.ctx, fmt.Sprint("tenant-", i%4), ids[i])
		require.NoError(t, err)
		require.Equal(t, fmt.Sprint("order-", i), got.IntentRef, "each caller gets its own operation")
	}
	require.Equal(t, callers, b.count(t, `SELECT count(*) FROM operation_events`))
	statements := b.count(t, `SELECT count(DISTINCT xact_id) FROM operation_events`)
	require.Less(t, statements, callers/2, "concurrent intents share statements")
	require.Less(t, statements, b.count(t, `SELECT count(DISTINCT (xact_id, tenant_id)) FROM operation_events`),
		"statements span tenants")
	t.Logf("%d intents in %d statements", callers, statements)
}

// TestPrepareRefusesAnIntentOutsideItsScope: a caller in one tenant's scope cannot
// prepare another tenant's intent, even while that tenant's own calls are being
// written (alone, row-level security refuses it; combined with them, it would not).
func TestPrepareRefusesAnIntentOutsideItsScope(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var wg sync.WaitGroup
	for i := range 20 {
		wg.Go(func() {
			_, _, err := b.store.Tenant("globex").Prepare(b.ctx, prepareParams("globex", fmt.Sprint("own-", i), `{}`))
			assert.NoError(t, err) // not require: this is not the test's goroutine
		})
	}
	_, _, err := b.store.Tenant("acme").Prepare(b.ctx, prepareParams("globex", "smuggled", `{}`))
	wg.Wait()
	require.ErrorContains(t, err, `an intent of tenant "globex" in the scope of tenant "acme"`)
	require.Zero(t, b.count(t, `SELECT count(*) FROM operations WHERE intent_ref = 'smuggled'`))
	_, _, err = b.store.Tenant("acme,globex").Prepare(b.ctx, prepareParams("globex", "listed", `{}`))
	require.ErrorIs(t, err, store.ErrNoScope, "a caller's scope is one tenant")
}

// TestPrepareTogetherAnswersEach: a combined statement holding a repeat of an intent
// in the same batch, an intent already recorded, intents of two tenants in their own
// scopes, an unknown superseded operation and a tenant id the schema refuses still
// answers each intent as it would alone, and records only what it should.
func TestPrepareTogetherAnswersEach(t *testing.T) {
	t.Parallel()
	b := setup(t)
	existing, _, err := b.all.Prepare(b.ctx, prepareParams("acme", "old", `{"n":0}`))
	require.NoError(t, err)

	orphan := prepareParams("acme", "amend", `{"n":3}`)
	orphan.SupersedesID = uuid.NullUUID{UUID: uuid.Must(uuid.NewV7()), Valid: true}
	badTenant := prepareParams("Not_A_Tenant", "x", `{}`)
	clean := []store.PrepareParams{
		prepareParams("acme", "new-1", `{"n":1}`),
		prepareParams("acme", "new-1", `{"n":1}`), // the same intent twice in one batch
		prepareParams("acme", "old", `{"n":0}`),   // already recorded
		prepareParams("globex", "new-2", `{"n":2}`),
	}
	ops, created, errs := b.store.PrepareTogether(b.ctx, clean, false)
	for i := range clean {
		require.NoError(t, errs[i], "call %d", i)
	}
	require.Equal(t, []bool{true, false, false, true}, created)
	require.Equal(t, "new-1", ops[0].IntentRef)
	require.Equal(t, "new-2", ops[3].IntentRef)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM operations WHERE intent_ref = 'new-1'`))

	mixed := []store.PrepareParams{prepareParams("acme", "new-3", `{"n":3}`), orphan, badTenant, prepareParams("acme", "new-4", `{"n":4}`)}
	ops, created, errs = b.store.PrepareTogether(b.ctx, mixed, true)
	require.NoError(t, errs[0])
	require.ErrorIs(t, errs[1], store.ErrSupersededNotFound)
	require.ErrorContains(t, errs[2], "operations_tenant_id_format")
	require.NoError(t, errs[3])
	require.Equal(t, []bool{true, false, false, true}, created)
	require.Equal(t, "new-4", ops[3].IntentRef)

	require.Equal(t, 5, b.count(t, `SELECT count(*) FROM operations`), "old, new-1, new-2, new-3 and new-4")
	require.Equal(t, b.count(t, `SELECT count(*) FROM operations`), b.count(t, `SELECT count(*) FROM operation_events`),
		"one creation event per operation, none for what was refused")
	again, err := b.all.Get(b.ctx, "acme", existing.ID)
	require.NoError(t, err)
	require.Equal(t, existing, again)
}

// stalledDuplicate begins a transaction that inserts acme's intent intentRef and does
// not finish: it is rolled back at the end of the test, if not before.
func (b *testBundle) stalledDuplicate(t *testing.T, intentRef string) pgx.Tx {
	t.Helper()
	stalled, err := b.pool.Begin(b.ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = stalled.Rollback(context.Background()) })
	_, err = stalled.Exec(b.ctx, `SELECT set_config('opbroker.tenant', '*', true)`)
	require.NoError(t, err)
	_, err = stalled.Exec(b.ctx, `INSERT INTO operations (tenant_id, operation_id, operation_type, intent_ref, content_type, payload, payload_sha256)
		VALUES ('acme', gen_random_uuid(), 'demo.charge', $1, 'application/json', '{}', sha256('{}'))`, intentRef)
	require.NoError(t, err)
	return stalled
}

// TestCombinedPrepareDoesNotWaitOnAStalledDuplicate: an intent whose duplicate is being
// written by a transaction that does not finish holds up only itself: the intents
// combined with it are recorded within the combined statement's lock wait, and it is
// recorded as soon as the other transaction ends.
func TestCombinedPrepareDoesNotWaitOnAStalledDuplicate(t *testing.T) {
	t.Parallel()
	b := setup(t)
	stalled := b.stalledDuplicate(t, "contended")

	type answer struct {
		created []bool
		errs    []error
	}
	done := make(chan answer, 1)
	go func() {
		_, created, errs := b.store.PrepareTogether(b.ctx, []store.PrepareParams{
			prepareParams("acme", "contended", `{}`), prepareParams("acme", "free-1", `{}`), prepareParams("globex", "free-2", `{}`)}, true)
		done <- answer{created, errs}
	}()
	require.Eventually(t, func() bool {
		return b.count(t, `SELECT count(*) FROM operations WHERE intent_ref IN ('free-1', 'free-2')`) == 2
	}, 10*time.Second, 20*time.Millisecond, "the others are recorded while the duplicate's writer stalls")
	select {
	case <-done:
		t.Fatal("the contended intent did not wait for the other transaction")
	default:
	}
	require.NoError(t, stalled.Rollback(b.ctx))
	got := <-done
	require.Equal(t, []bool{true, true, true}, got.created, "the other transaction rolled back: the intent is new")
	for _, err := range got.errs {
		require.NoError(t, err)
	}
}

// TestStalledDuplicatesDoNotHoldUpOtherPrepares: callers of an intent whose duplicate a
// transaction that does not finish is writing wait for it off the combiner's writers:
// two of them, each in a batch of its own (which took both of the lane's writers and
// held them until the transaction ended), leave another tenant's Prepare to be recorded
// at once, and are recorded themselves as soon as that transaction ends.
func TestStalledDuplicatesDoNotHoldUpOtherPrepares(t *testing.T) {
	t.Parallel()
	b := setup(t)
	stalled := b.stalledDuplicate(t, "contended")

	acme := b.store.Tenant("acme")
	contended := make(chan error, 2)
	for range 2 {
		go func() {
			_, _, err := acme.Prepare(b.ctx, prepareParams("acme", "contended", `{}`))
			contended <- err
		}()
		time.Sleep(50 * time.Millisecond) // a batch of its own
	}
	time.Sleep(2 * store.CombinedLockWait) // both past the combined statement's lock wait

	start := time.Now()
	ctx, cancel := context.WithTimeout(b.ctx, 10*time.Second)
	defer cancel()
	_, created, err := b.store.Tenant("globex").Prepare(ctx, prepareParams("globex", "free", `{}`))
	require.NoError(t, err, "another tenant's Prepare waited for the stalled duplicate")
	require.True(t, created)
	require.Less(t, time.Since(start), 2*store.CombinedLockWait)
	require.Empty(t, contended, "the duplicates wait for the other transaction")

	require.NoError(t, stalled.Rollback(b.ctx))
	for range 2 {
		require.NoError(t, <-contended)
	}
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM operations WHERE intent_ref = 'contended'`))
}

// TestAnIntentRecordedAloneWaitsBoundedly: an intent whose duplicate's writer stalls,
// prepared by a caller with no deadline of its own, is given up after a bound (as a
// combined statement is), so that such callers cannot hold the pool's connections for
// good. Not parallel: it sets the bound for the package.
func TestAnIntentRecordedAloneWaitsBoundedly(t *testing.T) {
	b := setup(t)
	store.SetAloneTimeout(t, 500*time.Millisecond)
	b.stalledDuplicate(t, "contended")
	done := make(chan error, 1)
	start := time.Now()
	go func() {
		_, _, err := b.store.Tenant("acme").Prepare(context.Background(), prepareParams("acme", "contended", `{}`))
		done <- err
	}()
	select {
	case err := <-done:
		require.Error(t, err)
		require.Less(t, time.Since(start), store.CombinedLockWait+5*time.Second)
	case <-time.After(store.CombinedLockWait + 10*time.Second):
		t.Fatal("the intent recorded alone waited for the stalled writer with no bound")
	}
}
