package server

import (
	"context"
	"encoding/hex"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/opbroker/opbroker/auth"
	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/target"
)

func stateToProto(s store.State) opbrokerv1.Operation_State {
	return opbrokerv1.Operation_State(opbrokerv1.Operation_State_value["STATE_"+string(s)])
}

func stateFromProto(s opbrokerv1.Operation_State) store.State {
	return store.State(s.String()[len("STATE_"):])
}

func statesFromProto(states []opbrokerv1.Operation_State) []store.State {
	out := make([]store.State, len(states))
	for i, st := range states {
		out[i] = stateFromProto(st)
	}
	return out
}

// operationFor renders op for the caller in ctx. Operator and support-read principals,
// who look into escalations, also see the key the operation is sent with and where the
// target answers for it; a client does not need them, and the key identifies the
// operation at the target.
func operationFor(ctx context.Context, targets *target.Targets, op store.Operation) *opbrokerv1.Operation {
	out := operationToProto(op)
	if p := auth.FromContext(ctx); p != nil && p.Has(auth.RoleOperator, auth.RoleSupportRead) {
		out.RemoteKey = op.RemoteKey.String()
		if c, ok := targets.ForType(op.OperationType); ok {
			out.LookupUrl = c.LookupURL(op.RemoteKey)
		}
	}
	return out
}

func operationToProto(op store.Operation) *opbrokerv1.Operation {
	out := &opbrokerv1.Operation{
		Name:             operationName(op.TenantID, op.ID),
		Tenant:           op.TenantID,
		OperationType:    op.OperationType,
		IntentRef:        op.IntentRef,
		PayloadSha256:    hex.EncodeToString(op.PayloadSHA256),
		ContentType:      op.ContentType,
		State:            stateToProto(op.State),
		Revision:         op.Revision,
		FenceToken:       op.FenceToken,
		AttemptCount:     op.AttemptCount,
		RemoteRef:        op.RemoteRef,
		Labels:           op.Labels,
		DispatchDeadline: timestamp(op.DispatchDeadline),
		CreateTime:       timestamppb.New(op.CreatedAt),
		UpdateTime:       timestamppb.New(op.UpdatedAt),
		FirstSendTime:    timestamp(op.FirstSentAt),
		NextCheckTime:    timestamp(op.NextCheckAt),
		NotBefore:        timestamp(op.NotBefore),
	}
	if e := op.Escalation; e != nil {
		out.Escalation = &opbrokerv1.Operation_Escalation{Owner: e.Owner, Reason: e.Reason, EscalateTime: timestamppb.New(e.EscalatedAt)}
	}
	if c := op.Contradiction; c != nil {
		out.Contradiction = &opbrokerv1.Operation_Contradiction{RemoteRef: c.RemoteRef, RecordTime: timestamppb.New(c.RecordedAt)}
	}
	if op.SupersedesID.Valid {
		out.Supersedes = operationName(op.TenantID, op.SupersedesID.UUID)
	}
	out.LastObservation = observationToProto(op.LastObservation)
	return out
}

func observationToProto(obs *store.Observation) *opbrokerv1.Operation_Observation {
	if obs == nil {
		return nil
	}
	return &opbrokerv1.Operation_Observation{
		ObserveTime: timestamppb.New(obs.ObservedAt),
		Source:      opbrokerv1.Operation_Source(opbrokerv1.Operation_Source_value["SOURCE_"+obs.Source]),
		Outcome:     obs.Outcome,
		HttpStatus:  int32(obs.HTTPStatus),
		Summary:     obs.Summary,
	}
}

func eventToProto(e store.Event) *opbrokerv1.OperationEvent {
	out := &opbrokerv1.OperationEvent{Revision: e.Revision, ToState: stateToProto(e.State), Actor: e.Actor,
		Reason: e.Reason, Observation: observationToProto(e.Observation), FenceToken: e.FenceToken,
		CreateTime: timestamppb.New(e.At)}
	if e.From != nil {
		out.FromState = stateToProto(*e.From)
	}
	return out
}

func timestamp(t *time.Time) *timestamppb.Timestamp {
	if t == nil {
		return nil
	}
	return timestamppb.New(*t)
}
