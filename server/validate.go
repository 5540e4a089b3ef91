package server

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"unicode/utf8"

	"buf.build/go/protovalidate"
	"google.golang.org/genproto/googleapis/api/annotations"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/payload"
	"github.com/opbroker/opbroker/target"
)

// validateRequest checks a request against the rules in its proto. Each violation
// becomes a BadRequest field violation that says in words what the field must be:
// "is required" for a required field left empty, otherwise the field's rule as ruleWords
// states it, with a stable reason.
//
// Any text holding the NUL character is refused too, whatever the field: PostgreSQL
// stores it in no text and no JSON, so it would fail in the ledger as an internal error.
func validateRequest(v protovalidate.Validator, msg any) error {
	m, ok := msg.(proto.Message)
	if !ok {
		return nil
	}
	var violations []*errdetails.BadRequest_FieldViolation
	err := v.Validate(m)
	var verr *protovalidate.ValidationError
	switch {
	case errors.As(err, &verr):
		for _, viol := range verr.Violations {
			violations = append(violations, describe(viol))
		}
	case err != nil:
		return err // a rule that failed to compile: an internal error
	}
	violations = append(violations, textViolations("", m.ProtoReflect())...)
	if len(violations) == 0 {
		return nil
	}
	return invalidArgument(violations...)
}

// textViolations names the text fields of m (prefix, then the field's name; nested
// messages too) that are not valid UTF-8 or hold the NUL character: in the text itself,
// or in a list's element or a map's key or value. Over the network the codec refuses
// text that is not UTF-8 before this runs (requestCodec); a call in the same process
// (Local) brings its strings as they are.
func textViolations(prefix string, m protoreflect.Message) []*errdetails.BadRequest_FieldViolation {
	var out []*errdetails.BadRequest_FieldViolation
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		field := prefix + string(fd.Name())
		why := ""
		switch {
		case fd.IsMap():
			v.Map().Range(func(k protoreflect.MapKey, e protoreflect.Value) bool {
				if why = badText(fd.MapKey(), k.Value()); why == "" {
					why = badText(fd.MapValue(), e)
				}
				return why == ""
			})
		case fd.IsList():
			for i := 0; i < v.List().Len() && why == ""; i++ {
				why = badText(fd, v.List().Get(i))
			}
		case fd.Kind() == protoreflect.MessageKind:
			out = append(out, textViolations(field+".", v.Message())...)
		default:
			why = badText(fd, v)
		}
		if why != "" {
			out = append(out, violation(field, why, ReasonFieldInvalid))
		}
		return true
	})
	return out
}

// badText says what is wrong with v if it is text that is not valid UTF-8 or holds the
// NUL character, which the ledger can store in no text; "" otherwise.
func badText(fd protoreflect.FieldDescriptor, v protoreflect.Value) string {
	if fd.Kind() != protoreflect.StringKind {
		return ""
	}
	switch s := v.String(); {
	case !utf8.ValidString(s):
		return "must be valid UTF-8"
	case strings.ContainsRune(s, 0):
		return "must not contain the NUL character (U+0000)"
	}
	return ""
}

// ruleKey names a protovalidate rule of a request field: the field's name (every
// request is flat) and the rule's path in buf.validate.FieldRules, e.g. "string.pattern"
// or "map.keys.string.pattern".
type ruleKey struct{ field, rule string }

// ruleText is what a violated rule tells the client: a description that follows the
// field's name, and the reason of the violation.
type ruleText struct{ description, reason string }

// The words of the rules that several fields share.
const (
	tenantWords = `must be 1–63 lowercase letters, digits and hyphens, starting with a letter and not ending with a hyphen, e.g. "acme"`
	nameWords   = `must be an operation's name, tenants/{tenant}/operations/{id} with the id a lowercase UUID, ` +
		`e.g. "tenants/acme/operations/01a2294c-8210-7121-b2a6-1446b69b992d"`
	tokenWords = "is not a token of this call; start again without one"
)

// stateWords lists the states a filter may name.
var stateWords = func() string {
	var names []string
	values := opbrokerv1.Operation_STATE_UNSPECIFIED.Descriptor().Values()
	for i := range values.Len() {
		if n := values.Get(i).Number(); n != 0 {
			names = append(names, opbrokerv1.Operation_State(n).String())
		}
	}
	return "must be one of " + strings.Join(names, ", ")
}()

