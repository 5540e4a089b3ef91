package embeddedpg

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/loopback"
)

// TestStartRefusesClusterOfAnotherVersion: the library would wipe a data folder whose
// version does not match; we refuse instead, and the cluster stays.
func TestStartRefusesClusterOfAnotherVersion(t *testing.T) {
	t.Parallel()
	binDir := InstalledBinaries()
	if binDir == "" {
		t.Skip("no installed PostgreSQL binaries")
	}
	major, _, err := binariesVersion(binDir)
	require.NoError(t, err)

	dataDir := openTempDir(t)
	pgData := clusterDir(dataDir)
	require.NoError(t, os.MkdirAll(pgData, 0o700))
	versionFile := filepath.Join(pgData, "PG_VERSION")
	require.NoError(t, os.WriteFile(versionFile, []byte("9\n"), 0o600))
	precious := filepath.Join(pgData, "precious")
	require.NoError(t, os.WriteFile(precious, []byte("data"), 0o600))

	_, err = Start(context.Background(), Config{DataDir: dataDir, BinDir: binDir})
	require.ErrorContains(t, err, "PostgreSQL 9 cluster")
	require.FileExists(t, precious, "the existing cluster is left alone")
	_, err = checkDataVersion(openTempDir(t), major)
	require.NoError(t, err, "an empty folder is fine")
}

func TestReachable(t *testing.T) {
	t.Parallel()
	open := openTempDir(t)
	require.NoError(t, reachable(open))

	private := filepath.Join(open, "private")
	require.NoError(t, os.Mkdir(private, 0o700))
	inside := filepath.Join(private, "data")
	require.NoError(t, os.Mkdir(inside, 0o755))
	require.ErrorContains(t, reachable(inside), "not searchable")
}

// TestCrashRestartKeepsCommittedData: an immediate stop loses no committed transaction,
// even with fsync off (Config.NoFsync, which the restart keeps); the server comes back on
// the same address.
func TestCrashRestartKeepsCommittedData(t *testing.T) {
	t.Parallel()
	if InstalledBinaries() == "" {
		t.Skip("no installed PostgreSQL binaries")
	}
	srv := startInTempDir(t, Config{Restarted: true, Template: true, NoFsync: true})
	defer srv.Stop()
	if end, ok := loopback.Range(); ok {
		require.Less(t, int(srv.port), end, "a port no connection can take while the server is down")
	}
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, srv.URL())
	require.NoError(t, err)
	requireFsync(t, conn, "off")
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
	requireFsync(t, conn, "off")
}

// requireFsync checks the server's fsync setting.
func requireFsync(t *testing.T, conn *pgx.Conn, want string) {
	t.Helper()
	var fsync string
	require.NoError(t, conn.QueryRow(context.Background(), `SHOW fsync`).Scan(&fsync))
	require.Equal(t, want, fsync)
}

// TestFsyncIsOffOnlyWhenAsked: a Config without NoFsync leaves fsync at PostgreSQL's
// default (on), as the dev command, the chaos run and the benchmarks need; NoFsync turns
// it off; the settings every server shares are never changed.
func TestFsyncIsOffOnlyWhenAsked(t *testing.T) {
	t.Parallel()
	require.NotContains(t, parameters(Config{}), "fsync")
	require.Equal(t, "off", parameters(Config{NoFsync: true})["fsync"])
	require.NotContains(t, serverParameters, "fsync", "the settings every server shares are left as they were")
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
	requireServes(t, srv)
}

// TestStartsAtOnceLeaveTMPDIRAsItWas: a start points TMPDIR at a folder of its server's
// while the library writes its log; starts at once take turns, or each would put back
// what another had set. Not parallel: it reads TMPDIR when no other start runs.
func TestStartsAtOnceLeaveTMPDIRAsItWas(t *testing.T) {
	if InstalledBinaries() == "" {
		t.Skip("no installed PostgreSQL binaries")
	}
	before, had := os.LookupEnv("TMPDIR")
	var wg sync.WaitGroup
	for range 4 {
		dataDir := openTempDir(t)
		wg.Go(func() {
			srv, err := Start(context.Background(), Config{DataDir: dataDir, Template: true})
			if assert.NoError(t, err) {
				assert.NoError(t, srv.Stop())
			}
		})
	}
	wg.Wait()
	after, has := os.LookupEnv("TMPDIR")
	require.Equal(t, had, has)
	require.Equal(t, before, after)
}

