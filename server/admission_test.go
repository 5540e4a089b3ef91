package server

import (
	"context"
	"log/slog"
	"testing"

	"buf.build/go/protovalidate"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/auth"
	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/storetest"
)

// TestAdmittedCallSeesOnlyItsTenant: the context an admitted call runs with reaches only
// the request's tenant in the ledger, even through a store call that names another
// tenant (a handler bug): row-level security refuses it.
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
	_, err = st.Get(ctx, "globex", other.ID)
	require.ErrorIs(t, err, store.ErrNotFound, "an acme call cannot read globex's operation, whatever it asks the store")
	_, err = st.Get(store.WithTenant(context.Background(), "globex"), "globex", other.ID)
	require.NoError(t, err)
}
