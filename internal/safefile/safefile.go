// Package safefile opens files that come from outside (checkpoints,
// configs, tokenizers) the one way they may be opened: non-blocking, so a
// FIFO cannot hang the open, and checked with fstat to be regular files
// (symbolic links are followed; what they reach must be regular), read
// within a byte bound.
package safefile

import (
	"errors"
	"fmt"
	"io"
	"os"
	"syscall"
)

// ErrNotRegular is a path that is a directory, FIFO, device or socket.
// safetensors, hf and tokenizer export it as their own ErrNotRegular.
var ErrNotRegular = errors.New("not a regular file")

// Open opens path for reading if it is a regular file.
func Open(path string) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	if !st.Mode().IsRegular() {
		f.Close()
		return nil, fmt.Errorf("%w: %s is a %s", ErrNotRegular, path, kind(st.Mode()))
	}
	return f, nil
}

func kind(m os.FileMode) string {
	switch {
	case m.IsDir():
		return "directory"
	case m&os.ModeNamedPipe != 0:
		return "FIFO"
	case m&os.ModeSocket != 0:
		return "socket"
	case m&os.ModeDevice != 0:
		return "device"
	}
	return m.Type().String()
}

// ReadFile reads a regular file of at most limit bytes; a longer one gives
// an error wrapping tooLarge.
func ReadFile(path string, limit int64, tooLarge error) ([]byte, error) {
	f, err := Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > limit {
		return nil, fmt.Errorf("%w: %s is over %d bytes", tooLarge, path, limit)
	}
	return b, nil
}
