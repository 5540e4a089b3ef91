package server

import (
	"context"
	"log/slog"

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
	n, err := ledger(ctx, s.store).DeleteTenant(ctx, req.GetTenant())
	if err != nil {
		return nil, toStatus(ctx, s.log, &tenantError{tenant: req.GetTenant(), err: err})
	}
	// An audit record of who deleted what: the principal and tenant, never data.
	s.log.WarnContext(ctx, "tenant data deleted", "principal", auth.FromContext(ctx).Name, "tenant", req.GetTenant(), "operations", n)
	return &opbrokerv1.DeleteTenantDataResponse{DeletedOperations: n}, nil
}
