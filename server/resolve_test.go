package server_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/opbroker/opbroker/auth"
	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/server"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/storetest"
	"github.com/opbroker/opbroker/target"
)

// TestResolveOperation: an operator resolves an ESCALATED operation by hand; the event
// keeps the operator's name, the reason and the evidence; a client may not; SUCCEEDED
// needs the target's reference.
func TestResolveOperation(t *testing.T) {
	t.Parallel()
	authn, tokens := newPrincipals(t,
		auth.PrincipalConfig{Name: "alice", Roles: []auth.Role{auth.RoleOperator}, AllTenants: true},
		auth.PrincipalConfig{Name: "acme-client", Roles: []auth.Role{auth.RoleClient}, Tenants: []string{"acme"}})
	b := setupWith(t, func(o *server.Options) { o.Auth = authn })
	created, err := b.client.PrepareOperation(tokens.as(b.ctx, "acme-client"), prepareRequest("acme", "stuck", `{"amount":1}`))
	require.NoError(t, err)
	id := uuid.MustParse(created.GetOperation().GetName()[len("tenants/acme/operations/"):])
	escalated := escalate(t, b, "acme", id)

	admin := opbrokerv1.NewAdminServiceClient(b.conn)
	req := &opbrokerv1.ResolveOperationRequest{Name: created.GetOperation().GetName(), Revision: escalated.Revision,
		Resolution: opbrokerv1.ResolveOperationRequest_RESOLUTION_SUCCEEDED, Reason: "found in the provider's dashboard",
		Evidence: "charge ch_9, 1.00 EUR", EvidenceUrl: "https://dashboard.example.com/ch_9"}
	_, err = admin.ResolveOperation(tokens.as(b.ctx, "acme-client"), req)
	requireStatus(t, err, codes.PermissionDenied, server.ReasonRoleRequired)
	_, err = admin.ResolveOperation(tokens.as(b.ctx, "alice"), req)
	requireStatus(t, err, codes.InvalidArgument, server.ReasonFieldRequired) // no remote_ref

	req.RemoteRef = "ch_9"
	resp, err := admin.ResolveOperation(tokens.as(b.ctx, "alice"), req)
	require.NoError(t, err)
	require.Equal(t, opbrokerv1.Operation_STATE_SUCCEEDED, resp.GetOperation().GetState())
	require.Equal(t, "ch_9", resp.GetOperation().GetRemoteRef())
	events, err := b.store.AllTenants().Events(b.ctx, "acme", id, escalated.Revision, 10)
	require.NoError(t, err)
	require.Len(t, events, 1)
	require.Equal(t, "operator:alice", events[0].Actor)
	require.Equal(t, "found in the provider's dashboard", events[0].Observation.Summary)
	require.Equal(t, "charge ch_9, 1.00 EUR", events[0].Observation.Evidence)
	require.Equal(t, "https://dashboard.example.com/ch_9", events[0].Observation.EvidenceURL)

	_, err = admin.ResolveOperation(tokens.as(b.ctx, "alice"), req)
	requireStatus(t, err, codes.FailedPrecondition, server.ReasonOperationState)
}

// fourEyesTargets returns the demo contracts, charges needing a second operator to
// approve a resolution by hand within window.
func fourEyesTargets(t *testing.T, window time.Duration) *target.Targets {
	t.Helper()
	contracts := simtarget.DemoContracts("http://127.0.0.1:1")
	contracts[0].ManualResolution = &target.ManualResolution{SecondOperator: true, ApprovalWindow: target.Duration(window)}
	targets, err := target.New(contracts...)
	require.NoError(t, err)
	return targets
}

