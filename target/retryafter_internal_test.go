package target

import (
	"math"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestRetryAfterNeverOverflows: a Retry-After of seconds too many for a time.Duration
// is the longest wait, never one that overflowed to a negative one (which the
// dispatcher read as no wait at all).
func TestRetryAfterNeverOverflows(t *testing.T) {
	t.Parallel()
	longest := time.Duration(math.MaxInt64/int64(time.Second)) * time.Second
	for header, want := range map[string]time.Duration{
		"120":                   2 * time.Minute,
		" 7 ":                   7 * time.Second,
		"0":                     0,
		"-1":                    0,
		"soon":                  0,
		"9223372037":            longest,
		"99999999999999":        longest,
		"99999999999999999999":  longest,
		"-99999999999999999999": 0,
		time.Now().Add(-time.Hour).UTC().Format(http.TimeFormat): 0,
	} {
		require.Equal(t, want, retryAfter(header), "%q", header)
	}
	future := retryAfter(time.Now().Add(time.Hour).UTC().Format(http.TimeFormat))
	require.True(t, future > 58*time.Minute && future <= time.Hour, "%v", future)
}
