package server

import (
	"context"
	"fmt"
	"log/slog"
	"runtime/debug"
	"sync"
	"time"

	"buf.build/go/protovalidate"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/logging"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/recovery"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc/filters"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/status"

	"github.com/opbroker/opbroker/auth"
	"github.com/opbroker/opbroker/brokermetrics"
	"github.com/opbroker/opbroker/evidence"
	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/target"
	"github.com/opbroker/opbroker/tracing"
	"github.com/opbroker/opbroker/watch"
)

// DefaultMaxPayloadBytes is the payload cap when none is configured.
const DefaultMaxPayloadBytes = 256 << 10

// streamWorkers is how many goroutines the gRPC server keeps to run calls on (its
// experimental NumStreamWorkers option). Without them every call starts a goroutine
// whose stack then grows as the handler runs, copied at each step (docs/benchmarks.md:
// a few per cent of the process's CPU under PrepareOperation); a worker mostly keeps
// its grown stack from call to call (a collection halves an idle worker's stack when it
// uses under a quarter of it, and gRPC replaces each worker after 65,536 calls). A call
// that finds no worker free gets a goroutine of its own, as without workers. A worker
// is held for a stream's whole life, so on a replica with this many long-lived streams
// open (watches) every call gets its own goroutine again: the gain is gone, nothing
// worse.
const streamWorkers = 64

// Options configure a server.
type Options struct {
	Store *store.Store
	// Targets are the recorded contracts: an operation type no target serves is
	// refused at PrepareOperation.
	Targets *target.Targets
	Logger  *slog.Logger
	// MeterProvider receives the gRPC and domain metrics.
	MeterProvider metric.MeterProvider
	// TracerProvider receives a span for each call (none when nil); a call's W3C trace
	// context is read from its metadata, and PrepareOperation keeps it with the
	// operation (package tracing).
	TracerProvider trace.TracerProvider
	// MaxPayloadBytes caps PrepareOperation's payload; 0 means DefaultMaxPayloadBytes.
	MaxPayloadBytes int
	// Now is the clock; nil means time.Now.
	Now func() time.Time
	// Hub nudges watch streams; it is started and stopped by the caller.
	Hub *watch.Hub
	// WatchHeartbeat is how often an idle watch says it is alive; 0 means
	// DefaultWatchHeartbeat.
	WatchHeartbeat time.Duration
	// Auth knows the principals. Nil runs without credentials: every caller may do
	// everything (opbroker dev only).
	Auth *auth.Authenticator
	// Limits bound principals and tenants.
	Limits Limits
	// Credentials secure the transport (TLS, optionally verifying client
	// certificates); nil serves plaintext.
	Credentials credentials.TransportCredentials
	// Reflection registers the reflection service (for grpcurl).
	Reflection bool
	// Evidence keeps and matches the events targets report (EvidenceService, and the
	// quarantine's review); it is started and stopped by the caller. Nil: the server
	// makes one over Store and Targets whose loop nobody starts (events are matched as
	// they are reported; those that wait are matched by a broker that runs the loop).
	Evidence *evidence.Matcher
}

// Server is a gRPC server with the broker's services, health and reflection.
type Server struct {
	GRPC   *grpc.Server
	Health *health.Server
	// Local calls the services from inside the process, as GRPC would serve them.
	Local   *Local
	closing chan struct{}
	once    sync.Once
}

