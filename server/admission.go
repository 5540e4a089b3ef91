package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"buf.build/go/protovalidate"
	"golang.org/x/time/rate"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/peer"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/opbroker/opbroker/auth"
	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/store"
)

// methodRoles is the roles each RPC needs; a method not listed here is refused to
// everyone. Health and reflection need no credentials (public).
var methodRoles = map[string][]auth.Role{
	opbrokerv1.OperationService_PrepareOperation_FullMethodName:    {auth.RoleClient},
	opbrokerv1.OperationService_CancelOperation_FullMethodName:     {auth.RoleClient},
	opbrokerv1.OperationService_GetOperation_FullMethodName:        {auth.RoleClient, auth.RoleSupportRead, auth.RoleOperator},
	opbrokerv1.OperationService_ListOperations_FullMethodName:      {auth.RoleClient, auth.RoleSupportRead, auth.RoleOperator},
	opbrokerv1.OperationService_ListOperationEvents_FullMethodName: {auth.RoleClient, auth.RoleSupportRead, auth.RoleOperator},
	opbrokerv1.OperationService_WatchOperation_FullMethodName:      {auth.RoleClient, auth.RoleSupportRead, auth.RoleOperator},
	opbrokerv1.OperationService_WatchOperations_FullMethodName:     {auth.RoleClient, auth.RoleSupportRead, auth.RoleOperator},
	opbrokerv1.AdminService_DeleteTenantData_FullMethodName:        {auth.RoleOperator},
	opbrokerv1.AdminService_ResolveOperation_FullMethodName:        {auth.RoleOperator},
	opbrokerv1.AdminService_ApproveResolution_FullMethodName:       {auth.RoleOperator},
	opbrokerv1.AdminService_ListEscalations_FullMethodName:         {auth.RoleOperator, auth.RoleSupportRead},
	opbrokerv1.AdminService_GetStats_FullMethodName:                {auth.RoleOperator, auth.RoleSupportRead},
	opbrokerv1.AdminService_GetTargetReadiness_FullMethodName:      {auth.RoleOperator},
	opbrokerv1.AdminService_ListQuarantine_FullMethodName:          {auth.RoleOperator},
	opbrokerv1.AdminService_ReviewQuarantine_FullMethodName:        {auth.RoleOperator},
	opbrokerv1.EvidenceService_ReportEvidence_FullMethodName:       {auth.RoleEvidence},
}

// public reports whether a method needs no credentials: health checks and reflection.
func public(method string) bool {
	return strings.HasPrefix(method, "/"+healthpb.Health_ServiceDesc.ServiceName+"/") ||
		strings.HasPrefix(method, "/grpc.reflection.")
}

// devPrincipal is every caller when the server runs without an authenticator (dev).
var devPrincipal = &auth.Principal{Name: "dev", AllTenants: true,
	Roles: []auth.Role{auth.RoleClient, auth.RoleWorker, auth.RoleOperator, auth.RoleSupportRead, auth.RoleEvidence}}

// Limits bound what one principal or tenant may use.
type Limits struct {
	// WatchesPerPrincipal caps a principal's open watch streams; 0 means
	// DefaultWatchesPerPrincipal.
	WatchesPerPrincipal int
	// TenantRate is the calls per second a tenant may make (a token bucket with
	// TenantBurst); 0 means DefaultTenantRate with a burst of DefaultTenantBurst.
	TenantRate  float64
	TenantBurst int
}

// Defaults of Limits, which the broker's flags use too.
const (
	DefaultWatchesPerPrincipal = 100
	DefaultTenantRate          = 1000
	DefaultTenantBurst         = 2000
)

// admission decides whether a call may run: who calls (authentication), whether their
// role allows the method, whether the request is valid, whether they may act for its
// tenant (authorisation), and whether the tenant's rate and the principal's watches
// allow it. Every call passes through it, unary or streaming.
type admission struct {
	authn     *auth.Authenticator // nil: no credentials (dev)
	validator protovalidate.Validator
	log       *slog.Logger
	limits    Limits

	mu       sync.Mutex
	watches  map[string]int           // open watch streams by principal
	limiters map[string]*tenantBucket // by tenant
	swept    time.Time                // when idle buckets were last dropped
}

type tenantBucket struct {
	*rate.Limiter
	used time.Time
}

func newAdmission(authn *auth.Authenticator, v protovalidate.Validator, log *slog.Logger, limits Limits) *admission {
	if limits.WatchesPerPrincipal <= 0 {
		limits.WatchesPerPrincipal = DefaultWatchesPerPrincipal
	}
	if limits.TenantRate <= 0 {
		limits.TenantRate, limits.TenantBurst = DefaultTenantRate, DefaultTenantBurst
	}
	if limits.TenantBurst <= 0 {
		limits.TenantBurst = max(1, int(2*limits.TenantRate))
	}
	return &admission{authn: authn, validator: v, log: log, limits: limits,
		watches: map[string]int{}, limiters: map[string]*tenantBucket{}}
}

