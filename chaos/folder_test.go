package chaos

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/embeddedpg"
)

// TestARunRemovesTheFoldersOfKilledRuns: a run's folder is locked for the run's life,
// and the next run removes the folders whose runs were killed before they removed them
// (their lock free, made over a minute ago), never a live run's, one just begun, or
// another prefix's.
func TestARunRemovesTheFoldersOfKilledRuns(t *testing.T) {
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	folder := func(name string, old time.Duration) string {
		dir := filepath.Join(tmp, name)
		require.NoError(t, os.Mkdir(dir, 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(dir, "principals.yaml"), []byte("secret"), 0o600))
		require.NoError(t, os.WriteFile(filepath.Join(dir, "lock"), nil, 0o600))
		age(t, dir, old)
		return dir
	}
	live, held, err := embeddedpg.TempFolder(runFolder)
	require.NoError(t, err)
	defer held.Close()
	age(t, live, 2*time.Minute)
	killed := folder(runFolder+"killed", 2*time.Minute)
	begun := folder(runFolder+"begun", 0)
	other := folder(pgFolder+"other", 2*time.Minute)

	dir, lock, err := embeddedpg.TempFolder(runFolder)
	require.NoError(t, err)
	defer lock.Close()
	require.NoDirExists(t, killed, "a killed run's folder is removed")
	for _, kept := range []string{live, begun, other} {
		require.DirExists(t, kept)
	}
	require.Equal(t, tmp, filepath.Dir(dir))
	require.True(t, strings.HasPrefix(filepath.Base(dir), runFolder), dir)
	fi, err := os.Stat(dir)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o755), fi.Mode().Perm(), "PostgreSQL may run as another user")
	age(t, dir, 2*time.Minute)
	embeddedpg.RemoveOrphans(tmp, runFolder)
	require.DirExists(t, dir, "the new run's folder is locked")
}

// age makes the lock file of dir as old as RemoveOrphans asks of a killed run's.
func age(t *testing.T, dir string, by time.Duration) {
	at := time.Now().Add(-by)
	require.NoError(t, os.Chtimes(filepath.Join(dir, "lock"), at, at))
}
