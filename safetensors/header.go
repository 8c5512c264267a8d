package safetensors

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/bits"
	"slices"
	"unicode/utf8"
)

// MaxHeaderBytes bounds a header's length, as the reference implementation
// does: a longer one is refused with ErrTooLarge before anything is read.
const MaxHeaderBytes = 100_000_000

// Bounds on what a header may declare, so that parsing a hostile header
// of at most MaxHeaderBytes allocates a small multiple of it.
const (
	maxTensors = 1 << 20 // Llama 3.1 405B holds about 1,100 tensors in all
	maxRank    = 64
)

// TensorInfo is one tensor's entry in a header.
type TensorInfo struct {
	Name  string
	DType DType
	Shape []int
	// Begin and End are the tensor's byte range within the data that
	// follows the header (the file's data_offsets).
	Begin, End int64
}

// NumElements is the product of the shape (1 for a scalar).
func (t TensorInfo) NumElements() int64 { return (t.End - t.Begin) / t.DType.Size() }

// Bytes is the tensor's length in the file.
func (t TensorInfo) Bytes() int64 { return t.End - t.Begin }

// Header is a parsed, validated header: every tensor lies inside the data,
// its byte length is its dtype's size times its element count, and the
// tensors tile the data exactly, without gaps or overlaps.
type Header struct {
	// Tensors are in data order.
	Tensors []TensorInfo
	// Metadata is the "__metadata__" map, nil when the file has none.
	Metadata map[string]string
	index    map[string]int
}

// Lookup finds a tensor by name.
func (h *Header) Lookup(name string) (TensorInfo, bool) {
	i, ok := h.index[name]
	if !ok {
		return TensorInfo{}, false
	}
	return h.Tensors[i], true
}

// parseHeader parses and validates the JSON header b for data of dataLen
// bytes. Every error wraps ErrFormat or ErrTooLarge (or ErrDType for a
// dtype this package does not know).
func parseHeader(b []byte, dataLen int64) (*Header, error) {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: header: %s", ErrFormat, fmt.Sprintf(format, a...))
	}
	if !utf8.Valid(b) {
		return nil, bad("not UTF-8")
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	tok, err := dec.Token()
	if err != nil || tok != json.Delim('{') {
		return nil, bad("not a JSON object")
	}
	h := &Header{index: map[string]int{}}
	seenMeta := false
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, bad("%v", err)
		}
		name := tok.(string) // inside an object, a token before a value is its key
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return nil, bad("%q: %v", name, err)
		}
		if name == "__metadata__" {
			if seenMeta {
				return nil, bad("two __metadata__ entries")
			}
			seenMeta = true
			if h.Metadata, err = parseMetadata(raw); err != nil {
				return nil, bad("__metadata__: %v", err)
			}
			continue
		}
		if _, dup := h.index[name]; dup {
			return nil, bad("tensor %q declared twice", name)
		}
		if len(h.Tensors) == maxTensors {
			return nil, fmt.Errorf("%w: header: more than %d tensors", ErrTooLarge, maxTensors)
		}
		t, err := parseTensorInfo(name, raw)
		if err != nil {
			return nil, err
		}
		h.index[name] = len(h.Tensors)
		h.Tensors = append(h.Tensors, t)
	}
	if _, err := dec.Token(); err != nil { // the closing brace
		return nil, bad("%v", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, bad("data after the JSON object")
	}
	if err := h.validate(dataLen); err != nil {
		return nil, err
	}
	return h, nil
}

func parseMetadata(raw json.RawMessage) (map[string]string, error) {
	if string(raw) == "null" {
		return nil, nil
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil, errors.New("not an object of strings")
	}
	m := map[string]string{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, err
		}
		k := tok.(string)
		var v string
		if err := dec.Decode(&v); err != nil {
			return nil, fmt.Errorf("%q: values must be strings", k)
		}
		if _, dup := m[k]; dup {
			return nil, fmt.Errorf("key %q twice", k)
		}
		m[k] = v
	}
	return m, nil
}

// parseTensorInfo reads {"dtype": ..., "shape": [...], "data_offsets": [b, e]}
// and checks that the byte range is the dtype's size times the shape's
// product.
func parseTensorInfo(name string, raw json.RawMessage) (TensorInfo, error) {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: header: tensor %q: %s", ErrFormat, name, fmt.Sprintf(format, a...))
	}
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(raw, &fields); err != nil || fields == nil {
		return TensorInfo{}, bad("not an object")
	}
	for k := range fields {
		if k != "dtype" && k != "shape" && k != "data_offsets" {
			return TensorInfo{}, bad("unknown key %q", k)
		}
	}
	var dtype string
	var shape, offsets []uint64
	if err := json.Unmarshal(fields["dtype"], &dtype); err != nil || fields["dtype"] == nil {
		return TensorInfo{}, bad("dtype must be a string")
	}
	d, err := ParseDType(dtype)
	if err != nil {
		return TensorInfo{}, fmt.Errorf("header: tensor %q: %w", name, err)
	}
	if err := json.Unmarshal(fields["shape"], &shape); err != nil || shape == nil {
		return TensorInfo{}, bad("shape must be an array of non-negative integers")
	}
	if len(shape) > maxRank {
		return TensorInfo{}, fmt.Errorf("%w: header: tensor %q: %d dimensions, at most %d", ErrTooLarge, name, len(shape), maxRank)
	}
	if err := json.Unmarshal(fields["data_offsets"], &offsets); err != nil || len(offsets) != 2 {
		return TensorInfo{}, bad("data_offsets must be two non-negative integers")
	}
	b, e := offsets[0], offsets[1]
	if b > math.MaxInt64 || e > math.MaxInt64 || e < b {
		return TensorInfo{}, bad("data_offsets [%d, %d] are not a range", b, e)
	}
	n := uint64(1)
	dims := make([]int, len(shape))
	for i, s := range shape {
		if s > math.MaxInt64 {
			return TensorInfo{}, bad("dimension %d is too large", s)
		}
		dims[i] = int(s)
		hi, lo := bits.Mul64(n, s)
		if hi != 0 {
			return TensorInfo{}, bad("shape %v overflows", shape)
		}
		n = lo
	}
	hi, nbytes := bits.Mul64(n, uint64(d.Size()))
	if hi != 0 || nbytes != e-b {
		return TensorInfo{}, bad("%s %v needs %d×%d bytes, data_offsets [%d, %d] hold %d", d, dims, n, d.Size(), b, e, e-b)
	}
	return TensorInfo{Name: name, DType: d, Shape: dims, Begin: int64(b), End: int64(e)}, nil
}

// validate checks that the tensors tile [0, dataLen) exactly and sorts
// them into data order.
func (h *Header) validate(dataLen int64) error {
	slices.SortStableFunc(h.Tensors, func(a, b TensorInfo) int {
		if c := cmp.Compare(a.Begin, b.Begin); c != 0 {
			return c
		}
		return cmp.Compare(a.End, b.End)
	})
	at := int64(0)
	for i, t := range h.Tensors {
		if t.Begin != at {
			what := "overlaps the tensor before it"
			if t.Begin > at {
				what = "leaves a gap before it"
			}
			return fmt.Errorf("%w: header: tensor %q at [%d, %d] %s (which ends at %d)", ErrFormat, t.Name, t.Begin, t.End, what, at)
		}
		at = t.End
		h.index[t.Name] = i
	}
	if at != dataLen {
		return fmt.Errorf("%w: header: tensors cover %d bytes of data, the file holds %d", ErrFormat, at, dataLen)
	}
	return nil
}
