package safetensors

import (
	"bufio"
	"cmp"
	"encoding/binary"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"unicode/utf8"
	"unsafe"

	"github.com/batchfit/batchfit/half"
)

// Tensor is one tensor to write. Its values come from exactly one of
// Float32, Fill and Raw (none for a tensor with no elements).
type Tensor struct {
	Name  string
	DType DType // the stored type
	Shape []int
	// Float32 holds the values in row-major order; they are rounded to
	// DType (F32, BF16, F16 or F64) while streaming, a chunk at a time.
	Float32 []float32
	// Fill, when Float32 is nil, produces the values on demand: it fills
	// dst with the elements from index at on, in row-major order (a
	// transposing writer, say, gathers them from its own layout).
	Fill func(dst []float32, at int)
	// Raw is DType's little-endian bytes, written as they are.
	Raw []byte
}

func (t *Tensor) numel() (int64, error) {
	n := int64(1)
	for _, d := range t.Shape {
		if d < 0 {
			return 0, fmt.Errorf("%w: tensor %q: negative dimension in %v", ErrShape, t.Name, t.Shape)
		}
		if d != 0 && n > math.MaxInt64/int64(d) {
			return 0, fmt.Errorf("%w: tensor %q: shape %v overflows", ErrShape, t.Name, t.Shape)
		}
		n *= int64(d)
	}
	return n, nil
}

// check validates t and returns its byte length.
func (t *Tensor) check() (int64, error) {
	if !utf8.ValidString(t.Name) || t.Name == "__metadata__" {
		return 0, fmt.Errorf("%w: tensor name %q is not valid UTF-8 or is reserved", ErrFormat, t.Name)
	}
	if t.DType.Size() == 0 {
		return 0, fmt.Errorf("%w: tensor %q: %s", ErrDType, t.Name, t.DType)
	}
	n, err := t.numel()
	if err != nil {
		return 0, err
	}
	if len(t.Shape) > maxRank {
		return 0, fmt.Errorf("%w: tensor %q: %d dimensions, at most %d", ErrTooLarge, t.Name, len(t.Shape), maxRank)
	}
	bytes := n * t.DType.Size()
	if bytes/t.DType.Size() != n {
		return 0, fmt.Errorf("%w: tensor %q: %d elements of %s overflow", ErrShape, t.Name, n, t.DType)
	}
	sources := 0
	for _, set := range []bool{t.Float32 != nil, t.Fill != nil, t.Raw != nil} {
		if set {
			sources++
		}
	}
	switch {
	case sources > 1:
		return 0, fmt.Errorf("%w: tensor %q: set one of Float32, Fill and Raw", ErrFormat, t.Name)
	case sources == 0 && n != 0:
		return 0, fmt.Errorf("%w: tensor %q: %d elements and no values", ErrShape, t.Name, n)
	case t.Raw != nil && int64(len(t.Raw)) != bytes:
		return 0, fmt.Errorf("%w: tensor %q: %s %v is %d bytes, Raw holds %d", ErrShape, t.Name, t.DType, t.Shape, bytes, len(t.Raw))
	case (t.Float32 != nil || t.Fill != nil) && !t.DType.IsFloat():
		return 0, fmt.Errorf("%w: tensor %q: float values cannot be stored as %s", ErrDType, t.Name, t.DType)
	case t.Float32 != nil && int64(len(t.Float32)) != n:
		return 0, fmt.Errorf("%w: tensor %q: shape %v has %d elements, Float32 holds %d", ErrShape, t.Name, t.Shape, n, len(t.Float32))
	}
	return bytes, nil
}

