package chaos

import (
	"bufio"
	"context"
	crand "crypto/rand"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/goccy/go-yaml"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/opbroker/opbroker/auth"
	"github.com/opbroker/opbroker/crashpoint"
	"github.com/opbroker/opbroker/embeddedpg"
	"github.com/opbroker/opbroker/formation"
	"github.com/opbroker/opbroker/loopback"
	"github.com/opbroker/opbroker/provision"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/target"
)

// The operation types of the run, one per provider profile.
const (
	typeCharge    = "chaos.charge"    // replays saved responses, 5xx included (Stripe v1 style)
	typeProvision = "chaos.provision" // saves only successes; forgets keys after a retention
	typeNotify    = "chaos.notify"    // no idempotency at all: an unclear outcome is escalated
	typeObject    = "chaos.object"    // no key: a conditional create (If-None-Match: *), found by name
)

// provisionRetention is how long the provision target keeps a key; its contract says so.
const provisionRetention = 60 * time.Second

// provisionKeyEnv is the environment variable the replicas read the provision target's
// API key from.
const provisionKeyEnv = "OPCHAOS_PROVISION_API_KEY"

// cluster is everything the run starts: PostgreSQL, the simulated targets and the
// broker replicas, with the files they read.
type cluster struct {
	cfg      Config
	dir      string
	rmDir    func()               // removes dir, whose lock it holds until then (embeddedpg.TempFolder)
	pg       *embeddedpg.Server   // nil when the database was given
	ha       *formation.Formation // with Config.Failover
	schema   string
	adminURL string        // the administrator, on the run's schema
	appURL   string        // the broker's ordinary role
	admin    *pgxpool.Pool // on adminURL
	sims     []*simtarget.Server
	charge   *simtarget.Server // of sims: serves chaos.charge and chaos.notify
	tokens   map[string]string // bearer token by tenant, and the operator's
	targets  string            // the targets file
	auth     string            // the principals file
	// chargeToken is the file the replicas read the charge target's bearer token from,
	// replaced by a rename at each rotation; provisionKey is the provision target's API
	// key, set in the replicas' environment.
	chargeToken  string
	provisionKey string
	// webhookAddrs is each replica's webhook listener, the same at every start: the
	// charge target posts its events to them, in turn, as to a load balancer's.
	webhookAddrs []string

	probes callLog // the availability prober's calls (Config.Failover)

	mu        sync.Mutex
	failovers []Failover
	replicas  []*replica
	conns     map[string]*grpc.ClientConn
	rng       *rand.Rand
	healing   bool
	crashes   int
	faults    map[string]int // process and crash-point faults by kind
	// secrets is every credential the run made, in the order it made them; a secret is
	// added before anything can read it, so every log line is checked against every
	// secret that could be in it (I12).
	secrets       []secret
	logLines      int      // replica log lines checked
	logViolations []string // I12: log lines that held a secret (quoted without it), or could not be checked
}

// secret is a credential of the run, with a name the report may print instead of it.
type secret struct{ name, value string }

// replica is one broker process.
type replica struct {
	id      int
	cmd     *exec.Cmd
	addr    string // gRPC, once serving
	paused  bool
	stop    bool // stopped on purpose: its end is not a crash
	counted bool // its end was counted as a crash
	exited  chan struct{}
	crash   string // the crash point it was started with, if any
}

var servingLine = regexp.MustCompile(`msg=serving grpc=(\S+)`)

// pgFolder begins the names of the folders of the runs' embedded PostgreSQL servers: a
// folder of its own (embeddedpg.StartTemp), whose orphans a later run can tell from a
// live run's.
const pgFolder = "opchaos-pg-"

// runFolder begins the names of the runs' own folders (the targets' secrets, the
// principals, the formation's nodes), each locked for its run's life so that a later
// run removes those of killed runs (embeddedpg.TempFolder).
const runFolder = "opchaos-run-"

