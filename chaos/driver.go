package chaos

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/server"
	"github.com/opbroker/opbroker/simtarget"
)

// intent is one business intent of the workload and what the clients were told of it.
type intent struct {
	req *opbrokerv1.PrepareOperationRequest

	mu    sync.Mutex
	acked []string // the operation names of every acknowledged PrepareOperation
}

func (in *intent) ack(name string) {
	in.mu.Lock()
	defer in.mu.Unlock()
	in.acked = append(in.acked, name)
}

func (in *intent) name() string {
	in.mu.Lock()
	defer in.mu.Unlock()
	if len(in.acked) == 0 {
		return ""
	}
	return in.acked[0]
}

// history is the clients' side of the run: every intent and what came back, and what
// the cross-tenant probes saw.
type history struct {
	mu         sync.Mutex
	intents    []*intent
	probes     int
	violations []string // I8: a probe that got anything but a refusal
	gaveUp     int      // intents never acknowledged (within the retry budget): not counted as lost
	// amendmentsWaited counts amendments refused because their original was not settled
	// yet, which the client sent again once it was.
	amendmentsWaited int
}

func (h *history) add(in *intent) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.intents = append(h.intents, in)
}

// drive runs the workload: cfg.Intents intents over cfg.Tenants tenants (a few hot ones
// get most), by cfg.Clients clients, with concurrent duplicates, retries after the
// acknowledgement, legitimate repeats (a new intent with the same payload), amendments
// (a new intent that supersedes an acknowledged one) and cross-tenant probes.
func (c *cluster) drive(ctx context.Context, h *history, round int) {
	work := make(chan int)
	var wg sync.WaitGroup
	for w := range c.cfg.Clients {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(c.cfg.Seed+uint64(round), uint64(w)+1))
			for i := range work {
				c.runIntent(ctx, rng, h, i)
			}
		})
	}
	for i := range c.cfg.Intents {
		select {
		case work <- round*c.cfg.Intents + i:
		case <-ctx.Done():
		}
	}
	close(work)
	wg.Wait()
}

// webhookFaultOf returns which of simtarget.WebhookFaults intent i's charge carries, or
// -1: each fault twice, on intents 1 to 7 and 9 to 15 (8 is always amended), because a
// charge can end without effect (a replica killed before its send left, then found
// absent), and a short run must still see every fault on some charge's events.
func webhookFaultOf(i int) int {
	n := len(simtarget.WebhookFaults)
	switch {
	case i >= 1 && i <= n:
		return i - 1
	case i >= n+2 && i <= 2*n+1:
		return i - n - 2
	}
	return -1
}

// unclearNotification is the intent that is always a notification whose target makes
// the effect and then resets the connection. The notification target has neither
// idempotency keys nor a lookup, so the operation is escalated and the run's operator
// resolves it: a short run must see that too, and the notifications the random
// faults leave unclear are too few to count on (a run on a loaded machine had none).
// It comes after the intents webhookFaultOf gives a fault. The intent after it is
// always probed by another tenant, for the same reason (a short run once had none).
var unclearNotification = 2*len(simtarget.WebhookFaults) + 2

