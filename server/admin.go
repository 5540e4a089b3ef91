package server

import (
	"context"
	"log/slog"
	"strings"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/opbroker/opbroker/auth"
	"github.com/opbroker/opbroker/brokermetrics"
	"github.com/opbroker/opbroker/evidence"
	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/target"
)

// adminService serves operators.
type adminService struct {
	opbrokerv1.UnimplementedAdminServiceServer

	store    *store.Store
	targets  *target.Targets
	log      *slog.Logger
	events   *brokermetrics.Events // resolutions of UNKNOWN operations
	evidence *evidence.Matcher     // the quarantine's reviews
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
	current, err := ledger(ctx, s.store).Get(ctx, tenant, id)
	if err != nil {
		return nil, toStatus(ctx, s.log, err)
	}
	resolution := store.ManualResolution{TenantID: tenant, ID: id, Revision: req.GetRevision(),
		State: state, RemoteRef: req.GetRemoteRef(), Reason: req.GetReason(), Evidence: req.GetEvidence(),
		EvidenceURL: req.GetEvidenceUrl(), Actor: operatorActor(ctx), FailureSettlesAfter: s.failureSettlesAfter(current)}
	if contract, ok := s.targets.ForType(current.OperationType); ok && contract.SecondOperatorRequired() {
		proposed, err := ledger(ctx, s.store).ProposeResolution(ctx, resolution, contract.ManualResolution.Window())
		if err != nil {
			return nil, toStatus(ctx, s.log, err)
		}
		s.log.WarnContext(ctx, "resolution proposed; it waits for a second operator", "principal", auth.FromContext(ctx).Name,
			"name", req.GetName(), "state", state)
		return &opbrokerv1.ResolveOperationResponse{Operation: operationFor(ctx, s.targets, proposed),
			PendingResolution: pendingResolution(proposed)}, nil
	}
	op, err := ledger(ctx, s.store).ResolveManually(ctx, resolution)
	if err != nil {
		return nil, toStatus(ctx, s.log, err)
	}
	s.resolved(ctx, op, req.GetName())
	return &opbrokerv1.ResolveOperationResponse{Operation: operationFor(ctx, s.targets, op)}, nil
}

// ApproveResolution applies the resolution another operator proposed.
func (s *adminService) ApproveResolution(ctx context.Context, req *opbrokerv1.ApproveResolutionRequest) (*opbrokerv1.ApproveResolutionResponse, error) {
	tenant, id, err := parseOperationName("name", req.GetName())
	if err != nil {
		return nil, toStatus(ctx, s.log, err)
	}
	op, err := ledger(ctx, s.store).ApproveResolution(ctx, tenant, id, req.GetRevision(), operatorActor(ctx),
		s.failureSettlesAfter)
	if err != nil {
		return nil, toStatus(ctx, s.log, err)
	}
	s.resolved(ctx, op, req.GetName())
	return &opbrokerv1.ApproveResolutionResponse{Operation: operationFor(ctx, s.targets, op)}, nil
}

// failureSettlesAfter is how long after op's last send a resolution by hand may call it
// FAILED_TERMINAL, by the contract of the target serving its type (a type no target
// serves: at once).
func (s *adminService) failureSettlesAfter(op store.Operation) time.Duration {
	if contract, ok := s.targets.ForType(op.OperationType); ok {
		return contract.FailureSettlesAfter()
	}
	return 0
}

// operatorPrefix starts the actor of what an operator does by hand, before the
// principal's name.
const operatorPrefix = "operator:"

// operatorActor is the actor the ledger records for the calling operator.
func operatorActor(ctx context.Context) string { return operatorPrefix + auth.FromContext(ctx).Name }

// resolved counts and logs a resolution by hand that applied.
func (s *adminService) resolved(ctx context.Context, op store.Operation, name string) {
	// Resolved from UNKNOWN (it was never escalated): an ESCALATED one was counted when
	// it was escalated.
	if op.Escalation == nil {
		if contract, ok := s.targets.ForType(op.OperationType); ok {
			s.events.Resolved(ctx, contract, op)
		}
	}
	s.log.WarnContext(ctx, "operation resolved by hand", "principal", auth.FromContext(ctx).Name,
		"name", name, "state", op.State)
}

// pendingResolution is the proposal op's last observation holds, or nil.
func pendingResolution(op store.Operation) *opbrokerv1.PendingResolution {
	if op.LastObservation == nil || op.LastObservation.Proposal == nil {
		return nil
	}
	p := op.LastObservation.Proposal
	resolution := opbrokerv1.ResolveOperationRequest_RESOLUTION_FAILED_TERMINAL
	if p.State == store.StateSucceeded {
		resolution = opbrokerv1.ResolveOperationRequest_RESOLUTION_SUCCEEDED
	}
	return &opbrokerv1.PendingResolution{Resolution: resolution, RemoteRef: p.RemoteRef,
		ProposedBy: strings.TrimPrefix(p.ProposedBy, operatorPrefix), ExpireTime: timestamppb.New(p.ExpiresAt)}
}

