// Package logtest helps tests read what the broker logs.
package logtest

import (
	"bytes"
	"encoding/json"
	"strings"
	"sync"
	"testing"
)

// Buffer is a log's destination that several goroutines write while a test reads it.
type Buffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

// Write appends p.
func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// String returns everything written so far.
func (b *Buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// Entries decodes each line of a JSON log written to b into a T, failing the test on a
// line that is not one.
func Entries[T any](t testing.TB, b *Buffer) []T {
	t.Helper()
	var entries []T
	for line := range strings.Lines(b.String()) {
		var entry T
		if err := json.Unmarshal([]byte(line), &entry); err != nil {
			t.Fatalf("logtest: a line that is not JSON: %v: %s", err, line)
		}
		entries = append(entries, entry)
	}
	return entries
}
