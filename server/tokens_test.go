package server

import (
	"encoding/base64"
	"encoding/json"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/store"
)

func TestPageTokenRoundTrip(t *testing.T) {
	t.Parallel()
	states := []store.State{store.StateUnknown, store.StatePrepared}
	after := uuid.Must(uuid.NewV7())
	tok := encodeToken(pageToken{tokenScope: newScope("acme", states), After: after})

	got, err := decodePageToken(tok, newScope("acme", []store.State{store.StatePrepared, store.StateUnknown}))
	require.NoError(t, err, "the filter's order does not matter")
	require.Equal(t, after, got.UUID)

	_, err = decodePageToken(tok, newScope("globex", states))
	requireReason(t, err, "PAGE_TOKEN_MISMATCH")
	_, err = decodePageToken(tok, newScope("acme", nil))
	requireReason(t, err, "PAGE_TOKEN_MISMATCH")
	_, err = decodePageToken(tok, newScope("acme", states, "intent-1", ""))
	requireReason(t, err, "PAGE_TOKEN_MISMATCH")

	searched := encodeToken(pageToken{tokenScope: newScope("acme", states, "intent-1", ""), After: after})
	require.NotContains(t, searched, "intent-1")
	got, err = decodePageToken(searched, newScope("acme", states, "intent-1", ""))
	require.NoError(t, err)
	require.Equal(t, after, got.UUID)
	for _, other := range [][]string{{"intent-2", ""}, {"", "intent-1"}, {"intent-1", "ref"}} {
		_, err = decodePageToken(searched, newScope("acme", states, other...))
		requireReason(t, err, "PAGE_TOKEN_MISMATCH")
	}
	_, err = decodePageToken(encodeResumeToken(newScope("acme", states), store.FeedCursor{}), newScope("acme", states))
	requireReason(t, err, "PAGE_TOKEN_INVALID")
}

func TestResumeTokenRoundTrip(t *testing.T) {
	t.Parallel()
	states := []store.State{store.StateSucceeded}
	cursor := store.FeedCursor{After: store.FeedPosition{Xact: 900, Seq: 12},
		Ahead: []store.FeedPosition{{Xact: 901, Seq: 3}, {Xact: 900, Seq: 13}}}
	tok := encodeResumeToken(newScope("acme", states), cursor)

	got, err := decodeResumeToken(tok, newScope("acme", states))
	require.NoError(t, err)
	require.Equal(t, cursor, got)

	_, err = decodeResumeToken(tok, newScope("globex", states))
	requireReason(t, err, "RESUME_TOKEN_MISMATCH")
	_, err = decodeResumeToken(tok, newScope("acme", nil))
	requireReason(t, err, "RESUME_TOKEN_MISMATCH")
	_, err = decodeResumeToken(encodeToken(pageToken{tokenScope: newScope("acme", states), After: uuid.New()}), newScope("acme", states))
	requireReason(t, err, "RESUME_TOKEN_INVALID")
	behind := store.FeedCursor{After: cursor.After, Ahead: []store.FeedPosition{cursor.After}}
	_, err = decodeResumeToken(encodeResumeToken(newScope("acme", states), behind), newScope("acme", states))
	requireReason(t, err, "RESUME_TOKEN_INVALID")
}

func requireReason(t *testing.T, err error, reason string) {
	t.Helper()
	var invalid *invalidArgumentError
	require.ErrorAs(t, err, &invalid)
	require.Len(t, invalid.violations, 1)
	require.Equal(t, reason, invalid.violations[0].GetReason())
}

// FuzzPageToken: whatever a client sends, decoding never panics and never yields a
// position unless the token was made for the requesting tenant and filter.
func FuzzPageToken(f *testing.F) {
	f.Add(encodeToken(pageToken{tokenScope: newScope("acme", nil), After: uuid.Must(uuid.NewV7())}), "acme")
	f.Add(encodeToken(pageToken{tokenScope: newScope("globex", nil), After: uuid.Must(uuid.NewV7())}), "acme")
	f.Add("", "acme")
	f.Add("e30", "acme")
	f.Fuzz(func(t *testing.T, token, tenant string) {
		after, err := decodePageToken(token, newScope(tenant, nil))
		if err != nil || token == "" {
			require.False(t, after.Valid)
			return
		}
		requireTokenOf(t, token, tenant)
		require.True(t, after.Valid)
	})
}

// FuzzResumeToken: the same for resume tokens, and a decoded cursor is well-formed.
func FuzzResumeToken(f *testing.F) {
	cursor := store.FeedCursor{After: store.FeedPosition{Xact: 5, Seq: 1}, Ahead: []store.FeedPosition{{Xact: 6, Seq: 2}}}
	f.Add(encodeResumeToken(newScope("acme", nil), cursor), "acme")
	f.Add(encodeResumeToken(newScope("globex", nil), cursor), "acme")
	f.Add("e30", "acme")
	f.Fuzz(func(t *testing.T, token, tenant string) {
		got, err := decodeResumeToken(token, newScope(tenant, nil))
		if err != nil {
			require.Zero(t, got.After)
			return
		}
		requireTokenOf(t, token, tenant)
		require.GreaterOrEqual(t, got.After.Xact, int64(0))
	})
}

func requireTokenOf(t *testing.T, token, tenant string) {
	t.Helper()
	raw, err := base64.RawURLEncoding.DecodeString(token)
	require.NoError(t, err)
	var scope tokenScope
	require.NoError(t, json.Unmarshal(raw, &scope))
	require.Equal(t, tenant, scope.Tenant, "a token never crosses tenants")
}