// TestTheTemporaryDirectoryIsReadBetweenStarts: while a start has TMPDIR set to its
// server's folder, tempDir (where the templates are looked for) waits for it to put
// back what it found. Not parallel: it sets TMPDIR.
func TestTheTemporaryDirectoryIsReadBetweenStarts(t *testing.T) {
	before := os.TempDir()
	tmpdirMu.Lock() // as startKeepingLogs holds it
	previous, had := os.LookupEnv("TMPDIR")
	require.NoError(t, os.Setenv("TMPDIR", openTempDir(t)))
	read := make(chan string, 1)
	go func() { read <- tempDir() }()
	early := ""
	select {
	case early = <-read:
	case <-time.After(100 * time.Millisecond):
	}
	if had {
		os.Setenv("TMPDIR", previous)
	} else {
		os.Unsetenv("TMPDIR")
	}
	tmpdirMu.Unlock()
	require.Empty(t, early, "read while a start had TMPDIR set")
	require.Equal(t, before, <-read)
}

// TestATempFolderIsLockedAndRemovesKilledOnes: TempFolder's folder is locked for its
// process's life, and the next TempFolder of the prefix removes the folders whose
// processes were killed before they removed them (their lock free, made over a minute
// ago), never a live one, one just begun, or another prefix's; remove takes the folder.
func TestATempFolderIsLockedAndRemovesKilledOnes(t *testing.T) {
	tmp := openTempDir(t)
	t.Setenv("TMPDIR", tmp)
	const prefix = "test-run-"
	made := func(dir string, ago time.Duration) { // the folder's lock file was made ago
		t.Helper()
		at := time.Now().Add(-ago)
		require.NoError(t, os.Chtimes(lockFile(dir), at, at))
	}
	folder := func(name string, ago time.Duration) string {
		t.Helper()
		dir := filepath.Join(tmp, name)
		require.NoError(t, os.Mkdir(dir, 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(dir, "principals.yaml"), []byte("secret"), 0o600))
		require.NoError(t, os.WriteFile(lockFile(dir), nil, 0o600))
		made(dir, ago)
		return dir
	}
	live, removeLive, err := TempFolder(prefix)
	require.NoError(t, err)
	defer removeLive()
	made(live, 2*orphanAge)
	killed := folder(prefix+"killed", 2*orphanAge)
	begun := folder(prefix+"begun", 0)
	other := folder("test-pg-other", 2*orphanAge)

	dir, remove, err := TempFolder(prefix)
	require.NoError(t, err)
	require.NoDirExists(t, killed, "a killed process's folder is removed")
	for _, kept := range []string{live, begun, other} {
		require.DirExists(t, kept)
	}
	require.Equal(t, tmp, filepath.Dir(dir))
	require.True(t, strings.HasPrefix(filepath.Base(dir), prefix), dir)
	fi, err := os.Stat(dir)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o755), fi.Mode().Perm(), "PostgreSQL may run as another user")
	made(dir, 2*orphanAge)
	RemoveOrphans(tmp, prefix)
	require.DirExists(t, dir, "the new folder is locked")
	remove()
	require.NoDirExists(t, dir)
}

