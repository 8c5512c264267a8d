package safetensors_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/half"
	"github.com/batchfit/batchfit/safetensors"
)

func f32le(vs ...float32) []byte {
	b := make([]byte, 4*len(vs))
	for i, v := range vs {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(v))
	}
	return b
}

// The reference implementation's own serialization tests give these
// bytes; Encode must reproduce them exactly.
func TestEncodeMatchesReferenceBytes(t *testing.T) {
	cases := []struct {
		name     string
		tensors  []safetensors.Tensor
		metadata map[string]string
		want     []byte
	}{{
		name:    "one F32 tensor",
		tensors: []safetensors.Tensor{{Name: "attn.0", DType: safetensors.F32, Shape: []int{1, 2, 3}, Float32: []float32{0, 1, 2, 3, 4, 5}}},
		want: append(append([]byte{64, 0, 0, 0, 0, 0, 0, 0},
			`{"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}}`...), f32le(0, 1, 2, 3, 4, 5)...),
	}, {
		name:    "padded to 8 bytes",
		tensors: []safetensors.Tensor{{Name: "attn0", DType: safetensors.F32, Shape: []int{1, 1, 2, 3}, Raw: f32le(0, 1, 2, 3, 4, 5)}},
		want: append(append([]byte{72, 0, 0, 0, 0, 0, 0, 0},
			`{"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}}       `...), f32le(0, 1, 2, 3, 4, 5)...),
	}, {
		name: "empty",
		want: append([]byte{8, 0, 0, 0, 0, 0, 0, 0}, "{}      "...),
	}, {
		name:     "metadata only",
		metadata: map[string]string{"framework": "pt"},
		want:     append([]byte{40, 0, 0, 0, 0, 0, 0, 0}, `{"__metadata__":{"framework":"pt"}}     `...),
	}}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var buf bytes.Buffer
			require.NoError(t, safetensors.Encode(&buf, c.tensors, c.metadata))
			assert.Equal(t, c.want, buf.Bytes())
		})
	}
}

func randFloats(r *rand.Rand, n int) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(r.NormFloat64())
	}
	return v
}