// authenticate puts the caller's principal in the context, or fails UNAUTHENTICATED.
// Public methods (health, reflection) pass without credentials.
func (a *admission) authenticate(ctx context.Context) (context.Context, error) {
	if method, _ := grpc.Method(ctx); public(method) {
		return ctx, nil
	}
	if a.authn == nil {
		return auth.WithPrincipal(ctx, devPrincipal), nil
	}
	p, err := a.authn.Authenticate(ctx)
	if err != nil {
		reason, msg := ReasonCredentialsInvalid, "the credentials are not known"
		if errors.Is(err, auth.ErrNoCredentials) {
			reason, msg = ReasonCredentialsMissing, "send a bearer token (authorization: Bearer …) or a client certificate"
		}
		a.log.WarnContext(ctx, "authentication failed", "reason", reason, "peer", peerAddr(ctx))
		return nil, newStatus(codes.Unauthenticated, msg, reason, nil)
	}
	return auth.WithPrincipal(ctx, p), nil
}

func peerAddr(ctx context.Context) string {
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
		return p.Addr.String()
	}
	return ""
}

// admit checks one request of method for the principal in ctx, and returns ctx carrying
// the request's tenant as admitted: handlers reach the ledger through ledger(ctx), in
// that tenant's scope, and see nothing else.
func (a *admission) admit(ctx context.Context, method string, req any) (context.Context, error) {
	if public(method) {
		return ctx, validateRequest(a.validator, req)
	}
	p := auth.FromContext(ctx)
	need := methodRoles[method]
	if p == nil || !p.Has(need...) {
		a.deny(ctx, p, method, ReasonRoleRequired)
		return ctx, newStatus(codes.PermissionDenied, fmt.Sprintf("this call needs one of the roles %v", need), ReasonRoleRequired,
			map[string]string{"roles": fmt.Sprint(need)})
	}
	if err := validateRequest(a.validator, req); err != nil {
		return ctx, err
	}
	if noTenant[method] {
		return context.WithValue(ctx, admittedKey{}, admitted{}), nil
	}
	if allTenantsOnly[method] {
		if !p.AllTenants {
			a.deny(ctx, p, method, ReasonTenantNotPermitted)
			return ctx, newStatus(codes.PermissionDenied, "this call spans every tenant: it needs a principal with all tenants",
				ReasonTenantNotPermitted, map[string]string{"tenant": ""})
		}
		return context.WithValue(ctx, admittedKey{}, admitted{all: true}), nil
	}
	tenant, err := requestTenant(req)
	if err != nil {
		return ctx, err
	}
	if tenant == "" && acrossTenants[method] {
		if !p.AllTenants {
			a.deny(ctx, p, method, ReasonTenantNotPermitted)
			return ctx, newStatus(codes.PermissionDenied, "without a tenant this call spans every tenant: it needs a principal with all tenants",
				ReasonTenantNotPermitted, map[string]string{"tenant": ""})
		}
		return context.WithValue(ctx, admittedKey{}, admitted{all: true}), nil
	}
	if !p.MayActFor(tenant) {
		a.deny(ctx, p, method, ReasonTenantNotPermitted)
		return ctx, newStatus(codes.PermissionDenied, "the caller may not act for this tenant", ReasonTenantNotPermitted,
			map[string]string{"tenant": tenant})
	}
	if !a.limiter(tenant).Allow() {
		return ctx, newStatus(codes.ResourceExhausted, "the tenant's call rate is over its limit; retry after the delay",
			ReasonTenantRateLimited, map[string]string{"tenant": tenant},
			&errdetails.RetryInfo{RetryDelay: durationpb.New(time.Duration(float64(time.Second) / a.limits.TenantRate))})
	}
	return context.WithValue(ctx, admittedKey{}, admitted{tenant: tenant}), nil
}

// acrossTenants are the methods whose tenant is a filter: without one they span every
// tenant, for a principal with all tenants. allTenantsOnly are those that always span
// every tenant (the quarantine holds events of no tenant yet, or of any). noTenant are
// those that read no tenant's data at all.
var (
	allTenantsOnly = map[string]bool{opbrokerv1.AdminService_ListQuarantine_FullMethodName: true,
		opbrokerv1.AdminService_ReviewQuarantine_FullMethodName: true}
	acrossTenants = map[string]bool{opbrokerv1.AdminService_ListEscalations_FullMethodName: true,
		opbrokerv1.AdminService_GetStats_FullMethodName: true}
	noTenant = map[string]bool{opbrokerv1.AdminService_GetTargetReadiness_FullMethodName: true}
)

type admittedKey struct{}

// admitted is the tenants admission admitted a call for: one, or, for a call across
// tenants by a principal with all tenants, all.
type admitted struct {
	tenant string
	all    bool
}

