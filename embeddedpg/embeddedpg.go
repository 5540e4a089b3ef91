// Package embeddedpg runs a private PostgreSQL server in a data folder, for `opbroker
// dev` and for tests when no database is given.
//
// It uses the PostgreSQL binaries installed on the machine when it finds them, and
// otherwise lets github.com/fergusstrange/embedded-postgres download them. PostgreSQL
// refuses to run as root; as root the server runs as an unprivileged user (postgres, or
// else nobody) through wrapper scripts that drop privileges with setpriv(1).
//
// Layout of the data folder:
//
//	pg/data/   the cluster (reused across restarts; owned by the server's user)
//	runtime/   scratch space of the library, emptied at every start
//	wrappers/  root only: the privilege-dropping wrappers, owned by root
//	tmp/       the library's log of the latest start
//	lock       held by the process running the server
package embeddedpg

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	embeddedpostgres "github.com/fergusstrange/embedded-postgres"

	"github.com/opbroker/opbroker/loopback"
)

// Config says where and how to run the server.
type Config struct {
	// DataDir holds the cluster and everything else the server needs; it is created if
	// missing and reused if present.
	DataDir string
	// Port to listen on at 127.0.0.1; 0 picks a free one.
	Port uint32
	// Restarted says that CrashRestart will start the server again on its port: a port
	// Start picks is then one below the kernel's range of ephemeral ports (package
	// loopback), which no loopback connection can take while the server is down.
	Restarted bool
	// BinDir is a directory containing bin/pg_ctl, bin/initdb and bin/postgres; empty
	// means look for installed binaries, then download.
	BinDir string
	// Template makes a new cluster a copy of one kept in the temporary directory, which
	// initdb makes once per user, binaries and time zone (template.go): for the
	// tests and the chaos run, which start many servers. Such clusters share a system
	// identifier. Without installed binaries, when the template cannot be used, or when
	// the server does not start on the copy (the template is then removed), initdb
	// runs.
	Template bool
	// Logger receives PostgreSQL's start-up output; nil discards it.
	Logger io.Writer
	// NoFsync runs the server with fsync off. With synchronous_commit on (nothing here
	// turns it off) a commit still hands the write-ahead log to the kernel before it
	// returns, so no committed transaction is lost to a crash of the server
	// (CrashRestart); a crash of the machine could lose some and leave the cluster
	// corrupt. For the tests' servers, whose folders are thrown away, so that a commit
	// (and every TRUNCATE) waits for no disk. Never for the dev command, whose folder
	// outlives reboots, nor the chaos run or a benchmark, whose commits must wait for
	// the disk as a real server's do.
	NoFsync bool

	// templates is the folder that holds the templates' folder; empty means the
	// temporary directory. The tests that change the templates give each their own, so
	// that they run side by side.
	templates string
}

// serverParameters are the settings the server always runs with: loopback only, no Unix
// socket (its directory may not be writable), room for many test connections, and its
// messages untranslated (Start reads one: a port taken).
var serverParameters = map[string]string{
	"listen_addresses":        "127.0.0.1",
	"unix_socket_directories": "",
	"max_connections":         "200",
	"lc_messages":             "C",
}

// parameters returns the settings a server of cfg runs with.
func parameters(cfg Config) map[string]string {
	params := maps.Clone(serverParameters)
	if cfg.NoFsync {
		params["fsync"] = "off"
	}
	return params
}

// Server is a running embedded PostgreSQL.
type Server struct {
	ep      *embeddedpostgres.EmbeddedPostgres
	url     string
	dataDir string
	lock    *os.File
	tools   string // the directory holding bin/pg_ctl (or its wrapper)
	// the settings it was started with; CrashRestart starts it with them again
	params map[string]string
	port   uint32
}

// pgData is the server's cluster folder.
func (s *Server) pgData() string { return clusterDir(s.dataDir) }

// Start initialises the cluster if needed and starts the server. It blocks until the
// server accepts connections.
func Start(ctx context.Context, cfg Config) (*Server, error) {
	dataDir, err := filepath.Abs(cfg.DataDir)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dataDir, 0o755); err != nil {
		return nil, fmt.Errorf("embeddedpg: %w", err)
	}
	lock, err := lockDataDir(dataDir)
	if err != nil {
		return nil, err
	}
	srv, err := start(dataDir, cfg)
	// A free port is free only until the server binds it: another process (the embedded
	// server of another package's tests, started at the same moment) may take it first.
	for try := 1; err != nil && cfg.Port == 0 && portTaken(err) && try < portTries; try++ {
		srv, err = start(dataDir, cfg)
	}
	if err != nil {
		lock.Close()
		return nil, err
	}
	srv.lock = lock
	return srv, nil
}

