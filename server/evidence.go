package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/opbroker/opbroker/auth"
	"github.com/opbroker/opbroker/evidence"
	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/target"
)

// evidenceService serves internal services that report a target's events.
type evidenceService struct {
	opbrokerv1.UnimplementedEvidenceServiceServer

	matcher *evidence.Matcher
	targets *target.Targets
	log     *slog.Logger
}

// ReportEvidence keeps and matches an event as a verified webhook's (evidence.Matcher),
// for the tenant the caller named; it answers no more than whether it was kept.
func (s *evidenceService) ReportEvidence(ctx context.Context, req *opbrokerv1.ReportEvidenceRequest) (*opbrokerv1.ReportEvidenceResponse, error) {
	contract, ok := s.targets.ByName(req.GetTarget())
	if !ok {
		return nil, toStatus(ctx, s.log, invalidArgument(violation("target", "is not the name of a loaded target", ReasonUnknownTarget)))
	}
	if contract.Evidence == nil {
		return nil, toStatus(ctx, s.log, newStatus(codes.FailedPrecondition,
			fmt.Sprintf("target %s reads no events: its contract has no evidence section", contract.Name),
			ReasonTargetReadsNoEvidence, map[string]string{"target": contract.Name}))
	}
	kept, fresh, err := s.matcher.Receive(ctx, contract, req.GetEvent(), evidence.Source{
		Reporter: auth.FromContext(ctx).Name, Tenant: req.GetTenant()})
	switch {
	case errors.Is(err, evidence.ErrIgnored):
		return &opbrokerv1.ReportEvidenceResponse{Ignored: true}, nil
	case errors.Is(err, target.ErrMalformedEvent):
		return nil, toStatus(ctx, s.log, invalidArgument(violation("event", err.Error(), ReasonEventInvalid)))
	case err != nil:
		return nil, toStatus(ctx, s.log, err)
	}
	return &opbrokerv1.ReportEvidenceResponse{EventId: kept.EventID, Duplicate: !fresh}, nil
}

// ListQuarantine lists the quarantined events, oldest first.
func (s *adminService) ListQuarantine(ctx context.Context, req *opbrokerv1.ListQuarantineRequest) (*opbrokerv1.ListQuarantineResponse, error) {
	size := int(req.GetPageSize())
	if size == 0 {
		size = defaultPageSize
	}
	p := store.QuarantineParams{Target: req.GetTarget(), Limit: min(size, maxPageSize)}
	if err := decodeQuarantineToken(req, &p); err != nil {
		return nil, toStatus(ctx, s.log, err)
	}
	events, more, err := ledger(ctx, s.store).Quarantine(ctx, p)
	if err != nil {
		return nil, toStatus(ctx, s.log, err)
	}
	resp := &opbrokerv1.ListQuarantineResponse{}
	for _, e := range events {
		resp.Events = append(resp.Events, quarantinedEvent(e))
	}
	if more {
		resp.NextPageToken = encodeQuarantineToken(req, events[len(events)-1])
	}
	return resp, nil
}

// ReviewQuarantine attaches a quarantined event to an operation, or dismisses it.
func (s *adminService) ReviewQuarantine(ctx context.Context, req *opbrokerv1.ReviewQuarantineRequest) (*opbrokerv1.ReviewQuarantineResponse, error) {
	reviewer := operatorActor(ctx)
	var reviewed store.InboundEvidence
	var err error
	resp := &opbrokerv1.ReviewQuarantineResponse{}
	if req.GetAction() == opbrokerv1.ReviewQuarantineRequest_REVIEW_ACTION_ATTACH {
		if req.GetOperation() == "" {
			return nil, toStatus(ctx, s.log, invalidArgument(violation("operation",
				"is required to attach an event: the operation it is about", ReasonFieldRequired)))
		}
		tenant, id, perr := parseOperationName("operation", req.GetOperation())
		if perr != nil {
			return nil, toStatus(ctx, s.log, perr)
		}
		reviewed, err = s.evidence.Attach(ctx, reviewKey(req), tenant, id, reviewer, req.GetNote())
		if err == nil {
			op, gerr := ledger(ctx, s.store).Get(ctx, tenant, id)
			if gerr != nil {
				return nil, toStatus(ctx, s.log, gerr)
			}
			resp.Operation = operationFor(ctx, s.targets, op)
		}
	} else {
		reviewed, err = s.evidence.Dismiss(ctx, reviewKey(req), reviewer, req.GetNote())
	}
	if err != nil {
		return nil, toStatus(ctx, s.log, reviewError(req, err))
	}
	s.log.WarnContext(ctx, "quarantined event reviewed", "principal", auth.FromContext(ctx).Name,
		"target", req.GetTarget(), "event_id", req.GetEventId(), "review", reviewed.Disposition)
	resp.Event = quarantinedEvent(reviewed)
	return resp, nil
}

