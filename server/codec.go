package server

import (
	"fmt"
	"iter"
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
// codec leaves the request empty but for an unknown field, undecodedField, that says
// why it could not be decoded, and reports success; the admission finds that field
// (undecoded) before anything else reads the request, and answers INVALID_ARGUMENT.
// The reason travels with the message, so nothing is left behind when a call ends
// before the admission sees it.
type requestCodec struct{ encoding.CodecV2 }

func newRequestCodec() requestCodec {
	return requestCodec{CodecV2: encoding.GetCodecV2(protocodec.Name)}
}

// undecodedField is the field number under which requestCodec keeps why a request
// could not be decoded: the largest a field may have, which no request of ours uses.
// Its value is "F" and the name of the field whose text is not valid UTF-8, or "M" and
// what did not decode. A request that carries it itself is refused for that
// (errReservedField), whatever it says there.
const undecodedField = protowire.MaxValidNumber

var errReservedField = fmt.Errorf("field number %d is reserved", undecodedField)

func (c requestCodec) Unmarshal(data mem.BufferSlice, v any) error {
	err := c.CodecV2.Unmarshal(data, v)
	m, ok := v.(proto.Message)
	if !ok {
		return err
	}
	if err == nil {
		if _, marked := mark(m); !marked {
			return nil
		}
		err = errReservedField
	}
	proto.Reset(m)
	why := "M" + err.Error()
	if field := notUTF8(m.ProtoReflect().Descriptor(), data.Materialize()); field != "" {
		why = "F" + field
	}
	mark := protowire.AppendTag(nil, undecodedField, protowire.BytesType)
	m.ProtoReflect().SetUnknown(protowire.AppendString(mark, why))
	return nil
}

// undecoded returns the error for req if requestCodec could not decode it: nil
// otherwise.
func undecoded(req any) error {
	m, ok := req.(proto.Message)
	if !ok {
		return nil
	}
	why, marked := mark(m)
	if !marked || why == "" {
		return nil
	}
	return undecodable(m.ProtoReflect().Descriptor(), why[:1], why[1:])
}

// mark returns the value of m's unknown field undecodedField, and whether it has one.
func mark(m proto.Message) (string, bool) {
	for f := range wireFields(m.ProtoReflect().GetUnknown()) {
		if f.num == undecodedField && f.typ == protowire.BytesType {
			return string(f.bytes), true
		}
	}
	return "", false
}

// wireField is a field of a message in its wire form: its number, its type and, for a
// length-delimited field, its bytes.
type wireField struct {
	num   protowire.Number
	typ   protowire.Type
	bytes []byte
}

// wireFields yields the fields of the wire form b, up to the first it cannot read.
func wireFields(b []byte) iter.Seq[wireField] {
	return func(yield func(wireField) bool) {
		for len(b) > 0 {
			num, typ, n := protowire.ConsumeTag(b)
			if n < 0 {
				return
			}
			b = b[n:]
			f := wireField{num: num, typ: typ}
			if typ == protowire.BytesType {
				f.bytes, n = protowire.ConsumeBytes(b)
			} else {
				n = protowire.ConsumeFieldValue(num, typ, b)
			}
			if n < 0 || !yield(f) {
				return
			}
			b = b[n:]
		}
	}
}

// undecodable is the error for a request of md that did not decode: kind "F", the
// field named by detail is not valid UTF-8; otherwise detail says what did not decode.
func undecodable(md protoreflect.MessageDescriptor, kind, detail string) error {
	if kind == "F" {
		return invalidArgument(violation(detail, "must be valid UTF-8", ReasonFieldInvalid))
	}
	return newStatus(codes.InvalidArgument, fmt.Sprintf("the request is not a valid %s: %s", md.FullName(), detail), ReasonRequestMalformed, nil)
}

// notUTF8 names the first text field of a message of md, in its wire form b, that is
// not valid UTF-8: in a nested message as "outer.inner", a map's key or value as the
// map's field. "" if there is none, or b cannot be read far enough to find one.
func notUTF8(md protoreflect.MessageDescriptor, b []byte) string {
	for f := range wireFields(b) {
		fd := md.Fields().ByNumber(f.num)
		if f.typ != protowire.BytesType || fd == nil {
			continue
		}
		switch fd.Kind() {
		case protoreflect.StringKind:
			if !utf8.Valid(f.bytes) {
				return string(fd.Name())
			}
		case protoreflect.MessageKind:
			if inner := notUTF8(fd.Message(), f.bytes); inner != "" {
				if fd.IsMap() {
					return string(fd.Name())
				}
				return string(fd.Name()) + "." + inner
			}
		}
	}
	return ""
}
