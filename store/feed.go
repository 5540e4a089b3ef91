package store

import (
	"cmp"
	"context"
	"fmt"
	"slices"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// A tenant's feed is every event of its operations, read in the order (transaction id,
// sequence) and only below the horizon: the oldest transaction still running when the
// read began (pg_snapshot_xmin). Every transaction below it has committed or aborted, so
// the feed up to the horizon can never grow behind a reader's back, and a reader that
// remembers its last position skips nothing, whatever order concurrent writers commit in.
//
// Transaction ids are taken when a transaction first writes, not when it commits, so
// two changes of one operation (serialised by its row lock) may carry ids in the other
// order. ReadFeed keeps each operation's changes in revision order by sending the earlier
// ones first, ahead of their place, and remembers them in the cursor so that they are
// never sent twice.

// FeedPosition is an event's place in its tenant's feed.
type FeedPosition struct {
	Xact int64 // the writing transaction's id (xid8)
	Seq  int64 // the order of writing
}

func (p FeedPosition) compare(q FeedPosition) int {
	return cmp.Or(cmp.Compare(p.Xact, q.Xact), cmp.Compare(p.Seq, q.Seq))
}

// FeedCursor is how far a reader has read a tenant's feed: every event at or before
// After, and the events in Ahead, all after After, that were read ahead of their place.
type FeedCursor struct {
	After FeedPosition
	Ahead []FeedPosition
}

// read reports whether the event at p was read.
func (c FeedCursor) read(p FeedPosition) bool {
	return p.compare(c.After) <= 0 || slices.Contains(c.Ahead, p)
}

// advance returns the cursor moved to p (when p is later), without the events of Ahead
// it has passed.
func (c FeedCursor) advance(p FeedPosition) FeedCursor {
	if p.compare(c.After) <= 0 {
		return c
	}
	ahead := slices.DeleteFunc(slices.Clone(c.Ahead), func(a FeedPosition) bool { return a.compare(p) <= 0 })
	return FeedCursor{After: p, Ahead: ahead}
}

// readAhead returns the cursor with the event at p read ahead of its place.
func (c FeedCursor) readAhead(p FeedPosition) FeedCursor {
	return FeedCursor{After: c.After, Ahead: append(slices.Clone(c.Ahead), p)}
}

// FeedEvent is one change as the feed carries it.
type FeedEvent struct {
	Event
	// Operation is the operation as it was after the change.
	Operation Operation
	// Cursor is the reader's cursor once this event is read: resume from it.
	Cursor FeedCursor
}

// FeedParams selects a tenant's feed.
type FeedParams struct {
	TenantID string
	States   []State // only changes into these states; empty: every change
	Limit    int     // events per read, at most
}

// FeedBatch is the result of one read of a feed.
type FeedBatch struct {
	Events []FeedEvent
	// Cursor is where the next read starts. It may be past the last event: a read that
	// found everything below the horizon moves the cursor to the horizon.
	Cursor FeedCursor
	// More means the read stopped at its limit: read again now.
	More bool
	// Pending means events are committed beyond the horizon, held back by an older
	// transaction that is still running: read again soon, a notification may not come.
	Pending bool
}

// FeedHead returns a cursor at the end of every tenant's feed as of now: a reader from
// it gets the changes that commit from now on (and perhaps a few just before).
func (q Scope) FeedHead(ctx context.Context) (FeedCursor, error) {
	var xact int64
	if err := q.s.pool.QueryRow(ctx, `SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint`).Scan(&xact); err != nil {
		return FeedCursor{}, fmt.Errorf("store: feed head: %w", translate(err))
	}
	return FeedCursor{After: FeedPosition{Xact: xact}}, nil
}

// feedSelect reads feed events, their positions and their operations from the rows of
// operation_events e chosen by where; like eventsFrom's arguments, where is a constant
// of this package. $1 is the tenant and $2 the state filter.
func feedSelect(where string) string {
	return `SELECT e.xact_id::text::bigint, e.seq, ` + eventColumns + `,
			EXISTS (SELECT 1 FROM operation_events p
				WHERE p.tenant_id = e.tenant_id AND p.operation_id = e.operation_id AND p.revision < e.revision
				  AND (p.xact_id, p.seq) > (e.xact_id, e.seq)
				  AND (cardinality($2::text[]) = 0 OR p.to_state = ANY ($2::text[]::operation_state[]))),
			o.*
		FROM operation_events e
		JOIN LATERAL (SELECT ` + operationColumns + ` FROM operations
			WHERE tenant_id = e.tenant_id AND operation_id = e.operation_id) o ON true
		WHERE e.tenant_id = $1
		  AND (cardinality($2::text[]) = 0 OR e.to_state = ANY ($2::text[]::operation_state[]))
		  AND ` + where
}

// feedRow is one row of feedSelect.
type feedRow struct {
	event FeedEvent
	at    FeedPosition
	// inverted: an earlier change of the operation has a later position.
	inverted bool
}

func collectFeed(rows pgx.Rows) ([]feedRow, error) {
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (feedRow, error) {
		var r feedRow
		var op Operation
		dest := append([]any{&r.at.Xact, &r.at.Seq}, eventDest(&r.event.Event)...)
		dest = append(dest, &r.inverted)
		err := row.Scan(append(dest, operationDest(&op)...)...)
		r.event.Operation = r.event.Event.Apply(op)
		return r, err
	})
}

