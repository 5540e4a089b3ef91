package target

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Evidence says how to read the events a target reports about its effects, by webhook
// (Webhook) or through an internal service that receives them (EvidenceService). An
// event is evidence for exactly one operation, found by its reference; docs/evidence.md.
type Evidence struct {
	// EventID, EventType and Reference are the JSON pointers of the event's id (unique
	// within the target: a repeat of it adds nothing), its type, and the reference of the
	// operation it is about.
	EventID   string `yaml:"event_id"`
	EventType string `yaml:"event_type"`
	Reference string `yaml:"reference"`
	// ReferenceKind says what the reference is: ReferenceRemoteKey (the key the broker
	// sent, which the target echoes) or ReferenceRemoteRef (the target's own reference,
	// known to the broker once a send's answer was recorded).
	ReferenceKind string `yaml:"reference_kind"`
	// RemoteRef is the pointer of the target's reference, for events found by the remote
	// key: a success needs it.
	RemoteRef string `yaml:"remote_ref,omitempty"`
	// Tenant, optional, pairs where the event names the account or tenant at the target
	// with the field of the approved payload that must hold the same: an event that
	// names another, or none, is quarantined as a tenant conflict.
	Tenant *FieldMatch `yaml:"tenant,omitempty"`
	// Match lists the fields the event's object must share with the approved payload,
	// like a lookup's: an event that disagrees is quarantined, never applied.
	Match []FieldMatch `yaml:"match,omitempty"`
	// The event types that say the effect succeeded, is pending, or failed. Failed only
	// where Documented quotes the vendor saying that state is final and had no effect.
	// An event of a type in no list is acknowledged and ignored.
	Succeeded  []string `yaml:"succeeded"`
	Pending    []string `yaml:"pending,omitempty"`
	Failed     []string `yaml:"failed,omitempty"`
	Documented string   `yaml:"documented,omitempty"`
	// MatchFor is how long an event whose reference names no operation is matched again
	// before it is quarantined as unmatched: a webhook can come before the broker has
	// recorded the answer that carries the target's reference (DefaultMatchFor).
	MatchFor Duration `yaml:"match_for,omitempty"`
	// ExpectedWithin, optional, is how long after a send the target's events can be
	// expected. For a target without a lookup, an UNKNOWN operation that would be
	// escalated waits for them until then (bounded by the resolution deadline), since
	// they are its only way to be resolved without a person.
	ExpectedWithin Duration `yaml:"expected_within,omitempty"`

	Webhook *Webhook `yaml:"webhook,omitempty"`
}

// The kinds of reference an event can carry (Evidence.ReferenceKind).
const (
	ReferenceRemoteKey = "remote_key"
	ReferenceRemoteRef = "remote_ref"
)

// DefaultMatchFor is how long an unmatched event is matched again when the contract does
// not say.
const DefaultMatchFor = 10 * time.Minute

// String says in a line how the target's events arrive and are matched, for
// opbroker targets check.
func (e *Evidence) String() string {
	how := "reported by internal services only (no webhook)"
	if w := e.Webhook; w != nil {
		how = fmt.Sprintf("webhook at %s, signed (%s, secret in %s)", w.Path, w.Signature.Scheme, w.Signature.Secret)
	}
	by := "the target's reference"
	if e.ReferenceKind == ReferenceRemoteKey {
		by = "the broker's key"
	}
	tenant := ""
	if e.Tenant != nil {
		tenant = ", its account at " + e.Tenant.Remote
	}
	return fmt.Sprintf("%s; matched by %s at %s%s, then %d field(s) of the approved payload; an unmatched event is matched again for %s",
		how, by, e.Reference, tenant, len(e.Match), e.MatchWindow())
}

// MatchWindow returns how long an unmatched event is matched again.
func (e *Evidence) MatchWindow() time.Duration {
	if e.MatchFor <= 0 {
		return DefaultMatchFor
	}
	return e.MatchFor.D()
}

// Webhook is where and how the target posts its events to the broker's webhook
// listener.
type Webhook struct {
	// Path is the listener's path for this target's events, e.g. /stripe.
	Path      string    `yaml:"path"`
	Signature Signature `yaml:"signature"`
}

