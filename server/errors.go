package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/protoadapt"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/opbroker/opbroker/store"
)

// ErrorDomain is the domain of every ErrorInfo the broker sends. With the reason it forms
// a stable API: a (domain, reason) pair is never reused for another error.
const ErrorDomain = "opbroker.dev"

// Reasons of ErrorInfo, stable UPPER_SNAKE identifiers. docs/api.md's error table lists
// every reason a client can receive (TestEveryDocumentedReason keeps the two in step).
const (
	ReasonOperationNotFound           = "OPERATION_NOT_FOUND"
	ReasonSupersededOperationNotFound = "SUPERSEDED_OPERATION_NOT_FOUND"
	ReasonSupersededUnresolved        = "SUPERSEDED_OPERATION_UNRESOLVED"
	ReasonRevisionChanged             = "REVISION_CHANGED"
	ReasonBeingReconciled             = "BEING_RECONCILED"
	ReasonSendMayStillLand            = "SEND_MAY_STILL_LAND"
	ReasonTargetConfirmedEffect       = "TARGET_CONFIRMED_EFFECT"
	ReasonNoPendingResolution         = "NO_PENDING_RESOLUTION"
	ReasonSameOperator                = "SAME_OPERATOR"
	ReasonResolutionExpired           = "RESOLUTION_EXPIRED"
	ReasonIntentPayloadMismatch       = "INTENT_PAYLOAD_MISMATCH"
	ReasonOperationState              = "OPERATION_STATE"
	ReasonDatabaseUnavailable         = "DATABASE_UNAVAILABLE"
	ReasonCancelled                   = "CANCELLED"
	ReasonDeadlineExceeded            = "DEADLINE_EXCEEDED"
	ReasonInternal                    = "INTERNAL"
	ReasonInjectedFailure             = "INJECTED_FAILURE" // only with crash points enabled
	ReasonCredentialsMissing          = "CREDENTIALS_MISSING"
	ReasonCredentialsInvalid          = "CREDENTIALS_INVALID"
	ReasonRoleRequired                = "ROLE_REQUIRED"
	ReasonTenantNotPermitted          = "TENANT_NOT_PERMITTED"
	ReasonTenantRateLimited           = "TENANT_RATE_LIMITED"
	ReasonWatchLimit                  = "WATCH_LIMIT"
	ReasonTenantHasOpenOperations     = "TENANT_HAS_OPEN_OPERATIONS"
	ReasonTargetReadsNoEvidence       = "TARGET_READS_NO_EVIDENCE"
	ReasonEvidenceDoesNotMatch        = "EVIDENCE_DOES_NOT_MATCH"
	ReasonEvidenceNotQuarantined      = "EVIDENCE_NOT_QUARANTINED"
	ReasonEvidenceChanged             = "EVIDENCE_CHANGED"
	ReasonEvidenceNotFound            = "EVIDENCE_NOT_FOUND"
)

// Reasons of invalid input (INVALID_ARGUMENT). Each field violation of a BadRequest has
// one; the ErrorInfo has the violations' reason when they all have the same, and
// ReasonInvalidArgument when they differ (invalidArgumentError.reason).
const (
	// ReasonInvalidArgument: the violations have different reasons; see the BadRequest.
	ReasonInvalidArgument = "INVALID_ARGUMENT"
	// ReasonFieldRequired: a required field is missing (empty).
	ReasonFieldRequired = "FIELD_REQUIRED"
	// ReasonFieldInvalid: a field breaks its rule in the proto; the violation says the
	// rule in words.
	ReasonFieldInvalid          = "FIELD_INVALID"
	ReasonUnknownOperationType  = "UNKNOWN_OPERATION_TYPE"
	ReasonPayloadTooLarge       = "PAYLOAD_TOO_LARGE"
	ReasonPayloadInvalid        = "PAYLOAD_INVALID"
	ReasonSupersedesOtherTenant = "SUPERSEDES_OTHER_TENANT"
	ReasonDeadlinePassed        = "DEADLINE_PASSED"
	ReasonPageTokenInvalid      = "PAGE_TOKEN_INVALID"
	ReasonPageTokenMismatch     = "PAGE_TOKEN_MISMATCH"
	ReasonResumeTokenInvalid    = "RESUME_TOKEN_INVALID"
	ReasonResumeTokenMismatch   = "RESUME_TOKEN_MISMATCH"
	ReasonUnknownTarget         = "UNKNOWN_TARGET"
	ReasonEventInvalid          = "EVENT_INVALID"
	// ReasonRequestMalformed: the request's bytes are not a message of its type.
	ReasonRequestMalformed = "REQUEST_MALFORMED"
)

