package simtarget

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/target"
)

const testWebhookSecret = "whsec_simtarget_test"

// testEvent is what a test reads of an event.
type testEvent struct {
	ID      string `json:"id"`
	Type    string `json:"type"`
	Created int64  `json:"created"`
	Data    struct {
		Object struct {
			ID        string          `json:"id"`
			Reference string          `json:"reference"`
			Status    string          `json:"status"`
			Account   string          `json:"account"`
			Request   json.RawMessage `json:"request"`
		} `json:"object"`
	} `json:"data"`
}

// delivery is one POST the receiver got.
type delivery struct {
	header   http.Header
	body     []byte
	event    testEvent
	at       time.Time
	verified error // the contract verifier's verdict
}

// receiver records deliveries, answers 401 to one whose signature does not verify, as
// the broker does, and otherwise the status answer gives (200 when nil).
type receiver struct {
	verifier *target.Verifier
	answer   func(n int) int // n counts the deliveries before this one

	mu  sync.Mutex
	got []delivery
}

func (r *receiver) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	body, _ := io.ReadAll(req.Body)
	d := delivery{header: req.Header.Clone(), body: body, at: time.Now(), verified: r.verifier.Verify(req.Header, body, time.Now())}
	_ = json.Unmarshal(body, &d.event)
	r.mu.Lock()
	n := len(r.got)
	r.got = append(r.got, d)
	r.mu.Unlock()
	status := http.StatusOK
	switch {
	case d.verified != nil:
		status = http.StatusUnauthorized
	case r.answer != nil:
		status = r.answer(n)
	}
	w.WriteHeader(status)
}

func (r *receiver) deliveries() []delivery {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]delivery(nil), r.got...)
}

// hookBundle is a target whose webhooks go to a recording receiver.
type hookBundle struct {
	sim      *Target
	url      string // the target's API
	receiver *receiver
	contract *target.Contract // demo-payments
}

// setupHooks starts a target with cfg and a receiver that answers with answer.
// cfg.Webhooks gets the receiver's URL when it names none, and the secret, in a file
// when it names no source.
func setupHooks(t *testing.T, cfg Config, answer func(n int) int) *hookBundle {
	t.Helper()
	rec := &receiver{answer: answer}
	recSrv := httptest.NewServer(rec)
	t.Cleanup(recSrv.Close)
	w := *cfg.Webhooks
	if len(w.URLs) == 0 {
		w.URLs = []string{recSrv.URL + WebhookPath}
	}
	w.Secret = testWebhookSecret
	if w.SecretSource == (target.Secret{}) {
		path := filepath.Join(t.TempDir(), "secret")
		require.NoError(t, os.WriteFile(path, []byte(testWebhookSecret+"\n"), 0o600))
		w.SecretSource = target.Secret{File: path}
	}
	cfg.Webhooks = &w
	sim := New(cfg)
	simSrv := httptest.NewServer(sim)
	t.Cleanup(simSrv.Close)
	t.Cleanup(sim.Close) // first: stops the deliveries before the servers close
	contract := Contracts(simSrv.URL, cfg)[0]
	rec.verifier = contract.Verifier()
	require.NotNil(t, rec.verifier)
	return &hookBundle{sim: sim, url: simSrv.URL, receiver: rec, contract: contract}
}

// charge creates a charge with key and returns its id.
func (b *hookBundle) charge(t *testing.T, key, body string) string {
	t.Helper()
	resp, err := post(t, b.url, key, body)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	var created struct{ ID string }
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&created))
	return created.ID
}

// idle waits until no event is pending and returns what the receiver got.
func (b *hookBundle) idle(t *testing.T) []delivery {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	require.NoError(t, b.sim.WebhooksIdle(ctx))
	return b.receiver.deliveries()
}

func types(ds []delivery) []string {
	var out []string
	for _, d := range ds {
		out = append(out, d.event.Type)
	}
	return out
}