// ruleWords states every rule of the requests' protos in words. A rule missing here
// still refuses the request, with protovalidate's words (TestEveryRuleHasWords keeps
// the table complete).
var ruleWords = map[ruleKey]ruleText{
	{"tenant", "string.pattern"}: {tenantWords, ReasonFieldInvalid},

	{"operation_type", "string.pattern"}: {operationTypeWords, ReasonFieldInvalid},
	{"operation_type", "string.max_len"}: {operationTypeWords, ReasonFieldInvalid},

	{"intent_ref", "string.min_bytes"}: {intentRefWords, ReasonFieldInvalid},
	{"intent_ref", "string.max_bytes"}: {intentRefWords, ReasonFieldInvalid},
	{"intent_ref", "string.pattern"}:   {intentRefWords, ReasonFieldInvalid},

	{"payload", "bytes.min_len"}: {"must be at least 1 byte", ReasonFieldInvalid},

	{"content_type", "string.pattern"}: {contentTypeWords, ReasonFieldInvalid},
	{"content_type", "string.max_len"}: {contentTypeWords, ReasonFieldInvalid},

	{"supersedes", "string.pattern"}: {nameWords, ReasonFieldInvalid},
	{"name", "string.pattern"}:       {nameWords, ReasonFieldInvalid},

	{"labels", "map.max_pairs"}:               {"must have at most 16 entries", ReasonFieldInvalid},
	{"labels", "map.keys.string.pattern"}:     {labelKeyWords, ReasonFieldInvalid},
	{"labels", "map.values.string.max_bytes"}: {"must be a value of at most 256 bytes", ReasonFieldInvalid},

	{"revision", "int64.gt"}:            {"must be the revision of the operation you read, 1 or more", ReasonFieldInvalid},
	{"resolution", "enum.defined_only"}: {"must be RESOLUTION_SUCCEEDED or RESOLUTION_FAILED_TERMINAL", ReasonFieldInvalid},
	{"resolution", "enum.not_in"}:       {"must be RESOLUTION_SUCCEEDED or RESOLUTION_FAILED_TERMINAL", ReasonFieldInvalid},
	{"remote_ref", "string.max_len"}:    {"must be at most 256 characters", ReasonFieldInvalid},
	{"reason", "string.min_len"}:        {"must say why, in a few words", ReasonFieldInvalid},
	{"reason", "string.max_len"}:        {"must be at most 1000 characters", ReasonFieldInvalid},
	{"evidence", "string.min_len"}:      {"must say what was checked", ReasonFieldInvalid},
	{"evidence", "string.max_len"}:      {"must be at most 2000 characters", ReasonFieldInvalid},
	{"target", "string.min_len"}:        {"must be a target's name, at most 63 characters", ReasonFieldInvalid},
	{"target", "string.max_len"}:        {"must be a target's name, at most 63 characters", ReasonFieldInvalid},
	{"owner", "string.max_len"}:         {"must be at most 200 characters", ReasonFieldInvalid},
	{"evidence_url", "string.max_len"}:  {"must be at most 2000 characters", ReasonFieldInvalid},

	{"event", "bytes.min_len"}:      {"must be the target's event as it sent it, 1 byte to 256 KiB", ReasonFieldInvalid},
	{"event", "bytes.max_len"}:      {"must be the target's event as it sent it, 1 byte to 256 KiB", ReasonFieldInvalid},
	{"event_id", "string.min_len"}:  {"must be the event's id at its target, 1–256 characters", ReasonFieldInvalid},
	{"event_id", "string.max_len"}:  {"must be the event's id at its target, 1–256 characters", ReasonFieldInvalid},
	{"action", "enum.defined_only"}: {"must be REVIEW_ACTION_ATTACH or REVIEW_ACTION_DISMISS", ReasonFieldInvalid},
	{"action", "enum.not_in"}:       {"must be REVIEW_ACTION_ATTACH or REVIEW_ACTION_DISMISS", ReasonFieldInvalid},
	{"operation", "string.pattern"}: {nameWords, ReasonFieldInvalid},
	{"note", "string.min_len"}:      {"must say why, in a few words", ReasonFieldInvalid},
	{"note", "string.max_len"}:      {"must be at most 1000 characters", ReasonFieldInvalid},
	{"reporter", "string.max_len"}:  {"must be a principal's name, at most 63 characters", ReasonFieldInvalid},

	{"page_size", "int32.gte"}:            {"must be 0 (meaning 50) or more; more than 1000 means 1000", ReasonFieldInvalid},
	{"start_after_revision", "int64.gte"}: {"must be 0 (to start with the current state) or the last revision the client saw", ReasonFieldInvalid},

	{"states", "repeated.max_items"}:               {"must have at most 7 entries", ReasonFieldInvalid},
	{"states", "repeated.unique"}:                  {"must not name a state twice", ReasonFieldInvalid},
	{"states", "repeated.items.enum.defined_only"}: {stateWords, ReasonFieldInvalid},
	{"states", "repeated.items.enum.not_in"}:       {stateWords, ReasonFieldInvalid},

	// An over-long token is not a token of this call: the same reason as a malformed one.
	{"page_token", "string.max_len"}:   {tokenWords, ReasonPageTokenInvalid},
	{"resume_token", "string.max_len"}: {tokenWords, ReasonResumeTokenInvalid},
}

