//go:build crashpoints

package crashpoint

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestParse(t *testing.T) {
	t.Parallel()
	rules, err := parse(" dispatch.after_send=kill, prepare.after_commit=error@3,x=pause@* ")
	require.NoError(t, err)
	require.Equal(t, &rule{action: "kill", nth: 1}, rules["dispatch.after_send"])
	require.Equal(t, &rule{action: "error", nth: 3}, rules["prepare.after_commit"])
	require.Equal(t, &rule{action: "pause", nth: 0}, rules["x"])

	empty, err := parse("")
	require.NoError(t, err)
	require.Empty(t, empty)

	for _, bad := range []string{"nameonly", "a=explode", "a=kill@0", "a=kill@x"} {
		_, err := parse(bad)
		require.Error(t, err, bad)
	}
}

func TestRuleFiresOnItsHit(t *testing.T) {
	t.Parallel()
	third := &rule{action: "error", nth: 3}
	require.Equal(t, []bool{false, false, true, false}, []bool{third.hit(), third.hit(), third.hit(), third.hit()})
	every := &rule{action: "error", nth: 0}
	require.Equal(t, []bool{true, true}, []bool{every.hit(), every.hit()})
}

func TestHitIsInertWithoutRules(t *testing.T) {
	t.Parallel()
	once.Do(func() {}) // the environment of the test binary enables nothing
	require.NoError(t, Hit(DispatchAfterSend))
}

// TestClockIsOffByTheEnvironment: a replica of the chaos run can be given a wrong clock.
// (Not parallel: it sets the environment.)
func TestClockIsOffByTheEnvironment(t *testing.T) {
	t.Setenv(ClockOffsetEnvVar, "-10s")
	clock, err := Clock()
	require.NoError(t, err)
	require.InDelta(t, -10*time.Second, time.Until(clock()), float64(time.Second))

	t.Setenv(ClockOffsetEnvVar, "ten seconds")
	_, err = Clock()
	require.ErrorContains(t, err, ClockOffsetEnvVar)
}
