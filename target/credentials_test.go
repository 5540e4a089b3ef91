package target_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/hex"
	"encoding/pem"
	"fmt"
	"io"
	stdlog "log"
	"log/slog"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/logtest"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/target"
)

// TestAccessValidation: every malformed auth, tls or headers field is refused with its
// own message.
func TestAccessValidation(t *testing.T) {
	t.Parallel()
	env := target.Secret{Env: "ACME_TOKEN"}
	bearer := &target.Auth{Scheme: target.AuthBearer, Secret: env}
	for name, tc := range map[string]struct {
		adjust func(c *target.Contract)
		want   []string // field: problem, in order
	}{
		"unknown scheme": {func(c *target.Contract) { c.Auth = &target.Auth{Scheme: "token", Secret: env} },
			[]string{`auth.scheme: must be bearer, basic or header`}},
		"basic without user": {func(c *target.Contract) { c.Auth = &target.Auth{Scheme: target.AuthBasic, Secret: env} },
			[]string{`auth.user: is needed with scheme basic`}},
		"user of bearer": {func(c *target.Contract) { c.Auth = &target.Auth{Scheme: target.AuthBearer, User: "u", Secret: env} },
			[]string{`auth.user: is only for scheme basic`}},
		"user with colon": {func(c *target.Contract) { c.Auth = &target.Auth{Scheme: target.AuthBasic, User: "a:b", Secret: env} },
			[]string{`auth.user: must not contain a colon or a control character`}},
		"header scheme without header": {func(c *target.Contract) { c.Auth = &target.Auth{Scheme: target.AuthHeader, Secret: env} },
			[]string{`auth.header: must be an HTTP header name, e.g. X-Api-Key`}},
		"auth header is the key header": {func(c *target.Contract) {
			c.Auth = &target.Auth{Scheme: target.AuthHeader, Header: "idempotency-key", Secret: env}
		}, []string{`auth.header: is the idempotency key header, which the broker sets`}},
		"header of bearer": {func(c *target.Contract) {
			c.Auth = &target.Auth{Scheme: target.AuthBearer, Header: "X-Api-Key", Secret: env}
		},
			[]string{`auth.header: is only for scheme header`}},
		"prefix of basic": {func(c *target.Contract) {
			c.Auth = &target.Auth{Scheme: target.AuthBasic, User: "u", Prefix: "Token ", Secret: env}
		}, []string{`auth.prefix: is only for scheme header`}},
		"prefix with newline": {func(c *target.Contract) {
			c.Auth = &target.Auth{Scheme: target.AuthHeader, Header: "X-Api-Key", Prefix: "a\nb", Secret: env}
		}, []string{`auth.prefix: must not contain a control character`}},
		"no secret": {func(c *target.Contract) { c.Auth = &target.Auth{Scheme: target.AuthBearer} },
			[]string{`auth.secret: needs env (a variable's name) or file (a path)`}},
		"two secrets": {func(c *target.Contract) {
			c.Auth = &target.Auth{Scheme: target.AuthBearer, Secret: target.Secret{Env: "A", File: "/a"}}
		}, []string{`auth.secret: takes env or file, not both`}},
		"bad variable": {func(c *target.Contract) {
			c.Auth = &target.Auth{Scheme: target.AuthBearer, Secret: target.Secret{Env: "ACME-TOKEN"}}
		}, []string{`auth.secret.env: must be an environment variable's name, e.g. ACME_API_TOKEN`}},
		"relative secret file": {func(c *target.Contract) {
			c.Auth = &target.Auth{Scheme: target.AuthBearer, Secret: target.Secret{File: "secrets/token"}}
		}, []string{`auth.secret.file: must be an absolute path`}},
		"empty tls": {func(c *target.Contract) { c.TLS = &target.TLS{} },
			[]string{`tls: needs client_certificate and client_key, or ca, or all three`}},
		"certificate without key": {func(c *target.Contract) { c.TLS = &target.TLS{ClientCertificate: "/c.pem"} },
			[]string{`tls.client_key: is needed with client_certificate`}},
		"key without certificate": {func(c *target.Contract) { c.TLS = &target.TLS{ClientKey: "/k.pem"} },
			[]string{`tls.client_certificate: is needed with client_key`}},
		"relative tls files": {func(c *target.Contract) {
			c.TLS = &target.TLS{ClientCertificate: "c.pem", ClientKey: "k.pem", CA: "ca.pem"}
		},
			[]string{`tls.client_certificate: must be an absolute path`, `tls.client_key: must be an absolute path`, `tls.ca: must be an absolute path`}},
		"tls over http": {func(c *target.Contract) {
			c.TLS = &target.TLS{CA: "/ca.pem"}
			c.Endpoint.URL = "http://127.0.0.1:9/v1/charges"
			c.Lookup.URL = "http://127.0.0.1:9/v1/charges?reference={remote_key}"
		}, []string{`tls: needs https: endpoint.url is http`, `tls: needs https: lookup.url is http`}},
		"header name": {func(c *target.Contract) { c.Headers = map[string]string{"Api Version": "1"} },
			[]string{`headers["Api Version"]: must be an HTTP header name`}},
		"header value": {func(c *target.Contract) { c.Headers = map[string]string{"Api-Version": "1\r\nX-Evil: 1"} },
			[]string{`headers["Api-Version"]: must not contain a control character`}},
		"the key header": {func(c *target.Contract) { c.Headers = map[string]string{"idempotency-key": "fixed"} },
			[]string{`headers["idempotency-key"]: is the idempotency key header, which the broker sets`}},
		"the fence header": {func(c *target.Contract) {
			c.Endpoint.FenceHeader = "X-Fence"
			c.Headers = map[string]string{"X-Fence": "0"}
		}, []string{`headers["X-Fence"]: is the fence header, which the broker sets`}},
		"the request id header": {func(c *target.Contract) {
			c.Endpoint.RequestIDHeader = "X-Request-Id"
			c.Headers = map[string]string{"x-request-id": "r"}
		}, []string{`headers["x-request-id"]: is the request id header, which the broker sets`}},
		"the content type": {func(c *target.Contract) { c.Headers = map[string]string{"Content-Type": "text/plain"} },
			[]string{`headers["Content-Type"]: is the payload's content type, which the broker sets`}},
		"the auth header": {func(c *target.Contract) {
			c.Auth = &target.Auth{Scheme: target.AuthHeader, Header: "X-Api-Key", Secret: env}
			c.Headers = map[string]string{"X-API-KEY": "k"}
		}, []string{`headers["X-API-KEY"]: is the auth header, which the broker sets`}},
		"a literal credential": {func(c *target.Contract) { c.Headers = map[string]string{"Authorization": "Bearer sk_live"} },
			[]string{`headers["Authorization"]: must not carry a credential: use auth, which reads it from the environment or a file`}},
		"authorization with bearer auth": {func(c *target.Contract) {
			c.Auth = bearer
			c.Headers = map[string]string{"authorization": "Basic x"}
		}, []string{`headers["authorization"]: must not carry a credential: use auth, which reads it from the environment or a file`}},
		"framing": {func(c *target.Contract) { c.Headers = map[string]string{"Content-Length": "0", "Host": "evil.example"} },
			[]string{`headers["Content-Length"]: is a header of the HTTP exchange itself, which the broker sets`,
				`headers["Host"]: is a header of the HTTP exchange itself, which the broker sets`}},
	} {
		c := simtarget.DemoContracts("https://127.0.0.1:9")[0]
		tc.adjust(c)
		_, err := target.New(c)
		want := make([]string, len(tc.want))
		for i, w := range tc.want {
			want[i] = `<built in>: target "demo-payments": ` + w
		}
		require.EqualError(t, err, strings.Join(want, "\n"), name)
	}

	for name, adjust := range map[string]func(c *target.Contract){
		"bearer": func(c *target.Contract) { c.Auth = bearer },
		"basic": func(c *target.Contract) {
			c.Auth = &target.Auth{Scheme: target.AuthBasic, User: "opbroker", Secret: target.Secret{File: "/run/secrets/p"}}
		},
		"Authorization with a prefix": func(c *target.Contract) {
			c.Auth = &target.Auth{Scheme: target.AuthHeader, Header: "Authorization", Prefix: "Token ", Secret: env}
		},
		"mutual tls and headers": func(c *target.Contract) {
			c.TLS = &target.TLS{ClientCertificate: "/c.pem", ClientKey: "/k.pem", CA: "/ca.pem"}
			c.Headers = map[string]string{"Stripe-Version": "2024-06-20", "User-Agent": "acme-client"}
		},
	} {
		c := simtarget.DemoContracts("https://127.0.0.1:9")[0]
		adjust(c)
		_, err := target.New(c)
		require.NoError(t, err, name)
	}
}

