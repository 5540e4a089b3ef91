// Package brokertest builds the opbroker command for tests that run it as a process,
// with its crash points (crashpoint.BuildTag), which the release build does not have.
package brokertest

import (
	"fmt"
	"os/exec"
	"path/filepath"

	"github.com/opbroker/opbroker/crashpoint"
	"github.com/opbroker/opbroker/embeddedpg"
)

// Build builds the command in the package directory pkg (relative to the test's
// package) into a new folder of the temporary directory whose name begins with prefix,
// and returns its path with a function that removes the folder. The folder stays locked
// until then (embeddedpg.TempFolder): a test binary ended before its TestMain removes it
// (a timeout, an interrupt) leaves it, and a later Build of the same prefix removes it
// once its lock is over a minute old (embeddedpg.RemoveOrphans).
func Build(pkg, prefix string) (path string, remove func(), err error) {
	dir, remove, err := embeddedpg.TempFolder(prefix)
	if err != nil {
		return "", nil, err
	}
	path = filepath.Join(dir, "opbroker")
	out, err := exec.Command("go", "build", "-tags", crashpoint.BuildTag, "-ldflags=-s -w", "-o", path, pkg).CombinedOutput()
	if err != nil {
		remove()
		return "", nil, fmt.Errorf("building opbroker: %w\n%s", err, out)
	}
	return path, remove, nil
}
