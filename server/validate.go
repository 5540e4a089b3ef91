package server

import (
	"context"
	"errors"
	"log/slog"

	"buf.build/go/protovalidate"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
)

// validateRequest checks a request against the rules in its proto. Violations become
// BadRequest field violations, which every language's gRPC client can decode.
func validateRequest(v protovalidate.Validator, msg any) error {
	m, ok := msg.(proto.Message)
	if !ok {
		return nil
	}
	err := v.Validate(m)
	var verr *protovalidate.ValidationError
	if !errors.As(err, &verr) {
		return err // nil, or a rule that failed to compile: an internal error
	}
	violations := make([]*errdetails.BadRequest_FieldViolation, 0, len(verr.Violations))
	for _, viol := range verr.Violations {
		violations = append(violations, violation(
			protovalidate.FieldPathString(viol.Proto.GetField()), viol.Proto.GetMessage(), viol.Proto.GetRuleId()))
	}
	return invalidArgument(violations...)
}

func validationUnaryInterceptor(v protovalidate.Validator, log *slog.Logger) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		if err := validateRequest(v, req); err != nil {
			return nil, toStatus(ctx, log, err)
		}
		return handler(ctx, req)
	}
}

func validationStreamInterceptor(v protovalidate.Validator, log *slog.Logger) grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		return handler(srv, &validatingStream{ServerStream: ss, v: v, log: log})
	}
}

type validatingStream struct {
	grpc.ServerStream
	v   protovalidate.Validator
	log *slog.Logger
}

func (s *validatingStream) RecvMsg(m any) error {
	if err := s.ServerStream.RecvMsg(m); err != nil {
		return err
	}
	if err := validateRequest(s.v, m); err != nil {
		return toStatus(s.Context(), s.log, err)
	}
	return nil
}
