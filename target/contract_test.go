package target_test

import (
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/target"
)

func TestLoadFile(t *testing.T) {
	t.Parallel()
	targets, err := target.LoadFile("testdata/targets.yaml")
	require.NoError(t, err)
	payments, ok := targets.ForType("payments.refund")
	require.True(t, ok)
	require.Equal(t, "acme-payments", payments.Name)
	require.Equal(t, 24*time.Hour, payments.Idempotency.Retention.D())
	require.Equal(t, target.Capabilities{Replay: true, Lookup: true}, payments.Capabilities())
	require.True(t, payments.Idempotency.CoversEveryAttempt())
	mailer, ok := targets.ByName("acme-mailer")
	require.True(t, ok)
	require.True(t, mailer.Capabilities().None())
	_, ok = targets.ForType("unknown.type")
	require.False(t, ok)
}

// TestLoadErrorsNameFileTargetAndField: a malformed file fails with errors a person can
// act on.
func TestLoadErrorsNameFileTargetAndField(t *testing.T) {
	t.Parallel()
	good, err := os.ReadFile("testdata/targets.yaml")
	require.NoError(t, err)
	for name, tc := range map[string]struct {
		from, to string
		want     []string
	}{
		"unknown field":        {"    concurrency: 16", "    concurency: 16", []string{"t.yaml", "concurency"}},
		"bad duration":         {"timeout: 10s", "timeout: ten seconds", []string{"t.yaml", "line 18", `"ten seconds" is not a duration`}},
		"bad method":           {"method: POST\n      url: http://127.0.0.1:8081", "method: GET\n      url: http://127.0.0.1:8081", []string{`t.yaml: target "acme-payments": endpoint.method`}},
		"relative url":         {"url: http://127.0.0.1:8082/send", "url: /send", []string{`target "acme-mailer": endpoint.url`}},
		"lookup without key":   {"?reference={remote_key}", "?reference=x", []string{`target "acme-payments": lookup.url: must contain {remote_key}`}},
		"duplicate type":       {"operation_types: [mail.send]", "operation_types: [payments.charge]", []string{`target "acme-mailer": operation_types: "payments.charge" is already served by target "acme-payments"`}},
		"status in two lists":  {"- status: [402]", "- status: [409]", []string{`responses.`, `409 is also listed`}},
		"bad date":             {"checked: 2026-11-01", "checked: last week", []string{`target "acme-mailer": documentation.checked`}},
		"5xx as success":       {"- status: [200, 201]", "- status: [200, 503]", []string{`go/no-go control 6 (unknown handling) fails: 503 is listed as success`}},
		"success without ref":  {"      - status: [200]\n          remote_ref: /message_id", "      - status: [200]", []string{`target "acme-mailer": go/no-go control 7`}},
		"undocumented reject":  {`documented: "Declined payments create no charge (errors page, card_declined)"`, `documented: ""`, []string{`go/no-go control 8`}},
		"no owner":             {"team: messaging", "team: \"\"", []string{`target "acme-mailer": go/no-go control 9 (escalation path) fails: owner.team is missing`}},
		"no data owner":        {"owner: messaging\n", "owner: \"\"\n", []string{`target "acme-mailer": go/no-go control 10`}},
		"no documentation":     {"url: https://docs.example.com/mailer", "url: \"\"", []string{`target "acme-mailer": go/no-go control 1`}},
		"key coverage unsaid":  {"      saves: every_answer\n", "", []string{`target "acme-payments": go/no-go control 1 (target contract recorded) fails: idempotency.saves is missing`}},
		"key coverage unknown": {"saves: every_answer", "saves: errors", []string{`target "acme-payments": idempotency.saves: must be every_answer or successes_only`}},
		"undocumented not executed": {`documented: "Rate limiters run before the idempotency layer (idempotent requests page)"`, `documented: ""`,
			[]string{`go/no-go control 6 (unknown handling) fails: responses.not_executed[0] does not quote the documentation`}},
		"2xx not executed":           {"- status: [429]", "- status: [202]", []string{`go/no-go control 6 (unknown handling) fails: 202 is listed as not executed`}},
		"failed undocumented":        {`documented: "A canceled payment is final and moved no money (payment statuses page)"`, `documented: ""`, []string{`go/no-go control 8 (terminal failure rule) fails: completion.failed lists statuses`}},
		"completion not pointer":     {"field: /status", "field: status", []string{`target "acme-payments": completion.field: must be the JSON pointer`}},
		"status in two lists 2":      {"pending: [processing]", "pending: [succeeded]", []string{`completion.pending: "succeeded" is also listed under succeeded`}},
		"lookup status in two lists": {"not_found: [404]", "not_found: [404, 200]", []string{`target "acme-payments": lookup.not_found: 200 is also listed under lookup.found.status`}},
		"5xx as not found":           {"not_found: [404]", "not_found: [404, 503]", []string{`target "acme-payments": go/no-go control 6 (unknown handling) fails: 503 is listed as lookup.not_found`}},
		"credential elsewhere":       {"- status: [402]\n", "- status: [402]\n          credential: true\n", []string{`target "acme-payments": responses.rejection[0].credential: only a not_executed class`}},
	} {
		mutated := strings.Replace(string(good), tc.from, tc.to, 1)
		require.NotEqual(t, string(good), mutated, "%s: the mutation must apply", name)
		_, err := target.Parse("t.yaml", []byte(mutated))
		require.Error(t, err, name)
		for _, want := range tc.want {
			require.Contains(t, err.Error(), want, name)
		}
	}
}

