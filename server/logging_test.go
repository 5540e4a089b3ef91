package server_test

import (
	"errors"
	"io"
	"log/slog"
	"maps"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"

	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/logtest"
	"github.com/opbroker/opbroker/server"
)

// TestOneLinePerCall: each call is logged in one line with its method, code, reason and
// duration, at info for a client's calls; health checks and reflection (what grpcurl
// opens for every command) only at debug, and the peer and the error's message only at
// debug.
func TestOneLinePerCall(t *testing.T) {
	t.Parallel()
	for _, level := range []slog.Level{slog.LevelInfo, slog.LevelDebug} {
		t.Run(level.String(), func(t *testing.T) {
			t.Parallel()
			logs := &logtest.Buffer{}
			b := setupWith(t, func(o *server.Options) {
				o.Logger = slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: level}))
				o.Reflection = true
			})
			_, err := b.client.PrepareOperation(b.ctx, prepareRequest("acme", "log-1", `{}`))
			require.NoError(t, err)
			_, err = b.client.PrepareOperation(b.ctx, &opbrokerv1.PrepareOperationRequest{})
			require.Error(t, err)
			_, err = healthpb.NewHealthClient(b.conn).Check(b.ctx, &healthpb.HealthCheckRequest{})
			require.NoError(t, err)
			reflect, err := reflectionpb.NewServerReflectionClient(b.conn).ServerReflectionInfo(b.ctx)
			require.NoError(t, err)
			require.NoError(t, reflect.Send(&reflectionpb.ServerReflectionRequest{
				MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{}}))
			_, err = reflect.Recv()
			require.NoError(t, err)
			require.NoError(t, reflect.CloseSend())
			_, err = reflect.Recv()
			require.True(t, errors.Is(err, io.EOF), "%v", err) // the server has logged the call

			lines := logtest.Entries[map[string]any](t, logs)
			prepare := "/" + opbrokerv1.OperationService_ServiceDesc.ServiceName + "/PrepareOperation"
			want := []struct {
				level, method, code, reason string
			}{
				{"INFO", prepare, "OK", ""},
				{"INFO", prepare, "InvalidArgument", server.ReasonFieldRequired},
			}
			if level == slog.LevelDebug {
				want = append(want, struct{ level, method, code, reason string }{"DEBUG", "/grpc.health.v1.Health/Check", "OK", ""},
					struct{ level, method, code, reason string }{"DEBUG", "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", "OK", ""})
			}
			require.Len(t, lines, len(want), "one line per call: %s", logs.String())
			for i, w := range want {
				line := lines[i]
				require.Equal(t, "finished call", line["msg"])
				require.Equal(t, w.level, line["level"])
				require.Equal(t, w.method, line["method"])
				require.Equal(t, w.code, line["code"])
				require.Greater(t, line["duration"], 0.0)
				keys := []string{"time", "level", "msg", "method", "code", "duration"}
				if w.reason != "" {
					require.Equal(t, w.reason, line["reason"])
					keys = append(keys, "reason")
				}
				if level == slog.LevelDebug {
					require.Equal(t, "bufconn", line["peer"])
					keys = append(keys, "peer")
					if w.reason != "" {
						require.Contains(t, line["error"], "tenant: is required")
						keys = append(keys, "error")
					}
				}
				require.ElementsMatch(t, keys, slices.Collect(maps.Keys(line)), "nothing else: %v", line)
			}
		})
	}
}
