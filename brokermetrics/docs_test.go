package brokermetrics_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/goccy/go-yaml"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/brokermetrics"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/storetest"
	"github.com/opbroker/opbroker/target"
)

const runbook = "https://github.com/opbroker/opbroker/blob/main/docs/operations.md#"

// operationsDoc returns docs/operations.md, the metric names its metrics table lists,
// and the anchors of its headings as GitHub makes them.
func operationsDoc(t *testing.T) (metrics, anchors map[string]bool) {
	t.Helper()
	doc, err := os.ReadFile("../docs/operations.md")
	require.NoError(t, err)
	metrics, anchors = map[string]bool{}, map[string]bool{}
	row := regexp.MustCompile("^\\| `([a-z_*]+)`(?:, `([a-z_*]+)`)? \\|")
	punctuation := regexp.MustCompile(`[^a-z0-9 -]`)
	for line := range strings.Lines(string(doc)) {
		if m := row.FindStringSubmatch(line); m != nil {
			metrics[m[1]], metrics[m[2]] = true, m[2] != ""
		}
		if heading, ok := strings.CutPrefix(line, "#"); ok {
			heading = strings.TrimSpace(strings.TrimLeft(heading, "#"))
			anchors[strings.ReplaceAll(punctuation.ReplaceAllString(strings.ToLower(heading), ""), " ", "-")] = true
		}
	}
	require.NotEmpty(t, metrics)
	return metrics, anchors
}

// TestAlertsPointIntoTheRunbook: every alert of deploy/prometheus/alerts.yaml has a
// section of docs/operations.md named after it, which its runbook_url points at, and
// uses only metrics the metrics table documents.
func TestAlertsPointIntoTheRunbook(t *testing.T) {
	t.Parallel()
	metrics, anchors := operationsDoc(t)
	raw, err := os.ReadFile("../deploy/prometheus/alerts.yaml")
	require.NoError(t, err)
	var rules struct {
		Groups []struct {
			Rules []struct {
				Alert       string            `yaml:"alert"`
				Expr        string            `yaml:"expr"`
				Annotations map[string]string `yaml:"annotations"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	require.NoError(t, yaml.Unmarshal(raw, &rules))
	metricName := regexp.MustCompile(`\bopbroker_[a-z_]+`)
	alerts := 0
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			alerts++
			anchor, ok := strings.CutPrefix(r.Annotations["runbook_url"], runbook)
			require.True(t, ok, "%s: runbook_url %q points into docs/operations.md", r.Alert, r.Annotations["runbook_url"])
			require.Equal(t, strings.ToLower(r.Alert), anchor, "%s: its section is named after it", r.Alert)
			require.True(t, anchors[anchor], "%s: docs/operations.md has no section #%s", r.Alert, anchor)
			for _, name := range metricName.FindAllString(r.Expr, -1) {
				require.True(t, metrics[name], "%s uses %s, which the metrics table of docs/operations.md does not list", r.Alert, name)
			}
		}
	}
	require.Equal(t, 12, alerts)
}

// TestDashboardUsesDocumentedMetrics: the Grafana dashboard beside the alerts queries
// only metrics the metrics table of docs/operations.md lists.
func TestDashboardUsesDocumentedMetrics(t *testing.T) {
	t.Parallel()
	metrics, _ := operationsDoc(t)
	raw, err := os.ReadFile("../deploy/grafana/opbroker.json")
	require.NoError(t, err)
	var dashboard struct {
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	require.NoError(t, json.Unmarshal(raw, &dashboard))
	metricName := regexp.MustCompile(`\bopbroker_[a-z_]+`)
	queried := 0
	for _, p := range dashboard.Panels {
		for _, target := range p.Targets {
			for _, name := range metricName.FindAllString(target.Expr, -1) {
				queried++
				name = strings.TrimSuffix(name, "_bucket")
				require.True(t, metrics[name], "panel %q queries %s, which the metrics table of docs/operations.md does not list", p.Title, name)
			}
		}
	}
	require.NotZero(t, queried)
}

// TestEveryMetricIsDocumented: every metric of the package, as the Prometheus exporter
// names it, is in the metrics table of docs/operations.md.
func TestEveryMetricIsDocumented(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	metrics, _ := operationsDoc(t)
	st, _ := storetest.NewStore(t)
	mp, scrapeNow := meters(t)
	targets := demoTargets(t)
	payments, _ := targets.ByName("demo-payments")

	ledger, err := brokermetrics.NewLedger(brokermetrics.LedgerConfig{Store: st, Targets: targets, MeterProvider: mp,
		Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	require.NoError(t, ledger.Refresh(ctx))
	events, err := brokermetrics.NewEvents(mp)
	require.NoError(t, err)
	sent := time.Now()
	events.Sent(ctx, payments, store.RecordedOutcome{State: store.StateUnknown}, "TIMEOUT")
	events.Resolved(ctx, payments, store.Operation{State: store.StateSucceeded, FirstSentAt: &sent, UpdatedAt: sent})
	timed, err := brokermetrics.TimeRequests(&connector{}, mp)
	require.NoError(t, err)
	timed.Lookup(ctx, payments, uuid.New(), nil)
	timed.Send(ctx, target.Request{Contract: payments})
	evidence, err := brokermetrics.NewEvidence(mp)
	require.NoError(t, err)
	evidence.Received(ctx, "demo-payments", store.SourceWebhook, true)
	evidence.Decided(ctx, "demo-payments", store.EvidenceQuarantined, "UNMATCHED")
	evidence.Rejected(ctx, "demo-payments", "mismatch")
	evidence.Ignored(ctx, "demo-payments")

	var names []string
	for _, name := range scrapeNow().names() {
		if strings.HasPrefix(name, "opbroker_") { // not the exporter's target_info
			names = append(names, name)
		}
	}
	require.Len(t, names, 16, "%v", names)
	for _, name := range names {
		for _, suffix := range []string{"_bucket", "_sum", "_count"} {
			if base, ok := strings.CutSuffix(name, suffix); ok && strings.HasSuffix(base, "_seconds") {
				name = base
			}
		}
		require.True(t, metrics[name], "%s is not in the metrics table of docs/operations.md", name)
	}
}
