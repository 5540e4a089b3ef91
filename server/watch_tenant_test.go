package server_test

import (
	"context"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/metric/noop"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/server"
	"github.com/opbroker/opbroker/store"
)

// tenantStream is a WatchOperations stream with the token of the last message received.
type tenantStream struct {
	opbrokerv1.OperationService_WatchOperationsClient
	token string
}

// watchTenant opens a tenant-wide watch and reads its first message, a heartbeat.
func watchTenant(t *testing.T, ctx context.Context, b *testBundle, req *opbrokerv1.WatchOperationsRequest) *tenantStream {
	t.Helper()
	stream, err := b.client.WatchOperations(ctx, req)
	require.NoError(t, err)
	first, err := stream.Recv()
	require.NoError(t, err)
	require.NotNil(t, first.GetHeartbeat(), "a stream starts with its position")
	require.NotEmpty(t, first.GetResumeToken())
	return &tenantStream{stream, first.GetResumeToken()}
}

// change is one message of a tenant-wide stream.
type change struct {
	Name     string
	Revision int64
	State    opbrokerv1.Operation_State
	Token    string
}

// next reads n changes, skipping heartbeats.
func (s *tenantStream) next(t *testing.T, n int) []change {
	t.Helper()
	var out []change
	for len(out) < n {
		msg, err := s.Recv()
		require.NoError(t, err, "after %d of %d changes", len(out), n)
		s.token = msg.GetResumeToken()
		if op := msg.GetChange(); op != nil {
			out = append(out, change{op.GetName(), op.GetRevision(), op.GetState(), msg.GetResumeToken()})
		}
	}
	return out
}

// quiet asserts that no change arrives for a while (heartbeats do).
func (s *tenantStream) quiet(t *testing.T, cancel context.CancelFunc) {
	t.Helper()
	timer := time.AfterFunc(500*time.Millisecond, cancel)
	defer timer.Stop()
	for {
		msg, err := s.Recv()
		if err != nil {
			require.Equal(t, codes.Canceled, status.Code(err), "%v", err)
			return
		}
		require.Nil(t, msg.GetChange(), "nothing more: %v", msg.GetChange().GetName())
	}
}

func withoutTokens(cs []change) []change {
	out := make([]change, len(cs))
	for i, c := range cs {
		c.Token = ""
		out[i] = c
	}
	return out
}

func TestWatchOperationsFollowsItsTenant(t *testing.T) {
	t.Parallel()
	b := setup(t)
	stream := watchTenant(t, b.ctx, b, &opbrokerv1.WatchOperationsRequest{Tenant: "acme"})

	resp, err := b.client.PrepareOperation(b.ctx, prepareRequest("acme", "t-1", `{}`))
	require.NoError(t, err)
	name := resp.GetOperation().GetName()
	replica := store.New(b.pool) // changes at another replica: no in-process wake-up
	drive(t, b, replica, uuid.MustParse(name[len("tenants/acme/operations/"):]))
	_, err = b.client.PrepareOperation(b.ctx, prepareRequest("globex", "not-mine", `{}`))
	require.NoError(t, err)

	got := stream.next(t, 4)
	require.Equal(t, []change{
		{name, 1, opbrokerv1.Operation_STATE_PREPARED, ""},
		{name, 2, opbrokerv1.Operation_STATE_IN_FLIGHT, ""},
		{name, 3, opbrokerv1.Operation_STATE_UNKNOWN, ""},
		{name, 4, opbrokerv1.Operation_STATE_SUCCEEDED, ""},
	}, withoutTokens(got), "every change of the tenant's operation, in order, and nothing of another tenant")
}

// TestWatchOperationsResumesAtEveryMessage: resuming with the token of any message of a
// history replays exactly what followed it.
func TestWatchOperationsResumesAtEveryMessage(t *testing.T) {
	t.Parallel()
	b := setup(t)
	stream := watchTenant(t, b.ctx, b, &opbrokerv1.WatchOperationsRequest{Tenant: "acme"})
	start := stream.token
	for i := range 3 {
		resp, err := b.client.PrepareOperation(b.ctx, prepareRequest("acme", fmt.Sprint("r-", i), `{}`))
		require.NoError(t, err)
		switch i {
		case 0:
			drive(t, b, b.store, uuid.MustParse(resp.GetOperation().GetName()[len("tenants/acme/operations/"):]))
		case 2:
			_, err = b.client.CancelOperation(b.ctx, &opbrokerv1.CancelOperationRequest{Name: resp.GetOperation().GetName()})
			require.NoError(t, err)
		}
	}
	history := stream.next(t, 7)

	tokens := append([]string{start}, make([]string, len(history))...)
	for i, c := range history {
		tokens[i+1] = c.Token
	}
	for i, token := range tokens {
		ctx, cancel := context.WithCancel(b.ctx)
		resumed := watchTenant(t, ctx, b, &opbrokerv1.WatchOperationsRequest{Tenant: "acme", ResumeToken: token})
		require.Equal(t, withoutTokens(history[i:]), withoutTokens(resumed.next(t, len(history)-i)), "resuming after message %d", i)
		resumed.quiet(t, cancel)
	}
}

