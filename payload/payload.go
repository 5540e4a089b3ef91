// Package payload decides when two payloads are the same approved payload.
//
// An operation is bound to the SHA-256 of its canonical payload. For JSON content types
// (application/json and any +json type) the canonical form is RFC 8785 (JSON
// Canonicalization Scheme), so insignificant differences of serialisation (key order,
// white space, escapes, number spelling) hash alike. Other content types hash their raw
// bytes.
//
// Canonicalisation must never make two different payloads equal. RFC 8785 reads numbers
// as IEEE 754 doubles, which would merge 9007199254740993 with 9007199254740992, so a
// JSON payload is rejected when any number's exact decimal value differs from the value
// of its canonical form. JSON payloads must also be I-JSON: valid UTF-8, no duplicate
// object keys.
//
// Errors never quote payload content: payloads are sensitive and errors reach logs.
package payload

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"iter"
	"math/big"
	"mime"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/gowebpki/jcs"
)

// ErrInvalid is wrapped by every error about a payload that cannot be accepted.
var ErrInvalid = errors.New("invalid payload")

// Digest is the SHA-256 of a canonical payload.
type Digest [sha256.Size]byte

// String returns the digest as lowercase hex.
func (d Digest) String() string { return fmt.Sprintf("%x", d[:]) }

// IsJSON reports whether contentType is a JSON media type, whose payloads are
// canonicalised before hashing.
func IsJSON(contentType string) bool {
	mediaType, _, err := mime.ParseMediaType(contentType)
	if err != nil {
		return false
	}
	return mediaType == "application/json" || strings.HasSuffix(mediaType, "+json")
}

// Canonical returns the form of body that is hashed: RFC 8785 for JSON content types,
// body itself otherwise.
func Canonical(contentType string, body []byte) ([]byte, error) {
	if !IsJSON(contentType) {
		return body, nil
	}
	if !utf8.Valid(body) {
		return nil, fmt.Errorf("%w: JSON payload is not valid UTF-8", ErrInvalid)
	}
	if err := checkNumbers(body); err != nil {
		return nil, err
	}
	canonical, err := jcs.Transform(body)
	if err != nil {
		// jcs errors may quote keys; say only what kind of problem it is.
		return nil, fmt.Errorf("%w: JSON payload is not I-JSON (RFC 7493): duplicate object key or invalid value", ErrInvalid)
	}
	return canonical, nil
}

// Hash returns the digest of body's canonical form.
func Hash(contentType string, body []byte) (Digest, error) {
	canonical, err := Canonical(contentType, body)
	if err != nil {
		return Digest{}, err
	}
	return sha256.Sum256(canonical), nil
}

// Matches reports whether body, as stored, still has digest, the hash of its canonical
// form taken when it was accepted. Bytes that hash to digest as they are were accepted
// in canonical form, the common case, and need no canonicalising; others are
// canonicalised and hashed again.
func Matches(contentType string, body, digest []byte) bool {
	if raw := sha256.Sum256(body); bytes.Equal(raw[:], digest) {
		return true
	}
	d, err := Hash(contentType, body)
	return err == nil && bytes.Equal(d[:], digest)
}

// checkNumbers rejects body when it is not exactly one well-formed JSON value, or when
// any number in it would change value under RFC 8785's double-precision reading.
func checkNumbers(body []byte) error {
	if !json.Valid(body) {
		return fmt.Errorf("%w: not a single well-formed JSON value", ErrInvalid)
	}
	for num := range numbers(body) {
		if !exactAsDouble(num) {
			return fmt.Errorf("%w: JSON number cannot be represented exactly as an IEEE 754 double (RFC 8785); send it as a string", ErrInvalid)
		}
	}
	return nil
}

// numbers yields the number literals of body, a well-formed JSON value: outside
// strings, a number is the only token that holds a digit or a minus sign.
func numbers(body []byte) iter.Seq[string] {
	return func(yield func(string) bool) {
		inString := false
		for i := 0; i < len(body); i++ {
			switch c := body[i]; {
			case inString && c == '\\':
				i++ // the escaped character
			case c == '"':
				inString = !inString
			case !inString && (c == '-' || '0' <= c && c <= '9'):
				start := i
				for i+1 < len(body) && strings.IndexByte("0123456789+-.eE", body[i+1]) >= 0 {
					i++
				}
				if !yield(string(body[start : i+1])) {
					return
				}
			}
		}
	}
}

// exactAsDouble reports whether the decimal number text denotes the same value as its
// RFC 8785 serialisation.
func exactAsDouble(text string) bool {
	if digits := strings.TrimPrefix(text, "-"); len(digits) <= 15 && strings.Trim(digits, "0123456789") == "" {
		return true // an integer of at most 15 digits is a double exactly
	}
	f, err := strconv.ParseFloat(text, 64)
	if err != nil { // out of range
		return false
	}
	canonical, err := jcs.NumberToJSON(f)
	if err != nil {
		return false
	}
	want, ok1 := new(big.Rat).SetString(text)
	got, ok2 := new(big.Rat).SetString(canonical)
	return ok1 && ok2 && want.Cmp(got) == 0
}
