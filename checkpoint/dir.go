package checkpoint

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"

	"github.com/batchfit/batchfit/internal/safefile"
)

// A directory of checkpoints holds ckpt-NNNNNNNN directories (the step,
// eight digits or more; "-K" added when a name is taken already, as
// after a resume that saves a step again) and the file LatestFile naming
// the latest. A save builds its checkpoint in a hidden temporary
// directory beside them, syncs every file and the directory, renames it
// to its name, syncs the parent and then replaces the pointer the same
// way: a crash at any point leaves the pointer naming a complete
// checkpoint.

// checkpointName is the directory name of the checkpoint of step, the
// k-th of that step (k = 0 first).
func checkpointName(step, k int) string {
	if k == 0 {
		return fmt.Sprintf("ckpt-%08d", step)
	}
	return fmt.Sprintf("ckpt-%08d-%d", step, k)
}

// parseName reads a checkpointName.
func parseName(name string) (step, k int, ok bool) {
	rest, found := strings.CutPrefix(name, "ckpt-")
	if !found {
		return 0, 0, false
	}
	digits, suffix, hasK := strings.Cut(rest, "-")
	step, err := strconv.Atoi(digits)
	if err != nil || step < 0 || len(digits) < 8 || digits[0] == '+' {
		return 0, 0, false
	}
	if hasK {
		if k, err = strconv.Atoi(suffix); err != nil || k < 1 || suffix[0] == '+' || suffix[0] == '0' {
			return 0, 0, false
		}
	}
	return step, k, checkpointName(step, k) == name
}

// Latest is the path of the latest checkpoint in dir (the one its latest
// pointer names), or an error wrapping ErrNoCheckpoint when there is
// none. A dir that is itself a checkpoint is returned as it is.
func Latest(dir string) (string, error) {
	if _, err := os.Lstat(filepath.Join(dir, ManifestFile)); err == nil {
		return dir, nil
	}
	b, err := readBounded(filepath.Join(dir, LatestFile), maxLatestBytes)
	if errors.Is(err, os.ErrNotExist) {
		return "", fmt.Errorf("%w in %s (no %s, no %s)", ErrNoCheckpoint, dir, ManifestFile, LatestFile)
	}
	if err != nil {
		return "", fmt.Errorf("checkpoint: %w", err)
	}
	name := strings.TrimSuffix(string(b), "\n")
	if _, _, ok := parseName(name); !ok {
		return "", fmt.Errorf("%w: %s names %q, not a checkpoint directory", ErrCorrupt, filepath.Join(dir, LatestFile), name)
	}
	return filepath.Join(dir, name), nil
}

// commit renames the complete checkpoint tmp in dir to its step's first
// free name, makes it durable and points latest at it.
func commit(dir, tmp string, step int) (string, error) {
	var path string
	for k := 0; ; k++ {
		path = filepath.Join(dir, checkpointName(step, k))
		if _, err := os.Lstat(path); errors.Is(err, os.ErrNotExist) {
			break
		} else if err != nil {
			return "", err
		}
	}
	if err := os.Rename(tmp, path); err != nil {
		return "", err
	}
	if err := syncDir(dir); err != nil {
		return "", err
	}
	if testHook != nil {
		testHook("committed")
	}
	return path, writeAtomic(filepath.Join(dir, LatestFile), []byte(filepath.Base(path)+"\n"))
}

// prune removes the checkpoints of dir older than the keep newest of
// those up to the latest's step (those of later steps, a continuation
// abandoned by loading an older checkpoint, are left alone), and the
// temporary directories of saves that did not finish.
func prune(dir, latest string, keep int) error {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	top, topK, _ := parseName(filepath.Base(latest))
	type ck struct {
		name    string
		step, k int
	}
	var older []ck
	var errs []error
	for _, e := range ents {
		name := e.Name()
		if strings.HasPrefix(name, ".ckpt-") && strings.Contains(name, ".tmp-") && e.IsDir() ||
			strings.HasPrefix(name, "."+LatestFile+".tmp-") && e.Type().IsRegular() {
			errs = append(errs, os.RemoveAll(filepath.Join(dir, name)))
			continue
		}
		step, k, ok := parseName(name)
		if !ok || !e.IsDir() || name == filepath.Base(latest) || step > top || step == top && k > topK {
			continue
		}
		older = append(older, ck{name, step, k})
	}
	slices.SortFunc(older, func(a, b ck) int {
		if a.step != b.step {
			return b.step - a.step
		}
		return b.k - a.k
	})
	for i, c := range older {
		if i >= keep-1 {
			errs = append(errs, os.RemoveAll(filepath.Join(dir, c.name)))
		}
	}
	return errors.Join(errs...)
}

// writeAtomic writes b to path through a synced temporary file beside it
// and a rename, then syncs the directory.
func writeAtomic(path string, b []byte) error {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return err
	}
	_, err = f.Write(b)
	if err == nil {
		err = f.Chmod(0o644)
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), path)
	}
	if err != nil {
		os.Remove(f.Name())
		return err
	}
	return syncDir(dir)
}

// syncDir makes the entries of dir durable. Filesystems that cannot sync
// a directory (EINVAL) are let be: their renames are as durable as they
// get.
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	err = d.Sync()
	if cerr := d.Close(); err == nil {
		err = cerr
	}
	if errors.Is(err, errors.ErrUnsupported) || errors.Is(err, syscall.EINVAL) {
		return nil
	}
	return err
}

// readBounded reads the regular file at path of at most limit bytes; a
// larger one is ErrTooLarge (and safefile's).
func readBounded(path string, limit int64) ([]byte, error) {
	b, err := safefile.ReadAll(path, limit)
	if errors.Is(err, safefile.ErrTooLarge) {
		return nil, fmt.Errorf("%w: %w", ErrTooLarge, err)
	}
	return b, err
}
