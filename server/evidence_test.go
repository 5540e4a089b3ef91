package server_test

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"

	"github.com/opbroker/opbroker/auth"
	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/server"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/storetest"
	"github.com/opbroker/opbroker/target"
)

// evidenceTargets are the demo contracts with the simulated target's events.
func evidenceTargets(t *testing.T) *target.Targets {
	t.Helper()
	targets, err := target.New(simtarget.Contracts("http://127.0.0.1:1", simtarget.Config{
		Webhooks: &simtarget.WebhookConfig{SecretSource: target.Secret{Env: "UNUSED_WEBHOOK_SECRET"}}})...)
	require.NoError(t, err)
	return targets
}

// chargeEvent is an event of the simulated target about the charge made with key.
func chargeEvent(id, typ, key string, amount int) []byte {
	b, _ := json.Marshal(map[string]any{"id": id, "type": typ, "data": map[string]any{"object": map[string]any{
		"id": "ch_" + id, "object": "charge", "reference": key, "request": map[string]any{"amount": amount}}}})
	return b
}

// evidenceBundle is a server over the evidence targets, with an UNKNOWN charge of acme
// for amount 100 (its name and remote key).
type evidenceBundle struct {
	*testBundle
	admin    opbrokerv1.AdminServiceClient
	evidence opbrokerv1.EvidenceServiceClient
	name     string
	key      string
}

func setupEvidence(t *testing.T, change ...func(*server.Options)) *evidenceBundle {
	t.Helper()
	b := setupWith(t, func(o *server.Options) {
		o.Targets = evidenceTargets(t)
		for _, c := range change {
			c(o)
		}
	})
	op := storetest.PrepareJSON(t, b.store, "acme", simtarget.DemoCharge, "order-1", `{"amount":100}`)
	claimed, err := b.store.AllTenants().Claim(b.ctx, store.ClaimParams{FairClaim: store.FairClaim{
		OperationTypes: []string{simtarget.DemoCharge}, Worker: "test", Lease: time.Minute, Limit: 1, PerTenant: 1, MaxTenants: 1}})
	require.NoError(t, err)
	_, err = b.store.AllTenants().RecordOutcome(b.ctx, store.OutcomeParams{TenantID: "acme", ID: op.ID, Fence: claimed[0].FenceToken,
		State: store.StateUnknown, Actor: "test", Observation: store.Observation{Outcome: "TIMEOUT"}})
	require.NoError(t, err)
	return &evidenceBundle{testBundle: b, admin: opbrokerv1.NewAdminServiceClient(b.conn),
		evidence: opbrokerv1.NewEvidenceServiceClient(b.conn),
		name:     "tenants/acme/operations/" + op.ID.String(), key: storetest.RemoteKey(t, b.pool, op.ID)}
}

func (b *evidenceBundle) report(tenant string, event []byte) (*opbrokerv1.ReportEvidenceResponse, error) {
	return b.evidence.ReportEvidence(b.ctx, &opbrokerv1.ReportEvidenceRequest{Tenant: tenant, Target: "demo-payments", Event: event})
}

func (b *evidenceBundle) state(t *testing.T) opbrokerv1.Operation_State {
	t.Helper()
	got, err := b.client.GetOperation(b.ctx, &opbrokerv1.GetOperationRequest{Name: b.name})
	require.NoError(t, err)
	return got.GetOperation().GetState()
}

// quarantined reports an event that disagrees with the charge (another amount), which
// is quarantined at once. Its reporter is the dev principal, "dev".
func (b *evidenceBundle) quarantined(t *testing.T, id string) {
	t.Helper()
	_, err := b.report("acme", chargeEvent(id, "charge.succeeded", b.key, 999))
	require.NoError(t, err)
}

