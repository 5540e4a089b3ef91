package target

import (
	"context"
	"net"
	"net/http/httptrace"
	"sync"
	"time"
)

// sentConn tells when a request has really left. net/http reports WroteRequest while
// a small request may still sit in the connection's buffer, and flushes it afterwards;
// a large body is written straight to the socket before the report. So the hook runs on
// the first socket write after the report, or shortly after the report when no write
// follows (the request had already gone out). It runs at most once per request.
type sentConn struct {
	net.Conn
	mu    sync.Mutex
	hook  func() // set for the request using the connection (one at a time in HTTP/1.1)
	wrote bool   // the transport has produced the whole request
	gen   uint64 // which request the hook belongs to
}

// flushGrace is how long after WroteRequest a final flush is waited for.
const flushGrace = 20 * time.Millisecond

func (c *sentConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	if err == nil {
		c.mu.Lock()
		gen := c.gen
		c.mu.Unlock()
		c.fire(gen, true)
	}
	return n, err
}

// fire runs request gen's hook once, if the request has been produced.
func (c *sentConn) fire(gen uint64, requireWrote bool) {
	c.mu.Lock()
	var hook func()
	if c.gen == gen && c.hook != nil && (c.wrote || !requireWrote) {
		hook, c.hook = c.hook, nil
	}
	c.mu.Unlock()
	if hook != nil {
		hook()
	}
}

func withSentHook(ctx context.Context, hook func()) context.Context {
	var conn *sentConn
	return httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
		GotConn: func(info httptrace.GotConnInfo) {
			if c, ok := info.Conn.(*sentConn); ok {
				c.mu.Lock()
				c.gen++
				c.hook, c.wrote = hook, false
				c.mu.Unlock()
				conn = c
			}
		},
		WroteRequest: func(info httptrace.WroteRequestInfo) {
			if conn == nil || info.Err != nil {
				return
			}
			conn.mu.Lock()
			conn.wrote = true
			gen := conn.gen
			conn.mu.Unlock()
			time.AfterFunc(flushGrace, func() { conn.fire(gen, false) })
		},
	})
}
