package reconciler_test

import (
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/logtest"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/storetest"
)

// TestLogsNeverCarrySensitiveData: through every fault of the simulated target, for a
// keyed and an unkeyed target, the dispatcher's and the reconciler's logs (at debug
// level) never contain a payload's bytes, an intent reference or a remote key.
func TestLogsNeverCarrySensitiveData(t *testing.T) {
	t.Parallel()
	logs := &logtest.Buffer{}
	b := setupLogged(t, slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug})), simtarget.Config{})
	var secrets []string
	for i, f := range simtarget.Faults {
		for _, typ := range []string{simtarget.DemoCharge, simtarget.DemoNotify} {
			card := fmt.Sprintf("4111-0000-%04d-%s", i, typ)
			intent := fmt.Sprintf("customer-%d-%s", i, typ)
			op := b.prepare(t, typ, intent, `{"amount":100,"card":"`+card+`","sim":{"fault":"`+string(f)+`"}}`)
			secrets = append(secrets, card, intent, storetest.RemoteKey(t, b.pool, op.ID))
		}
	}
	require.NoError(t, b.dispatcher.Start(b.ctx))
	require.NoError(t, b.reconciler(t, "r").Start(b.ctx))
	// Every operation sent, and every UNKNOWN one reconciled at least once.
	require.Eventually(t, func() bool {
		var pending int
		require.NoError(t, b.pool.QueryRow(b.ctx, `SELECT count(*) FROM operations
			WHERE state = 'IN_FLIGHT' OR (state = 'PREPARED' AND attempt_count = 0)
				OR (state = 'UNKNOWN' AND checks + replays = 0)`).Scan(&pending))
		return pending == 0
	}, 60*time.Second, 50*time.Millisecond)

	out := logs.String()
	require.Contains(t, out, "escalated", "the scenarios were logged")
	for _, secret := range secrets {
		require.NotContains(t, out, secret)
	}
}
