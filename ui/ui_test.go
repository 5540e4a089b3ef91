package ui_test

import (
	"bufio"
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/metric/noop"

	"github.com/opbroker/opbroker/auth"
	"github.com/opbroker/opbroker/auth/authtest"
	"github.com/opbroker/opbroker/logtest"
	"github.com/opbroker/opbroker/server"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/storetest"
	"github.com/opbroker/opbroker/target"
	"github.com/opbroker/opbroker/ui"
	"github.com/opbroker/opbroker/watch"
)

// fixture is the support view over a broker's services, its ledger and its log.
type fixture struct {
	url    string
	store  *store.Store
	pool   *pgxpool.Pool
	logs   *logtest.Buffer
	tokens map[string]string
}

// The principals of the view's tests.
var principals = []auth.PrincipalConfig{
	{Name: "acme-support", Roles: []auth.Role{auth.RoleSupportRead}, Tenants: []string{"acme"}},
	{Name: "all-operator", Roles: []auth.Role{auth.RoleOperator}, AllTenants: true},
	{Name: "acme-client", Roles: []auth.Role{auth.RoleClient}, Tenants: []string{"acme"}},
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	st, pool := storetest.NewStore(t)
	logs := &logtest.Buffer{}
	log := slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	authn, tokens := authtest.Principals(t, principals...)
	contracts := simtarget.DemoContracts("http://127.0.0.1:1")
	for _, c := range contracts {
		c.DisplayName = "the payment provider"
	}
	targets, err := target.New(contracts...)
	require.NoError(t, err)
	hub := watch.New(st, log, 50*time.Millisecond)
	require.NoError(t, hub.Start(context.Background()))
	t.Cleanup(hub.Stop)
	srv, err := server.New(server.Options{Store: st, Targets: targets, Logger: log, MeterProvider: noop.NewMeterProvider(),
		Hub: hub, WatchHeartbeat: 200 * time.Millisecond, Auth: authn, Limits: server.Limits{WatchesPerPrincipal: 2}})
	require.NoError(t, err)
	t.Cleanup(func() { srv.Stop(time.Second) })
	view, err := ui.New(ui.Config{Local: srv.Local, Targets: targets, Logger: log})
	require.NoError(t, err)
	web := httptest.NewServer(view)
	t.Cleanup(web.Close)
	return &fixture{url: web.URL, store: st, pool: pool, logs: logs, tokens: tokens}
}

// browser is an HTTP client with a cookie jar that does not follow redirects.
func (f *fixture) browser(t *testing.T) *http.Client {
	t.Helper()
	jar, err := cookiejar.New(nil)
	require.NoError(t, err)
	return &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
}

// signIn signs c in as name and returns the answer's status.
func (f *fixture) signIn(t *testing.T, c *http.Client, name string) int {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, f.url+"/signin", strings.NewReader(url.Values{"token": {f.tokens[name]}}.Encode()))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	resp, err := c.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	return resp.StatusCode
}

func get(t *testing.T, c *http.Client, u string) (int, string) {
	t.Helper()
	resp, err := c.Get(u)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(body)
}

