package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/reflection/grpc_reflection_v1"

	"github.com/opbroker/opbroker/brokertest"
	"github.com/opbroker/opbroker/gcpace"
	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/storetest"
)

// binary is the opbroker command built for these tests: they run it as a real process.
var binary string

func TestMain(m *testing.M) {
	var remove func()
	var err error
	if binary, remove, err = brokertest.Build(".", "opbroker-bin-"); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := storetest.Run(m)
	remove()
	os.Exit(code)
}

// process is a running opbroker and what it printed.
type process struct {
	cmd    *exec.Cmd
	mu     sync.Mutex
	output []string
	ready  chan string // the gRPC address, once serving
	exited chan error
}

var servingLine = regexp.MustCompile(`msg=serving grpc=(\S+)`)

func start(t *testing.T, args ...string) *process {
	t.Helper()
	return startEnv(t, nil, args...)
}

// startEnv starts opbroker with extra environment variables (e.g. crash points).
func startEnv(t *testing.T, env []string, args ...string) *process {
	t.Helper()
	return startBinary(t, binary, env, args...)
}

// startBinary starts an opbroker binary other than the tests' own.
func startBinary(t *testing.T, bin string, env []string, args ...string) *process {
	t.Helper()
	p := &process{cmd: exec.Command(bin, args...), ready: make(chan string, 1), exited: make(chan error, 1)}
	p.cmd.Env = append(os.Environ(), env...)
	stderr, err := p.cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, p.cmd.Start())
	scanned := make(chan struct{})
	go func() {
		defer close(scanned)
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			p.mu.Lock()
			p.output = append(p.output, sc.Text())
			p.mu.Unlock()
			if m := servingLine.FindStringSubmatch(sc.Text()); m != nil {
				p.ready <- m[1]
			}
		}
	}()
	go func() {
		<-scanned
		p.exited <- p.cmd.Wait()
	}()
	t.Cleanup(func() {
		_ = p.cmd.Process.Kill()
	})
	return p
}

func (p *process) Output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := ""
	for _, l := range p.output {
		out += l + "\n"
	}
	return out
}

func (p *process) waitReady(t *testing.T) string {
	t.Helper()
	select {
	case addr := <-p.ready:
		return addr
	case err := <-p.exited:
		t.Fatalf("opbroker exited before serving: %v\n%s", err, p.Output())
	case <-time.After(60 * time.Second):
		t.Fatalf("opbroker did not start serving\n%s", p.Output())
	}
	return ""
}

// requireFails waits for the process to exit with an error that says message.
func (p *process) requireFails(t *testing.T, message string) {
	t.Helper()
	select {
	case err := <-p.exited:
		require.Error(t, err)
		require.Contains(t, p.Output(), message)
	case <-time.After(30 * time.Second):
		t.Fatalf("opbroker should have failed with %q\n%s", message, p.Output())
	}
}

func (p *process) stop(t *testing.T, sig syscall.Signal) {
	t.Helper()
	require.NoError(t, p.cmd.Process.Signal(sig))
	select {
	case err := <-p.exited:
		require.NoError(t, err, "opbroker must exit cleanly on %v\n%s", sig, p.Output())
	case <-time.After(30 * time.Second):
		t.Fatalf("opbroker did not exit on %v\n%s", sig, p.Output())
	}
}

func dial(t *testing.T, addr string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	return conn
}

func prepare(ctx context.Context, client opbrokerv1.OperationServiceClient, intent string) (*opbrokerv1.PrepareOperationResponse, error) {
	return client.PrepareOperation(ctx, &opbrokerv1.PrepareOperationRequest{
		Tenant: "acme", OperationType: "demo.charge", IntentRef: intent,
		Payload: []byte(`{"amount":100}`), ContentType: "application/json",
	})
}

func TestServeRefusesUnmigratedSchemaUntilMigrated(t *testing.T) {
	t.Parallel()
	url := storetest.EmptySchema(t)
	serveArgs := serveArgs(url, targetsFile(t, simURL(t)))

	start(t, serveArgs...).requireFails(t, "run `opbroker migrate`")

	out, err := exec.Command(binary, "migrate", "--database-url", url).CombinedOutput()
	require.NoError(t, err, string(out))
	out, err = exec.Command(binary, "migrate", "--database-url", url).CombinedOutput()
	require.NoError(t, err, "migrate is idempotent: %s", out)

	p := start(t, serveArgs...)
	p.waitReady(t)
	p.stop(t, syscall.SIGTERM)
}

