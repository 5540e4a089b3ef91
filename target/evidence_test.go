package target_test

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/target"
)

// webhookContract is a contract whose events are read as the simulated charges' are,
// with the signature scheme sig.
func webhookContract(t *testing.T, sig target.Signature) *target.Contract {
	t.Helper()
	c := &target.Contract{Name: "charges", OperationTypes: []string{"demo.charge"},
		Endpoint:  target.Endpoint{Method: "POST", URL: "http://127.0.0.1:1/v1/charges", Timeout: target.Duration(time.Second)},
		Responses: target.Responses{Success: []target.ResponseClass{{Status: []int{200}, RemoteRef: "/id"}}},
		Evidence: &target.Evidence{EventID: "/id", EventType: "/type", Reference: "/data/object/reference",
			ReferenceKind: target.ReferenceRemoteKey, RemoteRef: "/data/object/id",
			Succeeded: []string{"charge.succeeded"}, Pending: []string{"charge.processing"},
			Webhook: &target.Webhook{Path: "/charges", Signature: sig}}}
	_, err := target.New(c)
	require.NoError(t, err)
	return c
}

func hmacHex(key, msg string) string {
	m := hmac.New(sha256.New, []byte(key))
	m.Write([]byte(msg))
	return hex.EncodeToString(m.Sum(nil))
}

// TestWebhookSignatureSchemes: each scheme accepts what its vendor's documentation
// signs, and refuses a wrong secret, a changed body, an old or future timestamp and a
// missing header, each with its reason.
func TestWebhookSignatureSchemes(t *testing.T) {
	now := time.Unix(1_800_000_000, 0)
	body := []byte(`{"id":"evt_1","type":"charge.succeeded","data":{"object":{"id":"ch_1","reference":"k"}}}`)
	ts := fmt.Sprint(now.Unix())

	t.Setenv("TEST_WEBHOOK_SECRET", "whsec_test_0123456789")
	stripe := webhookContract(t, target.Signature{Scheme: target.SignatureStripe,
		Secret: target.Secret{Env: "TEST_WEBHOOK_SECRET"}, Documented: "https://docs.stripe.com/webhooks"}).Verifier()
	stripeHeader := func(ts string, secret string, body []byte) http.Header {
		h := http.Header{}
		h.Set("Stripe-Signature", "t="+ts+",v1=0000,v1="+hmacHex(secret, ts+"."+string(body))+",v0=ignored")
		return h
	}
	require.NoError(t, stripe.Verify(stripeHeader(ts, "whsec_test_0123456789", body), body, now), "any v1 that matches passes")
	for name, tc := range map[string]struct {
		h      http.Header
		body   []byte
		reason string
	}{
		"wrong secret":  {stripeHeader(ts, "whsec_other", body), body, "mismatch"},
		"changed body":  {stripeHeader(ts, "whsec_test_0123456789", body), append([]byte(" "), body...), "mismatch"},
		"old":           {stripeHeader(fmt.Sprint(now.Add(-6*time.Minute).Unix()), "whsec_test_0123456789", body), body, "timestamp"},
		"future":        {stripeHeader(fmt.Sprint(now.Add(6*time.Minute).Unix()), "whsec_test_0123456789", body), body, "timestamp"},
		"centuries on":  {stripeHeader("9000000000000000000", "whsec_test_0123456789", body), body, "timestamp"},
		"centuries ago": {stripeHeader("-9000000000000000000", "whsec_test_0123456789", body), body, "timestamp"},
		"no header":     {http.Header{}, body, "missing"},
		"no timestamp":  {http.Header{"Stripe-Signature": {"v1=" + hmacHex("whsec_test_0123456789", "."+string(body))}}, body, "malformed"},
		"no v1":         {http.Header{"Stripe-Signature": {"t=" + ts + ",v0=" + hmacHex("whsec_test_0123456789", ts+"."+string(body))}}, body, "malformed"},
		"not hex equal": {http.Header{"Stripe-Signature": {"t=" + ts + ",v1=" + strings.ToUpper(hmacHex("whsec_test_0123456789", ts+"."+string(body)))}}, body, "mismatch"},
	} {
		err := stripe.Verify(tc.h, tc.body, now)
		var sigErr *target.SignatureError
		require.True(t, errors.As(err, &sigErr), "%s: %v", name, err)
		require.Equal(t, tc.reason, sigErr.Reason, name)
	}

	// Standard Webhooks: the key is the base64 after whsec_; id.timestamp.body.
	key := []byte("a standard webhooks key of 32 b.")
	t.Setenv("TEST_STANDARD_SECRET", "whsec_"+base64.StdEncoding.EncodeToString(key))
	standard := webhookContract(t, target.Signature{Scheme: target.SignatureStandardWebhooks,
		Secret: target.Secret{Env: "TEST_STANDARD_SECRET"}, Documented: "https://www.standardwebhooks.com/"}).Verifier()
	h := standardSigned(key, "msg_1", ts, body, "v1,bm90IGl0")
	require.NoError(t, standard.Verify(h, body, now))
	h.Set("webhook-id", "msg_2")
	require.Error(t, standard.Verify(h, body, now), "the id is signed")

	// GitHub's documented test vector.
	t.Setenv("TEST_HUB_SECRET", "It's a Secret to Everybody")
	hub := webhookContract(t, target.Signature{Scheme: target.SignatureHMACHex, Header: "X-Hub-Signature-256", Prefix: "sha256=",
		Secret: target.Secret{Env: "TEST_HUB_SECRET"}, Documented: "https://docs.github.com/webhooks/using-webhooks/validating-webhook-deliveries"}).Verifier()
	h = http.Header{}
	h.Set("X-Hub-Signature-256", "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17")
	require.NoError(t, hub.Verify(h, []byte("Hello, World!"), now))
	require.Error(t, hub.Verify(h, []byte("Hello, World?"), now))

	// A secret that cannot be read is the broker's failure, not the sender's.
	t.Setenv("TEST_WEBHOOK_SECRET", "")
	err := stripe.Verify(stripeHeader(ts, "whsec_test_0123456789", body), body, now)
	var sigErr *target.SignatureError
	require.Error(t, err)
	require.False(t, errors.As(err, &sigErr), "an unreadable secret is not a bad signature: %v", err)
}

