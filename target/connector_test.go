package target_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/clocktest"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/target"
)

func demo(t *testing.T, cfg simtarget.Config) (*simtarget.Target, *target.Targets) {
	t.Helper()
	sim := simtarget.New(cfg)
	srv := httptest.NewServer(sim)
	t.Cleanup(srv.Close)
	t.Cleanup(sim.Close)
	targets, err := target.New(simtarget.Contracts(srv.URL, cfg)...)
	require.NoError(t, err)
	return sim, targets
}

func send(t *testing.T, c *target.Connector, targets *target.Targets, typ string, key uuid.UUID, body string) target.Result {
	t.Helper()
	contract, ok := targets.ForType(typ)
	require.True(t, ok)
	return c.Send(context.Background(), target.Request{Contract: contract, Payload: []byte(body),
		ContentType: "application/json", RemoteKey: key, Fence: 1, Timeout: 500 * time.Millisecond})
}

func TestSendClassifiesEveryFault(t *testing.T) {
	t.Parallel()
	for fault, want := range map[simtarget.Fault]struct {
		outcome target.Outcome
		class   string
	}{
		simtarget.FaultNone:              {target.Succeeded, target.ClassVerifiedSuccess},
		simtarget.FaultDecline:           {target.Rejected, target.ClassDocumentedRejection},
		simtarget.FaultResetBeforeCommit: {target.Unknown, target.ClassConnectionError},
		simtarget.FaultCommitThenReset:   {target.Unknown, target.ClassConnectionError},
		simtarget.FaultCommitThenHang:    {target.Unknown, target.ClassTimeout},
		simtarget.FaultSlowCommit:        {target.Unknown, target.ClassTimeout},
		simtarget.Fault5xxBeforeCommit:   {target.Unknown, target.ClassServerError},
		simtarget.Fault5xxAfterCommit:    {target.Unknown, target.ClassServerError},
		simtarget.FaultInProgress:        {target.Unknown, target.ClassInProgress},
		simtarget.FaultThrottle:          {target.NotExecuted, target.ClassNotExecuted},
		simtarget.FaultRedirect:          {target.Unknown, target.ClassRedirect},
		simtarget.FaultLookupLag:         {target.Succeeded, target.ClassVerifiedSuccess},
	} {
		t.Run(string(fault)+"_", func(t *testing.T) {
			t.Parallel()
			sim, targets := demo(t, simtarget.Config{SlowDelay: time.Second})
			key := uuid.New()
			res := send(t, target.NewConnector(), targets, simtarget.DemoCharge, key, `{"amount":1,"sim":{"fault":"`+string(fault)+`"}}`)
			require.Equal(t, want.outcome, res.Outcome, "%+v", res)
			require.Equal(t, want.class, res.Class)
			if want.outcome == target.Succeeded {
				require.Equal(t, sim.Snapshot().Keys[key.String()].IDs[0], res.RemoteRef)
			}
			if fault == simtarget.FaultThrottle {
				require.Equal(t, time.Second, res.RetryAfter)
			}
			require.Equal(t, 1, sim.Snapshot().Keys[key.String()].Attempts, "one send is one request")
		})
	}
}

// TestNoHiddenRetryOnReusedConnection: net/http re-sends a request carrying an
// Idempotency-Key after a failure on a reused connection unless the body cannot be
// rewound. The target counts what really arrives.
func TestNoHiddenRetryOnReusedConnection(t *testing.T) {
	t.Parallel()
	sim, targets := demo(t, simtarget.Config{})
	c := target.NewConnector()
	warm := send(t, c, targets, simtarget.DemoCharge, uuid.New(), `{"amount":1}`)
	require.Equal(t, target.Succeeded, warm.Outcome)

	key := uuid.New()
	res := send(t, c, targets, simtarget.DemoCharge, key, `{"amount":2,"sim":{"fault":"reset_before_commit"}}`)
	require.Equal(t, target.Unknown, res.Outcome)
	require.Equal(t, 1, sim.Snapshot().Keys[key.String()].Attempts, "the transport must not re-send")
	require.Zero(t, sim.Snapshot().Keys[key.String()].Effects)
}

