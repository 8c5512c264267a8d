package safetensors

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"unsafe"

	"github.com/batchfit/batchfit/half"
	"github.com/batchfit/batchfit/internal/safefile"
)

// File is an open safetensors file whose header has been validated. Its
// reads stream from the file into the caller's slices (pread, so they may
// run concurrently); nothing but the header is held in memory.
type File struct {
	path      string
	f         *os.File
	dataStart int64
	h         *Header
}

// Open opens and validates a safetensors file. Symbolic links are followed
// (Hugging Face's cache links snapshots to blobs), but what they reach must
// be a regular file: it is opened non-blocking and checked with fstat, so
// a FIFO, device or directory fails with ErrNotRegular at once.
func Open(path string) (*File, error) {
	// No bound on the file's size: reads stream, and the header has its
	// own (MaxHeaderBytes).
	f, size, err := safefile.Open(path, math.MaxInt64)
	if err != nil {
		return nil, err
	}
	fail := func(err error) (*File, error) {
		f.Close()
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if size < 8 {
		return fail(fmt.Errorf("%w: %d bytes, shorter than the 8-byte header length", ErrFormat, size))
	}
	var lenBuf [8]byte
	if err := readFull(f, lenBuf[:], 0); err != nil {
		return fail(err)
	}
	n := binary.LittleEndian.Uint64(lenBuf[:])
	if n > MaxHeaderBytes {
		return fail(fmt.Errorf("%w: header of %d bytes, at most %d", ErrTooLarge, n, MaxHeaderBytes))
	}
	if n > uint64(size-8) {
		return fail(fmt.Errorf("%w: header of %d bytes in a file of %d (truncated?)", ErrFormat, n, size))
	}
	hb := make([]byte, n)
	if err := readFull(f, hb, 8); err != nil {
		return fail(err)
	}
	h, err := parseHeader(hb, size-8-int64(n))
	if err != nil {
		return fail(err)
	}
	return &File{path: path, f: f, dataStart: 8 + int64(n), h: h}, nil
}

// readFull reads len(b) bytes at off; a short read means the file shrank
// under us or lied, and wraps ErrFormat.
func readFull(f *os.File, b []byte, off int64) error {
	n, err := f.ReadAt(b, off)
	if n == len(b) {
		return nil
	}
	if err == nil || errors.Is(err, io.EOF) {
		return fmt.Errorf("%w: %d bytes at offset %d, the file ends after %d (truncated while open?)", ErrFormat, len(b), off, n)
	}
	return err
}

// Close closes the file.
func (f *File) Close() error { return f.f.Close() }

// Path is the path the file was opened with.
func (f *File) Path() string { return f.path }

// Header is the file's validated header.
func (f *File) Header() *Header { return f.h }

// Tensors lists the tensors in data order.
func (f *File) Tensors() []TensorInfo { return f.h.Tensors }

// Tensor finds a tensor by name.
func (f *File) Tensor(name string) (TensorInfo, bool) { return f.h.Lookup(name) }

// Metadata is the file's "__metadata__" map, nil when it has none.
func (f *File) Metadata() map[string]string { return f.h.Metadata }

func (f *File) lookup(name string) (TensorInfo, error) {
	t, ok := f.h.Lookup(name)
	if !ok {
		return TensorInfo{}, fmt.Errorf("%w: %s: %q", ErrNotFound, f.path, name)
	}
	return t, nil
}

func (f *File) lengthErr(t TensorInfo, what string, got int64) error {
	return fmt.Errorf("%w: %s: tensor %q (%s %v) has %d elements, the destination %s holds %d",
		ErrShape, f.path, t.Name, t.DType, t.Shape, t.NumElements(), what, got)
}

func (f *File) dtypeErr(t TensorInfo, read string, want string) error {
	return fmt.Errorf("%w: %s: tensor %q is %s; %s reads %s", ErrDType, f.path, t.Name, t.DType, read, want)
}

// Section is a reader of the tensor's raw little-endian bytes.
func (f *File) Section(name string) (*io.SectionReader, error) {
	t, err := f.lookup(name)
	if err != nil {
		return nil, err
	}
	return io.NewSectionReader(f.f, f.dataStart+t.Begin, t.Bytes()), nil
}

// ReadRaw copies the tensor's bytes, as stored (little-endian), into dst,
// which must be exactly the tensor's length.
func (f *File) ReadRaw(name string, dst []byte) error {
	t, err := f.lookup(name)
	if err != nil {
		return err
	}
	if int64(len(dst)) != t.Bytes() {
		return fmt.Errorf("%w: %s: tensor %q has %d bytes, the destination holds %d", ErrShape, f.path, name, t.Bytes(), len(dst))
	}
	return f.read(dst, t.Begin)
}

func (f *File) read(dst []byte, at int64) error {
	if err := readFull(f.f, dst, f.dataStart+at); err != nil {
		return fmt.Errorf("%s: %w", f.path, err)
	}
	return nil
}

// chunkElems is how many elements a converting read holds in its buffer at
// once (256 KiB of 8-byte values): the only memory a read adds to dst.
const chunkElems = 1 << 15

// chunks calls fn for consecutive pieces of the tensor's bytes, each of at
// most chunkElems elements, with the index of its first element.
func (f *File) chunks(t TensorInfo, fn func(b []byte, first int)) error {
	size := t.DType.Size()
	buf := make([]byte, min(t.Bytes(), chunkElems*size))
	for at := int64(0); at < t.Bytes(); at += int64(len(buf)) {
		b := buf[:min(int64(len(buf)), t.Bytes()-at)]
		if err := f.read(b, t.Begin+at); err != nil {
			return err
		}
		fn(b, int(at/size))
	}
	return nil
}

// hostLittleEndian reports whether float32 slices can receive a file's
// bytes as they are.
var hostLittleEndian = binary.NativeEndian.Uint16([]byte{1, 0}) == 1

// ReadFloat32 reads a floating-point tensor into dst, which must hold
// exactly its elements: F32 is read straight into dst, BF16 and F16 are
// widened exactly, F64 is rounded to nearest.
func (f *File) ReadFloat32(name string, dst []float32) error {
	t, err := f.lookup(name)
	if err != nil {
		return err
	}
	if !t.DType.IsFloat() {
		return f.dtypeErr(t, "ReadFloat32", "F32, BF16, F16 and F64")
	}
	if int64(len(dst)) != t.NumElements() {
		return f.lengthErr(t, "[]float32", int64(len(dst)))
	}
	if len(dst) == 0 {
		return nil
	}
	if t.DType == F32 && hostLittleEndian {
		return f.read(unsafe.Slice((*byte)(unsafe.Pointer(&dst[0])), 4*len(dst)), t.Begin)
	}
	return f.chunks(t, func(b []byte, first int) {
		out := dst[first:]
		switch t.DType {
		case F32:
			for i := range len(b) / 4 {
				out[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
			}
		case F64:
			for i := range len(b) / 8 {
				out[i] = float32(math.Float64frombits(binary.LittleEndian.Uint64(b[8*i:])))
			}
		case BF16:
			for i := range len(b) / 2 {
				out[i] = half.BF16(binary.LittleEndian.Uint16(b[2*i:])).Float32()
			}
		case F16:
			for i := range len(b) / 2 {
				out[i] = half.F16(binary.LittleEndian.Uint16(b[2*i:])).Float32()
			}
		}
	})
}

// ReadFloat64 reads a floating-point tensor into dst, exactly.
func (f *File) ReadFloat64(name string, dst []float64) error {
	t, err := f.lookup(name)
	if err != nil {
		return err
	}
	if !t.DType.IsFloat() {
		return f.dtypeErr(t, "ReadFloat64", "F64, F32, BF16 and F16")
	}
	if int64(len(dst)) != t.NumElements() {
		return f.lengthErr(t, "[]float64", int64(len(dst)))
	}
	return f.chunks(t, func(b []byte, first int) {
		out := dst[first:]
		switch t.DType {
		case F64:
			for i := range len(b) / 8 {
				out[i] = math.Float64frombits(binary.LittleEndian.Uint64(b[8*i:]))
			}
		case F32:
			for i := range len(b) / 4 {
				out[i] = float64(math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:])))
			}
		case BF16:
			for i := range len(b) / 2 {
				out[i] = float64(half.BF16(binary.LittleEndian.Uint16(b[2*i:])).Float32())
			}
		case F16:
			for i := range len(b) / 2 {
				out[i] = float64(half.F16(binary.LittleEndian.Uint16(b[2*i:])).Float32())
			}
		}
	})
}