// TestAWebhookSecretMustHoldAKey: a secret that holds no usable key (for
// standard_webhooks whsec_ alone, whose empty key anyone can sign with, one too short,
// one that is not base64; for stripe its prefix alone) verifies nothing, and its
// credential is unreadable, so the broker does not start with it.
func TestAWebhookSecretMustHoldAKey(t *testing.T) { // not parallel: t.Setenv
	body, now := []byte(`{"id":"evt_1"}`), time.Now()
	ts := fmt.Sprint(now.Unix())
	for secret, usable := range map[string]bool{
		"whsec_": false, "whsec_" + base64.StdEncoding.EncodeToString([]byte("15 bytes of key")): false,
		"whsec_not base64!": false, "whsec_" + base64.StdEncoding.EncodeToString([]byte("sixteen byte key")): true,
	} {
		t.Setenv("TEST_STANDARD_SECRET", secret)
		c := webhookContract(t, target.Signature{Scheme: target.SignatureStandardWebhooks,
			Secret: target.Secret{Env: "TEST_STANDARD_SECRET"}, Documented: "https://www.standardwebhooks.com/"})
		key, _ := base64.StdEncoding.DecodeString(strings.TrimPrefix(secret, "whsec_"))
		err := c.Verifier().Verify(standardSigned(key, "msg_1", ts, body), body, now)
		creds := c.Credentials()
		require.Len(t, creds, 1)
		if usable {
			require.NoError(t, err, secret)
			require.Equal(t, target.CredentialPresent, creds[0].State, secret)
			continue
		}
		require.Error(t, err, "%q: nothing verifies", secret)
		require.False(t, errors.As(err, new(*target.SignatureError)), "%q: the broker's problem, not the sender's", secret)
		require.Equal(t, target.CredentialUnreadable, creds[0].State, secret)
	}
	// The other schemes sign with the secret's bytes: its prefix alone is no key either.
	t.Setenv("TEST_STRIPE_SECRET", "whsec_")
	stripe := webhookContract(t, target.Signature{Scheme: target.SignatureStripe, Secret: target.Secret{Env: "TEST_STRIPE_SECRET"},
		Documented: "x"})
	err := stripe.Verifier().Verify(http.Header{"Stripe-Signature": {"t=" + ts + ",v1=" + hmacHex("whsec_", ts+"."+string(body))}}, body, now)
	require.Error(t, err, "nothing verifies")
	require.False(t, errors.As(err, new(*target.SignatureError)), "the broker's problem, not the sender's")
	require.Equal(t, target.CredentialUnreadable, stripe.Credentials()[0].State)
	t.Setenv("TEST_HUB_SHORT_SECRET", "fifteen bytes!!")
	hub := webhookContract(t, target.Signature{Scheme: target.SignatureHMACHex, Header: "X-Hub-Signature-256", Prefix: "sha256=",
		Secret: target.Secret{Env: "TEST_HUB_SHORT_SECRET"}, Documented: "x"})
	require.Equal(t, target.CredentialUnreadable, hub.Credentials()[0].State, "a secret of 15 bytes")
}

