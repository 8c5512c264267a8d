package safefile_test

import (
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/internal/safefile"
)

func TestOpenAndReadFile(t *testing.T) {
	dir := t.TempDir()
	reg := filepath.Join(dir, "a.json")
	require.NoError(t, os.WriteFile(reg, []byte("12345"), 0o644))
	link := filepath.Join(dir, "link.json")
	require.NoError(t, os.Symlink(reg, link))
	fifo := filepath.Join(dir, "fifo")
	require.NoError(t, syscall.Mkfifo(fifo, 0o644))

	tooLarge := errors.New("too large")
	b, err := safefile.ReadFile(link, 5, tooLarge)
	require.NoError(t, err, "a link to a regular file is followed")
	assert.Equal(t, "12345", string(b))
	_, err = safefile.ReadFile(reg, 4, tooLarge)
	assert.ErrorIs(t, err, tooLarge)
	for _, p := range []string{fifo, dir, "/dev/null"} {
		_, err := safefile.Open(p) // a FIFO must not block
		assert.ErrorIs(t, err, safefile.ErrNotRegular, p)
	}
	_, err = safefile.Open(filepath.Join(dir, "absent"))
	assert.ErrorIs(t, err, os.ErrNotExist)
}
