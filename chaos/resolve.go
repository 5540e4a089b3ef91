package chaos

import (
	"context"
	"fmt"
	"math/rand/v2"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/server"
	"github.com/opbroker/opbroker/simtarget"
)

// operatorName is the run's on-call operator, a principal with every tenant.
const operatorName = "oncall"

// operatorLooks is how many times the operator lists the escalations at most: 30 s of
// waiting, 200 ms after each look that leaves some to wait for or finds no replica
// serving.
const operatorLooks = 150

// resolveEscalations does what the owners of the run's escalations would: it lists the
// escalation queue through the API, checks each operation at its target (the run's
// ground truth, by the remote key the queue shows an operator) and records what it
// found with ResolveOperation: SUCCEEDED with the effect's id where the target made it,
// FAILED_TERMINAL where it did not (or where it failed). An effect the target still
// processes may yet succeed, and a request it is still handling may yet take effect
// (the runbook: no failure while a send can still land): the operator waits for both to
// finish, and for a replica to serve when none does. It returns how many it resolved,
// and when escalations are left after its last look (or may be: no replica served), an
// error that says why they were.
func (c *cluster) resolveEscalations(ctx context.Context, rng *rand.Rand) (int, error) {
	resolved := 0
	// What the last look left unresolved, and why.
	left := ""
	for attempt := 0; attempt < operatorLooks && ctx.Err() == nil; attempt++ {
		conn, err := c.client(rng)
		if err != nil {
			// Every replica is down: the run's end stops those still armed with a crash
			// point (restartArmed), and the supervisor starts them again a moment later.
			left = "no replica to list them with: " + err.Error()
			time.Sleep(200 * time.Millisecond)
			continue
		}
		truth := c.truth()
		admin := opbrokerv1.NewAdminServiceClient(conn)
		callCtx, cancel := context.WithTimeout(c.asOperator(ctx), 10*time.Second)
		list, err := admin.ListEscalations(callCtx, &opbrokerv1.ListEscalationsRequest{PageSize: 1000})
		cancel()
		if err != nil {
			left = fmt.Sprintf("the escalations could not be listed: %v", err)
			time.Sleep(200 * time.Millisecond)
			continue
		}
		if len(list.GetEscalations()) == 0 {
			return resolved, nil
		}
		var atTarget, mayLand, again int
		for _, e := range list.GetEscalations() {
			op := e.GetOperation()
			if kt := truth[op.GetRemoteKey()]; kt != nil && (kt.Processing > 0 || kt.Committing > 0) {
				atTarget++ // looked at again once the target has finished
				continue
			}
			req := &opbrokerv1.ResolveOperationRequest{Name: op.GetName(), Revision: op.GetRevision(),
				Resolution: opbrokerv1.ResolveOperationRequest_RESOLUTION_FAILED_TERMINAL,
				Reason:     "checked at the target: no effect under the operation's key",
				Evidence:   "the target's record of key " + op.GetRemoteKey()}
			if kt := truth[op.GetRemoteKey()]; kt != nil && settledEffect(kt) != "" {
				req.Resolution, req.RemoteRef = opbrokerv1.ResolveOperationRequest_RESOLUTION_SUCCEEDED, settledEffect(kt)
				req.Reason = "checked at the target: the effect exists under the operation's key"
			}
			callCtx, cancel := context.WithTimeout(c.asOperator(ctx), 10*time.Second)
			_, err := admin.ResolveOperation(callCtx, req)
			cancel()
			switch code := status.Code(err); {
			case code == codes.OK:
				resolved++
			case code == codes.Aborted, code == codes.Unavailable, code == codes.DeadlineExceeded:
				again++ // listed again
			case code == codes.FailedPrecondition && reasonOf(err) == server.ReasonSendMayStillLand:
				mayLand++ // the broker says the last send may still land: look again later
			default:
				return resolved, fmt.Errorf("resolving %s: %w", op.GetName(), err)
			}
		}
		left = ""
		if atTarget+mayLand+again > 0 {
			left = fmt.Sprintf("%d listed: %d still at their target, %d whose last send may still land, %d to be tried again",
				len(list.GetEscalations()), atTarget, mayLand, again)
			time.Sleep(200 * time.Millisecond)
		}
	}
	switch {
	case left == "":
		return resolved, ctx.Err()
	case ctx.Err() != nil:
		return resolved, fmt.Errorf("%w; the last look: %s", ctx.Err(), left)
	}
	return resolved, fmt.Errorf("escalations left after %d looks; the last: %s", operatorLooks, left)
}

// settledEffect is the id of an effect the target finished (neither processing nor
// failed), or "".
func settledEffect(kt *simtarget.KeyTruth) string {
	if kt.Effects-kt.Processing-kt.Failed <= 0 || len(kt.IDs) == 0 {
		return ""
	}
	return kt.IDs[0]
}

// asOperator returns ctx with the operator's bearer token.
func (c *cluster) asOperator(ctx context.Context) context.Context {
	return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+c.tokens[operatorName])
}
