package server_test

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/metric/noop"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/opbroker/opbroker/clocktest"
	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/logtest"
	"github.com/opbroker/opbroker/server"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/storetest"
	"github.com/opbroker/opbroker/target"
	"github.com/opbroker/opbroker/watch"
)

type testBundle struct {
	ctx    context.Context
	client opbrokerv1.OperationServiceClient
	conn   *grpc.ClientConn
	pool   *pgxpool.Pool
	store  *store.Store
	logs   *logtest.Buffer
	srv    *server.Server
}

const testMaxPayload = 1024

func setup(t *testing.T) *testBundle {
	t.Helper()
	return setupWith(t, nil)
}

// setupWith is setup with options changed by change (nil: none).
func setupWith(t *testing.T, change func(*server.Options)) *testBundle {
	t.Helper()
	st, pool := storetest.NewStore(t)
	logs := &logtest.Buffer{}
	log := slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	hub := watch.New(st, log, 50*time.Millisecond)
	require.NoError(t, hub.Start(context.Background()))
	t.Cleanup(hub.Stop)
	opts := server.Options{
		Store:           st,
		Targets:         demoTargets(t),
		Logger:          log,
		MeterProvider:   noop.NewMeterProvider(),
		MaxPayloadBytes: testMaxPayload,
		Hub:             hub,
		WatchHeartbeat:  200 * time.Millisecond,
	}
	if change != nil {
		change(&opts)
	}
	srv, conn := serveServer(t, opts)
	return &testBundle{ctx: context.Background(), client: opbrokerv1.NewOperationServiceClient(conn), conn: conn, pool: pool,
		store: st, logs: logs, srv: srv}
}

// serve runs a server with opts over an in-memory listener and returns a client
// connection to it; both are closed at cleanup.
func serve(t *testing.T, opts server.Options) *grpc.ClientConn {
	t.Helper()
	_, conn := serveServer(t, opts)
	return conn
}

func serveServer(t *testing.T, opts server.Options) (*server.Server, *grpc.ClientConn) {
	t.Helper()
	srv, err := server.New(opts)
	require.NoError(t, err)
	srv.SetServing()
	lis := bufconn.Listen(1 << 20)
	go func() { _ = srv.GRPC.Serve(lis) }()
	t.Cleanup(func() { srv.Stop(time.Second) })

	conn, err := grpc.NewClient("passthrough:///bufconn",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	return srv, conn
}

// demoTargets serves demo.charge and demo.notify; nothing is sent in these tests.
func demoTargets(t *testing.T) *target.Targets {
	t.Helper()
	targets, err := target.New(simtarget.DemoContracts("http://127.0.0.1:1")...)
	require.NoError(t, err)
	return targets
}

func prepareRequest(tenant, intent, payload string) *opbrokerv1.PrepareOperationRequest {
	return &opbrokerv1.PrepareOperationRequest{
		Tenant:        tenant,
		OperationType: "demo.charge",
		IntentRef:     intent,
		Payload:       []byte(payload),
		ContentType:   "application/json",
	}
}

// requireStatus asserts the code and that the error carries an ErrorInfo of our domain
// with the reason; it returns the status for further checks.
func requireStatus(t *testing.T, err error, code codes.Code, reason string) *status.Status {
	t.Helper()
	require.Error(t, err)
	st := status.Convert(err)
	require.Equal(t, code, st.Code(), st.Message())
	info := errorInfo(st)
	require.NotNil(t, info, "every error carries an ErrorInfo")
	require.Equal(t, server.ErrorDomain, info.GetDomain())
	require.Equal(t, reason, info.GetReason())
	return st
}

func errorInfo(st *status.Status) *errdetails.ErrorInfo {
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			return info
		}
	}
	return nil
}

func fieldViolations(st *status.Status) map[string]string {
	out := map[string]string{}
	for _, d := range st.Details() {
		if br, ok := d.(*errdetails.BadRequest); ok {
			for _, v := range br.GetFieldViolations() {
				out[v.GetField()] = v.GetReason()
			}
		}
	}
	return out
}

