//go:build crashpoints

package crashpoint

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Enabled reports whether this build has crash points (the build tag crashpoints).
const Enabled = true

type rule struct {
	action string
	nth    int // 0: every hit
	hits   int
}

var (
	once  sync.Once
	mu    sync.Mutex
	rules map[string]*rule
	// parseErr is reported at the first Hit: a mistyped rule must not pass silently.
	parseErr error
)

func load() {
	rules, parseErr = parse(os.Getenv(EnvVar))
}

// parse reads a spec of EnvVar.
func parse(spec string) (map[string]*rule, error) {
	out := map[string]*rule{}
	spec = strings.TrimSpace(spec)
	if spec == "" {
		return out, nil
	}
	for _, item := range strings.Split(spec, ",") {
		name, action, ok := strings.Cut(strings.TrimSpace(item), "=")
		if !ok {
			return nil, fmt.Errorf("%s: %q is not name=action", EnvVar, item)
		}
		r := &rule{nth: 1}
		action, count, hasCount := strings.Cut(action, "@")
		if hasCount {
			if count == "*" {
				r.nth = 0
			} else if n, err := strconv.Atoi(count); err == nil && n > 0 {
				r.nth = n
			} else {
				return nil, fmt.Errorf("%s: %q: @ takes a positive number or *", EnvVar, item)
			}
		}
		if action != "kill" && action != "pause" && action != "error" {
			return nil, fmt.Errorf("%s: %q: the action must be kill, pause or error", EnvVar, item)
		}
		r.action = action
		out[name] = r
	}
	return out, nil
}

// hit counts a pass of the rule's point and reports whether it fires. The caller holds mu.
func (r *rule) hit() bool {
	r.hits++
	return r.nth == 0 || r.hits == r.nth
}

// Hit passes the named point. It does nothing unless the point is enabled; then it
// kills or stops the process, or returns ErrInjected.
func Hit(name string) error {
	once.Do(load)
	if parseErr != nil {
		return parseErr
	}
	mu.Lock()
	r := rules[name]
	fire := r != nil && r.hit()
	mu.Unlock()
	if !fire {
		return nil
	}
	switch r.action {
	case "kill":
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {} // the signal is on its way
	case "pause":
		_ = syscall.Kill(os.Getpid(), syscall.SIGSTOP)
		return nil
	}
	return fmt.Errorf("%w at %s", ErrInjected, name)
}

// Clock returns the clock the broker's safety decisions read: the real time, off by
// ClockOffsetEnvVar when it is set.
func Clock() (func() time.Time, error) {
	spec := os.Getenv(ClockOffsetEnvVar)
	if spec == "" {
		return time.Now, nil
	}
	offset, err := time.ParseDuration(spec)
	if err != nil {
		return nil, fmt.Errorf("%s: %q is not a duration such as -10s", ClockOffsetEnvVar, spec)
	}
	return func() time.Time { return time.Now().Add(offset) }, nil
}
