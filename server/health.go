package server

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"time"

	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/startstop"
	"github.com/opbroker/opbroker/store"
)

// Defaults of DatabaseHealthConfig.
const (
	// DefaultHealthInterval is how often the database is pinged, and how long a ping
	// may take.
	DefaultHealthInterval = time.Second
	// DefaultDatabaseDownAfter is how long the database must fail every ping before
	// health turns NOT_SERVING: long enough that one slow ping or a failover's blip does
	// not take the replica out of its load balancer.
	DefaultDatabaseDownAfter = 3 * time.Second
)

// healthServices are the names health reports on: the server as a whole ("") and the
// API.
var healthServices = []string{"", opbrokerv1.OperationService_ServiceDesc.ServiceName}

// setHealth reports status for every service. After Health.Shutdown it does nothing.
func (s *Server) setHealth(status healthpb.HealthCheckResponse_ServingStatus) {
	for _, name := range healthServices {
		s.Health.SetServingStatus(name, status)
	}
}

// DatabaseHealthConfig configures a DatabaseHealth. Zero values take the defaults
// noted.
type DatabaseHealthConfig struct {
	// Server is the server whose health it sets.
	Server *Server
	// Store reaches the ledger's database.
	Store  *store.Store
	Logger *slog.Logger
	// Interval between pings (DefaultHealthInterval); a ping is abandoned after it.
	Interval time.Duration
	// DownAfter is how long every ping must fail before health turns NOT_SERVING
	// (DefaultDatabaseDownAfter).
	DownAfter time.Duration
	// RequireSynchronousReplication makes each ping also check that commits wait for a
	// standby (store.CheckSynchronousReplication); health turns NOT_SERVING at the first
	// ping that finds they do not, without waiting DownAfter.
	RequireSynchronousReplication bool
	// Now is the clock; nil means time.Now.
	Now func() time.Time
}

// DatabaseHealth makes the server's health say whether it can reach its database: it
// pings the database every Interval, turns health NOT_SERVING once every ping has
// failed for DownAfter (at once when synchronous replication is required and missing),
// and SERVING again at the first ping that succeeds. It only
// undoes what it did: it never turns SERVING a server that it did not turn NOT_SERVING
// (one that SetServing has not yet made SERVING), and after Server.Stop began
// (health's Shutdown) nothing changes health any more. Start and Stop follow package
// startstop.
type DatabaseHealth struct {
	startstop.Base
	cfg DatabaseHealthConfig
	log *slog.Logger

	mu           sync.Mutex
	failingSince time.Time // when the first failed ping since the last success began; zero after one
	down         bool      // whether it turned health NOT_SERVING
}

// NewDatabaseHealth returns a stopped DatabaseHealth.
func NewDatabaseHealth(cfg DatabaseHealthConfig) *DatabaseHealth {
	if cfg.Interval <= 0 {
		cfg.Interval = DefaultHealthInterval
	}
	if cfg.DownAfter <= 0 {
		cfg.DownAfter = DefaultDatabaseDownAfter
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &DatabaseHealth{cfg: cfg, log: cfg.Logger.With("component", "health")}
}

// Start pings the database at once and then every Interval until Stop, and returns at
// once.
func (h *DatabaseHealth) Start(ctx context.Context) error {
	h.Base.Start(ctx, func(ctx context.Context) {
		ticker := time.NewTicker(h.cfg.Interval)
		defer ticker.Stop()
		for {
			if err := h.Check(ctx); err != nil && ctx.Err() == nil {
				h.log.Debug("the database did not answer a ping", "error", err)
			}
			select {
			case <-ctx.Done():
				return
			case <-ticker.C:
			}
		}
	})
	return nil
}

// Check pings the database once and sets health from what it found and what the
// pings before it found; it returns the ping's error. Start's loop calls it; tests call
// it directly. A ping cut short because ctx ended says nothing of the database and
// changes nothing.
func (h *DatabaseHealth) Check(ctx context.Context) error {
	began := h.cfg.Now()
	pingCtx, cancel := context.WithTimeout(ctx, h.cfg.Interval)
	ping := h.cfg.Store.Ping
	if h.cfg.RequireSynchronousReplication {
		ping = h.cfg.Store.CheckSynchronousReplication
	}
	err := ping(pingCtx)
	cancel()
	if err != nil && ctx.Err() != nil {
		return err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if err == nil {
		h.failingSince = time.Time{}
		if h.down {
			h.down = false
			h.cfg.Server.setHealth(healthpb.HealthCheckResponse_SERVING)
			h.log.Info("the database answers again: health is SERVING")
		}
		return nil
	}
	if h.failingSince.IsZero() {
		h.failingSince = began
	}
	switch failing := h.cfg.Now().Sub(h.failingSince); {
	case h.down:
	case errors.Is(err, store.ErrNotReplicated):
		h.down = true
		h.cfg.Server.setHealth(healthpb.HealthCheckResponse_NOT_SERVING)
		h.log.Warn("synchronous replication is required and missing: health is NOT_SERVING until commits wait for a standby", "error", err)
	case failing >= h.cfg.DownAfter:
		h.down = true
		h.cfg.Server.setHealth(healthpb.HealthCheckResponse_NOT_SERVING)
		h.log.Warn("the database does not answer: health is NOT_SERVING until it does", "unreachable_for", failing, "error", err)
	}
	return err
}
