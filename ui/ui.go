// Package ui is the support view: read-only web pages, in plain language, about
// operations, for support staff and operators. Every page is built from the broker's
// own RPCs, called through server.Local as the signed-in principal, so every page is
// admitted exactly as a gRPC call is: tenant-scoped, and only what the principal's
// roles may read. The pages never show payload bytes, remote keys or tokens, and no
// URL carries them.
package ui

import (
	"context"
	"embed"
	"errors"
	"html/template"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/opbroker/opbroker/auth"
	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/server"
	"github.com/opbroker/opbroker/target"
)

//go:embed templates static
var assets embed.FS

// CookieName is the session cookie: the sealed session (session.go), Secure, HttpOnly
// and SameSite=Strict. The __Host- prefix makes browsers refuse it unless it is Secure,
// for the whole host, and set by the host itself.
const CookieName = "__Host-opbroker-session"

// Config configures the view.
type Config struct {
	// Local is the broker's services in this process.
	Local *server.Local
	// Targets name the providers and owners in words.
	Targets *target.Targets
	Logger  *slog.Logger
	// SessionKey seals sessions; every replica given the same key accepts the others'
	// sessions. Empty: a random key, so a session works on this process only.
	SessionKey []byte
	// SessionLifetime is how long a sign-in lasts; 0 means DefaultSessionLifetime.
	SessionLifetime time.Duration
	// Now is the clock; nil means time.Now.
	Now func() time.Time
}

// view serves the pages.
type view struct {
	cfg      Config
	sessions *sealer
	ops      opbrokerv1.OperationServiceClient
	admin    opbrokerv1.AdminServiceClient
	pages    map[string]*template.Template
}

// New returns the view's handler.
func New(cfg Config) (http.Handler, error) {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.SessionLifetime <= 0 {
		cfg.SessionLifetime = DefaultSessionLifetime
	}
	sessions, err := newSealer(cfg.SessionKey)
	if err != nil {
		return nil, err
	}
	conn := readOnly{cfg.Local}
	v := &view{cfg: cfg, sessions: sessions, ops: opbrokerv1.NewOperationServiceClient(conn), admin: opbrokerv1.NewAdminServiceClient(conn),
		pages: map[string]*template.Template{}}
	for _, page := range []string{"signin", "home", "list", "operation", "escalations", "error"} {
		t, err := template.New("layout.html").Funcs(template.FuncMap{"when": when, "waited": waited}).
			ParseFS(assets, "templates/layout.html", "templates/"+page+".html")
		if err != nil {
			return nil, err
		}
		v.pages[page] = t
	}
	static, err := fs.Sub(assets, "static")
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("GET /static/", http.StripPrefix("/static/", http.FileServerFS(static)))
	mux.HandleFunc("GET /signin", v.signinPage)
	mux.HandleFunc("POST /signin", v.signin)
	mux.HandleFunc("POST /signout", v.signout)
	mux.HandleFunc("GET /{$}", v.signedIn(v.home))
	mux.HandleFunc("GET /search", v.signedIn(v.search))
	mux.HandleFunc("GET /tenants/{tenant}/operations", v.signedIn(v.list))
	mux.HandleFunc("GET /tenants/{tenant}/operations/{id}", v.signedIn(v.operation))
	mux.HandleFunc("GET /tenants/{tenant}/operations/{id}/live", v.signedIn(v.live))
	mux.HandleFunc("GET /escalations", v.signedIn(v.escalations))
	// Cross-origin POSTs (sign-in and sign-out are the only ones) are refused; there is
	// nothing else to write.
	return secureHeaders(http.NewCrossOriginProtection().Handler(mux)), nil
}

// readOnly lets the view call only the reads it needs, whatever the principal's roles:
// an operator's session in the view cannot resolve or delete anything.
type readOnly struct{ *server.Local }

var readMethods = map[string]bool{
	opbrokerv1.OperationService_GetOperation_FullMethodName:        true,
	opbrokerv1.OperationService_ListOperations_FullMethodName:      true,
	opbrokerv1.OperationService_ListOperationEvents_FullMethodName: true,
	opbrokerv1.OperationService_WatchOperation_FullMethodName:      true,
	opbrokerv1.AdminService_ListEscalations_FullMethodName:         true,
}

