package target

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"
)

// Auth is how the broker authenticates to a target. The contract names where the secret
// is read, never the secret itself, so a contract can be printed, encoded and logged.
type Auth struct {
	// Scheme is AuthBearer, AuthBasic or AuthHeader.
	Scheme string `yaml:"scheme"`
	// User is the basic scheme's user name; it is not secret.
	User string `yaml:"user,omitempty"`
	// Header and Prefix, for the header scheme: the secret is sent as Header: Prefix+secret
	// (e.g. X-Api-Key, or Authorization with the prefix "Token ").
	Header string `yaml:"header,omitempty"`
	Prefix string `yaml:"prefix,omitempty"`
	// Secret is where the bearer token, the basic password or the header's value is read.
	Secret Secret `yaml:"secret"`
}

// The schemes of Auth.
const (
	AuthBearer = "bearer" // Authorization: Bearer <secret>
	AuthBasic  = "basic"  // Authorization: Basic base64(user:secret)
	AuthHeader = "header" // <header>: <prefix><secret>
)

// Secret is where a credential is read: an environment variable or a file, exactly one.
// Surrounding whitespace (a file's final newline) is dropped from what is read.
type Secret struct {
	Env  string `yaml:"env,omitempty"`
	File string `yaml:"file,omitempty"`
}

// String names where the secret is read, never its value.
func (s Secret) String() string {
	if s.Env != "" {
		return "environment variable " + s.Env
	}
	return "file " + s.File
}

// TLS holds the files of mutual TLS with a target: the client certificate and its key
// presented to it, and the CA its certificate is verified against (instead of the
// system's). Every file is PEM and named by an absolute path.
type TLS struct {
	ClientCertificate string `yaml:"client_certificate,omitempty"`
	ClientKey         string `yaml:"client_key,omitempty"`
	CA                string `yaml:"ca,omitempty"`
}

// Credential is one credential a contract names and whether it can be read now.
type Credential struct {
	Field  string // auth.secret, tls.client_certificate, tls.client_key or tls.ca
	Source string // "environment variable NAME" or "file /path"
	State  CredentialState
	// Problem says why it is missing or unreadable, naming the variable or the file and
	// never what it holds.
	Problem string
	// holds is what the credential must hold, to say what to set.
	holds string
}

// CredentialState is what opbroker targets check says of a credential.
type CredentialState string

// The states of a credential.
const (
	CredentialPresent    CredentialState = "present"
	CredentialMissing    CredentialState = "missing"    // unset or empty variable, absent or empty file
	CredentialUnreadable CredentialState = "unreadable" // there, but it cannot be read or used
)

// Credentials reads every credential of the contract, now, and says of each whether it
// is present, missing or unreadable. Nothing it returns holds a credential's value.
func (c *Contract) Credentials() []Credential {
	var out []Credential
	if a := c.Auth; a != nil {
		cred := Credential{Field: "auth.secret", Source: a.Secret.String(), State: CredentialPresent, holds: a.holds()}
		if _, err := a.Secret.read(); err != nil {
			cred.State, cred.Problem = stateOf(err), err.Error()
		}
		out = append(out, cred)
	}
	if e := c.Evidence; e != nil && e.Webhook != nil {
		s := e.Webhook.Signature.Secret
		sig := &e.Webhook.Signature
		cred := Credential{Field: "evidence.webhook.signature.secret", Source: s.String(), State: CredentialPresent,
			holds: "the webhook signing secret the target shows for this endpoint"}
		secret, err := s.read()
		if err == nil {
			_, err = sig.hmacKey(secret) // there, but no key to verify with
		}
		if err != nil {
			cred.State, cred.Problem = stateOf(err), err.Error()
		}
		out = append(out, cred)
	}
	if t := c.TLS; t != nil {
		if t.ClientCertificate != "" {
			cert := Credential{Field: "tls.client_certificate", Source: "file " + t.ClientCertificate, State: CredentialPresent,
				holds: "the PEM client certificate"}
			_, certErr := readPEMFile(t.ClientCertificate, isCertificate)
			if certErr != nil {
				cert.State, cert.Problem = stateOf(certErr), certErr.Error()
			}
			key := Credential{Field: "tls.client_key", Source: "file " + t.ClientKey, State: CredentialPresent,
				holds: "the PEM private key of tls.client_certificate"}
			// The pair is judged only when the certificate reads: its problem is its own.
			_, keyErr := readPEMFile(t.ClientKey, isPrivateKey)
			if keyErr == nil && certErr == nil {
				_, keyErr = loadKeyPair(t.ClientCertificate, t.ClientKey)
			}
			if keyErr != nil {
				key.State, key.Problem = stateOf(keyErr), keyErr.Error()
			}
			out = append(out, cert, key)
		}
		if t.CA != "" {
			cred := Credential{Field: "tls.ca", Source: "file " + t.CA, State: CredentialPresent,
				holds: "the PEM certificate of the CA that signs the target's certificate"}
			if _, err := loadCA(t.CA); err != nil {
				cred.State, cred.Problem = stateOf(err), err.Error()
			}
			out = append(out, cred)
		}
	}
	return out
}

