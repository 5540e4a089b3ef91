package target

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	"go.opentelemetry.io/otel/propagation"

	"github.com/opbroker/opbroker/tracing"
)

// Outcome is what a send means for the operation.
type Outcome int

const (
	// Unknown: the effect may or may not have happened; ask the target before anything
	// is retried.
	Unknown Outcome = iota
	// Succeeded: the target confirmed the effect and gave its reference.
	Succeeded
	// Rejected: the target answered with a rejection its documentation says has no
	// side effect.
	Rejected
	// NotExecuted: the target answered with an answer its documentation says was never
	// executed (no effect); the request may be sent again later with the same key.
	NotExecuted
)

// Classes of a send's result, recorded as the observation's outcome.
const (
	ClassVerifiedSuccess     = "VERIFIED_SUCCESS"
	ClassDocumentedRejection = "DOCUMENTED_REJECTION"
	ClassPending             = "PENDING"
	ClassDocumentedFailure   = "DOCUMENTED_FAILURE"
	ClassNotConfirmed        = "STATUS_NOT_CONFIRMED"
	ClassPreconditionFailed  = "PRECONDITION_FAILED"
	ClassNotExecuted         = "NOT_EXECUTED"
	ClassCredentialRefused   = "CREDENTIAL_REFUSED"
	ClassSuccessWithoutRef   = "SUCCESS_WITHOUT_REFERENCE"
	ClassInProgress          = "IN_PROGRESS"
	ClassAccepted            = "ACCEPTED_NOT_CONFIRMED"
	ClassThrottled           = "THROTTLED"
	ClassRedirect            = "REDIRECT_NOT_FOLLOWED"
	ClassServerError         = "HTTP_5XX"
	ClassUnlistedStatus      = "UNLISTED_STATUS"
	ClassTimeout             = "TIMEOUT"
	ClassConnectFailed       = "CONNECT_FAILED"
	ClassConnectionError     = "CONNECTION_ERROR"
	// ClassCredentialUnavailable: a credential of the contract could not be read, so
	// nothing was sent.
	ClassCredentialUnavailable = "CREDENTIAL_UNAVAILABLE"
)

// Request is one send of an operation.
type Request struct {
	Contract    *Contract
	Payload     []byte
	ContentType string
	RemoteKey   uuid.UUID
	Fence       int64
	// Timeout bounds the whole exchange; the caller bounds it by the lease and the
	// dispatch deadline. The contract's timeout applies when it is shorter.
	Timeout time.Duration
	// OnSent, if set, is called once the whole request has been handed to the operating
	// system (not merely buffered), before the reply is read.
	OnSent func()
}

// Result is what one send observed.
type Result struct {
	Outcome    Outcome
	Class      string
	HTTPStatus int
	RemoteRef  string
	Summary    string
	// Sent is false only when the request provably never left (the connection could not
	// be made).
	Sent bool
	// RetryAfter is the delay the answer's Retry-After asked for, whatever its class:
	// the dispatcher's resend after an answer documented as not executed waits for it,
	// and so does the reconciler's replay after an answer that left the operation
	// UNKNOWN (a 503, an unlisted 429).
	RetryAfter time.Duration
}

// maxResponseBody bounds what is read of a target's answer.
const maxResponseBody = 1 << 20

// Connector sends operations to targets over HTTP. It is safe for concurrent use.
//
// A contract's auth, tls and headers apply to its sends and lookups. Its secret is read
// at every request (a file only when it changed, credentials.go), its certificate files
// at every new connection; a contract with tls has a transport of its own.
type Connector struct {
	dialer *net.Dialer
	plain  *route // targets without auth or tls

	mu     sync.Mutex
	routes map[*Contract]*route // targets with auth or tls, built at their first request
}

// route is how the connector reaches one target: its HTTP client and where its
// credentials are read. A contract with a tls block gets a transport of its own, so its
// certificates are presented to that target only.
type route struct {
	client *http.Client
	// auth and tlsFiles are the contract's blocks as the route was built from them: a
	// contract changed since is given a new route.
	auth     *Auth
	tlsFiles *TLS
	secret   *secretSource
	pair     *watched[tls.Certificate]
	ca       *watched[*x509.CertPool]
}

// NewConnector returns a connector whose client never retries and never follows
// redirects, and ignores proxy settings of the environment: a target's address comes
// only from its contract.
func NewConnector() *Connector {
	c := &Connector{dialer: &net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}, routes: map[*Contract]*route{}}
	c.plain = &route{}
	c.plain.client = c.newClient(c.plain)
	return c
}

