package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/google/uuid"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"google.golang.org/grpc/codes"

	"github.com/opbroker/opbroker/auth"
	"github.com/opbroker/opbroker/crashpoint"
	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/payload"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/target"
	"github.com/opbroker/opbroker/tracing"
	"github.com/opbroker/opbroker/watch"
)

const (
	defaultPageSize = 50
	maxPageSize     = 1000
)

// operationService implements opbrokerv1.OperationServiceServer.
type operationService struct {
	opbrokerv1.UnimplementedOperationServiceServer

	store      *store.Store
	targets    *target.Targets
	log        *slog.Logger
	maxPayload int
	now        func() time.Time
	prepares   metric.Int64Counter
	hub        *watch.Hub
	heartbeat  time.Duration
	closing    <-chan struct{} // closed when the server stops: watches end
}

func (s *operationService) PrepareOperation(ctx context.Context, req *opbrokerv1.PrepareOperationRequest) (*opbrokerv1.PrepareOperationResponse, error) {
	op, created, err := s.prepare(ctx, req)
	result := "created"
	switch {
	case errors.As(err, new(*store.PayloadMismatchError)):
		result = "payload_mismatch"
	case err != nil:
		result = "error"
	case !created:
		result = "replayed"
	}
	s.prepares.Add(ctx, 1, metric.WithAttributes(attribute.String("result", result)))
	if err != nil {
		return nil, toStatus(ctx, s.log, err)
	}
	if err := crashpoint.Hit(crashpoint.PrepareAfterCommit); err != nil {
		// The intent is durable; the client retries and finds it.
		return nil, newStatus(codes.Unavailable, "injected failure after commit; retry", ReasonInjectedFailure, nil)
	}
	return &opbrokerv1.PrepareOperationResponse{Operation: operationFor(ctx, s.targets, op), Created: created}, nil
}

func (s *operationService) prepare(ctx context.Context, req *opbrokerv1.PrepareOperationRequest) (store.Operation, bool, error) {
	if _, ok := s.targets.ForType(req.GetOperationType()); !ok {
		return store.Operation{}, false, unknownOperationType(s.targets)
	}
	if len(req.GetPayload()) > s.maxPayload {
		return store.Operation{}, false, invalidArgument(violation("payload",
			fmt.Sprintf("must be at most %d bytes", s.maxPayload), "PAYLOAD_TOO_LARGE"))
	}
	digest, err := payload.Hash(req.GetContentType(), req.GetPayload())
	if err != nil {
		return store.Operation{}, false, invalidPayload(err)
	}
	params := store.PrepareParams{
		TenantID:      req.GetTenant(),
		OperationType: req.GetOperationType(),
		IntentRef:     req.GetIntentRef(),
		ContentType:   req.GetContentType(),
		Payload:       req.GetPayload(),
		PayloadSHA256: digest[:],
		Labels:        req.GetLabels(),
		Actor:         clientActor(ctx),
		TraceParent:   tracing.TraceParent(ctx),
	}
	if name := req.GetSupersedes(); name != "" {
		tenant, id, err := parseOperationName("supersedes", name)
		if err != nil {
			return store.Operation{}, false, err
		}
		if tenant != req.GetTenant() {
			return store.Operation{}, false, invalidArgument(violation("supersedes", "must name an operation of the same tenant", "SUPERSEDES_OTHER_TENANT"))
		}
		params.SupersedesID = uuid.NullUUID{UUID: id, Valid: true}
	}
	if req.GetNotBefore() != nil {
		notBefore, err := timeOf("not_before", req.GetNotBefore())
		if err != nil {
			return store.Operation{}, false, err
		}
		params.NotBefore = &notBefore
	}
	if req.GetDispatchDeadline() != nil {
		deadline, err := timeOf("dispatch_deadline", req.GetDispatchDeadline())
		if err != nil {
			return store.Operation{}, false, err
		}
		if params.NotBefore != nil && !deadline.After(*params.NotBefore) {
			return store.Operation{}, false, invalidArgument(violation("dispatch_deadline", "must be after not_before", ReasonFieldInvalid))
		}
		params.DispatchDeadline = &deadline
		if !deadline.After(s.now()) {
			params.RejectCreation = invalidArgument(violation("dispatch_deadline", "must be in the future", "DEADLINE_PASSED"))
		}
	}
	return ledger(ctx, s.store).Prepare(ctx, params)
}