// credentialProblems are go/no-go control 1's problems with the credentials: each says
// what to set.
func credentialProblems(credentials []Credential) []string {
	var p []string
	for _, cred := range credentials {
		if cred.State == CredentialPresent {
			continue
		}
		fix := "the file must hold " + cred.holds + ", readable by the broker"
		if strings.HasPrefix(cred.Source, "environment variable ") {
			fix = "set it to " + cred.holds
		}
		p = append(p, fmt.Sprintf("%s is %s: %s: %s", cred.Field, cred.State, cred.Problem, fix))
	}
	return p
}

// holds says what the auth secret is, for the reason of a failing control.
func (a *Auth) holds() string {
	switch a.Scheme {
	case AuthBasic:
		return fmt.Sprintf("the password of user %q", a.User)
	case AuthHeader:
		return "the value of header " + a.Header
	default:
		return "the target's bearer token"
	}
}

// header returns the header the scheme sets.
func (a *Auth) header() string {
	if a.Scheme == AuthHeader {
		return http.CanonicalHeaderKey(a.Header)
	}
	return "Authorization"
}

// apply sets the credential on h.
func (a *Auth) apply(h http.Header, secret string) {
	switch a.Scheme {
	case AuthBasic:
		h.Set("Authorization", "Basic "+base64.StdEncoding.EncodeToString([]byte(a.User+":"+secret)))
	case AuthHeader:
		h.Set(a.Header, a.Prefix+secret)
	default:
		h.Set("Authorization", "Bearer "+secret)
	}
}

// credentialError is a credential that cannot be had. Its text names the variable or
// the file, never the content.
type credentialError struct {
	missing bool
	text    string
}

func (e *credentialError) Error() string { return e.text }

func missing(format string, args ...any) error {
	return &credentialError{missing: true, text: fmt.Sprintf(format, args...)}
}

func unreadable(format string, args ...any) error {
	return &credentialError{text: fmt.Sprintf(format, args...)}
}

func stateOf(err error) CredentialState {
	var ce *credentialError
	if errors.As(err, &ce) && ce.missing {
		return CredentialMissing
	}
	return CredentialUnreadable
}

// fileError names the file and what went wrong, from a failed stat or read.
func fileError(path string, err error) error {
	if errors.Is(err, fs.ErrNotExist) {
		return missing("file %s does not exist", path)
	}
	var pe *fs.PathError
	if errors.As(err, &pe) {
		err = pe.Err
	}
	return unreadable("file %s cannot be read: %v", path, err)
}

// read returns the secret, read now.
func (s Secret) read() (string, error) {
	if s.Env != "" {
		v, ok := os.LookupEnv(s.Env)
		if !ok {
			return "", missing("environment variable %s is not set", s.Env)
		}
		return s.value([]byte(v))
	}
	b, err := os.ReadFile(s.File)
	if err != nil {
		return "", fileError(s.File, err)
	}
	return s.value(b)
}

// value checks what was read: a secret goes into a header, so it must not be empty or
// hold a control character.
func (s Secret) value(raw []byte) (string, error) {
	v := strings.TrimSpace(string(raw))
	switch {
	case v == "":
		return "", missing("%s is empty", s)
	case strings.ContainsFunc(v, isControl):
		return "", unreadable("%s holds a control character", s)
	}
	return v, nil
}

func isControl(r rune) bool { return r < 0x20 && r != '\t' || r == 0x7f }

func isCertificate(blockType string) bool { return blockType == "CERTIFICATE" }

func isPrivateKey(blockType string) bool { return strings.HasSuffix(blockType, "PRIVATE KEY") }

// readPEMFile reads path and checks that it holds a PEM block of a kind.
func readPEMFile(path string, kind func(blockType string) bool) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fileError(path, err)
	}
	if len(strings.TrimSpace(string(b))) == 0 {
		return nil, missing("file %s is empty", path)
	}
	for rest := b; ; {
		var block *pem.Block
		block, rest = pem.Decode(rest)
		if block == nil {
			what := "certificate"
			if kind("PRIVATE KEY") {
				what = "private key"
			}
			return nil, unreadable("file %s holds no PEM %s", path, what)
		}
		if kind(block.Type) {
			return b, nil
		}
	}
}

