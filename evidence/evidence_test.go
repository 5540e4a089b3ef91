package evidence_test

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	metricnoop "go.opentelemetry.io/otel/metric/noop"

	"github.com/opbroker/opbroker/evidence"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/storetest"
	"github.com/opbroker/opbroker/target"
)

func TestMain(m *testing.M) { storetest.Main(m) }

const (
	chargeType = "demo.charge"
	secret     = "whsec_evidence_test"
)

// bundle is a ledger with a target whose events name the remote key, carry the account
// (the tenant at the target) and the amount, and a webhook listener for them.
type bundle struct {
	ctx        context.Context
	store      *store.Store
	admin      *pgxpool.Pool
	targets    *target.Targets
	matcher    *evidence.Matcher
	listener   *httptest.Server
	secretFile string
}

// setup builds the bundle; adjust changes the contract's evidence section first.
func setup(t testing.TB, adjust ...func(*target.Evidence)) *bundle {
	t.Helper()
	b := &bundle{ctx: context.Background()}
	b.store, b.admin = storetest.NewStore(t)
	b.secretFile = filepath.Join(t.TempDir(), "webhook-secret")
	require.NoError(t, os.WriteFile(b.secretFile, []byte(secret+"\n"), 0o600))
	c := &target.Contract{Name: "charges", OperationTypes: []string{chargeType},
		Endpoint:  target.Endpoint{Method: "POST", URL: "http://127.0.0.1:1/v1/charges", Timeout: target.Duration(time.Second)},
		Responses: target.Responses{Success: []target.ResponseClass{{Status: []int{200}, RemoteRef: "/id"}}},
		Evidence: &target.Evidence{EventID: "/id", EventType: "/type", Reference: "/data/object/reference",
			ReferenceKind: target.ReferenceRemoteKey, RemoteRef: "/data/object/id",
			Tenant:    &target.FieldMatch{Remote: "/data/object/account", Payload: "/account"},
			Match:     []target.FieldMatch{{Remote: "/data/object/amount", Payload: "/amount"}},
			Succeeded: []string{"charge.succeeded"}, Pending: []string{"charge.processing"}, Failed: []string{"charge.failed"},
			Documented: "test: a failed charge moved no money", MatchFor: target.Duration(time.Minute),
			Webhook: &target.Webhook{Path: "/charges", Signature: target.Signature{Scheme: target.SignatureStripe,
				Secret: target.Secret{File: b.secretFile}, Documented: "https://docs.stripe.com/webhooks"}}}}
	for _, f := range adjust {
		f(c.Evidence)
	}
	var err error
	b.targets, err = target.New(c)
	require.NoError(t, err)
	b.matcher, err = evidence.New(evidence.Config{Store: b.store, Targets: b.targets, MeterProvider: metricnoop.NewMeterProvider(),
		Logger: slog.New(slog.DiscardHandler), PollInterval: 20 * time.Millisecond})
	require.NoError(t, err)
	b.listener = httptest.NewServer(evidence.NewWebhooks(b.matcher, b.targets, 4096, nil))
	t.Cleanup(b.listener.Close)
	return b
}

// prepare records a charge of tenant for amount; its payload names the tenant's account.
func (b *bundle) prepare(t testing.TB, tenant, intent string, amount int) store.Operation {
	t.Helper()
	return storetest.PrepareJSON(t, b.store, tenant, chargeType, intent, fmt.Sprintf(`{"account":%q,"amount":%d}`, tenant, amount))
}

// claim takes the operation IN_FLIGHT and returns its claim.
func (b *bundle) claim(t testing.TB, op store.Operation) store.Claimed {
	t.Helper()
	claimed, err := b.store.AllTenants().Claim(b.ctx, store.ClaimParams{FairClaim: store.FairClaim{OperationTypes: []string{chargeType},
		Worker: "w", Lease: time.Minute, Limit: 10, PerTenant: 10, MaxTenants: 10}})
	require.NoError(t, err)
	for _, c := range claimed {
		if c.ID == op.ID {
			return c
		}
	}
	t.Fatalf("operation %s not claimed", op.ID)
	return store.Claimed{}
}

