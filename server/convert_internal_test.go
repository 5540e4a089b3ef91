package server

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/auth"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/target"
)

// TestRemoteKeyForThoseWhoLookIntoEscalations: operator and support-read principals see
// the key an operation is sent with and its lookup URL; a client does not.
func TestRemoteKeyForThoseWhoLookIntoEscalations(t *testing.T) {
	targets, err := target.New(simtarget.DemoContracts("http://127.0.0.1:9")...)
	require.NoError(t, err)
	key := uuid.New()
	op := store.Operation{TenantID: "acme", ID: uuid.New(), OperationType: simtarget.DemoCharge, RemoteKey: key, State: store.StateEscalated}
	for roles, sees := range map[auth.Role]bool{auth.RoleOperator: true, auth.RoleSupportRead: true, auth.RoleClient: false} {
		ctx := auth.WithPrincipal(context.Background(), &auth.Principal{Name: "p", Roles: []auth.Role{roles}, Tenants: []string{"acme"}})
		out := operationFor(ctx, targets, op)
		if !sees {
			require.Empty(t, out.GetRemoteKey(), roles)
			require.Empty(t, out.GetLookupUrl(), roles)
			continue
		}
		require.Equal(t, key.String(), out.GetRemoteKey(), roles)
		require.Equal(t, "http://127.0.0.1:9/v1/charges?reference="+key.String(), out.GetLookupUrl(), roles)
	}
	require.Empty(t, operationFor(context.Background(), targets, op).GetRemoteKey(), "no principal, no key")
}

// TestAContradictionIsRendered: a verified success that contradicts how the operation
// ended reaches the API with its reference and time; an operation without one has none.
func TestAContradictionIsRendered(t *testing.T) {
	at := time.Date(2026, 12, 6, 15, 0, 0, 0, time.UTC)
	op := store.Operation{TenantID: "acme", ID: uuid.New(), State: store.StateFailedTerminal,
		Contradiction: &store.Contradiction{RemoteRef: "ch_late", RecordedAt: at}}
	out := operationToProto(op)
	require.Equal(t, "ch_late", out.GetContradiction().GetRemoteRef())
	require.Equal(t, at, out.GetContradiction().GetRecordTime().AsTime())
	op.Contradiction = nil
	require.Nil(t, operationToProto(op).GetContradiction())
}
