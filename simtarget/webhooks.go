package simtarget

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net/http"
	"slices"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/google/uuid"

	"github.com/opbroker/opbroker/target"
)

// With Config.Webhooks the target reports its charges as Stripe does: every charge made
// with an idempotency key is followed by events POSTed to the broker's webhook listener,
// each signed with the shared secret:
//
//	Stripe-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>", keyed by the secret>
//
// An event is
//
//	{"id":"evt_000001","type":"charge.succeeded","created":<unix seconds>,
//	 "data":{"object":{"id":"ch_000001","object":"charge","reference":"<idempotency key>",
//	   "status":"succeeded","account":"<with WebhookConfig.Account>","request":<the request body>}}}
//
// Without Config.Completion a charge has one event, charge.succeeded (status
// "succeeded"), when it is made. With it, charge.processing when it is made, then
// charge.succeeded or charge.failed when it completes; a failed charge is final and
// moved no money. A delivery that gets no 2xx is tried again at the next URL, with a
// backoff doubling from 100ms to 5s, until WebhookConfig.RetryFor has passed since its
// first try. The ground truth records every sending (Truth.Webhooks).

// WebhookPath is the path of the broker's webhook listener for the demo-payments
// contract's events.
const WebhookPath = "/demo-payments"

// The event types of a charge.
const (
	EventChargeProcessing = "charge.processing"
	EventChargeSucceeded  = "charge.succeeded"
	EventChargeFailed     = "charge.failed"
)

// WebhookFault is what the target does wrong with the events of one charge. A fault
// applies to all the charge's events.
type WebhookFault string

// The webhook faults.
const (
	WebhookNone WebhookFault = ""
	// WebhookDuplicate delivers every event twice, the second time once the first is
	// acknowledged or given up: the same id and the same body.
	WebhookDuplicate WebhookFault = "duplicate"
	// WebhookLate delivers every event WebhookConfig.LateDelay later.
	WebhookLate WebhookFault = "late"
	// WebhookReordered, with Config.Completion, holds the processing event back until
	// the final one (succeeded or failed) is acknowledged or given up. Without
	// Completion it changes nothing.
	WebhookReordered WebhookFault = "reordered"
	// WebhookUnknownReference adds a fabricated event, a copy of the final one with a
	// fresh id whose reference is a random UUID no charge has.
	WebhookUnknownReference WebhookFault = "unknown_reference"
	// WebhookOtherTenant adds a fabricated event, a copy of the final one with a fresh
	// id that names another account ("acct_other_…"); the copy names it even when
	// WebhookConfig.Account is off, so the broker can see it.
	WebhookOtherTenant WebhookFault = "other_tenant"
	// WebhookChangedAmount adds a fabricated event, a copy of the final one with a fresh
	// id whose request's amount is one more (1 when it has no numeric amount).
	WebhookChangedAmount WebhookFault = "changed_amount"
	// WebhookBadSignature delivers every event first signed with a wrong secret, once,
	// and then as it should be.
	WebhookBadSignature WebhookFault = "bad_signature"
)

// WebhookFaults lists every webhook fault, for tests and the chaos run.
var WebhookFaults = []WebhookFault{WebhookDuplicate, WebhookLate, WebhookReordered, WebhookUnknownReference,
	WebhookOtherTenant, WebhookChangedAmount, WebhookBadSignature}

// ParseWebhookFault returns the webhook fault named name, or an error naming the known
// ones.
func ParseWebhookFault(name string) (WebhookFault, error) {
	if name == "" || slices.Contains(WebhookFaults, WebhookFault(name)) {
		return WebhookFault(name), nil
	}
	return "", fmt.Errorf("unknown webhook fault %q; known: %v", name, WebhookFaults)
}