// StartTemp starts a server of cfg in a new folder of the temporary directory, named
// prefix and a random suffix (cfg.DataDir is not used), open to the server's user
// (another user when we are root). First it stops and removes the orphans that killed
// processes left under that prefix (RemoveOrphans). The caller ends it with
// StopAndRemove.
func StartTemp(ctx context.Context, prefix string, cfg Config) (*Server, error) {
	dir, err := newTempFolder(prefix)
	if err != nil {
		return nil, err
	}
	cfg.DataDir = dir
	srv, err := Start(ctx, cfg)
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	return srv, nil
}

// TempFolder is StartTemp's folder without a server, for a process that keeps its own
// files there: it removes prefix's orphans (RemoveOrphans), makes the folder and locks
// it for the process's life, as RemoveOrphans reads it (the kernel releases the lock
// however the process ends). remove removes the folder, then gives up the lock.
func TempFolder(prefix string) (dir string, remove func(), err error) {
	if dir, err = newTempFolder(prefix); err != nil {
		return "", nil, err
	}
	lock, err := lockDataDir(dir)
	if err != nil {
		os.RemoveAll(dir)
		return "", nil, err
	}
	return dir, func() {
		os.RemoveAll(dir)
		lock.Close()
	}, nil
}

// newTempFolder removes prefix's orphans in the temporary directory, then makes a new
// folder of prefix there, searchable by all: as root, the server runs as another user.
func newTempFolder(prefix string) (string, error) {
	parent := tempDir()
	RemoveOrphans(parent, prefix)
	dir, err := os.MkdirTemp(parent, prefix)
	if err != nil {
		return "", fmt.Errorf("embeddedpg: %w", err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		os.RemoveAll(dir)
		return "", fmt.Errorf("embeddedpg: %w", err)
	}
	return dir, nil
}

// StopAndRemove stops a server of StartTemp and removes its folder. A server that did
// not stop keeps its folder, unlocked, so that a later StartTemp of the same prefix (a
// minute or more after this one's) finds it, stops it and removes it (RemoveOrphans).
func (s *Server) StopAndRemove() error {
	if err := s.Stop(); err != nil {
		return fmt.Errorf("%w (its folder %s is left for a later start to remove)", err, s.dataDir)
	}
	return os.RemoveAll(s.dataDir)
}

func start(dataDir string, cfg Config) (*Server, error) {
	port := cfg.Port
	if port == 0 {
		var err error
		if port, err = freePort(cfg.Restarted); err != nil {
			return nil, fmt.Errorf("embeddedpg: %w", err)
		}
	}
	logger := cfg.Logger
	if logger == nil {
		logger = io.Discard
	}

	binDir := cfg.BinDir
	if binDir == "" {
		binDir = InstalledBinaries()
	}
	pgData := clusterDir(dataDir)
	params := parameters(cfg)
	runtimeDir := filepath.Join(dataDir, "runtime")
	tools := runtimeDir // where the library extracts downloaded binaries
	epCfg := embeddedpostgres.DefaultConfig().
		Port(port).
		RuntimePath(runtimeDir).
		DataPath(pgData).
		Logger(logger).
		StartParameters(params).
		Username(superuser).
		Password(password).
		Encoding(clusterEncoding).
		Locale(clusterLocale)

	var version string
	initialised := false // pgData holds a cluster; only known with installed binaries
	if binDir != "" {
		major, line, err := binariesVersion(binDir)
		if err != nil {
			return nil, err
		}
		version = line
		if initialised, err = checkDataVersion(pgData, major); err != nil {
			return nil, err
		}
		epCfg = epCfg.Version(embeddedpostgres.PostgresVersion(fmt.Sprintf("%d.0.0", major))).BinariesPath(binDir)
		tools = binDir
	}

	var runAs *owner // the account the server runs as, when it is not ours
	if os.Geteuid() == 0 {
		if binDir == "" {
			return nil, errors.New("embeddedpg: running as root needs installed PostgreSQL server binaries (e.g. the Debian package postgresql); none were found")
		}
		var err error
		if runAs, err = serverOwner(); err != nil {
			return nil, err
		}
		wrappers, err := dropPrivileges(dataDir, binDir, runAs)
		if err != nil {
			return nil, err
		}
		epCfg = epCfg.BinariesPath(wrappers)
		tools = wrappers
	}
	stopOrphan(tools, pgData)
	var template string // the template pgData is a copy of
	if cfg.Template && binDir != "" && !initialised {
		var err error
		if template, err = seed(cfg.templates, pgData, binDir, version, filepath.Join(tools, "bin", "initdb"), runAs); err != nil {
			fmt.Fprintf(logger, "embeddedpg: the template cluster was not used, initdb runs: %v\n", err)
		}
	}

	ep := embeddedpostgres.NewDatabase(epCfg)
	if err := startKeepingLogs(ep, filepath.Join(dataDir, "tmp")); err != nil {
		if template != "" && !portTaken(err) {
			// A template that copies but does not start (damaged, or made by other
			// binaries at the same path) would fail every start: drop it and the copy.
			fmt.Fprintf(logger, "embeddedpg: the server did not start on a copy of the template %s, which is removed; initdb runs: %v\n", template, err)
			if err := errors.Join(removeTemplate(template), os.RemoveAll(pgData)); err != nil {
				return nil, fmt.Errorf("embeddedpg: %w", err)
			}
			cfg.Template = false
			return start(dataDir, cfg)
		}
		return nil, fmt.Errorf("embeddedpg: start in %s: %w", dataDir, err)
	}
	return &Server{
		ep:      ep,
		url:     fmt.Sprintf("postgres://%s:%s@127.0.0.1:%d/postgres?sslmode=disable", superuser, password, port),
		dataDir: dataDir,
		tools:   tools,
		params:  params,
		port:    port,
	}, nil
}

// CrashRestart stops the server as a crash would (immediate mode: no checkpoint, every
// session cut; the next start recovers from the write-ahead log) and starts it again on
// the same port, which Config.Restarted keeps free meanwhile. It returns once the server
// accepts connections. For fault injection.
func (s *Server) CrashRestart() error {
	pgCtl := filepath.Join(s.tools, "bin", "pg_ctl")
	if out, err := exec.Command(pgCtl, "stop", "-D", s.pgData(), "-m", "immediate", "-w").CombinedOutput(); err != nil {
		return fmt.Errorf("embeddedpg: immediate stop: %w: %s", err, out)
	}
	options := fmt.Sprintf("-p %d", s.port)
	for _, k := range slices.Sorted(maps.Keys(s.params)) {
		options += fmt.Sprintf(" -c %s='%s'", k, s.params[k])
	}
	logFile := filepath.Join(filepath.Dir(s.pgData()), "restart.log")
	if out, err := exec.Command(pgCtl, "start", "-D", s.pgData(), "-w", "-o", options, "-l", logFile).CombinedOutput(); err != nil {
		return fmt.Errorf("embeddedpg: restart: %w: %s", err, out)
	}
	return nil
}

// URL is the connection string of the server's postgres database.
func (s *Server) URL() string { return s.url }

// Stop shuts the server down (fast mode: sessions are ended, committed data is safe) and
// releases the data folder.
func (s *Server) Stop() error {
	defer s.lock.Close()
	if err := s.ep.Stop(); err != nil {
		return fmt.Errorf("embeddedpg: stop: %w", err)
	}
	return nil
}

// lockDataDir takes an exclusive lock on the data folder for the life of the process
// (the kernel releases it however the process ends), so that two processes never run a
// server on one folder and a server found running under the lock is an orphan.
func lockDataDir(dataDir string) (*os.File, error) {
	f, err := os.OpenFile(lockFile(dataDir), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, fmt.Errorf("embeddedpg: %w", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, fmt.Errorf("embeddedpg: %s is in use by another process (another opbroker dev?)", dataDir)
		}
		return nil, fmt.Errorf("embeddedpg: lock %s: %w", dataDir, err)
	}
	return f, nil
}

// clusterDir is where a data folder keeps its cluster; lockFile, its lock.
func clusterDir(dataDir string) string { return filepath.Join(dataDir, "pg", "data") }
func lockFile(dataDir string) string   { return filepath.Join(dataDir, "lock") }

// stopOrphan stops a server left running on pgData by a process that was killed, with
// the pg_ctl of the tools that started it. Under the folder's lock no live owner can be
// using it.
func stopOrphan(tools, pgData string) {
	if _, err := os.Stat(filepath.Join(pgData, "postmaster.pid")); err != nil {
		return
	}
	pgCtl := filepath.Join(tools, "bin", "pg_ctl")
	if _, err := os.Stat(pgCtl); err != nil {
		return
	}
	// A stale pid file with no server behind it makes pg_ctl fail; PostgreSQL itself
	// removes such a file at start, so the error is of no interest.
	_ = exec.Command(pgCtl, "stop", "-D", pgData, "-m", "fast", "-w").Run()
}

// stopServer stops the server of pgData, as pg_ctl's fast stop does (SIGINT, then a
// wait for it to end), and reports whether none runs there now. RemoveOrphans uses it
// rather than stopOrphan: it does not know which binaries (or, as root, which wrappers)
// started a folder's server, and it checks, unlike pg_ctl, that the process the pid file
// names is that server (a stale file's ID may be another process's by now).
func stopServer(pgData string) bool {
	pid, running := postmaster(pgData)
	if !running {
		return true
	}
	if err := syscall.Kill(pid, syscall.SIGINT); err != nil {
		return errors.Is(err, syscall.ESRCH)
	}
	for deadline := time.Now().Add(stopWait); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if !serves(pid, pgData) { // its pid file goes a moment before it does
			return true
		}
	}
	return false
}

