// Package simtarget is a simulated remote target: an HTTP server that behaves like a
// vendor API, keeps ground truth about every effect it really made, and injects the
// faults and provider behaviours the broker must survive.
//
// The API:
//
//	POST /v1/charges            create a charge; honours the Idempotency-Key header
//	GET  /v1/charges?reference= look a charge up by the key it was created with
//	POST /v1/notifications      send a notification; no idempotency, no lookup
//	GET  /sim/truth             ground truth (never used by the broker)
//
// With Config.Webhooks the target also reports its charges as Stripe does: after a charge
// made with an idempotency key it POSTs events (charge.processing, charge.succeeded,
// charge.failed) signed with Stripe-Signature to the broker's webhook listener, retries
// those not acknowledged, and injects webhook faults (duplicates, late and reordered
// events, fabricated events, bad signatures), chosen per charge like a request's faults
// with {"sim": {"webhook": "..."}} or WebhookConfig.FaultRates. Truth.Webhooks records
// every sending; webhooks.go has the details.
//
// Faults are chosen per request: by a JSON payload field {"sim": {"fault": "..."}} (with
// "times": n, for the first n requests with that body only), by
// Config.Fault, or at random from Config.FaultRates with a seeded source. Provider
// behaviours (how saved responses are replayed, key retention, lookup lag, the
// credential it requires) are set in Config.
package simtarget

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/opbroker/opbroker/target"
)

// Fault is what the target does wrong with one request.
type Fault string

// The faults, each with what the broker must do about it in docs/testing.md#faults.
const (
	FaultNone              Fault = ""
	FaultResetBeforeCommit Fault = "reset_before_commit" // closes the connection; no effect
	FaultCommitThenReset   Fault = "commit_then_reset"   // makes the effect, then resets
	FaultCommitThenHang    Fault = "commit_then_hang"    // makes the effect, never answers
	FaultSlowCommit        Fault = "slow_commit"         // makes the effect after SlowDelay, then answers
	Fault5xxBeforeCommit   Fault = "5xx_before_commit"   // 503, no effect
	Fault5xxAfterCommit    Fault = "5xx_after_commit"    // makes the effect, answers 500
	FaultInProgress        Fault = "in_progress"         // 409: the key is still executing; no effect
	FaultThrottle          Fault = "throttle"            // 429 with Retry-After, before the key is looked at; no effect
	FaultRedirect          Fault = "redirect"            // 307 to another host; no effect
	FaultDecline           Fault = "decline"             // 402, documented as creating no charge
	FaultLookupLag         Fault = "lookup_lag"          // makes the effect, invisible to lookups for LookupLag

	// FaultLookupUnavailable is a lookup answered 503 (Config.LookupFailures); it is
	// counted in the ground truth, and a create cannot ask for it.
	FaultLookupUnavailable Fault = "lookup_unavailable"
	// FaultUnauthorized is a create or a lookup answered 401 because it did not carry
	// the credential of Config.Auth; no effect, not an attempt of its key. A create
	// cannot ask for it.
	FaultUnauthorized Fault = "unauthorized"
)

// Faults lists every fault, for tests and the chaos run.
var Faults = []Fault{FaultResetBeforeCommit, FaultCommitThenReset, FaultCommitThenHang, FaultSlowCommit,
	Fault5xxBeforeCommit, Fault5xxAfterCommit, FaultInProgress, FaultThrottle, FaultRedirect, FaultDecline, FaultLookupLag}

// ParseFault returns the fault named name, or an error naming the known ones.
func ParseFault(name string) (Fault, error) {
	if name == "" || slices.Contains(Faults, Fault(name)) {
		return Fault(name), nil
	}
	return "", fmt.Errorf("unknown fault %q; known: %v", name, Faults)
}