// Signature is how a webhook's sender proves it holds the shared secret: an HMAC-SHA256
// over the raw body (and, for the timestamped schemes, its timestamp), verified before
// anything of the body is read.
type Signature struct {
	// Scheme is one of the vendors' documented formats: SignatureStripe,
	// SignatureStandardWebhooks or SignatureHMACHex.
	Scheme string `yaml:"scheme"`
	Secret Secret `yaml:"secret"`
	// Header and Prefix, for SignatureHMACHex: the header that carries the hex digest,
	// and what precedes it (GitHub's "sha256=").
	Header string `yaml:"header,omitempty"`
	Prefix string `yaml:"prefix,omitempty"`
	// Tolerance, for the timestamped schemes, is how far a signature's timestamp may be
	// from the broker's clock (DefaultTolerance): a replayed old delivery is refused.
	Tolerance Duration `yaml:"tolerance,omitempty"`
	// Documented links the vendor's description of the scheme.
	Documented string `yaml:"documented"`
}

// The signature schemes.
const (
	// SignatureStripe: header Stripe-Signature "t=<unix seconds>,v1=<hex>[,v1=<hex>…]",
	// the HMAC of "<t>.<body>" keyed by the whole secret's bytes.
	SignatureStripe = "stripe"
	// SignatureStandardWebhooks: headers webhook-id, webhook-timestamp and
	// webhook-signature "v1,<base64>[ v1,<base64>…]", the HMAC of "<id>.<timestamp>.<body>"
	// keyed by the base64-decoded secret after its "whsec_" prefix.
	SignatureStandardWebhooks = "standard_webhooks"
	// SignatureHMACHex: the header holds Prefix and the hex HMAC of the body keyed by the
	// secret's bytes; no timestamp (GitHub's X-Hub-Signature-256).
	SignatureHMACHex = "hmac_sha256_hex"
)

// DefaultTolerance is how old or new a timestamped signature may be when the contract
// does not say (Stripe's libraries and the Standard Webhooks library use 5 minutes).
const DefaultTolerance = 5 * time.Minute

func (s *Signature) tolerance() time.Duration {
	if s.Tolerance <= 0 {
		return DefaultTolerance
	}
	return s.Tolerance.D()
}

// Meaning is what an event says of the effect.
type Meaning string

// The meanings of events; an event of another type means nothing to the broker.
const (
	MeaningSucceeded Meaning = "SUCCEEDED"
	MeaningPending   Meaning = "PENDING"
	MeaningFailed    Meaning = "FAILED"
)

// Event is what the contract reads of one event.
type Event struct {
	ID        string
	Type      string
	Meaning   Meaning // "" for a type in no list: ignored
	Reference string
	RemoteRef string // the target's reference: the reference itself, or at Evidence.RemoteRef
}

// Limits of what an event's fields may hold (the ledger's columns).
const (
	maxEventID   = 256
	maxEventType = 256
	maxReference = 512
)

// ErrMalformedEvent means the event is not JSON or lacks a field the contract reads.
var ErrMalformedEvent = errors.New("malformed event")

// Read reads an event's id, type, meaning and references. It does not judge whether
// the event matches anything. An event of a type in no list is read no further: it
// means nothing to the broker, and its other fields may be anywhere or nowhere (a
// provider sends an endpoint events of every kind).
func (e *Evidence) Read(body []byte) (Event, error) {
	var ev Event
	var err error
	if ev.Type, err = eventField(body, "event_type", e.EventType, maxEventType); err != nil {
		return Event{}, err
	}
	switch {
	case slices.Contains(e.Succeeded, ev.Type):
		ev.Meaning = MeaningSucceeded
	case slices.Contains(e.Pending, ev.Type):
		ev.Meaning = MeaningPending
	case slices.Contains(e.Failed, ev.Type):
		ev.Meaning = MeaningFailed
	default:
		return ev, nil
	}
	if ev.ID, err = eventField(body, "event_id", e.EventID, maxEventID); err != nil {
		return Event{}, err
	}
	if ev.Reference, err = eventField(body, "reference", e.Reference, maxReference); err != nil {
		return Event{}, err
	}
	if e.ReferenceKind == ReferenceRemoteRef {
		ev.RemoteRef = ev.Reference
	} else if e.RemoteRef != "" {
		if ref, ok := remoteRefAt(body, e.RemoteRef); ok {
			ev.RemoteRef = ref
		}
	}
	return ev, nil
}