// stopWait bounds stopServer's wait for a server to end.
const stopWait = 30 * time.Second

// postmaster returns the process ID in pgData's pid file, and whether that process is
// a server of pgData: its command line names the folder (after a reboot, a stale
// file's ID may be another process's).
func postmaster(pgData string) (int, bool) {
	b, err := os.ReadFile(filepath.Join(pgData, "postmaster.pid"))
	if err != nil {
		return 0, false
	}
	line, _, _ := strings.Cut(string(b), "\n")
	pid, err := strconv.Atoi(strings.TrimSpace(line))
	if err != nil || pid <= 0 {
		return 0, false
	}
	return pid, serves(pid, pgData)
}

// serves reports whether process pid is alive and its command line names pgData (Linux's
// /proc; an ended process not yet reaped has an empty one).
func serves(pid int, pgData string) bool {
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	return err == nil && slices.Contains(strings.Split(string(cmdline), "\x00"), pgData)
}

// RemoveOrphans stops the servers, and removes the data folders, that processes killed
// before they stopped their server (a test binary that panicked or ran out of time)
// left in parent under names beginning with prefix. A folder is an orphan when it and
// its lock file are this user's, the lock file was made at least orphanAge ago, and no
// process holds the lock now: for folders that one process makes, uses and leaves,
// such as the tests' (a folder used again, such as opbroker dev's, is unlocked between
// its uses). It needs Linux's /proc, and does nothing without it. Best effort: what
// cannot be stopped or removed is left.
func RemoveOrphans(parent, prefix string) {
	if _, err := os.Stat("/proc/self/cmdline"); err != nil {
		return
	}
	entries, err := os.ReadDir(parent)
	if err != nil {
		return
	}
	for _, e := range entries {
		if !e.IsDir() || !strings.HasPrefix(e.Name(), prefix) {
			continue // a link is not followed
		}
		dir := filepath.Join(parent, e.Name())
		folder, err := os.Lstat(dir)
		if err != nil || !ours(folder) {
			continue
		}
		lockInfo, err := os.Lstat(lockFile(dir))
		if err != nil || !lockInfo.Mode().IsRegular() || !ours(lockInfo) || time.Since(lockInfo.ModTime()) < orphanAge {
			continue // never started, just started, or not ours
		}
		lock, err := lockDataDir(dir)
		if err != nil {
			continue // its process lives
		}
		if stopServer(clusterDir(dir)) {
			os.RemoveAll(dir)
		}
		lock.Close()
	}
}

