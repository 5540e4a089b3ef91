package reconciler

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/store"
)

// stripeLike is a target with capabilities A and B whose key saves every answer: a 24h
// key window, lookups visible after 5s, absence never final. The operation was sent a
// minute ago, and that send may have executed.
func stripeLike() Input {
	return Input{
		Replay: true, Lookup: true, KeyCoversEveryAttempt: true, KeyWindowLeft: 24*time.Hour - time.Minute,
		VisibilityDelay: 5 * time.Second, MayHaveExecuted: true, SinceLastSend: time.Minute,
		ResolutionLeft: 48 * time.Hour, MaxReplays: 3, MaxLooks: 20, Jitter: 0.5,
	}
}

// successesOnly is stripeLike for a target whose key saves only successes: a replay
// after an attempt that executed and then failed executes again.
func successesOnly() Input {
	in := stripeLike()
	in.KeyCoversEveryAttempt = false
	return in
}

func TestDecideTable(t *testing.T) {
	t.Parallel()
	with := func(f func(*Input)) Input {
		in := stripeLike()
		f(&in)
		return in
	}
	withOnlySuccesses := func(f func(*Input)) Input {
		in := successesOnly()
		f(&in)
		return in
	}
	for name, tc := range map[string]struct {
		in   Input
		want Action
	}{
		"found and matching":       {with(func(in *Input) { in.Evidence = Evidence{Kind: Found, RemoteRef: "ch_1", Matches: true} }), RecordSuccess},
		"found without reference":  {with(func(in *Input) { in.Evidence = Evidence{Kind: Found, Matches: true} }), Escalate},
		"found but mismatched":     {with(func(in *Input) { in.Evidence = Evidence{Kind: Found, RemoteRef: "ch_1"} }), Escalate},
		"not found before visible": {with(func(in *Input) { in.Evidence.Kind = NotFound; in.SinceLastSend = time.Second }), Wait},
		"not found before a replay's write is visible": {with(func(in *Input) {
			in.Evidence.Kind = NotFound
			in.KeyWindowLeft, in.SinceLastSend = 24*time.Hour-time.Hour, time.Second
		}), Wait},
		"not found inside the window": {with(func(in *Input) { in.Evidence.Kind = NotFound }), Replay},
		"not found after the window":  {with(func(in *Input) { in.Evidence.Kind = NotFound; in.KeyWindowLeft = -time.Hour }), Wait},
		"not found after the business deadline": {with(func(in *Input) {
			in.Evidence.Kind = NotFound
			in.BusinessDeadlinePassed = true
		}), Wait},
		"not found, replays spent": {with(func(in *Input) { in.Evidence.Kind = NotFound; in.Replays = 3 }), Wait},
		"not found, absence final": {with(func(in *Input) {
			in.Evidence.Kind = NotFound
			in.Replay = false
			in.AbsenceFinalAfter = time.Hour
			in.KeyWindowLeft, in.SinceLastSend = 24*time.Hour-2*time.Hour, 2*time.Hour
		}), RecordFailure},
		"not found, absence final but replay still possible": {with(func(in *Input) {
			in.Evidence.Kind = NotFound
			in.AbsenceFinalAfter = time.Hour
			in.KeyWindowLeft, in.SinceLastSend = 24*time.Hour-2*time.Hour, 2*time.Hour
		}), Replay},
		"not found, absence not yet final": {with(func(in *Input) {
			in.Evidence.Kind = NotFound
			in.Replay = false
			in.AbsenceFinalAfter = 3 * time.Hour
			in.KeyWindowLeft, in.SinceLastSend = 24*time.Hour-2*time.Hour, 2*time.Hour
		}), Wait},
		"not found, absence final counts from the last send": {with(func(in *Input) {
			in.Evidence.Kind = NotFound
			in.Replay = false
			in.AbsenceFinalAfter = time.Hour
			in.KeyWindowLeft, in.SinceLastSend = 24*time.Hour-2*time.Hour, 30*time.Minute
		}), Wait},
		"not found, budget spent":       {with(func(in *Input) { in.Evidence.Kind = NotFound; in.Replay = false; in.Looks = 20 }), Escalate},
		"not found, deadline spent":     {with(func(in *Input) { in.Evidence.Kind = NotFound; in.Replay = false; in.ResolutionLeft = 0 }), Escalate},
		"in progress":                   {with(func(in *Input) { in.Evidence.Kind = InProgress }), Wait},
		"in progress, no lookup":        {with(func(in *Input) { in.Evidence.Kind = InProgress; in.Lookup = false }), Escalate},
		"key in use, no lookup, waited": {with(func(in *Input) { in.Evidence.Kind = KeyInUse; in.Lookup = false }), Replay},
		"key in use, just answered": {with(func(in *Input) {
			in.Evidence.Kind, in.Lookup, in.Replays, in.SinceLastSend = KeyInUse, false, 2, time.Second
		}), Wait},
		// A replay waits for the target's Retry-After, and backs off after replays so far.
		"no lookup, the target asked to wait": {with(func(in *Input) {
			in.Lookup, in.RetryAfter, in.SinceLastSend = false, 2*time.Minute, time.Second
		}), Wait},
		"no lookup, its wait has passed": {with(func(in *Input) {
			in.Lookup, in.RetryAfter, in.SinceLastSend = false, 2*time.Minute, 3*time.Minute
		}), Replay},
		"no lookup, just replayed": {with(func(in *Input) { in.Lookup, in.Replays, in.SinceLastSend = false, 2, time.Second }), Wait},
		"lookup failed, the target asked to wait": {with(func(in *Input) {
			in.Evidence.Kind, in.RetryAfter, in.SinceLastSend = LookupFailed, time.Minute, time.Second
		}), Wait},
		// Not sent at once instead, nor again at every claim while the replays last.
		"lookup failed, the target asked to wait, looks spent": {with(func(in *Input) {
			in.Evidence.Kind, in.RetryAfter, in.SinceLastSend, in.Looks = LookupFailed, time.Minute, time.Second, 20
		}), Escalate},
		"lookup failed, just replayed, looks spent": {with(func(in *Input) {
			in.Evidence.Kind, in.Replays, in.SinceLastSend, in.Looks = LookupFailed, 1, 100*time.Millisecond, 20
		}), Escalate},
		// Due once the least the jittered backoff can be has passed: an earlier look with
		// a lower jitter waited that long.
		"lookup failed, past the least backoff, looks spent": {with(func(in *Input) {
			in.Evidence.Kind, in.Replays, in.SinceLastSend, in.Looks, in.Jitter = LookupFailed, 2, 3500*time.Millisecond, 20, 0.99
		}), Replay},
		"lookup failed, looks spent, nothing to wait for": {with(func(in *Input) {
			in.Evidence.Kind, in.Looks = LookupFailed, 20
		}), Replay},
		"key in use, replay budget spent": {with(func(in *Input) { in.Evidence.Kind, in.Lookup, in.Replays = KeyInUse, false, 3 }), Escalate},
		"key in use, key saves only successes": {with(func(in *Input) {
			in.Evidence.Kind, in.Lookup, in.KeyCoversEveryAttempt = KeyInUse, false, false
		}), Escalate},
		"scope changed":         {with(func(in *Input) { in.Lookup = false; in.KeyScopeChanged = true }), Escalate},
		"scope changed, lookup": {with(func(in *Input) { in.Evidence.Kind = NotFound; in.KeyScopeChanged = true }), Wait},
		"lookup changed, not found long after the send": {with(func(in *Input) {
			in.Evidence.Kind, in.LookupScopeChanged = NotFound, true
			in.AbsenceFinalAfter = time.Hour
			in.KeyWindowLeft, in.SinceLastSend = -time.Hour, 2*time.Hour
		}), Wait},
		"scope changed, not found long after the send": {with(func(in *Input) {
			in.Evidence.Kind, in.KeyScopeChanged = NotFound, true
			in.AbsenceFinalAfter = time.Hour
			in.KeyWindowLeft, in.SinceLastSend = 24*time.Hour-2*time.Hour, 2*time.Hour
		}), Wait},
		"conditional only, nothing yet": {Input{Conditional: true, MayHaveExecuted: true, ResolutionLeft: time.Hour, MaxReplays: 3, Jitter: 0.5}, Replay},
		"conditional, after a key's window": {with(func(in *Input) {
			in.Lookup, in.Conditional, in.KeyCoversEveryAttempt, in.KeyWindowLeft = false, true, false, -time.Hour
		}), Replay},
		"conditional, scope changed": {Input{Conditional: true, KeyScopeChanged: true, ResolutionLeft: time.Hour, MaxReplays: 3}, Escalate},
		"conditional, budget spent":  {Input{Conditional: true, Replays: 3, MaxReplays: 3, ResolutionLeft: time.Hour}, Escalate},
		"exists, lookup":             {with(func(in *Input) { in.Evidence.Kind = Exists }), Wait},
		"exists, no lookup":          {Input{Conditional: true, Evidence: Evidence{Kind: Exists}, ResolutionLeft: time.Hour, MaxReplays: 3}, Escalate},
		// A 412 on record stays, whatever the lookup says later (it lags, or the object was
		// removed since): never sent again, never a failure.
		"effect exists, not found long after": {with(func(in *Input) {
			in.Evidence.Kind, in.EffectExists, in.Conditional, in.Replay = NotFound, true, true, false
			in.AbsenceFinalAfter, in.SinceLastSend = time.Hour, 2*time.Hour
		}), Escalate},
		"effect exists, not found yet": {with(func(in *Input) {
			in.Evidence.Kind, in.EffectExists, in.Conditional = NotFound, true, true
			in.VisibilityDelay, in.SinceLastSend = time.Minute, time.Second
		}), Wait},
		"effect exists, lookup failed": {with(func(in *Input) { in.Evidence.Kind, in.EffectExists, in.Conditional = LookupFailed, true, true }), Wait},
		"effect exists, no lookup, looked before": {Input{Conditional: true, EffectExists: true, Evidence: Evidence{Kind: NoEvidence},
			ResolutionLeft: time.Hour, MaxReplays: 3}, Escalate},
		"key in use, after the window": {with(func(in *Input) {
			in.Evidence.Kind, in.Lookup, in.KeyWindowLeft = KeyInUse, false, -time.Hour
		}), Escalate},
		"found, pending":             {with(func(in *Input) { in.Evidence = Evidence{Kind: InProgress} }), Wait},
		"found failed, documented":   {with(func(in *Input) { in.Evidence = Evidence{Kind: FoundFailed, Matches: true} }), RecordFailure},
		"found failed, not matching": {with(func(in *Input) { in.Evidence = Evidence{Kind: FoundFailed} }), Escalate},
		"accepted earlier, not found": {with(func(in *Input) {
			in.Evidence.Kind = NotFound
			in.AcceptedBefore = true
		}), Wait},
		"lookup failed, replayable":     {with(func(in *Input) { in.Evidence.Kind = LookupFailed }), Replay},
		"lookup failed, not replayable": {with(func(in *Input) { in.Evidence.Kind = LookupFailed; in.Replay = false }), Wait},
		"nothing yet, lookup":           {stripeLike(), Wait},
		"nothing yet, only replay":      {with(func(in *Input) { in.Lookup = false }), Replay},
		"nothing yet, only replay, after window": {with(func(in *Input) {
			in.Lookup = false
			in.KeyWindowLeft = -time.Hour
		}), Escalate},
		"capability D": {Input{ResolutionLeft: time.Hour}, Escalate},

		// A verified success the target answered after the sender lost its fence: no
		// lookup that contradicts it makes a failure or a replay.
		"verified success, found": {with(func(in *Input) {
			in.VerifiedSuccess, in.Evidence = true, Evidence{Kind: Found, RemoteRef: "ch_1", Matches: true}
		}), RecordSuccess},
		"verified success, not found before visible": {with(func(in *Input) {
			in.VerifiedSuccess, in.Evidence.Kind, in.SinceLastSend = true, NotFound, time.Second
		}), Wait},
		"verified success, not found inside the window": {with(func(in *Input) { in.VerifiedSuccess, in.Evidence.Kind = true, NotFound }), Escalate},
		"verified success, not found, absence final": {with(func(in *Input) {
			in.VerifiedSuccess, in.Evidence.Kind, in.Replay = true, NotFound, false
			in.AbsenceFinalAfter = time.Hour
			in.KeyWindowLeft, in.SinceLastSend = 24*time.Hour-2*time.Hour, 2*time.Hour
		}), Escalate},
		"verified success, found failed": {with(func(in *Input) {
			in.VerifiedSuccess, in.Evidence = true, Evidence{Kind: FoundFailed, Matches: true}
		}), Escalate},
		"verified success, lookup failed": {with(func(in *Input) { in.VerifiedSuccess, in.Evidence.Kind = true, LookupFailed }), Wait},
		"verified success, in progress":   {with(func(in *Input) { in.VerifiedSuccess, in.Evidence.Kind = true, InProgress }), Wait},

		// A key that saves only successes does not cover an attempt that executed and
		// then failed: only a lookup that proves absence allows a replay.
		"successes only: lookup failed after an attempt that may have executed": {withOnlySuccesses(func(in *Input) {
			in.Evidence.Kind = LookupFailed
		}), Wait},
		"successes only: lookup failed, nothing can have executed": {withOnlySuccesses(func(in *Input) {
			in.Evidence.Kind = LookupFailed
			in.MayHaveExecuted = false
		}), Replay},
		"successes only: not found after the visibility delay": {withOnlySuccesses(func(in *Input) { in.Evidence.Kind = NotFound }), Replay},
		// A lookup repointed since the send asks where the effect need not be.
		"successes only: not found by a lookup that changed since the send": {withOnlySuccesses(func(in *Input) {
			in.Evidence.Kind, in.LookupScopeChanged = NotFound, true
		}), Wait},
		"successes only: not found before the last send's write is visible": {withOnlySuccesses(func(in *Input) {
			in.Evidence.Kind = NotFound
			in.SinceLastSend = time.Second
		}), Wait},
		"successes only: no lookup, an attempt may have executed": {withOnlySuccesses(func(in *Input) { in.Lookup = false }), Escalate},
		"successes only: no lookup, nothing can have executed": {withOnlySuccesses(func(in *Input) {
			in.Lookup = false
			in.MayHaveExecuted = false
		}), Replay},
		"successes only: lookup failed, budget spent": {withOnlySuccesses(func(in *Input) {
			in.Evidence.Kind = LookupFailed
			in.Looks = 20
		}), Escalate},
	} {
		got := Decide(tc.in)
		require.Equal(t, tc.want, got.Action, "%s: %s", name, got.Reason)
		require.NotEmpty(t, got.Reason, name)
	}
}