// TestOrphansAreStoppedAndRemoved: a folder whose process died with its server running
// (its lock released, as the kernel releases it) is an orphan once its lock file is a
// minute old: its server is stopped and the folder removed. A folder whose lock is held,
// one locked moments ago, and one of another name are left.
func TestOrphansAreStoppedAndRemoved(t *testing.T) {
	t.Parallel()
	if InstalledBinaries() == "" {
		t.Skip("no installed PostgreSQL binaries")
	}
	parent := openTempDir(t)
	made := func(dir string, ago time.Duration) { // the folder's lock file was made ago
		t.Helper()
		at := time.Now().Add(-ago)
		require.NoError(t, os.Chtimes(lockFile(dir), at, at))
	}
	// folder makes a data folder whose lock file was made ago; its lock is held (as
	// by a live process) when held is set, and released otherwise.
	folder := func(name string, ago time.Duration, held bool) string {
		t.Helper()
		dir := filepath.Join(parent, name)
		require.NoError(t, os.Mkdir(dir, 0o755))
		lock, err := lockDataDir(dir)
		require.NoError(t, err)
		if held {
			t.Cleanup(func() { lock.Close() })
		} else {
			require.NoError(t, lock.Close())
		}
		made(dir, ago)
		return dir
	}
	orphanDir := filepath.Join(parent, "test-pg-orphan")
	orphan, err := Start(context.Background(), Config{DataDir: orphanDir, Template: true})
	require.NoError(t, err)
	t.Cleanup(func() { orphan.Stop() })
	require.NoError(t, orphan.lock.Close()) // its process is gone
	made(orphanDir, 2*orphanAge)
	left := []string{
		folder("test-pg-young", 0, false),
		folder("test-pg-live", 2*orphanAge, true),
		folder("other-orphan", 2*orphanAge, false),
	}

	pid, running := postmaster(orphan.pgData())
	require.True(t, running)
	// The kernel releases a dead process's lock at once; a lock closed here stays held a
	// moment longer when another test of this binary has just forked (the child holds a
	// copy of the descriptor until it execs), and RemoveOrphans then leaves the folder
	// for a later call, as it should.
	require.Eventually(t, func() bool {
		RemoveOrphans(parent, "test-pg-")
		_, err := os.Stat(orphanDir)
		return errors.Is(err, fs.ErrNotExist)
	}, 10*time.Second, 50*time.Millisecond, "the orphan's folder is removed")
	// (Not kill(pid, 0): an ended server is reparented to init, which may not reap it.)
	require.False(t, serves(pid, orphan.pgData()), "the orphan's server is stopped")
	for _, dir := range left {
		require.DirExists(t, dir)
	}
}

// TestStopAndRemove: a stopped server's folder goes; one whose stop failed (its server
// stopped beneath it, so that pg_ctl finds none) stays, unlocked, for RemoveOrphans.
func TestStopAndRemove(t *testing.T) {
	t.Parallel()
	if InstalledBinaries() == "" {
		t.Skip("no installed PostgreSQL binaries")
	}
	parent := openTempDir(t)
	stopped, err := Start(context.Background(), Config{DataDir: filepath.Join(parent, "stopped"), Template: true})
	require.NoError(t, err)
	t.Cleanup(func() { stopped.Stop() }) // if StopAndRemove failed
	require.NoError(t, stopped.StopAndRemove())
	require.NoDirExists(t, stopped.dataDir)

	failed, err := Start(context.Background(), Config{DataDir: filepath.Join(parent, "failed"), Template: true})
	require.NoError(t, err)
	require.True(t, stopServer(failed.pgData()))
	require.Error(t, failed.StopAndRemove())
	require.DirExists(t, failed.dataDir, "the folder of a server that did not stop is kept")
	// (A lock released in this process stays held while another test's just-forked
	// child has not yet run its program: TestOrphansAreStoppedAndRemoved.)
	require.Eventually(t, func() bool {
		lock, err := lockDataDir(failed.dataDir)
		if err == nil {
			lock.Close()
		}
		return err == nil
	}, 10*time.Second, 50*time.Millisecond, "and unlocked, for RemoveOrphans")
}

// TestClustersAreUTF8WhateverTheLocale: for a user whose session sets no locale
// (POSIX), initdb would make a SQL_ASCII cluster; the template's initdb and the
// library's both make a UTF-8 cluster with the C locale.
func TestClustersAreUTF8WhateverTheLocale(t *testing.T) {
	if InstalledBinaries() == "" {
		t.Skip("no installed PostgreSQL binaries")
	}
	t.Setenv("LC_ALL", "POSIX") // not parallel: the environment is the process's
	t.Setenv("LANG", "")
	for _, cfg := range []Config{{Template: true, templates: openTempDir(t)}, {}} {
		srv := startInTempDir(t, cfg)
		t.Cleanup(func() { srv.Stop() })
		conn, err := pgx.Connect(context.Background(), srv.URL())
		require.NoError(t, err)
		t.Cleanup(func() { conn.Close(context.Background()) })
		var encoding, collate, ctype string
		require.NoError(t, conn.QueryRow(context.Background(), `SELECT pg_encoding_to_char(encoding), datcollate, datctype
			FROM pg_database WHERE datname = current_database()`).Scan(&encoding, &collate, &ctype))
		require.Equal(t, []string{"UTF8", "C", "C"}, []string{encoding, collate, ctype}, "template: %v", cfg.Template)
	}
}