// TestResolutionNeedsASecondOperator: for a target whose contract asks for it, an
// operator's resolution is only proposed, visible as pending with its proposer and
// expiry; the proposer cannot approve it; another operator's approval, at the
// proposal's revision, applies it.
func TestResolutionNeedsASecondOperator(t *testing.T) {
	t.Parallel()
	authn, tokens := newPrincipals(t,
		auth.PrincipalConfig{Name: "alice", Roles: []auth.Role{auth.RoleOperator}, AllTenants: true},
		auth.PrincipalConfig{Name: "bob", Roles: []auth.Role{auth.RoleOperator}, AllTenants: true},
		auth.PrincipalConfig{Name: "acme-client", Roles: []auth.Role{auth.RoleClient}, Tenants: []string{"acme"}})
	b := setupWith(t, func(o *server.Options) { o.Auth, o.Targets = authn, fourEyesTargets(t, time.Hour) })
	created, err := b.client.PrepareOperation(tokens.as(b.ctx, "acme-client"), prepareRequest("acme", "four-eyes", `{"amount":1}`))
	require.NoError(t, err)
	name := created.GetOperation().GetName()
	escalated := escalate(t, b, "acme", uuid.MustParse(name[len("tenants/acme/operations/"):]))

	admin := opbrokerv1.NewAdminServiceClient(b.conn)
	resp, err := admin.ResolveOperation(tokens.as(b.ctx, "alice"), &opbrokerv1.ResolveOperationRequest{Name: name,
		Revision: escalated.Revision, Resolution: opbrokerv1.ResolveOperationRequest_RESOLUTION_SUCCEEDED, RemoteRef: "ch_4",
		Reason: "found in the dashboard", Evidence: "charge ch_4"})
	require.NoError(t, err)
	require.Equal(t, opbrokerv1.Operation_STATE_ESCALATED, resp.GetOperation().GetState(), "not applied yet")
	pending := resp.GetPendingResolution()
	require.NotNil(t, pending)
	require.Equal(t, opbrokerv1.ResolveOperationRequest_RESOLUTION_SUCCEEDED, pending.GetResolution())
	require.Equal(t, "ch_4", pending.GetRemoteRef())
	require.Equal(t, "alice", pending.GetProposedBy())
	require.WithinDuration(t, time.Now().Add(time.Hour), pending.GetExpireTime().AsTime(), time.Minute)

	queue, err := admin.ListEscalations(tokens.as(b.ctx, "bob"), &opbrokerv1.ListEscalationsRequest{})
	require.NoError(t, err)
	require.Len(t, queue.GetEscalations(), 1)
	require.Equal(t, "alice", queue.GetEscalations()[0].GetPendingResolution().GetProposedBy(), "the queue shows what waits")

	approve := &opbrokerv1.ApproveResolutionRequest{Name: name, Revision: resp.GetOperation().GetRevision()}
	_, err = admin.ApproveResolution(tokens.as(b.ctx, "acme-client"), approve)
	requireStatus(t, err, codes.PermissionDenied, server.ReasonRoleRequired)
	_, err = admin.ApproveResolution(tokens.as(b.ctx, "alice"), approve)
	requireStatus(t, err, codes.FailedPrecondition, server.ReasonSameOperator)
	approved, err := admin.ApproveResolution(tokens.as(b.ctx, "bob"), approve)
	require.NoError(t, err)
	require.Equal(t, opbrokerv1.Operation_STATE_SUCCEEDED, approved.GetOperation().GetState())
	require.Equal(t, "ch_4", approved.GetOperation().GetRemoteRef())

	history, err := b.client.ListOperationEvents(tokens.as(b.ctx, "acme-client"), &opbrokerv1.ListOperationEventsRequest{Name: name})
	require.NoError(t, err)
	events := history.GetEvents()
	require.Equal(t, "operator:alice", events[len(events)-2].GetActor())
	require.Equal(t, "operator:bob", events[len(events)-1].GetActor())
}

