package target

import (
	"bytes"
	"encoding/json"
	"strconv"
	"strings"
)

// jsonPointerString evaluates an RFC 6901 pointer in a JSON document and returns the
// string (or number, as text) it names.
func jsonPointerString(doc []byte, pointer string) (string, bool) {
	v, ok := jsonPointer(doc, pointer, true)
	if !ok {
		return "", false
	}
	switch x := v.(type) {
	case string:
		return x, x != ""
	case json.Number:
		return x.String(), true
	}
	return "", false
}

// remoteRefAt returns the target's reference at pointer in doc: a string or number of
// at most maxReference bytes without control characters, or false. The ledger stores
// and indexes it, and a statement that records a longer one (past what an index entry
// holds) or one with a NUL fails, and with it every outcome recorded beside it.
func remoteRefAt(doc []byte, pointer string) (string, bool) {
	ref, ok := jsonPointerString(doc, pointer)
	if !ok || len(ref) > maxReference || strings.ContainsFunc(ref, isControl) {
		return "", false
	}
	return ref, true
}

// jsonPointer evaluates an RFC 6901 pointer in a JSON document. Numbers are json.Number
// with useNumber, float64 otherwise.
func jsonPointer(doc []byte, pointer string, useNumber bool) (any, bool) {
	var v any
	dec := json.NewDecoder(bytes.NewReader(doc))
	if useNumber {
		dec.UseNumber()
	}
	if err := dec.Decode(&v); err != nil {
		return nil, false
	}
	if pointer == "" {
		return v, true
	}
	for _, token := range strings.Split(strings.TrimPrefix(pointer, "/"), "/") {
		token = strings.ReplaceAll(strings.ReplaceAll(token, "~1", "/"), "~0", "~")
		switch node := v.(type) {
		case map[string]any:
			next, ok := node[token]
			if !ok {
				return nil, false
			}
			v = next
		case []any:
			i, err := strconv.Atoi(token)
			if err != nil || i < 0 || i >= len(node) {
				return nil, false
			}
			v = node[i]
		default:
			return nil, false
		}
	}
	return v, true
}
