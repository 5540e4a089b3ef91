package simtarget

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/target"
)

func post(t *testing.T, url, key, body string) (*http.Response, error) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url+"/v1/charges", bytes.NewReader([]byte(body)))
	require.NoError(t, err)
	req.GetBody = nil
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	client := &http.Client{Timeout: 500 * time.Millisecond, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	return client.Do(req)
}

func TestFaultsGroundTruth(t *testing.T) {
	t.Parallel()
	for fault, want := range map[Fault]struct {
		status  int // 0: no answer
		effects int
	}{
		FaultNone:              {200, 1},
		FaultResetBeforeCommit: {0, 0},
		FaultCommitThenReset:   {0, 1},
		FaultCommitThenHang:    {0, 1},
		FaultSlowCommit:        {0, 1},
		Fault5xxBeforeCommit:   {503, 0},
		Fault5xxAfterCommit:    {500, 1},
		FaultInProgress:        {409, 0},
		FaultThrottle:          {429, 0},
		FaultRedirect:          {307, 0},
		FaultDecline:           {402, 0},
		FaultLookupLag:         {200, 1},
	} {
		t.Run(string(fault)+"_", func(t *testing.T) {
			t.Parallel()
			target := New(Config{SlowDelay: 700 * time.Millisecond})
			srv := httptest.NewServer(target)
			defer srv.Close()
			defer target.Close()
			body := `{"amount":1,"sim":{"fault":"` + string(fault) + `"}}`
			resp, err := post(t, srv.URL, "key-1", body)
			if want.status == 0 {
				require.Error(t, err, "the target must not answer")
			} else {
				require.NoError(t, err)
				resp.Body.Close()
				require.Equal(t, want.status, resp.StatusCode)
			}
			require.Eventually(t, func() bool {
				kt := target.Snapshot().Keys["key-1"]
				return kt != nil && kt.Effects == want.effects
			}, 2*time.Second, 10*time.Millisecond)
			kt := target.Snapshot().Keys["key-1"]
			require.Equal(t, 1, kt.Attempts)
			require.Equal(t, []string{hashOf([]byte(body))}, kt.PayloadSHA256)
		})
	}
}

// A fault the payload names for a number of times hits only that many requests with the
// body; the next one is served.
func TestPayloadFaultForSomeTimes(t *testing.T) {
	t.Parallel()
	target := New(Config{})
	srv := httptest.NewServer(target)
	defer srv.Close()
	defer target.Close()
	body := `{"amount":1,"sim":{"fault":"throttle","times":2}}`
	for _, want := range []int{429, 429, 200} {
		resp, err := post(t, srv.URL, "key-1", body)
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, want, resp.StatusCode)
	}
	require.Equal(t, 1, target.Snapshot().Keys["key-1"].Effects)
}

func TestReplayOfSavedResponse(t *testing.T) {
	t.Parallel()
	target := New(Config{})
	srv := httptest.NewServer(target)
	defer srv.Close()

	resp, err := post(t, srv.URL, "k", `{"amount":1,"sim":{"fault":"5xx_after_commit"}}`)
	require.NoError(t, err)
	require.Equal(t, 500, resp.StatusCode)
	resp, err = post(t, srv.URL, "k", `{"amount":1,"sim":{"fault":"5xx_after_commit"}}`)
	require.NoError(t, err)
	require.Equal(t, 500, resp.StatusCode, "Stripe v1 style: the saved 5xx is replayed")
	require.Equal(t, 1, target.Snapshot().Keys["k"].Effects)

	resp, err = post(t, srv.URL, "k", `{"amount":2}`)
	require.NoError(t, err)
	require.Equal(t, 422, resp.StatusCode, "same key, other parameters")
}

func TestSaveOnlySuccessesReexecutes(t *testing.T) {
	t.Parallel()
	target := New(Config{SaveOnlySuccesses: true})
	srv := httptest.NewServer(target)
	defer srv.Close()
	body := `{"amount":1,"sim":{"fault":"5xx_after_commit"}}`
	for range 2 {
		resp, err := post(t, srv.URL, "k", body)
		require.NoError(t, err)
		require.Equal(t, 500, resp.StatusCode)
	}
	require.Equal(t, 2, target.Snapshot().Keys["k"].Effects, "a replay after a saved error executes again")
}