// reviewKey is the event a review names.
func reviewKey(req *opbrokerv1.ReviewQuarantineRequest) store.EvidenceKey {
	return store.EvidenceKey{Target: req.GetTarget(), EventID: req.GetEventId(), Reporter: req.GetReporter()}
}

// reviewError turns the errors of a review into statuses; others pass to toStatus.
func reviewError(req *opbrokerv1.ReviewQuarantineRequest, err error) error {
	subject := req.GetTarget() + "/" + req.GetEventId()
	if req.GetReporter() != "" {
		subject += " reported by " + req.GetReporter()
	}
	precondition := func(reason, desc string) error {
		return newStatus(codes.FailedPrecondition, desc, reason, map[string]string{"target": req.GetTarget(), "eventId": req.GetEventId()},
			&errdetails.PreconditionFailure{Violations: []*errdetails.PreconditionFailure_Violation{
				{Type: "EVIDENCE", Subject: subject, Description: desc}}})
	}
	var mismatch *evidence.MismatchError
	switch {
	case errors.As(err, &mismatch):
		return precondition(ReasonEvidenceDoesNotMatch, mismatch.Error())
	case errors.Is(err, evidence.ErrNotQuarantined):
		return precondition(ReasonEvidenceNotQuarantined, "the event is not quarantined (any more): read the quarantine again")
	case errors.Is(err, evidence.ErrOtherTarget), errors.Is(err, evidence.ErrUnknownTarget), errors.Is(err, evidence.ErrBodyPurged):
		return precondition(ReasonEvidenceDoesNotMatch, err.Error())
	case errors.Is(err, store.ErrEvidenceChanged):
		return newStatus(codes.Aborted, "the event or its operation changed meanwhile: read them again", ReasonEvidenceChanged, nil)
	case errors.Is(err, store.ErrEvidenceNotFound):
		return newStatus(codes.NotFound, "no event of that target has that id from that sender (a reported event is named with its reporter)",
			ReasonEvidenceNotFound, nil, &errdetails.ResourceInfo{ResourceType: "opbroker.dev/Evidence", ResourceName: subject})
	}
	return err
}

// quarantinedEvent is the API's view of a quarantined (or reviewed) event.
func quarantinedEvent(e store.InboundEvidence) *opbrokerv1.QuarantinedEvent {
	q := &opbrokerv1.QuarantinedEvent{Target: e.Target, EventId: e.EventID, EventType: e.EventType,
		Reference: e.Reference, ReferenceKind: e.ReferenceKind, Reason: e.Reason, Detail: e.Detail,
		ReceiveTime: timestamppb.New(e.ReceivedAt), Source: e.Source, Reporter: e.Reporter, ClaimedTenant: e.ClaimedTenant,
		Body: e.Body, ReviewedBy: e.ReviewedBy, ReviewNote: e.ReviewNote}
	if e.TenantID != "" {
		q.Operation = operationName(e.TenantID, e.OperationID)
	}
	if e.ReviewedAt != nil {
		q.Review, q.ReviewTime = e.Disposition, timestamppb.New(*e.ReviewedAt)
	}
	return q
}