// New builds the server. Health reports NOT_SERVING until SetServing is called. The
// server holds goroutines from New on (gRPC's stream workers), so Stop it even when it
// never served.
func New(opts Options) (*Server, error) {
	if opts.MaxPayloadBytes == 0 {
		opts.MaxPayloadBytes = DefaultMaxPayloadBytes
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.WatchHeartbeat <= 0 {
		opts.WatchHeartbeat = DefaultWatchHeartbeat
	}
	closing := make(chan struct{})
	log := opts.Logger
	if opts.Evidence == nil {
		m, err := evidence.New(evidence.Config{Store: opts.Store, Targets: opts.Targets, Logger: log, MeterProvider: opts.MeterProvider})
		if err != nil {
			return nil, err
		}
		opts.Evidence = m
	}
	validator, err := protovalidate.New()
	if err != nil {
		return nil, fmt.Errorf("server: validator: %w", err)
	}
	meter := opts.MeterProvider.Meter("github.com/opbroker/opbroker/server")
	prepares, err := meter.Int64Counter("opbroker.prepare.requests",
		metric.WithDescription("PrepareOperation calls by result: created, replayed, payload_mismatch, error"),
		metric.WithUnit("{call}"))
	if err != nil {
		return nil, fmt.Errorf("server: metrics: %w", err)
	}

	// Only the end of each call is logged, in one line (callLogger). Requests and
	// responses are never logged, so payloads and intent references stay out of logs.
	logOpts := []logging.Option{
		logging.WithLogOnEvents(logging.FinishCall),
		logging.WithErrorFields(reasonField),
		logging.WithDurationField(func(d time.Duration) logging.Fields { return logging.Fields{"duration", d} }),
	}
	logger := callLogger(log)
	onPanic := recovery.WithRecoveryHandlerContext(func(ctx context.Context, p any) error {
		log.ErrorContext(ctx, "panic in handler", "panic", p, "stack", string(debug.Stack()))
		return newStatus(codes.Internal, "internal error", ReasonInternal, nil)
	})

	admit := newAdmission(opts.Auth, validator, log, opts.Limits)
	unary := chainUnary(
		logging.UnaryServerInterceptor(logger, logOpts...),
		recovery.UnaryServerInterceptor(onPanic),
		admit.unaryInterceptor())
	stream := chainStream(
		logging.StreamServerInterceptor(logger, logOpts...),
		recovery.StreamServerInterceptor(onPanic),
		admit.streamInterceptor())
	local := newLocal(admit, unary, stream)
	if opts.TracerProvider == nil {
		opts.TracerProvider = tracenoop.NewTracerProvider()
	}
	serverOpts := []grpc.ServerOption{
		grpc.StatsHandler(otelgrpc.NewServerHandler(
			otelgrpc.WithMeterProvider(opts.MeterProvider),
			otelgrpc.WithTracerProvider(opts.TracerProvider),
			otelgrpc.WithPropagators(tracing.Propagator),
			otelgrpc.WithFilter(filters.Not(filters.HealthCheck())))),
		grpc.UnaryInterceptor(unary),
		grpc.StreamInterceptor(stream),
		grpc.ForceServerCodecV2(newRequestCodec()),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 20 * time.Second, PermitWithoutStream: true}),
		grpc.KeepaliveParams(keepalive.ServerParameters{
			Time: 30 * time.Second, Timeout: 10 * time.Second,
			MaxConnectionAge: 30 * time.Minute, MaxConnectionAgeGrace: time.Minute,
		}),
		// Room for the largest payload plus the request's other fields (labels, names).
		grpc.MaxRecvMsgSize(opts.MaxPayloadBytes + 64<<10),
		grpc.MaxConcurrentStreams(1000),
		grpc.NumStreamWorkers(streamWorkers),
	}
	if opts.Credentials != nil {
		serverOpts = append(serverOpts, grpc.Creds(opts.Credentials))
	}
	events, err := brokermetrics.NewEvents(opts.MeterProvider)
	if err != nil {
		return nil, err
	}
	// Nothing fails from here on: the gRPC server starts its stream workers.
	grpcServer := grpc.NewServer(serverOpts...)
	register := func(desc *grpc.ServiceDesc, impl any) {
		grpcServer.RegisterService(desc, impl)
		local.register(desc, impl)
	}
	register(&opbrokerv1.OperationService_ServiceDesc, &operationService{
		store:      opts.Store,
		targets:    opts.Targets,
		log:        log,
		maxPayload: opts.MaxPayloadBytes,
		now:        opts.Now,
		prepares:   prepares,
		hub:        opts.Hub,
		heartbeat:  opts.WatchHeartbeat,
		closing:    closing,
	})
	register(&opbrokerv1.AdminService_ServiceDesc, &adminService{store: opts.Store, targets: opts.Targets, log: log, events: events,
		evidence: opts.Evidence})
	register(&opbrokerv1.EvidenceService_ServiceDesc, &evidenceService{matcher: opts.Evidence, targets: opts.Targets, log: log})
	hs := health.NewServer()
	healthpb.RegisterHealthServer(grpcServer, hs)
	if opts.Reflection {
		reflection.Register(grpcServer)
	}
	s := &Server{GRPC: grpcServer, Health: hs, Local: local, closing: closing}
	s.setHealth(healthpb.HealthCheckResponse_NOT_SERVING)
	return s, nil
}

// callLogger writes the line that ends each call: its method, code, reason (for an
// error with an ErrorInfo) and duration, at the code's level (info for OK and the
// client's mistakes, warn or error otherwise); health checks and reflection (grpcurl
// opens a reflection stream for every command) at debug. With debug on, the line also
// has the peer's address and the error's message. The middleware's other fields (start
// time, method type, component) are dropped.
func callLogger(log *slog.Logger) logging.Logger {
	return logging.LoggerFunc(func(ctx context.Context, lvl logging.Level, msg string, fields ...any) {
		var service, method string
		var code, reason, duration, peer, message any
		for it := logging.Fields(fields).Iterator(); it.Next(); {
			switch k, v := it.At(); k {
			case "grpc.service":
				service, _ = v.(string)
			case "grpc.method":
				method, _ = v.(string)
			case "grpc.code":
				code = v
			case "reason":
				reason = v
			case "duration":
				duration = v
			case "peer.address":
				peer = v
			case "grpc.error":
				message = v
			}
		}
		level := slog.Level(lvl)
		fullMethod := "/" + service + "/" + method
		if public(fullMethod) {
			level = slog.LevelDebug
		}
		if !log.Enabled(ctx, level) {
			return
		}
		attrs := []any{"method", fullMethod, "code", code}
		if reason != nil {
			attrs = append(attrs, "reason", reason)
		}
		attrs = append(attrs, "duration", duration)
		if log.Enabled(ctx, slog.LevelDebug) {
			attrs = append(attrs, "peer", peer)
			if message != nil {
				attrs = append(attrs, "error", message)
			}
		}
		log.Log(ctx, level, msg, attrs...)
	})
}

// reasonField is the ErrorInfo reason of a call's error, for its log line.
func reasonField(err error) logging.Fields {
	for _, d := range status.Convert(err).Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			return logging.Fields{"reason", info.GetReason()}
		}
	}
	return nil
}

// SetServing marks every service SERVING. From then on a running DatabaseHealth turns
// them NOT_SERVING while the database does not answer.
func (s *Server) SetServing() { s.setHealth(healthpb.HealthCheckResponse_SERVING) }

// Stop drains the server: health goes NOT_SERVING at once, watch streams end with
// UNAVAILABLE (naming the revision to resume from), calls in progress get until grace to
// finish, then the rest are cut.
func (s *Server) Stop(grace time.Duration) {
	s.Health.Shutdown()
	s.once.Do(func() { close(s.closing) }) // watch streams never end on their own
	done := make(chan struct{})
	go func() {
		s.GRPC.GracefulStop()
		close(done)
	}()
	timer := time.NewTimer(grace)
	defer timer.Stop()
	select {
	case <-done:
	case <-timer.C:
		s.GRPC.Stop()
		<-done
	}
}
