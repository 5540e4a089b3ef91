package server

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/opbroker/opbroker/store"
)

// The time left before a failure may be recorded is said in whole seconds, rounded up:
// never sooner than the ledger would accept it.
func TestSendMayStillLandRoundsUp(t *testing.T) {
	t.Parallel()
	for wait, want := range map[time.Duration]time.Duration{
		time.Millisecond:        time.Second,
		time.Second:             time.Second,
		1500 * time.Millisecond: 2 * time.Second,
		time.Hour:               time.Hour,
	} {
		st := status.Convert(toStatus(context.Background(), slog.New(slog.DiscardHandler), &store.SendMayStillLandError{Wait: wait}))
		var info *errdetails.ErrorInfo
		var retry *errdetails.RetryInfo
		for _, d := range st.Details() {
			switch d := d.(type) {
			case *errdetails.ErrorInfo:
				info = d
			case *errdetails.RetryInfo:
				retry = d
			}
		}
		require.Equal(t, ReasonSendMayStillLand, info.GetReason())
		require.Equal(t, want, retry.GetRetryDelay().AsDuration(), wait)
		require.Equal(t, strconv.FormatInt(int64(want/time.Second), 10), info.GetMetadata()["retryAfterSeconds"], wait)
	}
}

// TestABoundOfTheBrokersOwnIsNotTheCallersDeadline: a store call cut by a bound of the
// broker's own (a combined write's, or an intent recorded alone after it) is the ledger
// not answering in time, UNAVAILABLE: a caller who set no deadline, or one that has
// not passed, is not told that its deadline passed.
func TestABoundOfTheBrokersOwnIsNotTheCallersDeadline(t *testing.T) {
	t.Parallel()
	cut := fmt.Errorf("store: prepare: %w", context.DeadlineExceeded)
	log := slog.New(slog.DiscardHandler)
	require.Equal(t, codes.Unavailable, status.Code(toStatus(context.Background(), log, cut)), "no deadline of the caller's")
	later, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	require.Equal(t, codes.Unavailable, status.Code(toStatus(later, log, cut)), "the caller's deadline still ahead")
	passed, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer cancel()
	require.Equal(t, codes.DeadlineExceeded, status.Code(toStatus(passed, log, cut)), "the caller's deadline passed")
}
