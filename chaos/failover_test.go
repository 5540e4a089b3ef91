package chaos

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestUnavailabilityWindows: a failover's window runs from the prober's first failed
// call after it to its first acknowledged one after that, counts only the calls before
// the next failover, and, when no call is acknowledged again, runs to the last failed
// call and is marked not recovered.
func TestUnavailabilityWindows(t *testing.T) {
	t0 := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	at := func(s float64) time.Time { return t0.Add(time.Duration(s * float64(time.Second))) }
	const refused = "Unavailable DATABASE_UNAVAILABLE"
	for _, tc := range []struct {
		name      string
		calls     []call
		failovers []Failover
		want      []Failover
	}{{
		name:      "no call failed",
		calls:     []call{{at: at(1)}, {at: at(2)}},
		failovers: []Failover{{At: at(0)}},
		want:      []Failover{{At: at(0), Recovered: true}},
	}, {
		name:      "failed, then acknowledged",
		calls:     []call{{at: at(0.5)}, {at: at(1), failed: refused}, {at: at(3), failed: "DeadlineExceeded"}, {at: at(4.5)}, {at: at(5), failed: refused}},
		failovers: []Failover{{At: at(0.8)}},
		want: []Failover{{At: at(0.8), Unavailable: 3500 * time.Millisecond, Recovered: true,
			Refusals: map[string]int{refused: 1, "DeadlineExceeded": 1}}},
	}, {
		name:      "a call before the fault does not count",
		calls:     []call{{at: at(0), failed: refused}, {at: at(2)}},
		failovers: []Failover{{At: at(1)}},
		want:      []Failover{{At: at(1), Recovered: true}},
	}, {
		name:      "never acknowledged before the next failover, nor after the last",
		calls:     []call{{at: at(1), failed: refused}, {at: at(2), failed: refused}, {at: at(11), failed: refused}, {at: at(14), failed: refused}},
		failovers: []Failover{{At: at(0)}, {At: at(10)}},
		want: []Failover{
			{At: at(0), Unavailable: time.Second, Refusals: map[string]int{refused: 2}},
			{At: at(10), Unavailable: 3 * time.Second, Refusals: map[string]int{refused: 2}},
		},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			l := &callLog{}
			for i := len(tc.calls) - 1; i >= 0; i-- { // out of order: windows sorts them
				l.add(tc.calls[i])
			}
			l.windows(tc.failovers)
			require.Equal(t, tc.want, tc.failovers)
		})
	}
}
