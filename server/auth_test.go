package server_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/opbroker/opbroker/auth"
	"github.com/opbroker/opbroker/auth/authtest"
	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/server"
	"github.com/opbroker/opbroker/storetest"
)

// principals of the authorisation tests, by name, with their tokens.
type principals map[string]string

func newPrincipals(t *testing.T, configs ...auth.PrincipalConfig) (*auth.Authenticator, principals) {
	t.Helper()
	return authtest.Principals(t, configs...)
}

func (p principals) as(ctx context.Context, name string) context.Context {
	if name == "" {
		return ctx
	}
	return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+p[name])
}

// rpcCall calls one RPC for a tenant's fixture and returns its error.
type rpcCall func(ctx context.Context, b *testBundle, tenant string) error

// recvFirst opens a stream and returns the error of its first message.
func recvFirst[T any](stream interface{ Recv() (T, error) }, err error) error {
	if err != nil {
		return err
	}
	_, err = stream.Recv()
	return err
}

// TestEveryRPCAuthorises: every RPC × {no credentials, another tenant, a role that may
// not call it, the right principal} gives exactly the expected code, and the refused
// calls change nothing; over the network and through the server's Local connection
// (the support view's), which admits exactly as the network does.
func TestEveryRPCAuthorises(t *testing.T) {
	t.Parallel()
	t.Run("network", func(t *testing.T) { t.Parallel(); testEveryRPCAuthorises(t, false) })
	t.Run("local", func(t *testing.T) { t.Parallel(); testEveryRPCAuthorises(t, true) })
}