// newClient returns a client for r. Every connection, plain or TLS, is a sentConn, so
// that OnSent reports a request the operating system has.
func (c *Connector) newClient(r *route) *http.Client {
	transport := &http.Transport{
		Proxy: nil,
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			conn, err := c.dialer.DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			return &sentConn{Conn: conn}, nil
		},
		// The handshake is made here rather than by the transport so that the
		// connection it returns is the sentConn (wrapping the TLS connection), and so
		// that a failed handshake is known to have sent nothing.
		DialTLSContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			config, err := r.tlsConfig()
			if err != nil {
				return nil, &handshakeError{err: err}
			}
			raw, err := c.dialer.DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			if config.ServerName, _, err = net.SplitHostPort(addr); err != nil {
				raw.Close()
				return nil, &handshakeError{err: err}
			}
			conn := tls.Client(raw, config)
			hctx, cancel := context.WithTimeout(ctx, tlsHandshakeTimeout)
			defer cancel()
			if err := conn.HandshakeContext(hctx); err != nil {
				raw.Close()
				return nil, &handshakeError{err: err}
			}
			return &sentConn{Conn: conn}, nil
		},
		MaxIdleConns:        256,
		MaxIdleConnsPerHost: 64,
		IdleConnTimeout:     60 * time.Second,
	}
	return &http.Client{
		Transport: transport,
		// A redirect is never followed: it would send the same body again, to another
		// address than the contract's.
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}
}

const tlsHandshakeTimeout = 5 * time.Second

// handshakeError is a TLS connection that could not be made: nothing was sent on it.
type handshakeError struct{ err error }

func (e *handshakeError) Error() string { return "TLS handshake: " + e.err.Error() }
func (e *handshakeError) Unwrap() error { return e.err }

// route returns the route of contract, built at its first request.
func (c *Connector) route(contract *Contract) *route {
	if contract.Auth == nil && contract.TLS == nil {
		return c.plain
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	r, ok := c.routes[contract]
	if ok && equalBlocks(r.auth, contract.Auth) && equalBlocks(r.tlsFiles, contract.TLS) {
		return r
	}
	if ok && r.tlsFiles != nil {
		r.client.CloseIdleConnections()
	}
	r = &route{client: c.plain.client}
	if a := contract.Auth; a != nil {
		copied := *a
		r.auth, r.secret = &copied, newSecretSource(a.Secret)
	}
	if t := contract.TLS; t != nil {
		copied := *t
		r.tlsFiles = &copied
		if t.ClientCertificate != "" {
			r.pair = newWatched(func() (tls.Certificate, error) { return loadKeyPair(copied.ClientCertificate, copied.ClientKey) },
				t.ClientCertificate, t.ClientKey)
		}
		if t.CA != "" {
			r.ca = newWatched(func() (*x509.CertPool, error) { return loadCA(copied.CA) }, t.CA)
		}
		r.client = c.newClient(r)
	}
	c.routes[contract] = r
	return r
}

// LookupURL is the target's lookup URL for the operation with remoteKey, or "" for a
// target without a lookup: where its owner can ask the target too.
func (c *Contract) LookupURL(remoteKey uuid.UUID) string {
	if c.Lookup == nil {
		return ""
	}
	return strings.ReplaceAll(c.Lookup.URL, "{remote_key}", remoteKey.String())
}

// sendURL is the endpoint's URL for the operation with remoteKey: {remote_key} names the
// operation's object, and a conditional target's parameter carries its precondition.
func (c *Contract) sendURL(remoteKey uuid.UUID) string {
	raw := strings.ReplaceAll(c.Endpoint.URL, "{remote_key}", remoteKey.String())
	p := c.Conditional
	if p == nil || p.Parameter == "" {
		return raw
	}
	u, err := url.Parse(raw)
	if err != nil {
		return raw // validated when loaded; NewRequest reports it
	}
	q := u.Query()
	q.Set(p.Parameter, p.Value)
	u.RawQuery = q.Encode()
	return u.String()
}

// CredentialVersion returns a token that changes whenever the credential the connector
// presents to the target changes: its secret, or its client certificate. It is a
// SHA-256 over what they hold now, kept in memory by its caller to notice a rotation,
// never stored, logged or shown. "" for a target without credentials, or one that
// cannot be read now.
func (c *Connector) CredentialVersion(contract *Contract) string {
	r := c.route(contract)
	if r.secret == nil && r.pair == nil {
		return ""
	}
	h := sha256.New()
	if r.secret != nil {
		secret, err := r.secret.get()
		if err != nil {
			return ""
		}
		h.Write([]byte(secret))
	}
	if r.pair != nil {
		pair, err := r.pair.get()
		if err != nil {
			return ""
		}
		for _, der := range pair.Certificate {
			h.Write(der)
		}
	}
	return string(h.Sum(nil))
}

func equalBlocks[T comparable](a, b *T) bool {
	return a == nil && b == nil || a != nil && b != nil && *a == *b
}

// tlsConfig is the TLS configuration of a new connection, with the certificate files as
// they are now: a rotated certificate or CA is used from the next connection on.
func (r *route) tlsConfig() (*tls.Config, error) {
	config := &tls.Config{MinVersion: tls.VersionTLS12}
	if r.ca != nil {
		pool, err := r.ca.get()
		if err != nil {
			return nil, fmt.Errorf("tls: %w", err)
		}
		config.RootCAs = pool
	}
	if r.pair != nil {
		pair, err := r.pair.get()
		if err != nil {
			return nil, fmt.Errorf("tls: %w", err)
		}
		// Always presented, whatever CAs the target says it accepts.
		config.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &pair, nil }
	}
	return config, nil
}