// TestAccessYAML: the documented shape reads and encodes back; a secret written in the
// file itself is not a field.
func TestAccessYAML(t *testing.T) {
	t.Parallel()
	good := string(mustRead(t, "testdata/targets.yaml"))
	access := "    concurrency: 16\n" +
		"    auth:\n      scheme: basic\n      user: opbroker\n      secret: {file: /run/secrets/acme-password}\n" +
		"    tls:\n      client_certificate: /run/secrets/acme/tls.crt\n      client_key: /run/secrets/acme/tls.key\n      ca: /run/secrets/acme/ca.crt\n" +
		"    headers:\n      Stripe-Version: 2024-06-20\n"
	data := strings.NewReplacer("    concurrency: 16\n", access, "http://127.0.0.1:8081", "https://127.0.0.1:8081").Replace(good)
	file, err := target.Decode("t.yaml", []byte(data))
	require.NoError(t, err)
	c := file.Targets[0]
	require.Equal(t, &target.Auth{Scheme: target.AuthBasic, User: "opbroker", Secret: target.Secret{File: "/run/secrets/acme-password"}}, c.Auth)
	require.Equal(t, &target.TLS{ClientCertificate: "/run/secrets/acme/tls.crt", ClientKey: "/run/secrets/acme/tls.key", CA: "/run/secrets/acme/ca.crt"}, c.TLS)
	require.Equal(t, map[string]string{"Stripe-Version": "2024-06-20"}, c.Headers)

	encoded, err := target.Encode(file.Targets)
	require.NoError(t, err)
	again, err := target.Decode("encoded.yaml", encoded)
	require.NoError(t, err, string(encoded))
	require.Equal(t, c.Auth, again.Targets[0].Auth)
	require.Equal(t, c.TLS, again.Targets[0].TLS)
	require.Equal(t, c.Headers, again.Targets[0].Headers)
	require.Nil(t, again.Targets[1].Auth, "a target without auth encodes none")

	// A secret cannot be written into the file itself.
	for from, to := range map[string]string{
		"secret: {file: /run/secrets/acme-password}": "secret: {value: hunter2}",
		"user: opbroker": "user: opbroker\n      password: hunter2",
	} {
		_, err := target.Decode("t.yaml", []byte(strings.Replace(data, from, to, 1)))
		require.ErrorContains(t, err, "unknown field")
		require.ErrorContains(t, err, strings.Fields(to)[len(strings.Fields(to))-2])
	}
}