// TestPortTaken: both ways a start finds its port taken are told from other failures:
// the library's check before the start, and the server's bind.
func TestPortTaken(t *testing.T) {
	t.Parallel()
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
	cfg.DataDir = openTempDir(t)
	srv, err := Start(context.Background(), cfg)
	require.NoError(t, err)
	return srv
}

// requireServes checks that srv accepts a connection.
func requireServes(t *testing.T, srv *Server) {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), srv.URL())
	require.NoError(t, err)
	require.NoError(t, conn.Close(context.Background()))
}

// TestNewClustersAreCopiesOfTheTemplate: with Template, initdb runs once and every new
// cluster is a copy of what it made (initdb draws a cluster's system identifier; the
// copies share it), which the server can write to: as root, the copy is the server
// user's.
func TestNewClustersAreCopiesOfTheTemplate(t *testing.T) {
	if InstalledBinaries() == "" {
		t.Skip("no installed PostgreSQL binaries")
	}
	t.Parallel()
	tmp := openTempDir(t)
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
	first, second := systemID(Config{Template: true, templates: tmp}), systemID(Config{Template: true, templates: tmp})
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
	t.Parallel()
	tmp := openTempDir(t)
	folder := filepath.Join(tmp, fmt.Sprintf("opbroker-pg-templates-%d", os.Geteuid()))
	require.NoError(t, os.Mkdir(folder, 0o777))
	require.NoError(t, os.Chmod(folder, 0o777))
	var log strings.Builder
	srv := startInTempDir(t, Config{Template: true, Logger: &log, templates: tmp})
	defer srv.Stop()
	require.Contains(t, log.String(), "the template cluster was not used, initdb runs: "+folder+" is not a folder of this user's alone")
	entries, err := os.ReadDir(folder)
	require.NoError(t, err)
	require.Empty(t, entries)
	requireServes(t, srv)
}

// TestTheTemplateFolderMustBeOursAlone: the template folder is refused when others can
// write to it, when it is a symbolic link, and when it is another user's.
func TestTheTemplateFolderMustBeOursAlone(t *testing.T) {
	t.Parallel()
	tmp := openTempDir(t)
	folder := filepath.Join(tmp, fmt.Sprintf("opbroker-pg-templates-%d", os.Geteuid()))
	dir, err := templateDir(tmp, "/bin", "postgres (PostgreSQL) 15.20")
	require.NoError(t, err, "a folder it makes itself")
	require.Equal(t, folder, filepath.Dir(dir))

	refused := func(why string) {
		t.Helper()
		_, err := templateDir(tmp, "/bin", "postgres (PostgreSQL) 15.20")
		require.ErrorContains(t, err, folder+" is not a folder of this user's alone", why)
	}
	require.NoError(t, os.Chmod(folder, 0o777))
	refused("others can write to it")

	require.NoError(t, os.Remove(folder))
	ours := openTempDir(t)
	require.NoError(t, os.Symlink(ours, folder))
	refused("a symbolic link to a folder of ours")

	if os.Geteuid() == 0 {
		require.NoError(t, os.Remove(folder))
		require.NoError(t, os.Mkdir(folder, 0o755))
		runAs, err := serverOwner()
		require.NoError(t, err)
		require.NoError(t, os.Chown(folder, runAs.uid, runAs.gid))
		refused("another user's")
	}
}

// TestALostRaceForTheTemplateKeepsTheWinner: when another process made the template
// first, the one made after it is removed and the first stays.
func TestALostRaceForTheTemplateKeepsTheWinner(t *testing.T) {
	binDir := InstalledBinaries()
	if binDir == "" {
		t.Skip("no installed PostgreSQL binaries")
	}
	t.Parallel()
	dir, err := templateDir(openTempDir(t), binDir, "race")
	require.NoError(t, err)
	require.NoError(t, os.Mkdir(dir, 0o755))
	winner := filepath.Join(dir, "PG_VERSION")
	require.NoError(t, os.WriteFile(winner, []byte("the winner's"), 0o600))

	initdb, runAs := initdbFor(t, binDir)
	require.NoError(t, makeTemplate(dir, initdb, runAs))
	b, err := os.ReadFile(winner)
	require.NoError(t, err)
	require.Equal(t, "the winner's", string(b))
	entries, err := os.ReadDir(filepath.Dir(dir))
	require.NoError(t, err)
	require.Len(t, entries, 1, "the scratch folder is removed")
}

