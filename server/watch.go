package server

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/grpc/codes"

	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/watch"
)

// DefaultWatchHeartbeat is how often an idle watch stream says it is alive.
const DefaultWatchHeartbeat = 15 * time.Second

// eventsPerRead bounds one read of the event log while streaming.
const eventsPerRead = 500

// ReasonRevisionTooOld: the history after the requested revision is gone.
const ReasonRevisionTooOld = "REVISION_TOO_OLD"

// ReasonRevisionNotReached: the requested revision is past the operation's current one.
const ReasonRevisionNotReached = "REVISION_NOT_REACHED"

// ReasonShuttingDown: the server is stopping; resume elsewhere.
const ReasonShuttingDown = "SHUTTING_DOWN"

// A tenant-wide watch whose feed has changes held back by an older transaction reads
// again after this, doubling up to maxFeedRetry while they stay held.
const (
	minFeedRetry = 10 * time.Millisecond
	maxFeedRetry = time.Second
)

// A watch stream's goroutine lives as long as the stream, so what it holds while idle
// is what 10,000 idle watchers cost. Each handler therefore keeps its state in a
// follower on the heap and waits in follow, whose frame is small; the work of a wake
// runs in calls that return. (An idle stack must stay under a quarter of its size for
// the collector to halve it: with the work's locals in the waiting frame it did not,
// and every watcher kept 16 KB of stack. `opbench watch` prints the stack an idle stream
// keeps.)

// follower is one watch stream's state and what it does when woken.
type follower interface {
	// start sends what the stream begins with, and reports when that already completes
	// it.
	start() (done bool, err error)
	// catchUp sends what changed since the last call, and reports when the stream is
	// complete (the operation reached a terminal state).
	catchUp() (done bool, err error)
	heartbeat() error
	// shuttingDown is the status that ends the stream when the server stops.
	shuttingDown() error
	// woken fires on a change that may concern the stream; again, when set, on a
	// retry the follower asked for.
	woken() <-chan struct{}
	again() <-chan time.Time
	close()
}

// follow starts the stream, then waits for wakes and heartbeats until it ends.
func (s *operationService) follow(ctx context.Context, f follower) error {
	defer f.close()
	if done, err := f.start(); done || err != nil {
		return err
	}
	beat := time.NewTicker(s.heartbeat)
	defer beat.Stop()
	for {
		select {
		case <-ctx.Done():
			return toStatus(ctx, s.log, ctx.Err())
		case <-s.closing:
			return f.shuttingDown()
		case <-beat.C:
			if err := f.heartbeat(); err != nil {
				return err
			}
			continue
		case <-f.woken():
		case <-f.again():
		}
		if done, err := f.catchUp(); done || err != nil {
			return err
		}
	}
}

// WatchOperation streams an operation's changes. It subscribes before it reads, so no
// change is missed between the two; every message carries the full operation after the
// change; the stream ends with OK after a terminal state.
func (s *operationService) WatchOperation(req *opbrokerv1.WatchOperationRequest, stream opbrokerv1.OperationService_WatchOperationServer) error {
	tenant, id, err := parseOperationName("name", req.GetName())
	if err != nil {
		return toStatus(stream.Context(), s.log, err)
	}
	key := store.OperationKey{TenantID: tenant, ID: id}
	return s.follow(stream.Context(), &operationFollower{s: s, stream: stream, sub: s.hub.Subscribe(key),
		key: key, last: req.GetStartAfterRevision()})
}

// operationFollower follows one operation.
type operationFollower struct {
	s      *operationService
	stream opbrokerv1.OperationService_WatchOperationServer
	sub    *watch.Subscription
	key    store.OperationKey
	op     store.Operation
	last   int64
	state  store.State
}

// start sends the operation as it is, or its changes after the requested revision, or,
// when that is the current revision, a heartbeat with it: a client that resumes never
// receives again what it saw. The subscription was taken before this read, so no change
// falls between the two. A revision past the current one is refused: the operation
// never had it, so the client is not resuming this operation's history (one database
// holds every revision, so no replica can be behind another).
func (f *operationFollower) start() (bool, error) {
	ctx := f.stream.Context()
	var err error
	f.op, err = ledger(ctx, f.s.store).Get(ctx, f.key.TenantID, f.key.ID)
	if err != nil {
		return false, toStatus(ctx, f.s.log, err)
	}
	f.state = f.op.State
	switch {
	case f.last > f.op.Revision:
		return false, newStatus(codes.OutOfRange,
			fmt.Sprintf("the operation is at revision %d and has not reached revision %d; watch from its current revision, or from 0 for its current state",
				f.op.Revision, f.last),
			ReasonRevisionNotReached, map[string]string{"revision": fmt.Sprint(f.last), "currentRevision": fmt.Sprint(f.op.Revision)})
	case f.last == f.op.Revision:
		err = f.heartbeat()
	case f.last == 0:
		err = f.stream.Send(&opbrokerv1.WatchOperationResponse{Event: &opbrokerv1.WatchOperationResponse_Snapshot{Snapshot: operationFor(f.stream.Context(), f.s.targets, f.op)}})
		f.last = f.op.Revision
	default:
		f.last, f.state, err = f.s.sendChanges(f.stream, f.op, f.last, f.state)
	}
	return f.state.Terminal(), err
}

func (f *operationFollower) catchUp() (bool, error) {
	var err error
	f.last, f.state, err = f.s.sendChanges(f.stream, f.op, f.last, f.state)
	return f.state.Terminal(), err
}

func (f *operationFollower) heartbeat() error {
	return f.stream.Send(&opbrokerv1.WatchOperationResponse{Event: &opbrokerv1.WatchOperationResponse_Heartbeat_{
		Heartbeat: &opbrokerv1.WatchOperationResponse_Heartbeat{Revision: f.last}}})
}

