// Package auth says who is calling: principals with roles and the tenants they may act
// for, known by a bearer token (stored only as its SHA-256) or by the identity in a
// verified client certificate (a SPIFFE URI or DNS name).
//
// Authentication is here; what each call needs (authorisation) is decided in one place,
// the server's authorize.
package auth

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"regexp"
	"slices"

	"github.com/goccy/go-yaml"
	grpcauth "github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/auth"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
)

// Role is what a principal may do.
type Role string

// The roles. Each RPC declares the roles that may call it.
const (
	// RoleClient records intents, reads, cancels and watches its tenants' operations.
	RoleClient Role = "client"
	// RoleWorker is an executor outside the broker that claims and reports under a
	// fence (its API comes later; no call accepts it yet).
	RoleWorker Role = "worker"
	// RoleOperator administers: it may delete a tenant's data.
	RoleOperator Role = "operator"
	// RoleSupportRead reads and watches operations, and changes nothing.
	RoleSupportRead Role = "support-read"
	// RoleEvidence reports the events a target sent to an internal service, for its
	// tenants (EvidenceService).
	RoleEvidence Role = "evidence"
)

var roles = []Role{RoleClient, RoleWorker, RoleOperator, RoleSupportRead, RoleEvidence}

// Principal is an authenticated caller.
type Principal struct {
	Name  string
	Roles []Role
	// Tenants the principal may act for; AllTenants for every tenant.
	Tenants    []string
	AllTenants bool
}

// Has reports whether the principal has one of the roles.
func (p *Principal) Has(want ...Role) bool {
	return slices.ContainsFunc(want, func(r Role) bool { return slices.Contains(p.Roles, r) })
}

// MayActFor reports whether the principal may act for the tenant.
func (p *Principal) MayActFor(tenant string) bool {
	return p.AllTenants || slices.Contains(p.Tenants, tenant)
}

// Errors of Authenticate.
var (
	ErrNoCredentials  = errors.New("auth: no credentials: send a bearer token or a client certificate")
	ErrBadCredentials = errors.New("auth: the credentials are not known")
)

// Authenticator knows the configured principals by their credentials.
type Authenticator struct {
	byToken    map[[sha256.Size]byte]*Principal
	byIdentity map[string]*Principal
}

// File is the principals file (YAML), as documented in docs/security.md.
type File struct {
	Principals []PrincipalConfig `yaml:"principals"`
}

// PrincipalConfig is one principal of the file.
type PrincipalConfig struct {
	Name       string   `yaml:"name"`
	Roles      []Role   `yaml:"roles"`
	Tenants    []string `yaml:"tenants"`
	AllTenants bool     `yaml:"all_tenants"`
	// TokenSHA256 holds the hex SHA-256 of each bearer token (opbroker token new).
	TokenSHA256 []string `yaml:"token_sha256"`
	// Identities are URI (spiffe://…) or DNS names of client certificates.
	Identities []string `yaml:"identities"`
}

