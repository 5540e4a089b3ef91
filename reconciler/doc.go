// Package reconciler resolves UNKNOWN operations by asking the authoritative system,
// conservatively, or hands them to their owner.
//
// The heart of it is Decide, a pure function from what is known (the evidence, the
// target's recorded contract, the time since the first send against the key's retention
// window, the time since the last send against the lookup's visibility delay, whether an
// earlier attempt may have executed and whether the key covers it, the business and
// resolution deadlines, the budgets) to one action: record success, record failure,
// replay with the same key, wait and look again, or escalate.
//
// A replay is the one action that sends again. It never follows an attempt that may
// have executed unless the target's key covers that attempt (it saves every answer) or a
// lookup proved that nothing took effect.
package reconciler
