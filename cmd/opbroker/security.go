package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"os"

	"github.com/urfave/cli/v3"
	"google.golang.org/grpc/credentials"

	"github.com/opbroker/opbroker/auth"
	"github.com/opbroker/opbroker/server"
)

// security is how a broker admits callers: who they are, over what transport.
type security struct {
	auth        *auth.Authenticator // nil: no authentication
	credentials credentials.TransportCredentials
	tls         *tls.Config // the gRPC server's TLS, which the support view serves too; nil: plaintext
	reflection  bool
}

// The flags of serve that choose its security. Insecure choices must be explicit.
var securityFlags = []cli.Flag{
	&cli.StringFlag{Name: "auth-config", Usage: "YAML file of principals: roles, tenants, token hashes, certificate identities (docs/security.md)", Sources: cli.EnvVars("OPBROKER_AUTH_CONFIG")},
	&cli.BoolFlag{Name: "insecure-no-auth", Usage: "serve without authentication: every caller may do everything (never in production)", Sources: cli.EnvVars("OPBROKER_INSECURE_NO_AUTH")},
	&cli.StringFlag{Name: "tls-cert", Usage: "PEM certificate (chain) of the gRPC server", Sources: cli.EnvVars("OPBROKER_TLS_CERT")},
	&cli.StringFlag{Name: "tls-key", Usage: "PEM private key of --tls-cert", Sources: cli.EnvVars("OPBROKER_TLS_KEY")},
	&cli.StringFlag{Name: "tls-client-ca", Usage: "PEM CA certificates that sign client certificates (enables mutual TLS; bearer tokens keep working)", Sources: cli.EnvVars("OPBROKER_TLS_CLIENT_CA")},
	&cli.BoolFlag{Name: "plaintext", Usage: "serve gRPC without TLS (only behind a proxy that terminates TLS, or on loopback)", Sources: cli.EnvVars("OPBROKER_PLAINTEXT")},
	&cli.BoolFlag{Name: "reflection", Usage: "register gRPC reflection (for grpcurl)", Sources: cli.EnvVars("OPBROKER_REFLECTION")},
}

// securityFromFlags builds serve's security, refusing an unstated insecure choice.
func securityFromFlags(cmd *cli.Command, log *slog.Logger) (security, error) {
	sec := security{reflection: cmd.Bool("reflection")}
	switch config := cmd.String("auth-config"); {
	case config != "" && cmd.Bool("insecure-no-auth"):
		return sec, errors.New("--auth-config and --insecure-no-auth exclude each other")
	case config != "":
		a, err := auth.Load(config)
		if err != nil {
			return sec, fmt.Errorf("--auth-config: %w", err)
		}
		sec.auth = a
	case cmd.Bool("insecure-no-auth"):
		log.Warn("AUTHENTICATION IS OFF (--insecure-no-auth): every caller may act for every tenant")
	default:
		return sec, errors.New("give --auth-config (principals) or, knowingly, --insecure-no-auth")
	}

	cert, key, clientCA := cmd.String("tls-cert"), cmd.String("tls-key"), cmd.String("tls-client-ca")
	switch {
	case cmd.Bool("plaintext") && (cert != "" || key != "" || clientCA != ""):
		return sec, errors.New("--plaintext excludes --tls-cert, --tls-key and --tls-client-ca")
	case cmd.Bool("plaintext"):
		log.Warn("TLS IS OFF (--plaintext): bearer tokens and payloads cross the network in the clear")
		return sec, nil
	case cert == "" || key == "":
		return sec, errors.New("give --tls-cert and --tls-key or, knowingly, --plaintext")
	}
	config, err := serverTLS(cert, key, clientCA)
	if err != nil {
		return sec, err
	}
	sec.credentials, sec.tls = credentials.NewTLS(config), config
	return sec, nil
}

// serverTLS is TLS 1.2 or later with the certificate; with clientCA, a client
// certificate, when one is presented, must verify against it.
func serverTLS(certFile, keyFile, clientCAFile string) (*tls.Config, error) {
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, fmt.Errorf("--tls-cert/--tls-key: %w", err)
	}
	config := &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{cert}}
	if clientCAFile != "" {
		pem, err := os.ReadFile(clientCAFile)
		if err != nil {
			return nil, fmt.Errorf("--tls-client-ca: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("--tls-client-ca: no PEM certificates in %s", clientCAFile)
		}
		config.ClientCAs, config.ClientAuth = pool, tls.VerifyClientCertIfGiven
	}
	return config, nil
}

func tokenCommand() *cli.Command {
	return &cli.Command{
		Name:  "token",
		Usage: "bearer tokens for the principals file",
		Commands: []*cli.Command{{
			Name:  "new",
			Usage: "print a new random token (give it to the caller) and its hash (put it in the principals file)",
			Action: func(_ context.Context, cmd *cli.Command) error {
				token, hash := auth.NewToken()
				fmt.Fprintf(cmd.Root().Writer, "token:        %s\ntoken_sha256: %s\n", token, hash)
				return nil
			},
		}},
	}
}

// limitsFromFlags reads the per-principal and per-tenant limits.
func limitsFromFlags(cmd *cli.Command) server.Limits {
	return server.Limits{
		WatchesPerPrincipal: cmd.Int("watches-per-principal"),
		TenantRate:          cmd.Float64("tenant-rate"),
		TenantBurst:         cmd.Int("tenant-burst"),
	}
}
