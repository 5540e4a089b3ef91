package main

import (
	"context"
	"fmt"
	"runtime/debug"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/urfave/cli/v3"
)

// version and commit name a release; the linker sets them:
//
//	go build -ldflags "-X main.version=v1.4.0 -X main.commit=$(git rev-parse HEAD)" ./cmd/opbroker
//
// Left empty, they come from what the Go toolchain records in every binary: the main
// module's version and the git revision of the checkout it was built in. A build
// outside a checkout records no revision (the Docker build context leaves .git out,
// hence the Dockerfile's build arguments).
var version, commit string

// build describes this binary: `opbroker version` prints it, the metric
// opbroker_build_info carries it as labels.
type build struct {
	Version, Commit, GoVersion string
}

func (b build) String() string {
	return fmt.Sprintf("%s (commit %s, %s)", b.Version, b.Commit, b.GoVersion)
}

func currentBuild() build {
	info, _ := debug.ReadBuildInfo() // missing only in a binary built without modules, which this cannot be
	return describeBuild(info, version, commit)
}

// describeBuild prefers the linker's version and commit to the build information. A
// commit built with uncommitted changes is marked +dirty, as Go marks its version.
func describeBuild(info *debug.BuildInfo, version, commit string) build {
	b := build{Version: version, Commit: commit, GoVersion: info.GoVersion}
	if b.Version == "" {
		b.Version = info.Main.Version
	}
	if b.Commit == "" {
		var revision, modified string
		for _, s := range info.Settings {
			switch s.Key {
			case "vcs.revision":
				revision = s.Value
			case "vcs.modified":
				modified = s.Value
			}
		}
		b.Commit = revision
		if revision != "" && modified == "true" {
			b.Commit += "+dirty"
		}
	}
	for _, field := range []*string{&b.Version, &b.Commit, &b.GoVersion} {
		if *field == "" {
			*field = "unknown"
		}
	}
	return b
}

// metric is opbroker_build_info: always 1, with the build as labels, so that a
// dashboard can tell which build each replica runs.
func (b build) metric() prometheus.Collector {
	return prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name:        "opbroker_build_info",
		Help:        "The build this broker runs (version, commit, go_version); always 1.",
		ConstLabels: prometheus.Labels{"version": b.Version, "commit": b.Commit, "go_version": b.GoVersion},
	}, func() float64 { return 1 })
}

// versionCommand prints what `opbroker --version` prints.
func versionCommand() *cli.Command {
	return &cli.Command{
		Name:  "version",
		Usage: "print the version, commit and Go version of this binary",
		Action: func(_ context.Context, cmd *cli.Command) error {
			cli.ShowVersion(cmd.Root())
			return nil
		},
	}
}
