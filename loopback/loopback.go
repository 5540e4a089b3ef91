// Package loopback picks ports of 127.0.0.1 for servers that a test harness stops and
// starts again on the same port (the chaos run's replicas and PostgreSQL, a formation's
// nodes).
//
// A port the kernel picks for a listener (port 0) comes from its range of ephemeral
// ports, the same range it gives outgoing connections their local ports from. While the
// server is down, any outgoing connection on the machine can be given its port (a
// database session can last a whole run), and binding it again fails for as long as that
// connection lives. So Ports picks below that range, where only servers listen.
package loopback

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
)

// First is the lowest port Ports picks: above the well-known services' ports.
const First = 16384

// Ports returns n distinct ports of 127.0.0.1 that no one listened on a moment ago,
// below the ephemeral range where the system says what it is (Linux), otherwise picked
// by the kernel.
func Ports(n int) ([]int, error) {
	next := func() int { return 0 }
	if low, ok := EphemeralLow(); ok && low-First >= 100*n {
		next = func() int { return First + rand.IntN(low-First) }
	}
	var ports []int
	var held []net.Listener
	defer func() {
		for _, lis := range held {
			lis.Close()
		}
	}()
	for try := 0; len(held) < n; try++ {
		lis, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", next()))
		if err != nil {
			if try < 1000 {
				continue // taken: another
			}
			return nil, err
		}
		held = append(held, lis)
		ports = append(ports, lis.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// Addrs is Ports as host:port addresses.
func Addrs(n int) ([]string, error) {
	ports, err := Ports(n)
	if err != nil {
		return nil, err
	}
	addrs := make([]string, n)
	for i, p := range ports {
		addrs[i] = net.JoinHostPort("127.0.0.1", strconv.Itoa(p))
	}
	return addrs, nil
}

// EphemeralLow returns the first port of Linux's range of ephemeral ports.
func EphemeralLow() (int, bool) {
	data, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 0, false
	}
	fields := strings.Fields(string(data))
	if len(fields) != 2 {
		return 0, false
	}
	low, err := strconv.Atoi(fields[0])
	return low, err == nil
}
