package safefile_test

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/internal/safefile"
)

// A regular file within the limit opens and reads whole, through a
// symbolic link too; one past the limit, a FIFO without a writer, a
// symlink to /dev/zero, /dev/null and a directory are refused at once (a
// blocking open of the FIFO would never return).
func TestOpen(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "ok")
	require.NoError(t, os.WriteFile(file, []byte("hello"), 0o644))
	data, err := safefile.ReadAll(file, 5)
	require.NoError(t, err)
	assert.Equal(t, "hello", string(data))
	_, err = safefile.ReadAll(file, 4)
	assert.ErrorIs(t, err, safefile.ErrTooLarge)
	_, _, err = safefile.Open(file, 4)
	assert.ErrorIs(t, err, safefile.ErrTooLarge, "decided from fstat, before a read")

	link := filepath.Join(dir, "link")
	require.NoError(t, os.Symlink(file, link))
	f, size, err := safefile.Open(link, 5)
	require.NoError(t, err, "a link to a regular file is followed")
	assert.Equal(t, int64(5), size)
	require.NoError(t, f.Close())

	fifo := filepath.Join(dir, "fifo")
	require.NoError(t, syscall.Mkfifo(fifo, 0o644))
	zero := filepath.Join(dir, "zero")
	require.NoError(t, os.Symlink("/dev/zero", zero))
	start := time.Now()
	for _, p := range []string{fifo, zero, "/dev/null"} {
		_, _, err := safefile.Open(p, 1<<30)
		assert.ErrorIs(t, err, safefile.ErrNotRegular, p)
	}
	assert.Less(t, time.Since(start), time.Second)
	_, _, err = safefile.Open(dir, 1<<30)
	assert.ErrorIs(t, err, safefile.ErrNotRegular)
	assert.ErrorIs(t, err, syscall.EISDIR)
	_, _, err = safefile.Open(filepath.Join(dir, "none"), 1)
	assert.ErrorIs(t, err, os.ErrNotExist)
}