func TestPrepareGetListRoundTrip(t *testing.T) {
	t.Parallel()
	b := setup(t)
	req := prepareRequest("acme", "order-1", `{"amount":100,"currency":"EUR"}`)
	req.Labels = map[string]string{"team": "billing"}
	resp, err := b.client.PrepareOperation(b.ctx, req)
	require.NoError(t, err)
	require.True(t, resp.GetCreated())
	op := resp.GetOperation()
	require.Regexp(t, `^tenants/acme/operations/[0-9a-f-]{36}$`, op.GetName())
	require.Equal(t, opbrokerv1.Operation_STATE_PREPARED, op.GetState())
	require.Equal(t, int64(1), op.GetRevision())
	require.Len(t, op.GetPayloadSha256(), 64)
	require.Equal(t, "order-1", op.GetIntentRef())
	require.Equal(t, map[string]string{"team": "billing"}, op.GetLabels())

	got, err := b.client.GetOperation(b.ctx, &opbrokerv1.GetOperationRequest{Name: op.GetName()})
	require.NoError(t, err)
	require.Equal(t, op.GetName(), got.GetOperation().GetName())
	require.Equal(t, op.GetPayloadSha256(), got.GetOperation().GetPayloadSha256())

	list, err := b.client.ListOperations(b.ctx, &opbrokerv1.ListOperationsRequest{Tenant: "acme"})
	require.NoError(t, err)
	require.Len(t, list.GetOperations(), 1)
	require.Equal(t, op.GetName(), list.GetOperations()[0].GetName())
	require.Empty(t, list.GetNextPageToken())
}

func TestPrepareReplaysCanonicallyEqualPayload(t *testing.T) {
	t.Parallel()
	b := setup(t)
	first, err := b.client.PrepareOperation(b.ctx, prepareRequest("acme", "order-1", `{"amount":100,"currency":"EUR"}`))
	require.NoError(t, err)
	again, err := b.client.PrepareOperation(b.ctx, prepareRequest("acme", "order-1", "{ \"currency\": \"EUR\",\n \"amount\": 1e2 }"))
	require.NoError(t, err)
	require.False(t, again.GetCreated())
	require.Equal(t, first.GetOperation().GetName(), again.GetOperation().GetName())
	require.Equal(t, first.GetOperation().GetRevision(), again.GetOperation().GetRevision(), "a replay changes nothing")
}

func TestPrepareConcurrentIdenticalCallsMakeOneOperation(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const callers = 50
	names := make(chan string, callers)
	createdCount := make(chan bool, callers)
	var wg sync.WaitGroup
	for range callers {
		wg.Go(func() {
			resp, err := b.client.PrepareOperation(b.ctx, prepareRequest("acme", "same-intent", `{"amount":7}`))
			if err != nil {
				names <- "error: " + err.Error()
				return
			}
			names <- resp.GetOperation().GetName()
			createdCount <- resp.GetCreated()
		})
	}
	wg.Wait()
	close(names)
	close(createdCount)
	distinct := map[string]bool{}
	for n := range names {
		distinct[n] = true
	}
	require.Len(t, distinct, 1, "%v", distinct)
	creators := 0
	for c := range createdCount {
		if c {
			creators++
		}
	}
	require.Equal(t, 1, creators)
}

func TestPreparePayloadMismatchIsAlreadyExists(t *testing.T) {
	t.Parallel()
	b := setup(t)
	first, err := b.client.PrepareOperation(b.ctx, prepareRequest("acme", "credit-7", `{"amount":50}`))
	require.NoError(t, err)
	_, err = b.client.PrepareOperation(b.ctx, prepareRequest("acme", "credit-7", `{"amount":40}`))
	st := requireStatus(t, err, codes.AlreadyExists, server.ReasonIntentPayloadMismatch)
	require.Equal(t, first.GetOperation().GetName(), errorInfo(st).GetMetadata()["operation"])
	require.Equal(t, first.GetOperation().GetPayloadSha256(), errorInfo(st).GetMetadata()["existingPayloadSha256"])
	var resource *errdetails.ResourceInfo
	for _, d := range st.Details() {
		if r, ok := d.(*errdetails.ResourceInfo); ok {
			resource = r
		}
	}
	require.NotNil(t, resource)
	require.Equal(t, first.GetOperation().GetName(), resource.GetResourceName())

	got, err := b.client.GetOperation(b.ctx, &opbrokerv1.GetOperationRequest{Name: first.GetOperation().GetName()})
	require.NoError(t, err)
	require.Equal(t, first.GetOperation().GetPayloadSha256(), got.GetOperation().GetPayloadSha256(), "nothing changed")
	require.Equal(t, int64(1), got.GetOperation().GetRevision())
}