// TestLeftoversOfAKilledMakerAreRemoved: each new cluster made from a template removes
// the scratch folders and templates renamed aside that killed processes left in the
// templates' folder, of any key, and keeps those a live process holds locked, anything
// else, and what a link points to. (The template here is a folder with a PG_VERSION: it
// is only copied.)
func TestLeftoversOfAKilledMakerAreRemoved(t *testing.T) {
	t.Parallel()
	tmp := openTempDir(t)
	dir, err := templateDir(tmp, "bin", "leftovers")
	require.NoError(t, err)
	require.NoError(t, os.Mkdir(dir, 0o700))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "PG_VERSION"), []byte("15\n"), 0o600))
	root := filepath.Dir(dir)
	killed := []string{dir + ".new-killed", dir + ".removed-killed", filepath.Join(root, "0123456789abcdef.new-killed")}
	live := []string{dir + ".new-live", dir + ".removed-live"}
	for _, path := range append(append(killed, live...), dir+".other") {
		require.NoError(t, os.MkdirAll(filepath.Join(path, "data"), 0o700))
	}
	for _, path := range live {
		lock, err := lockFolder(path, false)
		require.NoError(t, err)
		defer lock.Close()
	}
	outside := filepath.Join(tmp, "outside")
	require.NoError(t, os.Mkdir(outside, 0o700))
	require.NoError(t, os.Symlink(outside, dir+".new-link"))

	_, err = seed(tmp, filepath.Join(tmp, "cluster"), "bin", "leftovers", "no initdb", nil)
	require.NoError(t, err)
	require.FileExists(t, filepath.Join(tmp, "cluster", "PG_VERSION"))
	for _, path := range killed {
		require.NoDirExists(t, path)
	}
	for _, path := range append(live, dir, dir+".other", outside) {
		require.DirExists(t, path)
	}
}

// TestAMakerLocksItsScratchFolder: while initdb runs, the scratch folder is locked, so
// that another process's removeLeftovers leaves it. Here initdb is a script that exits
// with flock(1)'s status for a lock of that folder without waiting.
func TestAMakerLocksItsScratchFolder(t *testing.T) {
	flock, err := exec.LookPath("flock")
	if err != nil {
		t.Skip("no flock(1)")
	}
	t.Parallel()
	tmp := openTempDir(t)
	dir, err := templateDir(tmp, "bin", "locked")
	require.NoError(t, err)
	initdb := filepath.Join(tmp, "initdb")
	script := fmt.Sprintf("#!/bin/sh\n# -D is the sixth argument\nexec %s -n \"${6%%/*}\" true\n", flock)
	require.NoError(t, os.WriteFile(initdb, []byte(script), 0o755))
	require.ErrorContains(t, makeTemplate(dir, initdb, nil), "initdb: exit status 1")
	entries, err := os.ReadDir(filepath.Dir(dir))
	require.NoError(t, err)
	require.Empty(t, entries, "the scratch folder is removed")
}

// TestATemplateBeingRemovedIsLeftToItsRemover: removeTemplate locks the template until
// it is gone, so a second remover (or removeLeftovers) leaves it to the first.
func TestATemplateBeingRemovedIsLeftToItsRemover(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(openTempDir(t), "template")
	require.NoError(t, os.Mkdir(dir, 0o700))
	lock, err := lockFolder(dir, false)
	require.NoError(t, err)
	require.NoError(t, removeTemplate(dir))
	require.DirExists(t, dir, "left to the process that holds it")
	require.NoError(t, lock.Close())
	require.NoError(t, removeTemplate(dir))
	require.NoDirExists(t, dir)
}

// TestATemplateThatDoesNotStartIsReplaced: a template whose copy does not start (here a
// setting PostgreSQL refuses) is removed, and the server starts on a cluster of its own
// initdb.
func TestATemplateThatDoesNotStartIsReplaced(t *testing.T) {
	if InstalledBinaries() == "" {
		t.Skip("no installed PostgreSQL binaries")
	}
	t.Parallel()
	tmp := openTempDir(t)
	srv := startInTempDir(t, Config{Template: true, templates: tmp})
	require.NoError(t, srv.Stop())
	templates, err := filepath.Glob(filepath.Join(tmp, "opbroker-pg-templates-*", "*", "postgresql.conf"))
	require.NoError(t, err)
	require.Len(t, templates, 1)
	conf, err := os.OpenFile(templates[0], os.O_APPEND|os.O_WRONLY, 0)
	require.NoError(t, err)
	_, err = conf.WriteString("no_such_setting = 1\n")
	require.NoError(t, err)
	require.NoError(t, conf.Close())

	var log strings.Builder
	srv = startInTempDir(t, Config{Template: true, Logger: &log, templates: tmp})
	defer srv.Stop()
	require.Contains(t, log.String(), "embeddedpg: the server did not start on a copy of the template "+filepath.Dir(templates[0])+", which is removed; initdb runs")
	require.NoDirExists(t, filepath.Dir(templates[0]))
	requireServes(t, srv)
}