// authorize checks that the route's credentials can be read now and sets the auth
// header. Its error names the field and the variable or file, never a value.
func (r *route) authorize(h http.Header) error {
	if r.tlsFiles != nil {
		if _, err := r.tlsConfig(); err != nil {
			return err
		}
	}
	if r.auth == nil {
		return nil
	}
	secret, err := r.secret.get()
	if err != nil {
		return fmt.Errorf("auth.secret: %w", err)
	}
	r.auth.apply(h, secret)
	return nil
}

// setHeaders sets the User-Agent, the contract's static headers and the W3C trace
// context of the span ctx carries (traceparent; none without one). The broker's own
// headers are set after them: validation refuses a static header that would replace
// one, and the order keeps it so for a contract that skipped validation.
func setHeaders(ctx context.Context, h http.Header, contract *Contract) {
	h.Set("User-Agent", "opbroker")
	for name, value := range contract.Headers {
		h.Set(name, value)
	}
	tracing.Propagator.Inject(ctx, propagation.HeaderCarrier(h))
}

// Send transmits req once and classifies the answer by the contract. It never retries.
// A credential that cannot be read is CREDENTIAL_UNAVAILABLE, and nothing is sent.
func (c *Connector) Send(ctx context.Context, req Request) Result {
	ep := req.Contract.Endpoint
	timeout := ep.Timeout.D()
	if req.Timeout > 0 {
		timeout = min(timeout, req.Timeout)
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if req.OnSent != nil {
		ctx = withSentHook(ctx, req.OnSent)
	}

	httpReq, err := http.NewRequestWithContext(ctx, ep.Method, req.Contract.sendURL(req.RemoteKey), bytes.NewReader(req.Payload))
	if err != nil {
		return Result{Class: ClassConnectFailed, Summary: "the request could not be built: " + err.Error()}
	}
	// Without GetBody the transport cannot rewind the body, so it never re-sends the
	// request on another connection: net/http would otherwise retry a request that
	// carries an Idempotency-Key header after a failure on a reused connection.
	httpReq.GetBody = nil
	setHeaders(ctx, httpReq.Header, req.Contract)
	httpReq.Header.Set("Content-Type", req.ContentType)
	if idem := req.Contract.Idempotency; idem != nil {
		httpReq.Header.Set(idem.Header, req.RemoteKey.String())
	}
	if p := req.Contract.Conditional; p != nil && p.Header != "" {
		httpReq.Header.Set(p.Header, p.Value)
	}
	if ep.RequestIDHeader != "" {
		httpReq.Header.Set(ep.RequestIDHeader, req.RemoteKey.String())
	}
	if ep.FenceHeader != "" {
		httpReq.Header.Set(ep.FenceHeader, strconv.FormatInt(req.Fence, 10))
	}
	r := c.route(req.Contract)
	if err := r.authorize(httpReq.Header); err != nil {
		return Result{Class: ClassCredentialUnavailable, Summary: "a credential cannot be read; nothing was sent: " + err.Error()}
	}

	resp, err := r.client.Do(httpReq)
	if err != nil {
		return transportResult(ctx, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxResponseBody))
	if err != nil {
		r := transportResult(ctx, err)
		r.HTTPStatus = resp.StatusCode
		r.Summary = fmt.Sprintf("status %d, then the body could not be read: %s", resp.StatusCode, r.Summary)
		return r
	}
	return req.Contract.Responses.classify(resp, body, req.Contract.Completion, req.Contract.Conditional)
}

// transportResult classifies a failure with no complete answer.
func transportResult(ctx context.Context, err error) Result {
	var opErr *net.OpError
	var handshake *handshakeError
	switch {
	case errors.Is(ctx.Err(), context.DeadlineExceeded) || errors.Is(err, context.DeadlineExceeded):
		return Result{Class: ClassTimeout, Sent: true, Summary: "no answer before the timeout"}
	case errors.As(err, &opErr) && opErr.Op == "dial":
		return Result{Class: ClassConnectFailed, Summary: "the connection could not be made; nothing was sent"}
	case errors.As(err, &handshake):
		return Result{Class: ClassConnectFailed, Summary: "the TLS connection could not be made; nothing was sent: " + handshake.err.Error()}
	default:
		return Result{Class: ClassConnectionError, Sent: true, Summary: "the connection failed before a complete answer"}
	}
}

// classify maps a complete answer to an outcome. Only a listed success with the
// target's reference is a success, only a listed (documented) rejection is a rejection;
// everything else is unknown.
func (r *Responses) classify(resp *http.Response, body []byte, completion *Completion, conditional *Conditional) Result {
	status := resp.StatusCode
	res := Result{HTTPStatus: status, Sent: true, RetryAfter: retryAfter(resp.Header.Get("Retry-After"))}
	for _, class := range r.Success {
		if slices.Contains(class.Status, status) {
			ref, ok := remoteRefAt(body, class.RemoteRef)
			if !ok {
				res.Class, res.Summary = ClassSuccessWithoutRef, fmt.Sprintf("status %d without a usable reference at %s", status, class.RemoteRef)
				return res
			}
			res.RemoteRef = ref
			switch settled, value := completion.Of(body); settled {
			case Settled:
				res.Outcome, res.Class = Succeeded, ClassVerifiedSuccess
				res.Summary = fmt.Sprintf("status %d with reference", status)
			case Pending:
				res.Class = ClassPending
				res.Summary = fmt.Sprintf("status %d with reference, but the object is %q: accepted, not finished", status, value)
			case FailedFinal:
				res.Outcome, res.Class = Rejected, ClassDocumentedFailure
				res.Summary = fmt.Sprintf("status %d, the object is %q: documented as final and without effect", status, value)
			default:
				res.Class = ClassNotConfirmed
				res.Summary = fmt.Sprintf("status %d with reference, but the object's status %q is not one the contract lists as succeeded", status, value)
			}
			return res
		}
	}
	for _, class := range r.Rejection {
		if slices.Contains(class.Status, status) {
			res.Outcome, res.Class = Rejected, ClassDocumentedRejection
			res.Summary = fmt.Sprintf("status %d: documented as having no side effect", status)
			return res
		}
	}
	if conditional != nil && slices.Contains(conditional.PreconditionFailed, status) {
		res.Class = ClassPreconditionFailed
		res.Summary = fmt.Sprintf("status %d: the precondition failed, so the target did not create it again: an earlier send made the effect", status)
		return res
	}
	for _, class := range r.NotExecuted {
		if slices.Contains(class.Status, status) {
			res.Outcome, res.Class = NotExecuted, ClassNotExecuted
			res.Summary = fmt.Sprintf("status %d: documented as not executed", status)
			if class.Credential {
				res.Class, res.Summary = ClassCredentialRefused, fmt.Sprintf("status %d: the target refused the credential; documented as not executed", status)
			}
			return res
		}
	}
	for _, class := range r.InProgress {
		if slices.Contains(class.Status, status) {
			res.Class, res.Summary = ClassInProgress, fmt.Sprintf("status %d: still executing at the target", status)
			return res
		}
	}
	switch {
	case status == http.StatusTooManyRequests:
		res.Class, res.Summary = ClassThrottled, "status 429: throttled, but the contract does not document it as not executed"
	case status == http.StatusAccepted:
		res.Class, res.Summary = ClassAccepted, "status 202: accepted, completion not confirmed"
	case status >= 300 && status < 400:
		res.Class, res.Summary = ClassRedirect, fmt.Sprintf("status %d: redirects are never followed", status)
	case status >= 500:
		res.Class, res.Summary = ClassServerError, fmt.Sprintf("status %d: the effect may have happened", status)
	default:
		res.Class, res.Summary = ClassUnlistedStatus, fmt.Sprintf("status %d is not in the contract", status)
	}
	return res
}

// retryAfter reads a Retry-After header: a number of seconds or a date, 0 when it is
// neither or in the past. A number too large for a time.Duration is the largest one,
// not one that overflowed to a negative wait (the dispatcher caps what it obeys).
func retryAfter(v string) time.Duration {
	if secs, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64); err == nil && secs >= 0 {
		return time.Duration(min(secs, math.MaxInt64/int64(time.Second))) * time.Second
	} else if errors.Is(err, strconv.ErrRange) && !strings.HasPrefix(strings.TrimSpace(v), "-") {
		return time.Duration(math.MaxInt64/int64(time.Second)) * time.Second
	}
	if t, err := http.ParseTime(v); err == nil {
		return max(time.Until(t), 0)
	}
	return 0
}