// Config sets the target's behaviour. The zero value is a well-behaved Stripe-like API.
type Config struct {
	// Fault applies to every create request that names no fault of its own.
	Fault Fault
	// FaultRates picks a fault at random for requests that name none, with Seed.
	FaultRates map[Fault]float64
	Seed       uint64
	// SaveOnlySuccesses: a saved error is not replayed; the same key executes again
	// (some providers). Default: the first response is saved and replayed, 5xx included
	// (Stripe v1 style).
	SaveOnlySuccesses bool
	// Retention forgets keys this long after their first use; 0 keeps them forever.
	Retention time.Duration
	// LookupLag hides every new effect from lookups for this long (and FaultLookupLag
	// hides one).
	LookupLag time.Duration
	// LookupFailures is the share of lookups, drawn with Seed, that answer 503 as a
	// lookup API in an outage would (1: every lookup).
	LookupFailures float64
	// SlowDelay is how long FaultSlowCommit waits; default 2s.
	SlowDelay time.Duration
	// Latency delays every create and lookup before it is handled, as a real API's
	// processing time; 0 is the fastest profile.
	Latency time.Duration
	// Now is the clock; nil means time.Now.
	Now func() time.Time
	// Completion makes charges (not notifications or objects) finish after they are
	// made, as a card payment does: for this long their status is "processing", then
	// "succeeded", or "failed" (final, no money moved) when the request's payload asks
	// with {"sim": {"completes": "failed"}}. Answers and lookups carry the status; 0
	// finishes at once and says nothing of a status.
	Completion time.Duration
	// Auth, when set, is how every create and lookup must authenticate, and Credential
	// the secret it must carry (not empty). Contracts gives the broker the same Auth:
	// whoever runs the target puts Credential where Auth.Secret says.
	Auth       *target.Auth
	Credential string
	// Webhooks, when set, makes the target send signed events about its charges; nil
	// sends none.
	Webhooks *WebhookConfig
}

// Effect is one real remote effect.
type Effect struct {
	ID            string    `json:"id"`
	Key           string    `json:"key"`
	PayloadSHA256 string    `json:"payload_sha256"`
	At            time.Time `json:"at"`
	visibleAt     time.Time
	body          []byte    // the request that made it, echoed by lookups
	doneAt        time.Time // with Config.Completion: when it stops processing
	fails         bool      // and then fails instead of succeeding
}

// The statuses of a charge with Config.Completion.
const (
	StatusProcessing = "processing"
	StatusSucceeded  = "succeeded"
	StatusFailed     = "failed"
)

// status is the charge's status at now.
func (e *Effect) status(now time.Time) string {
	switch {
	case now.Before(e.doneAt):
		return StatusProcessing
	case e.fails:
		return StatusFailed
	}
	return StatusSucceeded
}

// KeyTruth is what really happened for one key.
type KeyTruth struct {
	Effects       int      `json:"effects"`
	Attempts      int      `json:"attempts"`
	PayloadSHA256 []string `json:"payload_sha256"`
	IDs           []string `json:"ids"`
	// With Config.Completion, the effects still processing, and those that failed
	// (final, without effect), at the time of the snapshot.
	Processing int `json:"processing,omitempty"`
	Failed     int `json:"failed,omitempty"`
	// Committing counts the requests under the key that arrived and have not committed
	// yet (FaultSlowCommit): their effect is still to come, whatever was answered.
	Committing int `json:"committing,omitempty"`
}

// Truth is the ground truth of a target.
type Truth struct {
	Keys     map[string]*KeyTruth `json:"keys"`
	Unkeyed  int                  `json:"unkeyed_effects"`
	Faults   map[Fault]int        `json:"faults"`
	Requests int                  `json:"requests"`
	// MaxConcurrent is the most requests (creates and lookups) ever in progress at once.
	MaxConcurrent int `json:"max_concurrent"`
	// PreconditionFailed counts conditional writes refused because the object existed.
	PreconditionFailed int `json:"precondition_failed,omitempty"`
	// Webhooks records every sending of an event (Config.Webhooks), in the order they
	// were queued.
	Webhooks []WebhookTruth `json:"webhooks,omitempty"`
}

// saved is a response saved for an idempotency key.
type saved struct {
	status    int
	body      []byte
	hash      string
	firstUsed time.Time
	inFlight  bool
}