// TestGetStats: the period's statistics per tenant and target, a tenant's alone or every
// tenant's for a principal with all; a period that ends before it starts is refused.
func TestGetStats(t *testing.T) {
	t.Parallel()
	authn, tokens := newPrincipals(t,
		auth.PrincipalConfig{Name: "alice", Roles: []auth.Role{auth.RoleOperator}, AllTenants: true},
		auth.PrincipalConfig{Name: "acme-support", Roles: []auth.Role{auth.RoleSupportRead}, Tenants: []string{"acme"}},
		auth.PrincipalConfig{Name: "client", Roles: []auth.Role{auth.RoleClient}, AllTenants: true})
	b := setupWith(t, func(o *server.Options) { o.Auth = authn })
	for _, tenant := range []string{"acme", "globex"} {
		_, err := b.client.PrepareOperation(tokens.as(b.ctx, "client"), prepareRequest(tenant, "stats", `{"amount":1}`))
		require.NoError(t, err)
	}
	_, err := b.client.PrepareOperation(tokens.as(b.ctx, "client"), prepareRequest("acme", "stats", `{"amount":2}`))
	requireStatus(t, err, codes.AlreadyExists, server.ReasonIntentPayloadMismatch)

	admin := opbrokerv1.NewAdminServiceClient(b.conn)
	all, err := admin.GetStats(tokens.as(b.ctx, "alice"), &opbrokerv1.GetStatsRequest{})
	require.NoError(t, err)
	require.Len(t, all.GetRows(), 2)
	acme := all.GetRows()[0]
	require.Equal(t, "acme", acme.GetTenant())
	require.Equal(t, "demo-payments", acme.GetTarget())
	require.Equal(t, int64(1), acme.GetPayloadMismatches())
	require.Equal(t, map[string]int64{"STATE_PREPARED": 1}, acme.GetOperationsByState())
	require.WithinDuration(t, time.Now().Add(-7*24*time.Hour), all.GetStartTime().AsTime(), time.Minute)

	own, err := admin.GetStats(tokens.as(b.ctx, "acme-support"), &opbrokerv1.GetStatsRequest{Tenant: "acme"})
	require.NoError(t, err)
	require.Len(t, own.GetRows(), 1)
	_, err = admin.GetStats(tokens.as(b.ctx, "acme-support"), &opbrokerv1.GetStatsRequest{})
	requireStatus(t, err, codes.PermissionDenied, server.ReasonTenantNotPermitted)
	_, err = admin.GetStats(tokens.as(b.ctx, "alice"), &opbrokerv1.GetStatsRequest{
		StartTime: timestamppb.Now(), EndTime: timestamppb.New(time.Now().Add(-time.Hour))})
	requireStatus(t, err, codes.InvalidArgument, server.ReasonFieldInvalid)
}

// TestHistoryNamesWhoDidWhat: every event records the principal that caused it, and
// ListOperationEvents returns the history, oldest first, in pages.
func TestHistoryNamesWhoDidWhat(t *testing.T) {
	t.Parallel()
	authn, tokens := newPrincipals(t,
		auth.PrincipalConfig{Name: "acme-client", Roles: []auth.Role{auth.RoleClient}, Tenants: []string{"acme"}},
		auth.PrincipalConfig{Name: "acme-support", Roles: []auth.Role{auth.RoleSupportRead}, Tenants: []string{"acme"}})
	b := setupWith(t, func(o *server.Options) { o.Auth = authn })
	created, err := b.client.PrepareOperation(tokens.as(b.ctx, "acme-client"), prepareRequest("acme", "history", `{"amount":1}`))
	require.NoError(t, err)
	name := created.GetOperation().GetName()
	_, err = b.client.CancelOperation(tokens.as(b.ctx, "acme-client"), &opbrokerv1.CancelOperationRequest{Name: name})
	require.NoError(t, err)

	resp, err := b.client.ListOperationEvents(tokens.as(b.ctx, "acme-support"), &opbrokerv1.ListOperationEventsRequest{Name: name})
	require.NoError(t, err)
	require.False(t, resp.GetMore())
	require.Len(t, resp.GetEvents(), 2)
	first, second := resp.GetEvents()[0], resp.GetEvents()[1]
	require.Equal(t, opbrokerv1.Operation_STATE_UNSPECIFIED, first.GetFromState())
	require.Equal(t, opbrokerv1.Operation_STATE_PREPARED, first.GetToState())
	require.Equal(t, "client:acme-client", first.GetActor(), "the principal, not just \"client\"")
	require.Equal(t, opbrokerv1.Operation_STATE_CANCELLED, second.GetToState())
	require.Equal(t, "client:acme-client", second.GetActor())

	page, err := b.client.ListOperationEvents(tokens.as(b.ctx, "acme-support"), &opbrokerv1.ListOperationEventsRequest{Name: name, PageSize: 1})
	require.NoError(t, err)
	require.Len(t, page.GetEvents(), 1)
	require.True(t, page.GetMore())
	rest, err := b.client.ListOperationEvents(tokens.as(b.ctx, "acme-support"), &opbrokerv1.ListOperationEventsRequest{Name: name,
		StartAfterRevision: page.GetEvents()[0].GetRevision()})
	require.NoError(t, err)
	require.Len(t, rest.GetEvents(), 1)
	require.Equal(t, int64(2), rest.GetEvents()[0].GetRevision())
}

