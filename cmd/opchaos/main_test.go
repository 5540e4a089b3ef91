package main

import (
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/crashpoint"
)

// TestRequireCrashPoints tells the two builds apart by the tags Go records in a binary;
// a small command of this module stands in for the broker.
func TestRequireCrashPoints(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	build := func(name string, args ...string) string {
		path := filepath.Join(dir, name)
		out, err := exec.Command("go", append(append([]string{"build", "-ldflags=-s -w", "-o", path}, args...), "../simtarget")...).CombinedOutput()
		require.NoError(t, err, string(out))
		return path
	}
	require.NoError(t, requireCrashPoints(build("tagged", "-tags", "othertag,"+crashpoint.BuildTag)))
	require.ErrorContains(t, requireCrashPoints(build("release")), "built without -tags crashpoints")
	require.ErrorContains(t, requireCrashPoints(filepath.Join(dir, "missing")), "--broker")
}