// Target is a simulated vendor API. It is an http.Handler.
type Target struct {
	cfg   Config
	mu    sync.Mutex
	rng   *rand.Rand
	keys  map[string]*saved  // idempotency state, which may be forgotten
	eff   map[string]*Effect // by id
	byKey map[string][]*Effect
	// committing counts, by key, the requests that have not committed yet.
	committing map[string]int
	truth      Truth
	seq        int
	busy       int // requests in progress
	// writing holds the objects being written by a conditional create: a second one
	// meanwhile fails its precondition, as a storage API's atomic create does.
	writing map[string]bool
	named   map[string]int // requests so far per body whose payload names a fault for a number of times
	hang    chan struct{}  // closed by Close: releases hanging requests
	once    sync.Once
	hooks   *sender // sends the events of Config.Webhooks; nil without
	mux     *http.ServeMux
}

// New returns a target with cfg.
func New(cfg Config) *Target {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.SlowDelay == 0 {
		cfg.SlowDelay = 2 * time.Second
	}
	t := &Target{
		cfg:        cfg,
		rng:        rand.New(rand.NewPCG(cfg.Seed, cfg.Seed^0x9e3779b97f4a7c15)),
		keys:       map[string]*saved{},
		eff:        map[string]*Effect{},
		byKey:      map[string][]*Effect{},
		committing: map[string]int{},
		writing:    map[string]bool{},
		named:      map[string]int{},
		truth:      Truth{Keys: map[string]*KeyTruth{}, Faults: map[Fault]int{}},
		hang:       make(chan struct{}),
		mux:        http.NewServeMux(),
	}
	if cfg.Webhooks != nil {
		t.hooks = newSender(*cfg.Webhooks, cfg.Seed, cfg.Now)
	}
	t.mux.HandleFunc("POST /v1/charges", t.authorized(t.createCharge))
	t.mux.HandleFunc("GET /v1/charges", t.authorized(t.lookupCharge))
	t.mux.HandleFunc("POST /v1/notifications", t.authorized(t.createNotification))
	t.mux.HandleFunc("PUT /v1/objects/{name}", t.authorized(t.writeObject))
	t.mux.HandleFunc("GET /v1/objects/{name}", t.authorized(t.lookupObject))
	t.mux.HandleFunc("GET /sim/truth", t.serveTruth)
	return t
}

func (t *Target) ServeHTTP(w http.ResponseWriter, r *http.Request) { t.mux.ServeHTTP(w, r) }

// Close releases requests held by FaultCommitThenHang, stops the webhook deliveries
// still pending and waits for their goroutines to end. It is idempotent.
func (t *Target) Close() {
	t.once.Do(func() { close(t.hang) })
	if t.hooks != nil {
		t.hooks.close()
	}
}

// WebhooksIdle blocks until no event is pending: every one queued so far is
// acknowledged, given up, or stopped by Close (a charge still processing has its final
// event pending). Without Config.Webhooks it returns at once. It returns ctx's error if
// ctx ends first.
func (t *Target) WebhooksIdle(ctx context.Context) error {
	if t.hooks == nil {
		return nil
	}
	return t.hooks.waitIdle(ctx)
}

// WebhookBody returns an event the target sent, as it sent it: for a service that
// reports the target's events itself. False when it sent none of that id.
func (t *Target) WebhookBody(eventID string) ([]byte, bool) {
	if t.hooks == nil {
		return nil, false
	}
	return t.hooks.body(eventID)
}

// TruthHandler serves the ground truth as JSON.
func (t *Target) TruthHandler() http.Handler { return http.HandlerFunc(t.serveTruth) }

// Snapshot returns a copy of the ground truth.
func (t *Target) Snapshot() Truth {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := Truth{Keys: map[string]*KeyTruth{}, Faults: map[Fault]int{}, Unkeyed: t.truth.Unkeyed, Requests: t.truth.Requests,
		MaxConcurrent: t.truth.MaxConcurrent, PreconditionFailed: t.truth.PreconditionFailed}
	for k, v := range t.truth.Keys {
		c := *v
		c.PayloadSHA256 = append([]string(nil), v.PayloadSHA256...)
		c.IDs = append([]string(nil), v.IDs...)
		c.Committing = t.committing[k]
		for _, e := range t.byKey[k] {
			switch e.status(t.cfg.Now()) {
			case StatusProcessing:
				c.Processing++
			case StatusFailed:
				c.Failed++
			}
		}
		out.Keys[k] = &c
	}
	for f, n := range t.truth.Faults {
		out.Faults[f] = n
	}
	if t.hooks != nil {
		out.Webhooks = t.hooks.snapshot()
	}
	return out
}