// unknown prepares a charge and records its send as UNKNOWN.
func (b *bundle) unknown(t testing.TB, tenant, intent string, amount int) store.Operation {
	t.Helper()
	op := b.prepare(t, tenant, intent, amount)
	c := b.claim(t, op)
	_, err := b.store.AllTenants().RecordOutcome(b.ctx, store.OutcomeParams{TenantID: tenant, ID: op.ID, Fence: c.FenceToken,
		State: store.StateUnknown, Observation: store.Observation{Source: "DISPATCH", Outcome: "TIMEOUT"}, Actor: "test"})
	require.NoError(t, err)
	return b.get(t, op)
}

func (b *bundle) get(t testing.TB, op store.Operation) store.Operation {
	t.Helper()
	got, err := b.store.AllTenants().Get(b.ctx, op.TenantID, op.ID)
	require.NoError(t, err)
	return got
}

func (b *bundle) key(t testing.TB, op store.Operation) string {
	t.Helper()
	return storetest.RemoteKey(t, b.admin, op.ID)
}

func (b *bundle) evidence(t testing.TB, eventID string) store.InboundEvidence {
	t.Helper()
	e, err := b.store.AllTenants().Evidence(b.ctx, store.EvidenceKey{Target: "charges", EventID: eventID})
	require.NoError(t, err)
	return e
}

// event is a charge event as the target sends it.
func event(id, typ, reference, remoteRef, account string, amount int) []byte {
	body, _ := json.Marshal(map[string]any{"id": id, "type": typ, "data": map[string]any{"object": map[string]any{
		"id": remoteRef, "reference": reference, "account": account, "amount": amount}}})
	return body
}

// sign is Stripe's signature of body at now with key.
func sign(key string, body []byte, now time.Time) string {
	ts := fmt.Sprint(now.Unix())
	mac := hmac.New(sha256.New, []byte(key))
	mac.Write([]byte(ts + "." + string(body)))
	return "t=" + ts + ",v1=" + hex.EncodeToString(mac.Sum(nil))
}

// post delivers body to path, signed with key, and returns the status and answer.
func (b *bundle) post(t testing.TB, path string, body []byte, key string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, b.listener.URL+path, bytes.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Stripe-Signature", sign(key, body, time.Now()))
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	answer, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(answer)
}

func (b *bundle) deliver(t *testing.T, body []byte) {
	t.Helper()
	status, answer := b.post(t, "/charges", body, secret)
	require.Equal(t, http.StatusOK, status, answer)
}

func (b *bundle) countEvidence(t testing.TB) int {
	t.Helper()
	var n int
	require.NoError(t, b.admin.QueryRow(b.ctx, `SELECT count(*) FROM inbound_evidence`).Scan(&n))
	return n
}

// events returns the reasons of the operation's events, in order.
func (b *bundle) events(t testing.TB, op store.Operation) []string {
	t.Helper()
	rows, err := b.admin.Query(b.ctx, `SELECT coalesce(reason, '') || ' by ' || actor FROM operation_events
		WHERE tenant_id = $1 AND operation_id = $2 ORDER BY revision`, op.TenantID, op.ID)
	require.NoError(t, err)
	var out []string
	for rows.Next() {
		var s string
		require.NoError(t, rows.Scan(&s))
		out = append(out, s)
	}
	require.NoError(t, rows.Err())
	return out
}

