package server

import (
	"context"
	"errors"
	"log/slog"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"

	"github.com/opbroker/opbroker/auth"
	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/store"
)

// adminService serves operators.
type adminService struct {
	opbrokerv1.UnimplementedAdminServiceServer

	store *store.Store
	log   *slog.Logger
}

func (s *adminService) DeleteTenantData(ctx context.Context, req *opbrokerv1.DeleteTenantDataRequest) (*opbrokerv1.DeleteTenantDataResponse, error) {
	n, err := s.store.DeleteTenant(ctx, req.GetTenant())
	if errors.Is(err, store.ErrTenantHasOpenOperations) {
		return nil, newStatus(codes.FailedPrecondition,
			"the tenant has operations that are PREPARED, IN_FLIGHT, UNKNOWN or ESCALATED; cancel or resolve them first",
			ReasonTenantHasOpenOperations, map[string]string{"tenant": req.GetTenant()},
			&errdetails.PreconditionFailure{Violations: []*errdetails.PreconditionFailure_Violation{
				{Type: "OPEN_OPERATIONS", Subject: "tenants/" + req.GetTenant(), Description: "operations not in a terminal state"}}})
	}
	if err != nil {
		return nil, toStatus(ctx, s.log, err)
	}
	// An audit record of who deleted what: the principal and tenant, never data.
	s.log.WarnContext(ctx, "tenant data deleted", "principal", auth.FromContext(ctx).Name, "tenant", req.GetTenant(), "operations", n)
	return &opbrokerv1.DeleteTenantDataResponse{DeletedOperations: n}, nil
}