// loadKeyPair reads a client certificate and its key. A key that does not load is
// reported without the parser's words, which could quote it.
func loadKeyPair(certFile, keyFile string) (tls.Certificate, error) {
	key, err := readPEMFile(keyFile, isPrivateKey)
	if err != nil {
		return tls.Certificate{}, err
	}
	cert, err := readPEMFile(certFile, isCertificate)
	if err != nil {
		return tls.Certificate{}, err
	}
	pair, err := tls.X509KeyPair(cert, key)
	if err != nil {
		return tls.Certificate{}, unreadable("file %s holds no private key that pairs with the certificate in %s", keyFile, certFile)
	}
	return pair, nil
}

// loadCA reads a file of PEM CA certificates.
func loadCA(path string) (*x509.CertPool, error) {
	b, err := readPEMFile(path, isCertificate)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(b) {
		return nil, unreadable("file %s holds no PEM certificate that parses", path)
	}
	return pool, nil
}

// racyWindow is how long after a file's modification time what was read from it is not
// trusted to be its final content: a rewrite within the file system's timestamp
// granularity would leave the modification time and the size as they were.
const racyWindow = 2 * time.Second

// watched is what was last made of a set of files, read again when any of them changes:
// another file under the path (a renamed or re-linked secret, as Kubernetes rotates
// them), another size or modification time, or a modification time too recent to tell
// a later rewrite apart. Each get costs one stat per file. Safe for concurrent use.
type watched[T any] struct {
	paths []string
	load  func() (T, error)

	mu     sync.Mutex
	stats  []os.FileInfo
	readAt time.Time
	value  T
	ok     bool
}

func newWatched[T any](load func() (T, error), paths ...string) *watched[T] {
	return &watched[T]{paths: paths, load: load}
}

// get returns what the files hold now. A file that cannot be read is an error, even if
// an earlier read succeeded: a credential that was removed is not used.
func (w *watched[T]) get() (T, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	var zero T
	stats := make([]os.FileInfo, len(w.paths))
	for i, path := range w.paths {
		fi, err := os.Stat(path)
		if err != nil {
			w.ok = false
			return zero, fileError(path, err)
		}
		stats[i] = fi
	}
	if w.ok && w.unchanged(stats) {
		return w.value, nil
	}
	readAt := time.Now()
	v, err := w.load()
	if err != nil {
		w.ok = false
		return zero, err
	}
	w.stats, w.readAt, w.value, w.ok = stats, readAt, v, true
	return v, nil
}

func (w *watched[T]) unchanged(stats []os.FileInfo) bool {
	for i, fi := range stats {
		old := w.stats[i]
		if !os.SameFile(old, fi) || old.Size() != fi.Size() || !old.ModTime().Equal(fi.ModTime()) ||
			w.readAt.Sub(fi.ModTime()) < racyWindow {
			return false
		}
	}
	return true
}

// secretSource gives a contract's secret at each use: a variable is read every time, a
// file when it changed (watched).
type secretSource struct {
	secret Secret
	file   *watched[string]
}

func newSecretSource(s Secret) *secretSource {
	src := &secretSource{secret: s}
	if s.File != "" {
		src.file = newWatched(s.read, s.File)
	}
	return src
}

func (s *secretSource) get() (string, error) {
	if s.file != nil {
		return s.file.get()
	}
	return s.secret.read()
}

var envPattern = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// validateAccess checks auth, tls and headers.
func (c *Contract) validateAccess(bad func(field, format string, args ...any)) {
	if a := c.Auth; a != nil {
		a.validate(bad, c.brokerHeaders(false))
	}
	if t := c.TLS; t != nil {
		t.validate(bad)
		for _, u := range []struct{ field, raw string }{{"endpoint.url", c.Endpoint.URL}, {"lookup.url", c.lookupURL()}} {
			if parsed, err := url.Parse(u.raw); err == nil && parsed.Scheme == "http" {
				bad("tls", "needs https: %s is http", u.field)
			}
		}
	}
	reserved := c.brokerHeaders(true)
	names := make([]string, 0, len(c.Headers))
	for name := range c.Headers {
		names = append(names, name)
	}
	slices.Sort(names) // the same file gets its problems in the same order
	for _, name := range names {
		field := fmt.Sprintf("headers[%q]", name)
		canonical := http.CanonicalHeaderKey(name)
		switch what, ok := reserved[canonical]; {
		case !headerPattern.MatchString(name):
			bad(field, "must be an HTTP header name")
		case canonical == "Authorization" || canonical == "Proxy-Authorization":
			bad(field, "must not carry a credential: use auth, which reads it from the environment or a file")
		case ok:
			bad(field, "is %s, which the broker sets", what)
		case strings.ContainsFunc(c.Headers[name], isControl):
			bad(field, "must not contain a control character")
		}
	}
}

