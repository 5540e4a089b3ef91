package server

import (
	"errors"

	"buf.build/go/protovalidate"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
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