func TestWriteReadRoundTrip(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	big := randFloats(r, 3*40_000+7) // more than one streaming chunk
	small := randFloats(r, 12)
	path := filepath.Join(t.TempDir(), "model.safetensors")
	ints := make([]byte, 8*3)
	for i, v := range []int64{-5, 0, 1 << 40} {
		binary.LittleEndian.PutUint64(ints[8*i:], uint64(v))
	}
	filled := func(dst []float32, at int) { // the transpose of small viewed as [3, 4]
		for i := range dst {
			k := at + i
			dst[i] = small[(k%3)*4+k/3]
		}
	}
	tensors := []safetensors.Tensor{
		{Name: "w.f32", DType: safetensors.F32, Shape: []int{3, 40_002, 1}, Float32: big[:3*40_002]},
		{Name: "w.bf16", DType: safetensors.BF16, Shape: []int{len(big)}, Float32: big},
		{Name: "w.f16", DType: safetensors.F16, Shape: []int{3, 4}, Float32: small},
		{Name: "w.f64", DType: safetensors.F64, Shape: []int{2, 6}, Float32: small},
		{Name: "w.t", DType: safetensors.F32, Shape: []int{4, 3}, Fill: filled},
		{Name: "ids", DType: safetensors.I64, Shape: []int{3}, Raw: ints},
		{Name: "scalar", DType: safetensors.F32, Shape: []int{}, Float32: []float32{2.5}},
		{Name: "empty", DType: safetensors.BF16, Shape: []int{0, 5}},
	}
	require.NoError(t, safetensors.WriteFile(path, tensors, map[string]string{"format": "pt"}))
	entries, err := os.ReadDir(filepath.Dir(path))
	require.NoError(t, err)
	require.Len(t, entries, 1, "no temporary file is left behind")

	f, err := safetensors.Open(path)
	require.NoError(t, err)
	defer f.Close()
	assert.Equal(t, map[string]string{"format": "pt"}, f.Metadata())
	var names []string
	for _, ti := range f.Tensors() {
		names = append(names, ti.Name)
		assert.Zero(t, ti.Begin%ti.DType.Size(), "%s is aligned", ti.Name)
	}
	// Widest dtype first, then by name, as the reference orders them.
	assert.Equal(t, []string{"ids", "w.f64", "scalar", "w.f32", "w.t", "empty", "w.bf16", "w.f16"}, names)

	got := make([]float32, 3*40_002)
	require.NoError(t, f.ReadFloat32("w.f32", got))
	assert.Equal(t, big[:3*40_002], got, "F32 is exact")

	got = make([]float32, len(big))
	require.NoError(t, f.ReadFloat32("w.bf16", got))
	for i, v := range big {
		require.Equal(t, half.RoundBF16(v), got[i], "bf16 element %d", i)
	}
	got64 := make([]float64, len(big))
	require.NoError(t, f.ReadFloat64("w.bf16", got64))
	assert.Equal(t, float64(got[len(big)-1]), got64[len(big)-1])

	got = make([]float32, 12)
	require.NoError(t, f.ReadFloat32("w.f16", got))
	for i, v := range small {
		assert.Equal(t, half.RoundF16(v), got[i])
	}
	require.NoError(t, f.ReadFloat32("w.f64", got))
	assert.Equal(t, small, got, "float32 → F64 → float32 is exact")
	require.NoError(t, f.ReadFloat32("w.t", got))
	for i := range 4 {
		for j := range 3 {
			assert.Equal(t, small[j*4+i], got[i*3+j])
		}
	}
	ids := make([]int64, 3)
	require.NoError(t, f.ReadInt64("ids", ids))
	assert.Equal(t, []int64{-5, 0, 1 << 40}, ids)
	one := make([]float32, 1)
	require.NoError(t, f.ReadFloat32("scalar", one))
	assert.Equal(t, float32(2.5), one[0])
	require.NoError(t, f.ReadFloat32("empty", nil))

	ti, ok := f.Tensor("w.f16")
	require.True(t, ok)
	assert.Equal(t, []int{3, 4}, ti.Shape)
	assert.Equal(t, int64(12), ti.NumElements())
	sec, err := f.Section("w.f16")
	require.NoError(t, err)
	assert.Equal(t, int64(24), sec.Size())

	// Wrong destinations and dtypes are typed errors.
	assert.ErrorIs(t, f.ReadFloat32("w.f16", make([]float32, 11)), safetensors.ErrShape)
	assert.ErrorIs(t, f.ReadFloat32("ids", make([]float32, 3)), safetensors.ErrDType)
	assert.ErrorIs(t, f.ReadInt64("w.f32", make([]int64, 3*40_002)), safetensors.ErrDType)
	assert.ErrorIs(t, f.ReadFloat32("nope", nil), safetensors.ErrNotFound)
	assert.ErrorIs(t, f.ReadRaw("ids", make([]byte, 5)), safetensors.ErrShape)
	raw := make([]byte, 24)
	require.NoError(t, f.ReadRaw("ids", raw))
	assert.Equal(t, ints, raw)
}

func TestConcurrentReads(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	vals := randFloats(r, 50_000)
	path := filepath.Join(t.TempDir(), "m.safetensors")
	var ts []safetensors.Tensor
	names := []string{"a", "b", "c", "d"}
	for _, n := range names {
		ts = append(ts, safetensors.Tensor{Name: n, DType: safetensors.BF16, Shape: []int{len(vals)}, Float32: vals})
	}
	require.NoError(t, safetensors.WriteFile(path, ts, nil))
	f, err := safetensors.Open(path)
	require.NoError(t, err)
	defer f.Close()
	assert.Nil(t, f.Metadata())
	var wg sync.WaitGroup
	errs := make([]error, len(names))
	outs := make([][]float32, len(names))
	for i, n := range names {
		wg.Add(1)
		go func() {
			defer wg.Done()
			outs[i] = make([]float32, len(vals))
			errs[i] = f.ReadFloat32(n, outs[i])
		}()
	}
	wg.Wait()
	for i := range names {
		require.NoError(t, errs[i])
		assert.Equal(t, outs[0], outs[i])
	}
}

