package server

import (
	"context"
	"log/slog"
	"maps"
	"slices"
	"testing"

	"buf.build/go/protovalidate"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/opbroker/opbroker/auth"
	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/storetest"
)

// TestAdmittedCallSeesOnlyItsTenant: the ledger an admitted call reaches is the
// request's tenant's only, even through a store call that names another tenant (a
// handler bug): row-level security refuses it. A call admission did not admit for a
// tenant reaches nothing.
func TestAdmittedCallSeesOnlyItsTenant(t *testing.T) {
	t.Parallel()
	st, _ := storetest.NewStore(t)
	other := storetest.PrepareJSON(t, st, "globex", "demo.charge", "theirs", `{}`)
	validator, err := protovalidate.New()
	require.NoError(t, err)
	a := newAdmission(nil, validator, slog.New(slog.DiscardHandler), Limits{})

	ctx := auth.WithPrincipal(context.Background(), devPrincipal)
	ctx, err = a.admit(ctx, opbrokerv1.OperationService_ListOperations_FullMethodName, &opbrokerv1.ListOperationsRequest{Tenant: "acme"})
	require.NoError(t, err)
	_, err = ledger(ctx, st).Get(ctx, "globex", other.ID)
	require.ErrorIs(t, err, store.ErrNotFound, "an acme call cannot read globex's operation, whatever it asks the store")
	_, err = ledger(auth.WithPrincipal(context.Background(), devPrincipal), st).Get(ctx, "globex", other.ID)
	require.ErrorIs(t, err, store.ErrNoScope, "a call that was not admitted reaches nothing")
	_, err = st.Tenant("globex").Get(context.Background(), "globex", other.ID)
	require.NoError(t, err)
}

// FuzzAdmit: whatever bytes arrive as a request of any RPC, admission never panics, and
// admits a call of a principal bound to one tenant only for that tenant.
func FuzzAdmit(f *testing.F) {
	requests := map[string]func() proto.Message{
		opbrokerv1.OperationService_PrepareOperation_FullMethodName: func() proto.Message { return &opbrokerv1.PrepareOperationRequest{} },
		opbrokerv1.OperationService_GetOperation_FullMethodName:     func() proto.Message { return &opbrokerv1.GetOperationRequest{} },
		opbrokerv1.OperationService_ListOperations_FullMethodName:   func() proto.Message { return &opbrokerv1.ListOperationsRequest{} },
		opbrokerv1.OperationService_CancelOperation_FullMethodName:  func() proto.Message { return &opbrokerv1.CancelOperationRequest{} },
		opbrokerv1.OperationService_WatchOperation_FullMethodName:   func() proto.Message { return &opbrokerv1.WatchOperationRequest{} },
		opbrokerv1.OperationService_WatchOperations_FullMethodName:  func() proto.Message { return &opbrokerv1.WatchOperationsRequest{} },
		opbrokerv1.AdminService_DeleteTenantData_FullMethodName:     func() proto.Message { return &opbrokerv1.DeleteTenantDataRequest{} },
	}
	methods := slices.Sorted(maps.Keys(requests))
	seed := func(m proto.Message) []byte { b, _ := proto.Marshal(m); return b }
	f.Add(0, seed(&opbrokerv1.ListOperationsRequest{Tenant: "acme"}))
	f.Add(1, seed(&opbrokerv1.GetOperationRequest{Name: "tenants/globex/operations/01a229ec-38ce-7392-a665-637feac50b5b"}))
	f.Add(2, seed(&opbrokerv1.PrepareOperationRequest{Tenant: "globex", OperationType: "demo.charge", IntentRef: "x",
		Payload: []byte(`{}`), ContentType: "application/json"}))
	validator, err := protovalidate.New()
	require.NoError(f, err)
	a := newAdmission(nil, validator, slog.New(slog.DiscardHandler), Limits{TenantRate: 1e9, TenantBurst: 1e9})
	principal := &auth.Principal{Name: "p", Tenants: []string{"acme"},
		Roles: []auth.Role{auth.RoleClient, auth.RoleSupportRead, auth.RoleOperator}}
	f.Fuzz(func(t *testing.T, which int, raw []byte) {
		method := methods[(which%len(methods)+len(methods))%len(methods)]
		req := requests[method]()
		if proto.Unmarshal(raw, req) != nil {
			return
		}
		if _, err := a.admit(auth.WithPrincipal(context.Background(), principal), method, req); err != nil {
			return
		}
		tenant, err := requestTenant(req)
		require.NoError(t, err)
		require.Equal(t, "acme", tenant, "admitted only for its tenant")
	})
}
