package target

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
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
)

// Classes of a send's result, recorded as the observation's outcome.
const (
	ClassVerifiedSuccess     = "VERIFIED_SUCCESS"
	ClassDocumentedRejection = "DOCUMENTED_REJECTION"
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
	Sent       bool
	RetryAfter time.Duration
}

// maxResponseBody bounds what is read of a target's answer.
const maxResponseBody = 1 << 20

// Connector sends operations to targets over HTTP. It is safe for concurrent use.
type Connector struct {
	client *http.Client
}

// NewConnector returns a connector whose client never retries and never follows
// redirects, and ignores proxy settings of the environment: a target's address comes
// only from its contract.
func NewConnector() *Connector {
	dialer := &net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}
	transport := &http.Transport{
		Proxy: nil,
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			conn, err := dialer.DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			return &sentConn{Conn: conn}, nil
		},
		MaxIdleConns:        256,
		MaxIdleConnsPerHost: 64,
		IdleConnTimeout:     60 * time.Second,
		TLSHandshakeTimeout: 5 * time.Second,
	}
	return &Connector{client: &http.Client{
		Transport: transport,
		// A redirect is never followed: it would send the same body again, to another
		// address than the contract's.
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}}
}

// Send transmits req once and classifies the answer by the contract. It never retries.
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

	httpReq, err := http.NewRequestWithContext(ctx, ep.Method, ep.URL, bytes.NewReader(req.Payload))
	if err != nil {
		return Result{Class: ClassConnectFailed, Summary: "the request could not be built: " + err.Error()}
	}
	// Without GetBody the transport cannot rewind the body, so it never re-sends the
	// request on another connection: net/http would otherwise retry a request that
	// carries an Idempotency-Key header after a failure on a reused connection.
	httpReq.GetBody = nil
	httpReq.Header.Set("Content-Type", req.ContentType)
	httpReq.Header.Set("User-Agent", "opbroker")
	if idem := req.Contract.Idempotency; idem != nil {
		httpReq.Header.Set(idem.Header, req.RemoteKey.String())
	}
	if ep.RequestIDHeader != "" {
		httpReq.Header.Set(ep.RequestIDHeader, req.RemoteKey.String())
	}
	if ep.FenceHeader != "" {
		httpReq.Header.Set(ep.FenceHeader, strconv.FormatInt(req.Fence, 10))
	}

	resp, err := c.client.Do(httpReq)
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
	return req.Contract.Responses.classify(resp, body)
}

// transportResult classifies a failure with no complete answer.
func transportResult(ctx context.Context, err error) Result {
	var opErr *net.OpError
	switch {
	case errors.Is(ctx.Err(), context.DeadlineExceeded) || errors.Is(err, context.DeadlineExceeded):
		return Result{Class: ClassTimeout, Sent: true, Summary: "no answer before the timeout"}
	case errors.As(err, &opErr) && opErr.Op == "dial":
		return Result{Class: ClassConnectFailed, Summary: "the connection could not be made; nothing was sent"}
	default:
		return Result{Class: ClassConnectionError, Sent: true, Summary: "the connection failed before a complete answer"}
	}
}

// classify maps a complete answer to an outcome. Only a listed success with the
// target's reference is a success, only a listed (documented) rejection is a rejection;
// everything else is unknown.
func (r *Responses) classify(resp *http.Response, body []byte) Result {
	status := resp.StatusCode
	res := Result{HTTPStatus: status, Sent: true}
	for _, class := range r.Success {
		if slices.Contains(class.Status, status) {
			ref, ok := jsonPointerString(body, class.RemoteRef)
			if !ok {
				res.Class, res.Summary = ClassSuccessWithoutRef, fmt.Sprintf("status %d without the reference at %s", status, class.RemoteRef)
				return res
			}
			res.Outcome, res.Class, res.RemoteRef = Succeeded, ClassVerifiedSuccess, ref
			res.Summary = fmt.Sprintf("status %d with reference", status)
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
	for _, class := range r.InProgress {
		if slices.Contains(class.Status, status) {
			res.Class, res.Summary = ClassInProgress, fmt.Sprintf("status %d: still executing at the target", status)
			return res
		}
	}
	switch {
	case status == http.StatusTooManyRequests:
		res.Class = ClassThrottled
		res.RetryAfter = retryAfter(resp.Header.Get("Retry-After"))
		res.Summary = "status 429: throttled"
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

func retryAfter(v string) time.Duration {
	if secs, err := strconv.Atoi(strings.TrimSpace(v)); err == nil && secs >= 0 {
		return time.Duration(secs) * time.Second
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
	Matches    bool
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
	req, err := http.NewRequestWithContext(ctx, l.Method, strings.ReplaceAll(l.URL, "{remote_key}", remoteKey.String()), nil)
	if err != nil {
		return LookupResult{Summary: "the lookup could not be built: " + err.Error()}
	}
	req.Header.Set("User-Agent", "opbroker")
	resp, err := c.client.Do(req)
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
		res.RemoteRef, _ = jsonPointerString(body, l.Found.RemoteRef)
		res.Matches, res.Summary = l.matches(body, remoteKey, approved)
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
	if _, ok := jsonPointerString(object, l.Found.RemoteRef); !ok {
		return false, "found an object without the target's reference"
	}
	for _, m := range l.Match {
		remote, ok1 := jsonPointer(object, m.Remote, false)
		want, ok2 := jsonPointer(approved, m.Payload, false)
		if !ok1 || !ok2 || !reflect.DeepEqual(remote, want) {
			return false, fmt.Sprintf("found an object whose %s does not match the approved payload's %s", m.Remote, m.Payload)
		}
	}
	return true, "found, carrying this operation's reference and matching the approved payload"
}
