package server

import (
	"fmt"
	"maps"
	"os"
	"slices"
	"strings"
	"testing"

	"buf.build/gen/go/bufbuild/protovalidate/protocolbuffers/go/buf/validate"
	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/payload"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/target"
)

// protoRules returns every protovalidate rule of the services' requests, keyed as
// ruleWords is: the field and the rule's path in FieldRules ("map.keys.string.pattern").
func protoRules(t *testing.T) map[ruleKey]bool {
	t.Helper()
	rules := map[ruleKey]bool{}
	var walk func(field, prefix string, m protoreflect.Message)
	walk = func(field, prefix string, m protoreflect.Message) {
		m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
			name := prefix + string(fd.Name())
			switch {
			case name == "ignore": // when rules apply, not a rule
			case fd.Kind() == protoreflect.MessageKind && !fd.IsList() && !fd.IsMap():
				walk(field, name+".", v.Message())
			default:
				rules[ruleKey{field, name}] = true
			}
			return true
		})
	}
	for _, file := range []protoreflect.FileDescriptor{
		opbrokerv1.File_opbroker_v1_operation_service_proto, opbrokerv1.File_opbroker_v1_admin_service_proto,
		opbrokerv1.File_opbroker_v1_evidence_service_proto,
	} {
		for i := range file.Services().Len() {
			methods := file.Services().Get(i).Methods()
			for j := range methods.Len() {
				fields := methods.Get(j).Input().Fields()
				for k := range fields.Len() {
					fd := fields.Get(k)
					if r, ok := proto.GetExtension(fd.Options(), validate.E_Field).(*validate.FieldRules); ok && r != nil {
						walk(string(fd.Name()), "", r.ProtoReflect())
					}
				}
			}
		}
	}
	return rules
}

// TestEveryRuleHasWords: every rule in the requests' protos is stated in words in
// ruleWords, and ruleWords states no rule the protos do not have.
func TestEveryRuleHasWords(t *testing.T) {
	t.Parallel()
	rules := protoRules(t)
	require.Contains(t, rules, ruleKey{"labels", "map.keys.string.pattern"}, "the walk reaches nested rules")
	key := func(k ruleKey) string { return k.field + " " + k.rule }
	require.ElementsMatch(t, slices.Sorted(func(yield func(string) bool) {
		for k := range rules {
			yield(key(k))
		}
	}), slices.Sorted(func(yield func(string) bool) {
		for k := range maps.Keys(ruleWords) {
			yield(key(k))
		}
	}))
	for k, text := range ruleWords {
		require.NotContains(t, text.description, "regex", k)
		require.Regexp(t, `^(must|is) `, text.description, "%v: a description follows the field's name", k)
	}
}

// TestLimitsStateTheRules: docs/api.md's Limits say each field's rule in the words a
// violation uses.
func TestLimitsStateTheRules(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile("../docs/api.md")
	require.NoError(t, err)
	_, limits, ok := strings.Cut(string(doc), "\n## Limits\n")
	require.True(t, ok)
	limits = strings.Join(strings.Fields(limits), " ") // lines are wrapped
	for _, k := range []ruleKey{
		{"tenant", "string.pattern"}, {"operation_type", "string.pattern"}, {"intent_ref", "string.pattern"},
		{"content_type", "string.pattern"}, {"page_size", "int32.gte"},
	} {
		rule := strings.TrimPrefix(ruleWords[k].description, "must be ")
		rule, _, _ = strings.Cut(rule, `, e.g. "`)
		rule = strings.ReplaceAll(rule, `"`, "`") // the docs quote code in backticks
		require.Contains(t, limits, rule, "docs/api.md's Limits say %s's rule as violations do", k.field)
	}
	require.Contains(t, limits, "(not `9acme`", "the tenant's example of what is refused")
}

func TestUnknownOperationTypeListsServedTypes(t *testing.T) {
	t.Parallel()
	demo, err := target.New(simtarget.DemoContracts("http://127.0.0.1:1")...)
	require.NoError(t, err)
	requireOnlyViolation(t, unknownOperationType(demo), "operation_type",
		"is not served by this broker, which serves demo.charge, demo.notify, demo.object", ReasonUnknownOperationType)

	many := simtarget.DemoContracts("http://127.0.0.1:1")[:1]
	many[0].OperationTypes = nil
	for i := range maxListedTypes + 3 {
		many[0].OperationTypes = append(many[0].OperationTypes, fmt.Sprintf("t.op%02d", i))
	}
	lots, err := target.New(many...)
	require.NoError(t, err)
	requireOnlyViolation(t, unknownOperationType(lots), "operation_type",
		"is not served by this broker, which serves t.op00, t.op01, t.op02, t.op03, t.op04, t.op05, t.op06, t.op07, t.op08, "+
			"t.op09, t.op10, t.op11, t.op12, t.op13, t.op14, t.op15, t.op16, t.op17, t.op18, t.op19 and 3 more", ReasonUnknownOperationType)
}

func TestInvalidPayloadSaysWhatIsWrong(t *testing.T) {
	t.Parallel()
	_, err := payload.Hash("application/json", []byte(`{"amount":`))
	require.ErrorIs(t, err, payload.ErrInvalid)
	err = invalidPayload(err)
	requireOnlyViolation(t, err, "payload", "not a single well-formed JSON value", ReasonPayloadInvalid)
	require.Equal(t, "payload: not a single well-formed JSON value", err.Error())
}

func requireOnlyViolation(t *testing.T, err error, field, description, reason string) {
	t.Helper()
	var invalid *invalidArgumentError
	require.ErrorAs(t, err, &invalid)
	require.Len(t, invalid.violations, 1)
	require.Equal(t, field, invalid.violations[0].GetField())
	require.Equal(t, description, invalid.violations[0].GetDescription())
	require.Equal(t, reason, invalid.violations[0].GetReason())
	require.Equal(t, reason, invalid.reason())
}

// TestInvalidArgumentReason: the ErrorInfo's reason is the violations' reason when they
// share one, INVALID_ARGUMENT when they differ; a repeated violation is said once.
func TestInvalidArgumentReason(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		violations []*errdetails.BadRequest_FieldViolation
		reason     string
		message    string
	}{
		"one": {[]*errdetails.BadRequest_FieldViolation{violation("a", "is required", ReasonFieldRequired)},
			ReasonFieldRequired, "a: is required"},
		"the same reason": {[]*errdetails.BadRequest_FieldViolation{
			violation("a", "is required", ReasonFieldRequired), violation("b", "is required", ReasonFieldRequired)},
			ReasonFieldRequired, "a: is required; b: is required"},
		"different reasons": {[]*errdetails.BadRequest_FieldViolation{
			violation("a", "is required", ReasonFieldRequired), violation("b", "must be x", ReasonFieldInvalid)},
			ReasonInvalidArgument, "a: is required; b: must be x"},
		"a repeat": {[]*errdetails.BadRequest_FieldViolation{
			violation("a", "must be x", ReasonFieldInvalid), violation("a", "must be x", ReasonFieldInvalid)},
			ReasonFieldInvalid, "a: must be x"},
	} {
		err := invalidArgument(tc.violations...)
		var invalid *invalidArgumentError
		require.ErrorAs(t, err, &invalid, name)
		require.Equal(t, tc.reason, invalid.reason(), name)
		require.Equal(t, tc.message, err.Error(), name)
	}
}
