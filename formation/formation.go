// Package formation runs a replicated PostgreSQL on this machine the way production runs
// one: Patroni managing each PostgreSQL node, etcd holding the leader lock, every
// process on loopback and on its own, so that a node can be killed, stopped or restarted
// like a server. It serves the chaos run's failover mode and the benchmarks; it needs
// Debian's patroni and etcd-server packages and the PostgreSQL binaries.
//
// The formation runs Patroni's strict synchronous mode: a commit is acknowledged only
// once a standby has it, the leader lock passes only to that standby, and with no
// standby left commits wait rather than go unreplicated. Patroni restarts a node's
// PostgreSQL itself; a node killed as a whole (Patroni and PostgreSQL) stays down until
// Restart, and comes back as a standby of the new primary (pg_rewind).
package formation

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/opbroker/opbroker/embeddedpg"
	"github.com/opbroker/opbroker/loopback"
)

// EnvTest is the environment variable that, set to 1, makes the tests that start a
// formation run (they need Patroni and etcd, and take a minute or more): `make test-ha`
// and .ci/run set it.
const EnvTest = "OPBROKER_TEST_FORMATION"

// Config describes a formation.
type Config struct {
	// Dir holds every node's data and logs; it must be reachable by the unprivileged
	// user PostgreSQL runs as when we are root (not under a private directory).
	Dir string
	// Nodes is the number of PostgreSQL nodes (default 3: a primary and two standbys, so
	// that a failover leaves a synchronous standby behind).
	Nodes int
	// TTL is the leader lock's time to live (default 10s): how long a primary that
	// stopped answering keeps the lock before a standby takes it over.
	TTL time.Duration
	// Log receives etcd's output; nil discards it. Each node's Patroni and PostgreSQL
	// write to NAME.log in Dir.
	Log io.Writer
}

// Formation is a running formation.
type Formation struct {
	cfg   Config
	bin   string // PostgreSQL's bin directory
	cred  *syscall.Credential
	etcd  *exec.Cmd
	nodes []*node
}

type node struct {
	name    string
	pgPort  int
	apiPort int
	config  string // Patroni's configuration file
	data    string

	mu      sync.Mutex
	patroni *exec.Cmd
	exited  chan struct{}
}

// Start starts etcd and the nodes, and returns once one node is primary and every
// other streams from it, one of them synchronously.
func Start(ctx context.Context, cfg Config) (*Formation, error) {
	if cfg.Nodes <= 0 {
		cfg.Nodes = 3
	}
	if cfg.TTL <= 0 {
		cfg.TTL = 10 * time.Second
	}
	if cfg.Log == nil {
		cfg.Log = io.Discard
	}
	for _, tool := range []string{"patroni", "etcd"} {
		if _, err := exec.LookPath(tool); err != nil {
			return nil, fmt.Errorf("formation: %s not found: install Debian's patroni and etcd-server packages", tool)
		}
	}
	f := &Formation{cfg: cfg}
	if f.bin = embeddedpg.InstalledBinaries(); f.bin == "" {
		return nil, errors.New("formation: no installed PostgreSQL binaries")
	}
	f.bin = filepath.Join(f.bin, "bin")
	dir, err := filepath.Abs(cfg.Dir)
	if err != nil {
		return nil, err
	}
	f.cfg.Dir = dir
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("formation: %w", err)
	}
	if os.Geteuid() == 0 { // PostgreSQL refuses to run as root
		if f.cred, err = embeddedpg.ServerCredential(); err != nil {
			return nil, fmt.Errorf("formation: %w", err)
		}
	}
	ports, err := loopback.Ports(2 + 2*cfg.Nodes)
	if err != nil {
		return nil, err
	}
	if err := f.startEtcd(ports[0], ports[1]); err != nil {
		return nil, err
	}
	for i := range cfg.Nodes {
		n := &node{name: fmt.Sprintf("pg%d", i), pgPort: ports[2+2*i], apiPort: ports[3+2*i],
			data: filepath.Join(dir, fmt.Sprintf("pg%d", i))}
		n.config = filepath.Join(dir, n.name+".yaml")
		if err := os.WriteFile(n.config, []byte(f.patroniConfig(n, ports[0])), 0o644); err != nil {
			f.Close()
			return nil, fmt.Errorf("formation: %w", err)
		}
		f.nodes = append(f.nodes, n)
	}
	if err := f.chown(dir); err != nil {
		f.Close()
		return nil, err
	}
	// The first node bootstraps alone, so that it is the first primary; the others
	// then copy it.
	for i, n := range f.nodes {
		if err := f.startPatroni(n); err != nil {
			f.Close()
			return nil, err
		}
		if i == 0 {
			if _, err := f.waitPrimary(ctx, time.Minute); err != nil {
				f.Close()
				return nil, err
			}
		}
	}
	if err := f.WaitWhole(ctx, 2*time.Minute); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