// TestCredentialStates: each credential is present, missing or unreadable, said without
// its value; one that is not present fails control 1 with what to set, and Parse (serve)
// refuses the file.
func TestCredentialStates(t *testing.T) { // not parallel: t.Setenv
	dir := t.TempDir()
	secret := randomSecret(t)
	present := writeFile(t, dir, "present", secret+"\n")
	empty := writeFile(t, dir, "empty", "\n")
	control := writeFile(t, dir, "control", secret+"\x01")
	pki := newPKI(t)
	cert, key := pki.issue(t, "opbroker", false)
	certFile, keyFile, caFile := writeFile(t, dir, "tls.crt", string(cert)), writeFile(t, dir, "tls.key", string(key)), writeFile(t, dir, "ca.crt", string(pki.caPEM))
	_, otherKey := pki.issue(t, "other", false)
	otherKeyFile := writeFile(t, dir, "other.key", string(otherKey))
	notPEM := writeFile(t, dir, "not.pem", secret)
	envSet, envEmpty, envUnset := "OPBROKER_TEST_SET_"+secret[:8], "OPBROKER_TEST_EMPTY_"+secret[:8], "OPBROKER_TEST_UNSET_"+secret[:8]
	t.Setenv(envSet, secret)
	t.Setenv(envEmpty, " ")

	bearer := func(s target.Secret) func(*target.Contract) {
		return func(c *target.Contract) { c.Auth = &target.Auth{Scheme: target.AuthBearer, Secret: s} }
	}
	for name, tc := range map[string]struct {
		adjust func(*target.Contract)
		want   []target.Credential // without their hints
		reason string              // control 1's, when it fails
	}{
		"variable set": {bearer(target.Secret{Env: envSet}), []target.Credential{
			{Field: "auth.secret", Source: "environment variable " + envSet, State: target.CredentialPresent}}, ""},
		"variable unset": {bearer(target.Secret{Env: envUnset}), []target.Credential{
			{Field: "auth.secret", Source: "environment variable " + envUnset, State: target.CredentialMissing,
				Problem: "environment variable " + envUnset + " is not set"}},
			"auth.secret is missing: environment variable " + envUnset + " is not set: set it to the target's bearer token"},
		"variable empty": {bearer(target.Secret{Env: envEmpty}), []target.Credential{
			{Field: "auth.secret", Source: "environment variable " + envEmpty, State: target.CredentialMissing,
				Problem: "environment variable " + envEmpty + " is empty"}},
			"auth.secret is missing: environment variable " + envEmpty + " is empty: set it to the target's bearer token"},
		"file": {bearer(target.Secret{File: present}), []target.Credential{
			{Field: "auth.secret", Source: "file " + present, State: target.CredentialPresent}}, ""},
		"no file": {func(c *target.Contract) {
			c.Auth = &target.Auth{Scheme: target.AuthBasic, User: "opbroker", Secret: target.Secret{File: dir + "/absent"}}
		}, []target.Credential{
			{Field: "auth.secret", Source: "file " + dir + "/absent", State: target.CredentialMissing,
				Problem: "file " + dir + "/absent does not exist"}},
			"auth.secret is missing: file " + dir + "/absent does not exist: the file must hold the password of user \"opbroker\", readable by the broker"},
		"empty file": {bearer(target.Secret{File: empty}), []target.Credential{
			{Field: "auth.secret", Source: "file " + empty, State: target.CredentialMissing, Problem: "file " + empty + " is empty"}},
			"auth.secret is missing: file " + empty + " is empty: the file must hold the target's bearer token, readable by the broker"},
		"a directory": {bearer(target.Secret{File: dir}), []target.Credential{
			{Field: "auth.secret", Source: "file " + dir, State: target.CredentialUnreadable, Problem: "file " + dir + " cannot be read: is a directory"}},
			"auth.secret is unreadable: file " + dir + " cannot be read: is a directory: the file must hold the target's bearer token, readable by the broker"},
		"a control character": {func(c *target.Contract) {
			c.Auth = &target.Auth{Scheme: target.AuthHeader, Header: "X-Api-Key", Secret: target.Secret{File: control}}
		}, []target.Credential{
			{Field: "auth.secret", Source: "file " + control, State: target.CredentialUnreadable, Problem: "file " + control + " holds a control character"}},
			"auth.secret is unreadable: file " + control + " holds a control character: the file must hold the value of header X-Api-Key, readable by the broker"},
		"mutual tls": {func(c *target.Contract) {
			c.TLS = &target.TLS{ClientCertificate: certFile, ClientKey: keyFile, CA: caFile}
		},
			[]target.Credential{
				{Field: "tls.client_certificate", Source: "file " + certFile, State: target.CredentialPresent},
				{Field: "tls.client_key", Source: "file " + keyFile, State: target.CredentialPresent},
				{Field: "tls.ca", Source: "file " + caFile, State: target.CredentialPresent}}, ""},
		"tls files wrong": {func(c *target.Contract) {
			c.TLS = &target.TLS{ClientCertificate: notPEM, ClientKey: dir + "/absent.key", CA: keyFile}
		},
			[]target.Credential{
				{Field: "tls.client_certificate", Source: "file " + notPEM, State: target.CredentialUnreadable, Problem: "file " + notPEM + " holds no PEM certificate"},
				{Field: "tls.client_key", Source: "file " + dir + "/absent.key", State: target.CredentialMissing, Problem: "file " + dir + "/absent.key does not exist"},
				{Field: "tls.ca", Source: "file " + keyFile, State: target.CredentialUnreadable, Problem: "file " + keyFile + " holds no PEM certificate"}},
			"tls.client_certificate is unreadable: file " + notPEM + " holds no PEM certificate: the file must hold the PEM client certificate, readable by the broker; " +
				"tls.client_key is missing: file " + dir + "/absent.key does not exist: the file must hold the PEM private key of tls.client_certificate, readable by the broker; " +
				"tls.ca is unreadable: file " + keyFile + " holds no PEM certificate: the file must hold the PEM certificate of the CA that signs the target's certificate, readable by the broker"},
		"a key of another certificate": {func(c *target.Contract) { c.TLS = &target.TLS{ClientCertificate: certFile, ClientKey: otherKeyFile} },
			[]target.Credential{
				{Field: "tls.client_certificate", Source: "file " + certFile, State: target.CredentialPresent},
				{Field: "tls.client_key", Source: "file " + otherKeyFile, State: target.CredentialUnreadable,
					Problem: "file " + otherKeyFile + " holds no private key that pairs with the certificate in " + certFile}},
			"tls.client_key is unreadable: file " + otherKeyFile + " holds no private key that pairs with the certificate in " + certFile +
				": the file must hold the PEM private key of tls.client_certificate, readable by the broker"},
	} {
		c := simtarget.DemoContracts("https://127.0.0.1:9")[0]
		tc.adjust(c)
		got := c.Credentials()
		require.Len(t, got, len(tc.want), name)
		for i, want := range tc.want {
			require.Equal(t, want.Field, got[i].Field, name)
			require.Equal(t, want.Source, got[i].Source, name)
			require.Equal(t, want.State, got[i].State, name)
			require.Equal(t, want.Problem, got[i].Problem, name)
		}
		control := c.Controls()[0]
		if tc.reason == "" {
			require.True(t, control.Pass, "%s: %s", name, control.Reason)
			require.Contains(t, control.Reason, "credentials present: "+got[0].Field, name)
		} else {
			require.False(t, control.Pass, name)
			require.Equal(t, tc.reason, control.Reason, name)
		}
		data, err := target.Encode([]*target.Contract{c})
		require.NoError(t, err)
		_, err = target.Parse("t.yaml", data)
		if tc.reason == "" {
			require.NoError(t, err, name)
		} else {
			require.EqualError(t, err, `t.yaml: target "demo-payments": go/no-go control 1 (target contract recorded) fails: `+tc.reason, name)
		}
		for _, text := range []string{control.Reason, string(data)} {
			require.NotContains(t, text, secret, name)
		}
	}

	// A send reads the variable at the time of the send.
	sim := simtarget.New(simtarget.Config{Auth: &target.Auth{Scheme: target.AuthBearer}, Credential: secret})
	srv := httptest.NewServer(sim)
	t.Cleanup(srv.Close)
	c := simtarget.DemoContracts(srv.URL)[0]
	c.Auth = &target.Auth{Scheme: target.AuthBearer, Secret: target.Secret{Env: envSet}}
	conn := target.NewConnector()
	require.Equal(t, target.Succeeded, sendTo(conn, c, `{"amount":1}`).Outcome)
	t.Setenv(envSet, "revoked")
	require.Equal(t, 401, sendTo(conn, c, `{"amount":1}`).HTTPStatus)
}