// invalidArgumentError carries field violations until toStatus renders them.
type invalidArgumentError struct {
	violations []*errdetails.BadRequest_FieldViolation
}

// Error is every violation as "field: description", separated by semicolons.
func (e *invalidArgumentError) Error() string {
	parts := make([]string, len(e.violations))
	for i, v := range e.violations {
		parts[i] = v.GetField() + ": " + v.GetDescription()
	}
	return strings.Join(parts, "; ")
}

// reason is the violations' reason when they all have the same, otherwise
// ReasonInvalidArgument: a client that switches on the ErrorInfo's reason can act on it
// whenever there is one thing to act on.
func (e *invalidArgumentError) reason() string {
	if len(e.violations) == 0 {
		return ReasonInvalidArgument
	}
	reason := e.violations[0].GetReason()
	for _, v := range e.violations[1:] {
		if v.GetReason() != reason {
			return ReasonInvalidArgument
		}
	}
	return reason
}

// violation is a field violation. The message shows description after "field: ", so it
// says what the field must be ("is required", "must be …") without naming the field
// again; reason is one of the INVALID_ARGUMENT reasons.
func violation(field, description, reason string) *errdetails.BadRequest_FieldViolation {
	return &errdetails.BadRequest_FieldViolation{Field: field, Description: description, Reason: reason}
}

// timeOf reads the timestamp field of that name. One that no Timestamp may hold (before
// the year 1 or after 9999, or nanoseconds out of range) is refused: converted as it
// is, it would reach the ledger as another time.
func timeOf(field string, ts *timestamppb.Timestamp) (time.Time, error) {
	if err := ts.CheckValid(); err != nil {
		return time.Time{}, invalidArgument(violation(field, "must be a valid time, from the year 1 to 9999", ReasonFieldInvalid))
	}
	return ts.AsTime(), nil
}

// invalidArgument is the error of invalid input. A violation that repeats an earlier one
// (one field breaking two rules stated in the same words) is dropped.
func invalidArgument(violations ...*errdetails.BadRequest_FieldViolation) error {
	kept := make([]*errdetails.BadRequest_FieldViolation, 0, len(violations))
	for _, v := range violations {
		if !slices.ContainsFunc(kept, func(k *errdetails.BadRequest_FieldViolation) bool {
			return k.GetField() == v.GetField() && k.GetDescription() == v.GetDescription() && k.GetReason() == v.GetReason()
		}) {
			kept = append(kept, v)
		}
	}
	return &invalidArgumentError{violations: kept}
}

// tenantError is the error of a call on a whole tenant, naming the tenant for toStatus
// (the store's errors do not carry it).
type tenantError struct {
	tenant string
	err    error
}

func (e *tenantError) Error() string { return fmt.Sprintf("tenant %s: %v", e.tenant, e.err) }
func (e *tenantError) Unwrap() error { return e.err }

