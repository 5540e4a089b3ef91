# syntax=docker/dockerfile:1
# opbroker: a static binary on a distroless base, running as a non-root user.
#   docker build --build-arg VERSION="$(git describe --tags --always --dirty)" \
#     --build-arg COMMIT="$(git rev-parse HEAD)" -t opbroker .
#   docker run --rm -e DATABASE_URL=postgres://... opbroker migrate
#   docker run --rm -p 50051:50051 -p 9090:9090 -e DATABASE_URL=postgres://... \
#     -e OPBROKER_TARGETS=/etc/opbroker/targets.yaml -e OPBROKER_AUTH_CONFIG=/etc/opbroker/principals.yaml \
#     -e OPBROKER_TLS_CERT=/etc/opbroker/tls.crt -e OPBROKER_TLS_KEY=/etc/opbroker/tls.key \
#     -v /path/to/config:/etc/opbroker:ro opbroker
# serve refuses to start without principals and TLS unless told --insecure-no-auth and
# --plaintext; DATABASE_URL names an ordinary role that owns the schema (docs/security.md).

FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN --mount=type=cache,target=/go/pkg/mod go mod download
COPY . .
# Built without the crashpoints tag, as a release must be: the binary contains no crash
# points (package crashpoint), so no environment variable can make it kill itself.
# .git is not in the build context (.dockerignore), so Go records no commit: the build
# arguments name the release instead (`opbroker version`, the metric opbroker_build_info).
ARG VERSION
ARG COMMIT
RUN --mount=type=cache,target=/go/pkg/mod --mount=type=cache,target=/root/.cache/go-build \
    CGO_ENABLED=0 go build -trimpath -ldflags="-s -w -X main.version=${VERSION} -X main.commit=${COMMIT}" \
    -o /out/opbroker ./cmd/opbroker

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/opbroker /opbroker
USER nonroot:nonroot
# Inside a container the listeners bind every interface; publish them deliberately.
ENV OPBROKER_GRPC_ADDR=:50051 \
    OPBROKER_HTTP_ADDR=:9090
EXPOSE 50051 9090
ENTRYPOINT ["/opbroker"]
CMD ["serve"]