// TestAMismatchSaysWhy: an escalation for a found object that is not the operation's
// says what the lookup found wrong, not always "does not match the approved payload"
// (a found object without a usable reference of the target's was escalated so).
func TestAMismatchSaysWhy(t *testing.T) {
	t.Parallel()
	const why = "found an object without a usable reference of the target's"
	for _, kind := range []EvidenceKind{Found, FoundFailed} {
		d := Decide(Input{Evidence: Evidence{Kind: kind, Why: why}})
		require.Equal(t, Escalate, d.Action)
		require.Contains(t, d.Reason, why)
		require.NotContains(t, d.Reason, "approved payload")
	}
	d := Decide(Input{Evidence: Evidence{Kind: Found, Matches: true}})
	require.Equal(t, Escalate, d.Action)
	require.Contains(t, d.Reason, "no usable reference")
}

func TestWaitBacksOffWithJitter(t *testing.T) {
	t.Parallel()
	in := stripeLike()
	in.Replay = false
	in.Evidence.Kind = NotFound
	var last time.Duration
	for looks := range 8 {
		in.Looks = looks
		d := Decide(in)
		require.Equal(t, Wait, d.Action)
		require.Greater(t, d.After, last, "the wait grows")
		last = d.After
	}
	in.Looks = 19
	require.LessOrEqual(t, Decide(in).After, maxWait, "and is capped")

	in.Looks, in.Jitter = 2, 0
	low := Decide(in).After
	in.Jitter = 0.999
	require.Greater(t, Decide(in).After, low, "jitter spreads waits")

	in.ResolutionLeft = 10 * time.Second
	require.LessOrEqual(t, Decide(in).After, 10*time.Second, "a wait never passes the resolution deadline")
}