// TestSignInAndAdmission: only a support-read or operator token signs in; the session
// cookie is Secure, HttpOnly and SameSite=Strict; pages of another tenant are refused,
// every write is refused, and no page, URL or log line carries a payload or a token.
func TestSignInAndAdmission(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	acme := storetest.PrepareJSON(t, f.store, "acme", "demo.charge", "order-1", `{"amount":"secret-amount","card":"secret-pan","secret-field":1}`)
	globex := storetest.PrepareJSON(t, f.store, "globex", "demo.charge", "order-1", `{"amount":1}`)
	acmePage := "/tenants/acme/operations/" + acme.ID.String()

	anon := f.browser(t)
	code, _ := get(t, anon, f.url+acmePage)
	require.Equal(t, http.StatusSeeOther, code, "without a session, a page sends to sign-in")

	require.Equal(t, http.StatusForbidden, f.signIn(t, f.browser(t), "acme-client"), "a client token is not for the view")
	f.tokens["forged"] = "opb_forged"
	require.Equal(t, http.StatusUnauthorized, f.signIn(t, f.browser(t), "forged"))

	c := f.browser(t)
	req, _ := http.NewRequest(http.MethodPost, f.url+"/signin", strings.NewReader("token="+url.QueryEscape(f.tokens["acme-support"])))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	resp, err := c.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusSeeOther, resp.StatusCode)
	cookie := resp.Cookies()[0]
	require.Equal(t, ui.CookieName, cookie.Name)
	require.True(t, cookie.Secure && cookie.HttpOnly && cookie.SameSite == http.SameSiteStrictMode, "%+v", cookie)
	require.Equal(t, int(ui.DefaultSessionLifetime.Seconds()), cookie.MaxAge, "a session ends")
	require.NotContains(t, cookie.Value, strings.TrimPrefix(f.tokens["acme-support"], "opb_"), "the cookie is sealed")
	raw := f.browser(t)
	raw.Jar.SetCookies(resp.Request.URL, []*http.Cookie{{Name: ui.CookieName, Value: f.tokens["acme-support"], Path: "/"}})
	code, _ = get(t, raw, f.url+"/")
	require.Equal(t, http.StatusSeeOther, code, "a token is not a session")
	require.Contains(t, resp.Header.Get("Content-Security-Policy"), "script-src 'self'")

	var pages []string // every page the session saw
	var body string
	code, body = get(t, c, f.url+acmePage)
	pages = append(pages, body)
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, "Received: not sent yet")
	require.Contains(t, body, "order-1")

	code, body = get(t, c, f.url+"/tenants/globex/operations/"+globex.ID.String())
	require.Equal(t, http.StatusForbidden, code, "another tenant's operation")
	require.NotContains(t, body, globex.ID.String())
	code, _ = get(t, c, f.url+"/tenants/globex/operations")
	require.Equal(t, http.StatusForbidden, code)
	code, _ = get(t, c, f.url+"/search?tenant=globex&q=order-1")
	require.Equal(t, http.StatusForbidden, code)

	code, body = get(t, c, f.url+"/search?tenant=acme&q=order-1")
	pages = append(pages, body)
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, acmePage)
	code, _ = get(t, c, f.url+"/search?tenant=acme&q=tenants/acme/operations/"+acme.ID.String())
	require.Equal(t, http.StatusSeeOther, code, "an operation's name goes to its page")
	code, _ = get(t, c, f.url+"/tenants/acme/operations/"+uuid.NewString())
	require.Equal(t, http.StatusNotFound, code)

	// Writes: no method but GET on a page, and a cross-site POST is refused even to
	// sign out.
	for _, method := range []string{http.MethodPost, http.MethodPut, http.MethodDelete, http.MethodPatch} {
		req, _ := http.NewRequest(method, f.url+acmePage, nil)
		resp, err := c.Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusMethodNotAllowed, resp.StatusCode, method)
	}
	req, _ = http.NewRequest(http.MethodPost, f.url+"/signout", nil)
	req.Header.Set("Sec-Fetch-Site", "cross-site")
	resp, err = c.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusForbidden, resp.StatusCode, "cross-origin protection")
	op, err := f.store.AllTenants().Get(context.Background(), "acme", acme.ID)
	require.NoError(t, err)
	require.Equal(t, store.StatePrepared, op.State, "nothing changed")

	code, body = get(t, c, f.url+"/tenants/acme/operations")
	require.Equal(t, http.StatusOK, code)
	pages = append(pages, body)
	remoteKey := storetest.RemoteKey(t, f.pool, acme.ID)
	for _, secret := range []string{"secret-pan", "secret-amount", "secret-field", remoteKey, f.tokens["acme-support"], strings.TrimPrefix(f.tokens["acme-support"], "opb_")} {
		require.NotContains(t, strings.Join(pages, ""), secret)
		require.NotContains(t, f.logs.String(), secret, "the log never holds a payload or a token")
	}
}

// TestLiveAndQueue: an operation's live stream says when it changed and ends once it is
// finished; a closed stream gives its watch back (the principal may hold two here);
// the provider's reference finds the operation; an operator of every tenant sees every
// tenant's escalations.
func TestLiveAndQueue(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	op := storetest.PrepareJSON(t, f.store, "acme", "demo.charge", "order-live", `{"amount":1}`)
	storetest.ToUnknown(t, f.store, op)
	c := f.browser(t)
	require.Equal(t, http.StatusSeeOther, f.signIn(t, c, "acme-support"))
	live := f.url + "/tenants/acme/operations/" + op.ID.String() + "/live"

	for range 4 { // more than the principal's two watches, one after another
		openLive(t, c, live).Close()
	}

	events := bufio.NewScanner(openLive(t, c, live))
	next := func() string {
		t.Helper()
		for events.Scan() {
			if name, ok := strings.CutPrefix(events.Text(), "event: "); ok && name != "heartbeat" {
				return name
			}
		}
		return "closed"
	}
	require.Equal(t, "snapshot", next())
	storetest.ResolveUnknown(t, f.store, op, store.ResolveParams{State: store.StateSucceeded, RemoteRef: "ch_live",
		Observation: store.Observation{Source: "LOOKUP", Outcome: "FOUND"}, Actor: "test"})
	require.Equal(t, "change", next())
	require.Equal(t, "end", next(), "a finished operation's stream ends")

	code, body := get(t, c, f.url+"/search?tenant=acme&q=ch_live")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, "/tenants/acme/operations/"+op.ID.String())
	require.Contains(t, body, "Confirmed by the payment provider")

	escalated := storetest.PrepareJSON(t, f.store, "globex", "demo.charge", "order-stuck", `{"amount":1}`)
	escalate(t, f, escalated)
	code, body = get(t, c, f.url+"/escalations")
	require.Equal(t, http.StatusOK, code)
	require.NotContains(t, body, "order-stuck", "acme's queue")
	operator := f.browser(t)
	require.Equal(t, http.StatusSeeOther, f.signIn(t, operator, "all-operator"))
	code, body = get(t, operator, f.url+"/escalations")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, "order-stuck")
	require.Contains(t, body, "<td>globex</td>")
	code, _ = get(t, operator, f.url+"/search?tenant=globex&q=")
	require.Equal(t, http.StatusSeeOther, code, "an empty reference lists the tenant's operations")
}

