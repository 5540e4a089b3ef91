package ui_test

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/fetch"
	cdplog "github.com/chromedp/cdproto/log"
	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/cdproto/runtime"
	"github.com/chromedp/chromedp"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/logtest"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/storetest"
)

// EnvBrowser set to 1 makes the browser test fail, instead of skipping, when no
// Chromium is installed (CI installs Debian's chromium). EnvScreenshot names a file
// the test writes the operation page's screenshot to (docs/ has one).
const (
	EnvBrowser    = "OPBROKER_TEST_BROWSER"
	EnvScreenshot = "OPBROKER_TEST_SCREENSHOT"
)

// TestBrowser drives the view in a headless Chromium: sign in, search, open an
// operation that goes UNKNOWN → SUCCEEDED and see the page change by itself, see an
// escalation's owner, be refused another tenant's operation and every write, and see a
// page that cannot fetch a change say that its live updates stopped; the pages break no
// content security policy rule and log no error.
func TestBrowser(t *testing.T) {
	t.Parallel()
	chromium := ""
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			chromium = p
			break
		}
	}
	if chromium == "" {
		if os.Getenv(EnvBrowser) == "1" {
			t.Fatal("no Chromium found; install Debian's chromium")
		}
		t.Skip("no Chromium found (apt-get install chromium); " + EnvBrowser + "=1 makes this a failure")
	}
	f := newFixture(t)
	ctx := context.Background()

	// An escalated operation, then one left UNKNOWN, then one of another tenant.
	escalated := storetest.PrepareJSON(t, f.store, "acme", "demo.charge", "order-escalated", `{"amount":1}`)
	escalate(t, f, escalated)
	pending := storetest.PrepareJSON(t, f.store, "acme", "demo.charge", "order-1042", `{"amount":4242}`)
	storetest.ToUnknown(t, f.store, pending)
	other := storetest.PrepareJSON(t, f.store, "globex", "demo.charge", "order-1042", `{"amount":1}`)

	var mu sync.Mutex
	var problems []string
	allocCtx, cancelAlloc := chromedp.NewExecAllocator(ctx, append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(chromium))...)
	defer cancelAlloc()
	browser, cancelBrowser := chromedp.NewContext(allocCtx, chromedp.WithListener(func(ev any) {
		mu.Lock()
		defer mu.Unlock()
		switch ev := ev.(type) {
		case *cdplog.EventEntryAdded:
			if ev.Entry.Level == cdplog.EntryLevelError || ev.Entry.Source == cdplog.EntrySourceSecurity {
				problems = append(problems, fmt.Sprintf("%s: %s %s", ev.Entry.Source, ev.Entry.Text, ev.Entry.URL))
			}
		case *runtime.EventExceptionThrown:
			problems = append(problems, "exception: "+ev.ExceptionDetails.Text)
		}
	}))
	defer cancelBrowser()
	browser, cancel := context.WithTimeout(browser, 90*time.Second)
	defer cancel()
	text := func(sel string) string {
		t.Helper()
		s, err := chromedp.Run(browser, chromedp.Text(chromedp.CSS(sel)))
		require.NoError(t, err, sel)
		return s
	}

	// Every field has a label.
	labelled := func() {
		t.Helper()
		ok, err := chromedp.Run(browser, chromedp.Evaluate[bool](
			`[...document.querySelectorAll("input, select")].every(e => e.labels.length > 0)`))
		require.NoError(t, err)
		require.True(t, ok, "every field has a label")
	}

	// Sign in with the support token, typed into the form.
	require.NoError(t, chromedp.Do(browser, chromedp.Navigate(f.url+"/"), chromedp.WaitVisible(chromedp.CSS("#token"))))
	labelled()
	require.NoError(t, chromedp.Do(browser, chromedp.SendKeys(chromedp.CSS("#token"), f.tokens["acme-support"])))
	_, err := chromedp.RunResponse(browser, chromedp.Submit(chromedp.CSS("#token")))
	require.NoError(t, err)
	require.Contains(t, text("header"), "Signed in as acme-support")
	labelled()

	// Search by the customer's reference, and open the result.
	require.NoError(t, chromedp.Do(browser, chromedp.SendKeys(chromedp.CSS("#q"), "order-1042")))
	_, err = chromedp.RunResponse(browser, chromedp.Submit(chromedp.CSS("#q")))
	require.NoError(t, err)
	require.Contains(t, text("main"), "Confirmation pending")
	// The principal's two watches are taken elsewhere: the page's live stream is turned
	// away for a while, the page says so after a few tries and asks less and less often,
	// and once a watch comes back its stream opens and the notice goes.
	elsewhere := f.browser(t)
	require.Equal(t, http.StatusSeeOther, f.signIn(t, elsewhere, "acme-support"))
	live := f.url + "/tenants/acme/operations/" + pending.ID.String() + "/live"
	held := []liveStream{openLive(t, elsewhere, live), openLive(t, elsewhere, live)}
	_, err = chromedp.RunResponse(browser, chromedp.Click(chromedp.CSS("td a")))
	require.NoError(t, err)
	require.Equal(t, "Confirmation pending: we are checking with the payment provider", text("#headline"))
	_, err = chromedp.Run(browser, chromedp.Poll[bool](
		`document.getElementById("live-status").textContent.startsWith("Live updates paused")`,
		chromedp.WithPollingTimeout(15*time.Second)))
	require.NoError(t, err, "the page says its live updates are paused")
	// The page waited a second after the first refusal, two after the second, and four
	// after the third (the broker's log has the times): 3.5 s on there are four at most
	// (asking every second: about six).
	time.Sleep(3500 * time.Millisecond)
	var refusals []time.Time
	for _, entry := range logtest.Entries[struct {
		Time   time.Time
		Reason string
	}](t, f.logs) {
		if entry.Reason == "WATCH_LIMIT" {
			refusals = append(refusals, entry.Time)
		}
	}
	require.GreaterOrEqual(t, len(refusals), 3, "the broker logs each refusal")
	require.LessOrEqual(t, len(refusals), 4, "the page waits longer after each refusal")
	require.GreaterOrEqual(t, refusals[1].Sub(refusals[0]), 900*time.Millisecond, "a second after the first")
	require.GreaterOrEqual(t, refusals[2].Sub(refusals[1]), 1800*time.Millisecond, "two after the second")
	if len(refusals) == 4 {
		require.GreaterOrEqual(t, refusals[3].Sub(refusals[2]), 3600*time.Millisecond, "four after the third")
	}
	for _, h := range held {
		h.Close()
	}
	_, err = chromedp.Run(browser, chromedp.Poll[bool](`(s => s.textContent === "Live updates resumed." &&
		s.classList.contains("visually-hidden"))(document.getElementById("live-status"))`, chromedp.WithPollingTimeout(15*time.Second)))
	require.NoError(t, err, "the notice goes once the stream opens, and screen readers hear so")

	// The reconciler's lookup finds the charge: the page changes by itself, with no
	// reload (a mark on the window survives).
	_, err = chromedp.Run(browser, chromedp.Evaluate[bool](`window.notReloaded = true`))
	require.NoError(t, err)
	storetest.ResolveUnknown(t, f.store, pending, store.ResolveParams{State: store.StateSucceeded, RemoteRef: "ch_1042",
		Observation: store.Observation{Source: "LOOKUP", Outcome: "FOUND"}, Actor: "test"})
	_, err = chromedp.Run(browser, chromedp.Poll[bool](
		`document.getElementById("headline").textContent === "Confirmed by the payment provider"`,
		chromedp.WithPollingTimeout(15*time.Second)))
	require.NoError(t, err, "the page showed: %s", text("#operation"))
	notReloaded, err := chromedp.Run(browser, chromedp.Evaluate[bool](`window.notReloaded === true`))
	require.NoError(t, err)
	require.True(t, notReloaded, "the page changed without a reload")
	page := text("#operation")
	require.Contains(t, page, "ch_1042")
	require.Contains(t, page, "No clear answer from the payment provider", "the history in words")
	if path := os.Getenv(EnvScreenshot); path != "" {
		png, err := chromedp.Run(browser, chromedp.FullScreenshot(100))
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(path, png, 0o644))
	}

	// Writes are refused, whatever the method.
	for _, method := range []string{"POST", "PUT", "DELETE"} {
		code, err := chromedp.Run(browser, chromedp.Evaluate[int](
			fmt.Sprintf(`fetch(location.href, {method: %q}).then(r => r.status)`, method), chromedp.EvalAwaitPromise))
		require.NoError(t, err)
		require.Equal(t, 405, code, method)
	}

	// The escalation: its owner, on its page and in the queue.
	require.NoError(t, chromedp.Do(browser, chromedp.Navigate(f.url+"/tenants/acme/operations/"+escalated.ID.String())))
	require.Equal(t, "Needs attention: demo-oncall is looking into it", text("#headline"))
	require.Contains(t, text("#owner"), "demo-oncall")
	require.NoError(t, chromedp.Do(browser, chromedp.Navigate(f.url+"/escalations")))
	require.Contains(t, text("main"), "demo-oncall")

	// Another tenant's operation, and one that does not exist.
	require.NoError(t, chromedp.Do(browser, chromedp.Navigate(f.url+"/tenants/globex/operations/"+other.ID.String())))
	require.Contains(t, text("main"), "You may not see this")
	require.NotContains(t, text("main"), "order-1042")
	require.NoError(t, chromedp.Do(browser, chromedp.Navigate(f.url+"/tenants/acme/operations/"+uuid.NewString())))
	require.Contains(t, text("main"), "There is no such operation")

	// A change the page cannot fetch (the network fails): the page stops its live
	// updates, says to reload, and keeps what it showed.
	// (Another type than the others', so that only it is claimed and resolved.)
	unfetched := storetest.PrepareJSON(t, f.store, "acme", "demo.notify", "order-1043", `{"amount":4343}`)
	storetest.ToUnknown(t, f.store, unfetched)
	unfetchedPage := f.url + "/tenants/acme/operations/" + unfetched.ID.String()
	require.NoError(t, chromedp.Do(browser, chromedp.Navigate(unfetchedPage)))
	shown := text("#headline")
	require.Contains(t, shown, "Confirmation pending")
	failed := failLoads(t, browser, unfetchedPage)
	storetest.ResolveUnknown(t, f.store, unfetched, store.ResolveParams{State: store.StateSucceeded, RemoteRef: "ch_1043",
		Observation: store.Observation{Source: "LOOKUP", Outcome: "FOUND"}, Actor: "test"})
	_, err = chromedp.Run(browser, chromedp.Poll[bool](`(s => s.textContent ===
		"Live updates stopped: reload the page to see the latest." && !s.classList.contains("visually-hidden"))(
		document.getElementById("live-status"))`, chromedp.WithPollingTimeout(15*time.Second)))
	n, failErr := failed()
	require.NoError(t, failErr, "failing the page's fetch")
	require.Positive(t, n, "the page fetched itself again after the change")
	require.NoError(t, err, "the page says its live updates stopped")
	require.Equal(t, shown, text("#headline"))

	mu.Lock()
	defer mu.Unlock()
	var unexpected []string
	for _, p := range problems {
		// The refused writes and pages above are logged by the browser as failed loads,
		// and so is the fetch made to fail.
		if !strings.Contains(p, "status of 405") && !strings.Contains(p, "status of 403") && !strings.Contains(p, "status of 404") &&
			!(strings.Contains(p, "net::ERR_FAILED") && strings.Contains(p, unfetched.ID.String())) {
			unexpected = append(unexpected, p)
		}
	}
	require.Empty(t, unexpected, "no content security policy violation, script error or failed load")
}