func (t *Target) serveTruth(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(t.Snapshot())
}

// chooseFault picks the fault for a request: its payload's own, else the configured
// one, else a random one.
func (t *Target) chooseFault(body []byte) Fault {
	var doc struct {
		Sim struct {
			Fault Fault `json:"fault"`
			// Times, when set, limits the fault to the first Times requests with this
			// body; later ones get a fault as if the payload named none.
			Times int `json:"times"`
		} `json:"sim"`
	}
	if json.Unmarshal(body, &doc) == nil && doc.Sim.Fault != "" {
		if doc.Sim.Times <= 0 {
			return doc.Sim.Fault
		}
		t.mu.Lock()
		t.named[hashOf(body)]++
		n := t.named[hashOf(body)]
		t.mu.Unlock()
		if n <= doc.Sim.Times {
			return doc.Sim.Fault
		}
	}
	t.mu.Lock()
	fault, rates := t.cfg.Fault, t.cfg.FaultRates
	x := t.rng.Float64()
	t.mu.Unlock()
	if fault != "" {
		return fault
	}
	faults := make([]Fault, 0, len(rates))
	for f := range rates {
		faults = append(faults, f)
	}
	sort.Slice(faults, func(i, j int) bool { return faults[i] < faults[j] }) // deterministic per seed
	for _, f := range faults {
		if x < rates[f] {
			return f
		}
		x -= rates[f]
	}
	return FaultNone
}

// Heal stops the configured faults, lookup failures and random webhook faults included:
// from now on a request gets a fault only if its payload names one. Provider behaviours
// (saved responses, retention, lookup lag) stay, and so do events already queued.
func (t *Target) Heal() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.cfg.Fault, t.cfg.FaultRates, t.cfg.LookupFailures = FaultNone, nil, 0
	if t.hooks != nil {
		t.hooks.heal()
	}
}

// SetCredential replaces the credential the target requires, as a vendor does when a
// key is rotated: from now on only the new one is accepted.
func (t *Target) SetCredential(credential string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.cfg.Credential = credential
}

// authorized answers 401, with no effect, to a request that does not carry the
// configured credential.
func (t *Target) authorized(next http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		a := t.cfg.Auth
		if a == nil {
			next(w, r)
			return
		}
		t.mu.Lock()
		want := t.cfg.Credential
		t.mu.Unlock()
		var got string
		var ok bool
		switch a.Scheme {
		case target.AuthBasic:
			var user string
			user, got, ok = r.BasicAuth()
			ok = ok && user == a.User
		case target.AuthHeader:
			got, ok = strings.CutPrefix(r.Header.Get(a.Header), a.Prefix)
		default:
			got, ok = strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		}
		if ok && want != "" && subtle.ConstantTimeCompare([]byte(got), []byte(want)) == 1 {
			next(w, r)
			return
		}
		_, _ = readBody(r)
		t.mu.Lock()
		t.truth.Faults[FaultUnauthorized]++
		t.mu.Unlock()
		if a.Scheme == target.AuthBasic {
			w.Header().Set("WWW-Authenticate", `Basic realm="simtarget"`)
		} else if a.Scheme == target.AuthBearer {
			w.Header().Set("WWW-Authenticate", `Bearer realm="simtarget"`)
		}
		writeJSON(w, http.StatusUnauthorized, map[string]string{"error": "unauthorized", "note": "the request was not executed"})
	}
}

// throttle answers 429 with Retry-After, as a rate limiter does before anything is
// executed (FaultThrottle).
func throttle(w http.ResponseWriter) {
	w.Header().Set("Retry-After", "1")
	writeJSON(w, http.StatusTooManyRequests, map[string]string{"error": "rate limited", "note": "the request was not executed"})
}

func hashOf(body []byte) string {
	sum := sha256.Sum256(body)
	return hex.EncodeToString(sum[:])
}