func TestRetentionForgetsKeys(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	target := New(Config{Retention: time.Hour, Now: func() time.Time { return now }})
	srv := httptest.NewServer(target)
	defer srv.Close()
	_, err := post(t, srv.URL, "k", `{"amount":1}`)
	require.NoError(t, err)
	now = now.Add(30 * time.Minute)
	_, err = post(t, srv.URL, "k", `{"amount":1}`)
	require.NoError(t, err)
	require.Equal(t, 1, target.Snapshot().Keys["k"].Effects, "inside the window the key is honoured")
	now = now.Add(time.Hour)
	_, err = post(t, srv.URL, "k", `{"amount":1}`)
	require.NoError(t, err)
	require.Equal(t, 2, target.Snapshot().Keys["k"].Effects, "after the window a replay makes a second effect")
}

func TestLookupLag(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	target := New(Config{LookupLag: time.Minute, Now: func() time.Time { return now }})
	srv := httptest.NewServer(target)
	defer srv.Close()
	resp, err := post(t, srv.URL, "k", `{"amount":1}`)
	require.NoError(t, err)
	var created map[string]string
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&created))

	lookup := func() int { return lookupStatus(t, srv.URL, "k") }
	require.Equal(t, 404, lookup(), "not yet visible")
	now = now.Add(2 * time.Minute)
	require.Equal(t, 200, lookup())
}

// TestLookupFailuresUntilHealed: a lookup outage answers 503, is counted, and ends with
// Heal.
func TestLookupFailuresUntilHealed(t *testing.T) {
	t.Parallel()
	target := New(Config{LookupFailures: 1})
	srv := httptest.NewServer(target)
	defer srv.Close()
	_, err := post(t, srv.URL, "k", `{"amount":1}`)
	require.NoError(t, err)
	lookup := func() int { return lookupStatus(t, srv.URL, "k") }
	require.Equal(t, 503, lookup())
	require.Equal(t, 503, lookup())
	require.Equal(t, 2, target.Snapshot().Faults[FaultLookupUnavailable])
	target.Heal()
	require.Equal(t, 200, lookup())
}

func TestRandomFaultsAreSeeded(t *testing.T) {
	t.Parallel()
	pick := func() []Fault {
		target := New(Config{FaultRates: map[Fault]float64{FaultDecline: 0.3, Fault5xxBeforeCommit: 0.3}, Seed: 42})
		var out []Fault
		for range 20 {
			out = append(out, target.chooseFault([]byte(`{}`)))
		}
		return out
	}
	require.Equal(t, pick(), pick())
}

