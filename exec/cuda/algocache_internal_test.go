package cuda

import (
	"encoding/json"
	"errors"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/planner"
)

// testAlgoKey is a forward convolution of ResNet-50's stem as the search
// keys it.
func testAlgoKey() algoKey {
	return algoKey{Pass: convForward, DType: graph.Float32, X: [4]int64{64, 3, 224, 224}, W: [4]int64{64, 3, 7, 7},
		Y: [4]int64{64, 64, 112, 112}, Pad: [2]int64{3, 3}, Stride: [2]int64{2, 2}, Dil: [2]int64{1, 1}, Groups: 1,
		Math: cudnnFMAMath, Limit: 308 << 20, Device: "NVIDIA H100 80GB HBM3", Arch: "sm_90", CUDNN: 91400, Im2col: "conv.go/1"}
}

func testAlgoResults() []algoResult {
	return []algoResult{
		{Algo: 0, TimeMS: 2.5, Memory: 0, Deterministic: true, Math: cudnnFMAMath},
		{Algo: 1, TimeMS: 1.25, Memory: 1 << 20, Deterministic: true, Math: cudnnFMAMath},
		{Algo: 6, Status: 9, TimeMS: -1, Memory: 0, Math: cudnnFMAMath},
	}
}

// TestAlgoCacheRoundTrip: an entry written for a key reads back equal, in
// the cache's directory under the key's hash, and its file repeats the key.
func TestAlgoCacheRoundTrip(t *testing.T) {
	dir := t.TempDir()
	k, rs := testAlgoKey(), testAlgoResults()
	_, err := readAlgoEntry(dir, k)
	require.ErrorIs(t, err, fs.ErrNotExist, "a miss is no cache error")
	require.False(t, errors.Is(err, ErrAlgoCache))

	require.NoError(t, writeAlgoEntry(dir, k, rs))
	got, err := readAlgoEntry(dir, k)
	require.NoError(t, err)
	assert.Equal(t, rs, got)
	b, err := os.ReadFile(filepath.Join(dir, k.file()))
	require.NoError(t, err)
	var e algoEntry
	require.NoError(t, json.Unmarshal(b, &e))
	assert.Equal(t, k.String(), e.Key)

	// Another key misses, though the directory holds an entry.
	other := k
	other.Y[0], other.X[0] = 32, 32
	_, err = readAlgoEntry(dir, other)
	require.ErrorIs(t, err, fs.ErrNotExist)

	// With the im2col path in the key, its result is one.
	withIm2col := k
	withIm2col.Im2col = "conv.go/1,conv.cu/0123456789abcdef"
	rs2 := append(testAlgoResults(), algoResult{Algo: im2colAlgo, TimeMS: 0.5, Memory: 64 << 20, Deterministic: true, Math: cudnnFMAMath})
	require.NoError(t, writeAlgoEntry(dir, withIm2col, rs2))
	got, err = readAlgoEntry(dir, withIm2col)
	require.NoError(t, err)
	assert.Equal(t, rs2, got)

	// An entry with a result cuDNN never returns is not written.
	bad := append(testAlgoResults(), algoResult{Algo: 99, Deterministic: true})
	require.ErrorIs(t, writeAlgoEntry(dir, other, bad), ErrAlgoCache)
	_, err = readAlgoEntry(dir, other)
	require.ErrorIs(t, err, fs.ErrNotExist)
}

// TestAlgoKeyCoversEveryField: changing any one field of the key changes
// its text and its file, so a search's results are never taken for
// another pass, shape, window, dtype, layout, math type, workspace,
// device or cuDNN.
func TestAlgoKeyCoversEveryField(t *testing.T) {
	base := testAlgoKey()
	v := reflect.ValueOf(&base).Elem()
	seen := map[string]string{base.String(): "base"}
	for i := range v.NumField() {
		f := v.Type().Field(i)
		k := base
		fv := reflect.ValueOf(&k).Elem().Field(i)
		switch fv.Kind() {
		case reflect.Array:
			for j := range fv.Len() {
				kj := base
				e := reflect.ValueOf(&kj).Elem().Field(i).Index(j)
				e.SetInt(e.Int() + 1)
				name := f.Name + "[" + string(rune('0'+j)) + "]"
				require.NotContains(t, seen, kj.String(), "%s changes nothing in the key", name)
				seen[kj.String()] = name
				assert.NotEqual(t, base.file(), kj.file(), name)
			}
			continue
		case reflect.Int, reflect.Int8, reflect.Int32, reflect.Int64:
			fv.SetInt(fv.Int() + 1)
		case reflect.Uint8:
			fv.SetUint(fv.Uint() + 1)
		case reflect.Bool:
			fv.SetBool(!fv.Bool())
		case reflect.String:
			fv.SetString(fv.String() + "x")
		default:
			t.Fatalf("field %s of kind %s: extend the test", f.Name, fv.Kind())
		}
		require.NotContains(t, seen, k.String(), "%s changes nothing in the key", f.Name)
		seen[k.String()] = f.Name
		assert.NotEqual(t, base.file(), k.file(), f.Name)
	}
	// A device name cannot forge the fields after it.
	forged := base
	forged.Device = `H100|arch=sm_80|cudnn=1`
	assert.NotEqual(t, base.String(), forged.String())
	assert.Contains(t, forged.String(), `device="H100|arch=sm_80|cudnn=1"`)
}

