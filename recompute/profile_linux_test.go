package recompute_test

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/internal/safefile"
	"github.com/batchfit/batchfit/recompute"
)

// A profile path that is a FIFO (no writer) or a symlink to /dev/zero is
// refused at once with ErrProfile, instead of blocking in open(2) or
// reading without end.
func TestLoadProfileRefusesNonRegularFiles(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "fifo.json")
	require.NoError(t, syscall.Mkfifo(fifo, 0o644))
	zero := filepath.Join(dir, "zero.json")
	require.NoError(t, os.Symlink("/dev/zero", zero))
	done := make(chan struct{})
	go func() {
		defer close(done)
		for _, p := range []string{fifo, zero} {
			_, err := recompute.LoadProfile(p)
			assert.ErrorIs(t, err, recompute.ErrProfile, p)
			assert.ErrorIs(t, err, safefile.ErrNotRegular, p)
		}
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("LoadProfile blocked on a FIFO")
	}
}