func TestWriteRejects(t *testing.T) {
	dir := t.TempDir()
	cases := []struct {
		name string
		t    []safetensors.Tensor
		want error
	}{
		{"length", []safetensors.Tensor{{Name: "a", DType: safetensors.F32, Shape: []int{2, 2}, Float32: make([]float32, 3)}}, safetensors.ErrShape},
		{"raw length", []safetensors.Tensor{{Name: "a", DType: safetensors.I64, Shape: []int{2}, Raw: make([]byte, 15)}}, safetensors.ErrShape},
		{"no values", []safetensors.Tensor{{Name: "a", DType: safetensors.F32, Shape: []int{2}}}, safetensors.ErrShape},
		{"negative", []safetensors.Tensor{{Name: "a", DType: safetensors.F32, Shape: []int{-1}}}, safetensors.ErrShape},
		{"floats as ints", []safetensors.Tensor{{Name: "a", DType: safetensors.I32, Shape: []int{1}, Float32: []float32{1}}}, safetensors.ErrDType},
		{"invalid dtype", []safetensors.Tensor{{Name: "a", Shape: []int{1}, Raw: []byte{1}}}, safetensors.ErrDType},
		{"duplicate", []safetensors.Tensor{{Name: "a", DType: safetensors.U8, Shape: []int{1}, Raw: []byte{1}}, {Name: "a", DType: safetensors.U8, Shape: []int{1}, Raw: []byte{1}}}, safetensors.ErrFormat},
		{"reserved", []safetensors.Tensor{{Name: "__metadata__", DType: safetensors.U8, Shape: []int{1}, Raw: []byte{1}}}, safetensors.ErrFormat},
		{"two sources", []safetensors.Tensor{{Name: "a", DType: safetensors.F32, Shape: []int{1}, Float32: []float32{1}, Raw: f32le(1)}}, safetensors.ErrFormat},
		{"not UTF-8", []safetensors.Tensor{{Name: "a\xff", DType: safetensors.U8, Shape: []int{1}, Raw: []byte{1}}}, safetensors.ErrFormat},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			path := filepath.Join(dir, c.name+".safetensors")
			assert.ErrorIs(t, safetensors.WriteFile(path, c.t, nil), c.want)
			_, err := os.Stat(path)
			assert.ErrorIs(t, err, os.ErrNotExist, "nothing is written")
		})
	}
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	assert.Empty(t, entries, "no temporary files are left behind")
}

func TestWriteReplacesAtomically(t *testing.T) {
	path := filepath.Join(t.TempDir(), "m.safetensors")
	require.NoError(t, os.WriteFile(path, []byte("old"), 0o644))
	bad := []safetensors.Tensor{{Name: "a", DType: safetensors.F32, Shape: []int{2}, Float32: []float32{1}}}
	require.Error(t, safetensors.WriteFile(path, bad, nil))
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	assert.Equal(t, "old", string(b), "a failed write leaves the old file")
	good := []safetensors.Tensor{{Name: "a", DType: safetensors.F32, Shape: []int{2}, Float32: []float32{1, 2}}}
	require.NoError(t, safetensors.WriteFile(path, good, nil))
	st, err := os.Stat(path)
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o644), st.Mode().Perm())
}

// file builds a safetensors file from a header string and data bytes, with
// the header length given (or computed when n < 0).
func file(t *testing.T, n int64, header string, data []byte) string {
	t.Helper()
	if n < 0 {
		n = int64(len(header))
	}
	b := binary.LittleEndian.AppendUint64(nil, uint64(n))
	b = append(append(b, header...), data...)
	path := filepath.Join(t.TempDir(), "x.safetensors")
	require.NoError(t, os.WriteFile(path, b, 0o644))
	return path
}