// orphanAge is how long ago a folder's lock file must have been made for RemoveOrphans:
// a process locks its folder moments after making it.
const orphanAge = time.Minute

// ours reports whether the file fi describes is this user's.
func ours(fi os.FileInfo) bool {
	st, ok := fi.Sys().(*syscall.Stat_t)
	return ok && int(st.Uid) == os.Geteuid()
}

// tmpdirMu makes starts one at a time where they change TMPDIR (two at once would each
// put back what the other set), and tempDir read it when none does.
var tmpdirMu sync.Mutex

// tempDir is the process's temporary directory, not the folder a start points TMPDIR at
// meanwhile.
func tempDir() string {
	tmpdirMu.Lock()
	defer tmpdirMu.Unlock()
	return os.TempDir()
}

// startKeepingLogs starts ep with the process's temporary directory pointed at tmpDir,
// emptied first: the library writes a log file there at every start and never removes
// it. It changes the environment of the whole process while it runs: this package reads
// TMPDIR through tempDir, and a goroutine of the process that reads it otherwise may
// find that folder.
func startKeepingLogs(ep *embeddedpostgres.EmbeddedPostgres, tmpDir string) error {
	tmpdirMu.Lock()
	defer tmpdirMu.Unlock()
	if err := os.RemoveAll(tmpDir); err != nil {
		return err
	}
	if err := os.MkdirAll(tmpDir, 0o700); err != nil {
		return err
	}
	previous, had := os.LookupEnv("TMPDIR")
	os.Setenv("TMPDIR", tmpDir)
	defer func() {
		if had {
			os.Setenv("TMPDIR", previous)
		} else {
			os.Unsetenv("TMPDIR")
		}
	}()
	return ep.Start()
}