// TestAlgoCacheHostileEntries: a cache entry that is not a regular file
// within the cap, not JSON of this format, written for another key, or
// holding values cuDNN never returns is an error wrapping ErrAlgoCache
// (the search runs again and rewrites it), never a panic, a hang or a
// result; a rewrite replaces it.
func TestAlgoCacheHostileEntries(t *testing.T) {
	k := testAlgoKey()
	valid := func() algoEntry { return algoEntry{Format: algoFormat, Key: k.String(), Results: testAlgoResults()} }
	encode := func(e algoEntry) []byte {
		b, err := json.Marshal(e)
		require.NoError(t, err)
		return b
	}
	with := func(f func(e *algoEntry)) []byte {
		e := valid()
		f(&e)
		return encode(e)
	}
	cases := map[string][]byte{
		"empty":          {},
		"not json":       []byte("not json at all"),
		"truncated":      encode(valid())[:40],
		"trailing data":  append(encode(valid()), []byte(`{"format":"x"}`)...),
		"unknown field":  []byte(strings.Replace(string(encode(valid())), `"format"`, `"extra":1,"format"`, 1)),
		"wrong type":     []byte(strings.Replace(string(encode(valid())), `"algo":0`, `"algo":"zero"`, 1)),
		"other format":   with(func(e *algoEntry) { e.Format = "batchfit-cudnn-find/0" }),
		"other key":      with(func(e *algoEntry) { o := k; o.CUDNN = 90100; e.Key = o.String() }),
		"too many":       with(func(e *algoEntry) { e.Results = make([]algoResult, maxAlgoResults+1) }),
		"algo range":     with(func(e *algoEntry) { e.Results[0].Algo = cudnnFwdAlgoCount }),
		"negative algo":  with(func(e *algoEntry) { e.Results[0].Algo = -2 }),
		"status":         with(func(e *algoEntry) { e.Results[0].Status = -3 }),
		"negative time":  with(func(e *algoEntry) { e.Results[0].TimeMS = -2 }),
		"memory":         with(func(e *algoEntry) { e.Results[0].Memory = -1 }),
		"huge memory":    with(func(e *algoEntry) { e.Results[0].Memory = maxAlgoMemory + 1 }),
		"math type":      with(func(e *algoEntry) { e.Results[0].Math = 7 }),
		"int overflow":   []byte(strings.Replace(string(encode(valid())), `"algo":0`, `"algo":99999999999999999999`, 1)),
		"time not float": []byte(strings.Replace(string(encode(valid())), `"time_ms":2.5`, `"time_ms":1e999`, 1)),
	}
	for name, b := range cases {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			require.NoError(t, os.WriteFile(filepath.Join(dir, k.file()), b, 0o600))
			_, err := readAlgoEntry(dir, k)
			require.ErrorIs(t, err, ErrAlgoCache)
			require.NoError(t, writeAlgoEntry(dir, k, testAlgoResults()))
			got, err := readAlgoEntry(dir, k)
			require.NoError(t, err, "a rewrite replaces the bad entry")
			assert.Equal(t, testAlgoResults(), got)
		})
	}

	t.Run("im2col untimed", func(t *testing.T) {
		dir := t.TempDir()
		plain := k
		plain.Im2col = "" // a channels-last key: no im2col candidate
		e := algoEntry{Format: algoFormat, Key: plain.String(), Results: testAlgoResults()}
		e.Results[0].Algo = im2colAlgo
		require.NoError(t, os.WriteFile(filepath.Join(dir, plain.file()), encode(e), 0o600))
		_, err := readAlgoEntry(dir, plain)
		require.ErrorIs(t, err, ErrAlgoCache)
	})
	t.Run("directory", func(t *testing.T) {
		dir := t.TempDir()
		require.NoError(t, os.Mkdir(filepath.Join(dir, k.file()), 0o700))
		_, err := readAlgoEntry(dir, k)
		require.ErrorIs(t, err, ErrAlgoCache)
	})
	t.Run("symlink", func(t *testing.T) {
		dir := t.TempDir()
		target := filepath.Join(dir, "target.json")
		require.NoError(t, os.WriteFile(target, encode(valid()), 0o600))
		require.NoError(t, os.Symlink(target, filepath.Join(dir, k.file())))
		_, err := readAlgoEntry(dir, k)
		require.ErrorIs(t, err, ErrAlgoCache, "a link is not followed, even to a valid entry")
		require.NoError(t, writeAlgoEntry(dir, k, testAlgoResults()))
		_, err = readAlgoEntry(dir, k)
		require.NoError(t, err, "the rewrite replaces the link, not its target")
		b, err := os.ReadFile(target)
		require.NoError(t, err)
		assert.Equal(t, encode(valid()), b)
	})
	t.Run("fifo", func(t *testing.T) {
		if runtime.GOOS == "windows" {
			t.Skip("no FIFOs")
		}
		dir := t.TempDir()
		require.NoError(t, syscall.Mkfifo(filepath.Join(dir, k.file()), 0o600))
		_, err := readAlgoEntry(dir, k) // must not block waiting for a writer
		require.ErrorIs(t, err, ErrAlgoCache)
	})
	t.Run("over the cap", func(t *testing.T) {
		dir := t.TempDir()
		f, err := os.Create(filepath.Join(dir, k.file()))
		require.NoError(t, err)
		_, err = f.Write(encode(valid()))
		require.NoError(t, err)
		require.NoError(t, f.Truncate(maxAlgoEntryBytes+1))
		require.NoError(t, f.Close())
		_, err = readAlgoEntry(dir, k)
		require.ErrorIs(t, err, ErrAlgoCache)
	})
}

