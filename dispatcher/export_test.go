package dispatcher

import "context"

// RunOnce is the claim loop's body, for tests that drive it by hand.
func (d *Dispatcher) RunOnce(ctx context.Context) (claimed int, full bool, err error) {
	return d.runOnce(ctx)
}

// PaceWindow is how long the claim loop measures a target's pace over.
const PaceWindow = paceWindow
