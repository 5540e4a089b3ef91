package main

import (
	"context"
	"crypto/tls"
	"fmt"
	"net/http"
	neturl "net/url"
	"os"
	"path/filepath"
	"regexp"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/opbroker/opbroker/auth"
	"github.com/opbroker/opbroker/auth/authtest"
	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/storetest"
)

// TestServeWithPrincipals: serve over TLS with two tenants and three principals (two
// bearer tokens, one client certificate); each sees exactly what its roles and tenants
// allow.
func TestServeWithPrincipals(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ca := authtest.NewCA(t)
	certFile, keyFile := authtest.WriteFiles(t, dir, "server", ca.Server(t))
	caFile := filepath.Join(dir, "ca.crt")
	require.NoError(t, os.WriteFile(caFile, ca.PEM, 0o600))
	clientToken, clientHash := auth.NewToken()
	supportToken, supportHash := auth.NewToken()
	principals := filepath.Join(dir, "principals.yaml")
	require.NoError(t, os.WriteFile(principals, fmt.Appendf(nil, `principals:
  - name: checkout
    roles: [client]
    tenants: [acme]
    token_sha256: [%s]
  - name: support
    roles: [support-read]
    all_tenants: true
    token_sha256: [%s]
  - name: billing
    roles: [client]
    tenants: [globex]
    identities: ["spiffe://test/billing"]
`, clientHash, supportHash), 0o600))

	url := storetest.Schema(t)
	base := []string{"serve", "--database-url", url, "--targets", targetsFile(t, simURL(t)),
		"--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--log-format", "text", "--dispatch=false"}
	start(t, base...).requireFails(t, "give --auth-config (principals) or, knowingly, --insecure-no-auth")
	start(t, append(base, "--auth-config", principals)...).requireFails(t, "give --tls-cert and --tls-key or, knowingly, --plaintext")

	p := start(t, append(base, "--auth-config", principals, "--tls-cert", certFile, "--tls-key", keyFile, "--tls-client-ca", caFile,
		"--ui-addr", "127.0.0.1:0")...)
	addr := p.waitReady(t)
	dialTLS := func(certs ...tls.Certificate) opbrokerv1.OperationServiceClient {
		conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(
			&tls.Config{RootCAs: ca.Pool, Certificates: certs, MinVersion: tls.VersionTLS12})))
		require.NoError(t, err)
		t.Cleanup(func() { conn.Close() })
		return opbrokerv1.NewOperationServiceClient(conn)
	}
	anonymous := dialTLS()
	billing := dialTLS(ca.Client(t, "spiffe://test/billing"))
	stranger := dialTLS(ca.Client(t, "spiffe://test/stranger"))
	bearer := func(token string) context.Context {
		return metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+token)
	}
	code := func(err error) codes.Code { return status.Code(err) }
	prepareIn := func(ctx context.Context, client opbrokerv1.OperationServiceClient, tenant string) (*opbrokerv1.PrepareOperationResponse, error) {
		return client.PrepareOperation(ctx, &opbrokerv1.PrepareOperationRequest{Tenant: tenant, OperationType: "demo.charge",
			IntentRef: "order-" + tenant, Payload: []byte(`{"amount":1}`), ContentType: "application/json"})
	}
	list := func(ctx context.Context, client opbrokerv1.OperationServiceClient, tenant string) (int, error) {
		resp, err := client.ListOperations(ctx, &opbrokerv1.ListOperationsRequest{Tenant: tenant})
		return len(resp.GetOperations()), err
	}

	// checkout (token): its tenant only.
	acmeOp, err := prepareIn(bearer(clientToken), anonymous, "acme")
	require.NoError(t, err)
	_, err = prepareIn(bearer(clientToken), anonymous, "globex")
	require.Equal(t, codes.PermissionDenied, code(err))

	// billing (client certificate): its tenant only.
	_, err = prepareIn(context.Background(), billing, "globex")
	require.NoError(t, err)
	_, err = billing.GetOperation(context.Background(), &opbrokerv1.GetOperationRequest{Name: acmeOp.GetOperation().GetName()})
	require.Equal(t, codes.PermissionDenied, code(err))

	// support (token): reads every tenant, changes nothing.
	for _, tenant := range []string{"acme", "globex"} {
		n, err := list(bearer(supportToken), anonymous, tenant)
		require.NoError(t, err)
		require.Equal(t, 1, n, tenant)
	}
	_, err = prepareIn(bearer(supportToken), anonymous, "acme")
	require.Equal(t, codes.PermissionDenied, code(err))

	// Nobody, a forged token, an unknown certificate, a plaintext client.
	_, err = list(context.Background(), anonymous, "acme")
	require.Equal(t, codes.Unauthenticated, code(err))
	_, err = list(bearer(supportHash), anonymous, "acme")
	require.Equal(t, codes.Unauthenticated, code(err), "the hash is not the token")
	_, err = list(context.Background(), stranger, "acme")
	require.Equal(t, codes.Unauthenticated, code(err))
	_, err = list(bearer(supportToken), opbrokerv1.NewOperationServiceClient(dial(t, addr)), "acme")
	require.Equal(t, codes.Unavailable, code(err), "no plaintext on a TLS port")

	// The support view: HTTPS with the same certificate, over HTTP/2, no client
	// certificate asked for; a support token signs in; no HSTS, which would hold for
	// the metrics port too.
	view := regexp.MustCompile(`msg="support view" addr=(https://\S+)`).FindStringSubmatch(p.Output())
	require.NotNil(t, view, p.Output())
	web := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: ca.Pool, MinVersion: tls.VersionTLS12},
		ForceAttemptHTTP2: true}, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err := web.PostForm(view[1]+"/signin", neturl.Values{"token": {supportToken}})
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusSeeOther, resp.StatusCode)
	require.Equal(t, "HTTP/2.0", resp.Proto)
	require.Empty(t, resp.Header.Get("Strict-Transport-Security"))
	require.Len(t, resp.Cookies(), 1)

	require.NotContains(t, p.Output(), clientToken, "tokens never reach the log")
	require.NotContains(t, p.Output(), supportToken, "tokens never reach the log")
	require.Contains(t, p.Output(), `msg="permission denied"`)
	p.stop(t, syscall.SIGTERM)
}