// eventField reads the string at pointer in an event's body, one of its fields (name):
// present, at most limit bytes, without control characters.
func eventField(body []byte, name, pointer string, limit int) (string, error) {
	v, ok := jsonPointerString(body, pointer)
	switch {
	case !ok:
		return "", fmt.Errorf("%w: no %s at %s", ErrMalformedEvent, name, pointer)
	case len(v) > limit:
		return "", fmt.Errorf("%w: %s is longer than %d bytes", ErrMalformedEvent, name, limit)
	case strings.ContainsFunc(v, isControl):
		return "", fmt.Errorf("%w: %s holds a control character", ErrMalformedEvent, name)
	}
	return v, nil
}

// TenantMatches checks the tenant the event names against the approved payload: true
// when the contract names none.
func (e *Evidence) TenantMatches(body, approved []byte) (bool, string) {
	if e.Tenant == nil {
		return true, ""
	}
	return fieldsMatch(body, approved, []FieldMatch{*e.Tenant}, "the event")
}

// FieldsMatch checks the event's object against the approved payload's match fields.
func (e *Evidence) FieldsMatch(body, approved []byte) (bool, string) {
	return fieldsMatch(body, approved, e.Match, "the event")
}

// fieldsMatch reports whether the object agrees with the approved payload on every
// field, or names the first that does not.
func fieldsMatch(object, approved []byte, fields []FieldMatch, what string) (bool, string) {
	for _, m := range fields {
		remote, ok1 := jsonPointer(object, m.Remote, false)
		want, ok2 := jsonPointer(approved, m.Payload, false)
		if !ok1 || !ok2 || !reflect.DeepEqual(remote, want) {
			return false, fmt.Sprintf("%s's %s does not match the approved payload's %s", what, m.Remote, m.Payload)
		}
	}
	return true, ""
}

// SignatureError is a webhook whose signature does not verify; Reason is a stable word
// for the rejection counter.
type SignatureError struct {
	Reason string // missing, malformed, mismatch, timestamp
	Detail string
}

func (e *SignatureError) Error() string { return "webhook signature: " + e.Detail }

// Verifier checks a target's webhook signatures, reading the secret at each use (a
// variable every time, a file when it changed), so a rotated secret applies at once.
type Verifier struct {
	sig    *Signature
	secret *secretSource
}

// Verifier returns the contract's webhook verifier, nil without a webhook.
func (c *Contract) Verifier() *Verifier {
	if c.Evidence == nil || c.Evidence.Webhook == nil {
		return nil
	}
	s := &c.Evidence.Webhook.Signature
	return &Verifier{sig: s, secret: newSecretSource(s.Secret)}
}

// Verify checks the signature of a delivery on its raw body, at now. A *SignatureError
// is the sender's; any other error is the broker's (its secret cannot be read).
func (v *Verifier) Verify(h http.Header, body []byte, now time.Time) error {
	secret, err := v.secret.get()
	if err != nil {
		return fmt.Errorf("webhook secret: %w", err)
	}
	return v.sig.verify(h, body, secret, now)
}