// TestUnmatchedAndCrossTenantEventsAreQuarantined is the seed's sixth fault-injection
// test: an event whose reference matches no operation, and one about another tenant's
// operation (by the account it names, and as reported for another tenant), are
// quarantined and change no operation, while the event that matches resolves its UNKNOWN
// operation to SUCCEEDED with source EVIDENCE.
func TestUnmatchedAndCrossTenantEventsAreQuarantined(t *testing.T) {
	t.Parallel()
	b := setup(t, func(e *target.Evidence) { e.MatchFor = target.Duration(200 * time.Millisecond) })
	acme := b.unknown(t, "acme", "order-1", 100)
	globex := b.unknown(t, "globex", "order-1", 100)

	// Unmatched: acknowledged (kept), matched again until its window closes, quarantined.
	b.deliver(t, event("evt_unmatched", "charge.succeeded", uuid.NewString(), "ch_9", "acme", 100))
	require.Equal(t, store.EvidencePending, b.evidence(t, "evt_unmatched").Disposition, "matched again until its window closes")
	// Cross-tenant: globex's operation, by its key, but the event names acme's account.
	b.deliver(t, event("evt_cross", "charge.succeeded", b.key(t, globex), "ch_2", "acme", 100))
	// Reported by a service for acme, about globex's operation.
	_, _, err := b.matcher.Receive(b.ctx, mustContract(t, b), event("evt_reported", "charge.succeeded", b.key(t, globex), "ch_2", "globex", 100),
		evidence.Source{Reporter: "svc-acme", Tenant: "acme"})
	require.NoError(t, err)
	// The one that matches.
	b.deliver(t, event("evt_match", "charge.succeeded", b.key(t, acme), "ch_1", "acme", 100))

	require.NoError(t, b.matcher.Start(b.ctx))
	t.Cleanup(b.matcher.Stop)
	require.Eventually(t, func() bool { return b.evidence(t, "evt_unmatched").Disposition == store.EvidenceQuarantined },
		5*time.Second, 20*time.Millisecond)

	for k, reason := range map[store.EvidenceKey]string{key("evt_unmatched"): evidence.ReasonUnmatched,
		key("evt_cross"): evidence.ReasonTenantConflict,
		{Target: "charges", EventID: "evt_reported", Reporter: "svc-acme"}: evidence.ReasonTenantConflict} {
		e, err := b.store.AllTenants().Evidence(b.ctx, k)
		require.NoError(t, err)
		require.Equal(t, store.EvidenceQuarantined, e.Disposition, k)
		require.Equal(t, reason, e.Reason, k)
		if reason == evidence.ReasonTenantConflict {
			// Not in globex's scope: the event is acme's body, or an acme service's report.
			require.Empty(t, e.TenantID, k)
			require.Equal(t, uuid.Nil, e.OperationID, k)
			require.Contains(t, e.Detail, "tenants/globex/operations/"+globex.ID.String(), k)
		}
	}
	inGlobex, _, err := b.store.Tenant("globex").Quarantine(b.ctx, store.QuarantineParams{Limit: 10})
	require.NoError(t, err)
	require.Empty(t, inGlobex, "another tenant's event is not in globex's scope")
	got := b.get(t, globex)
	require.Equal(t, store.StateUnknown, got.State, "a cross-tenant event changes nothing")
	require.Equal(t, globex.Revision, got.Revision)
	require.Equal(t, globex.FenceToken, got.FenceToken)

	got = b.get(t, acme)
	require.Equal(t, store.StateSucceeded, got.State)
	require.Equal(t, "ch_1", got.RemoteRef)
	require.Equal(t, "EVIDENCE", got.LastObservation.Source)
	require.Equal(t, "evt_match", got.LastObservation.EventID)
	require.Equal(t, acme.FenceToken+1, got.FenceToken, "evidence takes the fence")
	require.Equal(t, store.EvidenceApplied, b.evidence(t, "evt_match").Disposition)
	require.Equal(t, []string{" by test", " by dispatcher:w", "TIMEOUT by test", "EVIDENCE_SUCCEEDED by webhook:charges"}, b.events(t, acme))

	page, more, err := b.store.AllTenants().Quarantine(b.ctx, store.QuarantineParams{Limit: 10})
	require.NoError(t, err)
	require.False(t, more)
	require.Len(t, page, 3)
}

// key is the key of the test target's webhook event id.
func key(id string) store.EvidenceKey { return store.EvidenceKey{Target: "charges", EventID: id} }

func mustContract(t *testing.T, b *bundle) *target.Contract {
	t.Helper()
	c, ok := b.targets.ByName("charges")
	require.True(t, ok)
	return c
}

