package ui

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
)

// TestSessionSeal: a sealed session gives its token back until it ends, and nothing
// after; one changed, or sealed with another key, gives nothing; the cookie never
// shows the token.
func TestSessionSeal(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	s, err := newSealer([]byte("shared secret"))
	require.NoError(t, err)
	sealed, err := s.seal("opb_token", now.Add(time.Hour))
	require.NoError(t, err)
	require.NotContains(t, sealed, "token")

	token, err := s.open(sealed, now.Add(59*time.Minute))
	require.NoError(t, err)
	require.Equal(t, "opb_token", token)
	_, err = s.open(sealed, now.Add(time.Hour))
	require.ErrorIs(t, err, errSessionInvalid, "ended")

	sameKey, err := newSealer([]byte("shared secret"))
	require.NoError(t, err)
	_, err = sameKey.open(sealed, now)
	require.NoError(t, err, "another replica with the same key")
	otherKey, err := newSealer(nil)
	require.NoError(t, err)
	_, err = otherKey.open(sealed, now)
	require.ErrorIs(t, err, errSessionInvalid)

	flipped := []byte(sealed)
	flipped[len(flipped)/2] ^= 1
	for _, bad := range []string{string(flipped), "", "opb_token", strings.Repeat("A", 40)} {
		_, err = s.open(bad, now)
		require.ErrorIs(t, err, errSessionInvalid, bad)
	}
}

// TestReadOnlyCallsOnlyReads: the view's connection refuses every method but the reads
// it needs, before the call reaches the broker.
func TestReadOnlyCallsOnlyReads(t *testing.T) {
	t.Parallel()
	conn := readOnly{} // no Local: a refused call must not reach it
	ctx := context.Background()
	_, err := opbrokerv1.NewAdminServiceClient(conn).ResolveOperation(ctx, &opbrokerv1.ResolveOperationRequest{})
	require.Equal(t, codes.PermissionDenied, status.Code(err))
	_, err = opbrokerv1.NewAdminServiceClient(conn).DeleteTenantData(ctx, &opbrokerv1.DeleteTenantDataRequest{})
	require.Equal(t, codes.PermissionDenied, status.Code(err))
	_, err = opbrokerv1.NewOperationServiceClient(conn).CancelOperation(ctx, &opbrokerv1.CancelOperationRequest{})
	require.Equal(t, codes.PermissionDenied, status.Code(err))
	_, err = opbrokerv1.NewOperationServiceClient(conn).WatchOperations(ctx, &opbrokerv1.WatchOperationsRequest{})
	require.Equal(t, codes.PermissionDenied, status.Code(err))
}