func (s *Signature) verify(h http.Header, body []byte, secret string, now time.Time) error {
	key, err := s.hmacKey(secret)
	if err != nil {
		return err
	}
	switch s.Scheme {
	case SignatureStripe:
		header := h.Get("Stripe-Signature")
		if header == "" {
			return &SignatureError{"missing", "no Stripe-Signature header"}
		}
		var timestamp string
		var signatures []string
		for part := range strings.SplitSeq(header, ",") {
			key, value, _ := strings.Cut(strings.TrimSpace(part), "=")
			switch key {
			case "t":
				timestamp = value
			case "v1":
				signatures = append(signatures, value)
			}
		}
		if err := s.checkTimestamp(timestamp, now); err != nil {
			return err
		}
		mac := sign(key, timestamp, ".", string(body))
		return anyEqual(signatures, hex.EncodeToString(mac))
	case SignatureStandardWebhooks:
		id, timestamp, header := h.Get("webhook-id"), h.Get("webhook-timestamp"), h.Get("webhook-signature")
		if id == "" || header == "" {
			return &SignatureError{"missing", "no webhook-id or webhook-signature header"}
		}
		if err := s.checkTimestamp(timestamp, now); err != nil {
			return err
		}
		var signatures []string
		for entry := range strings.FieldsSeq(header) {
			if version, value, ok := strings.Cut(entry, ","); ok && version == "v1" {
				signatures = append(signatures, value)
			}
		}
		mac := sign(key, id, ".", timestamp, ".", string(body))
		return anyEqual(signatures, base64.StdEncoding.EncodeToString(mac))
	default: // SignatureHMACHex
		header := h.Get(s.Header)
		if header == "" {
			return &SignatureError{"missing", "no " + s.Header + " header"}
		}
		value, ok := strings.CutPrefix(header, s.Prefix)
		if !ok {
			return &SignatureError{"malformed", fmt.Sprintf("%s does not begin with %q", s.Header, s.Prefix)}
		}
		return anyEqual([]string{value}, hex.EncodeToString(sign(key, string(body))))
	}
}

// checkTimestamp refuses a signature timestamp (unix seconds) farther than the
// tolerance from now, in either direction.
func (s *Signature) checkTimestamp(timestamp string, now time.Time) error {
	seconds, err := strconv.ParseInt(timestamp, 10, 64)
	if err != nil {
		return &SignatureError{"malformed", "the signature's timestamp is not a number of seconds"}
	}
	// In whole seconds, not a time.Duration: a timestamp centuries away saturates
	// now.Sub, whose negation overflows back to itself and passed both comparisons.
	tolerance := int64(s.tolerance() / time.Second)
	if seconds < now.Unix()-tolerance || seconds > now.Unix()+tolerance {
		return &SignatureError{"timestamp", fmt.Sprintf("the signature's timestamp is %s from the broker's clock, more than the tolerance of %s",
			now.Sub(time.Unix(seconds, 0)).Round(time.Second), s.tolerance())}
	}
	return nil
}

// minKey is the fewest bytes a signing key may have (128 bits): a shorter one, above all
// an empty one (a standard_webhooks secret of whsec_ alone) or a stripe secret of its
// prefix alone, would let anyone sign.
const minKey = 16

// hmacKey returns the key the scheme signs with, from the secret as read: for
// standard_webhooks the base64 after whsec_, for the others the secret's bytes; at
// least minKey bytes.
func (s *Signature) hmacKey(secret string) ([]byte, error) {
	key := []byte(secret)
	if s.Scheme == SignatureStandardWebhooks {
		var err error
		if key, err = base64.StdEncoding.DecodeString(strings.TrimPrefix(secret, "whsec_")); err != nil {
			return nil, fmt.Errorf("webhook secret: %s does not hold whsec_ and base64", s.Secret)
		}
	}
	if len(key) < minKey {
		return nil, fmt.Errorf("webhook secret: %s holds a key of %d bytes, fewer than %d", s.Secret, len(key), minKey)
	}
	return key, nil
}

func sign(key []byte, parts ...string) []byte {
	mac := hmac.New(sha256.New, key)
	for _, p := range parts {
		mac.Write([]byte(p))
	}
	return mac.Sum(nil)
}

// anyEqual compares in constant time, so the time taken says nothing of the secret.
func anyEqual(signatures []string, want string) error {
	if len(signatures) == 0 {
		return &SignatureError{"malformed", "no signature of the expected version"}
	}
	ok := false
	for _, s := range signatures {
		ok = hmac.Equal([]byte(s), []byte(want)) || ok
	}
	if !ok {
		return &SignatureError{"mismatch", "no signature matches the body"}
	}
	return nil
}

var pathPattern = regexp.MustCompile(`^(/[A-Za-z0-9._~-]+)+$`)