// toStatus is the one table from domain errors to gRPC statuses. Unexpected errors are
// logged here (they carry no payload) and become INTERNAL without their text.
func toStatus(ctx context.Context, log *slog.Logger, err error) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err // already a status, e.g. from a library
	}
	var (
		invalid    *invalidArgumentError
		mismatch   *store.PayloadMismatchError
		stateErr   *store.StateError
		unresolved *store.SupersededUnresolvedError
		revChanged *store.RevisionChangedError
		mayLand    *store.SendMayStillLandError
		confirmed  *store.TargetConfirmedError
		tenantErr  *tenantError
	)
	switch {
	case errors.As(err, &invalid):
		return newStatus(codes.InvalidArgument, invalid.Error(), invalid.reason(), nil,
			&errdetails.BadRequest{FieldViolations: invalid.violations})
	case errors.As(err, &mismatch):
		name := operationName(mismatch.Existing.TenantID, mismatch.Existing.ID)
		return newStatus(codes.AlreadyExists,
			"this intent is already recorded with another payload; a changed payload needs a new intent_ref (see the existing operation)",
			ReasonIntentPayloadMismatch,
			map[string]string{"operation": name, "existingPayloadSha256": fmt.Sprintf("%x", mismatch.Existing.PayloadSHA256)},
			&errdetails.ResourceInfo{ResourceType: "opbroker.dev/Operation", ResourceName: name,
				Description: "the operation that already records this intent"})
	case errors.As(err, &stateErr):
		name := operationName(stateErr.Operation.TenantID, stateErr.Operation.ID)
		desc := fmt.Sprintf("operation is %s; this requires %s", stateErr.Operation.State, stateErr.Want)
		return newStatus(codes.FailedPrecondition, desc, ReasonOperationState,
			map[string]string{"operation": name, "state": "STATE_" + string(stateErr.Operation.State)},
			&errdetails.PreconditionFailure{Violations: []*errdetails.PreconditionFailure_Violation{
				{Type: "STATE", Subject: name, Description: desc}}})
	case errors.As(err, &revChanged):
		return newStatus(codes.Aborted, "the operation changed since that revision: read it again and decide on what it is now",
			ReasonRevisionChanged, map[string]string{"currentRevision": fmt.Sprint(revChanged.Current)})
	case errors.Is(err, store.ErrNoProposal):
		return newStatus(codes.FailedPrecondition, "no resolution is waiting for approval on this operation",
			ReasonNoPendingResolution, nil)
	case errors.Is(err, store.ErrSameOperator):
		return newStatus(codes.FailedPrecondition, "a resolution must be approved by another operator than the one who proposed it",
			ReasonSameOperator, nil)
	case errors.Is(err, store.ErrProposalExpired):
		return newStatus(codes.FailedPrecondition, "the proposed resolution expired: propose it again with ResolveOperation",
			ReasonResolutionExpired, nil)
	case errors.As(err, &mayLand):
		wait := (mayLand.Wait + time.Second - 1).Truncate(time.Second) // whole seconds, never short
		desc := fmt.Sprintf("the operation's last send may still take effect, or its effect not be visible at the target yet: "+
			"look at the target again and resolve it as FAILED_TERMINAL after %s", wait)
		return newStatus(codes.FailedPrecondition, desc, ReasonSendMayStillLand,
			map[string]string{"retryAfterSeconds": fmt.Sprint(int64(wait / time.Second))},
			&errdetails.PreconditionFailure{Violations: []*errdetails.PreconditionFailure_Violation{
				{Type: "LAST_SEND", Description: desc}}},
			&errdetails.RetryInfo{RetryDelay: durationpb.New(wait)})
	case errors.As(err, &confirmed):
		desc := "the target answered one of the operation's sends with a verified success (its answer came after the send's lease): " +
			"the effect exists, whatever a later look at the target showed; resolve it as SUCCEEDED with the reference in remoteRef"
		meta := map[string]string{"remoteRef": confirmed.RemoteRef}
		if confirmed.EventID != "" {
			desc = "the target's event " + confirmed.EventID + " said the operation succeeded, and was matched to it: " +
				"the effect exists, whatever a later look at the target showed; resolve it as SUCCEEDED with the reference in remoteRef " +
				"(ask the target for it where the event carried none)"
			meta["eventId"] = confirmed.EventID
		}
		return newStatus(codes.FailedPrecondition, desc, ReasonTargetConfirmedEffect, meta,
			&errdetails.PreconditionFailure{Violations: []*errdetails.PreconditionFailure_Violation{
				{Type: "TARGET_ANSWER", Description: desc}}})
	case errors.Is(err, store.ErrBeingReconciled):
		return newStatus(codes.Aborted, "a reconciler is working on the operation at this moment: retry in a few seconds",
			ReasonBeingReconciled, nil)
	case errors.As(err, &unresolved):
		name := operationName(unresolved.Superseded.TenantID, unresolved.Superseded.ID)
		desc := fmt.Sprintf("the superseded operation is %s: its effect may still happen, or may have happened unconfirmed; amend it once it is resolved",
			unresolved.Superseded.State)
		return newStatus(codes.FailedPrecondition, desc, ReasonSupersededUnresolved,
			map[string]string{"operation": name, "state": "STATE_" + string(unresolved.Superseded.State)},
			&errdetails.PreconditionFailure{Violations: []*errdetails.PreconditionFailure_Violation{
				{Type: "STATE", Subject: name, Description: desc}}})
	case errors.As(err, &tenantErr) && errors.Is(tenantErr.err, store.ErrTenantHasOpenOperations):
		return newStatus(codes.FailedPrecondition,
			"the tenant has operations that are PREPARED, IN_FLIGHT, UNKNOWN or ESCALATED; cancel or resolve them first",
			ReasonTenantHasOpenOperations, map[string]string{"tenant": tenantErr.tenant},
			&errdetails.PreconditionFailure{Violations: []*errdetails.PreconditionFailure_Violation{
				{Type: "OPEN_OPERATIONS", Subject: "tenants/" + tenantErr.tenant, Description: "operations not in a terminal state"}}})
	case errors.Is(err, store.ErrSupersededNotFound):
		return newStatus(codes.NotFound, "the operation named in supersedes does not exist in this tenant",
			ReasonSupersededOperationNotFound, nil,
			&errdetails.ResourceInfo{ResourceType: "opbroker.dev/Operation", Description: "supersedes"})
	case errors.Is(err, store.ErrNotFound):
		return newStatus(codes.NotFound, "operation not found", ReasonOperationNotFound, nil,
			&errdetails.ResourceInfo{ResourceType: "opbroker.dev/Operation"})
	case errors.Is(err, context.Canceled) && !deadlinePassed(ctx):
		return newStatus(codes.Canceled, "the call was cancelled", ReasonCancelled, nil)
	case errors.Is(err, context.Canceled):
		// gRPC ends a call whose deadline passes by cancelling its context, which races
		// with the context's own deadline: the deadline is what happened.
		return newStatus(codes.DeadlineExceeded, "the call's deadline passed", ReasonDeadlineExceeded, nil)
	case errors.Is(err, context.DeadlineExceeded) && deadlinePassed(ctx):
		return newStatus(codes.DeadlineExceeded, "the call's deadline passed", ReasonDeadlineExceeded, nil)
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, store.ErrUnavailable):
		// A bound of the broker's own (a combined write's 30 s, say), not the caller's
		// deadline, ran out: the ledger did not answer in time.
		log.WarnContext(ctx, "database unavailable", "error", err)
		return newStatus(codes.Unavailable, "the ledger database is unavailable; retry with backoff", ReasonDatabaseUnavailable, nil)
	default:
		log.ErrorContext(ctx, "internal error", "error", err)
		return newStatus(codes.Internal, "internal error", ReasonInternal, nil)
	}
}

// deadlinePassed reports whether the call in ctx has a deadline that has passed.
func deadlinePassed(ctx context.Context) bool {
	deadline, ok := ctx.Deadline()
	return ok && !time.Now().Before(deadline)
}

func newStatus(code codes.Code, msg, reason string, metadata map[string]string, details ...protoadapt.MessageV1) error {
	st := status.New(code, msg)
	all := append([]protoadapt.MessageV1{&errdetails.ErrorInfo{Reason: reason, Domain: ErrorDomain, Metadata: metadata}}, details...)
	withDetails, err := st.WithDetails(all...)
	if err != nil {
		return st.Err()
	}
	return withDetails.Err()
}