const (
	operationTypeWords = `must be at most 128 characters: lowercase words of letters, digits and underscores, ` +
		`each starting with a letter, joined by dots, e.g. "demo.charge"`
	intentRefWords   = `must be 1–256 bytes without control characters, e.g. "order-1001"`
	contentTypeWords = `must be a media type of at most 127 characters, type and subtype in lowercase, ` +
		`optionally with parameters after ";" without control characters, e.g. "application/json"`
	labelKeyWords = `must have a key of 1–63 characters: a lowercase letter, then lowercase letters, ` +
		`digits, "_", "." or "-", e.g. "team"`
)

// describe turns a protovalidate violation into a field violation in words.
func describe(viol *protovalidate.Violation) *errdetails.BadRequest_FieldViolation {
	path := viol.Proto.GetField()
	field := protovalidate.FieldPathString(path)
	if requiredButEmpty(viol) {
		return violation(field, "is required", ReasonFieldRequired)
	}
	key := ruleKey{rule: protovalidate.FieldPathString(viol.Proto.GetRule())}
	if elements := path.GetElements(); len(elements) > 0 {
		key.field = elements[0].GetFieldName()
	}
	if text, ok := ruleWords[key]; ok {
		return violation(field, text.description, text.reason)
	}
	return violation(field, viol.Proto.GetMessage(), ReasonFieldInvalid)
}

// requiredButEmpty reports whether the violation is of a field the proto marks REQUIRED
// (google.api.field_behavior) that the request left empty.
func requiredButEmpty(viol *protovalidate.Violation) bool {
	fd := viol.FieldDescriptor
	if fd == nil || len(viol.Proto.GetField().GetElements()) != 1 || fd.IsList() || fd.IsMap() {
		return false // an element of a list or map, or a nested field
	}
	behaviors, _ := proto.GetExtension(fd.Options(), annotations.E_FieldBehavior).([]annotations.FieldBehavior)
	if !slices.Contains(behaviors, annotations.FieldBehavior_REQUIRED) || !viol.FieldValue.IsValid() {
		return false
	}
	switch fd.Kind() {
	case protoreflect.StringKind:
		return viol.FieldValue.String() == ""
	case protoreflect.BytesKind:
		return len(viol.FieldValue.Bytes()) == 0
	}
	return false
}

// maxListedTypes bounds how many operation types an UNKNOWN_OPERATION_TYPE lists.
const maxListedTypes = 20

// unknownOperationType is the error of a PrepareOperation whose operation type no target
// serves: it lists the types this broker serves.
func unknownOperationType(targets *target.Targets) error {
	var types []string
	for _, c := range targets.All() {
		types = append(types, c.OperationTypes...)
	}
	slices.Sort(types)
	served := strings.Join(types, ", ")
	if len(types) > maxListedTypes {
		served = fmt.Sprintf("%s and %d more", strings.Join(types[:maxListedTypes], ", "), len(types)-maxListedTypes)
	}
	desc := "is not served by this broker, which serves " + served
	if len(types) == 0 {
		desc = "is not served by this broker, which serves none: it has no target contracts"
	}
	return invalidArgument(violation("operation_type", desc, ReasonUnknownOperationType))
}

// invalidPayload is the error of a payload that payload.Hash refused: its description
// says what is wrong without repeating that the payload is invalid.
func invalidPayload(err error) error {
	desc := strings.TrimPrefix(err.Error(), payload.ErrInvalid.Error()+": ")
	return invalidArgument(violation("payload", desc, ReasonPayloadInvalid))
}