// createCharge is an idempotent create.
func (t *Target) createCharge(w http.ResponseWriter, r *http.Request) {
	body, err := readBody(r)
	if err != nil {
		http.Error(w, "bad body", http.StatusBadRequest)
		return
	}
	defer t.delay()()
	key := r.Header.Get("Idempotency-Key")
	hash := hashOf(body)
	fault := t.chooseFault(body)
	now := t.cfg.Now()

	t.mu.Lock()
	t.countArrival(fault, key, hash)
	if fault == FaultThrottle {
		// The rate limiter runs before the idempotency layer, as Stripe's does: nothing
		// is executed and nothing is saved under the key.
		t.mu.Unlock()
		throttle(w)
		return
	}
	if fault == FaultInProgress {
		// As when another request with this key is still executing: this one is refused
		// by the key's lock, executes nothing and is not saved.
		t.mu.Unlock()
		writeJSON(w, http.StatusConflict, map[string]string{"error": "a request with this key is in progress"})
		return
	}
	if key != "" {
		if s, ok := t.keys[key]; ok && t.cfg.Retention > 0 && now.Sub(s.firstUsed) > t.cfg.Retention {
			delete(t.keys, key) // the provider forgot the key
		}
		if s, ok := t.keys[key]; ok {
			switch {
			case s.hash != hash:
				t.mu.Unlock()
				writeJSON(w, http.StatusUnprocessableEntity, map[string]string{"error": "idempotency key reused with different parameters"})
				return
			case s.inFlight:
				t.mu.Unlock()
				writeJSON(w, http.StatusConflict, map[string]string{"error": "a request with this key is in progress"})
				return
			case s.status != 0:
				t.mu.Unlock()
				w.Header().Set("Idempotent-Replayed", "true")
				writeRaw(w, s.status, s.body)
				return
			}
		}
		t.keys[key] = &saved{hash: hash, firstUsed: now, inFlight: true}
	}
	t.mu.Unlock()

	status, resp := t.execute(w, fault, key, body, now, true)
	if key != "" {
		t.mu.Lock()
		if s := t.keys[key]; s != nil {
			s.inFlight = false
			switch {
			case status == 0 && s.status == 0: // no answer was given: nothing saved
				if !t.committed(key) {
					delete(t.keys, key)
				} else {
					s.status, s.body = http.StatusOK, t.chargeBodyLocked(key)
				}
			case t.cfg.SaveOnlySuccesses && (status < 200 || status > 299):
				delete(t.keys, key)
			case status != 0:
				s.status, s.body = status, resp
			}
		}
		t.mu.Unlock()
	}
}

// execute applies the fault and, where the fault commits, the effect. It returns the
// status and body it answered with (0 when it answered nothing).
//
// processes says whether the effect processes for Config.Completion before it is done:
// charges do; notifications and objects are done when they are made.
func (t *Target) execute(w http.ResponseWriter, fault Fault, key string, body []byte, now time.Time, processes bool) (int, []byte) {
	switch fault {
	case FaultResetBeforeCommit:
		reset(w)
		return 0, nil
	case FaultCommitThenReset:
		t.commit(key, body, now, 0, processes)
		reset(w)
		return 0, nil
	case FaultCommitThenHang:
		t.commit(key, body, now, 0, processes)
		<-t.hang
		reset(w)
		return 0, nil
	case FaultSlowCommit:
		t.countCommitting(key, 1)
		select {
		case <-time.After(t.cfg.SlowDelay):
		case <-t.hang:
		}
		t.commit(key, body, t.cfg.Now(), 0, processes)
		t.countCommitting(key, -1)
		resp := t.chargeBody(key)
		writeRaw(w, http.StatusOK, resp)
		return http.StatusOK, resp
	case Fault5xxBeforeCommit:
		return answer(w, http.StatusServiceUnavailable, map[string]string{"error": "unavailable"})
	case Fault5xxAfterCommit:
		t.commit(key, body, now, 0, processes)
		return answer(w, http.StatusInternalServerError, map[string]string{"error": "internal"})
	case FaultRedirect:
		w.Header().Set("Location", "http://127.0.0.2:1/v1/charges")
		return answer(w, http.StatusTemporaryRedirect, map[string]string{"error": "moved"})
	case FaultDecline:
		return answer(w, http.StatusPaymentRequired, map[string]string{"error": "card_declined", "note": "no charge was created"})
	case FaultLookupLag:
		t.commit(key, body, now, max(t.cfg.LookupLag, 2*time.Second), processes)
	default:
		t.commit(key, body, now, 0, processes)
	}
	resp := t.chargeBody(key)
	writeRaw(w, http.StatusOK, resp)
	return http.StatusOK, resp
}