func newCluster(ctx context.Context, cfg Config) (c *cluster, err error) {
	c = &cluster{cfg: cfg, tokens: map[string]string{},
		conns: map[string]*grpc.ClientConn{}, faults: map[string]int{},
		rng: rand.New(rand.NewPCG(cfg.Seed, 0xc4a05))}
	defer func() {
		if err != nil {
			c.close()
		}
	}()
	if c.dir, c.rmDir, err = embeddedpg.TempFolder(runFolder); err != nil {
		return c, err
	}
	base := cfg.DatabaseURL
	if cfg.Failover {
		fmt.Fprintln(cfg.Log, "chaos: starting the formation: etcd and three PostgreSQL nodes under Patroni")
		if c.ha, err = formation.Start(ctx, formation.Config{Dir: filepath.Join(c.dir, "formation")}); err != nil {
			return c, err
		}
		base = c.ha.URL()
	}
	if base == "" {
		// The servers of earlier runs killed before they stopped theirs (kill -9, a test
		// binary's timeout) are stopped and removed first.
		if c.pg, err = embeddedpg.StartTemp(ctx, pgFolder, embeddedpg.Config{Restarted: true, Template: true}); err != nil {
			return c, err
		}
		base = c.pg.URL()
	}
	c.schema = fmt.Sprintf("chaos_%d_%d", cfg.Seed, time.Now().UnixNano())
	if c.appURL, err = provision.Schema(ctx, base, "opbroker_chaos", c.schema); err != nil {
		return c, err
	}
	if err := store.MigrateURL(ctx, c.appURL); err != nil {
		return c, err
	}
	if c.adminURL, err = provision.WithParams(base, map[string]string{"search_path": c.schema}); err != nil {
		return c, err
	}
	if c.admin, err = pgxpool.New(ctx, c.adminURL); err != nil {
		return c, err
	}
	if c.webhookAddrs, err = loopback.Addrs(cfg.Replicas); err != nil {
		return c, err
	}
	if err := c.startTargets(); err != nil {
		return c, err
	}
	if err := c.writePrincipals(); err != nil {
		return c, err
	}
	for i := range cfg.Replicas {
		// A replica refuses to start while its database is unavailable, or, on a
		// formation, while its commits do not wait for a standby yet: a few tries.
		for try := 1; ; try++ {
			err := c.start(i)
			if err == nil {
				break
			}
			if try == 5 {
				return c, err
			}
			time.Sleep(time.Second)
		}
	}
	return c, nil
}

// startTargets starts the two simulated providers with the run's fault mix and writes
// the contracts that describe them (simtarget.Contracts: what each key saves and how
// long it keeps it, as the simulator does). Each requires a credential made for the run:
// the charge provider a bearer token the replicas read from a file (rotated as a fault),
// the provision provider an X-Api-Key they read from their environment.
// chargeCompletion is how long the charge provider's charges process.
const chargeCompletion = 300 * time.Millisecond

func (c *cluster) startTargets() error {
	token := c.newSecret("the charge target's bearer token")
	c.chargeToken = filepath.Join(c.dir, "charge-token")
	install, err := stageSecretFile(c.chargeToken, token)
	if err != nil {
		return err
	}
	if err := install(); err != nil {
		return err
	}
	c.provisionKey = c.newSecret("the provision target's API key")
	webhookSecret := filepath.Join(c.dir, "webhook-secret")
	signing := c.newSecret("the charge target's webhook signing secret")
	if err := os.WriteFile(webhookSecret, []byte(signing+"\n"), 0o600); err != nil {
		return err
	}
	rates := map[simtarget.Fault]float64{}
	for _, f := range simtarget.Faults {
		rates[f] = c.cfg.FaultRate / float64(len(simtarget.Faults))
	}
	// The charge target reports its charges by webhook, every fault of its events as
	// often as a create gets any one fault, each event's account the tenant's.
	hooks := &simtarget.WebhookConfig{Secret: signing, SecretSource: target.Secret{File: webhookSecret},
		FaultRates: map[simtarget.WebhookFault]float64{}, LateDelay: 2 * time.Second, Account: true}
	for _, addr := range c.webhookAddrs {
		hooks.URLs = append(hooks.URLs, "http://"+addr+simtarget.WebhookPath)
	}
	for _, f := range simtarget.WebhookFaults {
		hooks.FaultRates[f] = 2 * c.cfg.FaultRate / float64(len(simtarget.WebhookFaults))
	}
	// Lookups fail as often as a create gets any one fault: a failed lookup must never
	// let a replay through that the key does not cover.
	lookupFailures := c.cfg.FaultRate / float64(len(simtarget.Faults))
	// Charges process for a moment before they succeed, or fail when the payload asks:
	// nothing may be SUCCEEDED while the target says processing.
	stripeCfg := simtarget.Config{FaultRates: rates, Seed: c.cfg.Seed, LookupFailures: lookupFailures, SlowDelay: 4 * time.Second,
		Completion: chargeCompletion, Webhooks: hooks,
		Auth: &target.Auth{Scheme: target.AuthBearer, Secret: target.Secret{File: c.chargeToken}}, Credential: token}
	stripe, err := simtarget.Start(stripeCfg)
	if err != nil {
		return err
	}
	forgetfulCfg := simtarget.Config{FaultRates: rates, Seed: c.cfg.Seed + 1, SaveOnlySuccesses: true,
		Retention: provisionRetention, LookupFailures: lookupFailures, SlowDelay: 4 * time.Second,
		Auth:       &target.Auth{Scheme: target.AuthHeader, Header: "X-Api-Key", Secret: target.Secret{Env: provisionKeyEnv}},
		Credential: c.provisionKey}
	forgetful, err := simtarget.Start(forgetfulCfg)
	if err != nil {
		stripe.Close()
		return err
	}
	c.sims, c.charge = []*simtarget.Server{stripe, forgetful}, stripe

	demo := simtarget.Contracts(stripe.URL, stripeCfg)
	charge, notify, object := demo[0], demo[1], demo[2]
	charge.Name, charge.OperationTypes = "chaos-payments", []string{typeCharge}
	// An event whose reference no operation has is quarantined soon: the audit reads
	// the quarantine once the work settles.
	charge.Evidence.MatchFor = target.Duration(evidenceMatchFor)
	notify.Name, notify.OperationTypes = "chaos-notify", []string{typeNotify}
	object.Name, object.OperationTypes = "chaos-objects", []string{typeObject}
	provision := simtarget.Contracts(forgetful.URL, forgetfulCfg)[0]
	provision.Name, provision.OperationTypes = "chaos-provisioning", []string{typeProvision}
	data, err := target.Encode([]*target.Contract{charge, provision, notify, object})
	if err != nil {
		return err
	}
	c.targets = filepath.Join(c.dir, "targets.yaml")
	return os.WriteFile(c.targets, data, 0o600)
}