// TestReportEvidence: an internal service's report of an event resolves the UNKNOWN
// operation it matches, once per event id; one reported for a tenant whose operation it
// is not is quarantined, and the caller learns nothing of the difference; a malformed
// one is refused naming the field.
func TestReportEvidence(t *testing.T) {
	t.Parallel()
	authn, tokens := newPrincipals(t,
		auth.PrincipalConfig{Name: "svc", Roles: []auth.Role{auth.RoleEvidence}, Tenants: []string{"acme", "globex"}},
		auth.PrincipalConfig{Name: "ops", Roles: []auth.Role{auth.RoleOperator, auth.RoleClient}, AllTenants: true})
	b := setupEvidence(t, func(o *server.Options) { o.Auth = authn })
	svc, ops := tokens.as(b.ctx, "svc"), tokens.as(b.ctx, "ops")

	cross, err := b.evidence.ReportEvidence(svc, &opbrokerv1.ReportEvidenceRequest{Tenant: "globex", Target: "demo-payments",
		Event: chargeEvent("evt_cross", "charge.succeeded", b.key, 100)})
	require.NoError(t, err)
	require.Equal(t, "evt_cross", cross.GetEventId())
	got, err := b.client.GetOperation(ops, &opbrokerv1.GetOperationRequest{Name: b.name})
	require.NoError(t, err)
	require.Equal(t, opbrokerv1.Operation_STATE_UNKNOWN, got.GetOperation().GetState(), "reported for another tenant: nothing changes")

	ok, err := b.evidence.ReportEvidence(svc, &opbrokerv1.ReportEvidenceRequest{Tenant: "acme", Target: "demo-payments",
		Event: chargeEvent("evt_1", "charge.succeeded", b.key, 100)})
	require.NoError(t, err)
	require.Equal(t, &opbrokerv1.ReportEvidenceResponse{EventId: "evt_1"}, stripped(ok), "the answer says as little for a match as for a conflict")
	got, err = b.client.GetOperation(ops, &opbrokerv1.GetOperationRequest{Name: b.name})
	require.NoError(t, err)
	require.Equal(t, opbrokerv1.Operation_STATE_SUCCEEDED, got.GetOperation().GetState())
	require.Equal(t, opbrokerv1.Operation_SOURCE_EVIDENCE, got.GetOperation().GetLastObservation().GetSource())
	require.Equal(t, "ch_evt_1", got.GetOperation().GetRemoteRef())

	again, err := b.evidence.ReportEvidence(svc, &opbrokerv1.ReportEvidenceRequest{Tenant: "acme", Target: "demo-payments",
		Event: chargeEvent("evt_1", "charge.succeeded", b.key, 100)})
	require.NoError(t, err)
	require.True(t, again.GetDuplicate())

	_, err = b.evidence.ReportEvidence(svc, &opbrokerv1.ReportEvidenceRequest{Tenant: "acme", Target: "demo-payments", Event: []byte(`{"id":1}`)})
	st := requireStatus(t, err, codes.InvalidArgument, server.ReasonEventInvalid)
	require.Contains(t, st.Message(), "event: malformed event")

	list, err := b.admin.ListQuarantine(ops, &opbrokerv1.ListQuarantineRequest{})
	require.NoError(t, err)
	require.Len(t, list.GetEvents(), 1)
	q := list.GetEvents()[0]
	require.Equal(t, "evt_cross", q.GetEventId())
	require.Equal(t, "TENANT_CONFLICT", q.GetReason())
	require.Equal(t, "REPORTED", q.GetSource())
	require.Equal(t, "svc", q.GetReporter())
	require.Equal(t, "globex", q.GetClaimedTenant())
	require.NotEmpty(t, q.GetBody())

	// A reported event is named by its reporter too.
	review := &opbrokerv1.ReviewQuarantineRequest{Target: "demo-payments", EventId: "evt_cross",
		Action: opbrokerv1.ReviewQuarantineRequest_REVIEW_ACTION_DISMISS, Note: "misrouted by the reporter"}
	_, err = b.admin.ReviewQuarantine(ops, review)
	requireStatus(t, err, codes.NotFound, server.ReasonEvidenceNotFound)
	review.Reporter = "svc"
	resp, err := b.admin.ReviewQuarantine(ops, review)
	require.NoError(t, err)
	require.Equal(t, "DISMISSED", resp.GetEvent().GetReview())
}