func (t *Target) commit(key string, body []byte, now time.Time, extraLag time.Duration, processes bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.seq++
	doneAt := now
	if processes {
		doneAt = now.Add(t.cfg.Completion)
	}
	e := &Effect{ID: fmt.Sprintf("ch_%06d", t.seq), Key: key, PayloadSHA256: hashOf(body), At: now,
		visibleAt: now.Add(t.cfg.LookupLag + extraLag), body: body,
		doneAt: doneAt, fails: processes && completesFailed(body)}
	t.eff[e.ID] = e
	if key == "" {
		t.truth.Unkeyed++
		return
	}
	t.byKey[key] = append(t.byKey[key], e)
	kt := t.keyTruth(key)
	kt.Effects++
	kt.IDs = append(kt.IDs, e.ID)
	if processes && t.hooks != nil { // a charge made with a key
		t.hooks.charge(e, t.cfg.Completion > 0)
	}
}

func (t *Target) committed(key string) bool { return len(t.byKey[key]) > 0 }

// countCommitting adds n to the requests under key still to commit.
func (t *Target) countCommitting(key string, n int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.committing[key] += n; t.committing[key] <= 0 {
		delete(t.committing, key)
	}
}

func (t *Target) chargeBody(key string) []byte {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.chargeBodyLocked(key)
}

// chargeBodyLocked is chargeBody for a caller holding t.mu.
func (t *Target) chargeBodyLocked(key string) []byte {
	effects := t.byKey[key]
	if len(effects) == 0 {
		b, _ := json.Marshal(map[string]string{"id": fmt.Sprintf("ch_%06d", t.seq), "object": "charge"})
		return b
	}
	e := effects[len(effects)-1]
	resp := map[string]string{"id": e.ID, "object": "charge", "reference": key}
	if t.cfg.Completion > 0 {
		resp["status"] = e.status(t.cfg.Now())
	}
	b, _ := json.Marshal(resp)
	return b
}

// completesFailed reports whether a request's payload asks its charge to fail.
func completesFailed(body []byte) bool {
	var doc struct {
		Sim struct {
			Completes string `json:"completes"`
		} `json:"sim"`
	}
	return json.Unmarshal(body, &doc) == nil && doc.Sim.Completes == StatusFailed
}

// delay counts a request in progress and applies the configured latency; the returned
// function ends it.
func (t *Target) delay() func() {
	t.mu.Lock()
	t.busy++
	t.truth.MaxConcurrent = max(t.truth.MaxConcurrent, t.busy)
	t.mu.Unlock()
	if t.cfg.Latency > 0 {
		time.Sleep(t.cfg.Latency)
	}
	return func() {
		t.mu.Lock()
		t.busy--
		t.mu.Unlock()
	}
}

// countArrival records in the ground truth that a request arrived. The caller holds t.mu.
func (t *Target) countArrival(fault Fault, key, hash string) {
	t.truth.Requests++
	t.truth.Faults[fault]++
	if key == "" {
		return
	}
	kt := t.keyTruth(key)
	kt.Attempts++
	if !slices.Contains(kt.PayloadSHA256, hash) {
		kt.PayloadSHA256 = append(kt.PayloadSHA256, hash)
	}
}

func (t *Target) keyTruth(key string) *KeyTruth {
	kt := t.truth.Keys[key]
	if kt == nil {
		kt = &KeyTruth{}
		t.truth.Keys[key] = kt
	}
	return kt
}

// lookupCharge finds the charge created with a key, once it is visible.
func (t *Target) lookupCharge(w http.ResponseWriter, r *http.Request) {
	t.lookup(w, r.URL.Query().Get("reference"))
}

// lookupObject finds an object by its name, once it is visible.
func (t *Target) lookupObject(w http.ResponseWriter, r *http.Request) {
	t.lookup(w, r.PathValue("name"))
}

