//go:build !crashpoints

package crashpoint

import "time"

// Enabled reports whether this build has crash points (the build tag crashpoints).
const Enabled = false

// Hit does nothing: this build has no crash points.
func Hit(string) error { return nil }

// Clock returns the real clock: this build cannot be set off it.
func Clock() (func() time.Time, error) { return time.Now, nil }