// TestAuthArrives: each scheme's credential and the static headers arrive with sends and
// lookups; the target accepts them, and refuses a request without them.
func TestAuthArrives(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		auth  target.Auth
		check func(t *testing.T, h http.Header, secret string)
	}{
		"bearer": {target.Auth{Scheme: target.AuthBearer}, func(t *testing.T, h http.Header, secret string) {
			require.Equal(t, "Bearer "+secret, h.Get("Authorization"))
		}},
		"basic": {target.Auth{Scheme: target.AuthBasic, User: "opbroker"}, func(t *testing.T, h http.Header, secret string) {
			r := http.Request{Header: h}
			user, password, ok := r.BasicAuth()
			require.True(t, ok)
			require.Equal(t, "opbroker", user)
			require.Equal(t, secret, password)
		}},
		"named header": {target.Auth{Scheme: target.AuthHeader, Header: "X-Api-Key", Prefix: "Token "}, func(t *testing.T, h http.Header, secret string) {
			require.Equal(t, "Token "+secret, h.Get("X-Api-Key"))
			require.Empty(t, h.Get("Authorization"))
		}},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			secret := randomSecret(t)
			auth := tc.auth
			auth.Secret = target.Secret{File: writeFile(t, t.TempDir(), "secret", secret+"\n")}
			cfg := simtarget.Config{Auth: &auth, Credential: secret}
			sim := simtarget.New(cfg)
			seen := make(chan http.Header, 4)
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				seen <- r.Header.Clone()
				sim.ServeHTTP(w, r)
			}))
			t.Cleanup(srv.Close)
			contracts := simtarget.Contracts(srv.URL, cfg)
			require.Equal(t, &auth, contracts[0].Auth, "the simulator's contracts carry its auth")
			contracts[0].Headers = map[string]string{"Stripe-Version": "2024-06-20"}
			targets, err := target.New(contracts...)
			require.NoError(t, err)
			c := target.NewConnector()
			key := uuid.New()
			res := send(t, c, targets, simtarget.DemoCharge, key, `{"amount":1}`)
			require.Equal(t, target.Succeeded, res.Outcome, res.Summary)
			contract, _ := targets.ForType(simtarget.DemoCharge)
			found := c.Lookup(context.Background(), contract, key, []byte(`{"amount":1}`))
			require.Equal(t, target.LookupFound, found.Outcome, found.Summary)
			for _, what := range []string{"send", "lookup"} {
				h := <-seen
				tc.check(t, h, secret)
				require.Equal(t, "2024-06-20", h.Get("Stripe-Version"), what)
			}
			require.Zero(t, sim.Snapshot().Faults[simtarget.FaultUnauthorized])

			// Another credential: 401, nothing executed, counted by the target.
			sim.SetCredential(randomSecret(t))
			refused := send(t, c, targets, simtarget.DemoCharge, uuid.New(), `{"amount":1}`)
			require.Equal(t, http.StatusUnauthorized, refused.HTTPStatus)
			require.Equal(t, target.ClassCredentialRefused, refused.Class)
			notFound := c.Lookup(context.Background(), contract, key, []byte(`{"amount":1}`))
			require.Equal(t, target.LookupFailed, notFound.Outcome)
			require.Equal(t, http.StatusUnauthorized, notFound.HTTPStatus)
			require.Equal(t, 2, sim.Snapshot().Faults[simtarget.FaultUnauthorized])
			require.Equal(t, 1, sim.Snapshot().Keys[key.String()].Effects)
		})
	}
}

