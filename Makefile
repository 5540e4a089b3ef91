# The habits of this project. Everything runs with the Go toolchain alone: buf is built
# from tools/buf (its own module: its dependencies clash with the runtime's), the
# protoc plugins are tool entries of go.mod.

BUF := go tool -modfile=tools/buf/go.mod buf
STATICCHECK := go run honnef.co/go/tools/cmd/staticcheck@v0.8.2
GO_FILES = $(shell git ls-files '*.go' | grep -v '^gen/')

.PHONY: all build build-chaos dev test test-race test-ha test-browser fuzz chaos chaos-ha check-helm bench generate lint check-generated schema

all: lint test

# What a bare `make` does: list the targets. CONTRIBUTING.md says when to run each.
.DEFAULT_GOAL := help
.PHONY: help
help:
	@printf 'make TARGET, where TARGET is one of\n\n'
	@printf '  %-16s %s\n' \
		lint 'gofmt, go vet, staticcheck, buf format and buf lint' \
		test 'every test, then the unit tests of the crash points' \
		test-race 'every test with the race detector' \
		all 'lint, then test' \
		fuzz '30 seconds of each fuzz target' \
		chaos 'a chaos run and its audit (SEED=1 DURATION=10m by default); fails if an invariant broke' \
		chaos-ha 'the chaos run on a failing-over PostgreSQL formation (Patroni)' \
		test-ha 'the formation test and a short chaos run with failovers (Patroni)' \
		test-browser "the support view driven in a headless Chromium (Debian's chromium)" \
		bench 'every benchmark: prints numbers, asserts nothing' \
		generate 'buf format -w and buf generate: proto/ to gen/' \
		check-generated 'fails when gen/ does not match proto/' \
		check-helm 'the Helm chart: helm lint, helm template, manifests validated' \
		build 'every command, static, into bin/' \
		build-chaos 'bin/opbroker-chaos: the broker with its crash points' \
		dev 'opbroker dev: the broker on an embedded PostgreSQL' \
		schema 'rewrite store/schema.sql from a freshly migrated database' \
		help 'this list'

# Every command, into bin/ (ignored by git). The broker built here, like the Docker
# image, has no crash points.
build:
	CGO_ENABLED=0 go build -trimpath -o bin/ ./cmd/...

# The broker with its crash points (build tag crashpoints), for the chaos run only.
build-chaos:
	go build -tags crashpoints -o bin/opbroker-chaos ./cmd/opbroker

dev:
	go run ./cmd/opbroker dev

# The README's test command, then the unit tests of the crash points, which exist only
# with their build tag. Uses OPBROKER_TEST_DATABASE_URL when set, else an embedded
# PostgreSQL.
test:
	go test ./...
	go test -tags crashpoints ./crashpoint

test-race:
	go test -race ./...

# The tests that start a replicated PostgreSQL (package formation): a failover keeps
# every acknowledged commit, and the short chaos run with failovers. Needs Debian's
# patroni and etcd-server packages.
# The support view's browser test, which fails instead of skipping without Chromium.
test-browser:
	OPBROKER_TEST_BROWSER=1 go test -count=1 -run '^TestBrowser$$' ./ui

test-ha:
	OPBROKER_TEST_FORMATION=1 go test -p 1 -count=1 -timeout 15m -run 'TestAcknowledgedCommitsSurviveAFailover|TestShortChaosRunWithFailovers' ./formation ./chaos

# The chaos run (package chaos): replicas as processes, every fault, then the audit of
# invariants I1-I16. SEED and DURATION pick the run; it exits non-zero if an invariant broke.
SEED ?= 1
DURATION ?= 10m
chaos: build-chaos
	go run ./cmd/opchaos --broker bin/opbroker-chaos --seed $(SEED) --duration $(DURATION) --json bin/chaos-report.json

# The chaos run on a replicated PostgreSQL (Patroni, etcd, three nodes on loopback,
# strict synchronous mode), whose primary is killed and stopped over and over, beside
# every other fault. Needs Debian's patroni and etcd-server packages.
chaos-ha: build-chaos
	go run ./cmd/opchaos --broker bin/opbroker-chaos --failover --seed $(SEED) --duration $(DURATION) --json bin/chaos-ha-report.json

# The Helm chart: lint and render with the default values and each file in
# deploy/helm/opbroker/ci/, then validate the manifests (helm and the validator are
# pinned by deploy/helm/validate/go.mod).
check-helm:
	deploy/helm/check

# Measures and prints; asserts nothing. Uses DATABASE_URL when set, else an embedded
# PostgreSQL. compare-river builds bench/river (River's engine, a module of its own)
# into a temporary directory.
bench:
	go run ./cmd/opbench prepare
	go run ./cmd/opbench dispatch --ops 20000
	go run ./cmd/opbench compare-river --ops 20000 --rounds 5
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
	go test ./evidence -run '^$$' -fuzz FuzzWebhook -fuzztime 30s

generate:
	$(BUF) format -w
	$(BUF) generate

lint:
	@test -z "$$(gofmt -l $(GO_FILES))" || { gofmt -l $(GO_FILES); echo 'gofmt: the files above need formatting'; exit 1; }
	go vet ./...
	go vet -tags crashpoints ./crashpoint
	$(STATICCHECK) ./...
	$(STATICCHECK) -tags crashpoints ./crashpoint
	$(BUF) format --diff --exit-code
	$(BUF) lint

# Fails when gen/ does not match proto/.
check-generated: generate
	git diff --exit-code -- gen/ proto/
	@test -z "$$(git status --porcelain -- gen/)" || { git status --porcelain -- gen/; echo 'gen/: untracked generated files'; exit 1; }

# store/schema.sql: the schema a fresh database has after the migrations (pg_dump of
# opbroker dev's embedded PostgreSQL). CI fails when it is not up to date.
schema:
	.ci/schema-dump store/schema.sql
