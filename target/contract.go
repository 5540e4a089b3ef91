package target

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"os"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/goccy/go-yaml"
	"github.com/goccy/go-yaml/ast"
)

// File is the configuration file of targets.
type File struct {
	Targets []*Contract `yaml:"targets"`
}

// Contract is what the broker knows of one remote target, from its vendor's
// documentation.
type Contract struct {
	Name string `yaml:"name"`
	// DisplayName is how the support view names the target to support staff, as
	// they would say it ("the payment provider"); "the provider" when empty.
	DisplayName    string        `yaml:"display_name,omitempty"`
	Documentation  Documentation `yaml:"documentation"`
	Owner          Owner         `yaml:"owner"`
	Data           DataOwnership `yaml:"data"`
	OperationTypes []string      `yaml:"operation_types"`
	Endpoint       Endpoint      `yaml:"endpoint"`
	Idempotency    *Idempotency  `yaml:"idempotency"`
	Lookup         *Lookup       `yaml:"lookup"`
	Conditional    *Conditional  `yaml:"conditional_mutation"`
	Responses      Responses     `yaml:"responses"`
	Completion     *Completion   `yaml:"completion"`
	// Evidence says how to read the events the target reports (webhooks, or events an
	// internal service reports for it); nil: the target reports none.
	Evidence    *Evidence `yaml:"evidence,omitempty"`
	Concurrency int       `yaml:"concurrency"`
	// ManualResolution governs operators' resolutions of the target's operations; nil
	// lets one operator resolve alone.
	ManualResolution *ManualResolution `yaml:"manual_resolution,omitempty"`

	// Auth, TLS and Headers apply to every request to the target, sends and lookups.
	// The contract names where a secret is read, never the secret (credentials.go).
	Auth    *Auth             `yaml:"auth,omitempty"`
	TLS     *TLS              `yaml:"tls,omitempty"`
	Headers map[string]string `yaml:"headers,omitempty"` // sent as they are, e.g. an API version
}

// ManualResolution asks for four eyes on the resolutions operators make by hand.
type ManualResolution struct {
	// SecondOperator: a resolution applies only once a second, different operator
	// approves it (AdminService.ApproveResolution).
	SecondOperator bool `yaml:"second_operator"`
	// ApprovalWindow is how long a proposed resolution may be approved
	// (DefaultApprovalWindow when zero; at most a week).
	ApprovalWindow Duration `yaml:"approval_window,omitempty"`
}

// DefaultApprovalWindow is how long a proposed resolution waits for its second operator
// when the contract does not say.
const DefaultApprovalWindow = time.Hour

// Window returns how long a proposed resolution may be approved.
func (m *ManualResolution) Window() time.Duration {
	if m.ApprovalWindow <= 0 {
		return DefaultApprovalWindow
	}
	return m.ApprovalWindow.D()
}

// SecondOperatorRequired reports whether an operator's resolution of the contract's
// operations needs another operator's approval.
func (c *Contract) SecondOperatorRequired() bool {
	return c.ManualResolution != nil && c.ManualResolution.SecondOperator
}

// FailureSettlesAfter is how long after an operation's last send ended a resolution by
// hand may call it FAILED_TERMINAL: until then a write the send made may not be visible
// to a look at the target yet (the lookup's visibility delay), or the request may still
// take effect (its documented absence_final_after). Zero for a target with no lookup.
func (c *Contract) FailureSettlesAfter() time.Duration {
	if c.Lookup == nil {
		return 0
	}
	return max(c.Lookup.VisibilityDelay.D(), c.Lookup.AbsenceFinalAfter.D())
}

// Documentation says where the contract comes from.
type Documentation struct {
	URL     string `yaml:"url"`
	Checked string `yaml:"checked"` // YYYY-MM-DD
}

// Owner receives the target's escalations.
type Owner struct {
	Team       string `yaml:"team"`
	Escalation string `yaml:"escalation"` // where a person finds the runbook or the queue
}

// DataOwnership names who owns what the broker stores about this target's operations
// (go/no-go control 10, docs/targets.md).
type DataOwnership struct {
	Owner     string   `yaml:"owner"`
	Retention Duration `yaml:"retention"`
}