func TestPrepareLegitimateRepeat(t *testing.T) {
	t.Parallel()
	b := setup(t)
	a, err := b.client.PrepareOperation(b.ctx, prepareRequest("acme", "purchase-1", `{"item":"tea","amount":3}`))
	require.NoError(t, err)
	c, err := b.client.PrepareOperation(b.ctx, prepareRequest("acme", "purchase-2", `{"item":"tea","amount":3}`))
	require.NoError(t, err)
	require.True(t, c.GetCreated())
	require.NotEqual(t, a.GetOperation().GetName(), c.GetOperation().GetName())
	require.Equal(t, a.GetOperation().GetPayloadSha256(), c.GetOperation().GetPayloadSha256())
}

func TestPrepareSupersedes(t *testing.T) {
	t.Parallel()
	b := setup(t)
	orig, err := b.client.PrepareOperation(b.ctx, prepareRequest("acme", "credit-1", `{"amount":50}`))
	require.NoError(t, err)
	amend := prepareRequest("acme", "credit-1b", `{"amount":40}`)
	amend.Supersedes = orig.GetOperation().GetName()
	resp, err := b.client.PrepareOperation(b.ctx, amend)
	require.NoError(t, err)
	require.Equal(t, orig.GetOperation().GetName(), resp.GetOperation().GetSupersedes())

	missing := prepareRequest("acme", "credit-2", `{"amount":40}`)
	missing.Supersedes = "tenants/acme/operations/0190a4a8-0000-7000-8000-000000000000"
	_, err = b.client.PrepareOperation(b.ctx, missing)
	requireStatus(t, err, codes.NotFound, server.ReasonSupersededOperationNotFound)

	// The amendment is sent (IN_FLIGHT): amending it is refused, naming it and its state.
	id, err := uuid.Parse(strings.TrimPrefix(resp.GetOperation().GetName(), "tenants/acme/operations/"))
	require.NoError(t, err)
	claimed, err := b.store.AllTenants().Claim(b.ctx, store.ClaimParams{FairClaim: store.FairClaim{
		OperationTypes: []string{simtarget.DemoCharge}, Worker: "test", Lease: time.Minute, Limit: 10, PerTenant: 10, MaxTenants: 10}})
	require.NoError(t, err)
	require.Len(t, claimed, 1)
	require.Equal(t, id, claimed[0].ID)
	again := prepareRequest("acme", "credit-1c", `{"amount":30}`)
	again.Supersedes = resp.GetOperation().GetName()
	_, err = b.client.PrepareOperation(b.ctx, again)
	st := requireStatus(t, err, codes.FailedPrecondition, server.ReasonSupersededUnresolved)
	info := errorInfo(st)
	require.Equal(t, resp.GetOperation().GetName(), info.GetMetadata()["operation"])
	require.Equal(t, "STATE_IN_FLIGHT", info.GetMetadata()["state"])
}

func TestPrepareWithPastDeadline(t *testing.T) {
	t.Parallel()
	clock := clocktest.New(0) // the server's clock, moved by the test
	b := setupWith(t, func(o *server.Options) { o.Now = clock.Now })
	future := prepareRequest("acme", "order-d", `{"amount":1}`)
	future.DispatchDeadline = timestamppb.New(clock.Now().Add(time.Minute))
	first, err := b.client.PrepareOperation(b.ctx, future)
	require.NoError(t, err)
	require.True(t, first.GetCreated())
	clock.Advance(2 * time.Minute) // the deadline is in the past for the retry

	retry, err := b.client.PrepareOperation(b.ctx, future)
	require.NoError(t, err, "an identical retry finds its operation even after the deadline")
	require.False(t, retry.GetCreated())

	late := prepareRequest("acme", "order-late", `{"amount":1}`)
	late.DispatchDeadline = timestamppb.New(clock.Now().Add(-time.Minute))
	_, err = b.client.PrepareOperation(b.ctx, late)
	st := requireStatus(t, err, codes.InvalidArgument, server.ReasonDeadlinePassed)
	require.Equal(t, "DEADLINE_PASSED", fieldViolations(st)["dispatch_deadline"])
}