// stripped drops the message's internal state for comparison.
func stripped(r *opbrokerv1.ReportEvidenceResponse) *opbrokerv1.ReportEvidenceResponse {
	return &opbrokerv1.ReportEvidenceResponse{EventId: r.GetEventId(), Duplicate: r.GetDuplicate(), Ignored: r.GetIgnored()}
}

// TestQuarantineReview: the quarantine pages oldest first; an attached event that still
// disagrees is refused and stays; a dismissal is recorded with the operator and note.
func TestQuarantineReview(t *testing.T) {
	t.Parallel()
	b := setupEvidence(t)
	for _, id := range []string{"evt_a", "evt_b", "evt_c"} {
		b.quarantined(t, id)
	}
	page, err := b.admin.ListQuarantine(b.ctx, &opbrokerv1.ListQuarantineRequest{PageSize: 2})
	require.NoError(t, err)
	require.Len(t, page.GetEvents(), 2)
	require.Equal(t, "evt_a", page.GetEvents()[0].GetEventId())
	require.Equal(t, "PAYLOAD_MISMATCH", page.GetEvents()[0].GetReason())
	require.Equal(t, b.name, page.GetEvents()[0].GetOperation(), "the operation its reference found")
	rest, err := b.admin.ListQuarantine(b.ctx, &opbrokerv1.ListQuarantineRequest{PageSize: 2, PageToken: page.GetNextPageToken()})
	require.NoError(t, err)
	require.Len(t, rest.GetEvents(), 1)
	require.Equal(t, "evt_c", rest.GetEvents()[0].GetEventId())
	require.Empty(t, rest.GetNextPageToken())
	_, err = b.admin.ListQuarantine(b.ctx, &opbrokerv1.ListQuarantineRequest{Target: "demo-notify", PageToken: page.GetNextPageToken()})
	requireStatus(t, err, codes.InvalidArgument, server.ReasonPageTokenMismatch)

	_, err = b.admin.ReviewQuarantine(b.ctx, &opbrokerv1.ReviewQuarantineRequest{Target: "demo-payments", EventId: "evt_a",
		Action: opbrokerv1.ReviewQuarantineRequest_REVIEW_ACTION_ATTACH, Operation: b.name, Note: "looks like ours", Reporter: "dev"})
	st := requireStatus(t, err, codes.FailedPrecondition, server.ReasonEvidenceDoesNotMatch)
	require.Contains(t, st.Message(), "/data/object/request/amount")
	require.Equal(t, opbrokerv1.Operation_STATE_UNKNOWN, b.state(t))

	_, err = b.admin.ReviewQuarantine(b.ctx, &opbrokerv1.ReviewQuarantineRequest{Target: "demo-payments", EventId: "evt_a",
		Action: opbrokerv1.ReviewQuarantineRequest_REVIEW_ACTION_ATTACH, Note: "no operation"})
	requireStatus(t, err, codes.InvalidArgument, server.ReasonFieldRequired)

	resp, err := b.admin.ReviewQuarantine(b.ctx, &opbrokerv1.ReviewQuarantineRequest{Target: "demo-payments", EventId: "evt_b",
		Action: opbrokerv1.ReviewQuarantineRequest_REVIEW_ACTION_DISMISS, Note: "the provider's test event", Reporter: "dev"})
	require.NoError(t, err)
	require.Equal(t, "DISMISSED", resp.GetEvent().GetReview())
	require.Equal(t, "operator:dev", resp.GetEvent().GetReviewedBy())
	require.Equal(t, "the provider's test event", resp.GetEvent().GetReviewNote())
	require.Equal(t, "PAYLOAD_MISMATCH", resp.GetEvent().GetReason())
	left, err := b.admin.ListQuarantine(b.ctx, &opbrokerv1.ListQuarantineRequest{})
	require.NoError(t, err)
	require.Len(t, left.GetEvents(), 2, "a dismissed event leaves the quarantine")
	require.Contains(t, b.logs.String(), `"msg":"quarantined event reviewed"`)
}