// FuzzDecide checks the properties the promise rests on, for any input.
func FuzzDecide(f *testing.F) {
	f.Add(uint8(NotFound), "ch_1", true, true, true, int64(time.Hour), int64(time.Second), int64(0), int64(time.Minute), false, int64(time.Hour), 0, 3, 0, 10, false, 0.5,
		false, true, int64(time.Minute), int64(0))
	f.Add(uint8(Found), "", false, false, true, int64(0), int64(0), int64(time.Hour), int64(2*time.Hour), true, int64(0), 5, 3, 10, 10, true, 0.1,
		true, true, int64(time.Hour), int64(0))
	f.Add(uint8(NotFound)|0x60, "", false, false, true, int64(time.Hour), int64(time.Second), int64(time.Second), int64(time.Minute), false, int64(time.Hour), 0, 3, 0, 10, false, 0.5,
		false, true, int64(time.Hour), int64(0))
	f.Add(uint8(NoEvidence), "", false, true, false, int64(time.Hour), int64(0), int64(0), int64(time.Minute), false, int64(time.Hour), 1, 3, 0, 10, false, 0.5,
		true, true, int64(time.Second), int64(2*time.Minute))
	f.Add(uint8(LookupFailed), "", false, true, true, int64(time.Hour), int64(time.Second), int64(0), int64(time.Minute), false, int64(time.Hour), 0, 3, 0, 10, false, 0.5,
		false, true, int64(time.Millisecond), int64(0))
	// A lookup that changed since the send: its "not found" neither allows a replay of a
	// key that saves only successes nor becomes a failure.
	f.Add(uint8(NotFound)|0x10, "", false, true, true, int64(time.Hour), int64(time.Second), int64(0), int64(time.Minute), false, int64(time.Hour), 0, 3, 0, 10, false, 0.5,
		false, true, int64(time.Minute), int64(0))
	f.Add(uint8(NotFound)|0x10, "", false, false, true, int64(0), int64(time.Second), int64(time.Hour), int64(2*time.Hour), false, int64(time.Hour), 0, 3, 0, 10, false, 0.5,
		false, true, int64(2*time.Hour), int64(0))
	f.Fuzz(func(t *testing.T, kind uint8, ref string, matches, replay, lookup bool, retention, visibility, absenceFinal, since int64,
		deadlinePassed bool, resolutionLeft int64, replays, maxReplays, looks, maxLooks int, accepted bool, jitter float64,
		keyCovers, mayHaveExecuted bool, sinceLast, retryAfter int64) {
		if jitter < 0 || jitter >= 1 || jitter != jitter {
			jitter = 0.5
		}
		in := Input{
			Evidence: Evidence{Kind: EvidenceKind(kind % 8), RemoteRef: ref, Matches: matches},
			Replay:   replay, Lookup: lookup, KeyCoversEveryAttempt: keyCovers,
			// retention and since (from the first send) make the key's window; kind's top
			// bit says the contract's key scope changed since, the next that the target is
			// conditional (C), the next that a send was refused because the effect exists,
			// the next that the lookup changed since the first send.
			KeyWindowLeft: time.Duration(retention) - time.Duration(since), KeyScopeChanged: kind&0x80 != 0,
			Conditional: kind&0x40 != 0, EffectExists: kind&0x20 != 0, LookupScopeChanged: kind&0x10 != 0,
			VisibilityDelay: time.Duration(visibility), AbsenceFinalAfter: time.Duration(absenceFinal),
			MayHaveExecuted: mayHaveExecuted, SinceLastSend: time.Duration(sinceLast),
			BusinessDeadlinePassed: deadlinePassed, ResolutionLeft: time.Duration(resolutionLeft),
			Replays: replays, MaxReplays: maxReplays, Looks: looks, MaxLooks: maxLooks, AcceptedBefore: accepted, Jitter: jitter,
			RetryAfter: time.Duration(retryAfter),
		}
		absenceProven := in.Evidence.Kind == NotFound && in.Lookup && !in.LookupScopeChanged && in.SinceLastSend >= in.VisibilityDelay
		d := Decide(in)
		require.GreaterOrEqual(t, int(d.Action), int(RecordSuccess))
		require.LessOrEqual(t, int(d.Action), int(Escalate))
		require.NotEmpty(t, d.Reason)
		switch d.Action {
		case Replay:
			require.GreaterOrEqual(t, in.SinceLastSend, in.RetryAfter, "never before the target's Retry-After")
			require.True(t, in.Replays <= 0 || in.SinceLastSend >= minWait*8/5, "never sooner than the least backoff after a replay")
			require.True(t, in.Replay || in.Conditional, "never replay without a key or a precondition")
			require.True(t, in.Conditional || in.KeyWindowLeft > 0, "never replay outside the window the key was first sent with")
			require.NotEqual(t, Exists, in.Evidence.Kind, "never send again what the target says exists")
			require.False(t, in.EffectExists, "nor once it said so of any send")
			require.False(t, in.KeyScopeChanged, "never replay a key whose contract changed since it was sent")
			require.False(t, in.BusinessDeadlinePassed, "never replay after the business deadline")
			require.False(t, in.AcceptedBefore, "never replay after the target accepted the request")
			require.True(t, in.MaxReplays <= 0 || in.Replays < in.MaxReplays, "never beyond the replay budget")
			require.True(t, in.Conditional || in.KeyCoversEveryAttempt || !in.MayHaveExecuted || absenceProven,
				"a replay never follows an attempt that may have executed unless the key covers it or a lookup proved absence")
		case RecordSuccess:
			require.Equal(t, Found, in.Evidence.Kind)
			require.True(t, in.Evidence.Matches, "a mismatched effect is never accepted")
			require.NotEmpty(t, d.RemoteRef)
		case RecordFailure:
			if in.Evidence.Kind == FoundFailed {
				require.True(t, in.Evidence.Matches, "only the operation's own object, failed as documented final")
				break
			}
			require.True(t, absenceProven && in.AbsenceFinalAfter > 0 && in.SinceLastSend >= in.AbsenceFinalAfter,
				"not found becomes a failure only when absence is provably final")
			require.False(t, in.KeyScopeChanged, "nor once the contract changed: the lookup asks the contract as it is now")
			require.False(t, in.EffectExists, "nor once the target said an earlier send made the effect")
			replayable, _ := in.replayable(true)
			require.False(t, replayable)
		case Wait:
			replayable, _ := in.replayable(absenceProven)
			require.True(t, in.Lookup || in.Evidence.Kind == KeyInUse || replayable, "waiting needs a way to look again, or a replay to come")
			require.Greater(t, in.ResolutionLeft, time.Duration(0), "waiting ends at the resolution deadline")
			require.True(t, in.MaxLooks <= 0 || in.Looks < in.MaxLooks, "waiting ends when the look budget is spent")
			require.Greater(t, d.After, time.Duration(0))
			require.LessOrEqual(t, d.After, in.ResolutionLeft)
		}
		if (in.Evidence.Kind == Found || in.Evidence.Kind == FoundFailed) && !in.Evidence.Matches {
			require.Equal(t, Escalate, d.Action)
		}
		if in.Evidence.Kind == InProgress {
			require.NotEqual(t, RecordSuccess, d.Action, "a pending object is never SUCCEEDED")
			require.NotEqual(t, Replay, d.Action, "nor replayed")
		}
	})
}

