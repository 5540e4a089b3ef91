package brokermetrics_test

import (
	"context"
	"net/http/httptest"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/stretchr/testify/require"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/storetest"
	"github.com/opbroker/opbroker/target"
)

func TestMain(m *testing.M) { storetest.Main(m) }

// meters returns a MeterProvider exported to Prometheus as the broker's is
// (cmd/opbroker), and a scrape of it.
func meters(t *testing.T) (*sdkmetric.MeterProvider, func() scrape) {
	t.Helper()
	registry := prometheus.NewRegistry()
	exporter, err := otelprom.New(otelprom.WithRegisterer(registry))
	require.NoError(t, err)
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(exporter))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	return mp, func() scrape {
		t.Helper()
		rec := httptest.NewRecorder()
		promhttp.HandlerFor(registry, promhttp.HandlerOpts{}).ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
		require.Equal(t, 200, rec.Code)
		return parseScrape(t, rec.Body.String())
	}
}

// scrape is a /metrics page: each series, spelled `name{label="value",…}` with its
// labels sorted and the exporter's otel_scope_* labels left out, and its value.
type scrape map[string]float64

var (
	sampleLine = regexp.MustCompile(`^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$`)
	labelPair  = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"`)
)

func parseScrape(t *testing.T, body string) scrape {
	t.Helper()
	s := scrape{}
	for line := range strings.Lines(body) {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		m := sampleLine.FindStringSubmatch(line)
		require.NotNil(t, m, line)
		var labels []string
		for _, l := range labelPair.FindAllStringSubmatch(m[2], -1) {
			if !strings.HasPrefix(l[1], "otel_scope_") {
				labels = append(labels, l[0])
			}
		}
		slices.Sort(labels)
		v, err := strconv.ParseFloat(m[3], 64)
		require.NoError(t, err, line)
		s[m[1]+"{"+strings.Join(labels, ",")+"}"] = v
	}
	return s
}

// names returns the metric names of the scrape's series.
func (s scrape) names() []string {
	var names []string
	for series := range s {
		names = append(names, series[:strings.IndexByte(series, '{')])
	}
	slices.Sort(names)
	return slices.Compact(names)
}

// matching returns the series whose name is name.
func (s scrape) matching(name string) scrape {
	got := scrape{}
	for series, v := range s {
		if strings.HasPrefix(series, name+"{") {
			got[series] = v
		}
	}
	return got
}

// demoTargets returns the demo contracts: demo-payments serves demo.charge, demo-notify
// demo.notify, demo-objects demo.object.
func demoTargets(t *testing.T) *target.Targets {
	t.Helper()
	targets, err := target.New(simtarget.DemoContracts("http://127.0.0.1:1")...)
	require.NoError(t, err)
	return targets
}