// TestRankAlgos: the ranking keeps what a plan may run (succeeded,
// deterministic, within the workspace, a math type the policy allows) and
// orders it by time, except that within algoTie of the fastest the least
// workspace leads; equal times go to the lower algorithm id.
func TestRankAlgos(t *testing.T) {
	r := func(algo int32, ms float64, mem int64, math int32) algoResult {
		return algoResult{Algo: algo, TimeMS: ms, Memory: mem, Deterministic: true, Math: math}
	}
	algos := func(rs []algoResult) []int32 {
		var out []int32
		for _, x := range rs {
			out = append(out, x.Algo)
		}
		return out
	}
	in := []algoResult{
		r(0, 3.0, 0, cudnnFMAMath),
		r(1, 1.0, 64<<20, cudnnFMAMath),
		r(7, 1.01, 1<<20, cudnnFMAMath), // within 2% of the fastest, less workspace: leads
		r(2, 0.5, 0, cudnnFMAMath),      // FFT: too far from the direct sums in plain float32
		{Algo: 3, TimeMS: 0.4, Memory: 0, Deterministic: false, Math: cudnnFMAMath},
		{Algo: 5, Status: 9, TimeMS: -1},
		r(6, 0.9, 512<<20, cudnnFMAMath), // over the workspace
		r(4, 0.3, 0, cudnnTensorOpMath),  // TF32: not plain float32
	}
	assert.Equal(t, []int32{7, 1, 0}, algos(rankAlgos(convGradWeight, graph.Float32, true, 256<<20, in)))
	// TF32 (not strict): FFT and tensor-op math are in; float32 rounded to 16 bits never.
	tf := append(in, r(4, 0.1, 0, cudnnTensorOpAllowConversion))
	// Past the lead, by time alone.
	assert.Equal(t, []int32{4, 2, 1, 7, 0}, algos(rankAlgos(convGradWeight, graph.Float32, false, 256<<20, tf)))
	// 16-bit: conversion math is fine.
	assert.Equal(t, []int32{4, 4, 2, 1, 7, 0}, algos(rankAlgos(convGradWeight, graph.BFloat16, false, 256<<20, tf)))
	// Equal times: the lower algorithm id, whatever order they came in.
	tie := []algoResult{r(6, 1, 0, cudnnFMAMath), r(1, 1, 0, cudnnFMAMath), r(0, 2, 0, cudnnFMAMath)}
	assert.Equal(t, []int32{1, 6, 0}, algos(rankAlgos(convForward, graph.Float32, true, 0, tie)))
	// Nothing left: empty.
	assert.Empty(t, rankAlgos(convForward, graph.Float32, true, 0, []algoResult{r(1, 1, 1, cudnnFMAMath)}))
}