// reviewReasons produce the review's errors for TestEveryDocumentedReason.
func reviewReasons(t *testing.T, reason string) seen {
	b := setupEvidence(t)
	review := func(id string, action opbrokerv1.ReviewQuarantineRequest_ReviewAction) error {
		_, err := b.admin.ReviewQuarantine(b.ctx, &opbrokerv1.ReviewQuarantineRequest{Target: "demo-payments", EventId: id,
			Action: action, Operation: b.name, Note: "review", Reporter: "dev"})
		return err
	}
	switch reason {
	case server.ReasonUnknownTarget:
		_, err := b.evidence.ReportEvidence(b.ctx, &opbrokerv1.ReportEvidenceRequest{Tenant: "acme", Target: "nowhere", Event: []byte(`{}`)})
		return received(t, err)
	case server.ReasonTargetReadsNoEvidence:
		_, err := b.evidence.ReportEvidence(b.ctx, &opbrokerv1.ReportEvidenceRequest{Tenant: "acme", Target: "demo-notify", Event: []byte(`{}`)})
		return received(t, err)
	case server.ReasonEventInvalid:
		_, err := b.report("acme", []byte(`not json`))
		return received(t, err)
	case server.ReasonEvidenceNotFound:
		return received(t, review("evt_none", opbrokerv1.ReviewQuarantineRequest_REVIEW_ACTION_DISMISS))
	case server.ReasonEvidenceNotQuarantined:
		_, err := b.report("acme", chargeEvent("evt_ok", "charge.succeeded", b.key, 100))
		require.NoError(t, err)
		return received(t, review("evt_ok", opbrokerv1.ReviewQuarantineRequest_REVIEW_ACTION_DISMISS))
	case server.ReasonEvidenceDoesNotMatch:
		b.quarantined(t, "evt_q")
		return received(t, review("evt_q", opbrokerv1.ReviewQuarantineRequest_REVIEW_ACTION_ATTACH))
	case server.ReasonEvidenceChanged:
		// The operation moves between the review's reading and its recording: the test
		// holds the operation's row while the review waits on it, and moves it.
		_, err := b.report("acme", chargeEvent("evt_u", "charge.succeeded", uuid.NewString(), 100))
		require.NoError(t, err)
		_, err = b.pool.Exec(b.ctx, `UPDATE inbound_evidence SET disposition = 'QUARANTINED', reason = 'UNMATCHED', decided_at = now()
			WHERE event_id = 'evt_u'`)
		require.NoError(t, err)
		tx, err := b.pool.Begin(b.ctx)
		require.NoError(t, err)
		defer tx.Rollback(b.ctx) //nolint:errcheck // committed below
		id := strings.TrimPrefix(b.name, "tenants/acme/operations/")
		_, err = tx.Exec(b.ctx, `SELECT 1 FROM operations WHERE operation_id = $1 FOR UPDATE`, id)
		require.NoError(t, err)
		done := make(chan error, 1)
		go func() { done <- review("evt_u", opbrokerv1.ReviewQuarantineRequest_REVIEW_ACTION_ATTACH) }()
		require.Eventually(t, func() bool {
			var waiting bool
			require.NoError(t, b.pool.QueryRow(b.ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity
				WHERE wait_event_type = 'Lock' AND query LIKE '%inbound_evidence%')`).Scan(&waiting))
			return waiting
		}, 5*time.Second, 10*time.Millisecond)
		_, err = tx.Exec(b.ctx, `UPDATE operations SET revision = revision + 1 WHERE operation_id = $1`, id)
		require.NoError(t, err)
		require.NoError(t, tx.Commit(b.ctx))
		return received(t, <-done)
	}
	t.Fatalf("no producer of %s", reason)
	return seen{}
}