// TestWebhookDeliveries: a delivery is kept only once verified, once per event id; what
// is refused leaves nothing behind, and the broker's own failure asks the sender to
// deliver again.
func TestWebhookDeliveries(t *testing.T) {
	t.Parallel()
	b := setup(t)
	op := b.unknown(t, "acme", "order-1", 100)
	good := event("evt_1", "charge.succeeded", b.key(t, op), "ch_1", "acme", 100)

	status, _ := b.post(t, "/charges", good, "whsec_wrong")
	require.Equal(t, http.StatusUnauthorized, status)
	require.Equal(t, 0, b.countEvidence(t), "a bad signature is not kept")
	require.Equal(t, store.StateUnknown, b.get(t, op).State)

	status, answer := b.post(t, "/charges", good, secret)
	require.Equal(t, http.StatusOK, status)
	require.JSONEq(t, `{"event_id":"evt_1","duplicate":false}`, answer)
	require.Equal(t, store.StateSucceeded, b.get(t, op).State)
	status, answer = b.post(t, "/charges", good, secret)
	require.Equal(t, http.StatusOK, status)
	require.JSONEq(t, `{"event_id":"evt_1","duplicate":true}`, answer, "a repeated event id is acknowledged")
	require.Equal(t, 1, b.countEvidence(t))
	revision := b.get(t, op).Revision
	b.deliver(t, event("evt_2", "charge.succeeded", b.key(t, op), "ch_1", "acme", 100))
	require.Equal(t, store.EvidenceObserved, b.evidence(t, "evt_2").Disposition, "a second report of the same success agrees")
	require.Equal(t, revision, b.get(t, op).Revision)

	status, answer = b.post(t, "/charges", event("evt_3", "charge.refunded", b.key(t, op), "ch_1", "acme", 100), secret)
	require.Equal(t, http.StatusOK, status)
	require.JSONEq(t, `{"ignored":true}`, answer)
	status, answer = b.post(t, "/charges", []byte(`{"id":"evt_5","type":"customer.created","data":{"object":{"id":"cus_1"}}}`), secret)
	require.Equal(t, http.StatusOK, status, "a type the contract does not list, without the fields of those it lists")
	require.JSONEq(t, `{"ignored":true}`, answer)
	status, _ = b.post(t, "/charges", []byte(`{"type":"charge.succeeded"}`), secret)
	require.Equal(t, http.StatusBadRequest, status, "signed, but not an event the contract reads")
	status, _ = b.post(t, "/charges", []byte(`{"id":"`+strings.Repeat("x", 5000)+`"}`), secret)
	require.Equal(t, http.StatusRequestEntityTooLarge, status)
	status, _ = b.post(t, "/other", good, secret)
	require.Equal(t, http.StatusNotFound, status)
	resp, err := http.Get(b.listener.URL + "/charges")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusMethodNotAllowed, resp.StatusCode)
	require.Equal(t, 2, b.countEvidence(t), "nothing refused or ignored was kept")

	require.NoError(t, os.Remove(b.secretFile))
	status, _ = b.post(t, "/charges", event("evt_4", "charge.succeeded", b.key(t, op), "ch_1", "acme", 100), secret)
	require.Equal(t, http.StatusServiceUnavailable, status, "the broker cannot verify now: the sender delivers again later")
}

// TestEvidenceTakesTheFenceFromTheSender: a success reported while the send is still
// waiting for its answer resolves the operation and takes its fence; the sender's late
// outcome changes nothing and is kept as a stale outcome.
func TestEvidenceTakesTheFenceFromTheSender(t *testing.T) {
	t.Parallel()
	b := setup(t)
	op := b.prepare(t, "acme", "order-1", 100)
	c := b.claim(t, op)
	b.deliver(t, event("evt_1", "charge.succeeded", c.RemoteKey.String(), "ch_1", "acme", 100))
	got := b.get(t, op)
	require.Equal(t, store.StateSucceeded, got.State)
	require.Equal(t, c.FenceToken+1, got.FenceToken)

	_, err := b.store.AllTenants().RecordOutcome(b.ctx, store.OutcomeParams{TenantID: "acme", ID: op.ID, Fence: c.FenceToken,
		State: store.StateUnknown, Observation: store.Observation{Source: "DISPATCH", Outcome: "TIMEOUT"}, Actor: "w"})
	require.ErrorIs(t, err, store.ErrFenceLost)
	require.Equal(t, got.Revision, b.get(t, op).Revision, "the sender's late outcome changed nothing")
	var stale int
	require.NoError(t, b.admin.QueryRow(b.ctx, `SELECT count(*) FROM stale_outcomes WHERE operation_id = $1`, op.ID).Scan(&stale))
	require.Equal(t, 1, stale)
}