// standardSigned is a Standard Webhooks delivery's headers, signed with key over
// id.ts.body; decoys are signatures put before the real one.
func standardSigned(key []byte, id, ts string, body []byte, decoys ...string) http.Header {
	mac := hmac.New(sha256.New, key)
	mac.Write([]byte(id + "." + ts + "." + string(body)))
	h := http.Header{}
	h.Set("webhook-id", id)
	h.Set("webhook-timestamp", ts)
	h.Set("webhook-signature", strings.Join(append(decoys, "v1,"+base64.StdEncoding.EncodeToString(mac.Sum(nil))), " "))
	return h
}

// TestEvidenceRead: an event's fields are read by the contract's pointers; a type in no
// list means nothing; a missing field is malformed.
func TestEvidenceRead(t *testing.T) {
	t.Parallel()
	e := webhookContract(t, target.Signature{Scheme: target.SignatureStripe, Secret: target.Secret{Env: "UNUSED_SECRET"},
		Documented: "x"}).Evidence
	ev, err := e.Read([]byte(`{"id":"evt_1","type":"charge.succeeded","data":{"object":{"id":"ch_1","reference":"k1"}}}`))
	require.NoError(t, err)
	require.Equal(t, target.Event{ID: "evt_1", Type: "charge.succeeded", Meaning: target.MeaningSucceeded, Reference: "k1", RemoteRef: "ch_1"}, ev)
	ev, err = e.Read([]byte(`{"id":"evt_2","type":"charge.refunded","data":{"object":{"id":"ch_1","reference":"k1"}}}`))
	require.NoError(t, err)
	require.Equal(t, target.Meaning(""), ev.Meaning)
	// A type in no list is read no further: an endpoint receives events of every kind.
	for _, body := range []string{`{"type":"customer.created","data":{"object":{"id":"cus_1"}}}`, `{"type":"balance.available"}`} {
		ev, err = e.Read([]byte(body))
		require.NoError(t, err, body)
		require.Equal(t, target.Meaning(""), ev.Meaning, body)
	}
	for _, body := range []string{`not json`, `{"id":"e","data":{"object":{"reference":"k"}}}`, `{"id":"e","type":"t\u0001"}`, `{"type":"charge.succeeded","data":{"object":{"reference":"k"}}}`,
		`{"id":"e","type":"charge.succeeded","data":{}}`, `{"id":"` + strings.Repeat("x", 300) + `","type":"charge.succeeded","data":{"object":{"reference":"k"}}}`,
		`{"id":"evt\u0000","type":"charge.succeeded","data":{"object":{"reference":"k"}}}`} {
		_, err := e.Read([]byte(body))
		require.ErrorIs(t, err, target.ErrMalformedEvent, body)
	}
}

