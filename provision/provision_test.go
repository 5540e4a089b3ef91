package provision

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestWithParams(t *testing.T) {
	params := map[string]string{"search_path": "ledger", "role": "opbroker"}
	for conn, want := range map[string]string{
		"postgres://admin@127.0.0.1:5432/test?sslmode=disable": "postgres://admin@127.0.0.1:5432/test?role=opbroker&search_path=ledger&sslmode=disable",
		"host=127.0.0.1 dbname=test":                           "host=127.0.0.1 dbname=test role=opbroker search_path=ledger",
	} {
		got, err := WithParams(conn, params)
		require.NoError(t, err)
		require.Equal(t, want, got)
	}
	_, err := WithParams("postgres://%zz", params)
	require.Error(t, err, "a URL that does not parse")
}