func TestOpenHostileFiles(t *testing.T) {
	d8 := make([]byte, 8)
	cases := []struct {
		name   string
		n      int64
		header string
		data   []byte
		want   error
	}{
		{"huge header length", 1 << 62, "{}", nil, safetensors.ErrTooLarge},
		{"header just over the limit", safetensors.MaxHeaderBytes + 1, "{}", nil, safetensors.ErrTooLarge},
		{"header longer than the file", 100, "{}", nil, safetensors.ErrFormat},
		{"not JSON", -1, "{nope", nil, safetensors.ErrFormat},
		{"not an object", -1, "[1,2]", nil, safetensors.ErrFormat},
		{"not UTF-8", -1, "{\"a\xff\":1}", nil, safetensors.ErrFormat},
		{"trailing data", -1, `{} x`, nil, safetensors.ErrFormat},
		{"offsets past the end", -1, `{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}`, make([]byte, 4), safetensors.ErrFormat},
		{"offsets far outside", -1, `{"a":{"dtype":"U8","shape":[8],"data_offsets":[18446744073709551600,18446744073709551608]}}`, d8, safetensors.ErrFormat},
		{"reversed offsets", -1, `{"a":{"dtype":"U8","shape":[0],"data_offsets":[8,0]}}`, d8, safetensors.ErrFormat},
		{"dtype × shape ≠ length", -1, `{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}`, d8, safetensors.ErrFormat},
		{"shape overflows", -1, `{"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}}`, d8, safetensors.ErrFormat},
		{"bytes overflow", -1, `{"a":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8]}}`, d8, safetensors.ErrFormat},
		{"overlap", -1, `{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}`, d8, safetensors.ErrFormat},
		{"gap", -1, `{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}`, d8, safetensors.ErrFormat},
		{"data not covered", -1, `{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}`, d8, safetensors.ErrFormat},
		{"unknown dtype", -1, `{"a":{"dtype":"F4","shape":[16],"data_offsets":[0,8]}}`, d8, safetensors.ErrDType},
		{"dtype not a string", -1, `{"a":{"dtype":4,"shape":[2],"data_offsets":[0,8]}}`, d8, safetensors.ErrFormat},
		{"negative dimension", -1, `{"a":{"dtype":"U8","shape":[-8],"data_offsets":[0,8]}}`, d8, safetensors.ErrFormat},
		{"fractional dimension", -1, `{"a":{"dtype":"U8","shape":[8.0],"data_offsets":[0,8]}}`, d8, safetensors.ErrFormat},
		{"three offsets", -1, `{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8,9]}}`, d8, safetensors.ErrFormat},
		{"missing shape", -1, `{"a":{"dtype":"U8","data_offsets":[0,8]}}`, d8, safetensors.ErrFormat},
		{"unknown key", -1, `{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8],"x":1}}`, d8, safetensors.ErrFormat},
		{"duplicate tensor", -1, `{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"a":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}}`, d8, safetensors.ErrFormat},
		{"metadata not strings", -1, `{"__metadata__":{"format":1}}`, nil, safetensors.ErrFormat},
		{"metadata twice", -1, `{"__metadata__":{},"__metadata__":{}}`, nil, safetensors.ErrFormat},
		{"too many dimensions", -1, `{"a":{"dtype":"U8","shape":[` + repeat("1,", 64) + `1],"data_offsets":[0,1]}}`, []byte{0}, safetensors.ErrTooLarge},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f, err := safetensors.Open(file(t, c.n, c.header, c.data))
			if f != nil {
				f.Close()
			}
			assert.ErrorIs(t, err, c.want)
		})
	}
	t.Run("shorter than 8 bytes", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "x")
		require.NoError(t, os.WriteFile(path, []byte{1, 2, 3}, 0o644))
		_, err := safetensors.Open(path)
		assert.ErrorIs(t, err, safetensors.ErrFormat)
	})
	t.Run("truncated", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "m.safetensors")
		require.NoError(t, safetensors.WriteFile(path, []safetensors.Tensor{{Name: "a", DType: safetensors.F32, Shape: []int{64}, Float32: make([]float32, 64)}}, nil))
		b, err := os.ReadFile(path)
		require.NoError(t, err)
		for _, cut := range []int{len(b) - 1, len(b) - 200, 20, 7} {
			require.NoError(t, os.WriteFile(path, b[:cut], 0o644))
			_, err := safetensors.Open(path)
			assert.ErrorIs(t, err, safetensors.ErrFormat, "cut at %d", cut)
		}
	})
	t.Run("shrinks while open", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "m.safetensors")
		require.NoError(t, safetensors.WriteFile(path, []safetensors.Tensor{{Name: "a", DType: safetensors.BF16, Shape: []int{64}, Float32: make([]float32, 64)}}, nil))
		f, err := safetensors.Open(path)
		require.NoError(t, err)
		defer f.Close()
		require.NoError(t, os.Truncate(path, 100))
		assert.ErrorIs(t, f.ReadFloat32("a", make([]float32, 64)), safetensors.ErrFormat)
	})
}