// TestWebhookEventWithoutCompletion: a charge made with a key gets one signed
// charge.succeeded event of the documented shape; notifications, objects and charges
// without a key get none.
func TestWebhookEventWithoutCompletion(t *testing.T) {
	t.Parallel()
	b := setupHooks(t, Config{Webhooks: &WebhookConfig{Delay: time.Millisecond}}, nil)
	id := b.charge(t, "k1", `{"amount":5}`)
	b.charge(t, "", `{"amount":6}`)
	for _, req := range []struct{ method, path string }{{http.MethodPost, "/v1/notifications"}, {http.MethodPut, "/v1/objects/o1"}} {
		r, err := http.NewRequest(req.method, b.url+req.path, strings.NewReader(`{"amount":7}`))
		require.NoError(t, err)
		resp, err := http.DefaultClient.Do(r)
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
	}

	got := b.idle(t)
	require.Len(t, got, 1)
	d := got[0]
	require.NoError(t, d.verified)
	require.Equal(t, "application/json", d.header.Get("Content-Type"))
	require.InDelta(t, time.Now().Unix(), d.event.Created, 5)
	want := fmt.Sprintf(`{"id":"evt_000001","type":"charge.succeeded","created":%d,"data":{"object":{"id":"%s","object":"charge","reference":"k1","status":"succeeded","request":{"amount":5}}}}`,
		d.event.Created, id)
	require.Equal(t, want, string(d.body))

	truth := b.sim.Snapshot()
	require.Equal(t, []WebhookTruth{{EventID: "evt_000001", Type: EventChargeSucceeded, Reference: "k1", EffectID: id,
		Genuine: true, Deliveries: 1, LastStatus: 200, Acknowledged: true}}, truth.Webhooks)
	resp, err := http.Get(b.url + "/sim/truth")
	require.NoError(t, err)
	defer resp.Body.Close()
	var served Truth
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&served))
	require.Equal(t, truth.Webhooks, served.Webhooks)
}

// TestWebhookEventsWithCompletion: with Completion a charge is reported processing, then
// succeeded or failed, each by an event of its own id.
func TestWebhookEventsWithCompletion(t *testing.T) {
	t.Parallel()
	b := setupHooks(t, Config{Completion: 30 * time.Millisecond, Webhooks: &WebhookConfig{Delay: time.Millisecond}}, nil)
	b.charge(t, "ok", `{"amount":1}`)
	b.charge(t, "bad", `{"amount":2,"sim":{"completes":"failed"}}`)
	byRef := map[string][]delivery{}
	ids := map[string]bool{}
	for _, d := range b.idle(t) {
		require.NoError(t, d.verified)
		byRef[d.event.Data.Object.Reference] = append(byRef[d.event.Data.Object.Reference], d)
		ids[d.event.ID] = true
	}
	require.Len(t, ids, 4, "every event has an id of its own")
	// Events are made in order; 30 ms apart, they may still arrive out of it on a loaded
	// machine (the race detector's run in CI once did): compare them in the order made.
	for _, ds := range byRef {
		slices.SortFunc(ds, func(a, b delivery) int { return strings.Compare(a.event.ID, b.event.ID) })
	}
	require.Equal(t, []string{EventChargeProcessing, EventChargeSucceeded}, types(byRef["ok"]))
	require.Equal(t, []string{EventChargeProcessing, EventChargeFailed}, types(byRef["bad"]))
	require.Equal(t, StatusProcessing, byRef["bad"][0].event.Data.Object.Status)
	require.Equal(t, StatusFailed, byRef["bad"][1].event.Data.Object.Status)
	require.Equal(t, StatusSucceeded, byRef["ok"][1].event.Data.Object.Status)
	for _, r := range b.sim.Snapshot().Webhooks {
		require.True(t, r.Genuine && r.Acknowledged, "%+v", r)
	}
}

// TestWebhookSignature: the contract's verifier, reading the secret where the contract
// says, accepts what the target signs and refuses it under another secret.
func TestWebhookSignature(t *testing.T) {
	const env = "SIMTARGET_TEST_WEBHOOK_SECRET"
	t.Setenv(env, testWebhookSecret)
	cfg := Config{Webhooks: &WebhookConfig{Delay: time.Millisecond, SecretSource: target.Secret{Env: env}}}
	b := setupHooks(t, cfg, nil)
	b.charge(t, "k1", `{"amount":5}`)
	got := b.idle(t)
	require.Len(t, got, 1)
	d := got[0]
	require.NoError(t, b.contract.Verifier().Verify(d.header, d.body, time.Now()))
	require.Regexp(t, `^t=\d+,v1=[0-9a-f]{64}$`, d.header.Get("Stripe-Signature"))

	var sigErr *target.SignatureError
	require.ErrorAs(t, b.contract.Verifier().Verify(d.header, append(bytes.Clone(d.body), ' '), time.Now()), &sigErr)
	t.Setenv(env, "whsec_another_secret")
	require.ErrorAs(t, b.contract.Verifier().Verify(d.header, d.body, time.Now()), &sigErr)
	require.Equal(t, "mismatch", sigErr.Reason)

	_, err := target.New(Contracts("http://127.0.0.1:1", cfg)...)
	require.NoError(t, err)
	cfg.Webhooks.Account = true
	contracts := Contracts("http://127.0.0.1:1", cfg)
	_, err = target.New(contracts...)
	require.NoError(t, err)
	require.Equal(t, &target.FieldMatch{Remote: "/data/object/account", Payload: "/account"}, contracts[0].Evidence.Tenant)
	require.Nil(t, DemoContracts("http://127.0.0.1:1")[0].Evidence)
}

