// Package targettest runs a simulated target with its demo contracts for tests.
package targettest

import (
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/target"
)

// Demo runs a simulated target with cfg for the test and returns it with the contracts
// that describe it (simtarget.Contracts), tuned for fast tests (1s timeouts, lookups visible after 300ms) and then
// changed by adjust. Both are closed at cleanup.
func Demo(t testing.TB, cfg simtarget.Config, adjust ...func(*target.Contract)) (*simtarget.Target, *target.Targets) {
	t.Helper()
	sim := simtarget.New(cfg)
	srv := httptest.NewServer(sim)
	t.Cleanup(srv.Close)
	t.Cleanup(sim.Close)
	contracts := simtarget.Contracts(srv.URL, cfg)
	for _, c := range contracts {
		c.Endpoint.Timeout = target.Duration(time.Second)
		if c.Lookup != nil {
			c.Lookup.VisibilityDelay = target.Duration(300 * time.Millisecond)
		}
		for _, f := range adjust {
			f(c)
		}
	}
	targets, err := target.New(contracts...)
	require.NoError(t, err)
	return sim, targets
}

// BearerFile returns a bearer credential read from a file of its own that holds token,
// and the file's path: a test rotates the credential by writing the file.
func BearerFile(t testing.TB, token string) (*target.Auth, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "token")
	require.NoError(t, os.WriteFile(path, []byte(token), 0o600))
	return &target.Auth{Scheme: target.AuthBearer, Secret: target.Secret{File: path}}, path
}
