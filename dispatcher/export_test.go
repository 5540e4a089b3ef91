package dispatcher

import (
	"context"
	"time"

	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/target"
)

// RunOnce is the claim loop's body after a wake-up (every target is claimed for), for
// tests that drive it by hand.
func (d *Dispatcher) RunOnce(ctx context.Context) (claimed int, full bool, err error) {
	d.undrain()
	return d.runOnce(ctx)
}

// PaceWindow is how long the claim loop measures a target's pace over.
const PaceWindow = paceWindow

// DeliverAfter hands the dispatcher a claim as its claim loop does: the claim is
// delivered on a goroutine of its own, which Stop waits for and cuts, once acquire (the
// claim's wait for its slots) returns.
func (d *Dispatcher) DeliverAfter(contract *target.Contract, op store.Claimed, asOf time.Time,
	acquire func(context.Context) (func(), error)) {
	d.inFlight.Add(1)
	go func() {
		defer d.inFlight.Done()
		d.deliver(contract, op, asOf, acquire)
	}()
}

// CredentialAnswer records what the answer res to a send begun at sentAt, presenting
// the credential the target's contract reads now, says of the credential, as a send does.
func (d *Dispatcher) CredentialAnswer(contract *target.Contract, res target.Result, sentAt time.Time) {
	d.credentialAnswer(contract, res, d.cfg.Connector.CredentialVersion(contract), sentAt)
}
