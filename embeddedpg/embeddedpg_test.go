package embeddedpg

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestStartRefusesClusterOfAnotherVersion: the library would wipe a data folder whose
// version does not match; we refuse instead, and the cluster stays.
func TestStartRefusesClusterOfAnotherVersion(t *testing.T) {
	binDir := findInstalled()
	if binDir == "" {
		t.Skip("no installed PostgreSQL binaries")
	}
	major, err := majorVersion(binDir)
	require.NoError(t, err)

	dataDir := t.TempDir()
	pgData := filepath.Join(dataDir, "pg", "data")
	require.NoError(t, os.MkdirAll(pgData, 0o700))
	versionFile := filepath.Join(pgData, "PG_VERSION")
	require.NoError(t, os.WriteFile(versionFile, []byte("9\n"), 0o600))
	precious := filepath.Join(pgData, "precious")
	require.NoError(t, os.WriteFile(precious, []byte("data"), 0o600))

	_, err = Start(context.Background(), Config{DataDir: dataDir, BinDir: binDir})
	require.ErrorContains(t, err, "PostgreSQL 9 cluster")
	require.FileExists(t, precious, "the existing cluster is left alone")
	require.NoError(t, checkDataVersion(t.TempDir(), major), "an empty folder is fine")
}

func TestReachable(t *testing.T) {
	open, err := os.MkdirTemp("", "embeddedpg-reachable-")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(open) })
	require.NoError(t, os.Chmod(open, 0o755))
	require.NoError(t, reachable(open))

	private := filepath.Join(open, "private")
	require.NoError(t, os.Mkdir(private, 0o700))
	inside := filepath.Join(private, "data")
	require.NoError(t, os.Mkdir(inside, 0o755))
	require.ErrorContains(t, reachable(inside), "not searchable")
}
