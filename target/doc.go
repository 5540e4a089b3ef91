// Package target holds the recorded contracts of remote targets and the connector that
// talks to them.
//
// A contract is written from the vendor's primary documentation (with its link and the
// date it was checked) and loaded from a YAML file: which operation types the target
// serves, its endpoint, its idempotency key and retention window, how to look an effect
// up by reference, which responses verify success, which are documented rejections
// without side effect, and who owns its escalations. The capabilities A–D of a target
// (same-key replay, lookup, conditional mutation, none) follow from it, and so do the
// go/no-go controls that `opbroker targets check` prints. A target that fails a control
// cannot be loaded: nothing is sent to it.
//
// The connector sends exactly the approved bytes with the operation's stable key, never
// retries, never follows redirects, and classifies the answer by the contract. Anything
// the contract does not name as verified success or documented rejection is UNKNOWN.
package target