// LookupOutcome is what a lookup by reference found.
type LookupOutcome int

const (
	// LookupFailed: no usable answer (timeout, connection error, an unlisted status).
	LookupFailed LookupOutcome = iota
	// LookupFound: the target has an object under the operation's reference.
	LookupFound
	// LookupNotFound: the target says it has none (weak evidence).
	LookupNotFound
)

// LookupResult is one lookup's observation.
type LookupResult struct {
	Outcome LookupOutcome
	// RemoteRef is the target's reference of the found object.
	RemoteRef string
	// Matches: the found object carries our key and agrees with the approved payload on
	// every field the contract lists.
	Matches bool
	// Settlement, for a matching object, is what its status says (Settled without a
	// completion in the contract).
	Settlement Settlement
	HTTPStatus int
	Summary    string
}

// Lookup asks the target for the effect of the operation with remoteKey (capability B)
// and checks a found object against the approved payload.
func (c *Connector) Lookup(ctx context.Context, contract *Contract, remoteKey uuid.UUID, approved []byte) LookupResult {
	l := contract.Lookup
	if l == nil {
		return LookupResult{Summary: "the target offers no lookup"}
	}
	ctx, cancel := context.WithTimeout(ctx, contract.Endpoint.Timeout.D())
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, l.Method, contract.LookupURL(remoteKey), nil)
	if err != nil {
		return LookupResult{Summary: "the lookup could not be built: " + err.Error()}
	}
	setHeaders(ctx, req.Header, contract)
	r := c.route(contract)
	if err := r.authorize(req.Header); err != nil {
		return LookupResult{Summary: "a credential cannot be read; nothing was sent: " + err.Error()}
	}
	resp, err := r.client.Do(req)
	if err != nil {
		return LookupResult{Summary: transportResult(ctx, err).Summary}
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxResponseBody))
	res := LookupResult{HTTPStatus: resp.StatusCode}
	switch {
	case err != nil:
		res.Summary = fmt.Sprintf("status %d, then the body could not be read", resp.StatusCode)
	case slices.Contains(l.NotFound, resp.StatusCode):
		res.Outcome, res.Summary = LookupNotFound, fmt.Sprintf("status %d: not found", resp.StatusCode)
	case slices.Contains(l.Found.Status, resp.StatusCode):
		res.Outcome = LookupFound
		res.RemoteRef, _ = remoteRefAt(body, l.Found.RemoteRef)
		res.Matches, res.Summary = l.matches(body, remoteKey, approved)
		if res.Matches {
			var value string
			if res.Settlement, value = contract.Completion.Of(body); res.Settlement != Settled {
				res.Summary += fmt.Sprintf("; its status is %q", value)
			}
		}
	default:
		res.Summary = fmt.Sprintf("status %d is not a lookup answer of the contract", resp.StatusCode)
	}
	return res
}

// matches checks a found object: it must carry our key and agree with the approved
// payload on every listed field.
func (l *Lookup) matches(object []byte, remoteKey uuid.UUID, approved []byte) (bool, string) {
	if key, ok := jsonPointerString(object, l.Found.Reference); !ok || key != remoteKey.String() {
		return false, "found an object that does not carry this operation's reference"
	}
	if _, ok := remoteRefAt(object, l.Found.RemoteRef); !ok {
		return false, "found an object without a usable reference of the target's"
	}
	if ok, why := fieldsMatch(object, approved, l.Match, "the found object"); !ok {
		return false, why
	}
	return true, "found, carrying this operation's reference and matching the approved payload"
}
