package main

import (
	"context"
	"fmt"
	"io"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/crashpoint"
	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/storetest"
)

// ledger reads the test's ledger directly.
type ledger struct {
	t    *testing.T
	conn *pgx.Conn
}

func openLedger(t *testing.T, url string) *ledger {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), storetest.AdminURL(t, url))
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close(context.Background()) })
	return &ledger{t: t, conn: conn}
}

// operationName is the SQL of the operation's resource name, as the API gives it, for any
// ledger row that has tenant_id and operation_id.
const operationName = `'tenants/' || tenant_id || '/operations/' || operation_id`

func (l *ledger) state(name string) string {
	var state string
	require.NoError(l.t, l.conn.QueryRow(context.Background(),
		`SELECT state FROM operations WHERE `+operationName+` = $1`, name).Scan(&state))
	return state
}

func (l *ledger) remoteKey(name string) string {
	var key string
	require.NoError(l.t, l.conn.QueryRow(context.Background(),
		`SELECT remote_key::text FROM operations WHERE `+operationName+` = $1`, name).Scan(&key))
	return key
}

// prepare sends PrepareOperation for intent through client and returns the operation's
// name once the ledger records it, without waiting for the reply: a replica armed to kill
// or stop itself in its dispatcher can send the operation, and so reach its crash point,
// before it has written the reply. The call goes on in the background until the test
// ends (its context ends before its cleanups run).
func (l *ledger) prepare(client opbrokerv1.OperationServiceClient, intent string) string {
	l.t.Helper()
	called := make(chan struct{})
	go func() {
		defer close(called)
		_, _ = prepare(l.t.Context(), client, intent)
	}()
	l.t.Cleanup(func() { <-called })
	var name string
	require.Eventually(l.t, func() bool {
		return l.conn.QueryRow(context.Background(), `SELECT `+operationName+` FROM operations WHERE intent_ref = $1`, intent).Scan(&name) == nil
	}, 30*time.Second, 10*time.Millisecond, "intent %s never recorded", intent)
	return name
}

func (l *ledger) waitState(name, want string) {
	l.t.Helper()
	require.Eventually(l.t, func() bool { return l.state(name) == want }, 30*time.Second, 20*time.Millisecond,
		"operation %s never reached %s", name, want)
}

// TestWorkerKilledAfterSendEndsUnknown (seed fault-injection test 2, and the crash after
// remote success before the local record): a real process is killed after the target
// answered and before the answer was recorded, so the effect certainly exists while the
// ledger says IN_FLIGHT. Another replica's sweeper moves the operation to UNKNOWN when
// the lease expires; its reconciler finds the effect; nobody re-sends it. (Killed right after
// writing the request, the process's socket is reset and the target may never read it:
// that is the reset-before-commit case, covered by the fault tests.)
func TestWorkerKilledAfterSendEndsUnknown(t *testing.T) {
	t.Parallel()
	url := storetest.Schema(t)
	sim, simAt := simulated(t, simtarget.Config{})
	targets := targetsFile(t, simAt)

	victim := startEnv(t, []string{crashpoint.EnvVar + "=" + crashpoint.DispatchAfterReply + "=kill"},
		serveArgs(url, targets, "--dispatch-lease", "2s")...)
	client := opbrokerv1.NewOperationServiceClient(dial(t, victim.waitReady(t)))
	l := openLedger(t, url)
	name := l.prepare(client, "order-killed")

	select {
	case err := <-victim.exited:
		require.ErrorContains(t, err, "signal: killed")
	case <-time.After(30 * time.Second):
		t.Fatal("the crash point did not kill the worker")
	}
	require.Equal(t, "IN_FLIGHT", l.state(name), "killed between send and record")

	// The survivor's sweeper makes it UNKNOWN when the lease expires (never PREPARED),
	// and its reconciler asks the target and finds the effect.
	survivor := start(t, serveArgs(url, targets, "--dispatch-lease", "2s")...)
	survivor.waitReady(t)
	l.waitState(name, "SUCCEEDED")
	var path []string
	rows, err := l.conn.Query(context.Background(), `SELECT coalesce(from_state::text, '') || '>' || to_state FROM operation_events
		WHERE `+operationName+` = $1 ORDER BY revision`, name)
	require.NoError(t, err)
	for rows.Next() {
		var step string
		require.NoError(t, rows.Scan(&step))
		path = append(path, step)
	}
	require.Equal(t, []string{">PREPARED", "PREPARED>IN_FLIGHT", "IN_FLIGHT>UNKNOWN", "UNKNOWN>SUCCEEDED"}, path)
	kt := sim.Snapshot().Keys[l.remoteKey(name)]
	require.NotNil(t, kt, "the target received the request")
	require.Equal(t, 1, kt.Attempts, "sent once, never re-sent")
	require.Equal(t, 1, kt.Effects)
	survivor.stop(t, syscall.SIGTERM)
}