// TestPendingEvidenceStopsReplays: an event that says the request is accepted and not
// finished marks an UNKNOWN operation so that no replay follows, and resolves nothing;
// the final event then does.
func TestPendingEvidenceStopsReplays(t *testing.T) {
	t.Parallel()
	b := setup(t)
	op := b.unknown(t, "acme", "order-1", 100)
	b.deliver(t, event("evt_1", "charge.processing", b.key(t, op), "ch_1", "acme", 100))
	got := b.get(t, op)
	require.Equal(t, store.StateUnknown, got.State)
	require.True(t, got.AcceptedUnfinished)
	require.Equal(t, op.FenceToken, got.FenceToken, "an observation does not take the fence")
	b.deliver(t, event("evt_2", "charge.failed", b.key(t, op), "ch_1", "acme", 100))
	require.Equal(t, store.StateFailedTerminal, b.get(t, op).State)
	b.deliver(t, event("evt_3", "charge.succeeded", b.key(t, op), "ch_1", "acme", 100))
	e := b.evidence(t, "evt_3")
	require.Equal(t, evidence.ReasonContradictsTerminal, e.Reason, "a success after a documented final failure is raised, not applied")
	require.Equal(t, store.StateFailedTerminal, b.get(t, op).State)
}

// TestAFailureAfterAVerifiedSuccessIsQuarantined: the target answered a send of the
// operation with a verified success, which reached its worker after the lease expired
// (kept as a stale outcome): an event of a final failure then contradicts the target's
// own answer, and is quarantined rather than making the operation FAILED_TERMINAL (a
// client would make the effect again). A success event still resolves it.
func TestAFailureAfterAVerifiedSuccessIsQuarantined(t *testing.T) {
	t.Parallel()
	b := setup(t)
	op := b.unknown(t, "acme", "order-1", 100)
	_, err := b.admin.Exec(b.ctx, `INSERT INTO stale_outcomes (tenant_id, operation_id, fence_token, actor, outcome, observation, remote_ref, sent)
		VALUES ('acme', $1, 1, 'w', 'VERIFIED_SUCCESS', '{}', 'ch_1', true)`, op.ID)
	require.NoError(t, err)
	b.deliver(t, event("evt_1", "charge.failed", b.key(t, op), "ch_1", "acme", 100))
	e := b.evidence(t, "evt_1")
	require.Equal(t, store.EvidenceQuarantined, e.Disposition)
	require.Equal(t, evidence.ReasonContradictsLedger, e.Reason)
	require.Contains(t, e.Detail, "answered with a verified success")
	require.Equal(t, op.Revision, b.get(t, op).Revision, "nothing changed")

	b.deliver(t, event("evt_2", "charge.succeeded", b.key(t, op), "ch_1", "acme", 100))
	require.Equal(t, store.StateSucceeded, b.get(t, op).State)
}

