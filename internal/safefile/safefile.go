package safefile

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"syscall"
)

// Errors Open and ReadAll return, inside an *fs.PathError naming the path.
// Packages that export their own (safetensors, tokenizer) alias
// ErrNotRegular, and wrap ErrTooLarge in theirs.
var (
	// ErrNotRegular: the path (after symlinks) is a directory, FIFO,
	// device or socket, which could block or never end.
	ErrNotRegular = errors.New("not a regular file")
	// ErrTooLarge: the file is larger than the caller's limit.
	ErrTooLarge = errors.New("file too large")
)

// Open opens path for reading if it is a regular file of at most limit
// bytes, and returns it with its size. A directory's error also wraps
// syscall.EISDIR; a missing or unreadable file's is the os error
// (errors.Is fs.ErrNotExist, fs.ErrPermission).
func Open(path string, limit int64) (*os.File, int64, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
	if err != nil {
		return nil, 0, err
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, 0, err
	}
	switch {
	case fi.IsDir():
		f.Close()
		return nil, 0, &fs.PathError{Op: "open", Path: path, Err: fmt.Errorf("%w (a directory): %w", ErrNotRegular, syscall.EISDIR)}
	case !fi.Mode().IsRegular():
		f.Close()
		return nil, 0, &fs.PathError{Op: "open", Path: path, Err: fmt.Errorf("%w (%s)", ErrNotRegular, kind(fi.Mode()))}
	case fi.Size() > limit:
		f.Close()
		return nil, 0, &fs.PathError{Op: "open", Path: path, Err: fmt.Errorf("%w: %d bytes, more than %d", ErrTooLarge, fi.Size(), limit)}
	}
	return f, fi.Size(), nil
}

// ReadAll reads the regular file path of at most limit bytes (Open's
// checks), stopping at limit bytes should it grow meanwhile.
func ReadAll(path string, limit int64) ([]byte, error) {
	f, size, err := Open(path, limit)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data := make([]byte, 0, size+1)
	for {
		n, err := f.Read(data[len(data):cap(data)])
		data = data[:len(data)+n]
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, err
		}
		if int64(len(data)) > limit {
			return nil, &fs.PathError{Op: "read", Path: path, Err: fmt.Errorf("%w: grew past %d bytes while read", ErrTooLarge, limit)}
		}
		if len(data) == cap(data) {
			data = append(data, 0)[:len(data)]
		}
	}
	return data, nil
}

// kind names a file mode's type for an error.
func kind(m fs.FileMode) string {
	switch {
	case m&fs.ModeNamedPipe != 0:
		return "a named pipe"
	case m&fs.ModeCharDevice != 0:
		return "a character device"
	case m&fs.ModeDevice != 0:
		return "a block device"
	case m&fs.ModeSocket != 0:
		return "a socket"
	}
	return "mode " + m.Type().String()
}
