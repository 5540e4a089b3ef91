package embeddedpg

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// The credentials of every cluster: initdb is given them (the template's, or the
// library's when it makes the cluster), and Server.URL carries them.
const (
	superuser = "postgres"
	password  = "postgres"
)

// The encoding and locale of every cluster, whatever the environment says. initdb would
// take both from LANG and LC_*, and for a user whose session sets no locale (POSIX) it
// makes a SQL_ASCII cluster: one that stores any bytes as text unchecked, and where ICU
// collations cannot be made. C compares text byte by byte, which for UTF-8 is the order
// of code points, as C.UTF-8 orders it.
const (
	clusterEncoding = "UTF8"
	clusterLocale   = "C"
)

// seed fills the new cluster folder pgData with a copy of a template cluster of the
// binaries in binDir (version: their postgres --version), made by initdb the first time
// and kept in the folder parent (the temporary directory when empty); it returns the
// template's folder, or "" with an error. initdb costs about a second of CPU; the copy a
// tenth of that. initdb is the tool that makes the template: binDir's, or the
// privilege-dropping wrapper when we are root, and then runAs is the server's user.
// That user owns the template and the copies, and the copy does not open their files
// with root's rights: initdb and cp run as that user.
func seed(parent, pgData, binDir, version, initdb string, runAs *owner) (string, error) {
	dir, err := templateDir(parent, binDir, version)
	if err != nil {
		return "", err
	}
	removeLeftovers(filepath.Dir(dir))
	if _, err := os.Stat(filepath.Join(dir, "PG_VERSION")); err != nil {
		if err := makeTemplate(dir, initdb, runAs); err != nil {
			return "", err
		}
	}
	if err := copyCluster(dir, pgData, runAs); err != nil {
		return "", err
	}
	return dir, nil
}

