package startstop_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/opbroker/opbroker/startstop"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// service counts its bodies running at once and in all.
type service struct {
	startstop.Base
	running, most, runs atomic.Int32
}

func (s *service) Start(ctx context.Context) {
	s.Base.Start(ctx, func(ctx context.Context) {
		n := s.running.Add(1)
		for m := s.most.Load(); n > m && !s.most.CompareAndSwap(m, n); m = s.most.Load() {
		}
		s.runs.Add(1)
		<-ctx.Done()
		s.running.Add(-1)
	})
}

func TestLifecycle(t *testing.T) {
	t.Parallel()
	var s service
	s.Stop() // safe without Start
	require.False(t, s.Running())

	s.Start(t.Context())
	s.Start(t.Context()) // does nothing while running
	require.True(t, s.Running())
	s.Stop()
	s.Stop() // idempotent
	require.False(t, s.Running())
	require.Zero(t, s.running.Load(), "Stop returns once the body has returned")
	require.Equal(t, int32(1), s.runs.Load())

	s.Start(t.Context()) // restartable
	require.True(t, s.Running())
	s.Stop()
	require.Equal(t, int32(2), s.runs.Load())
}

// TestStartStopStress: Start and Stop from many goroutines at once never run two
// bodies together, never leave one running after the last Stop, and leak nothing.
func TestStartStopStress(t *testing.T) {
	t.Parallel()
	var s service
	var wg sync.WaitGroup
	for i := range 16 {
		wg.Go(func() {
			for j := range 200 {
				if (i+j)%2 == 0 {
					s.Start(t.Context())
				} else {
					s.Stop()
				}
			}
		})
	}
	wg.Wait()
	s.Stop()
	require.False(t, s.Running())
	require.Zero(t, s.running.Load())
	require.LessOrEqual(t, s.most.Load(), int32(1), "one body at a time")
	require.Positive(t, s.runs.Load())
}