// TestTimesOutsideATimestampAreRefused: a time no Timestamp may hold (after 9999, before
// the year 1, nanoseconds out of range) is INVALID_ARGUMENT naming its field; converted
// as it is, it would reach the ledger as another time (18446744073710 seconds as 1970).
// The bounds themselves are accepted, and an identical retry of a not_before with
// nanoseconds (the ledger keeps microseconds) finds its operation.
func TestTimesOutsideATimestampAreRefused(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for name, ts := range map[string]*timestamppb.Timestamp{
		"wraps":       {Seconds: 18446744073710},
		"after 9999":  {Seconds: 253402300800},
		"before 1":    {Seconds: -62135596801},
		"bad nanos":   {Seconds: 2000000000, Nanos: -1},
		"nanos ≥ 1 s": {Seconds: 2000000000, Nanos: 1e9},
	} {
		for _, field := range []string{"not_before", "dispatch_deadline"} {
			req := prepareRequest("acme", "times-"+field, `{"amount":1}`)
			if field == "not_before" {
				req.NotBefore = ts
			} else {
				req.DispatchDeadline = ts
			}
			_, err := b.client.PrepareOperation(b.ctx, req)
			st := requireStatus(t, err, codes.InvalidArgument, server.ReasonFieldInvalid)
			require.Equal(t, map[string]string{field: server.ReasonFieldInvalid}, fieldViolations(st), "%s %s", field, name)
		}
		for _, field := range []string{"start_time", "end_time"} {
			req := &opbrokerv1.GetStatsRequest{}
			if field == "start_time" {
				req.StartTime = ts
			} else {
				req.EndTime = ts
			}
			_, err := opbrokerv1.NewAdminServiceClient(b.conn).GetStats(b.ctx, req)
			st := requireStatus(t, err, codes.InvalidArgument, server.ReasonFieldInvalid)
			require.Equal(t, map[string]string{field: server.ReasonFieldInvalid}, fieldViolations(st), "%s %s", field, name)
		}
	}
	last := prepareRequest("acme", "times-bounds", `{"amount":1}`)
	last.NotBefore = &timestamppb.Timestamp{Seconds: -62135596800, Nanos: 123456789}  // 0001-01-01 with nanoseconds: part of the intent, compared to the microsecond
	last.DispatchDeadline = &timestamppb.Timestamp{Seconds: 253402300799, Nanos: 5e8} // 9999-12-31 23:59:59.5
	first, err := b.client.PrepareOperation(b.ctx, last)
	require.NoError(t, err)
	require.True(t, first.GetCreated())
	retry, err := b.client.PrepareOperation(b.ctx, last)
	require.NoError(t, err)
	require.False(t, retry.GetCreated())
	require.Equal(t, last.DispatchDeadline.AsTime(), first.GetOperation().GetDispatchDeadline().AsTime())
}