// TestAsRootTheCopyIsMadeAsTheServersUser: as root, the template is the server user's,
// who could put in it a link to a file of root's; cp runs as that user, so what that
// user cannot read is not copied.
func TestAsRootTheCopyIsMadeAsTheServersUser(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("only as root")
	}
	t.Setenv("LC_ALL", "C") // cp's message, untranslated
	runAs, err := serverOwner()
	require.NoError(t, err)
	give := func(path string) {
		t.Helper()
		require.NoError(t, os.Chown(path, runAs.uid, runAs.gid))
	}
	template := filepath.Join(openTempDir(t), "template")
	require.NoError(t, os.Mkdir(template, 0o700))
	give(template)
	require.NoError(t, os.WriteFile(filepath.Join(template, "PG_VERSION"), []byte("15\n"), 0o600))
	give(filepath.Join(template, "PG_VERSION"))
	roots := filepath.Join(template, "roots")
	require.NoError(t, os.WriteFile(roots, []byte("root's alone"), 0o600))
	pg := filepath.Join(openTempDir(t), "pg")
	require.NoError(t, os.Mkdir(pg, 0o700))
	give(pg)
	pgData := filepath.Join(pg, "data")

	require.ErrorContains(t, copyCluster(template, pgData, runAs), "Permission denied")
	entries, err := os.ReadDir(pg)
	require.NoError(t, err)
	require.Empty(t, entries, "neither the cluster nor the unfinished copy is left")

	require.NoError(t, os.Remove(roots))
	require.NoError(t, copyCluster(template, pgData, runAs))
	fi, err := os.Stat(filepath.Join(pgData, "PG_VERSION"))
	require.NoError(t, err)
	require.Equal(t, uint32(runAs.uid), fi.Sys().(*syscall.Stat_t).Uid)
	require.Equal(t, os.FileMode(0o600), fi.Mode().Perm())
}

// TestACopyThatCannotTakeItsPlaceIsRemoved: when the cluster's folder is taken (not
// empty), the copy made beside it is removed.
func TestACopyThatCannotTakeItsPlaceIsRemoved(t *testing.T) {
	t.Parallel()
	template := filepath.Join(openTempDir(t), "template")
	require.NoError(t, os.Mkdir(template, 0o700))
	require.NoError(t, os.WriteFile(filepath.Join(template, "PG_VERSION"), []byte("15\n"), 0o600))
	pg := openTempDir(t)
	pgData := filepath.Join(pg, "data")
	require.NoError(t, os.Mkdir(pgData, 0o700))
	require.NoError(t, os.WriteFile(filepath.Join(pgData, "left"), nil, 0o600))

	require.Error(t, copyCluster(template, pgData, nil))
	entries, err := os.ReadDir(pg)
	require.NoError(t, err)
	require.Len(t, entries, 1, "only the folder that was there")
}

// initdbFor returns the initdb that makes a template, and the user it runs as: as root,
// the privilege-dropping wrapper and the server's user.
func initdbFor(t *testing.T, binDir string) (string, *owner) {
	t.Helper()
	if os.Geteuid() != 0 {
		return filepath.Join(binDir, "bin", "initdb"), nil
	}
	runAs, err := serverOwner()
	require.NoError(t, err)
	wrappers, err := dropPrivileges(openTempDir(t), binDir, runAs)
	require.NoError(t, err)
	return filepath.Join(wrappers, "bin", "initdb"), runAs
}

// tempRoot is the temporary directory as the tests began: while a server starts, TMPDIR
// names a folder of its own (startKeepingLogs), and the tests run side by side.
var tempRoot = os.TempDir()

// openTempDir returns a new folder in the temporary directory that every user can
// search, as the server's user must when we are root.
func openTempDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp(tempRoot, "embeddedpg-")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	require.NoError(t, os.Chmod(dir, 0o755))
	return dir
}