// liveStream is an open live stream: its events after the first line, and its body to
// close it.
type liveStream struct {
	*bufio.Reader
	io.Closer
}

// openLive opens an operation's live stream, closed at the test's end if not before. A
// closed stream's watch comes back once the server has seen the close, which may be a
// moment after the next request arrives: it asks again while the stream is turned away
// for a while (a busy event), up to 5 seconds.
func openLive(t *testing.T, c *http.Client, live string) liveStream {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; {
		resp, err := c.Get(live)
		require.NoError(t, err)
		t.Cleanup(func() { resp.Body.Close() })
		require.Equal(t, http.StatusOK, resp.StatusCode)
		require.Equal(t, "text/event-stream", resp.Header.Get("Content-Type"))
		events := bufio.NewReader(resp.Body)
		first, err := events.ReadString('\n')
		require.NoError(t, err)
		if first == "retry: 3000\n" {
			return liveStream{events, resp.Body}
		}
		resp.Body.Close()
		require.Equal(t, "retry: 1000\n", first, "a stream turned away for a while")
		require.True(t, time.Now().Before(deadline), "the earlier streams' watches came back")
		time.Sleep(20 * time.Millisecond)
	}
}

// TestALiveStreamRefusedForAWhileIsAskedForAgain: a live stream over the principal's
// watch limit ends at once with a busy event and a retry, both naming the wait, rather
// than a refusal (which a browser's EventSource takes as final); once a watch is given
// back, the stream opens. A stream of an operation that does not exist is refused.
func TestALiveStreamRefusedForAWhileIsAskedForAgain(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	op := storetest.PrepareJSON(t, f.store, "acme", "demo.charge", "order-busy", `{"amount":1}`)
	c := f.browser(t)
	require.Equal(t, http.StatusSeeOther, f.signIn(t, c, "acme-support"))
	live := f.url + "/tenants/acme/operations/" + op.ID.String() + "/live"

	held := openLive(t, c, live) // the principal's two watches
	other := openLive(t, c, live)
	resp, err := c.Get(live)
	require.NoError(t, err)
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, "text/event-stream", resp.Header.Get("Content-Type"))
	require.Equal(t, "retry: 1000\nevent: busy\ndata: 1000\n\n", string(body), "the stream ends at once")

	held.Close()
	openLive(t, c, live).Close()
	other.Close()

	// The watches just closed come back once the server has seen the closes (openLive):
	// until then any stream of the principal's is busy.
	missing := f.url + "/tenants/acme/operations/" + uuid.NewString() + "/live"
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		code, body := get(t, c, missing)
		if code == http.StatusOK && strings.HasSuffix(body, "event: busy\ndata: 1000\n\n") && time.Now().Before(deadline) {
			continue
		}
		require.Equal(t, http.StatusNotFound, code, "a refusal that lasts is an HTTP error, which the page takes as final")
		break
	}
}

// escalate takes the only PREPARED operation of its type through an unclear send to
// ESCALATED, owned by the demo targets' team, as the dispatcher and reconciler would.
func escalate(t *testing.T, f *fixture, op store.Operation) {
	t.Helper()
	storetest.ToUnknown(t, f.store, op)
	storetest.ResolveUnknown(t, f.store, op, store.ResolveParams{State: store.StateEscalated,
		Observation: store.Observation{Source: "BROKER", Outcome: "ESCALATED", Summary: "no evidence"},
		Escalation:  &store.Escalation{Owner: "demo-oncall (README.md#operations)", Reason: "no evidence", EscalatedAt: time.Now()}, Actor: "test"})
}
