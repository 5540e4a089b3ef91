package payload

import (
	"bytes"
	"encoding/json"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestIsJSON(t *testing.T) {
	t.Parallel()
	for ct, want := range map[string]bool{
		"application/json":                true,
		"application/json; charset=utf-8": true,
		"application/merge-patch+json":    true,
		"APPLICATION/JSON":                true,
		"application/octet-stream":        false,
		"text/plain":                      false,
		"application/jsonx":               false,
		"not a media type":                false,
	} {
		require.Equal(t, want, IsJSON(ct), ct)
	}
}

func TestHashJSONIgnoresInsignificantDifferences(t *testing.T) {
	t.Parallel()
	a := []byte(`{"amount":100,"currency":"EUR","meta":{"b":[1,2],"a":"\u00e9"}}`)
	variants := [][]byte{
		[]byte("{\n  \"currency\": \"EUR\",\n  \"amount\": 1e2,\n  \"meta\": {\"a\": \"é\", \"b\": [1.0, 2]}\n}"),
		[]byte(`{"meta":{"a":"é","b":[1,2]},"currency":"EUR","amount":100.000}`),
	}
	want, err := Hash("application/json", a)
	require.NoError(t, err)
	for _, v := range variants {
		got, err := Hash("application/json", v)
		require.NoError(t, err)
		require.Equal(t, want, got, string(v))
	}
}

func TestHashJSONDistinguishesSignificantDifferences(t *testing.T) {
	t.Parallel()
	base, err := Hash("application/json", []byte(`{"amount":100}`))
	require.NoError(t, err)
	for _, other := range []string{`{"amount":101}`, `{"amount":"100"}`, `{"amount":100,"x":null}`, `{"Amount":100}`, `[{"amount":100}]`} {
		got, err := Hash("application/json", []byte(other))
		require.NoError(t, err)
		require.NotEqual(t, base, got, other)
	}
}

func TestHashRawBytesForOtherContentTypes(t *testing.T) {
	t.Parallel()
	a, err := Hash("application/octet-stream", []byte(`{"a":1, "b":2}`))
	require.NoError(t, err)
	b, err := Hash("application/octet-stream", []byte(`{"b":2, "a":1}`))
	require.NoError(t, err)
	require.NotEqual(t, a, b)
	require.Len(t, a.String(), 64)
}

func TestCanonicalRejects(t *testing.T) {
	t.Parallel()
	for name, body := range map[string]string{
		"not json":            `{"amount":`,
		"two values":          `{} {}`,
		"trailing garbage":    `{"a":1}x`,
		"duplicate key":       `{"a":1,"a":2}`,
		"beyond double":       `{"id":9007199254740993}`,
		"precision lost":      `{"amount":0.30000000000000001}`,
		"out of range":        `{"x":1e400}`,
		"invalid utf8":        "{\"a\":\"\xff\"}",
		"empty":               ``,
		"lone surrogate only": `{"a":"\ud800"}`,
	} {
		_, err := Canonical("application/json", []byte(body))
		require.Error(t, err, name)
		require.True(t, errors.Is(err, ErrInvalid), name)
		require.NotContains(t, err.Error(), "amount", "errors must not quote payload content")
	}
}

func TestCanonicalAcceptsExactNumbers(t *testing.T) {
	t.Parallel()
	for _, body := range []string{`{"x":9007199254740992}`, `{"x":0.1}`, `{"x":-0}`, `{"x":1.5e-7}`, `{"x":123456789.25}`} {
		_, err := Canonical("application/json", []byte(body))
		require.NoError(t, err, body)
	}
}

// FuzzCanonical checks the properties the ledger relies on: canonicalisation is
// idempotent, survives re-serialisation by another encoder, and never merges two
// documents that decode to different values.
func FuzzCanonical(f *testing.F) {
	for _, seed := range []string{`{"amount":100,"currency":"EUR"}`, `[1,2.5,"x",null,true]`, `{"a":{"b":{"c":[]}}}`, `"\u00e9"`, `1e2`, `{"a":1,"a":2}`} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		canonical, err := Canonical("application/json", body)
		if err != nil {
			require.ErrorIs(t, err, ErrInvalid)
			return
		}
		again, err := Canonical("application/json", canonical)
		require.NoError(t, err)
		require.True(t, bytes.Equal(canonical, again), "not idempotent")

		var value any
		require.NoError(t, json.Unmarshal(body, &value))
		reencoded, err := json.Marshal(value)
		require.NoError(t, err)
		h1, err := Hash("application/json", body)
		require.NoError(t, err)
		h2, err := Hash("application/json", reencoded)
		require.NoError(t, err)
		require.Equal(t, h1, h2, "re-serialisation changed the hash")

		var fromCanonical any
		require.NoError(t, json.Unmarshal(canonical, &fromCanonical))
		require.Equal(t, value, fromCanonical, "canonical form decodes to another value")
	})
}

func TestMatches(t *testing.T) {
	const ct = "application/json"
	sent := []byte(`{ "b": 1, "a": "x" }`)
	digest, err := Hash(ct, sent)
	require.NoError(t, err)
	canonical, err := Canonical(ct, sent)
	require.NoError(t, err)
	require.True(t, Matches(ct, sent, digest[:]), "the bytes as accepted")
	require.True(t, Matches(ct, canonical, digest[:]), "their canonical form")
	require.False(t, Matches(ct, []byte(`{"a":"x","b":2}`), digest[:]), "changed bytes")
	require.False(t, Matches(ct, []byte(`{"a":"x","b":1`), digest[:]), "broken bytes")
	raw := []byte("not json")
	rawDigest, err := Hash("application/octet-stream", raw)
	require.NoError(t, err)
	require.True(t, Matches("application/octet-stream", raw, rawDigest[:]))
	require.False(t, Matches("application/octet-stream", []byte("not json!"), rawDigest[:]))
}
