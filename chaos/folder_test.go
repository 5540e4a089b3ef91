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
	folder := func(name string, age time.Duration) string {
		dir := filepath.Join(tmp, name)
		require.NoError(t, os.Mkdir(dir, 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(dir, "principals.yaml"), []byte("secret"), 0o600))
		lock := filepath.Join(dir, "lock")
		require.NoError(t, os.WriteFile(lock, nil, 0o600))
		at := time.Now().Add(-age)
		require.NoError(t, os.Chtimes(lock, at, at))
		return dir
	}
	killed := folder(runFolder+"killed", 2*time.Minute)
	live := folder(runFolder+"live", 2*time.Minute)
	held, err := embeddedpg.LockFolder(live)
	require.NoError(t, err)
	defer held.Close()
	begun := folder(runFolder+"begun", 0)
	other := folder(pgFolder+"other", 2*time.Minute)

	dir, lock, err := makeRunFolder()
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
	_, err = embeddedpg.LockFolder(dir)
	require.Error(t, err, "the new run's folder is locked")
}