// Endpoint is where an operation is sent. It comes only from configuration, never from
// a request.
type Endpoint struct {
	Method      string   `yaml:"method"`
	URL         string   `yaml:"url"`
	Timeout     Duration `yaml:"timeout"`
	FenceHeader string   `yaml:"fence_header"` // optional: send the fence token to targets that check it
	// RequestIDHeader, optional, carries the operation's remote key for correlation on
	// targets without idempotency keys; it asks nothing of the target.
	RequestIDHeader string `yaml:"request_id_header"`
}

// Idempotency is the target's key mechanism (capability A).
type Idempotency struct {
	Header    string   `yaml:"header"`
	Retention Duration `yaml:"retention"` // from the first send
	Scope     string   `yaml:"scope"`
	// ParameterMismatch is what the target does when a key is reused with other
	// parameters: "rejects", "replays_original" or "undocumented".
	ParameterMismatch string `yaml:"parameter_mismatch"`
	// Saves is what the target keeps under a key, and so which earlier attempts a
	// repeat of the key cannot execute again: SavesEveryAnswer or SavesSuccessesOnly.
	// Where it is unsaid, the contract fails go/no-go control 1.
	Saves string `yaml:"saves"`
}

// What a target saves under an idempotency key (Idempotency.Saves).
const (
	// SavesEveryAnswer: once the target began executing a request, the first answer it
	// made, an error or a 5xx included, is saved under the key and returned to every
	// repeat (Stripe's API v1). A repeat never executes again, whatever the first
	// attempt answered.
	SavesEveryAnswer = "every_answer"
	// SavesSuccessesOnly: only a success is saved; a repeat after an error, a 5xx, a
	// reset or a timeout executes the request again. The key protects only attempts
	// whose success the target saved.
	SavesSuccessesOnly = "successes_only"
)

// CoversEveryAttempt reports whether a repeat of the key can never execute an attempt
// that already began executing: the target saves and returns every answer.
func (i *Idempotency) CoversEveryAttempt() bool { return i != nil && i.Saves == SavesEveryAnswer }

// KeyRetention is how long the target keeps an idempotency key, from its first use (0
// for a target without one).
func (c *Contract) KeyRetention() time.Duration {
	if c.Idempotency == nil {
		return 0
	}
	return c.Idempotency.Retention.D()
}

