package server

import (
	"context"
	"log/slog"
	"testing"

	"buf.build/go/protovalidate"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"

	"github.com/opbroker/opbroker/auth"
	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
)

// TestAnUndecodedRequestIsForgotten: the reason the codec keeps for a request it could
// not decode is taken by the first interceptor that sees the request, before the call
// is authenticated, so a caller without credentials leaves nothing behind either; the
// handler never runs.
func TestAnUndecodedRequestIsForgotten(t *testing.T) {
	t.Parallel()
	validator, err := protovalidate.New()
	require.NoError(t, err)
	_, digest := auth.NewToken()
	authn, err := auth.New([]auth.PrincipalConfig{{Name: "svc", Roles: []auth.Role{auth.RoleClient}, AllTenants: true, TokenSHA256: []string{digest}}})
	require.NoError(t, err)
	a := newAdmission(authn, validator, slog.New(slog.DiscardHandler), Limits{})
	codec := newRequestCodec(a.undecoded)
	req := &opbrokerv1.GetOperationRequest{}
	require.NoError(t, codec.Unmarshal(mem.BufferSlice{mem.SliceBuffer([]byte{0x0a, 0x02, 'a', 0xff})}, req))
	require.Empty(t, req.GetName(), "left empty")

	handled := false
	_, err = a.unaryInterceptor()(context.Background(), req, &grpc.UnaryServerInfo{FullMethod: opbrokerv1.OperationService_GetOperation_FullMethodName},
		func(context.Context, any) (any, error) { handled = true; return nil, nil })
	require.Equal(t, codes.Unauthenticated, status.Code(err), "no credentials")
	require.False(t, handled)
	require.NoError(t, a.undecoded.take(req), "forgotten")
	a.undecoded.requests.Range(func(k, _ any) bool { t.Errorf("kept: %v", k); return true })
}
