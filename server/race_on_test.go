//go:build race

package server_test

// raceEnabled: the race detector is on, and frames and stacks are larger.
const raceEnabled = true