// portTaken reports whether err is a start's that found its port taken: before the
// start (the library's check) or when the server bound it.
func portTaken(err error) bool {
	return strings.Contains(err.Error(), "already listening on port") ||
		strings.Contains(err.Error(), "Address already in use")
}

// portTries is how many ports Start tries when it picks them and the server finds one
// taken.
const portTries = 5

// freePort returns a port of 127.0.0.1 that no one listened on a moment ago, below the
// ephemeral range for a server that is restarted (Config.Restarted); a variable for
// tests.
var freePort = func(restarted bool) (uint32, error) {
	if restarted {
		ports, err := loopback.Ports(1)
		if err != nil {
			return 0, err
		}
		return uint32(ports[0]), nil
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return uint32(l.Addr().(*net.TCPAddr).Port), nil
}

// InstalledBinaries returns a directory containing bin/pg_ctl of an installed PostgreSQL,
// or "" when there is none: pg_ctl on PATH first, then the usual package locations,
// newest version first.
func InstalledBinaries() string {
	if p, err := exec.LookPath("pg_ctl"); err == nil {
		if real, err := filepath.EvalSymlinks(p); err == nil {
			dir := filepath.Dir(filepath.Dir(real))
			if hasServer(dir) {
				return dir
			}
		}
	}
	var candidates []string
	for _, pattern := range []string{"/usr/lib/postgresql/*", "/usr/pgsql-*", "/usr/local/pgsql", "/opt/homebrew/opt/postgresql@*", "/usr/local/opt/postgresql@*"} {
		matches, _ := filepath.Glob(pattern)
		candidates = append(candidates, matches...)
	}
	sort.Slice(candidates, func(i, j int) bool { return versionOf(candidates[i]) > versionOf(candidates[j]) })
	for _, dir := range candidates {
		if hasServer(dir) {
			return dir
		}
	}
	return ""
}

func hasServer(dir string) bool {
	for _, tool := range []string{"pg_ctl", "initdb", "postgres"} {
		if _, err := os.Stat(filepath.Join(dir, "bin", tool)); err != nil {
			return false
		}
	}
	return true
}

var trailingNumber = regexp.MustCompile(`(\d+)$`)

func versionOf(dir string) int {
	n, _ := strconv.Atoi(trailingNumber.FindString(dir))
	return n
}

var versionOutput = regexp.MustCompile(`\(PostgreSQL\) (\d+)`)

// binariesVersion asks the binaries in binDir for their version: the major version, and
// the line postgres --version prints.
func binariesVersion(binDir string) (int, string, error) {
	out, err := exec.Command(filepath.Join(binDir, "bin", "postgres"), "--version").Output()
	if err != nil {
		return 0, "", fmt.Errorf("embeddedpg: %s/bin/postgres --version: %w", binDir, err)
	}
	m := versionOutput.FindSubmatch(out)
	if m == nil {
		return 0, "", fmt.Errorf("embeddedpg: cannot read the version of %s/bin/postgres", binDir)
	}
	major, err := strconv.Atoi(string(m[1]))
	return major, strings.TrimSpace(string(out)), err
}

// checkDataVersion reports whether pgData holds a cluster, and refuses one of another
// major version: the library would otherwise delete it and start afresh.
func checkDataVersion(pgData string, major int) (bool, error) {
	b, err := os.ReadFile(filepath.Join(pgData, "PG_VERSION"))
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("embeddedpg: %w", err)
	}
	if have := strings.TrimSpace(string(b)); have != strconv.Itoa(major) {
		return true, fmt.Errorf("embeddedpg: %s holds a PostgreSQL %s cluster but the binaries are version %d; use another data folder or matching binaries", pgData, have, major)
	}
	return true, nil
}
