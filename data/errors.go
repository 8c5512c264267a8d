package data

import (
	"errors"
	"fmt"
)

// Errors, checked with errors.Is.
var (
	// ErrNotRegular: the path names a directory, a device, a FIFO or a
	// socket, which would read as anything or block.
	ErrNotRegular = errors.New("data: not a regular file")
	// ErrFormat: the file is not a token file of the format asked for, or
	// of any format known (FormatAuto): an unknown llm.c version, a size
	// that is not a whole number of tokens, a big-endian host.
	ErrFormat = errors.New("data: not a token file of a known format")
	// ErrSize: the file's size is not what its header says.
	ErrSize = errors.New("data: file size disagrees with its header")
	// ErrChanged: the file changed while mapped (truncated under the
	// loader: reading the mapping faulted).
	ErrChanged = errors.New("data: file changed while mapped")
	// ErrToken: a token is outside the vocabulary (WindowOptions.Vocab).
	ErrToken = errors.New("data: token outside the vocabulary")
	// ErrOptions: options or arguments out of range.
	ErrOptions = errors.New("data: invalid options")
	// ErrPosition: a resume position of another seed or dataset, or out
	// of range.
	ErrPosition = errors.New("data: position does not belong to this loader")
	// ErrClosed: the loader was closed.
	ErrClosed = errors.New("data: loader closed")
)

// FileError is an error reading the token file at Path.
type FileError struct {
	Path string
	Err  error
}

func (e *FileError) Error() string { return fmt.Sprintf("data: %s: %v", e.Path, e.Err) }
func (e *FileError) Unwrap() error { return e.Err }

// errorf wraps kind with a message: errors.Is(err, kind) holds.
func errorf(kind error, format string, args ...any) error {
	return fmt.Errorf("%w: %s", kind, fmt.Sprintf(format, args...))
}
