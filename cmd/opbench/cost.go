package main

import (
	"bytes"
	"context"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// workCost is what a stretch of work cost: the WAL PostgreSQL wrote, the write
// transactions it committed (transaction ids assigned) and the CPU of its processes,
// which opbench reads from /proc (PostgreSQL runs on the same machine; every process
// named postgres counts, so other work on that server counts too); and the CPU of the
// client process that did the work (the broker's, or River's program).
type workCost struct {
	walBytes, writeXacts  int64
	cpu, clientCPU        time.Duration
	cpuKnown, clientKnown bool
}

// per returns the cost per unit of n, as printed.
func (c workCost) per(n int) string {
	return fmt.Sprintf("PostgreSQL CPU %s, WAL %.0f B, %.4f write transactions; client CPU %s", perMillis(c.cpu, c.cpuKnown, n),
		float64(c.walBytes)/float64(n), float64(c.writeXacts)/float64(n), perMillis(c.clientCPU, c.clientKnown, n))
}

// perMillis returns d per unit of n in milliseconds, as printed, or "-" when d is not
// known.
func perMillis(d time.Duration, known bool, n int) string {
	if !known {
		return "-"
	}
	return fmt.Sprintf("%.3f ms", millisPer(d, n))
}

// millisPer returns d per unit of n, in milliseconds.
func millisPer(d time.Duration, n int) float64 {
	return float64(d) / float64(time.Millisecond) / float64(n)
}

// measureCost starts measuring what PostgreSQL and the client process (its pid; 0 for
// none) spend; the function it returns stops and reports. admin reads the server's
// counters.
func measureCost(ctx context.Context, admin *pgxpool.Pool, client int) (func() (workCost, error), error) {
	var lsn string
	var xmax int64
	read := func() error {
		return admin.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text, pg_snapshot_xmax(pg_current_snapshot())::text::bigint`).Scan(&lsn, &xmax)
	}
	if err := read(); err != nil {
		return nil, fmt.Errorf("cost: %w", err)
	}
	startLSN, startXmax := lsn, xmax
	base := postgresCPU()
	last := maps.Clone(base)
	clientBase, clientKnown := processCPU(client)
	clientLast := clientBase
	stop, done := make(chan struct{}), make(chan struct{})
	// A process that exits takes its CPU time with it, so the processes are sampled while
	// the work runs; a backend that exits between samples loses what it spent since the
	// last. Each sample reads all of /proc, a few milliseconds of this process's CPU, which
	// competes with what is measured: every 50 ms took 6% of a core from a burn-down.
	// The connections of a burn-down live as long as it does, so a few samples a second
	// lose nothing of theirs; the last sample is taken when the work is over, not at the
	// tick before (which left out up to a quarter of a second of it).
	sample := func() {
		maps.Copy(last, postgresCPU())
		if t, ok := processCPU(client); ok {
			clientLast = t
		}
	}
	go func() {
		defer close(done)
		tick := time.NewTicker(250 * time.Millisecond)
		defer tick.Stop()
		for {
			sample()
			select {
			case <-stop:
				sample()
				return
			case <-tick.C:
			}
		}
	}()
	return func() (workCost, error) {
		close(stop)
		<-done
		var c workCost
		for pid, t := range last {
			c.cpu += t - base[pid]
		}
		c.cpuKnown = len(last) > 0
		c.clientCPU, c.clientKnown = clientLast-clientBase, clientKnown
		if err := read(); err != nil {
			return c, fmt.Errorf("cost: %w", err)
		}
		c.writeXacts = xmax - startXmax
		err := admin.QueryRow(ctx, `SELECT pg_wal_lsn_diff($1::pg_lsn, $2::pg_lsn)::bigint`, lsn, startLSN).Scan(&c.walBytes)
		return c, err
	}, nil
}

// postgresCPU returns the CPU time (user and system) of each process named postgres,
// from /proc; nothing where there is no /proc.
func postgresCPU() map[int]time.Duration {
	cpu := map[int]time.Duration{}
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	for _, dir := range dirs {
		if comm, err := os.ReadFile(filepath.Join(dir, "comm")); err != nil || string(bytes.TrimSpace(comm)) != "postgres" {
			continue
		}
		pid, err := strconv.Atoi(filepath.Base(dir))
		if err != nil {
			continue
		}
		if t, ok := processCPU(pid); ok {
			cpu[pid] = t
		}
	}
	return cpu
}

// processCPU returns the CPU time (user and system, all its threads) of the process
// pid, from /proc; false for pid 0, or where there is no /proc or no such process.
func processCPU(pid int) (time.Duration, bool) {
	if pid <= 0 {
		return 0, false
	}
	stat, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return 0, false
	}
	// The fields after the command's closing parenthesis: utime and stime are the 12th
	// and 13th, in clock ticks (USER_HZ, 100 on Linux).
	fields := bytes.Fields(stat[bytes.LastIndexByte(stat, ')')+1:])
	if len(fields) < 13 {
		return 0, false
	}
	utime, err1 := strconv.ParseInt(string(fields[11]), 10, 64)
	stime, err2 := strconv.ParseInt(string(fields[12]), 10, 64)
	if err1 != nil || err2 != nil {
		return 0, false
	}
	return time.Duration(utime+stime) * 10 * time.Millisecond, true
}