// WebhookConfig makes the target send signed events about its charges.
type WebhookConfig struct {
	// URLs are where events are POSTed: the broker's listener for this target, e.g.
	// http://127.0.0.1:8080/demo-payments. With several, each event starts at the next
	// one in turn, and a delivery that fails (no answer, or not a 2xx) is tried next at
	// the next one, as behind a load balancer.
	URLs []string
	// Secret is the signing secret, and SecretSource where the broker reads it (the
	// contract's). Whoever runs the target puts Secret there; the broker trims spaces
	// around what it reads, so Secret has none.
	Secret       string
	SecretSource target.Secret
	// Delay is how long after a charge reaches a state its event is sent; default 50ms.
	Delay time.Duration
	// FaultRates picks a fault at random, with Config.Seed, for the events of a charge
	// whose request names none with {"sim": {"webhook": "<fault>"}} (a name the target
	// does not know is ignored).
	FaultRates map[WebhookFault]float64
	// LateDelay is the extra delay of WebhookLate; default 3s.
	LateDelay time.Duration
	// RetryFor is how long an event is tried again after its first try when it gets no
	// 2xx; default 2 minutes. A forged copy (WebhookBadSignature) is tried once only.
	RetryFor time.Duration
	// Account makes events carry the request's JSON /account string as
	// data.object.account, and the contract read it as the tenant.
	Account bool
}

// WebhookTruth is one sending of an event: the event, delivered until a delivery is
// acknowledged or it is given up. A WebhookDuplicate's second sending and a
// WebhookBadSignature's forged copy are sendings of their own, with the same event id.
type WebhookTruth struct {
	EventID   string `json:"event_id"`
	Type      string `json:"type"`
	Reference string `json:"reference"`
	// EffectID is the charge the event is about; "" for WebhookUnknownReference's.
	EffectID string       `json:"effect_id,omitempty"`
	Fault    WebhookFault `json:"fault,omitempty"`
	// Genuine: correctly signed, it truthfully reports the state of the charge with the
	// key Reference. Events fabricated by a fault, and forged copies, are not: they
	// must never change an operation.
	Genuine bool `json:"genuine"`
	// Forged: WebhookBadSignature's copy, signed with a wrong secret.
	Forged bool `json:"forged,omitempty"`
	// Duplicate: WebhookDuplicate's second sending.
	Duplicate bool `json:"duplicate,omitempty"`
	// Deliveries counts the tries; LastStatus is the last one's HTTP status, 0 when it
	// got no answer.
	Deliveries int `json:"deliveries"`
	LastStatus int `json:"last_status,omitempty"`
	// Acknowledged: a delivery got a 2xx. GaveUp: the tries ended without one
	// (RetryFor passed, or a forged copy's one try); a sending stopped by Close has
	// neither.
	Acknowledged bool `json:"acknowledged"`
	GaveUp       bool `json:"gave_up,omitempty"`
}

// Backoff between the tries of a delivery, and how long one try may take.
const (
	minBackoff      = 100 * time.Millisecond
	maxBackoff      = 5 * time.Second
	deliveryTimeout = 5 * time.Second
)

// sender sends a target's events. Its goroutines, one per sending, end by Close.
type sender struct {
	cfg    WebhookConfig
	now    func() time.Time
	client *http.Client
	ctx    context.Context // cancelled by close: stops every sending
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu      sync.Mutex
	rng     *rand.Rand
	rates   map[WebhookFault]float64
	seq     int // events so far: their ids
	sends   int // sendings so far: which URL each starts at
	records []WebhookTruth
	bodies  map[string][]byte // each event as sent (not a forged copy), by id
	pending int               // sendings not yet acknowledged, given up or stopped
	idle    chan struct{}     // closed when pending drops to 0
	closed  bool
}

