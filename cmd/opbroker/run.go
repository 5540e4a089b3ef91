package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/urfave/cli/v3"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/opbroker/opbroker/brokermetrics"
	"github.com/opbroker/opbroker/crashpoint"
	"github.com/opbroker/opbroker/dispatcher"
	"github.com/opbroker/opbroker/evidence"
	"github.com/opbroker/opbroker/gcpace"
	"github.com/opbroker/opbroker/reconciler"
	"github.com/opbroker/opbroker/server"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/sweeper"
	"github.com/opbroker/opbroker/target"
	"github.com/opbroker/opbroker/tracing"
	"github.com/opbroker/opbroker/ui"
	"github.com/opbroker/opbroker/watch"
)

// broker is one running broker process: its gRPC server, dispatcher and metrics
// endpoint over a database pool.
type broker struct {
	log        *slog.Logger
	pool       *pgxpool.Pool
	store      *store.Store
	targets    *target.Targets
	srv        *server.Server
	health     *server.DatabaseHealth // turns srv's health NOT_SERVING while the database does not answer
	dispatcher *dispatcher.Dispatcher // always built: the reconciler's replays go through it
	sweeper    *sweeper.Sweeper       // runs where the dispatcher does
	dispatch   bool                   // whether this replica claims PREPARED operations
	reconciler *reconciler.Reconciler // nil when this replica does not reconcile
	evidence   *evidence.Matcher      // matches the events targets report
	webhookSrv *http.Server           // nil without --webhook-addr
	webhookLis net.Listener
	uiSrv      *http.Server // the support view; nil without --ui-addr
	uiLis      net.Listener
	uiURL      string // where the support view is; "" without one
	notifier   *store.Notifier
	ledger     *brokermetrics.Ledger // the ledger's gauges; nil when --metrics-interval is 0
	hub        *watch.Hub
	grpcLis    net.Listener
	httpSrv    *http.Server
	httpLis    net.Listener
	mux        *http.ServeMux
	meters     *sdkmetric.MeterProvider
	traces     *tracing.Provider
	grace      time.Duration
	// requireSync: --require-synchronous-replication was given.
	requireSync bool
	grpcDone    chan error
}

func newLogger(cmd *cli.Command) (*slog.Logger, error) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(cmd.String("log-level"))); err != nil {
		return nil, fmt.Errorf("--log-level: %w", err)
	}
	opts := &slog.HandlerOptions{Level: level}
	switch cmd.String("log-format") {
	case "json":
		return slog.New(slog.NewJSONHandler(os.Stderr, opts)), nil
	case "text":
		return slog.New(slog.NewTextHandler(os.Stderr, opts)), nil
	default:
		return nil, fmt.Errorf("--log-format must be json or text, not %q", cmd.String("log-format"))
	}
}

// defaultConnectTimeout bounds a new database connection when the URL sets no
// connect_timeout; defaultPingTimeout the liveness ping of an idle one when it sets no
// pool_ping_timeout.
const (
	defaultConnectTimeout = 5 * time.Second
	defaultPingTimeout    = 2 * time.Second
)

// startBroker connects to the database, checks its schema and starts listening. The
// caller runs it with serve and stops it with shutdown.
func startBroker(ctx context.Context, cmd *cli.Command, log *slog.Logger, databaseURL string, targets *target.Targets, sec security) (*broker, error) {
	// A replay is claimed under the reconciler's lease but kept by the dispatcher, which
	// extends what it holds every third of its own lease and sends nothing within a tenth
	// of a lease's end: under a shorter lease, a long replay's could run out before it is
	// first extended, and another replica take the operation over while it is sent.
	if reconcile, dispatch := cmd.Duration("reconcile-lease"), cmd.Duration("dispatch-lease"); cmd.Bool("reconcile") && reconcile < dispatch {
		return nil, fmt.Errorf("--reconcile-lease %s is shorter than --dispatch-lease %s: a replay is held under the first and kept by the dispatcher, "+
			"which extends leases every third of the second; make it at least as long", reconcile, dispatch)
	}
	poolCfg, err := pgxpool.ParseConfig(databaseURL)
	if err != nil {
		return nil, fmt.Errorf("database: %w", err)
	}
	// A node that accepts a connection and then says nothing (a stopped or partitioned
	// primary) must not hold a new connection up for long: the next host of a
	// multi-host URL is tried after it.
	if poolCfg.ConnConfig.ConnectTimeout == 0 {
		poolCfg.ConnConfig.ConnectTimeout = defaultConnectTimeout
	}
	// Nor an idle connection to it: one idle for more than a second is pinged before
	// use, and dropped for another if the ping takes longer than this.
	if poolCfg.PingTimeout == 0 {
		poolCfg.PingTimeout = defaultPingTimeout
	}
	pool, err := pgxpool.NewWithConfig(ctx, poolCfg)
	if err != nil {
		return nil, fmt.Errorf("database: %w", err)
	}
	b := &broker{log: log, pool: pool, targets: targets, grace: cmd.Duration("shutdown-grace"), grpcDone: make(chan error, 1)}
	if err := b.start(ctx, cmd, sec); err != nil {
		b.close()
		return nil, err
	}
	return b, nil
}

