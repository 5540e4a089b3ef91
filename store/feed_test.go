package store_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"golang.org/x/sync/errgroup"

	"github.com/opbroker/opbroker/store"
)

// observe appends an UNKNOWN → UNKNOWN event (a new observation) to op inside tx, as
// the reconciler does, and returns the new revision.
func observe(t *testing.T, ctx context.Context, tx pgx.Tx, op store.Operation) int64 {
	t.Helper()
	rev, err := tryObserve(ctx, tx, op)
	require.NoError(t, err)
	return rev
}

func tryObserve(ctx context.Context, tx pgx.Tx, op store.Operation) (rev int64, err error) {
	err = tx.QueryRow(ctx, `WITH rows AS (
			UPDATE operations SET revision = revision + 1, updated_at = now()
			WHERE tenant_id = $1 AND operation_id = $2 RETURNING *)
		INSERT INTO operation_events (tenant_id, operation_id, revision, from_state, to_state, fence_token, actor)
		SELECT tenant_id, operation_id, revision, state, state, fence_token, 'test' FROM rows
		RETURNING revision`, op.TenantID, op.ID).Scan(&rev)
	return rev, err
}

// beginWithXid starts a transaction that holds a transaction id from now on, as any
// transaction does from its first write.
func beginWithXid(t *testing.T, ctx context.Context, pool *pgxpool.Pool) pgx.Tx {
	t.Helper()
	tx, err := tryBeginWithXid(ctx, pool)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	return tx
}

func tryBeginWithXid(ctx context.Context, pool *pgxpool.Pool) (pgx.Tx, error) {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return nil, err
	}
	if _, err = tx.Exec(ctx, `SELECT pg_current_xact_id()`); err != nil {
		_ = tx.Rollback(ctx)
		return nil, err
	}
	return tx, nil
}

type feedChange struct {
	ID       uuid.UUID
	Revision int64
}

func changes(events []store.FeedEvent) []feedChange {
	out := make([]feedChange, len(events))
	for i, e := range events {
		out[i] = feedChange{e.ID, e.Revision}
	}
	return out
}

// readAll reads the feed from cursor until it has read every committed event. (Other
// tests' transactions hold the horizon back for moments.)
func readAll(t *testing.T, b *testBundle, p store.FeedParams, cursor store.FeedCursor) ([]store.FeedEvent, store.FeedCursor) {
	t.Helper()
	var all []store.FeedEvent
	for {
		batch, err := b.all.ReadFeed(b.ctx, p, cursor)
		require.NoError(t, err)
		all, cursor = append(all, batch.Events...), batch.Cursor
		if !batch.More && !batch.Pending {
			return all, cursor
		}
		if !batch.More {
			time.Sleep(time.Millisecond)
		}
	}
}

// TestFeedWaitsForLateCommit: an event whose transaction began first and commits last is
// not skipped. A reader of "position greater than the last seen" alone would read B's
// event, move past A's position, and never see A's event.
func TestFeedWaitsForLateCommit(t *testing.T) {
	t.Parallel()
	b := setup(t)
	x := unknownOp(t, b, "acme", "x")
	p := store.FeedParams{TenantID: "acme", Limit: 100}
	_, cursor := readAll(t, b, p, store.FeedCursor{})

	a := beginWithXid(t, b.ctx, b.pool) // A takes its transaction id first...
	y := prepare(t, b, "acme", "y")     // ...B writes and commits after it...
	revA := observe(t, b.ctx, a, x)     // ...and A writes its event after B's.

	batch, err := b.all.ReadFeed(b.ctx, p, cursor)
	require.NoError(t, err)
	require.Empty(t, batch.Events, "B's event waits while A, older, is running")
	require.True(t, batch.Pending, "the reader is told to look again soon")
	cursor = batch.Cursor

	require.NoError(t, a.Commit(b.ctx))
	got, _ := readAll(t, b, p, cursor)
	require.Equal(t, []feedChange{{x.ID, revA}, {y.ID, 1}}, changes(got))
}

func prepare(t *testing.T, b *testBundle, tenant, intent string) store.Operation {
	t.Helper()
	op, _, err := b.all.Prepare(b.ctx, prepareParams(tenant, intent, `{"amount":1}`))
	require.NoError(t, err)
	return op
}