func newSender(cfg WebhookConfig, seed uint64, now func() time.Time) *sender {
	if cfg.Delay == 0 {
		cfg.Delay = 50 * time.Millisecond
	}
	if cfg.LateDelay == 0 {
		cfg.LateDelay = 3 * time.Second
	}
	if cfg.RetryFor == 0 {
		cfg.RetryFor = 2 * time.Minute
	}
	cfg.URLs = slices.Clone(cfg.URLs)
	transport := http.DefaultTransport.(*http.Transport).Clone()
	transport.Proxy = nil
	ctx, cancel := context.WithCancel(context.Background())
	return &sender{
		cfg: cfg, now: now, ctx: ctx, cancel: cancel,
		client: &http.Client{Transport: transport, Timeout: deliveryTimeout,
			CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }},
		// A source of its own, so webhooks do not change the faults a seed gives requests.
		rng:    rand.New(rand.NewPCG(seed^0x6a09e667f3bcc908, seed)),
		rates:  maps.Clone(cfg.FaultRates),
		bodies: map[string][]byte{},
	}
}

// message is one sending: an event, delivered until acknowledged or given up.
type message struct {
	record int // its index in sender.records
	body   []byte
	key    []byte // the signing key: a wrong one for a forged copy
	at     time.Time
	after  <-chan struct{} // it waits for this first; nil: it does not
	once   bool            // one try only
	start  int             // the index of the URL it tries first
	tried  chan struct{}   // closed after its first try
	done   chan struct{}   // closed when it is acknowledged, given up or stopped
}

// event is the JSON of an event.
type event struct {
	ID      string `json:"id"`
	Type    string `json:"type"`
	Created int64  `json:"created"`
	Data    struct {
		Object eventObject `json:"object"`
	} `json:"data"`
}

type eventObject struct {
	ID        string          `json:"id"`
	Object    string          `json:"object"`
	Reference string          `json:"reference"`
	Status    string          `json:"status"`
	Account   string          `json:"account,omitempty"`
	Request   json.RawMessage `json:"request"` // null when the request was not JSON
}

// charge queues the events of a charge just made. It does not block.
func (s *sender) charge(e *Effect, completes bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return
	}
	fault := s.chooseFault(e.body)
	delay := s.cfg.Delay
	if fault == WebhookLate {
		delay += s.cfg.LateDelay
	}
	obj := eventObject{ID: e.ID, Object: "charge", Reference: e.Key}
	if json.Valid(e.body) {
		obj.Request = json.RawMessage(e.body)
	}
	if s.cfg.Account {
		obj.Account = accountOf(e.body)
	}
	truth := WebhookTruth{Reference: e.Key, EffectID: e.ID, Fault: fault, Genuine: true}

	var processing event
	if completes {
		obj.Status = StatusProcessing
		processing = s.newEvent(EventChargeProcessing, e.At, obj)
	}
	final := EventChargeSucceeded
	obj.Status = e.status(e.doneAt)
	if obj.Status == StatusFailed {
		final = EventChargeFailed
	}
	ev := s.newEvent(final, e.doneAt, obj)
	finalDelay := delay + e.doneAt.Sub(e.At)

	// A fabricated event goes first, so the broker gets it while the operation is still
	// open; the genuine one follows its first try.
	var after <-chan struct{}
	if fab, ok := s.fabricate(fault, ev); ok {
		rec := truth
		rec.EventID, rec.Type, rec.Reference, rec.Genuine = fab.ID, fab.Type, fab.Data.Object.Reference, false
		if fault == WebhookUnknownReference {
			rec.EffectID = ""
		}
		after = s.queue(rec, marshal(fab), finalDelay, nil, false).tried
	}
	finalSent := s.queueEvent(truth, ev, finalDelay, after)
	if completes {
		after = nil
		if fault == WebhookReordered {
			after = finalSent
		}
		s.queueEvent(truth, processing, delay, after)
	}
}