// TestEscalationQueue: an operator with all tenants lists every tenant's escalations,
// oldest first, with owner, target, age and runbook, in pages; one bound to a tenant must
// name it.
// GetTargetReadiness gives every target's controls.
func TestEscalationQueue(t *testing.T) {
	t.Parallel()
	authn, tokens := newPrincipals(t,
		auth.PrincipalConfig{Name: "oncall", Roles: []auth.Role{auth.RoleOperator}, AllTenants: true},
		auth.PrincipalConfig{Name: "acme-operator", Roles: []auth.Role{auth.RoleOperator}, Tenants: []string{"acme"}})
	b := setupWith(t, func(o *server.Options) { o.Auth = authn })
	for _, tenant := range []string{"acme", "globex"} {
		escalate(t, b, tenant, storetestPrepare(t, b, tenant))
	}
	admin := opbrokerv1.NewAdminServiceClient(b.conn)
	all, err := admin.ListEscalations(tokens.as(b.ctx, "oncall"), &opbrokerv1.ListEscalationsRequest{})
	require.NoError(t, err)
	require.Len(t, all.GetEscalations(), 2, "every tenant's")
	first := all.GetEscalations()[0]
	require.Equal(t, "acme", first.GetOperation().GetTenant(), "oldest first")
	require.Equal(t, "demo-payments", first.GetTarget())
	require.NotEmpty(t, first.GetRunbook())
	require.NotEmpty(t, first.GetOperation().GetRemoteKey(), "what the owner needs at the target")
	require.GreaterOrEqual(t, first.GetAgeSeconds(), int64(0))

	_, err = admin.ListEscalations(tokens.as(b.ctx, "acme-operator"), &opbrokerv1.ListEscalationsRequest{})
	requireStatus(t, err, codes.PermissionDenied, server.ReasonTenantNotPermitted)
	own, err := admin.ListEscalations(tokens.as(b.ctx, "acme-operator"), &opbrokerv1.ListEscalationsRequest{Tenant: "acme"})
	require.NoError(t, err)
	require.Len(t, own.GetEscalations(), 1)
	none, err := admin.ListEscalations(tokens.as(b.ctx, "oncall"), &opbrokerv1.ListEscalationsRequest{Owner: "someone-else"})
	require.NoError(t, err)
	require.Empty(t, none.GetEscalations())
	page, err := admin.ListEscalations(tokens.as(b.ctx, "oncall"), &opbrokerv1.ListEscalationsRequest{PageSize: 1})
	require.NoError(t, err)
	require.Len(t, page.GetEscalations(), 1)
	require.True(t, page.GetMore())
	require.NotEmpty(t, page.GetNextPageToken())
	next, err := admin.ListEscalations(tokens.as(b.ctx, "oncall"), &opbrokerv1.ListEscalationsRequest{PageSize: 1,
		PageToken: page.GetNextPageToken()})
	require.NoError(t, err)
	require.Len(t, next.GetEscalations(), 1)
	require.Equal(t, "globex", next.GetEscalations()[0].GetOperation().GetTenant(), "the page after the first")
	require.False(t, next.GetMore())
	require.Empty(t, next.GetNextPageToken(), "the end")
	_, err = admin.ListEscalations(tokens.as(b.ctx, "oncall"), &opbrokerv1.ListEscalationsRequest{Owner: "demo",
		PageToken: page.GetNextPageToken()})
	requireStatus(t, err, codes.InvalidArgument, server.ReasonPageTokenMismatch)
	_, err = admin.ListEscalations(tokens.as(b.ctx, "oncall"), &opbrokerv1.ListEscalationsRequest{PageToken: "bm90IGEgdG9rZW4"})
	requireStatus(t, err, codes.InvalidArgument, server.ReasonPageTokenInvalid)

	readiness, err := admin.GetTargetReadiness(tokens.as(b.ctx, "acme-operator"), &opbrokerv1.GetTargetReadinessRequest{})
	require.NoError(t, err)
	require.NotEmpty(t, readiness.GetTargets())
	for _, target := range readiness.GetTargets() {
		require.Len(t, target.GetControls(), 11, target.GetName())
	}
}

