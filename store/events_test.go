package store_test

import (
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/store"
)

func TestEventsReplayTheOperation(t *testing.T) {
	t.Parallel()
	b := setup(t)
	op := unknownOp(t, b, "acme", "e-1") // PREPARED, IN_FLIGHT, UNKNOWN
	claimed, err := b.all.ClaimUnknown(b.ctx, unknownParams())
	require.NoError(t, err)
	done, err := b.all.ResolveUnknown(b.ctx, store.ResolveParams{TenantID: "acme", ID: op.ID, Fence: claimed[0].FenceToken,
		State: store.StateSucceeded, RemoteRef: "ch_7", Observation: store.Observation{Source: "LOOKUP", Outcome: "FOUND"}, Actor: "rec"})
	require.NoError(t, err)

	events, err := b.all.Events(b.ctx, "acme", op.ID, 0, 100)
	require.NoError(t, err)
	var states []store.State
	for i, e := range events {
		require.Equal(t, int64(i+1), e.Revision)
		states = append(states, e.State)
	}
	require.Equal(t, []store.State{store.StatePrepared, store.StateInFlight, store.StateUnknown, store.StateSucceeded}, states)
	last := events[len(events)-1]
	require.Equal(t, "ch_7", last.RemoteRef)
	require.Equal(t, int32(1), last.AttemptCount)
	require.Equal(t, int32(1), events[1].AttemptCount, "the claim's event counts its attempt")
	require.Empty(t, events[1].RemoteRef)

	rebuilt := last.Apply(op)
	require.Equal(t, done.State, rebuilt.State)
	require.Equal(t, done.Revision, rebuilt.Revision)
	require.Equal(t, done.RemoteRef, rebuilt.RemoteRef)

	after, err := b.all.Events(b.ctx, "acme", op.ID, 3, 100)
	require.NoError(t, err)
	require.Len(t, after, 1)
	none, err := b.all.Events(b.ctx, "globex", op.ID, 0, 100)
	require.NoError(t, err)
	require.Empty(t, none, "events are scoped by tenant")

	revs, err := b.all.Revisions(b.ctx, []store.OperationKey{{TenantID: "acme", ID: op.ID}, {TenantID: "acme", ID: uuid.New()}, {TenantID: "globex", ID: op.ID}})
	require.NoError(t, err)
	require.Equal(t, map[store.OperationKey]int64{{TenantID: "acme", ID: op.ID}: done.Revision}, revs)
}