func (c *cluster) runIntent(ctx context.Context, rng *rand.Rand, h *history, i int) {
	tenant := fmt.Sprintf("tenant-%d", hotTenant(rng, c.cfg.Tenants))
	typ := []string{typeCharge, typeCharge, typeCharge, typeProvision, typeProvision, typeNotify, typeObject, typeObject}[rng.IntN(8)]
	// The account is the tenant's at the targets: the charge target's events name it.
	payload := fmt.Appendf(nil, `{"account":%q,"amount":%d,"order":%d}`, tenant, 1+rng.IntN(10000), i)
	if typ == typeCharge && rng.IntN(10) == 0 { // a charge the provider declines after processing
		payload = fmt.Appendf(nil, `{"account":%q,"amount":%d,"order":%d,"sim":{"completes":"failed"}}`, tenant, 1+rng.IntN(10000), i)
	}
	if i == 0 { // a charge throttled once (429, documented as not executed), then sent again
		typ, payload = typeCharge, fmt.Appendf(nil, `{"account":%q,"amount":1,"order":0,"sim":{"fault":"throttle","times":1}}`, tenant)
	}
	if k := webhookFaultOf(i); k >= 0 { // each fault of the charge target's events, on a charge
		typ, payload = typeCharge, fmt.Appendf(nil, `{"account":%q,"amount":%d,"order":%d,"sim":{"fault":%q,"webhook":%q}}`,
			tenant, 1+rng.IntN(10000), i, simtarget.FaultLookupLag, simtarget.WebhookFaults[k])
	}
	if i == unclearNotification { // a notification left unclear: a person resolves it
		typ, payload = typeNotify, fmt.Appendf(nil, `{"account":%q,"amount":1,"order":%d,"sim":{"fault":%q}}`,
			tenant, i, simtarget.FaultCommitThenReset)
	}
	in := &intent{req: &opbrokerv1.PrepareOperationRequest{Tenant: tenant, OperationType: typ,
		IntentRef: fmt.Sprintf("intent-%d", i), ContentType: "application/json", Payload: payload}}
	h.add(in)

	if rng.IntN(5) == 0 { // a concurrent duplicate, as from a client that timed out and retried at once
		var wg sync.WaitGroup
		other := rand.New(rand.NewPCG(rng.Uint64(), 7)) // the client's own random source
		wg.Go(func() { _ = c.prepare(ctx, other, h, in) })
		_ = c.prepare(ctx, rng, h, in)
		wg.Wait()
	} else {
		_ = c.prepare(ctx, rng, h, in)
	}
	name := in.name()
	if name == "" {
		return
	}
	if rng.IntN(10) == 0 { // a retry long after the acknowledgement
		_ = c.prepare(ctx, rng, h, in)
	}
	if rng.IntN(20) == 0 { // a genuinely new action with the same payload: a new intent
		repeat := &intent{req: cloneRequest(in.req)}
		repeat.req.IntentRef += "-repeat"
		h.add(repeat)
		_ = c.prepare(ctx, rng, h, repeat)
	}
	// An amendment of the acknowledged operation; the first round's ninth intent always
	// has one, so that a short run has one too, and the unclear notification never has
	// one, which could cancel it before its send.
	if rng.IntN(20) == 0 && i != unclearNotification || i == len(simtarget.WebhookFaults)+1 {
		amend := &intent{req: cloneRequest(in.req)}
		amend.req.IntentRef += "-amend"
		amend.req.Supersedes = name
		amend.req.Payload = fmt.Appendf(nil, `{"account":%q,"amount":%d,"order":%d,"amended":true}`, tenant, 1+rng.IntN(10000), i)
		h.add(amend)
		c.amend(ctx, rng, h, amend)
	}
	if rng.IntN(10) == 0 || i == unclearNotification+1 { // always the one after the notification
		c.probe(ctx, rng, h, tenant, name)
	}
}

func cloneRequest(r *opbrokerv1.PrepareOperationRequest) *opbrokerv1.PrepareOperationRequest {
	return proto.Clone(r).(*opbrokerv1.PrepareOperationRequest)
}

// hotTenant picks tenant 0 half the time, tenant 1 a quarter, and so on.
func hotTenant(rng *rand.Rand, n int) int {
	for i := range n - 1 {
		if rng.IntN(2) == 0 {
			return i
		}
	}
	return n - 1
}

// retryable says whether a client should try a PrepareOperation again: the broker was
// unreachable, stopping, failed, or refused for load.
func retryable(err error) bool {
	switch status.Code(err) {
	case codes.Unavailable, codes.DeadlineExceeded, codes.Internal, codes.ResourceExhausted, codes.Aborted, codes.Unknown:
		return true
	}
	return false
}

// amend prepares an amendment as a client that follows the rule does: while the
// original is not settled the broker refuses it (SUPERSEDED_OPERATION_UNRESOLVED), so
// the client waits until the original is terminal and sends it again. An original that
// ends ESCALATED waits for a person: the amendment is given up.
func (c *cluster) amend(ctx context.Context, rng *rand.Rand, h *history, in *intent) {
	waited := false
	for ctx.Err() == nil {
		err := c.prepare(ctx, rng, h, in)
		if status.Code(err) != codes.FailedPrecondition || reasonOf(err) != server.ReasonSupersededUnresolved {
			return
		}
		if !waited {
			waited = true
			h.mu.Lock()
			h.amendmentsWaited++
			h.mu.Unlock()
		}
		if !c.waitSettled(ctx, rng, in.req.GetTenant(), in.req.GetSupersedes()) {
			return
		}
	}
}

// waitSettled polls an operation until it is terminal (true) or ESCALATED, or a minute
// passes (false).
func (c *cluster) waitSettled(ctx context.Context, rng *rand.Rand, tenant, name string) bool {
	for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline) && ctx.Err() == nil; {
		if conn, err := c.client(rng); err == nil {
			callCtx, cancel := context.WithTimeout(c.as(ctx, tenant), 5*time.Second)
			resp, err := opbrokerv1.NewOperationServiceClient(conn).GetOperation(callCtx, &opbrokerv1.GetOperationRequest{Name: name})
			cancel()
			if err == nil {
				switch st := strings.TrimPrefix(resp.GetOperation().GetState().String(), "STATE_"); {
				case slices.Contains(terminal, st):
					return true
				case st == "ESCALATED":
					return false
				}
			}
		}
		time.Sleep(time.Duration(100+rng.IntN(200)) * time.Millisecond)
	}
	return false
}