// escalate takes the only PREPARED operation, id of tenant, through an unclear send to
// ESCALATED, as the dispatcher and the reconciler would, and returns it.
func escalate(t *testing.T, b *testBundle, tenant string, id uuid.UUID) store.Operation {
	t.Helper()
	op, err := b.store.AllTenants().Get(b.ctx, tenant, id)
	require.NoError(t, err)
	storetest.ToUnknown(t, b.store, op)
	return storetest.ResolveUnknown(t, b.store, op, store.ResolveParams{State: store.StateEscalated,
		Escalation: &store.Escalation{Owner: "demo-oncall", Reason: "no way to find out", EscalatedAt: time.Now()}, Actor: "test"})
}

// storetestPrepare records an intent of tenant with the test's store.
func storetestPrepare(t *testing.T, b *testBundle, tenant string) uuid.UUID {
	t.Helper()
	return storetest.PrepareJSON(t, b.store, tenant, simtarget.DemoCharge, "escalated-"+tenant, `{"amount":1}`).ID
}

// TestFailureTooSoonSaysHowLongToWait: FAILED_TERMINAL right after the last send, within
// the target's visibility delay, is refused with the time left, as a precondition and
// as a retry delay; nothing is recorded.
func TestFailureTooSoonSaysHowLongToWait(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := storetestPrepare(t, b, "acme")
	escalated := escalate(t, b, "acme", id)
	admin := opbrokerv1.NewAdminServiceClient(b.conn)
	_, err := admin.ResolveOperation(b.ctx, &opbrokerv1.ResolveOperationRequest{Name: "tenants/acme/operations/" + id.String(),
		Revision: escalated.Revision, Resolution: opbrokerv1.ResolveOperationRequest_RESOLUTION_FAILED_TERMINAL,
		Reason: "the provider has no such charge", Evidence: "searched the dashboard by the remote key"})
	st := requireStatus(t, err, codes.FailedPrecondition, server.ReasonSendMayStillLand)
	var retry *errdetails.RetryInfo
	for _, d := range st.Details() {
		if r, ok := d.(*errdetails.RetryInfo); ok {
			retry = r
		}
	}
	require.NotNil(t, retry)
	delay := retry.GetRetryDelay().AsDuration()
	require.True(t, delay == time.Second || delay == 2*time.Second, "within the demo target's visibility delay, 2 s: %s", delay)
	require.Equal(t, fmt.Sprint(int64(delay/time.Second)), errorInfo(st).GetMetadata()["retryAfterSeconds"])
	op, err := b.store.AllTenants().Get(b.ctx, "acme", id)
	require.NoError(t, err)
	require.Equal(t, escalated.Revision, op.Revision, "nothing recorded")
}

// TestDeleteTenantAfterItsEscalationIsResolved: a tenant with an escalation cannot be
// deleted; once an operator resolved it, it can, end to end.
func TestDeleteTenantAfterItsEscalationIsResolved(t *testing.T) {
	t.Parallel()
	b := setup(t) // dev: the caller may act as operator
	id := storetestPrepare(t, b, "acme")
	escalated := escalate(t, b, "acme", id)

	admin := opbrokerv1.NewAdminServiceClient(b.conn)
	_, err := admin.DeleteTenantData(b.ctx, &opbrokerv1.DeleteTenantDataRequest{Tenant: "acme"})
	requireStatus(t, err, codes.FailedPrecondition, server.ReasonTenantHasOpenOperations)
	_, err = admin.ResolveOperation(b.ctx, &opbrokerv1.ResolveOperationRequest{Name: "tenants/acme/operations/" + id.String(),
		Revision: escalated.Revision, Resolution: opbrokerv1.ResolveOperationRequest_RESOLUTION_SUCCEEDED, RemoteRef: "ch_found",
		Reason: "the provider has the charge", Evidence: "searched the dashboard by the remote key"})
	require.NoError(t, err)
	deleted, err := admin.DeleteTenantData(b.ctx, &opbrokerv1.DeleteTenantDataRequest{Tenant: "acme"})
	require.NoError(t, err)
	require.Equal(t, int64(1), deleted.GetDeletedOperations())
}