// ReadInt64 reads an integer or BOOL tensor into dst. A BOOL byte other
// than 0 or 1, or a U64 above the int64 range, is an ErrFormat error.
func (f *File) ReadInt64(name string, dst []int64) error {
	t, err := f.lookup(name)
	if err != nil {
		return err
	}
	switch t.DType {
	case I64, I32, I16, I8, U64, U32, U16, U8, BOOL:
	default:
		return f.dtypeErr(t, "ReadInt64", "I64, I32, I16, I8, U64, U32, U16, U8 and BOOL")
	}
	if int64(len(dst)) != t.NumElements() {
		return f.lengthErr(t, "[]int64", int64(len(dst)))
	}
	var bad error
	err = f.chunks(t, func(b []byte, first int) {
		out := dst[first:]
		le := binary.LittleEndian
		switch t.DType {
		case I64:
			for i := range len(b) / 8 {
				out[i] = int64(le.Uint64(b[8*i:]))
			}
		case U64:
			for i := range len(b) / 8 {
				v := le.Uint64(b[8*i:])
				if v > math.MaxInt64 && bad == nil {
					bad = fmt.Errorf("%w: %s: tensor %q: element %d is %d, beyond int64", ErrFormat, f.path, name, first+i, v)
				}
				out[i] = int64(v)
			}
		case I32:
			for i := range len(b) / 4 {
				out[i] = int64(int32(le.Uint32(b[4*i:])))
			}
		case U32:
			for i := range len(b) / 4 {
				out[i] = int64(le.Uint32(b[4*i:]))
			}
		case I16:
			for i := range len(b) / 2 {
				out[i] = int64(int16(le.Uint16(b[2*i:])))
			}
		case U16:
			for i := range len(b) / 2 {
				out[i] = int64(le.Uint16(b[2*i:]))
			}
		case I8:
			for i, v := range b {
				out[i] = int64(int8(v))
			}
		case U8:
			for i, v := range b {
				out[i] = int64(v)
			}
		case BOOL:
			for i, v := range b {
				if v > 1 && bad == nil {
					bad = fmt.Errorf("%w: %s: tensor %q: BOOL element %d is byte %d", ErrFormat, f.path, name, first+i, v)
				}
				out[i] = int64(v)
			}
		}
	})
	if err != nil {
		return err
	}
	return bad
}