func (f *Formation) startEtcd(client, peer int) error {
	clientURL, peerURL := fmt.Sprintf("http://127.0.0.1:%d", client), fmt.Sprintf("http://127.0.0.1:%d", peer)
	f.etcd = exec.Command("etcd", "--name", "etcd0", "--data-dir", filepath.Join(f.cfg.Dir, "etcd"),
		"--listen-client-urls", clientURL, "--advertise-client-urls", clientURL,
		"--listen-peer-urls", peerURL, "--initial-advertise-peer-urls", peerURL,
		"--initial-cluster", "etcd0="+peerURL, "--enable-v2", "--log-level", "warn")
	f.etcd.Stdout, f.etcd.Stderr = f.cfg.Log, f.cfg.Log
	f.etcd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := f.etcd.Start(); err != nil {
		return fmt.Errorf("formation: etcd: %w", err)
	}
	return nil
}

// patroniConfig is node n's Patroni configuration. Patroni talks to etcd through its v2
// API: there, Patroni (3.0.2, Debian 12's) renews the leader key by compare-and-swap on
// its own name, whereas through the v3 API it writes a new key outright when its lease
// has expired, over the key of the node that took over meanwhile. The chaos run found
// that: a primary stopped past the TTL, once continued, took the lock back, and the
// commits acknowledged by the node promoted in its place were rewound away. Patroni
// fixed it upstream after 3.0.2 (pull request 2689).
// The timings are a production's
// scaled down so that a run sees many failovers: the leader lock lives TTL, Patroni's
// loop runs every second. What keeps acknowledged commits is the synchronous mode (only
// the synchronous standby, which has every one of them, may be promoted), not a bound on
// lag: a primary stopped under load has written WAL its standbys never got, for commits
// it never acknowledged, and a small maximum_lag_on_failover would then forbid every
// failover.
func (f *Formation) patroniConfig(n *node, etcdPort int) string {
	return fmt.Sprintf(`scope: opbroker
name: %[1]s
restapi:
  listen: 127.0.0.1:%[2]d
  connect_address: 127.0.0.1:%[2]d
etcd:
  host: 127.0.0.1:%[3]d
bootstrap:
  dcs:
    ttl: %[4]d
    loop_wait: 1
    retry_timeout: %[5]d
    maximum_lag_on_failover: 1073741824
    synchronous_mode: true
    synchronous_mode_strict: true
    postgresql:
      use_pg_rewind: true
      parameters:
        wal_log_hints: "on"
        synchronous_commit: "on"
        max_connections: 300
        unix_socket_directories: ""
  initdb:
  - encoding: UTF8
  - auth: trust
  pg_hba:
  - host replication all 127.0.0.1/32 trust
  - host all all 127.0.0.1/32 trust
postgresql:
  listen: 127.0.0.1:%[6]d
  connect_address: 127.0.0.1:%[6]d
  data_dir: %[7]s
  bin_dir: %[8]s
  pgpass: %[9]s
  authentication:
    replication:
      username: postgres
    superuser:
      username: postgres
    rewind:
      username: postgres
  parameters:
    unix_socket_directories: ""
`, n.name, n.apiPort, etcdPort, int(f.cfg.TTL.Seconds()), max(2, int(f.cfg.TTL.Seconds())/3),
		n.pgPort, n.data, f.bin, filepath.Join(f.cfg.Dir, n.name+".pgpass"))
}