func TestSendHeadersAndUnkeyedTarget(t *testing.T) {
	t.Parallel()
	sim, targets := demo(t, simtarget.Config{})
	key := uuid.New()
	res := send(t, target.NewConnector(), targets, simtarget.DemoNotify, key, `{"to":"ops"}`)
	require.Equal(t, target.Succeeded, res.Outcome)
	require.Equal(t, 1, sim.Snapshot().Keys[key.String()].Effects, "the request id header correlates the effect")
}

func TestConnectFailedIsNotSent(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(simtarget.New(simtarget.Config{}))
	contracts := simtarget.DemoContracts(srv.URL)
	srv.Close() // nothing listens any more
	targets, err := target.New(contracts...)
	require.NoError(t, err)
	res := send(t, target.NewConnector(), targets, simtarget.DemoCharge, uuid.New(), `{}`)
	require.Equal(t, target.Unknown, res.Outcome)
	require.Equal(t, target.ClassConnectFailed, res.Class)
	require.False(t, res.Sent)
}

// TestOnSentMeansTheTargetCanReadIt: when OnSent runs, the request has left the process:
// the target receives it even if the process stops sending anything at that moment.
func TestOnSentMeansTheTargetCanReadIt(t *testing.T) {
	t.Parallel()
	sim, targets := demo(t, simtarget.Config{})
	contract, _ := targets.ForType(simtarget.DemoCharge)
	c := target.NewConnector()
	for _, size := range []int{10, 100 << 10} { // in one write, and across many
		key := uuid.New()
		body := `{"pad":"` + strings.Repeat("x", size) + `"}`
		arrived := make(chan bool, 1)
		res := c.Send(context.Background(), target.Request{Contract: contract, Payload: []byte(body),
			ContentType: "application/json", RemoteKey: key, Fence: 1, Timeout: 2 * time.Second,
			OnSent: func() {
				// Block the sender here, as a paused process would, and watch the target.
				deadline := time.Now().Add(2 * time.Second)
				for time.Now().Before(deadline) {
					if kt := sim.Snapshot().Keys[key.String()]; kt != nil && kt.Attempts == 1 {
						arrived <- true
						return
					}
					time.Sleep(time.Millisecond)
				}
				arrived <- false
			}})
		require.True(t, <-arrived, "size %d: the target did not receive a request reported as sent", size)
		require.Equal(t, target.Succeeded, res.Outcome)
	}
}

func TestSendHeaders(t *testing.T) {
	t.Parallel()
	got := make(chan http.Header, 1)
	var body []byte
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ = io.ReadAll(r.Body)
		got <- r.Header.Clone()
		_, _ = w.Write([]byte(`{"id":"x_1"}`))
	}))
	defer srv.Close()
	contracts := simtarget.DemoContracts(srv.URL)
	contracts[0].Endpoint.FenceHeader = "X-Fence-Token"
	contracts[0].Endpoint.RequestIDHeader = "X-Request-Id"
	targets, err := target.New(contracts...)
	require.NoError(t, err)
	key := uuid.New()
	payload := `{ "amount" : 1 }`
	contract, _ := targets.ForType(simtarget.DemoCharge)
	res := target.NewConnector().Send(context.Background(), target.Request{Contract: contract, Payload: []byte(payload),
		ContentType: "application/json; charset=utf-8", RemoteKey: key, Fence: 7, Timeout: time.Second})
	require.Equal(t, target.Succeeded, res.Outcome)
	h := <-got
	require.Equal(t, key.String(), h.Get("Idempotency-Key"))
	require.Equal(t, key.String(), h.Get("X-Request-Id"))
	require.Equal(t, "7", h.Get("X-Fence-Token"))
	require.Equal(t, "application/json; charset=utf-8", h.Get("Content-Type"))
	require.Equal(t, payload, string(body), "exactly the approved bytes")
}

// TestRetryAfterOnEveryAnswer: an answer's Retry-After is read whatever its class, not
// only on one documented as not executed: a 503 that leaves the operation UNKNOWN
// carries the wait its replay must keep.
func TestRetryAfterOnEveryAnswer(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Retry-After", "120")
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	defer srv.Close()
	targets, err := target.New(simtarget.DemoContracts(srv.URL)...)
	require.NoError(t, err)
	res := send(t, target.NewConnector(), targets, simtarget.DemoCharge, uuid.New(), `{"amount":1}`)
	require.Equal(t, target.Unknown, res.Outcome)
	require.Equal(t, target.ClassServerError, res.Class)
	require.Equal(t, 2*time.Minute, res.RetryAfter)
}

