package embeddedpg

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// The credentials of every cluster: initdb is given them, and URL carries them. They
// are the library's defaults, which its own initdb uses.
const (
	superuser = "postgres"
	password  = "postgres"
)

// seed fills the new cluster folder pgData with a copy of a template cluster of the
// binaries in binDir, made by initdb the first time and kept in the temporary directory.
// initdb costs about a second of CPU; the copy a tenth of that. initdb is the tool that
// makes the template: binDir's, or the privilege-dropping wrapper when we are root, and
// then owner is the server's user, who is given the copy. On an error pgData is left
// absent.
func seed(pgData, binDir, initdb string, major int, owner *owner) error {
	dir, err := templateDir(binDir, major)
	if err != nil {
		return err
	}
	if _, err := os.Stat(filepath.Join(dir, "PG_VERSION")); err != nil {
		if err := makeTemplate(dir, initdb, owner); err != nil {
			return err
		}
	}
	if err := os.MkdirAll(filepath.Dir(pgData), 0o700); err != nil {
		return err
	}
	if err := copyCluster(dir, pgData, owner); err != nil {
		os.RemoveAll(pgData)
		return err
	}
	return nil
}

// templateDir returns where the template of these binaries is kept: a folder of this
// user's in the temporary directory, one cluster per binaries, major version and locale.
// The folder must be this user's alone, or another user of the machine could plant a
// cluster.
func templateDir(binDir string, major int) (string, error) {
	root := filepath.Join(os.TempDir(), fmt.Sprintf("opbroker-pg-templates-%d", os.Geteuid()))
	// Searchable by all: when we are root the server's user makes the template inside.
	if err := os.Mkdir(root, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
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
	// initdb takes the cluster's locale from the environment.
	key := []string{binDir, strconv.Itoa(major)}
	for _, name := range []string{"LC_ALL", "LC_COLLATE", "LC_CTYPE", "LC_MESSAGES", "LC_MONETARY", "LC_NUMERIC", "LC_TIME", "LANG"} {
		key = append(key, os.Getenv(name))
	}
	sum := sha256.Sum256([]byte(strings.Join(key, "\x00")))
	return filepath.Join(root, fmt.Sprintf("%d-%x", major, sum[:8])), nil
}

// makeTemplate runs initdb into a scratch folder beside dir and renames the cluster to
// dir, so that a template is whole or absent. Two processes may make one at once: the
// first rename wins and the other's cluster is removed.
func makeTemplate(dir, initdb string, owner *owner) error {
	scratch, err := os.MkdirTemp(filepath.Dir(dir), filepath.Base(dir)+".new-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(scratch)
	if owner != nil {
		if err := os.Chown(scratch, owner.uid, owner.gid); err != nil {
			return err
		}
	}
	pwfile := filepath.Join(scratch, "pwfile")
	if err := os.WriteFile(pwfile, []byte(password), 0o600); err != nil {
		return err
	}
	cluster := filepath.Join(scratch, "data")
	out, err := exec.Command(initdb, "-A", "password", "-U", superuser, "-D", cluster, "--pwfile="+pwfile).CombinedOutput()
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

// owner is an account that files are given.
type owner struct {
	name     string
	uid, gid int
}

// copyCluster copies the cluster src to dst, which must not exist, keeping every file's
// permissions (PostgreSQL refuses a cluster others can read).
func copyCluster(src, dst string, owner *owner) error {
	return filepath.WalkDir(src, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, path)
		if err != nil {
			return err
		}
		target := filepath.Join(dst, rel)
		fi, err := d.Info()
		if err != nil {
			return err
		}
		switch {
		case d.IsDir():
			err = os.Mkdir(target, fi.Mode().Perm())
		case d.Type().IsRegular():
			err = copyFile(path, target, fi.Mode().Perm())
		default:
			return fmt.Errorf("%s: neither a folder nor a file", path)
		}
		if err != nil {
			return err
		}
		if owner != nil {
			return os.Lchown(target, owner.uid, owner.gid)
		}
		return nil
	})
}

func copyFile(src, dst string, perm fs.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, perm)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}