// Encode writes tensors and metadata to w in the safetensors format, as
// the reference implementation lays them out: tensors sorted by dtype
// (widest first) then name, a compact JSON header with "__metadata__"
// first, padded with spaces to a multiple of 8 bytes. Values stream
// through a buffer of a few hundred KiB; nothing is copied whole.
func Encode(w io.Writer, tensors []Tensor, metadata map[string]string) error {
	order, header, err := prepare(tensors, metadata)
	if err != nil {
		return err
	}
	var lenBuf [8]byte
	binary.LittleEndian.PutUint64(lenBuf[:], uint64(len(header)))
	if _, err := w.Write(lenBuf[:]); err != nil {
		return err
	}
	if _, err := w.Write(header); err != nil {
		return err
	}
	var scratch []byte
	var vals []float32
	for _, i := range order {
		t := &tensors[i]
		switch {
		case t.Raw != nil:
			if _, err := w.Write(t.Raw); err != nil {
				return err
			}
		case t.Float32 != nil && t.DType == F32 && hostLittleEndian:
			if len(t.Float32) > 0 {
				if _, err := w.Write(unsafe.Slice((*byte)(unsafe.Pointer(&t.Float32[0])), 4*len(t.Float32))); err != nil {
					return err
				}
			}
		case t.Float32 != nil || t.Fill != nil:
			n, _ := t.numel()
			if scratch == nil {
				scratch, vals = make([]byte, chunkElems*8), make([]float32, chunkElems)
			}
			for at := 0; at < int(n); at += chunkElems {
				k := min(chunkElems, int(n)-at)
				src := vals[:k]
				if t.Float32 != nil {
					src = t.Float32[at : at+k]
				} else {
					t.Fill(src, at)
				}
				b := encodeFloats(scratch, src, t.DType)
				if _, err := w.Write(b); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// encodeFloats stores src as dt's little-endian bytes in buf.
func encodeFloats(buf []byte, src []float32, dt DType) []byte {
	le := binary.LittleEndian
	switch dt {
	case F32:
		for i, v := range src {
			le.PutUint32(buf[4*i:], math.Float32bits(v))
		}
	case F64:
		for i, v := range src {
			le.PutUint64(buf[8*i:], math.Float64bits(float64(v)))
		}
	case BF16:
		for i, v := range src {
			le.PutUint16(buf[2*i:], uint16(half.BF16From(v)))
		}
	case F16:
		for i, v := range src {
			le.PutUint16(buf[2*i:], uint16(half.F16From(v)))
		}
	}
	return buf[:int64(len(src))*dt.Size()]
}

// prepare validates the tensors, orders them and builds the header.
func prepare(tensors []Tensor, metadata map[string]string) ([]int, []byte, error) {
	if len(tensors) > maxTensors {
		return nil, nil, fmt.Errorf("%w: %d tensors, at most %d", ErrTooLarge, len(tensors), maxTensors)
	}
	sizes := make([]int64, len(tensors))
	seen := make(map[string]bool, len(tensors))
	for i := range tensors {
		n, err := tensors[i].check()
		if err != nil {
			return nil, nil, err
		}
		if seen[tensors[i].Name] {
			return nil, nil, fmt.Errorf("%w: tensor %q given twice", ErrFormat, tensors[i].Name)
		}
		seen[tensors[i].Name] = true
		sizes[i] = n
	}
	order := make([]int, len(tensors))
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int {
		if c := cmp.Compare(tensors[b].DType, tensors[a].DType); c != 0 {
			return c
		}
		return cmp.Compare(tensors[a].Name, tensors[b].Name)
	})
	h := []byte{'{'}
	if metadata != nil {
		keys := make([]string, 0, len(metadata))
		for k, v := range metadata {
			if !utf8.ValidString(k) || !utf8.ValidString(v) {
				return nil, nil, fmt.Errorf("%w: metadata %q: not valid UTF-8", ErrFormat, k)
			}
			keys = append(keys, k)
		}
		slices.Sort(keys)
		h = append(h, `"__metadata__":{`...)
		for i, k := range keys {
			if i > 0 {
				h = append(h, ',')
			}
			h = appendJSONString(h, k)
			h = append(h, ':')
			h = appendJSONString(h, metadata[k])
		}
		h = append(h, '}')
	}
	at := int64(0)
	for j, i := range order {
		t := &tensors[i]
		if j > 0 || metadata != nil {
			h = append(h, ',')
		}
		h = appendJSONString(h, t.Name)
		h = append(h, `:{"dtype":"`...)
		h = append(h, t.DType.String()...)
		h = append(h, `","shape":[`...)
		for k, d := range t.Shape {
			if k > 0 {
				h = append(h, ',')
			}
			h = strconv.AppendInt(h, int64(d), 10)
		}
		h = append(h, `],"data_offsets":[`...)
		h = strconv.AppendInt(h, at, 10)
		h = append(h, ',')
		at += sizes[i]
		h = strconv.AppendInt(h, at, 10)
		h = append(h, "]}"...)
	}
	h = append(h, '}')
	for len(h)%8 != 0 {
		h = append(h, ' ')
	}
	if len(h) > MaxHeaderBytes {
		return nil, nil, fmt.Errorf("%w: header of %d bytes, at most %d", ErrTooLarge, len(h), MaxHeaderBytes)
	}
	return order, h, nil
}

// appendJSONString quotes s as serde_json does: only '"', '\\' and control
// characters are escaped, so headers match the reference byte for byte.
func appendJSONString(b []byte, s string) []byte {
	const hex = "0123456789abcdef"
	b = append(b, '"')
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '"' || c == '\\':
			b = append(b, '\\', c)
		case c == '\b':
			b = append(b, '\\', 'b')
		case c == '\f':
			b = append(b, '\\', 'f')
		case c == '\n':
			b = append(b, '\\', 'n')
		case c == '\r':
			b = append(b, '\\', 'r')
		case c == '\t':
			b = append(b, '\\', 't')
		case c < 0x20:
			b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
		default:
			b = append(b, c)
		}
	}
	return append(b, '"')
}

// WriteFile writes tensors and metadata (Hugging Face's loaders expect
// {"format": "pt"}) to path atomically: into a temporary file beside it,
// synced, then renamed over path, so a reader never sees half a file and
// a failed write leaves path as it was.
func WriteFile(path string, tensors []Tensor, metadata map[string]string) (err error) {
	if _, _, err := prepare(tensors, metadata); err != nil { // fail before creating anything
		return fmt.Errorf("%s: %w", path, err)
	}
	dir := filepath.Dir(path)
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	bw := bufio.NewWriterSize(tmp, 1<<20)
	if err := Encode(bw, tensors, metadata); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	if err := bw.Flush(); err != nil {
		return err
	}
	if err := tmp.Chmod(0o644); err != nil {
		return err
	}
	if err := tmp.Sync(); err != nil {
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return err
	}
	syncDir(dir)
	return nil
}

// syncDir makes a rename in dir durable; failure only weakens durability
// (some filesystems refuse to sync directories), so it is not reported.
func syncDir(dir string) {
	if d, err := os.Open(dir); err == nil {
		d.Sync()
		d.Close()
	}
}
