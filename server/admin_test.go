package server_test

import (
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/server"
	"github.com/opbroker/opbroker/storetest"
)

// TestDeleteTenantDataRefusesOpenOperations: while a tenant has an operation that is not
// terminal, DeleteTenantData is FAILED_PRECONDITION naming the tenant, and deletes
// nothing; once it is terminal, the tenant's data is deleted.
func TestDeleteTenantDataRefusesOpenOperations(t *testing.T) {
	t.Parallel()
	b := setup(t)
	admin := opbrokerv1.NewAdminServiceClient(b.conn)
	op := storetest.PrepareJSON(t, b.store, "acme", "demo.charge", "open", `{}`)

	_, err := admin.DeleteTenantData(b.ctx, &opbrokerv1.DeleteTenantDataRequest{Tenant: "acme"})
	st := requireStatus(t, err, codes.FailedPrecondition, server.ReasonTenantHasOpenOperations)
	require.Equal(t, "the tenant has operations that are PREPARED, IN_FLIGHT, UNKNOWN or ESCALATED; cancel or resolve them first", st.Message())
	want := []proto.Message{
		&errdetails.ErrorInfo{Reason: server.ReasonTenantHasOpenOperations, Domain: server.ErrorDomain, Metadata: map[string]string{"tenant": "acme"}},
		&errdetails.PreconditionFailure{Violations: []*errdetails.PreconditionFailure_Violation{
			{Type: "OPEN_OPERATIONS", Subject: "tenants/acme", Description: "operations not in a terminal state"}}},
	}
	require.Len(t, st.Details(), len(want))
	for i, d := range st.Details() {
		got, ok := d.(proto.Message)
		require.True(t, ok && proto.Equal(want[i], got), "detail %d: %v", i, d)
	}
	_, err = b.client.GetOperation(b.ctx, &opbrokerv1.GetOperationRequest{Name: "tenants/acme/operations/" + op.ID.String()})
	require.NoError(t, err, "nothing deleted")

	_, err = b.client.CancelOperation(b.ctx, &opbrokerv1.CancelOperationRequest{Name: "tenants/acme/operations/" + op.ID.String()})
	require.NoError(t, err)
	resp, err := admin.DeleteTenantData(b.ctx, &opbrokerv1.DeleteTenantDataRequest{Tenant: "acme"})
	require.NoError(t, err)
	require.Equal(t, int64(1), resp.GetDeletedOperations())
}