// evidenceMatchFor is how long the charge target's events are matched again before one
// whose reference names no operation is quarantined.
const evidenceMatchFor = 5 * time.Second

// newSecret returns a random credential, recorded under name for the leak check before
// anyone is given it.
func (c *cluster) newSecret(name string) string {
	value := crand.Text()
	c.mu.Lock()
	defer c.mu.Unlock()
	c.secrets = append(c.secrets, secret{name: name, value: value})
	return value
}

// stageSecretFile writes value to a file beside path, readable by its owner only, and
// returns what renames it over path: a reader of path never sees half a secret.
func stageSecretFile(path, value string) (install func() error, err error) {
	tmp := path + ".new"
	if err := os.WriteFile(tmp, []byte(value+"\n"), 0o600); err != nil {
		return nil, err
	}
	return func() error { return os.Rename(tmp, path) }, nil
}

// writePrincipals makes one client principal per tenant, the on-call operator, and the
// service that reports the charge target's events (role evidence).
func (c *cluster) writePrincipals() error {
	var file auth.File
	for _, tenant := range tenants(c.cfg.Tenants) {
		token, hash := auth.NewToken()
		c.tokens[tenant] = token
		file.Principals = append(file.Principals, auth.PrincipalConfig{Name: "client-" + tenant,
			Roles: []auth.Role{auth.RoleClient}, Tenants: []string{tenant}, TokenSHA256: []string{hash}})
	}
	token, hash := auth.NewToken()
	c.tokens[operatorName] = token
	file.Principals = append(file.Principals, auth.PrincipalConfig{Name: operatorName,
		Roles: []auth.Role{auth.RoleOperator}, AllTenants: true, TokenSHA256: []string{hash}})
	token, hash = auth.NewToken()
	c.tokens[reporterName] = token
	file.Principals = append(file.Principals, auth.PrincipalConfig{Name: reporterName,
		Roles: []auth.Role{auth.RoleEvidence}, AllTenants: true, TokenSHA256: []string{hash}})
	data, err := yaml.Marshal(file)
	if err != nil {
		return err
	}
	c.auth = filepath.Join(c.dir, "principals.yaml")
	return os.WriteFile(c.auth, data, 0o600)
}

func tenants(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("tenant-%d", i)
	}
	return out
}

// crashPoints are the broker's named crash points the run enables, one per replica
// start at most.
var crashPoints = []string{crashpoint.DispatchAfterClaim, crashpoint.DispatchAfterSend, crashpoint.DispatchAfterReply,
	crashpoint.DispatchAfterRecord, crashpoint.PrepareAfterCommit, crashpoint.EvidenceAfterReceipt}

