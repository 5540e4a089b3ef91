package store_test

import (
	"fmt"
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

	n, err := b.all.PurgePayloads(b.ctx, store.PurgeParams{Default: 24 * time.Hour, Limit: 10})
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
	n, err = b.all.PurgePayloads(b.ctx, store.PurgeParams{Default: 24 * time.Hour, Limit: 10})
	require.NoError(t, err)
	require.Zero(t, n)
}

// hasPayload reports whether op still has its payload bytes.
func (b *testBundle) hasPayload(t *testing.T, op store.Operation) (kept bool) {
	t.Helper()
	require.NoError(t, b.pool.QueryRow(b.ctx, `SELECT payload IS NOT NULL FROM operations WHERE operation_id = $1`, op.ID).Scan(&kept))
	return kept
}

// TestPurgePayloadsByOperationType: each operation type keeps its payloads for its own
// retention, a type without one for the default; an open operation keeps its payload
// however old.
func TestPurgePayloadsByOperationType(t *testing.T) {
	t.Parallel()
	b := setup(t)
	op := func(typ, intent string, terminal bool, age time.Duration) store.Operation {
		p := prepareParams("acme", intent, `{"amount":1}`)
		p.OperationType = typ
		op, _, err := b.all.Prepare(b.ctx, p)
		require.NoError(t, err)
		if terminal {
			b.cancel(t, op)
		}
		b.age(t, op, age)
		return op
	}
	cases := []struct {
		op     store.Operation
		purged bool
	}{
		{op("pay.charge", "charge-2h", true, 2*time.Hour), true},
		{op("pay.charge", "charge-open", false, 48*time.Hour), false},
		{op("mail.send", "send-2h", true, 2*time.Hour), false},
		{op("mail.send", "send-4h", true, 4*time.Hour), true},
		{op("old.export", "export-4h", true, 4*time.Hour), false},
		{op("old.export", "export-6h", true, 6*time.Hour), true},
	}
	p := store.PurgeParams{Retentions: map[string]time.Duration{"pay.charge": time.Hour, "mail.send": 3 * time.Hour},
		Default: 5 * time.Hour, Limit: 10}

	n, err := b.all.PurgePayloads(b.ctx, p)
	require.NoError(t, err)
	require.Equal(t, 3, n)
	for _, tc := range cases {
		require.Equal(t, !tc.purged, b.hasPayload(t, tc.op), tc.op.IntentRef)
	}

	// Without a default, the unlisted type keeps its payloads; the listed ones do not.
	old := op("old.export", "export-1y", true, 365*24*time.Hour)
	late := op("mail.send", "send-late", true, 4*time.Hour)
	p.Default = 0
	n, err = b.all.PurgePayloads(b.ctx, p)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.True(t, b.hasPayload(t, old), "no default: kept")
	require.False(t, b.hasPayload(t, late), "past its type's retention")
}

// TestPurgePayloadsLimit: one statement purges at most Limit payloads, across types.
func TestPurgePayloadsLimit(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for i, typ := range []string{"pay.charge", "mail.send", "old.export"} {
		p := prepareParams("acme", fmt.Sprint("intent-", i), `{"amount":1}`)
		p.OperationType = typ
		op, _, err := b.all.Prepare(b.ctx, p)
		require.NoError(t, err)
		b.cancel(t, op)
		b.age(t, op, 2*time.Hour)
	}
	p := store.PurgeParams{Retentions: map[string]time.Duration{"pay.charge": time.Hour, "mail.send": time.Hour},
		Default: time.Hour, Limit: 2}
	for _, want := range []int{2, 1, 0} {
		n, err := b.all.PurgePayloads(b.ctx, p)
		require.NoError(t, err)
		require.Equal(t, want, n)
	}
}

// TestPurgePayloadsRefusesANonPositiveRetention: a listed type's retention of 0 would
// purge at once (or, read as "keep", never); it is a caller's bug, and nothing is purged.
func TestPurgePayloadsRefusesANonPositiveRetention(t *testing.T) {
	t.Parallel()
	b := setup(t)
	op := prepare(t, b, "acme", "done")
	b.cancel(t, op)
	b.age(t, op, 48*time.Hour)
	_, err := b.all.PurgePayloads(b.ctx, store.PurgeParams{Retentions: map[string]time.Duration{"demo.charge": 0},
		Default: time.Hour, Limit: 10})
	require.ErrorContains(t, err, `"demo.charge" must be positive`)
	require.True(t, b.hasPayload(t, op))
}

// TestDeleteTenant: refused while an operation is open; then every operation of the
// tenant goes with its events, and no other tenant's.
func TestDeleteTenant(t *testing.T) {
	t.Parallel()
	b := setup(t)
	op := prepare(t, b, "acme", "a")
	other := prepare(t, b, "globex", "g")
	for _, o := range []store.Operation{op, other} { // a stale outcome and a target's event of each
		insertStaleOutcome(t, b.pool, o, 1)
		insertEvidence(t, b.pool, "evt_"+o.TenantID, &o)
	}

	_, err := b.all.DeleteTenant(b.ctx, "acme")
	require.ErrorIs(t, err, store.ErrTenantHasOpenOperations)
	require.Equal(t, 2, b.count(t, `SELECT count(*) FROM operations`), "nothing deleted")

	b.cancel(t, op)
	n, err := b.all.DeleteTenant(b.ctx, "acme")
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	for _, table := range []string{"operation_events", "operation_keys", "stale_outcomes", "inbound_evidence"} {
		require.Zero(t, b.count(t, `SELECT count(*) FROM `+table+` WHERE tenant_id = 'acme'`), table)
		require.NotZero(t, b.count(t, `SELECT count(*) FROM `+table+` WHERE tenant_id = 'globex'`), table)
	}
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM operations WHERE tenant_id = 'globex'`))

	n, err = b.all.DeleteTenant(b.ctx, "acme")
	require.NoError(t, err)
	require.Zero(t, n, "deleting again deletes nothing")
}
