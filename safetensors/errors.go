package safetensors

import (
	"errors"

	"github.com/batchfit/batchfit/internal/safefile"
)

// The errors a File, Open or WriteFile returns wrap one of these; test
// with errors.Is. Each message names the file and, where there is one, the
// tensor.
var (
	// ErrFormat: the file is not valid safetensors (truncated, a header
	// that is not JSON or lies about offsets, shapes or dtypes, tensors
	// overlapping or leaving gaps), or a tensor to write is malformed.
	ErrFormat = errors.New("safetensors: malformed file")
	// ErrTooLarge: the header length exceeds MaxHeaderBytes, or a header
	// holds more tensors or dimensions than the bounds here allow.
	ErrTooLarge = errors.New("safetensors: too large")
	// ErrNotRegular: the path is a directory, FIFO, device or socket
	// (after following symbolic links), which could block or never end.
	ErrNotRegular = safefile.ErrNotRegular
	// ErrNotFound: no tensor of that name in the file.
	ErrNotFound = errors.New("safetensors: no such tensor")
	// ErrDType: a dtype this package does not know, or one the chosen
	// read or write cannot convert.
	ErrDType = errors.New("safetensors: unsupported dtype")
	// ErrShape: a destination or source slice whose length is not the
	// tensor's element (or byte) count.
	ErrShape = errors.New("safetensors: length mismatch")
)
