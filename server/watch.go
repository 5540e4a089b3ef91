package server

import (
	"fmt"
	"time"

	"google.golang.org/grpc/codes"

	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/store"
)

// DefaultWatchHeartbeat is how often an idle watch stream says it is alive.
const DefaultWatchHeartbeat = 15 * time.Second

// eventsPerRead bounds one read of the event log while streaming.
const eventsPerRead = 500

// ReasonRevisionTooOld: the history after the requested revision is gone.
const ReasonRevisionTooOld = "REVISION_TOO_OLD"

// ReasonShuttingDown: the server is stopping; resume elsewhere.
const ReasonShuttingDown = "SHUTTING_DOWN"

// A tenant-wide watch whose feed has changes held back by an older transaction reads
// again after this, doubling up to maxFeedRetry while they stay held.
const (
	minFeedRetry = 10 * time.Millisecond
	maxFeedRetry = time.Second
)

// WatchOperation streams an operation's changes. It subscribes before it reads, so no
// change is missed between the two; every message carries the full operation after the
// change; the stream ends with OK after a terminal state.
func (s *operationService) WatchOperation(req *opbrokerv1.WatchOperationRequest, stream opbrokerv1.OperationService_WatchOperationServer) error {
	ctx := stream.Context()
	tenant, id, err := parseOperationName("name", req.GetName())
	if err != nil {
		return toStatus(ctx, s.log, err)
	}
	sub := s.hub.Subscribe(store.OperationKey{TenantID: tenant, ID: id})
	defer sub.Close()
	op, err := s.store.Get(ctx, tenant, id)
	if err != nil {
		return toStatus(ctx, s.log, err)
	}

	last, state := req.GetStartAfterRevision(), op.State
	if last == 0 || last >= op.Revision {
		if err := stream.Send(&opbrokerv1.WatchOperationResponse{Event: &opbrokerv1.WatchOperationResponse_Snapshot{Snapshot: operationToProto(op)}}); err != nil {
			return err
		}
		last = op.Revision
	} else if last, state, err = s.sendChanges(stream, op, last, state); err != nil {
		return err
	}
	if state.Terminal() {
		return nil
	}

	heartbeat := time.NewTicker(s.heartbeat)
	defer heartbeat.Stop()
	for {
		select {
		case <-ctx.Done():
			return toStatus(ctx, s.log, ctx.Err())
		case <-s.closing:
			return newStatus(codes.Unavailable, fmt.Sprintf("the server is shutting down; resume with start_after_revision %d", last),
				ReasonShuttingDown, map[string]string{"revision": fmt.Sprint(last)})
		case <-heartbeat.C:
			if err := stream.Send(&opbrokerv1.WatchOperationResponse{Event: &opbrokerv1.WatchOperationResponse_Heartbeat_{
				Heartbeat: &opbrokerv1.WatchOperationResponse_Heartbeat{Revision: last}}}); err != nil {
				return err
			}
		case <-sub.C:
			if last, state, err = s.sendChanges(stream, op, last, state); err != nil {
				return err
			}
			if state.Terminal() {
				return nil
			}
		}
	}
}

// sendChanges sends every event of op after revision last, as the operation after each
// change, and returns the last revision sent with its state (state, unchanged, when
// nothing was sent). History that is gone is an error that tells the client to re-read.
func (s *operationService) sendChanges(stream opbrokerv1.OperationService_WatchOperationServer, op store.Operation, last int64, state store.State) (int64, store.State, error) {
	ctx := stream.Context()
	for {
		events, err := s.store.Events(ctx, op.TenantID, op.ID, last, eventsPerRead)
		if err != nil {
			return last, state, toStatus(ctx, s.log, err)
		}
		if len(events) > 0 && events[0].Revision != last+1 {
			return last, state, newStatus(codes.OutOfRange,
				fmt.Sprintf("the history after revision %d is no longer kept; read the operation with GetOperation and watch from its revision", last),
				ReasonRevisionTooOld, map[string]string{"revision": fmt.Sprint(last)})
		}
		for _, e := range events {
			if err := stream.Send(&opbrokerv1.WatchOperationResponse{Event: &opbrokerv1.WatchOperationResponse_Change{Change: operationToProto(e.Apply(op))}}); err != nil {
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
	ctx := stream.Context()
	states := statesFromProto(req.GetStates())
	scope := newScope(req.GetTenant(), states)
	sub := s.hub.SubscribeAll()
	defer sub.Close()
	var cursor store.FeedCursor
	var err error
	if req.GetResumeToken() == "" {
		cursor, err = s.store.FeedHead(ctx)
	} else {
		cursor, err = decodeResumeToken(req.GetResumeToken(), scope)
	}
	if err != nil {
		return toStatus(ctx, s.log, err)
	}
	heartbeat := func() error {
		return stream.Send(&opbrokerv1.WatchOperationsResponse{
			Event:       &opbrokerv1.WatchOperationsResponse_Heartbeat_{Heartbeat: &opbrokerv1.WatchOperationsResponse_Heartbeat{}},
			ResumeToken: encodeResumeToken(scope, cursor)})
	}
	if err := heartbeat(); err != nil {
		return err
	}

	beat := time.NewTicker(s.heartbeat)
	defer beat.Stop()
	params := store.FeedParams{TenantID: req.GetTenant(), States: states, Limit: eventsPerRead}
	retry := minFeedRetry
	for {
		batch, err := s.store.ReadFeed(ctx, params, cursor)
		if err != nil {
			return toStatus(ctx, s.log, err)
		}
		for _, e := range batch.Events {
			if err := stream.Send(&opbrokerv1.WatchOperationsResponse{
				Event:       &opbrokerv1.WatchOperationsResponse_Change{Change: operationToProto(e.Operation)},
				ResumeToken: encodeResumeToken(scope, e.Cursor)}); err != nil {
				return err
			}
		}
		cursor = batch.Cursor
		if batch.More {
			continue
		}
		var again <-chan time.Time
		if batch.Pending {
			again, retry = time.After(retry), min(2*retry, maxFeedRetry)
		} else {
			retry = minFeedRetry
		}
	wait:
		for {
			select {
			case <-ctx.Done():
				return toStatus(ctx, s.log, ctx.Err())
			case <-s.closing:
				token := encodeResumeToken(scope, cursor)
				return newStatus(codes.Unavailable, "the server is shutting down; resume with the last resume_token",
					ReasonShuttingDown, map[string]string{"resumeToken": token})
			case <-beat.C:
				if err := heartbeat(); err != nil {
					return err
				}
			case <-sub.C:
				break wait
			case <-again:
				break wait
			}
		}
	}
}