func testEveryRPCAuthorises(t *testing.T, local bool) {
	authn, tokens := newPrincipals(t,
		auth.PrincipalConfig{Name: "acme-client", Roles: []auth.Role{auth.RoleClient}, Tenants: []string{"acme"}},
		auth.PrincipalConfig{Name: "acme-worker", Roles: []auth.Role{auth.RoleWorker}, Tenants: []string{"acme"}},
		auth.PrincipalConfig{Name: "acme-support", Roles: []auth.Role{auth.RoleSupportRead}, Tenants: []string{"acme"}},
		auth.PrincipalConfig{Name: "acme-operator", Roles: []auth.Role{auth.RoleOperator}, Tenants: []string{"acme"}},
		auth.PrincipalConfig{Name: "all-operator", Roles: []auth.Role{auth.RoleOperator}, AllTenants: true},
		auth.PrincipalConfig{Name: "acme-evidence", Roles: []auth.Role{auth.RoleEvidence}, Tenants: []string{"acme"}},
	)
	b := setupWith(t, func(o *server.Options) { o.Auth = authn })
	var conn grpc.ClientConnInterface = b.conn
	if local {
		conn = b.srv.Local
	}
	client := opbrokerv1.NewOperationServiceClient(conn)
	admin := opbrokerv1.NewAdminServiceClient(conn)
	evidence := opbrokerv1.NewEvidenceServiceClient(conn)
	ops := map[string]string{} // the PREPARED operation of each tenant
	for _, tenant := range []string{"acme", "globex"} {
		op := storetest.PrepareJSON(t, b.store, tenant, "demo.charge", "fixture", `{"amount":1}`)
		ops[tenant] = fmt.Sprintf("tenants/%s/operations/%s", tenant, op.ID)
	}

	rpcs := map[string]struct {
		call       rpcCall
		right      string     // the principal that may call it
		ok         codes.Code // what the right principal gets
		tenantless bool       // it reads no tenant's data
		allTenants bool       // it spans every tenant: a principal of some is refused
	}{
		"PrepareOperation": {func(ctx context.Context, b *testBundle, tenant string) error {
			_, err := client.PrepareOperation(ctx, prepareRequest(tenant, "authz", `{}`))
			return err
		}, "acme-client", codes.OK, false, false},
		"GetOperation": {func(ctx context.Context, b *testBundle, tenant string) error {
			_, err := client.GetOperation(ctx, &opbrokerv1.GetOperationRequest{Name: ops[tenant]})
			return err
		}, "acme-support", codes.OK, false, false},
		"ListOperationEvents": {func(ctx context.Context, b *testBundle, tenant string) error {
			_, err := client.ListOperationEvents(ctx, &opbrokerv1.ListOperationEventsRequest{Name: ops[tenant]})
			return err
		}, "acme-support", codes.OK, false, false},
		"ListOperations": {func(ctx context.Context, b *testBundle, tenant string) error {
			_, err := client.ListOperations(ctx, &opbrokerv1.ListOperationsRequest{Tenant: tenant})
			return err
		}, "acme-support", codes.OK, false, false},
		"CancelOperation": {func(ctx context.Context, b *testBundle, tenant string) error {
			_, err := client.CancelOperation(ctx, &opbrokerv1.CancelOperationRequest{Name: ops[tenant]})
			return err
		}, "acme-client", codes.OK, false, false},
		"WatchOperation": {func(ctx context.Context, b *testBundle, tenant string) error {
			return recvFirst(client.WatchOperation(ctx, &opbrokerv1.WatchOperationRequest{Name: ops[tenant]}))
		}, "acme-support", codes.OK, false, false},
		"WatchOperations": {func(ctx context.Context, b *testBundle, tenant string) error {
			return recvFirst(client.WatchOperations(ctx, &opbrokerv1.WatchOperationsRequest{Tenant: tenant}))
		}, "acme-support", codes.OK, false, false},
		"DeleteTenantData": {func(ctx context.Context, b *testBundle, tenant string) error {
			_, err := admin.DeleteTenantData(ctx, &opbrokerv1.DeleteTenantDataRequest{Tenant: tenant})
			return err
		}, "acme-operator", codes.FailedPrecondition, false, false}, // acme's operation is open
		"ListEscalations": {func(ctx context.Context, b *testBundle, tenant string) error {
			_, err := admin.ListEscalations(ctx, &opbrokerv1.ListEscalationsRequest{Tenant: tenant})
			return err
		}, "acme-operator", codes.OK, false, false},
		"GetTargetReadiness": {func(ctx context.Context, b *testBundle, tenant string) error {
			_, err := admin.GetTargetReadiness(ctx, &opbrokerv1.GetTargetReadinessRequest{})
			return err
		}, "acme-operator", codes.OK, true, false},
		"ResolveOperation": {func(ctx context.Context, b *testBundle, tenant string) error {
			_, err := admin.ResolveOperation(ctx, &opbrokerv1.ResolveOperationRequest{Name: ops[tenant], Revision: 1,
				Resolution: opbrokerv1.ResolveOperationRequest_RESOLUTION_FAILED_TERMINAL, Reason: "authz", Evidence: "none"})
			return err
		}, "acme-operator", codes.FailedPrecondition, false, false}, // acme's operation is PREPARED, not unsettled
		"GetStats": {func(ctx context.Context, b *testBundle, tenant string) error {
			_, err := admin.GetStats(ctx, &opbrokerv1.GetStatsRequest{Tenant: tenant})
			return err
		}, "acme-support", codes.OK, false, false},
		"ApproveResolution": {func(ctx context.Context, b *testBundle, tenant string) error {
			_, err := admin.ApproveResolution(ctx, &opbrokerv1.ApproveResolutionRequest{Name: ops[tenant], Revision: 1})
			return err
		}, "acme-operator", codes.FailedPrecondition, false, false}, // no resolution is pending
		"ListQuarantine": {func(ctx context.Context, b *testBundle, tenant string) error {
			_, err := admin.ListQuarantine(ctx, &opbrokerv1.ListQuarantineRequest{})
			return err
		}, "all-operator", codes.OK, false, true},
		"ReviewQuarantine": {func(ctx context.Context, b *testBundle, tenant string) error {
			_, err := admin.ReviewQuarantine(ctx, &opbrokerv1.ReviewQuarantineRequest{Target: "demo-payments", EventId: "evt_none",
				Action: opbrokerv1.ReviewQuarantineRequest_REVIEW_ACTION_DISMISS, Note: "authz"})
			return err
		}, "all-operator", codes.NotFound, false, true}, // no such event
		"ReportEvidence": {func(ctx context.Context, b *testBundle, tenant string) error {
			_, err := evidence.ReportEvidence(ctx, &opbrokerv1.ReportEvidenceRequest{Tenant: tenant, Target: "demo-payments", Event: []byte(`{}`)})
			return err
		}, "acme-evidence", codes.FailedPrecondition, false, false}, // the demo targets read no events
	}
	require.Len(t, rpcs, len(opbrokerv1.OperationService_ServiceDesc.Methods)+len(opbrokerv1.OperationService_ServiceDesc.Streams)+
		len(opbrokerv1.AdminService_ServiceDesc.Methods)+len(opbrokerv1.EvidenceService_ServiceDesc.Methods), "every RPC is in the table")

	before := ledgerDigest(t, b)
	for name, rpc := range rpcs {
		wrongRole := "acme-worker"
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(b.ctx)
			defer cancel()
			requireCode(t, rpc.call(tokens.as(ctx, ""), b, "acme"), codes.Unauthenticated, server.ReasonCredentialsMissing)
			requireCode(t, rpc.call(metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer opb_forged"), b, "acme"),
				codes.Unauthenticated, server.ReasonCredentialsInvalid)
			switch {
			case rpc.allTenants:
				requireCode(t, rpc.call(tokens.as(ctx, "acme-operator"), b, "acme"), codes.PermissionDenied, server.ReasonTenantNotPermitted)
			case !rpc.tenantless:
				requireCode(t, rpc.call(tokens.as(ctx, rpc.right), b, "globex"), codes.PermissionDenied, server.ReasonTenantNotPermitted)
			}
			requireCode(t, rpc.call(tokens.as(ctx, wrongRole), b, "acme"), codes.PermissionDenied, server.ReasonRoleRequired)
		})
	}
	require.Equal(t, before, ledgerDigest(t, b), "refused calls change nothing")

	// In an order that keeps each call's fixture: acme's operations stay open until the
	// cancellation, last.
	for _, name := range []string{"PrepareOperation", "GetOperation", "ListOperations", "ListOperationEvents", "WatchOperation",
		"WatchOperations", "DeleteTenantData", "ResolveOperation", "ApproveResolution", "ListEscalations", "GetStats",
		"GetTargetReadiness", "ListQuarantine", "ReviewQuarantine", "ReportEvidence", "CancelOperation"} {
		rpc := rpcs[name]
		t.Run(name+"/right principal", func(t *testing.T) {
			ctx, cancel := context.WithCancel(b.ctx)
			defer cancel()
			err := rpc.call(tokens.as(ctx, rpc.right), b, "acme")
			require.Equal(t, rpc.ok, status.Code(err), "%v", err)
		})
	}
	logs := b.logs.String()
	require.Contains(t, logs, `"msg":"permission denied"`, "denials are security events in the log")
	require.NotContains(t, logs, strings.TrimPrefix(tokens["acme-client"], "opb_"), "tokens never reach the log")
}