// TestPausedWorkerCannotRecordOverNewState: a worker stopped (SIGSTOP) after sending,
// past its lease, wakes (SIGCONT) to a fence it no longer holds: it writes no state and
// its observation is kept as evidence.
func TestPausedWorkerCannotRecordOverNewState(t *testing.T) {
	t.Parallel()
	url := storetest.Schema(t)
	// The target answers after the worker paused: OnSent runs once the request is
	// written, and an answer read before the pause took effect would be recorded.
	sim, simAt := simulated(t, simtarget.Config{Latency: 300 * time.Millisecond})
	targets := targetsFile(t, simAt)

	paused := startEnv(t, []string{crashpoint.EnvVar + "=" + crashpoint.DispatchAfterSend + "=pause"},
		serveArgs(url, targets, "--dispatch-lease", "2s", "--reconcile=false")...)
	client := opbrokerv1.NewOperationServiceClient(dial(t, paused.waitReady(t)))
	l := openLedger(t, url)
	name := l.prepare(client, "order-paused")
	require.Eventually(t, func() bool { return sim.Snapshot().Keys[l.remoteKey(name)] != nil }, 30*time.Second, 10*time.Millisecond)

	// Neither replica reconciles: a reconciler (a legitimate actor with a new fence) would
	// resolve the operation, and this test is about the stale write alone.
	sweeper := start(t, serveArgs(url, targets, "--dispatch-lease", "2s", "--reconcile=false")...)
	sweeper.waitReady(t)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("sweeper:\n%s\npaused:\n%s", sweeper.Output(), paused.Output())
		}
	})
	l.waitState(name, "UNKNOWN")

	require.NoError(t, paused.cmd.Process.Signal(syscall.SIGCONT))
	require.Eventually(t, func() bool {
		var finished bool
		require.NoError(t, l.conn.QueryRow(context.Background(), `SELECT count(*) = 1 FROM stale_outcomes
			WHERE `+operationName+` = $1`, name).Scan(&finished))
		return finished
	}, 30*time.Second, 20*time.Millisecond, "the woken worker records its observation")
	var outcome string
	require.NoError(t, l.conn.QueryRow(context.Background(), `SELECT outcome FROM stale_outcomes
		WHERE `+operationName+` = $1`, name).Scan(&outcome))
	// What it saw depends on how long it slept (the reply; its own call timeout; or the
	// call cut when its lease proved lost): it is kept, whatever it was.
	require.Contains(t, []string{"VERIFIED_SUCCESS", "TIMEOUT", "CONNECTION_ERROR"}, outcome, "its observation is kept as evidence")
	require.Equal(t, "UNKNOWN", l.state(name), "the new state stands")
	require.Equal(t, 1, sim.Snapshot().Keys[l.remoteKey(name)].Attempts)
	paused.stop(t, syscall.SIGTERM)
	sweeper.stop(t, syscall.SIGTERM)
}

// TestReplicasRaceSendOnce (seed fault-injection test 3, processes): several broker
// processes dispatch the same ledger; every operation is sent exactly once.
func TestReplicasRaceSendOnce(t *testing.T) {
	t.Parallel()
	url := storetest.Schema(t)
	sim, simAt := simulated(t, simtarget.Config{})
	targets := targetsFile(t, simAt)
	var replicas []*process
	for range 3 {
		p := start(t, serveArgs(url, targets, "--dispatch-pool-size", "8", "--dispatch-claim-batch", "8")...)
		p.waitReady(t)
		replicas = append(replicas, p)
	}
	client := opbrokerv1.NewOperationServiceClient(dial(t, <-func() chan string {
		ch := make(chan string, 1)
		ch <- servingLine.FindStringSubmatch(replicas[0].Output())[1]
		return ch
	}()))
	const n = 600
	var wg sync.WaitGroup
	for w := range 6 {
		wg.Go(func() {
			for i := w; i < n; i += 6 {
				_, err := prepare(context.Background(), client, fmt.Sprintf("race-%d", i))
				if !assert.NoError(t, err) { // not require: this is not the test's goroutine
					return
				}
			}
		})
	}
	wg.Wait()
	l := openLedger(t, url)
	require.Eventually(t, func() bool {
		var done int
		require.NoError(t, l.conn.QueryRow(context.Background(), `SELECT count(*) FROM operations WHERE state = 'SUCCEEDED'`).Scan(&done))
		return done == n
	}, 60*time.Second, 50*time.Millisecond)

	var workers int
	require.NoError(t, l.conn.QueryRow(context.Background(), `SELECT count(DISTINCT actor) FROM operation_events WHERE to_state = 'IN_FLIGHT'`).Scan(&workers))
	require.Greater(t, workers, 1, "the replicas shared the work")
	truth := sim.Snapshot()
	require.Len(t, truth.Keys, n)
	for key, kt := range truth.Keys {
		require.Equal(t, 1, kt.Attempts, key)
		require.Equal(t, 1, kt.Effects, key)
	}
	for _, p := range replicas {
		p.stop(t, syscall.SIGTERM)
	}
}