func (f *operationFollower) shuttingDown() error {
	return newStatus(codes.Unavailable, fmt.Sprintf("the server is shutting down; resume with start_after_revision %d", f.last),
		ReasonShuttingDown, map[string]string{"revision": fmt.Sprint(f.last)})
}

func (f *operationFollower) woken() <-chan struct{}  { return f.sub.C }
func (f *operationFollower) again() <-chan time.Time { return nil }
func (f *operationFollower) close()                  { f.sub.Close() }

// sendChanges sends every event of op after revision last, as the operation after each
// change, and returns the last revision sent with its state (state, unchanged, when
// nothing was sent). History that is gone is an error that tells the client to re-read.
func (s *operationService) sendChanges(stream opbrokerv1.OperationService_WatchOperationServer, op store.Operation, last int64, state store.State) (int64, store.State, error) {
	ctx := stream.Context()
	for {
		events, err := ledger(ctx, s.store).Events(ctx, op.TenantID, op.ID, last, eventsPerRead)
		if err != nil {
			return last, state, toStatus(ctx, s.log, err)
		}
		if len(events) > 0 && events[0].Revision != last+1 {
			return last, state, newStatus(codes.OutOfRange,
				fmt.Sprintf("the history after revision %d is no longer kept; read the operation with GetOperation and watch from its revision", last),
				ReasonRevisionTooOld, map[string]string{"revision": fmt.Sprint(last)})
		}
		for _, e := range events {
			if err := stream.Send(&opbrokerv1.WatchOperationResponse{Event: &opbrokerv1.WatchOperationResponse_Change{Change: operationFor(stream.Context(), s.targets, e.Apply(op))}}); err != nil {
				return last, state, err
			}
			last, state = e.Revision, e.State
		}
		if len(events) < eventsPerRead {
			return last, state, nil
		}
	}
}

// WatchOperations streams a tenant's feed: each change once, each operation's in
// revision order, every message with the token to resume after it.
func (s *operationService) WatchOperations(req *opbrokerv1.WatchOperationsRequest, stream opbrokerv1.OperationService_WatchOperationsServer) error {
	states := statesFromProto(req.GetStates())
	return s.follow(stream.Context(), &tenantFollower{s: s, stream: stream, sub: s.hub.SubscribeAll(),
		scope: newScope(req.GetTenant(), states), resumeToken: req.GetResumeToken(),
		params: store.FeedParams{TenantID: req.GetTenant(), States: states, Limit: eventsPerRead}, backoff: minFeedRetry})
}

// tenantFollower follows a tenant's feed.
type tenantFollower struct {
	s           *operationService
	stream      opbrokerv1.OperationService_WatchOperationsServer
	sub         *watch.Subscription
	scope       tokenScope
	resumeToken string // where the stream starts; empty: the feed's head
	params      store.FeedParams
	cursor      store.FeedCursor
	// retry is set while committed changes are held back by an older transaction.
	retry   <-chan time.Time
	backoff time.Duration
}

// start places the feed at its head or the resume token, says so with a heartbeat
// carrying the start token, and sends what is already there.
func (f *tenantFollower) start() (bool, error) {
	ctx := f.stream.Context()
	var err error
	if f.resumeToken == "" {
		f.cursor, err = ledger(ctx, f.s.store).FeedHead(ctx)
	} else {
		f.cursor, err = decodeResumeToken(f.resumeToken, f.scope)
	}
	if err != nil {
		return false, toStatus(ctx, f.s.log, err)
	}
	if err := f.heartbeat(); err != nil {
		return false, err
	}
	return f.catchUp()
}

// catchUp sends the feed from the cursor to its end (a tenant's feed never completes).
func (f *tenantFollower) catchUp() (bool, error) {
	ctx := f.stream.Context()
	for {
		batch, err := ledger(ctx, f.s.store).ReadFeed(ctx, f.params, f.cursor)
		if err != nil {
			return false, toStatus(ctx, f.s.log, err)
		}
		for _, e := range batch.Events {
			if err := f.stream.Send(&opbrokerv1.WatchOperationsResponse{
				Event:       &opbrokerv1.WatchOperationsResponse_Change{Change: operationFor(f.stream.Context(), f.s.targets, e.Operation)},
				ResumeToken: encodeResumeToken(f.scope, e.Cursor)}); err != nil {
				return false, err
			}
		}
		f.cursor = batch.Cursor
		if batch.More {
			continue
		}
		f.retry = nil
		if batch.Pending {
			f.retry, f.backoff = time.After(f.backoff), min(2*f.backoff, maxFeedRetry)
		} else {
			f.backoff = minFeedRetry
		}
		return false, nil
	}
}

func (f *tenantFollower) heartbeat() error {
	return f.stream.Send(&opbrokerv1.WatchOperationsResponse{
		Event:       &opbrokerv1.WatchOperationsResponse_Heartbeat_{Heartbeat: &opbrokerv1.WatchOperationsResponse_Heartbeat{}},
		ResumeToken: encodeResumeToken(f.scope, f.cursor)})
}

func (f *tenantFollower) shuttingDown() error {
	return newStatus(codes.Unavailable, "the server is shutting down; resume with the last resume_token",
		ReasonShuttingDown, map[string]string{"resumeToken": encodeResumeToken(f.scope, f.cursor)})
}

func (f *tenantFollower) woken() <-chan struct{}  { return f.sub.C }
func (f *tenantFollower) again() <-chan time.Time { return f.retry }
func (f *tenantFollower) close()                  { f.sub.Close() }