// KeyScope fingerprints what an idempotency key sent to this target means there: the
// target, its endpoint, its static headers (an API version), the key's header and
// scope, and the credential's identity (its scheme, user, header and where its secret
// is read, and the client certificate's file; never a secret). The ledger keeps the
// fingerprint of the first send of an operation that may have taken effect; a replay
// is allowed only while the contract still has it. "" for a target without a key or a
// precondition.
func (c *Contract) KeyScope() string {
	if c.Idempotency == nil && c.Conditional == nil {
		return ""
	}
	h := sha256.New()
	fmt.Fprintf(h, "target %q\nendpoint %q %q\n", c.Name, c.Endpoint.Method, c.Endpoint.URL)
	if i := c.Idempotency; i != nil {
		fmt.Fprintf(h, "key %q %q\n", i.Header, i.Scope)
	}
	if p := c.Conditional; p != nil {
		fmt.Fprintf(h, "precondition %q %q %q\n", p.Header, p.Parameter, p.Value)
	}
	for _, name := range slices.Sorted(maps.Keys(c.Headers)) {
		fmt.Fprintf(h, "header %q %q\n", name, c.Headers[name])
	}
	if a := c.Auth; a != nil {
		fmt.Fprintf(h, "auth %q %q %q %q %q %q\n", a.Scheme, a.User, a.Header, a.Prefix, a.Secret.Env, a.Secret.File)
	}
	if t := c.TLS; t != nil {
		fmt.Fprintf(h, "tls %q\n", t.ClientCertificate)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// LookupScope fingerprints where the lookup asks for an operation's effect and what it
// takes as "not found": its method, its URL and its not-found statuses (its headers and
// credential are the endpoint's, in KeyScope). The ledger keeps it as it keeps
// KeyScope; a "not found" proves absence only while the contract still has it. It is
// the first 16 bytes of a SHA-256, in hexadecimal (the ledger writes it with every
// version of an operation's row, so it is kept short); "" for a target without a
// lookup.
func (c *Contract) LookupScope() string {
	l := c.Lookup
	if l == nil {
		return ""
	}
	h := sha256.New()
	fmt.Fprintf(h, "target %q\nlookup %q %q\nnot found %v\n", c.Name, l.Method, l.URL, slices.Compact(slices.Sorted(slices.Values(l.NotFound))))
	return hex.EncodeToString(h.Sum(nil)[:16])
}

// Lookup finds an effect by the operation's remote key (capability B).
type Lookup struct {
	Method string `yaml:"method"`
	// URL may contain {remote_key}.
	URL string `yaml:"url"`
	// VisibilityDelay is how long a write may take to become visible to lookups.
	VisibilityDelay Duration `yaml:"visibility_delay"`
	// AbsenceFinalAfter, when set, is the time after a send past which the target
	// documents that the request can no longer take effect, so that absence is final
	// (counted from the last send). Unset: absence is never final.
	AbsenceFinalAfter Duration `yaml:"absence_final_after"`
	// Found is the answer that means "found": its remote_ref is the target's reference,
	// its reference the JSON pointer at which the object carries our remote key.
	Found    ResponseClass `yaml:"found"`
	NotFound []int         `yaml:"not_found"`
	// Match lists the key fields a found object must share with the approved payload;
	// an object that carries our key but disagrees is escalated, never accepted.
	Match []FieldMatch `yaml:"match"`
}

// FieldMatch pairs a field of the remote object with a field of the approved payload,
// both JSON pointers.
type FieldMatch struct {
	Remote  string `yaml:"remote"`
	Payload string `yaml:"payload"`
}

// Completion describes a target whose objects finish after the answer: the success
// answer and the lookup's found object carry a status, and only the values listed as
// succeeded confirm the effect. A pending object is never SUCCEEDED: the operation stays
// UNKNOWN and is looked up again until it settles. A failed one is FAILED_TERMINAL only
// because Documented quotes the vendor saying those values are final and had no effect;
// a value in no list is taken as not settled.
type Completion struct {
	// Field is the JSON pointer of the status in the object, e.g. /status.
	Field      string   `yaml:"field"`
	Succeeded  []string `yaml:"succeeded"`
	Pending    []string `yaml:"pending"`
	Failed     []string `yaml:"failed"`
	Documented string   `yaml:"documented"` // required with failed
}

// Settlement is what an object's status says of the effect.
type Settlement int

const (
	// Settled: the effect is confirmed (or the target has no completion to wait for).
	Settled Settlement = iota
	// Pending: accepted, not finished; it may still succeed or fail.
	Pending
	// FailedFinal: the target documents the status as final and without effect.
	FailedFinal
	// Unsettled: a status the contract does not list, or none: not confirmed.
	Unsettled
)

// Of reads an object's status and says what it means, with the status read ("" when
// there is none). A nil Completion settles every object.
func (c *Completion) Of(object []byte) (Settlement, string) {
	if c == nil {
		return Settled, ""
	}
	status, ok := jsonPointerString(object, c.Field)
	switch {
	case !ok:
		return Unsettled, ""
	case slices.Contains(c.Succeeded, status):
		return Settled, status
	case slices.Contains(c.Pending, status):
		return Pending, status
	case slices.Contains(c.Failed, status):
		return FailedFinal, status
	}
	return Unsettled, status
}

// Conditional is the target's precondition mechanism (capability C): every send carries
// a precondition under which the target creates the effect only if it does not exist
// yet (S3's If-None-Match: *, Cloud Storage's ifGenerationMatch=0), on an object named by
// the operation's remote key (the endpoint URL holds {remote_key}). A resend therefore
// either creates the effect, the earlier sends having made nothing, or is refused with
// a PreconditionFailed answer: it can never make a second one.
type Conditional struct {
	// Header or Parameter (a query parameter), exactly one, carries Value.
	Header    string `yaml:"header,omitempty"`
	Parameter string `yaml:"parameter,omitempty"`
	Value     string `yaml:"value"`
	// PreconditionFailed are the statuses of a refusal: the effect already exists.
	PreconditionFailed []int `yaml:"precondition_failed"`
	// Documented quotes the vendor's statement of the precondition's guarantee.
	Documented string `yaml:"documented"`
}

// Responses classify the target's answers to a send.
type Responses struct {
	Success   []ResponseClass `yaml:"success"`
	Rejection []ResponseClass `yaml:"rejection"`
	// NotExecuted lists the answers the vendor documents as never executed (a rate
	// limit that runs before its idempotency layer, a refused credential): the
	// operation is sent again later, with the same key and bytes.
	NotExecuted []ResponseClass `yaml:"not_executed"`
	InProgress  []ResponseClass `yaml:"in_progress"`
}

// ResponseClass is a set of HTTP statuses that mean one thing.
type ResponseClass struct {
	Status []int `yaml:"status"`
	// RemoteRef is the JSON pointer (RFC 6901) of the target's reference in the body.
	RemoteRef string `yaml:"remote_ref"`
	// Documented quotes or links the vendor's statement that makes this class mean what
	// it does (required for rejections: no side effect).
	Documented string `yaml:"documented"`
	// Reference, for lookups, is the JSON pointer at which the object carries the
	// operation's remote key.
	Reference string `yaml:"reference"`
	// Credential, for a not_executed class, says the answer means the target refused the
	// broker's credential: the target's sends wait until the credential changes.
	Credential bool `yaml:"credential,omitempty"`
}

// Duration is a time.Duration written in YAML as "10s", "5m" or "24h"; a malformed one
// is reported with its line.
type Duration time.Duration

// D returns the duration as a time.Duration.
func (d Duration) D() time.Duration { return time.Duration(d) }

// MarshalYAML writes the duration as Go spells it (90s, 24h0m0s), as it is read.
func (d Duration) MarshalYAML() (any, error) { return time.Duration(d).String(), nil }

func (d Duration) String() string { return time.Duration(d).String() }

// UnmarshalYAML implements yaml.NodeUnmarshaler.
func (d *Duration) UnmarshalYAML(node ast.Node) error {
	text := strings.Trim(node.String(), `"'`)
	v, err := time.ParseDuration(text)
	if err != nil {
		return fmt.Errorf("line %d: %q is not a duration such as 10s, 5m or 24h", node.GetToken().Position.Line, text)
	}
	*d = Duration(v)
	return nil
}

// Serves reports whether the target serves the operation type.
func (c *Contract) Serves(operationType string) bool {
	return slices.Contains(c.OperationTypes, operationType)
}

// Capabilities of a target: A to D of docs/targets.md#capabilities.
type Capabilities struct {
	Replay      bool // A: same-key replay inside the retention window
	Lookup      bool // B: lookup by reference
	Conditional bool // C: conditional mutation
}

// None reports capability D: no way to resolve an unclear outcome but a person.
func (c Capabilities) None() bool { return !c.Replay && !c.Lookup && !c.Conditional }

func (c Capabilities) String() string {
	var parts []string
	if c.Replay {
		parts = append(parts, "A same-key replay")
	}
	if c.Lookup {
		parts = append(parts, "B lookup by reference")
	}
	if c.Conditional {
		parts = append(parts, "C conditional mutation")
	}
	if len(parts) == 0 {
		return "D none: unclear outcomes are escalated, never retried"
	}
	return strings.Join(parts, ", ")
}

// Capabilities derives the target's capabilities from its contract.
func (c *Contract) Capabilities() Capabilities {
	return Capabilities{
		Replay:      c.Idempotency != nil && c.Idempotency.Retention > 0,
		Lookup:      c.Lookup != nil,
		Conditional: c.Conditional != nil,
	}
}

// Targets is a loaded, valid set of contracts.
type Targets struct {
	byName map[string]*Contract
	byType map[string]*Contract
	all    []*Contract
}

// ForType returns the target serving an operation type.
func (t *Targets) ForType(operationType string) (*Contract, bool) {
	c, ok := t.byType[operationType]
	return c, ok
}

// All returns the contracts in file order.
func (t *Targets) All() []*Contract { return t.all }

// ByName returns a contract by its name.
func (t *Targets) ByName(name string) (*Contract, bool) {
	c, ok := t.byName[name]
	return c, ok
}

// Encode returns the YAML of a targets file holding contracts: what LoadFile reads (for
// programs that run brokers against targets they start, such as the chaos run).
func Encode(contracts []*Contract) ([]byte, error) {
	return yaml.Marshal(File{Targets: contracts})
}

// LoadFile reads, checks and returns the targets in path. Every problem is reported,
// each naming the file, the target and the field; a target that fails a go/no-go
// control is an error too.
func LoadFile(path string) (*Targets, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("targets: %w", err)
	}
	return Parse(path, data)
}

// Parse is LoadFile on data already read; name is used in errors.
func Parse(name string, data []byte) (*Targets, error) {
	file, err := Decode(name, data)
	if err != nil {
		return nil, err
	}
	var problems []error
	for _, c := range file.Targets {
		for _, r := range c.Controls() {
			if !r.Pass {
				problems = append(problems, fmt.Errorf("%s: target %q: go/no-go control %d (%s) fails: %s", name, c.Name, r.Number, r.Name, r.Reason))
			}
		}
	}
	if len(problems) > 0 {
		return nil, errors.Join(problems...)
	}
	return newTargets(file.Targets), nil
}

// New returns Targets over contracts that are already valid (for tests and dev mode).
func New(contracts ...*Contract) (*Targets, error) {
	file := &File{Targets: contracts}
	if err := file.validate("<built in>"); err != nil {
		return nil, err
	}
	return newTargets(contracts), nil
}

func newTargets(contracts []*Contract) *Targets {
	t := &Targets{byName: map[string]*Contract{}, byType: map[string]*Contract{}, all: contracts}
	for _, c := range contracts {
		t.byName[c.Name] = c
		for _, typ := range c.OperationTypes {
			t.byType[typ] = c
		}
	}
	return t
}

// Decode parses and validates the file's fields without judging the go/no-go controls.
func Decode(name string, data []byte) (*File, error) {
	var file File
	if err := yaml.UnmarshalWithOptions(data, &file, yaml.DisallowUnknownField()); err != nil {
		return nil, fmt.Errorf("%s: %s", name, yaml.FormatError(err, false, true))
	}
	if err := file.validate(name); err != nil {
		return nil, err
	}
	return &file, nil
}

var (
	namePattern          = regexp.MustCompile(`^[a-z][a-z0-9-]{0,62}$`)
	operationTypePattern = regexp.MustCompile(`^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)*$`)
	headerPattern        = regexp.MustCompile(`^[A-Za-z0-9-]+$`)
)

// validate reports every malformed field, each as "file: target "name": field: problem".
func (f *File) validate(file string) error {
	var problems []error
	if len(f.Targets) == 0 {
		problems = append(problems, fmt.Errorf("%s: targets: at least one target is needed", file))
	}
	names := map[string]bool{}
	types := map[string]string{}
	paths := map[string]string{}
	for i, c := range f.Targets {
		label := fmt.Sprintf("target #%d", i+1)
		if c.Name != "" {
			label = fmt.Sprintf("target %q", c.Name)
		}
		bad := func(field, format string, args ...any) {
			problems = append(problems, fmt.Errorf("%s: %s: %s: %s", file, label, field, fmt.Sprintf(format, args...)))
		}
		switch {
		case !namePattern.MatchString(c.Name):
			bad("name", "must be lowercase letters, digits and hyphens, starting with a letter")
		case names[c.Name]:
			bad("name", "is used by another target")
		}
		names[c.Name] = true
		if len(c.OperationTypes) == 0 {
			bad("operation_types", "at least one operation type is needed")
		}
		for _, typ := range c.OperationTypes {
			if !operationTypePattern.MatchString(typ) {
				bad("operation_types", "%q is not dotted lowercase words", typ)
			} else if other, dup := types[typ]; dup {
				bad("operation_types", "%q is already served by target %q", typ, other)
			}
			types[typ] = c.Name
		}
		c.Endpoint.validate(bad)
		if c.Idempotency != nil {
			c.Idempotency.validate(bad)
		}
		if c.Lookup != nil {
			c.Lookup.validate(bad)
		}
		if c.Completion != nil {
			c.Completion.validate(bad)
		}
		if c.Evidence != nil {
			c.Evidence.validate(bad)
			if w := c.Evidence.Webhook; w != nil {
				if other, dup := paths[w.Path]; dup {
					bad("evidence.webhook.path", "is used by target %q", other)
				}
				paths[w.Path] = c.Name
			}
		}
		if m := c.ManualResolution; m != nil && (m.ApprovalWindow < 0 || m.ApprovalWindow.D() > 7*24*time.Hour) {
			bad("manual_resolution.approval_window", "must be between 0 (the default, %s) and a week", DefaultApprovalWindow)
		}
		if c.Conditional != nil {
			c.Conditional.validate(bad)
			if !strings.Contains(c.Endpoint.URL, "{remote_key}") {
				bad("endpoint.url", "must name the object by {remote_key} for conditional_mutation: the precondition must hold for this operation's object")
			}
		}
		if c.Documentation.Checked != "" {
			if _, err := time.Parse(time.DateOnly, c.Documentation.Checked); err != nil {
				bad("documentation.checked", "must be a date, YYYY-MM-DD")
			}
		}
		if c.Documentation.URL != "" {
			if u, err := url.Parse(c.Documentation.URL); err != nil || u.Scheme == "" {
				bad("documentation.url", "must be an absolute URL")
			}
		}
		if c.Concurrency < 0 {
			bad("concurrency", "must not be negative (0 means the default)")
		}
		var preconditionFailed []int
		if c.Conditional != nil {
			preconditionFailed = c.Conditional.PreconditionFailed
		}
		c.Responses.validate(bad, preconditionFailed)
		c.validateAccess(bad)
	}
	return errors.Join(problems...)
}

func (e *Endpoint) validate(bad func(field, format string, args ...any)) {
	if !slices.Contains([]string{http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete}, e.Method) {
		bad("endpoint.method", "must be POST, PUT, PATCH or DELETE")
	}
	validateURL(bad, "endpoint.url", strings.ReplaceAll(e.URL, "{remote_key}", "x"))
	if e.Timeout <= 0 {
		bad("endpoint.timeout", "must be a positive duration, e.g. 10s")
	}
	if e.FenceHeader != "" && !headerPattern.MatchString(e.FenceHeader) {
		bad("endpoint.fence_header", "must be an HTTP header name")
	}
	if e.RequestIDHeader != "" && !headerPattern.MatchString(e.RequestIDHeader) {
		bad("endpoint.request_id_header", "must be an HTTP header name")
	}
}

func (i *Idempotency) validate(bad func(field, format string, args ...any)) {
	if !headerPattern.MatchString(i.Header) {
		bad("idempotency.header", "must be an HTTP header name, e.g. Idempotency-Key")
	}
	if i.Retention <= 0 {
		bad("idempotency.retention", "must be the documented key retention, e.g. 24h")
	}
	if i.Scope == "" {
		bad("idempotency.scope", "must say what a key is unique within, from the documentation")
	}
	if !slices.Contains([]string{"rejects", "replays_original", "undocumented"}, i.ParameterMismatch) {
		bad("idempotency.parameter_mismatch", "must be rejects, replays_original or undocumented")
	}
	if i.Saves != "" && i.Saves != SavesEveryAnswer && i.Saves != SavesSuccessesOnly {
		bad("idempotency.saves", "must be %s or %s", SavesEveryAnswer, SavesSuccessesOnly)
	}
}

func (c *Conditional) validate(bad func(field, format string, args ...any)) {
	switch {
	case (c.Header == "") == (c.Parameter == ""):
		bad("conditional_mutation", "needs exactly one of header and parameter")
	case c.Header != "" && !headerPattern.MatchString(c.Header):
		bad("conditional_mutation.header", "must be an HTTP header name, e.g. If-None-Match")
	case c.Parameter != "" && !headerPattern.MatchString(c.Parameter):
		bad("conditional_mutation.parameter", "must be a query parameter name, e.g. ifGenerationMatch")
	}
	if c.Value == "" {
		bad("conditional_mutation.value", "must be the precondition's value, e.g. * or 0")
	}
	if len(c.PreconditionFailed) == 0 {
		bad("conditional_mutation.precondition_failed", "must list the statuses of a failed precondition, e.g. [412]")
	}
	validateStatuses(bad, "conditional_mutation.precondition_failed", c.PreconditionFailed)
}

func (c *Completion) validate(bad func(field, format string, args ...any)) {
	if !strings.HasPrefix(c.Field, "/") {
		bad("completion.field", "must be the JSON pointer of the object's status, e.g. /status")
	}
	if len(c.Succeeded) == 0 {
		bad("completion.succeeded", "at least one status value must confirm the effect")
	}
	seen := map[string]string{}
	for _, list := range []struct {
		name   string
		values []string
	}{{"succeeded", c.Succeeded}, {"pending", c.Pending}, {"failed", c.Failed}} {
		for _, v := range list.values {
			if other, dup := seen[v]; dup {
				bad("completion."+list.name, "%q is also listed under %s", v, other)
			}
			seen[v] = list.name
		}
	}
}

func (l *Lookup) validate(bad func(field, format string, args ...any)) {
	if l.Method != http.MethodGet {
		bad("lookup.method", "must be GET")
	}
	validateURL(bad, "lookup.url", strings.ReplaceAll(l.URL, "{remote_key}", "x"))
	if !strings.Contains(l.URL, "{remote_key}") {
		bad("lookup.url", "must contain {remote_key}")
	}
	if l.VisibilityDelay < 0 || l.AbsenceFinalAfter < 0 {
		bad("lookup", "durations must not be negative")
	}
	if l.AbsenceFinalAfter > 0 && l.AbsenceFinalAfter < l.VisibilityDelay {
		bad("lookup.absence_final_after", "must not be shorter than visibility_delay")
	}
	if len(l.Found.Status) == 0 || l.Found.RemoteRef == "" || l.Found.Reference == "" {
		bad("lookup.found", "needs status, remote_ref and reference (where the object carries our key)")
	}
	for i, m := range l.Match {
		if !strings.HasPrefix(m.Remote, "/") || !strings.HasPrefix(m.Payload, "/") {
			bad(fmt.Sprintf("lookup.match[%d]", i), "remote and payload must be JSON pointers, e.g. /amount")
		}
	}
	validateStatuses(bad, "lookup.found.status", l.Found.Status)
	validateStatuses(bad, "lookup.not_found", l.NotFound)
	for _, st := range l.NotFound {
		if slices.Contains(l.Found.Status, st) {
			bad("lookup.not_found", "%d is also listed under lookup.found.status", st)
		}
	}
}

// validate checks the response classes. A status has one meaning: it is in one class
// at most, and never both in a class and among a conditional target's
// preconditionFailed, which the connector reads after the success and rejection classes
// (a 412 listed as a rejection as well would turn "an earlier send made the effect"
// into a failure).
func (r *Responses) validate(bad func(field, format string, args ...any), preconditionFailed []int) {
	if len(r.Success) == 0 {
		bad("responses.success", "at least one class is needed")
	}
	seen := map[int]string{}
	for _, st := range preconditionFailed {
		seen[st] = "conditional_mutation.precondition_failed"
	}
	for _, kinds := range []struct {
		kind    string
		classes []ResponseClass
	}{{"success", r.Success}, {"rejection", r.Rejection}, {"not_executed", r.NotExecuted}, {"in_progress", r.InProgress}} {
		kind := kinds.kind
		for i, class := range kinds.classes {
			field := fmt.Sprintf("responses.%s[%d]", kind, i)
			if len(class.Status) == 0 {
				bad(field+".status", "at least one status is needed")
			}
			validateStatuses(bad, field+".status", class.Status)
			for _, st := range class.Status {
				if other, dup := seen[st]; dup && other != kind {
					bad(field+".status", "%d is also listed under %s", st, other)
				}
				seen[st] = kind
			}
			if class.RemoteRef != "" && !strings.HasPrefix(class.RemoteRef, "/") {
				bad(field+".remote_ref", "must be a JSON pointer, e.g. /id")
			}
			if class.Credential && kind != "not_executed" {
				bad(field+".credential", "only a not_executed class can mean a refused credential")
			}
		}
	}
}

func validateStatuses(bad func(field, format string, args ...any), field string, statuses []int) {
	for _, st := range statuses {
		if st < 100 || st > 599 {
			bad(field, "%d is not an HTTP status", st)
		}
	}
}

func validateURL(bad func(field, format string, args ...any), field, raw string) {
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		bad(field, "must be an absolute http or https URL")
	}
}