// TestServeRefusesUnreplicatedCommitsWhenRequired: with
// --require-synchronous-replication, serve refuses a database whose commits do not wait
// for a standby (the test's single server), and says which setting is wrong.
func TestServeRefusesUnreplicatedCommitsWhenRequired(t *testing.T) {
	t.Parallel()
	url := storetest.Schema(t)
	start(t, serveArgs(url, targetsFile(t, simURL(t)), "--require-synchronous-replication")...).
		requireFails(t, "--require-synchronous-replication: commits do not wait for a synchronous standby: synchronous_standby_names is empty")
}

// TestServeThatFailsToStartLeavesNothingRunning: serve, run in this process, failing
// after the gRPC server was made (its address cannot be listened on), returns with
// nothing of its own still running: TestMain's check for leaked goroutines would find
// the server's stream workers.
func TestServeThatFailsToStartLeavesNothingRunning(t *testing.T) {
	t.Parallel()
	url := storetest.Schema(t)
	got := opbroker(t, serveArgs(url, targetsFile(t, simURL(t)), "--grpc-addr", "127.0.0.1:no-port")...)
	require.Equal(t, 1, got.code, got.stderr)
	require.Contains(t, got.stderr, "--grpc-addr")
}

// TestServeDrainsOnSIGTERM: every PrepareOperation acknowledged before or during the
// shutdown is in the ledger; the process exits 0.
func TestServeDrainsOnSIGTERM(t *testing.T) {
	t.Parallel()
	url := storetest.Schema(t)
	p := start(t, serveArgs(url, targetsFile(t, simURL(t)), "--dispatch=false")...)
	client := opbrokerv1.NewOperationServiceClient(dial(t, p.waitReady(t)))

	var acked sync.Map
	var count atomic.Int64
	var wg sync.WaitGroup
	ctx := context.Background()
	for w := range 8 {
		wg.Go(func() {
			for i := 0; ; i++ {
				callCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
				resp, err := prepare(callCtx, client, fmt.Sprintf("w%d-%d", w, i))
				cancel()
				if err != nil {
					return // the server is going away
				}
				acked.Store(resp.GetOperation().GetName(), true)
				count.Add(1)
			}
		})
	}
	require.Eventually(t, func() bool { return count.Load() >= 200 }, 30*time.Second, 10*time.Millisecond)
	p.stop(t, syscall.SIGTERM)
	wg.Wait()

	conn, err := pgx.Connect(ctx, storetest.AdminURL(t, url))
	require.NoError(t, err)
	defer conn.Close(ctx)
	missing := 0
	acked.Range(func(name, _ any) bool {
		var n int
		require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM operations WHERE 'tenants/acme/operations/' || operation_id = $1`, name).Scan(&n))
		if n != 1 {
			missing++
		}
		return true
	})
	require.Zero(t, missing, "every acknowledged intent is in the ledger")
}

// simulated runs a simulated target for the test and returns it and its URL.
func simulated(t *testing.T, cfg simtarget.Config) (*simtarget.Target, string) {
	t.Helper()
	sim := simtarget.New(cfg)
	srv := httptest.NewServer(sim)
	t.Cleanup(srv.Close)
	t.Cleanup(sim.Close)
	return sim, srv.URL
}

// targetsFile writes the demo contracts of a simulated target at url as a targets file.
func targetsFile(t *testing.T, url string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "targets.yaml")
	require.NoError(t, os.WriteFile(path, []byte(fmt.Sprintf(demoTargetsYAML, url, url, url)), 0o644))
	return path
}

const demoTargetsYAML = `targets:
  - name: demo-payments
    documentation: {url: "https://github.com/opbroker/opbroker/blob/main/simtarget/simtarget.go", checked: 2026-11-29}
    owner: {team: demo-oncall, escalation: "README.md#operations"}
    data: {owner: demo, retention: 720h}
    operation_types: [demo.charge]
    endpoint: {method: POST, url: "%s/v1/charges", timeout: 3s}
    idempotency: {header: Idempotency-Key, retention: 24h, scope: the API account, parameter_mismatch: rejects, saves: every_answer}
    lookup:
      method: GET
      url: "%s/v1/charges?reference={remote_key}"
      visibility_delay: 2s
      found: {status: [200], remote_ref: /id, reference: /reference}
      not_found: [404]
      match: [{remote: /request/amount, payload: /amount}]
    responses:
      success: [{status: [200, 201], remote_ref: /id}]
      rejection: [{status: [402], documented: "a declined card creates no charge"}]
      in_progress: [{status: [409]}]
  - name: demo-notify
    documentation: {url: "https://github.com/opbroker/opbroker/blob/main/simtarget/simtarget.go", checked: 2026-11-29}
    owner: {team: demo-oncall, escalation: "README.md#operations"}
    data: {owner: demo, retention: 720h}
    operation_types: [demo.notify]
    endpoint: {method: POST, url: "%s/v1/notifications", timeout: 3s, request_id_header: X-Request-Id}
    responses:
      success: [{status: [200], remote_ref: /id}]
`

func simURL(t *testing.T) string {
	t.Helper()
	_, url := simulated(t, simtarget.Config{})
	return url
}

// serveArgs runs serve on loopback without credentials or TLS (said explicitly, as serve
// requires); TestServeWithPrincipals covers both.
func serveArgs(databaseURL, targets string, extra ...string) []string {
	return append([]string{"serve", "--database-url", databaseURL, "--targets", targets,
		"--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--log-format", "text",
		"--insecure-no-auth", "--plaintext"}, extra...)
}

var pgURLLine = regexp.MustCompile(`PostgreSQL:\s+(postgres://\S+)`)

// TestDevRunsWithNothingGiven is the quick start: `opbroker dev` with only a data folder
// serves the API with reflection, metrics, and an embedded PostgreSQL that is stopped on
// SIGINT, keeps its data for the next start, is never shared by two processes, and is
// recovered after a kill -9.
func TestDevRunsWithNothingGiven(t *testing.T) {
	t.Parallel()
	parent, err := os.MkdirTemp("", "opbroker-dev-test-")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(parent) })
	// The embedded server runs as another user when tests run as root.
	require.NoError(t, os.Chmod(parent, 0o755))
	dataDir := filepath.Join(parent, "dev")
	args := []string{"dev", "--data-dir", dataDir, "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--webhook-addr", "127.0.0.1:0",
		"--ui-addr", "127.0.0.1:0"}

	p := start(t, args...)
	addr := p.waitReady(t)
	conn := dial(t, addr)
	client := opbrokerv1.NewOperationServiceClient(conn)
	ctx := context.Background()
	resp, err := prepare(ctx, client, "order-1")
	require.NoError(t, err)
	require.True(t, resp.GetCreated())

	// The demo target reports by webhook a charge whose answer it lost. Dev's lookups
	// see a charge at once and the webhook leaves 50 ms after it, so which of the two
	// resolves the operation depends on the machine's load; either way it ends
	// SUCCEEDED, and the webhook reaches dev's listener signed with dev's secret and is
	// accepted.
	lost, err := client.PrepareOperation(ctx, &opbrokerv1.PrepareOperationRequest{Tenant: "acme", OperationType: "demo.charge",
		IntentRef: "order-lost", ContentType: "application/json", Payload: []byte(`{"amount":100,"sim":{"fault":"commit_then_reset"}}`)})
	require.NoError(t, err)
	var charge string
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		got, err := client.GetOperation(ctx, &opbrokerv1.GetOperationRequest{Name: lost.GetOperation().GetName()})
		assert.NoError(c, err)
		assert.Equal(c, opbrokerv1.Operation_STATE_SUCCEEDED, got.GetOperation().GetState())
		assert.Contains(c, []opbrokerv1.Operation_Source{opbrokerv1.Operation_SOURCE_EVIDENCE, opbrokerv1.Operation_SOURCE_LOOKUP},
			got.GetOperation().GetLastObservation().GetSource())
		charge = got.GetOperation().GetRemoteRef()
	}, 10*time.Second, 20*time.Millisecond)
	truthURL := regexp.MustCompile(`demo ground truth: +(http://\S+)`).FindStringSubmatch(p.Output())
	require.NotNil(t, truthURL, p.Output())
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		var truth simtarget.Truth
		assert.NoError(c, json.Unmarshal([]byte(httpGet(c, truthURL[1])), &truth))
		assert.True(c, slices.ContainsFunc(truth.Webhooks, func(w simtarget.WebhookTruth) bool {
			return w.EffectID == charge && w.Genuine && w.Acknowledged
		}), "the webhook about %s is accepted: %+v", charge, truth.Webhooks)
	}, 10*time.Second, 20*time.Millisecond)

	services := listServices(t, conn)
	require.Contains(t, services, "opbroker.v1.OperationService")
	require.Contains(t, services, "opbroker.v1.EvidenceService")
	require.Contains(t, services, "grpc.health.v1.Health")

	metricsAddr := regexp.MustCompile(`metrics=http://(\S+)/metrics`).FindStringSubmatch(p.Output())
	require.NotNil(t, metricsAddr, p.Output())
	var body string
	// The server records a call's duration when the call has ended on its side, which may
	// be after the client has its reply.
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		body = httpGet(c, "http://"+metricsAddr[1]+"/metrics")
		assert.Contains(c, body, `rpc_server_call_duration_seconds`)
	}, 10*time.Second, 20*time.Millisecond)
	require.Contains(t, body, `opbroker_prepare_requests_total{`)
	b := builtWith(t, binary)
	require.Contains(t, body, fmt.Sprintf("opbroker_build_info{commit=%q,go_version=%q,version=%q} 1\n", b.Commit, b.GoVersion, b.Version))
	require.Contains(t, p.Output(), "no authentication", "dev mode says loudly that it is open")
	view := regexp.MustCompile(`support view: +(http://\S+)`).FindStringSubmatch(p.Output())
	require.NotNil(t, view, p.Output())
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		assert.Contains(c, httpGet(c, view[1]+"/signin"), "Your support token", "dev serves the support view")
	}, 10*time.Second, 20*time.Millisecond)

	pgURL := pgURLLine.FindStringSubmatch(p.Output())
	require.NotNil(t, pgURL, p.Output())
	p.stop(t, syscall.SIGINT)
	_, err = pgx.Connect(ctx, pgURL[1])
	require.Error(t, err, "the embedded PostgreSQL stops with opbroker dev")

	p = start(t, args...)
	client = opbrokerv1.NewOperationServiceClient(dial(t, p.waitReady(t)))
	again, err := prepare(ctx, client, "order-1")
	require.NoError(t, err)
	require.False(t, again.GetCreated(), "the data folder is reused across restarts")
	require.Equal(t, resp.GetOperation().GetName(), again.GetOperation().GetName())

	start(t, args...).requireFails(t, "in use by another process")

	// kill -9 leaves the embedded PostgreSQL running; the next start stops the orphan.
	require.NoError(t, p.cmd.Process.Kill())
	<-p.exited
	p = start(t, args...)
	client = opbrokerv1.NewOperationServiceClient(dial(t, p.waitReady(t)))
	_, err = client.GetOperation(ctx, &opbrokerv1.GetOperationRequest{Name: resp.GetOperation().GetName()})
	require.NoError(t, err)
	p.stop(t, syscall.SIGTERM)
}

