package server_test

import (
	"context"
	"go/ast"
	"go/parser"
	"go/token"
	"log/slog"
	"maps"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/metric/noop"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/opbroker/opbroker/auth"
	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/server"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/storetest"
	"github.com/opbroker/opbroker/watch"
)

// documentedReasons reads the error table of docs/api.md: every reason with its code. A
// row names one code for all its reasons, or one code per reason, in order.
func documentedReasons(t *testing.T) map[string]codes.Code {
	t.Helper()
	doc, err := os.ReadFile("../docs/api.md")
	require.NoError(t, err)
	_, section, ok := strings.Cut(string(doc), "\n## Errors\n")
	require.True(t, ok, "docs/api.md has an Errors section")
	section, _, _ = strings.Cut(section, "\n## ")
	ticked := regexp.MustCompile("`([A-Z][A-Z0-9_]*)`")
	names := func(cell string) []string {
		var out []string
		for _, m := range ticked.FindAllStringSubmatch(cell, -1) {
			out = append(out, m[1])
		}
		return out
	}
	reasons := map[string]codes.Code{}
	for line := range strings.SplitSeq(section, "\n") {
		cells := strings.Split(line, "|")
		if !strings.HasPrefix(line, "| `") || len(cells) < 4 {
			continue
		}
		codeNames, rowReasons := names(cells[1]), names(cells[2])
		require.NotEmpty(t, rowReasons, "a row with no reason: %s", line)
		require.True(t, len(codeNames) == 1 || len(codeNames) == len(rowReasons), "one code, or one per reason: %s", line)
		for i, reason := range rowReasons {
			var code codes.Code
			require.NoError(t, code.UnmarshalJSON([]byte(strconv.Quote(codeNames[min(i, len(codeNames)-1)]))), line)
			_, dup := reasons[reason]
			require.False(t, dup, "%s is in the table twice", reason)
			reasons[reason] = code
		}
	}
	require.NotEmpty(t, reasons)
	return reasons
}

// seen is what a client received: the code and the ErrorInfo's reason (of our domain).
type seen struct {
	code   codes.Code
	reason string
}

func received(t *testing.T, err error) seen {
	t.Helper()
	require.Error(t, err)
	st := status.Convert(err)
	info := errorInfo(st)
	require.NotNil(t, info, "every error carries an ErrorInfo: %v", err)
	require.Equal(t, server.ErrorDomain, info.GetDomain())
	return seen{st.Code(), info.GetReason()}
}

// callLines is a slog handler that passes the line ending each call to a channel, so a
// test can wait for what the broker answered a call whose answer its client never sees.
type callLines chan map[string]string

func (c callLines) Enabled(context.Context, slog.Level) bool { return true }
func (c callLines) WithAttrs([]slog.Attr) slog.Handler       { return c }
func (c callLines) WithGroup(string) slog.Handler            { return c }
func (c callLines) Handle(_ context.Context, r slog.Record) error {
	if r.Message != "finished call" {
		return nil
	}
	line := map[string]string{"level": r.Level.String()}
	r.Attrs(func(a slog.Attr) bool { line[a.Key] = a.Value.String(); return true })
	select {
	case c <- line:
	default: // nobody waits for this one
	}
	return nil
}

// answered waits for the broker's log line of a call of method and returns its code and
// reason.
func (c callLines) answered(t *testing.T, method string) seen {
	t.Helper()
	timeout := time.After(10 * time.Second)
	for {
		select {
		case line := <-c:
			if line["method"] != method {
				continue
			}
			for code := range codes.Code(17) {
				if code.String() == line["code"] {
					return seen{code, line["reason"]}
				}
			}
			t.Fatalf("no code %q", line["code"])
		case <-timeout:
			t.Fatalf("no log line for %s", method)
		}
	}
}

// stallingConn is a client connection whose writes can be held: a call's cancellation
// then cannot reach the server, which sees its own deadline pass.
type stallingConn struct {
	net.Conn
	mu      sync.Mutex
	stalled chan struct{} // nil: writes pass; otherwise closed to release them
}

