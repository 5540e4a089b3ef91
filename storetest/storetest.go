// Package storetest gives tests a real PostgreSQL: the one named by
// OPBROKER_TEST_DATABASE_URL, or an embedded one started for the test binary. Each test
// gets a schema of its own, migrated to the current version, so tests that commit, race
// or listen run in parallel without seeing each other. At cleanup the schema is reset
// to what the migrations leave and handed to a later test of the same binary, or, when
// that cannot be proved (reuse.go), dropped.
package storetest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"flag"
	"fmt"
	neturl "net/url"
	"os"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"

	"github.com/opbroker/opbroker/embeddedpg"
	"github.com/opbroker/opbroker/payload"
	"github.com/opbroker/opbroker/provision"
	"github.com/opbroker/opbroker/store"
)

// testServerFolder begins the names of the embedded servers' folders.
const testServerFolder = "opbroker-test-pg-"

// EnvDatabaseURL names the variable that points the tests at an existing database.
const EnvDatabaseURL = "OPBROKER_TEST_DATABASE_URL"

var baseURL string

// Main runs a package's tests with a database available and checks that they leak no
// goroutines. Call it from TestMain.
func Main(m *testing.M) {
	os.Exit(Run(m))
}

// Run is Main without the exit, for a TestMain with work of its own around it; it
// returns the exit code.
func Run(m *testing.M) int {
	baseURL = os.Getenv(EnvDatabaseURL)
	shared := baseURL != ""
	parallelByDefault(shared)
	if !shared {
		// The servers of earlier binaries killed before they stopped them (a panic, a
		// timeout) are stopped and removed first. fsync is off: no test's data need
		// outlive the machine, and commits and the resets' TRUNCATEs wait for no disk.
		srv, err := embeddedpg.StartTemp(context.Background(), testServerFolder, embeddedpg.Config{Template: true, NoFsync: true})
		if err != nil {
			fmt.Fprintln(os.Stderr, "storetest: no", EnvDatabaseURL, "set and the embedded PostgreSQL did not start:", err)
			return 1
		}
		defer func() {
			if err := srv.StopAndRemove(); err != nil {
				fmt.Fprintln(os.Stderr, "storetest:", err)
			}
		}()
		baseURL = srv.URL()
	}
	code := m.Run()
	if err := finish(baseURL, shared); err != nil {
		fmt.Fprintln(os.Stderr, "storetest:", err)
		code = 1
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "storetest: leaked goroutines:", err)
			return 1
		}
	}
	return code
}

// waitingTests is how many of a binary's parallel tests run at once per core, unless
// -parallel says otherwise. go test runs one per core (GOMAXPROCS), but most of ours
// wait more than they compute (for a lease to run out, a slow call, a server's start),
// so that with one per core the waits, not the cores, set how long a package takes.
const waitingTests = 4

// parallelByDefault sets -parallel to waitingTests per core when it was not given, on
// the embedded server only (not when the database is shared): a binary has that
// server's 200 connections to itself, where one named by EnvDatabaseURL (100 by
// default) serves every binary at once. Not when fuzzing either, where -parallel is the
// number of fuzzing processes, each with a server of its own.
func parallelByDefault(shared bool) {
	if !flag.Parsed() {
		flag.Parse()
	}
	if shared {
		return
	}
	given := false
	flag.Visit(func(f *flag.Flag) {
		given = given || f.Name == "test.parallel" || f.Name == "test.fuzz" || f.Name == "test.fuzzworker"
	})
	if !given {
		flag.Set("test.parallel", strconv.Itoa(waitingTests*runtime.GOMAXPROCS(0)))
	}
}

// URL returns the connection string of the test database (without a test schema).
func URL(t testing.TB) string {
	t.Helper()
	if baseURL == "" {
		t.Fatal("storetest: call storetest.Main from TestMain")
	}
	return baseURL
}

// Schema returns a connection string whose search_path selects a schema of the test's
// own, migrated to the current version: a new one, or one a finished test of this binary
// used and that was then put back exactly as the migrations leave it (reuse.go). At
// cleanup the schema is reset for a later test, or dropped.
func Schema(t testing.TB) string {
	t.Helper()
	if s, ok := takeSpare(); ok {
		cleanupSchema(t, s, true)
		return s.url
	}
	s := newSchema(t, true)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := store.Migrate(ctx, Pool(t, s.url)); err != nil {
		t.Fatalf("storetest: %v", err)
	}
	if err := record(ctx, URL(t), s.schema); err != nil {
		t.Fatalf("storetest: %v", err)
	}
	return s.url
}

