package formation_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/opbroker/opbroker/formation"
	"github.com/opbroker/opbroker/store"
)

// start starts a formation in a folder of the test's. It skips unless
// formation.EnvTest is 1, and fails when Patroni or etcd is not installed (.ci/run
// installs both).
func start(t *testing.T) *formation.Formation {
	t.Helper()
	if os.Getenv(formation.EnvTest) != "1" {
		t.Skipf("set %s=1 to run the tests that start a replicated PostgreSQL (make test-ha)", formation.EnvTest)
	}
	for _, tool := range []string{"patroni", "etcd"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s is not installed (Debian's patroni and etcd-server packages)", tool)
		}
	}
	dir, err := os.MkdirTemp("", "formation-test-")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	f, err := formation.Start(t.Context(), formation.Config{Dir: dir, TTL: 6 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Close)
	return f
}

// A commit waits for a standby; one acknowledged by the primary is on the standby that
// takes over when the primary is killed; the killed node, restarted, follows the new
// primary.
func TestAcknowledgedCommitsSurviveAFailover(t *testing.T) {
	f := start(t)
	ctx := t.Context()
	conn, err := pgx.Connect(ctx, f.URL())
	if err != nil {
		t.Fatal(err)
	}
	// The broker's check finds commits waiting for a standby, and finds a connection
	// that turns the wait off.
	pool, err := pgxpool.New(ctx, f.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if err := store.New(pool).CheckSynchronousReplication(ctx); err != nil {
		t.Fatalf("the formation's commits should wait for a standby: %v", err)
	}
	local, err := pgxpool.New(ctx, f.URL()+"&synchronous_commit=local")
	if err != nil {
		t.Fatal(err)
	}
	defer local.Close()
	if err := store.New(local).CheckSynchronousReplication(ctx); !errors.Is(err, store.ErrNotReplicated) ||
		!strings.Contains(err.Error(), "synchronous_commit is local") {
		t.Fatalf("a connection with synchronous_commit=local: got %v, want ErrNotReplicated", err)
	}
	old, err := f.Primary(ctx)
	if err != nil {
		t.Fatal(err)
	}

	// A commit waits for a standby: with every standby stopped, none is acknowledged.
	// (Asynchronous replication would acknowledge it at once.)
	if _, err := conn.Exec(ctx, "CREATE TABLE waited (n int)"); err != nil {
		t.Fatal(err)
	}
	for i := range f.Nodes() {
		if i != old {
			if err := f.Stop(i); err != nil {
				t.Fatal(err)
			}
		}
	}
	waitCtx, cancel := context.WithTimeout(ctx, 2*time.Second)
	_, err = conn.Exec(waitCtx, "INSERT INTO waited VALUES (1)")
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a commit with every standby stopped: got %v, want it to wait past its deadline", err)
	}
	conn.Close(ctx)
	if err := f.Heal(); err != nil {
		t.Fatal(err)
	}
	if err := f.WaitWhole(ctx, time.Minute); err != nil {
		t.Fatal(err)
	}
	if now, err := f.Primary(ctx); err != nil || now != old {
		t.Fatalf("primary after the standbys continued: %d (%v), was %d", now, err, old)
	}

	if conn, err = pgx.Connect(ctx, f.URL()); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, "CREATE TABLE acked (n int); INSERT INTO acked SELECT generate_series(1, 1000)"); err != nil {
		t.Fatal(err)
	}
	conn.Close(ctx)

	if err := f.Kill(old); err != nil {
		t.Fatal(err)
	}
	var n int
	deadline := time.Now().Add(time.Minute)
	for {
		if conn, err = pgx.Connect(ctx, f.URL()); err == nil {
			err = conn.QueryRow(ctx, "SELECT count(*) FROM acked").Scan(&n)
			conn.Close(ctx)
			if err == nil {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no primary a minute after the kill: %v", err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	if n != 1000 {
		t.Fatalf("the new primary has %d of the 1000 acknowledged rows", n)
	}
	if now, err := f.Primary(ctx); err != nil || now == old {
		t.Fatalf("primary after the kill: %d (%v), was %d", now, err, old)
	}
	if err := f.Restart(old); err != nil {
		t.Fatal(err)
	}
	if err := f.WaitWhole(ctx, time.Minute); err != nil {
		t.Fatal(err)
	}
}