func (c *stallingConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	gate := c.stalled
	c.mu.Unlock()
	if gate != nil {
		<-gate
	}
	return c.Conn.Write(p)
}

func (c *stallingConn) stall() (release func()) {
	gate := make(chan struct{})
	c.mu.Lock()
	c.stalled = gate
	c.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			c.mu.Lock()
			c.stalled = nil
			c.mu.Unlock()
			close(gate)
		})
	}
}

// TestEveryDocumentedReason: every reason in docs/api.md's error table is sent, with the
// table's code, for a request that should produce it, over gRPC through the real
// interceptors. (TestServerSendsOnlyDocumentedReasons checks the other way round.)
func TestEveryDocumentedReason(t *testing.T) {
	t.Parallel()
	b := setup(t)
	prepare := func(req *opbrokerv1.PrepareOperationRequest) error {
		_, err := b.client.PrepareOperation(b.ctx, req)
		return err
	}
	prepared := func(t *testing.T, intent string) string {
		t.Helper()
		resp, err := b.client.PrepareOperation(b.ctx, prepareRequest("acme", intent, `{"amount":1}`))
		require.NoError(t, err)
		return resp.GetOperation().GetName()
	}
	// inFlight prepares an operation on a server of its own and claims it, as the
	// dispatcher would.
	inFlight := func(t *testing.T) (*testBundle, string) {
		t.Helper()
		own := setup(t)
		resp, err := own.client.PrepareOperation(own.ctx, prepareRequest("acme", "sent", `{"amount":1}`))
		require.NoError(t, err)
		claimed, err := own.store.AllTenants().Claim(own.ctx, store.ClaimParams{FairClaim: store.FairClaim{
			OperationTypes: []string{simtarget.DemoCharge}, Worker: "test", Lease: time.Minute, Limit: 1, PerTenant: 1, MaxTenants: 1}})
		require.NoError(t, err)
		require.Len(t, claimed, 1)
		return own, resp.GetOperation().GetName()
	}
	watchAllErr := func(req *opbrokerv1.WatchOperationsRequest) error {
		return recvFirst(b.client.WatchOperations(b.ctx, req))
	}
	resumeToken := func(t *testing.T) string {
		stream, err := b.client.WatchOperations(b.ctx, &opbrokerv1.WatchOperationsRequest{Tenant: "acme"})
		require.NoError(t, err)
		first, err := stream.Recv()
		require.NoError(t, err)
		return first.GetResumeToken()
	}
	const missing = "tenants/acme/operations/0190a4a8-0000-7000-8000-000000000000"
	authn, tokens := newPrincipals(t,
		auth.PrincipalConfig{Name: "acme-client", Roles: []auth.Role{auth.RoleClient}, Tenants: []string{"acme"}},
		auth.PrincipalConfig{Name: "acme-support", Roles: []auth.Role{auth.RoleSupportRead}, Tenants: []string{"acme"}})
	withAuth := setupWith(t, func(o *server.Options) { o.Auth = authn })

	// unknownOp prepares an operation on a server of its own and makes it UNKNOWN, as a
	// dispatcher's unclear send would; held also gives a reconciler its lease.
	unknownOp := func(t *testing.T, held bool, change ...func(*server.Options)) (*testBundle, *opbrokerv1.Operation) {
		t.Helper()
		own := setupWith(t, func(o *server.Options) {
			for _, c := range change {
				c(o)
			}
		})
		resp, err := own.client.PrepareOperation(own.ctx, prepareRequest("acme", "unclear", `{"amount":1}`))
		require.NoError(t, err)
		fair := store.FairClaim{OperationTypes: []string{simtarget.DemoCharge}, Worker: "test", Lease: time.Minute, Limit: 1, PerTenant: 1, MaxTenants: 1}
		claimed, err := own.store.AllTenants().Claim(own.ctx, store.ClaimParams{FairClaim: fair})
		require.NoError(t, err)
		require.Len(t, claimed, 1)
		_, err = own.store.AllTenants().RecordOutcome(own.ctx, store.OutcomeParams{TenantID: "acme", ID: claimed[0].ID,
			Fence: claimed[0].FenceToken, State: store.StateUnknown, Actor: "test", Observation: store.Observation{Outcome: "TIMEOUT"}})
		require.NoError(t, err)
		if held {
			_, err = own.store.AllTenants().ClaimUnknown(own.ctx, fair)
			require.NoError(t, err)
		}
		got, err := own.client.GetOperation(own.ctx, &opbrokerv1.GetOperationRequest{Name: resp.GetOperation().GetName()})
		require.NoError(t, err)
		return own, got.GetOperation()
	}
	resolve := func(own *testBundle, op *opbrokerv1.Operation, revision int64) error {
		_, err := opbrokerv1.NewAdminServiceClient(own.conn).ResolveOperation(own.ctx, &opbrokerv1.ResolveOperationRequest{
			Name: op.GetName(), Revision: revision, Resolution: opbrokerv1.ResolveOperationRequest_RESOLUTION_SUCCEEDED,
			RemoteRef: "ch_found", Reason: "at the target", Evidence: "searched the dashboard"})
		return err
	}
	approve := func(own *testBundle, op *opbrokerv1.Operation, revision int64) error {
		_, err := opbrokerv1.NewAdminServiceClient(own.conn).ApproveResolution(own.ctx, &opbrokerv1.ApproveResolutionRequest{
			Name: op.GetName(), Revision: revision})
		return err
	}
	produce := map[string]func(t *testing.T) seen{
		server.ReasonRevisionChanged: func(t *testing.T) seen {
			own, op := unknownOp(t, false)
			return received(t, resolve(own, op, op.GetRevision()-1))
		},
		server.ReasonBeingReconciled: func(t *testing.T) seen {
			own, op := unknownOp(t, true)
			return received(t, resolve(own, op, op.GetRevision()))
		},
		server.ReasonSendMayStillLand: func(t *testing.T) seen {
			own, op := unknownOp(t, false)
			_, err := opbrokerv1.NewAdminServiceClient(own.conn).ResolveOperation(own.ctx, &opbrokerv1.ResolveOperationRequest{
				Name: op.GetName(), Revision: op.GetRevision(), Resolution: opbrokerv1.ResolveOperationRequest_RESOLUTION_FAILED_TERMINAL,
				Reason: "not at the target", Evidence: "searched the dashboard"})
			return received(t, err)
		},
		server.ReasonTargetConfirmedEffect: func(t *testing.T) seen {
			own := setup(t)
			resp, err := own.client.PrepareOperation(own.ctx, prepareRequest("acme", "confirmed late", `{"amount":1}`))
			require.NoError(t, err)
			all := own.store.AllTenants()
			claimed, err := all.Claim(own.ctx, store.ClaimParams{FairClaim: store.FairClaim{OperationTypes: []string{simtarget.DemoCharge},
				Worker: "test", Lease: time.Minute, Limit: 1, PerTenant: 1, MaxTenants: 1}})
			require.NoError(t, err)
			require.Len(t, claimed, 1)
			_, err = all.SweepExpiredLeases(own.ctx, store.SweepParams{Now: time.Now().Add(time.Hour), Limit: 1})
			require.NoError(t, err)
			_, err = all.RecordOutcome(own.ctx, store.OutcomeParams{TenantID: "acme", ID: claimed[0].ID, Fence: claimed[0].FenceToken,
				State: store.StateSucceeded, RemoteRef: "ch_late", Actor: "test", Observation: store.Observation{Outcome: "VERIFIED_SUCCESS"}})
			require.ErrorIs(t, err, store.ErrFenceLost, "kept: the lease had expired")
			got, err := own.client.GetOperation(own.ctx, &opbrokerv1.GetOperationRequest{Name: resp.GetOperation().GetName()})
			require.NoError(t, err)
			_, err = opbrokerv1.NewAdminServiceClient(own.conn).ResolveOperation(own.ctx, &opbrokerv1.ResolveOperationRequest{
				Name: got.GetOperation().GetName(), Revision: got.GetOperation().GetRevision(),
				Resolution: opbrokerv1.ResolveOperationRequest_RESOLUTION_FAILED_TERMINAL,
				Reason:     "not at the target", Evidence: "searched the dashboard"})
			require.Equal(t, "ch_late", errorInfo(status.Convert(err)).GetMetadata()["remoteRef"], "the reference to resolve it with")

			// An escalation whose target's event said it succeeded: the event's id too (on a
			// test of its own: the operation above is still UNKNOWN).
			own = setup(t)
			all = own.store.AllTenants()
			escalated := escalate(t, own, "acme", storetestPrepare(t, own, "acme"))
			_, _, err = all.ReceiveEvidence(own.ctx, store.InboundEvidence{Target: "demo-payments", EventID: "evt_ok", Source: store.SourceWebhook,
				EventType: "charge.succeeded", Meaning: "SUCCEEDED", Reference: "ref", ReferenceKind: "remote_ref", RemoteRef: "ch_event",
				Body: []byte(`{}`)}, time.Hour, time.Minute)
			require.NoError(t, err)
			require.NoError(t, all.SettleEvidence(own.ctx, store.EvidenceSettlement{EvidenceKey: store.EvidenceKey{Target: "demo-payments", EventID: "evt_ok"},
				From: store.EvidencePending, To: store.EvidenceApplied, TenantID: "acme", ID: escalated.ID,
				Change: &store.EvidenceChange{Revision: escalated.Revision, From: store.StateEscalated, To: store.StateEscalated,
					Observation: store.Observation{Source: "EVIDENCE", Outcome: "EVIDENCE_SUCCEEDED", EventID: "evt_ok"}, Actor: "webhook:test",
					Reason: "EVIDENCE_SUCCEEDED"}}))
			_, err = opbrokerv1.NewAdminServiceClient(own.conn).ResolveOperation(own.ctx, &opbrokerv1.ResolveOperationRequest{
				Name: "tenants/acme/operations/" + escalated.ID.String(), Revision: escalated.Revision + 1,
				Resolution: opbrokerv1.ResolveOperationRequest_RESOLUTION_FAILED_TERMINAL,
				Reason:     "not at the target", Evidence: "searched the dashboard"})
			info := errorInfo(status.Convert(err))
			require.Equal(t, server.ReasonTargetConfirmedEffect, info.GetReason(), "%v", err)
			require.Equal(t, map[string]string{"remoteRef": "ch_event", "eventId": "evt_ok"}, info.GetMetadata())
			return received(t, err)
		},
		server.ReasonNoPendingResolution: func(t *testing.T) seen {
			own, op := unknownOp(t, false)
			return received(t, approve(own, op, op.GetRevision()))
		},
		server.ReasonSameOperator: func(t *testing.T) seen {
			own, op := unknownOp(t, false, func(o *server.Options) { o.Targets = fourEyesTargets(t, time.Hour) })
			require.NoError(t, resolve(own, op, op.GetRevision())) // proposed by dev, who approves too
			return received(t, approve(own, op, op.GetRevision()+1))
		},
		server.ReasonResolutionExpired: func(t *testing.T) seen {
			own, op := unknownOp(t, false)
			_, id, _ := strings.Cut(op.GetName(), "/operations/")
			_, err := own.store.AllTenants().ProposeResolution(own.ctx, store.ManualResolution{TenantID: "acme", ID: uuid.MustParse(id),
				Revision: op.GetRevision(), State: store.StateFailedTerminal, Reason: "not there", Evidence: "searched",
				Actor: "operator:someone-else"}, time.Millisecond)
			require.NoError(t, err)
			time.Sleep(10 * time.Millisecond)
			return received(t, approve(own, op, op.GetRevision()+1))
		},
		server.ReasonFieldRequired: func(t *testing.T) seen {
			return received(t, prepare(&opbrokerv1.PrepareOperationRequest{}))
		},
		server.ReasonFieldInvalid: func(t *testing.T) seen {
			return received(t, prepare(prepareRequest("9acme", "r-1", `{}`)))
		},
		server.ReasonRequestMalformed: func(t *testing.T) seen {
			return received(t, b.conn.Invoke(b.ctx, opbrokerv1.OperationService_GetOperation_FullMethodName, []byte{0x0a, 0x7f},
				new(struct{}), grpc.ForceCodecV2(rawCodec{})))
		},
		server.ReasonInvalidArgument: func(t *testing.T) seen {
			req := prepareRequest("", "r-1", `{}`) // FIELD_REQUIRED
			req.ContentType = "json"               // FIELD_INVALID
			return received(t, prepare(req))
		},
		server.ReasonUnknownOperationType: func(t *testing.T) seen {
			req := prepareRequest("acme", "r-1", `{}`)
			req.OperationType = "demo.nothing"
			return received(t, prepare(req))
		},
		server.ReasonPayloadTooLarge: func(t *testing.T) seen {
			return received(t, prepare(prepareRequest("acme", "r-1", `"`+strings.Repeat("x", testMaxPayload)+`"`)))
		},
		server.ReasonPayloadInvalid: func(t *testing.T) seen {
			return received(t, prepare(prepareRequest("acme", "r-1", `{"amount":`)))
		},
		server.ReasonSupersedesOtherTenant: func(t *testing.T) seen {
			req := prepareRequest("acme", "r-1", `{}`)
			req.Supersedes = strings.Replace(missing, "/acme/", "/globex/", 1)
			return received(t, prepare(req))
		},
		server.ReasonDeadlinePassed: func(t *testing.T) seen {
			req := prepareRequest("acme", "r-deadline", `{}`)
			req.DispatchDeadline = timestamppb.New(time.Now().Add(-time.Hour))
			return received(t, prepare(req))
		},
		server.ReasonPageTokenInvalid: func(t *testing.T) seen {
			_, err := b.client.ListOperations(b.ctx, &opbrokerv1.ListOperationsRequest{Tenant: "acme", PageToken: "!!"})
			return received(t, err)
		},
		server.ReasonPageTokenMismatch: func(t *testing.T) seen {
			prepared(t, "page-1")
			prepared(t, "page-2")
			page, err := b.client.ListOperations(b.ctx, &opbrokerv1.ListOperationsRequest{Tenant: "acme", PageSize: 1})
			require.NoError(t, err)
			require.NotEmpty(t, page.GetNextPageToken())
			_, err = b.client.ListOperations(b.ctx, &opbrokerv1.ListOperationsRequest{Tenant: "globex", PageToken: page.GetNextPageToken()})
			return received(t, err)
		},
		server.ReasonResumeTokenInvalid: func(t *testing.T) seen {
			return received(t, watchAllErr(&opbrokerv1.WatchOperationsRequest{Tenant: "acme", ResumeToken: "bm90IGEgdG9rZW4"}))
		},
		server.ReasonResumeTokenMismatch: func(t *testing.T) seen {
			return received(t, watchAllErr(&opbrokerv1.WatchOperationsRequest{Tenant: "globex", ResumeToken: resumeToken(t)}))
		},
		server.ReasonIntentPayloadMismatch: func(t *testing.T) seen {
			prepared(t, "mismatch")
			return received(t, prepare(prepareRequest("acme", "mismatch", `{"amount":2}`)))
		},
		server.ReasonOperationNotFound: func(t *testing.T) seen {
			_, err := b.client.GetOperation(b.ctx, &opbrokerv1.GetOperationRequest{Name: missing})
			return received(t, err)
		},
		server.ReasonSupersededOperationNotFound: func(t *testing.T) seen {
			req := prepareRequest("acme", "amend-missing", `{}`)
			req.Supersedes = missing
			return received(t, prepare(req))
		},
		server.ReasonOperationState: func(t *testing.T) seen {
			own, name := inFlight(t)
			_, err := own.client.CancelOperation(own.ctx, &opbrokerv1.CancelOperationRequest{Name: name})
			return received(t, err)
		},
		server.ReasonSupersededUnresolved: func(t *testing.T) seen {
			own, name := inFlight(t)
			req := prepareRequest("acme", "amend", `{}`)
			req.Supersedes = name
			_, err := own.client.PrepareOperation(own.ctx, req)
			return received(t, err)
		},
		server.ReasonTenantHasOpenOperations: func(t *testing.T) seen {
			other := setup(t)
			storetest.PrepareJSON(t, other.store, "acme", "demo.charge", "open", `{}`)
			_, err := opbrokerv1.NewAdminServiceClient(other.conn).DeleteTenantData(b.ctx, &opbrokerv1.DeleteTenantDataRequest{Tenant: "acme"})
			return received(t, err)
		},
		server.ReasonDatabaseUnavailable: func(t *testing.T) seen {
			pool, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none?connect_timeout=2")
			require.NoError(t, err)
			t.Cleanup(pool.Close)
			conn := serve(t, server.Options{Store: store.New(pool), Targets: demoTargets(t),
				Logger: slog.New(slog.DiscardHandler), MeterProvider: noop.NewMeterProvider()})
			_, err = opbrokerv1.NewOperationServiceClient(conn).GetOperation(b.ctx, &opbrokerv1.GetOperationRequest{Name: missing})
			return received(t, err)
		},
		server.ReasonShuttingDown: func(t *testing.T) seen {
			other := setup(t)
			resp, err := other.client.PrepareOperation(other.ctx, prepareRequest("acme", "stop", `{}`))
			require.NoError(t, err)
			stream, err := other.client.WatchOperation(other.ctx, &opbrokerv1.WatchOperationRequest{Name: resp.GetOperation().GetName()})
			require.NoError(t, err)
			_, err = stream.Recv()
			require.NoError(t, err)
			go other.srv.Stop(5 * time.Second)
			_, err = collect(t, stream)
			return received(t, err)
		},
		server.ReasonRevisionTooOld: func(t *testing.T) seen {
			own := setup(t)
			resp, err := own.client.PrepareOperation(own.ctx, prepareRequest("acme", "too-old", `{}`))
			require.NoError(t, err)
			name := resp.GetOperation().GetName()
			id := uuid.MustParse(strings.TrimPrefix(name, "tenants/acme/operations/"))
			drive(t, own, own.store, id)
			historyGap(t, own, id, 2)
			stream, err := own.client.WatchOperation(own.ctx, &opbrokerv1.WatchOperationRequest{Name: name, StartAfterRevision: 1})
			require.NoError(t, err)
			_, err = collect(t, stream) // the operation is terminal: the stream ends
			return received(t, err)
		},
		server.ReasonRevisionNotReached: func(t *testing.T) seen {
			return received(t, recvFirst(b.client.WatchOperation(b.ctx, &opbrokerv1.WatchOperationRequest{Name: prepared(t, "not-reached"), StartAfterRevision: 2})))
		},
		server.ReasonCredentialsMissing: func(t *testing.T) seen {
			_, err := withAuth.client.ListOperations(b.ctx, &opbrokerv1.ListOperationsRequest{Tenant: "acme"})
			return received(t, err)
		},
		server.ReasonCredentialsInvalid: func(t *testing.T) seen {
			ctx := metadata.AppendToOutgoingContext(b.ctx, "authorization", "Bearer opb_forged")
			_, err := withAuth.client.ListOperations(ctx, &opbrokerv1.ListOperationsRequest{Tenant: "acme"})
			return received(t, err)
		},
		server.ReasonRoleRequired: func(t *testing.T) seen {
			_, err := withAuth.client.PrepareOperation(tokens.as(b.ctx, "acme-support"), prepareRequest("acme", "role", `{}`))
			return received(t, err)
		},
		server.ReasonTenantNotPermitted: func(t *testing.T) seen {
			_, err := withAuth.client.ListOperations(tokens.as(b.ctx, "acme-client"), &opbrokerv1.ListOperationsRequest{Tenant: "globex"})
			return received(t, err)
		},
		server.ReasonTenantRateLimited: func(t *testing.T) seen {
			limited := setupWith(t, func(o *server.Options) { o.Limits.TenantRate, o.Limits.TenantBurst = 0.001, 1 })
			_, err := limited.client.ListOperations(b.ctx, &opbrokerv1.ListOperationsRequest{Tenant: "acme"})
			require.NoError(t, err)
			_, err = limited.client.ListOperations(b.ctx, &opbrokerv1.ListOperationsRequest{Tenant: "acme"})
			return received(t, err)
		},
		server.ReasonWatchLimit: func(t *testing.T) seen {
			limited := setupWith(t, func(o *server.Options) { o.Limits.WatchesPerPrincipal = 1 })
			require.NoError(t, recvFirst(limited.client.WatchOperations(b.ctx, &opbrokerv1.WatchOperationsRequest{Tenant: "acme"})))
			return received(t, recvFirst(limited.client.WatchOperations(b.ctx, &opbrokerv1.WatchOperationsRequest{Tenant: "acme"})))
		},
		// The client's library reports a cancelled call itself; the broker's answer is
		// in its log line.
		server.ReasonCancelled: func(t *testing.T) seen {
			lines := make(callLines, 100)
			other := setupWith(t, func(o *server.Options) { o.Logger = slog.New(lines) })
			resp, err := other.client.PrepareOperation(other.ctx, prepareRequest("acme", "cancelled", `{}`))
			require.NoError(t, err)
			ctx, cancel := context.WithCancel(other.ctx)
			stream, err := other.client.WatchOperation(ctx, &opbrokerv1.WatchOperationRequest{Name: resp.GetOperation().GetName()})
			require.NoError(t, err)
			_, err = stream.Recv()
			require.NoError(t, err)
			cancel()
			return lines.answered(t, opbrokerv1.OperationService_WatchOperation_FullMethodName)
		},
		// The same for a deadline: the client's writes are held once the stream is open,
		// so its cancellation cannot overtake the server's own deadline.
		server.ReasonDeadlineExceeded: func(t *testing.T) seen {
			lines := make(callLines, 100)
			st, _ := storetest.NewStore(t)
			hub := watch.New(st, slog.New(slog.DiscardHandler), 50*time.Millisecond)
			require.NoError(t, hub.Start(context.Background()))
			t.Cleanup(hub.Stop)
			srv, err := server.New(server.Options{Store: st, Targets: demoTargets(t), Logger: slog.New(lines),
				MeterProvider: noop.NewMeterProvider(), Hub: hub, WatchHeartbeat: time.Hour})
			require.NoError(t, err)
			srv.SetServing()
			lis := bufconn.Listen(1 << 20)
			go func() { _ = srv.GRPC.Serve(lis) }()
			t.Cleanup(func() { srv.Stop(time.Second) })
			var clientConn *stallingConn
			conn, err := grpc.NewClient("passthrough:///bufconn",
				grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) {
					c, err := lis.DialContext(ctx)
					clientConn = &stallingConn{Conn: c}
					return clientConn, err
				}),
				grpc.WithTransportCredentials(insecure.NewCredentials()))
			require.NoError(t, err)
			t.Cleanup(func() { conn.Close() })
			client := opbrokerv1.NewOperationServiceClient(conn)
			resp, err := client.PrepareOperation(b.ctx, prepareRequest("acme", "deadline", `{}`))
			require.NoError(t, err)
			ctx, cancel := context.WithTimeout(b.ctx, time.Second)
			defer cancel()
			stream, err := client.WatchOperation(ctx, &opbrokerv1.WatchOperationRequest{Name: resp.GetOperation().GetName()})
			require.NoError(t, err)
			_, err = stream.Recv()
			require.NoError(t, err)
			release := clientConn.stall()
			defer release()
			return lines.answered(t, opbrokerv1.OperationService_WatchOperation_FullMethodName)
		},
		server.ReasonUnknownTarget:          func(t *testing.T) seen { return reviewReasons(t, server.ReasonUnknownTarget) },
		server.ReasonTargetReadsNoEvidence:  func(t *testing.T) seen { return reviewReasons(t, server.ReasonTargetReadsNoEvidence) },
		server.ReasonEventInvalid:           func(t *testing.T) seen { return reviewReasons(t, server.ReasonEventInvalid) },
		server.ReasonEvidenceNotFound:       func(t *testing.T) seen { return reviewReasons(t, server.ReasonEvidenceNotFound) },
		server.ReasonEvidenceNotQuarantined: func(t *testing.T) seen { return reviewReasons(t, server.ReasonEvidenceNotQuarantined) },
		server.ReasonEvidenceDoesNotMatch:   func(t *testing.T) seen { return reviewReasons(t, server.ReasonEvidenceDoesNotMatch) },
		server.ReasonEvidenceChanged:        func(t *testing.T) seen { return reviewReasons(t, server.ReasonEvidenceChanged) },
		server.ReasonInternal: func(t *testing.T) seen {
			conn := serve(t, server.Options{Store: nil, // every handler that touches the store panics
				Targets: demoTargets(t), Logger: slog.New(slog.DiscardHandler), MeterProvider: noop.NewMeterProvider()})
			_, err := opbrokerv1.NewOperationServiceClient(conn).GetOperation(b.ctx, &opbrokerv1.GetOperationRequest{Name: missing})
			return received(t, err)
		},
	}

	documented := documentedReasons(t)
	require.ElementsMatch(t, slices.Collect(maps.Keys(documented)), slices.Collect(maps.Keys(produce)),
		"the reasons this test produces are exactly those of docs/api.md's error table")
	for reason, code := range documented {
		t.Run(reason, func(t *testing.T) {
			got := produce[reason](t)
			require.Equal(t, seen{code, reason}, got)
		})
	}
}