func TestControlsOfAGoodTargetAllPass(t *testing.T) {
	t.Parallel()
	file, err := target.Decode("testdata/targets.yaml", mustRead(t, "testdata/targets.yaml"))
	require.NoError(t, err)
	for _, c := range file.Targets {
		results := c.Controls()
		require.Len(t, results, 11)
		for i, r := range results {
			require.Equal(t, i+1, r.Number)
			require.True(t, r.Pass, "%s control %d: %s", c.Name, r.Number, r.Reason)
			require.NotEmpty(t, r.Reason)
		}
	}
}

func mustRead(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	return b
}

// TestAFailedPreconditionHasNoOtherMeaning: a conditional target's precondition_failed
// status listed in a response class too would be read as that class (the connector reads
// success and rejection first): "an earlier send made the effect" would become a
// failure. The contract is refused.
func TestAFailedPreconditionHasNoOtherMeaning(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{"rejection", "not_executed", "in_progress"} {
		contracts := simtarget.DemoContracts("http://127.0.0.1:9")
		var conditional *target.Contract
		for _, c := range contracts {
			if c.Conditional != nil {
				conditional = c
			}
		}
		require.NotNil(t, conditional)
		class := []target.ResponseClass{{Status: []int{412}, Documented: "documented as having no effect"}}
		switch kind {
		case "rejection":
			conditional.Responses.Rejection = class
		case "not_executed":
			conditional.Responses.NotExecuted = class
		case "in_progress":
			conditional.Responses.InProgress = class
		}
		data, err := target.Encode(contracts)
		require.NoError(t, err)
		_, err = target.Parse("t.yaml", data)
		require.ErrorContains(t, err, "responses."+kind+"[0].status: 412 is also listed under conditional_mutation.precondition_failed")
	}
}

// TestEncodeRoundTrips: a file written by Encode reads back as the same contracts.
func TestEncodeRoundTrips(t *testing.T) {
	t.Parallel()
	contracts := simtarget.DemoContracts("http://127.0.0.1:9")
	data, err := target.Encode(contracts)
	require.NoError(t, err)
	got, err := target.Parse("encoded.yaml", data)
	require.NoError(t, err, string(data))
	var back []*target.Contract
	for _, c := range contracts {
		b, ok := got.ByName(c.Name)
		require.True(t, ok)
		require.Equal(t, c.Endpoint, b.Endpoint)
		require.Equal(t, c.Idempotency, b.Idempotency)
		back = append(back, b)
	}
	again, err := target.Encode(back)
	require.NoError(t, err)
	require.Equal(t, string(data), string(again))
}

