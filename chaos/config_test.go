package chaos

import (
	"bytes"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestLogsTakeOneWriteAtATime: the run's workers, fault injector and replicas' readers
// all write progress to the same Log and ReplicaLogs, which a caller may give as a plain
// bytes.Buffer; every line arrives whole (and the race detector sees no race).
func TestLogsTakeOneWriteAtATime(t *testing.T) {
	var buf bytes.Buffer
	cfg := Config{Log: &buf, ReplicaLogs: &buf}
	cfg.setDefaults()
	var wg sync.WaitGroup
	for w := range 8 {
		out := cfg.Log
		if w%2 == 1 {
			out = cfg.ReplicaLogs
		}
		wg.Go(func() {
			for range 500 {
				_, _ = out.Write([]byte("a whole line\n"))
			}
		})
	}
	wg.Wait()
	require.Equal(t, strings.Repeat("a whole line\n", 8*500), buf.String())
}
