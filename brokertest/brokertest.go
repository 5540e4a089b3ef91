// Package brokertest builds the opbroker command for tests that run it as a process,
// with its crash points (crashpoint.BuildTag), which the release build does not have.
package brokertest

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"

	"github.com/opbroker/opbroker/crashpoint"
	"github.com/opbroker/opbroker/embeddedpg"
)

// Binary is an opbroker built for the life of a test binary, in a folder of the
// temporary directory that stays locked for that life (embeddedpg.TempFolder). A test
// binary ended before its TestMain removes the folder (a timeout, an interrupt) leaves
// it, and a later Build of the same prefix removes it once its lock is over a minute old
// (embeddedpg.RemoveOrphans).
type Binary struct {
	Path string // the command
	lock *os.File
}

// Build builds the command in the package directory pkg (relative to the test's
// package) into a new folder whose name begins with prefix.
func Build(pkg, prefix string) (*Binary, error) {
	dir, lock, err := embeddedpg.TempFolder(prefix)
	if err != nil {
		return nil, err
	}
	b := &Binary{Path: filepath.Join(dir, "opbroker"), lock: lock}
	out, err := exec.Command("go", "build", "-tags", crashpoint.BuildTag, "-ldflags=-s -w", "-o", b.Path, pkg).CombinedOutput()
	if err != nil {
		b.Remove()
		return nil, fmt.Errorf("building opbroker: %w\n%s", err, out)
	}
	return b, nil
}

// Remove removes the binary's folder, then gives up its lock.
func (b *Binary) Remove() {
	os.RemoveAll(filepath.Dir(b.Path))
	b.lock.Close()
}
