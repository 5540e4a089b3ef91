package store_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/store"
)

func (b *testBundle) cancel(t *testing.T, op store.Operation) {
	t.Helper()
	_, err := b.all.Cancel(b.ctx, store.CancelParams{TenantID: op.TenantID, ID: op.ID, Actor: "test"})
	require.NoError(t, err)
}

func (b *testBundle) age(t *testing.T, op store.Operation, by time.Duration) {
	t.Helper()
	_, err := b.pool.Exec(b.ctx, `UPDATE operations SET updated_at = updated_at - $2::interval WHERE operation_id = $1`, op.ID, by)
	require.NoError(t, err)
}

// TestPurgePayloadsKeepsHashAndEvents: only terminal operations older than the
// retention lose their bytes; the hash and the audit trail stay.
func TestPurgePayloadsKeepsHashAndEvents(t *testing.T) {
	t.Parallel()
	b := setup(t)
	old, recent, open := prepare(t, b, "acme", "old"), prepare(t, b, "acme", "recent"), prepare(t, b, "acme", "open")
	b.cancel(t, old)
	b.cancel(t, recent)
	b.age(t, old, 48*time.Hour)
	b.age(t, open, 48*time.Hour)

	n, err := b.all.PurgePayloads(b.ctx, store.PurgeParams{Retention: 24 * time.Hour, Limit: 10})
	require.NoError(t, err)
	require.Equal(t, 1, n)
	for _, tc := range []struct {
		op     store.Operation
		purged bool
	}{{old, true}, {recent, false}, {open, false}} {
		var hasPayload bool
		var hash []byte
		var events int
		require.NoError(t, b.pool.QueryRow(b.ctx, `SELECT payload IS NOT NULL, payload_sha256,
			(SELECT count(*) FROM operation_events e WHERE e.operation_id = o.operation_id)
			FROM operations o WHERE operation_id = $1`, tc.op.ID).Scan(&hasPayload, &hash, &events))
		require.Equal(t, !tc.purged, hasPayload, tc.op.IntentRef)
		require.Equal(t, tc.op.PayloadSHA256, hash, "the hash stays")
		require.Positive(t, events, "the events stay")
	}
	n, err = b.all.PurgePayloads(b.ctx, store.PurgeParams{Retention: 24 * time.Hour, Limit: 10})
	require.NoError(t, err)
	require.Zero(t, n)
}

// TestDeleteTenant: refused while an operation is open; then every operation of the
// tenant goes with its events, and no other tenant's.
func TestDeleteTenant(t *testing.T) {
	t.Parallel()
	b := setup(t)
	op := prepare(t, b, "acme", "a")
	prepare(t, b, "globex", "g")

	_, err := b.all.DeleteTenant(b.ctx, "acme")
	require.ErrorIs(t, err, store.ErrTenantHasOpenOperations)
	require.Equal(t, 2, b.count(t, `SELECT count(*) FROM operations`), "nothing deleted")

	b.cancel(t, op)
	n, err := b.all.DeleteTenant(b.ctx, "acme")
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	require.Zero(t, b.count(t, `SELECT count(*) FROM operation_events WHERE tenant_id = 'acme'`))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM operations WHERE tenant_id = 'globex'`))

	n, err = b.all.DeleteTenant(b.ctx, "acme")
	require.NoError(t, err)
	require.Zero(t, n, "deleting again deletes nothing")
}