func (s *operationService) GetOperation(ctx context.Context, req *opbrokerv1.GetOperationRequest) (*opbrokerv1.GetOperationResponse, error) {
	tenant, id, err := parseOperationName("name", req.GetName())
	if err != nil {
		return nil, toStatus(ctx, s.log, err)
	}
	op, err := ledger(ctx, s.store).Get(ctx, tenant, id)
	if err != nil {
		return nil, toStatus(ctx, s.log, err)
	}
	return &opbrokerv1.GetOperationResponse{Operation: operationFor(ctx, s.targets, op)}, nil
}

func (s *operationService) ListOperations(ctx context.Context, req *opbrokerv1.ListOperationsRequest) (*opbrokerv1.ListOperationsResponse, error) {
	states := statesFromProto(req.GetStates())
	scope := newScope(req.GetTenant(), states, req.GetIntentRef(), req.GetRemoteRef())
	before, err := decodePageToken(req.GetPageToken(), scope)
	if err != nil {
		return nil, toStatus(ctx, s.log, err)
	}
	size := int(req.GetPageSize())
	switch {
	case size == 0:
		size = defaultPageSize
	case size > maxPageSize:
		size = maxPageSize
	}
	params := store.ListParams{TenantID: req.GetTenant(), States: states, IntentRef: req.GetIntentRef(), RemoteRef: req.GetRemoteRef(),
		Before: before, Limit: size}
	if params.IntentRef != "" {
		for _, c := range s.targets.All() {
			params.OperationTypes = append(params.OperationTypes, c.OperationTypes...)
		}
	}
	ops, more, err := ledger(ctx, s.store).List(ctx, params)
	if err != nil {
		return nil, toStatus(ctx, s.log, err)
	}
	resp := &opbrokerv1.ListOperationsResponse{Operations: make([]*opbrokerv1.Operation, len(ops))}
	for i, op := range ops {
		resp.Operations[i] = operationFor(ctx, s.targets, op)
	}
	if more {
		resp.NextPageToken = encodeToken(pageToken{tokenScope: scope, After: ops[len(ops)-1].ID})
	}
	return resp, nil
}

func (s *operationService) CancelOperation(ctx context.Context, req *opbrokerv1.CancelOperationRequest) (*opbrokerv1.CancelOperationResponse, error) {
	tenant, id, err := parseOperationName("name", req.GetName())
	if err != nil {
		return nil, toStatus(ctx, s.log, err)
	}
	op, err := ledger(ctx, s.store).Cancel(ctx, store.CancelParams{TenantID: tenant, ID: id, Actor: clientActor(ctx)})
	if err != nil {
		return nil, toStatus(ctx, s.log, err)
	}
	return &opbrokerv1.CancelOperationResponse{Operation: operationFor(ctx, s.targets, op)}, nil
}

// clientActor is what the events of a client's call record as their actor: client:
// and the principal's name.
func clientActor(ctx context.Context) string {
	if p := auth.FromContext(ctx); p != nil {
		return "client:" + p.Name
	}
	return "client"
}

// ListOperationEvents returns an operation's history from the ledger's events.
func (s *operationService) ListOperationEvents(ctx context.Context, req *opbrokerv1.ListOperationEventsRequest) (*opbrokerv1.ListOperationEventsResponse, error) {
	tenant, id, err := parseOperationName("name", req.GetName())
	if err != nil {
		return nil, toStatus(ctx, s.log, err)
	}
	size := int(req.GetPageSize())
	if size == 0 {
		size = defaultPageSize
	}
	size = min(size, maxPageSize)
	scope := ledger(ctx, s.store)
	if _, err := scope.Get(ctx, tenant, id); err != nil { // another tenant's is NOT_FOUND
		return nil, toStatus(ctx, s.log, err)
	}
	events, err := scope.Events(ctx, tenant, id, req.GetStartAfterRevision(), size+1)
	if err != nil {
		return nil, toStatus(ctx, s.log, err)
	}
	resp := &opbrokerv1.ListOperationEventsResponse{More: len(events) > size}
	for _, e := range events[:min(len(events), size)] {
		resp.Events = append(resp.Events, eventToProto(e))
	}
	return resp, nil
}
