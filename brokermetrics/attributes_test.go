package brokermetrics_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/brokermetrics"
)

// Each pair of values is recorded under its own series, however often and in whatever
// order the pairs come.
func TestPairsRecordEachPairOfValues(t *testing.T) {
	t.Parallel()
	mp, scrapeNow := meters(t)
	counter, err := mp.Meter("test").Int64Counter("test.sends")
	require.NoError(t, err)
	pairs := brokermetrics.NewPairs("target", "class")
	for _, p := range [][2]string{{"a", "OK"}, {"a", "TIMEOUT"}, {"b", "OK"}, {"a", "OK"}, {"OK", "a"}} {
		counter.Add(context.Background(), 1, pairs.Of(p[0], p[1]))
	}
	got := scrapeNow()
	for series, want := range map[string]float64{
		`test_sends_total{class="OK",target="a"}`:      2,
		`test_sends_total{class="TIMEOUT",target="a"}`: 1,
		`test_sends_total{class="OK",target="b"}`:      1,
		`test_sends_total{class="a",target="OK"}`:      1,
	} {
		require.Equal(t, want, got[series], series)
	}
}