func TestWatchOperationsFiltersByState(t *testing.T) {
	t.Parallel()
	b := setup(t)
	stream := watchTenant(t, b.ctx, b, &opbrokerv1.WatchOperationsRequest{Tenant: "acme",
		States: []opbrokerv1.Operation_State{opbrokerv1.Operation_STATE_SUCCEEDED, opbrokerv1.Operation_STATE_CANCELLED}})
	first, err := b.client.PrepareOperation(b.ctx, prepareRequest("acme", "f-1", `{}`))
	require.NoError(t, err)
	drive(t, b, b.store, uuid.MustParse(first.GetOperation().GetName()[len("tenants/acme/operations/"):]))
	second, err := b.client.PrepareOperation(b.ctx, prepareRequest("acme", "f-2", `{}`))
	require.NoError(t, err)
	_, err = b.client.CancelOperation(b.ctx, &opbrokerv1.CancelOperationRequest{Name: second.GetOperation().GetName()})
	require.NoError(t, err)

	require.Equal(t, []change{
		{first.GetOperation().GetName(), 4, opbrokerv1.Operation_STATE_SUCCEEDED, ""},
		{second.GetOperation().GetName(), 2, opbrokerv1.Operation_STATE_CANCELLED, ""},
	}, withoutTokens(stream.next(t, 2)))
}

// TestWatchOperationsConcurrentWriters: many writers at two replicas change a tenant's
// operations at once; one watcher receives every change exactly once, each operation's
// in revision order, and so does a watcher that resumes half way.
func TestWatchOperationsConcurrentWriters(t *testing.T) {
	t.Parallel()
	b := setup(t)
	stream := watchTenant(t, b.ctx, b, &opbrokerv1.WatchOperationsRequest{Tenant: "acme"})
	// Another replica: a server with its own Store on the same database, whose changes
	// reach this one through the database only.
	replica := opbrokerv1.NewOperationServiceClient(serve(t, server.Options{Store: store.New(b.pool), Targets: demoTargets(t),
		Logger: slog.New(slog.DiscardHandler), MeterProvider: noop.NewMeterProvider()}))

	const writers, perWriter = 8, 12
	var g errgroup.Group
	for w := range writers {
		client := b.client
		if w%2 == 1 {
			client = replica
		}
		g.Go(func() error {
			for i := range perWriter {
				resp, err := client.PrepareOperation(b.ctx, prepareRequest("acme", fmt.Sprintf("c-%d-%d", w, i), `{}`))
				if err != nil {
					return err
				}
				if _, err := client.CancelOperation(b.ctx, &opbrokerv1.CancelOperationRequest{Name: resp.GetOperation().GetName()}); err != nil {
					return err
				}
			}
			return nil
		})
	}
	require.NoError(t, g.Wait())

	const total = 2 * writers * perWriter
	got := stream.next(t, total)
	requireEachOnceInRevisionOrder(t, got, total)
	ctx, cancel := context.WithCancel(b.ctx)
	resumed := watchTenant(t, ctx, b, &opbrokerv1.WatchOperationsRequest{Tenant: "acme", ResumeToken: got[total/2-1].Token})
	require.Equal(t, withoutTokens(got[total/2:]), withoutTokens(resumed.next(t, total/2)))
	resumed.quiet(t, cancel)
}

func requireEachOnceInRevisionOrder(t *testing.T, got []change, total int) {
	t.Helper()
	last := map[string]int64{}
	for _, c := range got {
		require.Equal(t, last[c.Name]+1, c.Revision, "%s: each change once, in order", c.Name)
		last[c.Name] = c.Revision
	}
	require.Len(t, last, total/2)
}

func TestWatchOperationsErrors(t *testing.T) {
	t.Parallel()
	b := setup(t)
	acme := watchTenant(t, b.ctx, b, &opbrokerv1.WatchOperationsRequest{Tenant: "acme"})

	for name, tc := range map[string]struct {
		req    *opbrokerv1.WatchOperationsRequest
		reason string
	}{
		"another tenant's token": {&opbrokerv1.WatchOperationsRequest{Tenant: "globex", ResumeToken: acme.token}, "RESUME_TOKEN_MISMATCH"},
		"another filter's token": {&opbrokerv1.WatchOperationsRequest{Tenant: "acme", ResumeToken: acme.token,
			States: []opbrokerv1.Operation_State{opbrokerv1.Operation_STATE_UNKNOWN}}, "RESUME_TOKEN_MISMATCH"},
		"not a token": {&opbrokerv1.WatchOperationsRequest{Tenant: "acme", ResumeToken: "bm90IGEgdG9rZW4"}, "RESUME_TOKEN_INVALID"},
	} {
		t.Run(name, func(t *testing.T) {
			stream, err := b.client.WatchOperations(b.ctx, tc.req)
			require.NoError(t, err)
			_, err = stream.Recv()
			st := requireStatus(t, err, codes.InvalidArgument, tc.reason)
			require.Equal(t, map[string]string{"resume_token": tc.reason}, fieldViolations(st))
		})
	}

	stream, err := b.client.WatchOperations(b.ctx, &opbrokerv1.WatchOperationsRequest{Tenant: "Not A Tenant"})
	require.NoError(t, err)
	_, err = stream.Recv()
	requireStatus(t, err, codes.InvalidArgument, server.ReasonFieldInvalid)
}

func TestWatchOperationsEndsUnavailableOnShutdown(t *testing.T) {
	t.Parallel()
	b := setup(t)
	stream := watchTenant(t, b.ctx, b, &opbrokerv1.WatchOperationsRequest{Tenant: "acme"})
	go b.srv.Stop(5 * time.Second)
	for {
		_, err := stream.Recv()
		if err != nil {
			st := requireStatus(t, err, codes.Unavailable, server.ReasonShuttingDown)
			require.NotEmpty(t, errorInfo(st).GetMetadata()["resumeToken"])
			return
		}
	}
}
