package chaos

import (
	"context"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestTheOperatorWaitsForAReplica: an operator who finds every replica down (the end of
// a run stops those armed with a crash point, and the supervisor starts them again a
// moment later) keeps looking until its time is up, rather than giving up at the first
// look.
func TestTheOperatorWaitsForAReplica(t *testing.T) {
	t.Parallel()
	down := &replica{exited: make(chan struct{})}
	close(down.exited)
	c := &cluster{replicas: []*replica{down}}
	ctx, cancel := context.WithTimeout(context.Background(), 600*time.Millisecond)
	defer cancel()
	_, err := c.resolveEscalations(ctx, rand.New(rand.NewPCG(1, 2)))
	require.ErrorIs(t, err, context.DeadlineExceeded, "it looked until its time was up")
	require.ErrorContains(t, err, "no replica to list them with: no replica is running")
}