// templateDir returns where the template of these binaries is kept: a folder of this
// user's in parent (the temporary directory when empty), one cluster per binaries,
// version and time zone (initdb writes the zone into the cluster; the locale is
// clusterLocale). The folder must be this user's alone, or another user of the machine
// could plant a cluster.
func templateDir(parent, binDir, version string) (string, error) {
	if parent == "" {
		parent = tempDir()
	}
	root := filepath.Join(parent, fmt.Sprintf("opbroker-pg-templates-%d", os.Geteuid()))
	if err := os.Mkdir(root, 0o755); err == nil {
		// Searchable by all, whatever the umask: as root, the server's user makes and
		// copies the template inside.
		if err := os.Chmod(root, 0o755); err != nil {
			return "", err
		}
	} else if !errors.Is(err, fs.ErrExist) {
		return "", err
	}
	fi, err := os.Lstat(root)
	if err != nil {
		return "", err
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !fi.IsDir() || !ok || int(st.Uid) != os.Geteuid() || fi.Mode().Perm()&0o022 != 0 {
		return "", fmt.Errorf("%s is not a folder of this user's alone", root)
	}
	sum := sha256.Sum256([]byte(strings.Join([]string{binDir, version, clusterEncoding, clusterLocale, os.Getenv("TZ")}, "\x00")))
	return filepath.Join(root, fmt.Sprintf("%x", sum[:8])), nil
}

// makeTemplate runs initdb into a scratch folder beside dir and renames the cluster to
// dir, so that a template is whole or absent. Two processes may make one at once: the
// first rename wins and the other's cluster is removed. The scratch folder is ours;
// only the cluster's folder inside it is runAs's. It is locked while it is in use
// (removeLeftovers).
func makeTemplate(dir, initdb string, runAs *owner) error {
	scratch, err := os.MkdirTemp(filepath.Dir(dir), filepath.Base(dir)+".new-")
	if err != nil {
		return err
	}
	lock, err := lockFolder(scratch, true)
	if err != nil {
		os.RemoveAll(scratch)
		return err
	}
	defer func() {
		os.RemoveAll(scratch)
		lock.Close()
	}()
	if err := os.Chmod(scratch, 0o755); err != nil {
		return err
	}
	// The wrapper hands the password file to runAs; in our folder it cannot be swapped.
	pwfile := filepath.Join(scratch, "pwfile")
	if err := os.WriteFile(pwfile, []byte(password), 0o600); err != nil {
		return err
	}
	cluster := filepath.Join(scratch, "data")
	if err := os.Mkdir(cluster, 0o700); err != nil {
		return err
	}
	if runAs != nil {
		if err := os.Chown(cluster, runAs.uid, runAs.gid); err != nil {
			return err
		}
	}
	out, err := exec.Command(initdb, "-A", "password", "-U", superuser, "-D", cluster, "--pwfile="+pwfile,
		"--encoding="+clusterEncoding, "--locale="+clusterLocale).CombinedOutput()
	if err != nil {
		return fmt.Errorf("initdb: %w: %s", err, out)
	}
	if err := os.Rename(cluster, dir); err != nil {
		if _, statErr := os.Stat(filepath.Join(dir, "PG_VERSION")); statErr != nil {
			return err
		}
	}
	return nil
}

// removeLeftovers removes from the templates' folder root what a process killed while
// it made or removed a template left there: a scratch folder (about 40 MB) or a
// template renamed aside. A live process holds a lock on such a folder (lockFolder),
// which the kernel releases however the process ends, so the folders that are not
// locked are leftovers. Between making its scratch folder and locking it, a process
// could lose it to this: its initdb then fails, and its server starts on a cluster of
// its own initdb. It is best effort: what cannot be removed now is tried again at the
// next cluster made from a template.
func removeLeftovers(root string) {
	entries, err := os.ReadDir(root)
	if err != nil {
		return
	}
	for _, e := range entries {
		if name := e.Name(); !strings.Contains(name, ".new-") && !strings.Contains(name, ".removed-") {
			continue
		}
		path := filepath.Join(root, e.Name())
		lock, err := lockFolder(path, false)
		if err != nil {
			continue // in use, gone, or not a folder
		}
		os.RemoveAll(path)
		lock.Close()
	}
}

// lockFolder takes an exclusive lock on the folder path (never a link to one), waiting
// for it when wait is set. The lock lasts until the file is closed or the process ends.
func lockFolder(path string, wait bool) (*os.File, error) {
	fd, err := syscall.Open(path, syscall.O_RDONLY|syscall.O_DIRECTORY|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0)
	if err != nil {
		return nil, &fs.PathError{Op: "open", Path: path, Err: err}
	}
	how := syscall.LOCK_EX
	if !wait {
		how |= syscall.LOCK_NB
	}
	if err := syscall.Flock(fd, how); err != nil {
		syscall.Close(fd)
		return nil, &fs.PathError{Op: "flock", Path: path, Err: err}
	}
	return os.NewFile(uintptr(fd), path), nil
}

// copyCluster copies the cluster dir to pgData with cp -R -p, which keeps every file's
// permissions (PostgreSQL refuses a cluster others can read), as runAs when it is set.
// The copy is made beside pgData and renamed, so that a cluster in pgData is whole.
func copyCluster(dir, pgData string, runAs *owner) error {
	if err := os.MkdirAll(filepath.Dir(pgData), 0o700); err != nil {
		return err
	}
	staging := aside(pgData, "copy")
	cp := exec.Command("cp", "-R", "-p", dir, staging)
	if runAs != nil {
		cp.SysProcAttr = &syscall.SysProcAttr{Credential: runAs.credential()}
	}
	if out, err := cp.CombinedOutput(); err != nil {
		os.RemoveAll(staging)
		return fmt.Errorf("cp: %w: %s", err, out)
	}
	if err := os.Rename(staging, pgData); err != nil {
		os.RemoveAll(staging)
		return err
	}
	return nil
}

// removeTemplate removes a template: renamed aside first, so that no process copies a
// half-removed one, and locked until it is gone (removeLeftovers). A template another
// process is removing is left to it.
func removeTemplate(dir string) error {
	lock, err := lockFolder(dir, false)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.EWOULDBLOCK) {
			return nil // another process removed it, or is removing it
		}
		return err
	}
	defer lock.Close()
	dead := aside(dir, "removed")
	if err := os.Rename(dir, dead); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil // another process removed it
		}
		return err
	}
	return os.RemoveAll(dead)
}

// aside returns a new name beside path, for what is made or removed there.
func aside(path, what string) string {
	return path + "." + what + "-" + strconv.FormatInt(time.Now().UnixNano(), 36)
}

// owner is an account that files are given.
type owner struct {
	name     string
	uid, gid int
}

// credential is the owner's, for a process run as it.
func (o *owner) credential() *syscall.Credential {
	return &syscall.Credential{Uid: uint32(o.uid), Gid: uint32(o.gid)}
}