func (c readOnly) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	if !readMethods[method] {
		return status.Errorf(codes.PermissionDenied, "the support view does not call %s", method)
	}
	return c.Local.Invoke(ctx, method, args, reply, opts...)
}

func (c readOnly) NewStream(ctx context.Context, desc *grpc.StreamDesc, method string, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	if !readMethods[method] {
		return nil, status.Errorf(codes.PermissionDenied, "the support view does not call %s", method)
	}
	return c.Local.NewStream(ctx, desc, method, opts...)
}

// secureHeaders sets what every answer carries: a content security policy that allows
// only the view's own script and style, no framing, no referrer, and no caching. No
// Strict-Transport-Security: it would hold for every port of the host, the plain-HTTP
// metrics port included; the proxy that gives the view its own host name may set it.
func secureHeaders(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Content-Security-Policy", "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "+
			"connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("Referrer-Policy", "no-referrer")
		h.Set("Cache-Control", "no-store")
		next.ServeHTTP(w, r)
	})
}

// session is the signed-in principal of a request, and the context its calls carry.
type session struct {
	principal *auth.Principal
	ctx       context.Context
}

// signedIn runs h for a request with a valid session of a support-read or operator
// principal, and sends others to sign in. The calls the page makes carry the browser's
// address as their peer, for the log lines of refusals.
func (v *view) signedIn(h func(http.ResponseWriter, *http.Request, session)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		var token string
		c, err := r.Cookie(CookieName)
		if err == nil {
			token, err = v.sessions.open(c.Value, v.cfg.Now())
		}
		ctx := withPeer(r)
		var p *auth.Principal
		if err == nil {
			p, err = v.cfg.Local.Principal(ctx, token)
		}
		if err != nil || !p.Has(auth.RoleSupportRead, auth.RoleOperator) {
			clearSession(w)
			http.Redirect(w, r, "/signin", http.StatusSeeOther)
			return
		}
		h(w, r, session{principal: p, ctx: metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)})
	}
}

// withPeer is the request's context carrying the browser's address as the gRPC peer,
// for the log lines of the calls made for it.
func withPeer(r *http.Request) context.Context {
	if addr, err := netip.ParseAddrPort(r.RemoteAddr); err == nil {
		return peer.NewContext(r.Context(), &peer.Peer{Addr: net.TCPAddrFromAddrPort(addr)})
	}
	return r.Context()
}

func (v *view) signinPage(w http.ResponseWriter, r *http.Request) {
	v.render(w, r, http.StatusOK, "signin", nil, map[string]any{})
}

func (v *view) signin(w http.ResponseWriter, r *http.Request) {
	token := strings.TrimSpace(r.PostFormValue("token"))
	p, err := v.cfg.Local.Principal(withPeer(r), token)
	if token == "" || err != nil {
		v.render(w, r, http.StatusUnauthorized, "signin", nil, map[string]any{"Error": "That token is not known. Paste the token you were given for the support view."})
		return
	}
	if !p.Has(auth.RoleSupportRead, auth.RoleOperator) {
		v.render(w, r, http.StatusForbidden, "signin", nil, map[string]any{"Error": "That token is not for the support view: it needs the support-read or operator role."})
		return
	}
	sealed, err := v.sessions.seal(token, v.cfg.Now().Add(v.cfg.SessionLifetime))
	if err != nil {
		v.render(w, r, http.StatusInternalServerError, "signin", nil, map[string]any{"Error": "Signing in failed; try again."})
		return
	}
	v.cfg.Logger.InfoContext(r.Context(), "support view: signed in", "principal", p.Name, "peer", r.RemoteAddr)
	http.SetCookie(w, &http.Cookie{Name: CookieName, Value: sealed, Path: "/", MaxAge: int(v.cfg.SessionLifetime.Seconds()),
		Secure: true, HttpOnly: true, SameSite: http.SameSiteStrictMode})
	http.Redirect(w, r, "/", http.StatusSeeOther)
}

func (v *view) signout(w http.ResponseWriter, r *http.Request) {
	clearSession(w)
	http.Redirect(w, r, "/signin", http.StatusSeeOther)
}

func clearSession(w http.ResponseWriter) {
	http.SetCookie(w, &http.Cookie{Name: CookieName, Value: "", Path: "/", MaxAge: -1, Secure: true, HttpOnly: true, SameSite: http.SameSiteStrictMode})
}

