package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// pgCost is what PostgreSQL spent on a stretch of work: the WAL it wrote, the write
// transactions it committed (transaction ids assigned), and the CPU of its processes,
// which opbench reads from /proc (PostgreSQL runs on the same machine; every process
// named postgres counts, so other work on that server counts too).
type pgCost struct {
	walBytes, writeXacts int64
	cpu                  time.Duration
	cpuKnown             bool
}

// per returns the cost per unit of n, as printed.
func (c pgCost) per(n int) string {
	cpu := "-"
	if c.cpuKnown {
		cpu = fmt.Sprintf("%.3f ms", float64(c.cpu)/float64(time.Millisecond)/float64(n))
	}
	return fmt.Sprintf("PostgreSQL CPU %s, WAL %.0f B, %.4f write transactions", cpu,
		float64(c.walBytes)/float64(n), float64(c.writeXacts)/float64(n))
}

// measureCost starts measuring what PostgreSQL spends; the function it returns stops
// and reports. admin reads the server's counters.
func measureCost(ctx context.Context, admin *pgxpool.Pool) (func() (pgCost, error), error) {
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
	last := map[int]time.Duration{}
	for pid, t := range base {
		last[pid] = t
	}
	stop, done := make(chan struct{}), make(chan struct{})
	// A process that exits takes its CPU time with it, so the processes are sampled while
	// the work runs; a backend that exits between samples loses what it spent since the
	// last. Each sample reads all of /proc, a few milliseconds of this process's CPU, which
	// competes with what is measured: every 50 ms took 6% of a core from a burn-down.
	// The connections of a burn-down live as long as it does, so a few samples a second
	// lose nothing of theirs.
	go func() {
		defer close(done)
		tick := time.NewTicker(250 * time.Millisecond)
		defer tick.Stop()
		for {
			for pid, t := range postgresCPU() {
				last[pid] = t
			}
			select {
			case <-stop:
				return
			case <-tick.C:
			}
		}
	}()
	return func() (pgCost, error) {
		close(stop)
		<-done
		var c pgCost
		for pid, t := range last {
			c.cpu += t - base[pid]
		}
		c.cpuKnown = len(last) > 0
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
		stat, err := os.ReadFile(filepath.Join(dir, "stat"))
		if err != nil {
			continue
		}
		// The fields after the command's closing parenthesis: utime and stime are the
		// 12th and 13th, in clock ticks (USER_HZ, 100 on Linux).
		fields := bytes.Fields(stat[bytes.LastIndexByte(stat, ')')+1:])
		if len(fields) < 13 {
			continue
		}
		utime, err1 := strconv.ParseInt(string(fields[11]), 10, 64)
		stime, err2 := strconv.ParseInt(string(fields[12]), 10, 64)
		pid, err3 := strconv.Atoi(filepath.Base(dir))
		if err1 != nil || err2 != nil || err3 != nil {
			continue
		}
		cpu[pid] = time.Duration(utime+stime) * 10 * time.Millisecond
	}
	return cpu
}