// TestWebhookFaults: each fault does what it says to a charge's events, and the genuine
// events still tell the truth.
func TestWebhookFaults(t *testing.T) {
	t.Parallel()
	const late = 150 * time.Millisecond
	payload := func(f WebhookFault) string {
		return `{"amount":5,"account":"acct_1","sim":{"webhook":"` + string(f) + `"}}`
	}
	for _, tc := range []struct {
		fault WebhookFault
		check func(t *testing.T, b *hookBundle, sent time.Time, got []delivery, truth Truth)
	}{
		{WebhookDuplicate, func(t *testing.T, _ *hookBundle, _ time.Time, got []delivery, truth Truth) {
			require.Len(t, got, 4)
			byID := byEvent(got)
			require.Len(t, byID, 2)
			for _, ds := range byID {
				require.Len(t, ds, 2)
				require.Equal(t, ds[0].body, ds[1].body)
			}
			dups := 0
			for _, r := range truth.Webhooks {
				if r.Duplicate {
					dups++
				}
			}
			require.Equal(t, 2, dups)
		}},
		{WebhookLate, func(t *testing.T, _ *hookBundle, sent time.Time, got []delivery, _ Truth) {
			// The two events are sendings of their own, 20ms apart: a loaded machine may
			// deliver them in either order.
			require.ElementsMatch(t, []string{EventChargeProcessing, EventChargeSucceeded}, types(got))
			for _, d := range got {
				require.GreaterOrEqual(t, d.at.Sub(sent), late)
			}
		}},
		{WebhookReordered, func(t *testing.T, _ *hookBundle, _ time.Time, got []delivery, _ Truth) {
			require.Equal(t, []string{EventChargeSucceeded, EventChargeProcessing}, types(got))
		}},
		{WebhookUnknownReference, func(t *testing.T, _ *hookBundle, _ time.Time, got []delivery, truth Truth) {
			fab, _ := fabricated(t, got, truth)
			ref := fab.event.Data.Object.Reference
			require.NotContains(t, truth.Keys, ref, "no charge has the reference")
			require.NoError(t, uuid.Validate(ref))
			for _, r := range truth.Webhooks {
				if r.EventID == fab.event.ID {
					require.Equal(t, ref, r.Reference)
					require.Empty(t, r.EffectID)
				}
			}
		}},
		{WebhookChangedAmount, func(t *testing.T, b *hookBundle, _ time.Time, got []delivery, truth Truth) {
			fab, final := fabricated(t, got, truth)
			require.JSONEq(t, `6`, string(jsonAt(t, fab.event.Data.Object.Request, "amount")))
			ok, _ := b.contract.Evidence.FieldsMatch(fab.body, []byte(payload(WebhookChangedAmount)))
			require.False(t, ok)
			ok, _ = b.contract.Evidence.FieldsMatch(final.body, []byte(payload(WebhookChangedAmount)))
			require.True(t, ok, "the genuine event matches")
		}},
		{WebhookOtherTenant, func(t *testing.T, b *hookBundle, _ time.Time, got []delivery, truth Truth) {
			fab, final := fabricated(t, got, truth)
			require.True(t, strings.HasPrefix(fab.event.Data.Object.Account, "acct_other_"), fab.event.Data.Object.Account)
			ok, _ := b.contract.Evidence.TenantMatches(fab.body, []byte(payload(WebhookOtherTenant)))
			require.False(t, ok)
			require.Equal(t, "acct_1", final.event.Data.Object.Account)
			ok, _ = b.contract.Evidence.TenantMatches(final.body, []byte(payload(WebhookOtherTenant)))
			require.True(t, ok, "the genuine event names the request's account")
		}},
		{WebhookBadSignature, func(t *testing.T, _ *hookBundle, _ time.Time, got []delivery, truth Truth) {
			// Each event's genuine sending waits for its forged copy; the two events are
			// sendings of their own, so a loaded machine may interleave them.
			require.Len(t, got, 4)
			byID := byEvent(got)
			require.Len(t, byID, 2)
			for _, ds := range byID {
				require.Len(t, ds, 2)
				forged, genuine := ds[0], ds[1]
				require.Equal(t, forged.body, genuine.body)
				var sigErr *target.SignatureError
				require.ErrorAs(t, forged.verified, &sigErr, "the forged copy comes first")
				require.NoError(t, genuine.verified)
			}
			forged := 0
			for _, r := range truth.Webhooks {
				if r.Forged {
					forged++
					require.Equal(t, WebhookTruth{EventID: r.EventID, Type: r.Type, Reference: "k", EffectID: r.EffectID,
						Fault: WebhookBadSignature, Forged: true, Deliveries: 1, LastStatus: 401, GaveUp: true}, r)
				}
			}
			require.Equal(t, 2, forged)
		}},
	} {
		t.Run(string(tc.fault), func(t *testing.T) {
			t.Parallel()
			b := setupHooks(t, Config{Completion: 20 * time.Millisecond,
				Webhooks: &WebhookConfig{Delay: time.Millisecond, LateDelay: late, Account: true}}, nil)
			sent := time.Now()
			id := b.charge(t, "k", payload(tc.fault))
			got := b.idle(t)
			truth := b.sim.Snapshot()
			for _, r := range truth.Webhooks {
				require.Equal(t, tc.fault, r.Fault)
				if r.Genuine {
					require.Equal(t, "k", r.Reference)
					require.Equal(t, id, r.EffectID)
					require.Contains(t, []string{EventChargeProcessing, EventChargeSucceeded}, r.Type)
					require.True(t, r.Acknowledged, "%+v", r)
				}
			}
			tc.check(t, b, sent, got, truth)
		})
	}
}