// failLoads makes every later request for url fail, as when the network fails; other
// requests (the page's event stream) go through. The function it returns says how many
// it failed, and the first error in failing one.
func failLoads(t *testing.T, browser context.Context, url string) func() (int, error) {
	t.Helper()
	listening, stop := context.WithCancel(browser)
	t.Cleanup(stop)
	var mu sync.Mutex
	var failed int
	var failErr error
	// Subscribed before the interception begins, so that no paused request is missed;
	// the library queues the events for this goroutine, which may call the browser.
	paused := chromedp.Events(listening, fetch.RequestPaused)
	go func() {
		for ev, err := range paused {
			if err == nil {
				_, err = chromedp.Call(listening, fetch.FailRequest, fetch.FailRequestParams{RequestID: ev.RequestID, ErrorReason: network.ErrorReasonFailed})
			}
			if listening.Err() != nil {
				return // the test is over
			}
			mu.Lock()
			if err == nil {
				failed++
			} else if failErr == nil {
				failErr = err
			}
			mu.Unlock()
		}
	}()
	_, err := chromedp.Call(browser, fetch.Enable, fetch.EnableParams{Patterns: []*fetch.RequestPattern{{URLPattern: url}}})
	require.NoError(t, err)
	return func() (int, error) {
		mu.Lock()
		defer mu.Unlock()
		return failed, failErr
	}
}
