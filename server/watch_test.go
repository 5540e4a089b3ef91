package server_test

import (
	"errors"
	"io"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"

	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/server"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/storetest"
)

// drive moves a prepared operation through IN_FLIGHT to UNKNOWN and then SUCCEEDED, as
// the dispatcher and the reconciler would, with st (this process's store or another
// replica's).
func drive(t *testing.T, b *testBundle, st *store.Store, id uuid.UUID) {
	t.Helper()
	op, err := st.AllTenants().Get(b.ctx, "acme", id)
	require.NoError(t, err)
	storetest.ToUnknown(t, st, op)
	storetest.ResolveUnknown(t, st, op, store.ResolveParams{State: store.StateSucceeded, RemoteRef: "ch_1",
		Observation: store.Observation{Source: "LOOKUP", Outcome: "FOUND"}, Actor: "r"})
}

// historyGap deletes the event of revision of the operation id, which no statement of
// the broker can (an operation's history goes only with it): as a superuser repairing
// the ledger could, with the guards set aside.
func historyGap(t *testing.T, b *testBundle, id uuid.UUID, revision int) {
	t.Helper()
	tag := storetest.ExecAsideGuards(t, b.pool, `DELETE FROM operation_events WHERE operation_id = $1 AND revision = $2`, id, revision)
	require.EqualValues(t, 1, tag.RowsAffected())
}

// collect reads a watch stream to its end, skipping heartbeats.
func collect(t *testing.T, stream opbrokerv1.OperationService_WatchOperationClient) ([]*opbrokerv1.WatchOperationResponse, error) {
	t.Helper()
	var got []*opbrokerv1.WatchOperationResponse
	for {
		msg, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return got, nil
		}
		if err != nil {
			return got, err
		}
		if msg.GetHeartbeat() == nil {
			got = append(got, msg)
		}
	}
}

func states(msgs []*opbrokerv1.WatchOperationResponse) []string {
	var out []string
	for _, m := range msgs {
		op := m.GetSnapshot()
		kind := "snapshot"
		if op == nil {
			op, kind = m.GetChange(), "change"
		}
		out = append(out, kind+":"+op.GetState().String())
	}
	return out
}

func TestWatchFollowsToTheEnd(t *testing.T) {
	t.Parallel()
	for name, otherReplica := range map[string]bool{"changes here": false, "changes at another replica": true} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			resp, err := b.client.PrepareOperation(b.ctx, prepareRequest("acme", "w-1", `{"amount":1}`))
			require.NoError(t, err)
			stream, err := b.client.WatchOperation(b.ctx, &opbrokerv1.WatchOperationRequest{Name: resp.GetOperation().GetName()})
			require.NoError(t, err)
			first, err := stream.Recv()
			require.NoError(t, err)
			require.Equal(t, opbrokerv1.Operation_STATE_PREPARED, first.GetSnapshot().GetState())

			st := b.store
			if otherReplica { // another Store on the same database: no in-process wake-up
				st = store.New(b.pool)
			}
			id := uuid.MustParse(resp.GetOperation().GetName()[len("tenants/acme/operations/"):])
			drive(t, b, st, id)

			rest, err := collect(t, stream)
			require.NoError(t, err, "the stream ends with OK after a terminal state")
			require.Equal(t, []string{"change:STATE_IN_FLIGHT", "change:STATE_UNKNOWN", "change:STATE_SUCCEEDED"}, states(rest))
			var revs []int64
			for _, m := range rest {
				revs = append(revs, m.GetChange().GetRevision())
			}
			for i := range revs {
				require.Equal(t, int64(i+2), revs[i], "every change, in order, none lost or repeated")
			}
			last := rest[len(rest)-1].GetChange()
			require.Equal(t, "ch_1", last.GetRemoteRef())
			require.Equal(t, "FOUND", last.GetLastObservation().GetOutcome())
		})
	}
}

// TestWatchResumesAtEveryRevision: resuming after any revision of a history replays
// exactly what followed.
func TestWatchResumesAtEveryRevision(t *testing.T) {
	t.Parallel()
	b := setup(t)
	resp, err := b.client.PrepareOperation(b.ctx, prepareRequest("acme", "w-2", `{"amount":1}`))
	require.NoError(t, err)
	name := resp.GetOperation().GetName()
	drive(t, b, b.store, uuid.MustParse(name[len("tenants/acme/operations/"):]))
	final, err := b.client.GetOperation(b.ctx, &opbrokerv1.GetOperationRequest{Name: name})
	require.NoError(t, err)
	total := final.GetOperation().GetRevision()

	for after := int64(1); after < total; after++ {
		stream, err := b.client.WatchOperation(b.ctx, &opbrokerv1.WatchOperationRequest{Name: name, StartAfterRevision: after})
		require.NoError(t, err)
		msgs, err := collect(t, stream)
		require.NoError(t, err)
		require.Len(t, msgs, int(total-after), "after revision %d", after)
		for i, m := range msgs {
			require.Equal(t, after+int64(i)+1, m.GetChange().GetRevision())
		}
	}
	stream, err := b.client.WatchOperation(b.ctx, &opbrokerv1.WatchOperationRequest{Name: name, StartAfterRevision: total})
	require.NoError(t, err)
	first, err := stream.Recv()
	require.NoError(t, err)
	require.Equal(t, total, first.GetHeartbeat().GetRevision(), "at the current revision: a heartbeat, nothing repeated")
	msgs, err := collect(t, stream)
	require.NoError(t, err)
	require.Empty(t, states(msgs), "then the end: the operation is terminal")
}