// byEvent groups the deliveries by event id, each group in the order it arrived.
func byEvent(got []delivery) map[string][]delivery {
	byID := map[string][]delivery{}
	for _, d := range got {
		byID[d.event.ID] = append(byID[d.event.ID], d)
	}
	return byID
}

// fabricated returns the one fabricated event among the deliveries and the genuine final
// one, and checks that the fabricated event is a copy of the final one with an id of its
// own, delivered before it. The processing event is a sending of its own, which a loaded
// machine may deliver at any point.
func fabricated(t *testing.T, got []delivery, truth Truth) (fab, final delivery) {
	t.Helper()
	require.Len(t, got, 3)
	genuine := map[string]bool{}
	for _, r := range truth.Webhooks {
		genuine[r.EventID] = r.Genuine
	}
	var fabs, finals []int
	for i, d := range got {
		require.NoError(t, d.verified, "a fabricated event is signed as the vendor would")
		switch {
		case !genuine[d.event.ID]:
			fabs = append(fabs, i)
		case d.event.Type == EventChargeSucceeded:
			finals = append(finals, i)
		}
	}
	require.Len(t, fabs, 1)
	require.Len(t, finals, 1)
	require.Less(t, fabs[0], finals[0], "the fabricated event comes before the genuine final one")
	fab, final = got[fabs[0]], got[finals[0]]
	require.NotEqual(t, final.event.ID, fab.event.ID)
	require.Equal(t, final.event.Type, fab.event.Type)
	return fab, final
}

// jsonAt returns the member name of a JSON object.
func jsonAt(t *testing.T, object json.RawMessage, name string) json.RawMessage {
	t.Helper()
	var doc map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(object, &doc))
	return doc[name]
}

// TestWebhookRetriesUntilAcknowledged: a delivery answered 503 is tried again.
func TestWebhookRetriesUntilAcknowledged(t *testing.T) {
	t.Parallel()
	b := setupHooks(t, Config{Webhooks: &WebhookConfig{Delay: time.Millisecond}}, func(n int) int {
		if n == 0 {
			return http.StatusServiceUnavailable
		}
		return http.StatusOK
	})
	b.charge(t, "k", `{"amount":1}`)
	got := b.idle(t)
	require.Len(t, got, 2)
	require.Equal(t, got[0].body, got[1].body)
	require.GreaterOrEqual(t, got[1].at.Sub(got[0].at), minBackoff)
	r := b.sim.Snapshot().Webhooks
	require.Len(t, r, 1)
	require.Equal(t, 2, r[0].Deliveries)
	require.Equal(t, 200, r[0].LastStatus)
	require.True(t, r[0].Acknowledged)
}