func (e *Evidence) validate(bad func(field, format string, args ...any)) {
	for _, p := range []struct{ field, pointer string }{
		{"evidence.event_id", e.EventID}, {"evidence.event_type", e.EventType}, {"evidence.reference", e.Reference},
	} {
		if !strings.HasPrefix(p.pointer, "/") {
			bad(p.field, "must be a JSON pointer, e.g. /id")
		}
	}
	switch e.ReferenceKind {
	case ReferenceRemoteRef:
	case ReferenceRemoteKey:
		if !strings.HasPrefix(e.RemoteRef, "/") {
			bad("evidence.remote_ref", "must be the JSON pointer of the target's reference: an event found by the remote key needs it to record a success")
		}
	default:
		bad("evidence.reference_kind", "must be %s or %s", ReferenceRemoteKey, ReferenceRemoteRef)
	}
	if t := e.Tenant; t != nil && (!strings.HasPrefix(t.Remote, "/") || !strings.HasPrefix(t.Payload, "/")) {
		bad("evidence.tenant", "remote and payload must be JSON pointers, e.g. /account")
	}
	for i, m := range e.Match {
		if !strings.HasPrefix(m.Remote, "/") || !strings.HasPrefix(m.Payload, "/") {
			bad(fmt.Sprintf("evidence.match[%d]", i), "remote and payload must be JSON pointers, e.g. /data/object/amount")
		}
	}
	if len(e.Succeeded) == 0 {
		bad("evidence.succeeded", "at least one event type must confirm the effect")
	}
	if len(e.Failed) > 0 && strings.TrimSpace(e.Documented) == "" {
		bad("evidence.documented", "must quote the vendor saying the failed event types are final and had no effect")
	}
	seen := map[string]string{}
	for _, list := range []struct {
		name  string
		types []string
	}{{"succeeded", e.Succeeded}, {"pending", e.Pending}, {"failed", e.Failed}} {
		for _, t := range list.types {
			if other, dup := seen[t]; dup {
				bad("evidence."+list.name, "%q is also listed under %s", t, other)
			}
			seen[t] = list.name
		}
	}
	if e.MatchFor < 0 || e.MatchFor.D() > 7*24*time.Hour {
		bad("evidence.match_for", "must be between 0 (the default, %s) and a week", DefaultMatchFor)
	}
	if e.ExpectedWithin < 0 || e.ExpectedWithin.D() > 7*24*time.Hour {
		bad("evidence.expected_within", "must be between 0 (no wait) and a week")
	}
	if w := e.Webhook; w != nil {
		w.validate(bad)
	}
}

func (w *Webhook) validate(bad func(field, format string, args ...any)) {
	if !pathPattern.MatchString(w.Path) {
		bad("evidence.webhook.path", "must be a URL path such as /stripe")
	}
	s := &w.Signature
	switch s.Scheme {
	case SignatureStripe, SignatureStandardWebhooks:
		if s.Header != "" || s.Prefix != "" {
			bad("evidence.webhook.signature", "header and prefix are only for %s: %s names its own headers", SignatureHMACHex, s.Scheme)
		}
	case SignatureHMACHex:
		if !headerPattern.MatchString(s.Header) {
			bad("evidence.webhook.signature.header", "must be the HTTP header of the signature, e.g. X-Hub-Signature-256")
		}
		if s.Tolerance != 0 {
			bad("evidence.webhook.signature.tolerance", "%s carries no timestamp: a tolerance cannot apply", SignatureHMACHex)
		}
	default:
		bad("evidence.webhook.signature.scheme", "must be %s, %s or %s", SignatureStripe, SignatureStandardWebhooks, SignatureHMACHex)
	}
	s.Secret.validate(bad, "evidence.webhook.signature.secret")
	if s.Tolerance < 0 || s.Tolerance.D() > time.Hour {
		bad("evidence.webhook.signature.tolerance", "must be between 0 (the default, %s) and an hour", DefaultTolerance)
	}
	if strings.TrimSpace(s.Documented) == "" {
		bad("evidence.webhook.signature.documented", "must link the vendor's description of the signature")
	}
}
