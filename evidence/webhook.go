package evidence

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"time"

	"github.com/opbroker/opbroker/target"
)

// DefaultMaxWebhookBody is the largest webhook body the listener reads when the
// configuration does not say (Stripe's events are a few kilobytes).
const DefaultMaxWebhookBody = 256 << 10

// Webhooks serves the targets' webhooks, each at its contract's path. A delivery is
// answered 2xx only once its event is durable; its signature is verified on the raw
// bytes before any of them is parsed. What it answers:
//
//   - 200: kept (or kept before: a repeated event id adds nothing), or of a type the
//     contract does not list (acknowledged, not kept);
//   - 400: signed, but not an event the contract can read (no id, type or reference);
//   - 401: no signature, or one that does not verify (counted, never kept);
//   - 404 no target at the path, 405 not a POST, 413 a body over the limit;
//   - 503: the broker cannot keep it now (its database, or its copy of the secret): the
//     sender delivers it again later.
type Webhooks struct {
	matcher *Matcher
	byPath  map[string]webhookTarget
	maxBody int64
	clock   func() time.Time
}

type webhookTarget struct {
	contract *target.Contract
	verifier *target.Verifier
}

// NewWebhooks returns the handler of the webhooks of targets, reading bodies up to
// maxBody bytes (DefaultMaxWebhookBody when 0), verifying timestamps against clock
// (time.Now when nil).
func NewWebhooks(m *Matcher, targets *target.Targets, maxBody int64, clock func() time.Time) *Webhooks {
	if maxBody <= 0 {
		maxBody = DefaultMaxWebhookBody
	}
	if clock == nil {
		clock = time.Now
	}
	w := &Webhooks{matcher: m, byPath: map[string]webhookTarget{}, maxBody: maxBody, clock: clock}
	for _, c := range targets.All() {
		if c.Evidence != nil && c.Evidence.Webhook != nil {
			w.byPath[c.Evidence.Webhook.Path] = webhookTarget{contract: c, verifier: c.Verifier()}
			m.metrics.StartRejectedAtZero(c.Name, rejectionReasons)
		}
	}
	return w
}

// rejectionReasons are why ServeHTTP refuses a delivery to a target's path
// (opbroker_webhook_rejected_total): the signature's (target.SignatureError's reasons)
// and the listener's own.
var rejectionReasons = []string{"missing", "malformed", "mismatch", "timestamp", "too_large", "secret_unreadable",
	"malformed_event", "unavailable"}

// Paths reports how many targets have a webhook.
func (w *Webhooks) Paths() int { return len(w.byPath) }

func (w *Webhooks) ServeHTTP(rw http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	metrics := w.matcher.metrics
	t, ok := w.byPath[r.URL.Path]
	if !ok {
		metrics.Rejected(ctx, "", "unknown_path")
		http.Error(rw, "no target receives webhooks at this path", http.StatusNotFound)
		return
	}
	name := t.contract.Name
	if r.Method != http.MethodPost {
		rw.Header().Set("Allow", http.MethodPost)
		http.Error(rw, "webhooks are POSTed", http.StatusMethodNotAllowed)
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(rw, r.Body, w.maxBody))
	if err != nil {
		var tooLarge *http.MaxBytesError
		if errors.As(err, &tooLarge) {
			metrics.Rejected(ctx, name, "too_large")
			http.Error(rw, "the body is larger than the listener accepts", http.StatusRequestEntityTooLarge)
			return
		}
		http.Error(rw, "the body could not be read", http.StatusBadRequest)
		return
	}
	if err := t.verifier.Verify(r.Header, body, w.clock()); err != nil {
		var sigErr *target.SignatureError
		if errors.As(err, &sigErr) {
			metrics.Rejected(ctx, name, sigErr.Reason)
			http.Error(rw, "the signature does not verify", http.StatusUnauthorized)
			return
		}
		metrics.Rejected(ctx, name, "secret_unreadable")
		w.matcher.log.Error("webhook refused: the target's webhook secret cannot be read", "target", name, "error", err)
		http.Error(rw, "the broker cannot verify webhooks now", http.StatusServiceUnavailable)
		return
	}
	kept, fresh, err := w.matcher.Receive(ctx, t.contract, body, Source{})
	switch {
	case errors.Is(err, ErrIgnored):
		writeJSON(rw, map[string]any{"ignored": true})
	case errors.Is(err, target.ErrMalformedEvent):
		metrics.Rejected(ctx, name, "malformed_event")
		http.Error(rw, err.Error(), http.StatusBadRequest)
	case err != nil:
		metrics.Rejected(ctx, name, "unavailable")
		w.matcher.log.Warn("webhook not kept: the ledger is unavailable; the sender delivers it again", "target", name, "error", err)
		http.Error(rw, "the broker cannot keep the event now", http.StatusServiceUnavailable)
	default:
		writeJSON(rw, map[string]any{"event_id": kept.EventID, "duplicate": !fresh})
	}
}

func writeJSON(rw http.ResponseWriter, v any) {
	rw.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(rw).Encode(v)
}
