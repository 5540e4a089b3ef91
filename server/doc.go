// Package server is the gRPC face of the broker: the OperationService handlers and the
// server they run in (interceptors, health, reflection, limits).
//
// Every error a handler returns goes through one table (errors.go) that maps domain
// errors to a gRPC status carrying a google.rpc.ErrorInfo (domain "opbroker.dev"), plus
// BadRequest, ResourceInfo or PreconditionFailure where they apply, so clients in any
// language can act on them. Status messages never contain payloads or intent
// references: they are logged.
package server
