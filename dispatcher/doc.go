// Package dispatcher sends PREPARED operations to their targets, at most once per claim.
//
// What the fence guarantees: a claim moves an operation to IN_FLIGHT and increments its
// fence token in one conditional statement, so two dispatchers (in one process or many)
// never hold the same operation. Only the holder of the current fence records an
// outcome, and only while the operation is still IN_FLIGHT with that fence; a holder that
// lost its fence (paused past its lease, say) writes no state and never re-sends; what it
// observed is kept as evidence beside the operation's history (a stale outcome).
//
// What is durable when: the claim (with its event, the attempt's record) is committed before the
// request leaves. An outcome is written after the reply on a context that shutdown does
// not cancel. If the process dies in between, the lease expires and the sweeper moves the
// operation to UNKNOWN, never back to PREPARED, because the request may have left.
//
// Nothing is retried here. Verified success with a reference is SUCCEEDED, a documented
// side-effect-free rejection is FAILED_TERMINAL, and everything else (timeouts, resets,
// 5xx, 202, 409, 429, redirects) is UNKNOWN, for the reconciler to resolve by asking the
// target.
package dispatcher
