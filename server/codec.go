package server

import (
	"fmt"
	"sync"
	"unicode/utf8"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/encoding"
	protocodec "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// requestCodec is gRPC's protobuf codec, except for a request it cannot decode. gRPC
// answers such a request INTERNAL, with no ErrorInfo, before any interceptor runs (text
// that is not valid UTF-8, say, from a client whose library does not check it). This
// codec leaves the request empty, keeps why it could not be decoded, and reports success;
// the admission then takes that reason (undecoded.take) before anything else reads the
// request, and answers INVALID_ARGUMENT.
type requestCodec struct {
	encoding.CodecV2
	undecoded *undecoded
}

func newRequestCodec(u *undecoded) requestCodec {
	return requestCodec{CodecV2: encoding.GetCodecV2(protocodec.Name), undecoded: u}
}

func (c requestCodec) Unmarshal(data mem.BufferSlice, v any) error {
	err := c.CodecV2.Unmarshal(data, v)
	m, ok := v.(proto.Message)
	if err == nil || !ok {
		return err
	}
	proto.Reset(m)
	c.undecoded.requests.Store(m, undecodable(m.ProtoReflect().Descriptor(), data.Materialize(), err))
	return nil
}

// undecoded holds, for each request the codec could not decode, the error to answer it
// with, until the admission takes it.
type undecoded struct{ requests sync.Map }

// take returns, and forgets, the error for req if the codec could not decode it; nil
// otherwise.
func (u *undecoded) take(req any) error {
	if u == nil {
		return nil
	}
	if err, ok := u.requests.LoadAndDelete(req); ok {
		return err.(error)
	}
	return nil
}

// undecodable is the error for a request of md, in its wire form b, that did not decode
// (err): INVALID_ARGUMENT naming the field whose text is not valid UTF-8, or saying
// that the request is not a message of its type.
func undecodable(md protoreflect.MessageDescriptor, b []byte, err error) error {
	if field := notUTF8(md, b); field != "" {
		return invalidArgument(violation(field, "must be valid UTF-8", ReasonFieldInvalid))
	}
	return newStatus(codes.InvalidArgument, fmt.Sprintf("the request is not a valid %s: %v", md.FullName(), err), ReasonRequestMalformed, nil)
}

// notUTF8 names the first text field of a message of md, in its wire form b, that is
// not valid UTF-8: in a nested message as "outer.inner", a map's key or value as the
// map's field. "" if there is none, or b cannot be read far enough to find one.
func notUTF8(md protoreflect.MessageDescriptor, b []byte) string {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return ""
		}
		b = b[n:]
		fd := md.Fields().ByNumber(num)
		if typ != protowire.BytesType || fd == nil {
			if n = protowire.ConsumeFieldValue(num, typ, b); n < 0 {
				return ""
			}
			b = b[n:]
			continue
		}
		v, n := protowire.ConsumeBytes(b)
		if n < 0 {
			return ""
		}
		b = b[n:]
		switch fd.Kind() {
		case protoreflect.StringKind:
			if !utf8.Valid(v) {
				return string(fd.Name())
			}
		case protoreflect.MessageKind:
			if inner := notUTF8(fd.Message(), v); inner != "" {
				if fd.IsMap() {
					return string(fd.Name())
				}
				return string(fd.Name()) + "." + inner
			}
		}
	}
	return ""
}
