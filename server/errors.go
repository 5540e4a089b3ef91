package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/protoadapt"

	"github.com/opbroker/opbroker/store"
)

// ErrorDomain is the domain of every ErrorInfo the broker sends. With the reason it forms
// a stable API: a (domain, reason) pair is never reused for another error.
const ErrorDomain = "opbroker.dev"

// Reasons of ErrorInfo, stable UPPER_SNAKE identifiers.
const (
	ReasonInvalidArgument             = "INVALID_ARGUMENT"
	ReasonOperationNotFound           = "OPERATION_NOT_FOUND"
	ReasonSupersededOperationNotFound = "SUPERSEDED_OPERATION_NOT_FOUND"
	ReasonSupersededUnresolved        = "SUPERSEDED_OPERATION_UNRESOLVED"
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
)

// invalidArgumentError carries field violations until toStatus renders them.
type invalidArgumentError struct {
	violations []*errdetails.BadRequest_FieldViolation
}

func (e *invalidArgumentError) Error() string {
	msg := "invalid request"
	for i, v := range e.violations {
		sep := ", "
		if i == 0 {
			sep = ": "
		}
		msg += sep + v.GetField() + " " + v.GetDescription()
	}
	return msg
}

func violation(field, description, reason string) *errdetails.BadRequest_FieldViolation {
	return &errdetails.BadRequest_FieldViolation{Field: field, Description: description, Reason: reason}
}

func invalidArgument(violations ...*errdetails.BadRequest_FieldViolation) error {
	return &invalidArgumentError{violations: violations}
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
		tenantErr  *tenantError
	)
	switch {
	case errors.As(err, &invalid):
		return newStatus(codes.InvalidArgument, invalid.Error(), ReasonInvalidArgument, nil,
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
	case errors.Is(err, context.Canceled):
		return newStatus(codes.Canceled, "the call was cancelled", ReasonCancelled, nil)
	case errors.Is(err, context.DeadlineExceeded):
		return newStatus(codes.DeadlineExceeded, "the call's deadline passed", ReasonDeadlineExceeded, nil)
	case errors.Is(err, store.ErrUnavailable):
		log.WarnContext(ctx, "database unavailable", "error", err)
		return newStatus(codes.Unavailable, "the ledger database is unavailable; retry with backoff", ReasonDatabaseUnavailable, nil)
	default:
		log.ErrorContext(ctx, "internal error", "error", err)
		return newStatus(codes.Internal, "internal error", ReasonInternal, nil)
	}
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
