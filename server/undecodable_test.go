package server_test

import (
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/server"
)

// rawCodec sends the bytes it is given as the request, as a client whose library does
// not check what it encodes would; answers are not read.
type rawCodec struct{}

func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	return mem.BufferSlice{mem.SliceBuffer(v.([]byte))}, nil
}
func (rawCodec) Unmarshal(mem.BufferSlice, any) error { return nil }
func (rawCodec) Name() string                         { return "proto" }

// withText is m's wire form with one more occurrence of its field named field: text
// for a string, or a map entry {key: text} for a map.
func withText(t *testing.T, m proto.Message, field, text string) []byte {
	t.Helper()
	b, err := proto.Marshal(m)
	require.NoError(t, err)
	fd := m.ProtoReflect().Descriptor().Fields().ByName(protoreflect.Name(field))
	require.NotNil(t, fd, field)
	b = protowire.AppendTag(b, fd.Number(), protowire.BytesType)
	if !fd.IsMap() {
		return protowire.AppendString(b, text)
	}
	entry := protowire.AppendTag(nil, 1, protowire.BytesType)
	entry = protowire.AppendString(entry, text)
	return protowire.AppendBytes(b, entry)
}

// TestUndecodableRequestsAreInvalidArguments: a request that is not a message of its
// type (text that is not valid UTF-8, from a client whose library does not check it, or
// bytes that are not protobuf) is answered INVALID_ARGUMENT with an ErrorInfo naming
// the field, in a unary call and in a stream, like every other bad input; gRPC alone
// answers INTERNAL before any interceptor runs.
func TestUndecodableRequestsAreInvalidArguments(t *testing.T) {
	t.Parallel()
	b := setup(t)
	invoke := func(method string, raw []byte) error {
		return b.conn.Invoke(b.ctx, method, raw, new(struct{}), grpc.ForceCodecV2(rawCodec{}))
	}
	prepare := prepareRequest("acme", "order-1", `{"amount":1}`)
	for name, tc := range map[string]struct {
		err    error
		reason string
		want   string
	}{
		"a label's key": {invoke(opbrokerv1.OperationService_PrepareOperation_FullMethodName, withText(t, prepare, "labels", "k\xff")),
			server.ReasonFieldInvalid, "labels: must be valid UTF-8 (FIELD_INVALID)"},
		"an intent reference": {invoke(opbrokerv1.OperationService_PrepareOperation_FullMethodName, withText(t, prepare, "intent_ref", "order-\xc3")),
			server.ReasonFieldInvalid, "intent_ref: must be valid UTF-8 (FIELD_INVALID)"},
		"a name": {invoke(opbrokerv1.OperationService_GetOperation_FullMethodName, withText(t, &opbrokerv1.GetOperationRequest{}, "name", "tenants/acme\xff")),
			server.ReasonFieldInvalid, "name: must be valid UTF-8 (FIELD_INVALID)"},
		"not protobuf": {invoke(opbrokerv1.OperationService_GetOperation_FullMethodName, []byte{0x0a, 0x7f, 'x'}),
			server.ReasonRequestMalformed, ""},
	} {
		st := requireStatus(t, tc.err, codes.InvalidArgument, tc.reason)
		if tc.want != "" {
			require.Equal(t, []string{tc.want}, violationsOf(st), name)
		} else {
			require.Contains(t, st.Message(), "the request is not a valid opbroker.v1.GetOperationRequest", name)
		}
	}

	stream, err := b.conn.NewStream(b.ctx, &grpc.StreamDesc{ServerStreams: true}, opbrokerv1.OperationService_WatchOperation_FullMethodName,
		grpc.ForceCodecV2(rawCodec{}))
	require.NoError(t, err)
	require.NoError(t, stream.SendMsg(withText(t, &opbrokerv1.WatchOperationRequest{}, "name", "tenants/acme\xff")))
	require.NoError(t, stream.CloseSend())
	st := requireStatus(t, stream.RecvMsg(new(struct{})), codes.InvalidArgument, server.ReasonFieldInvalid)
	require.Equal(t, []string{"name: must be valid UTF-8 (FIELD_INVALID)"}, violationsOf(st))

	// A request that decodes is served as before.
	_, err = b.client.PrepareOperation(b.ctx, prepare)
	require.NoError(t, err)
}

// TestTextThatIsNotUTF8InTheProcess: a call in the same process (the support view's,
// through Local) brings its strings without a codec: text that is not valid UTF-8 is
// refused as over the network, not answered INTERNAL by the database.
func TestTextThatIsNotUTF8InTheProcess(t *testing.T) {
	t.Parallel()
	b := setup(t)
	client := opbrokerv1.NewOperationServiceClient(b.srv.Local)
	_, err := client.ListOperations(b.ctx, &opbrokerv1.ListOperationsRequest{Tenant: "acme", IntentRef: "order-\xff"})
	st := requireStatus(t, err, codes.InvalidArgument, server.ReasonFieldInvalid)
	require.Equal(t, []string{"intent_ref: must be valid UTF-8 (FIELD_INVALID)"}, violationsOf(st))
	stream, err := client.WatchOperation(b.ctx, &opbrokerv1.WatchOperationRequest{Name: "tenants/acme/operations/\xff"})
	require.NoError(t, err)
	_, err = stream.Recv()
	st = requireStatus(t, err, codes.InvalidArgument, server.ReasonFieldInvalid)
	require.Contains(t, violationsOf(st), "name: must be valid UTF-8 (FIELD_INVALID)")
}
