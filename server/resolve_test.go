package server_test

import (
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"

	"github.com/opbroker/opbroker/auth"
	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/server"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/store"
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
	fair := store.FairClaim{OperationTypes: []string{simtarget.DemoCharge}, Worker: "test", Lease: time.Minute, Limit: 1, PerTenant: 1, MaxTenants: 1}
	claimed, err := b.store.AllTenants().Claim(b.ctx, store.ClaimParams{Target: "demo-payments", FairClaim: fair})
	require.NoError(t, err)
	_, err = b.store.AllTenants().RecordOutcome(b.ctx, store.OutcomeParams{TenantID: "acme", ID: id, Fence: claimed[0].FenceToken,
		State: store.StateUnknown, Actor: "test", Observation: store.Observation{Outcome: "TIMEOUT"}})
	require.NoError(t, err)
	unknown, err := b.store.AllTenants().ClaimUnknown(b.ctx, fair)
	require.NoError(t, err)
	escalated, err := b.store.AllTenants().ResolveUnknown(b.ctx, store.ResolveParams{TenantID: "acme", ID: id, Fence: unknown[0].FenceToken,
		State: store.StateEscalated, Escalation: &store.Escalation{Owner: "demo-oncall", Reason: "no way to find out"}, Actor: "test"})
	require.NoError(t, err)

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
