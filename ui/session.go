package ui

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"time"
)

// DefaultSessionLifetime is how long a sign-in lasts.
const DefaultSessionLifetime = 8 * time.Hour

// sealer seals a session into its cookie: the principal's token and when the session
// ends, encrypted and authenticated (AES-256-GCM), so that the cookie is good for the
// view only, until then, and never shows the token.
type sealer struct {
	aead cipher.AEAD
}

// newSealer derives the key from secret (any length; random when empty, so sessions
// are this process's own).
func newSealer(secret []byte) (*sealer, error) {
	if len(secret) == 0 {
		secret = make([]byte, 32)
		if _, err := rand.Read(secret); err != nil {
			return nil, err
		}
	}
	key := sha256.Sum256(append([]byte("opbroker support view session\x00"), secret...))
	block, err := aes.NewCipher(key[:])
	if err != nil {
		return nil, err
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		return nil, err
	}
	return &sealer{aead: aead}, nil
}

type sessionData struct {
	Token string `json:"t"`
	Until int64  `json:"u"` // Unix seconds
}

func (s *sealer) seal(token string, until time.Time) (string, error) {
	plain, err := json.Marshal(sessionData{Token: token, Until: until.Unix()})
	if err != nil {
		return "", err
	}
	nonce := make([]byte, s.aead.NonceSize())
	if _, err := rand.Read(nonce); err != nil {
		return "", err
	}
	return base64.RawURLEncoding.EncodeToString(s.aead.Seal(nonce, nonce, plain, []byte(CookieName))), nil
}

var errSessionInvalid = errors.New("ui: the session is not valid or has ended")

// open returns the token of a sealed session that has not ended at now.
func (s *sealer) open(sealed string, now time.Time) (string, error) {
	b, err := base64.RawURLEncoding.DecodeString(sealed)
	if err != nil || len(b) < s.aead.NonceSize() {
		return "", errSessionInvalid
	}
	plain, err := s.aead.Open(nil, b[:s.aead.NonceSize()], b[s.aead.NonceSize():], []byte(CookieName))
	if err != nil {
		return "", errSessionInvalid
	}
	var d sessionData
	if json.Unmarshal(plain, &d) != nil || d.Token == "" || !now.Before(time.Unix(d.Until, 0)) {
		return "", errSessionInvalid
	}
	return d.Token, nil
}