func TestLookup(t *testing.T) {
	t.Parallel()
	sim, targets := demo(t, simtarget.Config{})
	contract, _ := targets.ForType(simtarget.DemoCharge)
	c := target.NewConnector()
	key := uuid.New()
	body := `{"amount":100,"currency":"EUR"}`
	require.Equal(t, target.Succeeded, send(t, c, targets, simtarget.DemoCharge, key, body).Outcome)

	found := c.Lookup(context.Background(), contract, key, []byte(body))
	require.Equal(t, target.LookupFound, found.Outcome, found.Summary)
	require.True(t, found.Matches, found.Summary)
	require.Equal(t, sim.Snapshot().Keys[key.String()].IDs[0], found.RemoteRef)

	respelled := c.Lookup(context.Background(), contract, key, []byte(`{"currency":"EUR","amount":1e2}`))
	require.True(t, respelled.Matches, "fields are compared as JSON values")

	other := c.Lookup(context.Background(), contract, key, []byte(`{"amount":40,"currency":"EUR"}`))
	require.Equal(t, target.LookupFound, other.Outcome)
	require.False(t, other.Matches, "an object that disagrees with the approved payload never matches")
	require.Contains(t, other.Summary, "/request/amount")

	missing := c.Lookup(context.Background(), contract, uuid.New(), []byte(body))
	require.Equal(t, target.LookupNotFound, missing.Outcome)

	notify, _ := targets.ForType(simtarget.DemoNotify)
	require.Equal(t, target.LookupFailed, c.Lookup(context.Background(), notify, key, nil).Outcome, "no lookup, no answer")
}