func TestValidationErrors(t *testing.T) {
	t.Parallel()
	b := setup(t)
	other, err := b.client.PrepareOperation(b.ctx, prepareRequest("globex", "g-1", `{}`))
	require.NoError(t, err)
	manyLabels := map[string]string{}
	for i := range 17 {
		manyLabels[fmt.Sprintf("k%d", i)] = "v"
	}
	mutate := func(f func(*opbrokerv1.PrepareOperationRequest)) *opbrokerv1.PrepareOperationRequest {
		r := prepareRequest("acme", "order-1", `{"amount":1}`)
		f(r)
		return r
	}
	for name, tc := range map[string]struct {
		req    *opbrokerv1.PrepareOperationRequest
		field  string
		reason string
	}{
		"missing tenant":      {mutate(func(r *opbrokerv1.PrepareOperationRequest) { r.Tenant = "" }), "tenant", server.ReasonFieldRequired},
		"bad tenant":          {mutate(func(r *opbrokerv1.PrepareOperationRequest) { r.Tenant = "Acme Corp" }), "tenant", server.ReasonFieldInvalid},
		"bad operation type":  {mutate(func(r *opbrokerv1.PrepareOperationRequest) { r.OperationType = "Charge!" }), "operation_type", server.ReasonFieldInvalid},
		"missing intent":      {mutate(func(r *opbrokerv1.PrepareOperationRequest) { r.IntentRef = "" }), "intent_ref", server.ReasonFieldRequired},
		"intent control char": {mutate(func(r *opbrokerv1.PrepareOperationRequest) { r.IntentRef = "a\nb" }), "intent_ref", server.ReasonFieldInvalid},
		"intent too long":     {mutate(func(r *opbrokerv1.PrepareOperationRequest) { r.IntentRef = strings.Repeat("x", 257) }), "intent_ref", server.ReasonFieldInvalid},
		"empty payload":       {mutate(func(r *opbrokerv1.PrepareOperationRequest) { r.Payload = nil }), "payload", server.ReasonFieldRequired},
		"payload over cap": {mutate(func(r *opbrokerv1.PrepareOperationRequest) {
			r.Payload = []byte(`"` + strings.Repeat("x", testMaxPayload) + `"`)
		}), "payload", server.ReasonPayloadTooLarge},
		"payload not json":     {mutate(func(r *opbrokerv1.PrepareOperationRequest) { r.Payload = []byte(`{"amount":`) }), "payload", server.ReasonPayloadInvalid},
		"missing content type": {mutate(func(r *opbrokerv1.PrepareOperationRequest) { r.ContentType = "" }), "content_type", server.ReasonFieldRequired},
		"bad content type":     {mutate(func(r *opbrokerv1.PrepareOperationRequest) { r.ContentType = "json" }), "content_type", server.ReasonFieldInvalid},
		"too many labels":      {mutate(func(r *opbrokerv1.PrepareOperationRequest) { r.Labels = manyLabels }), "labels", server.ReasonFieldInvalid},
		"bad label key":        {mutate(func(r *opbrokerv1.PrepareOperationRequest) { r.Labels = map[string]string{"Bad Key": "v"} }), `labels["Bad Key"]`, server.ReasonFieldInvalid},
		"label value too long": {mutate(func(r *opbrokerv1.PrepareOperationRequest) {
			r.Labels = map[string]string{"k": strings.Repeat("v", 257)}
		}), `labels["k"]`, server.ReasonFieldInvalid},
		"malformed supersedes":    {mutate(func(r *opbrokerv1.PrepareOperationRequest) { r.Supersedes = "operations/1" }), "supersedes", server.ReasonFieldInvalid},
		"supersedes other tenant": {mutate(func(r *opbrokerv1.PrepareOperationRequest) { r.Supersedes = other.GetOperation().GetName() }), "supersedes", server.ReasonSupersedesOtherTenant},
	} {
		_, err := b.client.PrepareOperation(b.ctx, tc.req)
		st := requireStatus(t, err, codes.InvalidArgument, tc.reason)
		require.Equal(t, map[string]string{tc.field: tc.reason}, fieldViolations(st), "%s: %v", name, st.Details())
	}

	for name, tc := range map[string]struct {
		call   func() error
		reason string
	}{
		"get malformed name": {func() error {
			_, err := b.client.GetOperation(b.ctx, &opbrokerv1.GetOperationRequest{Name: "tenants/acme/operations/42"})
			return err
		}, server.ReasonFieldInvalid},
		"cancel empty name": {func() error {
			_, err := b.client.CancelOperation(b.ctx, &opbrokerv1.CancelOperationRequest{})
			return err
		}, server.ReasonFieldRequired},
		"list negative page size": {func() error {
			_, err := b.client.ListOperations(b.ctx, &opbrokerv1.ListOperationsRequest{Tenant: "acme", PageSize: -1})
			return err
		}, server.ReasonFieldInvalid},
		"list garbage page token": {func() error {
			_, err := b.client.ListOperations(b.ctx, &opbrokerv1.ListOperationsRequest{Tenant: "acme", PageToken: "!!not-a-token"})
			return err
		}, server.ReasonPageTokenInvalid},
		"list unspecified state": {func() error {
			_, err := b.client.ListOperations(b.ctx, &opbrokerv1.ListOperationsRequest{Tenant: "acme", States: []opbrokerv1.Operation_State{0}})
			return err
		}, server.ReasonFieldInvalid},
		"watch malformed name": {func() error {
			stream, err := b.client.WatchOperation(b.ctx, &opbrokerv1.WatchOperationRequest{Name: "x"})
			require.NoError(t, err)
			_, err = stream.Recv()
			return err
		}, server.ReasonFieldInvalid},
	} {
		st := requireStatus(t, tc.call(), codes.InvalidArgument, tc.reason)
		require.NotEmpty(t, fieldViolations(st), name)
	}
	var n int
	require.NoError(t, b.pool.QueryRow(b.ctx, `SELECT count(*) FROM operations`).Scan(&n))
	require.Equal(t, 1, n, "no invalid request wrote anything")
}

