package gcpace_test

import (
	"math"
	"os"
	"runtime/debug"
	"strconv"
	"testing"

	"github.com/KimMachineGun/automemlimit/memlimit"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/gcpace"
)

// keep restores the process's pace, memory limit and environment at the end of the
// test, and clears AUTOMEMLIMIT, which changes the share of a container's limit.
func keep(t *testing.T) {
	t.Setenv("AUTOMEMLIMIT", "")
	os.Unsetenv("AUTOMEMLIMIT") // set but empty, the library refuses it
	percent, limit := debug.SetGCPercent(100), debug.SetMemoryLimit(math.MaxInt64)
	t.Cleanup(func() {
		debug.SetGCPercent(percent)
		debug.SetMemoryLimit(limit)
	})
}

// Not parallel, here and below: the pace and the limit are the process's.
func TestDefaultsWhereTheEnvironmentSaysNothing(t *testing.T) {
	keep(t)
	t.Setenv("GOGC", "")
	t.Setenv("GOMEMLIMIT", "")
	require.NoError(t, gcpace.SetFrom(memlimit.Limit(1<<30)))
	percent, limit := gcpace.Current()
	require.Equal(t, gcpace.Percent, percent)
	ratio := gcpace.MemoryRatio
	require.Equal(t, int64(ratio*(1<<30)), limit, "a share of the container's limit")

	for _, none := range []error{memlimit.ErrNoLimit, memlimit.ErrNoCgroup, memlimit.ErrCgroupsNotSupported} {
		require.NoError(t, gcpace.SetFrom(func() (uint64, error) { return 0, none }), "%v is no limit, not an error", none)
	}
	debug.SetMemoryLimit(1 << 30)
	require.NoError(t, gcpace.SetFrom(func() (uint64, error) { return 0, memlimit.ErrNoLimit }))
	_, limit = gcpace.Current()
	require.Equal(t, int64(math.MaxInt64), limit, "no container limit, no soft limit")
	gogc, memory := gcpace.Describe()
	require.Equal(t, [2]string{strconv.Itoa(gcpace.Percent), "none"}, [2]string{gogc, memory})
}

func TestTheEnvironmentWins(t *testing.T) {
	keep(t)
	t.Setenv("GOGC", "150")
	t.Setenv("GOMEMLIMIT", "2GiB")
	debug.SetGCPercent(150) // as the runtime applied them at the start
	debug.SetMemoryLimit(2 << 30)
	require.NoError(t, gcpace.SetFrom(memlimit.Limit(1<<30)))
	percent, limit := gcpace.Current()
	require.Equal(t, 150, percent)
	require.Equal(t, int64(2<<30), limit)
}

func TestCurrentOff(t *testing.T) {
	keep(t)
	debug.SetGCPercent(-1)
	percent, _ := gcpace.Current()
	require.Equal(t, -1, percent)
	debug.SetMemoryLimit(1 << 30)
	gogc, memory := gcpace.Describe()
	require.Equal(t, [2]string{"off", "1073741824"}, [2]string{gogc, memory})
}
