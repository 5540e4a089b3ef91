package server

import (
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
)

// TestTheCodecMarksWhatItCouldNotDecode: a request the codec cannot decode is left
// empty but for the reason, which travels with the message (nothing is kept beside it,
// so a call that ends before its admission leaves nothing behind); a request that
// decodes has no mark, and one that brings the mark itself is refused for it.
func TestTheCodecMarksWhatItCouldNotDecode(t *testing.T) {
	t.Parallel()
	codec := newRequestCodec()
	decode := func(b []byte) *opbrokerv1.GetOperationRequest {
		req := &opbrokerv1.GetOperationRequest{}
		require.NoError(t, codec.Unmarshal(mem.BufferSlice{mem.SliceBuffer(b)}, req))
		return req
	}

	notUTF8 := decode([]byte{0x0a, 0x02, 'a', 0xff})
	require.Empty(t, notUTF8.GetName(), "left empty")
	st := status.Convert(toStatus(t.Context(), nil, undecoded(notUTF8)))
	require.Equal(t, codes.InvalidArgument, st.Code())
	require.Equal(t, "name: must be valid UTF-8", st.Message())

	st = status.Convert(undecoded(decode([]byte{0x0a, 0x7f})))
	require.Equal(t, codes.InvalidArgument, st.Code())
	require.Contains(t, st.Message(), "the request is not a valid opbroker.v1.GetOperationRequest")

	good, err := proto.Marshal(&opbrokerv1.GetOperationRequest{Name: "tenants/acme/operations/x"})
	require.NoError(t, err)

	// A client that sends the mark itself, in a request that decodes, is refused for
	// that, whatever it wrote there.
	forged := protowire.AppendTag(append([]byte(nil), good...), undecodedField, protowire.BytesType)
	forged = protowire.AppendString(forged, "Fname")
	st = status.Convert(undecoded(decode(forged)))
	require.Equal(t, codes.InvalidArgument, st.Code())
	require.Equal(t, "the request is not a valid opbroker.v1.GetOperationRequest: field number 536870911 is reserved", st.Message())

	decoded := decode(good)
	require.Equal(t, "tenants/acme/operations/x", decoded.GetName())
	require.Empty(t, decoded.ProtoReflect().GetUnknown())
	require.NoError(t, undecoded(decoded))
}