func TestCancelOperation(t *testing.T) {
	t.Parallel()
	b := setup(t)
	prepared, err := b.client.PrepareOperation(b.ctx, prepareRequest("acme", "order-1", `{}`))
	require.NoError(t, err)
	name := prepared.GetOperation().GetName()

	resp, err := b.client.CancelOperation(b.ctx, &opbrokerv1.CancelOperationRequest{Name: name})
	require.NoError(t, err)
	require.Equal(t, opbrokerv1.Operation_STATE_CANCELLED, resp.GetOperation().GetState())
	require.Equal(t, int64(2), resp.GetOperation().GetRevision())
	again, err := b.client.CancelOperation(b.ctx, &opbrokerv1.CancelOperationRequest{Name: name})
	require.NoError(t, err)
	require.Equal(t, int64(2), again.GetOperation().GetRevision())

	sent, err := b.client.PrepareOperation(b.ctx, prepareRequest("acme", "order-2", `{}`))
	require.NoError(t, err)
	_, err = b.pool.Exec(b.ctx, `UPDATE operations SET state = 'IN_FLIGHT', revision = revision + 1, fence_token = 1,
		attempt_count = 1, first_sent_at = now(), lease_owner = 'test', lease_expires_at = now() + interval '1 minute'
		WHERE intent_ref = 'order-2'`)
	require.NoError(t, err)
	_, err = b.client.CancelOperation(b.ctx, &opbrokerv1.CancelOperationRequest{Name: sent.GetOperation().GetName()})
	st := requireStatus(t, err, codes.FailedPrecondition, server.ReasonOperationState)
	require.Contains(t, st.Message(), "IN_FLIGHT")
	require.Equal(t, "STATE_IN_FLIGHT", errorInfo(st).GetMetadata()["state"])

	_, err = b.client.CancelOperation(b.ctx, &opbrokerv1.CancelOperationRequest{Name: "tenants/acme/operations/0190a4a8-0000-7000-8000-000000000000"})
	requireStatus(t, err, codes.NotFound, server.ReasonOperationNotFound)
}

func TestTenantScoping(t *testing.T) {
	t.Parallel()
	b := setup(t)
	a, err := b.client.PrepareOperation(b.ctx, prepareRequest("acme", "order-1", `{}`))
	require.NoError(t, err)
	_, err = b.client.PrepareOperation(b.ctx, prepareRequest("globex", "order-1", `{}`))
	require.NoError(t, err)

	asOther := strings.Replace(a.GetOperation().GetName(), "tenants/acme/", "tenants/globex/", 1)
	_, err = b.client.GetOperation(b.ctx, &opbrokerv1.GetOperationRequest{Name: asOther})
	requireStatus(t, err, codes.NotFound, server.ReasonOperationNotFound)
	_, err = b.client.CancelOperation(b.ctx, &opbrokerv1.CancelOperationRequest{Name: asOther})
	requireStatus(t, err, codes.NotFound, server.ReasonOperationNotFound)

	list, err := b.client.ListOperations(b.ctx, &opbrokerv1.ListOperationsRequest{Tenant: "globex"})
	require.NoError(t, err)
	require.Len(t, list.GetOperations(), 1)
	require.Equal(t, "globex", list.GetOperations()[0].GetTenant())
}

func TestListPagination(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var names []string
	for i := range 5 {
		resp, err := b.client.PrepareOperation(b.ctx, prepareRequest("acme", fmt.Sprintf("o-%d", i), `{}`))
		require.NoError(t, err)
		names = append(names, resp.GetOperation().GetName())
	}
	_, err := b.client.CancelOperation(b.ctx, &opbrokerv1.CancelOperationRequest{Name: names[1]})
	require.NoError(t, err)

	var seen []string
	token := ""
	for {
		page, err := b.client.ListOperations(b.ctx, &opbrokerv1.ListOperationsRequest{Tenant: "acme", PageSize: 2, PageToken: token})
		require.NoError(t, err)
		require.LessOrEqual(t, len(page.GetOperations()), 2)
		for _, op := range page.GetOperations() {
			seen = append(seen, op.GetName())
		}
		token = page.GetNextPageToken()
		if token == "" {
			break
		}
		// A token is bound to its tenant and filter.
		_, err = b.client.ListOperations(b.ctx, &opbrokerv1.ListOperationsRequest{Tenant: "globex", PageSize: 2, PageToken: token})
		st := requireStatus(t, err, codes.InvalidArgument, server.ReasonPageTokenMismatch)
		require.Equal(t, "PAGE_TOKEN_MISMATCH", fieldViolations(st)["page_token"])
		_, err = b.client.ListOperations(b.ctx, &opbrokerv1.ListOperationsRequest{Tenant: "acme", PageSize: 2, PageToken: token,
			States: []opbrokerv1.Operation_State{opbrokerv1.Operation_STATE_PREPARED}})
		requireStatus(t, err, codes.InvalidArgument, server.ReasonPageTokenMismatch)
	}
	require.Equal(t, []string{names[4], names[3], names[2], names[1], names[0]}, seen)

	prepared, err := b.client.ListOperations(b.ctx, &opbrokerv1.ListOperationsRequest{Tenant: "acme", PageSize: 5000,
		States: []opbrokerv1.Operation_State{opbrokerv1.Operation_STATE_PREPARED}})
	require.NoError(t, err, "a page size above the maximum is coerced")
	require.Len(t, prepared.GetOperations(), 4)
	for _, op := range prepared.GetOperations() {
		require.Equal(t, opbrokerv1.Operation_STATE_PREPARED, op.GetState())
	}
}

