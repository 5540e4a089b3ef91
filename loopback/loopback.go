// Package loopback picks ports of 127.0.0.1 for servers that a test harness stops and
// starts again on the same port (the chaos run's replicas and PostgreSQL, a formation's
// nodes, a crash-restarted embedded PostgreSQL).
//
// A port the kernel picks for a listener (port 0) comes from its range of ephemeral
// ports, the same range it gives connections their local ports from. While the server
// is down, any connection over loopback can be given its port (a database session can
// last a whole run), and binding it again fails for as long as that connection lives.
// So Ports picks below that range, where only servers listen, wherever the system says
// what the range is (Linux).
package loopback

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"syscall"
)

// First is the lowest port Ports picks: above the ports common servers use (5432,
// 6379, 8080, …).
const First = 16384

// Range returns the ports Ports picks from, [First, end): those below Linux's range of
// ephemeral ports. ok is false where the range cannot be read or leaves fewer than 1,024
// ports above First; Ports then lets the kernel pick.
func Range() (end int, ok bool) {
	data, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 0, false
	}
	fields := strings.Fields(string(data))
	if len(fields) != 2 {
		return 0, false
	}
	low, err := strconv.Atoi(fields[0])
	if err != nil || low-First < 1024 {
		return 0, false
	}
	return low, true
}

// Ports returns n distinct ports of 127.0.0.1 that no one listened on a moment ago,
// picked from Range.
func Ports(n int) ([]int, error) {
	next := func() int { return 0 }
	if end, ok := Range(); ok {
		next = func() int { return First + rand.IntN(end-First) }
	}
	var ports []int
	var held []net.Listener
	defer func() {
		for _, lis := range held {
			lis.Close()
		}
	}()
	for taken := 0; len(held) < n; {
		lis, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", next()))
		if err != nil {
			taken++
			if errors.Is(err, syscall.EADDRINUSE) && taken < 1000 {
				continue // in use: another, a thousand times at most
			}
			return nil, fmt.Errorf("loopback: %w", err)
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
