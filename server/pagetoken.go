package server

import (
	"encoding/base64"
	"encoding/json"
	"slices"
	"strings"

	"github.com/google/uuid"

	"github.com/opbroker/opbroker/store"
)

// pageToken is the opaque continuation of a listing. It is bound to the tenant and the
// filter of the request that produced it: a token presented with another tenant or
// filter is rejected, so it can never be turned into a read of another tenant.
type pageToken struct {
	Version int       `json:"v"`
	Tenant  string    `json:"t"`
	Filter  string    `json:"f"`
	After   uuid.UUID `json:"a"`
}

const pageTokenVersion = 1

// filterKey is a canonical spelling of a state filter.
func filterKey(states []store.State) string {
	names := make([]string, len(states))
	for i, s := range states {
		names[i] = string(s)
	}
	slices.Sort(names)
	return strings.Join(names, ",")
}

func encodePageToken(tok pageToken) string {
	tok.Version = pageTokenVersion
	b, _ := json.Marshal(tok) // cannot fail for this type
	return base64.RawURLEncoding.EncodeToString(b)
}

// decodePageToken returns the position a token continues from. The empty token starts
// at the beginning.
func decodePageToken(token, tenant string, states []store.State) (uuid.NullUUID, error) {
	if token == "" {
		return uuid.NullUUID{}, nil
	}
	bad := invalidArgument(violation("page_token", "is not a page token of this listing; start again without one", "PAGE_TOKEN_INVALID"))
	b, err := base64.RawURLEncoding.DecodeString(token)
	if err != nil {
		return uuid.NullUUID{}, bad
	}
	var tok pageToken
	if err := json.Unmarshal(b, &tok); err != nil || tok.Version != pageTokenVersion || tok.After == uuid.Nil {
		return uuid.NullUUID{}, bad
	}
	if tok.Tenant != tenant || tok.Filter != filterKey(states) {
		return uuid.NullUUID{}, invalidArgument(violation("page_token", "belongs to another tenant or filter; start again without one", "PAGE_TOKEN_MISMATCH"))
	}
	return uuid.NullUUID{UUID: tok.After, Valid: true}, nil
}