// TestBrokerHeadersWin: a static header never replaces one the broker sets, even in a
// contract that skipped validation.
func TestBrokerHeadersWin(t *testing.T) {
	t.Parallel()
	got := make(chan http.Header, 1)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got <- r.Header.Clone()
		_, _ = w.Write([]byte(`{"id":"x_1"}`))
	}))
	t.Cleanup(srv.Close)
	secret := randomSecret(t)
	c := simtarget.DemoContracts(srv.URL)[0]
	c.Endpoint.FenceHeader = "X-Fence"
	c.Auth = &target.Auth{Scheme: target.AuthBearer, Secret: target.Secret{File: writeFile(t, t.TempDir(), "s", secret)}}
	c.Headers = map[string]string{"Idempotency-Key": "fixed", "X-Fence": "0", "Content-Type": "text/plain",
		"Authorization": "Bearer other", "Api-Version": "7"}
	_, err := target.New(c)
	require.Error(t, err, "validation refuses every one of them")
	key := uuid.New()
	res := target.NewConnector().Send(context.Background(), target.Request{Contract: c, Payload: []byte(`{}`),
		ContentType: "application/json", RemoteKey: key, Fence: 3, Timeout: time.Second})
	require.Equal(t, target.Succeeded, res.Outcome, res.Summary)
	h := <-got
	require.Equal(t, key.String(), h.Get("Idempotency-Key"))
	require.Equal(t, "3", h.Get("X-Fence"))
	require.Equal(t, "application/json", h.Get("Content-Type"))
	require.Equal(t, "Bearer "+secret, h.Get("Authorization"))
	require.Equal(t, "7", h.Get("Api-Version"))
}