// statsPeriod is GetStats' default period, and maxStatsPeriod the longest it answers.
const (
	statsPeriod    = 7 * 24 * time.Hour
	maxStatsPeriod = 366 * 24 * time.Hour
)

// GetStats computes a period's statistics from the ledger, per tenant and target.
func (s *adminService) GetStats(ctx context.Context, req *opbrokerv1.GetStatsRequest) (*opbrokerv1.GetStatsResponse, error) {
	end := time.Now()
	var err error
	if req.GetEndTime() != nil {
		if end, err = timeOf("end_time", req.GetEndTime()); err != nil {
			return nil, toStatus(ctx, s.log, err)
		}
	}
	start := end.Add(-statsPeriod)
	if req.GetStartTime() != nil {
		if start, err = timeOf("start_time", req.GetStartTime()); err != nil {
			return nil, toStatus(ctx, s.log, err)
		}
	}
	if !start.Before(end) || end.Sub(start) > maxStatsPeriod {
		return nil, toStatus(ctx, s.log, invalidArgument(violation("start_time",
			"must be before end_time, and the period at most 366 days", ReasonFieldInvalid)))
	}
	targets := map[string]string{}
	for _, c := range s.targets.All() {
		for _, typ := range c.OperationTypes {
			targets[typ] = c.Name
		}
	}
	// The admitted scope: the request's tenant, or every tenant for a principal with all.
	rows, err := ledger(ctx, s.store).PeriodStats(ctx, store.PeriodParams{From: start, To: end, Targets: targets})
	if err != nil {
		return nil, toStatus(ctx, s.log, err)
	}
	resp := &opbrokerv1.GetStatsResponse{StartTime: timestamppb.New(start), EndTime: timestamppb.New(end)}
	for _, r := range rows {
		row := &opbrokerv1.GetStatsResponse_Row{Tenant: r.TenantID, Target: r.Target, UnknownEnteredByDay: r.UnknownEntered,
			Resolved: r.Resolved, MedianResolutionSeconds: r.MedianToResolution.Seconds(),
			WorstResolutionSeconds: r.WorstToResolution.Seconds(), OpenEscalated: r.OpenEscalated,
			OldestEscalationAgeSeconds: int64(r.OldestEscalation.Seconds()), PayloadMismatches: r.PayloadMismatches,
			OperationsByState: map[string]int64{}}
		for state, n := range r.ByState {
			row.OperationsByState[stateToProto(state).String()] = n
		}
		resp.Rows = append(resp.Rows, row)
	}
	return resp, nil
}

// ListEscalations lists ESCALATED operations, oldest first, with who owns them and how
// long they have waited.
func (s *adminService) ListEscalations(ctx context.Context, req *opbrokerv1.ListEscalationsRequest) (*opbrokerv1.ListEscalationsResponse, error) {
	size := int(req.GetPageSize())
	if size == 0 {
		size = defaultPageSize
	}
	after, err := decodeEscalationToken(req)
	if err != nil {
		return nil, toStatus(ctx, s.log, err)
	}
	params := store.EscalationsParams{TenantID: req.GetTenant(), Owner: req.GetOwner(), Limit: min(size, maxPageSize), After: after}
	if name := req.GetTarget(); name != "" {
		contract, ok := s.targets.ByName(name)
		if !ok {
			return &opbrokerv1.ListEscalationsResponse{}, nil // no target of that name: none of its operations
		}
		params.OperationTypes = contract.OperationTypes
	}
	escalated, more, err := ledger(ctx, s.store).Escalations(ctx, params)
	if err != nil {
		return nil, toStatus(ctx, s.log, err)
	}
	resp := &opbrokerv1.ListEscalationsResponse{More: more}
	if more {
		resp.NextPageToken = encodeEscalationToken(req, escalated[len(escalated)-1].Position)
	}
	for _, e := range escalated {
		item := &opbrokerv1.ListEscalationsResponse_Escalation{Operation: operationFor(ctx, s.targets, e.Operation),
			AgeSeconds: int64(e.Waited.Seconds()), PendingResolution: pendingResolution(e.Operation)}
		if contract, ok := s.targets.ForType(e.OperationType); ok {
			item.Target, item.Runbook = contract.Name, contract.Owner.Escalation
		}
		resp.Escalations = append(resp.Escalations, item)
	}
	return resp, nil
}

// GetTargetReadiness returns the go/no-go controls of every loaded target.
func (s *adminService) GetTargetReadiness(ctx context.Context, _ *opbrokerv1.GetTargetReadinessRequest) (*opbrokerv1.GetTargetReadinessResponse, error) {
	resp := &opbrokerv1.GetTargetReadinessResponse{}
	for _, c := range s.targets.All() {
		t := &opbrokerv1.GetTargetReadinessResponse_Target{Name: c.Name, OperationTypes: c.OperationTypes,
			Capabilities: c.Capabilities().String()}
		for _, r := range c.Controls() {
			t.Controls = append(t.Controls, &opbrokerv1.GetTargetReadinessResponse_Control{Number: int32(r.Number), Name: r.Name,
				Pass: r.Pass, Reason: r.Reason})
		}
		resp.Targets = append(resp.Targets, t)
	}
	return resp, nil
}
