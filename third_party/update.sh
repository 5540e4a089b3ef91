#!/usr/bin/env bash
# Re-copies the vendored protos at the versions named here; see README.md.
set -euo pipefail
cd "$(dirname "$0")"
GOOGLE_PROTO_FILES=6.0.1
PROTOVALIDATE=v1.2.2

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "google-proto-files@$GOOGLE_PROTO_FILES" >/dev/null && tar xzf google-proto-files-*.tgz)
install -m 644 "$tmp"/package/google/api/{field_behavior,resource}.proto proto/google/api/
install -m 644 "$tmp/package/LICENSE" proto/google/LICENSE

dir="$(GOFLAGS=-mod=mod go mod download -json "github.com/bufbuild/protovalidate@$PROTOVALIDATE" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')"
install -m 644 "$dir/proto/protovalidate/buf/validate/validate.proto" proto/buf/validate/
install -m 644 "$dir/LICENSE" proto/buf/LICENSE
echo "updated; now run make generate and the tests"