// TestSecretFileRotates: a secret file rewritten between two sends is read again, without
// a restart, however it was replaced. Each case is caught by one rule alone.
func TestSecretFileRotates(t *testing.T) {
	t.Parallel()
	longAgo := time.Now().Add(-time.Hour).Truncate(time.Second)
	for name, tc := range map[string]struct {
		fresh  bool // the first file was just written
		rotate func(t *testing.T, path, value string)
	}{
		// Rewritten within the file system's timestamp granularity: the same size and
		// modification time, caught because the first read was too close to it.
		"rewritten in the same tick": {true, func(t *testing.T, path, value string) {
			fi, err := os.Stat(path)
			require.NoError(t, err)
			require.NoError(t, os.WriteFile(path, []byte(value), 0o600))
			require.NoError(t, os.Chtimes(path, fi.ModTime(), fi.ModTime()))
		}},
		// An old file rewritten in place with the same size: its modification time moves.
		"rewritten later": {false, func(t *testing.T, path, value string) {
			require.NoError(t, os.WriteFile(path, []byte(value), 0o600))
			require.NoError(t, os.Chtimes(path, longAgo.Add(time.Minute), longAgo.Add(time.Minute)))
		}},
		// As Kubernetes rotates a mounted secret: the name linked to another file, here of
		// the same size and modification time.
		"relinked": {false, func(t *testing.T, path, value string) {
			next := path + ".next"
			require.NoError(t, os.WriteFile(next+".data", []byte(value), 0o600))
			require.NoError(t, os.Chtimes(next+".data", longAgo, longAgo))
			require.NoError(t, os.Symlink(next+".data", next))
			require.NoError(t, os.Rename(next, path))
		}},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			first, second := randomSecret(t), randomSecret(t)
			path := writeFile(t, dir, "token.data", first)
			if !tc.fresh {
				require.NoError(t, os.Chtimes(path, longAgo, longAgo))
			}
			if name == "relinked" {
				require.NoError(t, os.Symlink(path, filepath.Join(dir, "token")))
				path = filepath.Join(dir, "token")
			}
			got := make(chan string, 3)
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				got <- r.Header.Get("Authorization")
				_, _ = w.Write([]byte(`{"id":"x_1"}`))
			}))
			t.Cleanup(srv.Close)
			c := simtarget.DemoContracts(srv.URL)[0]
			c.Auth = &target.Auth{Scheme: target.AuthBearer, Secret: target.Secret{File: path}}
			conn := target.NewConnector()
			for range 2 {
				require.Equal(t, target.Succeeded, sendTo(conn, c, `{}`).Outcome)
				require.Equal(t, "Bearer "+first, <-got)
			}
			tc.rotate(t, path, second)
			require.Equal(t, target.Succeeded, sendTo(conn, c, `{}`).Outcome)
			require.Equal(t, "Bearer "+second, <-got, "the rotated secret is used")
		})
	}
}

// TestCredentialUnavailableSendsNothing: a secret that cannot be read at the send stops
// the send before anything leaves, and says which file.
func TestCredentialUnavailableSendsNothing(t *testing.T) {
	t.Parallel()
	var arrived atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { arrived.Add(1) }))
	t.Cleanup(srv.Close)
	dir := t.TempDir()
	path := writeFile(t, dir, "token", randomSecret(t))
	c := simtarget.DemoContracts(srv.URL)[0]
	c.Auth = &target.Auth{Scheme: target.AuthBearer, Secret: target.Secret{File: path}}
	conn := target.NewConnector()
	require.True(t, sendTo(conn, c, `{}`).Sent)
	require.NoError(t, os.Remove(path))
	res := sendTo(conn, c, `{}`)
	require.Equal(t, target.ClassCredentialUnavailable, res.Class)
	require.Equal(t, target.Unknown, res.Outcome)
	require.False(t, res.Sent)
	require.Equal(t, "a credential cannot be read; nothing was sent: auth.secret: file "+path+" does not exist", res.Summary)
	found := conn.Lookup(context.Background(), c, uuid.New(), nil)
	require.Equal(t, target.LookupFailed, found.Outcome)
	require.Equal(t, "a credential cannot be read; nothing was sent: auth.secret: file "+path+" does not exist", found.Summary)
	require.Equal(t, int32(1), arrived.Load(), "only the first send arrived")
}

// TestMutualTLS: the configured client certificate is presented to its target only, a
// rotated one from the next connection on; a target whose certificate the CA does not
// sign gets nothing.
func TestMutualTLS(t *testing.T) {
	t.Parallel()
	pki := newPKI(t)
	serverCert, serverKey := pki.issue(t, "target", true)
	pair, err := tls.X509KeyPair(serverCert, serverKey)
	require.NoError(t, err)
	var handled atomic.Int32
	peers := make(chan string, 8)
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		handled.Add(1)
		peers <- r.TLS.PeerCertificates[0].Subject.CommonName
		w.Header().Set("Connection", "close") // each request on a new connection: a new handshake
		if r.Method == http.MethodGet {
			_, _ = w.Write([]byte(`{"id":"x_1","reference":"` + r.URL.Query().Get("reference") + `","request":{"amount":1}}`))
			return
		}
		_, _ = w.Write([]byte(`{"id":"x_1"}`))
	}))
	srv.TLS = &tls.Config{Certificates: []tls.Certificate{pair}, ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: pki.pool}
	srv.Config.ErrorLog = stdlog.New(io.Discard, "", 0)
	srv.StartTLS()
	t.Cleanup(srv.Close)

	dir := t.TempDir()
	clientCert, clientKey := pki.issue(t, "opbroker", false)
	files := &target.TLS{ClientCertificate: writeFile(t, dir, "tls.crt", string(clientCert)),
		ClientKey: writeFile(t, dir, "tls.key", string(clientKey)), CA: writeFile(t, dir, "ca.crt", string(pki.caPEM))}
	withCert := simtarget.DemoContracts(srv.URL)[0]
	withCert.TLS = files
	_, err = target.New(withCert)
	require.NoError(t, err)
	conn := target.NewConnector()

	sent := make(chan struct{})
	key := uuid.New()
	res := conn.Send(context.Background(), target.Request{Contract: withCert, Payload: []byte(`{"amount":1}`),
		ContentType: "application/json", RemoteKey: key, Fence: 1, Timeout: 2 * time.Second, OnSent: func() { close(sent) }})
	require.Equal(t, target.Succeeded, res.Outcome, res.Summary)
	select { // it may come just after the answer, when the last write preceded the report
	case <-sent:
	case <-time.After(2 * time.Second):
		t.Fatal("OnSent never reported a request sent over TLS")
	}
	require.Equal(t, "opbroker", <-peers)
	found := conn.Lookup(context.Background(), withCert, key, []byte(`{"amount":1}`))
	require.Equal(t, target.LookupFound, found.Outcome, found.Summary)
	require.Equal(t, "opbroker", <-peers)

	// Rotated files are used from the next connection on.
	rotatedCert, rotatedKey := pki.issue(t, "opbroker-rotated", false)
	require.NoError(t, os.WriteFile(files.ClientCertificate, rotatedCert, 0o600))
	require.NoError(t, os.WriteFile(files.ClientKey, rotatedKey, 0o600))
	require.Equal(t, target.Succeeded, sendTo(conn, withCert, `{"amount":1}`).Outcome)
	require.Equal(t, "opbroker-rotated", <-peers)

	// The same target without the certificate, through the same connector: refused in
	// the handshake, never handled.
	withoutCert := simtarget.DemoContracts(srv.URL)[0]
	withoutCert.TLS = &target.TLS{CA: files.CA}
	refused := sendTo(conn, withoutCert, `{"amount":1}`)
	require.Equal(t, target.Unknown, refused.Outcome)
	require.Zero(t, refused.HTTPStatus, refused.Summary)

	// A CA that did not sign the target's certificate: the handshake fails, nothing sent.
	otherCA := writeFile(t, dir, "other-ca.crt", string(newPKI(t).caPEM))
	untrusted := simtarget.DemoContracts(srv.URL)[0]
	untrusted.TLS = &target.TLS{ClientCertificate: files.ClientCertificate, ClientKey: files.ClientKey, CA: otherCA}
	res = sendTo(conn, untrusted, `{"amount":1}`)
	require.Equal(t, target.ClassConnectFailed, res.Class, res.Summary)
	require.False(t, res.Sent)
	require.Contains(t, res.Summary, "the TLS connection could not be made; nothing was sent")

	// A key file that went missing: nothing sent.
	require.NoError(t, os.Remove(files.ClientKey))
	res = sendTo(conn, withCert, `{"amount":1}`)
	require.Equal(t, target.ClassCredentialUnavailable, res.Class)
	require.Equal(t, "a credential cannot be read; nothing was sent: tls: file "+files.ClientKey+" does not exist", res.Summary)
	require.Equal(t, int32(3), handled.Load(), "only the requests that presented the certificate were handled")
}

