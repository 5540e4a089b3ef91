package embeddedpg

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"syscall"
)

// serverUsers are the accounts tried, in order, to run PostgreSQL when we are root.
var serverUsers = []string{"postgres", "nobody"}

// dropPrivileges prepares wrappers that run initdb and pg_ctl from binDir as the
// unprivileged user runAs, hands that user the cluster's folder, and returns the
// directory to use as the library's binaries path. The wrappers stay owned by root, so
// the server's user cannot change what root executes.
func dropPrivileges(dataDir, binDir string, runAs *owner) (string, error) {
	setpriv, err := exec.LookPath("setpriv")
	if err != nil {
		return "", errors.New("embeddedpg: running as root needs setpriv(1) (util-linux) to start PostgreSQL as an unprivileged user")
	}
	uid, gid := runAs.uid, runAs.gid
	if err := reachable(dataDir); err != nil {
		return "", fmt.Errorf("embeddedpg: PostgreSQL runs as %s, which cannot reach %s: %w; choose a data folder outside private directories (e.g. under /var/tmp)", runAs.name, dataDir, err)
	}

	pgDir := filepath.Join(dataDir, "pg")
	if err := os.MkdirAll(pgDir, 0o700); err != nil {
		return "", fmt.Errorf("embeddedpg: %w", err)
	}
	if err := os.Chown(pgDir, uid, gid); err != nil {
		return "", fmt.Errorf("embeddedpg: %w", err)
	}

	wrappers := filepath.Join(dataDir, "wrappers")
	if err := os.MkdirAll(filepath.Join(wrappers, "bin"), 0o755); err != nil {
		return "", fmt.Errorf("embeddedpg: %w", err)
	}
	drop := fmt.Sprintf("exec %s --reuid=%d --regid=%d --clear-groups --", setpriv, uid, gid)
	scripts := map[string]string{
		// The library writes initdb's password file as root with mode 0600; hand it over.
		"initdb": fmt.Sprintf("for arg; do case \"$arg\" in --pwfile=*) chown %d:%d \"${arg#--pwfile=}\";; esac; done\n%s %s \"$@\"\n",
			uid, gid, drop, filepath.Join(binDir, "bin", "initdb")),
		"pg_ctl": fmt.Sprintf("%s %s \"$@\"\n", drop, filepath.Join(binDir, "bin", "pg_ctl")),
	}
	for name, body := range scripts {
		script := "#!/bin/sh\n# Written by opbroker: PostgreSQL refuses to run as root.\n" + body
		if err := os.WriteFile(filepath.Join(wrappers, "bin", name), []byte(script), 0o755); err != nil {
			return "", fmt.Errorf("embeddedpg: %w", err)
		}
	}
	return wrappers, nil
}

// serverOwner returns serverUser as the owner of the server's files.
func serverOwner() (*owner, error) {
	u, err := serverUser()
	if err != nil {
		return nil, err
	}
	uid, err := strconv.Atoi(u.Uid)
	if err != nil {
		return nil, fmt.Errorf("embeddedpg: user %s: %w", u.Username, err)
	}
	gid, err := strconv.Atoi(u.Gid)
	if err != nil {
		return nil, fmt.Errorf("embeddedpg: user %s: %w", u.Username, err)
	}
	return &owner{name: u.Username, uid: uid, gid: gid}, nil
}

// ServerCredential returns the credential of the unprivileged account that runs
// PostgreSQL when we are root, for the processes of PostgreSQL's that another package
// starts as root (the formation's Patroni nodes): the same account, and the same
// errors, as the embedded server's.
func ServerCredential() (*syscall.Credential, error) {
	o, err := serverOwner()
	if err != nil {
		return nil, err
	}
	return o.credential(), nil
}

// serverUser returns the unprivileged account that runs PostgreSQL when we are root:
// the first of postgres and nobody that exists.
func serverUser() (*user.User, error) {
	for _, name := range serverUsers {
		if u, err := user.Lookup(name); err == nil && u.Uid != "0" {
			return u, nil
		}
	}
	return nil, fmt.Errorf("embeddedpg: running as root needs one of the users %v to run PostgreSQL", serverUsers)
}

// reachable checks that dir and every ancestor can be traversed by anyone, which an
// unprivileged user needs to reach its cluster.
func reachable(dir string) error {
	for d := dir; ; d = filepath.Dir(d) {
		fi, err := os.Stat(d)
		if err != nil {
			return err
		}
		if fi.Mode().Perm()&0o001 == 0 {
			return fmt.Errorf("%s is not searchable by other users", d)
		}
		if d == filepath.Dir(d) {
			return nil
		}
	}
}