// lookupStatus looks the charge made with key up and returns the answer's status.
func lookupStatus(t *testing.T, baseURL, key string) int {
	t.Helper()
	resp, err := http.Get(baseURL + "/v1/charges?reference=" + key)
	require.NoError(t, err)
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// TestRequiresCredential: a target with Config.Auth answers a create or a lookup without
// its credential 401, with no effect, and counts it; its contracts carry the auth.
func TestRequiresCredential(t *testing.T) {
	t.Parallel()
	auth := &target.Auth{Scheme: target.AuthHeader, Header: "X-Api-Key", Prefix: "Token ", Secret: target.Secret{Env: "SIM_API_KEY"}}
	sim := New(Config{Auth: auth, Credential: "k1"})
	srv := httptest.NewServer(sim)
	defer srv.Close()
	request := func(method, path, credential string) (int, map[string]string) {
		req, err := http.NewRequest(method, srv.URL+path, bytes.NewReader([]byte(`{"amount":1}`)))
		require.NoError(t, err)
		req.Header.Set("Idempotency-Key", "k")
		if credential != "" {
			req.Header.Set("X-Api-Key", credential)
		}
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		var body map[string]string
		_ = json.NewDecoder(resp.Body).Decode(&body)
		return resp.StatusCode, body
	}
	for _, tc := range []struct {
		method, path, credential string
		status                   int
	}{
		{http.MethodPost, "/v1/charges", "", 401},
		{http.MethodPost, "/v1/charges", "Token k2", 401},
		{http.MethodPost, "/v1/charges", "k1", 401}, // without the prefix
		{http.MethodPost, "/v1/notifications", "", 401},
		{http.MethodGet, "/v1/charges?reference=k", "", 401},
		{http.MethodPost, "/v1/charges", "Token k1", 200},
		{http.MethodGet, "/v1/charges?reference=k", "Token k1", 200},
	} {
		status, body := request(tc.method, tc.path, tc.credential)
		require.Equal(t, tc.status, status, "%+v", tc)
		if status == 401 {
			require.Equal(t, "unauthorized", body["error"])
		}
	}
	truth := sim.Snapshot()
	require.Equal(t, 5, truth.Faults[FaultUnauthorized])
	require.Equal(t, 1, truth.Keys["k"].Effects, "a refused create makes no effect")
	require.Equal(t, 1, truth.Keys["k"].Attempts, "nor counts as an attempt of its key")

	sim.SetCredential("k2")
	status, _ := request(http.MethodGet, "/v1/charges?reference=k", "Token k1")
	require.Equal(t, 401, status, "a rotated credential replaces the old one")

	contracts := Contracts(srv.URL, Config{Auth: auth})
	for _, c := range contracts {
		require.Equal(t, auth, c.Auth)
		require.NotSame(t, auth, c.Auth)
	}
	require.Nil(t, DemoContracts(srv.URL)[0].Auth)
}

// TestOnlyChargesProcess: with Completion, a charge is processing until it completes;
// an object and a notification are done when they are made, as their contracts, which
// have no completion, read them.
func TestOnlyChargesProcess(t *testing.T) {
	t.Parallel()
	target := New(Config{Completion: time.Hour})
	srv := httptest.NewServer(target)
	defer srv.Close()
	defer target.Close()
	resp, err := post(t, srv.URL, "charge-1", `{"amount":1}`)
	require.NoError(t, err)
	resp.Body.Close()
	for path, header := range map[string]string{"/v1/objects/object-1": "", "/v1/notifications": "X-Request-Id"} {
		method := http.MethodPut
		if header != "" {
			method = http.MethodPost
		}
		req, err := http.NewRequest(method, srv.URL+path, bytes.NewReader([]byte(`{"amount":1}`)))
		require.NoError(t, err)
		if header != "" {
			req.Header.Set(header, "notification-1")
		}
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode, path)
	}
	truth := target.Snapshot()
	require.Equal(t, 1, truth.Keys["charge-1"].Processing)
	require.Zero(t, truth.Keys["object-1"].Processing)
	require.Equal(t, 1, truth.Keys["object-1"].Effects)
	require.Zero(t, truth.Keys["notification-1"].Processing)
	require.Equal(t, 1, truth.Keys["notification-1"].Effects)
}

// TestSlowCommitIsCommitting: a request the target has not committed yet shows as
// committing, so that whoever checks the target knows an effect may still come.
func TestSlowCommitIsCommitting(t *testing.T) {
	t.Parallel()
	target := New(Config{SlowDelay: 700 * time.Millisecond})
	srv := httptest.NewServer(target)
	defer srv.Close()
	defer target.Close()
	_, err := post(t, srv.URL, "key-1", `{"amount":1,"sim":{"fault":"slow_commit"}}`)
	require.Error(t, err, "the client gave up before the commit")
	kt := target.Snapshot().Keys["key-1"]
	require.NotNil(t, kt)
	require.Equal(t, 0, kt.Effects)
	require.Equal(t, 1, kt.Committing)
	require.Eventually(t, func() bool {
		kt := target.Snapshot().Keys["key-1"]
		return kt.Effects == 1 && kt.Committing == 0
	}, 2*time.Second, 10*time.Millisecond)
}