// TestNoSecretLeaks: whatever fails, a secret's bytes appear in no result, summary,
// error, credential report, control, encoded contract or log line.
func TestNoSecretLeaks(t *testing.T) {
	t.Parallel()
	secret := randomSecret(t)
	logs := &logtest.Buffer{}
	log := slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	var texts []string
	collect := func(what string, v any) {
		texts = append(texts, fmt.Sprintf("%s: %+v", what, v))
		log.Debug(what, "value", v)
	}

	// A target that echoes what it received, as a careless API's error might.
	echo := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("WWW-Authenticate", "Bearer error=invalid_token, got="+r.Header.Get("Authorization"))
		w.WriteHeader(http.StatusUnauthorized)
		_, _ = w.Write([]byte(`{"error":"bad credential","got":"` + r.Header.Get("Authorization") + r.Header.Get("X-Api-Key") + `"}`))
	}))
	echo.Config.ErrorLog = stdlog.New(logs, "server: ", 0)
	t.Cleanup(echo.Close)
	pki := newPKI(t)
	serverCert, serverKey := pki.issue(t, "target", true)
	pair, err := tls.X509KeyPair(serverCert, serverKey)
	require.NoError(t, err)
	mtls := httptest.NewUnstartedServer(echo.Config.Handler)
	mtls.TLS = &tls.Config{Certificates: []tls.Certificate{pair}, ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: pki.pool}
	mtls.Config.ErrorLog = stdlog.New(logs, "server: ", 0)
	mtls.StartTLS()
	t.Cleanup(mtls.Close)

	dir := t.TempDir()
	good := writeFile(t, dir, "good", secret+"\n")
	withControl := writeFile(t, dir, "control", secret+"\x00\n")
	caFile := writeFile(t, dir, "ca.crt", string(pki.caPEM))
	clientCert, _ := pki.issue(t, "opbroker", false)
	certFile := writeFile(t, dir, "tls.crt", string(clientCert))
	keyIsSecret := writeFile(t, dir, "tls.key", "-----BEGIN PRIVATE KEY-----\n"+base64.StdEncoding.EncodeToString([]byte(secret))+"\n-----END PRIVATE KEY-----\n")
	secretAsCA := writeFile(t, dir, "ca-secret.crt", secret)

	cases := map[string]func(c *target.Contract){
		"401 to bearer": func(c *target.Contract) {
			c.Auth = &target.Auth{Scheme: target.AuthBearer, Secret: target.Secret{File: good}}
		},
		"401 to basic": func(c *target.Contract) {
			c.Auth = &target.Auth{Scheme: target.AuthBasic, User: "opbroker", Secret: target.Secret{File: good}}
		},
		"401 to a named header": func(c *target.Contract) {
			c.Auth = &target.Auth{Scheme: target.AuthHeader, Header: "X-Api-Key", Secret: target.Secret{File: good}}
		},
		"a control character": func(c *target.Contract) {
			c.Auth = &target.Auth{Scheme: target.AuthBearer, Secret: target.Secret{File: withControl}}
		},
		"a missing file": func(c *target.Contract) {
			c.Auth = &target.Auth{Scheme: target.AuthBearer, Secret: target.Secret{File: dir + "/absent"}}
		},
		"no client certificate": func(c *target.Contract) {
			c.Endpoint.URL, c.Lookup.URL = mtls.URL+"/v1/charges", mtls.URL+"/v1/charges?reference={remote_key}"
			c.Auth = &target.Auth{Scheme: target.AuthBearer, Secret: target.Secret{File: good}}
			c.TLS = &target.TLS{CA: caFile}
		},
		"a key that is not a key": func(c *target.Contract) {
			c.Endpoint.URL, c.Lookup.URL = mtls.URL+"/v1/charges", mtls.URL+"/v1/charges?reference={remote_key}"
			c.Auth = &target.Auth{Scheme: target.AuthBearer, Secret: target.Secret{File: good}}
			c.TLS = &target.TLS{ClientCertificate: certFile, ClientKey: keyIsSecret, CA: caFile}
		},
		"a CA that is not a CA": func(c *target.Contract) {
			c.Endpoint.URL, c.Lookup.URL = mtls.URL+"/v1/charges", mtls.URL+"/v1/charges?reference={remote_key}"
			c.Auth = &target.Auth{Scheme: target.AuthBearer, Secret: target.Secret{File: good}}
			c.TLS = &target.TLS{CA: secretAsCA}
		},
		"an untrusted target": func(c *target.Contract) {
			c.Endpoint.URL, c.Lookup.URL = mtls.URL+"/v1/charges", mtls.URL+"/v1/charges?reference={remote_key}"
			c.Auth = &target.Auth{Scheme: target.AuthBearer, Secret: target.Secret{File: good}}
			c.TLS = &target.TLS{CA: writeFile(t, dir, "other-ca.crt", string(newPKI(t).caPEM))}
		},
	}
	conn := target.NewConnector()
	var statuses []int
	for name, adjust := range cases {
		c := simtarget.DemoContracts(echo.URL)[0]
		adjust(c)
		res := sendTo(conn, c, `{"amount":1}`)
		found := conn.Lookup(context.Background(), c, uuid.New(), []byte(`{"amount":1}`))
		statuses = append(statuses, res.HTTPStatus)
		collect(name+": result", res)
		collect(name+": lookup", found)
		collect(name+": credentials", c.Credentials())
		collect(name+": controls", c.Controls())
		collect(name+": contract", c)
		data, err := target.Encode([]*target.Contract{c})
		require.NoError(t, err)
		collect(name+": encoded", string(data))
		_, err = target.Parse("t.yaml", data)
		collect(name+": parse", err)
		_, err = target.New(c)
		collect(name+": new", err)
	}
	require.Contains(t, statuses, http.StatusUnauthorized, "the 401 cases reached the target")
	echo.Close() // waits for the servers' connections, and so for their logs
	mtls.Close()
	require.Contains(t, logs.String(), "TLS handshake error", "the server's log is captured")

	all := strings.Join(texts, "\n") + "\n" + logs.String()
	basic := base64.StdEncoding.EncodeToString([]byte("opbroker:" + secret))
	for _, form := range []string{secret, basic, base64.StdEncoding.EncodeToString([]byte(secret))} {
		require.NotContains(t, all, form)
	}
	require.Contains(t, all, good, "the file is named")
}