func (v *view) home(w http.ResponseWriter, r *http.Request, s session) {
	v.render(w, r, http.StatusOK, "home", &s, map[string]any{"Tenants": s.principal.Tenants, "AllTenants": s.principal.AllTenants})
}

// search finds operations by what a customer or colleague may quote: an operation's
// name or id, an intent reference, or the provider's reference.
func (v *view) search(w http.ResponseWriter, r *http.Request, s session) {
	tenant, q := strings.TrimSpace(r.FormValue("tenant")), strings.TrimSpace(r.FormValue("q"))
	if t, id, ok := operationName(q); ok {
		http.Redirect(w, r, "/tenants/"+url.PathEscape(t)+"/operations/"+id.String(), http.StatusSeeOther)
		return
	}
	if q == "" && tenant != "" {
		http.Redirect(w, r, "/tenants/"+url.PathEscape(tenant)+"/operations", http.StatusSeeOther)
		return
	}
	if id, err := uuid.Parse(q); err == nil && tenant != "" {
		http.Redirect(w, r, "/tenants/"+url.PathEscape(tenant)+"/operations/"+id.String(), http.StatusSeeOther)
		return
	}
	var found []*opbrokerv1.Operation
	more := false
	seen := map[string]bool{}
	for _, req := range []*opbrokerv1.ListOperationsRequest{{Tenant: tenant, IntentRef: q}, {Tenant: tenant, RemoteRef: q}} {
		resp, err := v.ops.ListOperations(s.ctx, req)
		if err != nil {
			v.fail(w, r, &s, err)
			return
		}
		more = more || resp.GetNextPageToken() != ""
		for _, op := range resp.GetOperations() {
			if !seen[op.GetName()] {
				seen[op.GetName()] = true
				found = append(found, op)
			}
		}
	}
	v.render(w, r, http.StatusOK, "list", &s, map[string]any{"Title": "Search results", "Tenant": tenant, "Query": q,
		"Rows": v.rows(found), "More": more})
}

// operationName splits tenants/{tenant}/operations/{id}.
func operationName(q string) (tenant string, id uuid.UUID, ok bool) {
	parts := strings.Split(q, "/")
	if len(parts) != 4 || parts[0] != "tenants" || parts[2] != "operations" {
		return "", uuid.UUID{}, false
	}
	id, err := uuid.Parse(parts[3])
	return parts[1], id, err == nil
}

// states are the filters of a tenant's list, in words.
var states = []struct{ Value, Label string }{
	{"", "All"}, {"STATE_UNKNOWN", "Confirmation pending"}, {"STATE_ESCALATED", "Needs attention"},
	{"STATE_SUCCEEDED", "Confirmed"}, {"STATE_FAILED_TERMINAL", "Not done"}, {"STATE_PREPARED", "Not sent yet"},
	{"STATE_IN_FLIGHT", "Being sent"}, {"STATE_CANCELLED", "Cancelled"},
}

func (v *view) list(w http.ResponseWriter, r *http.Request, s session) {
	tenant, state := r.PathValue("tenant"), r.FormValue("state")
	req := &opbrokerv1.ListOperationsRequest{Tenant: tenant, PageSize: 50, PageToken: r.FormValue("page")}
	if state != "" {
		st, ok := opbrokerv1.Operation_State_value[state]
		if !ok {
			v.fail(w, r, &s, status.Error(codes.InvalidArgument, "there is no such state to filter by"))
			return
		}
		req.States = []opbrokerv1.Operation_State{opbrokerv1.Operation_State(st)}
	}
	resp, err := v.ops.ListOperations(s.ctx, req)
	if err != nil {
		v.fail(w, r, &s, err)
		return
	}
	v.render(w, r, http.StatusOK, "list", &s, map[string]any{"Title": "Recent operations of " + tenant, "Tenant": tenant,
		"States": states, "State": state, "Rows": v.rows(resp.GetOperations()), "Next": resp.GetNextPageToken()})
}

// row is an operation in a list.
type row struct {
	Link, Type, Intent string
	Status             Status
	Updated            time.Time
}

