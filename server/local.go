package server

import (
	"context"
	"io"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/opbroker/opbroker/auth"
)

// Local is a connection to the broker's services from inside the process (the support
// view): the generated clients work on it, and each call passes through the same
// interceptors as one over the network: the call's log line, recovery, and admission
// (the bearer token of the call's metadata authenticated, the role checked, the
// request validated, the tenant authorised and rate-limited). The services, the
// interceptors and their order are the gRPC server's own, so nothing a remote caller
// may not do can be done through it.
//
// grpchan's in-process channel does this generically, but it brings the deprecated
// github.com/golang/protobuf and protoreflect's v1 into the binary; the broker needs
// unary calls and server streams, which the generated service descriptions serve.
type Local struct {
	unary   map[string]grpc.MethodDesc // by full method name
	streams map[string]grpc.StreamDesc
	impl    map[string]any // the service implementation, by service name
	unaryI  grpc.UnaryServerInterceptor
	streamI grpc.StreamServerInterceptor
	admit   *admission
}

var _ grpc.ClientConnInterface = (*Local)(nil)

func newLocal(a *admission, unary grpc.UnaryServerInterceptor, stream grpc.StreamServerInterceptor) *Local {
	return &Local{unary: map[string]grpc.MethodDesc{}, streams: map[string]grpc.StreamDesc{}, impl: map[string]any{},
		unaryI: unary, streamI: stream, admit: a}
}

// register adds a service that is registered on the gRPC server too.
func (l *Local) register(desc *grpc.ServiceDesc, impl any) {
	l.impl[desc.ServiceName] = impl
	for _, m := range desc.Methods {
		l.unary["/"+desc.ServiceName+"/"+m.MethodName] = m
	}
	for _, s := range desc.Streams {
		l.streams["/"+desc.ServiceName+"/"+s.StreamName] = s
	}
}

// Principal returns who token is, or fails UNAUTHENTICATED as a call with it would.
func (l *Local) Principal(ctx context.Context, token string) (*auth.Principal, error) {
	ctx, err := l.admit.authenticate(metadata.NewIncomingContext(ctx, metadata.Pairs("authorization", "Bearer "+token)))
	if err != nil {
		return nil, err
	}
	return auth.FromContext(ctx), nil
}

// Invoke calls a unary method; the server sees the outgoing metadata of ctx as the
// call's.
func (l *Local) Invoke(ctx context.Context, method string, args, reply any, _ ...grpc.CallOption) error {
	m, ok := l.unary[method]
	if !ok {
		return status.Errorf(codes.Unimplemented, "unknown method %s", method)
	}
	dec := func(into any) error {
		proto.Merge(into.(proto.Message), args.(proto.Message))
		return nil
	}
	ctx, cancel := context.WithCancel(ctx) // as gRPC ends a unary call's context when it returns
	defer cancel()
	out, err := m.Handler(l.impl[serviceOf(method)], serverContext(ctx), dec, l.unaryI)
	if err != nil {
		return err
	}
	proto.Merge(reply.(proto.Message), out.(proto.Message))
	return nil
}

// NewStream opens a server stream (the only kind the broker serves) whose handler runs
// on a goroutine of its own until it returns or ctx ends.
func (l *Local) NewStream(ctx context.Context, _ *grpc.StreamDesc, method string, _ ...grpc.CallOption) (grpc.ClientStream, error) {
	s, ok := l.streams[method]
	if !ok || !s.ServerStreams || s.ClientStreams {
		return nil, status.Errorf(codes.Unimplemented, "unknown server stream %s", method)
	}
	ctx, cancel := context.WithCancel(ctx)
	cs := &localClientStream{ctx: ctx, cancel: cancel, req: make(chan proto.Message, 1), msgs: make(chan proto.Message),
		done: make(chan struct{})}
	go func() {
		defer close(cs.done)
		ss := &localServerStream{ctx: serverContext(ctx), cs: cs}
		cs.err = l.streamI(l.impl[serviceOf(method)], ss, &grpc.StreamServerInfo{FullMethod: method, IsServerStream: true}, s.Handler)
	}()
	return cs, nil
}

func serviceOf(method string) string {
	service, _, _ := strings.Cut(strings.TrimPrefix(method, "/"), "/")
	return service
}

// serverContext is ctx as the server sees the call: its outgoing metadata incoming,
// and none outgoing (a handler's own calls must not pass the caller's token on).
func serverContext(ctx context.Context) context.Context {
	md, _ := metadata.FromOutgoingContext(ctx)
	return metadata.NewOutgoingContext(metadata.NewIncomingContext(ctx, md), metadata.MD{})
}

// localClientStream is the caller's side of a Local stream.
type localClientStream struct {
	ctx    context.Context
	cancel context.CancelFunc
	req    chan proto.Message // the one request
	msgs   chan proto.Message // what the handler sends
	done   chan struct{}      // closed when the handler returned, with err
	err    error
}

func (c *localClientStream) Header() (metadata.MD, error) { return nil, nil }
func (c *localClientStream) Trailer() metadata.MD         { return nil }
func (c *localClientStream) CloseSend() error             { return nil }
func (c *localClientStream) Context() context.Context     { return c.ctx }

func (c *localClientStream) SendMsg(m any) error {
	select {
	case c.req <- proto.Clone(m.(proto.Message)):
		return nil
	default:
		return status.Error(codes.Internal, "a server stream takes one request")
	}
}

func (c *localClientStream) RecvMsg(m any) error {
	select {
	case msg := <-c.msgs:
		proto.Merge(m.(proto.Message), msg)
		return nil
	case <-c.done:
		c.cancel()
		if c.err != nil {
			return c.err
		}
		return io.EOF
	case <-c.ctx.Done():
		return status.FromContextError(c.ctx.Err()).Err()
	}
}

// localServerStream is the handler's side of a Local stream.
type localServerStream struct {
	ctx      context.Context
	cs       *localClientStream
	received bool
}

func (s *localServerStream) Context() context.Context     { return s.ctx }
func (s *localServerStream) SetHeader(metadata.MD) error  { return nil }
func (s *localServerStream) SendHeader(metadata.MD) error { return nil }
func (s *localServerStream) SetTrailer(metadata.MD)       {}

func (s *localServerStream) SendMsg(m any) error {
	select {
	case s.cs.msgs <- proto.Clone(m.(proto.Message)):
		return nil
	case <-s.ctx.Done():
		return status.FromContextError(s.ctx.Err()).Err()
	}
}

func (s *localServerStream) RecvMsg(m any) error {
	if s.received {
		return io.EOF
	}
	select {
	case req := <-s.cs.req:
		s.received = true
		proto.Merge(m.(proto.Message), req)
		return nil
	case <-s.ctx.Done():
		return status.FromContextError(s.ctx.Err()).Err()
	}
}

// chainUnary makes one interceptor of ics, the first outermost, as
// grpc.ChainUnaryInterceptor does on the server.
func chainUnary(ics ...grpc.UnaryServerInterceptor) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		for i := len(ics) - 1; i >= 0; i-- {
			ic, next := ics[i], handler
			handler = func(ctx context.Context, req any) (any, error) { return ic(ctx, req, info, next) }
		}
		return handler(ctx, req)
	}
}

// chainStream is chainUnary for streams.
func chainStream(ics ...grpc.StreamServerInterceptor) grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		for i := len(ics) - 1; i >= 0; i-- {
			ic, next := ics[i], handler
			handler = func(srv any, ss grpc.ServerStream) error { return ic(srv, ss, info, next) }
		}
		return handler(srv, ss)
	}
}
