//go:build !crashpoints

package crashpoint

// Enabled reports whether this build has crash points (the build tag crashpoints).
const Enabled = false

// Hit does nothing: this build has no crash points.
func Hit(string) error { return nil }