func (b *broker) start(ctx context.Context, cmd *cli.Command, sec security) error {
	if err := b.pool.Ping(ctx); err != nil {
		return fmt.Errorf("database: %w", err)
	}
	if err := store.CheckSchema(ctx, b.pool); err != nil {
		return err
	}
	b.requireSync = cmd.Bool(requireSyncFlag.Name)
	if b.requireSync {
		if err := store.New(b.pool).CheckSynchronousReplication(ctx); err != nil {
			return fmt.Errorf("--%s: %w", requireSyncFlag.Name, err)
		}
		b.log.Info("commits wait for a synchronous standby")
	}
	for _, v := range []string{crashpoint.EnvVar, crashpoint.ClockOffsetEnvVar} {
		if !crashpoint.Enabled && os.Getenv(v) != "" {
			b.log.Warn(v+" is ignored: this build has no crash points", "build_tag", crashpoint.BuildTag)
		}
	}
	clock, err := crashpoint.Clock()
	if err != nil {
		return err
	}

	registry := prometheus.NewRegistry()
	registry.MustRegister(currentBuild().metric(), collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	exporter, err := otelprom.New(otelprom.WithRegisterer(registry))
	if err != nil {
		return fmt.Errorf("metrics: %w", err)
	}
	b.meters = sdkmetric.NewMeterProvider(sdkmetric.WithReader(exporter))
	if b.traces, err = tracing.New(ctx, currentBuild().Version); err != nil {
		return err
	}
	if b.traces.Exporting {
		b.log.Info("exporting traces over OTLP")
	}
	b.store = store.New(b.pool)
	b.notifier = b.store.NewNotifier(b.log, 10*time.Millisecond)
	b.hub = watch.New(b.store, b.log, time.Second)

	b.evidence, err = evidence.New(evidence.Config{Store: b.store, Targets: b.targets, Logger: b.log, MeterProvider: b.meters,
		BodyRetention: cmd.Duration("evidence-body-retention")})
	if err != nil {
		return err
	}
	b.srv, err = server.New(server.Options{
		Store:           b.store,
		Targets:         b.targets,
		Logger:          b.log,
		MeterProvider:   b.meters,
		TracerProvider:  b.traces,
		MaxPayloadBytes: cmd.Int("max-payload-bytes"),
		Hub:             b.hub,
		Auth:            sec.auth,
		Limits:          limitsFromFlags(cmd),
		Credentials:     sec.credentials,
		Reflection:      sec.reflection,
		Evidence:        b.evidence,
	})
	if err != nil {
		return err
	}
	b.health = server.NewDatabaseHealth(server.DatabaseHealthConfig{Server: b.srv, Store: b.store, Logger: b.log,
		RequireSynchronousReplication: b.requireSync})
	connector, err := brokermetrics.TimeRequests(target.NewConnector(), b.meters)
	if err != nil {
		return err
	}
	b.dispatch = cmd.Bool("dispatch")
	b.dispatcher, err = dispatcher.New(dispatcher.Config{
		Store: b.store, Targets: b.targets, Connector: connector,
		Logger: b.log, MeterProvider: b.meters, TracerProvider: b.traces,
		PoolSize: cmd.Int("dispatch-pool-size"), ClaimBatch: cmd.Int("dispatch-claim-batch"),
		Lease: cmd.Duration("dispatch-lease"), ShutdownGrace: b.grace, MaxResends: cmd.Int("dispatch-max-resends"),
		Clock: clock,
	})
	if err != nil {
		return err
	}
	b.sweeper, err = sweeper.New(sweeper.Config{Store: b.store, Targets: b.targets, Logger: b.log, MeterProvider: b.meters,
		PayloadRetention: cmd.Duration("payload-retention")})
	if err != nil {
		return err
	}
	if cmd.Bool("reconcile") {
		b.reconciler, err = reconciler.New(reconciler.Config{
			Store: b.store, Targets: b.targets, Connector: connector, Deliverer: b.dispatcher,
			Logger: b.log, MeterProvider: b.meters, TracerProvider: b.traces,
			MaxReplays: cmd.Int("reconcile-max-replays"), MaxLooks: cmd.Int("reconcile-max-looks"),
			ResolutionDeadline: cmd.Duration("reconcile-deadline"), Lease: cmd.Duration("reconcile-lease"),
			Clock: clock,
		})
		if err != nil {
			return err
		}
	}
	if interval := cmd.Duration("metrics-interval"); interval > 0 {
		b.ledger, err = brokermetrics.NewLedger(brokermetrics.LedgerConfig{Store: b.store, Targets: b.targets,
			MeterProvider: b.meters, Logger: b.log, Interval: interval})
		if err != nil {
			return err
		}
	}
	if b.grpcLis, err = net.Listen("tcp", cmd.String("grpc-addr")); err != nil {
		return fmt.Errorf("--grpc-addr: %w", err)
	}
	if b.httpLis, err = net.Listen("tcp", cmd.String("http-addr")); err != nil {
		return fmt.Errorf("--http-addr: %w", err)
	}
	if addr := cmd.String("webhook-addr"); addr != "" {
		webhooks := evidence.NewWebhooks(b.evidence, b.targets, int64(cmd.Int("webhook-max-body")), clock)
		if webhooks.Paths() == 0 {
			b.log.Warn("--webhook-addr is set, but no target's contract has evidence.webhook: every delivery gets 404")
		}
		if b.webhookLis, err = net.Listen("tcp", addr); err != nil {
			return fmt.Errorf("--webhook-addr: %w", err)
		}
		// The providers' side: bounded in time and size, whoever connects.
		b.webhookSrv = &http.Server{Handler: webhooks, ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 15 * time.Second,
			WriteTimeout: 15 * time.Second, IdleTimeout: time.Minute, MaxHeaderBytes: 16 << 10}
	}
	if addr := cmd.String("ui-addr"); addr != "" {
		var key []byte
		if file := cmd.String("ui-session-key-file"); file != "" {
			if key, err = os.ReadFile(file); err != nil {
				return fmt.Errorf("--ui-session-key-file: %w", err)
			}
			if key = bytes.TrimSpace(key); len(key) < 32 { // a trailing newline or not, the same key
				return errors.New("--ui-session-key-file: the secret must be at least 32 bytes, e.g. from openssl rand -base64 32")
			}
		}
		view, err := ui.New(ui.Config{Local: b.srv.Local, Targets: b.targets, Logger: b.log, Now: clock,
			SessionKey: key, SessionLifetime: cmd.Duration("ui-session-lifetime")})
		if err != nil {
			return err
		}
		if b.uiLis, err = net.Listen("tcp", addr); err != nil {
			return fmt.Errorf("--ui-addr: %w", err)
		}
		// No write timeout: a page's live updates are a long response.
		b.uiSrv = &http.Server{Handler: view, ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 15 * time.Second,
			IdleTimeout: time.Minute, MaxHeaderBytes: 16 << 10}
		b.uiURL = "http://" + b.uiLis.Addr().String()
		if sec.tls != nil { // HTTP/2 (ServeTLS offers it); browsers present no client certificate
			b.uiSrv.TLSConfig = sec.tls.Clone()
			b.uiSrv.TLSConfig.ClientAuth, b.uiSrv.TLSConfig.ClientCAs = tls.NoClientCert, nil
			b.uiURL = "https://" + b.uiLis.Addr().String()
		}
	}
	b.mux = http.NewServeMux()
	b.mux.Handle("GET /metrics", promhttp.HandlerFor(registry, promhttp.HandlerOpts{}))
	b.httpSrv = &http.Server{Handler: b.mux, ReadHeaderTimeout: 10 * time.Second}
	return nil
}

// run serves until ctx is cancelled (SIGINT or SIGTERM) or the gRPC server fails, then
// shuts down: health NOT_SERVING, the reconciler and the dispatcher stop claiming at
// once; gRPC calls and sends in progress get the grace period (sends' outcomes are
// recorded); then the notifier, the metrics endpoint and the database pool close.
func (b *broker) run(ctx context.Context) error {
	if err := b.notifier.Start(context.WithoutCancel(ctx)); err != nil {
		return err
	}
	if err := b.hub.Start(context.WithoutCancel(ctx)); err != nil {
		return err
	}
	if b.dispatch {
		if err := b.dispatcher.Start(context.WithoutCancel(ctx)); err != nil {
			return err
		}
		if err := b.sweeper.Start(context.WithoutCancel(ctx)); err != nil {
			return err
		}
	}
	if b.reconciler != nil {
		if err := b.reconciler.Start(context.WithoutCancel(ctx)); err != nil {
			return err
		}
	}
	if b.ledger != nil {
		if err := b.ledger.Start(context.WithoutCancel(ctx)); err != nil {
			return err
		}
	}
	if err := b.evidence.Start(context.WithoutCancel(ctx)); err != nil {
		return err
	}
	if err := b.health.Start(context.WithoutCancel(ctx)); err != nil {
		return err
	}
	go func() { b.grpcDone <- b.srv.GRPC.Serve(b.grpcLis) }()
	go func() {
		if err := b.httpSrv.Serve(b.httpLis); err != nil && !errors.Is(err, http.ErrServerClosed) {
			b.log.Error("metrics endpoint stopped", "error", err)
		}
	}()
	if b.webhookSrv != nil {
		go func() {
			if err := b.webhookSrv.Serve(b.webhookLis); err != nil && !errors.Is(err, http.ErrServerClosed) {
				b.log.Error("webhook listener stopped", "error", err)
			}
		}()
		b.log.Info("receiving webhooks", "addr", "http://"+b.webhookLis.Addr().String())
	}
	if b.uiSrv != nil {
		go func() {
			serve := func() error { return b.uiSrv.Serve(b.uiLis) }
			if b.uiSrv.TLSConfig != nil {
				serve = func() error { return b.uiSrv.ServeTLS(b.uiLis, "", "") } // the certificate is in TLSConfig
			}
			if err := serve(); err != nil && !errors.Is(err, http.ErrServerClosed) {
				b.log.Error("support view stopped", "error", err)
			}
		}()
		b.log.Info("support view", "addr", b.uiURL)
	}
	b.srv.SetServing()
	gogc, memoryLimit := gcpace.Describe()
	b.log.Info("serving", "grpc", b.grpcLis.Addr().String(), "metrics", "http://"+b.httpLis.Addr().String()+"/metrics",
		"gogc", gogc, "gomemlimit", memoryLimit)

	var err error
	select {
	case <-ctx.Done():
		b.log.Info("shutting down", "grace", b.grace)
	case err = <-b.grpcDone:
		err = fmt.Errorf("grpc server: %w", err)
	}
	var stopping sync.WaitGroup
	stopping.Go(func() { b.srv.Stop(b.grace) })
	stopping.Go(func() {
		// Nothing new is claimed from here. The reconciler's replays deliver through the
		// dispatcher, so the reconciler stops before the dispatcher's grace begins.
		b.dispatcher.StopClaiming()
		if b.reconciler != nil {
			b.reconciler.Stop()
		}
		b.dispatcher.Stop()
	})
	stopping.Go(b.sweeper.Stop)
	stopping.Go(func() {
		if b.webhookSrv != nil {
			// Deliveries in progress finish (their events are kept); new ones are refused,
			// and their senders deliver them again to another replica or later.
			shutdownCtx, cancel := context.WithTimeout(context.Background(), b.grace)
			_ = b.webhookSrv.Shutdown(shutdownCtx)
			cancel()
		}
		b.evidence.Stop()
	})
	stopping.Go(func() {
		if b.uiSrv != nil {
			_ = b.uiSrv.Close() // read-only pages and live updates: nothing to finish
		}
	})
	stopping.Wait()
	b.close()
	return err
}

func (b *broker) close() {
	if b.srv != nil {
		b.srv.Stop(0) // what New started, when start failed after it; after a run, stopped already
	}
	if b.httpSrv != nil {
		shutdownCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_ = b.httpSrv.Shutdown(shutdownCtx)
		cancel()
	}
	for _, l := range []net.Listener{b.grpcLis, b.httpLis, b.webhookLis, b.uiLis} {
		if l != nil {
			l.Close()
		}
	}
	if b.hub != nil {
		b.hub.Stop()
	}
	if b.notifier != nil {
		b.notifier.Stop()
	}
	if b.ledger != nil {
		b.ledger.Stop()
	}
	if b.health != nil {
		b.health.Stop() // no hurry: once srv.Stop began, health ignores it
	}
	if b.meters != nil {
		_ = b.meters.Shutdown(context.Background())
	}
	if b.traces != nil {
		shutdownCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if err := b.traces.Shutdown(shutdownCtx); err != nil {
			b.log.Warn("traces not all exported", "error", err)
		}
		cancel()
	}
	b.pool.Close()
}
