package server_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/server"
)

// violationsOf returns the BadRequest's violations as "field: description (REASON)".
func violationsOf(st *status.Status) []string {
	var out []string
	for _, d := range st.Details() {
		if br, ok := d.(*errdetails.BadRequest); ok {
			for _, v := range br.GetFieldViolations() {
				out = append(out, v.GetField()+": "+v.GetDescription()+" ("+v.GetReason()+")")
			}
		}
	}
	return out
}

// TestValidationMessages: what a client is told about invalid input, word for word: a
// missing field is required, a malformed one gets its rule in words with an example, and
// the ErrorInfo's reason is the violations' reason, or INVALID_ARGUMENT when they differ.
func TestValidationMessages(t *testing.T) {
	t.Parallel()
	b := setup(t)
	admin := opbrokerv1.NewAdminServiceClient(b.conn)
	prepare := func(change func(*opbrokerv1.PrepareOperationRequest)) func() error {
		return func() error {
			req := prepareRequest("acme", "order-1", `{"amount":1}`)
			change(req)
			_, err := b.client.PrepareOperation(b.ctx, req)
			return err
		}
	}
	list := func(req *opbrokerv1.ListOperationsRequest) func() error {
		return func() error {
			_, err := b.client.ListOperations(b.ctx, req)
			return err
		}
	}
	const (
		tenantRule = `must be 1–63 lowercase letters, digits and hyphens, starting with a letter and not ending with a hyphen, e.g. "acme"`
		nameRule   = `must be an operation's name, tenants/{tenant}/operations/{id} with the id a lowercase UUID, e.g. "tenants/acme/operations/01a2294c-8210-7121-b2a6-1446b69b992d"`
		nulRule    = "must not contain the NUL character (U+0000) (FIELD_INVALID)"
		stateRule  = "must be one of STATE_PREPARED, STATE_IN_FLIGHT, STATE_SUCCEEDED, STATE_FAILED_TERMINAL, STATE_UNKNOWN, STATE_ESCALATED, STATE_CANCELLED"
	)
	manyLabels := map[string]string{}
	for _, k := range strings.Split("abcdefghijklmnopq", "") {
		manyLabels[k] = "v"
	}

	for name, tc := range map[string]struct {
		call       func() error
		reason     string   // the ErrorInfo's
		violations []string // "field: description (REASON)"
	}{
		"nothing": {func() error {
			_, err := b.client.PrepareOperation(b.ctx, &opbrokerv1.PrepareOperationRequest{})
			return err
		}, server.ReasonFieldRequired, []string{
			"tenant: is required (FIELD_REQUIRED)",
			"operation_type: is required (FIELD_REQUIRED)",
			"intent_ref: is required (FIELD_REQUIRED)",
			"payload: is required (FIELD_REQUIRED)",
			"content_type: is required (FIELD_REQUIRED)",
		}},
		"tenant starting with a digit": {prepare(func(r *opbrokerv1.PrepareOperationRequest) { r.Tenant = "9acme" }),
			server.ReasonFieldInvalid, []string{"tenant: " + tenantRule + " (FIELD_INVALID)"}},
		"tenant ending with a hyphen": {prepare(func(r *opbrokerv1.PrepareOperationRequest) { r.Tenant = "acme-" }),
			server.ReasonFieldInvalid, []string{"tenant: " + tenantRule + " (FIELD_INVALID)"}},
		"tenant too long": {prepare(func(r *opbrokerv1.PrepareOperationRequest) { r.Tenant = strings.Repeat("a", 64) }),
			server.ReasonFieldInvalid, []string{"tenant: " + tenantRule + " (FIELD_INVALID)"}},
		"required and malformed": {prepare(func(r *opbrokerv1.PrepareOperationRequest) { r.Tenant, r.ContentType = "", "json" }),
			server.ReasonInvalidArgument, []string{
				"tenant: is required (FIELD_REQUIRED)",
				`content_type: must be a media type of at most 127 characters, type and subtype in lowercase, optionally with parameters after ";" without control characters, e.g. "application/json" (FIELD_INVALID)`,
			}},
		"operation type": {prepare(func(r *opbrokerv1.PrepareOperationRequest) { r.OperationType = "Charge!" }),
			server.ReasonFieldInvalid, []string{`operation_type: must be at most 128 characters: lowercase words of letters, digits and underscores, each starting with a letter, joined by dots, e.g. "demo.charge" (FIELD_INVALID)`}},
		"operation type too long, one violation": {prepare(func(r *opbrokerv1.PrepareOperationRequest) { r.OperationType = strings.Repeat("A", 129) }),
			server.ReasonFieldInvalid, []string{`operation_type: must be at most 128 characters: lowercase words of letters, digits and underscores, each starting with a letter, joined by dots, e.g. "demo.charge" (FIELD_INVALID)`}},
		"intent with control characters, too long": {prepare(func(r *opbrokerv1.PrepareOperationRequest) { r.IntentRef = strings.Repeat("\n", 257) }),
			server.ReasonFieldInvalid, []string{`intent_ref: must be 1–256 bytes without control characters, e.g. "order-1001" (FIELD_INVALID)`}},
		"supersedes": {prepare(func(r *opbrokerv1.PrepareOperationRequest) { r.Supersedes = "operations/1" }),
			server.ReasonFieldInvalid, []string{"supersedes: " + nameRule + " (FIELD_INVALID)"}},
		"too many labels": {prepare(func(r *opbrokerv1.PrepareOperationRequest) { r.Labels = manyLabels }),
			server.ReasonFieldInvalid, []string{"labels: must have at most 16 entries (FIELD_INVALID)"}},
		"label key": {prepare(func(r *opbrokerv1.PrepareOperationRequest) { r.Labels = map[string]string{"Bad Key": "v"} }),
			server.ReasonFieldInvalid, []string{`labels["Bad Key"]: must have a key of 1–63 characters: a lowercase letter, then lowercase letters, digits, "_", "." or "-", e.g. "team" (FIELD_INVALID)`}},
		"label value": {prepare(func(r *opbrokerv1.PrepareOperationRequest) {
			r.Labels = map[string]string{"k": strings.Repeat("v", 257)}
		}),
			server.ReasonFieldInvalid, []string{`labels["k"]: must be a value of at most 256 bytes (FIELD_INVALID)`}},
		"get without a name": {func() error {
			_, err := b.client.GetOperation(b.ctx, &opbrokerv1.GetOperationRequest{})
			return err
		}, server.ReasonFieldRequired, []string{"name: is required (FIELD_REQUIRED)"}},
		"cancel with a malformed name": {func() error {
			_, err := b.client.CancelOperation(b.ctx, &opbrokerv1.CancelOperationRequest{Name: "tenants/acme/operations/42"})
			return err
		}, server.ReasonFieldInvalid, []string{"name: " + nameRule + " (FIELD_INVALID)"}},
		"negative page size": {list(&opbrokerv1.ListOperationsRequest{Tenant: "acme", PageSize: -1}),
			server.ReasonFieldInvalid, []string{"page_size: must be 0 (meaning 50) or more; more than 1000 means 1000 (FIELD_INVALID)"}},
		"over-long page token": {list(&opbrokerv1.ListOperationsRequest{Tenant: "acme", PageToken: strings.Repeat("x", 1025)}),
			server.ReasonPageTokenInvalid, []string{"page_token: is not a token of this call; start again without one (PAGE_TOKEN_INVALID)"}},
		"unspecified and unknown states": {list(&opbrokerv1.ListOperationsRequest{Tenant: "acme", States: []opbrokerv1.Operation_State{0, 99}}),
			server.ReasonFieldInvalid, []string{"states[0]: " + stateRule + " (FIELD_INVALID)", "states[1]: " + stateRule + " (FIELD_INVALID)"}},
		"a state twice": {list(&opbrokerv1.ListOperationsRequest{Tenant: "acme", States: []opbrokerv1.Operation_State{1, 1}}),
			server.ReasonFieldInvalid, []string{"states: must not name a state twice (FIELD_INVALID)"}},
		"too many states": {list(&opbrokerv1.ListOperationsRequest{Tenant: "acme", States: []opbrokerv1.Operation_State{1, 2, 3, 4, 5, 6, 7, 1}}),
			server.ReasonFieldInvalid, []string{"states: must have at most 7 entries (FIELD_INVALID)", "states: must not name a state twice (FIELD_INVALID)"}},
		"negative revision": {func() error {
			return recvFirst(b.client.WatchOperation(b.ctx, &opbrokerv1.WatchOperationRequest{
				Name: "tenants/acme/operations/0190a4a8-0000-7000-8000-000000000000", StartAfterRevision: -1}))
		}, server.ReasonFieldInvalid, []string{"start_after_revision: must be 0 (to start with the current state) or the last revision the client saw (FIELD_INVALID)"}},
		"over-long resume token": {func() error {
			return recvFirst(b.client.WatchOperations(b.ctx, &opbrokerv1.WatchOperationsRequest{Tenant: "acme", ResumeToken: strings.Repeat("x", 8193)}))
		}, server.ReasonResumeTokenInvalid, []string{"resume_token: is not a token of this call; start again without one (RESUME_TOKEN_INVALID)"}},
		"NUL in a label": {prepare(func(r *opbrokerv1.PrepareOperationRequest) { r.Labels = map[string]string{"team": "a\x00b"} }),
			server.ReasonFieldInvalid, []string{"labels: " + nulRule}},
		"NUL in a media type's parameter": {prepare(func(r *opbrokerv1.PrepareOperationRequest) { r.ContentType = "application/json; x=\x00" }),
			server.ReasonFieldInvalid, []string{"content_type: " + nulRule}},
		"a control character in a media type's parameter": {prepare(func(r *opbrokerv1.PrepareOperationRequest) { r.ContentType = "application/json; x=\x01" }),
			server.ReasonFieldInvalid, []string{`content_type: must be a media type of at most 127 characters, type and subtype in lowercase, optionally with parameters after ";" without control characters, e.g. "application/json" (FIELD_INVALID)`}},
		"NUL in a filter": {list(&opbrokerv1.ListOperationsRequest{Tenant: "acme", RemoteRef: "a\x00b"}),
			server.ReasonFieldInvalid, []string{"remote_ref: " + nulRule}},
		"NUL in an escalation's owner": {func() error {
			_, err := admin.ListEscalations(b.ctx, &opbrokerv1.ListEscalationsRequest{Owner: "a\x00"})
			return err
		}, server.ReasonFieldInvalid, []string{"owner: " + nulRule}},
		"NUL in a resolution's reason": {func() error {
			_, err := admin.ResolveOperation(b.ctx, &opbrokerv1.ResolveOperationRequest{Name: "tenants/acme/operations/0190a4a8-0000-7000-8000-000000000000",
				Revision: 1, Resolution: opbrokerv1.ResolveOperationRequest_RESOLUTION_FAILED_TERMINAL, Reason: "x\x00y", Evidence: "checked"})
			return err
		}, server.ReasonFieldInvalid, []string{"reason: " + nulRule}},
		"delete without a tenant": {func() error {
			_, err := admin.DeleteTenantData(b.ctx, &opbrokerv1.DeleteTenantDataRequest{})
			return err
		}, server.ReasonFieldRequired, []string{"tenant: is required (FIELD_REQUIRED)"}},
	} {
		t.Run(name, func(t *testing.T) {
			st := requireStatus(t, tc.call(), codes.InvalidArgument, tc.reason)
			require.Equal(t, tc.violations, violationsOf(st))
			var message []string
			for _, v := range tc.violations {
				message = append(message, v[:strings.LastIndex(v, " (")])
			}
			require.Equal(t, strings.Join(message, "; "), st.Message(), "the message lists the violations")
			require.NotContains(t, st.Message(), "regex", "rules are said in words")
		})
	}
}
