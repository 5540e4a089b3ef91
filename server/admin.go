package server

import (
	"context"
	"errors"
	"log/slog"

	"github.com/opbroker/opbroker/auth"
	"github.com/opbroker/opbroker/brokermetrics"
	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/target"
)

// adminService serves operators.
type adminService struct {
	opbrokerv1.UnimplementedAdminServiceServer

	store   *store.Store
	targets *target.Targets
	log     *slog.Logger
	events  *brokermetrics.Events // resolutions of UNKNOWN operations
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

// ResolveOperation records an operator's resolution of an UNKNOWN or ESCALATED
// operation (store.Scope.ResolveManually), its actor the operator principal's name.
func (s *adminService) ResolveOperation(ctx context.Context, req *opbrokerv1.ResolveOperationRequest) (*opbrokerv1.ResolveOperationResponse, error) {
	tenant, id, err := parseOperationName("name", req.GetName())
	if err != nil {
		return nil, toStatus(ctx, s.log, err)
	}
	state := store.StateFailedTerminal
	if req.GetResolution() == opbrokerv1.ResolveOperationRequest_RESOLUTION_SUCCEEDED {
		state = store.StateSucceeded
		if req.GetRemoteRef() == "" {
			return nil, toStatus(ctx, s.log, invalidArgument(violation("remote_ref",
				"is required to resolve as succeeded: the target's identifier of the effect", ReasonFieldRequired)))
		}
	}
	scope := ledger(ctx, s.store)
	before, err := scope.Get(ctx, tenant, id)
	if err != nil {
		return nil, toStatus(ctx, s.log, err)
	}
	op, err := scope.ResolveManually(ctx, store.ManualResolution{TenantID: tenant, ID: id, Revision: req.GetRevision(),
		State: state, RemoteRef: req.GetRemoteRef(), Reason: req.GetReason(), Evidence: req.GetEvidence(),
		EvidenceURL: req.GetEvidenceUrl(), Actor: "operator:" + auth.FromContext(ctx).Name})
	if errors.Is(err, store.ErrRevisionChanged) {
		err = &revisionChangedError{current: before.Revision}
	}
	if err != nil {
		return nil, toStatus(ctx, s.log, err)
	}
	if before.State == store.StateUnknown { // an ESCALATED one was counted when it was escalated
		if contract, ok := s.targets.ForType(op.OperationType); ok {
			s.events.Resolved(ctx, contract, op)
		}
	}
	s.log.WarnContext(ctx, "operation resolved by hand", "principal", auth.FromContext(ctx).Name,
		"name", req.GetName(), "state", state)
	return &opbrokerv1.ResolveOperationResponse{Operation: operationFor(ctx, s.targets, op)}, nil
}

// revisionChangedError is store.ErrRevisionChanged with the operation's revision now.
type revisionChangedError struct{ current int64 }

func (e *revisionChangedError) Error() string { return store.ErrRevisionChanged.Error() }
func (e *revisionChangedError) Unwrap() error { return store.ErrRevisionChanged }