// AppRole is the ordinary role the broker's connections use in tests: row-level
// security binds it, as in production.
const AppRole = "opbroker_app"

// EmptySchema is Schema without the migration, always a new schema, dropped at cleanup.
// The connection string is the broker's: the administrator's credentials acting as
// AppRole, which owns the schema.
func EmptySchema(t testing.TB) string {
	t.Helper()
	return newSchema(t, false).url
}

// newSchema creates a schema owned by AppRole; at cleanup it is dropped, or given back
// for reuse if reuse is set.
func newSchema(t testing.TB, reuse bool) spare {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	suffix := make([]byte, 6)
	_, _ = rand.Read(suffix)
	schema := "test_" + hex.EncodeToString(suffix)
	url, err := provision.Schema(ctx, URL(t), AppRole, schema)
	if err == nil {
		// The schema as application_name too: a reset finds the sessions still connected.
		url, err = provision.WithParams(url, map[string]string{"application_name": schema})
	}
	if err != nil {
		t.Fatalf("storetest: %v", err)
	}
	s := spare{schema: schema, url: url}
	if reuse {
		admin, err := adminURL(url)
		if err != nil {
			t.Fatalf("storetest: %v", err)
		}
		s.pools = &pools{urls: [2]string{url, admin}}
	}
	cleanupSchema(t, s, reuse)
	return s
}

// cleanupSchema registers the schema's cleanup, and lends the schema's pools to the test
// if it is to be reused. Cleanups run last first, so it runs after those the test
// registers once it has the schema (its pools, servers and processes).
func cleanupSchema(t testing.TB, s spare, reuse bool) {
	if reuse {
		lend(s.pools)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		var err error
		if reuse {
			err = giveBack(ctx, URL(t), s, t.Failed(), t.Logf)
		} else {
			err = provision.DropSchema(ctx, URL(t), s.schema)
		}
		if err != nil {
			t.Errorf("storetest: %v", err)
		}
	})
}

// AdminURL returns the administrator's connection string for a schema of EmptySchema:
// for tests that inspect or damage the ledger beneath the broker (row-level security
// does not bind it).
func AdminURL(t testing.TB, url string) string {
	t.Helper()
	admin, err := adminURL(url)
	if err != nil {
		t.Fatalf("storetest: %v", err)
	}
	return admin
}

// adminURL is AdminURL's work.
func adminURL(url string) (string, error) {
	u, err := neturl.Parse(url)
	if err != nil {
		return "", err
	}
	q := u.Query()
	q.Del("role")
	u.RawQuery = q.Encode()
	return u.String(), nil
}

// Pool opens a pool on url, closed at cleanup. On a connection string of Schema, or
// AdminURL's of one, the pool is instead kept with the schema for a later test, and may
// be one an earlier test opened on it, its sessions put back as they began (reuse.go).
func Pool(t testing.TB, url string) *pgxpool.Pool {
	t.Helper()
	lent := lentFor(url)
	pool := lent.take(url)
	if pool == nil {
		var err error
		if pool, err = pgxpool.New(context.Background(), url); err != nil {
			t.Fatalf("storetest: %v", err)
		}
	}
	if lent == nil {
		t.Cleanup(pool.Close)
	} else {
		t.Cleanup(func() { lent.handBack(url, pool) })
	}
	return pool
}

// NewStore returns a Store on a fresh schema, and an administrator's pool on the same
// schema for the test's own reads and writes beneath the store.
func NewStore(t testing.TB) (*store.Store, *pgxpool.Pool) {
	t.Helper()
	url := Schema(t)
	return store.New(Pool(t, url)), Pool(t, AdminURL(t, url))
}

// PrepareJSON records an intent with a JSON payload, hashing it as the server would.
func PrepareJSON(t testing.TB, st *store.Store, tenant, operationType, intent, body string) store.Operation {
	t.Helper()
	return PrepareJSONWith(t, st, tenant, operationType, intent, body, func(*store.PrepareParams) {})
}