// TestListSearch: ListOperations finds a tenant's operations by intent reference (of
// any served type) and by the target's reference, never another tenant's.
func TestListSearch(t *testing.T) {
	t.Parallel()
	b := setup(t)
	charge := storetest.PrepareJSON(t, b.store, "acme", "demo.charge", "order-7", `{}`)
	drive(t, b, b.store, charge.ID) // SUCCEEDED with remote reference ch_1
	notify := storetest.PrepareJSON(t, b.store, "acme", "demo.notify", "order-7", `{}`)
	storetest.PrepareJSON(t, b.store, "acme", "demo.charge", "order-8", `{}`)
	storetest.PrepareJSON(t, b.store, "globex", "demo.charge", "order-7", `{}`)

	search := func(req *opbrokerv1.ListOperationsRequest) []string {
		t.Helper()
		resp, err := b.client.ListOperations(b.ctx, req)
		require.NoError(t, err)
		var ids []string
		for _, op := range resp.GetOperations() {
			require.Equal(t, "acme", op.GetTenant())
			ids = append(ids, op.GetName())
		}
		return ids
	}
	name := func(op store.Operation) string { return "tenants/acme/operations/" + op.ID.String() }
	require.Equal(t, []string{name(notify), name(charge)}, search(&opbrokerv1.ListOperationsRequest{Tenant: "acme", IntentRef: "order-7"}))
	require.Equal(t, []string{name(charge)}, search(&opbrokerv1.ListOperationsRequest{Tenant: "acme", RemoteRef: "ch_1"}))
	require.Equal(t, []string{name(charge)}, search(&opbrokerv1.ListOperationsRequest{Tenant: "acme", IntentRef: "order-7",
		States: []opbrokerv1.Operation_State{opbrokerv1.Operation_STATE_SUCCEEDED}}))
	require.Empty(t, search(&opbrokerv1.ListOperationsRequest{Tenant: "acme", IntentRef: "order-7", RemoteRef: "ch_2"}))
	require.Empty(t, search(&opbrokerv1.ListOperationsRequest{Tenant: "acme", IntentRef: "order-9"}))

	_, err := b.client.ListOperations(b.ctx, &opbrokerv1.ListOperationsRequest{Tenant: "acme", IntentRef: "bad\nref"})
	st := requireStatus(t, err, codes.InvalidArgument, server.ReasonFieldInvalid)
	require.Contains(t, fieldViolations(st), "intent_ref")
}

func TestLogsNeverContainPayloadsOrIntentRefs(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const intent = "intent-SECRET-7f3a"
	const marker = "PAYLOAD-SECRET-91c2"
	_, err := b.client.PrepareOperation(b.ctx, prepareRequest("acme", intent, `{"note":"`+marker+`"}`))
	require.NoError(t, err)
	_, err = b.client.PrepareOperation(b.ctx, prepareRequest("acme", intent, `{"note":"`+marker+`-changed"}`))
	require.Error(t, err)
	_, err = b.client.PrepareOperation(b.ctx, prepareRequest("acme", intent+"\n", `{"note":"`+marker+`"`))
	require.Error(t, err)
	_, err = b.client.PrepareOperation(b.ctx, prepareRequest("acme", intent+"-2", `{"`+marker+`":1,"`+marker+`":2}`))
	require.Error(t, err)

	logs := b.logs.String()
	require.Contains(t, logs, "PrepareOperation", "calls are logged")
	require.NotContains(t, logs, "SECRET")
}

func TestHealthServing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	resp, err := healthpb.NewHealthClient(b.conn).Check(b.ctx, &healthpb.HealthCheckRequest{Service: "opbroker.v1.OperationService"})
	require.NoError(t, err)
	require.Equal(t, healthpb.HealthCheckResponse_SERVING, resp.GetStatus())
}