func requireCode(t *testing.T, err error, code codes.Code, reason string) {
	t.Helper()
	st := requireStatus(t, err, code, reason)
	require.NotContains(t, st.Message(), "globex", "an error names nothing of the other tenant")
}

// ledgerDigest summarises everything the ledger holds.
func ledgerDigest(t *testing.T, b *testBundle) string {
	t.Helper()
	var digest string
	require.NoError(t, b.pool.QueryRow(b.ctx, `SELECT
		(SELECT coalesce(string_agg(tenant_id || operation_id::text || state || revision, ',' ORDER BY operation_id), '') FROM operations) ||
		(SELECT count(*) FROM operation_events)::text`).Scan(&digest))
	return digest
}

// TestWatchLimitPerPrincipal: a principal's watch streams beyond the limit are refused
// with RESOURCE_EXHAUSTED; closing one makes room.
func TestWatchLimitPerPrincipal(t *testing.T) {
	t.Parallel()
	authn, tokens := newPrincipals(t,
		auth.PrincipalConfig{Name: "viewer", Roles: []auth.Role{auth.RoleSupportRead}, AllTenants: true},
		auth.PrincipalConfig{Name: "other", Roles: []auth.Role{auth.RoleSupportRead}, AllTenants: true})
	b := setupWith(t, func(o *server.Options) { o.Auth = authn; o.Limits.WatchesPerPrincipal = 2 })
	open := func(ctx context.Context, who string) (grpc.ServerStreamingClient[opbrokerv1.WatchOperationsResponse], error) {
		stream, err := b.client.WatchOperations(tokens.as(ctx, who), &opbrokerv1.WatchOperationsRequest{Tenant: "acme"})
		if err != nil {
			return nil, err
		}
		_, err = stream.Recv()
		return stream, err
	}
	first, cancelFirst := context.WithCancel(b.ctx)
	_, err := open(first, "viewer")
	require.NoError(t, err)
	_, err = open(b.ctx, "viewer")
	require.NoError(t, err)
	_, err = open(b.ctx, "viewer")
	requireStatus(t, err, codes.ResourceExhausted, server.ReasonWatchLimit)
	_, err = open(b.ctx, "other")
	require.NoError(t, err, "the limit is per principal")

	cancelFirst()
	require.Eventually(t, func() bool {
		ctx, cancel := context.WithCancel(b.ctx)
		_, err := open(ctx, "viewer")
		cancel()
		return err == nil
	}, 5*time.Second, 20*time.Millisecond, "a closed stream makes room")
}

// TestTenantRateLimit: a tenant over its rate gets RESOURCE_EXHAUSTED with a retry
// delay, and nothing is written; another tenant is not affected.
func TestTenantRateLimit(t *testing.T) {
	t.Parallel()
	b := setupWith(t, func(o *server.Options) { o.Limits.TenantRate, o.Limits.TenantBurst = 0.001, 2 })
	for i := range 2 {
		_, err := b.client.PrepareOperation(b.ctx, prepareRequest("acme", fmt.Sprint("rate-", i), `{}`))
		require.NoError(t, err)
	}
	_, err := b.client.PrepareOperation(b.ctx, prepareRequest("acme", "rate-2", `{}`))
	st := requireStatus(t, err, codes.ResourceExhausted, server.ReasonTenantRateLimited)
	require.True(t, hasRetryInfo(st), "the error says when to retry")
	_, err = b.client.PrepareOperation(b.ctx, prepareRequest("globex", "rate-0", `{}`))
	require.NoError(t, err, "the limit is per tenant")

	var n int
	require.NoError(t, b.pool.QueryRow(b.ctx, `SELECT count(*) FROM operations WHERE intent_ref = 'rate-2'`).Scan(&n))
	require.Zero(t, n, "nothing half-written")
}

func hasRetryInfo(st *status.Status) bool {
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.RetryInfo); ok && info.GetRetryDelay().AsDuration() > 0 {
			return true
		}
	}
	return false
}