// TestEvidenceSaysHowEventsArrive: targets check's line about a target's events.
func TestEvidenceSaysHowEventsArrive(t *testing.T) {
	t.Parallel()
	c := webhookContract(t, target.Signature{Scheme: target.SignatureStripe, Secret: target.Secret{Env: "S"}, Documented: "x"})
	c.Evidence.Tenant = &target.FieldMatch{Remote: "/data/object/account", Payload: "/account"}
	require.Equal(t, "webhook at /charges, signed (stripe, secret in environment variable S); matched by the broker's key at "+
		"/data/object/reference, its account at /data/object/account, then 0 field(s) of the approved payload; an unmatched event is matched again for 10m0s",
		c.Evidence.String())
}

// TestEvidenceValidation: a contract's evidence section is checked field by field.
func TestEvidenceValidation(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		adjust func(*target.Evidence)
		want   string
	}{
		"no pointer":         {func(e *target.Evidence) { e.EventID = "id" }, "evidence.event_id"},
		"kind":               {func(e *target.Evidence) { e.ReferenceKind = "intent" }, "evidence.reference_kind"},
		"key without ref":    {func(e *target.Evidence) { e.RemoteRef = "" }, "evidence.remote_ref"},
		"no success":         {func(e *target.Evidence) { e.Succeeded = nil }, "evidence.succeeded"},
		"undocumented fail":  {func(e *target.Evidence) { e.Failed = []string{"charge.failed"} }, "evidence.documented"},
		"type twice":         {func(e *target.Evidence) { e.Pending = []string{"charge.succeeded"} }, "also listed"},
		"path":               {func(e *target.Evidence) { e.Webhook.Path = "charges" }, "evidence.webhook.path"},
		"scheme":             {func(e *target.Evidence) { e.Webhook.Signature.Scheme = "md5" }, "evidence.webhook.signature.scheme"},
		"secret":             {func(e *target.Evidence) { e.Webhook.Signature.Secret = target.Secret{} }, "evidence.webhook.signature.secret"},
		"hex needs a header": {func(e *target.Evidence) { e.Webhook.Signature.Scheme = target.SignatureHMACHex }, "evidence.webhook.signature.header"},
		"undocumented sig":   {func(e *target.Evidence) { e.Webhook.Signature.Documented = "" }, "evidence.webhook.signature.documented"},
		"long match window":  {func(e *target.Evidence) { e.MatchFor = target.Duration(8 * 24 * time.Hour) }, "evidence.match_for"},
	} {
		c := &target.Contract{Name: "charges", OperationTypes: []string{"demo.charge"},
			Endpoint:  target.Endpoint{Method: "POST", URL: "http://127.0.0.1:1/v1/charges", Timeout: target.Duration(time.Second)},
			Responses: target.Responses{Success: []target.ResponseClass{{Status: []int{200}, RemoteRef: "/id"}}},
			Evidence: &target.Evidence{EventID: "/id", EventType: "/type", Reference: "/data/object/reference",
				ReferenceKind: target.ReferenceRemoteKey, RemoteRef: "/data/object/id", Succeeded: []string{"charge.succeeded"},
				Webhook: &target.Webhook{Path: "/charges", Signature: target.Signature{Scheme: target.SignatureStripe,
					Secret: target.Secret{Env: "S"}, Documented: "x"}}}}
		tc.adjust(c.Evidence)
		_, err := target.New(c)
		require.ErrorContains(t, err, tc.want, name)
	}
}