func sendTo(c *target.Connector, contract *target.Contract, body string) target.Result {
	return c.Send(context.Background(), target.Request{Contract: contract, Payload: []byte(body),
		ContentType: "application/json", RemoteKey: uuid.New(), Fence: 1, Timeout: 2 * time.Second})
}

// randomSecret is a secret no test output can contain by chance.
func randomSecret(t *testing.T) string {
	t.Helper()
	b := make([]byte, 16)
	_, err := rand.Read(b)
	require.NoError(t, err)
	return "sk_test_" + hex.EncodeToString(b)
}

func writeFile(t *testing.T, dir, name, content string) string {
	t.Helper()
	path := filepath.Join(dir, name)
	require.NoError(t, os.WriteFile(path, []byte(content), 0o600))
	return path
}

// pki is a throwaway certificate authority for a test; nothing of it is written
// anywhere but the test's temporary directory.
type pki struct {
	ca    *x509.Certificate
	key   *ecdsa.PrivateKey
	caPEM []byte
	pool  *x509.CertPool
}

func newPKI(t *testing.T) *pki {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(t, err)
	ca, err := x509.ParseCertificate(der)
	require.NoError(t, err)
	pool := x509.NewCertPool()
	pool.AddCert(ca)
	return &pki{ca: ca, key: key, caPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pool: pool}
}

// issue returns a PEM certificate and key signed by the CA: for 127.0.0.1 if server,
// for client authentication otherwise.
func (p *pki) issue(t *testing.T, name string, server bool) (certPEM, keyPEM []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	serial, err := rand.Int(rand.Reader, big.NewInt(1<<62))
	require.NoError(t, err)
	tmpl := &x509.Certificate{SerialNumber: serial, Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}
	if server {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
		tmpl.IPAddresses = []net.IP{net.IPv4(127, 0, 0, 1)}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.ca, &key.PublicKey, p.key)
	require.NoError(t, err)
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	require.NoError(t, err)
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})
}
