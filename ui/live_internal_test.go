package ui

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
)

// TestWhichRefusalsAreAskedAgain: the refusals that pass end a live stream with a retry
// (the delay the refusal names, when longer); the others are errors the page takes as
// final.
func TestWhichRefusalsAreAskedAgain(t *testing.T) {
	t.Parallel()
	withDelay := func(c codes.Code, d time.Duration) error {
		st, err := status.New(c, "refused").WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(d)})
		require.NoError(t, err)
		return st.Err()
	}
	for _, tc := range []struct {
		err   error
		after time.Duration
		ok    bool
	}{
		{status.Error(codes.ResourceExhausted, "the watch limit"), time.Second, true},
		{withDelay(codes.ResourceExhausted, 2500*time.Millisecond), 2500 * time.Millisecond, true},
		{withDelay(codes.ResourceExhausted, 10*time.Millisecond), time.Second, true},
		{status.Error(codes.Unavailable, "the ledger database is unavailable"), 3 * time.Second, true},
		{status.Error(codes.NotFound, "no such operation"), 0, false},
		{status.Error(codes.PermissionDenied, "another tenant's"), 0, false},
		{status.Error(codes.Unauthenticated, "the session ended"), 0, false},
		{errors.New("not a status"), 0, false},
		{nil, 0, false},
	} {
		after, ok := retryLater(tc.err)
		require.Equal(t, tc.ok, ok, "%v", tc.err)
		require.Equal(t, tc.after, after, "%v", tc.err)
	}
}