// TestFeedKeepsAnOperationsOrder: two changes of one operation whose transaction ids are
// in the other order arrive in revision order, each once, and a resume from either
// cursor continues exactly.
func TestFeedKeepsAnOperationsOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	x := unknownOp(t, b, "acme", "x")
	p := store.FeedParams{TenantID: "acme", Limit: 100}
	_, start := readAll(t, b, p, store.FeedCursor{})

	a := beginWithXid(t, b.ctx, b.pool) // the smaller transaction id...
	second := beginWithXid(t, b.ctx, b.pool)
	rev1 := observe(t, b.ctx, second, x) // ...writes the later revision
	require.NoError(t, second.Commit(b.ctx))
	rev2 := observe(t, b.ctx, a, x)
	require.NoError(t, a.Commit(b.ctx))
	require.Equal(t, rev1+1, rev2)

	got, end := readAll(t, b, p, start)
	require.Equal(t, []feedChange{{x.ID, rev1}, {x.ID, rev2}}, changes(got))
	require.Len(t, got[0].Cursor.Ahead, 1, "the earlier revision was read ahead of its place")
	require.Equal(t, rev2, got[1].Operation.Revision)

	resumed, _ := readAll(t, b, p, got[0].Cursor)
	require.Equal(t, []feedChange{{x.ID, rev2}}, changes(resumed), "resuming after the first change")
	resumed, _ = readAll(t, b, p, got[1].Cursor)
	require.Empty(t, resumed, "the change read ahead is not sent again")
	require.Empty(t, end.Ahead, "the cursor forgets what it has passed")
}

// TestFeedFiltersByState: only changes into the chosen states, in order.
func TestFeedFiltersByState(t *testing.T) {
	t.Parallel()
	b := setup(t)
	x := unknownOp(t, b, "acme", "x")
	_ = prepare(t, b, "other", "o")
	got, _ := readAll(t, b, store.FeedParams{TenantID: "acme", States: []store.State{store.StateUnknown}, Limit: 1}, store.FeedCursor{})
	require.Equal(t, []feedChange{{x.ID, 3}}, changes(got), "PREPARED and IN_FLIGHT are left out")
	require.Equal(t, store.StateUnknown, got[0].Operation.State)
	require.NotEmpty(t, got[0].Operation.IntentRef, "the operation's fields come with the change")
}

// TestFeedConcurrentWriters: writers that take their transaction ids in one order,
// change operations in another and commit in a third, while a reader follows the feed.
// The reader gets every event of the tenant exactly once, each operation's in revision
// order; a resume from any cursor it was given continues exactly where it was.
func TestFeedConcurrentWriters(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ops := make([]store.Operation, 4)
	for i := range ops {
		ops[i] = unknownOp(t, b, "acme", fmt.Sprint("op-", i))
	}
	p := store.FeedParams{TenantID: "acme", Limit: 7}
	_, start := readAll(t, b, p, store.FeedCursor{})

	var writers errgroup.Group
	for w := range 6 {
		writers.Go(func() error {
			rng := rand.New(rand.NewPCG(uint64(w), 1))
			for range 25 {
				tx, err := tryBeginWithXid(b.ctx, b.pool)
				if err != nil {
					return err
				}
				time.Sleep(time.Duration(rng.IntN(3000)) * time.Microsecond)
				if _, err := tryObserve(b.ctx, tx, ops[rng.IntN(len(ops))]); err != nil {
					return err
				}
				time.Sleep(time.Duration(rng.IntN(3000)) * time.Microsecond)
				if err := tx.Commit(b.ctx); err != nil {
					return err
				}
			}
			return nil
		})
	}
	done := make(chan error)
	go func() { done <- writers.Wait() }()
	var got []store.FeedEvent
	cursor := start
	for finished := false; !finished; {
		select {
		case err := <-done:
			require.NoError(t, err)
			finished = true
		default:
		}
		var events []store.FeedEvent
		events, cursor = readAll(t, b, p, cursor)
		got = append(got, events...)
	}

	var want []feedChange
	rows, _ := b.pool.Query(b.ctx, `SELECT operation_id, revision FROM operation_events
		WHERE tenant_id = 'acme' AND (xact_id, seq) > ($1::bigint::text::xid8, $2)
		ORDER BY operation_id, revision`, start.After.Xact, start.After.Seq)
	want, err := pgx.CollectRows(rows, pgx.RowToStructByPos[feedChange])
	require.NoError(t, err)
	require.Len(t, want, 150)

	requireEachOnceInOrder(t, want, changes(got))
	for i := 0; i < len(got); i += 11 {
		rest, _ := readAll(t, b, p, got[i].Cursor)
		require.Equal(t, changes(got[i+1:]), changes(rest), "resuming after event %d", i)
	}
}

// requireEachOnceInOrder: got holds every change of want once, and each operation's
// changes in revision order.
func requireEachOnceInOrder(t *testing.T, want, got []feedChange) {
	t.Helper()
	seen := map[feedChange]bool{}
	last := map[uuid.UUID]int64{}
	for _, c := range got {
		require.False(t, seen[c], "%v delivered twice", c)
		seen[c] = true
		require.Greater(t, c.Revision, last[c.ID], "%v out of order", c)
		last[c.ID] = c.Revision
	}
	for _, c := range want {
		require.True(t, seen[c], "%v never delivered", c)
	}
}