func (v *view) rows(ops []*opbrokerv1.Operation) []row {
	out := make([]row, len(ops))
	for i, op := range ops {
		out[i] = v.row(op)
	}
	return out
}

func (v *view) row(op *opbrokerv1.Operation) row {
	return row{Link: "/" + op.GetName(), Type: op.GetOperationType(), Intent: op.GetIntentRef(),
		Status: describe(op, v.provider(op.GetOperationType()), v.cfg.Now()), Updated: op.GetUpdateTime().AsTime()}
}

// provider is how support staff call the target of an operation type.
func (v *view) provider(operationType string) string {
	if c, ok := v.cfg.Targets.ForType(operationType); ok && c.DisplayName != "" {
		return c.DisplayName
	}
	return "the provider"
}

func (v *view) operation(w http.ResponseWriter, r *http.Request, s session) {
	name := "tenants/" + r.PathValue("tenant") + "/operations/" + r.PathValue("id")
	resp, err := v.ops.GetOperation(s.ctx, &opbrokerv1.GetOperationRequest{Name: name})
	if err != nil {
		v.fail(w, r, &s, err)
		return
	}
	op := resp.GetOperation()
	provider := v.provider(op.GetOperationType())
	type step struct {
		At   time.Time
		Line string
	}
	var history []step
	for after := int64(0); ; {
		page, err := v.ops.ListOperationEvents(s.ctx, &opbrokerv1.ListOperationEventsRequest{Name: name, StartAfterRevision: after, PageSize: 200})
		if err != nil {
			v.fail(w, r, &s, err)
			return
		}
		for _, e := range page.GetEvents() {
			history = append(history, step{At: e.GetCreateTime().AsTime(), Line: eventLine(e, provider)})
			after = e.GetRevision()
		}
		if !page.GetMore() || len(page.GetEvents()) == 0 {
			break
		}
	}
	live := ""
	if !terminal(op.GetState()) {
		live = "/" + name + "/live"
	}
	v.render(w, r, http.StatusOK, "operation", &s, map[string]any{"Op": op, "Status": describe(op, provider, v.cfg.Now()),
		"History": history, "Live": live, "Revision": op.GetRevision()})
}

func terminal(s opbrokerv1.Operation_State) bool {
	return s == opbrokerv1.Operation_STATE_SUCCEEDED || s == opbrokerv1.Operation_STATE_FAILED_TERMINAL ||
		s == opbrokerv1.Operation_STATE_CANCELLED
}

// retryLater reports whether err turns a live stream away for a while, and how long the
// browser should wait before it asks again (the page's script waits longer after each
// further refusal in a row): the principal's watches at their limit (a reloaded
// page's new stream can arrive before the broker has seen the old one close) or the
// tenant's call rate, after a second (or the longer delay the refusal names); the
// ledger's database unavailable, after 3 seconds, as after a broken stream.
func retryLater(err error) (time.Duration, bool) {
	st := status.Convert(err)
	var after time.Duration
	switch st.Code() {
	case codes.ResourceExhausted:
		after = time.Second
	case codes.Unavailable:
		after = 3 * time.Second
	default:
		return 0, false
	}
	for _, d := range st.Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok {
			after = max(after, ri.GetRetryDelay().AsDuration())
		}
	}
	return after, true
}