// start starts replica i (again) and waits until it serves. A third of the starts run
// on a clock off the database's (seconds either way). Half the starts arm a crash
// point that kills the process (or fails a prepare) at a random hit.
func (c *cluster) start(i int) error {
	c.mu.Lock()
	crash := ""
	if !c.healing && c.rng.IntN(2) == 0 {
		point, mode := crashPoints[c.rng.IntN(len(crashPoints))], "kill"
		if point == crashpoint.PrepareAfterCommit && c.rng.IntN(2) == 0 {
			mode = "error"
		}
		crash = fmt.Sprintf("%s=%s@%d", point, mode, 2+c.rng.IntN(20))
	}
	// A third of the starts run on a clock up to 10 s off the database's.
	var skew time.Duration
	if !c.healing && c.rng.IntN(3) == 0 {
		skew = time.Duration(c.rng.IntN(21)-10) * time.Second
	}
	c.mu.Unlock()

	url, err := provision.WithParams(c.appURL, map[string]string{"application_name": fmt.Sprintf("opbroker-chaos-%d", i)})
	if err != nil {
		return err
	}
	cmd := exec.Command(c.cfg.Broker, "serve", "--database-url", url, "--targets", c.targets,
		"--auth-config", c.auth, "--plaintext", "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0",
		"--log-format", "text", "--dispatch-lease", c.cfg.Lease.String(), "--reconcile-lease", c.cfg.Lease.String(), "--shutdown-grace", "2s",
		"--tenant-rate", "100000", "--tenant-burst", "100000", "--reconcile-deadline", c.cfg.ResolutionDeadline.String(),
		"--webhook-addr", c.webhookAddrs[i])
	if c.ha != nil {
		cmd.Args = append(cmd.Args, "--require-synchronous-replication")
	}
	cmd.Env = append(os.Environ(), provisionKeyEnv+"="+c.provisionKey)
	// A run killed before it stopped its replicas (kill -9, a test binary's timeout)
	// takes them with it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if crash != "" {
		cmd.Env = append(cmd.Env, crashpoint.EnvVar+"="+crash)
	}
	if skew != 0 {
		cmd.Env = append(cmd.Env, crashpoint.ClockOffsetEnvVar+"="+skew.String())
	}
	// Its standard output and error, the two streams a log collector would keep, are
	// read as one.
	output, w, err := os.Pipe()
	if err != nil {
		return err
	}
	cmd.Stdout, cmd.Stderr = w, w
	err = cmd.Start()
	w.Close()
	if err != nil {
		output.Close()
		return err
	}
	r := &replica{id: i, cmd: cmd, exited: make(chan struct{}), crash: crash}
	ready := make(chan string, 1)
	go func() {
		defer output.Close()
		sc := bufio.NewScanner(output)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			if m := servingLine.FindStringSubmatch(line); m != nil {
				ready <- m[1]
			}
			c.checkLog(i, line)
			if c.cfg.ReplicaLogs != nil {
				fmt.Fprintf(c.cfg.ReplicaLogs, "[replica %d] %s\n", i, line)
			}
		}
		if err := sc.Err(); err != nil {
			c.mu.Lock()
			c.logViolations = append(c.logViolations, fmt.Sprintf("replica %d: its log could not be checked past a line: %v", i, err))
			c.mu.Unlock()
			_, _ = io.Copy(io.Discard, output) // the replica must not block on a full pipe
		}
		_ = cmd.Wait()
		close(r.exited)
	}()
	select {
	case addr := <-ready:
		r.addr = addr
	case <-r.exited:
		return fmt.Errorf("replica %d exited before serving", i)
	case <-time.After(30 * time.Second):
		_ = cmd.Process.Kill()
		return fmt.Errorf("replica %d did not start serving", i)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if i < len(c.replicas) {
		c.replicas[i] = r
	} else {
		c.replicas = append(c.replicas, r)
	}
	if crash != "" {
		c.faults["crash point armed"]++
	}
	if skew != 0 {
		c.faults["clock off the database's"]++
	}
	return nil
}

// checkLog checks one of replica i's log lines for the run's secrets (I12). A violation
// quotes the line with every secret replaced by its name.
func (c *cluster) checkLog(i int, line string) {
	c.mu.Lock()
	secrets := c.secrets[:len(c.secrets):len(c.secrets)]
	c.logLines++
	c.mu.Unlock()
	if held, redacted := redact(line, secrets); len(held) > 0 {
		c.mu.Lock()
		c.logViolations = append(c.logViolations, fmt.Sprintf("replica %d's log holds %s: %s", i, strings.Join(held, " and "), redacted))
		c.mu.Unlock()
	}
}