// ReadFeed reads a tenant's feed after cursor: every change once, each operation's
// changes in revision order, each with the cursor to resume from after it. It reads one
// snapshot of the ledger.
func (q Scope) ReadFeed(ctx context.Context, p FeedParams, cursor FeedCursor) (FeedBatch, error) {
	var batch FeedBatch
	err := q.inTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly},
		func(tx pgx.Tx) (err error) {
			batch, err = readFeed(ctx, tx, p, cursor)
			return err
		})
	if err != nil {
		return FeedBatch{}, fmt.Errorf("store: read feed: %w", translate(err))
	}
	return batch, nil
}

func readFeed(ctx context.Context, tx pgx.Tx, p FeedParams, cursor FeedCursor) (FeedBatch, error) {
	states := stateNames(p.States)
	after := cursor.After
	var horizon int64
	var pending bool
	// The horizon of this transaction's snapshot, which every statement below shares.
	err := tx.QueryRow(ctx, `SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint,
			EXISTS (SELECT 1 FROM operation_events e
				WHERE e.tenant_id = $1 AND e.xact_id >= pg_snapshot_xmin(pg_current_snapshot())
				  AND (e.xact_id, e.seq) > ($3::bigint::text::xid8, $4)
				  AND (cardinality($2::text[]) = 0 OR e.to_state = ANY ($2::text[]::operation_state[])))`,
		p.TenantID, states, after.Xact, after.Seq).Scan(&horizon, &pending)
	if err != nil {
		return FeedBatch{}, err
	}
	rows, _ := tx.Query(ctx, feedSelect(`(e.xact_id, e.seq) > ($3::bigint::text::xid8, $4)
		  AND e.xact_id < pg_snapshot_xmin(pg_current_snapshot())
		ORDER BY e.xact_id, e.seq LIMIT $5`), p.TenantID, states, after.Xact, after.Seq, p.Limit)
	page, err := collectFeed(rows)
	if err != nil {
		return FeedBatch{}, err
	}

	batch := FeedBatch{More: len(page) == p.Limit, Pending: pending}
	for _, r := range page {
		if cursor.read(r.at) { // sent ahead of its place
			cursor = cursor.advance(r.at)
			continue
		}
		if r.inverted {
			earlier, err := earlierChanges(ctx, tx, p.TenantID, states, r.event.ID, r.event.Revision, cursor)
			if err != nil {
				return FeedBatch{}, err
			}
			for _, e := range earlier {
				cursor = cursor.readAhead(e.at)
				e.event.Cursor = cursor
				batch.Events = append(batch.Events, e.event)
			}
		}
		cursor = cursor.advance(r.at)
		r.event.Cursor = cursor
		batch.Events = append(batch.Events, r.event)
	}
	if !batch.More {
		// Everything below the horizon was read.
		cursor = cursor.advance(FeedPosition{Xact: horizon})
	}
	batch.Cursor = cursor
	return batch, nil
}

// earlierChanges returns the changes of an operation before a revision that the cursor
// has not read, in revision order.
func earlierChanges(ctx context.Context, tx pgx.Tx, tenantID string, states []string, id uuid.UUID, revision int64, cursor FeedCursor) ([]feedRow, error) {
	rows, _ := tx.Query(ctx, feedSelect(`e.operation_id = $3 AND e.revision < $4
		  AND (e.xact_id, e.seq) > ($5::bigint::text::xid8, $6)
		ORDER BY e.revision`), tenantID, states, id, revision, cursor.After.Xact, cursor.After.Seq)
	earlier, err := collectFeed(rows)
	return slices.DeleteFunc(earlier, func(r feedRow) bool { return cursor.read(r.at) }), err
}