// TestControlOneSaysWhatTheKeyCovers: targets check shows, for a keyed target, whether
// a replay can execute an earlier attempt again.
func TestControlOneSaysWhatTheKeyCovers(t *testing.T) {
	t.Parallel()
	for saves, want := range map[string]string{
		target.SavesEveryAnswer:   "the key saves every answer: a replay never executes an earlier attempt again",
		target.SavesSuccessesOnly: "the key saves only successes: after an answer that may have executed, a replay needs a lookup that proves absence",
	} {
		c := simtarget.DemoContracts("http://127.0.0.1:9")[0]
		c.Idempotency.Saves = saves
		control := c.Controls()[0]
		require.True(t, control.Pass, control.Reason)
		require.Contains(t, control.Reason, want)
		require.Equal(t, saves == target.SavesEveryAnswer, c.Idempotency.CoversEveryAttempt())
	}
}

// TestProblemsComeInAStableOrder: the same file gets the same errors in the same order,
// every time.
func TestProblemsComeInAStableOrder(t *testing.T) {
	t.Parallel()
	good := string(mustRead(t, "testdata/targets.yaml"))
	bad := strings.NewReplacer("- status: [402]", "- status: [200, 999]", "- status: [409]", "- status: [0]",
		"- status: [200, 201]", "- status: [200, 1000]").Replace(good)
	_, first := target.Parse("t.yaml", []byte(bad))
	require.Error(t, first)
	require.GreaterOrEqual(t, strings.Count(first.Error(), "\n"), 2, "several problems: %v", first)
	for range 20 {
		_, again := target.Parse("t.yaml", []byte(bad))
		require.Equal(t, first.Error(), again.Error())
	}
}

// A failure by hand waits for the longer of the lookup's visibility delay and the
// documented finality of absence; a target with no lookup documents neither.
func TestFailureSettlesAfter(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		lookup *target.Lookup
		want   time.Duration
	}{
		{nil, 0},
		{&target.Lookup{VisibilityDelay: target.Duration(5 * time.Second)}, 5 * time.Second},
		{&target.Lookup{VisibilityDelay: target.Duration(5 * time.Second), AbsenceFinalAfter: target.Duration(time.Hour)}, time.Hour},
	} {
		require.Equal(t, c.want, (&target.Contract{Lookup: c.lookup}).FailureSettlesAfter())
	}
}

// TestLookupScopeIsWhereALookupAsks: the lookup's fingerprint changes with where it
// asks and what it takes as "not found", and with nothing else of it.
func TestLookupScopeIsWhereALookupAsks(t *testing.T) {
	t.Parallel()
	targets, err := target.LoadFile("testdata/targets.yaml")
	require.NoError(t, err)
	payments, ok := targets.ByName("acme-payments")
	require.True(t, ok)
	scope := payments.LookupScope()
	require.NotEmpty(t, scope)
	edited := func(edit func(*target.Lookup)) string {
		copied, lookup := *payments, *payments.Lookup
		lookup.NotFound = slices.Clone(lookup.NotFound)
		edit(&lookup)
		copied.Lookup = &lookup
		return copied.LookupScope()
	}
	for name, edit := range map[string]func(*target.Lookup){
		"another URL":       func(l *target.Lookup) { l.URL = strings.Replace(l.URL, "/v1/", "/v2/", 1) },
		"another method":    func(l *target.Lookup) { l.Method = "POST" },
		"another not found": func(l *target.Lookup) { l.NotFound = append(l.NotFound, 410) },
	} {
		require.NotEqual(t, scope, edited(edit), name)
	}
	require.Equal(t, scope, edited(func(l *target.Lookup) {
		l.VisibilityDelay, l.AbsenceFinalAfter = target.Duration(time.Minute), target.Duration(time.Hour)
		l.Match = nil
	}), "what a found object must carry is not where the lookup asks")
	require.Equal(t, scope, edited(func(l *target.Lookup) { l.NotFound = []int{404, 404} }), "the statuses as a set")

	mailer, ok := targets.ByName("acme-mailer")
	require.True(t, ok)
	require.Empty(t, mailer.LookupScope(), "no lookup, no scope")
}