// TestKilledAfterPrepareCommitLosesNothing: the broker dies after the intent is durable
// and before the client hears of it. The client's retry, at another replica, finds the
// same operation (no lost intent, no second one).
func TestKilledAfterPrepareCommitLosesNothing(t *testing.T) {
	t.Parallel()
	url := storetest.Schema(t)
	targets := targetsFile(t, simURL(t))
	victim := startEnv(t, []string{crashpoint.EnvVar + "=" + crashpoint.PrepareAfterCommit + "=kill"},
		serveArgs(url, targets, "--dispatch=false")...)
	client := opbrokerv1.NewOperationServiceClient(dial(t, victim.waitReady(t)))
	_, err := prepare(context.Background(), client, "order-ack-lost")
	require.Error(t, err, "the reply was lost")
	<-victim.exited

	other := start(t, serveArgs(url, targets, "--dispatch=false")...)
	client = opbrokerv1.NewOperationServiceClient(dial(t, other.waitReady(t)))
	resp, err := prepare(context.Background(), client, "order-ack-lost")
	require.NoError(t, err)
	require.False(t, resp.GetCreated(), "the intent was already durable")
	l := openLedger(t, url)
	var n int
	require.NoError(t, l.conn.QueryRow(context.Background(), `SELECT count(*) FROM operations WHERE intent_ref = 'order-ack-lost'`).Scan(&n))
	require.Equal(t, 1, n)
	other.stop(t, syscall.SIGTERM)
}

// TestWatchAcrossReplicas: watchers connected to one broker process, of one operation
// and of its whole tenant, see every change another process makes, through
// LISTEN/NOTIFY (or the polling fallback).
func TestWatchAcrossReplicas(t *testing.T) {
	t.Parallel()
	url := storetest.Schema(t)
	targets := targetsFile(t, simURL(t))
	api := start(t, serveArgs(url, targets, "--dispatch=false", "--reconcile=false")...)
	client := opbrokerv1.NewOperationServiceClient(dial(t, api.waitReady(t)))
	tenant, err := client.WatchOperations(context.Background(), &opbrokerv1.WatchOperationsRequest{Tenant: "acme"})
	require.NoError(t, err)
	_, err = tenant.Recv() // the stream's start
	require.NoError(t, err)
	resp, err := prepare(context.Background(), client, "order-watched")
	require.NoError(t, err)
	stream, err := client.WatchOperation(context.Background(), &opbrokerv1.WatchOperationRequest{Name: resp.GetOperation().GetName()})
	require.NoError(t, err)
	first, err := stream.Recv()
	require.NoError(t, err)
	require.Equal(t, opbrokerv1.Operation_STATE_PREPARED, first.GetSnapshot().GetState())

	worker := start(t, serveArgs(url, targets)...)
	worker.waitReady(t)
	var seen []opbrokerv1.Operation_State
	for {
		msg, err := stream.Recv()
		if err != nil {
			require.ErrorIs(t, err, io.EOF, "the stream ends with OK after the terminal state")
			break
		}
		if c := msg.GetChange(); c != nil {
			seen = append(seen, c.GetState())
		}
	}
	require.Equal(t, []opbrokerv1.Operation_State{opbrokerv1.Operation_STATE_IN_FLIGHT, opbrokerv1.Operation_STATE_SUCCEEDED}, seen)

	seen = nil
	for len(seen) < 3 {
		msg, err := tenant.Recv()
		require.NoError(t, err)
		if c := msg.GetChange(); c != nil {
			require.Equal(t, resp.GetOperation().GetName(), c.GetName())
			seen = append(seen, c.GetState())
		}
	}
	require.Equal(t, []opbrokerv1.Operation_State{opbrokerv1.Operation_STATE_PREPARED,
		opbrokerv1.Operation_STATE_IN_FLIGHT, opbrokerv1.Operation_STATE_SUCCEEDED}, seen)
	api.stop(t, syscall.SIGTERM)
	worker.stop(t, syscall.SIGTERM)
}

// TestServeRefusesAReconcileLeaseShorterThanTheDispatchLease: a replay is claimed under
// the reconciler's lease and kept by the dispatcher, which extends it every third of
// the dispatcher's lease; a shorter reconciler's lease could run out first.
func TestServeRefusesAReconcileLeaseShorterThanTheDispatchLease(t *testing.T) {
	t.Parallel()
	targets := targetsFile(t, simURL(t))
	got := opbroker(t, serveArgs("postgres://127.0.0.1:1/unreachable", targets, "--dispatch-lease", "30s", "--reconcile-lease", "5s")...)
	require.Equal(t, 1, got.code)
	require.Contains(t, got.stderr, "--reconcile-lease 5s is shorter than --dispatch-lease 30s")
	require.NotContains(t, opbroker(t, serveArgs("postgres://127.0.0.1:1/unreachable", targets,
		"--dispatch-lease", "30s", "--reconcile-lease", "5s", "--reconcile=false")...).stderr, "--reconcile-lease",
		"without a reconciler, its lease is not checked")
}