// live streams, as server-sent events, that an operation changed (its revision), from
// the broker's watch; the page's script then fetches the page again. It ends when the
// operation is terminal, or at once with a busy event when the broker turns it away for
// a while (retryLater).
func (v *view) live(w http.ResponseWriter, r *http.Request, s session) {
	name := "tenants/" + r.PathValue("tenant") + "/operations/" + r.PathValue("id")
	ctx, cancel := context.WithCancel(s.ctx)
	defer cancel()
	stream, err := v.ops.WatchOperation(ctx, &opbrokerv1.WatchOperationRequest{Name: name})
	var first *opbrokerv1.WatchOperationResponse
	if err == nil {
		first, err = stream.Recv() // the snapshot, or the refusal
	}
	if after, ok := retryLater(err); ok {
		// A refusal that passes ends the stream at once with a busy event, where an HTTP
		// error would make the browser give up. The event carries the wait: the page's
		// script closes the stream and asks again after it, longer after each further
		// refusal in a row. The same wait as retry makes a bare EventSource connect
		// again after it too, as after a broken stream.
		ms := strconv.FormatInt(after.Milliseconds(), 10)
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = w.Write([]byte("retry: " + ms + "\nevent: busy\ndata: " + ms + "\n\n"))
		return
	}
	if err != nil {
		v.fail(w, r, &s, err)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("X-Accel-Buffering", "no") // a proxy in front must not hold the events back
	rc := http.NewResponseController(w)
	send := func(event string, revision int64) error {
		if _, err := w.Write([]byte("event: " + event + "\ndata: " + strconv.FormatInt(revision, 10) + "\n\n")); err != nil {
			return err
		}
		return rc.Flush()
	}
	// After a broken stream (a replica shutting down, a database error) the browser
	// connects again after retry milliseconds and starts with a new snapshot.
	if _, err := w.Write([]byte("retry: 3000\n")); err != nil {
		return
	}
	if err := send("snapshot", first.GetSnapshot().GetRevision()); err != nil {
		return
	}
	for {
		msg, err := stream.Recv()
		if errors.Is(err, io.EOF) { // the operation is finished: the page is final
			_ = send("end", 0)
			return
		}
		if err != nil {
			return
		}
		var ev string
		var rev int64
		switch {
		case msg.GetChange() != nil:
			ev, rev = "change", msg.GetChange().GetRevision()
		case msg.GetHeartbeat() != nil:
			ev, rev = "heartbeat", msg.GetHeartbeat().GetRevision()
		default:
			continue
		}
		if send(ev, rev) != nil {
			return
		}
	}
}

func (v *view) escalations(w http.ResponseWriter, r *http.Request, s session) {
	tenant := r.FormValue("tenant")
	if tenant == "" && !s.principal.AllTenants && len(s.principal.Tenants) > 0 {
		tenant = s.principal.Tenants[0] // without all tenants, the queue is one tenant's
	}
	resp, err := v.admin.ListEscalations(s.ctx, &opbrokerv1.ListEscalationsRequest{Tenant: tenant, PageSize: 100,
		PageToken: r.FormValue("page")})
	if err != nil {
		v.fail(w, r, &s, err)
		return
	}
	type escalation struct {
		Op                    row
		Tenant, Owner, Reason string
		Age                   time.Duration
	}
	var out []escalation
	for _, e := range resp.GetEscalations() {
		op := e.GetOperation()
		out = append(out, escalation{Op: v.row(op), Tenant: op.GetTenant(), Owner: op.GetEscalation().GetOwner(),
			Reason: op.GetEscalation().GetReason(), Age: time.Duration(e.GetAgeSeconds()) * time.Second})
	}
	v.render(w, r, http.StatusOK, "escalations", &s, map[string]any{"Tenant": tenant, "Tenants": s.principal.Tenants, "Escalations": out,
		"Next": resp.GetNextPageToken()})
}

// fail answers a refused or failed call with a page that says what happened in words,
// and the HTTP status that matches the gRPC one.
func (v *view) fail(w http.ResponseWriter, r *http.Request, s *session, err error) {
	st := status.Convert(err)
	code, msg := http.StatusServiceUnavailable, "The broker could not answer just now. Try again in a moment."
	switch st.Code() {
	case codes.Unauthenticated:
		clearSession(w)
		http.Redirect(w, r, "/signin", http.StatusSeeOther)
		return
	case codes.PermissionDenied:
		code, msg = http.StatusForbidden, "You may not see this. Your sign-in covers other tenants or other pages."
	case codes.NotFound:
		code, msg = http.StatusNotFound, "There is no such operation for this tenant."
	case codes.InvalidArgument:
		code, msg = http.StatusBadRequest, "That search or address is not valid: "+st.Message()
	case codes.ResourceExhausted:
		code, msg = http.StatusTooManyRequests, "Too many requests for this tenant just now. Try again in a moment."
	}
	v.render(w, r, code, "error", s, map[string]any{"Message": msg})
}

func (v *view) render(w http.ResponseWriter, r *http.Request, code int, page string, s *session, data map[string]any) {
	if s != nil {
		data["Principal"] = s.principal.Name
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(code)
	if err := v.pages[page].Execute(w, data); err != nil {
		v.cfg.Logger.ErrorContext(r.Context(), "support view: rendering failed", "page", page, "error", err)
	}
}
