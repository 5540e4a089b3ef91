package brokertest_test

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/brokertest"
	"github.com/opbroker/opbroker/embeddedpg"
)

// TestBuildKeepsItsFolderUntilRemove: a build goes into a folder of the temporary
// directory that stays locked until Remove, so that the next build's removal of the
// folders killed test binaries left (their lock free and over a minute old) takes
// theirs and leaves it; Remove takes it. A small command of this module stands in for
// the broker.
func TestBuildKeepsItsFolderUntilRemove(t *testing.T) {
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	const prefix = "brokertest-bin-"
	killed := filepath.Join(tmp, prefix+"killed")
	require.NoError(t, os.Mkdir(killed, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(killed, "lock"), nil, 0o600))
	age(t, killed)

	path, remove, err := brokertest.Build("../cmd/simtarget", prefix)
	require.NoError(t, err)
	require.NoDirExists(t, killed, "a killed binary's folder is removed by the next build")
	require.FileExists(t, path)
	dir := filepath.Dir(path)
	require.Equal(t, tmp, filepath.Dir(dir))
	age(t, dir)
	embeddedpg.RemoveOrphans(tmp, prefix)
	require.FileExists(t, path, "a live build's folder is kept")
	remove()
	require.NoDirExists(t, dir)
}

// age makes the lock file of dir as old as a killed binary's.
func age(t *testing.T, dir string) {
	t.Helper()
	old := time.Now().Add(-2 * time.Minute)
	require.NoError(t, os.Chtimes(filepath.Join(dir, "lock"), old, old))
}
