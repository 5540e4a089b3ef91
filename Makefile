# The habits of this project. Everything runs with the Go toolchain alone: buf is built
# from tools/buf (its own module: its dependencies clash with the runtime's), the
# protoc plugins are tool entries of go.mod.

BUF := go tool -modfile=tools/buf/go.mod buf
STATICCHECK := go run honnef.co/go/tools/cmd/staticcheck@v0.8.2
GO_FILES = $(shell git ls-files '*.go' | grep -v '^gen/')

.PHONY: all build dev test test-race fuzz chaos bench generate lint check-generated

all: lint test

build:
	CGO_ENABLED=0 go build -trimpath -o bin/opbroker ./cmd/opbroker

dev:
	go run ./cmd/opbroker dev

# The README's test command. Uses OPBROKER_TEST_DATABASE_URL when set, else an
# embedded PostgreSQL.
test:
	go test ./...

test-race:
	go test -race ./...

# Measures and prints; asserts nothing. Uses DATABASE_URL when set, else an embedded
# PostgreSQL.
# The chaos run (package chaos): replicas as processes, every fault, then the audit of
# invariants I1-I10. SEED and DURATION pick the run; it exits non-zero if an invariant broke.
SEED ?= 1
DURATION ?= 10m
chaos: build
	go run ./cmd/opchaos --broker bin/opbroker --seed $(SEED) --duration $(DURATION) --json bin/chaos-report.json

bench:
	go run ./cmd/opbench prepare
	go run ./cmd/opbench dispatch --ops 20000
	go run ./cmd/opbench watch --watchers 10000
	go run ./cmd/opbench reconcile --ops 5000
	go run ./cmd/opbench ledger --operations 1000000

# A short run of each fuzz target (the seed corpora also run in `make test`).
fuzz:
	go test ./payload -run '^$$' -fuzz FuzzCanonical -fuzztime 30s
	go test ./reconciler -run '^$$' -fuzz FuzzDecide -fuzztime 30s
	go test ./server -run '^$$' -fuzz FuzzPageToken -fuzztime 30s
	go test ./server -run '^$$' -fuzz FuzzResumeToken -fuzztime 30s
	go test ./server -run '^$$' -fuzz FuzzAdmit -fuzztime 30s

generate:
	$(BUF) format -w
	$(BUF) generate

lint:
	@test -z "$$(gofmt -l $(GO_FILES))" || { gofmt -l $(GO_FILES); echo 'gofmt: the files above need formatting'; exit 1; }
	go vet ./...
	$(STATICCHECK) ./...
	$(BUF) format --diff --exit-code
	$(BUF) lint

# Fails when gen/ does not match proto/.
check-generated: generate
	git diff --exit-code -- gen/ proto/
	@test -z "$$(git status --porcelain -- gen/)" || { git status --porcelain -- gen/; echo 'gen/: untracked generated files'; exit 1; }
