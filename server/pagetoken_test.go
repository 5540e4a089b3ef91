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
	tok := encodePageToken(pageToken{Tenant: "acme", Filter: filterKey(states), After: after})

	got, err := decodePageToken(tok, "acme", []store.State{store.StatePrepared, store.StateUnknown})
	require.NoError(t, err, "the filter's order does not matter")
	require.Equal(t, after, got.UUID)

	_, err = decodePageToken(tok, "globex", states)
	require.Error(t, err)
	_, err = decodePageToken(tok, "acme", nil)
	require.Error(t, err)
}

// FuzzPageToken: whatever a client sends, decoding never panics and never yields a
// position unless the token was made for the requesting tenant and filter.
func FuzzPageToken(f *testing.F) {
	f.Add(encodePageToken(pageToken{Tenant: "acme", After: uuid.Must(uuid.NewV7())}), "acme")
	f.Add(encodePageToken(pageToken{Tenant: "globex", After: uuid.Must(uuid.NewV7())}), "acme")
	f.Add("", "acme")
	f.Add("e30", "acme")
	f.Fuzz(func(t *testing.T, token, tenant string) {
		after, err := decodePageToken(token, tenant, nil)
		if err != nil {
			require.False(t, after.Valid)
			return
		}
		if token == "" {
			require.False(t, after.Valid)
			return
		}
		raw, decodeErr := base64.RawURLEncoding.DecodeString(token)
		require.NoError(t, decodeErr)
		var tok pageToken
		require.NoError(t, json.Unmarshal(raw, &tok))
		require.Equal(t, tenant, tok.Tenant, "a token never crosses tenants")
		require.True(t, after.Valid)
	})
}