// writeObject writes the object named in the path, as a storage API does: without a
// precondition every write is an effect (the object is written again); with
// If-None-Match: * the write is refused, 412 with nothing written, when the object
// exists or is being written. The ground truth keys it by its name.
func (t *Target) writeObject(w http.ResponseWriter, r *http.Request) {
	body, err := readBody(r)
	if err != nil {
		http.Error(w, "bad body", http.StatusBadRequest)
		return
	}
	defer t.delay()()
	name, hash, fault, now := r.PathValue("name"), hashOf(body), t.chooseFault(body), t.cfg.Now()
	ifAbsent := r.Header.Get("If-None-Match") == "*"
	t.mu.Lock()
	t.countArrival(fault, name, hash)
	if fault == FaultThrottle {
		t.mu.Unlock()
		throttle(w)
		return
	}
	if ifAbsent && (t.committed(name) || t.writing[name]) {
		t.truth.PreconditionFailed++
		t.mu.Unlock()
		writeJSON(w, http.StatusPreconditionFailed, map[string]string{"error": "precondition failed: the object exists"})
		return
	}
	t.writing[name] = true
	t.mu.Unlock()
	t.execute(w, fault, name, body, now, false)
	t.mu.Lock()
	delete(t.writing, name)
	t.mu.Unlock()
}

// lookup answers a lookup of the effect made under key, once it is visible.
func (t *Target) lookup(w http.ResponseWriter, key string) {
	defer t.delay()()
	now := t.cfg.Now()
	t.mu.Lock()
	if t.cfg.LookupFailures > 0 && t.rng.Float64() < t.cfg.LookupFailures {
		t.truth.Faults[FaultLookupUnavailable]++
		t.mu.Unlock()
		writeJSON(w, http.StatusServiceUnavailable, map[string]string{"error": "lookups are unavailable"})
		return
	}
	var found *Effect
	for _, e := range t.byKey[key] {
		if !now.Before(e.visibleAt) {
			found = e
			break
		}
	}
	t.mu.Unlock()
	if found == nil {
		writeJSON(w, http.StatusNotFound, map[string]string{"error": "no such charge"})
		return
	}
	resp := map[string]any{"id": found.ID, "object": "charge", "reference": key, "payload_sha256": found.PayloadSHA256}
	if t.cfg.Completion > 0 {
		resp["status"] = found.status(now)
	}
	if json.Valid(found.body) {
		resp["request"] = json.RawMessage(found.body)
	}
	writeJSON(w, http.StatusOK, resp)
}

// createNotification has no idempotency: every request that arrives makes an effect.
// Ground truth keys it by X-Request-Id when the sender provides one.
func (t *Target) createNotification(w http.ResponseWriter, r *http.Request) {
	body, err := readBody(r)
	if err != nil {
		http.Error(w, "bad body", http.StatusBadRequest)
		return
	}
	defer t.delay()()
	key := r.Header.Get("X-Request-Id")
	hash := hashOf(body)
	fault := t.chooseFault(body)
	t.mu.Lock()
	t.countArrival(fault, key, hash)
	t.mu.Unlock()
	t.execute(w, fault, key, body, t.cfg.Now(), false)
}

func readBody(r *http.Request) ([]byte, error) {
	defer r.Body.Close()
	return io.ReadAll(io.LimitReader(r.Body, 8<<20))
}

func answer(w http.ResponseWriter, status int, v any) (int, []byte) {
	b, _ := json.Marshal(v)
	writeRaw(w, status, b)
	return status, b
}

func writeJSON(w http.ResponseWriter, status int, v any) { answer(w, status, v) }

func writeRaw(w http.ResponseWriter, status int, body []byte) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// reset closes the client's connection abruptly (RST), as a crashed server or a broken
// network would.
func reset(w http.ResponseWriter) {
	hj, ok := w.(http.Hijacker)
	if !ok {
		panic(http.ErrAbortHandler)
	}
	conn, _, err := hj.Hijack()
	if err != nil {
		panic(http.ErrAbortHandler)
	}
	if tcp, ok := conn.(*net.TCPConn); ok {
		_ = tcp.SetLinger(0)
	}
	conn.Close()
}
