// Package store is the operation ledger in PostgreSQL, and the only package that speaks
// SQL.
//
// Invariants, enforced by the schema (migrations/) as well as by the code here:
//   - One operation per (tenant, operation type, intent reference). Preparing it again
//     with the same canonical payload returns the existing operation; with another
//     payload it fails with a *PayloadMismatchError and nothing changes.
//   - The approved payload, its hash and the remote key never change once written. The
//     payload may only be purged, and only after a terminal state.
//   - Every state change follows the table operation_transitions, bumps the revision by
//     exactly one and appends an operation_events row in the same statement. Events are
//     never updated.
//   - Nothing is SUCCEEDED without a remote reference; nothing PREPARED or CANCELLED was
//     ever sent; the fence token never decreases.
//
// Every method takes the tenant with the operation's id: one tenant's call can never
// read or change another tenant's operation. Errors from the driver are translated here
// (ErrNotFound and the typed errors below); callers never see pgx error types.
//
// Statements that bind many values bind them by name (pgx.NamedArgs: @tenant_ids, not
// $1), so that reordering a statement's parameters cannot silently swap two of them; the
// hottest are rewritten to positional parameters once, when the package loads
// (namedSQL), not by pgx at every call.
// pgx's named arguments were chosen over generating code from .sql files (sqlc): the
// statements are built from shared fragments (the fair claim, the event append), which
// a generator would have to duplicate, and they need no step between editing and
// building.
package store