// notSent are reasons in the code that no client receives, and why.
var notSent = map[string]string{
	"INJECTED_FAILURE": "only in builds with crash points (the chaos run)",
	"NAME_FORMAT":      "parseOperationName refuses only names the proto's pattern has already refused",
}

// TestServerSendsOnlyDocumentedReasons: every reason the server package can send (a
// Reason constant, or a literal given to violation or newStatus) is in docs/api.md's
// error table. Reasons built at run time (the token reasons of decodeToken) are covered
// by TestEveryDocumentedReason.
func TestServerSendsOnlyDocumentedReasons(t *testing.T) {
	t.Parallel()
	documented := documentedReasons(t)
	files, err := filepath.Glob("*.go")
	require.NoError(t, err)
	inCode := map[string]string{} // reason → where
	fset := token.NewFileSet()
	for _, path := range files {
		if strings.HasSuffix(path, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, path, nil, 0)
		require.NoError(t, err)
		literal := func(e ast.Expr) {
			if lit, ok := e.(*ast.BasicLit); ok && lit.Kind == token.STRING {
				s, err := strconv.Unquote(lit.Value)
				require.NoError(t, err)
				inCode[s] = fset.Position(lit.Pos()).String()
			}
		}
		ast.Inspect(f, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.ValueSpec:
				for i, name := range n.Names {
					if strings.HasPrefix(name.Name, "Reason") && i < len(n.Values) {
						literal(n.Values[i])
					}
				}
			case *ast.CallExpr:
				if fn, ok := n.Fun.(*ast.Ident); ok && (fn.Name == "violation" || fn.Name == "newStatus") && len(n.Args) >= 3 {
					literal(n.Args[2])
				}
			}
			return true
		})
	}
	require.NotEmpty(t, inCode)
	for reason, where := range inCode {
		if _, ok := notSent[reason]; ok {
			continue
		}
		_, ok := documented[reason]
		require.True(t, ok, "%s (%s) is not in docs/api.md's error table", reason, where)
	}
	for reason := range notSent {
		require.Contains(t, inCode, reason, "an exemption for a reason the code no longer has")
	}
}
