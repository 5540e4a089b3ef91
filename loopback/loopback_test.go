package loopback_test

import (
	"net"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/loopback"
)

// TestPortsAreOutsideTheEphemeralRange: a server started again on its port must find it
// free, so the port must be one that no outgoing connection can be given meanwhile.
func TestPortsAreOutsideTheEphemeralRange(t *testing.T) {
	end, ok := loopback.Range()
	if !ok {
		t.Skip("no room below the ephemeral port range on this system: the kernel picks")
	}
	addrs, err := loopback.Addrs(8)
	require.NoError(t, err)
	require.Len(t, addrs, 8)
	seen := map[string]bool{}
	for _, addr := range addrs {
		tcp, err := net.ResolveTCPAddr("tcp", addr)
		require.NoError(t, err)
		require.Equal(t, "127.0.0.1", tcp.IP.String())
		require.GreaterOrEqual(t, tcp.Port, loopback.First, addr)
		require.Less(t, tcp.Port, end, "%s is in the ephemeral range from %d", addr, end)
		require.False(t, seen[addr], "%s twice", addr)
		seen[addr] = true
		// Free again once returned: the caller's server binds it.
		lis, err := net.Listen("tcp", addr)
		require.NoError(t, err)
		lis.Close()
	}
}