// TestEventBeforeItsReference: an event found by the target's reference can come before
// the answer that records that reference; it is matched again until the answer is
// recorded. Where the answer never comes (the send ended UNKNOWN), it is quarantined
// once its window closes.
func TestEventBeforeItsReference(t *testing.T) {
	t.Parallel()
	b := setup(t, func(e *target.Evidence) {
		e.ReferenceKind, e.Reference, e.RemoteRef = target.ReferenceRemoteRef, "/data/object/id", ""
		e.MatchFor = target.Duration(time.Second)
	})
	op := b.prepare(t, "acme", "order-1", 100)
	c := b.claim(t, op)
	b.deliver(t, event("evt_1", "charge.succeeded", "", "ch_1", "acme", 100))
	require.Equal(t, store.EvidencePending, b.evidence(t, "evt_1").Disposition)
	require.Equal(t, store.StateInFlight, b.get(t, op).State)
	_, err := b.store.AllTenants().RecordOutcome(b.ctx, store.OutcomeParams{TenantID: "acme", ID: op.ID, Fence: c.FenceToken,
		State: store.StateSucceeded, RemoteRef: "ch_1", Observation: store.Observation{Source: "DISPATCH", Outcome: "VERIFIED_SUCCESS"}, Actor: "w"})
	require.NoError(t, err)

	lost := b.unknown(t, "acme", "order-2", 100)
	b.deliver(t, event("evt_2", "charge.succeeded", "", "ch_2", "acme", 100))

	require.NoError(t, b.matcher.Start(b.ctx))
	t.Cleanup(b.matcher.Stop)
	require.Eventually(t, func() bool { return b.evidence(t, "evt_1").Disposition == store.EvidenceObserved }, 5*time.Second, 20*time.Millisecond)
	require.Equal(t, op.ID, b.evidence(t, "evt_1").OperationID)
	require.Eventually(t, func() bool { return b.evidence(t, "evt_2").Disposition == store.EvidenceQuarantined }, 5*time.Second, 20*time.Millisecond)
	require.Equal(t, evidence.ReasonUnmatched, b.evidence(t, "evt_2").Reason)
	require.Equal(t, store.StateUnknown, b.get(t, lost).State)
}

// TestReviewQuarantine: an operator attaches a quarantined event to the operation it is
// about, and it applies through the same checks; one that still disagrees stays
// quarantined; a dismissal closes one and changes nothing.
func TestReviewQuarantine(t *testing.T) {
	t.Parallel()
	b := setup(t, func(e *target.Evidence) { e.MatchFor = 0 })
	op := b.unknown(t, "acme", "order-1", 100)
	// The target reported the charge under a reference the broker does not know.
	quarantine := func(id string, amount int) {
		_, _, err := b.matcher.Receive(b.ctx, mustContract(t, b), event(id, "charge.succeeded", "not-a-key", "ch_1", "acme", amount), evidence.Source{})
		require.NoError(t, err)
		_, err = b.admin.Exec(b.ctx, `UPDATE inbound_evidence SET match_until = now() WHERE event_id = $1`, id)
		require.NoError(t, err)
	}
	quarantine("evt_changed", 150)
	quarantine("evt_1", 100)
	quarantine("evt_dismissed", 100)
	require.NoError(t, b.matcher.Start(b.ctx))
	require.Eventually(t, func() bool { return b.evidence(t, "evt_dismissed").Disposition == store.EvidenceQuarantined }, 5*time.Second, 20*time.Millisecond)
	b.matcher.Stop()

	_, err := b.matcher.Attach(b.ctx, key("evt_changed"), "acme", op.ID, "operator:ann", "the support ticket says so")
	var mismatch *evidence.MismatchError
	require.ErrorAs(t, err, &mismatch)
	require.Equal(t, evidence.ReasonPayloadMismatch, mismatch.Reason)
	require.Equal(t, store.EvidenceQuarantined, b.evidence(t, "evt_changed").Disposition)
	require.Equal(t, store.StateUnknown, b.get(t, op).State)

	attached, err := b.matcher.Attach(b.ctx, key("evt_1"), "acme", op.ID, "operator:ann", "the charge's reference was mistyped at the target")
	require.NoError(t, err)
	require.Equal(t, store.EvidenceAttached, attached.Disposition)
	require.Equal(t, "operator:ann", attached.ReviewedBy)
	require.Equal(t, evidence.ReasonUnmatched, attached.Reason, "the reason it was quarantined for stays")
	got := b.get(t, op)
	require.Equal(t, store.StateSucceeded, got.State)
	require.Contains(t, b.events(t, op), "EVIDENCE_SUCCEEDED by operator:ann")
	_, err = b.matcher.Attach(b.ctx, key("evt_1"), "acme", op.ID, "operator:ann", "again")
	require.ErrorIs(t, err, evidence.ErrNotQuarantined)

	dismissed, err := b.matcher.Dismiss(b.ctx, key("evt_dismissed"), "operator:bob", "a test event from the provider's dashboard")
	require.NoError(t, err)
	require.Equal(t, store.EvidenceDismissed, dismissed.Disposition)
	require.Equal(t, got.Revision, b.get(t, op).Revision)
	_, err = b.matcher.Dismiss(b.ctx, key("evt_dismissed"), "operator:bob", "again")
	require.ErrorIs(t, err, evidence.ErrNotQuarantined)
	_, err = b.matcher.Dismiss(b.ctx, key("evt_none"), "operator:bob", "none")
	require.ErrorIs(t, err, store.ErrEvidenceNotFound)
}