// supervise restarts replicas that died (killed, or by a crash point) until ctx ends.
// A replica that exits before serving (its database unreachable, as during a failover)
// is started again a second later, not at once, as a process supervisor backs off.
func (c *cluster) supervise(ctx context.Context) {
	failedAt := map[int]time.Time{}
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(200 * time.Millisecond):
		}
		c.mu.Lock()
		var dead []int
		for _, r := range c.replicas {
			if !r.alive() {
				dead = append(dead, r.id)
				if !r.stop && !r.counted {
					c.crashes++
					r.counted = true
				}
			}
		}
		c.mu.Unlock()
		for _, i := range dead {
			if time.Since(failedAt[i]) < time.Second {
				continue
			}
			if err := c.start(i); err != nil && ctx.Err() == nil {
				failedAt[i] = time.Now()
				fmt.Fprintf(c.cfg.Log, "chaos: restarting replica %d: %v\n", i, err)
			}
		}
	}
}

func (r *replica) alive() bool {
	select {
	case <-r.exited:
		return false
	default:
		return true
	}
}

// live returns the replicas whose process runs, paused ones too when withPaused. The
// caller holds c.mu.
func (c *cluster) live(withPaused bool) []*replica {
	var out []*replica
	for _, r := range c.replicas {
		if r.alive() && (withPaused || !r.paused) {
			out = append(out, r)
		}
	}
	return out
}

// client returns a connection to a live replica chosen at random: a paused one too, as
// a real client cannot know that one is paused.
func (c *cluster) client(rng *rand.Rand) (*grpc.ClientConn, error) { return c.connect(rng, true) }

// connect returns a connection to a live replica chosen at random, paused ones too when
// withPaused (as a load balancer's health check would leave them out, without).
func (c *cluster) connect(rng *rand.Rand, withPaused bool) (*grpc.ClientConn, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	live := c.live(withPaused)
	if len(live) == 0 {
		return nil, fmt.Errorf("no replica is running")
	}
	r := live[rng.IntN(len(live))]
	conn := c.conns[r.addr]
	if conn == nil {
		var err error
		if conn, err = grpc.NewClient(r.addr, grpc.WithTransportCredentials(insecure.NewCredentials())); err != nil {
			return nil, err
		}
		c.conns[r.addr] = conn
	}
	return conn, nil
}

// heal stops injecting: paused replicas continue, the targets stop failing, and no
// restart arms a crash point any more.
func (c *cluster) heal() {
	c.mu.Lock()
	c.healing = true
	for _, r := range c.replicas {
		if r.paused {
			_ = r.cmd.Process.Signal(syscall.SIGCONT)
			r.paused = false
		}
	}
	c.mu.Unlock()
	for _, s := range c.sims {
		s.Heal()
	}
}

// restartArmed restarts, without crash points, every replica still armed with one.
func (c *cluster) restartArmed() {
	c.mu.Lock()
	var armed []*replica
	for _, r := range c.replicas {
		if r.crash != "" {
			r.stop = true
			armed = append(armed, r)
		}
	}
	c.mu.Unlock()
	for _, r := range armed {
		_ = r.cmd.Process.Signal(syscall.SIGTERM)
		<-r.exited
	}
}

// stopReplicas stops every replica (SIGTERM, then SIGKILL after a grace).
func (c *cluster) stopReplicas() {
	c.mu.Lock()
	replicas := append([]*replica(nil), c.replicas...)
	c.mu.Unlock()
	for _, r := range replicas {
		c.mu.Lock()
		r.stop = true
		c.mu.Unlock()
		_ = r.cmd.Process.Signal(syscall.SIGCONT)
		_ = r.cmd.Process.Signal(syscall.SIGTERM)
	}
	for _, r := range replicas {
		select {
		case <-r.exited:
		case <-time.After(10 * time.Second):
			_ = r.cmd.Process.Kill()
			<-r.exited
		}
	}
}

func (c *cluster) close() {
	c.stopReplicas()
	for _, conn := range c.conns {
		conn.Close()
	}
	for _, s := range c.sims {
		s.Close()
	}
	if c.admin != nil {
		c.admin.Close()
	}
	if c.adminURL != "" {
		if err := provision.DropSchema(context.Background(), c.adminURL, c.schema); err != nil {
			fmt.Fprintf(c.cfg.Log, "chaos: dropping the run's schema: %v\n", err)
		}
	}
	// A server that did not stop keeps its folder, unlocked: a later run stops it and
	// removes the folder.
	if c.pg != nil {
		if err := c.pg.StopAndRemove(); err != nil {
			fmt.Fprintf(c.cfg.Log, "chaos: %v\n", err)
		}
	}
	if c.ha != nil {
		c.ha.Close()
	}
	if c.rmDir != nil {
		c.rmDir()
	}
}
