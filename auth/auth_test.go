package auth_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"net"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"

	"github.com/opbroker/opbroker/auth"
	"github.com/opbroker/opbroker/auth/authtest"
)

func TestNewRefusesBadPrincipals(t *testing.T) {
	t.Parallel()
	_, hash := auth.NewToken()
	ok := auth.PrincipalConfig{Name: "svc", Roles: []auth.Role{auth.RoleClient}, Tenants: []string{"acme"}, TokenSHA256: []string{hash}}
	for name, tc := range map[string]struct {
		change func(*auth.PrincipalConfig)
		want   string
	}{
		"bad name":          {func(p *auth.PrincipalConfig) { p.Name = "Not OK" }, "name must match"},
		"no role":           {func(p *auth.PrincipalConfig) { p.Roles = nil }, "at least one role"},
		"unknown role":      {func(p *auth.PrincipalConfig) { p.Roles = []auth.Role{"admin"} }, `unknown role "admin"`},
		"no tenants":        {func(p *auth.PrincipalConfig) { p.Tenants = nil }, "either tenants or all_tenants"},
		"both tenant kinds": {func(p *auth.PrincipalConfig) { p.AllTenants = true }, "either tenants or all_tenants"},
		"bad tenant":        {func(p *auth.PrincipalConfig) { p.Tenants = []string{"ACME"} }, `tenant "ACME"`},
		"no credential":     {func(p *auth.PrincipalConfig) { p.TokenSHA256 = nil }, "needs a token_sha256 or an identity"},
		"plain token":       {func(p *auth.PrincipalConfig) { p.TokenSHA256 = []string{"opb_secret"} }, "64 lowercase hex"},
	} {
		t.Run(name, func(t *testing.T) {
			p := ok
			tc.change(&p)
			_, err := auth.New([]auth.PrincipalConfig{p})
			require.ErrorContains(t, err, tc.want)
		})
	}
	_, err := auth.New([]auth.PrincipalConfig{ok, ok})
	require.ErrorContains(t, err, "name used twice")
	other := ok
	other.Name = "other"
	_, err = auth.New([]auth.PrincipalConfig{ok, other})
	require.ErrorContains(t, err, "token hash is used twice")
}

func TestAuthenticate(t *testing.T) {
	t.Parallel()
	token, hash := auth.NewToken()
	a, err := auth.New([]auth.PrincipalConfig{
		{Name: "checkout", Roles: []auth.Role{auth.RoleClient}, Tenants: []string{"acme"}, TokenSHA256: []string{hash}},
		{Name: "billing", Roles: []auth.Role{auth.RoleClient}, Tenants: []string{"globex"}, Identities: []string{"spiffe://test/billing"}},
	})
	require.NoError(t, err)
	bearer := func(tok string) context.Context {
		return metadata.NewIncomingContext(context.Background(), metadata.Pairs("authorization", "Bearer "+tok))
	}

	p, err := a.Authenticate(bearer(token))
	require.NoError(t, err)
	require.Equal(t, "checkout", p.Name)
	require.True(t, p.MayActFor("acme"))
	require.False(t, p.MayActFor("globex"))

	_, err = a.Authenticate(bearer(token + "x"))
	require.ErrorIs(t, err, auth.ErrBadCredentials)
	_, err = a.Authenticate(bearer(hash))
	require.ErrorIs(t, err, auth.ErrBadCredentials, "the hash is not the token")
	_, err = a.Authenticate(context.Background())
	require.ErrorIs(t, err, auth.ErrNoCredentials)

	ca := authtest.NewCA(t)
	withCert := func(cert tls.Certificate, verified bool) context.Context {
		state := tls.ConnectionState{PeerCertificates: []*x509.Certificate{cert.Leaf}}
		if verified {
			state.VerifiedChains = [][]*x509.Certificate{{cert.Leaf}}
		}
		return peer.NewContext(context.Background(), &peer.Peer{Addr: &net.TCPAddr{}, AuthInfo: credentials.TLSInfo{State: state}})
	}
	p, err = a.Authenticate(withCert(ca.Client(t, "spiffe://test/billing"), true))
	require.NoError(t, err)
	require.Equal(t, "billing", p.Name)
	_, err = a.Authenticate(withCert(ca.Client(t, "spiffe://test/billing"), false))
	require.ErrorIs(t, err, auth.ErrNoCredentials, "an unverified certificate is no credential")
	_, err = a.Authenticate(withCert(ca.Client(t, "spiffe://test/stranger"), true))
	require.ErrorIs(t, err, auth.ErrBadCredentials)
}