// outcomeOf names a call's failure by its code and reason, or "" when it succeeded.
func outcomeOf(err error) string {
	if err == nil {
		return ""
	}
	if reason := reasonOf(err); reason != "" {
		return status.Code(err).String() + " " + reason
	}
	return status.Code(err).String()
}

// reasonOf returns the ErrorInfo reason of a gRPC error, or "".
func reasonOf(err error) string {
	for _, d := range status.Convert(err).Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			return info.GetReason()
		}
	}
	return ""
}

// prepare sends the intent's PrepareOperation until it is acknowledged, retrying the
// same request as a careful client does, for up to a minute. It returns the error that
// ended it without an acknowledgement (nil when acknowledged).
func (c *cluster) prepare(ctx context.Context, rng *rand.Rand, h *history, in *intent) error {
	answered, err := c.ask(ctx, rng, in.req.GetTenant(), time.Minute, 5*time.Second,
		func(ctx context.Context, client opbrokerv1.OperationServiceClient) error {
			resp, err := client.PrepareOperation(ctx, in.req)
			if err == nil {
				in.ack(resp.GetOperation().GetName())
			}
			return err
		})
	switch {
	case answered && err != nil:
		fmt.Fprintf(c.cfg.Log, "chaos: %s refused: %v\n", in.req.GetIntentRef(), err)
		return err
	case answered:
		return nil
	}
	h.mu.Lock()
	h.gaveUp++
	h.mu.Unlock()
	return ctx.Err()
}

// ask makes a call as tenant's client on a live replica, bounded by timeout, until it is
// answered (with no error, or one that retryable does not list), ctx ends or patience
// passes, waiting between tries as a careful client does. It reports whether the call was
// answered, and with what.
func (c *cluster) ask(ctx context.Context, rng *rand.Rand, tenant string, patience, timeout time.Duration,
	call func(context.Context, opbrokerv1.OperationServiceClient) error) (bool, error) {
	deadline := time.Now().Add(patience)
	for attempt := 0; time.Now().Before(deadline) && ctx.Err() == nil; attempt++ {
		conn, err := c.client(rng)
		if err == nil {
			callCtx, cancel := context.WithTimeout(c.as(ctx, tenant), timeout)
			err = call(callCtx, opbrokerv1.NewOperationServiceClient(conn))
			cancel()
			if !retryable(err) {
				return true, err
			}
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Duration(20+rng.IntN(100)) * time.Millisecond << min(attempt, 4)):
		}
	}
	return false, nil
}

// as returns ctx with the tenant's bearer token.
func (c *cluster) as(ctx context.Context, tenant string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+c.tokens[tenant])
}

// probe: another tenant's client asks for this tenant's operation, by its own tenant's
// name and by this one's, and lists this tenant. Each must be refused without a trace
// of the operation. A check that gets no answer (its replica was down or paused) is
// asked again, of a replica chosen again, as a client does, for up to probePatience: a
// short run whose faults came thick must still have probes answered.
func (c *cluster) probe(ctx context.Context, rng *rand.Rand, h *history, tenant, name string) {
	if c.cfg.Tenants < 2 {
		return
	}
	other := tenant
	for other == tenant {
		other = fmt.Sprintf("tenant-%d", rng.IntN(c.cfg.Tenants))
	}
	id := name[len("tenants/"+tenant+"/operations/"):]
	checks := []struct {
		what string
		call func(context.Context, opbrokerv1.OperationServiceClient) error
		want codes.Code
	}{
		{"GetOperation of another tenant's name", func(ctx context.Context, client opbrokerv1.OperationServiceClient) error {
			_, err := client.GetOperation(ctx, &opbrokerv1.GetOperationRequest{Name: name})
			return err
		}, codes.PermissionDenied},
		{"GetOperation of another tenant's id under its own name", func(ctx context.Context, client opbrokerv1.OperationServiceClient) error {
			_, err := client.GetOperation(ctx, &opbrokerv1.GetOperationRequest{Name: "tenants/" + other + "/operations/" + id})
			return err
		}, codes.NotFound},
		{"ListOperations of another tenant", func(ctx context.Context, client opbrokerv1.OperationServiceClient) error {
			_, err := client.ListOperations(ctx, &opbrokerv1.ListOperationsRequest{Tenant: tenant})
			return err
		}, codes.PermissionDenied},
	}
	deadline := time.Now().Add(probePatience)
	for _, check := range checks {
		answered, err := c.ask(ctx, rng, other, time.Until(deadline), 2*time.Second, check.call)
		if !answered {
			return // no replica answered: no answer, no leak
		}
		h.mu.Lock()
		h.probes++
		if status.Code(err) != check.want {
			h.violations = append(h.violations, fmt.Sprintf("%s (%s as %s): got %v, want %v", check.what, name, other, err, check.want))
		}
		h.mu.Unlock()
	}
}

// probePatience is how long a cross-tenant probe asks again for an answer.
const probePatience = 15 * time.Second