// queueEvent queues a genuine event with what its fault adds (a forged copy before it,
// a duplicate after it) and returns what is closed when the event is settled.
func (s *sender) queueEvent(truth WebhookTruth, ev event, delay time.Duration, after <-chan struct{}) <-chan struct{} {
	truth.EventID, truth.Type = ev.ID, ev.Type
	body := marshal(ev)
	if truth.Fault == WebhookBadSignature {
		forged := truth
		forged.Genuine, forged.Forged = false, true
		after = s.queue(forged, body, delay, after, true).done
	}
	m := s.queue(truth, body, delay, after, false)
	if truth.Fault == WebhookDuplicate {
		dup := truth
		dup.Duplicate = true
		s.queue(dup, body, delay, m.done, false)
	}
	return m.done
}

// fabricate returns the event a fault adds to a charge whose final event is final.
func (s *sender) fabricate(fault WebhookFault, final event) (event, bool) {
	fab := final
	obj := &fab.Data.Object
	switch fault {
	case WebhookUnknownReference:
		obj.Reference = s.randomUUID()
	case WebhookOtherTenant:
		obj.Account = fmt.Sprintf("acct_other_%06d", s.seq+1)
	case WebhookChangedAmount:
		obj.Request = changedAmount(obj.Request)
	default:
		return event{}, false
	}
	return s.newEvent(fab.Type, time.Unix(fab.Created, 0), *obj), true
}

// newEvent makes an event with the next id. The caller holds s.mu.
func (s *sender) newEvent(typ string, created time.Time, obj eventObject) event {
	s.seq++
	ev := event{ID: fmt.Sprintf("evt_%06d", s.seq), Type: typ, Created: created.Unix()}
	ev.Data.Object = obj
	return ev
}

// queue records a sending and starts it. The caller holds s.mu.
func (s *sender) queue(rec WebhookTruth, body []byte, delay time.Duration, after <-chan struct{}, forged bool) *message {
	key := s.cfg.Secret
	if forged {
		key = "forged:" + key
	}
	m := &message{record: len(s.records), body: body, key: []byte(key), at: time.Now().Add(delay), after: after,
		once: forged, start: s.sends % max(len(s.cfg.URLs), 1), tried: make(chan struct{}), done: make(chan struct{})}
	s.sends++
	if !forged {
		s.bodies[rec.EventID] = body
	}
	s.records = append(s.records, rec)
	if s.pending == 0 {
		s.idle = make(chan struct{})
	}
	s.pending++
	s.wg.Add(1)
	go s.run(m)
	return m
}

// run delivers one sending, trying again until it is acknowledged, given up, or Close.
func (s *sender) run(m *message) {
	defer s.wg.Done()
	defer s.settle(m)
	if m.after != nil {
		select {
		case <-m.after:
		case <-s.ctx.Done():
			return
		}
	}
	if !sleep(s.ctx, time.Until(m.at)) {
		return
	}
	first, backoff := time.Now(), minBackoff
	for try := 0; ; try++ {
		var url string
		if len(s.cfg.URLs) > 0 {
			url = s.cfg.URLs[(m.start+try)%len(s.cfg.URLs)]
		}
		status := s.deliver(m, url)
		if try == 0 {
			close(m.tried)
		}
		acked := status >= 200 && status < 300
		giveUp := !acked && (m.once || time.Since(first) >= s.cfg.RetryFor)
		s.mu.Lock()
		r := &s.records[m.record]
		r.Deliveries++
		r.LastStatus, r.Acknowledged, r.GaveUp = status, r.Acknowledged || acked, giveUp
		s.mu.Unlock()
		if acked || giveUp || !sleep(s.ctx, backoff) {
			return
		}
		backoff = min(2*backoff, maxBackoff)
	}
}

// settle ends a sending: it no longer counts as pending.
func (s *sender) settle(m *message) {
	select {
	case <-m.tried:
	default:
		close(m.tried)
	}
	close(m.done)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.pending--
	if s.pending == 0 {
		close(s.idle)
	}
}