// TestChunkSizes: every chunk size planner.Split can make of n samples,
// and no other.
func TestChunkSizes(t *testing.T) {
	for _, n := range []int{1, 2, 3, 7, 64, 96, 100, 320, 4096} {
		want := map[int]bool{}
		for k := 1; k <= n; k++ {
			for _, c := range planner.Chunks(n, k) {
				want[c.Size] = true
			}
		}
		got := chunkSizes(n)
		require.True(t, slices.IsSorted(got), "n %d", n)
		require.Equal(t, n, got[len(got)-1], "n %d: the whole batch last", n)
		for _, b := range got {
			require.True(t, b >= 1 && b <= n, "n %d: size %d", n, b)
		}
		for b := range want {
			require.Contains(t, got, b, "n %d: a split makes chunks of %d", n, b)
		}
		assert.LessOrEqual(t, len(got), 4*int(math.Sqrt(float64(n)))+2, "n %d: about 4√n sizes", n)
	}
}

// TestAffineCover: the declared workspace fixed + per·b is exactly the
// whole batch's at the whole batch, at least each chunk size's at that
// size, never negative, and the steepest line that allows.
func TestAffineCover(t *testing.T) {
	const n = 64
	for name, w := range map[string]func(b int64) int64{
		"none":       func(int64) int64 { return 0 },
		"flat":       func(int64) int64 { return 1 << 20 },
		"linear":     func(b int64) int64 { return 4096 * b },
		"affine":     func(b int64) int64 { return 3<<20 + 4096*b },
		"concave":    func(b int64) int64 { return int64(1e6 * math.Sqrt(float64(b))) },
		"convex":     func(b int64) int64 { return 100 * b * b },
		"stepped":    func(b int64) int64 { return (b + 15) / 16 * 1000003 },
		"shrinking":  func(b int64) int64 { return 5<<20 - 1000*b },
		"odd bytes":  func(b int64) int64 { return 7 + 13*b },
		"tiny whole": func(b int64) int64 { return min(b, 3) },
	} {
		var pts []wsPoint
		for _, b := range chunkSizes(n) {
			pts = append(pts, wsPoint{int64(b), w(int64(b))})
		}
		fixed, per := affineCover(pts)
		require.GreaterOrEqual(t, fixed, int64(0), name)
		require.GreaterOrEqual(t, per, int64(0), name)
		for _, p := range pts {
			require.GreaterOrEqual(t, fixed+per*p.b, p.w, "%s: covers b = %d", name, p.b)
		}
		if name != "shrinking" {
			require.Equal(t, w(n), fixed+per*n, "%s: exact at the whole batch", name)
		} else {
			require.Equal(t, w(1), fixed, "%s: flat at the largest", name)
			require.Zero(t, per, name)
		}
		// Steepest: one more per sample would leave some size uncovered, or
		// make fixed negative.
		if name != "shrinking" {
			steeper := per + 1
			f2 := w(n) - steeper*n
			covered := f2 >= 0
			for _, p := range pts {
				covered = covered && f2+steeper*p.b >= p.w
			}
			require.False(t, covered, "%s: a steeper line would do", name)
		}
	}
	// A workspace affine in the batch is declared exactly at every size.
	var pts []wsPoint
	for _, b := range chunkSizes(n) {
		pts = append(pts, wsPoint{int64(b), 3<<20 + 4096*int64(b)})
	}
	fixed, per := affineCover(pts)
	assert.Equal(t, [2]int64{3 << 20, 4096}, [2]int64{fixed, per})
	assert.Equal(t, [2]int64{5, 0}, func() [2]int64 { f, p := affineCover([]wsPoint{{1, 5}}); return [2]int64{f, p} }(), "one sample")
	f, p := affineCover(nil)
	assert.Zero(t, f+p)
}
