// Package reconciler resolves UNKNOWN operations by asking the authoritative system,
// conservatively, or hands them to their owner.
//
// The heart of it is Decide, a pure function from what is known (the evidence, the
// target's recorded contract, the time since the first send against the key's retention
// window, the business and resolution deadlines, the budgets) to one action: record
// success, record failure, replay with the same key, wait and look again, or escalate.
package reconciler
