package simtarget

import (
	"time"

	"github.com/opbroker/opbroker/target"
)

// Demo operation types served by DemoContracts.
const (
	DemoCharge = "demo.charge" // capabilities A and B: idempotency key, lookup by reference
	DemoNotify = "demo.notify" // capability D: no idempotency, no lookup
	DemoObject = "demo.object" // capabilities B and C: a conditional write, lookup by name
)

// DemoContracts returns the recorded contracts of a simulated target at baseURL with
// the default Config, as a vendor's documentation would give them.
func DemoContracts(baseURL string) []*target.Contract { return Contracts(baseURL, Config{}) }

// Contracts returns the recorded contracts of a simulated target at baseURL configured
// with cfg: what its key saves and how long it keeps it say what the target does, they
// carry cfg.Auth when the target requires a credential, and demo-payments reads the
// events of cfg.Webhooks.
func Contracts(baseURL string, cfg Config) []*target.Contract {
	saves, retention := target.SavesEveryAnswer, 24*time.Hour
	if cfg.SaveOnlySuccesses {
		saves = target.SavesSuccessesOnly
	}
	if cfg.Retention > 0 {
		retention = cfg.Retention
	}
	docs := target.Documentation{URL: "https://github.com/opbroker/opbroker/blob/main/simtarget/simtarget.go", Checked: "2026-11-29"}
	owner := target.Owner{Team: "demo-oncall", Escalation: "README.md#operations"}
	data := target.DataOwnership{Owner: "demo data owner", Retention: target.Duration(30 * 24 * time.Hour)}
	// The simulated target answers both before anything is executed or any key saved.
	notExecuted := []target.ResponseClass{
		{Status: []int{429}, Documented: "simtarget: a throttled request (429, with Retry-After) is refused before it is executed or its key saved"},
		{Status: []int{401}, Credential: true, Documented: "simtarget: a request without the right credential (401) is refused before it is executed"},
	}
	contracts := []*target.Contract{
		{
			Name: "demo-payments", Documentation: docs, Owner: owner, Data: data,
			OperationTypes: []string{DemoCharge},
			Endpoint:       target.Endpoint{Method: "POST", URL: baseURL + "/v1/charges", Timeout: target.Duration(3 * time.Second)},
			Idempotency: &target.Idempotency{Header: "Idempotency-Key", Retention: target.Duration(retention),
				Scope: "the API account", ParameterMismatch: "rejects", Saves: saves},
			Lookup: &target.Lookup{Method: "GET", URL: baseURL + "/v1/charges?reference={remote_key}",
				VisibilityDelay: target.Duration(2 * time.Second),
				Found:           target.ResponseClass{Status: []int{200}, RemoteRef: "/id", Reference: "/reference"},
				NotFound:        []int{404},
				Match:           []target.FieldMatch{{Remote: "/request/amount", Payload: "/amount"}}},
			Responses: target.Responses{
				Success: []target.ResponseClass{{Status: []int{200, 201}, RemoteRef: "/id"}},
				Rejection: []target.ResponseClass{{Status: []int{402},
					Documented: "simtarget: a declined card (402) creates no charge"}},
				NotExecuted: notExecuted,
				InProgress:  []target.ResponseClass{{Status: []int{409}}},
			},
		},
		{
			Name: "demo-notify", Documentation: docs, Owner: owner, Data: data,
			OperationTypes: []string{DemoNotify},
			Endpoint: target.Endpoint{Method: "POST", URL: baseURL + "/v1/notifications", Timeout: target.Duration(3 * time.Second),
				RequestIDHeader: "X-Request-Id"},
			Responses: target.Responses{Success: []target.ResponseClass{{Status: []int{200}, RemoteRef: "/id"}},
				NotExecuted: notExecuted},
		},
		{
			Name: "demo-objects", Documentation: docs, Owner: owner, Data: data,
			OperationTypes: []string{DemoObject},
			Endpoint:       target.Endpoint{Method: "PUT", URL: baseURL + "/v1/objects/{remote_key}", Timeout: target.Duration(3 * time.Second)},
			Conditional: &target.Conditional{Header: "If-None-Match", Value: "*", PreconditionFailed: []int{412},
				Documented: "simtarget: a write with If-None-Match: * is refused with 412, writing nothing, when the object exists"},
			Lookup: &target.Lookup{Method: "GET", URL: baseURL + "/v1/objects/{remote_key}",
				VisibilityDelay: target.Duration(2 * time.Second),
				Found:           target.ResponseClass{Status: []int{200}, RemoteRef: "/id", Reference: "/reference"},
				NotFound:        []int{404},
				Match:           []target.FieldMatch{{Remote: "/request/amount", Payload: "/amount"}}},
			Responses: target.Responses{Success: []target.ResponseClass{{Status: []int{200, 201}, RemoteRef: "/id"}},
				NotExecuted: notExecuted},
		},
	}
	if cfg.Completion > 0 {
		contracts[0].Completion = &target.Completion{Field: "/status",
			Succeeded: []string{StatusSucceeded}, Pending: []string{StatusProcessing}, Failed: []string{StatusFailed},
			Documented: "simtarget: a charge whose status is failed is final and moved no money"}
	}
	if w := cfg.Webhooks; w != nil {
		contracts[0].Evidence = webhookEvidence(w)
	}
	if cfg.Auth != nil {
		for _, c := range contracts {
			auth := *cfg.Auth
			c.Auth = &auth
		}
	}
	return contracts
}

// webhookEvidence is how demo-payments' events are read (webhooks.go): found by the
// idempotency key they echo, matched on the amount, and with Account on the tenant.
func webhookEvidence(w *WebhookConfig) *target.Evidence {
	e := &target.Evidence{
		EventID: "/id", EventType: "/type", Reference: "/data/object/reference",
		ReferenceKind: target.ReferenceRemoteKey, RemoteRef: "/data/object/id",
		Match:      []target.FieldMatch{{Remote: "/data/object/request/amount", Payload: "/amount"}},
		Succeeded:  []string{EventChargeSucceeded},
		Pending:    []string{EventChargeProcessing},
		Failed:     []string{EventChargeFailed},
		Documented: "simtarget: a charge.failed event reports a charge that is final and moved no money",
		Webhook: &target.Webhook{Path: WebhookPath, Signature: target.Signature{Scheme: target.SignatureStripe,
			Secret: w.SecretSource, Documented: "https://github.com/opbroker/opbroker/blob/main/simtarget/webhooks.go"}},
	}
	if w.Account {
		e.Tenant = &target.FieldMatch{Remote: "/data/object/account", Payload: "/account"}
	}
	return e
}