// TestWebhookFailsOver: a delivery that gets no answer is tried at the next URL.
func TestWebhookFailsOver(t *testing.T) {
	t.Parallel()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	dead := "http://" + lis.Addr().String() + WebhookPath
	require.NoError(t, lis.Close())
	rec := &receiver{}
	recSrv := httptest.NewServer(rec)
	defer recSrv.Close()
	b := setupHooks(t, Config{Webhooks: &WebhookConfig{Delay: time.Millisecond, URLs: []string{dead, recSrv.URL + WebhookPath}}}, nil)
	rec.verifier = b.receiver.verifier
	b.charge(t, "k", `{"amount":1}`)
	require.Empty(t, b.idle(t), "the bundle's own receiver is not among the URLs")
	require.Len(t, rec.deliveries(), 1)
	r := b.sim.Snapshot().Webhooks
	require.Len(t, r, 1)
	require.Equal(t, 2, r[0].Deliveries, "the first URL, then the second")
	require.True(t, r[0].Acknowledged)
}

// TestWebhookGivesUp: a delivery never acknowledged is given up after RetryFor.
func TestWebhookGivesUp(t *testing.T) {
	t.Parallel()
	b := setupHooks(t, Config{Webhooks: &WebhookConfig{Delay: time.Millisecond, RetryFor: 250 * time.Millisecond}},
		func(int) int { return http.StatusInternalServerError })
	b.charge(t, "k", `{"amount":1}`)
	got := b.idle(t)
	require.GreaterOrEqual(t, len(got), 3, "tries at 0, 100ms and 300ms")
	r := b.sim.Snapshot().Webhooks
	require.Len(t, r, 1)
	require.Equal(t, WebhookTruth{EventID: r[0].EventID, Type: EventChargeSucceeded, Reference: "k", EffectID: r[0].EffectID,
		Genuine: true, Deliveries: len(got), LastStatus: 500, GaveUp: true}, r[0])
}

// TestWebhookCloseStopsDeliveries: Close stops an event still waiting and queues no more.
func TestWebhookCloseStopsDeliveries(t *testing.T) {
	t.Parallel()
	b := setupHooks(t, Config{Completion: time.Hour, Webhooks: &WebhookConfig{Delay: time.Millisecond}}, nil)
	b.charge(t, "k", `{"amount":1}`)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, b.sim.WebhooksIdle(ctx), context.DeadlineExceeded, "the final event waits for the completion")
	b.sim.Close()
	require.NoError(t, b.sim.WebhooksIdle(context.Background()))
	b.charge(t, "k2", `{"amount":1}`)
	r := b.sim.Snapshot().Webhooks
	require.Len(t, r, 2, "no event after Close")
	for _, rec := range r {
		if rec.Type == EventChargeSucceeded {
			require.Zero(t, rec.Deliveries)
			require.False(t, rec.Acknowledged || rec.GaveUp)
		}
	}
}

// TestWebhookFaultRatesAreSeeded: random webhook faults are the same for the same seed,
// and Heal stops them.
func TestWebhookFaultRatesAreSeeded(t *testing.T) {
	t.Parallel()
	cfg := Config{Seed: 7, Webhooks: &WebhookConfig{FaultRates: map[WebhookFault]float64{WebhookDuplicate: 0.3, WebhookLate: 0.3}}}
	pick := func(sim *Target) []WebhookFault {
		sim.hooks.mu.Lock()
		defer sim.hooks.mu.Unlock()
		var out []WebhookFault
		for range 30 {
			out = append(out, sim.hooks.chooseFault([]byte(`{}`)))
		}
		return out
	}
	a, b := New(cfg), New(cfg)
	defer a.Close()
	defer b.Close()
	first := pick(a)
	require.Equal(t, first, pick(b))
	require.Contains(t, first, WebhookDuplicate)
	require.Contains(t, first, WebhookLate)
	a.Heal()
	require.Equal(t, make([]WebhookFault, 30), pick(a))
}