// TestWaitForEvents: without a lookup, what would be escalated waits for the target's
// events while they can be expected after the last send (never past the resolution
// deadline or the look budget), and is escalated after; a target with a lookup, or
// without events, is unchanged.
func TestWaitForEvents(t *testing.T) {
	t.Parallel()
	pending := Input{Replay: true, KeyCoversEveryAttempt: true, KeyWindowLeft: time.Hour, MayHaveExecuted: true,
		Evidence: Evidence{Kind: InProgress}, AcceptedBefore: true, SinceLastSend: time.Minute,
		ResolutionLeft: 48 * time.Hour, MaxLooks: 20}
	require.Equal(t, Escalate, Decide(pending).Action, "no lookup, no events: a person decides")

	pending.EventsWithin = 30 * time.Minute
	d := Decide(pending)
	require.Equal(t, Wait, d.Action)
	require.Equal(t, 29*time.Minute, d.After, "until the events can no longer be expected")
	require.Contains(t, d.Reason, "wait for its events")

	late := pending
	late.SinceLastSend = 31 * time.Minute
	require.Equal(t, Escalate, Decide(late).Action, "past the window")
	deadline := pending
	deadline.ResolutionLeft = 5 * time.Minute
	require.Equal(t, 5*time.Minute, Decide(deadline).After, "never past the resolution deadline")
	spent := pending
	spent.Looks = 20
	require.Equal(t, Escalate, Decide(spent).Action, "nor past the budget")

	// An unkeyed target (D): no replay, no lookup; its events are the way to learn.
	unkeyed := Input{MayHaveExecuted: true, SinceLastSend: time.Second, ResolutionLeft: time.Hour, EventsWithin: time.Minute}
	require.Equal(t, Wait, Decide(unkeyed).Action)
	unkeyed.EventsWithin = 0
	require.Equal(t, Escalate, Decide(unkeyed).Action)
}

// TestRetryAfterIsTheLastSendsAnswers: the wait a replay keeps is the Retry-After of the
// last send's answer, as its observation or a look's since carries it.
func TestRetryAfterIsTheLastSendsAnswers(t *testing.T) {
	t.Parallel()
	require.Equal(t, 2*time.Minute, retryAfterOf(&store.Observation{Source: "DISPATCH", Outcome: "SERVER_ERROR", RetryAfterSeconds: 120}))
	require.Equal(t, 2*time.Minute, retryAfterOf(&store.Observation{Source: "LOOKUP", Outcome: "NOT_FOUND", RetryAfterSeconds: 120}))
	require.Zero(t, retryAfterOf(nil))
}
