package embeddedpg

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/loopback"
)

// TestStartRefusesClusterOfAnotherVersion: the library would wipe a data folder whose
// version does not match; we refuse instead, and the cluster stays.
func TestStartRefusesClusterOfAnotherVersion(t *testing.T) {
	binDir := InstalledBinaries()
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

// TestCrashRestartKeepsCommittedData: an immediate stop loses no committed transaction;
// the server comes back on the same address.
func TestCrashRestartKeepsCommittedData(t *testing.T) {
	if InstalledBinaries() == "" {
		t.Skip("no installed PostgreSQL binaries")
	}
	srv := startInTempDir(t, Config{Restarted: true, Template: true})
	defer srv.Stop()
	if end, ok := loopback.Range(); ok {
		require.Less(t, int(srv.port), end, "a port no connection can take while the server is down")
	}
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, srv.URL())
	require.NoError(t, err)
	_, err = conn.Exec(ctx, `CREATE TABLE kept (v int); INSERT INTO kept VALUES (42)`)
	require.NoError(t, err)

	require.NoError(t, srv.CrashRestart())
	require.Error(t, conn.Ping(ctx), "every session was cut")
	conn, err = pgx.Connect(ctx, srv.URL())
	require.NoError(t, err)
	defer conn.Close(ctx)
	var v int
	require.NoError(t, conn.QueryRow(ctx, `SELECT v FROM kept`).Scan(&v))
	require.Equal(t, 42, v)
}

// TestStartTriesAnotherPortWhenOneIsTaken: the port Start picks may be taken before the
// server binds it (by another package's test server, started at the same moment); it
// then starts on another.
func TestStartTriesAnotherPortWhenOneIsTaken(t *testing.T) {
	if InstalledBinaries() == "" {
		t.Skip("no installed PostgreSQL binaries")
	}
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer taken.Close()
	pick := freePort
	t.Cleanup(func() { freePort = pick })
	picked := 0
	freePort = func(restarted bool) (uint32, error) {
		picked++
		if picked == 1 {
			return uint32(taken.Addr().(*net.TCPAddr).Port), nil
		}
		return pick(restarted)
	}
	srv := startInTempDir(t, Config{Template: true})
	defer srv.Stop()
	require.Equal(t, 2, picked)
	conn, err := pgx.Connect(context.Background(), srv.URL())
	require.NoError(t, err)
	require.NoError(t, conn.Close(context.Background()))
}

// TestPortTaken: both ways a start finds its port taken are told from other failures:
// the library's check before the start, and the server's bind.
func TestPortTaken(t *testing.T) {
	for msg, taken := range map[string]bool{
		"process already listening on port 41379": true,
		`could not start postgres using pg_ctl start: LOG:  could not bind IPv4 address "127.0.0.1": Address already in use`: true,
		"could not start postgres using pg_ctl start: FATAL:  data directory has invalid permissions":                        false,
	} {
		require.Equal(t, taken, portTaken(errors.New(msg)), msg)
	}
}

// startInTempDir starts a server of cfg on a new data folder, removed after the test.
func startInTempDir(t *testing.T, cfg Config) *Server {
	t.Helper()
	dataDir, err := os.MkdirTemp("", "embeddedpg-")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dataDir) })
	require.NoError(t, os.Chmod(dataDir, 0o755)) // the server may run as another user
	cfg.DataDir = dataDir
	srv, err := Start(context.Background(), cfg)
	require.NoError(t, err)
	return srv
}

// TestNewClustersAreCopiesOfTheTemplate: with Template, initdb runs once and every new
// cluster is a copy of what it made (initdb draws a cluster's system identifier; the
// copies share it), which the server can write to: as root, the copy is the server
// user's.
func TestNewClustersAreCopiesOfTheTemplate(t *testing.T) {
	if InstalledBinaries() == "" {
		t.Skip("no installed PostgreSQL binaries")
	}
	tmp := openTempDir(t)
	t.Setenv("TMPDIR", tmp)
	systemID := func(cfg Config) int64 {
		srv := startInTempDir(t, cfg)
		defer srv.Stop()
		ctx := context.Background()
		conn, err := pgx.Connect(ctx, srv.URL())
		require.NoError(t, err)
		defer conn.Close(ctx)
		_, err = conn.Exec(ctx, `CREATE TABLE written (v int); INSERT INTO written VALUES (1); CHECKPOINT`)
		require.NoError(t, err)
		var id int64
		require.NoError(t, conn.QueryRow(ctx, `SELECT system_identifier FROM pg_control_system()`).Scan(&id))
		return id
	}
	first, second := systemID(Config{Template: true}), systemID(Config{Template: true})
	require.Equal(t, first, second, "both clusters are copies of one template")
	templates, err := filepath.Glob(filepath.Join(tmp, "opbroker-pg-templates-*", "*", "PG_VERSION"))
	require.NoError(t, err)
	require.Len(t, templates, 1)
	require.NotEqual(t, first, systemID(Config{}), "without the template, initdb makes the cluster")
}

// TestATemplateFolderOthersCanWriteIsNotUsed: another user could plant a cluster in a
// template folder that is not ours alone; the server then starts on a cluster of its
// own initdb.
func TestATemplateFolderOthersCanWriteIsNotUsed(t *testing.T) {
	if InstalledBinaries() == "" {
		t.Skip("no installed PostgreSQL binaries")
	}
	tmp := openTempDir(t)
	t.Setenv("TMPDIR", tmp)
	folder := filepath.Join(tmp, fmt.Sprintf("opbroker-pg-templates-%d", os.Geteuid()))
	require.NoError(t, os.Mkdir(folder, 0o777))
	require.NoError(t, os.Chmod(folder, 0o777))
	var log strings.Builder
	srv := startInTempDir(t, Config{Template: true, Logger: &log})
	defer srv.Stop()
	require.Contains(t, log.String(), "the template cluster was not used, initdb runs: "+folder+" is not a folder of this user's alone")
	entries, err := os.ReadDir(folder)
	require.NoError(t, err)
	require.Empty(t, entries)
	conn, err := pgx.Connect(context.Background(), srv.URL())
	require.NoError(t, err)
	require.NoError(t, conn.Close(context.Background()))
}

// openTempDir returns a new folder in the temporary directory that every user can
// search, as the server's user must when we are root.
func openTempDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "embeddedpg-tmp-")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	require.NoError(t, os.Chmod(dir, 0o755))
	return dir
}