// chown hands dir to PostgreSQL's user when we are root.
func (f *Formation) chown(dir string) error {
	if f.cred == nil {
		return nil
	}
	return filepath.Walk(dir, func(path string, _ os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		return os.Lchown(path, int(f.cred.Uid), int(f.cred.Gid))
	})
}

func (f *Formation) startPatroni(n *node) error {
	logFile, err := os.OpenFile(filepath.Join(f.cfg.Dir, n.name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("formation: %w", err)
	}
	defer logFile.Close() // the child has its own copy
	cmd := exec.Command("patroni", n.config)
	cmd.Dir = f.cfg.Dir
	cmd.Env = append(os.Environ(), "HOME="+f.cfg.Dir)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	// Its own process group, so that a kill reaches Patroni and nothing else; the
	// PostgreSQL it starts has a session of its own, killed through its pid file. If
	// this process dies without Close (a test's timeout), Patroni is told to stop, and
	// stops its PostgreSQL.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: f.cred, Pdeathsig: syscall.SIGTERM}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("formation: patroni %s: %w", n.name, err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	n.mu.Lock()
	n.patroni, n.exited = cmd, exited
	n.mu.Unlock()
	return nil
}

// URL is a connection string that reaches the primary, whichever node it is: every node
// listed, target_session_attrs=read-write, a short connect timeout so that a node that
// does not answer is passed over.
func (f *Formation) URL() string {
	var hosts []string
	for _, n := range f.nodes {
		hosts = append(hosts, fmt.Sprintf("127.0.0.1:%d", n.pgPort))
	}
	return "postgres://postgres@" + strings.Join(hosts, ",") +
		"/postgres?sslmode=disable&target_session_attrs=read-write&connect_timeout=2"
}

// Nodes is the number of nodes.
func (f *Formation) Nodes() int { return len(f.nodes) }

// member is a node as Patroni's REST API describes it.
type member struct {
	Name  string `json:"name"`
	Role  string `json:"role"`  // leader, sync_standby, replica
	State string `json:"state"` // running, streaming, starting, stopped, ...
}

// members asks the nodes' REST APIs, in turn, for the formation's members.
func (f *Formation) members(ctx context.Context) ([]member, error) {
	var last error
	for _, n := range f.nodes {
		ctx, cancel := context.WithTimeout(ctx, time.Second)
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, fmt.Sprintf("http://127.0.0.1:%d/cluster", n.apiPort), nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			cancel()
			last = err
			continue
		}
		var c struct{ Members []member }
		err = json.NewDecoder(resp.Body).Decode(&c)
		resp.Body.Close()
		cancel()
		if err != nil {
			last = err
			continue
		}
		return c.Members, nil
	}
	return nil, fmt.Errorf("formation: no node answers: %w", last)
}

// Primary returns the index of the node that holds the leader lock and runs.
func (f *Formation) Primary(ctx context.Context) (int, error) {
	ms, err := f.members(ctx)
	if err != nil {
		return -1, err
	}
	for _, m := range ms {
		if m.Role == "leader" && m.State == "running" {
			return f.index(m.Name), nil
		}
	}
	return -1, errors.New("formation: no primary")
}

func (f *Formation) index(name string) int {
	for i, n := range f.nodes {
		if n.name == name {
			return i
		}
	}
	return -1
}