// FuzzWebhook: whatever a sender posts (body, signature header), the listener answers
// one of its documented statuses and never panics; it keeps an event only when its
// signature verifies, and a kept event changes an operation only as decide allows (the
// one its reference names, which stays in its tenant). Half the inputs are signed with
// the real secret, so that reading and matching arbitrary signed bodies are reached.
func FuzzWebhook(f *testing.F) {
	b := setup(f)
	op := b.unknown(f, "acme", "order-1", 100)
	key := b.key(f, op)
	f.Add(event("evt_1", "charge.succeeded", key, "ch_1", "acme", 100), "", true)
	f.Add(event("evt_2", "charge.processing", key, "ch_1", "acme", 100), "", true)
	f.Add(event("evt_3", "charge.failed", key, "ch_1", "globex", 100), "", true)
	f.Add(event("evt_4", "charge.succeeded", key, "ch_1", "acme", 7), "t=1,v1=00", false)
	f.Add([]byte(`{"id":"evt_5","type":"charge.succeeded","data":{"object":{"reference":[1,2]}}}`), "", true)
	f.Add([]byte(`{"id":"","type":"","data":null}`), "t=,v1=,v1", false)
	f.Add([]byte{0xff, 0xfe, '{'}, strings.Repeat("v1=", 200), true)
	f.Fuzz(func(t *testing.T, body []byte, header string, signed bool) {
		kept := b.countEvidence(t)
		req, err := http.NewRequest(http.MethodPost, b.listener.URL+"/charges", bytes.NewReader(body))
		require.NoError(t, err)
		if signed {
			header = sign(secret, body, time.Now())
		}
		if !strings.ContainsFunc(header, func(r rune) bool { return r < ' ' && r != '\t' || r == 0x7f }) {
			req.Header.Set("Stripe-Signature", header) // a client sends no header it cannot encode
		}
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		require.Contains(t, []int{http.StatusOK, http.StatusBadRequest, http.StatusUnauthorized, http.StatusRequestEntityTooLarge},
			resp.StatusCode)
		if !signed || resp.StatusCode != http.StatusOK {
			require.Equal(t, kept, b.countEvidence(t), "nothing is kept from a delivery refused or not signed")
		}
		got := b.get(t, op)
		require.Equal(t, "acme", got.TenantID)
		if got.State != store.StateUnknown {
			require.Equal(t, "EVIDENCE", got.LastObservation.Source, "only evidence changed it")
		}
	})
}

// TestPendingEvidenceStopsAReplayAlreadyDecided: the target's word that it accepted the
// request without finishing it stops a same-key replay even when it comes after a
// reconciler claimed the operation, and counts for the next claim even when it came
// while the operation was IN_FLIGHT.
func TestPendingEvidenceStopsAReplayAlreadyDecided(t *testing.T) {
	t.Parallel()
	b := setup(t)
	fair := store.FairClaim{OperationTypes: []string{chargeType}, Worker: "r", Lease: time.Minute, Limit: 10, PerTenant: 10, MaxTenants: 10}

	op := b.unknown(t, "acme", "order-1", 100)
	claimed, err := b.store.AllTenants().ClaimUnknown(b.ctx, fair)
	require.NoError(t, err)
	require.Len(t, claimed, 1)
	require.False(t, claimed[0].AcceptedUnfinished)
	b.deliver(t, event("evt_1", "charge.processing", b.key(t, op), "ch_1", "acme", 100))
	_, err = b.store.AllTenants().BeginReplay(b.ctx, store.BeginReplayParams{TenantID: "acme", ID: op.ID,
		Fence: claimed[0].FenceToken, Worker: "r", Lease: time.Minute})
	require.ErrorIs(t, err, store.ErrFenceLost, "the replay decided before the event is refused")
	require.Equal(t, store.StateUnknown, b.get(t, op).State)

	sending := b.prepare(t, "acme", "order-2", 100)
	c := b.claim(t, sending)
	b.deliver(t, event("evt_2", "charge.processing", c.RemoteKey.String(), "ch_2", "acme", 100))
	require.Equal(t, store.EvidenceObserved, b.evidence(t, "evt_2").Disposition)
	_, err = b.store.AllTenants().RecordOutcome(b.ctx, store.OutcomeParams{TenantID: "acme", ID: sending.ID, Fence: c.FenceToken,
		State: store.StateUnknown, Observation: store.Observation{Source: "DISPATCH", Outcome: "TIMEOUT"}, Actor: "w"})
	require.NoError(t, err)
	_, err = b.admin.Exec(b.ctx, `UPDATE operations SET lease_expires_at = NULL, lease_owner = NULL WHERE operation_id = $1`, op.ID)
	require.NoError(t, err)
	again, err := b.store.AllTenants().ClaimUnknown(b.ctx, fair)
	require.NoError(t, err)
	for _, u := range again {
		require.True(t, u.AcceptedUnfinished, "%s: the target said it accepted the request", u.IntentRef)
	}
	require.Len(t, again, 2)
}