// ledger returns st in the scope that admission admitted for the call in ctx: one
// tenant's, or every tenant's for a call across tenants. A call that admission did not
// admit for a tenant gets a scope that reaches nothing (store.ErrNoScope).
func ledger(ctx context.Context, st *store.Store) store.Scope {
	a, _ := ctx.Value(admittedKey{}).(admitted)
	if a.all {
		return st.AllTenants()
	}
	return st.Tenant(a.tenant)
}

// deny logs an authorisation failure: a security event (who, what, never the request).
func (a *admission) deny(ctx context.Context, p *auth.Principal, method, reason string) {
	name := ""
	if p != nil {
		name = p.Name
	}
	a.log.WarnContext(ctx, "permission denied", "principal", name, "method", method, "reason", reason)
}

// requestTenant returns the tenant a (valid) request acts for.
func requestTenant(req any) (string, error) {
	switch r := req.(type) {
	case interface{ GetTenant() string }:
		return r.GetTenant(), nil
	case interface{ GetName() string }:
		tenant, _, err := parseOperationName("name", r.GetName())
		return tenant, err
	}
	return "", fmt.Errorf("server: no tenant in %T", req)
}

// limiter returns the tenant's token bucket. When many tenants are tracked, buckets
// unused for a minute are dropped, at most once a minute, so memory stays bounded
// without a scan on every call.
func (a *admission) limiter(tenant string) *rate.Limiter {
	a.mu.Lock()
	defer a.mu.Unlock()
	now := time.Now()
	if len(a.limiters) > 10_000 && now.Sub(a.swept) > time.Minute {
		a.swept = now
		for t, b := range a.limiters {
			if now.Sub(b.used) > time.Minute {
				delete(a.limiters, t)
			}
		}
	}
	b := a.limiters[tenant]
	if b == nil {
		b = &tenantBucket{Limiter: rate.NewLimiter(rate.Limit(a.limits.TenantRate), a.limits.TenantBurst)}
		a.limiters[tenant] = b
	}
	b.used = now
	return b.Limiter
}

// openWatch counts a watch stream of the principal, or refuses it over the limit; the
// returned function ends it.
func (a *admission) openWatch(p *auth.Principal) (func(), error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.watches[p.Name] >= a.limits.WatchesPerPrincipal {
		return nil, newStatus(codes.ResourceExhausted,
			fmt.Sprintf("this caller has %d watch streams open, the most allowed; close one first", a.watches[p.Name]),
			ReasonWatchLimit, map[string]string{"limit": fmt.Sprint(a.limits.WatchesPerPrincipal)})
	}
	a.watches[p.Name]++
	return func() {
		a.mu.Lock()
		defer a.mu.Unlock()
		if a.watches[p.Name]--; a.watches[p.Name] == 0 {
			delete(a.watches, p.Name)
		}
	}, nil
}

// The admission interceptors authenticate, then admit. Authentication is not a
// separate interceptor (go-grpc-middleware's auth, behind a selector for the public
// methods): every interceptor adds frames to each stream's goroutine for the stream's
// life, and an idle watch stream's stack must stay small enough for the collector to
// halve it (see follow).

func (a *admission) unaryInterceptor() grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		ctx, err := a.authenticate(ctx)
		if err != nil {
			return nil, err
		}
		if err := undecoded(req); err != nil {
			return nil, toStatus(ctx, a.log, err)
		}
		ctx, err = a.admit(ctx, info.FullMethod, req)
		if err != nil {
			return nil, toStatus(ctx, a.log, err)
		}
		return handler(ctx, req)
	}
}

func (a *admission) streamInterceptor() grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		ctx, err := a.authenticate(ss.Context())
		if err != nil {
			return err
		}
		if !public(info.FullMethod) && info.IsServerStream {
			if p := auth.FromContext(ctx); p != nil {
				done, err := a.openWatch(p)
				if err != nil {
					return err
				}
				defer done()
			}
		}
		return handler(srv, &admittedStream{ServerStream: ss, a: a, method: info.FullMethod, ctx: ctx})
	}
}

// admittedStream admits the request of a server stream when the handler receives it;
// from then on its context is limited to the request's tenant.
type admittedStream struct {
	grpc.ServerStream
	a      *admission
	method string
	ctx    context.Context
}

func (s *admittedStream) Context() context.Context { return s.ctx }

func (s *admittedStream) RecvMsg(m any) error {
	if err := s.ServerStream.RecvMsg(m); err != nil {
		return err
	}
	if err := undecoded(m); err != nil {
		return toStatus(s.ctx, s.a.log, err)
	}
	ctx, err := s.a.admit(s.ctx, s.method, m)
	if err != nil {
		return toStatus(s.ctx, s.a.log, err)
	}
	s.ctx = ctx
	return nil
}