func (c *Contract) lookupURL() string {
	if c.Lookup == nil {
		return ""
	}
	return strings.ReplaceAll(c.Lookup.URL, "{remote_key}", "x")
}

// brokerHeaders are the headers the broker or its HTTP client sets, by canonical name,
// with what each carries; with auth, the credential's header too.
func (c *Contract) brokerHeaders(withAuth bool) map[string]string {
	h := map[string]string{"Content-Type": "the payload's content type"}
	for _, name := range []string{"Host", "Content-Length", "Transfer-Encoding", "Connection", "Te", "Trailer", "Upgrade", "Keep-Alive"} {
		h[name] = "a header of the HTTP exchange itself"
	}
	set := func(name, what string) {
		if name != "" {
			h[http.CanonicalHeaderKey(name)] = what
		}
	}
	if c.Idempotency != nil {
		set(c.Idempotency.Header, "the idempotency key header")
	}
	if c.Conditional != nil {
		set(c.Conditional.Header, "the precondition header")
	}
	set(c.Endpoint.FenceHeader, "the fence header")
	set(c.Endpoint.RequestIDHeader, "the request id header")
	if withAuth && c.Auth != nil {
		set(c.Auth.header(), "the auth header")
	}
	return h
}

func (a *Auth) validate(bad func(field, format string, args ...any), reserved map[string]string) {
	switch a.Scheme {
	case AuthBearer, AuthBasic, AuthHeader:
	default:
		bad("auth.scheme", "must be %s, %s or %s", AuthBearer, AuthBasic, AuthHeader)
	}
	switch {
	case a.Scheme == AuthBasic && a.User == "":
		bad("auth.user", "is needed with scheme basic")
	case a.Scheme != AuthBasic && a.User != "":
		bad("auth.user", "is only for scheme basic")
	case strings.ContainsRune(a.User, ':') || strings.ContainsFunc(a.User, isControl):
		bad("auth.user", "must not contain a colon or a control character")
	}
	if a.Scheme == AuthHeader {
		canonical := http.CanonicalHeaderKey(a.Header)
		if what, ok := reserved[canonical]; ok {
			bad("auth.header", "is %s, which the broker sets", what)
		} else if !headerPattern.MatchString(a.Header) {
			bad("auth.header", "must be an HTTP header name, e.g. X-Api-Key")
		}
	} else {
		if a.Header != "" {
			bad("auth.header", "is only for scheme header")
		}
		if a.Prefix != "" {
			bad("auth.prefix", "is only for scheme header")
		}
	}
	if strings.ContainsFunc(a.Prefix, isControl) {
		bad("auth.prefix", "must not contain a control character")
	}
	a.Secret.validate(bad, "auth.secret")
}

// validate checks where a secret is read; field names it in problems.
func (s Secret) validate(bad func(field, format string, args ...any), field string) {
	switch {
	case s.Env == "" && s.File == "":
		bad(field, "needs env (a variable's name) or file (a path)")
	case s.Env != "" && s.File != "":
		bad(field, "takes env or file, not both")
	case s.Env != "" && !envPattern.MatchString(s.Env):
		bad(field+".env", "must be an environment variable's name, e.g. ACME_API_TOKEN")
	case s.File != "" && !filepath.IsAbs(s.File):
		bad(field+".file", "must be an absolute path")
	}
}

func (t *TLS) validate(bad func(field, format string, args ...any)) {
	switch {
	case t.ClientCertificate == "" && t.ClientKey == "" && t.CA == "":
		bad("tls", "needs client_certificate and client_key, or ca, or all three")
	case t.ClientCertificate != "" && t.ClientKey == "":
		bad("tls.client_key", "is needed with client_certificate")
	case t.ClientKey != "" && t.ClientCertificate == "":
		bad("tls.client_certificate", "is needed with client_key")
	}
	for _, f := range []struct{ field, path string }{
		{"tls.client_certificate", t.ClientCertificate}, {"tls.client_key", t.ClientKey}, {"tls.ca", t.CA}} {
		if f.path != "" && !filepath.IsAbs(f.path) {
			bad(f.field, "must be an absolute path")
		}
	}
}
