// Package crashpoint names the places where the broker can be made to fail on purpose,
// for fault-injection tests and the chaos run. The points exist only in a binary built
// with the build tag crashpoints, and act there only when the environment variable
// OPBROKER_CRASH_POINTS enables them:
//
//	go build -tags crashpoints -o bin/opbroker-chaos ./cmd/opbroker
//	OPBROKER_CRASH_POINTS="dispatch.after_send=kill,prepare.after_commit=error@3"
//
// An action is kill (SIGKILL to the process), pause (SIGSTOP to the process: it stops
// until someone sends SIGCONT, as a stalled worker would) or error (Hit returns
// ErrInjected). "@N" fires on the N-th hit only (default the first), "@*" on every hit.
//
// A build without the tag (make build, the Docker image) has the same API, but Hit
// does nothing: no environment variable can make a production broker kill itself.
package crashpoint

import "errors"

// The named crash points.
const (
	DispatchAfterClaim  = "dispatch.after_claim"  // claimed, nothing sent
	DispatchAfterSend   = "dispatch.after_send"   // the request is written, the reply not read
	DispatchAfterReply  = "dispatch.after_reply"  // the reply is read, not recorded
	DispatchAfterRecord = "dispatch.after_record" // the outcome is recorded
	PrepareAfterCommit  = "prepare.after_commit"  // the intent is durable, the client not told
	// EvidenceAfterReceipt: a target's event is verified and kept, not matched, and its
	// sender not answered.
	EvidenceAfterReceipt = "evidence.after_receipt"
)

// EnvVar enables crash points.
const EnvVar = "OPBROKER_CRASH_POINTS"

// ClockOffsetEnvVar sets the process's clock off the real time by a Go duration
// ("-10s"), as on a host whose clock is wrong (Clock).
const ClockOffsetEnvVar = "OPBROKER_CLOCK_OFFSET"

// BuildTag is the build tag that compiles the crash points in.
const BuildTag = "crashpoints"

// ErrInjected is returned by Hit for the error action.
var ErrInjected = errors.New("crashpoint: injected failure")