// TestQuarantineDetailIsClipped: a detail quotes what the event carries; however long
// that is, the event is quarantined with a detail the ledger holds, and the matcher's
// queue moves on.
func TestQuarantineDetailIsClipped(t *testing.T) {
	t.Parallel()
	b := setup(t, func(e *target.Evidence) { e.MatchFor = target.Duration(100 * time.Millisecond) })
	_, _, err := b.matcher.Receive(b.ctx, mustContract(t, b), event("evt_long", "charge.succeeded", strings.Repeat(`"`, 500), "ch_1", "acme", 1),
		evidence.Source{Reporter: "svc", Tenant: "acme"})
	require.NoError(t, err)
	require.NoError(t, b.matcher.Start(b.ctx))
	t.Cleanup(b.matcher.Stop)
	k := store.EvidenceKey{Target: "charges", EventID: "evt_long", Reporter: "svc"}
	require.Eventually(t, func() bool {
		e, err := b.store.AllTenants().Evidence(b.ctx, k)
		return err == nil && e.Disposition == store.EvidenceQuarantined
	}, 5*time.Second, 20*time.Millisecond)
	e, err := b.store.AllTenants().Evidence(b.ctx, k)
	require.NoError(t, err)
	require.LessOrEqual(t, len(e.Detail), 1024)
	require.True(t, strings.HasSuffix(e.Detail, "…"))
}

// TestEachSenderHasItsOwnEventIDs: an event id one sender used does not make another
// sender's event a repeat: a reporter cannot pre-empt the target's signed webhook.
func TestEachSenderHasItsOwnEventIDs(t *testing.T) {
	t.Parallel()
	b := setup(t)
	op := b.unknown(t, "globex", "order-1", 100)
	// A reporter for acme reports, first, an event id the target will use for globex.
	_, fresh, err := b.matcher.Receive(b.ctx, mustContract(t, b), event("evt_1", "charge.succeeded", b.key(t, op), "ch_1", "acme", 100),
		evidence.Source{Reporter: "svc-acme", Tenant: "acme"})
	require.NoError(t, err)
	require.True(t, fresh)
	require.Equal(t, store.StateUnknown, b.get(t, op).State, "reported for another tenant")
	status, answer := b.post(t, "/charges", event("evt_1", "charge.succeeded", b.key(t, op), "ch_1", "globex", 100), secret)
	require.Equal(t, http.StatusOK, status)
	require.JSONEq(t, `{"event_id":"evt_1","duplicate":false}`, answer)
	require.Equal(t, store.StateSucceeded, b.get(t, op).State, "the target's own event is kept and applied")
	_, fresh, err = b.matcher.Receive(b.ctx, mustContract(t, b), event("evt_1", "charge.succeeded", b.key(t, op), "ch_1", "acme", 100),
		evidence.Source{Reporter: "svc-acme", Tenant: "acme"})
	require.NoError(t, err)
	require.False(t, fresh, "the reporter's own repeat adds nothing")
}
