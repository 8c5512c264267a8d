package regfile_test

import (
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/internal/regfile"
)

// A regular file within the limit opens and reads whole; one past it, a
// FIFO without a writer, a symlink to /dev/zero and a directory are
// refused at once (a blocking open of the FIFO would never return).
func TestOpen(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "ok")
	require.NoError(t, os.WriteFile(file, []byte("hello"), 0o644))
	data, err := regfile.ReadAll(file, 5)
	require.NoError(t, err)
	assert.Equal(t, "hello", string(data))
	_, err = regfile.ReadAll(file, 4)
	assert.ErrorIs(t, err, regfile.ErrTooLarge)

	fifo := filepath.Join(dir, "fifo")
	require.NoError(t, syscall.Mkfifo(fifo, 0o644))
	zero := filepath.Join(dir, "zero")
	require.NoError(t, os.Symlink("/dev/zero", zero))
	start := time.Now()
	for _, p := range []string{fifo, zero} {
		_, _, err := regfile.Open(p, 1<<30)
		assert.ErrorIs(t, err, regfile.ErrNotRegular, p)
	}
	assert.Less(t, time.Since(start), time.Second)
	_, _, err = regfile.Open(dir, 1<<30)
	assert.ErrorIs(t, err, regfile.ErrNotRegular)
	assert.ErrorIs(t, err, syscall.EISDIR)
	_, _, err = regfile.Open(filepath.Join(dir, "none"), 1)
	assert.True(t, errors.Is(err, os.ErrNotExist))
}