// TestWatchResumedAtTheCurrentRevisionRepeatsNothing: a client that resumes after the
// revision it last saw, when that is the current one, receives a heartbeat with it and
// then the changes that follow, never that revision again.
func TestWatchResumedAtTheCurrentRevisionRepeatsNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	resp, err := b.client.PrepareOperation(b.ctx, prepareRequest("acme", "w-6", `{}`))
	require.NoError(t, err)
	name := resp.GetOperation().GetName()
	stream, err := b.client.WatchOperation(b.ctx, &opbrokerv1.WatchOperationRequest{Name: name, StartAfterRevision: 1})
	require.NoError(t, err)
	first, err := stream.Recv()
	require.NoError(t, err)
	require.NotNil(t, first.GetHeartbeat(), "not revision 1 again: %v", first)
	require.Equal(t, int64(1), first.GetHeartbeat().GetRevision())

	_, err = b.client.CancelOperation(b.ctx, &opbrokerv1.CancelOperationRequest{Name: name})
	require.NoError(t, err)
	rest, err := collect(t, stream)
	require.NoError(t, err)
	require.Equal(t, []string{"change:STATE_CANCELLED"}, states(rest), "then live changes")
	require.Equal(t, int64(2), rest[0].GetChange().GetRevision())
}

func TestWatchHeartbeatsWhileIdle(t *testing.T) {
	t.Parallel()
	b := setup(t)
	resp, err := b.client.PrepareOperation(b.ctx, prepareRequest("acme", "w-3", `{}`))
	require.NoError(t, err)
	stream, err := b.client.WatchOperation(b.ctx, &opbrokerv1.WatchOperationRequest{Name: resp.GetOperation().GetName()})
	require.NoError(t, err)
	_, err = stream.Recv()
	require.NoError(t, err)
	msg, err := stream.Recv()
	require.NoError(t, err)
	require.Equal(t, int64(1), msg.GetHeartbeat().GetRevision())
}

func TestWatchErrors(t *testing.T) {
	t.Parallel()
	b := setup(t)
	resp, err := b.client.PrepareOperation(b.ctx, prepareRequest("acme", "w-4", `{}`))
	require.NoError(t, err)
	name := resp.GetOperation().GetName()
	id := uuid.MustParse(name[len("tenants/acme/operations/"):])
	drive(t, b, b.store, id)

	other := "tenants/globex/operations/" + id.String()
	stream, err := b.client.WatchOperation(b.ctx, &opbrokerv1.WatchOperationRequest{Name: other})
	require.NoError(t, err)
	_, err = stream.Recv()
	requireStatus(t, err, codes.NotFound, server.ReasonOperationNotFound)

	historyGap(t, b, id, 2)
	stream, err = b.client.WatchOperation(b.ctx, &opbrokerv1.WatchOperationRequest{Name: name, StartAfterRevision: 1})
	require.NoError(t, err)
	_, err = collect(t, stream)
	st := requireStatus(t, err, codes.OutOfRange, server.ReasonRevisionTooOld)
	require.Contains(t, st.Message(), "GetOperation")
}

func TestWatchEndsUnavailableOnShutdown(t *testing.T) {
	t.Parallel()
	b := setup(t)
	resp, err := b.client.PrepareOperation(b.ctx, prepareRequest("acme", "w-5", `{}`))
	require.NoError(t, err)
	stream, err := b.client.WatchOperation(b.ctx, &opbrokerv1.WatchOperationRequest{Name: resp.GetOperation().GetName()})
	require.NoError(t, err)
	_, err = stream.Recv()
	require.NoError(t, err)
	go b.srv.Stop(5 * time.Second)
	_, err = collect(t, stream)
	st := requireStatus(t, err, codes.Unavailable, server.ReasonShuttingDown)
	require.Contains(t, st.Message(), "start_after_revision 1")
}

// TestWatchPastTheCurrentRevision: a revision the operation has not reached is refused
// with OUT_OF_RANGE naming the current revision, never answered with a snapshot.
func TestWatchPastTheCurrentRevision(t *testing.T) {
	t.Parallel()
	b := setup(t)
	resp, err := b.client.PrepareOperation(b.ctx, prepareRequest("acme", "w-7", `{}`))
	require.NoError(t, err)
	name := resp.GetOperation().GetName()
	_, err = b.client.CancelOperation(b.ctx, &opbrokerv1.CancelOperationRequest{Name: name})
	require.NoError(t, err) // revision 2

	stream, err := b.client.WatchOperation(b.ctx, &opbrokerv1.WatchOperationRequest{Name: name, StartAfterRevision: 3})
	require.NoError(t, err)
	msgs, err := collect(t, stream)
	require.Empty(t, msgs, "nothing is sent")
	st := requireStatus(t, err, codes.OutOfRange, server.ReasonRevisionNotReached)
	require.Equal(t, map[string]string{"revision": "3", "currentRevision": "2"}, errorInfo(st).GetMetadata())
	require.Equal(t, "the operation is at revision 2 and has not reached revision 3; watch from its current revision, or from 0 for its current state",
		st.Message())
}
