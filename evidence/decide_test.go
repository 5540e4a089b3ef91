package evidence

import (
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/target"
)

// TestDecide covers every state an operation can be in against each meaning of an
// event, and each check that quarantines: what changes an operation, what is only
// observed, and what is kept from it.
func TestDecide(t *testing.T) {
	t.Parallel()
	contract := &target.Contract{Name: "charges", OperationTypes: []string{"demo.charge"},
		Evidence: &target.Evidence{ReferenceKind: target.ReferenceRemoteKey,
			Tenant: &target.FieldMatch{Remote: "/data/object/account", Payload: "/account"},
			Match:  []target.FieldMatch{{Remote: "/data/object/amount", Payload: "/amount"}}}}
	body := []byte(`{"data":{"object":{"account":"acme","amount":100}}}`)
	payload := []byte(`{"account":"acme","amount":100}`)
	event := func(meaning target.Meaning) store.InboundEvidence {
		return store.InboundEvidence{Target: "charges", EventID: "evt_1", Source: store.SourceWebhook, EventType: "charge.x",
			Meaning: string(meaning), Reference: "k", ReferenceKind: target.ReferenceRemoteKey, RemoteRef: "ch_1", Body: body}
	}
	candidate := func(state store.State) store.Candidate {
		return store.Candidate{Operation: store.Operation{TenantID: "acme", ID: uuid.New(), State: state, Revision: 4}, Payload: payload}
	}
	type want struct {
		disposition string
		reason      string
		to          store.State // with a change
		accepted    bool
	}
	applied := func(to store.State) want { return want{disposition: store.EvidenceApplied, to: to} }
	observed := want{disposition: store.EvidenceObserved}
	quarantined := func(reason string) want { return want{disposition: store.EvidenceQuarantined, reason: reason} }
	for _, tc := range []struct {
		state   store.State
		meaning target.Meaning
		want    want
	}{
		{store.StateUnknown, target.MeaningSucceeded, applied(store.StateSucceeded)},
		{store.StateUnknown, target.MeaningFailed, applied(store.StateFailedTerminal)},
		{store.StateUnknown, target.MeaningPending, want{disposition: store.EvidenceApplied, to: store.StateUnknown, accepted: true}},
		{store.StateInFlight, target.MeaningSucceeded, applied(store.StateSucceeded)},
		{store.StateInFlight, target.MeaningFailed, applied(store.StateFailedTerminal)},
		{store.StateInFlight, target.MeaningPending, observed},
		{store.StateEscalated, target.MeaningSucceeded, applied(store.StateEscalated)},
		{store.StateEscalated, target.MeaningFailed, applied(store.StateEscalated)},
		{store.StateSucceeded, target.MeaningSucceeded, observed},
		{store.StateSucceeded, target.MeaningPending, observed},
		{store.StateSucceeded, target.MeaningFailed, quarantined(ReasonContradictsTerminal)},
		{store.StateFailedTerminal, target.MeaningFailed, observed},
		{store.StateFailedTerminal, target.MeaningPending, observed},
		{store.StateFailedTerminal, target.MeaningSucceeded, quarantined(ReasonContradictsTerminal)},
		{store.StatePrepared, target.MeaningSucceeded, quarantined(ReasonContradictsLedger)},
		{store.StateCancelled, target.MeaningPending, quarantined(ReasonContradictsLedger)},
	} {
		v := decide(contract, event(tc.meaning), []store.Candidate{candidate(tc.state)}, "webhook:charges")
		require.False(t, v.later)
		got := want{disposition: v.disposition, reason: v.reason}
		if v.change != nil {
			got.to, got.accepted = v.change.To, v.change.AcceptedUnfinished
			require.Equal(t, int64(4), v.change.Revision, "recorded only at the revision decided on")
			require.Equal(t, tc.state, v.change.From)
			require.Equal(t, "evt_1", v.change.Observation.EventID)
			require.Equal(t, "EVIDENCE", v.change.Observation.Source)
		}
		require.Equal(t, tc.want, got, "%s operation, %s event", tc.state, tc.meaning)
	}

	// A final failure of an operation whose send the target answered with a verified
	// success contradicts that answer; a success agrees with it.
	for _, state := range []store.State{store.StateUnknown, store.StateInFlight} {
		answered := candidate(state)
		answered.VerifiedSuccess = true
		v := decide(contract, event(target.MeaningFailed), []store.Candidate{answered}, "a")
		require.Equal(t, want{disposition: store.EvidenceQuarantined, reason: ReasonContradictsLedger}, want{disposition: v.disposition, reason: v.reason}, state)
		require.Equal(t, store.StateSucceeded, decide(contract, event(target.MeaningSucceeded), []store.Candidate{answered}, "a").change.To, state)
	}

	// The checks before the state, each quarantining.
	unknown := candidate(store.StateUnknown)
	require.True(t, decide(contract, event(target.MeaningSucceeded), nil, "a").later, "none found: matched again later")
	two := decide(contract, event(target.MeaningSucceeded), []store.Candidate{unknown, unknown}, "a")
	require.Equal(t, ReasonAmbiguous, two.reason)

	reported := event(target.MeaningSucceeded)
	reported.Source, reported.Reporter, reported.ClaimedTenant = store.SourceReported, "svc", "globex"
	require.Equal(t, ReasonTenantConflict, decide(contract, reported, []store.Candidate{unknown}, "a").reason)

	for name, tc := range map[string]struct {
		body   string
		reason string
	}{
		"another account": {`{"data":{"object":{"account":"globex","amount":100}}}`, ReasonTenantConflict},
		"no account":      {`{"data":{"object":{"amount":100}}}`, ReasonTenantConflict},
		"changed amount":  {`{"data":{"object":{"account":"acme","amount":101}}}`, ReasonPayloadMismatch},
	} {
		e := event(target.MeaningSucceeded)
		e.Body = []byte(tc.body)
		v := decide(contract, e, []store.Candidate{unknown}, "a")
		require.Equal(t, store.EvidenceQuarantined, v.disposition, name)
		require.Equal(t, tc.reason, v.reason, name)
		require.Nil(t, v.change, name)
	}

	withRef := unknown
	withRef.RemoteRef = "ch_other"
	require.Equal(t, ReasonContradictsLedger, decide(contract, event(target.MeaningSucceeded), []store.Candidate{withRef}, "a").reason,
		"another reference than the ledger's")

	noRef := event(target.MeaningSucceeded)
	noRef.RemoteRef = ""
	require.Equal(t, ReasonIncomplete, decide(contract, noRef, []store.Candidate{unknown}, "a").reason,
		"a success needs the target's reference")

	purged := candidate(store.StateSucceeded)
	purged.Payload = nil
	e := event(target.MeaningSucceeded)
	e.Body = []byte(`{"data":{"object":{"amount":5}}}`)
	require.Equal(t, store.EvidenceObserved, decide(contract, e, []store.Candidate{purged}, "a").disposition,
		"a terminal operation's purged payload is not compared: the event can only be observed or contradict")
}
