package safetensors

import (
	"bytes"
	"errors"
	"testing"
)

// FuzzParseHeader feeds arbitrary headers to the parser: it must never
// panic, every error must be one of the package's typed errors, and a
// header it accepts must tile its data exactly and survive being written
// again and parsed back unchanged. The seeds (and testdata/fuzz) run as a
// normal test; `go test -fuzz FuzzParseHeader ./safetensors/` explores.
func FuzzParseHeader(f *testing.F) {
	f.Add([]byte(`{"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}}`), int64(24))
	f.Add([]byte(`{"__metadata__":{"format":"pt"},"w":{"dtype":"BF16","shape":[4],"data_offsets":[0,8]},"b":{"dtype":"F16","shape":[],"data_offsets":[8,10]}}`), int64(10))
	f.Add([]byte(`{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},"b":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}`), int64(0))
	f.Add([]byte(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}`), int64(8))
	f.Add([]byte(`{"a":{"dtype":"I64","shape":[1],"data_offsets":[8,16]},"b":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}}  `), int64(16))
	f.Add([]byte(`{}`), int64(0))
	f.Add([]byte(`{"__metadata__":null}`), int64(0))
	f.Add([]byte(`{"a":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8]}}`), int64(8))
	f.Fuzz(func(t *testing.T, b []byte, dataLen int64) {
		if dataLen < 0 {
			return
		}
		h, err := parseHeader(b, dataLen)
		if err != nil {
			if !errors.Is(err, ErrFormat) && !errors.Is(err, ErrTooLarge) && !errors.Is(err, ErrDType) {
				t.Fatalf("untyped error %v", err)
			}
			return
		}
		at := int64(0)
		for _, ti := range h.Tensors {
			if ti.Begin != at || ti.End < ti.Begin || ti.NumElements()*ti.DType.Size() != ti.Bytes() {
				t.Fatalf("accepted a header that does not tile its data: %+v", ti)
			}
			if got, ok := h.Lookup(ti.Name); !ok || got.Begin != ti.Begin {
				t.Fatalf("index disagrees for %q", ti.Name)
			}
			at = ti.End
		}
		if at != dataLen {
			t.Fatalf("tensors cover %d of %d bytes", at, dataLen)
		}
		// Written again (in the writer's order), the header parses back to
		// the same tensors.
		ts := make([]Tensor, len(h.Tensors))
		for i, ti := range h.Tensors {
			ts[i] = Tensor{Name: ti.Name, DType: ti.DType, Shape: ti.Shape, Raw: make([]byte, ti.Bytes())}
		}
		if dataLen > 1<<20 {
			return // keep the round trip's data small
		}
		var buf bytes.Buffer
		if err := Encode(&buf, ts, h.Metadata); err != nil {
			t.Fatalf("re-encoding an accepted header: %v", err)
		}
		n := int64(buf.Bytes()[0]) | int64(buf.Bytes()[1])<<8 | int64(buf.Bytes()[2])<<16 | int64(buf.Bytes()[3])<<24
		h2, err := parseHeader(buf.Bytes()[8:8+n], dataLen)
		if err != nil {
			t.Fatalf("re-parsing: %v", err)
		}
		if len(h2.Tensors) != len(h.Tensors) || len(h2.Metadata) != len(h.Metadata) {
			t.Fatalf("round trip changed the header")
		}
		for _, ti := range h.Tensors {
			t2, ok := h2.Lookup(ti.Name)
			if !ok || t2.DType != ti.DType || t2.Bytes() != ti.Bytes() || len(t2.Shape) != len(ti.Shape) {
				t.Fatalf("round trip changed %q: %+v → %+v", ti.Name, ti, t2)
			}
		}
	})
}
