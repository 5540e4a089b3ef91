package server

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"

	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/store"
)

// Page and resume tokens are opaque to clients (base64url JSON) and bound to the tenant
// and the filter of the request that produced them: a token presented with another
// tenant or filter is rejected, so it can never be turned into a read of another tenant.

// tokenScope is what a token is bound to.
type tokenScope struct {
	Version int    `json:"v"`
	Tenant  string `json:"t"`
	Filter  string `json:"f"`
}

func (s tokenScope) scope() tokenScope { return s }

const tokenVersion = 1

// newScope binds a token to a tenant and a filter: states, and the references searched
// for (as a digest: a token names no reference).
func newScope(tenant string, states []store.State, refs ...string) tokenScope {
	filter := filterKey(states)
	if strings.Join(refs, "") != "" {
		sum := sha256.Sum256([]byte(strings.Join(refs, "\x00")))
		filter += "\x00refs=" + hex.EncodeToString(sum[:16])
	}
	return tokenScope{Version: tokenVersion, Tenant: tenant, Filter: filter}
}

// filterKey is a canonical spelling of a state filter.
func filterKey(states []store.State) string {
	names := make([]string, len(states))
	for i, s := range states {
		names[i] = string(s)
	}
	slices.Sort(names)
	return strings.Join(names, ",")
}

func encodeToken(tok any) string {
	b, _ := json.Marshal(tok) // cannot fail for the token types
	return base64.RawURLEncoding.EncodeToString(b)
}

// decodeToken reads the token in the request field into tok and checks that it is
// well-formed and bound to want. Errors are INVALID_ARGUMENT with the reason
// <FIELD>_INVALID, or <FIELD>_MISMATCH for a token of another tenant or filter.
func decodeToken(field, token string, want tokenScope, tok interface {
	scope() tokenScope
	valid() bool
}) error {
	reason := strings.ToUpper(field)
	b, err := base64.RawURLEncoding.DecodeString(token)
	if err != nil || json.Unmarshal(b, tok) != nil || tok.scope().Version != tokenVersion || !tok.valid() {
		return invalidArgument(violation(field, "is not a token of this call; start again without one", reason+"_INVALID"))
	}
	if tok.scope() != want {
		return invalidArgument(violation(field, "belongs to another tenant or filter; start again without one", reason+"_MISMATCH"))
	}
	return nil
}

// pageToken continues a listing after an operation.
type pageToken struct {
	tokenScope
	After uuid.UUID `json:"a"`
}

func (t *pageToken) valid() bool { return t.After != uuid.Nil }

// decodePageToken returns the position a page token continues from. The empty token
// starts at the beginning.
func decodePageToken(token string, scope tokenScope) (uuid.NullUUID, error) {
	if token == "" {
		return uuid.NullUUID{}, nil
	}
	var tok pageToken
	if err := decodeToken("page_token", token, scope, &tok); err != nil {
		return uuid.NullUUID{}, err
	}
	return uuid.NullUUID{UUID: tok.After, Valid: true}, nil
}

// escalationToken continues the escalation queue after an escalation.
type escalationToken struct {
	tokenScope
	At     time.Time `json:"at"`
	Tenant string    `json:"tn"`
	After  uuid.UUID `json:"a"`
}

func (t *escalationToken) valid() bool {
	return t.After != uuid.Nil && !t.At.IsZero() && t.Tenant != ""
}

// escalationScope binds an escalation token to its request's tenant and filters.
func escalationScope(req *opbrokerv1.ListEscalationsRequest) tokenScope {
	return tokenScope{Version: tokenVersion, Tenant: req.GetTenant(), Filter: "target=" + req.GetTarget() + "\x00owner=" + req.GetOwner()}
}

func encodeEscalationToken(req *opbrokerv1.ListEscalationsRequest, at store.EscalationPosition) string {
	return encodeToken(escalationToken{tokenScope: escalationScope(req), At: at.At, Tenant: at.TenantID, After: at.ID})
}

// decodeEscalationToken returns where the queue continues, or nil from its start.
func decodeEscalationToken(req *opbrokerv1.ListEscalationsRequest) (*store.EscalationPosition, error) {
	if req.GetPageToken() == "" {
		return nil, nil
	}
	var tok escalationToken
	if err := decodeToken("page_token", req.GetPageToken(), escalationScope(req), &tok); err != nil {
		return nil, err
	}
	return &store.EscalationPosition{At: tok.At, TenantID: tok.Tenant, ID: tok.After}, nil
}

// quarantineToken continues the quarantine after an event.
type quarantineToken struct {
	tokenScope
	At       time.Time `json:"at"`
	Target   string    `json:"tg"`
	EventID  string    `json:"e"`
	Reporter string    `json:"r,omitempty"`
}

func (t *quarantineToken) valid() bool { return !t.At.IsZero() && t.Target != "" && t.EventID != "" }

// quarantineScope binds a quarantine token to its request's target filter.
func quarantineScope(req *opbrokerv1.ListQuarantineRequest) tokenScope {
	return tokenScope{Version: tokenVersion, Filter: "target=" + req.GetTarget()}
}

func encodeQuarantineToken(req *opbrokerv1.ListQuarantineRequest, last store.InboundEvidence) string {
	return encodeToken(quarantineToken{tokenScope: quarantineScope(req), At: last.ReceivedAt, Target: last.Target,
		EventID: last.EventID, Reporter: last.Reporter})
}

// decodeQuarantineToken sets where the quarantine continues in p.
func decodeQuarantineToken(req *opbrokerv1.ListQuarantineRequest, p *store.QuarantineParams) error {
	if req.GetPageToken() == "" {
		return nil
	}
	var tok quarantineToken
	if err := decodeToken("page_token", req.GetPageToken(), quarantineScope(req), &tok); err != nil {
		return err
	}
	p.AfterReceived, p.AfterKey = tok.At, store.EvidenceKey{Target: tok.Target, EventID: tok.EventID, Reporter: tok.Reporter}
	return nil
}

// resumeToken continues a tenant's watch after a cursor of its feed.
type resumeToken struct {
	tokenScope
	After [2]int64   `json:"a"`
	Ahead [][2]int64 `json:"h,omitempty"`
}

func (t *resumeToken) valid() bool {
	if t.After[0] < 0 || t.After[1] < 0 {
		return false
	}
	for _, a := range t.Ahead {
		if a[0] < t.After[0] || a[0] == t.After[0] && a[1] <= t.After[1] {
			return false
		}
	}
	return true
}

func encodeResumeToken(scope tokenScope, c store.FeedCursor) string {
	tok := resumeToken{tokenScope: scope, After: [2]int64{c.After.Xact, c.After.Seq}}
	for _, a := range c.Ahead {
		tok.Ahead = append(tok.Ahead, [2]int64{a.Xact, a.Seq})
	}
	return encodeToken(tok)
}

func decodeResumeToken(token string, scope tokenScope) (store.FeedCursor, error) {
	var tok resumeToken
	if err := decodeToken("resume_token", token, scope, &tok); err != nil {
		return store.FeedCursor{}, err
	}
	c := store.FeedCursor{After: store.FeedPosition{Xact: tok.After[0], Seq: tok.After[1]}}
	for _, a := range tok.Ahead {
		c.Ahead = append(c.Ahead, store.FeedPosition{Xact: a[0], Seq: a[1]})
	}
	return c, nil
}