// PrepareJSONWith is PrepareJSON with the parameters adjusted first (a send time, a
// deadline).
func PrepareJSONWith(t testing.TB, st *store.Store, tenant, operationType, intent, body string, adjust func(*store.PrepareParams)) store.Operation {
	t.Helper()
	digest, err := payload.Hash("application/json", []byte(body))
	if err != nil {
		t.Fatalf("storetest: %v", err)
	}
	p := store.PrepareParams{TenantID: tenant, OperationType: operationType,
		IntentRef: intent, ContentType: "application/json", Payload: []byte(body), PayloadSHA256: digest[:], Actor: "test"}
	adjust(&p)
	op, _, err := st.Tenant(tenant).Prepare(context.Background(), p)
	if err != nil {
		t.Fatalf("storetest: prepare: %v", err)
	}
	return op
}

// RemoteKey returns the key an operation is sent with, as the target sees it.
func RemoteKey(t testing.TB, pool *pgxpool.Pool, id uuid.UUID) string {
	t.Helper()
	var key string
	if err := pool.QueryRow(context.Background(), `SELECT remote_key::text FROM operations WHERE operation_id = $1`, id).Scan(&key); err != nil {
		t.Fatalf("storetest: remote key: %v", err)
	}
	return key
}

// ExecAsideGuards runs sql as admin (a pool of AdminURL, a superuser) with the ledger's
// guards set aside for its transaction (session_replication_role = replica), as a
// superuser repairing the ledger could: for a state no statement of the broker can make.
func ExecAsideGuards(t testing.TB, admin *pgxpool.Pool, sql string, args ...any) pgconn.CommandTag {
	t.Helper()
	var tag pgconn.CommandTag
	err := pgx.BeginFunc(context.Background(), admin, func(tx pgx.Tx) error {
		if _, err := tx.Exec(context.Background(), `SET LOCAL session_replication_role = replica`); err != nil {
			return err
		}
		var err error
		tag, err = tx.Exec(context.Background(), sql, args...)
		return err
	})
	if err != nil {
		t.Fatalf("storetest: %s, guards aside: %v", sql, err)
	}
	return tag
}

// ToUnknown claims the operation, the only PREPARED one of its type, as the dispatcher
// would, and records that its send got no answer (TIMEOUT).
func ToUnknown(t testing.TB, st *store.Store, op store.Operation) {
	t.Helper()
	ctx := context.Background()
	claimed, err := st.AllTenants().Claim(ctx, store.ClaimParams{FairClaim: store.FairClaim{
		OperationTypes: []string{op.OperationType}, Worker: "w", Lease: time.Minute, Limit: 10, PerTenant: 10, MaxTenants: 10}})
	if err != nil || len(claimed) != 1 || claimed[0].ID != op.ID {
		t.Fatalf("storetest: claim: %v (claimed %d)", err, len(claimed))
	}
	if _, err := st.AllTenants().RecordOutcome(ctx, store.OutcomeParams{TenantID: op.TenantID, ID: op.ID, Fence: claimed[0].FenceToken,
		State: store.StateUnknown, Observation: store.Observation{Source: "DISPATCH", Outcome: "TIMEOUT"}, Actor: "w"}); err != nil {
		t.Fatalf("storetest: outcome: %v", err)
	}
}

// ResolveUnknown claims the operation, the only UNKNOWN one due of its type, as the
// reconciler would, and records p (whose TenantID, ID and Fence it sets).
func ResolveUnknown(t testing.TB, st *store.Store, op store.Operation, p store.ResolveParams) store.Operation {
	t.Helper()
	ctx := context.Background()
	unknown, err := st.AllTenants().ClaimUnknown(ctx, store.FairClaim{OperationTypes: []string{op.OperationType}, Worker: "r",
		Lease: time.Minute, Limit: 10, PerTenant: 10, MaxTenants: 10})
	if err != nil || len(unknown) != 1 || unknown[0].ID != op.ID {
		t.Fatalf("storetest: claim unknown: %v (claimed %d)", err, len(unknown))
	}
	p.TenantID, p.ID, p.Fence = op.TenantID, op.ID, unknown[0].FenceToken
	resolved, err := st.AllTenants().ResolveUnknown(ctx, p)
	if err != nil {
		t.Fatalf("storetest: resolve: %v", err)
	}
	return resolved
}