func (f *Formation) waitPrimary(ctx context.Context, bound time.Duration) (int, error) {
	deadline := time.Now().Add(bound)
	for {
		i, err := f.Primary(ctx)
		if err == nil {
			return i, nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return -1, fmt.Errorf("formation: no primary within %s: %w", bound, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// WaitWhole waits until one node is primary and every other one is a running standby,
// one of them synchronous.
func (f *Formation) WaitWhole(ctx context.Context, bound time.Duration) error {
	deadline := time.Now().Add(bound)
	for {
		ms, err := f.members(ctx)
		if err == nil && whole(ms, len(f.nodes)) {
			return nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("formation: not whole within %s: %v %v", bound, ms, err)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

func whole(ms []member, n int) bool {
	var leader, sync, running int
	for _, m := range ms {
		if m.State == "running" || m.State == "streaming" {
			running++
		}
		switch m.Role {
		case "leader":
			leader++
		case "sync_standby":
			sync++
		}
	}
	return len(ms) == n && running == n && leader == 1 && sync >= 1
}

// Kill kills node i as a machine's crash would: Patroni and PostgreSQL with SIGKILL. It
// stays down until Restart.
func (f *Formation) Kill(i int) error {
	n := f.nodes[i]
	return f.signal(n, syscall.SIGKILL, true)
}

// Stop stops node i's processes (SIGSTOP) as a partition would: its connections stay
// open and nothing answers on them. Resume continues it; its Patroni then finds the
// lock lost and demotes it.
func (f *Formation) Stop(i int) error { return f.signal(f.nodes[i], syscall.SIGSTOP, false) }

// Resume continues a node that Stop stopped.
func (f *Formation) Resume(i int) error { return f.signal(f.nodes[i], syscall.SIGCONT, false) }

// signal sends sig to node n's Patroni and to every process of its PostgreSQL; with
// wait, it waits for Patroni to exit and PostgreSQL's processes to be gone.
func (f *Formation) signal(n *node, sig syscall.Signal, wait bool) error {
	n.mu.Lock()
	cmd, exited := n.patroni, n.exited
	n.mu.Unlock()
	if cmd != nil {
		_ = syscall.Kill(-cmd.Process.Pid, sig)
	}
	// Each of PostgreSQL's processes has a session of its own, so no one signal reaches
	// them all, and the postmaster starts new ones: stop every one found until no new
	// one appears, then send the signal.
	var pids []int
	if sig != syscall.SIGCONT {
		for seen := map[int]bool{}; ; {
			found := false
			for _, pid := range processesIn(n.data) {
				if !seen[pid] {
					seen[pid], found = true, true
					pids = append(pids, pid)
					_ = syscall.Kill(pid, syscall.SIGSTOP)
				}
			}
			if !found {
				break
			}
		}
	} else {
		pids = processesIn(n.data)
	}
	if sig != syscall.SIGSTOP {
		for _, pid := range pids {
			_ = syscall.Kill(pid, sig)
		}
	}
	if !wait {
		return nil
	}
	if exited != nil {
		<-exited
	}
	for deadline := time.Now().Add(10 * time.Second); len(processesIn(n.data)) > 0; {
		if time.Now().After(deadline) {
			return fmt.Errorf("formation: %s's PostgreSQL processes %v outlived %s", n.name, processesIn(n.data), sig)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return nil
}

// processesIn returns the processes that work in dir: a node's PostgreSQL, whose
// postmaster and every process it starts change to the data directory. A pid read
// from the data directory's pid file would outlive a killed server and may since be
// another process's.
func processesIn(dir string) []int {
	want, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return nil
	}
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if cwd, err := os.Readlink(filepath.Join("/proc", e.Name(), "cwd")); err == nil && cwd == want {
			pids = append(pids, pid)
		}
	}
	return pids
}

// Restart starts node i's Patroni again after Kill; it rejoins as a standby.
func (f *Formation) Restart(i int) error {
	n := f.nodes[i]
	n.mu.Lock()
	exited := n.exited
	n.mu.Unlock()
	if exited != nil {
		select {
		case <-exited:
		default:
			return fmt.Errorf("formation: %s is running", n.name)
		}
	}
	return f.startPatroni(n)
}

// Heal continues every stopped node and restarts every killed one.
func (f *Formation) Heal() error {
	var errs []error
	for i, n := range f.nodes {
		errs = append(errs, f.Resume(i))
		n.mu.Lock()
		exited := n.exited
		n.mu.Unlock()
		select {
		case <-exited:
			errs = append(errs, f.Restart(i))
		default:
		}
	}
	return errors.Join(errs...)
}

// Close stops every process and removes nothing: the caller owns Dir.
func (f *Formation) Close() {
	for _, n := range f.nodes {
		_ = f.signal(n, syscall.SIGCONT, false)
		_ = f.signal(n, syscall.SIGKILL, true)
	}
	if f.etcd != nil && f.etcd.Process != nil {
		_ = syscall.Kill(-f.etcd.Process.Pid, syscall.SIGKILL)
		_ = f.etcd.Wait()
	}
}
