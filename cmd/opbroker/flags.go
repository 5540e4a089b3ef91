package main

import (
	"github.com/urfave/cli/v3"

	"github.com/opbroker/opbroker/brokermetrics"
	"github.com/opbroker/opbroker/dispatcher"
	"github.com/opbroker/opbroker/evidence"
	"github.com/opbroker/opbroker/reconciler"
	"github.com/opbroker/opbroker/server"
	"github.com/opbroker/opbroker/sweeper"
	"github.com/opbroker/opbroker/ui"
)

// The flags shared by dev and serve, with the environment variables they read.
func serverFlags(grpcAddr, httpAddr, webhookAddr, uiAddr, logFormat string) []cli.Flag {
	return []cli.Flag{
		&cli.StringFlag{Name: "grpc-addr", Value: grpcAddr, Usage: "address for the gRPC API", Sources: cli.EnvVars("OPBROKER_GRPC_ADDR")},
		&cli.StringFlag{Name: "http-addr", Value: httpAddr, Usage: "address for /metrics (Prometheus)", Sources: cli.EnvVars("OPBROKER_HTTP_ADDR")},
		&cli.DurationFlag{Name: "metrics-interval", Value: brokermetrics.DefaultInterval, Usage: "how often this replica reads the ledger for the gauges of open operations on /metrics (one statement); 0 turns them off here", Sources: cli.EnvVars("OPBROKER_METRICS_INTERVAL")},
		&cli.IntFlag{Name: "max-payload-bytes", Value: server.DefaultMaxPayloadBytes, Usage: "largest payload PrepareOperation accepts", Sources: cli.EnvVars("OPBROKER_MAX_PAYLOAD_BYTES")},
		&cli.DurationFlag{Name: "shutdown-grace", Value: dispatcher.DefaultShutdownGrace, Usage: "how long calls in progress may finish after SIGTERM", Sources: cli.EnvVars("OPBROKER_SHUTDOWN_GRACE")},
		&cli.StringFlag{Name: "log-format", Value: logFormat, Usage: "json or text", Sources: cli.EnvVars("OPBROKER_LOG_FORMAT")},
		&cli.StringFlag{Name: "log-level", Value: "info", Usage: "debug, info, warn or error", Sources: cli.EnvVars("OPBROKER_LOG_LEVEL")},
		&cli.BoolFlag{Name: "dispatch", Value: true, Usage: "run the dispatcher in this replica (--dispatch=false serves the API only)", Sources: cli.EnvVars("OPBROKER_DISPATCH")},
		&cli.IntFlag{Name: "dispatch-pool-size", Value: dispatcher.DefaultPoolSize, Usage: "concurrent sends of this replica", Sources: cli.EnvVars("OPBROKER_DISPATCH_POOL_SIZE")},
		&cli.IntFlag{Name: "dispatch-claim-batch", Value: dispatcher.DefaultClaimBatch, Usage: "operations claimed per statement", Sources: cli.EnvVars("OPBROKER_DISPATCH_CLAIM_BATCH")},
		&cli.IntFlag{Name: "dispatch-max-resends", Value: dispatcher.DefaultMaxResends, Usage: "answers documented as not executed one operation may get before it fails (nothing executed); each is sent again after backoff", Sources: cli.EnvVars("OPBROKER_DISPATCH_MAX_RESENDS")},
		&cli.BoolFlag{Name: "reconcile", Value: true, Usage: "run the reconciler in this replica (resolves UNKNOWN operations)", Sources: cli.EnvVars("OPBROKER_RECONCILE")},
		&cli.IntFlag{Name: "reconcile-max-replays", Value: reconciler.DefaultMaxReplays, Usage: "same-key replays of one UNKNOWN operation before it is escalated", Sources: cli.EnvVars("OPBROKER_RECONCILE_MAX_REPLAYS")},
		&cli.IntFlag{Name: "reconcile-max-looks", Value: reconciler.DefaultMaxLooks, Usage: "lookups of one UNKNOWN operation before it is escalated", Sources: cli.EnvVars("OPBROKER_RECONCILE_MAX_LOOKS")},
		&cli.DurationFlag{Name: "reconcile-deadline", Value: reconciler.DefaultResolutionDeadline, Usage: "time from the first send after which an unresolved operation is escalated", Sources: cli.EnvVars("OPBROKER_RECONCILE_DEADLINE")},
		&cli.DurationFlag{Name: "reconcile-lease", Value: reconciler.DefaultLease, Usage: "how long a reconciler's claim on an UNKNOWN operation is held before another replica may take it over; at least --dispatch-lease", Sources: cli.EnvVars("OPBROKER_RECONCILE_LEASE")},
		&cli.IntFlag{Name: "watches-per-principal", Value: server.DefaultWatchesPerPrincipal, Usage: "open watch streams one principal may hold", Sources: cli.EnvVars("OPBROKER_WATCHES_PER_PRINCIPAL")},
		&cli.Float64Flag{Name: "tenant-rate", Value: server.DefaultTenantRate, Usage: "calls per second one tenant may make (token bucket)", Sources: cli.EnvVars("OPBROKER_TENANT_RATE")},
		&cli.IntFlag{Name: "tenant-burst", Value: server.DefaultTenantBurst, Usage: "calls one tenant may make at once above --tenant-rate", Sources: cli.EnvVars("OPBROKER_TENANT_BURST")},
		&cli.DurationFlag{Name: "payload-retention", Value: sweeper.DefaultPayloadRetention, Usage: "how long a terminal operation keeps its payload bytes (hash and events stay) when no target's contract gives its operation type a data.retention; 0 keeps those", Sources: cli.EnvVars("OPBROKER_PAYLOAD_RETENTION")},
		&cli.StringFlag{Name: "webhook-addr", Value: webhookAddr, Usage: "address of the listener for the targets' webhooks (evidence.webhook in their contracts), which faces the providers: never the metrics port; empty: none", Sources: cli.EnvVars("OPBROKER_WEBHOOK_ADDR")},
		&cli.StringFlag{Name: "ui-addr", Value: uiAddr, Usage: "address of the support view (read-only web pages for support-read and operator principals; HTTPS when gRPC has TLS); empty: none", Sources: cli.EnvVars("OPBROKER_UI_ADDR")},
		&cli.StringFlag{Name: "ui-session-key-file", Usage: "file of a secret that seals the support view's sessions; give every replica the same one so that a session works on any of them (without it each process seals with its own random key)", Sources: cli.EnvVars("OPBROKER_UI_SESSION_KEY_FILE")},
		&cli.DurationFlag{Name: "ui-session-lifetime", Value: ui.DefaultSessionLifetime, Usage: "how long a sign-in to the support view lasts", Sources: cli.EnvVars("OPBROKER_UI_SESSION_LIFETIME")},
		&cli.IntFlag{Name: "webhook-max-body", Value: evidence.DefaultMaxWebhookBody, Usage: "largest webhook body the listener reads, in bytes", Sources: cli.EnvVars("OPBROKER_WEBHOOK_MAX_BODY")},
		&cli.DurationFlag{Name: "evidence-body-retention", Value: evidence.DefaultBodyRetention, Usage: "how long the body of a target's event is kept, for matching and for reviewing the quarantine (at least every target's evidence.match_for)", Sources: cli.EnvVars("OPBROKER_EVIDENCE_BODY_RETENTION")},
		&cli.DurationFlag{Name: "dispatch-lease", Value: dispatcher.DefaultLease, Usage: "how long a claim is held before an expired one becomes UNKNOWN (extended during a call)", Sources: cli.EnvVars("OPBROKER_DISPATCH_LEASE")},
	}
}

var targetsFlag = &cli.StringFlag{
	Name:     "targets",
	Usage:    "YAML file of recorded target contracts (docs/targets.md)",
	Sources:  cli.EnvVars("OPBROKER_TARGETS"),
	Required: true,
}

var databaseURLFlag = &cli.StringFlag{
	Name:     "database-url",
	Usage:    "PostgreSQL connection string (pool settings such as pool_max_conns may be added; for a replicated database, every node with target_session_attrs=read-write)",
	Sources:  cli.EnvVars("DATABASE_URL"),
	Required: true,
}

var requireSyncFlag = &cli.BoolFlag{
	Name:    "require-synchronous-replication",
	Usage:   "refuse to start, and report NOT_SERVING, unless every commit waits for a synchronous standby (without it a failover can lose acknowledged intents)",
	Sources: cli.EnvVars("OPBROKER_REQUIRE_SYNCHRONOUS_REPLICATION"),
}