// deliver POSTs the message once, signed at the target's clock, and returns the
// answer's status, 0 when there was none.
func (s *sender) deliver(m *message, url string) int {
	t := strconv.FormatInt(s.now().Unix(), 10)
	mac := hmac.New(sha256.New, m.key)
	mac.Write([]byte(t + "."))
	mac.Write(m.body)
	req, err := http.NewRequestWithContext(s.ctx, http.MethodPost, url, bytes.NewReader(m.body))
	if err != nil {
		return 0
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Stripe-Signature", "t="+t+",v1="+hex.EncodeToString(mac.Sum(nil)))
	resp, err := s.client.Do(req)
	if err != nil {
		return 0
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	resp.Body.Close()
	return resp.StatusCode
}

// chooseFault picks the fault of a charge's events: its request's own, else one drawn
// from the rates. The caller holds s.mu.
func (s *sender) chooseFault(body []byte) WebhookFault {
	var doc struct {
		Sim struct {
			Webhook WebhookFault `json:"webhook"`
		} `json:"sim"`
	}
	if json.Unmarshal(body, &doc) == nil && slices.Contains(WebhookFaults, doc.Sim.Webhook) {
		return doc.Sim.Webhook
	}
	x := s.rng.Float64()
	faults := slices.Collect(maps.Keys(s.rates))
	sort.Slice(faults, func(i, j int) bool { return faults[i] < faults[j] }) // deterministic per seed
	for _, f := range faults {
		if x < s.rates[f] {
			return f
		}
		x -= s.rates[f]
	}
	return WebhookNone
}

// randomUUID returns a random (version 4) UUID drawn from the seeded source. The caller holds
// s.mu.
func (s *sender) randomUUID() string {
	var u uuid.UUID
	binary.BigEndian.PutUint64(u[:8], s.rng.Uint64())
	binary.BigEndian.PutUint64(u[8:], s.rng.Uint64())
	u[6] = u[6]&0x0f | 0x40
	u[8] = u[8]&0x3f | 0x80
	return u.String()
}

// heal stops the random faults.
func (s *sender) heal() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.rates = nil
}

// snapshot copies the records.
func (s *sender) snapshot() []WebhookTruth {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.records)
}

// waitIdle blocks until no sending is pending, or ctx ends.
func (s *sender) waitIdle(ctx context.Context) error {
	s.mu.Lock()
	if s.pending == 0 {
		s.mu.Unlock()
		return nil
	}
	idle := s.idle
	s.mu.Unlock()
	select {
	case <-idle:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// close stops every sending and waits for their goroutines; no sending starts after
// it. It is idempotent.
func (s *sender) close() {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	s.cancel()
	s.wg.Wait()
	s.client.CloseIdleConnections()
}

// accountOf returns the request's /account string, "" when it has none.
func accountOf(body []byte) string {
	var doc struct {
		Account string `json:"account"`
	}
	_ = json.Unmarshal(body, &doc)
	return doc.Account
}

// changedAmount returns the request with its amount one more, or 1 when it has no
// numeric amount.
func changedAmount(request json.RawMessage) json.RawMessage {
	var doc map[string]any
	d := json.NewDecoder(bytes.NewReader(request))
	d.UseNumber()
	if d.Decode(&doc) != nil || doc == nil {
		doc = map[string]any{}
	}
	amount := json.Number("1")
	if n, ok := doc["amount"].(json.Number); ok {
		if i, err := n.Int64(); err == nil {
			amount = json.Number(strconv.FormatInt(i+1, 10))
		} else if f, err := n.Float64(); err == nil {
			amount = json.Number(strconv.FormatFloat(f+1, 'g', -1, 64))
		}
	}
	doc["amount"] = amount
	return marshal(doc)
}

// marshal encodes what cannot fail to encode.
func marshal(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		panic(fmt.Sprintf("simtarget: encoding an event: %v", err))
	}
	return b
}

// sleep waits d, and reports false when ctx ended first.
func sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// body returns the event of that id as it was sent.
func (s *sender) body(eventID string) ([]byte, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	b, ok := s.bodies[eventID]
	return b, ok
}