var (
	namePattern   = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,62}$`)
	tenantPattern = regexp.MustCompile(`^[a-z]([a-z0-9-]{0,61}[a-z0-9])?$`)
	hashPattern   = regexp.MustCompile(`^[0-9a-f]{64}$`)
)

// Load reads a principals file.
func Load(path string) (*Authenticator, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var file File
	if err := yaml.UnmarshalWithOptions(data, &file, yaml.DisallowUnknownField()); err != nil {
		return nil, fmt.Errorf("%s: %s", path, yaml.FormatError(err, false, true))
	}
	a, err := New(file.Principals)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return a, nil
}

// New checks the principals and returns their authenticator.
func New(principals []PrincipalConfig) (*Authenticator, error) {
	a := &Authenticator{byToken: map[[sha256.Size]byte]*Principal{}, byIdentity: map[string]*Principal{}}
	names := map[string]bool{}
	for i, pc := range principals {
		where := fmt.Sprintf("principal %d (%s)", i+1, pc.Name)
		switch {
		case !namePattern.MatchString(pc.Name):
			return nil, fmt.Errorf("%s: name must match %s", where, namePattern)
		case names[pc.Name]:
			return nil, fmt.Errorf("%s: name used twice", where)
		case len(pc.Roles) == 0:
			return nil, fmt.Errorf("%s: needs at least one role of %v", where, roles)
		case pc.AllTenants == (len(pc.Tenants) > 0):
			return nil, fmt.Errorf("%s: needs either tenants or all_tenants: true", where)
		case len(pc.TokenSHA256)+len(pc.Identities) == 0:
			return nil, fmt.Errorf("%s: needs a token_sha256 or an identity", where)
		}
		names[pc.Name] = true
		for _, r := range pc.Roles {
			if !slices.Contains(roles, r) {
				return nil, fmt.Errorf("%s: unknown role %q, want one of %v", where, r, roles)
			}
		}
		for _, t := range pc.Tenants {
			if !tenantPattern.MatchString(t) {
				return nil, fmt.Errorf("%s: tenant %q must match %s", where, t, tenantPattern)
			}
		}
		p := &Principal{Name: pc.Name, Roles: slices.Clone(pc.Roles), Tenants: slices.Clone(pc.Tenants), AllTenants: pc.AllTenants}
		for _, h := range pc.TokenSHA256 {
			var key [sha256.Size]byte
			if !hashPattern.MatchString(h) {
				return nil, fmt.Errorf("%s: token_sha256 must be 64 lowercase hex digits (opbroker token new prints one)", where)
			}
			_, _ = hex.Decode(key[:], []byte(h))
			if a.byToken[key] != nil {
				return nil, fmt.Errorf("%s: a token hash is used twice", where)
			}
			a.byToken[key] = p
		}
		for _, id := range pc.Identities {
			if a.byIdentity[id] != nil {
				return nil, fmt.Errorf("%s: identity %q is used twice", where, id)
			}
			a.byIdentity[id] = p
		}
	}
	return a, nil
}

// Authenticate returns the principal of a call: the bearer token's when the call carries
// one (it must be known), otherwise the verified client certificate's.
func (a *Authenticator) Authenticate(ctx context.Context) (*Principal, error) {
	if token, err := grpcauth.AuthFromMD(ctx, "bearer"); err == nil {
		if p := a.byToken[sha256.Sum256([]byte(token))]; p != nil {
			return p, nil
		}
		return nil, ErrBadCredentials
	}
	pr, ok := peer.FromContext(ctx)
	if !ok {
		return nil, ErrNoCredentials
	}
	info, ok := pr.AuthInfo.(credentials.TLSInfo)
	if !ok || len(info.State.VerifiedChains) == 0 || len(info.State.VerifiedChains[0]) == 0 {
		return nil, ErrNoCredentials
	}
	for _, id := range identities(info.State.VerifiedChains[0][0]) {
		if p := a.byIdentity[id]; p != nil {
			return p, nil
		}
	}
	return nil, ErrBadCredentials
}

// identities are the names a certificate vouches for: its URI and DNS names.
func identities(cert *x509.Certificate) []string {
	var out []string
	for _, u := range cert.URIs {
		out = append(out, u.String())
	}
	return append(out, cert.DNSNames...)
}

// NewToken returns a new random bearer token and the hash to configure for it.
func NewToken() (token, sha256Hex string) {
	b := make([]byte, 32)
	_, _ = rand.Read(b) // never fails (crypto/rand)
	token = "opb_" + base64.RawURLEncoding.EncodeToString(b)
	sum := sha256.Sum256([]byte(token))
	return token, hex.EncodeToString(sum[:])
}

type principalKey struct{}

// WithPrincipal returns ctx carrying the principal.
func WithPrincipal(ctx context.Context, p *Principal) context.Context {
	return context.WithValue(ctx, principalKey{}, p)
}

// FromContext returns the principal of ctx, or nil.
func FromContext(ctx context.Context) *Principal {
	p, _ := ctx.Value(principalKey{}).(*Principal)
	return p
}