// TestCompletion: with a completion in the contract, an answer or a found object is a
// success only when its status says so. Processing is pending (kept as UNKNOWN, with the
// target's reference), failed is a documented failure, any other status is not
// confirmed.
func TestCompletion(t *testing.T) {
	t.Parallel()
	simClock := clocktest.New(0)
	sim, targets := demo(t, simtarget.Config{Completion: time.Minute, Now: simClock.Now})
	contract, _ := targets.ForType(simtarget.DemoCharge)
	c := target.NewConnector()
	pays, fails := uuid.New(), uuid.New()

	res := send(t, c, targets, simtarget.DemoCharge, pays, `{"amount":1}`)
	require.Equal(t, target.Unknown, res.Outcome)
	require.Equal(t, target.ClassPending, res.Class, res.Summary)
	require.Equal(t, sim.Snapshot().Keys[pays.String()].IDs[0], res.RemoteRef)
	send(t, c, targets, simtarget.DemoCharge, fails, `{"amount":1,"sim":{"completes":"failed"}}`)
	for _, key := range []uuid.UUID{pays, fails} {
		found := c.Lookup(context.Background(), contract, key, []byte(`{"amount":1}`))
		require.True(t, found.Matches, found.Summary)
		require.Equal(t, target.Pending, found.Settlement, found.Summary)
	}

	simClock.Advance(time.Hour)
	require.Equal(t, target.Settled, c.Lookup(context.Background(), contract, pays, []byte(`{"amount":1}`)).Settlement)
	failed := c.Lookup(context.Background(), contract, fails, []byte(`{"amount":1}`))
	require.Equal(t, target.FailedFinal, failed.Settlement, failed.Summary)

	// An answer's own status: each value of the contract, and one it does not list.
	answering := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"id":"ch_x","status":` + string(body) + `}`))
	}))
	t.Cleanup(answering.Close)
	direct := *contract
	direct.Endpoint.URL = answering.URL
	for status, want := range map[string]struct {
		outcome target.Outcome
		class   string
	}{
		`"succeeded"`:  {target.Succeeded, target.ClassVerifiedSuccess},
		`"processing"`: {target.Unknown, target.ClassPending},
		`"failed"`:     {target.Rejected, target.ClassDocumentedFailure},
		`"on_hold"`:    {target.Unknown, target.ClassNotConfirmed},
		`null`:         {target.Unknown, target.ClassNotConfirmed},
	} {
		res := c.Send(context.Background(), target.Request{Contract: &direct, Payload: []byte(status),
			ContentType: "application/json", RemoteKey: uuid.New(), Fence: 1})
		require.Equal(t, want.outcome, res.Outcome, "%s: %s", status, res.Summary)
		require.Equal(t, want.class, res.Class, status)
	}
}

// TestConditionalSend: every send to a conditional target carries its precondition, on
// the object the operation's remote key names, so a second send of the same operation
// is refused (PRECONDITION_FAILED) and makes no second effect; a precondition given as a
// query parameter is added to the URL.
func TestConditionalSend(t *testing.T) {
	t.Parallel()
	sim, targets := demo(t, simtarget.Config{})
	c := target.NewConnector()
	key := uuid.New()
	first := send(t, c, targets, simtarget.DemoObject, key, `{"amount":1}`)
	require.Equal(t, target.Succeeded, first.Outcome, first.Summary)
	again := send(t, c, targets, simtarget.DemoObject, key, `{"amount":1}`)
	require.Equal(t, target.Unknown, again.Outcome)
	require.Equal(t, target.ClassPreconditionFailed, again.Class, again.Summary)
	require.Equal(t, 1, sim.Snapshot().Keys[key.String()].Effects, "the precondition held")
	require.Equal(t, 1, sim.Snapshot().PreconditionFailed)

	var got *http.Request
	capture := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got = r
		_, _ = w.Write([]byte(`{"id":"obj"}`))
	}))
	t.Cleanup(capture.Close)
	contract, _ := targets.ForType(simtarget.DemoObject)
	byParameter := *contract
	byParameter.Endpoint.URL = capture.URL + "/o?uploadType=media&name={remote_key}"
	byParameter.Conditional = &target.Conditional{Parameter: "ifGenerationMatch", Value: "0", PreconditionFailed: []int{412}}
	res := c.Send(context.Background(), target.Request{Contract: &byParameter, Payload: []byte(`{}`),
		ContentType: "application/json", RemoteKey: key, Fence: 1})
	require.Equal(t, target.Succeeded, res.Outcome, res.Summary)
	require.Equal(t, "0", got.URL.Query().Get("ifGenerationMatch"))
	require.Equal(t, key.String(), got.URL.Query().Get("name"))
	require.Equal(t, "media", got.URL.Query().Get("uploadType"))
}

// TestAnUnusableReferenceIsNoReference: a reference the ledger cannot store and index
// (over 512 bytes, or with a control character such as NUL) is taken as none: the
// answer is a success without a reference (UNKNOWN), and a found object without one
// does not match. Recorded, it would fail the statement, and with it every outcome in
// the same batch.
func TestAnUnusableReferenceIsNoReference(t *testing.T) {
	t.Parallel()
	// sendAndLook sends to a target whose answers and found objects carry id (JSON) as
	// their reference, and looks the operation up.
	sendAndLook := func(id string) (target.Result, target.LookupResult) {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write([]byte(`{"id":` + id + `,"reference":"` + r.URL.Query().Get("reference") + `","request":{"amount":1}}`))
		}))
		t.Cleanup(srv.Close)
		targets, err := target.New(simtarget.DemoContracts(srv.URL)...)
		require.NoError(t, err)
		contract, _ := targets.ForType(simtarget.DemoCharge)
		key := uuid.New()
		res := send(t, target.NewConnector(), targets, simtarget.DemoCharge, key, `{"amount":1}`)
		return res, target.NewConnector().Lookup(context.Background(), contract, key, []byte(`{"amount":1}`))
	}
	for name, id := range map[string]string{
		"too long": `"` + strings.Repeat("x", 513) + `"`,
		"NUL":      `"ch_\u0000"`,
		"newline":  `"ch_\n"`,
	} {
		res, found := sendAndLook(id)
		require.Equal(t, target.Unknown, res.Outcome, name)
		require.Equal(t, target.ClassSuccessWithoutRef, res.Class, name)
		require.Empty(t, res.RemoteRef, name)
		require.False(t, found.Matches, "%s: %s", name, found.Summary)
		require.Empty(t, found.RemoteRef, name)
	}
	longest := strings.Repeat("x", 512)
	res, found := sendAndLook(`"` + longest + `"`)
	require.Equal(t, target.Succeeded, res.Outcome, "512 bytes is a reference: %s", res.Summary)
	require.True(t, found.Matches, found.Summary)
	require.Equal(t, longest, found.RemoteRef)
}