func listServices(t *testing.T, conn *grpc.ClientConn) []string {
	t.Helper()
	stream, err := grpc_reflection_v1.NewServerReflectionClient(conn).ServerReflectionInfo(context.Background())
	require.NoError(t, err)
	require.NoError(t, stream.Send(&grpc_reflection_v1.ServerReflectionRequest{
		MessageRequest: &grpc_reflection_v1.ServerReflectionRequest_ListServices{}}))
	resp, err := stream.Recv()
	require.NoError(t, err)
	require.NoError(t, stream.CloseSend())
	var names []string
	for _, s := range resp.GetListServicesResponse().GetService() {
		names = append(names, s.GetName())
	}
	return names
}

func httpGet(t require.TestingT, url string) string {
	resp, err := http.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return string(b)
}

func TestTargetsCheck(t *testing.T) {
	t.Parallel()
	out, err := exec.Command(binary, "targets", "check", "--targets", "../../target/testdata/targets.yaml").CombinedOutput()
	require.NoError(t, err, string(out))
	require.Contains(t, string(out), "PASS   7 verified acknowledgment")
	require.Contains(t, string(out), "capabilities: D none")
	require.Contains(t, string(out), "the key saves every answer: a replay never executes an earlier attempt again")
	require.Contains(t, string(out), "every control passes")

	good, err := os.ReadFile("../../target/testdata/targets.yaml")
	require.NoError(t, err)
	bad := filepath.Join(t.TempDir(), "bad.yaml")
	require.NoError(t, os.WriteFile(bad, []byte(strings.Replace(string(good), "team: messaging", `team: ""`, 1)), 0o644))
	out, err = exec.Command(binary, "targets", "check", "--targets", bad).CombinedOutput()
	require.Error(t, err)
	require.Contains(t, string(out), "FAIL   9 escalation path                owner.team is missing")
	require.Contains(t, string(out), "1 control(s) fail")

	unsaid := filepath.Join(t.TempDir(), "unsaid.yaml")
	require.NoError(t, os.WriteFile(unsaid, []byte(strings.Replace(string(good), "      saves: every_answer\n", "", 1)), 0o644))
	out, err = exec.Command(binary, "targets", "check", "--targets", unsaid).CombinedOutput()
	require.Error(t, err, "a keyed target must say what its key saves")
	require.Contains(t, string(out), "FAIL   1 target contract recorded")
	require.Contains(t, string(out), "idempotency.saves is missing")

	out, err = exec.Command(binary, "serve", "--database-url", "postgres://127.0.0.1:1/x", "--targets", bad).CombinedOutput()
	require.Error(t, err)
	require.Contains(t, string(out), `target "acme-mailer": go/no-go control 9 (escalation path) fails`, "serve refuses a failing target")

	// Credentials are said present, missing or unreadable, never shown; one that is not
	// present fails control 1, and serve refuses it.
	dir := t.TempDir()
	secret := fmt.Sprintf("sk_test_%d", time.Now().UnixNano())
	keyFile := filepath.Join(dir, "mailer-key")
	require.NoError(t, os.WriteFile(keyFile, []byte(secret+"\n"), 0o600))
	credentialed := func(mailerKey string) string {
		path := filepath.Join(t.TempDir(), "credentials.yaml")
		require.NoError(t, os.WriteFile(path, []byte(strings.NewReplacer(
			"    concurrency: 16\n", "    concurrency: 16\n    auth: {scheme: bearer, secret: {env: OPBROKER_TEST_ACME_TOKEN}}\n    headers: {Stripe-Version: 2024-06-20}\n",
			"      request_id_header: X-Request-Id\n", "      request_id_header: X-Request-Id\n    auth: {scheme: header, header: X-Api-Key, secret: {file: "+mailerKey+"}}\n",
		).Replace(string(good))), 0o644))
		return path
	}
	check := func(path string, env ...string) (string, error) {
		cmd := exec.Command(binary, "targets", "check", "--targets", path)
		cmd.Env = append(os.Environ(), env...)
		out, err := cmd.CombinedOutput()
		require.NotContains(t, string(out), secret)
		return string(out), err
	}
	withKey := credentialed(keyFile)
	text, err := check(withKey, "OPBROKER_TEST_ACME_TOKEN="+secret)
	require.NoError(t, err, text)
	require.Contains(t, text, "  credential auth.secret (environment variable OPBROKER_TEST_ACME_TOKEN): present\n")
	require.Contains(t, text, "  credential auth.secret (file "+keyFile+"): present\n")
	require.Contains(t, text, "every control passes")

	text, err = check(withKey)
	require.Error(t, err, text)
	require.Contains(t, text, "  credential auth.secret: missing: environment variable OPBROKER_TEST_ACME_TOKEN is not set\n")
	require.Contains(t, text, "  FAIL   1 target contract recorded       auth.secret is missing: environment variable OPBROKER_TEST_ACME_TOKEN is not set: set it to the target's bearer token\n")
	require.Contains(t, text, "1 control(s) fail")

	text, err = check(credentialed(dir), "OPBROKER_TEST_ACME_TOKEN="+secret)
	require.Error(t, err, text)
	require.Contains(t, text, "  credential auth.secret: unreadable: file "+dir+" cannot be read: is a directory\n")
	require.Contains(t, text, "  FAIL   1 target contract recorded       auth.secret is unreadable: file "+dir+" cannot be read: is a directory: the file must hold the value of header X-Api-Key, readable by the broker\n")

	serve := exec.Command(binary, "serve", "--database-url", "postgres://127.0.0.1:1/x", "--targets", withKey)
	out, err = serve.CombinedOutput()
	require.Error(t, err)
	require.Contains(t, string(out), `target "acme-payments": go/no-go control 1 (target contract recorded) fails: auth.secret is missing: environment variable OPBROKER_TEST_ACME_TOKEN is not set`, "serve refuses a missing credential")
	require.NotContains(t, string(out), secret)
}

// TestServeRunsTheCollectorAtItsPace: the broker's process runs Go's collector at
// gcpace.Percent unless GOGC is set, and GOMEMLIMIT in the environment wins over the
// container's (gcpace's own tests cover a container's limit).
func TestServeRunsTheCollectorAtItsPace(t *testing.T) {
	t.Parallel()
	url := storetest.Schema(t)
	for env, want := range map[string]string{
		"GOGC=":           fmt.Sprintf(`gogc=%d `, gcpace.Percent),
		"GOGC=150":        `gogc=150 `,
		"GOMEMLIMIT=1GiB": fmt.Sprintf(`gogc=%d gomemlimit=1073741824$`, gcpace.Percent),
	} {
		// GOGC= first: a GOGC of the test's own environment would win otherwise.
		p := startEnv(t, []string{"GOGC=", env}, serveArgs(url, targetsFile(t, simURL(t)), "--dispatch=false")...)
		p.waitReady(t)
		p.stop(t, syscall.SIGTERM)
		require.Regexp(t, `(?m)msg=serving .* `+want, p.Output(), env)
	}
}
