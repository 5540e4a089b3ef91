package main

import (
	"context"
	"debug/buildinfo"
	"os/exec"
	"path/filepath"
	"runtime/debug"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/crashpoint"
	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/storetest"
)

func TestDescribeBuild(t *testing.T) {
	t.Parallel()
	fromCheckout := &debug.BuildInfo{
		GoVersion: "go1.26.0",
		Main:      debug.Module{Version: "v0.0.0-20261130153434-b4c7ca374c95+dirty"},
		Settings: []debug.BuildSetting{
			{Key: "vcs", Value: "git"},
			{Key: "vcs.revision", Value: "b4c7ca374c95e16941bedfadb238ffebcf3bdfe1"},
			{Key: "vcs.modified", Value: "true"},
		},
	}
	require.Equal(t, build{Version: "v0.0.0-20261130153434-b4c7ca374c95+dirty",
		Commit: "b4c7ca374c95e16941bedfadb238ffebcf3bdfe1+dirty", GoVersion: "go1.26.0"},
		describeBuild(fromCheckout, "", ""))

	clean := &debug.BuildInfo{GoVersion: "go1.26.0", Main: debug.Module{Version: "v1.4.0"},
		Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: "b4c7ca3"}, {Key: "vcs.modified", Value: "false"}}}
	require.Equal(t, build{Version: "v1.4.0", Commit: "b4c7ca3", GoVersion: "go1.26.0"}, describeBuild(clean, "", ""))

	require.Equal(t, build{Version: "v1.5.0", Commit: "0123abc", GoVersion: "go1.26.0"},
		describeBuild(fromCheckout, "v1.5.0", "0123abc"), "the linker's values win")

	outsideCheckout := &debug.BuildInfo{GoVersion: "go1.26.0", Main: debug.Module{Version: "(devel)"}}
	require.Equal(t, build{Version: "(devel)", Commit: "unknown", GoVersion: "go1.26.0"}, describeBuild(outsideCheckout, "", ""))
	require.Equal(t, build{Version: "unknown", Commit: "unknown", GoVersion: "unknown"}, describeBuild(&debug.BuildInfo{}, "", ""))
}

// builtWith describes the opbroker binary at path from the build information Go
// recorded in it.
func builtWith(t *testing.T, path string) build {
	t.Helper()
	info, err := buildinfo.ReadFile(path)
	require.NoError(t, err)
	return describeBuild(info, "", "")
}

func TestVersion(t *testing.T) {
	t.Parallel()
	want := "opbroker version " + builtWith(t, binary).String() + "\n"
	for _, arg := range []string{"version", "--version"} {
		out, err := exec.Command(binary, arg).CombinedOutput()
		require.NoError(t, err, string(out))
		require.Equal(t, want, string(out), arg)
	}
}

// TestReleaseBuild builds opbroker as the Dockerfile does: without the crashpoints tag,
// with the version and commit given to the linker. It ignores OPBROKER_CRASH_POINTS
// (armed to die once a prepare commits, it answers and keeps serving) and says so. The
// build leaves out the Dockerfile's -trimpath, which changes only the file paths the
// binary records: with it, every package, the standard library's too, is compiled a
// second time, about 100 s of CPU when the build cache is empty (a fresh machine).
func TestReleaseBuild(t *testing.T) {
	t.Parallel()
	release := filepath.Join(t.TempDir(), "opbroker")
	out, err := exec.Command("go", "build", "-ldflags", "-s -w -X main.version=v9.9.9 -X main.commit=0123abc",
		"-o", release, ".").CombinedOutput()
	require.NoError(t, err, string(out))

	out, err = exec.Command(release, "version").CombinedOutput()
	require.NoError(t, err, string(out))
	require.Regexp(t, `^opbroker version v9\.9\.9 \(commit 0123abc, go\S+\)\n$`, string(out))

	url := storetest.Schema(t)
	p := startBinary(t, release, []string{crashpoint.EnvVar + "=" + crashpoint.PrepareAfterCommit + "=kill",
		crashpoint.ClockOffsetEnvVar + "=-1h"},
		serveArgs(url, targetsFile(t, simURL(t)), "--dispatch=false")...)
	client := opbrokerv1.NewOperationServiceClient(dial(t, p.waitReady(t)))
	resp, err := prepare(context.Background(), client, "order-armed")
	require.NoError(t, err, "the crash point must not fire\n%s", p.Output())
	require.True(t, resp.GetCreated())
	require.Contains(t, p.Output(), crashpoint.EnvVar+" is ignored: this build has no crash points")
	require.Contains(t, p.Output(), crashpoint.ClockOffsetEnvVar+" is ignored: this build has no crash points")
	p.stop(t, syscall.SIGTERM)
}