func TestPanicBecomesInternalWithErrorInfo(t *testing.T) {
	t.Parallel()
	logs := &logtest.Buffer{}
	conn := serve(t, server.Options{
		Store:         nil, // every handler that touches the store panics
		Targets:       demoTargets(t),
		Logger:        slog.New(slog.NewJSONHandler(logs, nil)),
		MeterProvider: noop.NewMeterProvider(),
	})

	_, err := opbrokerv1.NewOperationServiceClient(conn).GetOperation(context.Background(),
		&opbrokerv1.GetOperationRequest{Name: "tenants/acme/operations/0190a4a8-0000-7000-8000-000000000000"})
	st := requireStatus(t, err, codes.Internal, server.ReasonInternal)
	require.Equal(t, "internal error", st.Message(), "the panic value is not sent to clients")
	require.Contains(t, logs.String(), "panic in handler")
}

func TestDatabaseDownIsUnavailable(t *testing.T) {
	t.Parallel()
	pool, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none?connect_timeout=2")
	require.NoError(t, err, "the pool connects lazily")
	t.Cleanup(pool.Close)
	conn := serve(t, server.Options{Store: store.New(pool), Targets: demoTargets(t),
		Logger: slog.New(slog.DiscardHandler), MeterProvider: noop.NewMeterProvider()})
	client := opbrokerv1.NewOperationServiceClient(conn)
	_, err = client.GetOperation(context.Background(), &opbrokerv1.GetOperationRequest{Name: "tenants/acme/operations/0190a4a8-0000-7000-8000-000000000000"})
	requireStatus(t, err, codes.Unavailable, server.ReasonDatabaseUnavailable)
	_, err = client.PrepareOperation(context.Background(), prepareRequest("acme", "x", `{}`))
	requireStatus(t, err, codes.Unavailable, server.ReasonDatabaseUnavailable)
}

// TestStandbyIsUnavailable: a connection that reached a standby (a multi-host URL during
// a failover, before the old primary is gone) refuses every write as a read-only
// transaction; the client is told to retry, not that its call failed.
func TestStandbyIsUnavailable(t *testing.T) {
	t.Parallel()
	cfg, err := pgxpool.ParseConfig(storetest.Schema(t))
	require.NoError(t, err)
	cfg.ConnConfig.RuntimeParams["default_transaction_read_only"] = "on"
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	conn := serve(t, server.Options{Store: store.New(pool), Targets: demoTargets(t),
		Logger: slog.New(slog.DiscardHandler), MeterProvider: noop.NewMeterProvider()})
	_, err = opbrokerv1.NewOperationServiceClient(conn).PrepareOperation(context.Background(), prepareRequest("acme", "x", `{}`))
	requireStatus(t, err, codes.Unavailable, server.ReasonDatabaseUnavailable)
}

// TestNotBefore: a scheduled operation waits, shows its time, can be cancelled until
// then, and its time is part of the intent.
func TestNotBefore(t *testing.T) {
	t.Parallel()
	b := setup(t)
	later := time.Now().Add(time.Hour).Truncate(time.Microsecond)
	req := prepareRequest("acme", "scheduled", `{"amount":1}`)
	req.NotBefore = timestamppb.New(later)
	resp, err := b.client.PrepareOperation(b.ctx, req)
	require.NoError(t, err)
	op := resp.GetOperation()
	require.True(t, op.GetNotBefore().AsTime().Equal(later))
	require.True(t, op.GetNextCheckTime().AsTime().Equal(later), "sent at its time")

	other := prepareRequest("acme", "scheduled", `{"amount":1}`)
	other.NotBefore = timestamppb.New(later.Add(time.Minute))
	_, err = b.client.PrepareOperation(b.ctx, other)
	requireStatus(t, err, codes.AlreadyExists, server.ReasonIntentPayloadMismatch)

	backwards := prepareRequest("acme", "backwards", `{"amount":1}`)
	backwards.NotBefore, backwards.DispatchDeadline = timestamppb.New(later), timestamppb.New(later.Add(-time.Minute))
	_, err = b.client.PrepareOperation(b.ctx, backwards)
	requireStatus(t, err, codes.InvalidArgument, server.ReasonFieldInvalid)

	cancelled, err := b.client.CancelOperation(b.ctx, &opbrokerv1.CancelOperationRequest{Name: op.GetName()})
	require.NoError(t, err)
	require.Equal(t, opbrokerv1.Operation_STATE_CANCELLED, cancelled.GetOperation().GetState())
}