func repeat(s string, n int) string { return string(bytes.Repeat([]byte(s), n)) }

func TestOpenNonRegular(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "fifo")
	require.NoError(t, syscall.Mkfifo(fifo, 0o644))
	link := filepath.Join(dir, "link")
	require.NoError(t, os.Symlink(fifo, link))
	dirLink := filepath.Join(dir, "dirlink")
	require.NoError(t, os.Symlink(dir, dirLink))
	for _, p := range []string{fifo, link, dir, dirLink, "/dev/null"} {
		_, err := safetensors.Open(p)
		assert.ErrorIs(t, err, safetensors.ErrNotRegular, p)
	}
	dangling := filepath.Join(dir, "dangling")
	require.NoError(t, os.Symlink(filepath.Join(dir, "absent"), dangling))
	_, err := safetensors.Open(dangling)
	assert.ErrorIs(t, err, os.ErrNotExist)

	// A link to a regular file is followed: Hugging Face's cache is built
	// of them.
	real := filepath.Join(dir, "real.safetensors")
	require.NoError(t, safetensors.WriteFile(real, []safetensors.Tensor{{Name: "a", DType: safetensors.F32, Shape: []int{1}, Float32: []float32{3}}}, nil))
	regLink := filepath.Join(dir, "model.safetensors")
	require.NoError(t, os.Symlink(real, regLink))
	f, err := safetensors.Open(regLink)
	require.NoError(t, err)
	got := make([]float32, 1)
	require.NoError(t, f.ReadFloat32("a", got))
	assert.Equal(t, float32(3), got[0])
	require.NoError(t, f.Close())
}

func TestReadInt64Kinds(t *testing.T) {
	path := filepath.Join(t.TempDir(), "i.safetensors")
	u64 := binary.LittleEndian.AppendUint64(nil, math.MaxUint64)
	require.NoError(t, safetensors.WriteFile(path, []safetensors.Tensor{
		{Name: "i32", DType: safetensors.I32, Shape: []int{2}, Raw: []byte{0xff, 0xff, 0xff, 0xff, 7, 0, 0, 0}},
		{Name: "u8", DType: safetensors.U8, Shape: []int{2}, Raw: []byte{200, 3}},
		{Name: "i8", DType: safetensors.I8, Shape: []int{1}, Raw: []byte{0xfe}},
		{Name: "bool", DType: safetensors.BOOL, Shape: []int{2}, Raw: []byte{1, 0}},
		{Name: "badbool", DType: safetensors.BOOL, Shape: []int{1}, Raw: []byte{2}},
		{Name: "u64", DType: safetensors.U64, Shape: []int{1}, Raw: u64},
	}, nil))
	f, err := safetensors.Open(path)
	require.NoError(t, err)
	defer f.Close()
	for name, want := range map[string][]int64{"i32": {-1, 7}, "u8": {200, 3}, "i8": {-2}, "bool": {1, 0}} {
		got := make([]int64, len(want))
		require.NoError(t, f.ReadInt64(name, got))
		assert.Equal(t, want, got, name)
	}
	assert.ErrorIs(t, f.ReadInt64("badbool", make([]int64, 1)), safetensors.ErrFormat)
	assert.ErrorIs(t, f.ReadInt64("u64", make([]int64, 1)), safetensors.ErrFormat)
}

func TestParseDType(t *testing.T) {
	for _, s := range []string{"F32", "BF16", "F16", "F64", "I64", "I32", "U8", "BOOL", "F8_E4M3"} {
		d, err := safetensors.ParseDType(s)
		require.NoError(t, err)
		assert.Equal(t, s, d.String())
	}
	_, err := safetensors.ParseDType("f32")
	assert.True(t, errors.Is(err, safetensors.ErrDType))
}
